"""How the tuner should time its candidates: which timing ranks configs as a long run does (H200).

    python bench/tuner_timing.py [--rounds 3]

The O-projection + residual + norm-statistics GEMM (16384 x 4096 x 4096, bf16) with four
configs, each timed in four ways, in shuffled rounds:

- ``cold``: after 2 s idle, :func:`codetta.matmul.tuning.graph_ms` with a CUDA graph of ~5 ms
  replayed 3 times, as the tuner did at 853abaa;
- ``warm``: the same after 1 s of steady load;
- ``warm 25ms``: after 1 s of steady load, graphs of ~25 ms (the tuner since: one replay each
  in each of its rounds);
- ``sustained``: after 2 s of steady load, ``triton.testing.do_bench_cudagraph`` (~100 ms
  graphs, 10 replays), as bench/config_sweep.py and bench/gemm_bench.py time.

cuBLAS's plain GEMM of the same shape is timed the same ways, for the clocks. Prints a table
of medians (ms) and each way's order of the configs; the sustained order is the reference.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codetta  # noqa: E402
from codetta.matmul import Config, tuning  # noqa: E402
from codetta.ops import rmsnorm  # noqa: E402

from common import markdown_table, median_graph_ms, require_gpu, write_results  # noqa: E402

CONFIGS = {
    "128x256 s3 w8 e1": Config(128, 256, 64, STAGES=3, num_warps=8, EPI_SPLIT=1),
    "128x256 s3 w8 e2 flat": Config(128, 256, 64, STAGES=3, num_warps=8, EPI_SPLIT=2, FLATTEN=True),
    "128x128 s3 w8 e2 2/SM": Config(128, 128, 64, STAGES=3, num_warps=8, EPI_SPLIT=2, CTAS_PER_SM=2),
    "128x128 s3 w4 e2 2/SM": Config(128, 128, 64, STAGES=3, num_warps=4, EPI_SPLIT=2, CTAS_PER_SM=2),
}


def load(seconds, fn):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()
        torch.cuda.synchronize()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_gpu("tuner_timing")
    m, n, k = 16384, 4096, 4096
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    gamma = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    program = rmsnorm._producer(torch.bfloat16, True, False)
    runs = {name: (lambda cfg=cfg: codetta.gemm(a, w.t(), program, config=cfg, residual=residual, norm_weight=gamma))
            for name, cfg in CONFIGS.items()}
    runs["cuBLAS plain"] = lambda: torch.mm(a, w.t())
    for run in runs.values():
        run()
    heavy = runs["128x256 s3 w8 e1"]
    ways = {
        "cold": (lambda: time.sleep(2.0), lambda fn: tuning.graph_ms(fn, budget_ms=5.0, replays=3)),
        "warm": (lambda: load(1.0, heavy), lambda fn: tuning.graph_ms(fn, budget_ms=5.0, replays=3)),
        "warm 25ms": (lambda: load(1.0, heavy), lambda fn: tuning.graph_ms(fn, budget_ms=25.0, replays=3)),
        "sustained": (lambda: load(2.0, heavy), lambda fn: median_graph_ms(fn)),
    }
    times = {(way, name): [] for way in ways for name in runs}
    rng = random.Random(0)
    for r in range(args.rounds):
        for way, (before, timer) in ways.items():
            order = list(runs)
            rng.shuffle(order)
            before()
            for name in order:
                times[way, name].append(timer(runs[name]))
        print(f"round {r + 1} done", flush=True)
    rows = []
    for name in runs:
        row = {"config": name}
        for way in ways:
            row[way] = sorted(times[way, name])[len(times[way, name]) // 2]
        rows.append(row)
    table = markdown_table(rows, ["config", *ways])
    orders = "\n".join(f"- {way}: " + " < ".join(r["config"] for r in sorted(rows[:-1], key=lambda r: r[way]))
                       for way in ways)
    print(table + "\n" + orders)
    write_results("tuner_timing", rows, table + "\n\nEach way's order (fastest first):\n\n" + orders)


if __name__ == "__main__":
    main()

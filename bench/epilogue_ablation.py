"""Where a fused epilogue's time goes: the producer's epilogue taken apart, one piece at a time (H200).

    python bench/epilogue_ablation.py [--rounds 3]

The residual + norm-producer epilogue of :func:`codetta.ops.linear_residual` (x = acc +
residual, stored; u = x g stored; per-row sums of squares of x) and its parts, as separate
programs on the same GEMM with the same fixed configs: a plain store; the aux tile added; a
second store; the row reduction. Llama-3-8B shapes of the O-projection (16384 x 4096 x 4096)
and the down projection (16384 x 4096 x 14336). Each timed from a CUDA graph, all (program,
config, shape) triples in a new random order per round after a warm-up; medians over the
rounds against the plain program's time with the same config. What each piece adds per
tile says where an epilogue rewrite (a Gluon kernel that prefetches the aux tile and
keeps stores in flight, see docs/internals.md) would win. Writes
bench/results/epilogue_ablation.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codetta  # noqa: E402
from codetta import epilogue as ep  # noqa: E402

from common import graph_ms_in_rounds, markdown_table, require_gpu, write_results  # noqa: E402

SHAPES = {"O-proj 16384x4096x4096": (16384, 4096, 4096), "down 16384x4096x14336": (16384, 4096, 14336)}
CONFIGS = {"128x256 s3 w8 e1": codetta.Config(BM=128, BN=256, BK=64, STAGES=3, num_warps=8, EPI_SPLIT=1),
           "128x256 s3 w8 e2": codetta.Config(BM=128, BN=256, BK=64, STAGES=3, num_warps=8, EPI_SPLIT=2)}


def programs() -> dict:
    """name -> (program, whether it reads the residual, whether it reads the norm weight)."""
    def make(name, aux, second_store, sumsq):
        p = ep.Program(f"ablation_{name}")
        x = p.acc + p.aux("residual") if aux else p.acc
        x = ep.round_to(x, torch.bfloat16)
        p.store("x", x)
        if second_store:
            p.store("u", x * p.col("norm_weight"))
        if sumsq:
            p.row_sumsq("sumsq", x)
        return p, aux, second_store

    return {"plain store": make("plain", False, False, False),
            "+ aux tile": make("aux", True, False, False),
            "+ second store": make("two_stores", False, True, False),
            "+ row sum of squares": make("sumsq", False, False, True),
            "+ aux + second store": make("aux_two_stores", True, True, False),
            "producer (all three)": make("producer", True, True, True)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_gpu("epilogue_ablation")
    runs = []
    for shape, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") * k**-0.5).bfloat16()
        residual = torch.randn(m, n, device="cuda").bfloat16()
        g = torch.randn(n, device="cuda").bfloat16()
        for cfg_name, cfg in CONFIGS.items():
            for name, (program, aux, norm) in programs().items():
                operands = {**({"residual": residual} if aux else {}), **({"norm_weight": g} if norm else {})}

                def run(a=a, w=w, program=program, operands=operands, cfg=cfg):
                    codetta.gemm(a, w.t(), program, config=cfg, **operands)

                run()
                runs.append((shape, cfg_name, name, run))
        cublas = (shape, "cuBLAS", "torch.matmul", lambda a=a, w=w: a @ w.t())
        runs.append(cublas)
    torch.cuda.synchronize()
    times = graph_ms_in_rounds({run[:3]: run[3] for run in runs}, args.rounds)
    median = {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}
    rows = []
    for (shape, cfg_name, name), ms in median.items():
        plain = median.get((shape, cfg_name, "plain store"), ms)
        rows.append({"shape": shape, "config": cfg_name, "epilogue": name, "ms": ms, "vs plain store": ms / plain})
    columns = ["shape", "config", "epilogue", "ms", "vs plain store"]
    write_results("epilogue_ablation", rows, markdown_table(rows, columns))
    print(markdown_table(rows, columns))


if __name__ == "__main__":
    main()

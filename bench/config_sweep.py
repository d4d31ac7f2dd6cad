"""Every tuning candidate of each fused GEMM, timed side by side (H200): what the tuner chooses from.

    python bench/config_sweep.py [--pieces "substring|..."] [--rounds 3]

The epilogue GEMMs of bench/ops_breakdown.py (Llama-3-8B shapes), each forced to each of its
tuning candidates in turn and timed from a CUDA graph (no host overhead); every round times
all (piece, config) pairs in a new random order after a warm-up that brings the GPU to its
loaded clocks, and the table gives each pair's median over the rounds against cuBLAS.
A GPU timed from idle runs at boost clocks for a while: timed once each, in table order,
the first candidates look faster than they are. Writes bench/results/config_sweep.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codetta.matmul import launch, tuning  # noqa: E402

from common import graph_ms_in_rounds, markdown_table, require_gpu, write_results  # noqa: E402
from ops_breakdown import pieces  # noqa: E402


def _config_name(c) -> str:
    extra = (" flat" if c.FLATTEN else "") + (" 2/SM" if c.CTAS_PER_SM == 2 else "")
    return f"{c.BM}x{c.BN}x{c.BK} s{c.STAGES} w{c.num_warps} e{c.EPI_SPLIT}{extra}"


def forced(fn, n):
    """A function running ``fn`` with its GEMM forced to the n-th tuning candidate (None when
    it has fewer), and that candidate."""
    chosen = []
    original = tuning.choose

    def choose(key, configs, bench, prepare=None, cannot_time=None):
        if n < len(configs):
            if prepare is not None and n == 0:
                prepare(configs)  # compile all candidates at once, the first time
            chosen.append(configs[n])
        return configs[min(n, len(configs) - 1)]

    tuning.choose = choose
    launch._PLANS.clear()
    try:
        fn()  # plans (and compiles) the forced config
    finally:
        tuning.choose = original
    if not chosen:
        return None, None
    plan_cache = dict(launch._PLANS)  # the forced plan, to be reinstated before each timing

    def run():
        launch._PLANS.clear()
        launch._PLANS.update(plan_cache)
        fn()

    return run, chosen[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pieces", default="epilogue GEMM", help="|-separated substrings of piece names")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_gpu("config_sweep")
    wanted = args.pieces.split("|")
    runs = []  # (piece, config name, run, cuBLAS fn)
    for name, (fn, base, _) in pieces().items():
        if base is None or not any(w in name for w in wanted):
            continue
        for n in range(64):
            run, cfg = forced(fn, n)
            if run is None:
                break
            runs.append((name, _config_name(cfg), run, base))
            print(f"compiled {name}: {_config_name(cfg)}", flush=True)
    bases = {(name, "cuBLAS"): base for name, _, _, base in runs}
    times = graph_ms_in_rounds({**{(name, cfg): run for name, cfg, run, _ in runs}, **bases}, args.rounds)
    cublas = {name: times.pop((name, cfg)) for name, cfg in bases}
    rows = []
    for (name, cfg), ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        base_ms = sorted(cublas[name])[len(cublas[name]) // 2]
        rows.append({"piece": name, "config": cfg, "ms": ms, "time / cuBLAS": ms / base_ms,
                     "spread %": 100 * (max(ts) - min(ts)) / ms})
    rows.sort(key=lambda row: (row["piece"], row["ms"]))
    columns = ["piece", "config", "ms", "time / cuBLAS", "spread %"]
    write_results("config_sweep", rows, markdown_table(rows, columns))
    print(markdown_table(rows, columns))


if __name__ == "__main__":
    main()

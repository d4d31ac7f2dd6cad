"""One GEMM's tuned config against another config, inside an op or block (H200).

    python bench/config_ab.py --program linear_residual_rmsnorm --shape 4096,4096 --config 128,256,64,3,8,1 [--rounds 3]

Until 853abaa the tuner timed each candidate alone (triton.testing.do_bench: L2 flushed before
each call; now from ~25 ms CUDA graphs: bench/tuner_timing.py); bench/config_sweep.py replays
each from a CUDA graph. Where they rank configs differently, the arbiter is the kernel inside
what users run: this times op b (O-projection + residual + norm
producer, Llama-3-8B, M = 16384) and the paper block (d = 4096, M = 16384), forward and
forward+backward as bench/ops_bench.py does, with the tuner's config for every GEMM whose
tuning key names ``--program`` and the ``--shape`` (N, K), then with that config replaced by
``--config`` (BM, BN, BK, STAGES, num_warps, EPI_SPLIT), alternating for ``--rounds``.
Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codetta.matmul import Config, launch, tuning  # noqa: E402

from block_bench import codetta_block, make_inputs, rope_args  # noqa: E402
from common import median_ms, require_gpu  # noqa: E402
from ops_bench import SHAPES, cases, timed_step  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--program", default="linear_residual_rmsnorm")
    parser.add_argument("--shape", default="4096,4096", help="N,K of the GEMM")
    parser.add_argument("--config", default="128,256,64,3,8,1", help="BM,BN,BK,STAGES,num_warps,EPI_SPLIT")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_gpu("config_ab")
    bm, bn, bk, stages, warps, split = (int(v) for v in args.config.split(","))
    other = Config(BM=bm, BN=bn, BK=bk, STAGES=stages, num_warps=warps, EPI_SPLIT=split).as_dict()
    n, k = args.shape.split(",")
    m = 16384
    inputs_b, fn_b, *_ = cases(m, SHAPES["llama3-8b"])["b_oproj_residual_norm"]
    block = codetta_block(*rope_args(m))
    subjects = {f"op b {pass_}": timed_step(fn_b, inputs_b(), backward) for pass_, backward in (("fwd", False),
                                                                                              ("fwd+bwd", True))}
    subjects.update({f"block d4096 {pass_}": timed_step(block, make_inputs(m, 4096), backward)
                     for pass_, backward in (("fwd", False), ("fwd+bwd", True))})
    table = tuning._load()
    keys = [key for key in table if args.program in key and f"|{n}|{k}|" in key]
    tuned = {key: table[key] for key in keys}
    print("keys:", *(f"{key} -> {tuned[key]}" for key in keys), sep="\n  ")
    times = {(name, which): [] for name in subjects for which in ("tuned", "other")}
    for _ in range(args.rounds):
        for which in ("tuned", "other"):
            for key in keys:
                table[key] = tuned[key] if which == "tuned" else {**tuned[key], **other, "CTAS_PER_SM": 1,
                                                                  "FLATTEN": False}
            launch._PLANS.clear()
            for name, step in subjects.items():
                step()  # plans (and compiles) the config
                times[(name, which)].append(median_ms(step))
    for name in subjects:
        t, o = (statistics.median(times[(name, w)]) for w in ("tuned", "other"))
        print(f"{name}: tuned {t:.3f} ms, {args.config} {o:.3f} ms, ratio {o / t:.3f}")


if __name__ == "__main__":
    main()

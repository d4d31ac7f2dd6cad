"""One launch of a plain GEMM and of epilogue programs at one shape, for Nsight Compute.

    ncu --kernel-name regex:"plain_gemm|bench_" --section SpeedOfLight --section WarpStateStats \\
        --section SchedulerStats python3 bench/ncu_epilogue.py

Each kernel runs once with a fixed config (by default the one the tuner picked on the H200
for the SwiGLU GEMM of Llama-3-8B). Not a benchmark: the numbers come from ncu's report
(why an epilogue costs more than its bytes: the warps' stall reasons).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codetta  # noqa: E402

from gemm_bench import _programs  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mnk", default="16384,28672,4096")
    parser.add_argument("--config", default="128,256,64,8,3,8,2", help="BM,BN,BK,GROUP_M,STAGES,warps,EPI_SPLIT")
    args = parser.parse_args()
    m, n, k = map(int, args.mnk.split(","))
    bm, bn, bk, group, stages, warps, split = map(int, args.config.split(","))
    cfg = codetta.Config(bm, bn, bk, group, stages, warps, split)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    operands = {"bench_rowscale": {"r": torch.rand(m, device="cuda") + 0.5},
                "bench_rowscale_swiglu": {"r": torch.rand(m, device="cuda") + 0.5},
                "bench_residual_sumsq": {"res": torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
                                         "gamma": torch.randn(n, device="cuda", dtype=torch.bfloat16)}}
    codetta.gemm(a, w.t(), config=cfg)
    for p in _programs():
        codetta.gemm(a, w.t(), p, config=cfg, **operands[p.name])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

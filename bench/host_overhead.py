"""Where the host time of one codetta.gemm call goes (GPU machine): per-call µs and a profile.

    python bench/host_overhead.py
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import codetta  # noqa: E402
from codetta import epilogue as ep  # noqa: E402


def per_call_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def main():
    m = n = k = 512  # small: the GPU never holds the host back
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    r = torch.rand(m, device="cuda")
    p = ep.Program("host_swiglu")
    z = p.acc * p.row("r")
    g, u = ep.pairs(z)
    p.store("y", ep.silu(g) * u)
    p.row_sumsq("ss", z)
    print(f"torch.matmul           {per_call_us(lambda: torch.matmul(a, w.t())):8.1f} us/call")
    print(f"codetta.gemm plain     {per_call_us(lambda: codetta.gemm(a, w.t())):8.1f} us/call")
    print(f"codetta.gemm swiglu+ss {per_call_us(lambda: codetta.gemm(a, w.t(), p, r=r)):8.1f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        codetta.gemm(a, w.t(), p, r=r)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

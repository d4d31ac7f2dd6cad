"""Where the host time of an op's call goes: cProfile of codetta's forward+backward.

    python bench/host_profile.py [--m 4096] [--ops a,b] [--calls 200] [--top 40]

The ops and inputs of bench/ops_bench.py (Llama-3-8B shapes). Kernels are launched as in
training; the GPU is kept busy so that the profile holds the host's work (Python, PyTorch's
dispatcher, Triton's launcher), not waits. Prints the functions with the most time of their
own and with the most time inclusive, and writes them to bench/results/host_profile_m<M>.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, require_gpu  # noqa: E402
from ops_bench import SHAPES, cases, host_ms, timed_step  # noqa: E402


def profile(step, calls, top):
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # the GPU stays busy (~0.5 s): the profile holds no wait for a kernel
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumtime").print_stats(top)
    return text.getvalue()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--ops", default="a,b")
    parser.add_argument("--calls", type=int, default=40, help="few enough that the launch queue never fills")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    require_gpu("host_profile")
    report = [str(environment())]
    for name, (make, ours, _, _) in cases(args.m, SHAPES["llama3-8b"]).items():
        if name[0] not in args.ops.split(","):
            continue
        step = timed_step(ours, make(), backward=True)
        head = f"== {name}, M = {args.m}, forward+backward: host {host_ms(step):.3f} ms per call"
        print(head, flush=True)
        report += [head, profile(step, args.calls, args.top)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"host_profile_m{args.m}.txt"
    path.write_text("\n".join(report))
    print("\n".join(report[1:]))


if __name__ == "__main__":
    main()

"""Where the time of an op's call goes: its GPU kernels, and cProfile of its host work.

    python bench/op_profile.py [--m 4096] [--ops a,b] [--block 2048] [--calls 40] [--top 40]

The ops and inputs of bench/ops_bench.py (Llama-3-8B shapes), codetta's forward+backward;
with --block d, also bench/block_bench.py's codetta block at width d, forward and forward+backward.
GPU: torch.profiler's time per kernel, per call. Host: the GPU is kept busy so that the
profile holds the host's work (Python, PyTorch's dispatcher, Triton's launcher), not waits;
the functions with the most time of their own and with the most time inclusive. Writes
bench/results/op_profile_m<M>.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, require_gpu  # noqa: E402
from block_bench import codetta_block, make_inputs, rope_args  # noqa: E402
from ops_bench import SHAPES, cases, host_ms, timed_step  # noqa: E402


def kernels(step, calls):
    """torch.profiler's GPU kernels of ``calls`` steps: a table of time per call."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in rows) / calls / 1e3
    lines = [f"GPU kernels: {total:.3f} ms per call", "| ms per call | launches per call | kernel |", "|---|---|---|"]
    lines += [f"| {e.device_time_total / calls / 1e3:.3f} | {e.count / calls:g} | {e.key[:90]} |" for e in rows]
    return "\n".join(lines)


def host_profile(step, calls, top):
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
    parser.add_argument("--block", type=int, help="also the codetta block at this width d")
    parser.add_argument("--calls", type=int, default=40, help="few enough that the launch queue never fills")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    require_gpu("op_profile")
    report = [str(environment())]
    profiled = [(name, make, ours, True) for name, (make, ours, _, _) in cases(args.m, SHAPES["llama3-8b"]).items()
                if name[0] in args.ops.split(",")]
    if args.block:
        block = codetta_block(*rope_args(args.m))
        profiled += [(f"block d={args.block}", lambda: make_inputs(args.m, args.block), block, backward)
                     for backward in (False, True)]
    for name, make, ours, backward in profiled:
        step = timed_step(ours, make(), backward=backward)
        host = host_ms(step)
        gc.disable()  # what Python's cyclic garbage collector adds to the host's time
        without_gc = host_ms(step)
        gc.enable()
        head = (f"== {name}, M = {args.m}, forward{'+backward' if backward else ''}: "
                f"host {host:.3f} ms per call ({without_gc:.3f} with the garbage collector off)")
        print(head, flush=True)
        report += [head, kernels(step, args.calls), host_profile(step, args.calls, args.top)]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"op_profile_m{args.m}.txt"
    path.write_text("\n".join(report))
    print("\n".join(report[1:]))


if __name__ == "__main__":
    main()

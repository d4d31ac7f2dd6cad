"""Where the host's time goes in a training step: cProfile over steady-state steps.

    python bench/host_profile.py --variant hf_codetta [--steps 3] [--top 45]

The model of bench/train_bench.py; after warm-up steps (tuning), each profiled step is
issued behind a GPU spin (``torch.cuda._sleep``) so that the host does not wait for the GPU:
what the profile holds is the host's own cost (Python, autograd, launches). Unless the step
waits after all, and a step's host time then holds the ~2 s spin, in the call that waited:
a synchronizing call (one more step runs under ``torch.cuda.set_sync_debug_mode("warn")``,
each such call printed with its stack), the allocator's cudaMalloc or cudaFree (the profiled
steps' new segments and retries are counted), or a launch into a full launch queue (about a
thousand kernels: a LoRA step issues more than that, so its profile shows the spin in
whichever call launched the one too many; the rest of the profile stands).
cProfile's own overhead inflates many-call functions; read the shares, not the absolute times. Prints the
functions by own time and by cumulative time; writes bench/results/host_profile_<variant>.txt
(with --lora: host_profile_<variant>_lora_<targets>.txt).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import RESULTS, environment, require_gpu  # noqa: E402
from train_bench import VARIANTS, step_arguments, warmed_up_step  # noqa: E402

SPIN_CYCLES = 4_000_000_000  # ~2 s at the H200's clock: longer than a step's host time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, default="hf_codetta")
    step_arguments(parser, steps=3)
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()
    require_gpu("bench/host_profile.py")
    step = warmed_up_step(args.variant, args)
    profiler, host_s = cProfile.Profile(), []
    before = torch.cuda.memory_stats()
    for _ in range(args.steps):
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        t0 = time.perf_counter()
        profiler.enable()
        step()
        profiler.disable()
        host_s.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    text = io.StringIO()
    print(environment(), file=text)
    print(f"host ms per profiled step: {[round(s * 1e3, 1) for s in host_s]}", file=text)
    for key in ("segment.all.allocated", "num_alloc_retries"):
        print(f"{key} during the profiled steps: {after.get(key, 0) - before.get(key, 0)}", file=text)
    print(synchronizing_calls(step), file=text)
    for order in ("tottime", "cumulative"):
        print(f"\n## by {order}, {args.steps} steps", file=text)
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(order).print_stats(args.top)
    lora = "_lora_" + args.lora.replace(",", "_") if args.lora else ""
    (RESULTS / f"host_profile_{args.variant}{lora}.txt").write_text(text.getvalue())
    print(text.getvalue())


def synchronizing_calls(step) -> str:
    """The calls of one ``step`` that PyTorch flags as synchronizing the host with the GPU, each
    with the stack that made it."""
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        found.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():  # restores warnings.showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return f"\n## synchronizing calls in one step: {len(found)}\n" + "\n".join(found)


if __name__ == "__main__":
    main()

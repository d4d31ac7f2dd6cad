"""What is allocated at a training step's peak, by where it was allocated: one variant of
bench/train_bench.py's step (full or LoRA fine-tuning), CUDA's allocator history replayed.

    python bench/memory_peak.py --variant hf_codetta [--lora q_proj,v_proj] [--rows 25] [--phase backward]

After the warmup steps, one step runs with torch.cuda.memory's history on. Replaying its
allocations and frees finds the moment the allocated bytes peak; the blocks live then are
grouped by the innermost Python frame of the model's code that allocated them (codetta,
transformers, peft, liger_kernel, torch.nn/autograd, else the innermost frame), and the
largest groups printed with their bytes (MiB) and block sizes, then the frames of the
allocation that reached the peak (when it happened). Run it for two variants to see where their peaks
differ. With ``--phase backward`` the history starts after the forward: the backward's peak, the
forward's activations among the bytes allocated before it.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import require_gpu  # noqa: E402
from train_bench import VARIANTS, step_arguments, warmed_up_step  # noqa: E402

OWN_CODE = ("codetta/", "transformers/", "peft/", "liger_kernel/", "torch/nn/", "torch/autograd/", "torch/optim/")


def where(frames: list[dict]) -> str:
    """The innermost frame in code of the model (OWN_CODE), as file:line function."""
    for f in frames:
        name = f["filename"]
        if any(part in name for part in OWN_CODE) and "memory_peak" not in name:
            short = name[name.rfind("site-packages/") + 14:] if "site-packages/" in name else name
            return f"{short}:{f['line']} {f['name']}"
    return "?" if not frames else f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}"


def live_at_peak(trace: list[dict], start_bytes: int) -> tuple[int, dict, list[dict]]:
    """(peak bytes, {address: (size, frames)} of the blocks allocated in the history and live at
    the peak, the frames of the allocation that reached it), replaying its allocs and frees on top
    of ``start_bytes`` allocated before it began."""
    live, total, peak, at_peak, peak_frames = {}, start_bytes, start_bytes, {}, []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            if total > peak:
                peak, at_peak, peak_frames = total, dict(live), event.get("frames", [])
        elif event["action"] == "free_completed":  # a block of the history's, or one allocated before it
            total -= live.pop(event["addr"])[0] if event["addr"] in live else event["size"]
    return peak, at_peak, peak_frames


def main():
    parser = argparse.ArgumentParser()
    step_arguments(parser, steps=1)
    parser.add_argument("--variant", choices=VARIANTS, default="hf_codetta")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--phase", choices=("step", "backward"), default="step",
                        help="the peak of the whole step, or of its backward and optimizer step only")
    args = parser.parse_args()
    require_gpu("memory_peak")
    step = warmed_up_step(args.variant, args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = 0

    def record():
        nonlocal before
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")

    if args.phase == "step":
        record()
        step()
    else:  # the backward and the optimizer step only: the forward's activations counted in `before`
        step(after_forward=record)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks, peak_frames = live_at_peak(snapshot["device_traces"][0], before)
    groups = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for size, frames in blocks.values():
        group = groups[where(frames)]
        group[0] += size
        group[1] += 1
        group[2][round(size / 2**20, 1)] += 1
    mib = 2**20
    print(f"{args.variant} lora={args.lora or '-'}: before the {args.phase} {before / mib:.0f} MiB allocated, replayed "
          f"peak {peak / mib:.0f} MiB (max_memory_allocated {torch.cuda.max_memory_allocated() / mib:.0f}), "
          f"{sum(s for s, _ in blocks.values()) / mib:.0f} MiB in {len(blocks)} blocks allocated during the "
          f"{args.phase}")
    for name, (size, count, sizes) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.rows]:
        by_size = ", ".join(f"{n} x {s:g}" for s, n in sorted(sizes.items(), reverse=True))
        print(f"{size / mib:9.1f} MiB {count:5d} blocks  {name}  ({by_size} MiB)")
    print("the allocation that reached the peak, innermost frames of the model's code first:")
    for f in [f for f in peak_frames if any(part in f["filename"] for part in OWN_CODE)][:8]:
        print(f"    {f['filename']}:{f['line']} {f['name']}")


if __name__ == "__main__":
    main()

"""Where the GPU time of one training step goes: a torch.profiler table per variant (H200).

    python bench/train_profile.py [--variant hf_codetta] [--steps 2] [--rows 30]

Builds the model of bench/train_bench.py, runs three warm-up steps (compilation, tuning),
times ``--steps`` steps unprofiled, profiles as many and prints the kernels with the most GPU time, and the total
GPU time per step. Writes bench/results/profile_<variant>.txt.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, require_gpu  # noqa: E402
from train_bench import VARIANTS, build  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, default="hf_codetta")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    require_gpu("train_profile")
    start = time.perf_counter()
    model = build(args.variant)
    print(f"built {args.variant} in {time.perf_counter() - start:.1f} s", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 128256, (args.batch, args.seq), device="cuda")

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"warm-up (compilation, tuning) done at {time.perf_counter() - start:.1f} s", flush=True)
    wall = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - wall) * 1e3 / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
    table = events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70)
    text = (f"{environment()}\nvariant {args.variant}: GPU kernel time per step {gpu_ms:.1f} ms, "
            f"wall time per step {wall_ms:.1f} ms (unprofiled)\n{table}\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"profile_{args.variant}.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""Where the GPU time of one training step goes: a torch.profiler table per variant (H200).

    python bench/train_profile.py [--variant hf_codetta] [--steps 2] [--rows 30]

Builds the model of bench/train_bench.py, runs three warm-up steps (compilation, tuning),
times ``--steps`` steps unprofiled, profiles as many and prints the kernels with the most GPU time, the total
GPU time per step, the ATen operators (other than GEMMs, attention and the optimizer) with the
most GPU time by input shapes (what memory-bound work the model does outside codetta's ops),
and where the GPU sat idle between kernels (see :func:`idle_report`). Writes
bench/results/profile_<variant>.txt (with --lora: profile_<variant>_lora_<targets>.txt).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, environment, require_gpu  # noqa: E402
from train_bench import VARIANTS, step_arguments, training_setup  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=VARIANTS, default="hf_codetta")
    step_arguments(parser, steps=2)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    require_gpu("train_profile")
    start = time.perf_counter()
    model, opt, ids = training_setup(args.variant, args)
    print(f"built {args.variant} in {time.perf_counter() - start:.1f} s", flush=True)

    def step():
        with record_function("phase:forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    print(f"warm-up (compilation, tuning) done at {time.perf_counter() - start:.1f} s", flush=True)
    wall = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - wall) * 1e3 / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / args.steps
    table = events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70)
    aten = aten_report(prof.key_averages(group_by_input_shape=True), args.steps)
    idle = idle_report(trace_events(prof), args.steps)
    # The GPU's own timeline with the host unslowed: no CPU-side tracing, only kernel records.
    with profile(activities=[ProfilerActivity.CUDA]) as quiet:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    gaps = gap_report(trace_events(quiet), args.steps)
    text = (f"{environment()}\nvariant {args.variant}: GPU kernel time per step {gpu_ms:.1f} ms, "
            f"wall time per step {wall_ms:.1f} ms (unprofiled)\n{table}\n\n{aten}\n\n{idle}\n\n{gaps}\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    lora = "_lora_" + args.lora.replace(",", "_") if args.lora else ""
    (RESULTS / f"profile_{args.variant}{lora}.txt").write_text(text)
    print(text)


_GPU = ("kernel", "gpu_memcpy", "gpu_memset")
_OPTIMIZER = "multi_tensor_apply"  # the kernels of fused AdamW: the last of a step
# ATen operators that are the step's FLOPs (GEMMs, attention) or the optimizer, left out of aten_report
_COMPUTE = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::_fused_adamw_",
            "aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "aten::_cudnn_attention",
            "aten::_flash_attention", "aten::_efficient_attention")


def aten_report(events, steps: int, rows: int = 15) -> str:
    """The ATen operators outside the step's GEMMs, attention and optimizer with the most GPU time
    of their own, by input shapes: copies, concatenations and elementwise passes the model runs
    around the fused operators (``events``: key averages grouped by input shape)."""
    memory = sorted((e for e in events if e.key.startswith("aten::") and e.self_device_time_total > 0
                     and not e.key.startswith(_COMPUTE)), key=lambda e: -e.self_device_time_total)
    lines = ["| ATen operator | input shapes | calls per step | GPU ms per step |", "|---|---|---|---|"]
    lines += [f"| {e.key} | {str(e.input_shapes)[:100]} | {e.count / steps:.0f} | "
              f"{e.self_device_time_total / 1e3 / steps:.3f} |" for e in memory[:rows]]
    return "\n".join(lines)


def trace_events(prof) -> list:
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        return json.loads(Path(trace.name).read_text())["traceEvents"]


def gap_report(events: list, steps: int, rows: int = 20) -> str:
    """Idle time between consecutive GPU operations of a CUDA-only profile (the host runs at its
    own speed), per step, by the pair of kernels around each gap."""
    ops = sorted((e for e in events if e.get("cat") in _GPU and "dur" in e), key=lambda e: e["ts"])
    busy = sum(e["dur"] for e in ops)
    by_pair, count, idle, end, before = collections.Counter(), collections.Counter(), 0.0, None, None
    by_step = [0.0]  # a step ends with the optimizer's multi-tensor kernels (fused AdamW)
    for e in ops:
        if before is not None and _OPTIMIZER in before and _OPTIMIZER not in e["name"]:
            by_step.append(0.0)
        if end is not None and e["ts"] > end:
            key = (before[:45], e["name"][:45])
            by_pair[key] += e["ts"] - end
            count[key] += 1
            idle += e["ts"] - end
            by_step[-1] += e["ts"] - end
        if end is None or e["ts"] + e["dur"] >= end:
            end, before = e["ts"] + e["dur"], e["name"]
    ms = 1e3 * steps
    lines = [f"CUDA-only profile of {steps} steps issued back to back: GPU busy {busy / ms:.2f} ms, idle "
             f"{idle / ms:.2f} ms per step; idle ms in step 1, 2, ...: {', '.join(f'{t / 1e3:.2f}' for t in by_step)}",
             "| before the gap | after the gap | gaps per step | idle ms per step |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {count[(a, b)] / steps:.0f} | {v / ms:.3f} |" for (a, b), v in by_pair.most_common(rows)]
    return "\n".join(lines)
_LAUNCH = ("cuda_runtime", "cuda_driver")


def idle_report(events: list, steps: int, rows: int = 15) -> str:
    """Where the GPU sat idle between consecutive kernels of the profiled steps, per step.

    Each gap before a kernel is charged to the phase (forward, backward, optimizer) whose host
    span holds that kernel's launch, and called host-bound when the launch call ended only
    after the GPU had run dry (the GPU waited for the host to issue it); otherwise the GPU
    waited on something else (a synchronization, a dependency, launch latency).
    """
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCH and "correlation" in e.get("args", {})}
    phases = sorted((e["ts"], e["ts"] + e["dur"], e["name"].split(":", 1)[1]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith("phase:"))
    kernels = sorted((e for e in events if e.get("cat") in _GPU and "dur" in e), key=lambda e: e["ts"])

    def phase_of(ts):
        return next((name for start, end, name in phases if start <= ts <= end), "between phases")

    busy = idle = 0.0
    by_phase = collections.Counter()
    host_bound = collections.Counter()
    by_kernel = collections.Counter()
    count = collections.Counter()
    end = None
    for k in kernels:
        busy += k["dur"]
        if end is not None and k["ts"] > end:
            gap = k["ts"] - end
            idle += gap
            launch = launches.get(k.get("args", {}).get("correlation"))
            phase = phase_of(launch["ts"]) if launch else "unknown"
            by_phase[phase] += gap
            if launch and launch["ts"] + launch.get("dur", 0) >= end:
                host_bound[phase] += gap
            key = (phase, k["name"][:60])
            by_kernel[key] += gap
            count[key] += 1
        end = max(end or 0.0, k["ts"] + k["dur"])
    ms = 1e3 * steps
    lines = [f"GPU idle between kernels: {idle / ms:.2f} ms per step (busy {busy / ms:.2f} ms)",
             "| phase | idle ms per step | of which host-bound |", "|---|---|---|"]
    lines += [f"| {p} | {v / ms:.2f} | {host_bound[p] / ms:.2f} |" for p, v in by_phase.most_common()]
    lines += ["", "| phase | kernel after the gap | gaps per step | idle ms per step |", "|---|---|---|---|"]
    lines += [f"| {p} | {name} | {count[(p, name)] / steps:.0f} | {v / ms:.3f} |"
              for (p, name), v in by_kernel.most_common(rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

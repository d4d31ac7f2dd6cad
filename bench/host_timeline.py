"""Where the host stands in a training step: host and GPU time per phase, and host-device syncs.

    python bench/host_timeline.py [--variants hf_eager,hf_codetta] [--seq 4096] [--batch 2]

For each variant of bench/train_bench.py (one process each): after warm-up steps, the GPU
is made to spin (``torch.cuda._sleep``) long enough that the host issues a whole step
(forward, backward, AdamW) before any of it runs; the host time of each phase is then its
own cost (launches, Python, autograd), unless the phase waits for the GPU: a phase whose
host time includes the spin has a host-device synchronization in it. Each phase's GPU time
comes from CUDA events. A step is host-bound where a phase's host time exceeds its GPU
time and the host is not ahead by then. Last, one more step runs under
``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing call is listed with the
frame outside torch that made it (a prototype: it misses some, which the spin shows).
Writes bench/results/host_timeline.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import markdown_table, require_gpu, write_results  # noqa: E402
from train_bench import rows_of_variants, step_arguments, training_setup  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
SPIN_CYCLES = 4_000_000_000  # ~2 s of GPU spin at the H200's clock: longer than any step's host time


def _step_phases(model, opt, ids):
    """The step's three phases as callables, in order."""
    state = {}

    def forward():
        state["loss"] = model(input_ids=ids, labels=ids).loss

    def backward():
        state["loss"].backward()

    def optimizer():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward, backward, optimizer


def _timed_step(model, opt, ids) -> dict:
    """Host ms of each phase issued behind a GPU spin, and each phase's GPU ms."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    events[0].record()
    row = {}
    for i, (name, phase) in enumerate(zip(PHASES, _step_phases(model, opt, ids))):
        t0 = time.perf_counter()
        phase()
        events[i + 1].record()
        row[f"{name} host ms"] = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    for i, name in enumerate(PHASES):
        row[f"{name} GPU ms"] = events[i].elapsed_time(events[i + 1])
    return row


def _back_to_back(model, opt, ids, steps: int) -> list[dict]:
    """Host ms of each phase of ``steps`` steps issued back to back (no synchronization): where
    the host is ahead of the GPU, a phase that waits for it (an implicit synchronization, a
    full launch queue) shows as a host time far above its usual one."""
    torch.cuda.synchronize()
    rows = []
    for _ in range(steps):
        row = {}
        for name, phase in zip(PHASES, _step_phases(model, opt, ids)):
            t0 = time.perf_counter()
            phase()
            row[name] = (time.perf_counter() - t0) * 1e3
        rows.append(row)
    torch.cuda.synchronize()
    return rows


def _syncs(model, opt, ids) -> list[str]:
    """Each synchronizing call of one step: its message and the innermost frame outside torch."""
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):  # the mode's own notice that it is a prototype
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename
                  and "/warnings.py" not in f.filename]
        where = f"{frames[-1].filename.split('/site-packages/')[-1]}:{frames[-1].lineno} ({frames[-1].name})" \
            if frames else "?"
        found.append(f"{str(message).splitlines()[0][:80]} at {where}")

    saved = warnings.showwarning
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            for phase in _step_phases(model, opt, ids):
                phase()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = saved
    torch.cuda.synchronize()
    return found


def run_variant(variant: str, args) -> dict:
    model, opt, ids = training_setup(variant, args)
    for _ in range(args.warmup):
        for phase in _step_phases(model, opt, ids):
            phase()
    rows = [_timed_step(model, opt, ids) for _ in range(args.steps)]
    row = {"variant": variant}
    for key in rows[0]:
        row[key] = sorted(r[key] for r in rows)[len(rows) // 2]
    row["host ms"] = sum(row[f"{p} host ms"] for p in PHASES)
    row["GPU ms"] = sum(row[f"{p} GPU ms"] for p in PHASES)
    row["back to back host ms"] = _back_to_back(model, opt, ids, 2 * args.steps)
    row["syncs"] = _syncs(model, opt, ids)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default="hf_eager,hf_codetta")
    step_arguments(parser, steps=5)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in a child process
    args = parser.parse_args()
    require_gpu("host_timeline")
    if args.variant:
        print(json.dumps(run_variant(args.variant, args)))
        return
    rows = [row for row in rows_of_variants(__file__, args) if "error" not in row]
    columns = ["variant", "host ms", "GPU ms", *(f"{p} {w} ms" for p in PHASES for w in ("host", "GPU"))]
    table = markdown_table(rows, columns)
    syncs = "\n".join(f"- {r['variant']}: {len(r['syncs'])} synchronizing calls per step"
                      + "".join(f"\n  - {s}" for s in sorted(set(r["syncs"]))) for r in rows)
    back = "\n".join(f"- {r['variant']}: " + "; ".join(
        "/".join(f"{step[p]:.0f}" for p in PHASES) for step in r["back to back host ms"]) for r in rows)
    print(table)
    print(syncs)
    print(back)
    write_results("host_timeline", rows, f"{table}\n\nHost-device synchronizations in one step "
                  f"(torch.cuda.set_sync_debug_mode):\n\n{syncs}\n\nHost ms of forward/backward/optimizer, steps issued "
                  f"back to back:\n\n{back}")


if __name__ == "__main__":
    main()

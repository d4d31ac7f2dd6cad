"""Shared pieces of the benchmarks: timing, environment description, result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

RESULTS = Path(__file__).resolve().parent / "results"


def require_gpu(script: str) -> None:
    """Exit with a clear message where there is no CUDA GPU (the benchmark times GPU kernels)."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU (on a CPU, bench/host_overhead.py and bench/ttgir_probe.py run)")


def median_ms(fn, *, warmup=25, rep=100) -> float:
    """Median time of ``fn`` in ms on the GPU (L2 flushed between runs by do_bench)."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def median_graph_ms(fn, *, rep=100) -> float:
    """Median GPU time of ``fn`` replayed from a CUDA graph: no host (Python, launch) overhead."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def graph_ms_in_rounds(runs: dict, rounds: int) -> dict:
    """key -> the :func:`median_graph_ms` of ``runs[key]`` in each of ``rounds`` rounds (a list).
    Each round times every run in a new random order (seeded), after two seconds of the first
    run that bring the GPU to its loaded clocks: timed from idle, in a fixed order, the first
    runs would see boost clocks the others do not."""
    times = {key: [] for key in runs}
    rng = random.Random(0)
    warm_up = next(iter(runs.values()))
    for r in range(rounds):
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            warm_up()
            torch.cuda.synchronize()
        order = list(runs.items())
        rng.shuffle(order)
        for key, run in order:
            times[key].append(median_graph_ms(run))
        print(f"round {r + 1} of {rounds} done", flush=True)
    return times


def gemm_operands(m: int, n: int, k: int) -> tuple:
    """A GEMM's bf16 operands on the GPU, seeded: a [m, k], w [n, k] (scaled by 1/sqrt(k), as a
    layer's weight), and a residual [m, n] and norm weight [n] for the epilogues that read them."""
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
    residual = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    gamma = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return a, w, residual, gamma


def environment() -> dict:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": dev,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "code": _commit(),
    }


def _commit() -> str:
    """The git commit of the code measured: $CODETTA_CODE_COMMIT when set (the device copy's
    .git may be older than its files: pass it from the machine that sent them), else git's."""
    if os.environ.get("CODETTA_CODE_COMMIT"):
        return os.environ["CODETTA_CODE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_results(name: str, rows: list[dict], table: str) -> Path:
    """Write rows as JSON and the printed table as Markdown under bench/results/."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    env = environment()
    (RESULTS / f"{name}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    header = "\n".join(f"- {k}: {v}" for k, v in env.items())
    path = RESULTS / f"{name}.md"
    path.write_text(f"# {name}\n\n{header}\n\n{table}\n")
    return path


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)

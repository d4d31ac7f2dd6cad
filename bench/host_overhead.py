"""Host (CPU) time per call: what a training step costs before the GPU does any work.

    python bench/host_overhead.py [--layers 2] [--seq 256] [--calls 200] [--lora q_proj,v_proj] [--profile]

Shapes are small, so the GPU finishes each kernel long before the host issues the next
one: the wall time of a loop of calls without a synchronization is then the host's time
to issue them (Python, checks, planning, Triton's and PyTorch's launchers). Measured:

- one plain GEMM through ``torch.mm`` and through ``codetta.gemm``, and the Triton launch
  of the same codetta kernel alone (its recorded arguments replayed);
- a training step (forward + backward) of a small Llama-shape model per layer: HF eager,
  HF + codetta, HF + Liger-Kernel (when importable; patched last, as it replaces
  transformers' classes for the whole process); with ``--lora``, PEFT LoRA adapters (r = 16)
  on the projections it names, as bench/train_bench.py puts them; with ``--profile``, where
  the codetta and Liger steps' host time goes, by package and by codetta's functions.

Without a GPU the kernels run as no-ops under Triton's interpreter (Liger's too), and the
model is narrow (d = 64), so the numbers are the host's own work (Python, autograd, PyTorch's
CPU ops on small tensors): a proxy for comparing the variants' host time. Writes
bench/results/host_overhead{_lora_<targets>}.{md,json} (``_cpu`` appended without a GPU).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codetta  # noqa: E402
from codetta import epilogue as ep  # noqa: E402
from codetta.matmul import plan  # noqa: E402

from common import markdown_table, write_results  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def host_us(fn, calls: int) -> float:
    """Median over 5 rounds of the wall time per call of ``calls`` calls issued back to back."""
    fn()
    rounds = []
    for _ in range(5):
        if ON_GPU:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    if ON_GPU:
        torch.cuda.synchronize()
    return statistics.median(rounds)


def stub_kernels():
    """Without a GPU: make every Triton launch a no-op (only the host's own work is left)."""
    from triton.runtime.interpreter import InterpretedFunction

    InterpretedFunction.run = lambda self, *args, **kwargs: None


def recorded_launch():
    """(what the next codetta.gemm launch records, a stand-in for plan.load_kernel that records it):
    the kernel, its grid and arguments, and the compiled kernel Triton's JIT returned."""
    seen = {}
    original = plan.load_kernel

    def recording(program, path):
        kernel = original(program, path)

        class Recorder:
            arg_names = kernel.arg_names

            def __getitem__(self, grid):
                def go(*args, **kwargs):
                    seen.update(kernel=kernel, grid=grid, args=args, kwargs=kwargs)
                    seen["compiled"] = kernel[grid](*args, **kwargs)
                    return seen["compiled"]
                return go
        return Recorder()

    return seen, recording


def gemm_rows(calls):
    a = torch.randn(256, 512, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(512, 512, device=DEVICE, dtype=torch.bfloat16)
    seen, recording = recorded_launch()
    plan.load_kernel, original = recording, plan.load_kernel
    codetta.gemm(a, w.t(), config=codetta.Config(BM=128, BN=128, BK=64))  # a plan of its own: launched now
    plan.load_kernel = original
    jit = seen["kernel"][seen["grid"]]
    args, kwargs = seen["args"], seen["kwargs"]
    residual = torch.randn(256, 512, device=DEVICE, dtype=torch.bfloat16)
    program = ep.Program("host_residual_sumsq")
    x = program.acc + program.aux("residual")
    program.store("x", x)
    program.row_sumsq("ss", x)
    rows = [
        {"what": "torch.mm", "host_us": host_us(lambda: torch.mm(a, w.t()), calls)},
        {"what": "codetta.gemm (plain)", "host_us": host_us(lambda: codetta.gemm(a, w.t()), calls)},
        {"what": "its Triton JIT launch alone", "host_us": host_us(lambda: jit(*args, **kwargs), calls)},
    ]
    if seen["compiled"] is not None:
        compiled = seen["compiled"][seen["grid"]]
        rows.append({"what": "its compiled-kernel launch alone", "host_us": host_us(lambda: compiled(*args), calls)})
    rows.append({"what": "codetta.gemm (residual + row sum of squares)",
                 "host_us": host_us(lambda: codetta.gemm(a, w.t(), program, residual=residual), calls)})
    return rows


def build_model(layers, patch, lora=""):
    import transformers

    # on the CPU a narrow model: its unfused ops compute for real there (codetta's and Liger's kernels do not)
    hidden, ffn, heads = (2048, 8192, 32) if ON_GPU else (64, 128, 4)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=heads // 4, max_position_embeddings=8192,
                                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    model = transformers.LlamaForCausalLM(config).to(device=DEVICE, dtype=dtype)
    if patch:
        codetta.patch(model)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                            target_modules=lora.split(",")))
    return model


def step_row(name, model, ids, calls, profiles=None):
    """The host time of a training step; with a list ``profiles``, its profile by package appended."""
    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    row = {"what": f"train step, {name}", "host_us": host_us(step, calls)}
    if profiles is not None:
        profiles.append(f"### {name}: own time by package, then codetta's costliest functions (cProfile, "
                        f"{calls} steps)\n\n{own_time_by_package(step, calls)}")
    return row


def _package(filename: str, function: str) -> str:
    """Where a profiled function lives: codetta's subpackage, a library, or the builtin's name."""
    if filename == "~":
        return "builtin " + function.split(" of ")[0].strip("<>")[:40]
    if "/codetta/" in filename and "site-packages" not in filename:
        return "codetta/" + filename.split("/codetta/")[-1].split("/")[0]
    for library in ("torch", "triton", "transformers", "peft", "liger_kernel"):
        if f"/{library}/" in filename:
            return library
    return "other"


def own_time_by_package(fn, calls: int, top: int = 20) -> str:
    """A table of the host's own time (cProfile's tottime) and calls per step of ``fn``, by
    package, then codetta's costliest functions: where a step's host time goes, and how many
    Python calls each layer of the stack makes (cProfile's per-call overhead inflates the
    times of many-call code: compare calls and shares, not absolute times)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    by_package = collections.defaultdict(lambda: [0.0, 0])
    functions = []
    for (filename, line, function), (_, ncalls, tottime, _, _) in stats.items():
        package = _package(filename, function)
        by_package[package][0] += tottime
        by_package[package][1] += ncalls
        if package.startswith("codetta/"):
            functions.append((tottime, ncalls, f"{filename.split('/codetta/')[-1]}:{line}({function})"))
    total = sum(t for t, _ in by_package.values())
    rows = [{"where": k, "ms_per_step": t / calls * 1e3, "share": t / total, "calls_per_step": n / calls}
            for k, (t, n) in sorted(by_package.items(), key=lambda kv: -kv[1][0])[:top]]
    rows += [{"where": name, "ms_per_step": t / calls * 1e3, "share": t / total, "calls_per_step": n / calls}
             for t, n, name in sorted(functions, reverse=True)[:top]]
    return markdown_table(rows, ["where", "ms_per_step", "share", "calls_per_step"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--lora", default="", help="PEFT LoRA adapters on these projections (comma-separated)")
    parser.add_argument("--profile", action="store_true", help="also print each step's host time by package")
    args = parser.parse_args()
    os.environ.setdefault("CODETTA_AUTOTUNE", "0")  # tuning is not host overhead of a step
    if not ON_GPU:
        stub_kernels()
    rows = gemm_rows(args.calls)
    ids = torch.randint(0, 32000, (1, args.seq), device=DEVICE)
    step_calls = max(args.calls // 20, 3)
    rows.append(step_row("HF eager", build_model(args.layers, False, args.lora), ids, step_calls))
    profiles = [] if args.profile else None
    rows.append(step_row("HF + codetta", build_model(args.layers, True, args.lora), ids, step_calls, profiles))
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError:
        pass
    else:
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
        rows.append(step_row("HF + Liger", build_model(args.layers, False, args.lora), ids, step_calls, profiles))
    for row in rows:
        if row["what"].startswith("train step"):
            row["per_layer_us"] = row["host_us"] / args.layers
    table = markdown_table(rows, ["what", "host_us", "per_layer_us"])
    table += "" if ON_GPU else "\n\n(no GPU: kernels stubbed, the host's own work only)"
    table += "".join("\n\n" + profile for profile in profiles or ())
    print(table)
    name = "host_overhead" + ("_lora_" + args.lora.replace(",", "_") if args.lora else "") + ("" if ON_GPU else "_cpu")
    write_results(name, rows, table)


if __name__ == "__main__":
    main()

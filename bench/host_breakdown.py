"""Where an operator's host time goes, piece by piece (on a GPU).

    python bench/host_breakdown.py [--m 4096]

For ops a (QKV + RoPE) and b (O-projection + residual + next norm's statistics) of
bench/ops_bench.py at Llama-3-8B widths, the host time (:func:`ops_bench.host_ms`: the GPU
held busy while the host enqueues) of: the forward+backward step as ops_bench times it; the
forward alone with autograd recording, and under no_grad; the operator's own implementation
(the custom op's function, no autograd); each of its GEMMs through codetta.gemm; the Triton
launch alone; torch.mm for scale; and the step replayed from a CUDA graph, where the host
issues nothing, against the op's SOL. Writes bench/results/host_breakdown.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, median_graph_ms, median_ms, require_gpu, write_results  # noqa: E402
from ops_bench import SHAPES, cases, host_ms, sol_ms, timed_step  # noqa: E402

import codetta  # noqa: E402
from codetta.ops import rmsnorm as rmsnorm_ops  # noqa: E402


def graph_rows(name, m):
    """The fwd+bwd step timed as ops_bench times it (host-bound at small M) and replayed from one
    CUDA graph (the GPU's time alone), both over the op's SOL."""
    make, ours, eager, gemms = cases(m, SHAPES["llama3-8b"])[name]
    sol = sol_ms(gemms, True)
    rows = []
    for label, fn in (("codetta", ours), ("eager", eager)):
        step = timed_step(fn, make(), True)
        rows.append({"op": name, "M": m, "variant": label, "sol_ms": sol, "step/SOL": median_ms(step) / sol,
                     "graph replay/SOL": median_graph_ms(step) / sol})
    return rows


def rows_of(name, m):
    make, ours, eager, _ = cases(m, SHAPES["llama3-8b"])[name]
    inputs = make()
    rows = [("fwd+bwd step", timed_step(ours, inputs, True)),
            ("fwd, autograd recording", lambda: ours(*inputs)),
            ("eager fwd+bwd step", timed_step(eager, inputs, True))]

    def no_grad():
        with torch.no_grad():
            ours(*inputs)
    rows.append(("fwd under no_grad", no_grad))
    if name.startswith("b"):
        a, w, r, g = (t.detach() for t in inputs)
        dx = torch.randn_like(r)
        codetta.gemm(a, w.t())  # tuned before it is timed
        codetta.gemm(dx.t(), a)
        rows += [("custom op impl (no autograd)", lambda: rmsnorm_ops._linear_residual_op.impl(a, [w], r, None, g, 1e-6, 1.0)),
                 ("backward math (dgrad + wgrad GEMMs)", lambda: rmsnorm_ops.linear_residual_backward(dx, a, [w])),
                 ("backward op, direct route", lambda: rmsnorm_ops._linear_residual_backward_op(dx, a, [w], [True])),
                 ("codetta.gemm plain [M, d] x [d, d]", lambda: codetta.gemm(a, w.t())),
                 ("codetta.gemm plain wgrad", lambda: codetta.gemm(dx.t(), a)),
                 ("torch.mm same", lambda: torch.mm(a, w.t())),
                 ("autograd: a Function doing x * 1, fwd+bwd", _function_step(a)),
                 ("autograd: a Function whose backward is the backward math", _math_step(a, w, dx))]
    return [{"op": name, "M": m, "what": what, "host_us": 1e3 * host_ms(fn, calls=50)} for what, fn in rows]


class _Times1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, dy):
        return dy * 1


def _function_step(like):
    """The autograd engine's own cost: a Python Function with one small kernel each way."""
    x = torch.randn(8, 8, device=like.device, requires_grad=True)
    dy = torch.ones(8, 8, device=like.device)

    def step():
        x.grad = None
        torch.autograd.backward(_Times1.apply(x), dy)
    return step


class _BackwardMath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, a, w):
        ctx.save_for_backward(a, w)
        return x * 1

    @staticmethod
    def backward(ctx, dy):
        a, w = ctx.saved_tensors
        da, dws = rmsnorm_ops.linear_residual_backward(dy, a, [w])
        return dy, da, dws[0]


def _math_step(a, w, dx):
    """The engine with one Python node whose backward runs op b's backward GEMMs."""
    x = torch.randn_like(dx, requires_grad=True)
    a, w = a.detach().requires_grad_(), w.detach().requires_grad_()

    def step():
        x.grad = a.grad = w.grad = None
        torch.autograd.backward(_BackwardMath.apply(x, a, w), dx)
    return step


def trace(name, m, out):
    """torch.profiler's CPU-side view of ten fwd+bwd steps: time per op and launch, both threads."""
    make, ours, _, _ = cases(m, SHAPES["llama3-8b"])[name]
    step = timed_step(ours, make(), True)
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 28)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            step()
    torch.cuda.synchronize()
    prof.export_chrome_trace(str(out))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--trace", default=None, help="also write a chrome trace of op b's steps to this file")
    args = parser.parse_args()
    require_gpu("host_breakdown")
    if args.trace:
        print(trace("b_oproj_residual_norm", args.m, args.trace))
    graphs = graph_rows("a_qkv_rope", args.m) + graph_rows("b_oproj_residual_norm", args.m)
    rows = rows_of("a_qkv_rope", args.m) + rows_of("b_oproj_residual_norm", args.m)
    table = (markdown_table(rows, ["op", "M", "what", "host_us"]) + "\n\n"
             + markdown_table(graphs, list(graphs[0])))
    print(table)
    write_results("host_breakdown", rows + graphs, table)


if __name__ == "__main__":
    main()

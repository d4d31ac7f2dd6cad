"""Plain GEMM and fused GEMM+epilogue programs against cuBLAS and eager PyTorch (H200).

    python bench/gemm_bench.py [--shapes all|quick|llama1b]

Per shape and layout: cuBLAS (torch.matmul), codetta's plain GEMM, and three fused
programs in the forward layout (row scale; row scale + SwiGLU; residual add + row
sum-of-squares + a second aux output) against their plain GEMM (the speed of light)
and against eager PyTorch doing the same unfused. Writes bench/results/gemm.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codetta  # noqa: E402
from codetta import epilogue as ep  # noqa: E402

from common import markdown_table, median_graph_ms, median_ms, require_gpu, write_results  # noqa: E402

SQUARE = [(s, s, s) for s in (2048, 4096, 8192)]
LLAMA8B = [(16384, 6144, 4096), (16384, 4096, 4096), (16384, 28672, 4096), (16384, 4096, 14336)]
# the layer GEMMs of bench/train_bench.py's Llama-3-1B shape at batch 2 x 4096: QKV, O, gate/up, down
LLAMA1B = [(8192, 3072, 2048), (8192, 2048, 2048), (8192, 16384, 2048), (8192, 2048, 8192)]
SHAPES = {"all": SQUARE + LLAMA8B, "quick": [SQUARE[1], LLAMA8B[2]], "llama1b": LLAMA1B}


def _programs():
    rowscale = ep.Program("bench_rowscale")
    rowscale.store("out", rowscale.acc * rowscale.row("r"))

    swiglu = ep.Program("bench_rowscale_swiglu")
    z = swiglu.acc * swiglu.row("r")
    g, u = ep.pairs(z)
    swiglu.store("z", z)
    swiglu.store("y", ep.silu(g) * u)

    resid = ep.Program("bench_residual_sumsq")
    x = ep.round_to(resid.acc + resid.aux("res"), torch.bfloat16)
    resid.store("x", x)
    resid.store("u", x * resid.col("gamma"))
    resid.row_sumsq("ss", x)
    return rowscale, swiglu, resid


def _eager(kind, a, w, ops):
    if kind == "rowscale":
        return lambda: torch.matmul(a, w.t()) * ops["r"][:, None]
    if kind == "swiglu":
        def f():
            z = torch.matmul(a, w.t()) * ops["r"][:, None]
            g, u = z.view(z.shape[0], -1, 2).unbind(-1)
            return z, F.silu(g) * u
        return f

    def f():
        x = torch.matmul(a, w.t()) + ops["res"]
        return x, x * ops["gamma"], x.float().square().sum(-1)
    return f


def _plan(*args, **kwargs):
    plan = codetta.explain(*args, **kwargs)
    c = plan["config"]
    return {"path": plan["path"],
            "config": f"{c.BM}x{c.BN}x{c.BK} s{c.STAGES} w{c.num_warps} e{c.EPI_SPLIT}"}


def layouts(m, n, k, dtype):
    """(name, a, b) of the three GEMMs of training a Linear with x [M, K] and W [N, K].

    fwd: y = x W^T ([M, N], reduce K); dgrad: dx = dy W ([M, K], reduce N);
    wgrad: dW = dy^T x ([N, K], reduce M). All three cost 2 M N K flops.
    """
    dev = "cuda"
    x = torch.randn(m, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    dy = torch.randn(m, n, device=dev, dtype=dtype)
    return [("fwd", x, w.t()), ("dgrad", dy, w), ("wgrad", dy.t(), x)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", choices=SHAPES, default="all",
                        help="all: square and Llama-3-8B; quick: one of each; llama1b: the training benchmark's layers")
    args = parser.parse_args()
    require_gpu("gemm_bench")
    dtype = torch.bfloat16
    shapes = SHAPES[args.shapes]
    programs = dict(zip(("rowscale", "swiglu", "residual_sumsq"), _programs()))
    rows = []
    for m, n, k in shapes:
        flops = 2 * m * n * k
        for name, a, b in layouts(m, n, k, dtype):
            t_cublas = median_ms(lambda: torch.matmul(a, b))
            t_plain = median_ms(lambda: codetta.gemm(a, b))
            g_plain = median_graph_ms(lambda: codetta.gemm(a, b))
            g_cublas = median_graph_ms(lambda: torch.matmul(a, b))
            err = (codetta.gemm(a, b).float() - torch.matmul(a, b).float()).norm() / torch.matmul(a, b).float().norm()
            rows.append(dict(shape=f"{m}x{n}x{k}", layout=name, op="plain", ms=t_plain, cublas_ms=t_cublas,
                             tflops=flops / t_plain / 1e9, vs_cublas=t_cublas / t_plain, graph_vs_cublas=g_cublas / g_plain,
                             rel_err=err.item(),
                             **_plan(a, b)))
            print(rows[-1], flush=True)
            _save(rows, args.shapes)
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        ops = {"r": torch.rand(m, device="cuda") + 0.5, "res": torch.randn(m, n, device="cuda", dtype=dtype),
               "gamma": torch.rand(n, device="cuda", dtype=dtype)}
        t_plain = median_ms(lambda: codetta.gemm(a, w.t()))
        g_plain = median_graph_ms(lambda: codetta.gemm(a, w.t()))
        t_cublas = median_ms(lambda: torch.matmul(a, w.t()))
        for kind, prog in programs.items():
            needed = {o: ops[o] for o in prog.operands}
            t_fused = median_ms(lambda: codetta.gemm(a, w.t(), prog, **needed))
            g_fused = median_graph_ms(lambda: codetta.gemm(a, w.t(), prog, **needed))
            t_eager = median_ms(_eager(kind.split("_")[0], a, w, ops))
            rows.append(dict(shape=f"{m}x{n}x{k}", layout="fwd", op=kind, ms=t_fused, cublas_ms=t_cublas,
                             tflops=flops / t_fused / 1e9, vs_plain=t_fused / t_plain, graph_vs_plain=g_fused / g_plain, eager_ms=t_eager,
                             eager_vs_fused=t_eager / t_fused, **_plan(a, w.t(), prog, **needed)))
            print(rows[-1], flush=True)
            _save(rows, args.shapes)
    print(_save(rows, args.shapes))


COLUMNS = ["shape", "layout", "op", "ms", "cublas_ms", "tflops", "vs_cublas", "graph_vs_cublas", "vs_plain",
            "graph_vs_plain", "eager_ms", "eager_vs_fused",
            "rel_err", "path", "config"]


def _summary(rows):
    """The issue's targets: plain GEMM throughput vs cuBLAS (median per layout), fused time vs plain."""
    lines = ["", "| summary (GPU time, CUDA graphs) | value |", "|---|---|"]
    for layout in ("fwd", "dgrad", "wgrad"):
        vals = sorted(r["graph_vs_cublas"] for r in rows if r["op"] == "plain" and r["layout"] == layout)
        if vals:
            lines.append(f"| plain {layout}: median throughput vs cuBLAS | {vals[len(vals) // 2]:.3f} |")
    for op in ("rowscale", "swiglu", "residual_sumsq"):
        vals = [r["graph_vs_plain"] for r in rows if r["op"] == op]
        if vals:
            lines.append(f"| {op}: time vs plain GEMM, worst / median | {max(vals):.3f} / {sorted(vals)[len(vals) // 2]:.3f} |")
    return "\n".join(lines)


def _save(rows, shapes):
    """Write what is measured so far (a run cut short still leaves its rows)."""
    table = markdown_table(rows, COLUMNS) + "\n" + _summary(rows)
    write_results("gemm" + ("" if shapes == "all" else f"_{shapes}"), rows, table)
    return table


if __name__ == "__main__":
    main()

"""Where an op's time goes: each piece of the forward and backward timed alone (H200).

    python bench/ops_breakdown.py

Llama-3-8B shapes (M = 16384 tokens, d = 4096). GPU time of each piece replayed from a
CUDA graph (no host overhead), against the cuBLAS GEMM of the same shape (the speed of
light). Pieces: the plain codetta GEMM with one B and with B in parts; each op's fused
epilogue GEMM; and the memory-bound kernels and torch passes around the GEMMs (RMSNorm
statistics, RoPE tables and backward, the weight stacking copies, SwiGLU backward (as a
kernel, or in the down projection's dgrad epilogue), the cross-entropy softmax gradient). Writes bench/results/ops_breakdown.{md,json}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codetta  # noqa: E402
from codetta.kernels.rope import rotate  # noqa: E402
from codetta.kernels.softmax_grad import softmax_grad_  # noqa: E402
from codetta.kernels.swiglu import swiglu_backward  # noqa: E402
from codetta.ops import rmsnorm, rope, swiglu  # noqa: E402
from codetta.kernels.rmsnorm import (rmsnorm as rmsnorm_rows, rmsnorm_backward, rmsnorm_stats,  # noqa: E402
                                     rstd_of_partial_sums)

from common import markdown_table, median_graph_ms, require_gpu, write_results  # noqa: E402

M, D, F, HQ, HKV, HD, VOCAB, CE_ROWS = 16384, 4096, 14336, 32, 8, 128, 128256, 4096


def _bf16(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


def pieces():
    """name -> (function to time, cuBLAS baseline or None, bytes moved by a memory-bound piece or None)."""
    x, g = _bf16(M, D), _bf16(D).add_(1)
    wq, wk, wv = _bf16(HQ * HD, D, scale=D**-0.5), _bf16(HKV * HD, D, scale=D**-0.5), _bf16(HKV * HD, D, scale=D**-0.5)
    wqkv = torch.cat([wq, wk, wv])
    wg, wu = _bf16(F, D, scale=D**-0.5), _bf16(F, D, scale=D**-0.5)
    wgu = torch.stack((wg, wu), 1).reshape(2 * F, D)
    u, rstd = rmsnorm_stats(x, g, 1e-5)
    pos = torch.arange(M, device="cuda") % 8192
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device="cuda").float() / HD))
    cos, sin = rope.rope_tables(pos, inv_freq, 1.0)
    rotated = rope._rotated_pairs(HQ, HKV, HD, HD, x.device)
    qkv_n = (HQ + 2 * HKV) * HD
    dqkv, qkv = _bf16(M, qkv_n), _bf16(M, qkv_n)
    dy, z, y_out = _bf16(M, F), _bf16(M, 2 * F), _bf16(M, F)
    logits = _bf16(CE_ROWS, VOCAB, scale=3.0)
    lse = torch.logsumexp(logits.float(), -1)
    target = torch.randint(0, VOCAB, (CE_ROWS,), device="cuda")
    scale = torch.full((CE_ROWS,), 1.0 / CE_ROWS, device="cuda")
    rope_prog, swiglu_prog = rope._forward_program(HD, False), swiglu._forward_program(False, "silu")
    norm_bwd = rmsnorm._consumer_backward()
    z_out = torch.empty(M, 2 * F, device="cuda", dtype=torch.bfloat16)

    def cublas(n, k):
        a, w = _bf16(M, k), _bf16(n, k)
        return lambda: a @ w.t()

    def cublas_dgrad(n, k):  # dx [M, k] = dz [M, n] W [n, k]
        dz, w = _bf16(M, n), _bf16(n, k)
        return lambda: dz @ w

    dx2, wd = _bf16(M, D), _bf16(D, F, scale=F**-0.5)
    attn, wo, y = _bf16(M, D), _bf16(D, D, scale=D**-0.5), _bf16(M, F)
    producer = rmsnorm._producer(torch.bfloat16, True, False)
    rstd_finish = {"sumsq": lambda part: rstd_of_partial_sums(part, D, 1e-5)}

    return {
        "qkv: codetta plain GEMM, one B": (lambda: codetta.gemm(u, wqkv.t()), cublas(qkv_n, D), None),
        "qkv: codetta plain GEMM, B in 3 parts": (lambda: codetta.gemm(u, [wq.t(), wk.t(), wv.t()]), cublas(qkv_n, D), None),
        "qkv: RoPE epilogue GEMM, 3 parts": (
            lambda: codetta.gemm(u, [wq.t(), wk.t(), wv.t()], rope_prog, rstd=rstd, cos=cos, sin=sin, rotated=rotated),
            cublas(qkv_n, D), None),
        "qkv: RoPE epilogue GEMM, one B (W_qkv stacked)": (
            lambda: codetta.gemm(u, wqkv.t(), rope_prog, rstd=rstd, cos=cos, sin=sin, rotated=rotated),
            cublas(qkv_n, D), None),
        "qkv: W_q, W_k, W_v stacking copy": (lambda: torch.cat([wq, wk, wv]), None, 2 * qkv_n * D * 2),
        "qkv dgrad: norm-backward epilogue GEMM, W in 3 parts": (
            lambda: codetta.gemm(dqkv, [wq, wk, wv], norm_bwd, rstd=rstd, norm_weight=g, x=x, zdz=rstd, inv_d=1.0 / D),
            cublas_dgrad(qkv_n, D), None),
        "gate/up dgrad: norm-backward epilogue GEMM, W in 2 parts": (
            lambda: codetta.gemm(z, [wg, wu], norm_bwd, rstd=rstd, norm_weight=g, x=x, zdz=rstd, inv_d=1.0 / D),
            cublas_dgrad(2 * F, D), None),
        "rmsnorm stats (u, rstd)": (lambda: rmsnorm_stats(x, g, 1e-5), None, 2 * M * D * 2),
        "rmsnorm (h, rstd; the CE's norm)": (lambda: rmsnorm_rows(x, g, 1e-5), None, 2 * M * D * 2),
        "rmsnorm backward (dx fp32, dg; the CE's norm)": (lambda: rmsnorm_backward(x, g, rstd, x), None, 8 * M * D),
        "rope tables (fp64 angles)": (lambda: rope.rope_tables(pos, inv_freq, 1.0), None, 2 * M * HD // 2 * 4),
        "rope backward kernel": (lambda: rotate(dqkv, qkv, cos, sin, n_rotated=(HQ + HKV) * HD, head_dim=HD),
                                 None, 3 * M * qkv_n * 2),
        "rope backward kernel, interleaved pairs": (
            lambda: rotate(dqkv, qkv, cos, sin, n_rotated=(HQ + HKV) * HD, head_dim=HD, interleaved=True),
            None, 3 * M * qkv_n * 2),
        "gate/up: weight interleave copy": (lambda: torch.stack((wg, wu), 1).reshape(2 * F, D), None, 4 * F * D * 2),
        "gate/up: SwiGLU epilogue GEMM, stacked B": (
            lambda: codetta.gemm(u, wgu.t(), swiglu_prog, rstd=rstd, out={"z_gate": z_out[:, :F], "z_up": z_out[:, F:]}),
            cublas(2 * F, D), None),
        "gate/up: SwiGLU epilogue GEMM, interleave()": (
            lambda: codetta.gemm(u, codetta.interleave(wg.t(), wu.t()), swiglu_prog, rstd=rstd,
                                 out={"z_gate": z_out[:, :F], "z_up": z_out[:, F:]}),
            cublas(2 * F, D), None),
        "swiglu backward kernel": (lambda: swiglu_backward(dy, z), None, 5 * M * F * 2),
        "swiglu backward kernel, recomputing y (swiglu_mlp)": (lambda: swiglu_backward(dy, z, y_out=y_out), None,
                                                              6 * M * F * 2),
        "O-proj: residual + norm-producer epilogue GEMM (linear_residual)": (
            lambda: codetta.gemm(attn, wo.t(), producer, residual=x, norm_weight=g, finish=rstd_finish),
            cublas(D, D), None),
        "down: residual + norm-producer epilogue GEMM (linear_residual)": (
            lambda: codetta.gemm(y, wd.t(), producer, residual=x, norm_weight=g, finish=rstd_finish),
            cublas(D, F), None),
        "down dgrad: plain GEMM (dy for the kernel above)": (lambda: codetta.gemm(dx2, wd), cublas_dgrad(D, F), None),
        "CE softmax gradient (4096 x 128256, in place)": (lambda: softmax_grad_(logits, lse, target, scale), None,
                                                          2 * CE_ROWS * VOCAB * 2),
    }


def main():
    require_gpu("ops_breakdown")
    rows = []
    for name, (fn, base, nbytes) in pieces().items():
        fn()  # compile, tune
        torch.cuda.synchronize()
        ms = median_graph_ms(fn)
        row = {"piece": name, "ms": ms}
        if base is not None:
            row["cuBLAS ms"] = median_graph_ms(base)
            row["time / cuBLAS"] = ms / row["cuBLAS ms"]
        if nbytes is not None:
            row["GB/s"] = nbytes / ms / 1e6
        rows.append(row)
        print(row, flush=True)
    columns = ["piece", "ms", "cuBLAS ms", "time / cuBLAS", "GB/s"]
    write_results("ops_breakdown", rows, markdown_table(rows, columns))
    print(markdown_table(rows, columns))


if __name__ == "__main__":
    main()

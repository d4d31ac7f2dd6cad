"""RMSNorm statistics in one pass over x, for a norm with no producer GEMM before it.

    u = x ⊙col g   (in x's dtype),   rstd_i = rsqrt(mean_j x_ij^2 + eps)   (fp32)

The GEMM after the norm reads u and scales its rows by rstd (:mod:`codetta.ops.rmsnorm`).
Each program takes BM rows and walks their d columns in blocks of BD: it stores each block
of u and adds its squares to an fp32 row sum, so x is read once and u written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..matmul.launch import interpreting
from ..matmul.mainloop import cast
from .launch import launch

GPU_BLOCK = (8, 512, 4)  # (rows, columns per step, warps)
INTERPRET_BLOCK = (16, 32, 1)


@triton.jit
def _rmsnorm_stats_kernel(x_ptr, g_ptr, u_ptr, rstd_ptr, M, D, x_s0, u_s0, eps,
                          BM: tl.constexpr, BD: tl.constexpr, EMULATE_RNE: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    sumsq = tl.zeros((BM,), dtype=tl.float32)
    for start in range(0, D, BD):
        cols = start + tl.arange(0, BD)
        col_ok = cols < D
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows64 * x_s0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
        tl.store(u_ptr + rows64 * u_s0 + cols[None, :], cast(x * g[None, :], u_ptr.dtype.element_ty, EMULATE_RNE),
                 mask=mask)
    tl.store(rstd_ptr + rows, tl.rsqrt(sumsq / D + eps), mask=row_ok)


def rmsnorm_stats(x: Tensor, norm_weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(u [M, d] in x's dtype, rstd [M] fp32) of x [..., d] (leading dims flattened)."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    u = torch.empty(m, d, device=x.device, dtype=x.dtype)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    if m and d:
        bm, bd, warps = INTERPRET_BLOCK if interpreting() else GPU_BLOCK
        launch(_rmsnorm_stats_kernel, (triton.cdiv(m, bm),),
            x2, norm_weight, u, rstd, m, d, x2.stride(0), u.stride(0), float(eps),
            BM=bm, BD=bd, EMULATE_RNE=interpreting(), num_warps=warps,
        )
    return u, rstd

"""RMSNorm row kernels (their statistics in fp32):

* ``rmsnorm_stats``: for a norm whose GEMM folds it (no producer GEMM before it)

      u = x ⊙col g   (in x's dtype or the GEMM's),   rstd_i = rsqrt(mean_j x_ij^2 + eps)   (fp32)

  the GEMM after the norm reads u and scales its rows by rstd (:mod:`codetta.ops.rmsnorm`);
* ``rmsnorm``: h = x ⊙row rstd ⊙col g computed in fp32 and rounded once to x's dtype, and
  rstd (for the LM head's cross-entropy, whose dW GEMM reads h);
* ``rmsnorm_backward``: given dh, with xhat = x ⊙row rstd and dxhat = dh ⊙col g,

      dx = rstd ⊙row (dxhat - xhat ⊙row mean_j(dxhat_ij xhat_ij)),   dg = sum_i dh_i ⊙ xhat_i

  dx in fp32 or x's dtype (rounded once), dg fp32 from per-program partial column sums
  summed after in a fixed order.

Each program takes BM rows and walks their d columns in blocks of BD; where a row's
statistic is needed before its outputs (rmsnorm, rmsnorm_backward), a first walk computes
it and a second one writes (the rows' second read mostly hits L2). Column strides of x
must be 1 (rows may have any stride); a strided norm weight is made contiguous.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..interpreter import interpreting
from ..matmul.mainloop import cast
from .launch import cdiv, launch, with_contiguous_columns

GPU_BLOCK = (8, 512, 4)  # (rows, columns per step, warps)
# the backward holds more values per element: half the tile (sm_90, local Triton 3.9: 109
# registers, no spill; 32 x 128 spilled 192 bytes per thread)
GPU_BACKWARD_BLOCK = (8, 256, 4)
INTERPRET_BLOCK = (16, 32, 1)


@triton.jit
def _columns(start, row_ok, D, BD: tl.constexpr):
    """(cols, col_ok, mask) of the column block at ``start`` for rows whose ``row_ok`` holds."""
    cols = start + tl.arange(0, BD)
    col_ok = cols < D
    return cols, col_ok, row_ok[:, None] & col_ok[None, :]


@triton.jit
def _tile(ptr, rows64, stride, cols, mask):
    """A [BM, BD] block of a tensor with unit column stride, in fp32 (0 outside ``mask``)."""
    return tl.load(ptr + rows64 * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rmsnorm_rows_kernel(x_ptr, g_ptr, out_ptr, rstd_ptr, M, D, x_s0, out_s0, eps,
                         BM: tl.constexpr, BD: tl.constexpr, NORMALIZE: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """NORMALIZE: out = x r g after the walk that finds r; else out = x g in the same walk."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    out_ty = out_ptr.dtype.element_ty
    sumsq = tl.zeros((BM,), dtype=tl.float32)
    for start in range(0, D, BD):
        cols, col_ok, mask = _columns(start, row_ok, D, BD)
        x = _tile(x_ptr, rows64, x_s0, cols, mask)
        sumsq += tl.sum(x * x, axis=1)
        if not NORMALIZE:
            g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows64 * out_s0 + cols[None, :], cast(x * g[None, :], out_ty, EMULATE_RNE), mask=mask)
    rstd = tl.rsqrt(sumsq / D + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    if NORMALIZE:
        for start in range(0, D, BD):
            cols, col_ok, mask = _columns(start, row_ok, D, BD)
            x = _tile(x_ptr, rows64, x_s0, cols, mask)
            g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows64 * out_s0 + cols[None, :],
                     cast(x * rstd[:, None] * g[None, :], out_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _rmsnorm_backward_kernel(x_ptr, g_ptr, rstd_ptr, dh_ptr, dx_ptr, dg_part_ptr, M, D, x_s0, dh_s0, dx_s0,
                             BM: tl.constexpr, BD: tl.constexpr, EMULATE_RNE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    r = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
    dot = tl.zeros((BM,), dtype=tl.float32)
    for start in range(0, D, BD):
        cols, col_ok, mask = _columns(start, row_ok, D, BD)
        g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dxhat = _tile(dh_ptr, rows64, dh_s0, cols, mask) * g[None, :]
        dot += tl.sum(dxhat * (_tile(x_ptr, rows64, x_s0, cols, mask) * r), axis=1)
    mean = (dot / D)[:, None]
    for start in range(0, D, BD):
        cols, col_ok, mask = _columns(start, row_ok, D, BD)
        g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        xhat = _tile(x_ptr, rows64, x_s0, cols, mask) * r
        dh = _tile(dh_ptr, rows64, dh_s0, cols, mask)
        dx = r * (dh * g[None, :] - xhat * mean)
        tl.store(dx_ptr + rows64 * dx_s0 + cols[None, :], cast(dx, dx_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)
        tl.store(dg_part_ptr + pid.to(tl.int64) * D + cols, tl.sum(dh * xhat, axis=0), mask=col_ok)


@triton.jit
def _rstd_of_partials_kernel(part_ptr, rstd_ptr, M, T, D, eps, BM: tl.constexpr, BT: tl.constexpr):
    """rstd_i = rsqrt(sum_t part_it / D + eps) of contiguous partial sums of squares part [M, T]."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    sumsq = tl.zeros((BM,), dtype=tl.float32)
    for start in range(0, T, BT):
        cols, _, mask = _columns(start, row_ok, T, BT)
        sumsq += tl.sum(_tile(part_ptr, rows64, T, cols, mask), axis=1)
    tl.store(rstd_ptr + rows, tl.rsqrt(sumsq / D + eps), mask=row_ok)


def rstd_of_partial_sums(part: Tensor, d: int, eps: float) -> Tensor:
    """rstd [M] fp32 = rsqrt(sum_j x_ij^2 / d + eps) from the per-tile partial sums of squares
    part [M, T] (fp32, contiguous) that a GEMM epilogue's ``row_sumsq`` wrote: the reduction's
    finishing step and the norm's statistic in one launch (``codetta.gemm(..., finish=...)``)."""
    m, t = part.shape
    if d == 0:
        return _rstd_of_no_columns(m, part.device)
    rstd = torch.empty(m, device=part.device, dtype=torch.float32)
    if m:
        bm, bt, warps = (16, 8, 1) if interpreting() else (128, 32, 4)
        launch(_rstd_of_partials_kernel, (cdiv(m, bm),), part, rstd, m, t, d, float(eps),
               BM=bm, BT=bt, num_warps=warps)
    return rstd


def _rstd_of_no_columns(m: int, device) -> Tensor:
    """rstd of rows without columns (d = 0), whose norm is empty: 0, so that a GEMM's row scale
    by it gives the 0 of its empty sum (not NaN, as the mean of no squares would make)."""
    return torch.zeros(m, device=device, dtype=torch.float32)


def _rows(x: Tensor) -> Tensor:
    """x [..., d] as [M, d] with contiguous columns (M the product of the leading dims, also for d = 0)."""
    return with_contiguous_columns(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]))


def _block(gpu_block=GPU_BLOCK):
    return INTERPRET_BLOCK if interpreting() else gpu_block


def _rows_pass(x: Tensor, norm_weight: Tensor, eps: float, normalize: bool, dtype=None) -> tuple[Tensor, Tensor]:
    x2 = _rows(x)
    m, d = x2.shape
    out = torch.empty(m, d, device=x.device, dtype=dtype or x.dtype)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32) if d else _rstd_of_no_columns(m, x.device)
    if m and d:
        bm, bd, warps = _block()
        launch(_rmsnorm_rows_kernel, (cdiv(m, bm),),
            x2, norm_weight.contiguous(), out, rstd, m, d, x2.stride(0), out.stride(0), float(eps),
            BM=bm, BD=bd, NORMALIZE=normalize, EMULATE_RNE=interpreting(), num_warps=warps,
        )
    return out, rstd


def rmsnorm_stats(x: Tensor, norm_weight: Tensor, eps: float, dtype: Optional[torch.dtype] = None
                  ) -> tuple[Tensor, Tensor]:
    """(u [M, d] in ``dtype`` (default x's), rstd [M] fp32) of x [..., d] (leading dims flattened).
    u is computed in fp32 and rounded once: with an fp32 x and a bf16 ``dtype``, u is what
    autocast hands the next GEMM (the fp32 norm output cast to bf16)."""
    return _rows_pass(x, norm_weight, eps, normalize=False, dtype=dtype)


def rmsnorm(x: Tensor, norm_weight: Tensor, eps: float, dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(h [M, d] in ``dtype`` (default x's), rstd [M] fp32) of x [..., d]: h = x rstd g in fp32,
    rounded once."""
    return _rows_pass(x, norm_weight, eps, normalize=True, dtype=dtype)


def rmsnorm_backward(x: Tensor, norm_weight: Tensor, rstd: Tensor, dh: Tensor, *,
                     dx_out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(dx, dg fp32 [d]) of h = RMSNorm(x) given dh and rstd [M] (see the module doc).

    dx is written into ``dx_out`` ([M, d], contiguous columns, any float dtype) when given,
    else into a new fp32 tensor.
    """
    x2, dh2 = _rows(x), _rows(dh)
    m, d = x2.shape
    if dh2.shape != (m, d) or rstd.shape != (m,) or norm_weight.shape != (d,):
        raise ValueError(f"rmsnorm_backward: x {tuple(x2.shape)}, dh {tuple(dh2.shape)}, rstd {tuple(rstd.shape)} "
                         f"and norm_weight {tuple(norm_weight.shape)} do not match")
    if dx_out is None:
        dx_out = torch.empty(m, d, device=x.device, dtype=torch.float32)
    elif dx_out.shape != (m, d) or dx_out.stride(-1) != 1:
        raise ValueError(f"rmsnorm_backward: dx_out must be [{m}, {d}] with contiguous columns, "
                         f"got {tuple(dx_out.shape)} strides {dx_out.stride()}")
    if not (m and d):
        return dx_out.zero_(), torch.zeros(d, device=x.device, dtype=torch.float32)
    bm, bd, warps = _block(GPU_BACKWARD_BLOCK)
    grid = cdiv(m, bm)
    dg_part = torch.empty(grid, d, device=x.device, dtype=torch.float32)
    launch(_rmsnorm_backward_kernel, (grid,),
        x2, norm_weight.contiguous(), rstd.contiguous(), dh2, dx_out, dg_part, m, d,
        x2.stride(0), dh2.stride(0), dx_out.stride(0),
        BM=bm, BD=bd, EMULATE_RNE=interpreting(), num_warps=warps,
    )
    return dx_out, dg_part.sum(0)

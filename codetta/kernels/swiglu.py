"""Gated-MLP backward in one memory-bound kernel, with the row dot product the norm backward needs.

With z = [z_g | z_u] ([M, 2F]: gate block then up block, as the forward of
:func:`codetta.ops.rmsnorm_swiglu` stores it), y = act(z_g) * z_u and dy [M, F], everything
in fp32:

    dz_g = dy * z_u * act'(z_g),   dz_u = dy * act(z_g)
    zdz_i = sum_k z_ik dz_ik  over the 2F columns (fp32)

for the activations of :mod:`codetta.ops.activations` (s = sigmoid(.), Phi = the normal CDF):

    silu       act = g s(g)                     act' = s (1 + g (1 - s))
    gelu_tanh  act = g s(2a), a = sqrt(2/pi) (g + 0.044715 g^3)      [= 0.5 g (1 + tanh a)]
               act' = s + g s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 g^2)
    gelu       act = g Phi(g)                   act' = Phi(g) + g exp(-g^2 / 2) / sqrt(2 pi)
    relu       act = max(g, 0)                  act' = 1 where g > 0, else 0 (as torch)

dz is stored in z's dtype, rounded to nearest even. zdz is taken from dz *after* that
rounding (each stored value read back as fp32): it is then exactly the row dot product of
the z and dz that the next GEMM (dL/dh = dz W) consumes, as eager PyTorch would compute it
from the stored tensors. In fp32 the two are the same.

One pass: each program reads a [BM, BF] tile of dy and the matching tiles of z_g and z_u,
writes those of dz_g and dz_u and one fp32 partial row sum per row into a [M, T] buffer
(T column blocks of F); the partials are summed after in torch, in a fixed order
(deterministic, no atomics). Offsets are int64 (M * 2F may exceed 2^31); rows may have
any stride, columns must be contiguous.

Optionally the same pass also writes y = act(z_g) * z_u (rounded to z's dtype) from the
tiles it has read: one [M, F] write that lets a caller recompute the activation instead of
keeping it from the forward (:func:`codetta.ops.swiglu_mlp` needs y only for dW_down, in
this same backward). Computed from the stored z, it is the y eager PyTorch computes from
its stored gate and up projections.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..interpreter import interpreting
from ..matmul.mainloop import cast
from ..ops.activations import check_activation
from .finish import row_sum
from .launch import launch

# [rows, columns of F] per program and warps: on a GPU 2K elements of each tile per program,
# 8 per thread (sm_90, local Triton 3.9: 64 registers, 80 with y; 32 x 256 took 255 and
# spilled 128 bytes per thread, 440 with y, at 8 warps per SM; 32 x 256 ran at 3.6 TB/s on the
# H200, this one at 3.8, 3.7 with y: ops_breakdown, code fc0ee00); in the interpreter, which pays per operation and per
# program, small tiles keep the tests fast.
GPU_BLOCK = (8, 256, 8)
INTERPRET_BLOCK = (16, 64, 1)


@triton.jit
def _activation_and_slope(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)) in fp32 (the module doc's table)."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu_tanh":
        s = tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))  # 2 sqrt(2/pi) = 1.5957...
        return g * s, s + g * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * g * g)
    elif ACTIVATION == "gelu":
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327  # 1 / sqrt(2 pi)
    else:
        tl.static_assert(ACTIVATION == "relu")
        positive = g > 0.0
        return tl.where(positive, g, 0.0), tl.where(positive, 1.0, 0.0)


@triton.jit
def _swiglu_backward_kernel(
    dy_ptr, z_ptr, dz_ptr, part_ptr, y_ptr, M, F,
    dy_s0, z_s0, dz_s0, part_s0, y_s0,
    BM: tl.constexpr, BF: tl.constexpr, ACTIVATION: tl.constexpr, STORE_Y: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_f = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_f * BF + tl.arange(0, BF)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)[None, :]

    dy = tl.load(dy_ptr + rows64[:, None] * dy_s0 + cols64, mask=mask, other=0.0).to(tl.float32)
    z_row = z_ptr + rows64[:, None] * z_s0
    g = tl.load(z_row + cols64, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(z_row + F + cols64, mask=mask, other=0.0).to(tl.float32)

    act, slope = _activation_and_slope(g, ACTIVATION)
    dg = dy * u * slope
    du = dy * act

    dg_st = cast(dg, dz_ptr.dtype.element_ty, EMULATE_RNE)
    du_st = cast(du, dz_ptr.dtype.element_ty, EMULATE_RNE)
    dz_row = dz_ptr + rows64[:, None] * dz_s0
    tl.store(dz_row + cols64, dg_st, mask=mask)
    tl.store(dz_row + F + cols64, du_st, mask=mask)
    if STORE_Y:
        y = cast(act * u, y_ptr.dtype.element_ty, EMULATE_RNE)
        tl.store(y_ptr + rows64[:, None] * y_s0 + cols64, y, mask=mask)

    # masked lanes hold g = u = 0, so they add nothing
    part = tl.sum(g * dg_st.to(tl.float32) + u * du_st.to(tl.float32), axis=1)
    tl.store(part_ptr + rows64 * part_s0 + pid_f, part, mask=row_ok)


def _rows_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def swiglu_backward(dy: Tensor, z: Tensor, *, activation: str = "silu", out: Optional[Tensor] = None,
                    y_out: Optional[Tensor] = None, block: Optional[tuple[int, int, int]] = None) -> tuple[Tensor, Tensor]:
    """(dz, zdz) of y = act(z_g) * z_u given dy; see the module doc for the math.

    Args:
        dy: [M, F]; z: [M, 2F] = [z_g | z_u] in the same dtype as dy. Any row strides.
        activation: act, one of :data:`codetta.ops.activations.GATE_ACTIVATIONS` (SiLU: SwiGLU).
        out: optional [M, 2F] tensor of z's dtype with contiguous columns to write dz into
            (it may be a view of a larger tensor: nothing outside it is written).
        y_out: optional [M, F] tensor of z's dtype with contiguous columns: the pass also
            writes y = act(z_g) * z_u into it.
        block: optional (rows, columns, num_warps) per program; by default one that suits
            a GPU, or a small one under Triton's interpreter.
    Returns:
        dz [M, 2F] in z's dtype and zdz [M] fp32 (from dz as stored).
    """
    if dy.dim() != 2 or z.dim() != 2 or z.shape != (dy.shape[0], 2 * dy.shape[1]):
        raise ValueError(f"need dy [M, F] and z [M, 2F], got {tuple(dy.shape)} and {tuple(z.shape)}")
    if dy.dtype != z.dtype or dy.device != z.device:
        raise ValueError(f"dy ({dy.dtype}, {dy.device}) and z ({z.dtype}, {z.device}) differ")
    m, f = dy.shape
    out = z.new_empty(m, 2 * f) if out is None else out
    for name, t, shape in (("out", out, (m, 2 * f)), ("y_out", y_out, (m, f))):
        if t is not None and (t.shape != shape or t.dtype != z.dtype or t.device != z.device or t.stride(-1) != 1):
            raise ValueError(f"{name} must be [{shape[0]}, {shape[1]}] {z.dtype} on {z.device} with contiguous "
                             f"columns, got {tuple(t.shape)} {t.dtype} {t.device} strides {t.stride()}")
    if m == 0 or f == 0:
        return out, torch.zeros(m, device=z.device, dtype=torch.float32)
    bm, bf, warps = block or (INTERPRET_BLOCK if interpreting() else GPU_BLOCK)
    dy, z = _rows_contiguous(dy), _rows_contiguous(z)
    grid = (triton.cdiv(m, bm), triton.cdiv(f, bf))
    part = torch.empty(m, grid[1], device=z.device, dtype=torch.float32)
    y = out if y_out is None else y_out  # not written without y_out
    launch(_swiglu_backward_kernel, grid,
        dy, z, out, part, y, m, f, dy.stride(0), z.stride(0), out.stride(0), part.stride(0), y.stride(0),
        BM=bm, BF=bf, ACTIVATION=check_activation(activation), STORE_Y=y_out is not None,
        EMULATE_RNE=interpreting(), num_warps=warps,
    )
    return out, row_sum(part)

"""Gated-MLP activation in one memory-bound kernel each way, with the row dot product the norm backward needs.

With gate and up [M, F] (z = [z_g | z_u], [M, 2F]: gate block then up block, as the forward
of :func:`codetta.ops.rmsnorm_swiglu` stores it; or two tensors, the outputs of projections
no GEMM of codetta runs: :func:`codetta.ops.gated_activation`), y = act(z_g) * z_u and dy
[M, F], everything in fp32:

    dz_g = dy * z_u * act'(z_g),   dz_u = dy * act(z_g)
    zdz_i = sum_k z_ik dz_ik  over the 2F columns (fp32; only where a norm backward needs it)

for the activations of :mod:`codetta.ops.activations` (s = sigmoid(.), Phi = the normal CDF):

    silu       act = g s(g)                     act' = s (1 + g (1 - s))
    gelu_tanh  act = g s(2a), a = sqrt(2/pi) (g + 0.044715 g^3)      [= 0.5 g (1 + tanh a)]
               act' = s + g s (1 - s) 2 sqrt(2/pi) (1 + 3 * 0.044715 g^2)
    gelu       act = g Phi(g)                   act' = Phi(g) + g exp(-g^2 / 2) / sqrt(2 pi)
    relu       act = max(g, 0)                  act' = 1 where g > 0, else 0 (as torch)

y and dz are stored in z's dtype, rounded to nearest even. zdz is taken from dz *after* that
rounding (each stored value read back as fp32): it is then exactly the row dot product of
the z and dz that the next GEMM (dL/dh = dz W) consumes, as eager PyTorch would compute it
from the stored tensors. In fp32 the two are the same.

One pass each way: each program reads a [BM, BF] tile of z_g and z_u (and dy), writes that
of y (or those of dz_g and dz_u, and one fp32 partial row sum per row into a [M, T] buffer,
T column blocks of F; the partials are summed after in torch, in a fixed order:
deterministic, no atomics). Offsets are int64 (M * 2F may exceed 2^31); rows may have any
stride, columns must be contiguous.

Optionally the backward pass also writes y = act(z_g) * z_u (rounded to z's dtype) from the
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
from ..matmul.mainloop import cast, times_gradient
from ..ops.activations import check_activation
from .finish import row_sum
from .launch import cdiv, launch, with_contiguous_columns

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
        off = g <= 0.0  # not for NaN, which stays NaN and passes its gradient, as in PyTorch
        return tl.where(off, 0.0, g), tl.where(off, 0.0, 1.0)


@triton.jit
def _gated_activation_kernel(g_ptr, u_ptr, y_ptr, M, F, g_s0, u_s0, y_s0,
                             BM: tl.constexpr, BF: tl.constexpr, ACTIVATION: tl.constexpr, EMULATE_RNE: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = (tl.program_id(1) * BF + tl.arange(0, BF)).to(tl.int64)[None, :]
    mask = (rows < M)[:, None] & (cols < F)
    rows64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + rows64 * g_s0 + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows64 * u_s0 + cols, mask=mask, other=0.0).to(tl.float32)
    act, _ = _activation_and_slope(g, ACTIVATION)
    tl.store(y_ptr + rows64 * y_s0 + cols, cast(act * u, y_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, part_ptr, y_ptr, M, F,
    dy_s0, g_s0, u_s0, dg_s0, du_s0, part_s0, y_s0,
    BM: tl.constexpr, BF: tl.constexpr, ACTIVATION: tl.constexpr, ROW_DOT: tl.constexpr, STORE_Y: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_f = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_f * BF + tl.arange(0, BF)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    cols64 = cols.to(tl.int64)[None, :]

    dy = tl.load(dy_ptr + rows64 * dy_s0 + cols64, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows64 * g_s0 + cols64, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows64 * u_s0 + cols64, mask=mask, other=0.0).to(tl.float32)

    act, slope = _activation_and_slope(g, ACTIVATION)
    if ACTIVATION == "relu":  # an off gate selects 0, as PyTorch's ReLU backward does (a NaN dy there gives no NaN)
        dg = tl.where(slope == 0.0, 0.0, dy * u * slope)
    else:  # a product, as PyTorch's SiLU and GELU backward take it: a NaN dy stays NaN where the slope is 0
        dg = dy * u * slope
    dg_st = cast(dg, dg_ptr.dtype.element_ty, EMULATE_RNE)
    du_st = cast(dy * act, du_ptr.dtype.element_ty, EMULATE_RNE)
    tl.store(dg_ptr + rows64 * dg_s0 + cols64, dg_st, mask=mask)
    tl.store(du_ptr + rows64 * du_s0 + cols64, du_st, mask=mask)
    if STORE_Y:
        y = cast(act * u, y_ptr.dtype.element_ty, EMULATE_RNE)
        tl.store(y_ptr + rows64 * y_s0 + cols64, y, mask=mask)
    if ROW_DOT:  # masked lanes hold g = u = 0, so they add nothing
        part = tl.sum(times_gradient(g, dg_st.to(tl.float32)) + times_gradient(u, du_st.to(tl.float32)), axis=1)
        tl.store(part_ptr + rows.to(tl.int64) * part_s0 + pid_f, part, mask=row_ok)


def _check_out(name: str, t: Optional[Tensor], like: Tensor, shape: tuple[int, int]) -> None:
    """A given output: [shape] in like's dtype, on its device, with contiguous columns."""
    if t is not None and (t.shape != shape or t.dtype != like.dtype or t.device != like.device or t.stride(-1) != 1):
        raise ValueError(f"{name} must be [{shape[0]}, {shape[1]}] {like.dtype} on {like.device} with contiguous "
                         f"columns, got {tuple(t.shape)} {t.dtype} {t.device} strides {t.stride()}")


def _grid_and_block(m: int, f: int, block: Optional[tuple[int, int, int]]):
    bm, bf, warps = block or (INTERPRET_BLOCK if interpreting() else GPU_BLOCK)
    return (cdiv(m, bm), cdiv(f, bf)), bm, bf, warps


def gated_activation(gate: Tensor, up: Tensor, *, activation: str = "silu", out: Optional[Tensor] = None,
                     block: Optional[tuple[int, int, int]] = None) -> Tensor:
    """y = act(gate) * up, [M, F] in fp32, rounded once to gate's dtype.

    gate, up: [M, F], one dtype and device, any row strides (columns of one [M, 2F] tensor
    too); out: optional [M, F] tensor of that dtype with contiguous columns to write y into;
    activation and block as :func:`swiglu_backward` takes them.
    """
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"need gate and up [M, F] of one dtype and device, got {gate.dtype} {tuple(gate.shape)} "
                         f"on {gate.device} and {up.dtype} {tuple(up.shape)} on {up.device}")
    m, f = gate.shape
    _check_out("out", out, gate, (m, f))
    out = gate.new_empty(m, f) if out is None else out
    if m == 0 or f == 0:
        return out
    grid, bm, bf, warps = _grid_and_block(m, f, block)
    gate, up = with_contiguous_columns(gate), with_contiguous_columns(up)
    launch(_gated_activation_kernel, grid, gate, up, out, m, f, gate.stride(0), up.stride(0), out.stride(0),
           BM=bm, BF=bf, ACTIVATION=check_activation(activation), EMULATE_RNE=interpreting(), num_warps=warps)
    return out


def gated_activation_backward(dy: Tensor, gate: Tensor, up: Tensor, *, activation: str = "silu",
                              dgate_out: Optional[Tensor] = None, dup_out: Optional[Tensor] = None,
                              y_out: Optional[Tensor] = None, row_dot: bool = False,
                              block: Optional[tuple[int, int, int]] = None):
    """(dgate, dup, zdz) of y = act(gate) * up given dy; see the module doc for the math.

    dy, gate, up: [M, F], one dtype and device, any row strides. dgate_out, dup_out, y_out:
    optional [M, F] tensors of that dtype with contiguous columns to write dgate, dup and y
    (``y_out`` only: the pass then also writes y) into. zdz [M] fp32 with ``row_dot``, else None.
    """
    if dy.dim() != 2 or not dy.shape == gate.shape == up.shape:
        raise ValueError(f"need dy, gate and up [M, F], got {tuple(dy.shape)}, {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if not dy.dtype == gate.dtype == up.dtype or not dy.device == gate.device == up.device:
        raise ValueError(f"dy ({dy.dtype}, {dy.device}), gate ({gate.dtype}, {gate.device}) and up ({up.dtype}, "
                         f"{up.device}) differ")
    m, f = dy.shape
    for name, t in (("dgate_out", dgate_out), ("dup_out", dup_out), ("y_out", y_out)):
        _check_out(name, t, gate, (m, f))
    dgate = gate.new_empty(m, f) if dgate_out is None else dgate_out
    dup = gate.new_empty(m, f) if dup_out is None else dup_out
    if m == 0 or f == 0:
        return dgate, dup, torch.zeros(m, device=gate.device, dtype=torch.float32) if row_dot else None
    grid, bm, bf, warps = _grid_and_block(m, f, block)
    dy, gate, up = (with_contiguous_columns(t) for t in (dy, gate, up))
    part = torch.empty(m, grid[1], device=gate.device, dtype=torch.float32) if row_dot else dgate  # dgate: unused
    y = dgate if y_out is None else y_out  # not written without y_out
    launch(_swiglu_backward_kernel, grid,
        dy, gate, up, dgate, dup, part, y, m, f,
        dy.stride(0), gate.stride(0), up.stride(0), dgate.stride(0), dup.stride(0), part.stride(0), y.stride(0),
        BM=bm, BF=bf, ACTIVATION=check_activation(activation), ROW_DOT=row_dot, STORE_Y=y_out is not None,
        EMULATE_RNE=interpreting(), num_warps=warps,
    )
    return dgate, dup, row_sum(part) if row_dot else None


def swiglu_backward(dy: Tensor, z: Tensor, *, activation: str = "silu", out: Optional[Tensor] = None,
                    y_out: Optional[Tensor] = None, block: Optional[tuple[int, int, int]] = None) -> tuple[Tensor, Tensor]:
    """(dz, zdz) of y = act(z_g) * z_u given dy, with z = [z_g | z_u] as the fused forward stores it
    (:func:`gated_activation_backward` over z's two column blocks); see the module doc for the math.

    Args:
        dy: [M, F]; z: [M, 2F] = [z_g | z_u] in the same dtype as dy. Any row strides.
        activation: act, one of :data:`codetta.ops.activations.GATE_ACTIVATIONS` (SiLU: SwiGLU).
        out: optional [M, 2F] tensor of z's dtype with contiguous columns to write dz into
            (it may be a view of a larger tensor: nothing outside it is written), z itself
            included: each element is read before it is written, by the same program.
        y_out: optional [M, F] tensor of z's dtype with contiguous columns: the pass also
            writes y = act(z_g) * z_u into it.
        block: optional (rows, columns, num_warps) per program; by default one that suits
            a GPU, or a small one under Triton's interpreter.
    Returns:
        dz [M, 2F] in z's dtype and zdz [M] fp32 (from dz as stored).
    """
    if dy.dim() != 2 or z.dim() != 2 or z.shape != (dy.shape[0], 2 * dy.shape[1]):
        raise ValueError(f"need dy [M, F] and z [M, 2F], got {tuple(dy.shape)} and {tuple(z.shape)}")
    m, f = dy.shape
    _check_out("out", out, z, (m, 2 * f))
    out = z.new_empty(m, 2 * f) if out is None else out
    _, _, zdz = gated_activation_backward(dy, z[:, :f], z[:, f:], activation=activation, dgate_out=out[:, :f],
                                          dup_out=out[:, f:], y_out=y_out, row_dot=True, block=block)
    return out, zdz

"""RMSNorm -> gate/up projection -> SwiGLU (or another gated activation) in one GEMM, and its backward.

With h = RMSNorm(x) (see :mod:`codetta.ops.rmsnorm`), W_g, W_u [F, d]:

    z_g = h W_g^T (+ b_g),  z_u = h W_u^T (+ b_u),  y = act(z_g) * z_u

act is SiLU (SwiGLU) by default, or another of :mod:`codetta.ops.activations` (GELU: GeGLU).

Forward: one GEMM reads u = x g against W_g and W_u *row-interleaved*
(``codetta.interleave(W_g^T, W_u^T)``: B column 2j is W_g's row j, column 2j + 1 W_u's, read
without a copy, through one TMA descriptor of both weights: :mod:`codetta.matmul.mainloop`),
so that each (gate, up) pair sits in adjacent columns of a tile, where splitting the pairs is
free (each thread holds adjacent accumulator columns); the epilogue scales rows by r, adds
the biases (where the projections have them: Llama's ``mlp_bias``; read as one interleaved
[2F] column vector, 0 for a missing one), writes y and keeps z = [z_g | z_u] ([M, 2F], gate
block then up block, biases included) for the backward.

Backward, given dy [M, F] (fp32 math; act' as :mod:`codetta.kernels.swiglu` lists it):

    dz_g = dy * z_u * act'(z_g),   dz_u = dy * act(z_g)
    zdz_i = sum_k z_ik dz_ik   (over the 2F columns: the row dot product of the norm backward)

1. one memory-bound kernel (:func:`codetta.kernels.swiglu.swiglu_backward`) reads dy and
   z and writes dz = [dz_g | dz_u] in z's dtype and zdz in fp32 (per-block partial row
   sums, summed after; zdz is taken from dz as stored, i.e. after its rounding); with
   biases z holds z + b, whose zdz would cancel, and the norm's row term is taken from dL/dh
   instead (see :mod:`codetta.ops.rmsnorm`); the biases' gradients are dz's column sums;
2. the norm-backward GEMM of :func:`codetta.ops.rmsnorm.rmsnorm_linear_backward`: dz
   against [W_g; W_u] read as one along K (no copy), with zdz giving the norm's row term,
   then dW_g = dz_g^T h and dW_u = dz_u^T h.

dz is written over z (which nothing reads after) where autograd frees the saved tensors after
the backward (:func:`codetta.ops.autograd.saved_tensors_freed_after`): one [M, 2F] tensor less.

z is stored in the forward rather than recomputed: one [M, 2F] write saves a GEMM.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import epilogue as ep
from ..matmul import gemm, interleave
from ..kernels.swiglu import swiglu_backward
from .rmsnorm import _check_norm_inputs, given_stats, norm_operands, rmsnorm_linear_backward, rstd_like, used_rstd
from .activations import check_activation, eager_activation, epilogue_activation
from .autocast import casts_under_autocast
from .autograd import direct_op, only_first_output_differentiable, saved_tensors_freed_after
from .weight_grads import for_autograd, run_backward, skipping, weight_grads_like
from .shapes import check_biases, concat_biases, dense_tensors_only, rows


@functools.lru_cache(maxsize=None)
def _forward_program(with_bias: bool, activation: str) -> ep.Program:
    p = ep.Program(f"rmsnorm_{activation}_glu" + ("_bias" if with_bias else ""))
    z = p.acc * p.row("rstd")
    gate, up = ep.pairs(z + p.col("bias") if with_bias else z)
    p.store("z_gate", gate)
    p.store("z_up", up)
    p.store("y", epilogue_activation(activation)(gate) * up)
    return p


def _interleaved(blocks: Tensor) -> Tensor:
    """[b_g | b_u] as the forward GEMM's columns: b_g0, b_u0, b_g1, b_u1, ..."""
    return blocks.view(2, -1).t().reshape(-1)


def bias_grad_sums(dz: Tensor, b_gate: Optional[Tensor], b_up: Optional[Tensor]) -> Tensor:
    """dz's column sums in fp32 ([2F]: the gradient of [b_g | b_u]), or an empty tensor without biases."""
    if b_gate is None and b_up is None:
        return dz.new_empty(0, dtype=torch.float32)
    return dz.sum(0, dtype=torch.float32)


def bias_grads(sums: Tensor, b_gate: Optional[Tensor], b_up: Optional[Tensor]) -> list[Optional[Tensor]]:
    """The gradients of the gate and up biases from :func:`bias_grad_sums`, each in its bias's dtype
    (None for a missing bias)."""
    if b_gate is None and b_up is None:
        return [None, None]
    return [None if b is None else s.to(b.dtype) for b, s in zip((b_gate, b_up), sums.view(2, -1))]


def swiglu_forward(x2: Tensor, u: Tensor, rstd: Tensor, w_gate: Tensor, w_up: Tensor, b_gate: Optional[Tensor],
                   b_up: Optional[Tensor], activation: str) -> tuple[Tensor, Tensor]:
    """(y [M, F], z [M, 2F]) of the rows x2 given their norm operands u and rstd (the module doc's forward)."""
    f = w_gate.shape[0]
    z = x2.new_empty(x2.shape[0], 2 * f, dtype=w_gate.dtype)
    biases = concat_biases((b_gate, b_up), (f, f))  # [b_g | b_u], z's column order
    operands = dict(rstd=rstd) if biases is None else dict(rstd=rstd, bias=_interleaved(biases))
    out = gemm(u.reshape(x2.shape), interleave(w_gate.t(), w_up.t()), _forward_program(biases is not None, activation),
               out={"z_gate": z[:, :f], "z_up": z[:, f:]}, **operands)
    return out["y"], z


@direct_op("codetta::rmsnorm_swiglu")
def _rmsnorm_swiglu_op(
    x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, eps: float, u: Optional[Tensor], rstd: Optional[Tensor],
    b_gate: Optional[Tensor], b_up: Optional[Tensor], activation: str,
) -> tuple[Tensor, Tensor, Tensor]:
    x2 = rows(x)
    u, rstd, rstd_out = norm_operands(x2, norm_weight, eps, w_gate.dtype, u, rstd)
    y, z = swiglu_forward(x2, u, rstd, w_gate, w_up, b_gate, b_up, activation)
    return y.reshape(*x.shape[:-1], y.shape[-1]), z, rstd_out


@_rmsnorm_swiglu_op.register_fake
def _(x, norm_weight, w_gate, w_up, eps, u, rstd, b_gate, b_up, activation):
    m, f = x.numel() // x.shape[-1], w_gate.shape[0]
    return (x.new_empty(*x.shape[:-1], f, dtype=w_gate.dtype), x.new_empty(m, 2 * f, dtype=w_gate.dtype),
            rstd_like(x, u, rstd))


def rmsnorm_swiglu_backward(dy, z, x, norm_weight, w_gate, w_up, rstd, b_gate=None, b_up=None, activation="silu",
                            dweights_into=(), dz_over_z=False):
    """(dx, dnorm_weight, the weight gradients of W_gate and W_up as :func:`codetta.ops.weight_grads.weight_grads`
    gives them, the biases' gradient sums of :func:`bias_grad_sums`) given dy (the module doc's steps 1 and 2).
    With ``dz_over_z`` dz is written over z, which is not read after (one [M, 2F] tensor less)."""
    dz, zdz = swiglu_backward(dy.reshape(z.shape[0], z.shape[1] // 2).to(z.dtype), z, activation=activation,
                              out=z if dz_over_z else None)
    if b_gate is not None or b_up is not None:
        zdz = None  # z holds z + b: the row term from dL/dh (codetta.ops.rmsnorm)
    return (*rmsnorm_linear_backward(dz, zdz, x, norm_weight, [w_gate, w_up], rstd, dweights_into),
            bias_grad_sums(dz, b_gate, b_up))


@direct_op("codetta::rmsnorm_swiglu_backward")
def _rmsnorm_swiglu_backward_op(
    dy: Tensor, z: Tensor, x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, rstd: Tensor,
    b_gate: Optional[Tensor], b_up: Optional[Tensor], activation: str, needs: list[bool],
) -> tuple[Tensor, Tensor, list[Tensor], Tensor]:
    return rmsnorm_swiglu_backward(dy, z, x, norm_weight, w_gate, w_up, rstd, b_gate, b_up, activation,
                                   skipping([w_gate, w_up], needs))


@_rmsnorm_swiglu_backward_op.register_fake
def _(dy, z, x, norm_weight, w_gate, w_up, rstd, b_gate, b_up, activation, needs):
    has_bias = b_gate is not None or b_up is not None
    return (x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), weight_grads_like([w_gate, w_up], needs),
            x.new_empty(z.shape[1] if has_bias else 0, dtype=torch.float32))


def _setup(ctx, inputs, output):
    only_first_output_differentiable(ctx, output)
    x, norm_weight, w_gate, w_up, eps, u, rstd, b_gate, b_up, activation = inputs
    _, z, rstd_out = output
    ctx.activation = activation
    ctx.save_for_backward(z, x, norm_weight, w_gate, w_up, used_rstd(u, rstd, rstd_out), b_gate, b_up)


def _backward(ctx, dy, _dz, _drstd):
    z, x, norm_weight, w_gate, w_up, rstd, b_gate, b_up = ctx.saved_tensors
    dx, dg, dws, dbias = run_backward(ctx, [w_gate, w_up], _rmsnorm_swiglu_backward_op, rmsnorm_swiglu_backward,
                                      dy, z, x, norm_weight, w_gate, w_up, rstd, b_gate, b_up, ctx.activation,
                                      weight_args=(2, 3), direct_only=dict(dz_over_z=saved_tensors_freed_after(ctx)))
    return dx, dg, *for_autograd(dws, [w_gate, w_up]), None, None, None, *bias_grads(dbias, b_gate, b_up), None


_rmsnorm_swiglu_op.register_autograd(_backward, setup_context=_setup)


@dense_tensors_only
@casts_under_autocast("w_gate", "w_up", "stats", "bias", streams=("x",))
def rmsnorm_swiglu(x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, eps: float = 1e-6, *, stats=None,
                   bias: tuple | None = None, activation: str = "silu"):
    """``act(h W_g^T + b_g) * (h W_u^T + b_u)`` with h = ``F.rms_norm(x, (d,), norm_weight, eps)``, fused.

    Args:
        x: [..., d]; norm_weight: [d]; w_gate, w_up: [F, d] as nn.Linear stores them.
        stats: optional (u, rstd) from :func:`codetta.ops.linear_residual`.
        bias: optional (b_gate, b_up), each [F] or None (Llama's ``mlp_bias``).
        activation: act: ``"silu"`` (SwiGLU), ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"relu"``
            (:mod:`codetta.ops.activations`).
        x may be fp32 with 16-bit weights (a wider residual stream, :mod:`codetta.ops.rmsnorm`).
    Returns:
        y [..., F] in the weights' dtype.
    """
    _check_norm_inputs(x, norm_weight, {"w_gate": w_gate, "w_up": w_up}, eps)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} differ")
    f = w_gate.shape[0]
    b_gate, b_up = check_biases(bias, ("b_gate", "b_up"), (f, f), x.device)
    u, rstd = given_stats(x, stats, w_gate.dtype, norm_weight, eps)
    return _rmsnorm_swiglu_op(x, norm_weight, w_gate, w_up, float(eps), u, rstd, b_gate, b_up,
                              check_activation(activation))[0]


def rmsnorm_swiglu_reference(x, norm_weight, w_gate, w_up, eps=1e-6, bias=None, activation="silu"):
    """:func:`rmsnorm_swiglu` unfused: act(F.linear(h, W_g, b_g)) * F.linear(h, W_u, b_u), h = F.rms_norm(x)."""
    b_gate, b_up = bias if bias is not None else (None, None)
    h = F.rms_norm(x, (x.shape[-1],), norm_weight, eps)
    return eager_activation(activation)(F.linear(h, w_gate, b_gate)) * F.linear(h, w_up, b_up)

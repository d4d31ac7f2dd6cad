"""RMSNorm -> gate/up projection -> SwiGLU in one GEMM, and its backward.

With h = RMSNorm(x) (see :mod:`codetta.ops.rmsnorm`), W_g, W_u [F, d]:

    z_g = h W_g^T,  z_u = h W_u^T,  y = silu(z_g) * z_u

Forward: one GEMM reads u = x g against W_gu = [W_g; W_u] *row-interleaved* (row 2j is
W_g's row j, row 2j + 1 W_u's), so that each (gate, up) pair sits in adjacent columns of a
tile, where splitting the pairs is free (each thread holds adjacent accumulator columns);
the epilogue scales rows by r, writes y and keeps z = [z_g | z_u] ([M, 2F], gate block then
up block) for the backward. W_gu is a copy made per call (2 F d elements read and written,
about 2% of the GEMM at d = 4096): ``codetta.interleave`` reads the two weights without a
copy, but as two dots of half width per tile, which read each A tile from shared memory
twice; on an H200 that made the whole op 1.22x its GEMM time (an earlier ops_bench run).

Backward, given dy [M, F] (s = sigmoid(z_g), fp32 math):

    dz_g = dy * z_u * s * (1 + z_g (1 - s)),   dz_u = dy * silu(z_g)
    zdz_i = sum_k z_ik dz_ik   (over the 2F columns: the row dot product of the norm backward)

1. one memory-bound kernel (:func:`codetta.kernels.swiglu.swiglu_backward`) reads dy and
   z and writes dz = [dz_g | dz_u] in z's dtype and zdz in fp32 (per-block partial row
   sums, summed after; zdz is taken from dz as stored, i.e. after its rounding);
2. the norm-backward GEMM of :func:`codetta.ops.rmsnorm.rmsnorm_linear_backward`: dz
   against [W_g; W_u] read as one along K (no copy), with zdz giving the norm's row term,
   then dW_g = dz_g^T h and dW_u = dz_u^T h.

z is stored in the forward rather than recomputed: one [M, 2F] write saves a GEMM.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import epilogue as ep
from ..matmul import gemm
from ..kernels.swiglu import swiglu_backward
from .rmsnorm import _check_norm_inputs, given_stats, norm_operands, rmsnorm_linear_backward, rstd_like, used_rstd
from .autocast import casts_under_autocast
from .autograd import direct_op, only_first_output_differentiable
from .weight_grads import for_autograd, run_backward, stacked_like
from .shapes import rows


@functools.lru_cache(maxsize=None)
def _forward_program() -> ep.Program:
    p = ep.Program("rmsnorm_swiglu")
    gate, up = ep.pairs(p.acc * p.row("rstd"))
    p.store("z_gate", gate)
    p.store("z_up", up)
    p.store("y", ep.silu(gate) * up)
    return p


@direct_op("codetta::rmsnorm_swiglu")
def _rmsnorm_swiglu_op(
    x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, eps: float, u: Optional[Tensor], rstd: Optional[Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    d, f = x.shape[-1], w_gate.shape[0]
    x2 = rows(x)
    u, rstd, rstd_out = norm_operands(x2, norm_weight, eps, w_gate.dtype, u, rstd)
    z = x.new_empty(x2.shape[0], 2 * f, dtype=w_gate.dtype)
    w_gate_up = torch.stack((w_gate, w_up), dim=1).reshape(2 * f, d)  # rows g0, u0, g1, u1, ...
    out = gemm(u.reshape(x2.shape), w_gate_up.t(), _forward_program(), rstd=rstd,
               out={"z_gate": z[:, :f], "z_up": z[:, f:]})
    return out["y"].reshape(*x.shape[:-1], f), z, rstd_out


@_rmsnorm_swiglu_op.register_fake
def _(x, norm_weight, w_gate, w_up, eps, u, rstd):
    m, f = x.numel() // x.shape[-1], w_gate.shape[0]
    return (x.new_empty(*x.shape[:-1], f, dtype=w_gate.dtype), x.new_empty(m, 2 * f, dtype=w_gate.dtype),
            rstd_like(x, u, rstd))


def rmsnorm_swiglu_backward(dy, z, x, norm_weight, w_gate, w_up, rstd, dweights_into=()):
    """(dx, dnorm_weight, the weight gradients of W_gate and W_up as :func:`codetta.ops.weight_grads.weight_grads`
    gives them) given dy (the module doc's steps 1 and 2)."""
    dz, zdz = swiglu_backward(dy.reshape(z.shape[0], z.shape[1] // 2).to(z.dtype), z)
    return rmsnorm_linear_backward(dz, zdz, x, norm_weight, [w_gate, w_up], rstd, dweights_into)


@direct_op("codetta::rmsnorm_swiglu_backward")
def _rmsnorm_swiglu_backward_op(
    dy: Tensor, z: Tensor, x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, list[Tensor]]:
    return rmsnorm_swiglu_backward(dy, z, x, norm_weight, w_gate, w_up, rstd)


@_rmsnorm_swiglu_backward_op.register_fake
def _(dy, z, x, norm_weight, w_gate, w_up, rstd):
    return torch.empty_like(x), torch.empty_like(norm_weight), stacked_like([w_gate, w_up])


def _setup(ctx, inputs, output):
    only_first_output_differentiable(ctx, output)
    x, norm_weight, w_gate, w_up, eps, u, rstd = inputs
    _, z, rstd_out = output
    ctx.save_for_backward(z, x, norm_weight, w_gate, w_up, used_rstd(u, rstd, rstd_out))


def _backward(ctx, dy, _dz, _drstd):
    z, x, norm_weight, w_gate, w_up, rstd = ctx.saved_tensors
    dx, dg, dws = run_backward(ctx, [w_gate, w_up], _rmsnorm_swiglu_backward_op, rmsnorm_swiglu_backward,
                                    dy, z, x, norm_weight, w_gate, w_up, rstd)
    return dx, dg, *for_autograd(dws, [w_gate, w_up]), None, None, None


_rmsnorm_swiglu_op.register_autograd(_backward, setup_context=_setup)


@casts_under_autocast("w_gate", "w_up", "stats", streams=("x",))
def rmsnorm_swiglu(x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, eps: float = 1e-6, *, stats=None):
    """``silu(h W_g^T) * (h W_u^T)`` with h = ``F.rms_norm(x, (d,), norm_weight, eps)``, fused.

    Args:
        x: [..., d]; norm_weight: [d]; w_gate, w_up: [F, d] as nn.Linear stores them.
        stats: optional (u, rstd) from :func:`codetta.ops.linear_residual`.
        x may be fp32 with 16-bit weights (a wider residual stream, :mod:`codetta.ops.rmsnorm`).
    Returns:
        y [..., F] in the weights' dtype.
    """
    _check_norm_inputs(x, norm_weight, [w_gate, w_up], eps)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} differ")
    u, rstd = given_stats(x, stats, w_gate.dtype, norm_weight, eps)
    return _rmsnorm_swiglu_op(x, norm_weight, w_gate, w_up, float(eps), u, rstd)[0]


def rmsnorm_swiglu_reference(x, norm_weight, w_gate, w_up, eps=1e-6):
    h = F.rms_norm(x, (x.shape[-1],), norm_weight, eps)
    return F.silu(F.linear(h, w_gate)) * F.linear(h, w_up)

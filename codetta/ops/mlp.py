"""The MLP half of a Llama-family block as one operator, residual included.

With h = RMSNorm(x) (:mod:`codetta.ops.rmsnorm`) and W_g, W_u [F, d], W_d [d, F]:

    z = [z_g | z_u] = h [W_g; W_u]^T (+ [b_g | b_u]),   y = act(z_g) * z_u,   x2 = y W_d^T (+ b_d) + x

(act SiLU, or another of :mod:`codetta.ops.activations`: GELU for GeGLU; the biases where the
projections have them: Llama's ``mlp_bias``; with a branch scale s,
x2 = s (y W_d^T + b_d) + x, and the backward below starts from s dx2 for the branch).

Forward: the SwiGLU GEMM of :func:`codetta.ops.rmsnorm_swiglu`, then the producer GEMM of
:func:`codetta.ops.linear_residual` (which also gives the next norm's statistics of x2).

Backward, given dx2, in three GEMMs and their weight gradients:

1. dy = dx2 W_d (a plain GEMM), then dz = [dz_g | dz_u] and zdz_i = sum_k z_ik dz_ik from
   the SwiGLU-backward kernel of :mod:`codetta.kernels.swiglu`, which also recomputes
   y = act(z_g) * z_u from the z it reads where W_d needs its gradient (not for a frozen
   W_d: one [M, F] tensor less at the backward's peak); dW_d = dx2^T y; db_d = sum over rows of dx2,
   [db_g | db_u] = sum over rows of dz.
   Running the SwiGLU backward in the dgrad's epilogue instead (z_g, z_u read as aux tiles,
   dz stored from the tile) saves one [M, F] write and read of dy, but on the H200 it was
   slower: 3.59 ms against 2.85 + 0.65 ms for GEMM and kernel at M=16384, d=4096, F=14336
   (bench/ops_breakdown.py): reading two aux tiles and storing two while the tensor cores
   idle costs more than the kernel's pass, which runs at 3.6 TB/s.
2. x reaches x2 along two paths, the norm and the residual, so dx = dx2 + (the norm's
   gradient). Written as two operators, autograd adds the two with a separate kernel (a
   read of both and a write, [M, d] each); here the norm-backward GEMM on dz
   (:func:`codetta.ops.rmsnorm.rmsnorm_linear_backward`) reads dx2 as one more tile and
   adds it in its epilogue. Then dW_g = dz_g^T h, dW_u = dz_u^T h.

Only z is kept from the forward, not y: [M, F] less memory per layer (2 GiB over the 16
layers of a Llama-3-1B step at 8192 tokens), for one more [M, F] write in the backward
kernel. y recomputed from the stored z is eager PyTorch's y (its silu(gate) * up reads the
stored projections); the forward's y, which feeds the down GEMM, comes from the unrounded
accumulators, so in bf16 the two may differ by a rounding. dz is written over z, its last
read, where autograd frees the saved tensors after the backward (not with ``retain_graph``,
nor under torch.compile: :func:`codetta.ops.autograd.saved_tensors_freed_after`): one [M, 2F]
tensor less at the backward's peak. The saved z that ``grad_fn.saved_tensors`` or a
saved-tensors hook shows then holds dz after the backward; and as autograd's own docs warn
against, threads backpropagating through one graph, some with ``retain_graph`` and some
without, are not supported.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..kernels.swiglu import swiglu_backward
from ..matmul import gemm
from .activations import check_activation
from .autocast import casts_under_autocast
from .autograd import direct_op, only_first_output_differentiable, saved_tensors_freed_after
from .rmsnorm import (NormStats, _check_norm_inputs, _linear_residual_op, _weight_k, check_eps, detached,
                      finite_real, given_stats, rmsnorm_linear_backward, rstd_like, scaled, used_rstd)
from .swiglu import _rmsnorm_swiglu_op, bias_grad_sums, bias_grads, rmsnorm_swiglu_reference
from .weight_grads import for_autograd, run_backward, skipping, weight_grad, weight_grads_like
from .shapes import check_biases, check_vector, dense_tensors_only, rows


@direct_op("codetta::swiglu_mlp")
def _mlp_op(
    x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, eps: float, u: Optional[Tensor],
    rstd: Optional[Tensor], next_norm_weight: Optional[Tensor], next_eps: float, b_gate: Optional[Tensor],
    b_up: Optional[Tensor], b_down: Optional[Tensor], branch_scale: float, activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(x2, u2, rstd2, z, rstd): x2 and its next norm's statistics (empty without
    next_norm_weight), then what the backward keeps."""
    y, z, rstd_out = _rmsnorm_swiglu_op.impl(x, norm_weight, w_gate, w_up, eps, u, rstd, b_gate, b_up, activation)
    x2, u2, rstd2 = _linear_residual_op.impl(y, [w_down], x, b_down, next_norm_weight, next_eps, branch_scale)
    return x2, u2, rstd2, z, rstd_out


@_mlp_op.register_fake
def _(x, norm_weight, w_gate, w_up, w_down, eps, u, rstd, next_norm_weight, next_eps, b_gate, b_up, b_down,
      branch_scale, activation):
    m, f, low = x.numel() // x.shape[-1], w_gate.shape[0], w_gate.dtype
    stats = (x.new_empty(m, x.shape[-1], dtype=low), x.new_empty(m, dtype=torch.float32)) if next_norm_weight is not None \
        else (x.new_empty(0), x.new_empty(0, dtype=torch.float32))
    return x.new_empty(x.shape), *stats, x.new_empty(m, 2 * f, dtype=low), rstd_like(x, u, rstd)


def swiglu_mlp_backward(dx2, x, norm_weight, w_gate, w_up, w_down, z, rstd, b_gate=None, b_up=None, branch_scale=1.0,
                        activation="silu", dweights_into=(), dz_over_z=False):
    """(dx, dnorm_weight, the weight gradients of W_gate and W_up as
    :func:`codetta.ops.weight_grads.weight_grads` gives them, dW_down, the gate and up biases'
    gradient sums of :func:`codetta.ops.swiglu.bias_grad_sums`) given dx2 (the module doc's backward;
    with a branch scale s, the branch's gradient is s dx2, the residual's dx2). With ``dz_over_z``
    dz is written over z, which is not read after (one [M, 2F] tensor less)."""
    into = list(dweights_into) or [None] * 3
    f, d = w_gate.shape
    dx2_2 = rows(scaled(dx2, branch_scale)).to(w_down.dtype).contiguous()  # the branch's gradient as the GEMMs' operand
    frozen_down = into[2] is not None and into[2].numel() == 0  # no dW_d: y, its operand, is not recomputed
    y = None if frozen_down else z.new_empty(z.shape[0], f)
    dz, zdz = swiglu_backward(gemm(dx2_2, _weight_k([w_down])), z, activation=activation, y_out=y,
                              out=z if dz_over_z else None)
    dw_down = dx2_2.new_empty(0) if frozen_down else weight_grad(dx2_2, y, into[2])
    if b_gate is not None or b_up is not None:
        zdz = None  # z holds z + b: the row term from dL/dh (codetta.ops.rmsnorm)
    dx, dg, dws_gate_up = rmsnorm_linear_backward(dz, zdz, x, norm_weight, [w_gate, w_up], rstd, into[:2],
                                                  residual_grad=dx2)
    return dx, dg, dws_gate_up, dw_down, bias_grad_sums(dz, b_gate, b_up)


@direct_op("codetta::swiglu_mlp_backward")
def _mlp_backward_op(
    dx2: Tensor, x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, z: Tensor, rstd: Tensor,
    b_gate: Optional[Tensor], b_up: Optional[Tensor], branch_scale: float, activation: str, needs: list[bool],
) -> tuple[Tensor, Tensor, list[Tensor], Tensor, Tensor]:
    return swiglu_mlp_backward(dx2, x, norm_weight, w_gate, w_up, w_down, z, rstd, b_gate, b_up, branch_scale,
                               activation, skipping([w_gate, w_up, w_down], needs))


@_mlp_backward_op.register_fake
def _(dx2, x, norm_weight, w_gate, w_up, w_down, z, rstd, b_gate, b_up, branch_scale, activation, needs):
    has_bias = b_gate is not None or b_up is not None
    (dw_down,) = weight_grads_like([w_down], needs[2:])
    return (x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), weight_grads_like([w_gate, w_up], needs[:2]), dw_down,
            x.new_empty(z.shape[1] if has_bias else 0, dtype=torch.float32))


def _setup(ctx, inputs, output):
    only_first_output_differentiable(ctx, output)
    x, norm_weight, w_gate, w_up, w_down, _, u, rstd, _, _, b_gate, b_up, b_down, branch_scale, activation = inputs
    *_, z, rstd_out = output
    ctx.has_down_bias, ctx.branch_scale, ctx.activation = b_down is not None, branch_scale, activation
    ctx.save_for_backward(x, norm_weight, w_gate, w_up, w_down, z, used_rstd(u, rstd, rstd_out), b_gate, b_up)


def _backward(ctx, dx2, *_unused):
    x, norm_weight, w_gate, w_up, w_down, z, rstd, b_gate, b_up = ctx.saved_tensors
    grads = run_backward(ctx, [w_gate, w_up, w_down], _mlp_backward_op, swiglu_mlp_backward,
                         dx2, x, norm_weight, w_gate, w_up, w_down, z, rstd, b_gate, b_up, ctx.branch_scale,
                         ctx.activation, weight_args=(2, 3, 4),
                         direct_only=dict(dz_over_z=saved_tensors_freed_after(ctx)))
    dx, dg, dws_gate_up, dw_down, dbias = grads
    db_down = rows(dx2).sum(0) * ctx.branch_scale if ctx.has_down_bias else None
    return (dx, dg, *for_autograd(dws_gate_up, [w_gate, w_up]), *for_autograd([dw_down], [w_down]), *(None,) * 5,
            *bias_grads(dbias, b_gate, b_up), db_down, None, None)


_mlp_op.register_autograd(_backward, setup_context=_setup)


@dense_tensors_only
@casts_under_autocast("w_gate", "w_up", "w_down", "stats", "bias", streams=("x",))
def swiglu_mlp(x: Tensor, norm_weight: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor, eps: float = 1e-6, *,
               stats=None, next_norm_weight: Tensor | None = None, next_eps: float = 1e-6, bias: tuple | None = None,
               branch_scale: float = 1.0, activation: str = "silu"):
    """``x + s ((act(h W_g^T + b_g) * (h W_u^T + b_u)) W_d^T + b_d)`` with h = ``F.rms_norm(x, (d,),
    norm_weight, eps)``, s = ``branch_scale`` (1, or Granite's residual multiplier) and act =
    ``activation``: ``"silu"`` (SwiGLU), ``"gelu"`` (erf), ``"gelu_tanh"`` or ``"relu"``
    (:mod:`codetta.ops.activations`).

    Args:
        x: [..., d]; norm_weight: [d]; w_gate, w_up: [F, d]; w_down: [d, F], as nn.Linear stores them.
        stats: optional (u, rstd) of x from :func:`codetta.ops.linear_residual`.
        next_norm_weight: [d] of the RMSNorm that will consume the output (its epsilon ``next_eps``).
        bias: optional (b_gate [F], b_up [F], b_down [d]), each a tensor or None (Llama's ``mlp_bias``).
        x may be fp32 with 16-bit weights (a wider residual stream, :mod:`codetta.ops.rmsnorm`):
        x2 is then fp32 too.
    Returns:
        x2, or (x2, (u2, rstd2)) with ``next_norm_weight``: the next norm's statistics, as
        :func:`codetta.ops.linear_residual` returns them.
    """
    _check_norm_inputs(x, norm_weight, {"w_gate": w_gate, "w_up": w_up}, eps)
    check_eps(next_eps=next_eps)
    f, d = w_gate.shape
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} differ")
    if w_down.shape != (d, f) or w_down.dtype != w_gate.dtype:
        raise ValueError(f"w_down must be [{d}, {f}] of {w_gate.dtype}, got {tuple(w_down.shape)} {w_down.dtype}")
    if next_norm_weight is not None:
        check_vector("next_norm_weight", next_norm_weight, d, x.device)
    biases = check_biases(bias, ("b_gate", "b_up", "b_down"), (f, f, d), x.device)
    u, rstd = given_stats(x, stats, w_gate.dtype, norm_weight, eps)
    branch_scale = finite_real("branch_scale", branch_scale)
    x2, u2, rstd2, *_ = _mlp_op(x, norm_weight, w_gate, w_up, w_down, float(eps), u, rstd, detached(next_norm_weight),
                                float(next_eps), *biases, branch_scale, check_activation(activation))
    return x2 if next_norm_weight is None else (x2, NormStats.of(u2, rstd2, x2, next_norm_weight, next_eps))


def swiglu_mlp_reference(x, norm_weight, w_gate, w_up, w_down, eps=1e-6, bias=None, branch_scale=1.0,
                         activation="silu"):
    """:func:`swiglu_mlp`'s x + branch_scale * down(act(gate(h)) * up(h)), h = RMSNorm(x), unfused."""
    b_gate, b_up, b_down = bias if bias is not None else (None, None, None)
    y = rmsnorm_swiglu_reference(x, norm_weight, w_gate, w_up, eps, (b_gate, b_up), activation)
    return x + branch_scale * torch.nn.functional.linear(y, w_down, b_down)

"""``codetta.ops.rms_norm``: an RMSNorm that no GEMM absorbs, one row kernel each way.

Where a norm's output is added to the residual stream (Gemma 2's and GLM-4's norms of the
attention's and the MLP's outputs), no GEMM follows it to fold it into: it runs as
:mod:`codetta.kernels.rmsnorm`'s row kernels,

    forward   h = x ⊙row r ⊙col g,   r_i = rsqrt(mean_j x_ij^2 + eps)    (fp32, h rounded once)
    backward  dx = r ⊙row (dxh - xh ⊙row mean_j(dxh_ij xh_ij)),   dg = sum_i dh_i ⊙ xh_i
              with xh = x ⊙row r and dxh = dh ⊙col g                     (fp32, dx rounded once)

instead of eager PyTorch's chain of fp32 elementwise ops (an upcast, a square, a mean, a
rsqrt, two products, a downcast, each a pass over [M, d], and as many backward). g may be
fp32 with a 16-bit x (Gemma's 1 + w, made in fp32). The op is the custom op
``codetta::rms_norm`` (its backward ``codetta::rms_norm_backward``), so torch.compile
traces it without a graph break.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..kernels.rmsnorm import rmsnorm, rmsnorm_backward
from ..matmul import KERNEL_DTYPES, check_device
from .autograd import arguments_needing_grad, direct_op, only_first_output_differentiable
from .rmsnorm import check_eps
from .shapes import dense_tensors_only



@direct_op("codetta::rms_norm")
def _rms_norm_op(x: Tensor, weight: Tensor, eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(h in ``dtype``, rstd fp32 [M])."""
    h, rstd = rmsnorm(x, weight, eps, dtype)
    return h.reshape(x.shape), rstd


@_rms_norm_op.register_fake
def _(x, weight, eps, dtype):
    # math.prod, not torch.Size.numel(), which makes symbolic sizes constants (a graph per shape)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(math.prod(x.shape[:-1]), dtype=torch.float32)


@direct_op("codetta::rms_norm_backward")
def _rms_norm_backward_op(dh: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dg in the weight's)."""
    dx = torch.empty(math.prod(x.shape[:-1]), x.shape[-1], device=x.device, dtype=x.dtype)
    dx, dg = rmsnorm_backward(x, weight, rstd, dh, dx_out=dx)
    return dx.reshape(x.shape), dg.to(weight.dtype)


@_rms_norm_backward_op.register_fake
def _(dh, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, weight, _, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    only_first_output_differentiable(ctx, output)


def _backward(ctx, dh, _drstd):
    x, weight, rstd = ctx.saved_tensors
    need_x, need_weight = arguments_needing_grad(ctx)[:2]
    dx, dg = _rms_norm_backward_op(dh, x, weight, rstd)
    return dx if need_x else None, dg if need_weight else None, None, None


_rms_norm_op.register_autograd(_backward, setup_context=_setup)


@dense_tensors_only
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, dtype: Optional[torch.dtype] = None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, computed in fp32 and rounded once to
    ``dtype`` (default x's); differentiable in x and weight.

    Equals ``F.rms_norm(x.float(), (d,), weight.float(), eps).to(dtype)``. x: [..., d] in fp16,
    bf16 or fp32; weight: [d], in any of those (e.g. Gemma's 1 + w made in fp32, or an fp16 model's
    weight beside x that bf16 autocast made); its gradient comes in its dtype.
    """
    if not isinstance(x, Tensor) or x.dim() < 1 or x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"rms_norm: x must be a tensor [..., d] in {KERNEL_DTYPES}, got "
                         + (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__))
    if not isinstance(weight, Tensor) or weight.shape != x.shape[-1:] or weight.dtype not in KERNEL_DTYPES:
        raise ValueError(f"rms_norm: weight must be a [{x.shape[-1]}] tensor in one of {KERNEL_DTYPES}, got "
                         + (f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, Tensor) else
                            type(weight).__name__))
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device} but x is on {x.device}")
    if dtype is not None and dtype not in KERNEL_DTYPES:
        raise ValueError(f"rms_norm: dtype must be one of {KERNEL_DTYPES}, got {dtype}")
    check_eps("rms_norm: ", eps=eps)
    if not x.is_meta:  # on the meta device the registered op's fake implementation gives the shapes
        check_device(x.device, "x")
    return _rms_norm_op(x, weight, float(eps), dtype or x.dtype)[0]

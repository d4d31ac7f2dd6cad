"""``codetta.linear``: torch.nn.functional.linear as the simplest epilogue program, with autograd.

Forward y = x W^T + b (the bias added in the epilogue); backward dx = dy W (dgrad),
dW = dy^T x (wgrad), db = sum_rows dy (in fp32, rounded once).
"""

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import epilogue as ep
from ..matmul import KERNEL_DTYPES, GemmError, gemm
from .autocast import casts_under_autocast
from .autograd import arguments_needing_grad, direct_op
from .weight_grads import weight_grad

from .shapes import dense_tensors_only, described, rows


@functools.lru_cache(maxsize=None)
def linear_program(with_bias: bool) -> ep.Program:
    """out = acc (+ the column vector bias), stored in the operands' dtype."""
    p = ep.Program("linear_bias" if with_bias else "linear")
    y = p.acc + p.col("bias") if with_bias else p.acc
    p.store("out", y)
    return p


@direct_op("codetta::linear")
def _linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    operands = {} if bias is None else {"bias": bias}
    return gemm(x, weight.t(), linear_program(bias is not None), **operands)["out"]


@_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@direct_op("codetta::linear_backward")
def _linear_backward_op(dy: Tensor, x: Tensor, weight: Tensor, with_bias: bool, need_dx: bool,
                        need_dw: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dW, db), each empty where not needed (no GEMM for a frozen weight or an input
    without gradient; db without a bias)."""
    dy2, x2 = rows(dy), rows(x)
    db = dy2.sum(0, dtype=torch.float32).to(dy.dtype) if with_bias else dy.new_empty(0)
    dx = gemm(dy2, weight).reshape(x.shape) if need_dx else dy.new_empty(0)
    return dx, weight_grad(dy2, x2, None) if need_dw else dy.new_empty(0), db


@_linear_backward_op.register_fake
def _(dy, x, weight, with_bias, need_dx, need_dw):
    return (x.new_empty(x.shape) if need_dx else dy.new_empty(0), weight.new_empty(weight.shape) if need_dw else dy.new_empty(0),
            dy.new_empty(dy.shape[-1] if with_bias else 0))


def _setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.with_bias = bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw = arguments_needing_grad(ctx)[:2]
    dx, dw, db = _linear_backward_op(dy, x, weight, ctx.with_bias, need_dx, need_dw)
    return dx if need_dx else None, dw if need_dw else None, db if ctx.with_bias else None


_linear_op.register_autograd(_backward, setup_context=_setup)


@dense_tensors_only
@casts_under_autocast("x", "weight", "bias")
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """y = x W^T + b, equal to ``torch.nn.functional.linear``, differentiable.

    x: [..., K] (or [K]); weight: [N, K] as nn.Linear stores it; bias: [N] or None.
    """
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise GemmError(f"x must be a tensor [..., K], got {described(x)}")
    if x.dtype not in KERNEL_DTYPES:
        raise GemmError(f"x has dtype {x.dtype}; codetta.linear takes {KERNEL_DTYPES}")
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise GemmError(f"weight must be a 2-d tensor [N, K], got {described(weight)}")
    if weight.dtype != x.dtype or weight.shape[1] != x.shape[-1]:
        raise GemmError(f"weight must be [N, {x.shape[-1]}] (x's last dim) in x's dtype {x.dtype}, got "
                        + described(weight))
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],)
                             or bias.dtype != weight.dtype):
        raise GemmError(f"bias must be a [{weight.shape[0]}] tensor of the weight's dtype {weight.dtype}, got "
                        + described(bias))
    if isinstance(x, Tensor) and x.dim() == 1:
        return _linear_op(x[None], weight, bias)[0]
    return _linear_op(x, weight, bias)

"""``codetta.ops.linear_cross_entropy``: the LM head and the cross-entropy loss, fused.

Math. With h = x, or h = RMSNorm(x) = x ⊙row r ⊙col g, r_i = rsqrt(mean_k x_ik^2 + eps),
the logits are z = h W^T (+ b) ([M, V], fp32 accumulators) and, for every row i whose
target t_i is not ``ignore_index`` (the valid rows, n_valid of them),

    lse_i  = log sum_j exp(z_ij)                         (row_logsumexp in the epilogue)
    zt_i   = sum_j [j == t_i] z_ij                       (row_sum in the epilogue)
    loss_i = lse_i - zt_i                                 (0 for ignored rows)

reduced as "none" (per row), "sum", or "mean" (sum / n_valid: NaN when n_valid = 0, as
in PyTorch). With dloss_i = dL/dloss_i (grad_output / n_valid for "mean", grad_output
for "sum", grad_output_i for "none"; 0 for ignored rows), the gradients are

    dz_ij = (exp(z_ij - lse_i) - [j == t_i]) * dloss_i    (softmax minus one-hot)
    dh = dz W,   dW = dz^T h,   db_j = sum_i dz_ij,
    RMSNorm:  dx = r ⊙row (dxh - xh ⊙row mean_k(dxh ⊙ xh)),  dg = sum_i dh_i ⊙ xh_i,
              with xh = x ⊙row r and dxh = dh ⊙col g.

Design. The rows are processed in chunks of ``chunk_size`` rows, so the [M, V] logits
are never materialized:

* forward, per chunk: one GEMM z = h_c W^T whose epilogue keeps only lse and zt (the
  logits stay on chip). lse [M] (fp32) is saved for the backward.
* backward, per chunk: the logits GEMM again, with an epilogue that stores
  dz_c = (exp(z - lse) - onehot) * dloss in the input dtype (and its column sums, db);
  then dh_c = gemm(dz_c, W) and dW += gemm(dz_c^T, h_c) (an accumulating fp32 store).

That is four GEMMs of M x V x d per training step. Computing the gradients inside the
forward would not save one here: dz is formed in the epilogue of a logits GEMM, which
needs lse before the tile exists, so such a forward also runs the logits GEMM twice.
(Liger runs it once by storing each chunk's logits and applying the softmax in a
separate memory-bound pass; epilogue programs have no such pass, and a prologue on the
A operand of dh = dz W would be needed to save the fourth GEMM.) Recomputing in the
backward saves only lse instead of gradients as large as x and W, does no gradient
work when no backward runs, and takes the per-row grad_output of reduction "none"
without a special case: dloss_i is a row operand of the dz epilogue (saved gradients
could not be rescaled per row for dW and db).

Memory, beyond the inputs and the gradients returned: forward, per chunk, the epilogue's
per-tile partials (3 fp32 [C, ceil(V / BLOCK_N)]) and h_c (RMSNorm); saved, lse [M].
Backward: dz_c [C, V] in the input dtype (and db's per-tile partials), h_c and dh_c [C, d], an fp32 [V, d] accumulator
for dW (it is dW itself for fp32 weights) and fp32 [V] for db. The default C keeps
C * V * 4 bytes <= 2^28 (256 MiB).

RMSNorm runs in plain PyTorch on each chunk, in fp32, rounded once to the input dtype
(as ``F.rms_norm`` does); h_c is recomputed in the backward instead of saved.

Targets: any integer dtype; values outside [0, V) other than ``ignore_index`` raise a
ValueError on the CPU; on a GPU they trigger ``torch._assert_async`` (a device-side
assert, no host synchronization, like PyTorch's own nll_loss), so the error surfaces
asynchronously as a RuntimeError. The epilogue compares column indices with targets in
fp32, exact for V < 2^24 (checked).

The operator is the custom op ``codetta::linear_cross_entropy`` (autograd through
``register_autograd``, its backward the custom op ``codetta::linear_cross_entropy_backward``),
with shape-only fake implementations, so torch.compile traces it without a graph break.
There is no double backward.
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .. import epilogue as ep
from ..matmul import gemm

_REDUCTIONS = ("mean", "sum", "none")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CHUNK_BYTES = 2**28  # the fp32-equivalent size of one chunk of logits (dz)
_MAX_VOCAB = 2**24  # column indices and targets are compared as fp32 in the epilogue


def default_chunk_size(vocab: int) -> int:
    """Rows per chunk so that one chunk of logits takes at most 2^28 bytes in fp32
    (rounded down to a multiple of 128 rows, one GEMM tile, when that many fit)."""
    rows = max(1, _CHUNK_BYTES // (4 * vocab))
    return rows if rows < 128 else rows - rows % 128


# --------------------------------------------------------------------------------------
# Epilogue programs


def _logits(p: ep.Program, bias: bool):
    return p.acc + p.col("bias") if bias else p.acc


def _is_target(p: ep.Program):
    return p.col_index().eq(p.row("target"))


@functools.lru_cache(maxsize=None)
def _loss_program(bias: bool) -> ep.Program:
    """Per row: lse = logsumexp of the logits, target_logit = the logit at the target column."""
    p = ep.Program("lce_loss_bias" if bias else "lce_loss")
    z = _logits(p, bias)
    p.row_logsumexp("lse", z)
    p.row_sum("target_logit", ep.where(_is_target(p), z, 0.0))
    return p


@functools.lru_cache(maxsize=None)
def _dlogits_program(bias: bool, dbias: bool) -> ep.Program:
    """dlogits = (softmax - onehot) * scale, stored in the input dtype; dbias = its column sums."""
    p = ep.Program(f"lce_dlogits{'_bias' if bias else ''}{'_dbias' if dbias else ''}")
    z = _logits(p, bias)
    dz = (ep.exp(z - p.row("lse")) - ep.where(_is_target(p), 1.0, 0.0)) * p.row("scale")
    p.store("dlogits", dz)
    if dbias:
        p.col_sum("dbias", dz)
    return p


@functools.lru_cache(maxsize=None)
def _accumulate_program() -> ep.Program:
    p = ep.Program("lce_dweight")
    p.store("dw", p.acc, dtype=torch.float32, accumulate=True)
    return p


# --------------------------------------------------------------------------------------
# Pieces of the computation


def _chunks(rows: int, chunk_size: int):
    for start in range(0, rows, chunk_size):
        yield slice(start, min(start + chunk_size, rows))


def _rstd(x, eps):
    """fp32 [C, 1]: 1 / sqrt(mean(x^2) + eps) per row."""
    return torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)


def _hidden(x, norm_weight, eps):
    """h = x, or RMSNorm(x) computed in fp32 and rounded once to x's dtype."""
    if norm_weight is None:
        return x
    return (x.float() * _rstd(x, eps) * norm_weight.float()).to(x.dtype)


def _rms_norm_backward(x, norm_weight, eps, dh):
    """(dx in x's dtype, fp32 dg) of h = x ⊙row r ⊙col g, given dh."""
    rstd = _rstd(x, eps)
    xhat = x.float() * rstd
    dh = dh.float()
    dxhat = dh * norm_weight.float()
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dh * xhat).sum(0)


def _bias_operand(bias):
    return {} if bias is None else {"bias": bias}


def _check_target_values(target, vocab, ignore_index):
    """Targets in [0, V) or ignore_index: a ValueError on the CPU, a device-side assert elsewhere."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    message = f"linear_cross_entropy: target values must be in [0, {vocab}) or ignore_index={ignore_index}"
    if target.device.type != "cpu":
        torch._assert_async(~bad.any(), message)
    elif bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{message}; target[{i}] = {int(target[i])} (flattened index)")


def _reduce(losses, valid, reduction):
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / valid.sum() if reduction == "mean" else total


def _row_scale(grad, valid, reduction):
    """dloss_i: fp32 [M], 0 on ignored rows (also for "mean" over no valid row)."""
    if reduction == "mean":
        grad = grad / valid.sum()
    return torch.where(valid, grad.float(), 0.0)


# --------------------------------------------------------------------------------------
# The custom ops (x is [M, d], target [M] int64: linear_cross_entropy flattens them)


@torch.library.custom_op("codetta::linear_cross_entropy", mutates_args=())
def _forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    eps: float,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse [M] fp32)."""
    _check_target_values(target, weight.shape[0], ignore_index)
    rows = x.shape[0]
    lse = torch.empty(rows, device=x.device, dtype=torch.float32)
    target_logit = torch.empty_like(lse)
    program = _loss_program(bias is not None)
    for c in _chunks(rows, chunk_size):
        h = _hidden(x[c], norm_weight, eps)
        gemm(h, weight.t(), program, out={"lse": lse[c], "target_logit": target_logit[c]},
             target=target[c], **_bias_operand(bias))
    valid = target != ignore_index
    losses = torch.where(valid, lse - target_logit, 0.0)
    return _reduce(losses, valid, reduction), lse


@_forward.register_fake
def _forward_fake(x, weight, target, bias, norm_weight, ignore_index, reduction, eps, chunk_size):
    rows = x.shape[0]
    loss = x.new_empty((rows,) if reduction == "none" else (), dtype=torch.float32)
    return loss, x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("codetta::linear_cross_entropy_backward", mutates_args=())
def _backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    lse: torch.Tensor,
    ignore_index: int,
    reduction: str,
    eps: float,
    chunk_size: int,
    need_x: bool,
    need_weight: bool,
    need_bias: bool,
    need_norm_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dnorm_weight); a gradient not asked for is an empty tensor."""
    scale = _row_scale(grad, target != ignore_index, reduction)
    fp32 = {"device": x.device, "dtype": torch.float32}
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype) if need_x else x.new_empty(0)
    dw = torch.zeros(weight.shape, **fp32) if need_weight else None
    db = torch.zeros(weight.shape[0], **fp32) if need_bias else None
    dg = torch.zeros(x.shape[1], **fp32) if need_norm_weight else None
    program = _dlogits_program(bias is not None, need_bias)
    for c in _chunks(x.shape[0], chunk_size):
        h = _hidden(x[c], norm_weight, eps)
        out = gemm(h, weight.t(), program, target=target[c], lse=lse[c], scale=scale[c], **_bias_operand(bias))
        dz = out["dlogits"]
        if need_bias:
            db += out["dbias"]
        if need_weight:
            gemm(dz.t(), h, _accumulate_program(), dw=dw)
        if norm_weight is None and need_x:
            gemm(dz, weight, out={"out": dx[c]})
        elif need_x or need_norm_weight:
            dx_c, dg_c = _rms_norm_backward(x[c], norm_weight, eps, gemm(dz, weight))
            if need_x:
                dx[c] = dx_c
            if need_norm_weight:
                dg += dg_c
    return (
        dx,
        dw.to(weight.dtype) if need_weight else weight.new_empty(0),
        db.to(bias.dtype) if need_bias else x.new_empty(0),
        dg.to(norm_weight.dtype) if need_norm_weight else x.new_empty(0),
    )


@_backward.register_fake
def _backward_fake(grad, x, weight, target, bias, norm_weight, lse, ignore_index, reduction, eps, chunk_size,
                   need_x, need_weight, need_bias, need_norm_weight):
    return (
        x.new_empty(x.shape if need_x else 0),
        weight.new_empty(weight.shape if need_weight else 0),
        x.new_empty(bias.shape if need_bias else 0, dtype=bias.dtype if need_bias else x.dtype),
        x.new_empty(norm_weight.shape if need_norm_weight else 0,
                    dtype=norm_weight.dtype if need_norm_weight else x.dtype),
    )


def _setup_context(ctx, inputs, output):
    x, weight, target, bias, norm_weight, ignore_index, reduction, eps, chunk_size = inputs
    ctx.save_for_backward(x, weight, target, bias, norm_weight, output[1])
    ctx.options = (ignore_index, reduction, eps, chunk_size)
    ctx.mark_non_differentiable(output[1])


def _autograd_backward(ctx, grad_loss, _grad_lse):
    x, weight, target, bias, norm_weight, lse = ctx.saved_tensors
    need_x, need_weight, _, need_bias, need_norm_weight = ctx.needs_input_grad[:5]
    dx, dw, db, dg = _backward(grad_loss, x, weight, target, bias, norm_weight, lse, *ctx.options,
                               need_x, need_weight, need_bias, need_norm_weight)
    return (
        dx if need_x else None,
        dw if need_weight else None,
        None,
        db if need_bias else None,
        dg if need_norm_weight else None,
        None, None, None, None,
    )


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# The public functions


def _check_inputs(x, weight, target, bias, norm_weight, reduction, chunk_size):
    def fail(msg):
        raise ValueError(f"linear_cross_entropy: {msg}")

    for name, t in (("x", x), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in _DTYPES:
        fail(f"x has dtype {x.dtype}; expected one of {_DTYPES}")
    if x.dim() < 1:
        fail("x must be [..., d], got a 0-d tensor")
    for name, t in (("weight", weight), ("target", target), ("bias", bias), ("norm_weight", norm_weight)):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            fail(f"{name} is on {t.device} but x is on {x.device}")
    if weight.dim() != 2:
        fail(f"weight must be 2-d [V, d] (as nn.Linear stores it), got shape {tuple(weight.shape)}")
    vocab, d = weight.shape
    if x.shape[-1] != d:
        fail(f"x is [..., {x.shape[-1]}] but weight is [{vocab}, {d}]: d differs")
    if not 0 < vocab < _MAX_VOCAB:
        fail(f"the vocabulary size must be in [1, 2^24), got {vocab}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        fail(f"target must hold integer class indices, got dtype {target.dtype}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        fail(f"target must have x's leading shape {tuple(x.shape[:-1])}, got {tuple(target.shape)}")
    for name, t, shape in (("weight", weight, (vocab, d)), ("bias", bias, (vocab,)), ("norm_weight", norm_weight, (d,))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            fail(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            fail(f"{name} has dtype {t.dtype} but x has {x.dtype}: cast one so they match")
    if reduction not in _REDUCTIONS:
        fail(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        fail(f"chunk_size must be a positive int or None, got {chunk_size!r}")


def linear_cross_entropy(x, weight, target, *, bias=None, ignore_index=-100, reduction="mean",
                         norm_weight=None, eps=1e-6, chunk_size=None):
    """Cross-entropy of the logits ``h W^T + b``, never materialized for all rows at once.

    Equals ``F.cross_entropy(F.linear(h, weight, bias).float(), target, ignore_index=...,
    reduction=...)`` with h = x, or h = ``F.rms_norm(x, (d,), norm_weight, eps)`` when
    ``norm_weight`` is given (the logits are kept in fp32, not rounded to x's dtype).

    Args:
        x: [..., d] fp32, fp16 or bf16; the leading dims are flattened into rows.
        weight: [V, d], as nn.Linear stores it; bias: [V] or None; norm_weight: [d] or None.
        target: integer class indices of x's leading shape; ``ignore_index`` rows count nothing.
        reduction: "mean" (over the rows not ignored), "sum", or "none" (x's leading shape).
        chunk_size: rows per chunk (default :func:`default_chunk_size`, about 2^26 / V).

    Gradients flow to x, weight, bias and norm_weight; see the module docstring for the
    math, the design and the memory bound.
    """
    _check_inputs(x, weight, target, bias, norm_weight, reduction, chunk_size)
    vocab, d = weight.shape
    chunk = default_chunk_size(vocab) if chunk_size is None else chunk_size
    loss, _ = _forward(x.reshape(-1, d), weight, target.reshape(-1).long(), bias, norm_weight,
                       int(ignore_index), reduction, float(eps), chunk)
    return loss.reshape(target.shape) if reduction == "none" else loss


def linear_cross_entropy_reference(x, weight, target, *, bias=None, ignore_index=-100, reduction="mean",
                                   norm_weight=None, eps=1e-6):
    """The same math in plain PyTorch over whole tensors (materializes the [M, V] logits).

    Logits in fp32 (as codetta's fp32 accumulators), RMSNorm in fp32 rounded once to x's
    dtype; differentiable by autograd. For comparison and debugging.
    """
    _check_inputs(x, weight, target, bias, norm_weight, reduction, None)
    _check_target_values(target.reshape(-1), weight.shape[0], ignore_index)
    h = _hidden(x, norm_weight, eps).float()
    z = F.linear(h, weight.float(), None if bias is None else bias.float())
    valid = target != ignore_index
    picked = z.gather(-1, torch.where(valid, target, 0).long().unsqueeze(-1)).squeeze(-1)
    losses = torch.where(valid, torch.logsumexp(z, -1) - picked, 0.0)
    return _reduce(losses, valid, reduction)

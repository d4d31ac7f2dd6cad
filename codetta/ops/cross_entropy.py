"""``codetta.ops.linear_cross_entropy``: the LM head and the cross-entropy loss, fused.

Math. With h = x, or h = RMSNorm(x) = x ⊙row r ⊙col g, r_i = rsqrt(mean_k x_ik^2 + eps),
the logits are z = h W^T (+ b) ([M, V], fp32 accumulators) and, for every row i whose
target t_i is not ``ignore_index`` (the valid rows, n_valid of them),

    lse_i  = log sum_j exp(z_ij) = m_i + log s_i         (row_logsumexp in the epilogue, m_i the row max)
    zt_i   = sum_j [j == t_i] z_ij                       (row_sum in the epilogue)
    loss_i = (m_i - zt_i) + log s_i                       (0 for ignored rows)

(m_i and log s_i are kept apart, as eager's log_softmax keeps (z - max) - log sum: a row whose
target wins by so much that its loss is under lse_i's fp32 spacing keeps its loss and 1 - p.)

reduced as "none" (per row), "sum", or "mean" (sum / n_valid: NaN when n_valid = 0, as
in PyTorch). With a logit soft cap s (Gemma 2's ``final_logit_softcapping``) the loss reads
the capped logits zc = s tanh(z / s) in z's place everywhere below, and the gradient of the
uncapped ones is dz = dzc (1 - tanh(z / s)^2). Optionally, with label smoothing e (PyTorch's ``label_smoothing``) and a
z-loss coefficient c (PaLM's auxiliary loss, pulling lse towards 0):

    zs_i   = sum_j z_ij                                   (row_sum in the epilogue, when e > 0)
    loss_i = lse_i - (1 - e) zt_i - (e / V) zs_i + c lse_i^2

With dloss_i = dL/dloss_i (grad_output / n_valid for "mean", grad_output
for "sum", grad_output_i for "none"; 0 for ignored rows), the gradients are

    dz_ij = (p_ij (1 + 2 c lse_i) - (1 - e) [j == t_i] - e / V) * dloss_i,  p_ij = exp((z_ij - m_i) - log s_i)

(softmax minus one-hot when e = c = 0), and
    dh = dz W,   dW = dz^T h,   db_j = sum_i dz_ij,
    RMSNorm:  dx = r ⊙row (dxh - xh ⊙row mean_k(dxh ⊙ xh)),  dg = sum_i dh_i ⊙ xh_i,
              with xh = x ⊙row r and dxh = dh ⊙col g.

Design. The rows are processed in chunks of ``chunk_size`` rows (C), so the [M, V]
logits exist one chunk at a time. Per chunk (``_chunked``):

1. GEMM z_c = h_c W^T (+ b). When gradients are computed it stores z_c, rounded to the
   input dtype, into one [C, V] buffer reused by every chunk, and one memory-bound pass
   over that buffer (``codetta.kernels.logsumexp.row_stats``) gives lse's parts and zt
   (the loss). Otherwise its epilogue computes them from the accumulators and stores
   nothing. A soft cap is applied where the logits are read (in fp32: by both passes over
   the stored z, which also keeps tanh(z / s) for dz exact where it saturates, and by the
   epilogue). (In the epilogue of a GEMM whose logits are stored anyway they cost more: on
   the H200 the logits GEMM with them took 1.03-1.10x a plain GEMM plus the pass at
   8192 x 128256 x d = 2048, 4096, and up to 1.17x with another tuning draw; the pass
   reads the bf16 logits at ~3.5 TB/s: bench/results/ce_logits_probe.md.)
2. ``softmax_grad_`` (codetta.kernels.softmax_grad) turns that buffer into dz_c in place,
   in fp32 arithmetic, stored in the input dtype (db += its column sums, when needed);
3. GEMM dh_c = dz_c W, then the RMSNorm backward (dx_c, dg) when norm_weight is given;
4. GEMM dW (+)= dz_c^T h_c: the first chunk writes, the others add (an accumulating store).

When the logits are stored, lse and zt are taken from the stored (rounded) logits, so
that loss and gradients are exactly eager PyTorch's math (``F.linear`` in bf16, then
``.float()``): the softmax of the stored logits sums to one in each row. (An lse of the
unrounded accumulators made the gradients' errors up to ~2.8x eager's in bf16 tests.)
Otherwise (inference, and the "none" recompute) both come from the fp32 accumulators.

When a backward will be needed (grad mode on, an input requires grad) and the reduction
is "mean" or "sum", the forward runs all of it, Liger-style: three GEMMs of M x V x d per
training step. It returns the gradients for grad_output = 1; the backward multiplies
them by grad_output, a scalar, in place (nothing when it is 1, decided on the GPU by
``kernels/scale.py``: no host synchronization).
Those saved gradients are consumed by the backward: a second backward through the same
graph (``retain_graph=True``) raises.
Otherwise the forward runs step 1 alone, storing nothing (inference, evaluation), and
reduction "none" recomputes in the backward (its per-row grad_output could not be
applied to gradients summed over rows): the forward keeps only its inputs and the
backward runs steps 1-4 with dloss_i as the row scale, four GEMMs in all.

In fp16, whose range is narrow, the forward's dz is not scaled by 1 / n_valid for "mean":
dz_ij = p_ij - [j == t_i] is stored (values a softmax has), dW is accumulated in fp32,
and dx, dW, db, dg are multiplied by 1 / n_valid in fp32 at the end; dW stays fp32 (like
dx, db, dg) until the backward has multiplied it by grad_output, the loss scale, and
rounds it once (rounded to fp16 before, small weight gradients were flushed to zero). Scaled first, the
small probabilities of a large batch fell below fp16's range before a loss scale
(GradScaler's grad_output) could lift them: with 8192 counted tokens the gradients'
errors were 7x eager's. bf16 has fp32's exponent range and keeps the scaled dz.

Memory, beyond the inputs and the gradients returned: the [C, V] logits / dz buffer in
the input dtype (rows padded to 16 bytes), the per-block partials of lse's parts and zt
(3 fp32 [C, ceil(V / 4096)], 4 with label smoothing), h_c and dh_c [C, d]; with several
chunks, an fp32 [V, d] accumulator for dW, cast to the weight's dtype at the end (with one
chunk dW is written directly in the weight's dtype); fp32 [V] for db. The default C keeps
the buffer at C * V * itemsize <= 2^30 bytes (1 GiB): 4096 rows at V = 128256 in bf16; or
takes all M rows when their logits need no more memory than such a chunk plus the fp32 dW
accumulator (M <= C + 4d / itemsize: 8192 rows at d = 2048 or 4096), which also saves dW's
read-modify-write per chunk. A frozen weight (no dW) keeps the buffer at 2^28 bytes: 1024
rows. The gradients computed in the forward live until the backward.

The RMSNorm of each chunk, forward and backward, is one row kernel each
(:mod:`codetta.kernels.rmsnorm`): h in fp32 rounded once to the input dtype, and dx, dg
from dh = dz W in fp32 (about 11 fp32 passes over [C, d] as separate torch ops before).

Targets: any integer dtype; values outside [0, V) other than ``ignore_index`` raise a
ValueError on the CPU; on a GPU they trigger ``torch._assert_async`` (a device-side
assert, no host synchronization, like PyTorch's own nll_loss), so the error surfaces
asynchronously as a RuntimeError. The epilogue compares column indices with targets in
fp32, exact for V < 2^24 (checked).

The operator is the custom op ``codetta::linear_cross_entropy`` (autograd through
``register_autograd``; its backward the custom ops ``codetta::linear_cross_entropy_scale_``
and ``codetta::linear_cross_entropy_backward``), with shape-only fake implementations, so
torch.compile traces it without a graph break. There is no double backward.
"""

import functools
import math
import numbers
from typing import Optional

import torch
import torch.nn.functional as F

from .. import epilogue as ep
from ..kernels.finish import row_max_and_log_sum
from ..kernels.logsumexp import row_stats
from ..kernels.rmsnorm import rmsnorm, rmsnorm_backward
from ..kernels.scale import scale_unless_one_
from ..kernels.softmax_grad import softmax_grad_
from ..matmul import KERNEL_DTYPES, gemm
from .rmsnorm import check_eps, rms_rstd
from .autocast import casts_under_autocast
from .autograd import (only_first_output_differentiable, refuse_batched_gradients, refuse_double_backward,
                       refuse_unsupported_autodiff)
from .linear import linear_program
from .weight_grads import weight_grad_program
from . import shapes

_REDUCTIONS = ("mean", "sum", "none")
_CHUNK_BYTES = 2**30  # one chunk of logits (dz) in the input dtype
_MAX_VOCAB = 2**24  # column indices and targets are compared as fp32 in the epilogue


def default_chunk_size(vocab: int, dtype: torch.dtype = torch.bfloat16, *, rows: int = 0, d: int = 0,
                       weight_grad: bool = True) -> int:
    """Rows per chunk so that one chunk of logits takes at most 2^30 bytes (1 GiB) in ``dtype``,
    2^28 where the weight needs no gradient (rounded down to a multiple of 128 rows, one GEMM
    tile, when that many fit): 4096 rows at V = 128256 in bf16 (1024 for a frozen weight),
    2048 in fp32.

    Given the problem's ``rows`` and width ``d``, when the weight needs a gradient
    (``weight_grad``): all rows in one chunk when their logits take no more than a chunk
    plus the fp32 [V, d] dW accumulator that several chunks need (e.g. 8192 rows at
    V = 128256, d = 4096: 2.1 GB instead of 1.1 + 2.1 GB); one chunk also writes dW once,
    in the weight's dtype. A frozen weight (LoRA, a tied embedding not trained) has no
    accumulator to read and write per chunk, and smaller chunks cost no time: 8192 rows at
    V = 128256, d = 2048 took 14.4 ms forward and backward in chunks of 2048 rows (0.54 GiB),
    14.5 ms in 4096 (1.05 GiB), 15.4 ms in one (2.07 GiB) on the H200
    (bench/results/ce_chunk_probe_h200.log). Below that they cost time: 1024 rows took 15.6
    ms against 2048's 14.5 on an H100 (0.5 ms more of a LoRA step's forward, where the loss's
    chunk of logits is what the step's peak holds on top of the activations: 246 MiB less
    peak with 1024 rows, bench/results/lora_ce_chunk_h100.log); 512 rows took 19.4 ms.
    """
    budget = _CHUNK_BYTES if weight_grad else _CHUNK_BYTES // 4
    chunk = max(1, budget // (dtype.itemsize * vocab))
    chunk = chunk if chunk < 128 else chunk - chunk % 128
    if weight_grad and chunk < rows and rows * dtype.itemsize <= chunk * dtype.itemsize + 4 * d:
        return rows
    return chunk


# --------------------------------------------------------------------------------------
# Epilogue programs


def _logits(p: ep.Program, bias: bool, capped: bool = False):
    """The logits z (+ b), soft-capped as s tanh(z / s) where ``capped`` (s: the scalar "softcap")."""
    z = p.acc + p.col("bias") if bias else p.acc
    return ep.tanh(z / p.scalar("softcap")) * p.scalar("softcap") if capped else z


def _is_target(p: ep.Program):
    return p.col_index().eq(p.row("target"))


@functools.lru_cache(maxsize=None)
def _loss_program(bias: bool, logit_sum: bool = False, capped: bool = False) -> ep.Program:
    """Per row, from the fp32 accumulators (nothing stored): lse = logsumexp of the logits (as its
    parts), target_logit = the logit at the target column, and with ``logit_sum`` the sum of the
    row's logits (label smoothing); the logits soft-capped where ``capped``."""
    p = ep.Program(f"lce_loss{'_bias' if bias else ''}{'_sum' if logit_sum else ''}{'_capped' if capped else ''}")
    z = _logits(p, bias, capped)
    p.row_logsumexp("lse", z)
    p.row_sum("target_logit", ep.where(_is_target(p), z, 0.0))
    if logit_sum:
        p.row_sum("logit_sum", z)
    return p


@functools.lru_cache(maxsize=None)
def _fp32_program() -> ep.Program:
    p = ep.Program("lce_fp32_out")
    p.store("out", p.acc, dtype=torch.float32)
    return p


# --------------------------------------------------------------------------------------
# Pieces of the computation


def _chunks(rows: int, chunk_size: int):
    for start in range(0, rows, chunk_size):
        yield slice(start, min(start + chunk_size, rows))


def _hidden(x, norm_weight, eps, dtype):
    """(h, rstd): h = x (rstd None), or RMSNorm(x) computed in fp32 and rounded once to the
    GEMM's ``dtype`` (one pass of :func:`codetta.kernels.rmsnorm.rmsnorm`), with its fp32 [C] rstd."""
    return (x, None) if norm_weight is None else rmsnorm(x, norm_weight, eps, dtype)


def _logit_operands(bias, softcap):
    """The loss program's operands beside the target: the bias, the soft cap, where there are."""
    return {**({} if bias is None else {"bias": bias}), **({"softcap": softcap} if softcap else {})}


def _lse_parts(pmax, psum):
    """(m, log s) from the loss epilogue's per-tile partials, with a NaN log s for a row holding +inf
    (F.cross_entropy's log_softmax has inf - inf there; the epilogue's logsumexp is inf, as
    torch.logsumexp's), as :func:`codetta.kernels.logsumexp.row_stats` gives where the logits are
    stored."""
    m, log_sum = row_max_and_log_sum(pmax, psum)
    return m, torch.where(pmax.amax(1) == math.inf, math.nan, log_sum)


def _store_logits(logits, h, weight, bias):
    """logits = h W^T (+ b), rounded to logits' dtype: a plain GEMM, or one adding the bias."""
    if bias is None:
        gemm(h, weight.t(), out=logits)
    else:
        gemm(h, weight.t(), linear_program(True), out={"out": logits}, bias=bias)


class TargetOutOfRangeError(ValueError, IndexError):
    """A class index outside [0, V) that is not ``ignore_index``: an IndexError, as PyTorch's
    cross-entropy raises on the CPU, and a ValueError, as codetta's other bad inputs."""


def _check_target_values(target, vocab, ignore_index):
    """Targets in [0, V) or ignore_index: a :class:`TargetOutOfRangeError` on the CPU, a device-side
    assert elsewhere (raising there would synchronize with the GPU)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    message = f"linear_cross_entropy: target values must be in [0, {vocab}) or ignore_index={ignore_index}"
    if target.device.type != "cpu":
        torch._assert_async(~bad.any(), message)
    elif bad.any():
        i = int(bad.nonzero()[0, 0])
        raise TargetOutOfRangeError(f"{message}; target[{i}] = {int(target[i])} (flattened index)")


def _losses(valid, lse_parts, target_logit, logit_sum, vocab, label_smoothing, z_loss):
    """loss_i (fp32 [M], 0 on ignored rows) from lse's parts (m, log s): see the module doc."""
    m, log_sum = lse_parts
    if label_smoothing:
        loss = (m - (1 - label_smoothing) * target_logit - (label_smoothing / vocab) * logit_sum) + log_sum
    else:
        loss = (m - target_logit) + log_sum
    if z_loss:
        loss = loss + z_loss * (m + log_sum).square()
    return torch.where(valid, loss, 0.0)


def _reduce(losses, valid, reduction):
    if reduction == "none":
        return losses
    total = losses.sum()
    return total / valid.sum() if reduction == "mean" else total


def _row_scale(grad, valid, reduction):
    """dloss_i: fp32 [M], 0 on ignored rows (also for "mean" over no valid row)."""
    grad = grad.float()  # in fp32 whatever the default dtype (a bf16 default would round 1 / n_valid)
    if reduction == "mean":
        grad = grad / valid.sum()
    return torch.where(valid, grad, 0.0)


def _add_dweight(dw, dz, h, first):
    """dw = dz^T h (first chunk) or dw += dz^T h (later chunks, an accumulating store in dw's dtype)."""
    if first:
        gemm(dz.t(), h, weight_grad_program(dw.dtype, False), out={"dw": dw})
    else:
        gemm(dz.t(), h, weight_grad_program(dw.dtype, True), dw=dw)


def _chunked(x, weight, target, bias, norm_weight, eps, chunk_size, scale, needs, fp32_grads=False,
             label_smoothing=0.0, z_loss=0.0, softcap=0.0, post_scale=None):
    """(m, log s) (lse's parts), target_logit, logit_sum (fp32 [M]; logit_sum None without label smoothing) and
    the gradients (dx, dweight, dbias, dnorm_weight) of sum_i scale_i loss_i asked for by
    ``needs`` (None for the others), chunk by chunk, times ``post_scale`` (an fp32 scalar
    tensor, applied in fp32 at the end; dW then accumulates in fp32). With ``fp32_grads``,
    dx, dbias and dnorm_weight stay fp32 (they are scaled afterwards).

    Gradients are computed only when one is needed: then each chunk's logits are stored
    (one buffer for all chunks) and turned into dz; see the module docstring.
    """
    need_x, need_weight, need_bias, need_norm_weight = needs
    rows, (vocab, d) = x.shape[0], weight.shape
    low = weight.dtype  # the GEMMs' operands (x may be a wider fp32 stream before the final norm)
    fp32 = {"device": x.device, "dtype": torch.float32}
    lse_parts = (torch.empty(rows, **fp32), torch.empty(rows, **fp32))  # (m, log s)
    target_logit = torch.empty(rows, **fp32)
    logit_sum = torch.empty(rows, **fp32) if label_smoothing else None
    store = any(needs)
    loss_program = _loss_program(bias is not None, bool(label_smoothing), bool(softcap))
    if store:  # rows padded to 16 bytes, so that the GEMMs can read and write it through TMA
        pad = 16 // low.itemsize
        logits = x.new_empty(min(rows, chunk_size), -(-vocab // pad) * pad, dtype=low)[:, :vocab]
    n_chunks = -(-rows // chunk_size)
    dx = torch.empty(x.shape, device=x.device, dtype=torch.float32 if fp32_grads else x.dtype) if need_x else None
    wide_dw = _wide_dweight(weight, fp32_grads)
    if need_weight:  # several chunks add into an fp32 accumulator; one writes dW in the weight's dtype
        dw_dtype = weight.dtype if n_chunks <= 1 and post_scale is None and not wide_dw else torch.float32
        dw = (torch.empty if n_chunks else torch.zeros)(weight.shape, device=x.device, dtype=dw_dtype)
    db = torch.zeros(vocab, **fp32) if need_bias else None
    dg = torch.zeros(d, **fp32) if need_norm_weight else None
    for i, c in enumerate(_chunks(rows, chunk_size)):
        h, rstd = _hidden(x[c], norm_weight, eps, low)
        if not store:
            out = {"target_logit": target_logit[c]}
            if label_smoothing:
                out["logit_sum"] = logit_sum[c]
            parts = gemm(h, weight.t(), loss_program, out=out, finish={"lse": _lse_parts}, target=target[c],
                         **_logit_operands(bias, softcap))["lse"]
            for buffer, part in zip(lse_parts, parts):
                buffer[c] = part
            continue
        dz = logits[: c.stop - c.start]
        _store_logits(dz, h, weight, bias)
        parts, target_logit[c], row_logit_sum = row_stats(dz, target[c], logit_sum=bool(label_smoothing),
                                                          softcap=softcap)
        for buffer, part in zip(lse_parts, parts):
            buffer[c] = part
        if label_smoothing:
            logit_sum[c] = row_logit_sum
        softmax_grad_(dz, tuple(t[c] for t in lse_parts), target[c], scale[c], label_smoothing=label_smoothing,
                      z_loss=z_loss, softcap=softcap)
        if need_bias:
            db += dz.sum(0, dtype=torch.float32)
        if need_weight:
            _add_dweight(dw, dz, h, first=i == 0)
        if norm_weight is None and need_x:
            gemm(dz, weight, *((_fp32_program(),) if fp32_grads else ()), out={"out": dx[c]})
        elif need_x or need_norm_weight:
            _, dg_c = rmsnorm_backward(x[c], norm_weight, rstd, gemm(dz, weight), dx_out=dx[c] if need_x else None)
            if need_norm_weight:
                dg += dg_c
    if post_scale is not None:
        dw = dw * post_scale if need_weight else None
        dx, db, dg = (t.mul_(post_scale) if t is not None else None for t in (dx, db, dg))
    grads = (
        dx,
        dw.to(torch.float32 if wide_dw else weight.dtype) if need_weight else None,
        db if not need_bias or fp32_grads else db.to(bias.dtype),
        dg if not need_norm_weight or fp32_grads else dg.to(norm_weight.dtype),
    )
    return lse_parts, target_logit, logit_sum, grads


def _wide_dweight(weight, fp32_grads):
    """Whether the forward keeps dW in fp32 until the backward scales it: fp16 weights, whose
    narrow range would flush small gradients to zero before a loss scale lifts them."""
    return fp32_grads and weight.dtype == torch.float16


def _in_forward(reduction, needs):
    """Which gradients the forward computes: those needed, unless the reduction is "none"."""
    return tuple(bool(n) and reduction != "none" for n in needs)


def _grad_outputs(x, grads):
    """The custom ops' gradient outputs: each gradient, or an empty tensor where it is None."""
    return tuple(x.new_empty(0) if g is None else g for g in grads)


def _fake_grads(x, weight, bias, norm_weight, needs, fp32_grads=False):
    dtypes = (torch.float32 if fp32_grads else x.dtype,
              torch.float32 if _wide_dweight(weight, fp32_grads) else weight.dtype) + \
        (torch.float32 if fp32_grads else None,) * 2
    return _grad_outputs(x, [t.new_empty(t.shape, dtype=dtype) if need else None
                             for t, need, dtype in zip((x, weight, bias, norm_weight), needs, dtypes)])


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
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    need_x: bool,
    need_weight: bool,
    need_bias: bool,
    need_norm_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dx, dweight, dbias, dnorm_weight): the gradients of the loss itself (grad_output
    = 1) that ``_in_forward`` selects, dx, dbias and dnorm_weight in fp32 until the backward
    scales them (one rounding, as eager's); the others are empty tensors."""
    _check_target_values(target, weight.shape[0], ignore_index)
    valid = target != ignore_index
    needs = _in_forward(reduction, (need_x, need_weight, need_bias, need_norm_weight))
    scale, post_scale = None, None
    if any(needs):
        if reduction == "mean" and weight.dtype == torch.float16:  # 1 / n_valid applied after, in fp32 (module doc)
            scale, post_scale = valid.float(), 1.0 / valid.sum().clamp_min(1).float()
        else:
            scale = _row_scale(torch.ones((), device=x.device, dtype=torch.float32), valid, reduction)
    lse_parts, target_logit, logit_sum, grads = _chunked(
        x, weight, target, bias, norm_weight, eps, chunk_size, scale, needs, fp32_grads=True,
        label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, post_scale=post_scale)
    losses = _losses(valid, lse_parts, target_logit, logit_sum, weight.shape[0], label_smoothing, z_loss)
    return (_reduce(losses, valid, reduction), *_grad_outputs(x, grads))


@_forward.register_fake
def _forward_fake(x, weight, target, bias, norm_weight, ignore_index, reduction, eps, label_smoothing, z_loss,
                  softcap, chunk_size, *needs):
    loss = x.new_empty((x.shape[0],) if reduction == "none" else (), dtype=torch.float32)
    return (loss, *_fake_grads(x, weight, bias, norm_weight, _in_forward(reduction, needs), fp32_grads=True))


@torch.library.custom_op("codetta::linear_cross_entropy_scale_", mutates_args=("dweight",))
def _scale_(grad: torch.Tensor, dweight: torch.Tensor) -> None:
    """dweight computed in the forward times the scalar grad_output, in place (nothing when it
    is 1, decided on the GPU: no host synchronization, and no pass over the [V, d] gradient in
    the usual case)."""
    scale_unless_one_(dweight, grad)


@_scale_.register_fake
def _scale_fake(grad, dweight):
    return None


@torch.library.custom_op("codetta::linear_cross_entropy_backward", mutates_args=())
def _backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    ignore_index: int,
    reduction: str,
    eps: float,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    chunk_size: int,
    need_x: bool,
    need_weight: bool,
    need_bias: bool,
    need_norm_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dnorm_weight) for ``grad``, the logits recomputed; a gradient not asked for is empty."""
    scale = _row_scale(grad, target != ignore_index, reduction)
    needs = (need_x, need_weight, need_bias, need_norm_weight)
    *_, grads = _chunked(x, weight, target, bias, norm_weight, eps, chunk_size, scale, needs,
                         label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
    return _grad_outputs(x, grads)


@_backward.register_fake
def _backward_fake(grad, x, weight, target, bias, norm_weight, ignore_index, reduction, eps, label_smoothing, z_loss,
                   softcap, chunk_size, *needs):
    return _fake_grads(x, weight, bias, norm_weight, needs)


def _setup_context(ctx, inputs, output):
    (x, weight, target, bias, norm_weight, ignore_index, reduction, eps, label_smoothing, z_loss, softcap, chunk_size,
     *needs) = inputs
    ctx.in_forward = _in_forward(reduction, needs)
    if any(ctx.in_forward):
        # which targets are counted, not the targets: the caller may reuse their buffer; and the weights the
        # gradients were made of, unused but checked by autograd when unpacked, as it checks those eager's
        # backward reads (not the bias): an in-place edit between forward and backward raises
        ctx.save_for_backward(*output[1:], target != ignore_index, weight, norm_weight)
    else:
        ctx.save_for_backward(x, weight, target, bias, norm_weight)
    ctx.options = (ignore_index, reduction, eps, label_smoothing, z_loss, softcap, chunk_size)
    ctx.dtypes = tuple(t.dtype if t is not None else None for t in (x, weight, bias, norm_weight))
    only_first_output_differentiable(ctx, output)


def _autograd_backward(ctx, grad_loss, *_grad_gradients):
    if grad_loss is None:  # no gradient came (a downstream function gave none): nothing flows back
        return (None,) * 16
    refuse_double_backward("codetta::linear_cross_entropy", (grad_loss,))
    needs = ctx.needs_input_grad[:2] + ctx.needs_input_grad[3:5]  # x, weight, bias, norm_weight
    if any(ctx.in_forward):  # the gradients made in the forward, scaled by grad_loss in place
        refuse_batched_gradients("codetta::linear_cross_entropy", (grad_loss,))
        if any(n and not f for n, f in zip(needs, ctx.in_forward)):
            raise RuntimeError("codetta::linear_cross_entropy: a gradient is needed that the forward was not asked "
                               "for (need_* arguments); linear_cross_entropy sets them")
        if getattr(ctx, "gradients_handed_out", False):
            raise RuntimeError(
                "codetta::linear_cross_entropy: this loss was backpropagated already. Its gradients are computed "
                "in the forward and handed out (scaled in place) by the first backward, so a second backward through "
                "the same graph (retain_graph=True) cannot give them again: compute the loss again, or use "
                "reduction='none' (its backward recomputes the logits) and reduce the losses yourself; a model "
                "patched by codetta.patch computes its loss unfused with codetta.patch(model, cross_entropy=False)")
        ctx.gradients_handed_out = True
        dx, dw, db, dg, counted, *_parameters = ctx.saved_tensors
        # PyTorch gives ignored rows no gradient whatever grad_output is, also an inf or nan one (not the
        # saved zeros times inf = nan): their rows of dx stay 0, and with no target counted every gradient is
        # exactly 0 (a "sum" divided by a count of 0, as transformers' Trainer does with num_items_in_batch = 0)
        grad_loss = torch.where(counted.any(), grad_loss, torch.zeros_like(grad_loss))
        wide_dw = needs[1] and dw.dtype != ctx.dtypes[1]  # fp16 weights: dW kept in fp32 (_wide_dweight)
        if not wide_dw:
            _scale_(grad_loss, dw)
        grads = [dx, dw, db, dg]
        scales = (torch.where(counted, grad_loss, 0.0)[:, None], grad_loss, grad_loss, grad_loss)
        for i in (0, 1, 2, 3) if wide_dw else (0, 2, 3):  # fp32 until here: scaled and rounded once
            if needs[i]:
                grads[i] = (grads[i] * scales[i]).to(ctx.dtypes[i])
    else:
        grads = _backward(grad_loss, *ctx.saved_tensors, *ctx.options, *needs)
    dx, dw, db, dg = (g if n else None for g, n in zip(grads, needs))
    return dx, dw, None, db, dg, *(None,) * 11


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# The public functions


def _check_inputs(x, weight, target, bias, norm_weight, reduction, chunk_size, label_smoothing=0.0, z_loss=0.0,
                  softcap=None, *, ignore_index=-100, eps=1e-6):
    def fail(msg):
        raise ValueError(f"linear_cross_entropy: {msg}")

    for name, t in (("x", x), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dtype not in KERNEL_DTYPES:
        fail(f"x has dtype {x.dtype}; expected one of {KERNEL_DTYPES}")
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
    for name, t, shape in (("bias", bias, (vocab,)), ("norm_weight", norm_weight, (d,))):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            fail(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    # The GEMMs run on the weight's dtype; x may be wider (fp32) with a final norm, which rounds its
    # output once to the weight's dtype (a wide residual stream, as under autocast); the norm runs in
    # fp32 whatever its weight's dtype (which autocast leaves as it is: an fp16 model under bf16).
    stream = norm_weight is not None and x.dtype == torch.float32 and weight.dtype in (torch.float16, torch.bfloat16)
    if weight.dtype != x.dtype and not stream:
        fail(f"weight has dtype {weight.dtype} but x has {x.dtype}: cast one so they match (x may be fp32 with "
             "16-bit weights when norm_weight is given)")
    if bias is not None and bias.dtype != weight.dtype:
        fail(f"bias has dtype {bias.dtype} but weight has {weight.dtype}: cast one so they match")
    if norm_weight is not None and norm_weight.dtype not in KERNEL_DTYPES:
        fail(f"norm_weight has dtype {norm_weight.dtype}; expected one of {KERNEL_DTYPES}")
    if reduction not in _REDUCTIONS:
        fail(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral) \
            or not -2**63 <= ignore_index < 2**63:
        fail(f"ignore_index must be an int (int64), got {ignore_index!r}")
    check_eps("linear_cross_entropy: ", eps=eps)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral)
                                   or chunk_size < 1):
        fail(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    for name, value, within, bounds in (("label_smoothing", label_smoothing, lambda v: 0.0 <= v <= 1.0, "[0, 1]"),
                                        ("z_loss", z_loss, lambda v: 0.0 <= v < math.inf, "[0, inf)")):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not within(value):
            fail(f"{name} must be a number in {bounds}, got {value!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not 0.0 < softcap < math.inf):
        fail(f"softcap must be None or a positive finite number, got {softcap!r}")


@shapes.dense_tensors_only
@casts_under_autocast("weight", "bias", streams_if=(("x", "norm_weight"),))
def linear_cross_entropy(x, weight, target, *, bias=None, ignore_index=-100, reduction="mean",
                         norm_weight=None, eps=1e-6, chunk_size=None, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """Cross-entropy of the logits ``h W^T + b``, never materialized for all rows at once.

    Equals ``F.cross_entropy(F.linear(h, weight, bias).float(), target, ignore_index=...,
    reduction=..., label_smoothing=...)`` with h = x, or h = ``F.rms_norm(x, (d,),
    norm_weight, eps)`` when ``norm_weight`` is given, plus ``z_loss * lse^2`` per row (not
    ignored) when ``z_loss`` > 0, reduced likewise. When gradients are computed in the forward ("mean", "sum"),
    loss and gradients come from the logits rounded to the weight's dtype (x's, but for an fp32
    x with 16-bit weights), as in eager PyTorch;
    otherwise from the fp32 logits.

    Args:
        x: [..., d] fp32, fp16 or bf16; the leading dims are flattened into rows. With
            norm_weight, x may be fp32 with 16-bit weights (a wide residual stream: the norm
            runs in fp32 and rounds h once, as under autocast).
        weight: [V, d], as nn.Linear stores it; bias: [V] or None, in the weight's dtype;
            norm_weight: [d] or None, in x's or the weight's dtype, or fp32 (Gemma's 1 + w).
        target: integer class indices of x's leading shape; ``ignore_index`` rows count nothing.
        reduction: "mean" (over the rows not ignored), "sum", or "none" (x's leading shape).
        chunk_size: rows per chunk (default :func:`default_chunk_size`: 2^30 bytes of
            logits in the weight's dtype at most (2^28 for a frozen weight), or all rows when that
            takes less memory).
        label_smoothing: e in [0, 1], as PyTorch's: the target distribution is (1 - e) one-hot
            + e uniform. z_loss: c >= 0, the coefficient of the auxiliary loss c lse^2 (PaLM).
        softcap: None, or s > 0: the logits are soft-capped to s tanh(logits / s) before the
            loss (Gemma 2's ``final_logit_softcapping``).

    Gradients flow to x, weight, bias and norm_weight; for "mean" and "sum" they are
    computed in this call when grad mode is on and an input requires grad (the loss can then
    be backpropagated once: a second backward through it raises). See the module
    docstring for the math, the design and the memory bound.
    """
    _check_inputs(x, weight, target, bias, norm_weight, reduction, chunk_size, label_smoothing, z_loss, softcap,
                  ignore_index=ignore_index, eps=eps)
    vocab, d = weight.shape
    x2 = shapes.rows(x)
    refuse_unsupported_autodiff("codetta::linear_cross_entropy", (x, weight, bias, norm_weight))
    # Under a torch.func transform (vmap) the gradients are not made in the forward: the
    # backward recomputes them with the gradients autograd asks for there.
    grad = torch.is_grad_enabled() and not torch._C._are_functorch_transforms_active()
    needs = [grad and t is not None and t.requires_grad for t in (x, weight, bias, norm_weight)]
    chunk = default_chunk_size(vocab, weight.dtype, rows=x2.shape[0], d=d, weight_grad=needs[1]) \
        if chunk_size is None else int(chunk_size)
    loss, *_ = _forward(x2, weight, target.reshape(-1).long(), bias, norm_weight,
                        int(ignore_index), reduction, float(eps), float(label_smoothing), float(z_loss),
                        float(softcap or 0.0), chunk, *needs)
    return loss.reshape(target.shape) if reduction == "none" else loss


def linear_cross_entropy_reference(x, weight, target, *, bias=None, ignore_index=-100, reduction="mean",
                                   norm_weight=None, eps=1e-6, label_smoothing=0.0, z_loss=0.0, softcap=None):
    """The same math in plain PyTorch over whole tensors (materializes the [M, V] logits).

    Logits in fp32 (as codetta's fp32 accumulators), RMSNorm in fp32 rounded once to the
    weight's dtype; differentiable by autograd. For comparison and debugging.
    """
    _check_inputs(x, weight, target, bias, norm_weight, reduction, None, label_smoothing, z_loss, softcap,
                  ignore_index=ignore_index, eps=eps)
    _check_target_values(target.reshape(-1), weight.shape[0], ignore_index)
    h = x if norm_weight is None else \
        (x.float() * rms_rstd(x, eps).unsqueeze(-1) * norm_weight.float()).to(weight.dtype)
    z = F.linear(h.float(), weight.float(), None if bias is None else bias.float())
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    valid = target != ignore_index
    picked = z.gather(-1, torch.where(valid, target, 0).long().unsqueeze(-1)).squeeze(-1)
    z2 = z.reshape(-1, z.shape[-1])  # each logit its own partial: (max, log sum exp) as the epilogue's finish
    lse_parts = tuple(t.reshape(z.shape[:-1]) for t in row_max_and_log_sum(z2, torch.ones_like(z2)))
    losses = _losses(valid, lse_parts, picked, z.sum(-1), z.shape[-1], label_smoothing, z_loss)
    return _reduce(losses, valid, reduction)

"""RMSNorm -> QKV projection -> RoPE on q and k, in one GEMM; and its backward.

Columns of qkv [M, (H_q + 2 H_kv) D]: the H_q query heads, then the H_kv key heads, then
the H_kv value heads, each D = head_dim wide (GQA when H_q != H_kv). With
h = RMSNorm(x) (:mod:`codetta.ops.rmsnorm`) and an optional bias b:

    z = r ⊙row (u W_qkv^T) + b

RoPE (Hugging Face's ``rotate_half`` convention) rotates, inside the first R = rotary_dim
columns of every q and k head, column t < R/2 with column t + R/2 by the angle
theta = position_i * inv_freq_t:

    out_t = z_t cos(theta) - z_{t+R/2} sin(theta),   out_{t+R/2} = z_{t+R/2} cos(theta) + z_t sin(theta)

(times HF's ``attention_scaling``). In the epilogue, these are column pairs inside
segments of R columns (``epilogue.pairs(z, segment=R)``); v heads and the columns past R
of a head are left as they are. The interleaved convention (``interleaved=True``: Helium's
and Ernie 4.5's ``rotate_half`` of columns 0::2 and 1::2, GPT-J's) rotates column 2t with
column 2t + 1 by the same angle theta_t: adjacent pairs (``epilogue.pairs(z)``), the same
tables, nothing else changed.

Angles. theta reaches 10^6 radians at positions near 2^20, where fp32 products are off
by up to 0.06 radians (as Hugging Face's own fp32 tables are). The per-token tables
cos_t = s cos(theta), sin_t = s sin(theta) [M, R/2] are computed from fp64 angles and
rounded once to fp32 (:func:`rope_tables`); the epilogue reads them as a per-row table
repeated along the heads (``Program.table``), so it does no trigonometry at all: a tile
of 128 x 256 would otherwise evaluate 32768 sines and cosines, more time than its MMAs.
Given a Hugging Face rotary embedding's own (cos, sin) instead (``cos_sin``, as the patched
models pass them), the tables are their first halves: RoPE rotates by exactly the model's
angles, in the model's precision.

Backward, given dqkv: the transposed rotation gives dz, and sum_k qkv_ik dqkv_ik =
sum_k z_ik dz_ik is the zdz of the norm backward; one memory-bound kernel
(:func:`codetta.kernels.rope.rotate`) writes both. Then the norm-backward GEMM of
:func:`codetta.ops.rmsnorm.rmsnorm_linear_backward`, dW_i = dz_i^T h and db = sum_i dz_i.
With a bias the stored qkv holds z + b, whose zdz would cancel when |b| >> |z|: the norm's
row term then comes from dL/dh (see :mod:`codetta.ops.rmsnorm`).

QK-norm (Qwen3, optional: ``q_norm_weight``, ``k_norm_weight``, ``qk_norm_eps`` = e). Between
the projection and RoPE, every q and k head h (its D columns) is RMS-normalized with a
weight w of D entries (w_q shared by the q heads, w_k by the k heads); v is untouched:

    r_ih = rsqrt(mean_{k in h} z_ik^2 + e),   zhat = z r_h,   zn = w ⊙ zhat,   qkv = RoPE(zn)

In the epilogue, ``segment_sum(z * z, D)`` gives the per-head sums (the tile holds whole
heads), a column operand holds w tiled over the heads, and ``where(column < (H_q + H_kv) D,
...)`` leaves the v heads alone. The forward also stores the pre-norm z [M, N] (inputs'
dtype) as a second output: one more [M, N] write, which saves recomputing the GEMM in the
backward (without QK-norm nothing more is stored). Backward: the RoPE kernel gives dzn (the
un-rotated gradient; its qkv . dqkv would be zn . dzn, not the z . dz the outer norm needs,
so it is skipped), then one memory-bound kernel (:func:`codetta.kernels.qk_norm.qk_norm_backward`)
computes per q/k head, with g = w ⊙ dzn,

    dz = r_h (g - zhat mean_{k in h}(g_k zhat_k))     (dz = dzn on the v heads)
    dw_q = sum over rows and q heads of dzn ⊙ zhat    (dw_k likewise)
    zdz_i = sum_k z_ik dz_ik over all N columns       (with a bias, the norm's row term from dL/dh instead)

and the norm-backward GEMM follows as above.
"""

from __future__ import annotations

import functools
import numbers
import weakref
from typing import Optional

import torch
from torch import Tensor

from .. import epilogue as ep
from ..matmul import gemm
from ..kernels.qk_norm import qk_norm_backward
from ..kernels.rope import rotate
from .rmsnorm import (_check_norm_inputs, _weight_t, check_eps, finite_real, given_stats, norm_operands,
                      rmsnorm_linear_backward, rstd_like, used_rstd)
from .autocast import casts_under_autocast
from .autograd import direct_op, only_first_output_differentiable
from .weight_grads import for_autograd, run_backward, skipping, weight_grads_like
from .shapes import broadcasts_to, check_biases, check_vector, concat_biases, dense_tensors_only, rows


def _pair_segment(rotary_dim: int, interleaved: bool) -> int:
    """The width of the column segments inside which RoPE pairs column t with t + segment/2:
    R (rotate_half) or 2 (interleaved: adjacent columns)."""
    return 2 if interleaved else rotary_dim


@functools.lru_cache(maxsize=None)
def _forward_program(rotary_dim: int, with_bias: bool, qk_norm_dim: int = 0, interleaved: bool = False) -> ep.Program:
    """The epilogue; ``qk_norm_dim`` = D turns QK-norm on (0: off, the program is unchanged);
    ``interleaved`` rotates adjacent column pairs instead of rotate_half's."""
    name = f"rmsnorm_qkv_rope_r{rotary_dim}" + ("_interleaved" if interleaved else "") + ("_bias" if with_bias else "")
    p = ep.Program(name + (f"_qknorm{qk_norm_dim}" if qk_norm_dim else ""))
    z = p.acc * p.row("rstd")
    if with_bias:
        z = z + p.col("bias")
    if qk_norm_dim:
        p.store("z", z)  # pre-norm z, for the backward
        r = ep.rsqrt(ep.segment_sum(z * z, qk_norm_dim) * (1.0 / qk_norm_dim) + p.scalar("qk_eps"))
        normed = p.col_index() < p.scalar("n_normed")  # the q and k columns
        z = ep.where(normed, z * r * p.col("qk_weight"), z)
    segment = _pair_segment(rotary_dim, interleaved)
    x1, x2 = ep.pairs(z, segment=segment)
    rotated = p.col("rotated", ep.HALF).ne(0)  # q and k pairs inside the rotary dims
    cos, sin = p.table("cos", rotary_dim // 2, ep.HALF), p.table("sin", rotary_dim // 2, ep.HALF)
    # the other pairs (v, columns past R) as they are: a rotation by 0 would turn an inf partner into NaN
    # q, k and v each in an allocation of its own (B's parts W_q, W_k, W_v): a KV cache can hold k and v alone
    p.store("qkv", ep.join(ep.where(rotated, x1 * cos - x2 * sin, x1), ep.where(rotated, x2 * cos + x1 * sin, x2),
                           segment=segment), per_b_part=True)
    return p


@functools.lru_cache(maxsize=64)
def _rotated_pairs(n_q: int, n_kv: int, head_dim: int, rotary_dim: int, device: torch.device,
                   interleaved: bool = False) -> Tensor:
    """1 for every column pair of qkv that RoPE rotates (q and k heads, first R columns), else 0; [N/2] fp32."""
    half = _pair_segment(rotary_dim, interleaved) // 2
    pair = torch.arange((n_q + 2 * n_kv) * head_dim // 2, device=device)
    col = (pair // half) * (2 * half) + pair % half  # the first column of each pair
    return ((col % head_dim < rotary_dim) & (col < (n_q + n_kv) * head_dim)).float()


def _qk_weight_columns(q_norm_weight: Tensor, k_norm_weight: Tensor, n_q: int, n_kv: int) -> Tensor:
    """w_q tiled over the q heads, w_k over the k heads, ones over the v heads: [N] fp32."""
    w_q, w_k = q_norm_weight.float(), k_norm_weight.float()
    return torch.cat([w_q.repeat(n_q), w_k.repeat(n_kv), w_k.new_ones(n_kv * w_k.shape[0])])


def _identity(t: Tensor):
    """What makes a tensor's values the same as before, while a reference keeps its memory; None
    for an inference tensor (``torch.inference_mode``), which has no version counter."""
    if t.is_inference():
        return None
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device, t._version


_LAST_TABLES = [None]  # (key, weak references to the inputs, tables) of the last tables made, replaced whole


def _owner(t: Tensor) -> Tensor:
    """The tensor whose life keeps t's memory from reuse: the base of a view (positions come as a
    fresh view per layer), else t."""
    return t._base if t._base is not None else t


def _forget_tables(ref) -> None:
    """An input of the cached tables died: its memory may be reused, and the tables are of no use."""
    entry = _LAST_TABLES[0]
    if entry is not None and any(r is ref for r in entry[1]):
        _LAST_TABLES[0] = None


def _cached_tables(inputs: tuple, extra, make) -> tuple[Tensor, Tensor]:
    """``make()``: the RoPE tables made from the tensors ``inputs`` (and ``extra``, hashable).

    The last result is reused while the same inputs come back unchanged (same memory, shape,
    strides and version counter) with the same ``extra``: a model's layers all ask for the same
    tables. Inference tensors, whose changes cannot be seen, are not reused, nor is anything
    while torch.compile traces. The cache holds its inputs (the bases of views) only weakly and
    forgets the tables when one of them dies (its memory could then pass for a new tensor's):
    nothing of a step, nor of a deleted model, is kept after it. Under torch.func's transforms the
    inputs are wrapped (no memory to compare): the tables are made, and the op then says what it
    supports.
    """
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return make()
    key = (*map(_identity, inputs), extra)
    reusable = None not in key
    entry = _LAST_TABLES[0]  # read once: a weak reference's callback may empty the cache meanwhile
    if reusable and entry is not None and entry[0] == key:
        return entry[2]
    tables = make()
    if reusable:
        _LAST_TABLES[0] = (key, tuple(weakref.ref(_owner(t), _forget_tables) for t in inputs), tables)
    return tables


def rope_tables(positions: Tensor, inv_freq: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(scale cos(theta), scale sin(theta)), [M, R/2] fp32 each, theta = position x inv_freq in fp64
    (reused while the inputs are unchanged: :func:`_cached_tables`)."""
    def make():
        theta = positions.reshape(-1, 1).double() * inv_freq.double().reshape(1, -1)
        return (torch.cos(theta) * scale).float(), (torch.sin(theta) * scale).float()

    return _cached_tables((positions, inv_freq), float(scale), make)


def _check_halves(cos: Tensor, sin: Tensor) -> None:
    """cos and sin [..., R] must each be two equal halves, or the first halves alone would give
    other angles than the caller's (e.g. tables repeated per adjacent pair, [c0, c0, c1, c1, ...]):
    a ValueError on the CPU; on a GPU a device-side assert (raising would synchronize with it),
    as for cross-entropy's targets (NaNs match NaNs). Not checked while torch.compile traces, a
    torch.func transform runs or a CUDA graph captures."""
    if cos.is_meta or torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() \
            or (cos.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    half = cos.shape[-1] // 2
    equal = torch.stack([torch.isclose(t[..., :half], t[..., half:], rtol=0, atol=0, equal_nan=True).all()
                         for t in (cos, sin)]).all()
    message = (f"cos and sin {tuple(cos.shape)} must each be two equal halves along the last dim (cat(freqs, freqs), "
               "as Hugging Face's rotary embeddings make them): codetta's RoPE reads their first halves")
    if cos.device.type != "cpu":
        torch._assert_async(equal, message)
    elif not equal:
        raise ValueError(message)


def tables_from_cos_sin(cos: Tensor, sin: Tensor, lead: torch.Size) -> tuple[Tensor, Tensor]:
    """A Hugging Face rotary embedding's (cos, sin) [..., R] (broadcasting to x's leading dims
    ``lead``; their two halves equal, as its cat(freqs, freqs): checked) as the epilogue's tables:
    the first halves, [M, R/2] fp32 each (reused while the inputs are unchanged: :func:`_cached_tables`)."""
    def make():
        _check_halves(cos, sin)
        half = cos.shape[-1] // 2
        return tuple(t[..., :half].expand(*lead, half).reshape(-1, half).float().contiguous() for t in (cos, sin))

    return _cached_tables((cos, sin), tuple(lead), make)


@direct_op("codetta::rmsnorm_qkv_rope", differentiable=3)
def _qkv_rope_op(
    x: Tensor, norm_weight: Tensor, weights: list[Tensor], bias: Optional[Tensor], cos: Tensor, sin: Tensor,
    n_q: int, n_kv: int, head_dim: int, rotary_dim: int, interleaved: bool, eps: float, u: Optional[Tensor],
    rstd: Optional[Tensor], q_norm_weight: Optional[Tensor], k_norm_weight: Optional[Tensor], qk_norm_eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(q, k, v, rstd, z): q, k and v in allocations of their own (one GEMM stores them per part
    of B), whose gradients the backward takes as they are (no concatenation); z is the
    pre-QK-norm projection [..., N] with QK-norm, else empty; cos and sin are the per-token
    tables [M, R/2] fp32 (:func:`rope_tables`)."""
    x2 = rows(x)
    u, rstd, rstd_out = norm_operands(x2, norm_weight, eps, weights[0].dtype, u, rstd)
    rotated = _rotated_pairs(n_q, n_kv, head_dim, rotary_dim, x.device, interleaved)
    operands = dict(rstd=rstd, cos=cos, sin=sin, rotated=rotated)
    if bias is not None:
        operands["bias"] = bias
    qk_norm = q_norm_weight is not None
    if qk_norm:
        operands.update(qk_eps=qk_norm_eps, n_normed=(n_q + n_kv) * head_dim,
                        qk_weight=_qk_weight_columns(q_norm_weight, k_norm_weight, n_q, n_kv))
    program = _forward_program(rotary_dim, bias is not None, head_dim if qk_norm else 0, interleaved)
    out = gemm(u.reshape(x2.shape), _weight_t(weights), program, **operands)
    lead = x.shape[:-1]
    q, k, v = (t.reshape(*lead, t.shape[-1]) for t in out["qkv"])
    z = out["z"].reshape(*lead, out["z"].shape[-1]) if qk_norm else x.new_empty(0)
    return q, k, v, rstd_out, z


@_qkv_rope_op.register_fake
def _(x, norm_weight, weights, bias, cos, sin, n_q, n_kv, head_dim, rotary_dim, interleaved, eps, u, rstd,
      q_norm_weight, k_norm_weight, qk_norm_eps):
    low = weights[0].dtype
    q, k, v = (x.new_empty(*x.shape[:-1], n * head_dim, dtype=low) for n in (n_q, n_kv, n_kv))
    z = x.new_empty(*x.shape[:-1], (n_q + 2 * n_kv) * head_dim, dtype=low) if q_norm_weight is not None \
        else x.new_empty(0)
    return q, k, v, rstd_like(x, u, rstd), z


def rmsnorm_qkv_rope_backward(dqkv, qkv, x, norm_weight, weights, bias, cos, sin, n_q, n_kv, head_dim, interleaved,
                              rstd, z, q_norm_weight, k_norm_weight, qk_norm_eps, dweights_into=()):
    """(dx, dnorm_weight, [dW_q, dW_k, dW_v], dbias, dq_norm_weight, dk_norm_weight) given dqkv, or
    [dq, dk, dv] (the module doc's backward). Without QK-norm and bias it reads the outputs
    [q, k, v] (``qkv``, or one tensor); with QK-norm the pre-norm z instead (qkv unused)."""
    def rows_of(t):
        return [rows(p) for p in t] if isinstance(t, list) else rows(t)

    qk_norm = q_norm_weight is not None
    # with a bias the stored outputs hold z + b, whose zdz would cancel: the norm's row term is then
    # taken from dL/dh (zdz None; see codetta.ops.rmsnorm)
    dz, zdz = rotate(rows_of(dqkv), None if qk_norm or bias is not None else rows_of(qkv), cos, sin,
                     n_rotated=(n_q + n_kv) * head_dim, head_dim=head_dim, interleaved=interleaved)
    if qk_norm:  # dz above is dzn; QK-norm's backward in place gives dz and zdz from the pre-norm z
        dz, zdz, dqw, dkw = qk_norm_backward(dz, rows(z), q_norm_weight, k_norm_weight, n_q=n_q, n_kv=n_kv,
                                             eps=qk_norm_eps, out=dz)
    else:
        dqw, dkw = dz.new_empty(0, dtype=torch.float32), dz.new_empty(0, dtype=torch.float32)
    dx, dg, dws = rmsnorm_linear_backward(dz, None if bias is not None else zdz, x, norm_weight, weights, rstd,
                                          dweights_into)
    dbias = dz.sum(0, dtype=torch.float32).to(bias.dtype) if bias is not None else dz.new_empty(0, dtype=torch.float32)
    return dx, dg, dws, dbias, dqw, dkw


@direct_op("codetta::rmsnorm_qkv_rope_backward")
def _qkv_rope_backward_op(
    dqkv: list[Tensor], qkv: list[Tensor], x: Tensor, norm_weight: Tensor, weights: list[Tensor],
    bias: Optional[Tensor], cos: Tensor, sin: Tensor, n_q: int, n_kv: int, head_dim: int, interleaved: bool,
    rstd: Tensor, z: Optional[Tensor], q_norm_weight: Optional[Tensor], k_norm_weight: Optional[Tensor],
    qk_norm_eps: float, needs: list[bool],
) -> tuple[Tensor, Tensor, list[Tensor], Tensor, Tensor, Tensor]:
    """The backward given [dq, dk, dv] and the outputs [q, k, v] it reads (empty: not read)."""
    return rmsnorm_qkv_rope_backward(dqkv, qkv or None, x, norm_weight, weights, bias, cos, sin, n_q, n_kv, head_dim,
                                     interleaved, rstd, z, q_norm_weight, k_norm_weight, qk_norm_eps,
                                     skipping(weights, needs))


@_qkv_rope_backward_op.register_fake
def _(dqkv, qkv, x, norm_weight, weights, bias, cos, sin, n_q, n_kv, head_dim, interleaved, rstd, z,
      q_norm_weight, k_norm_weight, qk_norm_eps, needs):
    def grad_like(t):
        return t.new_empty(t.shape) if t is not None else x.new_empty(0, dtype=torch.float32)

    return (x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), weight_grads_like(weights, needs),
            grad_like(bias), grad_like(q_norm_weight), grad_like(k_norm_weight))


def saves_qkv(bias, q_norm_weight) -> bool:
    """Whether the op keeps its outputs q, k and v for the backward (for the norm's zdz): without
    QK-norm (the pre-norm z instead) and without a bias (the row term from dL/dh instead).
    ``bias``: the op's (one tensor, or None) or :func:`rmsnorm_qkv_rope`'s (b_q, b_k, b_v)."""
    no_bias = bias is None or (isinstance(bias, (tuple, list)) and all(b is None for b in bias))
    return no_bias and q_norm_weight is None


def _setup(ctx, inputs, output):
    only_first_output_differentiable(ctx, output, 3)
    (x, norm_weight, weights, bias, cos, sin, n_q, n_kv, head_dim, rotary_dim, interleaved, eps, u, rstd, q_norm_weight,
     k_norm_weight, qk_norm_eps) = inputs
    q, k, v, rstd_out, z = output
    qk_norm = q_norm_weight is not None
    ctx.meta = (n_q, n_kv, head_dim, interleaved, bias is not None, qk_norm, qk_norm_eps)  # R: cos.shape[1] * 2
    empty = x.new_empty(0)
    read = [z] if qk_norm else [q, k, v] if saves_qkv(bias, q_norm_weight) else []
    ctx.n_read = len(read)
    ctx.save_for_backward(*read, x, norm_weight, cos, sin, used_rstd(u, rstd, rstd_out),
                          bias if bias is not None else empty, q_norm_weight if qk_norm else empty,
                          k_norm_weight if qk_norm else empty, *weights)


def _backward(ctx, dqkv, _drstd, _dz):
    saved = ctx.saved_tensors
    read = list(saved[:ctx.n_read])  # [z] with QK-norm, [q, k, v] where the backward reads them, else []
    x, norm_weight, cos, sin, rstd, bias, q_norm_weight, k_norm_weight, *weights = saved[ctx.n_read:]
    n_q, n_kv, head_dim, interleaved, has_bias, qk_norm, qk_norm_eps = ctx.meta
    qk = (read[0], q_norm_weight, k_norm_weight) if qk_norm else (None, None, None)
    dx, dg, dws, dbias, dqw, dkw = run_backward(
        ctx, weights, _qkv_rope_backward_op, rmsnorm_qkv_rope_backward,
        dqkv, [] if qk_norm else read, x, norm_weight, weights, bias if has_bias else None, cos, sin,
        n_q, n_kv, head_dim, interleaved, rstd, *qk, qk_norm_eps, weight_args=(2,))
    none10 = (None,) * 10  # cos, sin, n_q, n_kv, head_dim, rotary_dim, interleaved, eps, u, rstd
    return (dx, dg, for_autograd(dws, weights), dbias if has_bias else None, *none10, dqw if qk_norm else None,
            dkw if qk_norm else None, None)


_qkv_rope_op.register_autograd(_backward, setup_context=_setup)


def _token_positions(positions: Tensor, lead: torch.Size) -> Tensor:
    """``positions`` as one integer per token, of shape ``lead`` (x's leading dims)."""
    if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.is_complex() \
            or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor, got "
                         f"{positions.dtype if isinstance(positions, Tensor) else type(positions).__name__}")
    if positions.shape == lead:
        return positions
    if positions.dim() == 1 and len(lead) != 1 and positions.numel() == lead.numel():  # flat [M] (M = 1: a 1-d x)
        return positions.reshape(lead)
    if broadcasts_to(positions.shape, lead):
        return positions.expand(lead)
    raise ValueError(f"positions {tuple(positions.shape)} are not one per token of x's leading dims {tuple(lead)}")


def _tables_of_positions(positions, inv_freq, rotary_dim: int, attention_scaling: float, x: Tensor):
    """The tables of :func:`rope_tables`, the arguments checked. inv_freq is used as given (a bf16
    model holds it in bf16): the tables are made from it in fp64, and the same tensor in every
    layer lets them all share one pair of tables."""
    if positions is None or inv_freq is None:
        raise ValueError("RoPE needs positions and inv_freq, or cos_sin")
    if not isinstance(inv_freq, Tensor) or inv_freq.shape != (rotary_dim // 2,) or not inv_freq.is_floating_point():
        raise ValueError(f"inv_freq must be a floating point tensor [{rotary_dim // 2}], got "
                         f"{getattr(inv_freq, 'dtype', type(inv_freq).__name__)} {tuple(getattr(inv_freq, 'shape', ()))}")
    for name, t in (("positions", positions), ("inv_freq", inv_freq)):
        if isinstance(t, Tensor) and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    return rope_tables(_token_positions(positions, x.shape[:-1]), inv_freq, float(attention_scaling))


def angles_need_grad(inv_freq, cos_sin) -> bool:
    """Whether autograd would want a gradient for the rotary angles (a trainable inv_freq, or
    cos and sin made by a trainable module), which the fused RoPE does not give."""
    angles = (inv_freq, *(cos_sin if isinstance(cos_sin, (tuple, list)) else ()))
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in angles)


def _check_cos_sin(cos_sin, positions, inv_freq, rotary_dim, attention_scaling, x: Tensor) -> int:
    """The rotary dim of a valid ``cos_sin`` (see :func:`rmsnorm_qkv_rope`), or a ValueError."""
    if positions is not None or inv_freq is not None:
        raise ValueError("give positions and inv_freq, or cos_sin, not both")
    if attention_scaling != 1.0:
        raise ValueError("attention_scaling is part of cos_sin (HF's rotary embedding multiplies it in): leave it 1")
    if not isinstance(cos_sin, (tuple, list)) or len(cos_sin) != 2 or not all(isinstance(t, Tensor) for t in cos_sin):
        raise ValueError(f"cos_sin must be a pair of tensors (cos, sin), got {type(cos_sin).__name__}")
    cos, sin = cos_sin
    lead = x.shape[:-1]
    if cos.shape != sin.shape or cos.dim() < 1 or not (cos.is_floating_point() and sin.is_floating_point()):
        raise ValueError(f"cos and sin must be floating point tensors of one shape, got {cos.dtype} "
                         f"{tuple(cos.shape)} and {sin.dtype} {tuple(sin.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if not broadcasts_to(cos.shape[:-1], lead):
        raise ValueError(f"cos and sin {tuple(cos.shape)} are not [..., R] for each token of x's leading dims "
                         f"{tuple(lead)}")
    if rotary_dim is not None and rotary_dim != cos.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} differs from cos and sin's last dim {cos.shape[-1]}")
    return cos.shape[-1]


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def fits_qkv_epilogue(rotary_dim: int, head_dim: int, qk_norm: bool) -> bool:
    """Whether :func:`rmsnorm_qkv_rope`'s epilogue takes these heads: it rotates within column
    segments of R = ``rotary_dim`` columns and normalizes (QK-norm) within segments of head_dim,
    segments being power-of-two blocks of a tile; so R a power of two dividing head_dim, and
    head_dim a power of two with QK-norm. Other even R up to head_dim: :func:`codetta.ops.apply_rope`."""
    return _is_power_of_two(rotary_dim) and rotary_dim >= 2 and head_dim % rotary_dim == 0 \
        and (not qk_norm or _is_power_of_two(head_dim))


def rope_tables_for(x: Tensor, head_dim, positions, inv_freq, *, rotary_dim, attention_scaling, cos_sin,
                    interleaved, in_epilogue: bool = True) -> tuple[int, int, Tensor, Tensor]:
    """(head_dim, rotary_dim, cos, sin): the RoPE arguments of :func:`rmsnorm_qkv_rope` and
    :func:`codetta.ops.apply_rope` checked (a ValueError naming the wrong one), and the per-token
    tables [M, R/2] fp32 for x's tokens (``x.shape[:-1]``). R must be even and at most head_dim;
    ``in_epilogue`` (a GEMM epilogue rotates: its segments are power-of-two blocks of
    a tile) a power of two dividing head_dim."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}")
    head_dim = int(head_dim)
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral)):
        raise ValueError(f"rotary_dim must be an integer, got {rotary_dim!r}")
    attention_scaling = finite_real("attention_scaling", attention_scaling)
    if cos_sin is not None:
        rotary_dim = _check_cos_sin(cos_sin, positions, inv_freq, rotary_dim, attention_scaling, x)
    if angles_need_grad(inv_freq, cos_sin):
        raise ValueError("inv_freq or cos_sin requires grad: codetta's RoPE gives no gradient for the rotary "
                         "angles (it would be dropped); detach them, or apply RoPE unfused")
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    if not isinstance(interleaved, bool):
        raise ValueError(f"interleaved must be a bool, got {interleaved!r}")
    if in_epilogue and not fits_qkv_epilogue(rotary_dim, head_dim, qk_norm=False):
        raise ValueError(f"rotary_dim {rotary_dim} must be a power of two dividing head_dim {head_dim} in the QKV "
                         f"epilogue (codetta.ops.apply_rope after rmsnorm_linear takes any even one up to head_dim)")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
    if cos_sin is None:
        cos, sin = _tables_of_positions(positions, inv_freq, rotary_dim, attention_scaling, x)
    else:
        cos, sin = tables_from_cos_sin(*cos_sin, x.shape[:-1])
    return head_dim, rotary_dim, cos, sin


@dense_tensors_only
@casts_under_autocast("w_q", "w_k", "w_v", "bias", "stats", streams=("x",))
def rmsnorm_qkv_rope(x: Tensor, norm_weight: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor,
                     positions: Tensor | None = None, inv_freq: Tensor | None = None, *, head_dim: int,
                     rotary_dim: int | None = None, attention_scaling: float = 1.0, cos_sin: tuple | None = None,
                     interleaved: bool = False, bias: tuple | None = None, eps: float = 1e-6, stats=None,
                     q_norm_weight: Tensor | None = None, k_norm_weight: Tensor | None = None, qk_norm_eps: float = 1e-6):
    """q, k, v = RoPE(RMSNorm(x) W_q^T + b_q), RoPE(RMSNorm(x) W_k^T + b_k), RMSNorm(x) W_v^T + b_v, fused.

    With ``q_norm_weight`` and ``k_norm_weight`` (Qwen3's QK-norm), q and k are RMS-normalized
    per head (weights of D entries, epsilon ``qk_norm_eps``) before RoPE, in the same
    epilogue; the forward then also stores the pre-norm projection ([M, N], the weights' dtype) for the
    backward: one more [M, N] write instead of recomputing the GEMM (see the module docstring).

    Args:
        x: [..., d]; norm_weight: [d]; w_q: [H_q D, d]; w_k, w_v: [H_kv D, d].
        positions: the position of every token (integers): x's leading dims [...], a shape that
            broadcasts to them (HF's [1, S] position_ids), or flat [M].
        inv_freq: [rotary_dim / 2], any float dtype: the model's own rotary frequencies (HF's
            ``inv_freq``, in bf16 when the model was cast to bf16; its values are used as they are).
            The cos/sin tables made from positions and inv_freq are reused while both are the
            same tensors with the same version counters (a model's layers share them): a write
            that PyTorch does not count (into numpy memory shared with positions, through
            ``.data``) is not seen; pass new tensors for new positions.
        head_dim: D; rotary_dim: R (default D) with D a multiple of R (partial rotary), R a
            power of two. attention_scaling: HF's factor on cos and sin (rope scaling types).
        cos_sin: instead of positions and inv_freq (pass neither then): the (cos, sin) a Hugging
            Face rotary embedding returns, [..., R] each (a shape that broadcasts to x's leading
            dims, e.g. [1, S, R]), attention_scaling included, the two halves of each equal (its
            cat(freqs, freqs): only the first halves are read). RoPE then rotates by exactly the
            model's own angles, in their precision (fp32 products, or bf16 values in a bf16
            model); the model's position_embeddings, passed to every layer, make one pair of
            tables for all of them (reused while the same tensors come back unchanged).
        interleaved: rotate adjacent columns (2t, 2t + 1) by angle t instead of rotate_half's
            (t, t + R/2): the convention of Helium's and Ernie 4.5's ``apply_rotary_pos_emb``
            (there cos_sin is still the rotary embedding's cat(freqs, freqs)).
        bias: optional (b_q, b_k, b_v) (Qwen2), each a tensor or None (0).
        stats: optional (u, rstd) from linear_residual.
        q_norm_weight, k_norm_weight: optional [D] each, both or neither (QK-norm, Qwen3; D a
            power of two).
        qk_norm_eps: QK-norm's epsilon (Qwen3: config.rms_norm_eps).
    Returns:
        (q, k, v): [..., H_q D], [..., H_kv D], [..., H_kv D], each in an allocation of its own.
    """
    _check_norm_inputs(x, norm_weight, {"w_q": w_q, "w_k": w_k, "w_v": w_v}, eps)
    weights = [w_q, w_k, w_v]
    check_eps(qk_norm_eps=qk_norm_eps)
    head_dim, rotary_dim, cos, sin = rope_tables_for(x, head_dim, positions, inv_freq, rotary_dim=rotary_dim,
                                                     attention_scaling=attention_scaling, cos_sin=cos_sin,
                                                     interleaved=interleaved)
    nq, nk = (w_q.shape[0] // head_dim, w_q.shape[0] % head_dim), (w_k.shape[0] // head_dim, w_k.shape[0] % head_dim)
    if nq[1] or nk[1] or w_v.shape != w_k.shape:
        raise ValueError(f"q/k/v weights {[tuple(w.shape) for w in weights]} are not whole heads of {head_dim}")
    widths = tuple(w.shape[0] for w in weights)
    b = concat_biases(check_biases(bias, ("b_q", "b_k", "b_v"), widths, x.device), widths)  # a missing one adds 0
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("QK-norm needs both q_norm_weight and k_norm_weight (or neither)")
    if q_norm_weight is not None:
        if not fits_qkv_epilogue(rotary_dim, head_dim, qk_norm=True):  # rotary_dim fits (rope_tables_for)
            raise ValueError(f"QK-norm needs a head_dim that is a power of two (the epilogue sums whole heads as "
                             f"power-of-two segments), got {head_dim}")
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            check_vector(name, w, head_dim, x.device)
    u, rstd = given_stats(x, stats, weights[0].dtype, norm_weight, eps)
    return _qkv_rope_op(x, norm_weight, weights, b, cos, sin, nq[0], nk[0], head_dim, rotary_dim, interleaved, float(eps),
                        u, rstd, q_norm_weight, k_norm_weight, float(qk_norm_eps))[:3]


def rmsnorm_qkv_rope_reference(x, norm_weight, w_q, w_k, w_v, positions, inv_freq, *, head_dim, rotary_dim=None,
                               attention_scaling=1.0, interleaved=False, bias=None, eps=1e-6, q_norm_weight=None,
                               k_norm_weight=None, qk_norm_eps=1e-6):
    """The same math unfused: F.rms_norm, F.linear, per-head F.rms_norm (QK-norm), and HF's
    rotate_half RoPE (or the interleaved one) with fp64 angles."""
    rms_norm = torch.nn.functional.rms_norm
    h = rms_norm(x, (x.shape[-1],), norm_weight, eps)
    bias = bias or (None, None, None)
    q, k, v = (torch.nn.functional.linear(h, w, b) for w, b in zip((w_q, w_k, w_v), bias))
    if q_norm_weight is not None:
        q, k = (rms_norm(t.unflatten(-1, (-1, head_dim)), (head_dim,), w, qk_norm_eps).reshape(t.shape)
                for t, w in ((q, q_norm_weight), (k, k_norm_weight)))
    rotary_dim = rotary_dim or head_dim
    theta = positions.reshape(*positions.shape, 1).double() * inv_freq.double()
    cos = (torch.cos(theta) * attention_scaling).to(x.dtype).unsqueeze(-2)
    sin = (torch.sin(theta) * attention_scaling).to(x.dtype).unsqueeze(-2)

    def rope(t):
        heads = t.unflatten(-1, (-1, head_dim))
        rot, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
        if interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        else:
            x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return torch.cat([rotated, rest], dim=-1).reshape(t.shape)

    return rope(q), rope(k), v

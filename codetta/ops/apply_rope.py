"""``codetta.ops.apply_rope``: RoPE on q and k that no GEMM's epilogue applies, one kernel each way.

Where the QKV projection is not a GEMM codetta runs (a PEFT LoRA adapter on q_proj or v_proj:
the projections are the model's own modules), RoPE still need not be Hugging Face's
``apply_rotary_pos_emb``, whose ``rotate_half`` makes a negated copy, a concatenation, two
products and a sum of each of q and k (in their dtype, each rounded), as many again
backward, and keeps its inputs for it. Here one pass of :func:`codetta.kernels.rope.rotate`
reads q and k and writes both rotated,

    out_t = z_t cos_t - z_{t+R/2} sin_t,   out_{t+R/2} = z_{t+R/2} cos_t + z_t sin_t

(per q and k head, its first R = rotary_dim columns; in fp32, rounded once), and the backward
is one pass of the transposed rotation (sin_t negated) over dq and dk as autograd hands them
back, with nothing saved but the per-token tables (cos_t, sin_t) [M, R/2], which every
layer of a model shares (see :mod:`codetta.ops.rope` for the tables and the conventions).
The op is the custom op ``codetta::apply_rope`` (its backward ``codetta::apply_rope_backward``),
so torch.compile traces it without a graph break.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.rope import rotate
from ..matmul import KERNEL_DTYPES, check_device
from .autograd import direct_op
from .shapes import dense_tensors_only, rows
from .rope import rope_tables_for


def _rotated(parts: list[Tensor], cos: Tensor, sin: Tensor, head_dim: int, interleaved: bool,
             transposed: bool) -> tuple[Tensor, Tensor]:
    """q and k (or dq and dk) rotated, each in an allocation of its own, in their leading dims."""
    out, _ = rotate([rows(t) for t in parts], None, cos, sin, n_rotated=sum(t.shape[-1] for t in parts),
                    head_dim=head_dim, interleaved=interleaved, transposed=transposed, out_in_parts=True)
    return tuple(o.reshape(t.shape) for o, t in zip(out, parts))


@direct_op("codetta::apply_rope", differentiable=2)
def _apply_rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, head_dim: int,
                   interleaved: bool) -> tuple[Tensor, Tensor]:
    """q and k rotated, each in an allocation of its own (a KV cache can hold k without q)."""
    return _rotated([q, k], cos, sin, head_dim, interleaved, transposed=False)


@_apply_rope_op.register_fake
def _(q, k, cos, sin, head_dim, interleaved):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@direct_op("codetta::apply_rope_backward")
def _apply_rope_backward_op(dqk: list[Tensor], cos: Tensor, sin: Tensor, head_dim: int,
                            interleaved: bool) -> tuple[Tensor, Tensor]:
    """(dq, dk) from [dq, dk] as autograd hands them back: the transposed rotation."""
    return _rotated(dqk, cos, sin, head_dim, interleaved, transposed=True)


@_apply_rope_backward_op.register_fake
def _(dqk, cos, sin, head_dim, interleaved):
    return tuple(t.new_empty(t.shape) for t in dqk)


def _setup(ctx, inputs, output):
    _, _, cos, sin, head_dim, interleaved = inputs
    ctx.save_for_backward(cos, sin)
    ctx.set_materialize_grads(False)
    ctx.meta = (head_dim, interleaved)


def _backward(ctx, dqk):
    cos, sin = ctx.saved_tensors
    head_dim, interleaved = ctx.meta
    return (*_apply_rope_backward_op(dqk, cos, sin, head_dim, interleaved), None, None, None, None)


_apply_rope_op.register_autograd(_backward, setup_context=_setup)


@dense_tensors_only
def apply_rope(q: Tensor, k: Tensor, positions: Tensor | None = None, inv_freq: Tensor | None = None, *,
               head_dim: int, rotary_dim: int | None = None, attention_scaling: float = 1.0,
               cos_sin: tuple | None = None, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """(RoPE(q), RoPE(k)) for q [..., H_q D] and k [..., H_kv D] (token-major, as a projection
    returns them: heads side by side along the last dim), differentiable in q and k.

    Equals Hugging Face's ``apply_rotary_pos_emb`` on the heads (rotate_half, or the interleaved
    convention), computed in fp32 and rounded once; the two results in allocations of their own.
    The angles come as in :func:`codetta.ops.rmsnorm_qkv_rope`: ``positions`` (one per token of q's leading dims) and
    ``inv_freq`` [R/2] with ``attention_scaling``, or ``cos_sin``, a Hugging Face rotary
    embedding's (cos, sin) [..., R] (broadcasting to q's leading dims, the two halves of each
    equal); rotary_dim R (default D) even and at most D (no power of two and no divisor of D
    needed here, unlike the QKV epilogue: Phi-3-mini's D = 96 rotates, and Phi-4-mini's 96 of
    128). q and k: fp16, bf16 or fp32, one
    dtype, the same leading dims, on one device. Returns [..., H_q D] and [..., H_kv D] in q's dtype.
    """
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor) or t.dim() < 1 or t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"apply_rope: {name} must be a tensor [..., heads * head_dim] in {KERNEL_DTYPES}, got "
                             + (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__))
    if k.shape[:-1] != q.shape[:-1] or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"apply_rope: q and k must share their leading dims, dtype and device, got q {q.dtype} "
                         f"{tuple(q.shape)} on {q.device} and k {k.dtype} {tuple(k.shape)} on {k.device}")
    head_dim, _, cos, sin = rope_tables_for(q, head_dim, positions, inv_freq, rotary_dim=rotary_dim,
                                            attention_scaling=attention_scaling, cos_sin=cos_sin,
                                            interleaved=interleaved, in_epilogue=False)
    if q.shape[-1] % head_dim or k.shape[-1] % head_dim or not q.shape[-1] or not k.shape[-1]:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} are not whole heads of {head_dim}")
    if not q.is_meta:  # on the meta device the registered op's fake implementation gives the shapes
        check_device(q.device, "q")
    q_out, k_out = _apply_rope_op(q, k, cos, sin, head_dim, interleaved)
    if torch._C._are_functorch_transforms_active():  # vmap's wrapped tensors do not tell whether they need one
        return q_out, k_out
    # one op rotates both; each output asks for a gradient only where its input does (as HF's would:
    # a frozen first layer's k under LoRA on q), so that attention keeps nothing for it
    return (q_out if q.requires_grad else q_out.detach()), (k_out if k.requires_grad else k_out.detach())

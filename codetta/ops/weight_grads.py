"""Weight gradients dW = dz^T h (the wgrad GEMM), optionally added into an existing ``.grad``.

With gradient accumulation over micro-batches, every backward after the first normally
costs one more pass per weight: the GEMM writes dW, then autograd's ``W.grad += dW`` reads
W.grad and dW and writes W.grad again. Inside :func:`accumulate_weight_grads`, codetta's
operators instead run the wgrad GEMM with an accumulating store into the existing W.grad:

    W.grad = round(W.grad + dz^T h)      (fp32 sum in the epilogue, one rounding)

and give autograd no gradient for that weight (it would add it a second time). So what
autograd does with a gradient does not happen for such a weight: a Python hook on its
gradient (``register_hook``, ``register_post_accumulate_grad_hook``) turns the fusion off
for it, but hooks that autograd's C++ side keeps, as DistributedDataParallel's reducer
does, cannot be seen:
**do not use it with DDP.** Weights that are not plain tensors (FSDP2's DTensors), weights
without a .grad yet (the first micro-batch), torch.compile and create_graph backward passes
take the usual path, and so do ``torch.autograd.grad`` and ``backward(inputs=...)`` passes
that do not accumulate into the weight's .grad. The layer operators are covered (linear_residual, rmsnorm_linear,
rmsnorm_swiglu, swiglu_mlp, rmsnorm_qkv_rope); ``linear`` is not, nor is linear_cross_entropy,
whose dW is computed in its forward.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from torch import Tensor

from .. import epilogue as ep
from ..matmul import gemm

_ENABLED = [0]  # nesting depth of accumulate_weight_grads(); read by autograd's worker threads too


@contextlib.contextmanager
def accumulate_weight_grads():
    """Within this context, backward passes through codetta's layer operators add each weight
    gradient into the weight's existing ``.grad`` in the wgrad GEMM's epilogue (see the
    module doc, and do not use it with DDP)::

        for batch in micro_batches:
            loss = model(**batch).loss / len(micro_batches)
            with codetta.ops.accumulate_weight_grads():
                loss.backward()
    """
    _ENABLED[0] += 1
    try:
        yield
    finally:
        _ENABLED[0] -= 1


def _engine_accumulates(w: Tensor) -> bool:
    """Whether the backward running now accumulates into the leaf w's .grad: ``loss.backward()``
    does, ``backward(inputs=...)`` without w does not, nor does ``torch.autograd.grad``, which
    returns the gradients it is asked for and leaves every .grad alone (PyTorch then refuses the
    question)."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(w).node)
    except RuntimeError:  # inside torch.autograd.grad
        return False


def _existing_grad(w: Tensor) -> Optional[Tensor]:
    """w's .grad to add into, or None: w must be a leaf (under autocast the operators get cast
    copies of the weights, whose gradients autograd carries to the leaves: no accumulation
    in the epilogue then) whose .grad this backward accumulates into."""
    if (type(w) is not torch.nn.Parameter and type(w) is not torch.Tensor) or not w.is_leaf \
            or not _engine_accumulates(w):
        return None
    g = w.grad
    # hooks on the weight's gradient (register_hook: a mask, a clip) or after its accumulation
    # must see each micro-batch's gradient: autograd's own accumulation then
    if type(g) is not torch.Tensor or getattr(w, "_backward_hooks", None) \
            or getattr(w, "_post_accumulate_grad_hooks", None):
        return None
    # a .grad the kernels cannot write as it is (a lazily negated or conjugated view): autograd's
    if g.shape != w.shape or g.dtype != w.dtype or g.device != w.device or g.is_neg() or g.is_conj():
        return None
    return g


def run_backward(ctx, weights: list[Tensor], op, math, *args, weight_args: tuple[int, ...], direct_only=None):
    """An operator's backward: ``op(*args, needs)``, its registered backward op, where ``needs``
    says per weight whether its gradient is wanted (``weight_args``: the positions of the
    operator's arguments that hold the weights, a list or one each); or, when some weight is
    frozen (requires no gradient) or, inside :func:`accumulate_weight_grads`, has a .grad to
    add into, ``math(*args, dweights_into=[per weight: an empty tensor, that .grad, or None])``,
    the same computation as a plain function, whose weight gradients for those weights come
    back empty (a frozen weight's wgrad GEMM is not run).

    The plain function only on the direct eager route (``ctx.direct``, see
    :mod:`codetta.ops.autograd`) with grad mode off: the registered ops stay pure, so
    torch.compile and tensor subclasses keep autograd's own accumulation; there the op skips
    the wgrad GEMMs of the weights autograd wants no gradient for (``needs``). ``direct_only``:
    keyword arguments that only the plain function takes, and the direct route only (the plain
    function then runs where one of them is true): a permission to write a gradient over a saved
    tensor (:func:`codetta.ops.autograd.saved_tensors_freed_after`), which a registered op,
    declared not to mutate its arguments, must not do.
    """
    if getattr(ctx, "direct", None) is not None:
        if not torch.is_grad_enabled():
            into = [_gradient_into(w) for w in weights]
            if any(t is not None for t in into) or any((direct_only or {}).values()):
                return math(*args, dweights_into=into, **(direct_only or {}))
        needs = [w.requires_grad for w in weights]
    else:  # the registered op's ctx: needs_input_grad shaped as the arguments (a list for a list of weights)
        needs = [bool(n) for i in weight_args for n in
                 (ctx.needs_input_grad[i] if isinstance(ctx.needs_input_grad[i], (list, tuple))
                  else (ctx.needs_input_grad[i],))]
    return op(*args, needs)


def skipping(weights: list[Tensor], needs: list[bool]) -> list:
    """``dweights_into`` for a backward op's math: nothing where every weight's gradient is
    wanted (one stacked wgrad GEMM), else an empty tensor (no GEMM) for each weight not wanted."""
    return [] if all(needs) else [None if need else w.new_empty(0) for w, need in zip(weights, needs)]


def _gradient_into(w: Tensor) -> Optional[Tensor]:
    """Where w's gradient goes (see :func:`weight_grads`): nowhere (an empty tensor: no GEMM) for a
    frozen weight, its .grad inside :func:`accumulate_weight_grads`, else None (a new tensor)."""
    if not w.requires_grad:
        return w.new_empty(0)
    return _existing_grad(w) if _ENABLED[0] else None


@functools.lru_cache(maxsize=None)
def weight_grad_program(dtype: torch.dtype, accumulate: bool) -> ep.Program:
    """dw = acc, or dw += acc (an accumulating store), stored in ``dtype``."""
    p = ep.Program("weight_grad_add" if accumulate else "weight_grad")
    p.store("dw", p.acc, dtype=dtype, accumulate=accumulate)
    return p


def any_weight_grad(dweights_into) -> bool:
    """Whether :func:`weight_grads` with this ``dweights_into`` computes any gradient (reads h):
    not where every weight is frozen (an empty tensor each)."""
    return not dweights_into or any(t is None or t.numel() > 0 for t in dweights_into)


def weight_grads(dz: Tensor, h: Optional[Tensor], weights: list[Tensor], dweights_into=()) -> list[Tensor]:
    """The gradients dW_i = dz_i^T h of the weights [N_i, d] whose outputs are the column blocks dz_i
    of dz [M, sum N_i], h [M, d].

    Without a tensor in ``dweights_into``: one GEMM, dz^T h, which holds every dW_i, stacked
    along the rows, in one [sum N_i, d] tensor, returned alone in a list (:func:`for_autograd`
    cuts it into per-weight views). One GEMM of sum N_i rows fills the GPU where a GEMM per weight
    (W_k and W_v have few rows) leaves most of it idle, and it launches once. Where
    ``dweights_into`` gives a tensor, a GEMM per weight instead: dW_i added into that tensor
    (nothing computed for an empty one, a frozen weight) and an empty tensor returned for it.
    h may be None where every weight is frozen (:func:`any_weight_grad` false).
    """
    into = list(dweights_into) or [None] * len(weights)
    if all(t is None for t in into):
        return [gemm(dz.t(), h)]
    parts = torch.split(dz, [w.shape[0] for w in weights], dim=-1)
    return [weight_grad(part, h, t) for part, t in zip(parts, into)]


def weight_grads_like(weights: list[Tensor], needs: list[bool]) -> list[Tensor]:
    """What :func:`weight_grads` returns with ``dweights_into=skipping(weights, needs)``, as empty
    tensors (a fake implementation's)."""
    if all(needs):
        return [weights[0].new_empty(sum(w.shape[0] for w in weights), weights[0].shape[1])]
    return [w.new_empty(w.shape if need else 0) for w, need in zip(weights, needs)]


def weight_grad(dz: Tensor, h: Optional[Tensor], into: Optional[Tensor]) -> Tensor:
    """dz^T h [N, d] for dz [M, N], h [M, d]; with ``into``, added into it instead (an empty
    ``into``: not computed, h may be None), and an empty tensor returned."""
    if into is None:
        return gemm(dz.t(), h)
    if into.numel() > 0:
        gemm(dz.t(), h, weight_grad_program(into.dtype, True), dw=into)
    return dz.new_empty(0)


def for_autograd(dws: list[Tensor], weights: list[Tensor]) -> list[Optional[Tensor]]:
    """The gradients of :func:`weight_grads` to hand autograd, one per weight: the stacked tensor cut
    into per-weight row blocks (views of it: autograd keeps them as the weights' .grad without a
    copy), None for those already added into .grad (their empty placeholder), and an empty tensor
    of its shape for a weight without elements (as eager PyTorch gives it)."""
    if len(dws) == 1 and len(weights) > 1:
        return list(dws[0].split([w.shape[0] for w in weights]))
    return [w.new_empty(w.shape) if w.numel() == 0 else None if dw.numel() == 0 else dw
            for dw, w in zip(dws, weights)]

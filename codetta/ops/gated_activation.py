"""``codetta.ops.gated_activation``: a gated MLP's act(gate) * up that no GEMM's epilogue computes,
one kernel each way.

Where the gate and up projections are not GEMMs codetta runs (PEFT LoRA adapters on them:
the projections are the model's own modules), the activation still need not be eager
PyTorch's ``act_fn(gate) * up``: that writes act(gate) [M, F], keeps gate, act(gate) and up for
the backward (three [M, F] tensors), and backward runs a product's backward and the
activation's, five passes more. Here :func:`codetta.kernels.swiglu.gated_activation` reads gate
and up and writes y = act(gate) * up (fp32, rounded once), and the backward is one pass of
:func:`codetta.kernels.swiglu.gated_activation_backward`,

    dgate = dy * up * act'(gate),   dup = dy * act(gate),

from the two saved inputs. The op is the custom op ``codetta::gated_activation`` (its backward
``codetta::gated_activation_backward``), so torch.compile traces it without a graph break.

A caller that hands gate and up over (``inputs_consumed``: nothing reads them after the op but
its backward — no other autograd node saved them, no module or hook kept them — as where
:func:`codetta.patch`'s layer called PEFT LoRA projections itself,
:func:`codetta.integrations.hf.architectures.output_owned_by_caller`) lets the backward write
dgate and dup over them, as it reads each element last, where autograd frees the saved tensors
after it (:func:`codetta.ops.autograd.saved_tensors_freed_after`): one pair of [M, F] tensors
less at the backward's peak. Leaves (parameters) and views are never written over. Their version
counters are bumped then, so a node that saved them after all raises, where autograd checks: not
under saved-tensor hooks (non-reentrant checkpointing among them), where it would read the
gradients as its activations: the promise is the caller's to keep.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.swiglu import gated_activation as gated_activation_kernel
from ..kernels.swiglu import gated_activation_backward
from ..matmul import KERNEL_DTYPES, check_device
from .activations import check_activation
from .autograd import arguments_needing_grad, direct_op, saved_tensors_freed_after
from .shapes import dense_tensors_only, rows


@direct_op("codetta::gated_activation")
def _gated_activation_op(gate: Tensor, up: Tensor, activation: str, inputs_consumed: bool) -> Tensor:
    return gated_activation_kernel(rows(gate), rows(up), activation=activation).reshape(gate.shape)


@_gated_activation_op.register_fake
def _(gate, up, activation, inputs_consumed):
    return gate.new_empty(gate.shape)


def _gradients(dy: Tensor, gate: Tensor, up: Tensor, activation: str, over_inputs: bool = False):
    """(dgate, dup) given dy; with ``over_inputs`` written over gate and up (contiguous, of
    separate storages) and their version counters bumped."""
    outs = dict(dgate_out=gate.view(-1, gate.shape[-1]), dup_out=up.view(-1, up.shape[-1])) if over_inputs else {}
    dgate, dup, _ = gated_activation_backward(rows(dy.to(gate.dtype)), rows(gate), rows(up), activation=activation,
                                              **outs)
    if over_inputs:
        for t in (gate, up):
            torch.autograd.graph.increment_version(t)
    return dgate.reshape(gate.shape), dup.reshape(gate.shape)


@direct_op("codetta::gated_activation_backward")
def _gated_activation_backward_op(dy: Tensor, gate: Tensor, up: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    return _gradients(dy, gate, up, activation)


@_gated_activation_backward_op.register_fake
def _(dy, gate, up, activation):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


def _setup(ctx, inputs, output):
    gate, up, activation, inputs_consumed = inputs
    ctx.save_for_backward(gate, up)
    ctx.activation, ctx.inputs_consumed = activation, inputs_consumed


def _backward(ctx, dy):
    gate, up = ctx.saved_tensors
    need_gate, need_up = arguments_needing_grad(ctx)[:2]
    if ctx.inputs_consumed and saved_tensors_freed_after(ctx):
        dgate, dup = _gradients(dy, gate, up, ctx.activation, over_inputs=True)
    else:
        dgate, dup = _gated_activation_backward_op(dy, gate, up, ctx.activation)
    return dgate if need_gate else None, dup if need_up else None, None, None


_gated_activation_op.register_autograd(_backward, setup_context=_setup)


@dense_tensors_only
def gated_activation(gate: Tensor, up: Tensor, activation: str = "silu", *, inputs_consumed: bool = False) -> Tensor:
    """act(gate) * up, computed in fp32 and rounded once; differentiable in gate and up.

    Equals ``(F.silu(gate.float()) * up.float()).to(gate.dtype)`` for SwiGLU, likewise for the
    other activations of :data:`codetta.ops.activations.GATE_ACTIVATIONS` ("silu", "gelu"
    (erf), "gelu_tanh", "relu"). gate and up: [..., F] of one shape, dtype (fp16, bf16 or
    fp32) and device. Returns [..., F] in their dtype.

    ``inputs_consumed=True`` promises that nothing reads gate and up after this call but its
    backward (nor saved them for its own backward), which may then write the gradients over them
    (see the module doc); taken where they are contiguous tensors made by autograd operations
    (not leaves, not views) of two storages.
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, Tensor) or t.dim() < 1 or t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"gated_activation: {name} must be a tensor [..., F] in {KERNEL_DTYPES}, got "
                             + (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__))
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"gated_activation: gate and up must share their shape, dtype and device, got gate "
                         f"{gate.dtype} {tuple(gate.shape)} on {gate.device} and up {up.dtype} {tuple(up.shape)} "
                         f"on {up.device}")
    check_activation(activation, "gated_activation: ")
    if not gate.is_meta:  # on the meta device the registered op's fake implementation gives the shapes
        check_device(gate.device, "gate")
    return _gated_activation_op(gate, up, activation, bool(inputs_consumed) and _writable_over(gate, up))


def _writable_over(gate: Tensor, up: Tensor) -> bool:
    """Whether the backward may write over gate and up: plain contiguous tensors that autograd
    operations made (not leaves such as parameters, not views of another tensor), of two storages."""
    return all(type(t) is Tensor and t.is_contiguous() and not t.is_meta and not t.is_leaf and not t._is_view()
               for t in (gate, up)) and gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()

"""Autograd plumbing shared by the custom ops."""

from __future__ import annotations


def only_first_output_differentiable(ctx, outputs):
    """In a custom op's setup_context: its outputs after the first (statistics, saved
    pre-activations) carry no gradient, and autograd passes None, not a tensor of zeros, for
    gradients that never arrived. Without this, every step would allocate and fill a zero
    gradient for each such output (on the host ~20 µs each, on the GPU a memset)."""
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*outputs[1:])

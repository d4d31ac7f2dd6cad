"""Gradient (activation) checkpointing of a patched decoder layer, as transformers does it.

transformers recomputes a decoder layer in the backward (a ``GradientCheckpointingLayer``
whose ``gradient_checkpointing`` is set, in training) in one of two places:

* up to 5.22, in the layer's ``__call__``, around ``Module.__call__``: that calls the
  forward codetta sets on the instance, so the fused forward is checkpointed as it is;
* from 5.23, in its class's ``forward`` (wrapped for each subclass), and only with
  gradients enabled: a forward set on the instance replaces that wrapper, so the fused
  forward checkpoints itself (:func:`run`), with the same changes to the cache arguments.

Whether a layer is recomputed also decides whether norm statistics may be handed to or from
it (:func:`recomputed`): a recomputed layer would find none the second time.
"""

from __future__ import annotations

import functools

import torch

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # earlier releases checkpoint in the model's layer loop, around the layer's call
    GradientCheckpointingLayer = None

CHECKPOINTS_IN_FORWARD = GradientCheckpointingLayer is not None and "__call__" not in vars(GradientCheckpointingLayer)
# the KV cache's argument under the names transformers' layers give it; set to None when recomputed
_CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")


def recomputed(layer) -> bool:
    """Whether the model recomputes this layer's forward in the backward (checkpointing is on for
    it, in training; with transformers' ``every_n_layers`` not every layer is)."""
    return layer.training and bool(getattr(layer, "gradient_checkpointing", False))


def run(forward, layer, hidden_states, **kwargs):
    """``forward(layer, hidden_states, **kwargs)``, checkpointed where the layer's class forward,
    which ``forward`` replaces, would checkpoint (transformers 5.23 and later): without a cache
    argument (unless the layer may keep it, ``_can_checkpoint_with_cache``) and ``use_cache=False``,
    as transformers passes them."""
    if not (CHECKPOINTS_IN_FORWARD and isinstance(layer, GradientCheckpointingLayer) and recomputed(layer)
            and torch.is_grad_enabled()):
        return forward(layer, hidden_states, **kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not layer._can_checkpoint_with_cache:
        kwargs.update({name: None for name in _CACHE_ARGUMENTS if kwargs.get(name) is not None})
    return layer._gradient_checkpointing_func(functools.partial(forward, layer, **kwargs), hidden_states)

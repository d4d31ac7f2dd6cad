"""The activations a gated MLP's epilogue takes: y = act(z_g) * z_u.

By the name PyTorch gives each: ``"silu"`` (SwiGLU: Llama and most families), ``"gelu"``
(the exact, erf form: GeGLU), ``"gelu_tanh"`` (GELU's tanh approximation: Gemma's
``gelu_pytorch_tanh``) and ``"relu"`` (ReGLU). Their derivatives, which the backward kernel
computes, are in :mod:`codetta.kernels.swiglu`.
"""

from __future__ import annotations

from .. import epilogue as ep
from ..epilogue.reference import eager_unary

# the op's name -> the epilogue's unary function of it
_ACTIVATIONS = {"silu": "silu", "gelu": "gelu_erf", "gelu_tanh": "gelu_tanh", "relu": "relu"}
GATE_ACTIVATIONS = tuple(_ACTIVATIONS)


def check_activation(activation, prefix: str = "") -> str:
    """The name, if it is one of :data:`GATE_ACTIVATIONS`; else a ValueError starting with
    ``prefix`` (the operator's name, where its other messages give it)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{prefix}activation must be one of {', '.join(map(repr, GATE_ACTIVATIONS))}, "
                         f"got {activation!r}")
    return activation


def epilogue_activation(activation: str):
    """The activation as an epilogue function (of an :class:`codetta.epilogue.Expr`)."""
    return getattr(ep, _ACTIVATIONS[activation])


def eager_activation(activation: str):
    """The activation as eager PyTorch computes it (the references'), as the epilogue's reference executor does."""
    return eager_unary(_ACTIVATIONS[activation])

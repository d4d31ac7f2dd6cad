"""The activations a gated MLP's epilogue takes: y = act(z_g) * z_u.

By the name PyTorch gives each: ``"silu"`` (SwiGLU: Llama and most families), ``"gelu"``
(the exact, erf form: GeGLU), ``"gelu_tanh"`` (GELU's tanh approximation: Gemma's
``gelu_pytorch_tanh``) and ``"relu"`` (ReGLU). Their derivatives, which the backward kernel
computes, are in :mod:`codetta.kernels.swiglu`.
"""

from __future__ import annotations

import torch.nn.functional as F

from .. import epilogue as ep

# name -> (the epilogue's function, eager PyTorch's)
_ACTIVATIONS = {
    "silu": (ep.silu, F.silu),
    "gelu": (ep.gelu_erf, F.gelu),
    "gelu_tanh": (ep.gelu_tanh, lambda z: F.gelu(z, approximate="tanh")),
    "relu": (ep.relu, F.relu),
}
GATE_ACTIVATIONS = tuple(_ACTIVATIONS)


def check_activation(activation) -> str:
    """The name, if it is one of :data:`GATE_ACTIVATIONS`; else a ValueError."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, GATE_ACTIVATIONS))}, got {activation!r}")
    return activation


def epilogue_activation(activation: str):
    """The activation as an epilogue function (of an :class:`codetta.epilogue.Expr`)."""
    return _ACTIVATIONS[activation][0]


def eager_activation(activation: str):
    """The activation as eager PyTorch computes it (the references' and the unfused paths')."""
    return _ACTIVATIONS[activation][1]

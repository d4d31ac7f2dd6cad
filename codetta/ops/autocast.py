"""The operators under ``torch.autocast``: their GEMM operands in autocast's dtype.

Mixed-precision training keeps fp32 parameters and runs the model under
``torch.autocast(device, dtype=torch.bfloat16)``, which casts the inputs of every matmul
(``F.linear``) to bf16 while the rest (the residual adds, the norms) stays fp32: the
residual stream of a transformers model is then fp32. codetta's operators are GEMMs with
their surroundings fused in, so :func:`casts_under_autocast` does what autocast would do
to their pieces: when autocast is on for the device of the first argument, the GEMM
operands named (activations fed to a matmul, weights, biases) are cast to autocast's dtype
(a differentiable cast: fp32 parameters get fp32 gradients), and the operator runs with
autocast off. The residual stream (``streams``) keeps fp32, which the operators take with
16-bit weights (:mod:`codetta.ops.rmsnorm`); a 16-bit stream of the other dtype (an fp16
model under bf16 autocast) becomes fp32, as the model's first residual add (fp16 + bf16)
makes it. Norm weights are not cast: the epilogues read them in fp32, as the model's own fp32
norm does (``linear_cross_entropy``'s x is a stream only with its optional final norm;
without one, x is the GEMM's operand and is cast). Arguments that must keep their precision (RoPE's ``inv_freq``, positions, targets)
are not named; of the norm statistics ``stats = (u, rstd)`` handed between operators only
u is cast.
"""

from __future__ import annotations

import functools
import inspect

import torch


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def autocast_enabled(device: str) -> bool:
    """Whether autocast is on for ``device``; False for device types autocast does not know
    (meta): the operator then says what it makes of such tensors."""
    try:
        return torch.is_autocast_enabled(device)
    except RuntimeError:
        return False


def stream_under_autocast(stream: torch.dtype, autocast: torch.dtype) -> torch.dtype:
    """The dtype a residual stream of dtype ``stream`` takes in the operators under autocast to
    ``autocast``: fp32 for a 16-bit stream of the other dtype (see the module doc), else its own."""
    return torch.float32 if stream in (torch.float16, torch.bfloat16) and stream != autocast else stream


def casts_under_autocast(*names: str, streams: tuple = (), streams_if: tuple = ()):
    """Decorator for an operator's public function: under autocast on the first argument's
    device, the arguments ``names`` are cast to autocast's dtype, and those in ``streams``
    to fp32 where they are 16-bit of another dtype (see the module doc); ``streams_if``: (name,
    other) pairs, ``name`` a stream when the argument ``other`` is given (not None), else cast as
    ``names``."""

    def decorate(fn):
        signature = inspect.signature(fn)
        missing = set(names + streams + tuple(n for pair in streams_if for n in pair)) - set(signature.parameters)
        if missing:
            raise TypeError(f"{fn.__name__} has no parameters {sorted(missing)}")

        first_name = next(iter(signature.parameters))

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            first = args[0] if args else kwargs.get(first_name)  # passed by position or by name
            device = first.device.type if isinstance(first, torch.Tensor) else None
            if device is None or not autocast_enabled(device):
                return fn(*args, **kwargs)
            dtype = torch.get_autocast_dtype(device)
            bound = signature.bind(*args, **kwargs)
            given = {name: bound.arguments.get(other) is not None for name, other in streams_if}
            for name in (*names, *(n for n, stream in given.items() if not stream)):
                stats = bound.arguments.get(name) if name == "stats" else None
                if stats is not None:  # (u, rstd): rstd stays fp32
                    u, rstd = stats
                    bound.arguments[name] = stats.with_u(_cast(u, dtype)) if hasattr(stats, "with_u") \
                        else (_cast(u, dtype), rstd)
                elif name in bound.arguments:
                    bound.arguments[name] = _cast(bound.arguments[name], dtype)
            for name in (*streams, *(n for n, stream in given.items() if stream)):
                value = bound.arguments.get(name)
                if isinstance(value, torch.Tensor):
                    bound.arguments[name] = value.to(stream_under_autocast(value.dtype, dtype))
            with torch.autocast(device, enabled=False):
                return fn(*bound.args, **bound.kwargs)

        return wrapper

    return decorate

"""Shapes and layouts of the operators' tensors."""

from __future__ import annotations

import functools
import inspect
import math
from typing import Optional

import torch
from torch import Tensor

from ..matmul import KERNEL_DTYPES, layout_problem


def rows(t: Tensor) -> Tensor:
    """t [..., n] as [M, n], M the product of the leading dims (1 for a 1-d t): also where M or n
    is 0, which ``reshape(-1, n)`` and ``reshape(M, -1)`` cannot infer."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def described(t) -> str:
    """What an argument is, for an error message: a tensor's shape and dtype, else its type."""
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__


def broadcasts_to(shape, target) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` (``torch.broadcast_shapes(shape,
    target) == target``, without its ~25 µs of host time, paid per layer and step)."""
    return len(shape) <= len(target) and all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


def check_vector(name: str, t, n: int, device) -> None:
    """``t`` must be an [n] tensor on ``device`` in a dtype the kernels take (a norm weight, a bias)."""
    if not isinstance(t, Tensor) or t.shape != (n,) or t.dtype not in KERNEL_DTYPES or t.device != device:
        got = f"{described(t)} {t.device}" if isinstance(t, Tensor) else described(t)
        raise ValueError(f"{name} must be an [{n}] tensor in one of {KERNEL_DTYPES} on {device}, got {got}")


def check_biases(bias, names: tuple[str, ...], dims: tuple[int, ...], device) -> tuple:
    """``bias`` (None, or a tuple of one optional vector per name) checked: each a floating point
    vector of its projection's outputs (``dims``) on ``device``; returned as a tuple (Nones without)."""
    if bias is None:
        return (None,) * len(names)
    if not isinstance(bias, (tuple, list)) or len(bias) != len(names):
        got = f"{len(bias)} entries" if isinstance(bias, (tuple, list)) else f"a {type(bias).__name__}"
        raise ValueError(f"bias must be a tuple ({', '.join(names)}), each a tensor or None, got {got}")
    for name, b, n in zip(names, bias, dims):
        if b is not None:
            check_vector(name, b, n, device)
    return tuple(bias)


def concat_biases(biases: tuple, dims: tuple[int, ...]) -> Optional[Tensor]:
    """The checked ``biases`` (see :func:`check_biases`) as one vector, zeros of ``dims[i]`` for a
    missing one; None when all are missing."""
    given = [b for b in biases if b is not None]
    if not given:
        return None
    return torch.cat([b if b is not None else given[0].new_zeros(n) for b, n in zip(biases, dims)])


def _dense(value) -> bool:
    """Whether ``value`` is no sparse or nested tensor, nor a list or tuple holding one."""
    if isinstance(value, Tensor):
        return layout_problem(value) is None
    if isinstance(value, (list, tuple)):
        return all(map(_dense, value))
    return True


def _not_dense(value) -> Tensor:
    """The sparse or nested tensor that ``value`` is or holds (``_dense(value)`` is False)."""
    if isinstance(value, Tensor):
        return value
    return _not_dense(next(v for v in value if not _dense(v)))


def dense_tensors_only(fn):
    """Decorator for an operator's public function: an argument that is a sparse or a nested
    tensor, or a list or tuple holding one, is refused with a ValueError that names it, before
    the operator reshapes or reads it (PyTorch's own errors from there say little)."""
    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not (all(map(_dense, args)) and all(map(_dense, kwargs.values()))):
            name, tensor = next((name, _not_dense(value)) for name, value in (*zip(names, args), *kwargs.items())
                                if not _dense(value))
            raise ValueError(f"{fn.__name__}: {name} {layout_problem(tensor)}")
        return fn(*args, **kwargs)

    return wrapper

"""Shapes of the operators' tensors."""

from __future__ import annotations

import math

from torch import Tensor


def rows(t: Tensor) -> Tensor:
    """t [..., n] as [M, n], M the product of the leading dims (1 for a 1-d t): also where M or n
    is 0, which ``reshape(-1, n)`` and ``reshape(M, -1)`` cannot infer."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])

"""``codetta.linear``: torch.nn.functional.linear as the simplest epilogue program."""

import functools

from .. import epilogue as ep
from ..matmul import GemmError, gemm


@functools.lru_cache(maxsize=None)
def _program(with_bias: bool) -> ep.Program:
    p = ep.Program("linear_bias" if with_bias else "linear")
    y = p.acc + p.col("bias") if with_bias else p.acc
    p.store("out", y)
    return p


def linear(x, weight, bias=None):
    """y = x W^T + b, equal to ``torch.nn.functional.linear`` (forward only).

    x: [..., K]; weight: [N, K] as nn.Linear stores it; bias: [N] or None.
    """
    operands = {} if bias is None else {"bias": bias}
    if getattr(weight, "dim", lambda: 0)() != 2:
        raise GemmError(f"weight must be 2-d [N, K], got shape {tuple(getattr(weight, 'shape', ()))}")
    return gemm(x, weight.t(), _program(bias is not None), **operands)["out"]

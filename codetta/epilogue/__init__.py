"""The epilogue language (programs over a GEMM's output tile) and its two executors.

The language (values, widths, pairs and segments, outputs) is described in
:mod:`codetta.epilogue.ir` (``help(codetta.epilogue.ir)``); :func:`run_reference` runs a
program in plain PyTorch, :func:`kernel_source` shows the Triton kernel generated for it.
"""

from .codegen import kernel_source
from .ir import (
    FULL,
    HALF,
    EpilogueError,
    Expr,
    Program,
    Width,
    abs,
    cos,
    exp,
    floor,
    fma,
    gelu_erf,
    gelu_tanh,
    join,
    log,
    maximum,
    minimum,
    pairs,
    reciprocal,
    relu,
    round_to,
    rsqrt,
    segment_max,
    segment_sum,
    sigmoid,
    silu,
    sin,
    sqrt,
    square,
    tanh,
    where,
)
from .reference import run_reference

__all__ = [
    "FULL", "HALF", "EpilogueError", "Expr", "Program", "Width", "abs", "cos", "exp", "floor", "fma",
    "gelu_erf", "gelu_tanh", "join", "kernel_source", "log", "maximum", "minimum", "pairs", "reciprocal",
    "relu", "round_to", "rsqrt", "run_reference", "segment_max", "segment_sum", "sigmoid", "silu", "sin",
    "sqrt", "square", "tanh", "where",
]

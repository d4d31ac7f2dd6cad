"""codetta: the memory-bound parts of a Transformer block, run in GEMM epilogues.

``codetta.gemm(a, b, epilogue=program, **operands)`` multiplies like torch.matmul and
runs an epilogue program (:mod:`codetta.epilogue`) on each output tile while it is
still on chip. ``codetta.linear`` is the simplest such program.
"""

from . import epilogue
from .epilogue import EpilogueError, Program, kernel_source, run_reference
from .matmul import Config, GemmError, explain, gemm
from .ops import linear

__version__ = "0.1.0"

__all__ = [
    "Config", "EpilogueError", "GemmError", "Program", "epilogue", "explain", "gemm", "kernel_source", "linear",
    "run_reference",
]

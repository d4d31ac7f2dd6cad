"""codetta: the memory-bound parts of a Transformer block, run in GEMM epilogues.

``codetta.gemm(a, b, epilogue=program, **operands)`` multiplies like torch.matmul and
runs an epilogue program (:mod:`codetta.epilogue`) on each output tile while it is
still on chip. ``codetta.linear`` is the simplest such program.

Without a CUDA GPU, codetta runs its kernels in Triton's CPU interpreter (slow, for
tests and small demos).
"""

import os as _os

import torch as _torch

if not _torch.cuda.is_available():
    # No GPU: run the real kernels in Triton's CPU interpreter. This must be decided before
    # Triton decorates codetta's kernels, i.e. here; set TRITON_INTERPRET yourself to override.
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from . import epilogue  # noqa: E402
from .epilogue import EpilogueError, Program, kernel_source, run_reference  # noqa: E402
from .matmul import Config, GemmError, explain, gemm, interleave  # noqa: E402
from .ops import linear  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Config", "EpilogueError", "GemmError", "Program", "epilogue", "explain", "gemm", "interleave", "kernel_source",
    "linear",
    "run_reference",
]

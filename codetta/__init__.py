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


def patch(model, **options):
    """Patch a Hugging Face causal LM in place to run codetta's fused operators; see
    :func:`codetta.integrations.hf.patch` (imports transformers on first use)."""
    from .integrations.hf import patch as _patch

    return _patch(model, **options)


def unpatch(model):
    """Undo :func:`patch`."""
    from .integrations.hf import unpatch as _unpatch

    return _unpatch(model)

__all__ = [
    "Config", "EpilogueError", "GemmError", "Program", "epilogue", "explain", "gemm", "interleave", "kernel_source",
    "linear", "patch", "run_reference", "unpatch",
]

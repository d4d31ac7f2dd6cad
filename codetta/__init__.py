"""codetta: the memory-bound parts of a Transformer block, run in GEMM epilogues.

``codetta.gemm(a, b, epilogue=program, **operands)`` multiplies like torch.matmul and
runs an epilogue program (:mod:`codetta.epilogue`) on each output tile while it is
still on chip. ``codetta.linear`` is the simplest such program.

Without a CUDA GPU, codetta runs its kernels in Triton's CPU interpreter (slow, for
tests and small demos).
"""

import os as _os
import sys as _sys
import warnings as _warnings

import torch as _torch

if not _torch.cuda.is_available() and "TRITON_INTERPRET" not in _os.environ:
    # No GPU: run the real kernels in Triton's CPU interpreter. This must be decided before
    # Triton decorates any kernel, its own library's included (at ``import triton``); set
    # TRITON_INTERPRET yourself to override.
    if "triton" in _sys.modules:
        _warnings.warn("codetta: there is no CUDA GPU, and triton was imported before codetta (torch.compile and "
                       "transformers' models import it), so Triton's CPU interpreter can no longer be turned on: "
                       "codetta's kernels will refuse to run. Set TRITON_INTERPRET=1 in the environment, or import "
                       "codetta first.", stacklevel=2)
    else:
        _os.environ["TRITON_INTERPRET"] = "1"

from .interpreter import interpreting as _interpreting, skip_repeated_language_patches as _skip_repeats  # noqa: E402

if _interpreting():
    _skip_repeats()

from . import epilogue  # noqa: E402
from .epilogue import EpilogueError, Program, kernel_source, run_reference  # noqa: E402
from .matmul import Config, GemmError, explain, gemm, interleave  # noqa: E402
from . import ops  # noqa: E402
from .ops import linear  # noqa: E402
from .integrations import UnsupportedModelError  # noqa: E402
from . import nn  # noqa: E402

__version__ = "0.1.0"


def _hf():
    """codetta.integrations.hf, imported on first use (it needs transformers)."""
    try:
        from .integrations import hf
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise
        raise ModuleNotFoundError('codetta.patch needs transformers: pip install "codetta[hf]"',
                                  name="transformers") from e
    return hf


def patch(model, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True, cross_entropy: bool = True):
    """Patch a Hugging Face model of a Llama-shaped family (Llama, Mistral, Qwen2, Qwen3, ...: see
    :data:`codetta.integrations.hf.architectures.ARCHITECTURES`; its causal LM, bare
    decoder, or sequence-classification, token-classification or QA model) in place to run codetta's
    fused operators, and return it: ``rms_norm`` folds each RMSNorm that a GEMM reads into the
    GEMMs around it (the others, such as Gemma 2's output norms, run as ``codetta.ops.rms_norm``),
    ``rope`` and ``swiglu`` run in the QKV and gate/up epilogues (they need ``rms_norm``),
    ``cross_entropy`` fuses a causal LM's head with the loss when labels are given in training mode. See
    :func:`codetta.integrations.hf.patch`."""
    return _hf().patch(model, rms_norm=rms_norm, rope=rope, swiglu=swiglu, cross_entropy=cross_entropy)


def unpatch(model):
    """Undo :func:`patch`."""
    return _hf().unpatch(model)

__all__ = [
    "Config", "EpilogueError", "GemmError", "Program", "epilogue", "explain", "gemm", "interleave", "kernel_source",
    "linear", "nn", "ops", "patch", "run_reference", "UnsupportedModelError", "unpatch",
]

"""Integrations of codetta's fused operators into model libraries."""

import warnings

import torch


class UnsupportedModelError(ValueError):
    """The model (or an option of it) is not one codetta can patch; nothing was changed."""


def warn_unless_traced(message: str, stacklevel: int = 1) -> None:
    """``warnings.warn(message)`` from a patched forward, except while torch.compile traces it:
    Dynamo cannot trace ``warnings.warn`` (the graph would break there, and ``fullgraph=True``
    fail), so a compiled forward says nothing, as transformers' own forwards do."""
    if not torch.compiler.is_compiling():
        warnings.warn(message, stacklevel=stacklevel + 1)

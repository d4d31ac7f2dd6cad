"""Transformer operators built from epilogue programs."""

from .linear import linear

__all__ = ["linear"]

"""Transformer operators built from epilogue programs."""

from .linear import linear
from .rmsnorm import linear_residual, rmsnorm_linear

__all__ = ["linear", "linear_residual", "rmsnorm_linear"]

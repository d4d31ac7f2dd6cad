"""Transformer operators built from epilogue programs."""

from .apply_rope import apply_rope
from .compile_cache import key_compile_caches_on_source
from .cross_entropy import linear_cross_entropy
from .gated_activation import gated_activation
from .linear import linear
from .mlp import swiglu_mlp
from .norm import rms_norm
from .rmsnorm import linear_residual, rmsnorm_linear
from .rope import rmsnorm_qkv_rope
from .swiglu import rmsnorm_swiglu
from .weight_grads import accumulate_weight_grads

__all__ = [
    "accumulate_weight_grads", "apply_rope", "gated_activation", "linear_cross_entropy", "linear", "linear_residual",
    "rms_norm", "rmsnorm_linear", "rmsnorm_qkv_rope", "rmsnorm_swiglu", "swiglu_mlp",
]

key_compile_caches_on_source()

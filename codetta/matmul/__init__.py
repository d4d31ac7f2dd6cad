"""The GEMM kernel: the fixed mainloop, its configs and tuning, and the launcher (codetta.gemm)."""

from .config import Config
from .launch import GemmError, check_device, explain, gemm, interleave, interpreting, large_interpreter_tiles

__all__ = ["Config", "GemmError", "check_device", "explain", "gemm", "interleave", "interpreting",
           "large_interpreter_tiles"]

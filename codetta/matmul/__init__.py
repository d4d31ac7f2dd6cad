"""The GEMM kernel: the fixed mainloop, its configs and tuning, and the launcher (codetta.gemm).

A call goes through ``call`` (checked), ``path`` (TMA or pointers), ``tuning`` (a config),
``plan`` (the launch, made once per signature) and ``writes`` (what it may write in place);
``launch`` holds ``gemm`` and ``explain``.
"""

from .call import KERNEL_DTYPES, GemmError, check_device, interleave, layout_problem
from .config import Config
from .launch import explain, gemm, large_interpreter_tiles

__all__ = ["Config", "GemmError", "KERNEL_DTYPES", "check_device", "explain", "gemm", "interleave", "layout_problem",
           "large_interpreter_tiles"]

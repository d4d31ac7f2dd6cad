"""A program's GEMM kernel compiled for a GPU on a machine without one (ahead of time).

:func:`compile_gemm` gives the Triton ``CompiledKernel`` of ``program``'s kernel for an NVIDIA
target (Hopper, sm_90, by default) from the argument types the launcher would pass (TMA
descriptors with their block shapes, pointers, strides), not from tensors: no GPU and no CUDA
driver are needed, only a Triton that compiles (its interpreter off: ``TRITON_INTERPRET`` unset
or 0 when Triton is imported) and the ptxas it ships. Triton's interpreter runs a kernel as
Python, which takes code the compiler refuses (e.g. two returns of different types in the
branches of a ``constexpr`` if): compiling on the CPU catches that before a GPU run
(``tests/test_compile_for_hopper.py``), and the compiled kernel tells its registers, spills and
shared memory (``bench/ttgir_probe.py``).
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ..epilogue.codegen import kernel_args, load_kernel
from ..epilogue.ir import FULL, Program
from .call import MAX_B_PARTS
from .config import Config
from .path import one_k_loop

HOPPER_TARGET = GPUTarget("cuda", 90, 32)  # sm_90, warps of 32 threads
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compile_kernel(kernel, signature: dict, constexprs: dict, options: dict, target: GPUTarget = HOPPER_TARGET):
    """``kernel`` (a ``triton.jit`` function) compiled for ``target``: ``signature`` maps its
    runtime arguments to Triton types ("*bf16", "i32", "tensordesc<bf16[128, 64]>", ...),
    ``constexprs`` gives the others their values."""
    names = kernel.arg_names
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    missing = [name for name in names if name not in signature]
    if missing:
        raise ValueError(f"{kernel.__name__}: no type or value for {missing}")
    source = ASTSource(kernel, signature, {(names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(source, target=target, options=options)


def compile_gemm(program: Program, path: str, config: Config, *, dtype: torch.dtype = torch.bfloat16,
                 a_km: bool = False, b_kn: bool = False, b_parts: str = "n", num_b: int = 1,
                 target: GPUTarget = HOPPER_TARGET):
    """``program``'s kernel on ``path`` ('tma' or 'ptr') compiled for ``target`` with ``config``,
    for A and B of ``dtype`` in the layout ``a_km`` (A stored [K, M]: wgrad), ``b_kn`` (B stored
    [K, N]: dgrad) and ``num_b`` B parts read as one along ``b_parts`` ("n", "k", "interleave",
    or "interleave_one[_swapped]": two parts through one descriptor), as
    :class:`codetta.matmul.plan.Plan` would launch it. Operands and aux tiles are taken in the
    GEMM's dtype, row and column vectors and tables in fp32."""
    elem, tma = _TYPES[dtype], path == "tma"
    cfg = config
    sig = {"M": "i32", "N": "i32", "K": "i32"}
    parts = ("i32",) * num_b
    sig.update(b_starts=parts, b_ends=parts)
    one_descriptor = b_parts.startswith("interleave_one")
    if tma:
        bn = cfg.BN // 2 if b_parts.startswith("interleave") else cfg.BN
        sig["a"] = _descriptor(elem, [cfg.BK, cfg.BM] if a_km else [cfg.BM, cfg.BK])
        sig.update({f"b{i}": _descriptor(elem, [cfg.BK, bn] if b_kn else [bn, cfg.BK]) for i in range(num_b)})
        if one_descriptor:  # both parts through b0's; b1 is None
            sig["b0"] = _descriptor(elem, [bn, 2, cfg.BK])
    else:
        sig["a"] = f"*{elem}"
        sig.update({f"b{i}": f"*{elem}" for i in range(num_b)})
    sig.update(stride_a0="i32", stride_a1="i32", stride_b0=parts, stride_b1=parts)
    unused = {}  # a store per part of B: the arguments of the parts past num_b are None
    for name, kind in kernel_args(program, path):
        if kind in ("part", "part_desc") and int(name[-1]) >= num_b:
            unused[name] = None
        else:
            sig[name] = _argument_type(program, name, kind, elem, cfg)
    constexprs = dict(unused,BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, STAGES=cfg.STAGES,
                      EPI_SPLIT=cfg.EPI_SPLIT, FLATTEN=cfg.FLATTEN and tma and one_k_loop(b_parts, num_b), NUM_B=num_b,
                      B_PARTS=b_parts, A_KM=a_km, B_KN=b_kn, INTERPRET=False,
                      PRECISION="ieee" if dtype == torch.float32 else "tf32",
                      **{f"b{i}": None for i in range(1 if one_descriptor else num_b, MAX_B_PARTS)})
    return compile_kernel(load_kernel(program, path), sig, constexprs, cfg.launch_options(), target)


def _descriptor(elem: str, block: list) -> str:
    return f"tensordesc<{elem}[{', '.join(map(str, block))}]>"


def _argument_type(program, name, kind, elem, cfg):
    """The Triton type of one of the program's kernel arguments (see ``kernel_args``)."""
    base = name.rpartition("_")[0]
    if kind in ("row", "col", "table", "partial"):
        return "*fp32"
    if kind == "scalar":
        return "fp32"
    per_part = base in program.outputs and program.outputs[base].per_b_part
    if kind == "stride":
        return ("i32",) * MAX_B_PARTS if per_part else "i32"
    if kind == "aux":
        return f"*{elem}"
    if kind in ("out", "part"):
        return f"*{_output_type(program, base, elem)}"
    if kind == "table_desc":
        return _descriptor("fp32", [cfg.BM, program.operands[base].period])
    stored = kind in ("out_desc", "part_desc")
    owner = program.outputs[base] if stored else program.operands[base]
    width = cfg.epilogue_bn if owner.width is FULL else cfg.epilogue_bn // 2
    return _descriptor(_output_type(program, base, elem) if stored else elem, [cfg.BM, width])


def _output_type(program, name, elem):
    out = program.outputs[name]
    if out.kind != "store":
        return "fp32"  # per-segment reductions
    return _TYPES[out.dtype] if out.dtype is not None else elem

"""Compile an op's generated kernel for Hopper (sm_90) without a GPU and report its costs.

    python bench/ttgir_probe.py

Per GEMM epilogue program and config: layout conversions (``ttg.convert_layout``: an epilogue's go
through shared memory once per tile), dots and TMA copies counted in the TTGIR; and from the
cubin (``cuobjdump -res-usage``) the registers per thread and the stack frame, which is
where registers spill to (local memory: L1, then L2). Shared memory from Triton's metadata.
So an epilogue's register pressure can be checked on a CPU-only machine, before a GPU
measures it. Then the memory-bound kernels of codetta.kernels at their GPU tiles: registers,
spills and how many warps per SM their registers allow (their bandwidth wants many). bf16 operands, all epilogue tiles through TMA descriptors. The local Triton
may differ from the GPU machine's in its register allocation: compare programs and configs
with each other, not with absolute limits.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (before codetta is imported)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from codetta import Config, epilogue as ep  # noqa: E402
from codetta.matmul.aot import compile_gemm, compile_kernel  # noqa: E402
from codetta.matmul.path import table_block_n  # noqa: E402
from codetta.ops import rope, swiglu  # noqa: E402

_COUNTED = {"layout conversions": r"ttg\.convert_layout", "dots": r"ttng\.warp_group_dot ",
            "TMA loads": r"async_tma_copy_global_to_local", "TMA stores": r"async_tma_copy_local_to_global"}


def compile_sm90(program, *, BM=128, BN=256, BK=64, num_b=1, warps=8, stages=3, split=1, flatten=False, ctas_per_sm=1):
    """``program``'s TMA kernel compiled for sm_90 with one config (a triton CompiledKernel)."""
    config = Config(BM=BM, BN=BN, BK=BK, STAGES=stages, num_warps=warps, EPI_SPLIT=split, FLATTEN=flatten,
                    CTAS_PER_SM=ctas_per_sm)
    return compile_gemm(program, "tma", config, num_b=num_b)


def resources(compiled) -> dict:
    """Registers per thread and stack (spill) bytes per thread of the cubin, shared memory in KiB."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    regs, stack = found.groups() if found else ("?", "?")
    return {"registers": regs, "stack bytes": stack, "shared KiB": compiled.metadata.shared // 1024}


CONFIGS = {  # name -> compile_sm90 keyword arguments
    "128x256 split 1": dict(), "128x256 split 2": dict(split=2), "128x256 flattened": dict(flatten=True),
    "128x256 split 2 flattened": dict(split=2, flatten=True), "128x256 split 4": dict(split=4),
    "128x256 split 4, 4 stages": dict(split=4, stages=4), "128x128 8 warps": dict(BN=128, stages=4),
    # two CTAs per SM (Config.CTAS_PER_SM = 2): each under 113 KiB, and 8 warps capped at 128 registers
    "128x128 4 warps, 2 per SM": dict(BN=128, warps=4, stages=2, ctas_per_sm=2),
    "128x128 4 warps split 2, 2 per SM": dict(BN=128, warps=4, stages=3, split=2, ctas_per_sm=2),
    "128x128 8 warps, 2 per SM": dict(BN=128, warps=8, stages=2, ctas_per_sm=2),
    "128x128 8 warps split 2, 2 per SM": dict(BN=128, warps=8, stages=3, split=2, ctas_per_sm=2),
}


def main():
    import torch

    from codetta.ops import cross_entropy, rmsnorm

    plain = ep.Program("probe_plain")
    plain.store("y", plain.acc)
    programs = {
        "plain GEMM": (plain, 1), "RMSNorm + QKV + RoPE (3 parts)": (rope._forward_program(128, False, 0), 3),
        "RMSNorm + QKV + interleaved RoPE (3 parts)": (rope._forward_program(128, False, 0, True), 3),
        "RMSNorm + gate/up + SwiGLU": (swiglu._forward_program(False, "silu"), 1),
        "residual + norm statistics": (rmsnorm._producer(torch.bfloat16, True, False), 1),
        "norm backward": (rmsnorm._consumer_backward(), 1),
        "cross-entropy loss": (cross_entropy._loss_program(False), 1),
    }
    for name, (program, num_b) in programs.items():
        for config, kwargs in CONFIGS.items():
            if kwargs.get("flatten") and num_b > 1:
                continue  # the launcher flattens only a B of one part
            if kwargs.get("BN", 256) // kwargs.get("split", 1) < max(program.min_block_n(), table_block_n(program)):
                continue  # nor gives an epilogue tiles narrower than its segments or its tables' periods
            try:
                compiled = compile_sm90(program, num_b=num_b, **kwargs)
            except Exception as exc:  # report and go on: this is a probe
                print(f"{name}, {config}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
                continue
            text = compiled.asm["ttgir"]
            counts = {k: len(re.findall(v, text)) for k, v in _COUNTED.items()}
            print(f"{name}, {config}: " + ", ".join(f"{k} {v}" for k, v in {**counts, **resources(compiled)}.items()),
                  flush=True)


def compile_row_kernel(kernel, pointers: dict, scalars: dict, constexprs: dict, warps: int):
    """A memory-bound kernel of codetta.kernels compiled for sm_90: pointer arguments by element
    type, scalar arguments by type, the rest constexprs."""
    signature = {**{name: f"*{ty}" for name, ty in pointers.items()}, **scalars}
    unnamed = {name: None for name in kernel.arg_names if name not in signature and name not in constexprs}
    return compile_kernel(kernel, signature, {**unnamed, **constexprs}, dict(num_warps=warps))


def row_kernels():
    """(name, compile arguments) of each memory-bound kernel at its GPU tile, bf16 data."""
    from codetta.kernels import rmsnorm as norm_k, rope as rope_k, softmax_grad as softmax_k, swiglu as swiglu_k

    i32, i64, f32 = "i32", "i64", "fp32"
    rows = dict(x_ptr="bf16", g_ptr="bf16", out_ptr="bf16", rstd_ptr="fp32")
    rows_s = dict(M=i32, D=i32, x_s0=i64, out_s0=i64, eps=f32)
    bm, bd, w = norm_k.GPU_BLOCK
    kernels = [(f"rmsnorm {'(h, rstd)' if n else 'stats (u, rstd)'} {bm}x{bd}",
                (norm_k._rmsnorm_rows_kernel, rows, rows_s,
                 dict(BM=bm, BD=bd, NORMALIZE=n, EMULATE_RNE=False), w)) for n in (False, True)]
    bm, bd, w = norm_k.GPU_BACKWARD_BLOCK
    kernels.append((f"rmsnorm backward, dx fp32 {bm}x{bd}", (
        norm_k._rmsnorm_backward_kernel,
        dict(x_ptr="bf16", g_ptr="bf16", rstd_ptr="fp32", dh_ptr="bf16", dx_ptr="fp32", dg_part_ptr="fp32"),
        dict(M=i32, D=i32, x_s0=i64, dh_s0=i64, dx_s0=i64), dict(BM=bm, BD=bd, EMULATE_RNE=False), w)))
    bm, bf, w = swiglu_k.GPU_BLOCK
    kernels += [(f"swiglu backward{', recomputing y' if y else ''} {bm}x{bf}", (
        swiglu_k._swiglu_backward_kernel,
        dict(dy_ptr="bf16", g_ptr="bf16", u_ptr="bf16", dg_ptr="bf16", du_ptr="bf16", part_ptr="fp32", y_ptr="bf16"),
        dict(M=i32, F=i32, dy_s0=i64, g_s0=i64, u_s0=i64, dg_s0=i64, du_s0=i64, part_s0=i64, y_s0=i64),
        dict(BM=bm, BF=bf, ACTIVATION="silu", ROW_DOT=True, STORE_Y=y, EMULATE_RNE=False), w)) for y in (False, True)]
    bm, heads, w = rope_k.GPU_BLOCK
    kernels += [(f"rope backward (head_dim {d}, rotary dims {2 * r}{', interleaved' if il else ''}) {bm} rows x "
                 f"{heads} heads", (
        rope_k._rotate_kernel,
        dict(dqkv0="bf16", dqkv1="bf16", dqkv2="bf16", qkv="bf16", cos="fp32", sin="fp32", dz="bf16",
             zdz_part="fp32"),
        dict(M=i32, n_heads=i32, n_rotated_heads=i32, end0=i32, end1=i32, s_dqkv0=i64, s_dqkv1=i64, s_dqkv2=i64,
             s_qkv=i64, s_table=i64, s_dz=i64, s_part=i64),
        dict(HEAD_DIM=d, HALF_R=r, HALF_P=r_p, REST_P=rest_p, INTERLEAVED=il, BLOCK_M=bm, HEADS=heads,
             TRANSPOSED=True, WITH_ZDZ=True, EMULATE_RNE=False), w))
        for d, r, r_p, rest_p, il in ((128, 64, 64, 0, False), (128, 64, 64, 0, True), (128, 48, 64, 32, False))]
    bm, bn, w = softmax_k.GPU_BLOCK
    kernels.append((f"softmax gradient {bm}x{bn}", (
        softmax_k._softmax_grad_kernel,
        dict(z_ptr="bf16", shift_ptr="fp32", log_sum_ptr="fp32", target_ptr="i64", scale_ptr="fp32"),
        dict(z_stride=i64, M=i32, N=i32, target_weight=f32, uniform=f32, z_loss_2=f32),
        dict(SPLIT=True, BLOCK_M=bm, BLOCK_N=bn, EMULATE_RNE=False), w)))
    return kernels


def report_row_kernels():
    """Registers, spills and the warps per SM the registers allow (64K per SM) of each row kernel."""
    for name, (kernel, pointers, scalars, constexprs, warps) in row_kernels():
        try:
            found = resources(compile_row_kernel(kernel, pointers, scalars, constexprs, warps))
        except Exception as exc:  # report and go on: this is a probe
            print(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:200]}")
            continue
        regs = found["registers"]
        per_sm = min(64, 65536 // (int(regs) * 32 * warps) * warps) if regs.isdigit() else "?"
        print(f"{name}, {warps} warps: registers {regs}, stack bytes {found['stack bytes']}, warps per SM {per_sm}",
              flush=True)


if __name__ == "__main__":
    main()
    report_row_kernels()

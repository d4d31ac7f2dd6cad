"""The GEMM kernels compiled for Hopper (sm_90) on this machine, with or without a GPU.

Triton's interpreter runs a kernel as Python, which takes code the compiler refuses (two
returns of different types in the branches of a constexpr ``if`` passed the interpreted
suite and failed on the H200). So the kernels are also compiled, in a process of their own
with the interpreter off (:mod:`codetta.matmul.aot`): the mainloop in every layout and
arrangement of B, and every program and row kernel that the operators of a training step
launch, as this process records them.
"""

import itertools
import os
import pickle
import subprocess
import sys

import torch

import codetta
from codetta import Config, ops
from codetta.kernels import launch as kernel_launch
from codetta.matmul import launch
from codetta.matmul.path import b_arrangement, table_block_n
from conftest import DEVICE

_COMPILE = r'''
import importlib, pickle, sys
import torch
from codetta.matmul.aot import compile_gemm, compile_kernel
failed = []
for kind, what, *details in pickle.load(open(sys.argv[1], "rb")):
    try:
        if kind == "gemm":  # (program, path, config, layout keywords)
            compile_gemm(what, *details[:2], **details[2])
        else:  # (module, kernel name), signature, constexprs, num_warps
            kernel = getattr(importlib.import_module(what[0]), what[1])
            compile_kernel(kernel, details[0], details[1], dict(num_warps=details[2]))
    except Exception as exc:
        while exc.__cause__ is not None:  # the compiler's own error, inside the errors of each calling function
            exc = exc.__cause__
        failed.append(f"{kind} {what} {details}: {type(exc).__name__}: {str(exc)[-600:]}")
print("\n".join(failed))
sys.exit(1 if failed else 0)
'''

MAINLOOP = [("n", 1), ("n", 3), ("k", 3), ("interleave", 2)]
ONE_DESCRIPTOR = ["interleave_one", "interleave_one_swapped"]  # two W [N/2, K] (B not stored [K, N]) through TMA


def compile_all(kernels, tmp_path):
    """Compile in a process with the interpreter off, and assert that each compiles:
    ("gemm", program, path, config, compile_gemm's layout keywords) or ("row", (module, name),
    signature, constexprs, num_warps) of a row kernel."""
    todo = tmp_path / "kernels.pkl"
    todo.write_bytes(pickle.dumps(kernels))
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, str(todo)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, f"did not compile for sm_90:\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}"


def test_mainloop_compiles_for_hopper_in_every_layout(tmp_path):
    """The plain GEMM through TMA with A and B in each stored layout, B as one tensor, parts along
    N, along K and interleaved (by two descriptors, or one of both parts in either memory order;
    through pointers, where the strides are arguments, each arrangement of B once); and the configs' options: a flattened loop, epilogue slices, two
    CTAs per SM (a register cap)."""
    plain = codetta.epilogue.Program("plain_gemm")
    plain.store("out", plain.acc)
    base = Config(BM=128, BN=256, BK=64)
    kernels = [("gemm", plain, "tma", base, dict(a_km=a_km, b_kn=b_kn, b_parts=parts, num_b=num_b))
               for a_km, b_kn, (parts, num_b) in itertools.product((False, True), (False, True), MAINLOOP)]
    kernels += [("gemm", plain, "tma", base, dict(a_km=a_km, b_parts=parts, num_b=2))
                for a_km, parts in itertools.product((False, True), ONE_DESCRIPTOR)]
    kernels += [("gemm", plain, "ptr", base, dict(b_parts=parts, num_b=num_b)) for parts, num_b in MAINLOOP]
    options = [Config(BM=128, BN=256, BK=64, FLATTEN=True), Config(BM=128, BN=256, BK=64, EPI_SPLIT=4),
               Config(BM=128, BN=128, BK=64, STAGES=2, CTAS_PER_SM=2), Config(BM=64, BN=128, BK=64, num_warps=4)]
    kernels += [("gemm", plain, "tma", cfg, dict(num_b=1)) for cfg in options]
    kernels += [("gemm", plain, "tma", options[0], dict(b_parts="interleave_one_swapped", num_b=2))]
    kernels += [("gemm", plain, "ptr", base, dict(dtype=torch.float32)),
                ("gemm", plain, "tma", base, dict(dtype=torch.float16))]
    compile_all(kernels, tmp_path)


_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
                 torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def record_kernels(monkeypatch):
    """{key: compile_all's entry} of every GEMM plan made and row kernel launched from now on
    (plans made before are forgotten, so each signature makes one again)."""
    seen = {}

    def recording_plan(call, path, cfg):
        layout = dict(dtype=call.a.dtype, a_km=bool(call.layout[0]), b_kn=bool(call.layout[1]),
                      b_parts=b_arrangement(call, path), num_b=len(call.parts))
        seen[(call.program.fingerprint(), path, tuple(layout.values()))] = ("gemm", call.program, path, layout)
        return plan_class(call, path, cfg)

    def recording_launch(kernel, grid, *args, num_warps=4, **constexprs):
        signature = {name: _argument_type(value) for name, value in zip(kernel.arg_names, args)}
        compiled = {**constexprs, **{name: None for name, ty in signature.items() if ty is None}}
        if "EMULATE_RNE" in compiled:
            compiled["EMULATE_RNE"] = False  # the GPU's rounding, not the interpreter's emulation of it
        signature = {name: ty for name, ty in signature.items() if ty is not None}
        name = (kernel.fn.__module__, kernel.fn.__name__)  # one signature per kernel and constexprs
        seen.setdefault((name, str(compiled), num_warps), ("row", name, signature, compiled, num_warps))
        return row_launch(kernel, grid, *args, num_warps=num_warps, **constexprs)

    plan_class, row_launch = launch.Plan, kernel_launch.launch
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(launch, "Plan", recording_plan)
    for module in vars(codetta.kernels).values():
        if getattr(module, "launch", None) is row_launch:
            monkeypatch.setattr(module, "launch", recording_launch)
    return seen


def _argument_type(value):
    """A row kernel's runtime argument as Triton types it (None: passed as a constexpr None)."""
    if isinstance(value, torch.Tensor):
        return f"*{_TRITON_TYPES[value.dtype]}"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return None if value is None else "fp32"


def training_step():
    """Forward and backward of the operators, in their variants, on tiny bf16 inputs."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return (0.1 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype).requires_grad_()

    model = codetta.nn.Decoder(codetta.nn.DecoderConfig()).to(DEVICE, torch.bfloat16)
    ids = torch.randint(0, 256, (2, 24), generator=gen).to(DEVICE)
    model(ids, ids).backward()
    m, d, heads, kv, hd = 24, 64, 4, 2, 16
    x, g = rand(m, d), rand(d)
    wq, wk, wv = rand(heads * hd, d), rand(kv * hd, d), rand(kv * hd, d)
    positions = torch.arange(m, device=DEVICE)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2, device=DEVICE).float() / hd)
    for extra in (dict(interleaved=True, bias=(rand(heads * hd), rand(kv * hd), rand(kv * hd))),
                  dict(q_norm_weight=rand(hd), k_norm_weight=rand(hd), rotary_dim=hd // 2)):
        rotary = inv_freq[: extra.get("rotary_dim", hd) // 2]
        q, k, v = ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, positions, rotary, head_dim=hd, **extra)
        (q.float().sum() + k.float().sum() + v.float().sum()).backward()
    q, k = ops.apply_rope(rand(m, heads * hd), rand(m, kv * hd), positions, inv_freq, head_dim=hd)  # q, k apart
    (q.float().sum() + k.float().sum()).backward()
    for activation in ("gelu_tanh", "relu"):
        y = ops.rmsnorm_swiglu(x, g, rand(40, d), rand(40, d), bias=(rand(40), rand(40)), activation=activation)
        y.float().sum().backward()
    target = torch.randint(0, 37, (m,), generator=gen).to(DEVICE)
    for reduction in ("mean", "none"):  # logits stored with their gradient, or only reduced in the epilogue
        loss = ops.linear_cross_entropy(x, rand(37, d), target, bias=rand(37), norm_weight=g, reduction=reduction,
                                        label_smoothing=0.1, z_loss=1e-3, softcap=30.0)
        loss.sum().backward()
    ops.linear_cross_entropy(x.float(), rand(37, d, dtype=torch.float32), target).backward()
    ops.linear_residual(x, rand(d, d), rand(m, d), g, bias=rand(d), branch_scale=0.5)[0].float().sum().backward()
    w = rand(32, d)
    with ops.accumulate_weight_grads():
        for _ in range(2):
            ops.rmsnorm_linear(x, g, w).float().sum().backward()
    codetta.linear(rand(m, 60), rand(40, 60)).float().sum().backward()  # rows of 120 bytes: the pointer path


def test_the_kernels_of_a_training_step_compile_for_hopper(monkeypatch, tmp_path):
    """Every GEMM program the operators launch in a training step and every row kernel (norm,
    RoPE and SwiGLU backward, loss statistics, ...), recorded as they run here, compiled as they
    ran: a program on its path and in its layout, with a Hopper config wide enough for it (its
    segments, and on the TMA path its tables' periods), the epilogue in two slices where they
    fit; a row kernel with the argument types and blocks it ran with."""
    seen = record_kernels(monkeypatch)
    training_step()
    monkeypatch.undo()
    names = {entry[1].name for entry in seen.values() if entry[0] == "gemm"}
    for expected in ("rmsnorm_qkv_rope_r16_interleaved_bias", "rmsnorm_qkv_rope_r8_qknorm16", "rmsnorm_silu_glu",
                     "rmsnorm_relu_glu_bias", "linear_residual_bias_scaled_rmsnorm_bfloat16", "rmsnorm_linear",
                     "rmsnorm_linear_backward", "rmsnorm_linear_backward_residual", "lce_loss_bias_sum_capped",
                     "weight_grad", "weight_grad_add"):
        assert expected in names, sorted(names)  # the step ran that operator
    assert {"tma", "ptr"} == {entry[2] for entry in seen.values() if entry[0] == "gemm"}
    row_kernels = {entry[1][1] for entry in seen.values() if entry[0] == "row"}
    for expected in ("_rotate_kernel", "_swiglu_backward_kernel", "_rmsnorm_rows_kernel",
                     "_softmax_grad_kernel", "_qk_norm_backward_kernel"):
        assert expected in row_kernels, sorted(row_kernels)
    kernels = []
    for entry in seen.values():
        if entry[0] == "gemm":
            _, program, path, layout = entry
            need = max(program.min_block_n(), table_block_n(program) if path == "tma" else 1)  # as the launcher's
            bn = max(128, need)
            entry = ("gemm", program, path, Config(BM=128, BN=bn, BK=64, EPI_SPLIT=2 if bn // 2 >= need else 1), layout)
        kernels.append(entry)
    compile_all(kernels, tmp_path)

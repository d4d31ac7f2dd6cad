"""Bad and unusual inputs: refused with an error that names the problem, or handled correctly.

Refusals are checked with ``pytest.raises(..., match=...)`` on the error class the
library documents (GemmError for a / b, EpilogueError for programs and their operands
and outputs; both are ValueErrors). Inputs that are unusual but legal (empty M, N or K,
strided or misaligned a, poisoned out= buffers, accumulation, leading batch dims) are
checked against torch. Values are small multiples of 1/4 where a comparison is exact:
every product and sum of them is exact in fp32.
"""

import itertools
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import codetta
from codetta import EpilogueError, GemmError
from codetta import epilogue as ep
from codetta import ops
from codetta.matmul import launch, memory
from conftest import DEVICE


def dyadic(*shape, dtype=torch.float32, lo=-2, hi=2):
    """Random multiples of 1/4 in [lo, hi]: exact in fp32, bf16 and fp16, and so are their fp32 products."""
    return (torch.randint(4 * lo, 4 * hi + 1, shape) / 4).to(device=DEVICE, dtype=dtype)


def store_program(name="store_acc", dtype=torch.float32):
    p = ep.Program(name)
    p.store("y", p.acc, dtype=dtype)
    return p


def operand_program():
    """y = acc * r + c + x + s: one operand of each kind (row, col, aux, scalar)."""
    p = ep.Program("one_of_each")
    p.store("y", p.acc * p.row("r") + p.col("c") + p.aux("x") + p.scalar("s"), dtype=torch.float32)
    return p


def operands(m=8, n=6):
    return {"r": dyadic(m), "c": dyadic(n), "x": dyadic(m, n), "s": 0.5}


def all_outputs_program():
    """Every kind of output of z = acc + r: stores, row and column reductions, per segment."""
    p = ep.Program("all_outputs")
    z = p.acc + p.row("r")
    p.store("y", z, dtype=torch.float32)
    p.store("y_lo", z, dtype=torch.bfloat16)
    p.row_sum("rs", z)
    p.row_max("rm", z)
    p.row_logsumexp("lse", z)
    p.col_sum("cs", z)
    p.row_sum("seg_sum", z, segment=2)
    p.row_max("seg_max", z, segment=2)
    g, u = ep.pairs(z)
    p.store("h", g * u, dtype=torch.float32)
    return p


def expected_all_outputs(a, b, r):
    """What all_outputs_program computes, in fp64 torch (a: [M, K], r: [M])."""
    z = a.double() @ b.double() + r.double()[:, None]
    m, n = z.shape
    neg_inf = torch.full((m,), float("-inf"), dtype=torch.float64, device=z.device)
    segs = z.reshape(m, n // 2, 2)
    return {
        "y": z,
        "y_lo": z,
        "rs": z.sum(1),
        "rm": z.amax(1) if n else neg_inf,  # a max over no columns is -inf (torch.amax refuses)
        "lse": torch.logsumexp(z, 1),
        "cs": z.sum(0),
        "seg_sum": segs.sum(2),
        "seg_max": segs.amax(2),
        "h": z[:, 0::2] * z[:, 1::2],
    }


def check_reference_agrees(a, b, r):
    """The reference executor gives the same results as the kernels (empty dims included)."""
    p = all_outputs_program()
    check_all_outputs(ep.run_reference(p, a, b, {"r": r}, torch.float64), expected_all_outputs(a, b, r))


def check_all_outputs(got, want):
    assert set(got) == set(want)
    for name, ref in want.items():
        out = got[name]
        assert out.shape == ref.shape, (name, out.shape, ref.shape)
        tol = {"rtol": 1e-2, "atol": 1e-2} if out.dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
        torch.testing.assert_close(out.double(), ref, **tol, msg=lambda m, name=name: f"output {name!r}: {m}")


# --------------------------------------------------------------------------------------
# a and b


def test_mismatched_k_is_refused():
    """a [8, 5] @ b [4, 6]: K differs, and the message says so (also for one part of a list)."""
    a = dyadic(8, 5)
    with pytest.raises(GemmError, match="K differs"):
        codetta.gemm(a, dyadic(4, 6), store_program())
    with pytest.raises(GemmError, match="K differs"):
        codetta.gemm(a, [dyadic(5, 3), dyadic(4, 3)], store_program())


@pytest.mark.parametrize("b_dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_mismatched_dtypes_are_refused(b_dtype):
    """fp32 a with a b of another dtype: refused, naming both dtypes."""
    with pytest.raises(GemmError, match=rf"a is torch.float32 but b is {b_dtype}"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6, dtype=b_dtype), store_program())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64])
def test_unsupported_a_dtype_is_refused(dtype):
    """Integer (or fp64) a and b: refused, naming the dtype and the ones that are taken."""
    a, b = dyadic(8, 5).to(dtype), dyadic(5, 6).to(dtype)
    with pytest.raises(GemmError, match=rf"a has dtype {dtype}; codetta.gemm takes"):
        codetta.gemm(a, b, store_program())


def test_one_dimensional_weight_is_refused():
    """A 1-d b (or a 1-d nn.Linear weight) is refused as 'must be 2-d', by gemm and by linear."""
    x, w = dyadic(8, 5), dyadic(5)
    with pytest.raises(GemmError, match=r"b must be 2-d \[K, N\].*got shape \(5,\)"):
        codetta.gemm(x, w, store_program())
    with pytest.raises(GemmError, match=r"weight must be a 2-d tensor \[N, K\], got \(5,\) torch.float32"):
        codetta.linear(x, w)


def test_linear_names_x_when_refusing_it():
    """codetta.linear's input is x: a 0-d tensor, a list or an fp64 tensor is refused naming x
    (not gemm's a)."""
    w = dyadic(4, 5)
    for x, message in ((torch.tensor(1.0, device=DEVICE), r"x must be a tensor \[\.\.\., K\], got \(\)"),
                       ([1.0] * 5, r"x must be a tensor \[\.\.\., K\], got list"),
                       (dyadic(3, 5).double(), r"x has dtype torch.float64; codetta.linear takes")):
        with pytest.raises(GemmError, match=message):
            codetta.linear(x, w)


def test_linear_names_its_weight_when_refusing_it():
    """A weight of another dtype than x, or whose K is not x's last dim: refused naming weight
    and its own shape (not gemm's a and the transposed b)."""
    x = dyadic(3, 5)
    for w in (dyadic(4, 5).double(), dyadic(4, 6), dyadic(5, 4)):
        with pytest.raises(GemmError, match=rf"weight must be \[N, 5\] \(x's last dim\) in x's dtype torch.float32, "
                                            rf"got \({w.shape[0]}, {w.shape[1]}\) {w.dtype}"):
            codetta.linear(x, w)


@pytest.mark.parametrize("call, message", [
    (lambda x, w: ops.rmsnorm_linear(x[0, 0], dyadic(5), w), r"x must be a tensor \[\.\.\., d\], got \(\) torch.float32"),
    (lambda x, w: ops.linear_residual(x[0, 0], w, x), r"a must be a tensor of at least 1 dim, got \(\) torch.float32"),
    (lambda x, w: ops.linear_residual(x, w, 1.0), r"residual must be a tensor of at least 1 dim, got float"),
    (lambda x, w: codetta.linear(x, w.tolist()), r"weight must be a 2-d tensor \[N, K\], got list"),
], ids=["rmsnorm_linear-0d", "linear_residual-0d", "linear_residual-float", "linear-list"])
def test_what_was_given_instead_of_a_tensor_is_named(call, message):
    """A 0-d tensor or a non-tensor where an op wants a tensor: the message says what it got."""
    with pytest.raises((ValueError, GemmError), match=message):
        call(dyadic(3, 5), dyadic(4, 5))


@pytest.mark.parametrize("call, message", [
    (lambda x, g, w: ops.rmsnorm_linear(x, g, w), "the weights are torch.float64"),
    (lambda x, g, w: ops.rmsnorm_swiglu(x, g, w, w), "the weights are torch.float64"),
    (lambda x, g, w: ops.swiglu_mlp(x, g, w, w, w.t()), "the weights are torch.float64"),
    (lambda x, g, w: ops.rmsnorm_qkv_rope(x, g, w[:4], w[4:6], w[4:6], torch.arange(3, device=DEVICE),
                                          torch.ones(1, device=DEVICE, dtype=torch.float64), head_dim=2),
     "the weights are torch.float64"),
    (lambda x, g, w: ops.linear_residual(x, w, x[:, :6]), "a has dtype torch.float64"),
], ids=["rmsnorm_linear", "rmsnorm_swiglu", "swiglu_mlp", "rmsnorm_qkv_rope", "linear_residual"])
def test_fused_ops_name_an_fp64_argument_when_refusing_it(call, message):
    """fp64 operands of the fused ops are refused naming the op's own arguments (not gemm's a)."""
    x, g, w = dyadic(3, 8).double(), dyadic(8).double(), dyadic(6, 8).double()
    with pytest.raises(ValueError, match=rf"{message}; the kernels take \(torch.float16"):
        call(x, g, w)


@pytest.mark.parametrize("call, name", [
    (lambda x, g, w: ops.rmsnorm_linear(x, g, w), "norm_weight"),
    (lambda x, g, w: ops.rmsnorm_swiglu(x, g, w, w), "norm_weight"),
    (lambda x, g, w: ops.swiglu_mlp(x, g, w, w, w.t()), "norm_weight"),
    (lambda x, g, w: ops.swiglu_mlp(x, dyadic(8), w, w, w.t(), next_norm_weight=g), "next_norm_weight"),
    (lambda x, g, w: ops.rmsnorm_qkv_rope(x, g, w[:4], w[4:6], w[4:6], torch.arange(3, device=DEVICE),
                                          torch.ones(1, device=DEVICE), head_dim=2), "norm_weight"),
    (lambda x, g, w: ops.rmsnorm_qkv_rope(x, dyadic(8), w[:4], w[4:6], w[4:6], torch.arange(3, device=DEVICE),
                                          torch.ones(1, device=DEVICE), head_dim=2, q_norm_weight=g[:2],
                                          k_norm_weight=g[:2]), "q_norm_weight"),
    (lambda x, g, w: ops.linear_residual(x, w, x[:, :6], norm_weight=g[:6]), "norm_weight"),
    (lambda x, g, w: ops.linear_residual(x, w, x[:, :6], bias=g[:6]), "bias"),
    (lambda x, g, w: ops.linear_cross_entropy(x, w, torch.zeros(3, dtype=torch.long, device=DEVICE),
                                              norm_weight=g), "norm_weight"),
    (lambda x, g, w: ops.rms_norm(x, g), "weight"),
], ids=["rmsnorm_linear", "rmsnorm_swiglu", "swiglu_mlp", "swiglu_mlp-next", "rmsnorm_qkv_rope", "qk_norm",
        "linear_residual-norm", "linear_residual-bias", "linear_cross_entropy", "rms_norm"])
def test_an_fp64_norm_weight_or_bias_is_refused_by_every_op(call, name):
    """A norm weight or bias in fp64 beside fp32 x and weights is refused by each op that takes
    one, naming it, as the kernels compute in fp32 at most (not read in silently as fp32, with
    its gradient returned in fp64)."""
    x, g, w = dyadic(3, 8), dyadic(8).double(), dyadic(6, 8)
    with pytest.raises(ValueError, match=rf"{name}.*torch.float64|{name}.*float16, torch.bfloat16, torch.float32"):
        call(x, g, w)


@pytest.mark.parametrize("call, message", [
    (lambda x, g, w: ops.rmsnorm_linear(x, g, [w, w[:, :7]]), r"weight\[1\] must be \[out_features, 8\], got \(6, 7\)"),
    (lambda x, g, w: ops.rmsnorm_linear(x, g, w[:, :7]), r"weight must be \[out_features, 8\], got \(6, 7\)"),
    (lambda x, g, w: ops.rmsnorm_swiglu(x, g, w, w.half()), "w_up is torch.float16 but w_gate is torch.float32"),
    (lambda x, g, w: ops.swiglu_mlp(x, g, w[:, :7], w, w.t()), r"w_gate must be \[out_features, 8\]"),
    (lambda x, g, w: ops.rmsnorm_qkv_rope(x, g, w[:4], w[4:6, :7], w[4:6], torch.arange(3, device=DEVICE),
                                          torch.ones(1, device=DEVICE), head_dim=2), r"w_k must be \[out_features, 8\]"),
    (lambda x, g, w: ops.linear_residual(x, [w, None], x[:, :6]), "weight\\[1\\] must be a tensor"),
    (lambda x, g, w: ops.linear_residual(x, [w, w.half()], x.new_zeros(3, 12)),
     r"weight\[1\] must be \[out, 8\] of torch.float32, got \(6, 8\) torch.float16"),
], ids=["rmsnorm_linear-list", "rmsnorm_linear", "rmsnorm_swiglu", "swiglu_mlp", "rmsnorm_qkv_rope", "linear_residual",
        "linear_residual-list"])
def test_a_bad_weight_is_named_as_the_op_names_it(call, message):
    """A weight of the wrong shape or dtype is named by its argument's name (w_k, w_up, weight[1]),
    not by its place in an internal list."""
    x, g, w = dyadic(3, 8), dyadic(8), dyadic(6, 8)
    with pytest.raises(ValueError, match=message):
        call(x, g, w)


def test_one_dimensional_a_is_refused():
    with pytest.raises(GemmError, match=r"a must be at least 2-d"):
        codetta.gemm(dyadic(5), dyadic(5, 6), store_program())


def test_non_tensors_are_refused():
    """a or b that is not a tensor (a nested list, a numpy array: its .device is a string) is
    refused by name, not crashed on."""
    with pytest.raises(GemmError, match="a must be a torch.Tensor, got list"):
        codetta.gemm([[1.0, 2.0]], dyadic(2, 6), store_program())
    with pytest.raises(GemmError, match="a must be a torch.Tensor, got ndarray"):
        codetta.gemm(np.ones((8, 2), np.float32), dyadic(2, 6), store_program())
    with pytest.raises(GemmError, match="b must be a torch.Tensor, got list"):
        codetta.gemm(dyadic(8, 2), [[[1.0, 2.0]]], store_program())


def test_meta_tensors_are_refused():
    """Tensors on the meta device (no data) give a GemmError naming the device, not a crash in Triton."""
    meta = torch.device("meta")
    with pytest.raises(GemmError, match="a is on meta"):
        codetta.gemm(torch.ones(8, 5, device=meta), torch.ones(5, 6, device=meta), store_program())
    with pytest.raises(GemmError, match=rf"b is on {DEVICE}.* but a is on meta"):
        codetta.gemm(torch.ones(8, 5, device=meta), dyadic(5, 6), store_program())
    with pytest.raises(GemmError, match="b is on meta"):
        codetta.gemm(dyadic(8, 5), torch.ones(5, 6, device=meta), store_program())
    ops = operands()
    ops["r"] = torch.ones(8, device=meta)
    with pytest.raises(GemmError, match="operand 'r' of program 'one_of_each' is on meta"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), operand_program(), **ops)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a second device: a CUDA GPU besides the CPU")
def test_operands_on_another_device_are_refused():
    a = dyadic(8, 5)
    with pytest.raises(GemmError, match="b is on cpu but a is on cuda"):
        codetta.gemm(a, dyadic(5, 6).cpu(), store_program())
    ops = operands()
    ops["x"] = ops["x"].cpu()
    with pytest.raises(GemmError, match="operand 'x' .* is on cpu but a is on cuda"):
        codetta.gemm(a, dyadic(5, 6), operand_program(), **ops)


# --------------------------------------------------------------------------------------
# Programs and their operands


def test_program_that_writes_nothing_is_refused():
    p = ep.Program("silent")
    p.acc * p.row("r")  # noqa: B018 - a value that is never written
    with pytest.raises(EpilogueError, match="program 'silent' writes nothing"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), p, r=dyadic(8))
    with pytest.raises(EpilogueError, match="writes nothing"):
        codetta.kernel_source(p, "ptr")
    with pytest.raises(EpilogueError, match=r"path must be one of \['ptr', 'tma'\], got 'bogus'"):
        codetta.kernel_source(operand_program(), "bogus")


def test_unknown_operand_is_refused():
    """An operand the program does not declare: refused, listing the ones it takes."""
    with pytest.raises(EpilogueError, match=r"has no operand \['rstd'\]; it takes \['c', 'r', 's', 'x'\]"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), operand_program(), rstd=dyadic(8), **operands())


@pytest.mark.parametrize("name", ["r", "c", "x", "s"])
def test_missing_operand_is_refused(name):
    ops = operands()
    del ops[name]
    with pytest.raises(EpilogueError, match=rf"program 'one_of_each' needs operand\(s\) \['{name}'\]"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), operand_program(), **ops)


@pytest.mark.parametrize(
    "name, shape, message",
    [
        ("r", (8, 1), r"'r' .* is a row vector: expected \[8\]"),
        ("r", (1, 8), r"'r' .* is a row vector: expected \[8\]"),
        ("r", (7,), r"'r' .* is a row vector: expected \[8\]"),
        ("r", (), r"'r' .* is a row vector: expected \[8\]"),
        ("c", (5,), r"'c' .* is a column vector: expected \[6\], got \(5,\)"),
        ("c", (1, 6), r"'c' .* is a column vector: expected \[6\], got \(1, 6\)"),
        ("c", (6, 1), r"'c' .* is a column vector: expected \[6\], got \(6, 1\)"),
        ("x", (8, 5), r"'x' .* is a tile: expected \[8, 6\].*got \(8, 5\)"),
        ("x", (6, 8), r"'x' .* is a tile: expected \[8, 6\].*got \(6, 8\)"),
        ("x", (48,), r"'x' .* is a tile: expected \[8, 6\].*got \(48,\)"),
        ("x", (1, 8, 6), r"'x' .* is a tile: expected \[8, 6\].*got \(1, 8, 6\)"),
    ],
)
def test_operand_of_wrong_shape_is_refused(name, shape, message):
    """Row, column and tile operands of the wrong rank or length: refused with the expected shape."""
    ops = operands()
    ops[name] = dyadic(*shape)
    with pytest.raises(EpilogueError, match=message):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), operand_program(), **ops)


def test_shape_messages_with_leading_dims_and_accumulate_targets():
    """With a's leading dims the expected shape is given both ways; an accumulating store's
    target given in out= is pointed to the operands."""
    p = ep.Program("batched_ops")
    p.store("y", p.acc * p.row("r") + p.aux("x"), dtype=torch.float32)
    a, b = dyadic(2, 4, 5), dyadic(5, 6)
    with pytest.raises(EpilogueError, match=r"'r' .* row vector: expected \[8\] or \[2, 4\], got \(7,\)"):
        codetta.gemm(a, b, p, r=dyadic(7), x=dyadic(2, 4, 6))
    with pytest.raises(EpilogueError, match=r"'x' .* tile: expected \[8, 6\] or \[2, 4, 6\], got \(2, 4, 5\)"):
        codetta.gemm(a, b, p, r=dyadic(8), x=dyadic(2, 4, 5))
    acc = ep.Program("accumulate_target")
    acc.store("g", acc.acc, accumulate=True, dtype=torch.float32)
    with pytest.raises(EpilogueError, match=r"needs operand\(s\) \['g'\] \(g: the tensor an accumulating store "
                                            r"adds into, passed as an operand, e.g. g=tensor, not in out=\)"):
        codetta.gemm(dyadic(8, 5), b, acc, out={"g": dyadic(8, 6)})


def test_half_width_operands_given_full_width_are_refused():
    """A HALF column (or tile) operand has N/2 entries; one of N is refused, with N/2 in the message."""
    p = ep.Program("half_ops")
    g, u = ep.pairs(p.acc)
    p.store("y", g * p.col("ch", ep.HALF) + p.aux("xh", ep.HALF), dtype=torch.float32)
    a, b = dyadic(8, 5), dyadic(5, 6)
    with pytest.raises(EpilogueError, match=r"'ch' .* is a column vector: expected \[3\], got \(6,\)"):
        codetta.gemm(a, b, p, ch=dyadic(6), xh=dyadic(8, 3))
    with pytest.raises(EpilogueError, match=r"'xh' .* is a tile: expected \[8, 3\].*got \(8, 6\)"):
        codetta.gemm(a, b, p, ch=dyadic(3), xh=dyadic(8, 6))
    ch, xh = dyadic(3), dyadic(8, 3)
    y = codetta.gemm(a, b, p, ch=ch, xh=xh)["y"]
    acc = a.double() @ b.double()
    torch.testing.assert_close(y.double(), acc[:, 0::2] * ch.double() + xh.double())


@pytest.mark.parametrize("value", [torch.tensor(0.5), torch.ones(1), True, "0.5", None])
def test_scalar_given_as_non_number_is_refused(value):
    """A scalar operand takes a Python number: a tensor (even 0-d), a bool or a string is refused."""
    ops = operands()
    ops["s"] = value.to(DEVICE) if isinstance(value, torch.Tensor) else value
    with pytest.raises(EpilogueError, match=r"'s' .* is a scalar: pass a number, got"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), operand_program(), **ops)


def test_scalar_takes_any_real_number_within_float_range():
    """A scalar operand takes numpy's numbers as Python's; one beyond fp64's range is refused."""
    a, b, ops = dyadic(8, 5), dyadic(5, 6), operands()
    ref = codetta.gemm(a, b, operand_program(), **ops)["y"]
    for value in (np.float32(0.5), np.float64(0.5)):
        assert torch.equal(codetta.gemm(a, b, operand_program(), **{**ops, "s": value})["y"], ref)
    assert torch.equal(codetta.gemm(a, b, operand_program(), **{**ops, "s": np.int64(1)})["y"], ref + 0.5)
    with pytest.raises(EpilogueError, match=r"'s' .*: 10+ is beyond a float's range"):
        codetta.gemm(a, b, operand_program(), **{**ops, "s": 10**400})
    codetta.gemm(a, b, operand_program(), **{**ops, "s": 2})  # a plan kept for an int s checks each value
    with pytest.raises(EpilogueError, match=r"'s' .*: 10+ is beyond a float's range"):
        codetta.gemm(a, b, operand_program(), **{**ops, "s": 10**400})


@pytest.mark.parametrize("dtype, message", [
    (torch.bool, "pass a real number type"),
    (torch.float8_e4m3fn, "8-bit floats are not read: pass it as fp16, bf16 or fp32"),
    (torch.float8_e5m2, "8-bit floats are not read"),
])
def test_bool_and_fp8_operands_are_refused(dtype, message):
    """Booleans are no numbers here; 8-bit floats would be read wrongly where their NaN and inf
    encodings differ (found by a probe: Triton's interpreter decodes them as finite numbers)."""
    ops = operands()
    ops["r"] = torch.ones(8, device=DEVICE).to(dtype)
    with pytest.raises(EpilogueError, match=rf"'r' .* has dtype {dtype}; {message}"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), operand_program(), **ops)


@pytest.mark.parametrize(
    "combine",
    [
        lambda p, g: g + p.acc,
        lambda p, g: p.acc * g,
        lambda p, g: g - p.col("c"),
        lambda p, g: p.aux("x") / g,
        lambda p, g: ep.maximum(g, p.col_index()),
        lambda p, g: ep.where(g > 0.0, p.acc, 0.0),
        lambda p, g: ep.fma(g, p.acc, 1.0),
        lambda p, g: ep.join(g, p.acc),
        lambda p, g: p.acc + p.aux("xh", ep.HALF),
    ],
    ids=["add", "mul", "sub_col", "div_aux", "maximum_index", "where", "fma", "join", "aux_half"],
)
def test_mixing_full_and_half_widths_is_refused_at_build_time(combine):
    """A value over the N columns combined with one over the N/2 pairs: an error when the expression is built."""
    p = ep.Program("mixed")
    g, _ = ep.pairs(p.acc)
    with pytest.raises(EpilogueError, match=r"program 'mixed': .* \(width mismatch\)"):
        combine(p, g)


@pytest.mark.parametrize("use", [
    lambda p, c: c + 1.0, lambda p, c: ep.exp(c), lambda p, c: ep.maximum(p.acc, c), lambda p, c: ep.fma(c, p.acc, 1.0),
    lambda p, c: ep.round_to(c, torch.bfloat16), lambda p, c: ep.pairs(c), lambda p, c: ep.join(*ep.pairs(p.acc)) + c,
    lambda p, c: ep.join(ep.pairs(p.acc)[0] > 0, ep.pairs(p.acc)[1]), lambda p, c: ep.segment_sum(c, 4),
    lambda p, c: ep.segment_max(c, 4), lambda p, c: ep.where(c, c, 0.0),
], ids=["add", "exp", "maximum", "fma", "round_to", "pairs", "add_after_join", "join", "segment_sum", "segment_max",
        "where_branch"])
def test_booleans_computed_with_as_numbers_are_refused(use):
    """A comparison's result is a boolean: only where(), the logical operators and not take it;
    anything computing with it as a number is refused when built (a boolean tile would reach
    arithmetic the generated kernel cannot do)."""
    p = ep.Program("bools")
    with pytest.raises(EpilogueError, match=r"program 'bools': .*(of a boolean value; use where|between numbers)"):
        use(p, p.acc > 0)


def test_booleans_stored_or_reduced_and_logic_of_numbers_are_refused():
    p = ep.Program("logic")
    for write in (lambda c: p.store("y", c), lambda c: p.row_sum("s", c), lambda c: p.col_sum("s", c)):
        with pytest.raises(EpilogueError, match=r"program 'logic': output '.' is boolean; use where\(\)"):
            write(p.acc > 0)
    with pytest.raises(EpilogueError, match="'not' needs a boolean value"):
        ~p.acc
    with pytest.raises(EpilogueError, match="'and' needs two boolean values"):
        (p.acc > 0) & p.acc
    with pytest.raises(EpilogueError, match=r"accumulate must be a bool, got 'yes'"):
        p.store("y", p.acc, accumulate="yes")


@pytest.mark.parametrize("build", [lambda: ep.maximum(1.0, 2.0), lambda: ep.join(1.0, 2.0), lambda: ep.fma(1.0, 2.0, 3.0)],
                         ids=["maximum", "join", "fma"])
def test_functions_of_numbers_only_are_refused(build):
    """An epilogue function given no epilogue value says so (it mixes no programs)."""
    with pytest.raises(EpilogueError, match=r"takes epilogue values, got only \(1.0, 2.0"):
        build()


def test_where_of_a_python_comparison_names_eq():
    """``p.acc == 0`` is Python's object comparison (False): where() given it and numbers points
    to .eq() (found by a probe: the message said only "got only (False, 1.0, 0.0)")."""
    p = ep.Program("python_eq")
    with pytest.raises(EpilogueError, match=r"got only \(False, 1.0, 0.0\) \(== and != compare Python objects: "
                                            r"compare values with .eq\(\) and .ne\(\)\)"):
        ep.where(p.acc == 0, 1.0, 0.0)


def test_a_stored_python_comparison_names_eq():
    """``p.acc == p.acc`` is Python's object comparison (a bool): a store of it points to .eq()."""
    p = ep.Program("python_eq_stored")
    with pytest.raises(EpilogueError, match=r"output 'y' needs a value of this program \(== and != compare Python "
                                            r"objects: compare values with .eq\(\) and .ne\(\)\)"):
        p.store("y", p.acc == p.acc)


def test_an_operand_declared_twice_differently_and_values_of_two_programs_are_refused():
    p = ep.Program("twice")
    p.row("v")
    with pytest.raises(EpilogueError, match="program 'twice': operand 'v' declared as a row vector and as a "
                                            "FULL-width column vector"):
        p.col("v")
    p.col("h", ep.HALF)
    with pytest.raises(EpilogueError, match="'h' declared as a HALF-width column vector and as a FULL-width column"):
        p.col("h")
    other = ep.Program("other")
    with pytest.raises(EpilogueError, match=r"mixes values of different programs \['other', 'twice'\]"):
        p.acc + other.acc  # noqa: B018


# --------------------------------------------------------------------------------------
# Outputs


@pytest.mark.parametrize("kind", ["row_sum", "row_max", "row_logsumexp", "col_sum", "seg_row_sum"])
def test_reduction_out_buffer_must_be_fp32(kind):
    """A reduction is always fp32: an out= buffer of bf16 is refused, and the message says fp32."""
    p = ep.Program("reduce_" + kind)
    if kind == "seg_row_sum":
        p.row_sum("o", p.acc, segment=2)
        shape = (8, 3)
    else:
        getattr(p, kind)("o", p.acc)
        shape = (6,) if kind == "col_sum" else (8,)
    buf = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(EpilogueError, match=r"out\['o'\] .* must be torch.float32 \(a reduction, always fp32\), got torch.bfloat16"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), p, out={"o": buf})


def test_store_out_buffer_must_have_the_store_dtype():
    with pytest.raises(EpilogueError, match=r"out\['y'\] .* must be torch.bfloat16 \(stored as torch.bfloat16\), got torch.float32"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), store_program(dtype=torch.bfloat16), out={"y": torch.zeros(8, 6, device=DEVICE)})


@pytest.mark.parametrize(
    "name, shape, want",
    [("y", (8, 5), r"\(8, 6\)"), ("y", (6, 8), r"\(8, 6\)"), ("y", (48,), r"\(8, 6\)"), ("rs", (7,), r"\(8,\)"),
     ("rs", (8, 1), r"\(8,\)"), ("cs", (8,), r"\(6,\)")],
)
def test_out_buffer_of_wrong_shape_is_refused(name, shape, want):
    p = ep.Program("shapes")
    p.store("y", p.acc, dtype=torch.float32)
    p.row_sum("rs", p.acc)
    p.col_sum("cs", p.acc)
    with pytest.raises(EpilogueError, match=rf"out\['{name}'\] of program 'shapes' must have shape {want}, got"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), p, out={name: torch.zeros(shape, device=DEVICE)})


@pytest.mark.parametrize("name, width", [("y", 6), ("per_head", 3)])
def test_out_buffer_whose_rows_do_not_flatten_is_refused_naming_the_program(name, width):
    """An out= tile (a store, or a reduction per segment) with leading dims that cannot be merged
    into rows without a copy (a transposed [B, S] view) is refused before any launch, naming the
    program and the argument."""
    p = ep.Program("rows_of_out")
    p.store("y", p.acc, dtype=torch.float32)
    p.row_sum("per_head", p.acc, segment=2)
    out = torch.zeros(3, 2, width, device=DEVICE).transpose(0, 1)
    with pytest.raises(EpilogueError, match=rf"out\['{name}'\] of program 'rows_of_out' is written in place, so "
                                            r"its leading dims must flatten without a copy"):
        codetta.gemm(dyadic(2, 3, 5), dyadic(5, 6), p, out={name: out})
    assert not out.any()


def test_out_buffer_for_something_not_written_is_refused():
    """out= for a name the program does not write, or for an accumulating store (passed as an operand)."""
    p = ep.Program("acc_into")
    p.store("y", p.acc, accumulate=True, dtype=torch.float32)
    with pytest.raises(EpilogueError, match=r"program 'acc_into' has no output 'z' to write into"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), p, y=dyadic(8, 6), out={"z": torch.zeros(8, 6, device=DEVICE)})
    with pytest.raises(EpilogueError, match=r"program 'acc_into' has no output 'y' to write into"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), p, y=dyadic(8, 6), out={"y": torch.zeros(8, 6, device=DEVICE)})


# --------------------------------------------------------------------------------------
# Shapes the program cannot take


def test_odd_n_with_pairs_is_refused():
    p = ep.Program("swiglu")
    g, u = ep.pairs(p.acc)
    p.store("y", ep.silu(g) * u)
    with pytest.raises(EpilogueError, match=r"program 'swiglu' pairs columns but N = 7 is odd"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 7), p)


@pytest.mark.parametrize("segment", [3, 6, 0, 1, -2, 4.0, True, "4"])
def test_segments_that_are_no_power_of_two_are_refused(segment):
    p = ep.Program("bad_segment")
    for use in (lambda: ep.pairs(p.acc, segment), lambda: ep.segment_sum(p.acc, segment),
                lambda: p.row_sum("o", p.acc, segment=segment), lambda: ep.join(*ep.pairs(p.acc), segment)):
        with pytest.raises(EpilogueError, match=rf"program 'bad_segment': .* segment must be an integer power of two >= 2, got {segment!r}"):
            use()


def test_numpy_integer_segments_and_periods_are_taken():
    """A numpy integer is a segment or a table's period like a Python int (found by probes:
    refused as no power of two, or as no positive integer)."""
    p = ep.Program("numpy_segment")
    first, second = ep.pairs(p.acc, np.int64(4))
    p.store("y", ep.join(second, first, np.int32(4)))
    p.row_sum("s", p.acc, segment=np.int64(4))
    p.store("t", p.acc * p.table("t_in", np.int64(2)))
    a, b = dyadic(5, 8), dyadic(8, 8)
    table = dyadic(5, 2)
    acc = (a @ b).reshape(5, 2, 2, 2)
    got = codetta.gemm(a, b, p, t_in=table)
    torch.testing.assert_close(got["y"], acc.flip(2).reshape(5, 8))  # halves of each segment of 4 swapped
    torch.testing.assert_close(got["s"], acc.reshape(5, 2, 4).sum(-1))
    torch.testing.assert_close(got["t"], (a @ b) * table.repeat(1, 4))


@pytest.mark.parametrize("n", [6, 5])
@pytest.mark.parametrize("use", ["row_sum", "segment_sum", "pairs", "half_segment"])
def test_n_not_a_multiple_of_the_segment_is_refused(use, n):
    """Segments of 4 columns with N = 6 or 5 (or pairs over N/2 = 3 with segments of 4): refused,
    naming both; an odd N is called odd only where the program pairs columns."""
    p = ep.Program("seg4")
    if use == "row_sum":
        p.row_sum("o", p.acc, segment=4)
    elif use == "segment_sum":
        p.store("o", ep.segment_sum(p.acc, 4))
    elif use == "pairs":
        p.store("o", ep.pairs(p.acc, segment=4)[0])
    else:
        p.row_sum("o", ep.pairs(p.acc)[0], segment=4)
    if use in ("pairs", "half_segment") and n % 2:
        message = rf"program 'seg4' pairs columns but N = {n} is odd"
    else:
        if use == "half_segment":
            n *= 2  # N/2 = 6 for the half-width value
        width = "half width 6" if use == "half_segment" else f"full width {n}"
        message = rf"program 'seg4' uses segments of 4 columns but its {width} is no multiple of 4"
    with pytest.raises(EpilogueError, match=message):
        codetta.gemm(dyadic(8, 5), dyadic(5, n), p)


# --------------------------------------------------------------------------------------
# Empty dimensions


def test_empty_m():
    """M = 0: stores and row reductions are empty, column sums are zeros, as in torch."""
    a, b, r = dyadic(0, 5), dyadic(5, 6), dyadic(0)
    check_reference_agrees(a, b, r)
    got = codetta.gemm(a, b, all_outputs_program(), r=r)
    want = expected_all_outputs(a, b, r)
    assert torch.equal(got["cs"], torch.zeros(6, device=DEVICE))
    check_all_outputs(got, want)
    assert codetta.gemm(a, b).shape == (0, 6)


def test_empty_m_with_batch_dims():
    """a [2, 0, K]: outputs keep the leading dims, [2, 0, N] and [2, 0]."""
    got = codetta.gemm(dyadic(2, 0, 5), dyadic(5, 6), all_outputs_program(), r=dyadic(2, 0))
    assert got["y"].shape == (2, 0, 6) and got["rs"].shape == (2, 0) and got["seg_sum"].shape == (2, 0, 3)
    assert torch.equal(got["cs"], torch.zeros(6, device=DEVICE))


def test_empty_n():
    """N = 0: row sums are 0, row maxima and logsumexps -inf, stores empty, also accumulating ones."""
    a, b, r = dyadic(4, 5), dyadic(5, 0), dyadic(4)
    check_reference_agrees(a, b, r)
    got = codetta.gemm(a, b, all_outputs_program(), r=r)
    check_all_outputs(got, expected_all_outputs(a, b, r))
    assert torch.equal(got["rm"], torch.full((4,), float("-inf"), device=DEVICE))

    p = ep.Program("accumulate_empty")
    p.store("y", p.acc, accumulate=True, dtype=torch.float32)
    y = torch.empty(4, 0, device=DEVICE)
    assert codetta.gemm(a, b, p, y=y)["y"] is y


def test_empty_k():
    """K = 0: acc is zero, like torch.matmul over an empty K; the epilogue still runs on it."""
    a, b, r = dyadic(9, 0), dyadic(0, 6), dyadic(9)
    assert torch.equal(codetta.gemm(a, b), torch.matmul(a, b))
    check_reference_agrees(a, b, r)
    got = codetta.gemm(a, b, all_outputs_program(), r=r)
    check_all_outputs(got, expected_all_outputs(a, b, r))
    assert torch.equal(got["y"], r[:, None].expand(9, 6))


def test_empty_k_with_batch_dims():
    """a [2, 3, 0]: zeros of shape [2, 3, N], like torch.matmul (a reshape(-1, K) cannot infer M)."""
    a, b, r = dyadic(2, 3, 0), dyadic(0, 6), dyadic(2, 3)
    assert torch.equal(codetta.gemm(a, b), torch.zeros(2, 3, 6, device=DEVICE))
    got = codetta.gemm(a, b, all_outputs_program(), r=r)
    want = expected_all_outputs(a.reshape(6, 0), b, r.reshape(6))
    check_all_outputs({k: v if k == "cs" else v.flatten(0, 1) for k, v in got.items()}, want)
    assert got["y"].shape == (2, 3, 6) and got["rs"].shape == (2, 3) and got["seg_sum"].shape == (2, 3, 3)


# --------------------------------------------------------------------------------------
# Strided and misaligned a: the pointer path, with the right result


def _path(a, b, p):
    return codetta.explain(a, b, p)["path"]


def test_non_contiguous_a():
    """a[:, ::2] (no unit stride along K): the pointer path, and the right result."""
    full = dyadic(20, 40)
    a, b = full[:, ::2], dyadic(20, 12)
    p = store_program()
    assert _path(a, b, p) == "ptr"
    assert torch.equal(codetta.gemm(a, b, p)["y"], a @ b)


def test_bf16_rows_not_16_byte_aligned():
    """bf16 a [M, 5]: 10-byte rows, no TMA descriptor: the pointer path, exact in fp32 for these values."""
    a, b = dyadic(20, 5, dtype=torch.bfloat16), dyadic(5, 16, dtype=torch.bfloat16)
    p = store_program()
    assert _path(a, b, p) == "ptr"
    assert torch.equal(codetta.gemm(a, b, p)["y"], a.float() @ b.float())
    assert torch.equal(codetta.gemm(a, b).float(), (a.float() @ b.float()).bfloat16().float())


@pytest.mark.parametrize("dtype, offset", [(torch.float32, 1), (torch.bfloat16, 3), (torch.float16, 1)])
def test_odd_storage_offset(dtype, offset):
    """a and b as views at an odd element offset into their storage: not 16-byte aligned, still correct."""
    sa, sb = dyadic(offset + 20 * 16, dtype=dtype), dyadic(offset + 16 * 16, dtype=dtype)
    a = sa[offset:].view(20, 16)
    b = sb[offset:].view(16, 16)
    assert a.data_ptr() % 16 and b.data_ptr() % 16
    p = store_program()
    assert _path(a, b, p) == "ptr"
    assert torch.equal(codetta.gemm(a, b, p)["y"], a.float() @ b.float())


# --------------------------------------------------------------------------------------
# out= buffers and accumulation


@pytest.mark.parametrize("path", ["default", "ptr"])
def test_poisoned_out_buffers_are_overwritten(path, monkeypatch):
    """out= buffers filled with NaN: every element is written (tiles at ragged edges included)."""
    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    m, k, n = 37, 16, 44
    a, b, r = dyadic(m, k), dyadic(k, n), dyadic(m)
    p = all_outputs_program()
    shapes = {"y": (m, n), "y_lo": (m, n), "rs": (m,), "rm": (m,), "lse": (m,), "cs": (n,),
              "seg_sum": (m, n // 2), "seg_max": (m, n // 2), "h": (m, n // 2)}
    out = {name: torch.full(s, float("nan"), device=DEVICE, dtype=torch.bfloat16 if name == "y_lo" else torch.float32)
           for name, s in shapes.items()}
    got = codetta.gemm(a, b, p, out=out, r=r)
    for name, buf in out.items():
        assert got[name] is buf, f"{name}: the result is not the out= buffer"
        assert not buf.isnan().any(), f"{name}: {int(buf.isnan().sum())} elements left unwritten"
    check_all_outputs(got, expected_all_outputs(a, b, r))


def test_poisoned_strided_out_buffer():
    """An out= buffer that is a transposed view (column-major) is written through its strides."""
    a, b = dyadic(20, 16), dyadic(16, 12)
    y = torch.full((12, 20), float("nan"), device=DEVICE).t()
    codetta.gemm(a, b, store_program(), out={"y": y})
    assert torch.equal(y, a @ b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["default", "ptr"])
def test_accumulate_adds_into_prior_values(dtype, path, monkeypatch):
    """accumulate=True: the tensor passed ends as exactly prior + value (in fp32, then rounded to its dtype)."""
    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    m, k, n = 37, 16, 48
    a, b, r = dyadic(m, k), dyadic(k, n), dyadic(m)
    p = ep.Program("accumulate_" + str(dtype).split(".")[-1])
    p.store("grad", p.acc * p.row("r"), accumulate=True, dtype=dtype)
    prior = dyadic(m, n, lo=-100, hi=100, dtype=dtype)
    grad = prior.clone()
    result = codetta.gemm(a, b, p, r=r, grad=grad)["grad"]
    assert result is grad
    want = (prior.float() + (a @ b) * r[:, None]).to(dtype)
    assert torch.equal(grad, want)


def test_accumulate_twice():
    """Two accumulating calls add twice: prior + 2 value."""
    a, b = dyadic(10, 8), dyadic(8, 16)
    p = ep.Program("accumulate_acc")
    p.store("y", p.acc, accumulate=True, dtype=torch.float32)
    prior = dyadic(10, 16)
    y = prior.clone()
    codetta.gemm(a, b, p, y=y)
    codetta.gemm(a, b, p, y=y)
    assert torch.equal(y, prior + 2 * (a @ b))


def test_accumulate_dtype_must_match():
    p = ep.Program("accumulate_fp32")
    p.store("y", p.acc, accumulate=True, dtype=torch.float32)
    with pytest.raises(EpilogueError, match=r"'y' .* is accumulated into as torch.float32, got torch.bfloat16"):
        codetta.gemm(dyadic(8, 5), dyadic(5, 6), p, y=dyadic(8, 6, dtype=torch.bfloat16))


# --------------------------------------------------------------------------------------
# Leading batch dims


def test_leading_batch_dims():
    """a [2, 3, K] with row operands [2, 3] and aux tiles [2, 3, N]: outputs keep the leading dims."""
    lead, k, n = (2, 3), 16, 8
    a, b = dyadic(*lead, k), dyadic(k, n)
    r, c, x, prior = dyadic(*lead), dyadic(n), dyadic(*lead, n), dyadic(*lead, n)
    p = ep.Program("batched")
    z = p.acc * p.row("r") + p.col("c") + p.aux("x")
    p.store("y", z, dtype=torch.float32)
    p.store("acc_out", z, accumulate=True, dtype=torch.float32)
    p.row_sum("rs", z)
    p.row_max("seg", z, segment=4)
    p.col_sum("cs", z)
    acc_out = prior.clone()
    got = codetta.gemm(a, b, p, r=r, c=c, x=x, acc_out=acc_out)

    zz = (a @ b) * r[..., None] + c + x  # exact: dyadic values
    assert got["y"].shape == (*lead, n) and torch.equal(got["y"], zz)
    assert got["acc_out"] is acc_out and torch.equal(acc_out, prior + zz)
    assert got["rs"].shape == lead and torch.equal(got["rs"], zz.sum(-1))
    assert got["seg"].shape == (*lead, n // 4) and torch.equal(got["seg"], zz.reshape(*lead, n // 4, 4).amax(-1))
    assert got["cs"].shape == (n,) and torch.equal(got["cs"], zz.reshape(-1, n).sum(0))


def test_leading_batch_dims_accept_flat_operands():
    """With a [2, 3, K], row operands may also be given flat [6] and tiles as [6, N]; a wrong lead is refused."""
    a, b = dyadic(2, 3, 5), dyadic(5, 6)
    p = operand_program()
    flat = codetta.gemm(a, b, p, **operands(6, 6))["y"]
    assert flat.shape == (2, 3, 6)
    ops = operands(6, 6)
    ops["r"] = ops["r"].reshape(3, 2)
    with pytest.raises(EpilogueError, match=r"'r' .* is a row vector: expected \[6\] or \[2, 3\], got \(3, 2\)"):
        codetta.gemm(a, b, p, **ops)
    ops = operands(6, 6)
    ops["x"] = ops["x"].reshape(3, 2, 6)
    with pytest.raises(EpilogueError, match=r"'x' .* is a tile: expected \[6, 6\] or \[2, 3, 6\], got \(3, 2, 6\)"):
        codetta.gemm(a, b, p, **ops)


@pytest.mark.parametrize("name", ["a", "b", "epilogue", "out", "config"])
def test_operand_names_of_gemms_own_parameters_are_refused(name):
    with pytest.raises(EpilogueError, match=rf"operand name '{name}' is reserved"):
        ep.Program("reserved").row(name)


@pytest.mark.parametrize("name, match", [
    ("\u00b5", "operand name must be an ASCII identifier"),  # micro sign: Python reads it as Greek mu
    ("\ufb01", "operand name must be an ASCII identifier"),  # the ligature fi: read as "fi"
    ("\ufb00", "output name must be an ASCII identifier"),
    ("\ufb01lter", "a program name must be an ASCII identifier"),
    ("p" * 161, "a program name must be an ASCII identifier of at most 160"),  # it names the kernel's file
    (123, "a program name must be an ASCII identifier"),
], ids=["micro", "ligature", "output", "program", "long_program", "not_a_string"])
def test_names_the_generated_kernel_cannot_hold_are_refused(name, match):
    """Names become identifiers and a file name of the generated kernel: Python reads non-ASCII
    identifiers NFKC-normalized (two names could become one), and a file name has a length limit."""
    with pytest.raises(EpilogueError, match=match):
        if match.startswith("operand"):
            ep.Program("names").row(name)
        elif match.startswith("output"):
            p = ep.Program("names")
            p.store(name, p.acc)
        else:
            ep.Program(name)


@pytest.mark.parametrize("name", ["my-prog", "../../escaped", "p" * 300])
def test_a_program_renamed_to_a_name_no_kernel_can_hold_is_refused(name):
    """The name is checked when it is set, not only at construction: it becomes the kernel's
    identifier and file (a path would write outside the cache folder)."""
    p = ep.Program("renamed")
    p.store("y", p.acc * 2.0, dtype=torch.float32)
    with pytest.raises(EpilogueError, match="a program name must be an ASCII identifier"):
        p.name = name
    p.name = "renamed_again"
    a, b = dyadic(4, 3), dyadic(3, 5)
    torch.testing.assert_close(codetta.gemm(a, b, p)["y"], 2.0 * (a.double() @ b.double()).float())


def test_kernel_source_of_something_else_is_refused():
    with pytest.raises(EpilogueError, match="kernel_source takes a codetta.epilogue.Program, got str"):
        codetta.kernel_source("a_program", "tma")


@pytest.mark.parametrize("declare", [
    lambda p, w: p.col_index(w), lambda p, w: p.col("c", w), lambda p, w: p.aux("x", w),
    lambda p, w: p.table("t", 2, w),
], ids=["col_index", "col", "aux", "table"])
@pytest.mark.parametrize("width", [None, "half", 2])
def test_width_is_checked(width, declare):
    """Every declaration with a width takes FULL or HALF only, when the program is built."""
    with pytest.raises(EpilogueError, match="width must be FULL or HALF"):
        declare(ep.Program("widths"), width)


def test_a_programs_operands_and_outputs_are_read_only():
    """A program grows through its builder only: its ``outputs`` and ``operands`` refuse changes
    (a stored output swapped for another of the same name would keep the first one's analysis and
    kernel, a silently wrong result)."""
    p = ep.Program("read_only_probe")
    doubled, tripled = p.acc * 2.0, p.acc * p.scalar("s")
    p.store("y", doubled)
    with pytest.raises(TypeError):
        del p.outputs["y"]
    with pytest.raises(TypeError):
        p.outputs["y"] = tripled
    with pytest.raises(TypeError):
        p.operands["s"] = None
    assert list(p.outputs) == ["y"] and list(p.operands) == ["s"]
    assert repr(p) == "Program(name='read_only_probe', operands=['s'], outputs=['y'])"


def test_an_unusable_kernel_cache_falls_back_to_a_folder_of_the_process(tmp_path, monkeypatch):
    """CODETTA_CACHE_DIR naming a file (or anything that cannot be written): the kernels go to a
    temporary folder of this process, with a warning, and the GEMM still runs."""
    from codetta.epilogue import codegen

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("CODETTA_CACHE_DIR", str(blocker))
    monkeypatch.setattr(codegen, "_FALLBACK_DIR", [])
    p = ep.Program("cache_fallback_probe")
    p.store("y", p.acc * 3.0, dtype=torch.float32)
    a, b = dyadic(8, 5), dyadic(5, 6)
    with pytest.warns(UserWarning, match="cannot use the kernel cache"):
        out = codetta.gemm(a, b, p)["y"]
    torch.testing.assert_close(out, 3.0 * (a.double() @ b.double()).float())


@pytest.mark.parametrize("damage", [b"\xff\xfe\x00 not text", b"import triton\n"])
def test_a_damaged_kernel_file_in_the_cache_is_written_again(tmp_path, monkeypatch, damage):
    """A kernel file of the cache that holds something else (bytes that are not text, a truncated
    source) is written again when a process next loads that kernel, which then runs."""
    from codetta.epilogue import codegen

    monkeypatch.setenv("CODETTA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(codegen, "_LOADED", {})  # as in a new process: the kernel not yet loaded
    monkeypatch.setattr(launch, "_PLANS", {})
    p = ep.Program("damaged_cache_probe")
    p.store("y", p.acc * 3.0, dtype=torch.float32)
    a, b = dyadic(8, 5), dyadic(5, 6)
    codetta.gemm(a, b, p)
    files = list((tmp_path / "kernels").glob("damaged_cache_probe*.py"))
    assert len(files) == 1
    source = files[0].read_bytes()
    files[0].write_bytes(damage)
    monkeypatch.setattr(codegen, "_LOADED", {})
    monkeypatch.setattr(launch, "_PLANS", {})
    torch.testing.assert_close(codetta.gemm(a, b, p)["y"], 3.0 * (a.double() @ b.double()).float())
    assert files[0].read_bytes() == source


@pytest.mark.skipif(DEVICE == "cuda", reason="without a GPU only: codetta then needs Triton's interpreter")
@pytest.mark.parametrize("first", ["import codetta", "import triton; import codetta"])
def test_interpreter_switched_on_at_import_or_a_clear_error(first):
    """Without a GPU, importing codetta turns Triton's interpreter on, which works only before
    triton is imported: after it, a warning at import and a clear error at the first kernel,
    not Triton's internal one."""
    script = (f"{first}\nimport torch\n"
              "print(codetta.linear(torch.ones(2, 3), torch.ones(4, 3)).sum().item())")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if first == "import codetta":
        assert done.returncode == 0 and done.stdout.strip() == "24.0", done.stderr
    else:
        assert done.returncode != 0
        assert "triton was imported before codetta" in done.stderr
        assert "GemmError" in done.stderr and "TRITON_INTERPRET=1" in done.stderr


@pytest.mark.skipif(DEVICE == "cuda", reason="without a GPU only: codetta then needs Triton's interpreter")
@pytest.mark.parametrize("triton_version, numpy_version, refused",
                         [("3.6.0", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.5.0", False)])
def test_an_interpreter_that_fails_under_this_numpy_is_named(triton_version, numpy_version, refused, monkeypatch):
    """Triton 3.6's interpreter fails in every launch under numpy 2.4 or newer (with an error about
    0-dimensional arrays): codetta says which versions clash instead."""
    import numpy
    import triton

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    try:
        # a program of its own: a new plan, so the call is checked
        p = ep.Program("interpreter_versions_" + f"{triton_version}_{numpy_version}".replace(".", "_"))
        p.store("y", p.acc * 2.0, dtype=torch.float32)
        a, b = dyadic(4, 3), dyadic(3, 5)
        if refused:
            with pytest.raises(GemmError, match=re.escape(f"Triton {triton_version}'s CPU interpreter cannot run "
                                                          f"under numpy {numpy_version}")):
                codetta.gemm(a, b, p)
        else:
            torch.testing.assert_close(codetta.gemm(a, b, p)["y"], 2.0 * (a.double() @ b.double()).float())
    finally:
        monkeypatch.undo()


def test_patch_without_transformers_says_what_to_install():
    """codetta itself needs only torch, triton and numpy; codetta.patch names the extra it needs."""
    script = ("import sys\nsys.modules['transformers'] = None  # as if not installed\nimport codetta\n"
              "try:\n    codetta.patch(object())\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0 and 'pip install "codetta[hf]"' in done.stdout, done.stderr


def test_out_for_a_plain_gemm_may_be_one_tensor():
    a, b = dyadic(9, 8), dyadic(8, 12)
    out = torch.full((9, 12), float("nan"), device=DEVICE)
    assert codetta.gemm(a, b, out=out) is out
    assert torch.equal(out, a @ b)
    with pytest.raises(GemmError, match="out must be a dict"):
        codetta.gemm(a, b, store_program(), out=out)
    with pytest.raises(GemmError, match="out must be a dict"):
        codetta.gemm(a, b, out=[out])


@pytest.mark.parametrize("view", ["expand", "as_strided"])
@pytest.mark.parametrize("out_kind", ["store", "accumulate"])
def test_outputs_whose_elements_overlap_are_refused(out_kind, view):
    """An output whose elements share memory (a zero stride, or as_strided rows that overlap,
    which PyTorch's own check cannot tell: found by a probe, results off by up to 33) is refused."""
    a, b = dyadic(9, 8), dyadic(8, 12)
    overlapping = (torch.zeros(1, 12, device=DEVICE).expand(9, 12) if view == "expand"
                   else torch.zeros(9 + 12, device=DEVICE).as_strided((9, 12), (1, 1)))
    if out_kind == "store":
        with pytest.raises(EpilogueError, match="overlap in memory"):
            codetta.gemm(a, b, store_program(), out={"y": overlapping})
    else:
        p = ep.Program("accumulate_overlapping")
        p.store("y", p.acc, dtype=torch.float32, accumulate=True)
        with pytest.raises(EpilogueError, match="overlap in memory"):
            codetta.gemm(a, b, p, y=overlapping)


def test_outputs_sharing_memory_with_the_operands_are_refused():
    """A written tensor that shares elements with a or b (read across tiles by every tile's
    mainloop) or with another written tensor would be silently wrong (tiles overwrite what
    others still read): refused. Disjoint views of one buffer are taken."""
    a, b = torch.randn(64, 128, device=DEVICE), torch.randn(128, 128, device=DEVICE) / 10
    with pytest.raises(GemmError, match="shares memory with a"):
        codetta.gemm(a, b, out=a)
    with pytest.raises(GemmError, match="shares memory with b"):
        codetta.gemm(torch.randn(128, 128, device=DEVICE), b, out=b)
    with pytest.raises(GemmError, match="shares memory with a"):  # a partial overlap, through another dtype
        codetta.gemm(a[:, :64], b[:64, :64], out=a.view(torch.int32)[:, 63:127].view(torch.float32))
    p = ep.Program("two_stores")
    p.store("y", p.acc)
    p.store("z", p.acc * 2)
    buf = torch.empty(64, 128, device=DEVICE)
    with pytest.raises(GemmError, match="shares memory with out\\['y'\\]"):
        codetta.gemm(a, b, p, out={"y": buf, "z": buf})
    acc = ep.Program("accumulate_into_a")
    acc.store("y", acc.acc, dtype=torch.float32, accumulate=True)
    with pytest.raises(GemmError, match="shares memory with a"):
        codetta.gemm(a[:, :64], b[:64, :64], acc, y=a[:, 32:96])
    # disjoint column blocks of one buffer: not shared
    both = torch.zeros(64, 256, device=DEVICE)
    both[:, :128] = a
    out = codetta.gemm(both[:, :128], b, out=both[:, 128:])
    assert torch.allclose(out, a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fields, message", [
    (dict(BM=24), "BM must be a power of two"),
    (dict(BK=8), "BK must be a power of two"),
    (dict(num_warps=3), "num_warps must be a power of two"),
    (dict(EPI_SPLIT=8), "EPI_SPLIT must be a power of two in \\[1, 4\\]"),
    (dict(STAGES=0), "STAGES must be a positive integer"),
    (dict(GROUP_M=1.5), "GROUP_M must be a positive integer"),
    (dict(FLATTEN=1), "FLATTEN must be a bool"),
])
def test_config_values_are_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        codetta.Config(**{**dict(BM=16, BN=16, BK=16), **fields})


def test_config_must_be_a_config():
    with pytest.raises(GemmError, match="config must be a codetta.Config"):
        codetta.gemm(dyadic(9, 8), dyadic(8, 12), config={"BM": 16})


def test_gemm_says_it_does_not_track_gradients():
    a, b = dyadic(9, 8).requires_grad_(), dyadic(8, 12)
    with pytest.warns(UserWarning, match="does not track gradients"):
        y = codetta.gemm(a, b)
    assert y.grad_fn is None
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        codetta.gemm(a, b)  # no graph is recorded here: nothing to say
        codetta.gemm(a.detach(), b)
    assert not caught


def test_reference_executor_reads_b_and_a_as_gemm_does():
    """interleave(b0, b1) (K = 0 too), B in parts along K and a with batch dims: the reference
    executor gives what codetta.gemm gives, in the same shapes."""
    p = ep.Program("reference_layouts")
    y = p.acc * p.row("r")
    p.store("y", y, dtype=torch.float32)
    p.row_sum("s", y)
    p.row_sum("seg", y, segment=4)
    cases = {
        "interleave": (dyadic(6, 8), codetta.interleave(dyadic(8, 4), dyadic(8, 4)), lambda b: torch.stack(b, 2).reshape(8, 8)),
        "interleave, K = 0": (dyadic(6, 0), codetta.interleave(dyadic(0, 4), dyadic(0, 4)),
                              lambda b: torch.zeros(0, 8, device=DEVICE)),
        "parts along K": (dyadic(6, 8), [dyadic(3, 8), dyadic(5, 8)], lambda b: torch.cat(b, 0)),
        "batch dims": (dyadic(2, 3, 8), dyadic(8, 8), lambda b: b),
    }
    for what, (a, b, as_matrix) in cases.items():
        r = dyadic(*a.shape[:-1])
        got = codetta.gemm(a, b, p, r=r)
        ref = ep.run_reference(p, a, b, {"r": r})
        want = (a.double() @ as_matrix(b).double()) * r.double()[..., None]
        for name in ("y", "s", "seg"):
            assert got[name].shape == ref[name].shape, (what, name)
            torch.testing.assert_close(ref[name].cpu(), got[name].cpu(), msg=f"{what}: {name}")
        torch.testing.assert_close(ref["y"].double().cpu(), want.cpu(), msg=what)


def test_reference_executor_checks_operand_names():
    p = ep.Program("reference_operands")
    p.store("y", p.acc * p.row("r"))
    a, b = dyadic(6, 8), dyadic(8, 4)
    with pytest.raises(EpilogueError, match="needs operand"):
        ep.run_reference(p, a, b, {})
    with pytest.raises(EpilogueError, match="has no operand"):
        ep.run_reference(p, a, b, {"r": dyadic(6), "typo": 1.0})
    with pytest.raises(EpilogueError, match="compute_dtype must be a floating point dtype"):
        ep.run_reference(p, a, b, {"r": dyadic(6)}, compute_dtype=torch.int32)  # would truncate a and b
    r = dyadic(6)  # name -> value pairs, as dict() takes them (found by a probe: checked, then a TypeError)
    torch.testing.assert_close(ep.run_reference(p, a, b, [("r", r)])["y"], (a @ b) * r[:, None])


def test_reference_executor_checks_operands_as_gemm_does():
    """The reference executor refuses what codetta.gemm refuses, with the same messages (found by
    a probe: an aux tile of the wrong shape was silently reshaped, others raised torch errors)."""
    p = ep.Program("reference_checks")
    p.store("y", p.acc + p.aux("x"), dtype=torch.float32)
    a, b = dyadic(3, 4), dyadic(4, 6)
    for operands, message in [({"x": dyadic(6, 3)}, r"is a tile: expected \[3, 6\]"),
                              ({"x": 1.0}, "must be a torch.Tensor")]:
        for run in (lambda: codetta.gemm(a, b, p, **operands), lambda: ep.run_reference(p, a, b, operands)):
            with pytest.raises((EpilogueError, codetta.GemmError), match=message):
                run()
    pairs = ep.Program("reference_pairs")
    gate, up = ep.pairs(pairs.acc)
    pairs.store("y", gate * up)
    with pytest.raises(EpilogueError, match="N = 7 is odd"):
        ep.run_reference(pairs, a, dyadic(4, 7), {})


def _brute_force_share(x, y):
    bx = {x.data_ptr() + sum(i * s for i, s in zip(idx, x.stride())) * x.element_size() + k
          for idx in itertools.product(*map(range, x.shape)) for k in range(x.element_size())}
    by = {y.data_ptr() + sum(i * s for i, s in zip(idx, y.stride())) * y.element_size() + k
          for idx in itertools.product(*map(range, y.shape)) for k in range(y.element_size())}
    return bool(bx & by)


def test_memory_sharing_of_views_of_one_buffer_matches_brute_force():
    """The overlap test behind the check above (row arithmetic for column blocks, element sets
    otherwise) against the sets of bytes, on random views of one buffer."""
    gen = torch.Generator().manual_seed(0)
    buf = torch.zeros(4096)

    def rand(hi):
        return int(torch.randint(0, hi, (), generator=gen))

    def view():
        kind = rand(4)
        if kind == 0:  # a block of rows and columns of a [rows, pitch] matrix
            pitch = rand(12) + 1
            r0, c0 = rand(6), rand(pitch)
            return buf[r0 * pitch:].as_strided((rand(5) + 1, rand(pitch - c0) + 1), (pitch, 1), r0 * pitch + c0)
        if kind == 1:  # a transposed block
            pitch = rand(12) + 2
            return buf.as_strided((rand(4) + 1, rand(4) + 1), (1, pitch), rand(40))
        if kind == 2:  # 3-d, row-major leading dims
            return buf.as_strided((rand(3) + 1, rand(3) + 1, rand(4) + 1), (16, 4, 1), rand(40))
        return buf.as_strided((rand(8) + 1,), (rand(3) + 1,), rand(60))  # strided 1-d

    for _ in range(400):
        x, y = view(), view()
        assert memory.share_elements(x, y) == _brute_force_share(x, y), (x.shape, x.stride(), x.storage_offset(),
                                                                          y.shape, y.stride(), y.storage_offset())


def test_outputs_sharing_memory_with_the_programs_operands():
    """An output over a column vector the other row tiles read, or over an aux tile operand
    shifted by a row, is refused; an aux operand written in place (out is that very tensor) is
    computed as from its old values."""
    a, b = torch.randn(40, 24, device=DEVICE), torch.randn(24, 32, device=DEVICE) / 5
    p = ep.Program("col_and_aux")
    p.store("y", p.acc + p.col("c") + p.aux("r"))
    r = torch.randn(40, 32, device=DEVICE)
    buf = torch.randn(41, 32, device=DEVICE)
    with pytest.raises(GemmError, match=r"out\['y'\] is written but shares memory with operand 'c'"):
        codetta.gemm(a, b, p, out={"y": buf[:-1]}, c=buf[0], r=r)
    with pytest.raises(GemmError, match="shares memory with operand 'r'"):
        codetta.gemm(a, b, p, out={"y": buf[1:]}, c=torch.zeros(32, device=DEVICE), r=buf[:-1])
    c = torch.randn(32, device=DEVICE)
    expected = a.double() @ b.double() + c.double() + r.double()
    out = codetta.gemm(a, b, p, out={"y": r}, c=c, r=r)
    assert out["y"].data_ptr() == r.data_ptr()
    torch.testing.assert_close(r.double().cpu(), expected.cpu(), rtol=1e-5, atol=1e-5)


def test_written_tensors_are_checked_before_any_launch(monkeypatch):
    """The check runs before the call is planned: on a GPU, planning a new signature tunes, and
    the tuner's launches write into the caller's out tensors (gemm(a, b, out=a) destroyed a
    before it was refused)."""
    a, b = torch.randn(64, 128, device=DEVICE), torch.randn(128, 128, device=DEVICE) / 10
    before = a.clone()

    def plan(*args, **kwargs):
        raise AssertionError("planned (and, on a GPU, tuned) before the check")

    monkeypatch.setattr(launch, "_plan", plan)
    with pytest.raises(GemmError, match="shares memory with a"):
        codetta.gemm(a, b, out=a)
    assert torch.equal(a, before)


def test_written_tensors_are_checked_on_every_call():
    """A plan is reused for every call with the same shapes and strides: a second call whose
    out is a (same layout as the first call's fresh buffer) is refused too, and column halves
    of one large buffer (the SwiGLU forward's z) pass without an element-by-element test."""
    a, b = torch.randn(64, 128, device=DEVICE), torch.randn(128, 128, device=DEVICE) / 10
    codetta.gemm(a, b, out=torch.empty(64, 128, device=DEVICE))
    with pytest.raises(GemmError, match="shares memory with a"):
        codetta.gemm(a, b, out=a)
    big = torch.empty(4096, 2 * 1024, dtype=torch.bfloat16)
    assert not memory.share_elements(big[:, :1024], big[:, 1024:])
    assert memory.share_elements(big[:, :1025], big[:, 1024:])
    assert not memory.share_elements(big[1:, :1024], big[:-1, 1024:])


def test_tensors_written_in_place_count_the_write():
    """out= tensors and accumulating stores' operands get their version counter bumped, as
    PyTorch's in-place ops do: a backward through a graph that saved the old values raises (found
    by a probe: it returned a wrong gradient), and norm statistics made before the write are refused."""
    a, b = torch.randn(6, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    w = torch.randn(6, 4, device=DEVICE, requires_grad=True)
    z = w.exp()  # exp's backward reads its output z
    codetta.gemm(a, b, out=z.detach())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.sum().backward()

    accumulate = ep.Program("written_in_place_accumulate")
    accumulate.store("x", accumulate.acc, accumulate=True)
    x, stats = ops.linear_residual(torch.randn(6, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE),
                                   torch.randn(6, 4, device=DEVICE), torch.ones(4, device=DEVICE))
    before = x._version
    codetta.gemm(a, b, accumulate, x=x)
    assert x._version == before + 1
    with pytest.raises(ValueError, match="changed in place since"):
        ops.rmsnorm_linear(x, torch.ones(4, device=DEVICE), torch.randn(3, 4, device=DEVICE), stats=stats)


UNREADABLE = {  # kind: (a tensor of that kind, the start of the message naming it)
    "sparse": (lambda *shape: torch.randn(*shape, device=DEVICE).to_sparse(),
               "is a torch.sparse_coo tensor: codetta's kernels take dense"),
    "nested": (lambda *shape: torch.nested.nested_tensor([torch.randn(*shape, device=DEVICE)]),
               "is a nested tensor: codetta's kernels take dense"),
    # a real view whose values are the negation of what its memory holds (PyTorch's lazy negation)
    "negated": (lambda *shape: torch.randn(*shape, dtype=torch.complex64, device=DEVICE).conj().imag,
                "has PyTorch's negative bit set"),
}


@pytest.mark.parametrize("kind", sorted(UNREADABLE))
@pytest.mark.parametrize("where", ["a", "b", "b_part", "aux", "out", "accumulated"])
def test_tensors_the_kernels_cannot_read_as_stored_are_refused(where, kind):
    """Every tensor a call reads or writes is dense and holds its values as stored: a sparse or a
    nested one (no strides, nor a data pointer), or one with PyTorch's negative bit (its memory
    holds -values: read as it is stored, the result came out negated) gets a GemmError naming
    it; also after the same call with plain tensors (whose plan does not cover it)."""
    a, b = torch.randn(6, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    aux = ep.Program("unreadable_aux")
    aux.store("y", aux.acc + aux.aux("x"))
    accumulate = ep.Program("unreadable_accumulate")
    accumulate.store("y", accumulate.acc, accumulate=True)
    calls = {
        "a": (lambda make: codetta.gemm(make(6, 8), b), "a"),
        "b": (lambda make: codetta.gemm(a, make(8, 4)), "b"),
        "b_part": (lambda make: codetta.gemm(a, [b, make(8, 4)]), r"b\[1\]"),
        "aux": (lambda make: codetta.gemm(a, b, aux, x=make(6, 4)), "operand 'x'"),
        "out": (lambda make: codetta.gemm(a, b, out=make(6, 4)), r"out\['out'\]"),
        "accumulated": (lambda make: codetta.gemm(a, b, accumulate, y=make(6, 4)), "operand 'y'"),
    }
    call, name = calls[where]
    make, message = UNREADABLE[kind]
    call(lambda *shape: torch.randn(*shape, device=DEVICE))
    with pytest.raises(GemmError, match=rf"{name} .*{message}"):
        call(make)


def _operator_calls():
    """name -> (each public operator called on small valid tensors from a maker of tensors
    (``m(*shape, integer=False)``), the argument names in the order the maker is called): a
    maker that makes one of them sparse or nested shows what each operator says of it."""
    def t(*shape):
        return torch.randn(*shape, device=DEVICE)

    pos, inv_freq = torch.arange(4, device=DEVICE), torch.ones(2, device=DEVICE)
    return {
        "linear": (lambda m: codetta.linear(m(4, 8), m(6, 8), m(6)), ["x", "weight", "bias"]),
        "rms_norm": (lambda m: ops.rms_norm(m(4, 8), m(8)), ["x", "weight"]),
        "gated_activation": (lambda m: ops.gated_activation(m(4, 8), m(4, 8)), ["gate", "up"]),
        "apply_rope": (lambda m: ops.apply_rope(m(4, 8), m(4, 4), pos, inv_freq, head_dim=4), ["q", "k"]),
        "rmsnorm_linear": (lambda m: ops.rmsnorm_linear(m(4, 8), m(8), [t(6, 8), m(2, 8)]), ["x", "norm_weight",
                                                                                          "weight"]),
        "linear_residual": (lambda m: ops.linear_residual(m(4, 6), m(8, 6), m(4, 8), m(8)),
                            ["a", "weight", "residual", "norm_weight"]),
        "rmsnorm_swiglu": (lambda m: ops.rmsnorm_swiglu(m(4, 8), m(8), m(6, 8), m(6, 8)),
                           ["x", "norm_weight", "w_gate", "w_up"]),
        "swiglu_mlp": (lambda m: ops.swiglu_mlp(m(4, 8), m(8), m(6, 8), m(6, 8), m(8, 6)),
                       ["x", "norm_weight", "w_gate", "w_up", "w_down"]),
        "rmsnorm_qkv_rope": (lambda m: ops.rmsnorm_qkv_rope(m(4, 8), m(8), m(8, 8), m(4, 8), m(4, 8), pos, inv_freq,
                                                            head_dim=4), ["x", "norm_weight", "w_q", "w_k", "w_v"]),
        "linear_cross_entropy": (lambda m: ops.linear_cross_entropy(m(4, 8), m(10, 8), m(4, integer=True)),
                                 ["x", "weight", "target"]),
    }


@pytest.mark.parametrize("kind", ["sparse", "nested"])
@pytest.mark.parametrize("op", sorted(_operator_calls()))
def test_operators_refuse_sparse_and_nested_tensors_by_name(op, kind):
    """Each public operator runs on dense tensors and refuses a sparse or a nested one in any of
    its tensor arguments (also inside a list of weights) with a ValueError naming the operator and
    the argument, not an error from deep inside a reshape."""
    call, names = _operator_calls()[op]
    make_unreadable, message = UNREADABLE[kind]

    def dense(*shape, integer=False):
        return torch.randint(0, 4, shape, device=DEVICE) if integer else torch.randn(*shape, device=DEVICE)

    call(dense)
    for bad in names:
        made = []

        def make(*shape, integer=False):
            made.append(names[len(made)])
            return make_unreadable(*shape) if made[-1] == bad else dense(*shape, integer=integer)

        with pytest.raises(ValueError, match=rf"^{op}: {bad} {message}"):
            call(make)


def test_a_negated_view_reaches_no_kernel_as_stored():
    """codetta.linear refuses a negated view (it reaches the GEMM as it is); the operators that
    copy a strided input first compute on its values; one that would hand a contiguous negated
    view to a row kernel gets the same refusal, not the negation of PyTorch's result."""
    strided = UNREADABLE["negated"][0](5, 8)
    with pytest.raises(GemmError, match="negative bit"):
        codetta.linear(strided, torch.randn(3, 8, device=DEVICE))
    g = torch.rand(8, device=DEVICE) + 0.5
    torch.testing.assert_close(ops.rms_norm(strided, g), F.rms_norm(strided.resolve_neg(), (8,), g, 1e-6))
    contiguous = torch._neg_view(torch.randn(5, 8, device=DEVICE))
    assert contiguous.is_neg() and contiguous.is_contiguous()
    with pytest.raises(ValueError, match="negative bit"):
        ops.rms_norm(contiguous, g)


def test_an_inference_tensor_is_written_in_place_only_in_inference_mode():
    """An inference tensor counts no versions: PyTorch refuses to update it in place outside
    torch.inference_mode(), and so does codetta.gemm (out= or an accumulating store)."""
    a, b = torch.randn(6, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    accumulate = ep.Program("accumulate_inference")
    accumulate.store("y", accumulate.acc, accumulate=True)
    with torch.inference_mode():
        y, into = torch.zeros(6, 4, device=DEVICE), torch.ones(6, 4, device=DEVICE)
    with pytest.raises(GemmError, match=r"would write out\['out'\] in place, an inference tensor"):
        codetta.gemm(a, b, out=y)
    with pytest.raises(GemmError, match=r"would write operand 'y' \(accumulated into\) in place, an inference"):
        codetta.gemm(a, b, accumulate, y=into)
    with torch.inference_mode():
        codetta.gemm(a, b, out=y)
        codetta.gemm(a, b, accumulate, y=into)
    torch.testing.assert_close(y, a @ b)
    torch.testing.assert_close(into, a @ b + 1)


def test_a_tensor_autograd_tracks_is_not_written_in_place():
    """codetta.gemm records nothing for autograd: writing into a tensor that requires grad is refused
    while grad mode is on (as torch refuses an in-place write into a leaf that requires grad)."""
    a, b = torch.randn(6, 8, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    leaf = torch.zeros(6, 4, device=DEVICE, requires_grad=True)
    with pytest.raises(GemmError, match=r"would write out\['out'\] in place, which requires grad"):
        codetta.gemm(a, b, out=leaf)
    with torch.no_grad():
        codetta.gemm(a, b, out=leaf)
    torch.testing.assert_close(leaf.detach(), a @ b)

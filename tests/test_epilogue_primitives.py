"""Every epilogue primitive, run in the fused kernel, against independent fp64 math.

The expected values are written here from the definitions (index arithmetic, explicit
formulas), not with codetta's reference executor, so the two executors are checked
against something neither of them is. Shapes are odd (no multiple of any tile).
"""

import functools
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch

import codetta
from codetta import epilogue as ep
from codetta.kernels.rmsnorm import rstd_of_partial_sums
from conftest import DEVICE

M, N, K = 37, 48, 20


@pytest.fixture
def ab():
    a = torch.randn(M, K, device=DEVICE)
    b = torch.randn(K, N, device=DEVICE) / K**0.5
    return a, b, a.double().cpu() @ b.double().cpu()  # references are built on the CPU


def close(out, ref, tol=2e-5):
    out = out.cpu()
    scale = ref.abs().max().clamp_min(1.0)
    assert torch.isfinite(out).all()
    err = ((out.double() - ref).abs().max() / scale).item()
    assert err < tol, err


def _erf(x):
    return x.cpu().apply_(math.erf).to(x.device) if x.dtype == torch.float64 else torch.special.erf(x)


UNARY = {
    "exp": (ep.exp, torch.exp),
    "log": (lambda x: ep.log(ep.abs(x) + 0.5), lambda x: torch.log(x.abs() + 0.5)),
    "sqrt": (lambda x: ep.sqrt(ep.abs(x)), lambda x: x.abs() ** 0.5),
    "rsqrt": (lambda x: ep.rsqrt(ep.square(x) + 1.0), lambda x: 1 / (x * x + 1) ** 0.5),
    "reciprocal": (lambda x: ep.reciprocal(ep.abs(x) + 1.0), lambda x: 1 / (x.abs() + 1)),
    "sigmoid": (ep.sigmoid, lambda x: 1 / (1 + torch.exp(-x))),
    "tanh": (ep.tanh, torch.tanh),
    # relative precision near 0, where 1 - exp(-2|x|) cancels (tanh's series takes over there)
    "tanh_near_0": (lambda x: ep.tanh(x * 1e-4) * 1e4, lambda x: torch.tanh(x * 1e-4) * 1e4),
    "silu": (ep.silu, lambda x: x / (1 + torch.exp(-x))),
    "relu": (ep.relu, lambda x: torch.where(x > 0, x, 0.0)),
    "gelu_tanh": (
        ep.gelu_tanh,
        lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    ),
    "gelu_erf": (ep.gelu_erf, lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2)))),
    "sin": (ep.sin, torch.sin),
    "cos": (ep.cos, torch.cos),
    "floor": (lambda x: ep.floor(x * 4.0), lambda x: torch.floor(x * 4)),
    "neg_abs": (lambda x: -ep.abs(x), lambda x: -x.abs()),
    "builtin_abs": (lambda x: abs(x - 1.0), lambda x: (x - 1).abs()),
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name, ab):
    a, b, acc = ab
    f_ep, f_ref = UNARY[name]
    p = ep.Program(f"unary_{name}")
    p.store("out", f_ep(p.acc), dtype=torch.float32)
    out = codetta.gemm(a, b, p)["out"]
    if name == "floor":  # an fp32 acc near an integer boundary may floor either way
        assert ((out.cpu().double() - f_ref(acc)).abs() > 0).double().mean() < 0.02
        return
    close(out, f_ref(acc))


def test_operands_broadcast(ab):
    """row [M], column [N], scalar and aux tile [M, N] operands, each with its own indexing."""
    a, b, acc = ab
    r, c, x = torch.randn(M, device=DEVICE), torch.randn(N, device=DEVICE), torch.randn(M, N, device=DEVICE)
    p = ep.Program("operands")
    p.store("out", (p.acc * p.row("r") - p.col("c")) / (ep.abs(p.aux("x")) + 1.0) + p.scalar("s"), dtype=torch.float32)
    out = codetta.gemm(a, b, p, r=r, c=c, x=x, s=0.25)["out"]
    ref = torch.empty(M, N, dtype=torch.float64)
    for i in range(M):
        for j in range(N):
            ref[i, j] = (acc[i, j] * r[i].item() - c[j].item()) / (abs(x[i, j].item()) + 1) + 0.25
    close(out, ref)


def test_comparisons_where_minmax_fma(ab):
    a, b, acc = ab
    p = ep.Program("select")
    v = p.acc
    picked = ep.where((v > 0.1) & ~(v >= 0.8) | v.eq(0.0), ep.maximum(v, 0.3), ep.minimum(v, -0.2))
    p.store("out", ep.fma(picked, 2.0, p.row_index() - p.col_index()), dtype=torch.float32)
    out = codetta.gemm(a, b, p)["out"]
    cond = ((acc > 0.1) & ~(acc >= 0.8)) | (acc == 0)
    picked_ref = torch.where(cond, acc.clamp_min(0.3), acc.clamp_max(-0.2))
    idx = torch.arange(M, dtype=torch.float64)[:, None] - torch.arange(N, dtype=torch.float64)[None, :]
    close(out, picked_ref * 2 + idx)


def test_fma_rounds_once_in_both_executors():
    """Row 0: x * y + z with x = y = 1 + 2^-12, z = -(1 + 2^-11): exactly 2^-24, which two fp32
    roundings make 0. Row 1: -7 * 1e20 - 7, whose fp64 sum lies on an fp32 tie that the
    exact value does not: rounded twice it misses by one ulp (both found by probes: the
    reference executor rounded twice, then in fp64 and again in fp32)."""
    p = ep.Program("fma_rounding")
    p.store("out", ep.fma(p.aux("x"), p.aux("y"), p.aux("z")), dtype=torch.float32)
    a, b = torch.zeros(2, 4, device=DEVICE), torch.zeros(4, 16, device=DEVICE)
    rows = [(1 + 2**-12, 1 + 2**-12, -(1 + 2**-11)), (-7.0, 1e20, -7.0)]
    operands = {name: torch.tensor(column, device=DEVICE)[:, None].expand(2, 16) for name, column in
                zip("xyz", zip(*rows))}
    exact = [Fraction(float(np.float32(x))) * Fraction(float(np.float32(y))) + Fraction(float(np.float32(z)))
             for x, y, z in rows]
    expected = torch.tensor([_fp32_rounded(v) for v in exact], device=DEVICE)[:, None].expand(2, 16)
    for got in (codetta.gemm(a, b, p, **operands), ep.run_reference(p, a, b, operands)):
        assert torch.equal(got["out"], expected), (got["out"][:, 0], expected[:, 0])


def _fp32_rounded(value: Fraction) -> float:
    """The fp32 nearest to an exact rational (ties to even), by comparing the fp32 neighbours of
    its fp64 rounding exactly."""
    near = np.float32(float(value))
    candidates = (np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf)))
    return float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.uint32)) & 1)))


def test_a_long_chain_of_nodes():
    """A program of 2000 nodes in one chain runs in both executors (found by a probe: a recursion
    error in the program's topological order)."""
    p = ep.Program("long_chain")
    v = p.acc
    for _ in range(1000):
        v = v * 1.001 + 0.01
    p.store("y", v, dtype=torch.float32)
    a, b = torch.randn(3, 8, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    got, ref = codetta.gemm(a, b, p)["y"], ep.run_reference(p, a, b, {})["y"]
    # 2000 fp32 roundings (a compiler may contract each step into one fma): 1e-4 apart at most;
    # a step missing or repeated would be 1e-3
    torch.testing.assert_close(got, ref, rtol=3e-4, atol=3e-4)


def test_numeric_constants_of_any_real_type():
    """numpy scalars work on either side of an operator; a constant beyond a float, or a bool (what
    == gives), is refused naming the problem."""
    import numpy as np

    p = ep.Program("constants")
    p.store("y", p.acc * np.float32(2) + np.int64(1) + np.float32(0.5) * p.acc, dtype=torch.float32)
    a, b = torch.randn(3, 8, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    torch.testing.assert_close(codetta.gemm(a, b, p)["y"], 2.5 * (a @ b) + 1)
    with pytest.raises(ep.EpilogueError, match="beyond a float's range"):
        p.acc * 10**400
    with pytest.raises(ep.EpilogueError, match=r"\.eq\(\)"):
        ep.where(p.acc == 0, p.acc, 1.0)


@pytest.mark.parametrize("spelled, apply, instead", [
    ("x ** y", lambda x: x ** 2, "square"), ("x ** y", lambda x: 2 ** x, "exp"),
    ("x // y", lambda x: x // 2, "floor"), ("x // y", lambda x: 2 // x, "floor"),
    ("x % y", lambda x: x % 2, "floor"), ("x % y", lambda x: 2 % x, "floor"),
    ("round(x)", round, "round_to"), ("math.floor", math.floor, "floor"), ("math.floor", math.ceil, "floor"),
    ("math.floor", math.trunc, "floor"), ("x @ y", lambda x: x @ x, "x \\* y"),
], ids=["pow", "rpow", "floordiv", "rfloordiv", "mod", "rmod", "round", "floor", "ceil", "trunc", "matmul"])
def test_python_operators_without_an_epilogue_operation_are_refused_naming_the_program(spelled, apply, instead):
    p = ep.Program("no_such_operation")
    with pytest.raises(ep.EpilogueError, match=rf"'no_such_operation'.*{re.escape(spelled)}.*{instead}"):
        apply(p.acc)


def test_unary_plus_is_the_value_itself():
    p = ep.Program("unary_plus")
    assert +p.acc is p.acc


def test_constants_are_fp32_as_in_the_reference():
    """A constant is rounded to fp32, as the reference takes it: 1e300 is inf there, not an fp64
    value carrying its expression into fp64 (found by a probe: Triton types a Python float
    outside fp32's normal range as fp64, and where() of two such constants gave +-1 here)."""
    p = ep.Program("constants_beyond_fp32")
    p.store("y", ep.where(p.acc > 0, 1e300, -1e300) * 1e-300, dtype=torch.float32)  # fp32: inf * 0
    p.store("z", ep.where(p.acc > 0, 1e-40, -1e-40) * 1e30, dtype=torch.float32)  # an fp32 subnormal
    a, b = torch.randn(5, 8, device=DEVICE), torch.randn(8, 16, device=DEVICE)
    got, ref = codetta.gemm(a, b, p), ep.run_reference(p, a, b, {})
    assert torch.isnan(got["y"]).all() and torch.isnan(ref["y"]).all()
    if DEVICE == "cpu":  # a GPU may flush fp32 subnormals to zero
        assert torch.equal(got["z"], ref["z"])
        assert not torch.equal(got["z"].abs(), torch.full_like(got["z"], 1e-10))  # 1e-10: computed in fp64


@pytest.mark.parametrize("segment", [2, 8, 16])
def test_pairs_then_combine(segment, ab):
    """2 -> 1: column j of each segment with j + S/2 (S = 2: adjacent columns)."""
    a, b, acc = ab
    p = ep.Program(f"pairs{segment}")
    first, second = ep.pairs(p.acc, segment=segment)
    p.store("y", ep.silu(first) * second, dtype=torch.float32)
    out = codetta.gemm(a, b, p)["y"]
    half = segment // 2
    ref = torch.empty(M, N // 2, dtype=torch.float64)
    for q in range(N // 2):
        j = (q // half) * segment + q % half
        g, u = acc[:, j], acc[:, j + half]
        ref[:, q] = g / (1 + torch.exp(-g)) * u
    close(out, ref)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_one_byte_masks_at_full_and_half_width(dtype):
    """A dropout-style mask of one-byte integers, as a full tile and as a half-width one after a
    2 -> 1 pair (SwiGLU's output): read as integers, whatever their tiles' width in bytes (rows
    of 32 and 16 bytes, aligned for TMA, whose blocks need 16 bytes or more)."""
    n = 32
    a = torch.randn(M, K, device=DEVICE)
    b = torch.randn(K, n, device=DEVICE) / K**0.5
    acc = a.double().cpu() @ b.double().cpu()
    full = torch.randint(0, 3, (M, n), device=DEVICE, dtype=dtype)
    half = torch.randint(0, 3, (M, n // 2), device=DEVICE, dtype=dtype)
    p = ep.Program("one_byte_masks")
    first, second = ep.pairs(p.acc * p.aux("full"), segment=2)
    p.store("y", first * second * p.aux("half", ep.HALF), dtype=torch.float32)
    out = codetta.gemm(a, b, p, full=full, half=half)["y"]
    masked = acc * full.cpu().double()
    close(out, masked[:, 0::2] * masked[:, 1::2] * half.cpu().double())


@pytest.mark.parametrize("segment", [2, 16])
def test_pairs_rotation_and_join(segment, ab):
    """2 -> 2: a rotation of every pair by a per-pair angle (RoPE's shape), back into N columns."""
    a, b, acc = ab
    theta = torch.rand(N // 2, device=DEVICE) * 6
    p = ep.Program(f"rotate{segment}")
    x1, x2 = ep.pairs(p.acc, segment=segment)
    cos, sin = ep.cos(p.col("theta", ep.HALF)), ep.sin(p.col("theta", ep.HALF))
    p.store("out", ep.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin, segment=segment), dtype=torch.float32)
    out = codetta.gemm(a, b, p, theta=theta)["out"]
    half = segment // 2
    ref = torch.empty(M, N, dtype=torch.float64)
    for q in range(N // 2):
        j = (q // half) * segment + q % half
        t = theta[q].double().item()
        ref[:, j] = acc[:, j] * math.cos(t) - acc[:, j + half] * math.sin(t)
        ref[:, j + half] = acc[:, j + half] * math.cos(t) + acc[:, j] * math.sin(t)
    close(out, ref)


def test_segment_sum_and_max_in_tile(ab):
    """A per-segment reduction used inside the tile (QK-norm's per-head statistics)."""
    a, b, acc = ab
    p = ep.Program("segment_stats")
    p.store("out", p.acc * ep.rsqrt(ep.segment_sum(ep.square(p.acc), 16) / 16.0 + 1e-6) + ep.segment_max(p.acc, 8),
            dtype=torch.float32)
    out = codetta.gemm(a, b, p)["out"]
    heads = acc.view(M, N // 16, 16)
    norm = (heads / (heads.square().mean(-1, keepdim=True) + 1e-6).sqrt()).reshape(M, N)
    seg_max = acc.view(M, N // 8, 8).amax(-1, keepdim=True).expand(M, N // 8, 8).reshape(M, N)
    close(out, norm + seg_max)


@pytest.mark.parametrize("dtype, segment", [(torch.float32, 512), (torch.bfloat16, 1024)])
def test_segments_wider_than_every_tuned_tile(dtype, segment):
    """A segment wider than the tuned tiles (256 columns) widens the tile to hold it whole; on a
    GPU, configs with shallower K steps fit such a tile in shared memory (512 columns of fp32, 1024
    of bf16)."""
    m, k = 20, 24
    a = torch.randn(m, k, device=DEVICE).to(dtype)
    b = (torch.randn(k, 2 * segment, device=DEVICE) / k**0.5).to(dtype)
    p = ep.Program(f"wide_segments{segment}")
    p.store("out", p.acc * ep.rsqrt(ep.segment_sum(ep.square(p.acc), segment) / segment + 1e-6), dtype=dtype)
    out = codetta.gemm(a, b, p)["out"]
    heads = (a.double().cpu() @ b.double().cpu()).view(m, 2, segment)
    close(out, (heads / (heads.square().mean(-1, keepdim=True) + 1e-6).sqrt()).reshape(m, 2 * segment),
          tol=2e-5 if dtype == torch.float32 else 2**-7)


def test_row_and_column_reductions(ab):
    a, b, acc = ab
    p = ep.Program("reductions")
    p.row_sum("rsum", p.acc)
    p.row_sumsq("rss", p.acc)
    p.row_max("rmax", p.acc)
    p.row_logsumexp("lse", p.acc * 3.0)
    p.row_logsumexp("lse_seg", p.acc, segment=16)
    p.row_sum("rsum_seg", p.acc, segment=8)
    p.col_sum("csum", p.acc * p.row("w"))
    w = torch.rand(M, device=DEVICE)
    out = codetta.gemm(a, b, p, w=w)
    for name in out:
        assert out[name].dtype == torch.float32
    close(out["rsum"], acc.sum(1))
    close(out["rss"], (acc * acc).sum(1))
    close(out["rmax"], acc.max(1).values)
    close(out["lse"], torch.log(torch.exp(3 * acc).sum(1)))
    close(out["lse_seg"], torch.log(torch.exp(acc.view(M, 3, 16)).sum(-1)))
    close(out["rsum_seg"], acc.view(M, 6, 8).sum(-1))
    close(out["csum"], (acc * w.double().cpu()[:, None]).sum(0))


def test_finish_replaces_a_reductions_finishing_step(ab):
    """``finish=`` hands a reduction's fp32 partials to a function of the caller's: here the sums
    of squares finished straight into an RMSNorm's rstd (one kernel), also for a call without
    rows or columns; the other reductions keep their own finishing step."""
    a, b, acc = ab
    p = ep.Program("finish_override")
    p.row_sumsq("rstd", p.acc)
    p.col_sum("csum", p.acc)
    eps = 1e-5
    finish = {"rstd": functools.partial(rstd_of_partial_sums, d=N, eps=eps)}
    out = codetta.gemm(a, b, p, finish=finish)
    close(out["rstd"], 1 / ((acc * acc).mean(1) + eps) ** 0.5)
    close(out["csum"], acc.sum(0))
    seen = []
    codetta.gemm(a, b, p, finish={"csum": lambda part: seen.append(tuple(part.shape)) or part.sum(0)})
    assert len(seen) == 1 and seen[0][1] == N  # [row tiles, N] partials
    empty = codetta.gemm(a[:0], b, p, finish=finish)
    assert empty["rstd"].shape == (0,) and empty["csum"].shape == (N,)
    # explain takes gemm's arguments, finish= too (checked as gemm checks it)
    assert codetta.explain(a, b, p, finish=finish) == codetta.explain(a, b, p)
    with pytest.raises(codetta.GemmError, match="has no reduction 'nope'"):
        codetta.explain(a, b, p, finish={"nope": sum})


@pytest.mark.parametrize("rows", [M, 0], ids=["rows", "no_rows"])
def test_finish_writes_into_out(rows, ab):
    """A reduction finished by the caller's function lands in the tensor given in ``out``, also
    for a call without rows (its partials over no tile)."""
    a, b, acc = ab
    p = ep.Program("finish_into_out")
    p.row_sum("rsum", p.acc)
    p.col_sum("csum", p.acc)
    given = {"rsum": torch.full((rows,), 7.0, device=DEVICE), "csum": torch.full((N,), 7.0, device=DEVICE)}
    finish = {"rsum": lambda part: part.sum(1) * 2, "csum": lambda part: part.sum(0) * 2}
    out = codetta.gemm(a[:rows], b, p, out=given, finish=finish)
    assert out["rsum"] is given["rsum"] and out["csum"] is given["csum"]
    close(given["csum"], 2 * acc[:rows].sum(0))  # zeros without rows
    if rows:
        close(given["rsum"], 2 * acc.sum(1))


@pytest.mark.parametrize("result, got", [
    (lambda part: part.sum(), r"\(\)"), (lambda part: part, r"\(\d+, \d+\)"),
    (lambda part: part.sum(1)[:-1], r"\(\d+,\)"),
], ids=["scalar", "partials", "short"])
def test_finish_result_is_checked(result, got, ab):
    """A tensor the caller's finishing function returns must be the reduction's [M] (or in its
    leading dims): else a GemmError says what came back, not a reshape's error or a silent
    reshape. Anything else is the caller's to have (here two tensors), but not into ``out``."""
    a, b, acc = ab
    p = ep.Program("finish_result")
    p.row_sum("rsum", p.acc)
    with pytest.raises(codetta.GemmError, match=rf"finish\['rsum'\] must return a tensor of shape .*got .*{got}"):
        codetta.gemm(a[None], b, p, finish={"rsum": result})
    both = codetta.gemm(a, b, p, finish={"rsum": lambda part: (part.sum(1), part.amax(1))})["rsum"]
    close(both[0], acc.sum(1))
    with pytest.raises(codetta.GemmError, match=r"finish\['rsum'\] returned tuple, which cannot be written into out"):
        codetta.gemm(a, b, p, out={"rsum": torch.empty(M, device=DEVICE)}, finish={"rsum": lambda part: (part,)})


def test_rstd_of_partial_sums_matches_torch():
    part = torch.rand(45, 7, device=DEVICE) * 3
    ref = 1 / (part.double().sum(1) / 9 + 1e-6) ** 0.5
    close(rstd_of_partial_sums(part, 9, 1e-6), ref.cpu(), tol=1e-6)
    assert rstd_of_partial_sums(part[:0], 9, 1e-6).shape == (0,)


@pytest.mark.parametrize("finish, message", [
    ([], "must be a dict"), ({"nope": abs}, "no reduction 'nope'"), ({"out": abs}, "no reduction 'out'"),
    ({"seg": abs}, "no reduction 'seg'"), ({"rss": 3}, "must be a function"),
])
def test_finish_refuses_what_it_cannot_replace(finish, message, ab):
    a, b, _ = ab
    p = ep.Program("finish_checked")
    p.store("out", p.acc)
    p.row_sumsq("rss", p.acc)
    p.row_sum("seg", p.acc, segment=8)
    with pytest.raises(codetta.GemmError, match=message):
        codetta.gemm(a, b, p, finish=finish)


def test_max_reductions_keep_nan(ab):
    """A NaN in a row (a diverged activation) comes out of row_max and segment_max as NaN, as
    from torch.amax and the reference executor, not the max of the other values."""
    a, b, acc = ab
    x = torch.randn(M, N, device=DEVICE)
    x[0, 5] = float("nan")
    x[3, 40] = float("nan")
    p = ep.Program("max_keeping_nan")
    z = p.acc + p.aux("x")
    p.row_max("rmax", z)
    p.row_max("rmax_seg", z, segment=8)
    p.store("smax", ep.segment_max(z, 8), dtype=torch.float32)
    out = codetta.gemm(a, b, p, x=x)
    ref = ep.run_reference(p, a, b, {"x": x})
    z64 = acc + x.double().cpu()
    expected = {"rmax": z64.amax(1), "rmax_seg": z64.view(M, N // 8, 8).amax(-1),
                "smax": z64.view(M, N // 8, 8).amax(-1, keepdim=True).expand(M, N // 8, 8).reshape(M, N)}
    for name, e in expected.items():
        assert torch.equal(out[name].isnan().cpu(), e.isnan()) and torch.equal(ref[name].isnan().cpu(), e.isnan()), name
        close(out[name].nan_to_num(), e.nan_to_num())


def test_relu_keeps_nan(ab):
    """relu(NaN) = NaN, as torch.relu gives and the reference executor says, not max(NaN, 0) = 0
    (which would hide a diverged activation); relu(±inf) = inf, 0."""
    a, b, acc = ab
    x = torch.randn(M, N, device=DEVICE)
    x[0, 5], x[3, 40], x[7, 1], x[7, 2] = float("nan"), float("nan"), float("inf"), float("-inf")
    p = ep.Program("relu_nan")
    p.store("out", ep.relu(p.acc + p.aux("x")), dtype=torch.float32)
    out = codetta.gemm(a, b, p, x=x)["out"].cpu()
    z64 = acc + x.double().cpu()
    expected = torch.where(z64 > 0, z64, torch.where(z64.isnan(), z64, 0.0))
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out.isinf(), expected.isinf())
    assert torch.equal(ep.run_reference(p, a, b, {"x": x})["out"].isnan().cpu(), expected.isnan())
    close(out.nan_to_num(posinf=0.0), expected.nan_to_num(posinf=0.0))


@pytest.mark.parametrize("name", ["gelu_erf", "gelu_tanh"])
def test_gelu_in_both_executors_at_inf(name, ab):
    """GELU(+inf) = inf and GELU(-inf) = NaN (x times 0: the formula's, fp64 PyTorch's) in the kernel
    and in the reference executor alike (PyTorch's vectorized CPU F.gelu gave NaN at +inf); the finite
    values to fp32's absolute precision (1 + erf(x) cancels in the negative tail: a few 1e-7 times |x|)."""
    a, b, acc = ab
    x = torch.zeros(M, N, device=DEVICE)
    x[:, :8] = torch.tensor([float("inf"), float("-inf"), -3.0, -5.0, -8.0, 3.0, 1e30, -1e30])
    p = ep.Program(f"{name}_extremes")
    p.store("out", getattr(ep, name)(p.aux("x")), dtype=torch.float32)
    x64 = x.double().cpu()
    expected = UNARY[name][1](x64)
    for got in (codetta.gemm(a, b, p, x=x)["out"].cpu(), ep.run_reference(p, a, b, {"x": x})["out"].cpu()):
        assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.isinf(), expected.isinf())
        finite = expected.isfinite()
        torch.testing.assert_close(got.double()[finite], expected[finite], rtol=2e-6, atol=1e-6)


def test_logsumexp_of_minus_infinity_rows(ab):
    """Masked logits (-inf) in some tiles, whole rows of -inf: max-subtraction must not give NaN."""
    a, b, acc = ab
    p = ep.Program("lse_masked")
    keep = p.col_index() < p.row("limit")
    p.row_logsumexp("lse", ep.where(keep, p.acc, float("-inf")))
    limit = torch.randint(1, N, (M,), device=DEVICE).float()
    limit[0] = 0  # nothing kept: -inf
    out = codetta.gemm(a, b, p, limit=limit)["lse"]
    masked = torch.where(torch.arange(N)[None, :] < limit.cpu()[:, None], acc, float("-inf"))
    ref = torch.logsumexp(masked, 1)
    assert out[0].item() == float("-inf")
    close(out[1:], ref[1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_and_store_dtypes(dtype, ab):
    """round_to gives exactly what a store of that dtype keeps (round to nearest even)."""
    a, b, acc = ab
    p = ep.Program("rounding")
    x = p.acc * 3.7
    p.store("low", x, dtype=dtype)
    p.store("again", ep.round_to(x, dtype), dtype=torch.float32)
    out = codetta.gemm(a, b, p)
    ref = (acc * 3.7).float().to(dtype)
    assert out["low"].dtype == dtype
    assert (out["low"].float() != ref.float().to(out["low"].device)).float().mean() < 0.01  # fp32 acc vs fp64
    assert torch.equal(out["again"], out["low"].float())


def test_bf16_store_of_subnormals_and_nan_payloads(ab):
    """A bf16 store rounds as torch's .bfloat16() also for subnormals, ties and values rounding
    to inf, and keeps NaN a NaN whatever its payload (Triton's interpreter converts subnormals
    wrongly, and its round-to-nearest emulation carried a NaN's payload into the sign: -0.0)."""
    a, b, _ = ab
    bits = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0x7FC00000, 0x7F800001], dtype=torch.int64)
    special = torch.cat([bits.to(torch.int32).view(torch.float32),
                         torch.tensor([1e-39, -1e-39, 1e-40, 5.9e-39, 1.1754942e-38, 1.00390625, 1.01171875,
                                       3.3961e38, 3.4028235e38, -0.0])])
    x = torch.randn(M, N)
    x.view(-1)[torch.randperm(M * N)[: 4 * len(special)]] = special.repeat(4)
    x = x.to(DEVICE)
    p = ep.Program("bf16_store_bits")
    p.store("y", p.aux("x"), dtype=torch.bfloat16)
    out = codetta.gemm(a, b, p, x=x)["y"].cpu()
    want = x.cpu().bfloat16()
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])


def test_accumulate_into_existing_output(ab):
    a, b, acc = ab
    prior = torch.randn(M, N, device=DEVICE)
    target = prior.clone()
    p = ep.Program("accumulate")
    p.store("grad", p.acc * 0.5, accumulate=True)
    out = codetta.gemm(a, b, p, grad=target)["grad"]
    assert out.data_ptr() == target.data_ptr()
    close(target, prior.double().cpu() + 0.5 * acc)


def test_accumulating_store_returns_its_tensor_as_given_by_both_executors(ab):
    """a with a leading dim [1, M, K] and the tensor added into given flat [M, N]: codetta.gemm
    returns that tensor, the reference executor a new one of its shape (it returned [1, M, N])."""
    a, b, acc = ab
    prior = torch.randn(M, N, device=DEVICE)
    p = ep.Program("accumulate_flat")
    p.store("grad", p.acc * 0.5, accumulate=True)
    batched = a.unsqueeze(0)
    expected = codetta.run_reference(p, batched, b, {"grad": prior}, torch.float64)["grad"]
    target = prior.clone()
    got = codetta.gemm(batched, b, p, grad=target)["grad"]
    assert got is target and expected.shape == target.shape == (M, N)
    close(expected, prior.double().cpu() + 0.5 * acc)
    close(got, prior.double().cpu() + 0.5 * acc)


def test_half_width_operands_and_outputs(ab):
    """Column vectors and aux tiles over the N/2 pairs line up with pair outputs."""
    a, b, acc = ab
    c, x = torch.randn(N // 2, device=DEVICE), torch.randn(M, N // 2, device=DEVICE)
    p = ep.Program("half_operands")
    g, u = ep.pairs(p.acc)
    p.store("out", g * p.col("c", ep.HALF) + u * p.aux("x", ep.HALF), dtype=torch.float32)
    p.col_sum("csum", g)
    out = codetta.gemm(a, b, p, c=c, x=x)
    close(out["out"], acc[:, 0::2] * c.double().cpu() + acc[:, 1::2] * x.double().cpu())
    close(out["csum"], acc[:, 0::2].sum(0))


@pytest.mark.parametrize("period, strided", [(5, False), (16, True), (4, False), (8, False), (256, False), (24, False),
                                             (33, False)])
def test_tables_repeat_along_columns(period, strided, ab):
    """A table [M, P] is read at column j % P (FULL) or pair j % P (HALF): through TMA blocks
    [BM, P] repeated along the tile where P is a power of two of 16 bytes or more and the
    tables allow it, else through pointers (a strided view, P = 5, 24 or 33, a pair table wider than
    any tile; found by a probe: P = 24 or 33 made the interpreter's config for the TMA path, with a
    tile width no power of two, and raised)."""
    a, b, acc = ab
    full = torch.randn(M, 2 * period, device=DEVICE)[:, ::2] if strided else torch.randn(M, period, device=DEVICE)
    half = torch.randn(M, period, device=DEVICE)
    p = ep.Program(f"tables_{period}")
    g, u = ep.pairs(p.acc)
    p.store("out", p.acc * p.table("t", period), dtype=torch.float32)
    p.store("hout", g + u * p.table("h", period, ep.HALF), dtype=torch.float32)
    tma = not strided and period in (4, 8) and N % 2 == 0
    assert codetta.explain(a, b, p, t=full, h=half)["path"] == ("tma" if tma else "ptr")
    out = codetta.gemm(a, b, p, t=full, h=half)
    cols, pairs = torch.arange(N) % period, torch.arange(N // 2) % period
    close(out["out"], acc * full.double().cpu()[:, cols])
    close(out["hout"], acc[:, 0::2] + acc[:, 1::2] * half.double().cpu()[:, pairs])
    with pytest.raises(ep.EpilogueError, match="is a table"):
        codetta.gemm(a, b, p, t=full[:, :-1], h=half)


def test_generated_source_is_readable_triton():
    p = ep.Program("show_me")
    p.store("y", ep.silu(p.acc) * p.row("r"))
    src = codetta.kernel_source(p, "tma")
    assert "@triton.jit" in src and "def epilogue(" in src and "tl.sigmoid" in src
    assert "y_desc.store" in src and "r_ptr" in src
    assert "tl.store(y_ptrs" in codetta.kernel_source(p, "ptr")


def test_programs_key_dicts_and_caches_by_identity():
    """A program is hashable (a user's cache of per-program results); two programs built alike
    are two keys, with one fingerprint."""
    def build():
        p = ep.Program("twin")
        p.store("y", p.acc * p.row("r"))
        return p

    a, b = build(), build()
    assert a != b and len({a, b}) == 2 and a == a
    assert a.fingerprint() == b.fingerprint()
    assert functools.lru_cache(maxsize=None)(lambda p: p.name)(a) == "twin"


def test_both_executors_define_every_elementwise_function_of_the_language():
    """The language's elementwise functions (epilogue.ir) are the ones the reference executor
    and the code generator each define: none missing from either, none defined only there."""
    from codetta.epilogue import codegen, ir, reference
    assert set(reference._UNARY) == set(codegen._UNARY) == set(ir.UNARY_OPS)
    assert set(reference._BINARY) == set(codegen._BINARY) == set(ir.BINARY_OPS)

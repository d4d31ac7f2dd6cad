"""Random well-formed epilogue programs: the Triton kernel agrees with the fp64 reference.

A Hypothesis strategy writes the Python source of a random program (expression trees
of depth <= 4 over acc, row / col / aux / table / scalar operands, indices and constants, with
pairs / join / segment steps, and one to three outputs of random kinds); the test
builds it, runs ``codetta.gemm`` on random shapes and compares every output with
``ep.run_reference`` evaluated in float64 on the same inputs.

Keeping the comparison meaningful:

* All inputs are small dyadic numbers (multiples of 1/4), so acc = a @ b, and any
  expression built only from sums, products, max/min, floor and rounding of such
  values ("exact" values, tracked by the generator with a bound on their magnitude
  and on their fraction bits), is computed exactly in fp32 and in fp64. Comparisons
  (for ``where``), ``floor`` and ``round_to`` are only applied to exact values, so a
  comparison can never come out differently in the kernel and in the reference.
* Functions that are unsafe for some inputs only see safe ones: log / sqrt / rsqrt of
  square(x) + 1, exp of minimum(x, 3), division by abs(y) + 1.
* The generator keeps a bound on the magnitude of every intermediate value and never
  builds one above ``_LIMIT``, so fp32 rounding stays small against the tolerance.

The falsifying example printed by Hypothesis is the program's source, which can be
pasted after ``p = ep.Program("rand")``; the generated kernel is attached with note().
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import codetta
from codetta import Config
from codetta import epilogue as ep
from conftest import DEVICE, INTERPRET

_LIMIT = 100.0  # no intermediate value may exceed this bound (typical magnitude)
_EXACT_BITS = 22  # an exact value needs |v| * 2**frac_bits < 2**22 (fp32 has 24)
_MAX_K = 40
_MAX_M = 40
_MAX_N = 64


@pytest.fixture(autouse=True, scope="module")
def _private_kernel_cache(tmp_path_factory):
    """Generated kernels of random programs go to a temporary cache, not the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CODETTA_CACHE_DIR", str(tmp_path_factory.mktemp("codetta_cache")))
    yield
    mp.undo()


# --------------------------------------------------------------------------------------
# The program generator


@dataclass(frozen=True)
class Val:
    """A generated expression: its source, shape class and what is known of its values.

    width: ep.FULL, ep.HALF, or None (constant along columns).
    mag: a bound on |value| for the test's inputs (typical, used to keep values small).
    exact: (bound on |value|, fraction bits) when fp32 and fp64 compute it exactly, else None.
    """

    text: str
    width: ep.Width | None
    mag: float
    exact: tuple[float, int] | None


def _exact(bound, bits):
    """(bound, bits) if a value of that bound and fraction bits is exact in fp32, else None."""
    return (bound, bits) if bound * 2.0**bits < 2.0**_EXACT_BITS else None


_WTEXT = {ep.FULL: "ep.FULL", ep.HALF: "ep.HALF"}
_CONSTS = (-1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0)
_SEGMENTS = (2, 2, 4, 4, 8, 16)


class ProgramWriter:
    """Draws a random program and writes it as Python source, one statement a line."""

    def __init__(self, draw):
        self.draw = draw
        self.lines = []
        self.temps = 0
        self.shared = None  # a FULL value bound to a name, reused as a leaf

    def flip(self, p=0.5):
        """True with probability about p (integers: Hypothesis's floats favour 0 and 1)."""
        return self.draw(st.integers(0, 99)) < 100 * p

    def choose(self, options):
        return self.draw(st.sampled_from(list(options)))

    def temp(self, text):
        name = f"t{self.temps}"
        self.temps += 1
        self.lines.append(f"{name} = {text}")
        return name

    # leaves -----------------------------------------------------------------------
    def leaf(self, width, exact_only):
        """A leaf over ``width`` columns (None: constant along columns, never a bare constant)."""
        i = self.draw(st.integers(0, 1))
        if width is None:
            kinds = ["row", "scalar", "row_index"]
        else:
            kinds = ["col", "aux", "table", "col_index"] + (["acc", "acc"] if width is ep.FULL else [])
            if width is ep.FULL and self.shared is not None and (self.shared.exact or not exact_only):
                kinds += ["shared", "shared"]
        kind = self.choose(kinds)
        w = _WTEXT.get(width)
        suffix = "h" if width is ep.HALF else ""
        if kind == "acc":
            return Val("p.acc", ep.FULL, 8.0, (float(_MAX_K), 4))
        if kind == "shared":
            return self.shared
        if kind == "row":
            return Val(f"p.row('r{i}')", None, 2.0, (2.0, 2))
        if kind == "scalar":
            return Val(f"p.scalar('s{i}')", None, 2.0, (2.0, 2))
        if kind == "row_index":
            return Val("(p.row_index() * 0.25)", None, _MAX_M / 4, (_MAX_M / 4, 2))
        if kind == "col":
            return Val(f"p.col('c{suffix}{i}', {w})", width, 2.0, (2.0, 2))
        if kind == "aux":
            return Val(f"p.aux('x{suffix}{i}', {w})", width, 2.0, (2.0, 2))
        if kind == "table":
            return Val(f"p.table('t{suffix}{i}', {3 + 2 * i}, {w})", width, 2.0, (2.0, 2))
        return Val(f"(p.col_index({w}) * 0.125)", width, _MAX_N / 8, (_MAX_N / 8, 3))

    def const(self):
        c = self.choose(_CONSTS)
        return Val(repr(c), None, abs(c), (abs(c), 2))

    # expressions ------------------------------------------------------------------
    def expr(self, width, depth, vary=True, exact_only=False):
        """An expression whose width is ``width`` (if vary) or None (if not vary)."""
        target = width if vary else None
        if depth <= 0 or self.flip(0.15):
            return self.leaf(target, exact_only)
        kinds = ["unary", "binary", "binary"]
        if not exact_only:
            kinds += ["where", "fma"]
        if target is not None:
            kinds += ["segment"]
        if target is ep.HALF:
            kinds += ["pairs", "pairs"]
        if target is ep.FULL:
            kinds += ["join"]
        kind = self.choose(kinds)
        return getattr(self, kind)(target, depth, exact_only)

    def unary(self, width, depth, exact_only):
        x = self.expr(width, depth - 1, width is not None, exact_only)
        m, ex = x.mag, x.exact
        options = {  # text -> (mag, exact)
            f"(-{x.text})": (m, ex),
            f"ep.abs({x.text})": (m, ex),
            f"ep.relu({x.text})": (m, ex),
        }
        if m * m <= _LIMIT:
            options[f"ep.square({x.text})"] = (m * m, ex and _exact(ex[0] ** 2, 2 * ex[1]))
        if ex is not None:  # discontinuous functions: exact arguments only
            options[f"ep.floor({x.text} * 0.5)"] = (m / 2 + 1, _exact(ex[0] / 2 + 1, 0))
            dt = self.choose(["torch.bfloat16", "torch.float16"])
            options[f"ep.round_to({x.text}, {dt})"] = (m * 1.01, _exact(ex[0] * 1.01, ex[1]))
        if not exact_only:
            options.update({
                f"ep.sigmoid({x.text})": (1.0, None),
                f"ep.tanh({x.text})": (1.0, None),
                f"ep.silu({x.text})": (m, None),
                f"ep.gelu_tanh({x.text})": (m, None),
                f"ep.gelu_erf({x.text})": (m, None),
                f"ep.sin({x.text})": (1.0, None),
                f"ep.cos({x.text})": (1.0, None),
                f"ep.exp(ep.minimum({x.text}, 3.0))": (math.exp(3.0), None),
                f"ep.log(ep.square({x.text}) + 1.0)": (math.log(m * m + 1), None),
                f"ep.sqrt(ep.square({x.text}) + 1.0)": (m + 1, None),
                f"ep.rsqrt(ep.square({x.text}) + 1.0)": (1.0, None),
                f"ep.reciprocal(ep.abs({x.text}) + 1.0)": (1.0, None),
            })
        return self.pick(options, x.width, exact_only)

    def pick(self, options, width, exact_only):
        """Draw one of ``options`` (text -> (mag, exact)) within the magnitude limit.

        When none is within it (an argument already near the limit), the smallest one.
        """
        options = {t: v for t, v in options.items() if v[1] is not None or not exact_only}
        allowed = {t: v for t, v in options.items() if v[0] <= _LIMIT}
        if not allowed:
            text = min(options, key=lambda t: options[t][0])
            allowed = {text: options[text]}
        text = self.choose(sorted(allowed))
        return Val(text, width, *allowed[text])

    def operands_of(self, width, depth, exact_only, n=2):
        """n expressions that broadcast to ``width``; at least one varies if width is set.

        At most one is a bare constant, never the first (ops need an epilogue value).
        """
        varying = self.draw(st.integers(0, n - 1)) if width is not None else None
        const_at = self.draw(st.integers(1, n - 1)) if self.flip(0.3) else None
        out = []
        for i in range(n):
            if i == const_at and i != varying:
                out.append(self.const())
            else:
                vary = width is not None and (i == varying or self.flip(0.5))
                out.append(self.expr(width, depth - 1, vary, exact_only))
        return out

    def binary(self, width, depth, exact_only):
        x, y = self.operands_of(width, depth, exact_only)
        mx, my = x.mag, y.mag
        both = x.exact is not None and y.exact is not None
        bits = max(x.exact[1], y.exact[1]) if both else 0
        sum_ex = both and _exact(x.exact[0] + y.exact[0], bits)
        max_ex = both and _exact(max(x.exact[0], y.exact[0]), bits)
        options = {
            f"({x.text} + {y.text})": (mx + my, sum_ex),
            f"({x.text} - {y.text})": (mx + my, sum_ex),
            f"ep.maximum({x.text}, {y.text})": (max(mx, my), max_ex),
            f"ep.minimum({x.text}, {y.text})": (max(mx, my), max_ex),
            f"({x.text} * {y.text})": (mx * my, both and _exact(x.exact[0] * y.exact[0], x.exact[1] + y.exact[1])),
        }
        if _is_const(y):  # also with the constant on the left: the reflected operators
            options[f"({y.text} - {x.text})"] = (mx + my, sum_ex)
            options[f"({y.text} * {x.text})"] = options[f"({x.text} * {y.text})"]
        else:
            options[f"({x.text} / (ep.abs({y.text}) + 1.0))"] = (mx, None)
        options = {t: (m, ex or None) for t, (m, ex) in options.items()}
        return self.pick(options, x.width or y.width, exact_only)

    def condition(self, width, depth):
        """A boolean over ``width`` (or None) built from exact values only."""
        if depth > 1 and self.flip(0.25):
            c1 = self.condition(width, depth - 1)
            if self.flip(0.3):
                return Val(f"(~{c1.text})", c1.width, 0.0, None)
            c2 = self.condition(width, depth - 1)
            op = self.choose(["&", "|"])
            return Val(f"({c1.text} {op} {c2.text})", c1.width or c2.width, 0.0, None)
        vary = width is not None and self.flip(0.7)
        x = self.expr(width, depth - 1, vary, exact_only=True)
        y = self.const() if self.flip(0.5) else self.expr(width, depth - 2, False, exact_only=True)
        op = self.choose(["<", "<=", ">", ">=", "eq", "ne"])
        text = f"{x.text}.{op}({y.text})" if op in ("eq", "ne") else f"({x.text} {op} {y.text})"
        return Val(text, x.width or y.width, 0.0, None)

    def where(self, width, depth, exact_only):
        cond = self.condition(width, depth - 1)
        x, y = self.operands_of(width, depth, exact_only)
        w = cond.width or x.width or y.width
        return Val(f"ep.where({cond.text}, {x.text}, {y.text})", w, max(x.mag, y.mag), None)

    def fma(self, width, depth, exact_only):
        x, y, z = self.operands_of(width, depth, exact_only, n=3)
        if x.mag * y.mag + z.mag > _LIMIT:  # squash the factors (y may be the constant, x never is)
            x = Val(f"ep.sigmoid({x.text})", x.width, 1.0, None)
            if not _is_const(y):
                y = Val(f"ep.sigmoid({y.text})", y.width, 1.0, None)
        text = f"ep.fma({x.text}, {y.text}, {z.text})"
        return Val(text, x.width or y.width or z.width, x.mag * y.mag + z.mag, None)

    def segment(self, width, depth, exact_only):
        x = self.expr(width, depth - 1, True, exact_only)
        seg = self.choose(_SEGMENTS)
        options = {f"ep.segment_max({x.text}, {seg})": (x.mag, x.exact)}
        options[f"ep.segment_sum({x.text}, {seg})"] = (x.mag * seg, x.exact and _exact(x.exact[0] * seg, x.exact[1]))
        return self.pick(options, x.width, exact_only)

    def pairs(self, width, depth, exact_only):
        x = self.expr(ep.FULL, depth - 1, True, exact_only)
        t = self.temp(f"ep.pairs({x.text}, segment={self.choose(_SEGMENTS)})")
        ex = x.exact
        options = {
            f"{t}[0]": (x.mag, ex),
            f"{t}[1]": (x.mag, ex),
            f"({t}[0] - {t}[1])": (2 * x.mag, ex and _exact(2 * ex[0], ex[1])),
            f"({t}[0] * {t}[1])": (x.mag**2, ex and _exact(ex[0] ** 2, 2 * ex[1])),
            f"(ep.silu({t}[0]) * {t}[1])": (x.mag**2, None),
        }
        return self.pick(options, ep.HALF, exact_only)

    def join(self, width, depth, exact_only):
        first, second = self.operands_of(ep.HALF, depth, exact_only)
        seg = self.choose(_SEGMENTS)
        both = first.exact is not None and second.exact is not None
        ex = both and _exact(max(first.exact[0], second.exact[0]), max(first.exact[1], second.exact[1]))
        return Val(f"ep.join({first.text}, {second.text}, segment={seg})", ep.FULL, max(first.mag, second.mag), ex or None)


def _is_const(v):
    try:
        float(v.text)
        return True
    except ValueError:
        return False


_OUTPUT_KINDS = ("store", "store", "row_sum", "row_max", "row_logsumexp", "col_sum", "seg_row_sum", "seg_row_max", "seg_row_logsumexp")


@st.composite
def programs(draw):
    """The source of a random program: statements that build ``p``, an ep.Program."""
    w = ProgramWriter(draw)
    if w.flip(0.4):
        z = w.expr(ep.FULL, draw(st.integers(1, 2)))
        w.shared = Val(w.temp(z.text), ep.FULL, z.mag, z.exact)
    for i in range(draw(st.integers(1, 3))):
        width = w.choose([ep.FULL, ep.HALF])
        v = w.expr(width, draw(st.integers(1, 4)))
        if v.width is None:  # pragma: no cover - expr(vary=True) always varies
            raise AssertionError(v)
        kind = w.choose(_OUTPUT_KINDS)
        if kind == "store":
            w.lines.append(f"p.store('o{i}', {v.text}, dtype=torch.float32)")
        elif kind.startswith("seg_"):
            w.lines.append(f"p.{kind[4:]}('o{i}', {v.text}, segment={w.choose(_SEGMENTS)})")
        else:
            w.lines.append(f"p.{kind}('o{i}', {v.text})")
    return "\n".join(w.lines)


def build(source):
    p = ep.Program("rand")
    exec(source, {"ep": ep, "torch": torch, "p": p})  # noqa: S102 - the test's own generated code
    return p


# --------------------------------------------------------------------------------------
# Inputs and the comparison


def _dyadic(gen, shape, lo, hi):
    """Random multiples of 1/4 in [lo, hi]: exact in every dtype the test uses."""
    return (torch.randint(int(lo * 4), int(hi * 4) + 1, shape, generator=gen).float() / 4).to(DEVICE)


def make_operands(p, M, N, gen):
    ops = {}
    for op in sorted(p.operands.values(), key=lambda o: o.name):
        n = N if op.width is ep.FULL else N // 2
        if op.kind == "row":
            ops[op.name] = _dyadic(gen, (M,), -2, 2)
        elif op.kind == "col":
            ops[op.name] = _dyadic(gen, (n,), -2, 2)
        elif op.kind == "aux":
            ops[op.name] = _dyadic(gen, (M, n), -2, 2)
        elif op.kind == "table":
            ops[op.name] = _dyadic(gen, (M, op.period), -2, 2)
        else:
            ops[op.name] = float(_dyadic(gen, (), -2, 2))
    return ops


def _to64(v):
    return v.double() if isinstance(v, torch.Tensor) else v


def assert_matches(name, got, ref64, ref32):
    """got agrees with the fp64 reference to fp32 accuracy.

    rtol 1e-4; atol 1e-5 of the output's magnitude (at least 1), plus a few times the
    largest error of the same program evaluated by the reference in fp32 (the accuracy
    fp32 arithmetic can reach on these inputs at all).
    """
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)}, reference {tuple(ref64.shape)}"
    assert got.dtype == torch.float32, f"{name}: dtype {got.dtype}"
    ref = ref64.double()
    assert torch.isfinite(ref).all(), f"{name}: the reference is not finite (a generator bug)"
    scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
    noise = (ref32.double() - ref).abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5 * scale + 8 * noise, msg=lambda m: f"output {name!r}: {m}")


@st.composite
def problems(draw, p):
    """(M, K, N, layout, seed, split) for program ``p``: N even and a multiple of every segment;
    split: the epilogue on whole tiles (1) or on their column halves or quarters (2, 4, as the
    GPU tuner often picks), which leaves the last tile's last slices empty for some N."""
    unit = max(2, p.min_block_n())
    N = unit * draw(st.integers(1, _MAX_N // unit))
    M = draw(st.integers(1, _MAX_M))
    K = 4 * draw(st.integers(1, _MAX_K // 4)) if draw(st.booleans()) else draw(st.integers(1, _MAX_K))
    layout = draw(st.sampled_from(["a@b", "a@w.t()", "x.t()@b", "a@[b0,b1]"]))
    return M, K, N, layout, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from([1, 2, 4]))


def make_ab(M, K, N, layout, gen):
    """a [M, K] and b [K, N] (or b's two parts along N), stored in the given layout."""
    a = _dyadic(gen, (M, K), -1, 1)
    b = _dyadic(gen, (K, N), -1, 1)
    if layout == "a@w.t()":
        return a, b.t().contiguous().t()
    if layout == "x.t()@b":
        return a.t().contiguous().t(), b
    if layout == "a@[b0,b1]":
        cut = N // 2
        return a, [b[:, :cut].contiguous(), b[:, cut:].contiguous()]
    return a, b


def check_program(source, data, path):
    """Build ``source``, draw a problem for it, and compare the kernel with the reference."""
    p = build(source)
    M, K, N, layout, seed, split = data.draw(problems(p), label="M, K, N, layout, seed, split")
    run_and_compare(p, M, K, N, layout, seed, path, split=split, report=note)


def split_config(p, split):
    """A config running the epilogue on ``split`` column slices of each tile, each at least as wide
    as ``p`` needs (on a GPU one that fits fp32 operands)."""
    if INTERPRET:
        return Config(BM=16, BN=split * max(8, p.min_block_n()), BK=16, GROUP_M=2, STAGES=1, num_warps=4,
                      EPI_SPLIT=split)
    return Config(BM=64, BN=split * max(32, p.min_block_n()), BK=32, GROUP_M=8, STAGES=2, num_warps=4, EPI_SPLIT=split)


def run_and_compare(p, M, K, N, layout, seed, path, split=1, report=print):
    """Run ``p`` on that problem and compare every output; ``report`` shows the plan and kernel."""
    gen = torch.Generator().manual_seed(seed)
    a, b = make_ab(M, K, N, layout, gen)
    ops = make_operands(p, M, N, gen)
    config = split_config(p, split) if split > 1 else None
    with pytest.MonkeyPatch.context() as mp:
        if path == "ptr":
            mp.setenv("CODETTA_PATH", "ptr")
        else:
            mp.delenv("CODETTA_PATH", raising=False)
        plan = codetta.explain(a, b, p, config=config, **ops)
        report(f"M, K, N = {M}, {K}, {N}; {plan}\n{codetta.kernel_source(p, plan['path'])}")
        got = codetta.gemm(a, b, p, config=config, **ops)
    b64 = [t.double() for t in b] if isinstance(b, list) else b.double()
    ref64 = ep.run_reference(p, a.double(), b64, {k: _to64(v) for k, v in ops.items()}, torch.float64)
    ref32 = ep.run_reference(p, a, b, ops, torch.float32)
    assert set(got) == set(ref64) == set(p.outputs)
    for name in sorted(got):
        assert_matches(name, got[name], ref64[name], ref32[name])


_SETTINGS = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@_SETTINGS
@given(source=programs(), data=st.data())
def test_random_program_matches_reference(source, data):
    """A random program on random shapes and layouts, on the default path (TMA where strides allow)."""
    check_program(source, data, "default")


@_SETTINGS
@given(source=programs(), data=st.data())
def test_random_program_matches_reference_ptr_path(source, data):
    """The same with CODETTA_PATH=ptr: the pointer mainloop for every layout."""
    check_program(source, data, "ptr")


@settings(max_examples=200, deadline=None)
@given(source=programs())
def test_generated_programs_build(source):
    """The generator only writes well-formed programs (built and checked, not run): 1-3 outputs, tile-sized segments."""
    p = build(source).check()
    assert 1 <= len(p.outputs) <= 3
    assert p.min_block_n() <= _MAX_N // 2


# Programs the generator found failing once (the interpreter passed scalar operands as
# Python floats: no .to() for round_to, and 0-d comparisons that & and | refused).
REGRESSIONS = [
    "p.store('o0', ep.where((((-1.0 * p.scalar('s0')) < -1.0) & (~(p.col('c0', ep.FULL) < -1.0))), "
    "p.col('c0', ep.FULL), -1.0), dtype=torch.float32)",
    "p.store('o0', ep.where((p.col('c0', ep.FULL) < -1.0), p.col('c0', ep.FULL), "
    "ep.round_to(p.scalar('s0'), torch.bfloat16)), dtype=torch.float32)",
]


@pytest.mark.parametrize("source", REGRESSIONS)
def test_regressions(source):
    """Fixed programs that once failed, on a fixed problem with ragged tiles."""
    run_and_compare(build(source), 19, 8, 36, "a@b", 0, "default")

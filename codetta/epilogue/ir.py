"""The epilogue language: expressions over one output tile of a GEMM, and programs.

A program describes what happens to the fp32 accumulator tile ``acc = A @ B`` of a
GEMM before anything reaches global memory. Every value is an expression node with a
*shape class*:

* ``rows``: whether it varies along the M (token) axis;
* ``width``: the column space it varies along: ``FULL`` (the N columns of the GEMM),
  ``HALF`` (the N/2 column *pairs* made by :func:`pairs`), or ``None`` (constant
  along columns).

So ``acc`` is (rows, FULL), a row vector is (rows, None), a column vector is
(no rows, FULL or HALF), a scalar is (no rows, None). Operands broadcast like
NumPy; combining a FULL value with a HALF value is an error, found when the
expression is built.

Pairs. ``pairs(x, segment=S)`` cuts the columns into segments of width S and pairs
column j of a segment with column j + S/2 (Hugging Face's ``rotate_half``
convention); ``segment=2`` pairs adjacent columns (2p, 2p+1). Pair p of the whole
row is column ``(p // (S/2)) * S + p % (S/2)`` and its partner S/2 further on.
``join`` is the inverse.

All arithmetic is fp32 (comparisons give booleans); outputs are cast when stored.
Programs are checked as they are built: an error names the program and the problem.
"""

from __future__ import annotations

import enum
import hashlib
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch


class EpilogueError(ValueError):
    """A program or a call of a program is malformed."""


class Width(enum.Enum):
    """The width of an operand or output: the GEMM's N columns (FULL) or N / 2 (HALF: values
    over column pairs, as :func:`pairs` makes them)."""

    FULL = "full"
    HALF = "half"


FULL = Width.FULL
HALF = Width.HALF

# The elementwise functions of one and of two fp32 arguments. Their meaning is given once in
# the reference executor and once in Triton, in the code generator (each a dict by these names:
# tests/test_epilogue_primitives.py checks that the three agree).
UNARY_OPS = (
    "neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "square",
    "sigmoid", "tanh", "silu", "relu", "gelu_tanh", "gelu_erf", "sin", "cos",
    "floor", "not",
)
BINARY_OPS = ("add", "sub", "mul", "div", "maximum", "minimum", "lt", "le", "gt", "ge", "eq", "ne", "and", "or")
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGICAL = ("and", "or", "not")

STORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_B_PARTS = 4  # B parts codetta.gemm reads as one without a copy (and a store per part writes)
# The parameters of codetta.gemm other than the operands: no operand (nor accumulating store,
# whose tensor is passed as an operand) may take their names.
GEMM_PARAMETERS = ("a", "b", "epilogue", "out", "config", "finish")

# A program's name (with its path and fingerprint) names its kernel's source file: well within a
# file system's 255 bytes.
MAX_NAME_LENGTH = 160


def _is_name(name) -> bool:
    """An ASCII identifier: it becomes part of Python identifiers in the generated kernel, which
    Python reads NFKC-normalized (so a non-ASCII name such as 'µ' or 'ﬁ' would change there)."""
    return isinstance(name, str) and name.isascii() and name.isidentifier()


def _no_operation(spelled: str, instead: str):
    """An operator of Python's that the language has no operation for: an EpilogueError naming the
    program and what to write instead (Python's own TypeError would name neither)."""
    def refuse(self, *args):
        raise EpilogueError(f"program {self.program.name!r}: {spelled} is no epilogue operation; use {instead}")

    return refuse


class Expr:
    """One node of an epilogue expression graph (immutable; shared subexpressions are reused)."""

    __slots__ = ("program", "op", "args", "attrs", "rows", "width", "is_bool", "_index")

    def __init__(self, program, op, args=(), attrs=(), *, rows, width, is_bool=False):
        self.program = program
        self.op = op
        self.args = tuple(args)
        self.attrs = tuple(attrs)
        self.rows = rows
        self.width = width
        self.is_bool = is_bool
        self._index = program._register(self)

    def __repr__(self):
        return f"<{self.op} #{self._index} of {self.program.name}>"

    # arithmetic ---------------------------------------------------------------
    def __add__(self, o):
        return _binary("add", self, o)

    def __radd__(self, o):
        return _binary("add", o, self)

    def __sub__(self, o):
        return _binary("sub", self, o)

    def __rsub__(self, o):
        return _binary("sub", o, self)

    def __mul__(self, o):
        return _binary("mul", self, o)

    def __rmul__(self, o):
        return _binary("mul", o, self)

    def __truediv__(self, o):
        return _binary("div", self, o)

    def __rtruediv__(self, o):
        return _binary("div", o, self)

    def __neg__(self):
        return _unary("neg", self)

    def __lt__(self, o):
        return _binary("lt", self, o)

    def __le__(self, o):
        return _binary("le", self, o)

    def __gt__(self, o):
        return _binary("gt", self, o)

    def __ge__(self, o):
        return _binary("ge", self, o)

    def __and__(self, o):
        return _binary("and", self, o)

    def __or__(self, o):
        return _binary("or", self, o)

    def __invert__(self):
        return _unary("not", self)

    def __abs__(self):
        return _unary("abs", self)

    def __pos__(self):
        return self

    def __bool__(self):
        raise EpilogueError(
            f"program {self.program.name!r}: an epilogue value has no truth value while the "
            "program is built; use where(cond, a, b)"
        )

    __hash__ = object.__hash__

    __pow__ = __rpow__ = _no_operation("x ** y", "square(x), sqrt(x), rsqrt(x) or exp(y * log(x))")
    __matmul__ = __rmatmul__ = _no_operation("x @ y", "x * y (elementwise; the GEMM's product is the program's acc)")
    __floordiv__ = __rfloordiv__ = _no_operation("x // y", "floor(x / y)")
    __mod__ = __rmod__ = _no_operation("x % y", "x - y * floor(x / y)")
    __round__ = _no_operation("round(x)", "floor(x + 0.5), or round_to(x, dtype) for a dtype's rounding")
    __floor__ = __trunc__ = __ceil__ = _no_operation("math.floor, trunc or ceil of x",
                                                     "codetta.epilogue.floor(x) (ceil(x) = -floor(-x))")

    def eq(self, o):
        return _binary("eq", self, o)

    def ne(self, o):
        return _binary("ne", self, o)


_EQ_HINT = " (== and != compare Python objects: compare values with .eq() and .ne())"


def _program_of(*values):
    progs = {id(v.program): v.program for v in values if isinstance(v, Expr)}
    if not progs:
        hint = _EQ_HINT if any(isinstance(v, bool) for v in values) else ""
        raise EpilogueError(f"an epilogue function takes epilogue values, got only {values!r}{hint}")
    if len(progs) > 1:
        names = sorted(p.name for p in progs.values())
        raise EpilogueError(f"an epilogue expression mixes values of different programs {names}: build each "
                            "program from its own values")
    return next(iter(progs.values()))


def _as_expr(program, x):
    if isinstance(x, Expr):
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        hint = _EQ_HINT if isinstance(x, bool) else ""
        raise EpilogueError(
            f"program {program.name!r}: cannot use {type(x).__name__} {x!r} in an epilogue; "
            f"use a number, or declare an operand (row, col, scalar, aux, table){hint}"
        )
    try:
        value = float(x)
    except OverflowError:
        raise EpilogueError(f"program {program.name!r}: the constant {x!r} is beyond a float's range") from None
    return Expr(program, "const", attrs=(value,), rows=False, width=None)


def _broadcast(program, op, *values):
    widths = {v.width for v in values if v.width is not None}
    if len(widths) > 1:
        raise EpilogueError(
            f"program {program.name!r}: {op} combines a value over the N columns with a value "
            "over the N/2 column pairs (width mismatch)"
        )
    return any(v.rows for v in values), (widths.pop() if widths else None)


def _numbers(p, op, *values) -> None:
    """Refuse a boolean (a comparison's) among values that ``op`` computes with as numbers."""
    if any(v.is_bool for v in values):
        raise EpilogueError(f"program {p.name!r}: {op} of a boolean value; use where()")


def _unary(op, x):
    p = _program_of(x)
    if op == "not":
        if not x.is_bool:
            raise EpilogueError(f"program {p.name!r}: 'not' needs a boolean value")
    else:
        _numbers(p, op, x)
    return Expr(p, op, (x,), rows=x.rows, width=x.width, is_bool=op == "not")


def _binary(op, x, y):
    p = _program_of(x, y)
    x, y = _as_expr(p, x), _as_expr(p, y)
    rows, width = _broadcast(p, op, x, y)
    if op in LOGICAL:
        if not (x.is_bool and y.is_bool):
            raise EpilogueError(f"program {p.name!r}: {op!r} needs two boolean values")
    else:
        _numbers(p, op, x, y)
    return Expr(p, op, (x, y), rows=rows, width=width, is_bool=op in COMPARISONS + LOGICAL)


def _make_unary(name, doc):
    def f(x):
        if not isinstance(x, Expr):
            raise EpilogueError(f"{name}() takes an epilogue value, got {type(x).__name__}")
        return _unary(name, x)

    f.__name__ = name
    f.__doc__ = doc
    return f


abs = _make_unary("abs", "|x|")  # noqa: A001 - the epilogue's own abs
exp = _make_unary("exp", "e^x")
log = _make_unary("log", "natural logarithm")
sqrt = _make_unary("sqrt", "square root")
rsqrt = _make_unary("rsqrt", "1 / sqrt(x)")
reciprocal = _make_unary("reciprocal", "1 / x")
square = _make_unary("square", "x * x")
sigmoid = _make_unary("sigmoid", "1 / (1 + e^-x)")
tanh = _make_unary("tanh", "(e^x - e^-x) / (e^x + e^-x)")
silu = _make_unary("silu", "x * sigmoid(x)")
relu = _make_unary("relu", "max(x, 0); NaN stays NaN (as torch.relu)")
gelu_tanh = _make_unary("gelu_tanh", "0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) = x sigmoid(2 sqrt(2/pi)(x + 0.044715 x^3))")
gelu_erf = _make_unary("gelu_erf", "0.5 x (1 + erf(x / sqrt(2)))")
sin = _make_unary("sin", "sine")
cos = _make_unary("cos", "cosine")
floor = _make_unary("floor", "largest integer <= x")


def maximum(x, y):
    """Elementwise max(x, y) (fp32; NaN if either is)."""
    return _binary("maximum", x, y)


def minimum(x, y):
    """Elementwise min(x, y) (fp32; NaN if either is)."""
    return _binary("minimum", x, y)


def where(cond, x, y):
    """``x`` where ``cond`` holds, else ``y`` (cond must be boolean: a comparison)."""
    p = _program_of(cond, x, y)
    cond, x, y = (_as_expr(p, v) for v in (cond, x, y))
    if not cond.is_bool:
        raise EpilogueError(f"program {p.name!r}: where() needs a boolean condition (a comparison)")
    if x.is_bool or y.is_bool:
        raise EpilogueError(f"program {p.name!r}: where() selects between numbers, not booleans")
    rows, width = _broadcast(p, "where", cond, x, y)
    return Expr(p, "where", (cond, x, y), rows=rows, width=width)


def fma(x, y, z):
    """x * y + z with one rounding."""
    p = _program_of(x, y, z)
    x, y, z = (_as_expr(p, v) for v in (x, y, z))
    _numbers(p, "fma()", x, y, z)
    rows, width = _broadcast(p, "fma", x, y, z)
    return Expr(p, "fma", (x, y, z), rows=rows, width=width)


def round_to(x, dtype):
    """x rounded to ``dtype`` (bf16, fp16) and back to fp32: the value a store of x would keep."""
    p = _program_of(x)
    if dtype not in STORE_DTYPES:
        raise EpilogueError(f"program {p.name!r}: round_to() takes one of {STORE_DTYPES}, got {dtype}")
    _numbers(p, "round_to()", x)
    return Expr(p, "round_to", (x,), attrs=(dtype,), rows=x.rows, width=x.width)


def _check_segment(p, what, x, segment, need_width=None) -> int:
    """``segment`` as a Python int (numpy's integers too), checked: a power of two >= 2; x a number
    (not a boolean) that varies over columns (over the N columns with ``need_width`` FULL)."""
    _numbers(p, what, x)
    if isinstance(segment, numbers.Integral) and not isinstance(segment, bool):
        segment = int(segment)
    if not isinstance(segment, int) or segment < 2 or segment % 2 or segment & (segment - 1):
        raise EpilogueError(
            f"program {p.name!r}: {what} segment must be an integer power of two >= 2, got {segment!r}"
        )
    if x.width is None or (need_width is not None and x.width is not need_width):
        want = "the N columns" if need_width is FULL else "columns"
        raise EpilogueError(f"program {p.name!r}: {what} needs a value that varies over {want}")
    return segment


def pairs(x, segment=2):
    """Split x's columns into pairs: returns (first, second), each over the N/2 pairs.

    ``segment=2``: pairs (2p, 2p+1). ``segment=S``: inside each segment of S columns,
    column j pairs with j + S/2 (the ``rotate_half`` layout of RoPE, S = head_dim).
    """
    p = _program_of(x)
    segment = _check_segment(p, "pairs()", x, segment, FULL)
    split = Expr(p, "pairs", (x,), attrs=(segment,), rows=x.rows, width=HALF)
    first = Expr(p, "pair_item", (split,), attrs=(0,), rows=x.rows, width=HALF)
    second = Expr(p, "pair_item", (split,), attrs=(1,), rows=x.rows, width=HALF)
    return first, second


def join(first, second, segment=2):
    """Inverse of :func:`pairs`: interleave two pair-space values back into N columns."""
    p = _program_of(first, second)
    first, second = _as_expr(p, first), _as_expr(p, second)
    _numbers(p, "join()", first, second)
    rows, width = _broadcast(p, "join()", first, second)
    if width is not HALF:
        raise EpilogueError(f"program {p.name!r}: join() needs values over the N/2 column pairs")
    probe = first if first.width is HALF else second
    segment = _check_segment(p, "join()", probe, segment)
    return Expr(p, "join", (first, second), attrs=(segment,), rows=rows, width=FULL)


def _segment_reduce(kind, x, segment):
    p = _program_of(x)
    segment = _check_segment(p, f"segment_{kind}()", x, segment)
    return Expr(p, f"segment_{kind}", (x,), attrs=(segment,), rows=x.rows, width=x.width)


def segment_sum(x, segment):
    """Sum of x over each segment of ``segment`` columns, broadcast back to every column of it."""
    return _segment_reduce("sum", x, segment)


def segment_max(x, segment):
    """Max of x over each segment of ``segment`` columns, broadcast back to every column of it."""
    return _segment_reduce("max", x, segment)


# --------------------------------------------------------------------------------------
# Programs


@dataclass(frozen=True)
class Operand:
    """An input the caller passes by name: kind is 'row', 'col', 'scalar', 'aux' or 'table'."""

    name: str
    kind: str
    width: Width | None = None
    period: int | None = None

    def describe(self) -> str:
        """'a row vector', 'a HALF-width column vector', 'a table of period 8', ..."""
        what = {"row": "row vector", "col": "column vector", "scalar": "scalar", "aux": "tile", "table": "table"}
        width = f"{self.width.name}-width " if self.width is not None else ""
        period = f" of period {self.period}" if self.period is not None else ""
        return f"a {width}{what.get(self.kind, self.kind)}{period}"


@dataclass(frozen=True)
class Output:
    """Something a program writes.

    kind 'store': a tile [M, width] cast to ``dtype`` (None: the GEMM's input dtype),
    added into an existing tensor when ``accumulate``; ``per_b_part``: written as one tensor
    per part of B along N (part i's columns, [M, N_i], in an allocation of its own).
    kind 'row_sum' / 'row_max' / 'row_logsumexp': a reduction over the columns, fp32,
    [M] or [M, width / segment] per segment.
    kind 'col_sum': a reduction over the rows, fp32, [width].
    """

    name: str
    kind: str
    value: Expr
    dtype: torch.dtype | None = None
    accumulate: bool = False
    segment: int | None = None
    per_b_part: bool = False

    @property
    def width(self):
        return self.value.width


@dataclass(eq=False)
class Program:
    """An epilogue program under construction; :mod:`codetta.epilogue.ir`'s docstring describes the values.

    Compared and hashed by identity, as a mutable builder (a program can key a dict or a
    cache); :meth:`fingerprint` names its structure.

    >>> p = Program("rowscale_swiglu")
    >>> z = p.acc * p.row("rstd")
    >>> gate, up = pairs(z)
    >>> p.store("y", silu(gate) * up)
    """

    name: str
    _nodes: list = field(default_factory=list, repr=False, init=False)
    _operands: dict = field(default_factory=dict, init=False)
    _outputs: dict = field(default_factory=dict, init=False)
    _acc: Expr | None = field(default=None, repr=False, init=False)
    _analysis: dict = field(default_factory=dict, repr=False, init=False)
    _loads: dict = field(default_factory=dict, repr=False, init=False)

    def __setattr__(self, key, value):
        """The name is checked whenever it is set (at construction, and by a rename later)."""
        if key == "name" and not (_is_name(value) and len(value) <= MAX_NAME_LENGTH):
            raise EpilogueError(f"a program name must be an ASCII identifier of at most {MAX_NAME_LENGTH} characters "
                                f"(it names the kernel and its file), got {value!r:.120}")
        super().__setattr__(key, value)

    def __repr__(self):
        return f"Program(name={self.name!r}, operands={list(self._operands)}, outputs={list(self._outputs)})"

    @property
    def operands(self) -> Mapping[str, Operand]:
        """The operands declared so far, by name (read-only: the builder's methods declare them)."""
        return MappingProxyType(self._operands)

    @property
    def outputs(self) -> Mapping[str, Output]:
        """The outputs stored or reduced so far, by name (read-only: ``store`` and the reductions
        add them; a program's analysis and its kernels are kept until it grows)."""
        return MappingProxyType(self._outputs)

    def _register(self, node):
        self._nodes.append(node)
        return len(self._nodes) - 1

    def _cached(self, what, compute):
        """``compute()`` memoized until the program changes (calls check it on every launch)."""
        version = (len(self._nodes), len(self._operands), len(self._outputs))
        if self._analysis.get("version") != version:
            self._analysis = {"version": version}
        if what not in self._analysis:
            self._analysis[what] = compute()
        return self._analysis[what]

    # values ---------------------------------------------------------------------
    @property
    def acc(self):
        """The fp32 accumulator tile, A @ B."""
        if self._acc is None:
            self._acc = Expr(self, "acc", rows=True, width=FULL)
        return self._acc

    def _declare(self, name, kind, width=None, period=None):
        if not _is_name(name):
            raise EpilogueError(f"program {self.name!r}: operand name must be an ASCII identifier, got {name!r}")
        if name in GEMM_PARAMETERS:
            raise EpilogueError(f"program {self.name!r}: operand name {name!r} is reserved (a parameter of codetta.gemm)")
        new = Operand(name, kind, width, period)
        old = self.operands.get(name)
        if old is not None and old != new:
            raise EpilogueError(f"program {self.name!r}: operand {name!r} declared as {old.describe()} and as "
                                f"{new.describe()}")
        if name in self.outputs:
            raise EpilogueError(f"program {self.name!r}: {name!r} is already an output")
        self._operands[name] = new

    def _check_width(self, width):
        if not isinstance(width, Width):
            raise EpilogueError(f"program {self.name!r}: width must be FULL or HALF, got {width!r}")

    def _load(self, op, name, **shape):
        """The one load node of operand ``name`` (a second use reuses it, so it is read once)."""
        key = (op, name)
        if key not in self._loads:
            self._loads[key] = Expr(self, op, attrs=(name,), **shape)
        return self._loads[key]

    def row(self, name):
        """A per-row vector operand [M] (e.g. rstd), broadcast along columns."""
        self._declare(name, "row")
        return self._load("load_row", name, rows=True, width=None)

    def col(self, name, width=FULL):
        """A per-column vector operand [N] (width FULL) or [N/2] (width HALF)."""
        self._check_width(width)
        self._declare(name, "col", width)
        return self._load("load_col", name, rows=False, width=width)

    def scalar(self, name):
        """A runtime scalar operand (a Python number passed at call time)."""
        self._declare(name, "scalar")
        return self._load("load_scalar", name, rows=False, width=None)

    def aux(self, name, width=FULL):
        """A tile operand [M, N] (or [M, N/2]) read at the output tile's coordinates."""
        self._check_width(width)
        self._declare(name, "aux", width)
        return self._load("load_aux", name, rows=True, width=width)

    def table(self, name, period, width=FULL):
        """A per-row table [M, period] repeated along the columns: column (or pair) j reads
        entry j % period of its row. E.g. RoPE's cos and sin per token and frequency, read
        by every head. Read as [BM, period] blocks through a TMA descriptor where the call takes
        the TMA path (a period that is a power of two of 16 bytes or more), else through the cache."""
        if isinstance(period, numbers.Integral) and not isinstance(period, bool):
            period = int(period)  # numpy's integers too, as segments
        if not isinstance(period, int) or period < 1:
            raise EpilogueError(f"program {self.name!r}: table {name!r} needs a positive integer period, got {period!r}")
        self._check_width(width)
        self._declare(name, "table", width, period)
        return self._load("load_table", name, rows=True, width=width)

    def row_index(self):
        """The global row index of each row, as fp32 (exact below 2^24)."""
        return Expr(self, "row_index", rows=True, width=None)

    def col_index(self, width=FULL):
        """The global column (or pair) index of each column, as fp32 (exact below 2^24)."""
        self._check_width(width)
        return Expr(self, "col_index", attrs=(width,), rows=False, width=width)

    # outputs --------------------------------------------------------------------
    def _output(self, out):
        if not _is_name(out.name):
            raise EpilogueError(f"program {self.name!r}: output name must be an ASCII identifier, got {out.name!r}")
        if out.name in self.outputs:
            raise EpilogueError(f"program {self.name!r}: output {out.name!r} is written twice")
        if out.name in self.operands:
            raise EpilogueError(f"program {self.name!r}: output {out.name!r} is also an operand")
        if not isinstance(out.value, Expr) or out.value.program is not self:
            hint = _EQ_HINT if isinstance(out.value, bool) else ""
            raise EpilogueError(f"program {self.name!r}: output {out.name!r} needs a value of this program{hint}")
        if out.value.is_bool:
            raise EpilogueError(f"program {self.name!r}: output {out.name!r} is boolean; use where()")
        if out.value.width is None:
            raise EpilogueError(
                f"program {self.name!r}: output {out.name!r} needs a value that varies over columns"
            )
        self._outputs[out.name] = out

    def store(self, name, value, dtype=None, accumulate=False, per_b_part=False):
        """Write ``value`` as an [M, width] tensor of ``dtype`` (None: the inputs' dtype).

        With ``accumulate=True`` the caller passes the existing tensor under ``name``
        and the program adds into it (out = out + value, in fp32, then rounded).

        With ``per_b_part=True`` the columns of each part of B (``gemm(a, [b0, b1, ...])``,
        parts [K, N_i] along N) go to a tensor of their own, [M, N_i] each, and the call
        returns the tuple of them: e.g. q, k and v of a QKV projection in three allocations,
        which their users can keep or free one by one (a KV cache holds k and v, not q).
        For a value over all N columns, not accumulated.
        """
        if dtype is not None and dtype not in STORE_DTYPES:
            raise EpilogueError(f"program {self.name!r}: store dtype must be one of {STORE_DTYPES}, got {dtype}")
        if not isinstance(accumulate, bool):
            raise EpilogueError(f"program {self.name!r}: accumulate must be a bool, got {accumulate!r}")
        if accumulate and name in GEMM_PARAMETERS:  # its tensor is passed to codetta.gemm by this name
            raise EpilogueError(f"program {self.name!r}: an accumulating store cannot be named {name!r} "
                                "(a parameter of codetta.gemm)")
        if not isinstance(per_b_part, bool):
            raise EpilogueError(f"program {self.name!r}: per_b_part must be a bool, got {per_b_part!r}")
        if per_b_part and (accumulate or getattr(value, "width", None) is not FULL):
            raise EpilogueError(f"program {self.name!r}: store {name!r} per_b_part needs a value over all N columns "
                                "(not over column pairs), not accumulated")
        self._output(Output(name, "store", value, dtype=dtype, accumulate=accumulate, per_b_part=per_b_part))

    def _row_reduction(self, kind, name, value, segment):
        if segment is not None:
            segment = _check_segment(self, f"{kind}()", value, segment)
        self._output(Output(name, kind, value, dtype=torch.float32, segment=segment))

    def row_sum(self, name, value, segment=None):
        """fp32 sum over the columns of each row ([M]), or per segment of columns ([M, width/segment])."""
        self._row_reduction("row_sum", name, value, segment)

    def row_sumsq(self, name, value, segment=None):
        """fp32 sum of squares over the columns of each row (see :meth:`row_sum`)."""
        self._row_reduction("row_sum", name, value * value, segment)

    def row_max(self, name, value, segment=None):
        """fp32 max over the columns of each row (see :meth:`row_sum`)."""
        self._row_reduction("row_max", name, value, segment)

    def row_logsumexp(self, name, value, segment=None):
        """fp32 log(sum(exp(value))) over the columns of each row (see :meth:`row_sum`).

        Each tile keeps (max, sum of exp(value - max)); the finishing step merges them.
        """
        self._row_reduction("row_logsumexp", name, value, segment)

    def col_sum(self, name, value):
        """fp32 sum over the rows of each column ([width]); deterministic (no atomics)."""
        self._output(Output(name, "col_sum", value, dtype=torch.float32))

    # inspection ---------------------------------------------------------------------
    def nodes(self):
        """The nodes the outputs depend on, each after its arguments."""
        return self._cached("nodes", self._topological_order)

    def _topological_order(self):
        """Depth first, with a stack of its own (a program may chain thousands of nodes)."""
        seen, order = set(), []
        for out in self.outputs.values():
            stack = [(out.value, False)]
            while stack:
                n, args_done = stack.pop()
                if args_done:
                    order.append(n)
                elif id(n) not in seen:
                    seen.add(id(n))
                    stack.append((n, True))
                    stack.extend((a, False) for a in reversed(n.args))
        return order

    def check(self):
        """Raise EpilogueError unless the program writes something."""
        if not self.outputs:
            raise EpilogueError(f"program {self.name!r} writes nothing: add a store or a reduction")
        return self

    def segments(self):
        """(segment width, width class) of every in-tile segment the program uses: the tile must hold them."""
        return self._cached("segments", self._segments)

    def _segments(self):
        need = set()
        for n in self.nodes():
            if n.op in ("pairs", "join"):
                need.add((n.attrs[0], FULL))
            elif n.op in ("segment_sum", "segment_max"):
                need.add((n.attrs[0], n.width))
        for out in self.outputs.values():
            if out.segment:
                need.add((out.segment, out.width))
        return sorted(need, key=lambda s: (s[0], s[1].value))

    def min_block_n(self):
        """The smallest BLOCK_N whose tile holds every segment whole (a power of two)."""
        return self._cached("min_block_n", self._min_block_n)

    def _min_block_n(self):
        need = 1
        for seg, width in self.segments():
            need = max(need, seg if width is FULL else 2 * seg)
        if any(o.width is HALF for o in self.outputs.values()) or any(
            n.width is HALF for n in self.nodes()
        ):
            need = max(need, 2)
        return need

    def fingerprint(self):
        """A stable hash of the program's structure (for kernel and tuning caches)."""
        return self._cached("fingerprint", self._fingerprint)

    def _fingerprint(self):
        index = {id(n): i for i, n in enumerate(self.nodes())}
        parts = []
        for i, n in enumerate(self.nodes()):
            parts.append(f"{i}:{n.op}:{[index[id(a)] for a in n.args]}:{n.attrs!r}")
        for o in sorted(self.outputs.values(), key=lambda o: o.name):
            parts.append(f"out:{o.name}:{o.kind}:{index[id(o.value)]}:{o.dtype}:{o.accumulate}:{o.segment}"
                         + (":per_b_part" if o.per_b_part else ""))
        for o in sorted(self.operands.values(), key=lambda o: o.name):
            parts.append(f"in:{o}")
        return hashlib.sha256(("\n".join(parts)).encode()).hexdigest()[:16]

"""One call of ``codetta.gemm`` checked against its program: the operands' types, devices,
dtypes and shapes, how ``b``'s parts are read as one B (along N, along K, or interleaved), the
program's operands and the outputs given in ``out``. Every problem is a :class:`GemmError` or
an :class:`~codetta.epilogue.ir.EpilogueError` that names it; :class:`Call` holds the result.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..epilogue.ir import FULL, HALF, MAX_B_PARTS, EpilogueError, Program
from ..interpreter import interpreter_problem, interpreting
from .memory import overlaps_itself

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the kernels compute in


class GemmError(ValueError):
    """A call of codetta.gemm with inputs it cannot take."""


class Interleaved(tuple):
    """Two [K, N] operands read as one [K, 2N] whose columns alternate between them."""


def interleave(b0, b1) -> Interleaved:
    """B for ``gemm`` with column 2j = ``b0[:, j]`` and 2j + 1 = ``b1[:, j]``, without a copy.

    E.g. ``gemm(h, interleave(w_gate.t(), w_up.t()), program)``: each (gate, up) pair of a
    SwiGLU lands in adjacent columns of the same tile (``epilogue.pairs(acc)``). Two weights
    W [N, K] passed as ``W.t()`` with one row stride (nn.Linear's) are read through one TMA
    descriptor of both, as fast as one B tensor; other layouts through two (``explain``'s
    ``b_parts`` says which).
    """
    return Interleaved((b0, b1))


def layout_problem(t: torch.Tensor) -> str | None:
    """Why the kernels cannot address ``t`` (a sparse or nested tensor has no strides, nor one
    data pointer), to follow its name in an error message; None for a dense tensor."""
    if t.layout != torch.strided or t.is_nested:
        return f"is a {'nested' if t.is_nested else t.layout} tensor: codetta's kernels take dense (strided) tensors"
    return None


def check_tensor(t, what, device):
    if not isinstance(t, torch.Tensor):
        raise GemmError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    problem = layout_problem(t)
    if problem is not None:
        raise GemmError(f"{what} {problem}")
    if t.is_neg():
        raise GemmError(f"{what} has PyTorch's negative bit set (a lazily negated view, as z.conj().imag is): the "
                        "kernels read and write memory as it is stored; resolve it first (resolve_neg())")
    if t.device != device:
        raise GemmError(f"{what} is on {t.device} but a is on {device}")


def check_device(device: torch.device, what: str = "a") -> None:
    """Raise GemmError unless codetta's kernels can run on ``device`` (in this process)."""
    if device.type not in ("cuda", "cpu"):
        raise GemmError(
            f"{what} is on {device}; codetta's kernels run on a CUDA GPU (or on the CPU under TRITON_INTERPRET=1)"
        )
    if device.type == "cpu" and not interpreting():
        raise GemmError(
            "codetta's kernels run on a CUDA GPU; on a CPU they need Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before Python imports triton (importing codetta before triton, torch.compile or "
            "transformers' models does it), or use codetta.epilogue.run_reference"
        )
    problem = interpreter_problem() if device.type == "cpu" else None
    if problem is not None:
        raise GemmError(f"codetta's kernels run on a CPU in Triton's interpreter, but {problem}")


def scalar_operand(value, what: str) -> float:
    """A scalar operand as the float the kernel takes; a clear error for anything but a real
    number within a float's range (checked at every call: a plan is kept by the operand's type)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EpilogueError(f"{what} is a scalar: pass a number, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise EpilogueError(f"{what}: {value!r} is beyond a float's range") from None


class Call:
    """One checked call: the GEMM's operands and layout, the program's operands and outputs."""

    def __init__(self, a, b, program, operands, out, for_kernel=True):
        """``for_kernel=False``: the checks of :func:`codetta.epilogue.run_reference`, which runs on
        any device and takes fp64 as well."""
        if not isinstance(program, Program):
            raise GemmError(f"epilogue must be a codetta Program, got {type(program).__name__}")
        program.check()
        self.program = program
        check_tensor(a, "a", getattr(a, "device", None))
        device = a.device
        interleaved = isinstance(b, Interleaved)
        parts = list(b) if isinstance(b, (list, tuple)) else [b]
        if not 1 <= len(parts) <= MAX_B_PARTS:
            raise GemmError(f"b must be a tensor or a list of 1 to {MAX_B_PARTS} tensors, got {len(parts)}")
        for i, t in enumerate(parts):
            check_tensor(t, f"b[{i}]" if len(parts) > 1 else "b", device)
        dtypes = KERNEL_DTYPES if for_kernel else (*KERNEL_DTYPES, torch.float64)
        if a.dtype not in dtypes:
            raise GemmError(f"a has dtype {a.dtype}; codetta.gemm takes {dtypes}")
        for t in parts:
            if t.dtype != a.dtype:
                raise GemmError(f"a is {a.dtype} but b is {t.dtype}: cast one so they match")
            if t.dim() != 2:
                raise GemmError(f"b must be 2-d [K, N] (a weight W of nn.Linear is passed as W.t()), got shape {tuple(t.shape)}")
        if a.dim() < 2:
            raise GemmError(f"a must be at least 2-d [..., M, K], got shape {tuple(a.shape)}")
        if for_kernel:
            check_device(device)
        self.lead = tuple(a.shape[:-1])
        a2 = a if a.dim() == 2 else a.reshape(math.prod(self.lead), a.shape[-1])  # not -1: K may be 0
        self.a, self.parts, self.device = a2, parts, device
        self.M, self.K = a2.shape
        shapes = [tuple(t.shape) for t in parts]
        if interleaved:
            if len(shapes) != 2 or shapes[0] != shapes[1] or shapes[0][0] != self.K:
                raise GemmError(f"interleave() takes two [K, N] tensors with K = {self.K}, got {shapes}")
            self.b_parts, sizes = "interleave", [0, 0]
        elif all(k == self.K for k, _ in shapes):  # one tensor, or parts [K, N_i] along N
            self.b_parts = "n"
            sizes = [n for _, n in shapes]
        elif len({n for _, n in shapes}) == 1 and sum(k for k, _ in shapes) == self.K:  # parts [K_i, N] along K
            self.b_parts = "k"
            sizes = [k for k, _ in shapes]
        else:
            raise GemmError(
                f"a is [.., {self.K}] but b is {shapes[0] if len(shapes) == 1 else shapes}: K differs (b parts "
                "must be [K, N_i], read as concatenated along N, or [K_i, N] with sum K_i = K, along K)"
            )
        # Only parts along N constrain the tile width (a tile must not straddle two of them).
        self.part_sizes = sizes[:-1] if self.b_parts == "n" else []
        self.N = {"n": sum(sizes), "k": shapes[0][1], "interleave": 2 * shapes[0][1]}[self.b_parts]
        self.starts = tuple(int(sum(sizes[:i])) for i in range(len(parts)))
        self.ends = tuple(int(sum(sizes[: i + 1])) for i in range(len(parts)))
        self._check_segments()
        self._check_per_b_part()
        self.operands = self._check_operands(operands)
        self.given = operands  # as passed: an accumulating store returns the caller's tensor, in its shape
        self.user_out = self._check_out(out or {})

    # -- the program against the shape --------------------------------------------------
    def width(self, w):
        return self.N if w is FULL else self.N // 2

    def _check_segments(self):
        p = self.program
        pairs = any(o.width is HALF for o in p.outputs.values()) or any(
            n.width is HALF or n.op in ("pairs", "join") for n in p.nodes())
        if pairs and self.N % 2:
            raise EpilogueError(f"program {p.name!r} pairs columns but N = {self.N} is odd")
        for seg, width in p.segments():
            if self.width(width) % seg:
                raise EpilogueError(
                    f"program {p.name!r} uses segments of {seg} columns but its {width.value} width "
                    f"{self.width(width)} is no multiple of {seg}"
                )

    def _check_per_b_part(self):
        split = [o.name for o in self.program.outputs.values() if o.per_b_part]
        if split and self.b_parts != "n":
            given = "interleaved" if self.b_parts == "interleave" else "parts along K"
            raise EpilogueError(f"program {self.program.name!r} stores {split[0]!r} per part of B, which needs b as "
                                f"one tensor or parts [K, N_i] along N, not {given}")

    def describe_operand(self, name: str) -> str:
        return f"operand {name!r} of program {self.program.name!r}"

    def _check_operands(self, operands):
        p = self.program
        accum = {o.name for o in p.outputs.values() if o.kind == "store" and o.accumulate}
        unknown = set(operands) - set(p.operands) - accum
        if unknown:
            raise EpilogueError(
                f"program {p.name!r} has no operand {sorted(unknown)}; it takes {sorted(set(p.operands) | accum)}"
            )
        missing = (set(p.operands) | accum) - set(operands)
        if missing:
            targets = sorted(missing & accum)
            hint = (f" ({', '.join(targets)}: the tensor an accumulating store adds into, passed as an operand, "
                    f"e.g. {targets[0]}=tensor, not in out=)") if targets else ""
            raise EpilogueError(f"program {p.name!r} needs operand(s) {sorted(missing)}{hint}")
        checked = {}
        for name, value in operands.items():
            op = p.operands.get(name)
            kind = op.kind if op else "accumulate"
            what = self.describe_operand(name)
            if kind == "scalar":
                checked[name] = scalar_operand(value, what)
                continue
            check_tensor(value, what, self.device)
            if kind == "row":
                v = value.reshape(-1) if tuple(value.shape) == self.lead else value
                if v.dim() != 1 or v.shape[0] != self.M:
                    raise EpilogueError(f"{what} is a row vector: expected {self._shapes()}, got {tuple(value.shape)}")
            elif kind == "col":
                n = self.width(op.width)
                if value.dim() != 1 or value.shape[0] != n:
                    raise EpilogueError(f"{what} is a column vector: expected [{n}], got {tuple(value.shape)}")
                v = value
            elif kind == "table":
                if tuple(value.shape) not in ((self.M, op.period), (*self.lead, op.period)):
                    raise EpilogueError(f"{what} is a table: expected {self._shapes(op.period)}, got {tuple(value.shape)}")
                v = value.reshape(self.M, op.period)
            else:
                width = op.width if op else p.outputs[name].width
                n = self.width(width)
                if tuple(value.shape) not in ((self.M, n), (*self.lead, n)):
                    raise EpilogueError(f"{what} is a tile: expected {self._shapes(n)}, got {tuple(value.shape)}")
                if kind == "accumulate":
                    want = p.outputs[name].dtype or self.a.dtype
                    if value.dtype != want:
                        raise EpilogueError(f"{what} is accumulated into as {want}, got {value.dtype}")
                    check_no_overlap(value, what)
                    v = rows_view(value, n, what)
                else:
                    v = value.reshape(self.M, n)
            if kind != "accumulate" and (v.dtype.is_complex or v.dtype == torch.bool):
                raise EpilogueError(f"{what} has dtype {v.dtype}; pass a real number type")
            if v.dtype.is_floating_point and v.dtype.itemsize == 1:  # their NaN and inf encodings vary
                raise EpilogueError(f"{what} has dtype {v.dtype}; 8-bit floats are not read: pass it as "
                                    "fp16, bf16 or fp32")
            checked[name] = v
        return checked

    def _shapes(self, *last) -> str:
        """"[M, *last]", or with a's leading dims "[M, *last] or [B, S, *last]"."""
        flat = list((self.M, *last))
        return str(flat) if len(self.lead) == 1 else f"{flat} or {[*self.lead, *last]}"

    def _check_out(self, out):
        p = self.program
        checked = {}
        for name, t in out.items():
            o = p.outputs.get(name)
            if o is None or (o.kind == "store" and o.accumulate):
                raise EpilogueError(f"program {p.name!r} has no output {name!r} to write into")
            if o.per_b_part:
                raise EpilogueError(f"out[{name!r}] of program {p.name!r}: a store per part of B is allocated by the "
                                    "call (one tensor per part), not given")
            check_tensor(t, f"out[{name!r}]", self.device)
            shape, dtype = self.output_shape(o), self.output_dtype(o)
            if t.dtype != dtype:
                kind = "a reduction, always fp32" if o.kind != "store" else f"stored as {dtype}"
                raise EpilogueError(f"out[{name!r}] of program {p.name!r} must be {dtype} ({kind}), got {t.dtype}")
            if tuple(t.shape) != shape:
                raise EpilogueError(f"out[{name!r}] of program {p.name!r} must have shape {shape}, got {tuple(t.shape)}")
            what = f"out[{name!r}] of program {p.name!r}"
            check_no_overlap(t, what)
            if o.kind == "store" or o.segment:
                rows_view(t, shape[-1], what)  # written as [M, width] rows: a clear error if it cannot be
            checked[name] = t
        return checked

    def part_shapes(self) -> list[tuple]:
        """The shapes of the tensors a store per part of B writes: [..., N_i] each."""
        return [(*self.lead, end - start) for start, end in zip(self.starts, self.ends)]

    def output_shape(self, o):
        n = self.width(o.width)
        if o.kind == "store":
            return (*self.lead, n)
        if o.kind == "col_sum":
            return (n,)
        return (*self.lead, n // o.segment) if o.segment else self.lead

    def output_dtype(self, o):
        return (o.dtype or self.a.dtype) if o.kind == "store" else torch.float32


def check_no_overlap(t, what):
    """A tensor codetta writes must not have elements sharing memory (an expand()ed or
    as_strided view): its tiles would race."""
    if overlaps_itself(t):
        raise EpilogueError(f"{what} is written, but its elements overlap in memory (a broadcast, expand()ed "
                            "or as_strided view): pass a tensor of its own, e.g. .contiguous()")


def rows_view(t, n, what):
    """t as an [M, n] view sharing its memory (written in place), or a clear error."""
    try:
        return t.view(math.prod(t.shape[:-1]), n)  # not view(-1, n): that fails for n = 0
    except RuntimeError as e:
        raise EpilogueError(f"{what} is written in place, so its leading dims must flatten without a copy") from e

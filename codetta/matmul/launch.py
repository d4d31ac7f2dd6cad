"""``codetta.gemm``: check a call, pick a path and a config, allocate, launch, finish.

``gemm(a, b, epilogue=program, **operands)`` computes ``acc = a @ b`` like
``torch.matmul`` and runs ``program`` on each accumulator tile. The layout of each
operand is read from its strides, so the three GEMMs of training are written as in
PyTorch: ``gemm(x, w.t())`` (forward), ``gemm(dy, w)`` (dgrad), ``gemm(dy.t(), x)``
(wgrad). ``b`` may be several weights read as one without a copy: a list of [K, N_i]
(concatenated along N) or [K_i, N] (along K), or ``interleave(b0, b1)``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..epilogue.codegen import kernel_args, load_kernel
from ..epilogue.ir import FULL, HALF, EpilogueError, Program
from ..interpreter import INTERPRETER_LOCK, interpreting
from ..kernels import finish as finishing
from . import config as tile_configs, tuning
from .config import WIDEST_BN, Config, SharedMemory, candidates, interpreter_config
from .memory import byte_span, same_elements, share_elements, spans_meet

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_B_PARTS = 4  # B parts read as one without a copy


class GemmError(ValueError):
    """A call of codetta.gemm with inputs it cannot take."""


class Interleaved(tuple):
    """Two [K, N] operands read as one [K, 2N] whose columns alternate between them."""


def interleave(b0, b1) -> Interleaved:
    """B for ``gemm`` with column 2j = ``b0[:, j]`` and 2j + 1 = ``b1[:, j]``, without a copy.

    E.g. ``gemm(h, interleave(w_gate.t(), w_up.t()), program)``: each (gate, up) pair of a
    SwiGLU lands in adjacent columns of the same tile (``epilogue.pairs(acc)``).
    """
    return Interleaved((b0, b1))


@functools.lru_cache(maxsize=None)
def _plain_program():
    p = Program("plain_gemm")
    p.store("out", p.acc)
    return p


def _check_tensor(t, what, device):
    if not isinstance(t, torch.Tensor):
        raise GemmError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
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


def _tma_ok(t):
    """A 2-d tensor a TMA descriptor can read: unit last stride, 16-byte aligned base and strides."""
    es = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0 and t.stride(0) >= t.shape[1]


class _Call:
    """One checked call: the GEMM's operands and layout, the program's operands and outputs."""

    def __init__(self, a, b, program, operands, out, for_kernel=True):
        """``for_kernel=False``: the checks of :func:`codetta.epilogue.run_reference`, which runs on
        any device and takes fp64 as well."""
        if not isinstance(program, Program):
            raise GemmError(f"epilogue must be a codetta Program, got {type(program).__name__}")
        program.check()
        self.program = program
        if not isinstance(a, torch.Tensor):
            raise GemmError(f"a must be a torch.Tensor, got {type(a).__name__}")
        device = a.device
        interleaved = isinstance(b, Interleaved)
        parts = list(b) if isinstance(b, (list, tuple)) else [b]
        if not 1 <= len(parts) <= MAX_B_PARTS:
            raise GemmError(f"b must be a tensor or a list of 1 to {MAX_B_PARTS} tensors, got {len(parts)}")
        for i, t in enumerate(parts):
            _check_tensor(t, f"b[{i}]" if len(parts) > 1 else "b", device)
        dtypes = _DTYPES if for_kernel else (*_DTYPES, torch.float64)
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
        self.operands = self._check_operands(operands)
        self.given = operands  # as passed: an accumulating store returns the caller's tensor, in its shape
        self.user_out = self._check_out(out or {})

    # -- the program against the shape --------------------------------------------------
    def width(self, w):
        return self.N if w is FULL else self.N // 2

    def _check_segments(self):
        p = self.program
        if (any(o.width is not FULL for o in p.outputs.values()) or p.min_block_n() > 1) and self.N % 2:
            raise EpilogueError(f"program {p.name!r} pairs columns but N = {self.N} is odd")
        for seg, width in p.segments():
            if self.width(width) % seg:
                raise EpilogueError(
                    f"program {p.name!r} uses segments of {seg} columns but its {width.value} width "
                    f"{self.width(width)} is no multiple of {seg}"
                )

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
            what = f"operand {name!r} of program {p.name!r}"
            if kind == "scalar":
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise EpilogueError(f"{what} is a scalar: pass a Python number, got {type(value).__name__}")
                checked[name] = float(value)
                continue
            _check_tensor(value, what, self.device)
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
                    _check_no_overlap(value, what)
                    v = _rows_view(value, n, what)
                else:
                    v = value.reshape(self.M, n)
            if kind != "accumulate" and (v.dtype.is_complex or v.dtype == torch.bool):
                raise EpilogueError(f"{what} has dtype {v.dtype}; pass a real number type")
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
            _check_tensor(t, f"out[{name!r}]", self.device)
            shape, dtype = self.output_shape(o), self.output_dtype(o)
            if t.dtype != dtype:
                kind = "a reduction, always fp32" if o.kind != "store" else f"stored as {dtype}"
                raise EpilogueError(f"out[{name!r}] of program {p.name!r} must be {dtype} ({kind}), got {t.dtype}")
            if tuple(t.shape) != shape:
                raise EpilogueError(f"out[{name!r}] of program {p.name!r} must have shape {shape}, got {tuple(t.shape)}")
            what = f"out[{name!r}] of program {p.name!r}"
            _check_no_overlap(t, what)
            if o.kind == "store":
                _rows_view(t, shape[-1], what)  # written as [M, width] rows: a clear error if it cannot be
            checked[name] = t
        return checked

    def output_shape(self, o):
        n = self.width(o.width)
        if o.kind == "store":
            return (*self.lead, n)
        if o.kind == "col_sum":
            return (n,)
        return (*self.lead, n // o.segment) if o.segment else self.lead

    def output_dtype(self, o):
        return (o.dtype or self.a.dtype) if o.kind == "store" else torch.float32


def _written_in_place(program, operands, out) -> list:
    """[(what, tensor)] of the caller's tensors a call writes into: outputs given in ``out``, and
    the operands of accumulating stores."""
    written = [(f"out[{n!r}]", t) for n, t in out.items() if isinstance(t, torch.Tensor)]
    if isinstance(program, Program):
        written += [(f"operand {o.name!r} (accumulated into)", operands[o.name]) for o in program.outputs.values()
                    if o.kind == "store" and o.accumulate and isinstance(operands.get(o.name), torch.Tensor)]
    return written


def _check_untracked(written) -> None:
    """codetta.gemm records nothing for autograd: a tensor it would write in place while autograd
    tracks it (grad mode on, requires_grad) would keep a gradient that no longer fits its
    values, so it is refused, as torch refuses an in-place write into a leaf that requires grad."""
    if not torch.is_grad_enabled():
        return
    for what, t in written:
        if t.requires_grad:
            raise GemmError(f"codetta.gemm would write {what} in place, which requires grad: codetta.gemm does not "
                            "track gradients (detach it, or call under torch.no_grad())")


def _count_writes(written) -> None:
    """Bump the version counter of each tensor written in place, as PyTorch's in-place ops do:
    autograd then refuses a backward through a graph that saved the old values (of it or of a
    view sharing its counter), and codetta's norm statistics (NormStats) see x changed."""
    for _, t in written:
        torch.autograd.graph.increment_version(t)


def _check_written_apart(program, a, b, operands, out):
    """What the kernel writes (outputs given in ``out``, operands accumulated into) must not
    share an element with a, b or the program's operands, which tiles read beyond their own
    output tile, nor with another written tensor: tiles would overwrite what others still read
    (e.g. ``gemm(a, b, out=a)``: silently wrong, as torch.mm's ``out=a`` is). An aux tile
    operand written in place (the same elements, in the same layout, as the output) is fine:
    each tile reads its own tile of it before writing that tile. Checked on every call: it
    depends on the addresses, which a plan does not fix. Arguments of the wrong type are left
    to the call's own checks."""
    if not isinstance(program, Program):
        return
    accumulated = {o.name for o in program.outputs.values() if o.kind == "store" and o.accumulate}
    written = _written_in_place(program, operands, out)
    if not written:
        return
    parts = b if isinstance(b, (list, tuple)) else (b,)
    read = [("a", a, False)] + [(f"b[{i}]" if len(parts) > 1 else "b", t, False) for i, t in enumerate(parts)]
    read += [(f"operand {n!r}", operands.get(n), o.kind == "aux") for n, o in program.operands.items()
             if n not in accumulated]
    read = [r for r in read if isinstance(r[1], torch.Tensor)]
    everything = read + [(name, t, False) for name, t in written]
    spans = [byte_span(t) for _, t, _ in everything]
    for i in range(len(read), len(everything)):
        name, w, _ = everything[i]
        for j in range(i):
            other, t, in_place_ok = everything[j]
            if not spans_meet(spans[i], spans[j]) or (in_place_ok and same_elements(w, t)):
                continue
            if share_elements(w, t):
                raise GemmError(f"{name} is written but shares memory with {other}, which the GEMM "
                                f"{'reads beyond this tile' if j < len(read) else 'also writes'}: pass "
                                "a tensor of its own (e.g. a .clone())")


def _check_no_overlap(t, what):
    """A tensor codetta writes must not have elements sharing memory (an expand()ed view): its
    tiles would race."""
    if torch._debug_has_internal_overlap(t) == 1:
        raise EpilogueError(f"{what} is written, but its elements overlap in memory (a broadcast or expand()ed "
                            "view): pass a tensor of its own, e.g. .contiguous()")


def _rows_view(t, n, what):
    """t as an [M, n] view sharing its memory (written in place), or a clear error."""
    try:
        return t.view(math.prod(t.shape[:-1]), n)  # not view(-1, n): that fails for n = 0
    except RuntimeError as e:
        raise EpilogueError(f"{what} is written in place, so its leading dims must flatten without a copy") from e


def _operand_layout(t):
    """(transposed, store) of a 2-d operand: store is the row-major tensor (or view) TMA reads.

    transposed is False for a row-major tensor, True for the transpose of one, None when
    neither dim has unit stride (only the pointer path takes it).
    """
    if t.stride(1) == 1 or t.shape[1] == 1:
        return False, t
    if t.stride(0) == 1 or t.shape[0] == 1:
        return True, t.t()
    return None, t


@functools.lru_cache(maxsize=None)
def _has_tma(device):
    return interpreting() or torch.cuda.get_device_capability(device)[0] >= 9


def _layouts(call):
    """(A_KM, B_KN, whether the mainloop can read A and B through TMA descriptors)."""
    a_t, a_store = _operand_layout(call.a)
    b_layouts = [_operand_layout(t) for t in call.parts]
    b_t = {t for t, _ in b_layouts}
    tma = (
        a_t is not None
        and len(b_t) == 1
        and None not in b_t
        and call.K > 0
        and _tma_ok(a_store)
        and all(_tma_ok(store) for _, store in b_layouts)
        and _has_tma(call.device)
        and os.environ.get("CODETTA_PATH") != "ptr"
        # TMA reads A at each K part's first column: it must lie on a 16-byte boundary
        and not (call.b_parts == "k" and any(s * call.a.element_size() % 16 for s in call.starts))
    )
    # B^T row-major is nn.Linear's W [N, K]; B row-major [K, N] is "B_KN".
    return bool(a_t), (not b_t.pop()) if len(b_t) == 1 else False, tma


def _device_index(device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _num_programs(device, tiles, ctas_per_sm=1):
    """The persistent grid: one program per SM (``ctas_per_sm`` per SM), no more than there are tiles."""
    if interpreting():
        return min(tiles, 3)
    return min(tiles, ctas_per_sm * _sm_count(_device_index(device)))


@functools.lru_cache(maxsize=None)
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _shared_memory(index) -> SharedMemory:
    """The device's shared memory (Hopper's where PyTorch does not report it)."""
    props = torch.cuda.get_device_properties(index)
    per_block = getattr(props, "shared_memory_per_block_optin", getattr(props, "shared_memory_per_block", None))
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    if not per_block or not per_sm:
        return SharedMemory()
    return SharedMemory(per_sm=per_sm, per_block=per_block)


class _Plan:
    """How every call with one signature (see :func:`_plan`) is launched.

    The signature fixes the shapes, strides, dtypes, devices and alignment of all tensors,
    the program and the config; so the checks, the layout, the path, the tuned config, the
    strides and sizes passed to the kernel are settled once, here. A call then only
    reshapes its operands, allocates its outputs, makes its TMA descriptors and launches:
    after the first launch through Triton's JIT, straight through the compiled kernel (its
    specialization depends only on what the signature fixes).
    """

    def __init__(self, call, path, cfg):
        p, c = call.program, call
        self.path, self.cfg, self.device = path, cfg, c.device
        self.M, self.K = c.M, c.K
        self.a_km, self.b_kn, _ = c.layout
        self.kernel, self.compiled = load_kernel(p, path), None
        self.describe = TensorDescriptor.from_tensor  # checked, until the first launch has compiled
        tiles = triton.cdiv(c.M, cfg.BM) * triton.cdiv(c.N, cfg.BN)
        self.grid = (_num_programs(c.device, tiles, cfg.CTAS_PER_SM), 1, 1)
        self.options = cfg.launch_options()
        self.interpret = interpreting()
        # per operand: how the value passed becomes the kernel's view (see _Call._check_operands)
        accum = [o.name for o in p.outputs.values() if o.kind == "store" and o.accumulate]
        prepare = {name: _preparation(value, c.given[name], name in accum) for name, value in c.operands.items()}
        self.prepare = [(name, prep) for name, prep in prepare.items() if prep is not None]  # the others as given
        self.accumulate = accum
        written = [o for o in p.outputs.values() if (o.kind == "store" and not o.accumulate) or o.segment]
        self.user_written = [(o.name, (c.M, c.output_shape(o)[-1])) for o in written if o.name in c.user_out]
        # (name, shape, dtype, the [M, cols] view the kernel writes, None when it is the shape itself)
        self.allocated = [(o.name, shape, c.output_dtype(o), None if shape == (c.M, shape[-1]) else (c.M, shape[-1]))
                          for o in written if o.name not in c.user_out for shape in [c.output_shape(o)]]
        self.partials = _partial_shapes(c, cfg)
        # (name, finishing step, the output's shape when it is not the finished [M] or [N] one)
        self.finished = [(o.name, _FINISH[o.kind], None if len(shape) == 1 else shape) for o in p.outputs.values()
                         if not (o.kind == "store" or o.segment) for shape in [c.output_shape(o)]]
        self.template, self.filled = self._arguments(c)

    def _arguments(self, c):
        """(the kernel's arguments in order, with the per-call ones left None; [(index, fill)]):
        ``fill(a2, parts, operands, outputs, partials)`` gives argument ``index`` of a call."""
        cfg, tma = self.cfg, self.path == "tma"
        values, fills = {}, {}
        if tma:
            a_block = [cfg.BK, cfg.BM] if self.a_km else [cfg.BM, cfg.BK]
            bn = cfg.BN // 2 if c.b_parts == "interleave" else cfg.BN
            b_block = [cfg.BK, bn] if self.b_kn else [bn, cfg.BK]
            a_t = _operand_layout(c.a)[0]
            fills["a"] = lambda a, b, o, w, q: self.describe(a.t() if a_t else a, a_block)
            for i, part in enumerate(c.parts):
                b_t = _operand_layout(part)[0]  # the row-major store TMA reads
                fills[f"b{i}"] = lambda a, b, o, w, q, i=i, b_t=b_t: self.describe(b[i].t() if b_t else b[i], b_block)
            values.update(stride_a0=0, stride_a1=0, stride_b0=tuple(0 for _ in c.parts),
                          stride_b1=tuple(0 for _ in c.parts))
        else:
            fills["a"] = lambda a, b, o, w, q: a
            for i in range(len(c.parts)):
                fills[f"b{i}"] = lambda a, b, o, w, q, i=i: b[i]
            values.update(stride_a0=c.a.stride(0), stride_a1=c.a.stride(1),
                          stride_b0=tuple(t.stride(0) for t in c.parts), stride_b1=tuple(t.stride(1) for t in c.parts))
        values.update({f"b{i}": None for i in range(len(c.parts), MAX_B_PARTS)})
        values.update(b_starts=c.starts, b_ends=c.ends, M=c.M, N=c.N, K=c.K)
        partial_strides = {name: shape[1] for name, _, shape in self.partials}
        for name, kind in kernel_args(c.program, self.path):
            base, _, suffix = name.rpartition("_")
            if kind in ("scalar", "row", "col", "aux", "table"):
                fills[name] = lambda a, b, o, w, q, base=base: o[base]
            elif kind == "out":
                fills[name] = lambda a, b, o, w, q, base=base: w[base][1]
            elif kind == "table_desc":
                block = [cfg.BM, c.program.operands[base].period]
                fills[name] = lambda a, b, o, w, q, base=base, block=block: self.describe(o[base], block)
            elif kind in ("aux_desc", "out_desc"):
                width = (c.program.outputs.get(base) if kind == "out_desc" else c.program.operands[base]).width
                block = [cfg.BM, cfg.epilogue_bn if width is FULL else cfg.epilogue_bn // 2]
                if kind == "out_desc":
                    fills[name] = lambda a, b, o, w, q, base=base, block=block: self.describe(w[base][1], block)
                else:
                    fills[name] = lambda a, b, o, w, q, base=base, block=block: self.describe(o[base], block)
            elif kind == "partial":
                fills[name] = lambda a, b, o, w, q, base=base, i=int(suffix == "psum"): q[base][i]
            elif suffix == "pstride":
                values[name] = partial_strides[base]
            elif suffix == "stride":
                values[name] = c.operands[base].stride(0)
            else:  # s0 / s1 of a tile: an operand's view or an output's [M, cols] view (contiguous unless given)
                values[name] = self._tile_stride(c, base, 0 if suffix == "s0" else 1)
        values.update(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, STAGES=cfg.STAGES, EPI_SPLIT=cfg.EPI_SPLIT,
                      FLATTEN=cfg.FLATTEN and self.path == "tma" and len(c.parts) == 1, NUM_B=len(c.parts),
                      B_PARTS=c.b_parts, A_KM=self.a_km, B_KN=bool(self.b_kn), INTERPRET=interpreting(),
                      PRECISION="ieee" if (interpreting() or c.a.dtype == torch.float32) else "tf32")
        names = self.kernel.arg_names
        template = [values.get(n) for n in names]
        return template, [(names.index(n), f) for n, f in fills.items()]

    def _tile_stride(self, c, base, dim):
        if base in c.operands:
            return c.operands[base].stride(dim)
        user = c.user_out.get(base)
        if user is not None:
            return _rows_view(user, user.shape[-1], base).stride(dim)
        return (c.output_shape(c.program.outputs[base])[-1], 1)[dim]

    def compile(self, a, b, operands, out):
        """Compile the kernel for these arguments without launching it (Triton's warmup: under
        an AsyncCompileMode, in the background)."""
        *_, args = self._arguments_for(a, b, operands, out)
        self.kernel.warmup(*args, grid=self.grid, **self.options)

    def _arguments_for(self, a, b, operands, out):
        """(outputs, partials, the kernel's arguments) of one call."""
        a2 = a if a.dim() == 2 else a.reshape(self.M, self.K)
        parts = b if isinstance(b, (list, tuple)) else (b,)
        ops = dict(operands)
        for name, prep in self.prepare:
            ops[name] = prep(ops[name])
        outs = {name: (operands[name], ops[name]) for name in self.accumulate}
        for name, shape, dtype, rows in self.allocated:
            t = torch.empty(shape, device=self.device, dtype=dtype)
            outs[name] = (t, t if rows is None else t.view(rows))
        for name, rows in self.user_written:
            outs[name] = (out[name], out[name].view(rows))
        bufs = {name: tuple(torch.empty(shape, device=self.device, dtype=torch.float32) for _ in range(count))
                for name, count, shape in self.partials}
        args = list(self.template)
        for i, fill in self.filled:
            args[i] = fill(a2, parts, ops, outs, bufs)
        return outs, bufs, args

    def launch(self, a, b, operands, out):
        """Launch the kernel on one call's tensors: (outputs, partials), not yet finished."""
        outs, bufs, args = self._arguments_for(a, b, operands, out)
        if self.compiled is not None:
            self.compiled[self.grid](*args)
        elif self.interpret:
            with INTERPRETER_LOCK:
                self.kernel[self.grid](*args, **self.options)
        else:
            self.compiled = self.kernel[self.grid](*args, **self.options)
            self.describe = _UncheckedDescriptor.of
        return outs, bufs

    def execute(self, a, b, operands, out, finish):
        """The results of one call: the tensors the kernel wrote, the reductions finished (by
        ``finish[name]`` where given)."""
        outs, bufs = self.launch(a, b, operands, out)
        results = {name: pair[0] for name, pair in outs.items()}
        for name, finish_fn, shape in self.finished:
            val = finish[name](*bufs[name]) if name in finish else finish_fn(*bufs[name])
            val = val if shape is None else val.view(shape)
            results[name] = val if name not in out else out[name].copy_(val)
        return results


def _preparation(view, given, in_place):
    """How an operand as passed becomes the view the kernel reads or, ``in_place``, writes
    (the plan checked that it is a view); a scalar becomes a float; None: as it is."""
    if not isinstance(view, torch.Tensor):
        return float
    shape = tuple(view.shape)
    if tuple(given.shape) == shape:
        return None
    return (lambda v: v.view(shape)) if in_place else (lambda v: v.reshape(shape))


class _UncheckedDescriptor(TensorDescriptor):
    """A TMA descriptor whose checks (alignment, strides, block shape) are skipped: a plan's
    first launch made the same ones, with tensors of the same metadata, through the checked class."""

    def __post_init__(self):
        pass

    @classmethod
    def of(cls, t, block):
        return cls(t, t.shape, t.stride(), block)


def _partial_shapes(c, cfg):
    """[(name, buffers, shape)] of the fp32 partials of the program's non-segment reductions."""
    n_tiles_n, n_tiles_m = triton.cdiv(c.N, cfg.epilogue_bn), triton.cdiv(c.M, cfg.BM)
    shapes = []
    for o in c.program.outputs.values():
        if o.kind == "col_sum":
            shapes.append((o.name, 1, (n_tiles_m, c.width(o.width))))
        elif o.kind in ("row_sum", "row_max") and not o.segment:
            shapes.append((o.name, 1, (c.M, n_tiles_n)))
        elif o.kind == "row_logsumexp" and not o.segment:
            shapes.append((o.name, 2, (c.M, n_tiles_n)))
    return shapes


_FINISH = {"col_sum": finishing.col_sum, "row_sum": finishing.row_sum, "row_max": finishing.row_max,
           "row_logsumexp": finishing.row_logsumexp}


def gemm(a, b, epilogue: Program | None = None, *, out=None, config=None, finish=None, **operands):
    """``a @ b`` with ``epilogue`` run on each output tile before it is written.

    Args:
        a: [..., M, K] (leading dims are flattened into M) or a transposed [M, K] view.
        b: [K, N], or a list of up to four tensors read as one without a copy: [K, N_i]
            concatenated along N, or [K_i, N] concatenated along K (sum K_i = K); or
            ``interleave(b0, b1)``: two [K, N/2] whose columns alternate.
        epilogue: a :class:`codetta.epilogue.Program`; None means a plain GEMM.
        out: optional name -> tensor to write outputs into (checked: shape, dtype, device); for
            a plain GEMM (no program), the output tensor itself.
        config: a :class:`codetta.Config` to use instead of tuning.
        finish: optional name -> function replacing the finishing step of that reduction
            output (not per segment): it gets the fp32 partials ([M, T] per row tile column,
            [T, N] for a column sum; logsumexp's (maxima, sums)) and returns the result, e.g.
            to fold what follows the sum into the same small kernel.
        **operands: the program's operands by name (and, for accumulating stores, the
            tensor to add into).

    Returns:
        The output tensor for a plain GEMM, else a dict name -> tensor: stores as
        [..., M, width] in their dtype; row reductions fp32 [..., M] (per segment
        [..., M, width / segment]); column reductions fp32 [width].
    """
    program = epilogue if epilogue is not None else _plain_program()
    out = _outputs_given(out, epilogue)
    finish = _finishers(finish, program)
    b = _without_empty_parts(b)
    _warn_if_differentiable(a, b, operands)
    written = _written_in_place(program, operands, out)
    _check_untracked(written)
    _check_written_apart(program, a, b, operands, out)  # before any launch: the tuner's write into out too
    plan = _plan(a, b, program, operands, out, config)
    if plan is None:
        results = _trivial(_Call(a, b, program, operands, out), finish)
    else:
        results = plan.execute(a, b, operands, out, finish)
    _count_writes(written)
    return results["out"] if epilogue is None else results


def _finishers(finish, program):
    """``finish`` checked: a dict of the program's reductions with a finishing step -> a callable."""
    if finish is None:
        return {}
    if not isinstance(finish, dict):
        raise GemmError(f"finish must be a dict of output name -> function, got {type(finish).__name__}")
    for name, fn in finish.items():
        o = program.outputs.get(name) if isinstance(program, Program) else None
        if o is None or o.kind == "store" or o.segment:
            raise GemmError(f"finish[{name!r}]: program {getattr(program, 'name', program)!r} has no reduction "
                            f"{name!r} with a finishing step (a store or a per-segment reduction has none)")
        if not callable(fn):
            raise GemmError(f"finish[{name!r}] must be a function of the partials, got {type(fn).__name__}")
    return finish


def _outputs_given(out, epilogue):
    """``out`` as a dict name -> tensor: a plain GEMM (no program) also takes one tensor."""
    if out is None:
        return {}
    if isinstance(out, torch.Tensor) and epilogue is None:
        return {"out": out}
    if not isinstance(out, dict):
        raise GemmError(f"out must be a dict of output name -> tensor (a plain GEMM also takes one tensor), "
                        f"got {type(out).__name__}")
    return out


def _warn_if_differentiable(a, b, operands):
    """codetta.gemm does not record itself for autograd: say so where a caller may expect it to."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    tensors = [a, *(b if isinstance(b, (list, tuple)) else (b,)), *operands.values()]
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        warnings.warn("codetta.gemm does not track gradients: its results have no grad_fn although an input "
                      "requires grad (codetta.linear and the operators in codetta.ops are differentiable)",
                      stacklevel=3)


def _without_empty_parts(b):
    """A list of B parts without those that hold no element (a [K, 0] part along N, a [0, N] part
    along K: they add nothing, and no TMA descriptor takes them); as given when all or none do."""
    if isinstance(b, Interleaved) or not isinstance(b, (list, tuple)):
        return b
    kept = [t for t in b if not isinstance(t, torch.Tensor) or t.numel()]
    return kept if 0 < len(kept) < len(b) else b


def _trivial(call, finish):
    """The results of a call without rows or columns: reductions over nothing (a ``finish``
    function gets partials over no tile)."""
    results = {}
    for o in call.program.outputs.values():
        if o.name in finish:
            shape = (0, call.width(o.width)) if o.kind == "col_sum" else (call.M, 0)
            parts = [torch.empty(shape, device=call.device, dtype=torch.float32)
                     for _ in range(2 if o.kind == "row_logsumexp" else 1)]
            results[o.name] = finish[o.name](*parts).reshape(call.output_shape(o))
            continue
        shape, dtype = call.output_shape(o), call.output_dtype(o)
        if o.kind == "store" and o.accumulate:
            results[o.name] = call.given[o.name]
            continue
        t = call.user_out.get(o.name)
        if t is None:
            t = torch.empty(shape, device=call.device, dtype=dtype)
        if o.kind in ("row_sum", "col_sum"):
            t.zero_()
        elif o.kind != "store":
            t.fill_(float("-inf"))  # max and logsumexp over no columns
        results[o.name] = t
    return results


@functools.lru_cache(maxsize=None)
def _device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _tuning_key(call, path):
    device = _device_name(call.device)
    m_bucket = 1 << max(call.M - 1, 0).bit_length()
    p = call.program
    return "|".join(
        str(x)
        for x in (device, triton.__version__, p.name, p.fingerprint(), path, call.layout[0], call.layout[1],
                  call.a.dtype, call.N, call.K, m_bucket, call.part_sizes, call.b_parts)
    )


def _meta(v):
    if isinstance(v, torch.Tensor):
        return (v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16 == 0)
    return type(v)


_PLANS = {}
_MAX_PLANS = 4096


@contextlib.contextmanager
def large_interpreter_tiles():
    """Within it, Triton's CPU interpreter runs every GEMM on its large (64-wide) tiles, not only
    the large problems (:func:`codetta.matmul.config.interpreter_config`): for runs about
    training rather than tile edges (the CPU demo, the convergence test), about twice as fast.
    Plans made within are kept apart and forgotten after."""
    global _PLANS
    saved = tile_configs.INTERPRETER_SMALL_DIM, _PLANS
    tile_configs.INTERPRETER_SMALL_DIM, _PLANS = 0, {}
    try:
        yield
    finally:
        tile_configs.INTERPRETER_SMALL_DIM, _PLANS = saved


def _plan(a, b, program, operands, out, config):
    """The plan of a call (None when it has no rows or columns), made and checked on the first
    call with its signature: the program, the type and metadata of every argument, the
    config, and the environment that steers the choice."""
    if not isinstance(program, Program):
        raise GemmError(f"epilogue must be a codetta Program, got {type(program).__name__}")
    if config is not None and not isinstance(config, Config):
        raise GemmError(f"config must be a codetta.Config, got {type(config).__name__}")
    parts = b if isinstance(b, (list, tuple)) else (b,)
    sig = (
        program.fingerprint(), program.name, type(b), _meta(a), tuple(map(_meta, parts)),
        tuple((k, _meta(v)) for k, v in operands.items()), tuple((k, _meta(v)) for k, v in out.items()),
        config, interpreting(), os.environ.get("CODETTA_PATH"),
    )
    plan = _PLANS.get(sig)
    if plan is None:
        call = _Call(a, b, program, operands, out)
        if call.M == 0 or call.N == 0:
            return None
        plan = _Plan(call, *_choose(call, config))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[sig] = plan
    return plan


def _choose(call, config):
    """(path, config): TMA when every operand allows it; the config given, or tuned."""
    call.layout = _layouts(call)
    min_bn = call.program.min_block_n()
    tma_min_bn = max(min_bn, _table_block_n(call.program))
    parts = tuple(call.part_sizes)
    tma = call.layout[2] and _tiles_tma_ok(call)
    if config is not None:
        if config.epilogue_bn < min_bn:
            raise EpilogueError(
                f"config {config} gives the epilogue tiles {config.epilogue_bn} wide; program "
                f"{call.program.name!r} needs {min_bn}"
            )
        tma = tma and _fits(config, parts) and config.epilogue_bn >= tma_min_bn and _blocks_tma_ok(call, config)
        return ("tma" if tma else "ptr"), config
    if interpreting():
        size = dict(m=call.M, n=call.N, k=call.K)
        cfg = interpreter_config(min_bn=tma_min_bn, n_parts_sizes=parts, **size)
        if tma and cfg is not None:
            return "tma", cfg
        return "ptr", interpreter_config(min_bn=min_bn, **size)
    size = dict(elem_bytes=call.a.element_size(), m=call.M, n=call.N,
                smem=_shared_memory(_device_index(call.device)), **_epilogue_smem(call))
    configs = candidates(n_parts_sizes=parts, flatten=len(call.parts) == 1, min_bn=tma_min_bn, **size) if tma else []
    path = "tma" if configs else "ptr"
    configs = configs or candidates(min_bn=min_bn, **size)
    if not configs:
        raise GemmError(f"program {call.program.name!r}: no tile config fits this GPU's shared memory "
                        f"({size['smem'].per_block // 1024} KiB per block)")
    return path, _tuned(call, path, configs)


def _tuned(call, path, configs):
    """The fastest of ``configs`` for this call, timed on its own tensors (once per tuning key)."""
    plans = {}

    def plan_for(cfg):
        if cfg not in plans:
            plans[cfg] = _Plan(call, path, cfg)
        return plans[cfg]

    def compile_all(cfgs):
        tuning.compile_in_parallel([lambda cfg=cfg: plan_for(cfg).compile(call.a, call.parts, call.given, call.user_out)
                                    for cfg in cfgs])

    def bench(cfg):
        plan = plan_for(cfg)
        return tuning.graph_ms(lambda: plan.launch(call.a, call.parts, call.given, call.user_out))

    kept = []

    def prepare(cfgs):  # only when the candidates are timed (not on a cache hit)
        kept.extend((t, t.clone()) for t in _read_and_written(call))
        compile_all(cfgs)

    capturing = call.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    cannot_time = ("its first call is being captured into a CUDA graph, where no kernel can be timed; run the "
                   "model once before capturing it (as PyTorch advises for warm-up) to tune") if capturing else None
    try:
        return tuning.choose(_tuning_key(call, path), configs, bench, prepare=prepare, cannot_time=cannot_time)
    finally:
        for t, before in kept:
            t.copy_(before)


def _read_and_written(call):
    """The tensors the kernel reads and writes: those accumulated into, and an aux operand written
    in place (given in out=). The tuner's timed launches would each feed its result to the next, so
    their values are put back after the timings (put back, not timed on clones: a clone of a
    strided view is contiguous, and its strides would not be the plan's)."""
    p = call.program
    accumulated = [call.given[o.name] for o in p.outputs.values() if o.kind == "store" and o.accumulate]
    aux = [call.given[o.name] for o in p.operands.values() if o.kind == "aux"]
    return accumulated + [t for t in aux if any(same_elements(t, w) for w in call.user_out.values())]


def _epilogue_smem(call):
    """The element sizes the epilogue stages through shared memory (see Config.smem_bytes)."""
    p = call.program
    aux = [call.operands[o.name].element_size() for o in p.operands.values() if o.kind == "aux"]
    stored = [call.output_dtype(o).itemsize for o in p.outputs.values() if o.kind == "store"]
    # Tables read through TMA ([BM, P] blocks) are not counted: Triton 3.9 places them in shared
    # memory the ring or the output staging also use (the RoPE kernel's total is unchanged).
    return dict(staged_bytes=max(aux + stored, default=None), aux_bytes=sum(aux))


def _table_block_n(program):
    """The narrowest epilogue tile that holds every table's period whole (TMA path): P columns,
    or 2P for a table over the N/2 pairs."""
    return max((o.period * (2 if o.width is HALF else 1) for o in program.operands.values() if o.kind == "table"),
               default=1)


def explain(a, b, epilogue: Program | None = None, *, out=None, config=None, **operands):
    """The path ('tma' or 'ptr') and config ``gemm`` would launch with these arguments (tunes if needed)."""
    plan = _plan(a, _without_empty_parts(b), epilogue if epilogue is not None else _plain_program(), operands,
                 _outputs_given(out, epilogue), config)
    return {"path": None, "config": None} if plan is None else {"path": plan.path, "config": plan.cfg}


def _tiles_tma_ok(call):
    """Whether every tile the epilogue reads or stores can go through a TMA descriptor (the
    outputs codetta allocates are contiguous: their rows must be 16-byte multiples)."""
    p = call.program
    tiles = [call.operands[o.name] for o in p.operands.values() if o.kind == "aux"]
    for o in p.operands.values():  # a table's [BM, P] block: P a power of two of 16 bytes or more,
        if o.kind == "table":        # the tile it needs (P, 2P over pairs) no wider than the widest config's
            t = call.operands[o.name]
            width = o.period * (2 if o.width is HALF else 1)
            if o.period & (o.period - 1) or o.period * t.element_size() < 16 or width > WIDEST_BN:
                return False
            tiles.append(t)
    for o in p.outputs.values():
        if o.kind != "store":
            continue
        user = call.operands.get(o.name) if o.accumulate else call.user_out.get(o.name)
        if user is not None:
            tiles.append(call.operands[o.name] if o.accumulate else _rows_view(user, user.shape[-1], o.name))
        elif call.output_shape(o)[-1] * call.output_dtype(o).itemsize % 16:
            return False
    return all(_tma_ok(t) for t in tiles)


def _fits(cfg, part_sizes):
    return not any(s % cfg.BN for s in part_sizes)


def _blocks_tma_ok(call, cfg):
    """Whether every TMA block of ``cfg`` spans 16 bytes or more along its contiguous dim, as TMA
    needs: the A and B blocks, and the epilogue's aux and output tiles (a given config may have
    narrower ones than any the tuner tries, e.g. 4 columns of bf16 after EPI_SPLIT = 4)."""
    a_km, b_kn, _ = call.layout
    elem = call.a.element_size()
    bn = cfg.BN // 2 if call.b_parts == "interleave" else cfg.BN
    spans = [(cfg.BM if a_km else cfg.BK) * elem, (bn if b_kn else cfg.BK) * elem]
    p = call.program
    tiles = [(o.width, call.operands[o.name].element_size()) for o in p.operands.values() if o.kind == "aux"]
    tiles += [(o.width, call.output_dtype(o).itemsize) for o in p.outputs.values() if o.kind == "store"]
    spans += [(cfg.epilogue_bn if width is FULL else cfg.epilogue_bn // 2) * size for width, size in tiles]
    return min(spans) >= 16

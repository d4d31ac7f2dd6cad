"""Triton code generation: a program inlined into the epilogue of the persistent GEMM kernel.

The generated kernel walks output tiles persistently (grouped order), gets the fp32
accumulator of each from the fixed mainloop (:mod:`codetta.matmul.mainloop`) and then
runs the program's nodes as straight-line Triton code on that tile. Shapes inside a
tile: a value with rows is [BM, ...], without rows [1, ...]; a value over the N
columns is [..., BN], over the N/2 pairs [..., BN // 2], constant along columns
[..., 1]; a scalar operand is a [1, 1] tensor, a constant a Python float.

Row reductions over all N write one fp32 partial per (row, column tile), finished
on the host side (:mod:`codetta.kernels.finish`); per-segment row reductions are
whole inside a tile and are written finished. Column reductions write one partial
per (row tile, column), finished the same way. Nothing uses atomics, so every
result is deterministic.

:func:`kernel_source` returns the source; :func:`load_kernel` writes it to the
kernel cache and imports it (Triton's JIT reads a function's source from its file).
"""

from __future__ import annotations

import atexit
import importlib.util
import math
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from ..cache import cache_root, write_atomically
from ..interpreter import interpreting
from .ir import FULL, HALF, MAX_B_PARTS, EpilogueError, Program

_TL_DTYPE = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}

# A per-tile maximum as the reference point of a logsumexp: 0 where it is infinite (a row of
# -inf sums no exp; a row holding +inf gives exp(+inf - 0) = inf, not exp(inf - inf) = NaN).
_FINITE_OR_ZERO = "tl.where(tl.abs({0}) == float('inf'), 0.0, {0})"

_UNARY = {
    "neg": "-({0})",
    "abs": "tl.abs({0})",
    "exp": "tl.exp({0})",
    "log": "tl.log({0})",
    "sqrt": "tl.sqrt_rn({0})",
    "rsqrt": "tl.rsqrt({0})",
    "reciprocal": "tl.div_rn(1.0, {0})",
    "square": "({0}) * ({0})",
    "sigmoid": "tl.sigmoid({0})",
    "tanh": "tanh({0})",
    "silu": "({0}) * tl.sigmoid({0})",
    "relu": "tl.maximum({0}, 0.0, propagate_nan=tl.PropagateNan.ALL)",  # relu(NaN) = NaN, as torch.relu
    # 0.5 x (1 + tanh(u)) == x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
    "gelu_tanh": "({0}) * tl.sigmoid(1.5957691216057308 * (({0}) + 0.044715 * ({0}) * ({0}) * ({0})))",
    "gelu_erf": "0.5 * ({0}) * (1.0 + tl.erf(({0}) * 0.7071067811865476))",
    "sin": "tl.sin({0})",
    "cos": "tl.cos({0})",
    "floor": "tl.floor({0})",
    "not": "~({0})",
}

_BINARY = {
    "add": "({0}) + ({1})",
    "sub": "({0}) - ({1})",
    "mul": "({0}) * ({1})",
    "div": "tl.div_rn({0}, {1})",
    "maximum": "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "minimum": "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)",
    "lt": "({0}) < ({1})",
    "le": "({0}) <= ({1})",
    "gt": "({0}) > ({1})",
    "ge": "({0}) >= ({1})",
    "eq": "({0}) == ({1})",
    "ne": "({0}) != ({1})",
    "and": "({0}) & ({1})",
    "or": "({0}) | ({1})",
}


def kernel_name(program: Program, path: str) -> str:
    return f"{program.name}_{path}_{program.fingerprint()}"


def kernel_args(program: Program, path: str):
    """The kernel's runtime arguments after the GEMM's own, in order, as (name, what).

    On the 'tma' path, tiles (aux operands, tables, stores) are read and written through TMA
    descriptors (``{name}_desc``); on the 'ptr' path through pointers and strides.

    A store per part of B (``per_b_part``) gets a descriptor (``{name}_desc{i}``) or pointer
    (``{name}_ptr{i}``, its strides in the tuples ``{name}_s0``, ``{name}_s1``) per part, up
    to MAX_B_PARTS, those past the call's parts None.

    Every identifier made from an operand or output name is ``{name}_{role}``, with a role
    without underscores (val, ptr, stride, s0, s1, desc, part, pmax, psum, pstride, desc0..3,
    ptr0..3, and the local ptrs, mask, tile), and no name of the kernel's own ends in ``_{role}``: a program's
    names can neither collide with each other's nor with the kernel's (a scalar named
    ``tile`` or ``M``, a row vector named ``mma``).
    """
    return program._cached(("kernel_args", path), lambda: _kernel_args(program, path))


def _tile_args(name, what, path):
    if path == "tma":
        return [(f"{name}_desc", f"{what}_desc")]
    return [(f"{name}_ptr", what), (f"{name}_s0", "stride"), (f"{name}_s1", "stride")]


def _per_part_args(name, path):
    """The arguments of a store per part of B: one descriptor or pointer per possible part."""
    if path == "tma":
        return [(f"{name}_desc{i}", "part_desc") for i in range(MAX_B_PARTS)]
    pointers = [(f"{name}_ptr{i}", "part") for i in range(MAX_B_PARTS)]
    return pointers + [(f"{name}_s0", "stride"), (f"{name}_s1", "stride")]


def _kernel_args(program, path):
    args = []
    for op in sorted(program.operands.values(), key=lambda o: o.name):
        if op.kind == "scalar":
            args.append((f"{op.name}_val", "scalar"))
        elif op.kind in ("row", "col"):
            args += [(f"{op.name}_ptr", op.kind), (f"{op.name}_stride", "stride")]
        elif op.kind == "table":
            args += _tile_args(op.name, "table", path)
        else:
            args += _tile_args(op.name, "aux", path)
    for out in sorted(program.outputs.values(), key=lambda o: o.name):
        if out.kind == "store":
            args += _per_part_args(out.name, path) if out.per_b_part else _tile_args(out.name, "out", path)
        elif out.segment:
            args += _tile_args(out.name, "out", "ptr")
        if out.kind == "row_logsumexp" and not out.segment:
            args += [(f"{out.name}_pmax", "partial"), (f"{out.name}_psum", "partial"), (f"{out.name}_pstride", "stride")]
        elif (out.kind in ("row_sum", "row_max") and not out.segment) or out.kind == "col_sum":
            args += [(f"{out.name}_part", "partial"), (f"{out.name}_pstride", "stride")]
    return args


class _Writer:
    def __init__(self):
        self.lines = []
        self.count = 0

    def emit(self, line):
        self.lines.append("    " + line)

    def fresh(self, expr):
        name = f"v{self.count}"
        self.count += 1
        self.emit(f"{name} = {expr}")
        return name


def _shape(node):
    rows = "BM" if node.rows else "1"
    cols = {FULL: "BN", HALF: "BN // 2", None: "1"}[node.width]
    return rows, cols


def _broadcast(name, node, rows, cols):
    """Code for the value ``name`` of ``node`` broadcast to a [rows, cols] tensor."""
    if node.rows or node.width is not None:
        return f"tl.broadcast_to({name}, [{rows}, {cols}])"
    return f"(tl.zeros([{rows}, {cols}], tl.float32) + {name})"  # a Python or Triton scalar


_FP32_TINY = 2.0**-126  # fp32's smallest normal


def _const(x):
    """A constant as fp32 code, as the reference executor takes it: rounded to fp32 (beyond its
    range, an infinity). Triton types a Python float as fp32 only if it is 0, inf, nan or an fp32
    normal; any other (1e300, 1e-40) would be fp64 and carry its expression into fp64, so an fp32
    subnormal is written as an fp32 tensor."""
    x = torch.tensor(x, dtype=torch.float32).item()
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    if x != 0 and abs(x) < _FP32_TINY:
        return f"tl.full([1, 1], {x!r}, tl.float32)"
    return repr(x)


def _epilogue(program: Program, w: _Writer, path: str):
    """Emit the program's nodes and outputs into ``w``; tiles go through TMA on the 'tma' path."""
    names = {}
    width_cols = {FULL: ("cols", "col_ok", "off_n", "BN", "N"), HALF: ("hcols", "hcol_ok", "off_n // 2", "BN // 2", "N // 2")}

    def tile(node):
        """The node's value as a tensor of its own shape class."""
        return _broadcast(names[id(node)], node, *_shape(node))

    for node in program.nodes():
        op, a = node.op, [names[id(x)] for x in node.args]
        rows, cols = _shape(node)
        if op == "acc":
            names[id(node)] = "acc"
            continue
        if op == "const":
            names[id(node)] = _const(node.attrs[0])
            continue
        if op == "load_scalar":
            # A [1, 1] fp32 tensor, not the argument itself: Triton's interpreter passes a Python
            # float (fp64 arithmetic, no .to()), and splats a 0-d comparison result as fp32, which
            # & and | then refuse.
            expr = f"tl.full([1, 1], {node.attrs[0]}_val, tl.float32)"
        elif op == "load_row":
            n = node.attrs[0]
            expr = f"tl.load({n}_ptr + rows64 * {n}_stride, mask=row_ok, other=0.0).to(tl.float32)[:, None]"
        elif op == "load_col":
            n = node.attrs[0]
            c, ok = width_cols[node.width][:2]
            expr = f"tl.load({n}_ptr + {c}.to(tl.int64) * {n}_stride, mask={ok}, other=0.0).to(tl.float32)[None, :]"
        elif op == "load_aux" and path == "tma":
            expr = f"{node.attrs[0]}_desc.load([off_m, {width_cols[node.width][2]}]).to(tl.float32)"
        elif op == "load_aux":
            n = node.attrs[0]
            c, ok = width_cols[node.width][:2]
            expr = (
                f"tl.load({n}_ptr + rows64[:, None] * {n}_s0 + {c}.to(tl.int64)[None, :] * {n}_s1, "
                f"mask=row_ok[:, None] & {ok}[None, :], other=0.0).to(tl.float32)"
            )
        elif op == "load_table" and path == "tma":
            # the row's [BM, P] block once, repeated along the tile: the launcher gives the TMA path
            # only tiles whose width is a multiple of P (a power of two), starting at a multiple of it.
            # Read through shared memory, the table takes the accumulator's register layout: no
            # layout conversion of the tile (a pointer load's layout costs one, 64 KiB at 128 x 256).
            n, w_ = node.attrs[0], width_cols[node.width][3]
            period = program.operands[n].period
            expr = (
                f"tl.reshape(tl.broadcast_to(tl.reshape({n}_desc.load([off_m, 0]).to(tl.float32), [BM, 1, {period}]), "
                f"[BM, ({w_}) // {period}, {period}]), [BM, {w_}])"
            )
        elif op == "load_table":
            n = node.attrs[0]
            c, ok = width_cols[node.width][:2]
            period = program.operands[n].period
            expr = (
                f"tl.load({n}_ptr + rows64[:, None] * {n}_s0 + ({c} % {period}).to(tl.int64)[None, :] * {n}_s1, "
                f"mask=row_ok[:, None] & {ok}[None, :], other=0.0).to(tl.float32)"
            )
        elif op == "row_index":
            expr = "rows.to(tl.float32)[:, None]"
        elif op == "col_index":
            expr = f"{width_cols[node.attrs[0]][0]}.to(tl.float32)[None, :]"
        elif op in _UNARY:
            expr = _UNARY[op].format(*a)
        elif op in _BINARY:
            expr = _BINARY[op].format(*a)
        elif op == "where":
            expr = f"tl.where({a[0]}, {a[1]}, {a[2]})"
        elif op == "fma":
            expr = "tl.fma(" + ", ".join(_broadcast(names[id(x)], x, rows, cols) for x in node.args) + ")"
        elif op == "round_to":
            expr = f"cast({a[0]}, {_TL_DTYPE[node.attrs[0]]}, EMULATE_RNE).to(tl.float32)"
        elif op == "pairs":
            seg = node.attrs[0]
            src = tile(node.args[0])
            if seg == 2:
                w.emit(f"first, second = tl.split(tl.reshape({src}, [{rows}, BN // 2, 2]))")
            else:
                w.emit(
                    f"first, second = tl.split(tl.permute(tl.reshape({src}, [{rows}, BN // {seg}, 2, {seg // 2}]), (0, 1, 3, 2)))"
                )
            first = w.fresh(f"tl.reshape(first, [{rows}, BN // 2])")
            second = w.fresh(f"tl.reshape(second, [{rows}, BN // 2])")
            names[id(node)] = (first, second)
            continue
        elif op == "pair_item":
            names[id(node)] = names[id(node.args[0])][node.attrs[0]]
            continue
        elif op == "join":
            seg = node.attrs[0]
            f_, s_ = (_broadcast(names[id(x)], x, rows, "BN // 2") for x in node.args)
            if seg == 2:
                expr = f"tl.reshape(tl.join({f_}, {s_}), [{rows}, BN])"
            else:
                expr = (
                    f"tl.reshape(tl.permute(tl.join(tl.reshape({f_}, [{rows}, BN // {seg}, {seg // 2}]), "
                    f"tl.reshape({s_}, [{rows}, BN // {seg}, {seg // 2}])), (0, 1, 3, 2)), [{rows}, BN])"
                )
        elif op in ("segment_sum", "segment_max"):
            seg = node.attrs[0]
            red = "tl.sum({0}, axis=2, keep_dims=True)" if op == "segment_sum" else \
                "tl.reduce({0}, 2, max_keeping_nan, keep_dims=True)"
            segments = f"tl.reshape({tile(node.args[0])}, [{rows}, {cols} // {seg}, {seg}])"
            expr = f"tl.reshape(tl.broadcast_to({red.format(segments)}, [{rows}, {cols} // {seg}, {seg}]), [{rows}, {cols}])"
        else:  # pragma: no cover - the IR has no other ops
            raise AssertionError(op)
        names[id(node)] = w.fresh(expr)

    for out in sorted(program.outputs.values(), key=lambda o: o.name):
        c, ok, off, bw, nw = width_cols[out.width]
        n = out.name
        v = _broadcast(names[id(out.value)], out.value, "BM", bw)
        if out.kind == "store" and out.per_b_part:
            _store_per_part(w, n, v, path)
        elif out.kind == "store" and path == "tma":
            if out.accumulate:
                v = f"{n}_desc.load([off_m, {off}]).to(tl.float32) + {v}"
            w.emit(f"{n}_desc.store([off_m, {off}], cast({v}, {n}_desc.dtype, EMULATE_RNE))")
        elif out.kind == "store":
            w.emit(f"{n}_ptrs = {n}_ptr + rows64[:, None] * {n}_s0 + {c}.to(tl.int64)[None, :] * {n}_s1")
            w.emit(f"{n}_mask = row_ok[:, None] & {ok}[None, :]")
            dt = "{0}_ptr.dtype.element_ty".format(n)
            if out.accumulate:
                v = f"tl.load({n}_ptrs, mask={n}_mask, other=0.0).to(tl.float32) + {v}"
            w.emit(f"tl.store({n}_ptrs, cast({v}, {dt}, EMULATE_RNE), mask={n}_mask)")
        elif out.kind == "col_sum":
            w.emit(
                f"tl.store({n}_part + pid_m * {n}_pstride + {c}, "
                f"tl.sum(tl.where(row_ok[:, None], {v}, 0.0), axis=0), mask={ok})"
            )
        elif out.segment:
            seg = out.segment
            x = w.fresh(f"tl.reshape({v}, [BM, {bw} // {seg}, {seg}])")
            if out.kind == "row_sum":
                r = w.fresh(f"tl.sum({x}, axis=2)")
            elif out.kind == "row_max":
                r = w.fresh(f"tl.reduce({x}, 2, max_keeping_nan)")
            else:
                mx = w.fresh(f"tl.max({x}, axis=2)")
                mx_safe = w.fresh(_FINITE_OR_ZERO.format(mx))
                r = w.fresh(f"{mx_safe} + tl.log(tl.sum(tl.exp({x} - {mx_safe}[:, :, None]), axis=2))")
            sc = w.fresh(f"({off}) // {seg} + tl.arange(0, {bw} // {seg})")
            w.emit(
                f"tl.store({n}_ptr + rows64[:, None] * {n}_s0 + {sc}.to(tl.int64)[None, :] * {n}_s1, {r}, "
                f"mask=row_ok[:, None] & ({sc} < ({nw}) // {seg})[None, :])"
            )
        else:
            if out.kind == "row_logsumexp":
                masked = w.fresh(f"tl.where({ok}[None, :], {v}, float('-inf'))")
                mx = w.fresh(f"tl.max({masked}, axis=1)")
                mx_safe = w.fresh(_FINITE_OR_ZERO.format(mx))
                se = w.fresh(f"tl.sum(tl.exp({masked} - {mx_safe}[:, None]), axis=1)")
                w.emit(f"tl.store({n}_pmax + rows64 * {n}_pstride + pid_n, {mx}, mask=slice_ok)")
                w.emit(f"tl.store({n}_psum + rows64 * {n}_pstride + pid_n, {se}, mask=slice_ok)")
            else:
                fill, red = ("0.0", "tl.sum({0}, axis=1)") if out.kind == "row_sum" else \
                    ("float('-inf')", "tl.reduce({0}, 1, max_keeping_nan)")
                w.emit(
                    f"tl.store({n}_part + rows64 * {n}_pstride + pid_n, "
                    f"{red.format(f'tl.where({ok}[None, :], {v}, {fill})')}, mask=slice_ok)"
                )


def _store_per_part(w, n, v, path):
    """Store ``v`` into the tensor of the B part that holds its columns: on the 'tma' path a tile
    (slice) lies in one part (the launcher picks BN so), on the 'ptr' path each column picks its own."""
    if path == "tma":
        w.emit(f"{n}_tile = cast({v}, {n}_desc0.dtype, EMULATE_RNE)")
        for i in range(MAX_B_PARTS):
            w.emit(f"if NUM_B > {i}:")
            w.emit(f"    if (off_n >= b_starts[{i}]) & (off_n < b_ends[{i}]):")
            w.emit(f"        {n}_desc{i}.store([off_m, off_n - b_starts[{i}]], {n}_tile)")
        return

    def ptrs(i):
        column = f"(cols - b_starts[{i}]).to(tl.int64)[None, :]"
        return f"{n}_ptr{i} + rows64[:, None] * {n}_s0[{i}] + {column} * {n}_s1[{i}]"

    w.emit(f"{n}_ptrs = {ptrs(0)}")
    for i in range(1, MAX_B_PARTS):
        w.emit(f"if NUM_B > {i}:")
        w.emit(f"    {n}_ptrs = tl.where((cols >= b_starts[{i}])[None, :], {ptrs(i)}, {n}_ptrs)")
    w.emit(f"{n}_mask = row_ok[:, None] & col_ok[None, :]")
    w.emit(f"tl.store({n}_ptrs, cast({v}, {n}_ptr0.dtype.element_ty, EMULATE_RNE), mask={n}_mask)")


_SOURCE = '''"""Generated by codetta from epilogue program {prog!r}: do not edit."""
import triton
import triton.language as tl

from codetta.matmul.mainloop import cast, column_halves, max_keeping_nan, mma_pointers, mma_tma, tanh, tile_coords


@triton.jit
def epilogue(
    acc, pid_m, pid_n, off_m, off_n, M, N, b_starts, b_ends,
{args}
    NUM_B: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """The program on one [BM, BN] tile at (off_m, off_n); pid_n counts tiles of this width;
    B's NUM_B parts along N hold columns [b_starts[i], b_ends[i])."""
    rows = off_m + tl.arange(0, BM)
    rows64 = rows.to(tl.int64)
    row_ok = rows < M
    cols = off_n + tl.arange(0, BN)
    col_ok = cols < N
    hcols = off_n // 2 + tl.arange(0, BN // 2)
    hcol_ok = hcols < N // 2
    # Row partials are one per (row, column slice): a slice past N (the empty second half of
    # the last tile under EPI_SPLIT > 1) has none, and must not write into the next row's.
    slice_ok = row_ok & (tl.zeros_like(rows) + off_n < N)
{body}


@triton.jit
def {kname}(
    a, stride_a0, stride_a1, b0, b1, b2, b3, stride_b0, stride_b1, b_starts, b_ends, M, N, K,
{args}
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr, EPI_SPLIT: tl.constexpr, FLATTEN: tl.constexpr, NUM_B: tl.constexpr, B_PARTS: tl.constexpr,
    A_KM: tl.constexpr, B_KN: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
):
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile, M, N, BM, BN, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
{mainloop}
        # The program runs on EPI_SPLIT column slices of the tile, one after the other: each
        # needs 1 / EPI_SPLIT of the registers for its temporaries and of the staging memory.
        if EPI_SPLIT == 1:
            epilogue(acc, pid_m, pid_n, off_m, off_n, M, N, b_starts, b_ends, {call_args} NUM_B, BM, BN, INTERPRET)
        else:
            left, right = column_halves(acc, BM, BN)
            if EPI_SPLIT == 2:
                epilogue(left, pid_m, 2 * pid_n, off_m, off_n, M, N, b_starts, b_ends, {call_args}
                         NUM_B, BM, BN // 2, INTERPRET)
                epilogue(right, pid_m, 2 * pid_n + 1, off_m, off_n + BN // 2, M, N, b_starts, b_ends, {call_args}
                         NUM_B, BM, BN // 2, INTERPRET)
            else:
                q0, q1 = column_halves(left, BM, BN // 2)
                epilogue(q0, pid_m, 4 * pid_n, off_m, off_n, M, N, b_starts, b_ends, {call_args}
                         NUM_B, BM, BN // 4, INTERPRET)
                epilogue(q1, pid_m, 4 * pid_n + 1, off_m, off_n + BN // 4, M, N, b_starts, b_ends, {call_args}
                         NUM_B, BM, BN // 4, INTERPRET)
                q2, q3 = column_halves(right, BM, BN // 2)
                epilogue(q2, pid_m, 4 * pid_n + 2, off_m, off_n + BN // 2, M, N, b_starts, b_ends, {call_args}
                         NUM_B, BM, BN // 4, INTERPRET)
                epilogue(q3, pid_m, 4 * pid_n + 3, off_m, off_n + 3 * BN // 4, M, N, b_starts, b_ends, {call_args}
                         NUM_B, BM, BN // 4, INTERPRET)
'''

_MAINLOOP = {
    "tma": "        acc = mma_tma(a, (b0, b1, b2, b3), b_starts, b_ends, off_m, off_n, K,\n"
    "                      BM, BN, BK, NUM_B, B_PARTS, A_KM, B_KN, INTERPRET, PRECISION, STAGES)",
    "ptr": "        acc = mma_pointers(a, stride_a0, stride_a1, (b0, b1, b2, b3), stride_b0, stride_b1, b_starts, b_ends,\n"
    "                           off_m, off_n, M, N, K, BM, BN, BK, NUM_B, B_PARTS, INTERPRET, PRECISION, STAGES)",
}


def kernel_source(program: Program, path: str) -> str:
    """The Triton source of ``program`` fused into the GEMM kernel; path is 'tma' or 'ptr'."""
    if not isinstance(program, Program):
        raise EpilogueError(f"kernel_source takes a codetta.epilogue.Program, got {type(program).__name__}")
    if path not in _MAINLOOP:
        raise EpilogueError(f"path must be one of {sorted(_MAINLOOP)}, got {path!r}")
    program.check()
    w = _Writer()
    _epilogue(program, w, path)
    names = [name for name, _ in kernel_args(program, path)]
    return _SOURCE.format(
        prog=program.name,
        kname=kernel_name(program, path),
        args="".join(f"    {name},\n" for name in names),
        call_args="".join(f"{name}, " for name in names),
        body="\n".join(w.lines),
        mainloop=_MAINLOOP[path],
    )


_LOADED = {}


_FALLBACK_DIR = []  # this process's own folder, where the cache folder cannot be written


def _cache_dir() -> Path:
    path = cache_root() / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _source_file(name: str, source: str) -> Path:
    """The file holding ``source``, written where missing or different (also where it is not
    text: a damaged file): in the cache folder or, where that cannot be written (read-only, not
    a folder), in a temporary folder of this process, with a warning."""
    try:
        file = _cache_dir() / f"{name}.py"
        if not file.exists() or file.read_bytes() != source.encode():
            write_atomically(file, source)
        return file
    except OSError as exc:
        if not _FALLBACK_DIR:
            _FALLBACK_DIR.append(Path(tempfile.mkdtemp(prefix="codetta-kernels-")))
            atexit.register(shutil.rmtree, _FALLBACK_DIR[0], ignore_errors=True)
            warnings.warn(f"codetta: cannot use the kernel cache ({exc}); this process writes its kernels to "
                          f"{_FALLBACK_DIR[0]}. Set CODETTA_CACHE_DIR to a writable folder.", stacklevel=4)
        file = _FALLBACK_DIR[0] / f"{name}.py"
        write_atomically(file, source)
        return file


def load_kernel(program: Program, path: str):
    """The compiled-on-demand Triton kernel of ``program`` (cached per process and on disk)."""
    name = kernel_name(program, path)
    interp = interpreting()
    key = (name, interp)
    if key not in _LOADED:
        file = _source_file(name, kernel_source(program, path))
        modname = f"codetta_generated.{name}{'_interp' if interp else ''}"
        spec = importlib.util.spec_from_file_location(modname, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        spec.loader.exec_module(module)
        _LOADED[key] = getattr(module, name)
    return _LOADED[key]

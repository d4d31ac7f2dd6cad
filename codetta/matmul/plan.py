"""How every call with one signature is launched (:class:`Plan`): the kernel's argument list,
the grid, the outputs and partial buffers to allocate, the reductions to finish. Made once per
signature by ``launch``, then replayed with each call's tensors."""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..epilogue.codegen import kernel_args, load_kernel
from ..epilogue.ir import FULL
from ..interpreter import INTERPRETER_LOCK, interpreting
from ..kernels import finish as finishing
from .call import MAX_B_PARTS, GemmError, rows_view, scalar_operand
from .config import SharedMemory
from .path import b_arrangement, one_k_loop, operand_layout


def device_index(device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_programs(device, tiles, ctas_per_sm=1):
    """The persistent grid: one program per SM (``ctas_per_sm`` per SM), no more than there are tiles."""
    if interpreting():
        return min(tiles, 3)
    return min(tiles, ctas_per_sm * _sm_count(device_index(device)))


@functools.lru_cache(maxsize=None)
def _sm_count(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def shared_memory(index) -> SharedMemory:
    """The device's shared memory (Hopper's where PyTorch does not report it)."""
    props = torch.cuda.get_device_properties(index)
    per_block = getattr(props, "shared_memory_per_block_optin", getattr(props, "shared_memory_per_block", None))
    per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    if not per_block or not per_sm:
        return SharedMemory()
    return SharedMemory(per_sm=per_sm, per_block=per_block)


class Plan:
    """How every call with one signature (see ``launch._plan``) is launched.

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
        self.descriptor = TensorDescriptor  # checked, until the first launch has compiled
        self.b_parts = b_arrangement(c, path)
        tiles = triton.cdiv(c.M, cfg.BM) * triton.cdiv(c.N, cfg.BN)
        self.grid = (num_programs(c.device, tiles, cfg.CTAS_PER_SM), 1, 1)
        self.options = cfg.launch_options()
        self.interpret = interpreting()
        # per operand: how the value passed becomes the kernel's view (see Call._check_operands)
        accum = [o.name for o in p.outputs.values() if o.kind == "store" and o.accumulate]
        prepare = {name: _preparation(value, c.given[name], name in accum, c.describe_operand(name))
                   for name, value in c.operands.items()}
        self.prepare = [(name, prep) for name, prep in prepare.items() if prep is not None]  # the others as given
        self.accumulate = accum
        written = [o for o in p.outputs.values()
                   if (o.kind == "store" and not o.accumulate and not o.per_b_part) or o.segment]
        self.user_written = [(o.name, (c.M, c.output_shape(o)[-1])) for o in written if o.name in c.user_out]
        # (name, shape, dtype, the [M, cols] view the kernel writes, None when it is the shape itself)
        self.allocated = [(o.name, shape, c.output_dtype(o), None if shape == (c.M, shape[-1]) else (c.M, shape[-1]))
                          for o in written if o.name not in c.user_out for shape in [c.output_shape(o)]]
        # stores per part of B: (name, the parts' shapes, dtype), each part written as [M, N_i]
        self.allocated_parts = [(o.name, c.part_shapes(), c.output_dtype(o)) for o in p.outputs.values()
                                if o.per_b_part]
        self.partials = _partial_shapes(c, cfg)
        # (name, finishing step, the output's shape)
        self.finished = [(o.name, _FINISH[o.kind], c.output_shape(o)) for o in p.outputs.values()
                         if not (o.kind == "store" or o.segment)]
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
            a_t = operand_layout(c.a)[0]
            fills["a"] = lambda a, b, o, w, q: self.tma_descriptor(a.t() if a_t else a, a_block)
            if self.b_parts.startswith("interleave_one"):  # one descriptor of both parts' W [N/2, K]
                low, high = (1, 0) if self.b_parts == "interleave_one_swapped" else (0, 1)
                fills["b0"] = lambda a, b, o, w, q: self._pairs_descriptor(b[low].t(), b[high].t(), [bn, 2, cfg.BK])
                values["b1"] = None
            else:
                for i, part in enumerate(c.parts):
                    b_t = operand_layout(part)[0]  # the row-major store TMA reads
                    fills[f"b{i}"] = lambda a, b, o, w, q, i=i, b_t=b_t: self.tma_descriptor(
                        b[i].t() if b_t else b[i], b_block)
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
                fills[name] = lambda a, b, o, w, q, base=base, block=block: self.tma_descriptor(o[base], block)
            elif kind in ("aux_desc", "out_desc"):
                width = (c.program.outputs.get(base) if kind == "out_desc" else c.program.operands[base]).width
                block = [cfg.BM, cfg.epilogue_bn if width is FULL else cfg.epilogue_bn // 2]
                if kind == "out_desc":
                    fills[name] = lambda a, b, o, w, q, base=base, block=block: self.tma_descriptor(w[base][1], block)
                else:
                    fills[name] = lambda a, b, o, w, q, base=base, block=block: self.tma_descriptor(o[base], block)
            elif kind in ("part_desc", "part"):  # a store per part of B: this part's descriptor or pointer
                i = int(suffix[len("desc" if kind == "part_desc" else "ptr"):])
                if i >= len(c.parts):
                    values[name] = None
                elif kind == "part":
                    fills[name] = lambda a, b, o, w, q, base=base, i=i: w[base][1][i]
                else:
                    block = [cfg.BM, cfg.epilogue_bn]
                    fills[name] = lambda a, b, o, w, q, base=base, i=i, block=block: self.tma_descriptor(
                        w[base][1][i], block)
            elif kind == "partial":
                fills[name] = lambda a, b, o, w, q, base=base, i=int(suffix == "psum"): q[base][i]
            elif suffix == "pstride":
                values[name] = partial_strides[base]
            elif suffix == "stride":
                values[name] = c.operands[base].stride(0)
            else:  # s0 / s1 of a tile: an operand's view or an output's [M, cols] view (contiguous unless given)
                values[name] = self._tile_stride(c, base, 0 if suffix == "s0" else 1)
        values.update(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GROUP_M=cfg.GROUP_M, STAGES=cfg.STAGES, EPI_SPLIT=cfg.EPI_SPLIT,
                      FLATTEN=cfg.FLATTEN and tma and one_k_loop(self.b_parts, len(c.parts)), NUM_B=len(c.parts),
                      B_PARTS=self.b_parts, A_KM=self.a_km, B_KN=bool(self.b_kn), INTERPRET=interpreting(),
                      PRECISION="ieee" if (interpreting() or c.a.dtype == torch.float32) else "tf32")
        names = self.kernel.arg_names
        template = [values.get(n) for n in names]
        return template, [(names.index(n), f) for n, f in fills.items()]

    def tma_descriptor(self, t, block):
        """A TMA descriptor of the 2-d tensor ``t`` read in ``block`` tiles."""
        return self.descriptor(t, t.shape, t.stride(), block)

    def _pairs_descriptor(self, low, high, block):
        """One TMA descriptor [R, 2, K] of two row-major [R, K] tensors with one row stride,
        ``high`` above ``low`` in memory: element [r, p, k] is row r of ``low`` (p = 0) or of
        ``high`` (p = 1); its stride along p is their distance, a multiple of 16 bytes as both
        lie on 16-byte boundaries (TMA strides are positive and at most 2^40 bytes)."""
        distance = (high.data_ptr() - low.data_ptr()) // low.element_size()
        return self.descriptor(low, [low.shape[0], 2, low.shape[1]], [low.stride(0), distance, 1], block)

    def _tile_stride(self, c, base, dim):
        out = c.program.outputs.get(base)
        if out is not None and out.per_b_part:  # contiguous [M, N_i] parts; 0 past the call's parts
            widths = [shape[-1] for shape in c.part_shapes()]
            return tuple((widths[i], 1)[dim] if i < len(widths) else 0 for i in range(MAX_B_PARTS))
        if base in c.operands:
            return c.operands[base].stride(dim)
        user = c.user_out.get(base)
        if user is not None:
            return rows_view(user, user.shape[-1], base).stride(dim)
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
        for name, shapes, dtype in self.allocated_parts:
            stored = tuple(torch.empty(shape, device=self.device, dtype=dtype) for shape in shapes)
            outs[name] = (stored, tuple(t.view(self.M, t.shape[-1]) for t in stored))
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
            self.descriptor = _UncheckedDescriptor
        return outs, bufs

    def execute(self, a, b, operands, out, finish):
        """The results of one call: the tensors the kernel wrote, the reductions finished (by
        ``finish[name]`` where given)."""
        outs, bufs = self.launch(a, b, operands, out)
        results = {name: pair[0] for name, pair in outs.items()}
        for name, finish_fn, shape in self.finished:
            results[name] = finished(name, bufs[name], shape, finish.get(name, finish_fn), out.get(name))
        return results


def finished(name, partials, shape, finish_fn, out=None):
    """Reduction ``name`` finished from its fp32 partials by ``finish_fn`` (codetta's, or the
    caller's ``finish[name]``), written into ``out`` where one is given. A tensor it returns
    must have the output's ``shape`` (or hold it flattened) and is returned in that shape;
    anything else (several tensors: what follows the reduction, folded in) as it is."""
    val = finish_fn(*partials)
    if not isinstance(val, torch.Tensor):
        if out is not None:
            raise GemmError(f"finish[{name!r}] returned {type(val).__name__}, which cannot be written into out[{name!r}]")
        return val
    if tuple(val.shape) not in (shape, (math.prod(shape),)):
        raise GemmError(f"finish[{name!r}] must return a tensor of shape {shape} (or flattened), got a tensor of "
                        f"shape {tuple(val.shape)}")
    val = val.reshape(shape)
    return val if out is None else out.copy_(val)


def _preparation(view, given, in_place, what):
    """How an operand as passed becomes the view the kernel reads or, ``in_place``, writes
    (the plan checked that it is a view); a scalar becomes a float (checked: a plan is kept by
    its type, not its value); None: as it is."""
    if not isinstance(view, torch.Tensor):
        return functools.partial(scalar_operand, what=what)
    shape = tuple(view.shape)
    if tuple(given.shape) == shape:
        return None
    return (lambda v: v.view(shape)) if in_place else (lambda v: v.reshape(shape))


class _UncheckedDescriptor(TensorDescriptor):
    """A TMA descriptor whose checks (alignment, strides, block shape) are skipped: a plan's
    first launch made the same ones, with tensors of the same metadata, through the checked class."""

    def __post_init__(self):
        pass


def _partial_shapes(c, cfg):
    """[(name, number of buffers, shape)] of the fp32 partials of the program's non-segment reductions."""
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

"""``codetta.gemm``: check a call, pick a path and a config, allocate, launch, finish.

``gemm(a, b, epilogue=program, **operands)`` computes ``acc = a @ b`` like
``torch.matmul`` and runs ``program`` on each accumulator tile. The layout of each
operand is read from its strides, so the three GEMMs of training are written as in
PyTorch: ``gemm(x, w.t())`` (forward), ``gemm(dy, w)`` (dgrad), ``gemm(dy.t(), x)``
(wgrad). ``b`` may be several weights read as one without a copy: a list of [K, N_i]
(concatenated along N) or [K_i, N] (along K), or ``interleave(b0, b1)``.

The call is checked (``call``), its path chosen (``path``), a config tuned (``tuning``)
and a launch plan made (``plan``) on the first call with its signature; later calls with
the same signature reuse that plan.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings

import torch
import triton

from ..epilogue.ir import EpilogueError, Program
from ..interpreter import interpreting
from ..kernels.launch import on_device
from . import config as tile_configs, tuning
from .call import Call, GemmError, Interleaved
from .config import Config, candidates, interpreter_config, tiles_parts
from .memory import same_elements
from .path import (b_arrangement, blocks_tma_ok, layouts, one_k_loop, pair_order, table_block_n,
                   tiles_tma_ok)
from .plan import Plan, device_index, finished, shared_memory
from .writes import check_untracked, check_written_apart, count_writes, written_in_place


@functools.lru_cache(maxsize=None)
def _plain_program():
    p = Program("plain_gemm")
    p.store("out", p.acc)
    return p


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
            to fold what follows the sum into the same small kernel: a tensor of the output's
            shape (checked), or anything else (several tensors), returned as it is.
        **operands: the program's operands by name (and, for accumulating stores, the
            tensor to add into).

    Returns:
        The output tensor for a plain GEMM, else a dict name -> tensor: stores as
        [..., M, width] in their dtype (an accumulating store: the tensor added into, as it was
        given; a store per part of B, ``per_b_part=True``: a tuple of [..., M, N_i], one per
        part); row reductions fp32 [..., M] (per segment [..., M, width / segment]); column
        reductions fp32 [width].
    """
    program = epilogue if epilogue is not None else _plain_program()
    out = _outputs_given(out, epilogue)
    finish = _finishers(finish, program)
    given_b, b = b, _without_empty_parts(b)
    _warn_if_differentiable(a, b, operands)
    written = _checked_writes(program, a, b, operands, out)
    with on_device(a):  # tuning and launches on a's GPU, whichever is current
        plan = _plan(a, b, program, operands, out, config)
        if plan is None:
            results = _trivial(Call(a, b, program, operands, out), finish)
        else:
            results = plan.execute(a, b, operands, out, finish)
    count_writes(written)
    return results["out"] if epilogue is None else _with_empty_parts(results, program, given_b, b)


def _checked_writes(program, a, b, operands, out):
    """What a call writes in place (out=, accumulated operands), checked before any launch (the
    tuner's timed launches write there too): see :func:`check_untracked`, :func:`check_written_apart`."""
    written = written_in_place(program, operands, out)
    check_untracked(written)
    check_written_apart(program, a, b, operands, written)
    return written


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


def _with_empty_parts(results, program, given_b, b):
    """The results with an empty tensor, in its place, for each part of B that
    :func:`_without_empty_parts` left out, in the stores per part of B."""
    if b is given_b:
        return results
    for o in program.outputs.values():
        if o.per_b_part:
            kept, first = iter(results[o.name]), results[o.name][0]
            results[o.name] = tuple(next(kept) if t.numel() else first.new_empty(*first.shape[:-1], 0)
                                    for t in given_b)
    return results


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
            results[o.name] = finished(o.name, parts, call.output_shape(o), finish[o.name], call.user_out.get(o.name))
            continue
        shape, dtype = call.output_shape(o), call.output_dtype(o)
        if o.kind == "store" and o.accumulate:
            results[o.name] = call.given[o.name]
            continue
        if o.per_b_part:
            results[o.name] = tuple(torch.empty(s, device=call.device, dtype=dtype) for s in call.part_shapes())
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
                  call.a.dtype, call.N, call.K, m_bucket, call.part_sizes, b_arrangement(call, path))
    )


def _meta(v):
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or v.is_nested or v.is_neg():  # no strides, or negated: the checks refuse it
            return v.layout, v.is_nested, v.is_neg()
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
        pair_order(b) if isinstance(b, Interleaved) else None,
        tuple((k, _meta(v)) for k, v in operands.items()), tuple((k, _meta(v)) for k, v in out.items()),
        config, interpreting(), os.environ.get("CODETTA_PATH"), os.environ.get("CODETTA_AUTOTUNE"),
    )
    plan = _PLANS.get(sig)
    if plan is None:
        call = Call(a, b, program, operands, out)
        if call.M == 0 or call.N == 0:
            return None
        plan = Plan(call, *_choose(call, config))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[sig] = plan
    return plan


def _choose(call, config):
    """(path, config): TMA when every operand allows it; the config given, or tuned."""
    tuning.autotune_enabled()  # a bad CODETTA_AUTOTUNE is refused wherever a plan is made, tuned or not
    call.layout = layouts(call)
    min_bn = call.program.min_block_n()
    tma_min_bn = max(min_bn, table_block_n(call.program))
    parts = tuple(call.part_sizes)
    tma = call.layout[2] and tiles_tma_ok(call)
    if config is not None:
        if config.epilogue_bn < min_bn:
            raise EpilogueError(
                f"config {config} gives the epilogue tiles {config.epilogue_bn} wide; program "
                f"{call.program.name!r} needs {min_bn}"
            )
        tma = tma and tiles_parts(config.BN, parts) and config.epilogue_bn >= tma_min_bn and blocks_tma_ok(call, config)
        return ("tma" if tma else "ptr"), config
    if interpreting():
        size = dict(m=call.M, n=call.N, k=call.K)
        cfg = interpreter_config(min_bn=tma_min_bn, n_parts_sizes=parts, **size) if tma else None
        if cfg is not None and blocks_tma_ok(call, cfg):
            return "tma", cfg
        return "ptr", interpreter_config(min_bn=min_bn, **size)
    size = dict(elem_bytes=call.a.element_size(), m=call.M, n=call.N,
                smem=shared_memory(device_index(call.device)), **_epilogue_smem(call))
    flatten = one_k_loop(b_arrangement(call, "tma"), len(call.parts))
    configs = candidates(n_parts_sizes=parts, flatten=flatten, min_bn=tma_min_bn, **size) if tma else []
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
            plans[cfg] = Plan(call, path, cfg)
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


def explain(a, b, epilogue: Program | None = None, *, out=None, config=None, finish=None, **operands):
    """The path ('tma' or 'ptr'), config and reading of B (``b_parts``: the mainloop's arrangement,
    see :mod:`codetta.matmul.mainloop`) ``gemm`` would launch with these arguments (tunes if needed;
    ``finish`` runs after the kernel and changes none of them). Tuning launches the kernel into
    ``out=`` and the accumulated operands, as ``gemm`` would: the same checks refuse what it may not
    write, and what it may write counts as written (its version)."""
    program = epilogue if epilogue is not None else _plain_program()
    _finishers(finish, program)
    out = _outputs_given(out, epilogue)
    b = _without_empty_parts(b)
    written = _checked_writes(program, a, b, operands, out)
    with on_device(a):
        plan = _plan(a, b, program, operands, out, config)
    count_writes(written)
    if plan is None:
        return {"path": None, "config": None, "b_parts": None}
    return {"path": plan.path, "config": plan.cfg, "b_parts": plan.b_parts}

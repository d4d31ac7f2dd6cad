"""The reference executor: a program's semantics in plain PyTorch over whole tensors.

It runs anywhere PyTorch runs and is the definition the Triton code generator is
checked against. Arithmetic happens in ``compute_dtype`` (fp32 like the kernels, or
fp64 for tests); outputs come back as the kernels return them (stores in their
dtype, reductions in fp32).
"""

from __future__ import annotations

import math

import torch

from .ir import FULL, EpilogueError, Program

_UNARY = {
    "neg": torch.neg,
    "abs": torch.abs,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "square": torch.square,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "silu": torch.nn.functional.silu,
    "relu": torch.relu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    # the formula, as the kernel computes it: PyTorch's vectorized CPU F.gelu in fp32 gives NaN at +inf
    # and errs by ~1e-4 (relative) in the negative tail
    "gelu_erf": lambda x: 0.5 * x * (1 + torch.erf(x * 0.7071067811865476)),
    "sin": torch.sin,
    "cos": torch.cos,
    "floor": torch.floor,
    "not": torch.logical_not,
}

def eager_unary(name: str):
    """The PyTorch function this executor computes the epilogue's unary function ``name`` with."""
    return _UNARY[name]


_BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "eq": torch.eq,
    "ne": torch.ne,
    "and": torch.logical_and,
    "or": torch.logical_or,
}


def _split_pairs(x, segment):
    """[R, W] -> two [R, W/2]: column j of each segment with column j + segment/2."""
    r, w = x.shape
    v = x.reshape(r, w // segment, 2, segment // 2)
    return v[:, :, 0, :].reshape(r, w // 2), v[:, :, 1, :].reshape(r, w // 2)


def _join_pairs(first, second, segment):
    r, w2 = first.shape
    v = torch.stack(
        [first.reshape(r, w2 * 2 // segment, segment // 2), second.reshape(r, w2 * 2 // segment, segment // 2)],
        dim=2,
    )
    return v.reshape(r, 2 * w2)


def _segment_reduce(x, segment, fn):
    r, w = x.shape
    v = x.reshape(r, w // segment, segment)
    return fn(v).expand(r, w // segment, segment).reshape(r, w)


def _b_matrix(b, k, cd):
    """B as one [K, N] matrix in ``cd``, read as codetta.gemm reads it: a tensor; a list of [K, N_i]
    concatenated along N or of [K_i, N] along K; ``interleave(b0, b1)``, columns alternating."""
    from ..matmul.call import Interleaved

    parts = [t.to(cd) for t in (b if isinstance(b, (list, tuple)) else [b])]
    if isinstance(b, Interleaved):
        return torch.stack(parts, dim=2).reshape(k, 2 * parts[0].shape[1])  # not -1: K may be 0
    if all(t.shape[0] == k for t in parts):
        return torch.cat(parts, dim=1)
    return torch.cat(parts, dim=0)  # [K_i, N] along K (the call's checks refused anything else)


def _fma(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """x * y + z rounded once to the inputs' dtype, as ``tl.fma``. For fp32 inputs the product is
    exact in fp64 and the sum is rounded to odd there (where the fp64 sum s is inexact and its
    last bit even, the neighbour of s on the exact value's side), so that its rounding to fp32
    is the correctly rounded result (53 >= 2 * 24 + 2 bits); a plain fp64 sum rounded again to
    fp32 misses by one ulp where it lands on an fp32 tie."""
    if x.dtype == torch.float64:
        return torch.addcmul(z, x, y)
    p, c = x.double() * y.double(), z.double()
    s = p + c
    t = s - p
    error = (p - (s - t)) + (c - t)  # TwoSum: s + error == p + c exactly
    even = (s.view(torch.int64) & 1) == 0
    to_odd = torch.isfinite(s) & (error != 0) & even
    s = torch.where(to_odd, torch.nextafter(s, torch.where(error > 0, math.inf, -math.inf).double()), s)
    return s.to(x.dtype)


def run_reference(program: Program, a, b, operands, compute_dtype=torch.float32):
    """Evaluate ``program`` on acc = a @ b, with a, b and the operands as codetta.gemm reads them.

    a: [..., M, K] (leading dims flattened into M); b: [K, N], a list of [K, N_i]
    concatenated along N or of [K_i, N] along K, or ``interleave(b0, b1)``;
    operands: name -> tensor or number (and, for accumulating stores, the tensor to add into).
    Returns name -> output tensor, shaped as codetta.gemm returns it (a store per part of B: a
    tuple of tensors, one per part); an accumulating store's
    result is a new tensor in the operand's shape (prior + value: the operand is left as it was,
    where codetta.gemm adds into it in place and returns it).
    """
    from ..matmul.call import Call

    if not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise EpilogueError(f"run_reference: compute_dtype must be a floating point dtype (torch.float32 like "
                            f"the kernels, torch.float64), got {compute_dtype}")
    operands = dict(operands)
    call = Call(a, b, program, operands, {}, for_kernel=False)  # the checks codetta.gemm makes, on any device
    cd = compute_dtype
    lead = tuple(a.shape[:-1])
    acc = a.reshape(math.prod(lead), a.shape[-1]).to(cd) @ _b_matrix(b, a.shape[-1], cd)
    m, n = acc.shape

    def ncols(width):
        return n if width is FULL else n // 2

    values = {}
    for node in program.nodes():
        op, args = node.op, [values[id(x)] for x in node.args]
        if op == "acc":
            v = acc
        elif op == "const":
            v = torch.tensor(node.attrs[0], dtype=cd, device=acc.device)
        elif op == "load_row":
            v = operands[node.attrs[0]].to(cd).reshape(m, 1)
        elif op == "load_col":
            v = operands[node.attrs[0]].to(cd).reshape(1, ncols(node.width))
        elif op == "load_scalar":
            v = torch.tensor(float(operands[node.attrs[0]]), dtype=cd, device=acc.device)
        elif op == "load_aux":
            v = operands[node.attrs[0]].to(cd).reshape(m, ncols(node.width))
        elif op == "load_table":
            period = program.operands[node.attrs[0]].period
            table = operands[node.attrs[0]].to(cd).reshape(m, period)
            v = table[:, torch.arange(ncols(node.width), device=acc.device) % period]
        elif op == "row_index":
            v = torch.arange(m, dtype=cd, device=acc.device).reshape(m, 1)
        elif op == "col_index":
            v = torch.arange(ncols(node.width), dtype=cd, device=acc.device).reshape(1, -1)
        elif op in _UNARY:
            v = _UNARY[op](args[0])
        elif op in _BINARY:
            v = _BINARY[op](args[0], args[1])
        elif op == "where":
            v = torch.where(*args)
        elif op == "fma":
            v = _fma(*args)
        elif op == "round_to":
            v = args[0].to(node.attrs[0]).to(cd)
        elif op == "pairs":
            v = _split_pairs(_expand_cols(args[0], n), node.attrs[0])
        elif op == "pair_item":
            v = args[0][node.attrs[0]]
        elif op == "join":
            first, second = (_expand_cols(x, n // 2) for x in args)
            rows = max(first.shape[0], second.shape[0])
            v = _join_pairs(first.expand(rows, -1), second.expand(rows, -1), node.attrs[0])
        elif op == "segment_sum":
            v = _segment_reduce(_expand_cols(args[0], ncols(node.width)), node.attrs[0], lambda t: t.sum(-1, keepdim=True))
        elif op == "segment_max":
            v = _segment_reduce(
                _expand_cols(args[0], ncols(node.width)), node.attrs[0], lambda t: t.amax(-1, keepdim=True)
            )
        else:  # pragma: no cover - the IR has no other ops
            raise AssertionError(op)
        values[id(node)] = v

    results = {}
    for out in program.outputs.values():
        w = ncols(out.width)
        v = values[id(out.value)]
        tile = (v if v.dim() == 2 else v.reshape(1, 1)).expand(m, w)
        if out.kind == "store":
            dtype = out.dtype or a.dtype
            if out.accumulate:
                tile = operands[out.name].to(cd).reshape(m, w) + tile
            stored = tile.to(dtype)
            if out.per_b_part:  # one tensor per part of B along N
                results[out.name] = tuple(stored[:, start:end].reshape(*lead, end - start).clone()
                                          for start, end in zip(call.starts, call.ends))
            else:  # an accumulating store in the shape its operand was given in ([M, w] for [..., M, K] too)
                results[out.name] = stored.reshape(operands[out.name].shape if out.accumulate else (*lead, w))
        elif out.kind == "col_sum":
            results[out.name] = tile.sum(0).float()
        else:
            seg = out.segment or w
            t = tile.reshape(m, w // seg if seg else 1, seg)  # N = 0: one empty segment per row
            if out.kind == "row_sum":
                r = t.sum(-1)
            elif out.kind == "row_max":
                r = t.amax(-1) if seg else torch.full((m, 1), float("-inf"), dtype=cd, device=t.device)
            else:
                r = torch.logsumexp(t, -1)
            results[out.name] = (r.reshape(*lead, w // out.segment) if out.segment else r.reshape(lead)).float()
    return results


def _expand_cols(v, cols):
    """A value as a 2-d [rows or 1, cols] tensor (scalars and row vectors broadcast)."""
    if v.dim() == 0:
        v = v.reshape(1, 1)
    return v.expand(v.shape[0], cols)


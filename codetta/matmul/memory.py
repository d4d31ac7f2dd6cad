"""Whether two tensors share memory, from their addresses, shapes and strides.

A tile of a codetta GEMM reads a, b and the program's operands beyond its own output tile
and writes only its own tiles of the outputs: a written tensor that shares a byte with
anything read or written elsewhere would race (see ``writes.check_written_apart``). Tensors
whose byte spans lie apart (the usual case) are told apart from their addresses alone;
column blocks of one row-major buffer by arithmetic on their rows; other layouts whose
spans intersect element by element.
"""

from __future__ import annotations

import torch


def same_elements(x, y) -> bool:
    """Whether x and y are the same elements in the same layout (one written in place of the other)."""
    return (x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
            and x.element_size() == y.element_size())


def spans_meet(x, y) -> bool:
    """Whether two byte spans (from :func:`byte_span`; None: no bytes) intersect."""
    return x is not None and y is not None and x[0] < y[1] and y[0] < x[1]


def byte_span(t):
    """[first, last) byte address t's elements lie in, or None when it has none."""
    shape = t.shape
    if 0 in shape:
        return None
    start = t.data_ptr()
    return start, start + (sum((n - 1) * s for n, s in zip(shape, t.stride())) + 1) * t.element_size()


def merged_leading_dims(t) -> tuple:
    """(size, stride) of t's leading dims (all but the last), outermost first, with size-1 dims
    left out and neighbours that read as one dim merged: x [B, S, d] and ``x.reshape(B * S, d)``
    give the same, a transposed view of x does not."""
    merged = []
    for n, s in zip(t.shape[:-1], t.stride()[:-1]):
        if n == 1:
            continue
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    return tuple(merged)


def _as_rows(t):
    """(address, row pitch, row bytes, rows) of t read as rows of contiguous bytes, one after
    another at a constant pitch, or None."""
    shape = t.shape
    if shape and shape[-1] > 1 and t.stride(-1) != 1:
        return None
    lead = merged_leading_dims(t)
    if len(lead) > 1:
        return None
    rows, pitch = lead[0] if lead else (1, 0)
    size = t.element_size()
    return t.data_ptr(), pitch * size, (shape[-1] if shape else 1) * size, rows


def _rows_meet(x, y) -> bool | None:
    """Whether row sets x and y (from _as_rows) share a byte, when they have one pitch that
    both rows fit in (column blocks of one row-major buffer); None when this cannot tell."""
    (bx, px, wx, rx), (by, py, wy, ry) = x, y
    if rx == 1 and ry == 1:
        return True  # two runs of bytes whose spans (called only so) intersect
    pitch = px if rx > 1 else py
    if (rx > 1 and ry > 1 and px != py) or pitch <= 0 or wx > pitch or wy > pitch:
        return None
    q, p = divmod(by - bx, pitch)  # y's row j starts p bytes into x's row slot q + j
    slots = range(q, q + ry)  # x's rows in those slots meet y's rows from p on...
    if p < wx and slots.start <= rx - 1 and slots.stop - 1 >= 0:
        return True
    return p + wy > pitch and slots.start + 1 <= rx - 1 and slots.stop >= 0  # ...or wrap into the next slot


_EXACT_OVERLAP_ELEMENTS = 2**22  # above, for layouts _rows_meet cannot tell: intersecting spans count as shared


def _element_starts(t):
    """The byte address of every element of t, sorted (int64, on t's device)."""
    starts = torch.zeros((), dtype=torch.int64, device=t.device)
    for n, s in zip(t.shape, t.stride()):
        starts = starts[..., None] + torch.arange(n, device=t.device) * (s * t.element_size())
    return starts.reshape(-1).sort().values + t.data_ptr()


def share_elements(x, y) -> bool:
    """Whether tensors x and y have a byte of memory in common. Spans apart (the usual case) are
    told from addresses alone; column blocks of one buffer by arithmetic on their rows; other
    intersecting spans element by element or, for views too large for that, taken as shared."""
    if not spans_meet(byte_span(x), byte_span(y)):
        return False
    rows_x, rows_y = _as_rows(x), _as_rows(y)
    if rows_x is not None and rows_y is not None:
        meet = _rows_meet(rows_x, rows_y)
        if meet is not None:
            return meet
    if x.numel() + y.numel() > _EXACT_OVERLAP_ELEMENTS:
        return True
    xs, ys = _element_starts(x), _element_starts(y)
    # y's element at [b, b + ey) meets x's last element starting before b + ey, if that one ends after b
    i = torch.searchsorted(xs, ys + y.element_size()) - 1
    hit = (i >= 0) & (xs[i.clamp_min(0)] + x.element_size() > ys)
    return bool(hit.any())


def overlaps_itself(t) -> bool:
    """Whether elements of t may share memory: PyTorch's own check (a zero stride), or, where it
    cannot tell (an ``as_strided`` view), strides that do not nest: sorted by stride, each
    dim's stride must exceed the span of the dims below it."""
    verdict = torch._debug_has_internal_overlap(t)  # 0: no overlap, 1: overlap, 2: cannot tell
    if verdict != 2:
        return verdict == 1
    span = 0
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s > 1), key=lambda d: d[1]):
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False

"""Which path a call takes: TMA descriptors for A, B and every epilogue tile when all of them
allow one (unit last stride, 16-byte aligned base, strides and blocks; a Hopper GPU or the
interpreter), else pointers, for everything at once."""

from __future__ import annotations

import functools
import os

import torch

from ..epilogue.ir import FULL, HALF
from ..interpreter import interpreting
from .call import rows_view
from .config import WIDEST_BN


def tma_ok(t):
    """A 2-d tensor a TMA descriptor can read: unit last stride, 16-byte aligned base and strides."""
    es = t.element_size()
    return t.stride(1) == 1 and (t.stride(0) * es) % 16 == 0 and t.data_ptr() % 16 == 0 and t.stride(0) >= t.shape[1]


def operand_layout(t):
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


def layouts(call):
    """(A_KM, B_KN, whether the mainloop can read A and B through TMA descriptors)."""
    a_t, a_store = operand_layout(call.a)
    b_layouts = [operand_layout(t) for t in call.parts]
    b_t = {t for t, _ in b_layouts}
    tma = (
        a_t is not None
        and len(b_t) == 1
        and None not in b_t
        and call.K > 0
        and tma_ok(a_store)
        and all(tma_ok(store) for _, store in b_layouts)
        and _has_tma(call.device)
        and os.environ.get("CODETTA_PATH") != "ptr"
        # TMA reads A at each K part's first column: it must lie on a 16-byte boundary
        and not (call.b_parts == "k" and any(s * call.a.element_size() % 16 for s in call.starts))
    )
    # B^T row-major is nn.Linear's W [N, K]; B row-major [K, N] is "B_KN".
    return bool(a_t), (not b_t.pop()) if len(b_t) == 1 else False, tma


def b_arrangement(call, path):
    """How the mainloop reads B (its ``B_PARTS``, see :mod:`codetta.matmul.mainloop`): as the
    call gives the parts ("n", "k", "interleave") or, for ``interleave(b0, b1)`` on the TMA path
    with both parts stored [N/2, K] row-major with one row stride (nn.Linear weights, passed as
    W.t()), through one descriptor of both: "interleave_one" where b0 lies below b1 in memory,
    "interleave_one_swapped" where above. Two parts at one address, or so far apart that one
    descriptor would span 2^31 bytes or more (see :func:`pair_order`), keep two descriptors."""
    if call.b_parts != "interleave" or path != "tma" or call.layout[1]:
        return call.b_parts
    first, second = (operand_layout(t)[1] for t in call.parts)
    order = pair_order(call.parts)
    if first.stride(0) != second.stride(0) or order is None:
        return "interleave"
    return "interleave_one" if order > 0 else "interleave_one_swapped"


def one_k_loop(b_parts: str, num_b: int) -> bool:
    """Whether the TMA mainloop reads B in one K loop per tile (B one tensor, or two parts through
    one descriptor), where the tile loop can be flattened with it (``Config.FLATTEN``)."""
    return num_b == 1 or b_parts.startswith("interleave_one")


# One descriptor of two parts spans from the lower part's first byte to the upper part's last.
# Below 2^31 bytes: Triton sums that span in a C int when it makes the descriptor (a workaround
# for CUDA drivers up to 13.1 in its launcher), and TMA strides stop at 2^40 bytes.
_MAX_PAIR_SPAN = 2**31


def pair_order(parts):
    """What of B's two parts ``interleave(b0, b1)`` a launch plan depends on beyond each part's
    metadata (see :func:`b_arrangement`): 1 where b1 lies above b0 in memory, -1 where below, None
    where one descriptor cannot read both (one address, a span of 2^31 bytes or more); None too
    for any other B."""
    if (not isinstance(parts, (list, tuple)) or len(parts) != 2
            or not all(isinstance(t, torch.Tensor) and t.layout == torch.strided for t in parts)):
        return None
    distance = parts[1].data_ptr() - parts[0].data_ptr()
    upper = parts[1] if distance > 0 else parts[0]
    last = sum((size - 1) * abs(stride) for size, stride in zip(upper.shape, upper.stride())) * upper.element_size()
    if distance == 0 or abs(distance) + last >= _MAX_PAIR_SPAN:
        return None
    return 1 if distance > 0 else -1


def table_block_n(program):
    """The narrowest epilogue tile that holds every table's period whole (TMA path): P columns,
    or 2P for a table over the N/2 pairs."""
    return max((o.period * (2 if o.width is HALF else 1) for o in program.operands.values() if o.kind == "table"),
               default=1)


def tiles_tma_ok(call):
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
            tiles.append(call.operands[o.name] if o.accumulate else rows_view(user, user.shape[-1], o.name))
        elif any(shape[-1] * call.output_dtype(o).itemsize % 16
                 for shape in (call.part_shapes() if o.per_b_part else [call.output_shape(o)])):
            return False
    return all(tma_ok(t) for t in tiles)


def blocks_tma_ok(call, cfg):
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

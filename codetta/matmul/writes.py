"""What a call writes in place (outputs given in ``out``, tensors accumulated into): never
memory that a tile reads or writes elsewhere, never a tensor autograd tracks, and counted as a
write in its version counter as PyTorch's in-place ops do."""

from __future__ import annotations

import torch

from ..epilogue.ir import Program
from .call import GemmError
from .memory import byte_span, same_elements, share_elements, spans_meet


def written_in_place(program, operands, out) -> list:
    """[(what, tensor)] of the caller's tensors a call writes into: outputs given in ``out``, and
    the operands of accumulating stores. What is no dense tensor is left to the call's checks."""
    written = [(f"out[{n!r}]", t) for n, t in out.items() if _dense(t)]
    if isinstance(program, Program):
        written += [(f"operand {o.name!r} (accumulated into)", operands[o.name]) for o in program.outputs.values()
                    if o.kind == "store" and o.accumulate and _dense(operands.get(o.name))]
    return written


def _dense(t) -> bool:
    """A tensor with strides and a data pointer (anything else is left to the call's checks)."""
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_nested


def check_untracked(written) -> None:
    """codetta.gemm records nothing for autograd: a tensor it would write in place while autograd
    tracks it (grad mode on, requires_grad) would keep a gradient that no longer fits its
    values, so it is refused, as torch refuses an in-place write into a leaf that requires grad;
    likewise an inference tensor outside ``torch.inference_mode()`` (it counts no versions)."""
    tracking, inference_mode = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    for what, t in written:
        if t.is_inference() and not inference_mode:
            raise GemmError(f"codetta.gemm would write {what} in place, an inference tensor, outside "
                            "torch.inference_mode(): PyTorch refuses that too (write it inside inference_mode, "
                            "or pass a tensor made outside it)")
        if tracking and t.requires_grad:
            raise GemmError(f"codetta.gemm would write {what} in place, which requires grad: codetta.gemm does not "
                            "track gradients (detach it, or call under torch.no_grad())")


def count_writes(written) -> None:
    """Bump the version counter of each tensor written in place, as PyTorch's in-place ops do:
    autograd then refuses a backward through a graph that saved the old values (of it or of a
    view sharing its counter), and codetta's norm statistics (NormStats) see x changed."""
    for _, t in written:
        torch.autograd.graph.increment_version(t)


def check_written_apart(program, a, b, operands, written):
    """What the kernel writes (``written``, :func:`written_in_place`'s list: outputs given in ``out``,
    operands accumulated into) must not share an element with a, b or the program's operands,
    which tiles read beyond their own output tile, nor with another written tensor: tiles would
    overwrite what others still read (e.g. ``gemm(a, b, out=a)``: silently wrong, as torch.mm's
    ``out=a`` is). An aux tile operand written in place (the same elements, in the same layout,
    as the output) is fine: each tile reads its own tile of it before writing that tile.
    Checked on every call: it depends on the addresses, which a plan does not fix. Arguments of
    the wrong type are left to the call's own checks."""
    if not isinstance(program, Program) or not written:
        return
    accumulated = {o.name for o in program.outputs.values() if o.kind == "store" and o.accumulate}
    parts = b if isinstance(b, (list, tuple)) else (b,)
    read = [("a", a, False)] + [(f"b[{i}]" if len(parts) > 1 else "b", t, False) for i, t in enumerate(parts)]
    read += [(f"operand {n!r}", operands.get(n), o.kind == "aux") for n, o in program.operands.items()
             if n not in accumulated]
    read = [r for r in read if _dense(r[1])]
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

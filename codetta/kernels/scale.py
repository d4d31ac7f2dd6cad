"""``scale_unless_one_(t, s)``: t *= s in place for a scalar tensor s, nothing when s == 1.

The cross-entropy's weight gradient is computed in its forward for a loss gradient of 1
and scaled in the backward by the actual one, which is 1 in the usual ``loss.backward()``.
Deciding that on the host (``if s != 1``) would wait for the GPU to finish the forward, and
the GPU would then wait for the host to issue the backward; scaling unconditionally would
cost a pass over the [V, d] gradient. Here every program reads s on the GPU and returns at
once when it is 1; otherwise it multiplies its share of t in fp32, rounded once to t's dtype.
"""

import torch
import triton
import triton.language as tl

from ..interpreter import interpreting
from ..matmul.mainloop import cast
from .launch import cdiv, launch

GPU_BLOCK, GPU_PROGRAMS = 4096, 1024  # elements per program step; programs striding over t
INTERPRET_BLOCK, INTERPRET_PROGRAMS = 64, 4


@triton.jit
def _scale_unless_one_kernel(t_ptr, s_ptr, n, BLOCK: tl.constexpr, EMULATE_RNE: tl.constexpr):
    s = tl.load(s_ptr).to(tl.float32)
    if s != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            t = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(t_ptr + offs, cast(t * s, t_ptr.dtype.element_ty, EMULATE_RNE), mask=mask)


def scale_unless_one_(t: torch.Tensor, s: torch.Tensor) -> None:
    """t *= s for a one-element tensor s, skipped on the GPU when s == 1 (t contiguous, s on
    t's device; otherwise ``t.mul_(s)``)."""
    if s.numel() != 1:
        raise ValueError(f"scale_unless_one_: s must have one element, got shape {tuple(s.shape)}")
    if not t.is_contiguous() or s.device != t.device:
        t.mul_(s.reshape(()))
        return
    n = t.numel()
    if n == 0:
        return
    block, programs = (INTERPRET_BLOCK, INTERPRET_PROGRAMS) if interpreting() else (GPU_BLOCK, GPU_PROGRAMS)
    launch(_scale_unless_one_kernel, (min(cdiv(n, block), programs),), t, s, n,
           BLOCK=block, EMULATE_RNE=interpreting())

"""The cross-entropy gradient of stored logits, in place: softmax minus one-hot, scaled per row.

``softmax_grad_(z, lse, target, scale)`` turns the logits z [M, N] (bf16, fp16 or fp32)
into dz_ij = (exp(z_ij - lse_i) - [j == t_i]) * s_i, computed in fp32 and stored in z's
dtype (rounded to nearest even, also in Triton's interpreter). With label smoothing e and
a z-loss coefficient c (loss_i + c lse_i^2), the general form is

    dz_ij = (p_ij (1 + 2 c lse_i) - (1 - e) [j == t_i] - e / N) * s_i,   p_ij = exp(z_ij - lse_i)

lse may come as its two parts (m_i, log s_i), lse_i = m_i + log s_i with m_i the row's
maximum: p_ij = exp((z_ij - m_i) - log s_i) then keeps 1 - p of a target that wins by so
much that lse_i alone (about m_i, in fp32) would round it away, as eager's log_softmax
keeps it ((z - max) - log sum). The target's p - 1 is expm1(log p), by its series where p
is near 1 (|log p| < 1e-2: relative error under 1e-7), not exp(log p) - 1, whose absolute
error (exp's, ~1e-7 on a GPU) would swamp a p - 1 of ~1e-6.

(e = c = 0 computes exactly the plain form: the extra terms are exact no-ops then). With a
soft cap s > 0, z holds the uncapped logits and the loss read zc = s tanh(z / s) (lse too):
p_ij is zc's softmax, and the stored gradient is that of z, dz_ij (1 - tanh(z_ij / s)^2), with
tanh in fp32 (eager PyTorch's tanh backward reads its rounded output, whose 1 - t^2 loses
everything where t saturates near 1). One
memory-bound pass: a 2-D grid of [BLOCK_M, BLOCK_N] blocks, masked at the edges; only the
elements of the view z are read and written (any row stride, unit column stride).
"""

import torch
import triton
import triton.language as tl

from ..interpreter import interpreting
from ..matmul.mainloop import cast, tanh
from .launch import cdiv, launch
from .logsumexp import logit_rows


# (rows, columns, warps) per program: 89 registers on sm_90 (local Triton 3.9), 20 warps per
# SM; 16 x 512 took 176, 8 warps per SM, and ran at 3.1 TB/s on the H200; this one at 3.9 TB/s (ops_breakdown, code fc0ee00).
GPU_BLOCK = (4, 1024, 4)
INTERPRET_BLOCK = (64, 512)  # Triton's interpreter costs per program: few, large ones (tests pass small blocks)


@triton.jit
def _softmax_grad_kernel(z_ptr, z_stride, shift_ptr, log_sum_ptr, target_ptr, scale_ptr, M, N, target_weight, uniform,
                         z_loss_2, softcap, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         EMULATE_RNE: tl.constexpr, CAPPED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    ptrs = z_ptr + rows.to(tl.int64)[:, None] * z_stride + cols[None, :]
    z = tl.load(ptrs, mask=mask, other=0.0)
    shift = tl.load(shift_ptr + rows, mask=row_ok, other=0.0)  # lse, or m with SPLIT
    log_sum = tl.zeros_like(shift)
    if SPLIT:
        log_sum = tl.load(log_sum_ptr + rows, mask=row_ok, other=0.0)
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    logit = z.to(tl.float32)
    if CAPPED:
        capped = tanh(logit / softcap)
        logit = capped * softcap
    a = (logit - shift[:, None]) - log_sum[:, None]  # log p
    p = tl.exp(a)
    f = 1.0 + z_loss_2 * (shift + log_sum)[:, None]
    # the target's p f - (1 - e) as (p - 1) f + (f - (1 - e)), p - 1 = expm1(a) by its series
    # where p is near 1 (exp(a) - 1 would keep only exp's absolute error there, ~1e-7)
    p_minus_1 = tl.where(tl.abs(a) < 1e-2, a * (1.0 + a * (0.5 + a * (1.0 / 6.0))), p - 1.0)
    is_target = cols[None, :] == target[:, None]
    dz = (tl.where(is_target, p_minus_1 * f + (f - target_weight), p * f) - uniform) * scale[:, None]
    if CAPPED:
        dz = dz * (1.0 - capped * capped)
    tl.store(ptrs, cast(dz, z.dtype, EMULATE_RNE), mask=mask)


def softmax_grad_(z: torch.Tensor, lse, target: torch.Tensor, scale: torch.Tensor, *,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float = 0.0, block_m: int | None = None,
                  block_n: int | None = None) -> torch.Tensor:
    """z [M, N] becomes (softmax(z) - onehot(target)) * scale, in place; returns z.

    lse, scale: fp32 [M] (lse_i = logsumexp of row i, s_i its weight: 0 skips the row); lse
    may be a pair (m, log_sum) of fp32 [M], its parts (see the module doc);
    target: integer [M] (a value outside [0, N), e.g. an ignore_index, has no one-hot).
    label_smoothing, z_loss: e and c of the module doc's general form; softcap: s > 0 when the
    loss read the capped logits s tanh(z / s) (lse is theirs; the gradient stored is z's).
    block_m, block_n: the tile per program (4 warps; GPU_BLOCK, or INTERPRET_BLOCK in Triton's interpreter).
    """
    m, n, block_m, block_n = logit_rows("softmax_grad_", z, target, (block_m, block_n), GPU_BLOCK, INTERPRET_BLOCK)
    split = isinstance(lse, (tuple, list))
    shift, log_sum = lse if split else (lse, lse)
    for name, t in (("lse", shift), ("log_sum", log_sum), ("scale", scale)):
        if not isinstance(t, torch.Tensor) or t.shape != (m,) or t.dtype != torch.float32:
            raise ValueError(f"softmax_grad_: {name} must be fp32 [{m}], got "
                             f"{f'{t.dtype} {tuple(t.shape)}' if isinstance(t, torch.Tensor) else type(t).__name__}")
    if m and n:
        grid = (cdiv(m, block_m), cdiv(n, block_n))
        launch(_softmax_grad_kernel, grid, z, z.stride(0), shift.contiguous(), log_sum.contiguous(), target.contiguous(),
               scale.contiguous(), m, n, 1.0 - label_smoothing, label_smoothing / n, 2.0 * z_loss,
               float(softcap or 1.0),
               SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, EMULATE_RNE=interpreting(), CAPPED=bool(softcap),
               num_warps=GPU_BLOCK[2])
    return z

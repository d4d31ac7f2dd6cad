"""Row statistics of stored logits for the cross-entropy: logsumexp's parts, the target's logit and
the row sum, in one read of z [M, N].

Each program reads one [BLOCK_M, BLOCK_N] block of z and writes, per row, its partials: the
block's maximum m_b, s_b = sum_j exp(z_j - m_b), the target's logit (where the block holds the
target's column) and the sum of the logits, into [M, P] buffers (P = ceil(N / BLOCK_N));
:func:`codetta.kernels.finish.row_max_and_log_sum` and row sums finish them, as they finish a
GEMM epilogue's per-tile partials. A row whose logits are all -inf keeps m = -inf, s = 0 (its
lse is -inf); a row holding +inf gets s = NaN (inf - inf), as F.cross_entropy's log_softmax.
With a soft cap s > 0 the statistics are those of the capped logits s tanh(z / s), in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..interpreter import interpreting
from ..matmul.mainloop import tanh
from .finish import row_max_and_log_sum, row_sum
from .launch import cdiv, launch

# (rows, columns, warps) per program. On the H200 (bench/ce_logits_probe.py, 8192 x 128256 bf16)
# 1 x 4096 read at 3.4-3.6 TB/s, 4 x 1024 (the softmax-gradient pass's block) at 2.9-3.1,
# 16 x 256 at 2.8; a loop over a row's blocks in one program at 2.1.
GPU_BLOCK = (1, 4096, 4)
INTERPRET_BLOCK = (64, 64)


@triton.jit
def _row_stats_kernel(z_ptr, z_stride, target_ptr, max_ptr, sum_exp_ptr, target_logit_ptr, logit_sum_ptr, M, N, P,
                      softcap, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOGIT_SUM: tl.constexpr,
                      CAPPED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(1) * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    row_ptrs = z_ptr + rows.to(tl.int64) * z_stride
    z = tl.load(row_ptrs[:, None] + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    if CAPPED:  # the masked-off columns stay -inf (a capped -inf would be -softcap)
        z = tl.where(mask, tanh(z / softcap) * softcap, float("-inf"))
    m = tl.max(z, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # exp(-inf - -inf) would be NaN
    # z - m first (exact near the maximum): exp2(z log2(e) - m log2(e)) as one fma would carry the
    # rounding of m log2(e), ~4e-6 at m ~ 45, into s, and a confident row's log s is smaller
    s = tl.sum(tl.exp(z - m_safe[:, None]), axis=1)
    # the target's logit: one load per row, by the block that holds its column
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    here = row_ok & (target >= first) & (target < tl.minimum(first + BLOCK_N, N))
    zt = tl.load(row_ptrs + target, mask=here, other=0.0).to(tl.float32)
    if CAPPED:
        zt = tanh(zt / softcap) * softcap
    out = rows * P + tl.program_id(1)
    tl.store(max_ptr + out, m, mask=row_ok)
    tl.store(sum_exp_ptr + out, s, mask=row_ok)
    tl.store(target_logit_ptr + out, zt, mask=row_ok)
    if LOGIT_SUM:
        tl.store(logit_sum_ptr + out, tl.sum(tl.where(mask, z, 0.0), axis=1), mask=row_ok)


def logit_rows(caller: str, z: torch.Tensor, target: torch.Tensor, block: tuple, gpu_block: tuple,
               interpret_block: tuple) -> tuple[int, int, int, int]:
    """(M, N, block_m, block_n) for a kernel over the rows of logits z [M, N] with one integer
    target per row: z and target checked (a ValueError naming ``caller``), a block size not
    given (None) the caller's default on a GPU or in Triton's interpreter."""
    default = interpret_block if interpreting() else gpu_block
    block_m, block_n = block[0] or default[0], block[1] or default[1]
    m, n = z.shape
    if z.stride(1) != 1 and n > 1:
        raise ValueError(f"{caller}: z needs unit column stride, got strides {z.stride()}")
    if target.shape != (m,) or target.dtype.is_floating_point:
        raise ValueError(f"{caller}: target must be integer [{m}], got {target.dtype} {tuple(target.shape)}")
    return m, n, block_m, block_n


def row_stats(z: torch.Tensor, target: torch.Tensor, *, logit_sum: bool = False, softcap: float = 0.0,
              block_m: int | None = None, block_n: int | None = None) -> tuple:
    """((m, log s), target_logit, logit_sum or None) of the rows of z [M, N] (any float dtype, unit
    column stride), all fp32 [M]: lse_i = m_i + log s_i, target_logit_i = z[i, target_i] (0 where
    target_i is outside [0, N)), logit_sum_i = sum_j z_ij. A row holding +inf gets a NaN log s,
    as its log_softmax has (inf - inf). softcap: s > 0 for the statistics of s tanh(z / s) (0: of z).
    block_m, block_n: the block per program (GPU_BLOCK;
    64 x 64 in Triton's interpreter, so that small vocabularies span several blocks there too)."""
    m, n, block_m, block_n = logit_rows("row_stats", z, target, (block_m, block_n), GPU_BLOCK, INTERPRET_BLOCK)
    parts = max(1, cdiv(n, block_n))
    stats = torch.empty(4 if logit_sum else 3, m, parts, device=z.device, dtype=torch.float32)
    if m and n:
        launch(_row_stats_kernel, (cdiv(m, block_m), parts), z, z.stride(0), target.contiguous(), stats[0],
               stats[1], stats[2], stats[3] if logit_sum else stats[2], m, n, parts, float(softcap or 1.0),
               BLOCK_M=block_m, BLOCK_N=block_n, LOGIT_SUM=logit_sum, CAPPED=bool(softcap), num_warps=GPU_BLOCK[2])
    else:
        stats[0], stats[1:] = float("-inf"), 0.0
    return (row_max_and_log_sum(stats[0], stats[1]), row_sum(stats[2]),
            row_sum(stats[3]) if logit_sum else None)

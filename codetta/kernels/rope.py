"""RoPE's rotation of q and k heads as one memory-bound Triton kernel, either way: forward (where
no GEMM's epilogue applies it) and transposed (its backward, with the row sums sum(qkv * dqkv)).

qkv [M, N] holds heads of D columns; in the first ``n_rotated`` columns (the q and k
heads) the first R columns of every head are rotated: column t < R/2 with column
t + R/2 by the angle of frequency t, with cos_t = s cos(theta), sin_t = s sin(theta)
from per-token tables [M, R/2] (s: the attention scaling). The forward is

    qkv_t = cos_t z_t - sin_t z_{t+R/2},   qkv_{t+R/2} = cos_t z_{t+R/2} + sin_t z_t

(or, ``interleaved``, column 2t with column 2t + 1 by the same angle), so the gradient of z is
the transposed rotation of dqkv, the same with sin_t negated:

    dz_t = cos_t dqkv_t + sin_t dqkv_{t+R/2},   dz_{t+R/2} = cos_t dqkv_{t+R/2} - sin_t dqkv_t

and every other column passes through as it is. The kernel applies either (``transposed``), in
fp32, each output rounded once. Transposed, it can also return zdz_i = sum_k qkv_ik dqkv_ik
(fp32): a rotation keeps inner products, so this equals sum_k z_ik dz_ik when s = 1 and
is what the RMSNorm backward needs (with s, qkv . dqkv = z . dz too, since qkv = s R z
and dz = s R^T dqkv).

dqkv may come in parts along the columns (dq, dk, dv as autograd hands them back, each
[M, N_i] with a row stride of its own, whole heads each): the kernel reads each column from
its part, so that they need not be concatenated into one [M, N] tensor first (a read and a
write of all of dqkv).

The kernel works in the space of column pairs, D/2 per head (D even): pair j of a head
(p = head D/2 + j) is, for j < R/2, rotated, columns j and j + R/2 of the head (interleaved:
2j and 2j + 1) by the angle of frequency j; for j >= R/2 it passes through, columns
R + (j - R/2) and (D - R)/2 further on (interleaved: R + 2(j - R/2) and the next), so that
any even R <= D works (Phi-4-mini rotates 96 of its 128). Where R divides D those are the
pairs of segments of R columns, pair p at columns (p // (R/2)) R + p % (R/2) and R/2 further
on. Its grid is (row blocks, pair blocks). Pairs closer than a 32-byte sector (interleaved,
or R/2 a power of two under 16 dividing D/2) are read as a block of whole segments of
contiguous columns and split in registers (read as two stride-2 halves, they made the kernel 0.2 of the op's 1.25x of its
GEMM on the H200); rotate_half's halves, runs of R/2 columns, as they lie (the block split in
registers took 7% longer there: 0.182 against 0.170 ms, ops_breakdown). Each
program writes its partial row sums of zdz to an fp32 [M, pair blocks] buffer, summed after
(deterministic, no atomics). Without qkv (``qkv=None``: QK-norm, whose backward takes the
norm's zdz from the pre-norm z instead) the kernel neither reads qkv nor writes zdz.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..interpreter import interpreting
from ..matmul.mainloop import cast
from .launch import launch


# (rows, rotation pairs, warps) per program. On a GPU: 60 registers on sm_90 (local Triton
# 3.9), 32 warps per SM, 3.6 TB/s on the H200 (ops_breakdown, code fc0ee00); 16 x 256 took 152,
# 8 warps per SM, and ran at 3.4 TB/s.
GPU_BLOCK = (8, 256, 8)
INTERPRET_BLOCK = (16, 32, 4)


@triton.jit
def _pair_halves(t, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, HALF_SEGMENT: tl.constexpr):
    """A row block's 2 BLOCK_P contiguous columns, whole segments of 2 HALF_SEGMENT, as the
    first and the second columns of its BLOCK_P pairs, each [BLOCK_M, BLOCK_P] in pair order."""
    t = tl.reshape(t, (BLOCK_M, BLOCK_P // HALF_SEGMENT, 2, HALF_SEGMENT))
    first, second = tl.split(tl.permute(t, (0, 1, 3, 2)))
    return tl.reshape(first, (BLOCK_M, BLOCK_P)), tl.reshape(second, (BLOCK_M, BLOCK_P))


@triton.jit
def _pairs_joined(first, second, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, HALF_SEGMENT: tl.constexpr):
    """The inverse of :func:`_pair_halves`: the pairs' columns back in column order."""
    t = tl.join(tl.reshape(first, (BLOCK_M, BLOCK_P // HALF_SEGMENT, HALF_SEGMENT)),
                tl.reshape(second, (BLOCK_M, BLOCK_P // HALF_SEGMENT, HALF_SEGMENT)))
    return tl.reshape(tl.permute(t, (0, 1, 3, 2)), (BLOCK_M, 2 * BLOCK_P))


@triton.jit
def _dqkv_at(cols, rows64, dqkv0, dqkv1, dqkv2, end0, end1, s_dqkv0, s_dqkv1, s_dqkv2):
    """Pointers to dqkv's elements at these columns of qkv [1, C], each in its part."""
    return tl.where(cols < end0, dqkv0 + rows64 * s_dqkv0 + cols,
                    tl.where(cols < end1, dqkv1 + rows64 * s_dqkv1 + (cols - end0),
                             dqkv2 + rows64 * s_dqkv2 + (cols - end1)))


@triton.jit
def _rotate_kernel(
    dqkv0, dqkv1, dqkv2, qkv, cos, sin, dz, zdz_part,
    M, N, n_rotated, head_dim, end0, end1,
    s_dqkv0, s_dqkv1, s_dqkv2, s_qkv, s_table, s_dz, s_part,
    HALF_R: tl.constexpr, HALF_SEGMENT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr, TRANSPOSED: tl.constexpr, WITH_ZDZ: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """dqkv in three parts: columns [0, end0), [end0, end1), [end1, N); head_dim even.
    SPLIT (interleaved, HALF_SEGMENT 1; or rotate_half with R/2 = HALF_SEGMENT a power of two
    under 16 columns, 32 bytes of bf16, a memory sector, and R dividing D): a pair's columns lie
    HALF_SEGMENT apart inside segments of 2 HALF_SEGMENT columns tiling the heads, and a program
    reads and writes its 2 BLOCK_P columns as one contiguous block (BLOCK_P a multiple of
    HALF_SEGMENT: whole segments), split into pairs in registers. Otherwise (rotate_half) each
    half of its pairs is read as it lies, in runs of R/2 and (D - R)/2 columns."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    rows64 = rows.to(tl.int64)[:, None]
    half_d = head_dim // 2
    j = pairs % half_d  # the pair's index in its head: rotated by frequency j when j < R/2
    if SPLIT:  # segments of 2 HALF_SEGMENT columns tile the heads
        first = (pairs // HALF_SEGMENT) * (2 * HALF_SEGMENT) + pairs % HALF_SEGMENT
        second = first + HALF_SEGMENT
    else:  # rotate_half: runs of R/2 rotated, then runs of (D - R)/2 passing through
        first = (pairs - j) * 2 + tl.where(j < HALF_R, j, HALF_R + j)
        second = first + tl.where(j < HALF_R, HALF_R, half_d - HALF_R)
    first, second = first[None, :], second[None, :]
    cols = (tl.program_id(1) * 2 * BLOCK_P + tl.arange(0, 2 * BLOCK_P))[None, :]  # the block's columns, in order
    freq = j[None, :]
    ok = (rows < M)[:, None] & (cols < N)
    pair_ok = (rows < M)[:, None] & (pairs < N // 2)[None, :]
    rotated = (j < HALF_R)[None, :] & (first < n_rotated)
    parts = (dqkv0, dqkv1, dqkv2, end0, end1, s_dqkv0, s_dqkv1, s_dqkv2)

    if SPLIT:
        d = tl.load(_dqkv_at(cols, rows64, *parts), mask=ok, other=0.0).to(tl.float32)
        d1, d2 = _pair_halves(d, BLOCK_M, BLOCK_P, HALF_SEGMENT)
    else:
        d1 = tl.load(_dqkv_at(first, rows64, *parts), mask=pair_ok, other=0.0).to(tl.float32)
        d2 = tl.load(_dqkv_at(second, rows64, *parts), mask=pair_ok, other=0.0).to(tl.float32)
    c = tl.load(cos + rows64 * s_table + freq, mask=pair_ok & rotated, other=1.0)
    s = tl.load(sin + rows64 * s_table + freq, mask=pair_ok & rotated, other=0.0)
    if not TRANSPOSED:  # the forward rotation: the transposed one by -theta
        s = -s

    # unrotated pairs pass through as they are (a rotation by 0 would turn an inf partner into NaN)
    dz1 = tl.where(rotated, c * d1 + s * d2, d1)
    dz2 = tl.where(rotated, c * d2 - s * d1, d2)
    out_ty = dz.dtype.element_ty
    dz_rows = dz + rows64 * s_dz
    if SPLIT:
        tl.store(dz_rows + cols, cast(_pairs_joined(dz1, dz2, BLOCK_M, BLOCK_P, HALF_SEGMENT), out_ty, EMULATE_RNE),
                 mask=ok)
    else:
        tl.store(dz_rows + first, cast(dz1, out_ty, EMULATE_RNE), mask=pair_ok)
        tl.store(dz_rows + second, cast(dz2, out_ty, EMULATE_RNE), mask=pair_ok)
    if WITH_ZDZ:
        qkv_rows = qkv + rows64 * s_qkv
        if SPLIT:
            partial = tl.sum(tl.load(qkv_rows + cols, mask=ok, other=0.0).to(tl.float32) * d, axis=1)
        else:
            q1 = tl.load(qkv_rows + first, mask=pair_ok, other=0.0).to(tl.float32)
            q2 = tl.load(qkv_rows + second, mask=pair_ok, other=0.0).to(tl.float32)
            partial = tl.sum(q1 * d1 + q2 * d2, axis=1)
        tl.store(zdz_part + rows.to(tl.int64) * s_part + tl.program_id(1), partial, mask=rows < M)


def rotate(dqkv: torch.Tensor | list[torch.Tensor], qkv: Optional[torch.Tensor], cos: torch.Tensor,
           sin: torch.Tensor, *, n_rotated: int, head_dim: int, interleaved: bool = False,
           transposed: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(dz [M, N] in dqkv's dtype, zdz [M] fp32) from dqkv [M, N], or its parts along the columns
    (at most three, whole heads each: [dq, dk, dv]), qkv [M, N] and the tables cos, sin [M, R/2]
    fp32 (attention scaling included); see the module docstring. With ``qkv=None`` only dz is
    computed (zdz is None). ``interleaved``: the rotated pairs are adjacent columns.
    ``transposed=False``: the forward rotation instead (RoPE itself: dqkv is then z, dz the
    rotated z; zdz must not be asked for)."""
    if not transposed and qkv is not None:
        raise ValueError("zdz (qkv given) comes with the transposed rotation only")
    parts = [t if t.stride(1) == 1 else t.contiguous() for t in (dqkv if isinstance(dqkv, list) else [dqkv])]
    if not 1 <= len(parts) <= 3 or any(t.shape[0] != parts[0].shape[0] or t.dtype != parts[0].dtype for t in parts):
        raise ValueError(f"dqkv must be a tensor or up to three parts of one dtype and row count, got "
                         f"{[(tuple(t.shape), t.dtype) for t in parts]}")
    ends = list(itertools.accumulate(t.shape[1] for t in parts))  # where each part's columns end
    parts += [parts[-1]] * (3 - len(parts))
    ends += [ends[-1]] * (3 - len(ends))
    with_zdz = qkv is not None
    qkv = (qkv if qkv.stride(1) == 1 else qkv.contiguous()) if with_zdz else parts[0]
    m, n = parts[0].shape[0], ends[-1]
    half_r = cos.shape[1]
    half_segment = 1 if interleaved else half_r
    block_m, block_p, warps = INTERPRET_BLOCK if interpreting() else GPU_BLOCK
    # short runs (under a 32-byte sector) are read as whole segments and split in registers,
    # which takes power-of-two segments tiling the heads; any other run is read pair by pair, as it lies
    split = half_segment < 16 and half_segment & (half_segment - 1) == 0 and head_dim % (2 * half_segment) == 0
    if split:
        block_p = max(block_p, half_segment)  # whole segments (both powers of two)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n // 2, block_p))
    dz = torch.empty(m, n, device=parts[0].device, dtype=parts[0].dtype)
    part = torch.empty(m, grid[1], device=dz.device, dtype=torch.float32) if with_zdz else cos  # cos: unused
    if m and n:
        launch(_rotate_kernel, grid,
            *parts, qkv, cos, sin, dz, part, m, n, n_rotated, head_dim, ends[0], ends[1],
            *(t.stride(0) for t in parts), qkv.stride(0), cos.stride(0), dz.stride(0), part.stride(0),
            HALF_R=half_r, HALF_SEGMENT=half_segment, SPLIT=split, BLOCK_M=block_m, BLOCK_P=block_p,
            TRANSPOSED=transposed, WITH_ZDZ=with_zdz, EMULATE_RNE=interpreting(), num_warps=warps,
        )
    return dz, part.sum(dim=1) if with_zdz else None

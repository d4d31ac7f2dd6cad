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
[M, N_i] with a row stride of its own, whole heads each), and so may qkv (q, k and v as the
QKV GEMM stores them, in allocations of their own): the kernel reads each column from its
part, so that they need not be concatenated into one [M, N] tensor first (a read and a
write of all of them). dz may be written in dqkv's parts too (``out_in_parts``: rotated q and
k in allocations of their own, which a KV cache can hold apart).

A program takes a block of rows and a group of consecutive heads, loads the block's rows of
the tables once and rotates each head of the group in turn: the first R columns of a head as
R/2 pairs (rotate_half: its runs of R/2 columns as they lie; interleaved: the R columns as one
block split into adjacent pairs in registers), the other D - R pass through, any even R <= D
(Phi-4-mini rotates 96 of its 128; D and R/2 are compile-time constants, so each run's
contiguity is known to the compiler and its loads are vectorized). A head lies in one part, so
the part (its base and row stride) is chosen once per head. Each program writes its partial
row sums of zdz to an fp32 [M, head groups] buffer, summed after (deterministic, no atomics).
Without qkv (``qkv=None``: QK-norm, whose backward takes the norm's zdz from the pre-norm z
instead) the kernel neither reads qkv nor writes zdz.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import triton
import triton.language as tl

from ..interpreter import interpreting
from ..matmul.mainloop import cast, times_gradient
from .launch import cdiv, launch, next_power_of_2


# (rows, heads, warps) per program. On an H100 (bench/rope_kernel_probe.py, code a08b3f1) 2.4-2.7
# TB/s at Llama-3-8B's, Phi-3-mini's and Phi-4-mini's heads, within 7% of the best of ten blocks
# (4-32 rows, 4-16 heads, 4 or 8 warps); 140 registers (232 interleaved) on sm_90, no spills.
GPU_BLOCK = (16, 8, 4)
INTERPRET_BLOCK = (16, 4, 4)


@triton.jit
def _head_in_parts(start, rows64, p0, p1, p2, s0, s1, s2, end0, end1):
    """The pointers to column ``start`` of the given rows in a tensor held in three parts along
    the columns, [0, end0), [end0, end1) and [end1, ...) (whole heads each)."""
    in_first, in_second = start < end0, start < end1
    base = tl.where(in_first, p0, tl.where(in_second, p1, p2))
    stride = tl.where(in_first, s0, tl.where(in_second, s1, s2))
    return base + rows64 * stride + start - tl.where(in_first, 0, tl.where(in_second, end0, end1))


@triton.jit
def _rotate_kernel(
    dqkv0, dqkv1, dqkv2, qkv0, qkv1, qkv2, cos, sin, dz0, dz1, dz2, zdz_part,
    M, n_heads, n_rotated_heads, end0, end1, qkv_end0, qkv_end1, dz_end0, dz_end1,
    s_dqkv0, s_dqkv1, s_dqkv2, s_qkv0, s_qkv1, s_qkv2, s_table, s_dz0, s_dz1, s_dz2, s_part,
    HEAD_DIM: tl.constexpr, HALF_R: tl.constexpr, HALF_P: tl.constexpr, REST_P: tl.constexpr,
    INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, HEADS: tl.constexpr, TRANSPOSED: tl.constexpr,
    WITH_ZDZ: tl.constexpr, EMULATE_RNE: tl.constexpr,
):
    """dqkv in three parts: columns [0, end0), [end0, end1), [end1, n_heads D), whole heads each;
    qkv and dz likewise, split at qkv_end0 and qkv_end1, dz_end0 and dz_end1.
    HALF_P: R/2 rounded up to a power of two; REST_P: D - R so rounded (0 when R = D)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (rows < M)[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    t = tl.arange(0, HALF_P)[None, :]  # the pairs of a head
    pair_ok = row_ok & (t < HALF_R)
    c = tl.load(cos + rows64 * s_table + t, mask=pair_ok, other=1.0)
    s = tl.load(sin + rows64 * s_table + t, mask=pair_ok, other=0.0)
    if not TRANSPOSED:  # the forward rotation: the transposed one by -theta
        s = -s
    block = tl.arange(0, 2 * HALF_P)[None, :]  # interleaved: the rotated columns as one block
    block_ok = row_ok & (block < 2 * HALF_R)
    out_ty = dz0.dtype.element_ty
    partial = tl.zeros([BLOCK_M], dtype=tl.float32)
    for i in range(HEADS):
        head = tl.program_id(1) * HEADS + i
        if head < n_heads:
            start = head * HEAD_DIM
            src = _head_in_parts(start, rows64, dqkv0, dqkv1, dqkv2, s_dqkv0, s_dqkv1, s_dqkv2, end0, end1)
            out = _head_in_parts(start, rows64, dz0, dz1, dz2, s_dz0, s_dz1, s_dz2, dz_end0, dz_end1)
            if INTERLEAVED:
                d = tl.load(src + block, mask=block_ok, other=0.0).to(tl.float32)
                d1, d2 = tl.split(tl.reshape(d, (BLOCK_M, HALF_P, 2)))
            else:
                d1 = tl.load(src + t, mask=pair_ok, other=0.0).to(tl.float32)
                d2 = tl.load(src + HALF_R + t, mask=pair_ok, other=0.0).to(tl.float32)
            # v's heads pass through as they are (a rotation by 0 would turn an inf partner into NaN)
            rotates = head < n_rotated_heads
            o1 = tl.where(rotates, c * d1 + s * d2, d1)
            o2 = tl.where(rotates, c * d2 - s * d1, d2)
            if INTERLEAVED:
                tl.store(out + block, cast(tl.reshape(tl.join(o1, o2), (BLOCK_M, 2 * HALF_P)), out_ty, EMULATE_RNE),
                         mask=block_ok)
            else:
                tl.store(out + t, cast(o1, out_ty, EMULATE_RNE), mask=pair_ok)
                tl.store(out + HALF_R + t, cast(o2, out_ty, EMULATE_RNE), mask=pair_ok)
            qkv_head = _head_in_parts(start, rows64, qkv0, qkv1, qkv2, s_qkv0, s_qkv1, s_qkv2, qkv_end0, qkv_end1)
            if WITH_ZDZ:
                if INTERLEAVED:
                    z = tl.load(qkv_head + block, mask=block_ok, other=0.0).to(tl.float32)
                    partial += tl.sum(times_gradient(z, d), axis=1)
                else:
                    q1 = tl.load(qkv_head + t, mask=pair_ok, other=0.0).to(tl.float32)
                    q2 = tl.load(qkv_head + HALF_R + t, mask=pair_ok, other=0.0).to(tl.float32)
                    partial += tl.sum(times_gradient(q1, d1) + times_gradient(q2, d2), axis=1)
            if REST_P > 0:  # the columns [R, D) pass through
                rest = 2 * HALF_R + tl.arange(0, REST_P)[None, :]
                rest_ok = row_ok & (rest < HEAD_DIM)
                r = tl.load(src + rest, mask=rest_ok, other=0.0)
                tl.store(out + rest, r, mask=rest_ok)
                if WITH_ZDZ:
                    q = tl.load(qkv_head + rest, mask=rest_ok, other=0.0).to(tl.float32)
                    partial += tl.sum(times_gradient(q, r.to(tl.float32)), axis=1)
    if WITH_ZDZ:
        tl.store(zdz_part + rows.to(tl.int64) * s_part + tl.program_id(1), partial, mask=rows < M)


def _in_parts(t: torch.Tensor | list[torch.Tensor], what: str) -> tuple[list[torch.Tensor], list[int]]:
    """(up to three parts along the columns, each read with unit column stride, padded to three by
    repeating the last; where each part's columns end, likewise padded) of a tensor or its parts."""
    parts = [p if p.stride(1) == 1 else p.contiguous() for p in (t if isinstance(t, list) else [t])]
    if not 1 <= len(parts) <= 3 or any(p.shape[0] != parts[0].shape[0] or p.dtype != parts[0].dtype for p in parts):
        raise ValueError(f"{what} must be a tensor or up to three parts of one dtype and row count, got "
                         f"{[(tuple(p.shape), p.dtype) for p in parts]}")
    ends = list(itertools.accumulate(p.shape[1] for p in parts))
    return parts + [parts[-1]] * (3 - len(parts)), ends + [ends[-1]] * (3 - len(ends))


def rotate(dqkv: torch.Tensor | list[torch.Tensor], qkv: torch.Tensor | list[torch.Tensor] | None, cos: torch.Tensor,
           sin: torch.Tensor, *, n_rotated: int, head_dim: int, interleaved: bool = False,
           transposed: bool = True, out_in_parts: bool = False,
           block: Optional[tuple] = None) -> tuple[torch.Tensor | list[torch.Tensor], Optional[torch.Tensor]]:
    """(dz [M, N] in dqkv's dtype, zdz [M] fp32) from dqkv [M, N], or its parts along the columns
    (at most three, whole heads each: [dq, dk, dv]), qkv [M, N] (or its parts, whole heads each:
    [q, k, v]) and the tables cos, sin [M, R/2]
    fp32 (attention scaling included); see the module docstring. With ``qkv=None`` only dz is
    computed (zdz is None). ``interleaved``: the rotated pairs are adjacent columns.
    ``transposed=False``: the forward rotation instead (RoPE itself: dqkv is then z, dz the
    rotated z; zdz must not be asked for). ``out_in_parts``: dz as a list of tensors split as
    dqkv's parts, each its own allocation. ``block``: (rows, heads, warps) per program instead of
    GPU_BLOCK (for benchmarks)."""
    if not transposed and qkv is not None:
        raise ValueError("zdz (qkv given) comes with the transposed rotation only")
    parts, ends = _in_parts(dqkv, "dqkv")
    with_zdz = qkv is not None
    qkv_parts, qkv_ends = _in_parts(qkv, "qkv") if with_zdz else (parts, ends)
    half_r = cos.shape[1]
    if not 0 < 2 * half_r <= head_dim or any(t.shape[1] % head_dim for t in parts + qkv_parts) or n_rotated % head_dim:
        raise ValueError(f"the rotary dims {2 * half_r} must be at most head_dim {head_dim}, and the parts "
                         f"{[t.shape[1] for t in parts]} and the {n_rotated} rotated columns whole heads")
    if qkv_ends[-1] != ends[-1] or qkv_parts[0].shape[0] != parts[0].shape[0]:
        raise ValueError(f"qkv has {qkv_ends[-1]} columns and {qkv_parts[0].shape[0]} rows, dqkv {ends[-1]} and "
                         f"{parts[0].shape[0]}")
    m, n = parts[0].shape[0], ends[-1]
    block_m, heads, warps = block or (INTERPRET_BLOCK if interpreting() else GPU_BLOCK)
    grid = (cdiv(m, block_m), cdiv(n // head_dim, heads))
    given = dqkv if isinstance(dqkv, list) else [dqkv]
    dz = [torch.empty(m, t.shape[1], device=t.device, dtype=t.dtype) for t in given] if out_in_parts \
        else torch.empty(m, n, device=parts[0].device, dtype=parts[0].dtype)
    dz_parts, dz_ends = _in_parts(dz, "dz")
    part = torch.empty(m, grid[1], device=cos.device, dtype=torch.float32) if with_zdz else cos  # cos: unused
    rest = head_dim - 2 * half_r
    if m and n:
        launch(_rotate_kernel, grid,
            *parts, *qkv_parts, cos, sin, *dz_parts, part, m, n // head_dim, n_rotated // head_dim, ends[0], ends[1],
            qkv_ends[0], qkv_ends[1], dz_ends[0], dz_ends[1], *(t.stride(0) for t in parts + qkv_parts),
            cos.stride(0), *(t.stride(0) for t in dz_parts), part.stride(0),
            HEAD_DIM=head_dim, HALF_R=half_r, HALF_P=next_power_of_2(half_r),
            REST_P=next_power_of_2(rest) if rest else 0, INTERLEAVED=interleaved, BLOCK_M=block_m,
            HEADS=heads, TRANSPOSED=transposed, WITH_ZDZ=with_zdz, EMULATE_RNE=interpreting(), num_warps=warps,
        )
    return dz, part.sum(dim=1) if with_zdz else None

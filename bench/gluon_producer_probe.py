"""Probe: the residual + norm-producer epilogue in a Gluon (Triton 3.6) Hopper GEMM (H200).

    python bench/gluon_producer_probe.py [--rounds 3]

codetta's Triton kernels pay ~6 µs per 128 x 256 tile for this epilogue (x = acc + residual,
u = x * gamma, row sums of x^2: bench/results/epilogue_ablation.md), because Triton 3.6 waits
for the residual's TMA load right after the K loop and stages every TMA store through one
buffer with a full wait before each (docs/internals.md). Gluon states the schedule itself.
This kernel is persistent (one CTA per SM), not warp-specialized:

- mainloop: a ring of STAGES (A, B) slots filled by TMA, asynchronous wgmma with one group in
  flight; the loads run STAGES - 1 K-steps ahead across tile boundaries, so the next tile's
  first loads are in flight during this tile's epilogue;
- epilogue: the 128 x 256 accumulator in four 128 x 64 column slices (no data movement: the
  slices of wgmma's register layout); the residual's slices come through a ring of three
  shared-memory slots whose TMA loads are issued one tile ahead (during the mainloop); x and u
  go out through their own staging buffers, each store waiting only for the store that used
  the same buffer (``tma.store_wait(pendings=1)``).

Compared at the Llama-3 O-projection and down-projection shapes, from CUDA graphs in shuffled
rounds: cuBLAS's plain GEMM (the speed of light), codetta's tuned Triton kernel for the same
program, this kernel, the same with the programs that have one tile fewer started half a
tile later (``stagger``: SMs out of phase), and the same mainloop storing only the tile
(``plain``: what its mainloop can reach), and a warp-specialized "ping-pong" kernel
(:func:`pingpong_kernel`: one TMA loader warp, two consumer warpgroups on alternate 128 x 128
tiles, so that one's epilogue runs during the other's mainloop). Outputs are checked against
PyTorch first; a wrong kernel is reported and not timed.
``--compile-only`` compiles the kernels for sm_90 without a GPU and reports registers,
spills and shared memory. A probe for the next step, not a codetta path: Gluon has no CPU
interpreter. Results: bench/results/gluon_producer_probe.md (none of the Gluon variants beats
codetta's Triton kernel: the Gluon mainloop alone is 6-8% behind cuBLAS, the ping-pong kernel
at 1.30-1.39x).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_m, (tile % in_group) // group_m


@gluon.jit
def _issue_ab(a_desc, b_desc, a_ring, b_ring, ready, slot, tile, k, num_pid_m, num_pid_n,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr):
    pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [pid_m * BM, k * BK], bar, a_ring.index(slot))
    tma.async_copy_global_to_shared(b_desc, [pid_n * BN, k * BK], bar, b_ring.index(slot))


@gluon.jit
def _issue_residual(r_desc, r_ring, r_ready, slot, tile, quarter, num_pid_m, num_pid_n,
                    BM: gl.constexpr, BN: gl.constexpr, EN: gl.constexpr, GROUP_M: gl.constexpr):
    pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    bar = r_ready.index(slot)
    mbarrier.expect(bar, r_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(r_desc, [pid_m * BM, pid_n * BN + quarter * EN], bar, r_ring.index(slot))


@gluon.jit
def _now_ns():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _quarters(acc, BM: gl.constexpr, EN: gl.constexpr):
    """The four [BM, EN] column slices of a [BM, 4 EN] tile, in column order."""
    t = gl.permute(gl.reshape(acc, [BM, 2, 2, EN]), [0, 3, 1, 2])  # [BM, EN, q1, q0]: column (2 q1 + q0) EN + j
    lo, hi = gl.split(t)
    c0, c2 = gl.split(lo)
    c1, c3 = gl.split(hi)
    return c0, c1, c2, c3


@gluon.jit
def _epilogue_slice(c, q: gl.constexpr, slot: gl.constexpr, phase, r_ring, r_ready, x_stage, u_stage, x_desc, u_desc,
                    gamma_ptr, off_m, off_n, ss, epi_layout: gl.constexpr, EN: gl.constexpr):
    c = gl.convert_layout(c, epi_layout, assert_trivial=True)
    mbarrier.wait(r_ready.index(slot), phase)
    x = c + r_ring.index(slot).load(epi_layout).to(gl.float32)
    xb = x.to(x_desc.dtype)
    xr = xb.to(gl.float32)
    cols = off_n + q * EN + gl.arange(0, EN, layout=gl.SliceLayout(0, epi_layout))
    gamma = gl.load(gamma_ptr + cols).to(gl.float32)
    ub = (xr * gamma[None, :]).to(u_desc.dtype)
    ss += gl.sum(xr * xr, axis=1)
    _staged_store(xb, x_stage, x_desc, off_m, off_n + q * EN)
    _staged_store(ub, u_stage, u_desc, off_m, off_n + q * EN)
    return ss


@gluon.jit
def _plain_slice(c, q: gl.constexpr, stage, x_desc, off_m, off_n, epi_layout: gl.constexpr, EN: gl.constexpr):
    _staged_store(gl.convert_layout(c, epi_layout, assert_trivial=True).to(x_desc.dtype), stage, x_desc, off_m,
                  off_n + q * EN)


@gluon.jit
def _staged_store(value, stage, desc, row, col):
    """A TMA store of ``value`` through ``stage``, once the store issued before the latest one
    (x's for u, u's for x: the previous user of this buffer) has been read out of it."""
    tma.store_wait(pendings=1)
    gl.thread_barrier()
    stage.store(value)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(desc, [row, col], stage)


@gluon.jit
def producer_kernel(a_desc, b_desc, r_desc, x_desc, u_desc, gamma_ptr, part_ptr, M, N, K, stagger_ns,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, PLAIN: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    EN: gl.constexpr = r_desc.block_type.shape[1]
    gl.static_assert(BN == 4 * EN)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    epi_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, EN, 16])
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    r_ring = gl.allocate_shared_memory(r_desc.dtype, [3, BM, EN], r_desc.layout)
    x_stage = gl.allocate_shared_memory(x_desc.dtype, [BM, EN], x_desc.layout)
    u_stage = gl.allocate_shared_memory(u_desc.dtype, [BM, EN], u_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    r_ready = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(3):
        mbarrier.init(r_ready.index(i), count=1)

    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    num_tiles = num_pid_m * num_pid_n
    k_steps = gl.cdiv(K, BK)
    first = gl.program_id(0)
    step = gl.num_programs(0)

    # loads run STAGES - 1 K-steps ahead, across tiles: (ld_tile, ld_k) is the next one to issue
    ld_tile = first
    ld_k = 0
    produced = 0
    for _ in gl.static_range(STAGES - 1):
        if ld_tile < num_tiles:
            _issue_ab(a_desc, b_desc, a_ring, b_ring, ready, produced % STAGES, ld_tile, ld_k, num_pid_m, num_pid_n,
                      BM, BN, BK, GROUP_M)
            produced += 1
            ld_k += 1
            if ld_k == k_steps:
                ld_k = 0
                ld_tile += step
    if (first < num_tiles) & (not PLAIN):  # the first tile's residual slices 0-2 (slice 3 reuses slot 0)
        for q in gl.static_range(3):
            _issue_residual(r_desc, r_ring, r_ready, q, first, q, num_pid_m, num_pid_n, BM, BN, EN, GROUP_M)

    # The programs with one tile fewer start stagger_ns later: epilogues of all SMs at once
    # would write their outputs in one burst, at the memory's bandwidth
    if (stagger_ns > 0) & (first >= num_tiles % step):
        start = _now_ns()
        while _now_ns() - start < stagger_ns:
            pass
    consumed = 0
    done = 0  # tiles finished by this program: the residual slots' phases
    for tile in range(first, num_tiles, step):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = gl.zeros([BM, BN], gl.float32, acc_layout)
        for k in range(k_steps):
            slot = consumed % STAGES
            mbarrier.wait(ready.index(slot), (consumed // STAGES) & 1)
            acc = warpgroup_mma(a_ring.index(slot), b_ring.index(slot).permute((1, 0)), acc, use_acc=k > 0,
                                is_async=True)
            # the previous K-step's MMA is done: its slot takes the load STAGES - 1 steps ahead
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            consumed += 1
            if ld_tile < num_tiles:
                _issue_ab(a_desc, b_desc, a_ring, b_ring, ready, produced % STAGES, ld_tile, ld_k, num_pid_m,
                          num_pid_n, BM, BN, BK, GROUP_M)
                produced += 1
                ld_k += 1
                if ld_k == k_steps:
                    ld_k = 0
                    ld_tile += step
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])

        c0, c1, c2, c3 = _quarters(acc, BM, EN)
        if PLAIN:  # this mainloop's speed of light: the tile stored, nothing else (both buffers in turn)
            _plain_slice(c0, 0, x_stage, x_desc, off_m, off_n, epi_layout, EN)
            _plain_slice(c1, 1, u_stage, x_desc, off_m, off_n, epi_layout, EN)
            _plain_slice(c2, 2, x_stage, x_desc, off_m, off_n, epi_layout, EN)
            _plain_slice(c3, 3, u_stage, x_desc, off_m, off_n, epi_layout, EN)
        else:
            phase = done & 1
            ss = gl.zeros([BM], gl.float32, gl.SliceLayout(1, epi_layout))
            ss = _epilogue_slice(c0, 0, 0, 0, r_ring, r_ready, x_stage, u_stage, x_desc, u_desc, gamma_ptr, off_m,
                                 off_n, ss, epi_layout, EN)
            gl.thread_barrier()  # every warp has read slot 0: slice 3 of this tile goes there
            _issue_residual(r_desc, r_ring, r_ready, 0, tile, 3, num_pid_m, num_pid_n, BM, BN, EN, GROUP_M)
            ss = _epilogue_slice(c1, 1, 1, phase, r_ring, r_ready, x_stage, u_stage, x_desc, u_desc, gamma_ptr, off_m,
                                 off_n, ss, epi_layout, EN)
            ss = _epilogue_slice(c2, 2, 2, phase, r_ring, r_ready, x_stage, u_stage, x_desc, u_desc, gamma_ptr, off_m,
                                 off_n, ss, epi_layout, EN)
            ss = _epilogue_slice(c3, 3, 0, 1, r_ring, r_ready, x_stage, u_stage, x_desc, u_desc, gamma_ptr, off_m,
                                 off_n, ss, epi_layout, EN)
            rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, epi_layout))
            gl.store(part_ptr + rows * num_pid_n + pid_n, ss, mask=rows < M)
            gl.thread_barrier()  # every warp has read slots 0-2: the next tile's slices 0-2 go there
            nxt = tile + step
            if nxt < num_tiles:
                for q in gl.static_range(3):
                    _issue_residual(r_desc, r_ring, r_ready, q, nxt, q, num_pid_m, num_pid_n, BM, BN, EN, GROUP_M)
        done += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _pingpong_loader(a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr):
    """The loader warp: every K-step of this program's tiles, in order, into the ring (a slot
    is refilled once the consumer that read it has released it)."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    issued = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        for k in range(k_steps):
            slot = issued % STAGES
            mbarrier.wait(empty.index(slot), ((issued // STAGES) & 1) ^ 1)  # a new barrier passes phase 1
            _issue_ab(a_desc, b_desc, a_ring, b_ring, ready, slot, tile, k, num_pid_m, num_pid_n, BM, BN, BK, GROUP_M)
            issued += 1


@gluon.jit
def _pingpong_consumer(which: gl.constexpr, a_ring, b_ring, ready, empty, turns, r_desc, x_desc, u_desc, r_buf, u_buf,
                       r_bar, gamma_ptr, part_ptr, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                       GROUP_M: gl.constexpr):
    """Consumer ``which`` (0 or 1) of a program's tiles 0, 2, 4, ... or 1, 3, 5, ...: its mainloop
    runs while the other consumer's epilogue does, and its epilogue is plain synchronous code:
    x = acc + residual written over the residual's own buffer, u = x * gamma, the row sums of x^2.

    The two mainloops take turns (``turns[which]`` completes when the other consumer's mainloop
    ends): both read the one ring, whose barriers tell phases apart only by parity, so a
    consumer waiting for a K-step a whole tile ahead would take an older phase for its own."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    k_steps = gl.cdiv(K, BK)
    step = gl.num_programs(0)
    local = which  # this program's tile counter: which, which + 2, ...
    for tile in range(gl.program_id(0) + which * step, num_pid_m * num_pid_n, 2 * step):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = gl.zeros([BM, BN], gl.float32, layout)
        base = local * k_steps  # the ring position of this tile's first K-step
        # this consumer's j-th mainloop (j = local // 2) follows the other's mainloop number
        # j - 1 + which; a new barrier passes a wait for parity 1 (consumer 0's first tile)
        mbarrier.wait(turns.index(which), ((local // 2) & 1) ^ (1 - which))
        for k in range(k_steps):
            slot = (base + k) % STAGES
            mbarrier.wait(ready.index(slot), ((base + k) // STAGES) & 1)
            acc = warpgroup_mma(a_ring.index(slot), b_ring.index(slot).permute((1, 0)), acc, use_acc=k > 0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            mbarrier.arrive(empty.index((base + k + STAGES - 1) % STAGES), pred=k > 0)  # the previous step's slot
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(empty.index((base + k_steps - 1) % STAGES))
        mbarrier.arrive(turns.index(1 - which))  # the other consumer's mainloop may start

        mbarrier.expect(r_bar, r_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(r_desc, [off_m, off_n], r_bar, r_buf)
        mbarrier.wait(r_bar, (local // 2) & 1)
        x = acc + r_buf.load(layout).to(gl.float32)
        xb = x.to(x_desc.dtype)
        xr = xb.to(gl.float32)
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        ub = (xr * gl.load(gamma_ptr + cols).to(gl.float32)[None, :]).to(u_desc.dtype)
        rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        gl.store(part_ptr + rows * num_pid_n + pid_n, gl.sum(xr * xr, axis=1), mask=rows < M)
        gl.thread_barrier()  # every warp has read the residual: x goes over it
        r_buf.store(xb)
        u_buf.store(ub)
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(x_desc, [off_m, off_n], r_buf)
        tma.async_copy_shared_to_global(u_desc, [off_m, off_n], u_buf)
        tma.store_wait(pendings=0)  # the buffers are free for the next tile: the other mainloop runs meanwhile
        gl.thread_barrier()
        local += 2


@gluon.jit
def pingpong_kernel(a_desc, b_desc, r_desc, x_desc, u_desc, gamma_ptr, part_ptr, M, N, K,
                    GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """The producer as a warp-specialized "ping-pong" kernel: one loader warp, two consumer
    warpgroups (the default partition and a worker) on alternate [BM, BN] tiles."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    gl.static_assert(num_warps == 4)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    r_bufs = gl.allocate_shared_memory(r_desc.dtype, [2, BM, BN], r_desc.layout)
    u_bufs = gl.allocate_shared_memory(u_desc.dtype, [2, BM, BN], u_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    r_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(r_bars.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    gl.warp_specialize([
        (_pingpong_consumer, (0, a_ring, b_ring, ready, empty, turns, r_desc, x_desc, u_desc, r_bufs.index(0),
                              u_bufs.index(0), r_bars.index(0), gamma_ptr, part_ptr, M, N, K, BM, BN, BK, GROUP_M)),
        (_pingpong_consumer, (1, a_ring, b_ring, ready, empty, turns, r_desc, x_desc, u_desc, r_bufs.index(1),
                              u_bufs.index(1), r_bars.index(1), gamma_ptr, part_ptr, M, N, K, BM, BN, BK, GROUP_M)),
        (_pingpong_loader, (a_desc, b_desc, a_ring, b_ring, ready, empty, M, N, K, BM, BN, BK, GROUP_M)),
    ], [4, 1], [232, 40])


def _descriptor(t, block):
    """A host TMA descriptor of bf16 ``t`` in ``block``s, in the default NVMMA shared layout."""
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def _outputs(a, w, BN):
    """x and u [M, N] in a's dtype, and the fp32 [M, N / BN] row partials of sumsq."""
    M, N = a.shape[0], w.shape[0]
    x = torch.empty(M, N, device=a.device, dtype=a.dtype)
    return x, torch.empty_like(x), torch.empty(M, triton.cdiv(N, BN), device=a.device, dtype=torch.float32)


def _num_sms(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def gluon_producer(a, w, residual, gamma, *, stagger=0.0, plain=False, BM=128, BN=256, BK=64, EN=64, STAGES=3,
                   GROUP_M=8):
    """(x = a @ w.T + residual, u = x * gamma, sumsq = rowsum(x^2) in fp32), x and u in a's dtype.
    ``stagger``: the fraction of a tile's mainloop time (at ~5.2 TFLOP/s per SM) by which the
    programs with one tile fewer start later. ``plain``: x = a @ w.T alone (u and sumsq are garbage)."""
    (M, K), N = a.shape, w.shape[0]
    x, u, part = _outputs(a, w, BN)
    grid = (min(_num_sms(a.device), triton.cdiv(M, BM) * part.shape[1]),)
    producer_kernel[grid](_descriptor(a, [BM, BK]), _descriptor(w, [BN, BK]), _descriptor(residual, [BM, EN]),
                          _descriptor(x, [BM, EN]), _descriptor(u, [BM, EN]), gamma, part, M, N, K, int(stagger * 2 * BM * BN * K / 5.2e3),
                          GROUP_M=GROUP_M, STAGES=STAGES, PLAIN=plain, num_warps=8)
    return x, u, part.sum(1)


def compile_sm90(variant: str, m=16384, n=4096, k=4096):
    """A kernel of this probe ('producer', 'plain' or 'pingpong') compiled for sm_90 on any machine
    (CPU tensors stand in for the arguments): its registers, spills and shared memory, and the
    TTGIR, without a GPU."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from ttgir_probe import resources

    def desc(shape, block):
        return _descriptor(torch.empty(shape, dtype=torch.bfloat16), block)

    pingpong = variant == "pingpong"
    bn, en = (128, 128) if pingpong else (256, 64)
    args = dict(a_desc=desc((m, k), [128, 64]), b_desc=desc((n, k), [bn, 64]), r_desc=desc((m, n), [128, en]),
                x_desc=desc((m, n), [128, en]), u_desc=desc((m, n), [128, en]),
                gamma_ptr=torch.empty(n, dtype=torch.bfloat16), part_ptr=torch.empty(m, dtype=torch.float32),
                M=m, N=n, K=k, stagger_ns=1000)
    fn, warps = (pingpong_kernel, 4) if pingpong else (producer_kernel, 8)
    consts = dict(GROUP_M=8, STAGES=3, num_warps=warps, **({} if pingpong else {"PLAIN": variant == "plain"}))
    signature = {name: native_specialize_impl(BaseBackend, args[name], False, True, True)[0] if name in args
                 else "constexpr" for name in fn.arg_names}
    source = GluonASTSource(fn, signature, {(fn.arg_names.index(n),): v for n, v in consts.items()})
    options = dict(num_warps=warps, **({"maxnreg": PINGPONG_MAXNREG} if pingpong else {}))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, resources(compiled)


PINGPONG_MAXNREG = 168  # 12 warps (a loader warpgroup, two consumers) x 168 fill the 64K registers;
#                        the consumers get 232 each, the loader 40 (gl.warp_specialize's register split)


def gluon_pingpong(a, w, residual, gamma, *, BM=128, BN=128, BK=64, STAGES=3, GROUP_M=8):
    """The ping-pong kernel's (x, u, sumsq), as :func:`gluon_producer`'s."""
    (M, K), N = a.shape, w.shape[0]
    x, u, part = _outputs(a, w, BN)
    grid = (min(_num_sms(a.device), triton.cdiv(triton.cdiv(M, BM) * part.shape[1], 2)),)  # two tiles in turn
    pingpong_kernel[grid](_descriptor(a, [BM, BK]), _descriptor(w, [BN, BK]), _descriptor(residual, [BM, BN]),
                          _descriptor(x, [BM, BN]), _descriptor(u, [BM, BN]), gamma, part, M, N, K, GROUP_M=GROUP_M, STAGES=STAGES, num_warps=4,
                          maxnreg=PINGPONG_MAXNREG)
    return x, u, part.sum(1)


SHAPES = {"8B O-proj": (16384, 4096, 4096), "8B down": (16384, 4096, 14336),
          "1B O-proj": (8192, 2048, 2048), "1B down": (8192, 2048, 8192)}


def _errors(outputs, a, w, residual, gamma):
    """The largest relative errors of (x, u, sumsq) against PyTorch in fp32 (x: a @ w.T + residual;
    u and sumsq from the kernel's own x, as the epilogue computes them from x rounded)."""
    x, u, ss = outputs
    ref_x = a.float() @ w.float().t() + residual.float()
    return {"x": ((x.float() - ref_x).abs().max() / ref_x.abs().max()).item(),
            "u": ((u.float() - x.float() * gamma.float()).abs().max() / u.float().abs().max()).item(),
            "sumsq": ((ss - x.float().pow(2).sum(1)).abs().max() / ss.abs().max()).item()}


VARIANTS = {  # name -> (a, w, residual, gamma) -> (x, u, sumsq)
    "Gluon": gluon_producer,
    "Gluon staggered": functools.partial(gluon_producer, stagger=0.5),
    "Gluon ping-pong": gluon_pingpong,
}
TOLERANCE = {"x": 1e-2, "u": 1e-2, "sumsq": 1e-3}  # bf16 rounding of x and u; fp32 sums


def main():
    import codetta
    from codetta.ops import rmsnorm

    from common import gemm_operands, graph_ms_in_rounds, markdown_table, require_gpu, write_results

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report (no GPU needed)")
    args = parser.parse_args()
    if args.compile_only:
        for variant in ("producer", "plain", "pingpong"):
            compiled, res = compile_sm90(variant)
            path = Path(f"/tmp/gluon_{variant}.ttgir")
            path.write_text(compiled.asm["ttgir"])
            Path(f"/tmp/gluon_{variant}.ptx").write_text(compiled.asm["ptx"])
            print(variant, res, "TTGIR in", path)
        return
    require_gpu("gluon_producer_probe")
    program = rmsnorm._producer(torch.bfloat16, True, False)
    rows, runs = [], {}
    for name, (m, n, k) in SHAPES.items():
        a, w, residual, gamma = gemm_operands(m, n, k)
        row = {"shape": name, "M x N x K": f"{m}x{n}x{k}"}
        runs[name, "cuBLAS plain"] = lambda a=a, w=w: torch.mm(a, w.t())
        runs[name, "codetta (Triton)"] = lambda a=a, w=w, r=residual, g=gamma: codetta.gemm(
            a, w.t(), program, residual=r, norm_weight=g)
        plain = gluon_producer(a, w, residual, gamma, plain=True)[0]
        row["err Gluon plain"] = ((plain.float() - a.float() @ w.float().t()).abs().max()
                                  / plain.float().abs().max()).item() / TOLERANCE["x"]
        if row["err Gluon plain"] <= 1:
            runs[name, "Gluon plain"] = lambda a=a, w=w, r=residual, g=gamma: gluon_producer(a, w, r, g, plain=True)
        for variant, fn in VARIANTS.items():
            err = _errors(fn(a, w, residual, gamma), a, w, residual, gamma)
            print(name, variant, "relative max errors", err, flush=True)
            row[f"err {variant}"] = max(err[key] / TOLERANCE[key] for key in err)  # <= 1: within tolerance
            if row[f"err {variant}"] <= 1:  # a wrong kernel is reported, not timed
                runs[name, variant] = lambda a=a, w=w, r=residual, g=gamma, fn=fn: fn(a, w, r, g)
        rows.append(row)
    for run in runs.values():
        run()
    times = graph_ms_in_rounds(runs, args.rounds)
    timed = ["codetta (Triton)", "Gluon plain", *VARIANTS]
    for row in rows:
        cublas = sorted(times[row["shape"], "cuBLAS plain"])[args.rounds // 2]
        row["cuBLAS ms"] = cublas
        for what in timed:
            if (row["shape"], what) in times:
                row[f"{what} / cuBLAS"] = sorted(times[row["shape"], what])[args.rounds // 2] / cublas
    columns = ["shape", "M x N x K", "cuBLAS ms", *(f"{what} / cuBLAS" for what in timed),
               *(f"err {what}" for what in ("Gluon plain", *VARIANTS))]
    table = markdown_table(rows, columns)
    print(table)
    write_results("gluon_producer_probe", rows, table + "\n\nerr: the largest error over the tolerance (x and u 1e-2, "
                  "sumsq 1e-3 of their largest value); above 1, the kernel is wrong and was not timed.")


if __name__ == "__main__":
    main()

"""The fixed GEMM mainloop: Triton device functions that produce one fp32 accumulator tile.

Generated kernels (see :mod:`codetta.epilogue.codegen`) run a persistent loop over
output tiles in grouped order, call one of the two mainloops below for each tile, and
inline their epilogue program on the result.

Operand layouts. The GEMM is ``acc[M, N] = A[M, K] @ B[K, N]``:

* ``A_KM``: A is stored as the transpose of a row-major [K, M] tensor (wgrad: dy^T);
  otherwise A is row-major [M, K].
* ``B_KN``: B is row-major [K, N] (dgrad: W); otherwise B is the transpose of a
  row-major [N, K] tensor (forward: W^T, as nn.Linear stores W).

B may come in up to four parts (``NUM_B``) read as one, without a copy; ``B_PARTS`` says how:

* ``"n"``: concatenated along N (forward: W_q, W_k, W_v of a QKV projection), part i
  holding columns [b_starts[i], b_ends[i]);
* ``"k"``: concatenated along K (dgrad: dx = dq W_q + dk W_k + dv W_v), part i holding
  rows [b_starts[i], b_ends[i]);
* ``"interleave"``: two parts [K, N/2] whose columns alternate (column 2j is column j of
  part 0, 2j + 1 column j of part 1): gate and up projections side by side, so that a
  SwiGLU epilogue finds each (gate, up) pair in adjacent columns. Two accumulators of
  BN/2 columns share each A tile (two descriptors, or pointers).
* ``"interleave_one"``: the same B, both parts stored [N/2, K] row-major with one row stride,
  read through *one* descriptor ``[N/2, 2, K]`` whose middle stride is the distance from
  part 0 to part 1 in memory: its [BN/2, 2, BK] box is the B tile with rows alternating
  between the parts, reshaped in shared memory to [BN, BK], one dot of the full tile width
  (as fast as a B of one tensor). A descriptor's strides are positive, so where part 1
  lies below part 0 (``"interleave_one_swapped"``) the descriptor starts at part 1 and the
  accumulator's column pairs are swapped back after the dot (within each thread's registers).
"""

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of linear tile index ``tile``, in groups of GROUP_M row-tiles for L2 reuse."""
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % in_group) % group_m
    pid_n = (tile % in_group) // group_m
    return pid_m, pid_n


@triton.jit
def _a_tile(a_desc, off_m, off_k, A_KM: tl.constexpr):
    """A[off_m : off_m + BM, off_k : off_k + BK] through A's descriptor."""
    if A_KM:  # one return: the compiler types every return, also of the branch not taken
        a = a_desc.load([off_k, off_m]).T
    else:
        a = a_desc.load([off_m, off_k])
    return a


@triton.jit
def _b_tile(b_desc, off_n, off_k, B_KN: tl.constexpr):
    """B[off_k : off_k + BK, off_n : off_n + BN] through B's descriptor (a 3-d one: two parts
    of B^T with rows alternating, ``"interleave_one"``)."""
    if B_KN:
        b = b_desc.load([off_k, off_n])
    elif len(b_desc.block_shape) == 3:
        rows = b_desc.load([off_n // 2, 0, off_k])
        b = tl.reshape(rows, [2 * rows.shape[0], rows.shape[2]]).T
    else:
        b = b_desc.load([off_n, off_k]).T
    return b


@triton.jit
def _mma(acc, a, b, INTERPRET: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b in fp32."""
    if INTERPRET:  # Triton's interpreter multiplies raw bf16 bits: compute in fp32 there
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _dot_tma(acc, a_desc, b_desc, off_m, off_n, k_base, K,
             BK: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr, A_GOES_ON: tl.constexpr,
             INTERPRET: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """acc += A[off_m:, k_base : k_base + K] @ B[:K, off_n:]. Rows of B past K are TMA's zero
    fill, so a K that is no multiple of BK is exact where A's columns past k_base + K are
    zero fill too. Where A goes on (``A_GOES_ON``: B in parts along K, the next part's columns
    of A follow), the last, partial K step zeroes those columns: an inf there times a zero
    row of B would be NaN."""
    full_steps = K // BK if A_GOES_ON else tl.cdiv(K, BK)
    for k in tl.range(0, full_steps, num_stages=STAGES):
        a = _a_tile(a_desc, off_m, k_base + k * BK, A_KM)
        acc = _mma(acc, a, _b_tile(b_desc, off_n, k * BK, B_KN), INTERPRET, PRECISION)
    if A_GOES_ON:
        off_k = full_steps * BK
        if off_k < K:
            a = _a_tile(a_desc, off_m, k_base + off_k, A_KM)
            a = tl.where((off_k + tl.arange(0, BK) < K)[None, :], a, tl.zeros_like(a))
            acc = _mma(acc, a, _b_tile(b_desc, off_n, off_k, B_KN), INTERPRET, PRECISION)
    return acc


@triton.jit
def _dot2_tma(a_desc, b0_desc, b1_desc, off_m, off_n, K,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr,
              INTERPRET: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """(A @ B0[:, off_n:], A @ B1[:, off_n:]), each [BM, BN], from one pass over A."""
    acc0 = tl.zeros((BM, BN), dtype=tl.float32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
        a = _a_tile(a_desc, off_m, k * BK, A_KM)
        acc0 = _mma(acc0, a, _b_tile(b0_desc, off_n, k * BK, B_KN), INTERPRET, PRECISION)
        acc1 = _mma(acc1, a, _b_tile(b1_desc, off_n, k * BK, B_KN), INTERPRET, PRECISION)
    return acc0, acc1


@triton.jit
def mma_tma(a_desc, b_descs, b_starts, b_ends, off_m, off_n, K,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_B: tl.constexpr,
            B_PARTS: tl.constexpr, A_KM: tl.constexpr, B_KN: tl.constexpr,
            INTERPRET: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """acc = A[off_m:, :] @ B[:, off_n:] through TMA descriptors (B_PARTS: see the module doc).

    Parts along N: the tile's columns lie in one part (the launcher picks BN so).
    """
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if NUM_B == 1 or B_PARTS == "interleave_one" or B_PARTS == "interleave_one_swapped":
        acc = _dot_tma(acc, a_desc, b_descs[0], off_m, off_n, 0, K, BK, A_KM, B_KN, False, INTERPRET, PRECISION,
                       STAGES)
        if B_PARTS == "interleave_one_swapped":  # columns 2j read part 1, 2j + 1 part 0: swap them back
            from_part1, from_part0 = tl.split(tl.reshape(acc, [BM, BN // 2, 2]))
            acc = tl.reshape(tl.join(from_part0, from_part1), [BM, BN])
    elif B_PARTS == "interleave":
        acc0, acc1 = _dot2_tma(a_desc, b_descs[0], b_descs[1], off_m, off_n // 2, K, BM, BN // 2, BK, A_KM, B_KN,
                               INTERPRET, PRECISION, STAGES)
        acc = tl.reshape(tl.join(acc0, acc1), [BM, BN])
    elif B_PARTS == "k":
        for i in tl.static_range(NUM_B):
            acc = _dot_tma(acc, a_desc, b_descs[i], off_m, off_n, b_starts[i], b_ends[i] - b_starts[i],
                           BK, A_KM, B_KN, True, INTERPRET, PRECISION, STAGES)
    else:
        part = 0
        for i in tl.static_range(1, NUM_B):
            part += (off_n >= b_starts[i]).to(tl.int32)
        for i in tl.static_range(NUM_B):
            if part == i:
                acc = _dot_tma(acc, a_desc, b_descs[i], off_m, off_n - b_starts[i], 0, K,
                               BK, A_KM, B_KN, False, INTERPRET, PRECISION, STAGES)
    return acc


@triton.jit
def _dot_ptr(acc, a_ptr, stride_am, stride_ak, b_ptr, b_stride_k, b_step, rm, rk, b_cols, m_ok, n_ok, k_base, K,
             BK: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """acc += A[rm, k_base : k_base + K] @ B[:K, cols]; ``b_cols`` are B's column offsets and
    ``b_step`` its per-column pointer step for BK rows (both differ per part when N is split)."""
    a_p = a_ptr + rm[:, None] * stride_am + (k_base + rk)[None, :] * stride_ak
    b_p = b_ptr + rk[:, None] * b_stride_k + b_cols
    for k in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
        k_left = K - k * BK
        a = tl.load(a_p, mask=m_ok & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_p, mask=(rk[:, None] < k_left) & n_ok, other=0.0)
        acc = _mma(acc, a, b, INTERPRET, PRECISION)
        a_p += BK * stride_ak
        b_p += b_step
    return acc


@triton.jit
def mma_pointers(a_ptr, stride_am, stride_ak, b_ptrs, b_strides_k, b_strides_n, b_starts, b_ends,
            off_m, off_n, M, N, K,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_B: tl.constexpr, B_PARTS: tl.constexpr,
            INTERPRET: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """acc = A[off_m:, :] @ B[:, off_n:] through pointers: any strides, any part boundaries."""
    rm = (off_m + tl.arange(0, BM)).to(tl.int64)
    rn = (off_n + tl.arange(0, BN)).to(tl.int64)
    rk = tl.arange(0, BK).to(tl.int64)
    m_ok = (rm < M)[:, None]
    n_ok = (rn < N)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if B_PARTS == "k":
        for i in tl.static_range(NUM_B):
            acc = _dot_ptr(acc, a_ptr, stride_am, stride_ak, b_ptrs[i], b_strides_k[i], BK * b_strides_k[i], rm, rk,
                           rn[None, :] * b_strides_n[i], m_ok, n_ok, b_starts[i], b_ends[i] - b_starts[i],
                           BK, INTERPRET, PRECISION, STAGES)
    else:
        # Each column reads from the part that holds it: per-column base pointer and step.
        b_base = b_ptrs[0] + rn[None, :] * b_strides_n[0]
        b_step = tl.zeros((1, BN), dtype=tl.int64) + BK * b_strides_k[0]
        if B_PARTS == "interleave":
            odd = (rn % 2 == 1)[None, :]
            b_base = tl.where(odd, b_ptrs[1] + (rn // 2)[None, :] * b_strides_n[1], b_ptrs[0] + (rn // 2)[None, :] * b_strides_n[0])
            b_step = tl.where(odd, BK * b_strides_k[1], b_step)
        else:
            for i in tl.static_range(1, NUM_B):
                in_part = (rn >= b_starts[i])[None, :]
                b_base = tl.where(in_part, b_ptrs[i] + (rn - b_starts[i])[None, :] * b_strides_n[i], b_base)
                b_step = tl.where(in_part, BK * b_strides_k[i], b_step)
        b_stride_k = b_strides_k[0]
        if NUM_B > 1:
            b_stride_k = b_step // BK
        acc = _dot_ptr(acc, a_ptr, stride_am, stride_ak, b_base, b_stride_k, b_step, rm, rk, 0, m_ok, n_ok, 0, K,
                       BK, INTERPRET, PRECISION, STAGES)
    return acc


@triton.jit
def column_halves(x, BM: tl.constexpr, BN: tl.constexpr):
    """(x[:, :BN/2], x[:, BN/2:]) of a [BM, BN] tile. In the accumulator's layout the top bit of
    the column index selects registers within a thread: no data moves."""
    return tl.split(tl.permute(tl.reshape(x, [BM, 2, BN // 2]), (0, 2, 1)))


@triton.jit
def max_keeping_nan(a, b):
    """The combine function of a max reduction (``tl.reduce``) that is NaN where an element is,
    as torch.amax is; ``tl.max`` skips NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def times_gradient(value, grad):
    """value * grad, and 0 where grad is 0 (inf * 0 would be NaN): a term of a norm backward's row
    sum z . dz, where a value that overflowed to inf but got no gradient adds nothing, as it adds
    nothing to PyTorch's h . dh."""
    return tl.where(grad == 0.0, 0.0, value * grad)


@triton.jit
def tanh(x):
    """tanh(x) in fp32 from exp (Triton's interpreter has no libdevice): sign(x) (1 - e) / (1 + e)
    with e = exp(-2|x|); below |x| = 1/4, where 1 - e cancels, its Taylor series to x^9
    (relative error under 1e-8 there). NaN stays NaN, +-inf gives +-1."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    far = (1.0 - e) / (1.0 + e)
    x2 = x * x
    near = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(ax < 0.25, near, tl.where(x < 0.0, -far, far))


@triton.jit
def cast(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """x (fp32) converted to ``dtype``, rounded to nearest even.

    Triton's CPU interpreter truncates fp32 -> bf16, and gets subnormals wrong (1e-39 -> 4.2e-39);
    with EMULATE_RNE the bf16 bits are made from the fp32 bits: the top 16 after adding half an
    ulp of bf16 (ties to even), and for NaN (where that addition could carry into the sign) the
    top 16 with the quiet bit set, so that NaN stays NaN.
    """
    if EMULATE_RNE:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            top = tl.where(x != x, (bits >> 16) | 0x40, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
            x = top.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)

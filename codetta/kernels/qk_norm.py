"""QK-norm's backward (Qwen3: a per-head RMSNorm of q and k before RoPE) as one memory-bound Triton kernel.

z [M, N] holds heads of D columns (the pre-norm projections, as the forward stored them);
the first ``n_normed`` heads (the q heads, then the k heads) were normalized, each with the
weight of its kind (w_q for the first ``n_q`` heads, w_k for the others):

    r_ih = rsqrt(mean_{k in h} z_ik^2 + eps),   zhat = z r_h,   zn = w ⊙ zhat

Given dzn (the gradient of zn), per normalized head, in fp32:

    g = w ⊙ dzn,   dz = r_h (g - zhat mean_{k in h}(g_k zhat_k))
    dw_q = sum over rows and q heads of dzn ⊙ zhat      (dw_k likewise over the k heads)

and dz = dzn on the other (v) heads. The kernel also returns the row dot product the outer
RMSNorm's backward needs, zdz_i = sum over all N columns of z_ik dz_ik, taken from dz as
stored (rounded to its dtype and read back, as the next GEMM consumes it).

Grid: (row blocks, heads); each program owns ``ITERS`` blocks of ``BLOCK_M`` rows of one
head (D columns, D a power of two), keeps its weight-gradient partial [D] in registers and
writes it once to an fp32 [row blocks, n_normed, D] buffer, and its zdz partials to an fp32
[M, heads] buffer; both are summed after in torch in a fixed order (deterministic, no
atomics). Offsets are int64; rows may have any stride, columns must be contiguous.
With ``out=dzn`` the kernel works in place and does not rewrite the v heads (dz = dzn there).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..interpreter import interpreting
from ..matmul.mainloop import cast
from .finish import row_sum
from .launch import cdiv, launch


@triton.jit
def _qk_norm_backward_kernel(
    dzn_ptr, z_ptr, w_ptr, dz_ptr, zdz_part, dw_part,
    M, n_q, n_normed, eps,
    s_dzn, s_z, s_dz, s_zdz, s_dw0, s_dw1,
    D: tl.constexpr, BLOCK_M: tl.constexpr, ITERS: tl.constexpr, STORE_ALL: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, D)
    cols = head.to(tl.int64) * D + offs[None, :]
    normed = head < n_normed
    out_ty = dz_ptr.dtype.element_ty
    w = tl.load(w_ptr + (head >= n_q).to(tl.int64) * D + offs).to(tl.float32)[None, :]  # v heads: unused
    dw = tl.zeros([D], dtype=tl.float32)
    for it in range(ITERS):
        rows = (pid_m * ITERS + it) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)[:, None]
        mask = row_ok[:, None] & (offs < D)[None, :]
        g_in = tl.load(dzn_ptr + rows64 * s_dzn + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + rows64 * s_z + cols, mask=mask, other=0.0).to(tl.float32)
        if normed:
            r = tl.rsqrt(tl.sum(z * z, axis=1) / D + eps)[:, None]
            zhat = tl.where(row_ok[:, None], z * r, 0.0)  # masked rows: 0 (r is inf there when eps = 0)
            g = w * g_in
            c = (tl.sum(g * zhat, axis=1) / D)[:, None]
            d = cast(r * (g - zhat * c), out_ty, EMULATE_RNE)
            tl.store(dz_ptr + rows64 * s_dz + cols, d, mask=mask)
            dw += tl.sum(g_in * zhat, axis=0)
            part = tl.sum(z * d.to(tl.float32), axis=1)
        else:
            if STORE_ALL:
                tl.store(dz_ptr + rows64 * s_dz + cols, cast(g_in, out_ty, EMULATE_RNE), mask=mask)
            part = tl.sum(z * g_in, axis=1)
        tl.store(zdz_part + rows.to(tl.int64) * s_zdz + head, part, mask=row_ok)
    if normed:
        tl.store(dw_part + pid_m.to(tl.int64) * s_dw0 + head * s_dw1 + offs, dw)


def _block(m: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, ITERS, warps): small tiles in the interpreter; on a GPU ~4K elements per tile
    and up to 8 row blocks per program (fewer weight-gradient partials to write and sum)."""
    if interpreting():
        return 16, 1, 1
    block_m = max(1, min(64, 4096 // head_dim))
    iters = max(1, min(8, cdiv(m, block_m * 1024)))  # keep >= ~1K row programs
    return block_m, iters, 4


def qk_norm_backward(dzn: Tensor, z: Tensor, q_weight: Tensor, k_weight: Tensor, *, n_q: int, n_kv: int, eps: float,
                     out: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dz, zdz, dq_weight, dk_weight) of the per-head QK-norm given dzn; see the module docstring.

    Args:
        dzn, z: [M, N] with N = (n_q + 2 n_kv) D, unit column stride; dzn in the dtype dz gets.
        q_weight, k_weight: [D] each (D a power of two). eps: the norm's epsilon.
        out: where dz goes ([M, N], dzn's dtype, unit column stride); ``out=dzn`` works in
            place and leaves the v heads as they are.
    Returns:
        dz [M, N], zdz [M] fp32, and the two weight gradients [D] in the weights' dtypes.
    """
    head_dim = q_weight.shape[0]
    m, n = z.shape
    n_heads, n_normed = n_q + 2 * n_kv, n_q + n_kv
    if dzn.shape != z.shape or n != n_heads * head_dim or k_weight.shape != (head_dim,):
        raise ValueError(f"qk_norm_backward: dzn {tuple(dzn.shape)}, z {tuple(z.shape)}, weights "
                         f"{tuple(q_weight.shape)}, {tuple(k_weight.shape)} do not fit {n_q} + 2 x {n_kv} heads")
    if head_dim & (head_dim - 1):
        raise ValueError(f"qk_norm_backward: head_dim {head_dim} must be a power of two")
    dzn, z = (t if t.stride(1) == 1 else t.contiguous() for t in (dzn, z))
    in_place = out is not None and out.data_ptr() == dzn.data_ptr()
    if out is None:
        out = torch.empty_like(dzn)
    w = torch.stack([q_weight, k_weight]).float()
    block_m, iters, warps = _block(m, head_dim)
    grid = (cdiv(m, block_m * iters), n_heads)
    zdz_part = torch.empty(m, n_heads, device=z.device, dtype=torch.float32)
    dw_part = torch.zeros(grid[0], n_normed, head_dim, device=z.device, dtype=torch.float32)
    if m:
        launch(_qk_norm_backward_kernel, grid,
            dzn, z, w, out, zdz_part, dw_part, m, n_q, n_normed, float(eps),
            dzn.stride(0), z.stride(0), out.stride(0), zdz_part.stride(0), dw_part.stride(0), dw_part.stride(1),
            D=head_dim, BLOCK_M=block_m, ITERS=iters, STORE_ALL=not in_place, EMULATE_RNE=interpreting(),
            num_warps=warps,
        )
    dq = dw_part[:, :n_q].sum(dim=(0, 1)).to(q_weight.dtype)
    dk = dw_part[:, n_q:].sum(dim=(0, 1)).to(k_weight.dtype)
    return out, row_sum(zdz_part), dq, dk

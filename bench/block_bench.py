"""The non-attention part of a decoder block, forward and forward+backward, against its GEMMs (H200).

    python bench/block_bench.py [--d 2048,4096,8192] [--m 16384] [--no-compile]

The block runs from one layer's O-projection to the next layer's QKV (the peers' op "f"):

    x1 = x + a W_o^T;  y = SwiGLU(RMSNorm(x1) W_gu^T);  x2 = x1 + y W_d^T;  q, k, v = RoPE(RMSNorm(x2) W_qkv^T)

codetta (norms folded across the GEMMs: each producer hands its statistics to the next
consumer), eager PyTorch written the usual way, and torch.compile of it (mode
"max-autotune-no-cudagraphs"), against the SOL: the block's plain cuBLAS GEMMs (forward;
plus dX and dW for forward+backward). The paper's shapes: d in {2048, 4096, 8192},
FFN = round_up(8d/3, 256), heads of 128 with 4 q heads per kv head, M = 2 x 8192 tokens.
Writes bench/results/block.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codetta.ops import linear_residual, rmsnorm_qkv_rope, swiglu_mlp  # noqa: E402
from codetta.ops.rope import rmsnorm_qkv_rope_reference  # noqa: E402

from common import require_gpu  # noqa: E402
from ops_bench import HD, compare_passes, paper_shape, table  # noqa: E402

EPS = 1e-5


def make_inputs(m: int, d: int):
    s = paper_shape(d)
    ffn, hq, hkv = s.ffn, s.hq, s.hkv

    def p(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda") * scale + shift).bfloat16().requires_grad_()

    return (p(m, d), p(m, d), p(d, hq * HD, scale=d**-0.5), p(d, scale=0.1, shift=1.0),
            p(ffn, d, scale=d**-0.5), p(ffn, d, scale=d**-0.5), p(d, ffn, scale=ffn**-0.5), p(d, scale=0.1, shift=1.0),
            p(hq * HD, d, scale=d**-0.5), p(hkv * HD, d, scale=d**-0.5), p(hkv * HD, d, scale=d**-0.5))


def rope_args(m: int):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device="cuda").float() / HD))
    return torch.arange(m, device="cuda") % 8192, inv_freq


def codetta_block(pos, inv_freq):
    def block(a, x, wo, g2, wg, wu, wd, g1, wq, wk, wv):
        x1, s1 = linear_residual(a, wo, x, g2, EPS)
        x2, s2 = swiglu_mlp(x1, g2, wg, wu, wd, EPS, stats=s1, next_norm_weight=g1, next_eps=EPS)
        return (x2, *rmsnorm_qkv_rope(x2, g1, wq, wk, wv, pos, inv_freq, head_dim=HD, eps=EPS, stats=s2))
    return block


def eager_block(pos, inv_freq):
    def block(a, x, wo, g2, wg, wu, wd, g1, wq, wk, wv):
        x1 = x + F.linear(a, wo)
        h = F.rms_norm(x1, (x1.shape[-1],), g2, EPS)
        x2 = x1 + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
        return (x2, *rmsnorm_qkv_rope_reference(x2, g1, wq, wk, wv, pos, inv_freq, head_dim=HD, eps=EPS))
    return block


def gemms(m: int, d: int):
    s = paper_shape(d)
    ffn, hq, hkv = s.ffn, s.hq, s.hkv
    return [(m, d, hq * HD), (m, 2 * ffn, d), (m, d, ffn), (m, (hq + 2 * hkv) * HD, d)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", default="2048,4096,8192")
    parser.add_argument("--m", default="16384,4096")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    require_gpu("block_bench")
    rows = []
    for m in (int(v) for v in args.m.split(",")):
        pos, inv_freq = rope_args(m)
        for d in (int(v) for v in args.d.split(",")):
            variants = {"codetta": codetta_block(pos, inv_freq), "eager": eager_block(pos, inv_freq)}
            if not args.no_compile:
                variants["compile"] = torch.compile(eager_block(pos, inv_freq), mode="max-autotune-no-cudagraphs")
            compare_passes(rows, {"M": m, "d": d}, variants, lambda: make_inputs(m, d), gemms(m, d), "block")
    print(table(rows))


if __name__ == "__main__":
    main()

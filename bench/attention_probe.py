"""Probe: causal attention forward+backward through each of PyTorch's SDPA backends, in the
layout a Hugging Face Llama hands to SDPA ([B, H, S, D] views of [B, S, H, D] projections,
8 kv heads shared by 32 q heads), at the end-to-end benchmark's shapes. Not a test.

Counts: causal attention does 4 B H S^2 D / 2 FLOPs forward (QK^T and PV over half the
score matrix) and 2.5x that backward; the table gives TFLOP/s from those counts and each
backend's error (forward output, dq, dk, dv) against fp32 math at a small shape.

    python3 bench/attention_probe.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import markdown_table, median_graph_ms, require_gpu, write_results

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
SHAPES = [  # batch, q heads, kv heads, sequence, head_dim
    (2, 32, 8, 4096, 64), (1, 32, 8, 8192, 64), (2, 32, 8, 4096, 128), (1, 32, 8, 8192, 128),
]


def qkv(b, hq, hkv, s, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    return [t.requires_grad_() for t in (q, k, v)]


def attention(q, k, v, gqa):
    if not gqa:  # transformers' repeat_kv
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def step(backend, q, k, v, dout, gqa):
    def run():
        with sdpa_kernel([BACKENDS[backend]]):
            out = attention(q, k, v, gqa)
            torch.autograd.grad(out, (q, k, v), dout)
    return run


def errors(backend, gqa):
    q, k, v = qkv(1, 8, 2, 1024, 64)
    dout = torch.randn(1, 8, 1024, 64, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([BACKENDS[backend]]):
        out = attention(q, k, v, gqa)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.MATH]):
        ref = attention(*ref_in, gqa=False)
        ref_grads = torch.autograd.grad(ref, ref_in, dout.float())
    return [float((a.float() - r).norm() / r.norm()) for a, r in zip((out, *grads), (ref, *ref_grads))]


def main():
    require_gpu("attention_probe.py")
    rows = []
    for b, hq, hkv, s, d in SHAPES:
        flops = 4 * b * hq * s * s * d / 2 * 3.5
        q, k, v = qkv(b, hq, hkv, s, d)
        dout = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
        for backend in BACKENDS:
            for gqa in (False, True):
                row = {"shape": f"{b}x{hq}/{hkv}x{s}x{d}", "backend": backend, "gqa": gqa}
                try:
                    ms = median_graph_ms(step(backend, q, k, v, dout, gqa))
                    row.update(ms=ms, tflops=flops / ms / 1e9)
                    row.update(zip(("err_out", "err_dq", "err_dk", "err_dv"), errors(backend, gqa)))
                except RuntimeError as e:
                    row["error"] = str(e).splitlines()[0][:80]
                rows.append(row)
                print(row, flush=True)
    table = markdown_table(rows, ["shape", "backend", "gqa", "ms", "tflops", "err_out", "err_dq", "err_dk",
                                  "err_dv", "error"])
    print(table)
    write_results("attention_probe", rows, table)


if __name__ == "__main__":
    main()

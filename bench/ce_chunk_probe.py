"""Probe: the fused linear cross-entropy's time and peak memory against its chunk size, with the
output weight trained (full fine-tuning) and frozen (LoRA, a tied embedding not trained).

    python bench/ce_chunk_probe.py [--rows 8192] [--vocab 128256] [--d 2048,4096] [--chunks 1024,2048,4096,8192]

Per (d, weight trained or frozen, chunk rows): the median time of forward + backward of
``codetta.ops.linear_cross_entropy`` (bf16, final RMSNorm in the op, "mean"), and the peak
memory it allocates above its inputs; "default" is the chunk :func:`default_chunk_size`
picks. Liger-Kernel's fused linear cross-entropy (where importable) the same way, after
Liger's own RMSNorm. Counted: one chunk of C rows stores C x V logits in bf16 (2 C V bytes);
with the weight trained, chunks after the first add into an fp32 [V, d] dW (4 V d bytes,
read and written once per chunk).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import markdown_table, median_ms, require_gpu, write_results  # noqa: E402

def peak_and_ms(loss_fn, inputs) -> tuple[float, float]:
    """(peak GiB allocated above ``inputs`` by one forward + backward, its median ms)."""
    def step():
        for t in inputs:
            t.grad = None
        loss_fn().backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return peak, median_ms(step, warmup=3, rep=20)


def main():
    require_gpu("ce_chunk_probe.py")
    import codetta
    from codetta.ops.cross_entropy import default_chunk_size

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--d", default="2048,4096")
    parser.add_argument("--chunks", default="1024,2048,4096,8192",
                        help="the chunk sizes (rows) to time, besides the default")
    args = parser.parse_args()
    try:
        from liger_kernel.transformers import functional as lk
    except ImportError:
        lk = None
    rows_out = []
    for d in map(int, args.d.split(",")):
        torch.manual_seed(0)
        x = torch.randn(args.rows, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.ones(d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, args.vocab, (args.rows,), device="cuda")
        for trained in (True, False):
            w = (torch.randn(args.vocab, d, device="cuda") / d ** 0.5).to(torch.bfloat16).requires_grad_(trained)
            inputs = (x, g, w) if trained else (x, g)
            default = default_chunk_size(args.vocab, torch.bfloat16, rows=args.rows, d=d, weight_grad=trained)
            for chunk in sorted({*map(int, args.chunks.split(",")), default}):
                peak, ms = peak_and_ms(lambda: codetta.ops.linear_cross_entropy(
                    x, w, target, norm_weight=g, chunk_size=chunk), inputs)
                rows_out.append({"d": d, "weight": "trained" if trained else "frozen",
                                 "variant": f"codetta C={chunk}" + (" (default)" if chunk == default else ""),
                                 "ms": ms, "peak_GiB": peak})
                print(rows_out[-1], flush=True)
            if lk is not None:
                peak, ms = peak_and_ms(lambda: lk.liger_fused_linear_cross_entropy(
                    lk.liger_rms_norm(x, g, 1e-6, in_place=False), w, target), inputs)
                rows_out.append({"d": d, "weight": "trained" if trained else "frozen", "variant": "liger",
                                 "ms": ms, "peak_GiB": peak})
                print(rows_out[-1], flush=True)
    table = markdown_table(rows_out, ["d", "weight", "variant", "ms", "peak_GiB"])
    print(table)
    write_results("ce_chunk_probe", rows_out, table)


if __name__ == "__main__":
    main()

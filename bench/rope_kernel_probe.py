"""Probe: the rotation kernel of codetta.kernels.rope by itself (no autograd, no host: CUDA-graph
replays), forward (read z, write the rotated z) and transposed with zdz (read dqkv and qkv,
write dz), over its (rows, heads, warps) blocks, at the shapes of bench/rope_bench.py with
v's heads as the QKV backward hands them (three parts). Not a test.

    python3 bench/rope_kernel_probe.py [--blocks 16,8,4 8,8,4 ...]

Run from another checkout's root (``old/``: PYTHONPATH=old) it times that checkout's kernel
at its own block (an older ``rotate`` takes no ``block``).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, median_graph_ms, require_gpu  # noqa: E402
from codetta.kernels import rope as rope_kernels  # noqa: E402 (from PYTHONPATH first: the checkout timed)

SHAPES = {  # q heads, kv heads, head_dim, rotary dims, interleaved
    "llama3-8b": (32, 8, 128, 128, False),
    "llama3-8b interleaved": (32, 8, 128, 128, True),
    "phi3-mini": (32, 32, 96, 96, False),
    "phi4-mini": (24, 8, 128, 96, False),
}
TOKENS = 8192


def main():
    require_gpu("rope_kernel_probe.py")
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", nargs="*", default=["16,8,4"])
    args = parser.parse_args()
    takes_block = "block" in inspect.signature(rope_kernels.rotate).parameters
    blocks = [tuple(map(int, b.split(","))) for b in args.blocks] if takes_block else [None]
    print("kernel from", rope_kernels.__file__)
    rows = []
    for shape, (hq, hkv, d, r, interleaved) in SHAPES.items():
        if not takes_block and 128 % r:
            continue  # an older kernel took rotary dims dividing head_dim only
        g = torch.Generator(device="cuda").manual_seed(0)
        widths = [hq * d, hkv * d, hkv * d]
        parts = [torch.randn(TOKENS, w, device="cuda", dtype=torch.bfloat16, generator=g) for w in widths]
        qkv = torch.randn(TOKENS, sum(widths), device="cuda", dtype=torch.bfloat16, generator=g)
        cos, sin = (torch.rand(TOKENS, r // 2, device="cuda", generator=g) for _ in range(2))
        n_rot = (hq + hkv) * d
        qk = sum(t.numel() for t in parts[:2]) * 2
        for block in blocks:
            extra = {} if block is None else dict(block=block)
            common = dict(n_rotated=n_rot, head_dim=d, interleaved=interleaved, **extra)
            runs = {
                "forward q, k": (lambda: rope_kernels.rotate(parts[:2], None, cos, sin, transposed=False, **common),
                                 2 * qk),
                "transposed q, k, v + zdz": (lambda: rope_kernels.rotate(parts, qkv, cos, sin, **common),
                                             3 * qkv.numel() * 2),
            }
            for what, (run, moved) in runs.items():
                ms = median_graph_ms(run)
                rows.append({"shape": shape, "block": str(block), "what": what, "graph_ms": ms,
                             "TB/s": moved / ms / 1e9})
                print(rows[-1], flush=True)
    print(markdown_table(rows, ["shape", "block", "what", "graph_ms", "TB/s"]))


if __name__ == "__main__":
    main()

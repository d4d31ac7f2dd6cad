"""The dgrad GEMM with B in parts along K (dx = dq W_q + dk W_k + dv W_v) of two codetta versions.

    python bench/kparts_ab.py OLD_DIR [--new NEW_DIR] [--rounds 2]

OLD_DIR and NEW_DIR (default: this checkout) each hold a ``codetta`` package (e.g.
``git archive <commit> codetta | tar -x -C OLD_DIR``). Each round times the old version, then
the new one, each in a process of its own, with one fixed config (no tuning draw between
them), against cuBLAS on the concatenated weight (``dy @ cat(W)``), at the QKV shapes of
Llama-3-8B and -1B and one whose first part is no multiple of BK (its partial last K step
runs). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SHAPES = {  # name: (M, d, the K parts: q, k, v widths)
    "8b": (16384, 4096, (4096, 1024, 1024)),
    "1b": (8192, 2048, (2048, 512, 512)),
    "8b_partial_step": (16384, 4096, (4064, 1056, 1024)),
}
CONFIG = dict(BM=128, BN=256, BK=64, GROUP_M=8, STAGES=3, num_warps=8)


def measure(root: str) -> dict:
    """{shape: timings} with the codetta under ``root``, in this process."""
    sys.path.insert(0, root)
    import torch
    import triton

    import codetta

    if not Path(codetta.__file__).resolve().is_relative_to(Path(root).resolve()):
        raise SystemExit(f"imported {codetta.__file__}, not the codetta under {root}")
    cfg = codetta.Config(**CONFIG)
    results = {}
    for name, (m, d, parts) in SHAPES.items():
        torch.manual_seed(0)
        dy = torch.randn(m, sum(parts), device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(k, d, device="cuda", dtype=torch.bfloat16) / 64 for k in parts]
        cat = torch.cat(ws)
        ref = (dy @ cat).float()
        err = ((codetta.gemm(dy, ws, config=cfg).float() - ref).norm() / ref.norm()).item()
        results[name] = dict(
            ms=triton.testing.do_bench(lambda: codetta.gemm(dy, ws, config=cfg), warmup=50, rep=300),
            cublas_ms=triton.testing.do_bench(lambda: dy @ cat, warmup=50, rep=300),
            rel_err=err, path=codetta.explain(dy, ws, config=cfg)["path"])
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old")
    parser.add_argument("--new", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args.child)))
        return
    print("| round | version | shape | ms | cuBLAS ms | ratio | rel err | path |")
    print("|---|---|---|---|---|---|---|---|")
    for round_ in range(args.rounds):
        for label, root in (("old", args.old), ("new", args.new)):
            run = subprocess.run([sys.executable, __file__, args.old, "--child", root], capture_output=True, text=True)
            lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
            if not lines:
                raise SystemExit(f"{label} ({root}) failed:\n{run.stderr[-3000:]}")
            for shape, r in json.loads(lines[0][len("RESULT "):]).items():
                print(f"| {round_} | {label} | {shape} | {r['ms']:.3f} | {r['cublas_ms']:.3f} | "
                      f"{r['ms'] / r['cublas_ms']:.3f} | {r['rel_err']:.1e} | {r['path']} |")


if __name__ == "__main__":
    main()

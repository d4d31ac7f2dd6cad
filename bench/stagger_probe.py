"""Do a persistent grid's epilogues cost less when its CTAs are staggered? (H200)

    python bench/stagger_probe.py [--rounds 3]

Hypothesis (epilogue_ablation.md): tiles of equal cost keep the persistent grid in
lockstep, so all 132 CTAs run their epilogues at the same moments and their aux loads and
stores meet at HBM in one burst (132 x 192 KB for the producer: ~5 us at 4.8 TB/s, the
6 us per tile measured) while the tensor cores idle. ``Config.STAGGER`` delays each CTA
that has one tile less than the others by a share of its first tile's time (free: those
CTAs finish a tile early otherwise), moving their epilogues in between. Each (shape,
config, program) timed from a CUDA graph in rounds; outputs of STAGGER configs compared
bit for bit with the same config without it. Writes bench/results/stagger_probe.{md,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codetta  # noqa: E402

from common import gemm_operands, graph_ms_in_rounds, markdown_table, require_gpu, write_results  # noqa: E402
from epilogue_ablation import programs  # noqa: E402

SHAPES = {"O-proj 16384x4096x4096": (16384, 4096, 4096), "QKV 16384x6144x4096": (16384, 6144, 4096),
          "down 16384x4096x14336": (16384, 4096, 14336), "O-proj 4096x4096x4096": (4096, 4096, 4096)}
BASE = {"128x256 s3 w8 e1": codetta.Config(BM=128, BN=256, BK=64, STAGES=3, num_warps=8, EPI_SPLIT=1),
        "128x256 s3 w8 e2": codetta.Config(BM=128, BN=256, BK=64, STAGES=3, num_warps=8, EPI_SPLIT=2)}
PROGRAMS = ("plain store", "+ aux + second store", "producer (all three)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_gpu("stagger_probe")
    runs, mismatches = {}, []
    progs = programs()
    for shape, (m, n, k) in SHAPES.items():
        a, w, residual, g = gemm_operands(m, n, k)
        for cfg_name, base in BASE.items():
            for stagger in (False, True):
                cfg = dataclasses.replace(base, STAGGER=stagger)
                for name in PROGRAMS:
                    program, aux, norm = progs[name]
                    operands = {**({"residual": residual} if aux else {}), **({"norm_weight": g} if norm else {})}

                    def run(a=a, w=w, program=program, operands=operands, cfg=cfg):
                        return codetta.gemm(a, w.t(), program, config=cfg, **operands)

                    out = run()
                    if stagger:
                        ref = codetta.gemm(a, w.t(), program, config=base, **operands)
                        if any(not torch.equal(out[key], ref[key]) for key in ref):
                            mismatches.append((shape, cfg_name, name))
                    runs[(shape, cfg_name + (" stagger" if stagger else ""), name)] = run
        runs[(shape, "cuBLAS", "torch.matmul")] = lambda a=a, w=w: a @ w.t()
    torch.cuda.synchronize()
    times = graph_ms_in_rounds(runs, args.rounds)
    median = {key: sorted(ts)[len(ts) // 2] for key, ts in times.items()}
    rows = []
    for (shape, cfg_name, name), ms in median.items():
        cublas = median[(shape, "cuBLAS", "torch.matmul")]
        unstaggered = median.get((shape, cfg_name.removesuffix(" stagger"), name), ms)
        rows.append({"shape": shape, "config": cfg_name, "epilogue": name, "ms": ms, "vs cuBLAS": ms / cublas,
                     "vs unstaggered": ms / unstaggered})
    columns = ["shape", "config", "epilogue", "ms", "vs cuBLAS", "vs unstaggered"]
    table = markdown_table(rows, columns)
    table += f"\n\nOutputs differing from the unstaggered config's: {mismatches or 'none'}\n"
    write_results("stagger_probe", rows, table)
    print(table)


if __name__ == "__main__":
    main()

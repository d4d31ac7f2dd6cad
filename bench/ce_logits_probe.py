"""Probe: the cross-entropy's logits GEMM with its statistics in the epilogue, against a plain
logits GEMM followed by one memory-bound pass for the same statistics (H200).

    python bench/ce_logits_probe.py [--rounds 3]

Per shape (rows x vocab x d): cuBLAS's plain GEMM; the logits GEMM as the operator ran it up
to 75f2d32 (stores the rounded logits, row max and sum of exponentials per tile, the target's
logit); codetta's GEMM storing the logits only, as the operator runs it since;
:func:`codetta.kernels.logsumexp.row_stats` over the stored logits (in other blocks too); the
softmax-gradient pass that follows either way; both passes also with Gemma 2's logit soft cap
(s = 30: tanh of every logit in fp32 as they read it). The two ways' statistics are compared first.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCKS = ((8, 1024), (2, 2048), (16, 256), (1, 4096))  # other row_stats blocks (rows, columns), 4 warps
SOFTCAP = 30.0  # Gemma 2's final_logit_softcapping
SHAPES = {"llama3-1b": (8192, 128256, 2048), "llama3-8b": (8192, 128256, 4096)}


def fused_logits_program():
    """What the operator's logits GEMM ran before (code 75f2d32): the rounded logits stored, and lse's
    per-tile parts and the target's logit from them in the epilogue."""
    from codetta import epilogue as ep

    p = ep.Program("lce_logits_bfloat16")
    z = ep.round_to(p.acc, torch.bfloat16)
    p.store("logits", z)
    p.row_logsumexp("lse", z)
    p.row_sum("target_logit", ep.where(p.col_index().eq(p.row("target")), z, 0.0))
    return p


def main():
    import codetta
    from codetta.kernels.finish import row_max_and_log_sum
    from codetta.kernels.logsumexp import row_stats
    from codetta.kernels.softmax_grad import softmax_grad_

    from common import graph_ms_in_rounds, markdown_table, require_gpu, write_results

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_gpu("ce_logits_probe")
    program = fused_logits_program()
    rows, runs = [], {}
    for name, (m, v, d) in SHAPES.items():
        torch.manual_seed(0)
        h = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(v, d, device="cuda") / d ** 0.5).to(torch.bfloat16)
        target = torch.randint(0, v, (m,), device="cuda")
        logits = torch.empty(m, -(-v // 8) * 8, device="cuda", dtype=torch.bfloat16)[:, :v]
        scale = torch.full((m,), 1.0 / m, device="cuda")

        def fused(h=h, w=w, target=target, logits=logits):
            out = {"target_logit": torch.empty(h.shape[0], device="cuda"), "logits": logits}
            return codetta.gemm(h, w.t(), program, out=out, finish={"lse": row_max_and_log_sum}, target=target)

        def plain(h=h, w=w, logits=logits):
            return codetta.gemm(h, w.t(), out=logits)

        got = fused()
        stats = row_stats(logits, target)
        lse_fused = got["lse"][0] + got["lse"][1]
        lse_pass = stats[0][0] + stats[0][1]
        row = {"shape": name, "M x V x d": f"{m}x{v}x{d}",
               "lse max diff": (lse_fused - lse_pass).abs().max().item(),
               "target logit max diff": (got["target_logit"] - stats[1]).abs().max().item()}
        runs[name, "cuBLAS"] = lambda h=h, w=w: torch.mm(h, w.t())
        runs[name, "fused logits GEMM"] = fused
        runs[name, "plain logits GEMM"] = plain
        runs[name, "row_stats pass"] = lambda logits=logits, target=target: row_stats(logits, target)
        for bm, bn in BLOCKS:
            runs[name, f"row_stats {bm}x{bn}"] = lambda logits=logits, target=target, bm=bm, bn=bn: row_stats(
                logits, target, block_m=bm, block_n=bn)
        runs[name, "softmax_grad pass"] = lambda logits=logits, stats=stats, target=target, scale=scale: softmax_grad_(
            logits, stats[0], target, scale)
        runs[name, "row_stats pass, capped"] = lambda logits=logits, target=target: row_stats(logits, target,
                                                                                              softcap=SOFTCAP)
        runs[name, "softmax_grad pass, capped"] = lambda logits=logits, stats=stats, target=target, scale=scale: \
            softmax_grad_(logits, stats[0], target, scale, softcap=SOFTCAP)
        rows.append(row)
    for run in runs.values():
        run()
    times = graph_ms_in_rounds(runs, args.rounds)
    median = {key: sorted(t)[args.rounds // 2] for key, t in times.items()}
    for row in rows:
        name = row["shape"]
        for what in ("cuBLAS", "fused logits GEMM", "plain logits GEMM", "row_stats pass", "softmax_grad pass",
                     "row_stats pass, capped", "softmax_grad pass, capped",
                     *(f"row_stats {bm}x{bn}" for bm, bn in BLOCKS)):
            row[f"{what} ms"] = median[name, what]
        row["fused / (plain + pass)"] = median[name, "fused logits GEMM"] / (
            median[name, "plain logits GEMM"] + median[name, "row_stats pass"])
    columns = list(rows[0])
    table = markdown_table(rows, columns)
    print(table)
    write_results("ce_logits_probe", rows, table)


if __name__ == "__main__":
    main()

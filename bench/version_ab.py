"""Two versions of codetta on one machine, alternated: GPU and host time of ops a-d and of the block.

    python bench/version_ab.py OLD_DIR [--new NEW_DIR] [--rounds 2] [--m 4096]

OLD_DIR and NEW_DIR (default: this checkout) each hold a ``codetta`` package and its
``bench/`` (e.g. ``git archive <commit> codetta bench | tar -x -C OLD_DIR``). Each round
measures the old version, then the new one, each in a process of its own (both register
the same custom ops): ops a-d of bench/ops_bench.py at Llama-3-8B shapes and M = 4096 (or
``--m``), and
the block of bench/block_bench.py at M in {4096, 16384}, d in {2048, 4096}, forward and
forward+backward. The host time of one step varies by a third between processes on the
H200 machine, so each cell is the minimum over the rounds; read small host differences
with that in mind. Writes bench/results/version_ab.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OPS = ("a_qkv_rope", "b_oproj_residual_norm", "c_gateup_swiglu", "d_down_residual")
BLOCKS = ((4096, 2048), (4096, 4096), (16384, 2048), (16384, 4096))


def measure(root: Path, m_ops: int) -> dict:
    """{case: (GPU ms, host ms)} with the codetta under ``root``, in this process."""
    sys.path[:0] = [str(root), str(root / "bench")]
    import codetta
    from block_bench import codetta_block, make_inputs, rope_args
    from ops_bench import SHAPES, cases, measure as measure_step

    if not Path(codetta.__file__).resolve().is_relative_to(root):
        raise SystemExit(f"imported {codetta.__file__}, not the codetta under {root}")
    results = {}
    ops = cases(m_ops, SHAPES["llama3-8b"])
    for name in OPS:
        make, fn, _, _ = ops[name]
        for backward in (False, True):
            ms, host, _ = measure_step(fn, make(), backward)
            results[f"{name[0]} M{m_ops} {'fwd+bwd' if backward else 'fwd'}"] = (ms, host)
    for m, d in BLOCKS:
        positions, inv_freq = rope_args(m)
        for backward in (False, True):
            ms, host, _ = measure_step(codetta_block(positions, inv_freq), make_inputs(m, d), backward)
            results[f"block M{m} d{d} {'fwd+bwd' if backward else 'fwd'}"] = (ms, host)
    return results


def run(root: Path, m_ops: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--measure", str(root), "--m", str(m_ops)], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("old", nargs="?", type=Path)
    parser.add_argument("--new", type=Path, default=HERE.parent)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--m", type=int, default=4096, help="the ops' token count")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # one version, in this process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure.resolve(), args.m)))
        return
    sys.path.insert(0, str(HERE))
    from common import markdown_table, require_gpu, write_results

    require_gpu("bench/version_ab.py")
    if args.old is None:
        parser.error("give the directory of the old version")
    runs = {"old": [], "new": []}
    for _ in range(args.rounds):
        for label, root in (("old", args.old), ("new", args.new)):
            runs[label].append(run(root.resolve(), args.m))
    rows = []
    for case in runs["old"][0]:
        best = {label: [min(r[case][i] for r in runs[label]) for i in (0, 1)] for label in runs}
        rows.append({"case": case, "old ms": best["old"][0], "new ms": best["new"][0],
                     "new/old": best["new"][0] / best["old"][0], "old host ms": best["old"][1],
                     "new host ms": best["new"][1], "host new/old": best["new"][1] / best["old"][1]})
    table = markdown_table(rows, list(rows[0]))
    print(table)
    write_results("version_ab", rows, f"old: {args.old}, new: {args.new}, {args.rounds} rounds\n\n{table}")


if __name__ == "__main__":
    main()

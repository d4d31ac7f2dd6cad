"""Plots of the recorded benchmark results (bench/results/*.json -> *.png).

    python bench/plot.py

ops_m*.json: time / SOL per op and pass, one bar per variant (codetta, eager, Liger, compile),
with the 1.03 target drawn; train.json: tokens/s and peak memory per variant; block.json
(when present): time / SOL per width d and pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _bars(ax, labels, series, target=None, top=None):
    """Grouped bars: ``series`` is name -> values (None: missing) aligned with ``labels``; bars
    above ``top`` are cut there and labelled with their value."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + i * width for j, v in enumerate(values) if v is not None]
        ys = [v for v in values if v is not None]
        ax.bar(xs, [min(y, top) if top else y for y in ys], width, label=name)
        for x, y in zip(xs, ys):
            if top and y > top:
                ax.text(x, top, f"{y:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels, rotation=30, ha="right", fontsize=8)
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target}")
    ax.legend(fontsize=8)


def _ratio_plot(name: str, label_of, title: str, target: float):
    data = json.loads((RESULTS / f"{name}.json").read_text())
    rows = data["rows"]
    # GPU-time ratios per variant (the host-time columns, "<variant> host/SOL", are not plotted)
    variants = [k[: -len("/SOL")] for k in dict.fromkeys(k for r in rows for k in r)
                if k.endswith("/SOL") and not k.endswith(" host/SOL")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    top = 2.5
    _bars(ax, [label_of(r) for r in rows], {v: [r.get(f"{v}/SOL") for r in rows] for v in variants}, target, top)
    ax.set_ylabel("time / SOL (its plain cuBLAS GEMMs)")
    ax.set_title(f"{title} — {data['environment']['device']}", fontsize=10)
    ax.set_ylim(0.8, top * 1.08)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=120)
    plt.close(fig)
    print(f"wrote {RESULTS / name}.png")


def plot_train():
    data = json.loads((RESULTS / "train.json").read_text())
    rows = [r for r in data["rows"] if "tokens_per_s" in r]
    names = [r["variant"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    left.bar(names, [r["tokens_per_s"] for r in rows])
    left.set_ylabel("tokens / s")
    right.bar(names, [r["peak_GiB"] for r in rows])
    right.set_ylabel("peak memory (GiB)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"Llama-3-1B-shape training step — {data['environment']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(RESULTS / "train.png", dpi=120)
    plt.close(fig)
    print(f"wrote {RESULTS / 'train.png'}")


def main():
    for ops in sorted(RESULTS.glob("ops_m*.json")):
        _ratio_plot(ops.stem, lambda r: f"{r.get('shape', 'llama3-8b')} {r['op']} M={r['M']} {r['pass']}", "operators",
                    1.03)
    if (RESULTS / "block.json").exists():
        _ratio_plot("block", lambda r: f"d={r['d']} M={r['M']} {r['pass']}", "non-attention block", 1.02)
    if (RESULTS / "train.json").exists():
        plot_train()


if __name__ == "__main__":
    main()

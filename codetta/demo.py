"""The main job: train a small Llama twice, as transformers builds it and patched by codetta.

Both runs start from the same random weights and see the same batches of the text shipped
with codetta (``codetta/data/corpus.txt``, written for it and dedicated to the public
domain; byte-level, nothing downloaded). The demo prints the loss parity of the two runs
and the throughput of both, and writes a PNG plot of the two loss curves.

On a GPU the kernels are compiled (bf16); on a CPU they run in Triton's interpreter, so
the model and the run are made small enough to finish in about a minute on 2 cores (fp32).
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from .matmul import large_interpreter_tiles


@dataclass
class Setup:
    """Model and run sizes for one kind of device."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    batch: int
    steps: int
    lr: float
    dtype: torch.dtype


# On a GPU, large enough that the step is GPU time, not Python time: a d=1024 model took 46 ms per
# step on the H200, almost all of it the host launching kernels, for codetta and eager alike.
GPU = Setup(hidden=2048, layers=8, heads=16, kv_heads=4, ffn=5632, seq=2048, batch=8, steps=150, lr=6e-4,
            dtype=torch.bfloat16)
CPU = Setup(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=48, batch=4, steps=30, lr=3e-3, dtype=torch.float32)


def corpus() -> torch.Tensor:
    """The bytes of the shipped text (about 15 KB), as int64 token ids in [0, 256)."""
    data = resources.files("codetta").joinpath("data", "corpus.txt").read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, setup: Setup, device, seed: int = 0):
    """The same sequence of random windows for every run."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(setup.steps):
        starts = torch.randint(0, data.numel() - setup.seq - 1, (setup.batch,), generator=gen)
        yield torch.stack([data[s: s + setup.seq] for s in starts.tolist()]).to(device)


def build_model(setup: Setup, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=setup.hidden, intermediate_size=setup.ffn,
                         num_hidden_layers=setup.layers, num_attention_heads=setup.heads,
                         num_key_value_heads=setup.kv_heads, max_position_embeddings=setup.seq,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=setup.dtype)


def train(model, data, setup: Setup, device, label: str):
    """Per-step losses and tokens per second (after the first steps, which compile and tune)."""
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)
    losses, times = [], []
    for ids in tqdm(batches(data, setup, device), total=setup.steps, desc=label, leave=False):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs: the step's time is complete
        times.append(time.perf_counter() - t0)
    steady = times[len(times) // 3:] or times
    return losses, setup.batch * setup.seq * len(steady) / sum(steady)


def plot(curves: dict, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, losses), style in zip(curves.items(), ("-", "--")):
        ax.plot(range(1, len(losses) + 1), losses, style, label=label, linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats / byte)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out: Path, steps: int | None = None) -> int:
    """Train both runs, print the comparison, write the plot to ``out``; 0 when the losses agree."""
    import codetta

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    setup = GPU if gpu else CPU
    if steps is not None:
        setup = Setup(**{**setup.__dict__, "steps": steps})
    where = torch.cuda.get_device_name() if gpu else "CPU: Triton interpreter, a small model in fp32"
    print(f"\nTraining a {setup.layers}-layer Llama (d={setup.hidden}, {setup.heads} heads, {setup.kv_heads} kv heads) "
          f"on {where}: {setup.steps} steps of {setup.batch} x {setup.seq} bytes of the shipped text.")
    data = corpus()
    plain = build_model(setup, device)
    patched = codetta.patch(copy.deepcopy(plain))
    loss_plain, tps_plain = train(plain, data, setup, device, "transformers")
    with contextlib.nullcontext() if gpu else large_interpreter_tiles():  # the CPU run: about twice as fast
        loss_fused, tps_fused = train(patched, data, setup, device, "codetta.patch")

    diff = max(abs(a - b) for a, b in zip(loss_plain, loss_fused))
    print(f"{'':24}{'transformers':>14}{'codetta':>14}")
    print(f"{'first / last loss':24}{loss_plain[0]:>7.3f}/{loss_plain[-1]:<6.3f}{loss_fused[0]:>7.3f}/{loss_fused[-1]:<6.3f}")
    print(f"{'tokens / s':24}{tps_plain:>14,.0f}{tps_fused:>14,.0f}   ({tps_fused / tps_plain:.2f}x)")
    print(f"largest per-step loss difference: {diff:.2e}")
    if not gpu:
        print("(on a CPU codetta's kernels run in Triton's interpreter: its speed says nothing; run on a GPU)")
    plot({"transformers": loss_plain, "codetta.patch": loss_fused}, out,
         f"Llama {setup.layers}x{setup.hidden} on {'GPU' if gpu else 'CPU (interpreter)'}")
    print(f"loss curves: {out}")
    # Two trainings drift apart step by step from rounding alone (chaotically, more in bf16):
    # parity is judged on the mean loss of the last tenth of the run, the gap measured against
    # the first loss (a ratio of two end losses would weigh that noise by how far both learned).
    tail = max(1, setup.steps // 10)
    end_plain, end_fused = sum(loss_plain[-tail:]) / tail, sum(loss_fused[-tail:]) / tail
    tolerance = 0.02 if setup.dtype == torch.bfloat16 else 1e-3
    gap = abs(end_fused - end_plain) / loss_plain[0]
    last = f"last {tail} steps" if tail > 1 else "last step"
    print(f"mean loss of the {last}: {end_plain:.4f} vs {end_fused:.4f} (gap {gap:.1e} of the first loss, "
          f"tolerance {tolerance:.0e})")
    if gap > tolerance:
        print("FAILED: the patched run's loss is not the unpatched run's")
        return 1
    if end_plain > 0.75 * loss_plain[0]:
        print("(neither run has learned much yet: give it more --steps for a meaningful comparison)")
    return 0

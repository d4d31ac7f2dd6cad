"""RoPE on q and k by itself (``codetta.ops.apply_rope``: where no QKV epilogue applies it, a LoRA
adapter on q_proj or v_proj, rotary dims no power of two or no divisor of head_dim) against
Hugging Face's ``apply_rotary_pos_emb`` eager and under torch.compile, and Liger-Kernel's
``liger_rotary_pos_emb``, forward and forward + backward. Not a test.

Inputs as a projection hands them over: q [B, S, H_q D] and k [B, S, H_kv D] bf16 (HF's and
Liger's functions get their [B, H, S, D] views, as a model's attention makes them), the
rotary embedding's cos and sin [B, S, R] (bf16, as a bf16 model's); the gradients flow back to
q and k. Bytes moved at least: read q and k, write them rotated, and the same again backward
(the tables are small); ``TB/s`` is that count over the time. Times are medians of CUDA-graph
replays (``graph_ms``: the GPU's time, no host) and of plain launches (``ms``: with the
host's Python and launch costs, what a training step sees where the GPU waits for the host).

    python3 bench/rope_bench.py
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codetta.ops import apply_rope  # noqa: E402
from common import markdown_table, median_graph_ms, median_ms, require_gpu, write_results  # noqa: E402

SHAPES = {  # q heads, kv heads, head_dim, rotary dims
    "llama3-8b": (32, 8, 128, 128),
    "phi3-mini": (32, 32, 96, 96),
    "phi4-mini": (24, 8, 128, 96),
}
TOKENS = (2, 4096)


def hf_rope(q, k, cos, sin):
    """transformers' RoPE (Phi-3's: it takes partial rotary) on [B, H, S, D] views of q and k."""
    modeling = importlib.import_module("transformers.models.phi3.modeling_phi3")
    return modeling.apply_rotary_pos_emb(q, k, cos, sin)


def liger_rope(q, k, cos, sin):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    return liger_rotary_pos_emb(q, k, cos, sin)


def head_views(q, k, head_dim):
    """[B, H, S, D] views of [B, S, H D] q and k."""
    return tuple(t.unflatten(-1, (-1, head_dim)).transpose(1, 2) for t in (q, k))


def variants(head_dim):
    """name -> fn(q, k, cos, sin) -> (rotated q, rotated k), in whatever layout each returns."""
    def codetta(q, k, cos, sin):
        return apply_rope(q, k, cos_sin=(cos, sin), head_dim=head_dim)

    def viewed(fn):
        return lambda q, k, cos, sin: fn(*head_views(q, k, head_dim), cos, sin)

    runs = {"codetta": codetta, "hf eager": viewed(hf_rope),
            "hf torch.compile": viewed(torch.compile(hf_rope, dynamic=False))}
    if importlib.util.find_spec("liger_kernel") is not None:
        runs["liger"] = viewed(liger_rope)
    return runs


def inputs(hq, hkv, head_dim, rotary):
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s = TOKENS
    q = torch.randn(b, s, hq * head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hkv * head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    inv_freq = 10000.0 ** -(torch.arange(0, rotary, 2, device="cuda", dtype=torch.float32) / rotary)
    freqs = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1).expand(b, -1, -1)
    return q, k, emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)


def as_heads(t, head_dim):
    """An output as [B, H, S, D]: codetta's [B, S, H D] viewed so, the others' as they are."""
    return t.unflatten(-1, (-1, head_dim)).transpose(1, 2) if t.dim() == 3 else t


def max_error(fn, q, k, cos, sin, head_dim):
    """max |fn - HF's RoPE in fp64| over both outputs, relative to the largest output."""
    want = hf_rope(*head_views(q.double(), k.double(), head_dim), cos.double(), sin.double())
    got = [as_heads(t, head_dim) for t in fn(q, k, cos, sin)]
    return max(float((g.double() - w).abs().max() / w.abs().max()) for g, w in zip(got, want))


def timed(fn, q, k, cos, sin):
    """[(pass, run, bytes moved at least)]: the forward, and forward + backward to q and k."""
    qk_bytes = (q.numel() + k.numel()) * q.element_size()
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    grads = [torch.randn_like(o) for o in fn(*leaves, cos, sin)]

    def forward_backward():
        torch.autograd.grad(fn(*leaves, cos, sin), leaves, grads)

    return [("fwd", lambda: fn(q, k, cos, sin), 2 * qk_bytes), ("fwd+bwd", forward_backward, 4 * qk_bytes)]


def main():
    require_gpu("rope_bench.py")
    rows = []
    for shape, (hq, hkv, head_dim, rotary) in SHAPES.items():
        q, k, cos, sin = inputs(hq, hkv, head_dim, rotary)
        for name, fn in variants(head_dim).items():
            row = {"shape": f"{shape} {hq}/{hkv}x{head_dim} R{rotary}", "variant": name}
            try:
                row["max_err"] = max_error(fn, q, k, cos, sin, head_dim)
                for pass_, run, moved in timed(fn, q, k, cos, sin):
                    graph = median_graph_ms(run)
                    rows.append({**row, "pass": pass_, "graph_ms": graph, "ms": median_ms(run),
                                 "TB/s": moved / graph / 1e9})
                    print(rows[-1], flush=True)
            except (RuntimeError, ValueError, TypeError) as e:  # a peer that does not take this shape
                rows.append({**row, "error": str(e).splitlines()[0][:100]})
                print(rows[-1], flush=True)
    table = markdown_table(rows, ["shape", "variant", "pass", "graph_ms", "ms", "TB/s", "max_err", "error"])
    print(table)
    write_results("rope", rows, table)


if __name__ == "__main__":
    main()

"""The decoder's final norm, forward + backward on [2, 4096, 2048] bf16 (the Llama-3-1B
training step's): HF's LlamaRMSNorm (eager) vs codetta.ops.rms_norm, which the patched model
runs in its place; CUDA-graph replay time (the GPU's time, no host). GPU only.

    python bench/final_norm_probe.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import codetta  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from common import median_graph_ms, require_gpu  # noqa: E402

require_gpu("final_norm_probe")

x = torch.randn(2, 4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn_like(x)
hf = LlamaRMSNorm(2048, eps=1e-5).to("cuda", torch.bfloat16)
w = hf.weight


def step_hf():
    x.grad = w.grad = None
    hf(x).backward(dy)


def step_codetta():
    x.grad = w.grad = None
    codetta.ops.rms_norm(x, w, 1e-5).backward(dy)


for _ in range(3):  # compile codetta's kernels before any capture
    step_codetta()
for name, step in (("hf", step_hf), ("codetta", step_codetta)):
    print(f"final norm fwd+bwd {name}: {median_graph_ms(step):.4f} ms")

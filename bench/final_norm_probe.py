"""The decoder's final norm, forward + backward on [2, 4096, 2048] bf16 (the Llama-3-1B
training step's): HF's LlamaRMSNorm (eager) vs codetta.ops.rms_norm, which the patched model
runs in its place; CUDA-graph replay time (the GPU's time, no host). GPU only.

    python bench/final_norm_probe.py
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import codetta  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

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


for name, step in (("hf", step_hf), ("codetta", step_codetta)):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()
        with torch.cuda.graph(g):
            for _ in range(20):
                step()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) / 20)
    print(f"final norm fwd+bwd {name}: {sorted(times)[5]:.4f} ms")

"""End-to-end training step of a Llama-3-1B-shape model: HF eager, + torch.compile, + Liger, + codetta.

    python bench/train_bench.py [--seq 4096] [--batch 2] [--steps 8] [--warmup 3] [--lora q_proj,v_proj]

Each variant runs in its own process (Liger's patch replaces transformers' classes for the
whole process): forward, backward and fused AdamW on random tokens, bf16 parameters,
random init (no downloads). Reports median step time, tokens/s, peak memory and the
time of the first steps (compilation, tuning); and, to see whether the host keeps the GPU
busy, the step time with the steps issued back to back (``unsynced_step_ms``) and the
host and GPU times of one forward call. With ``--lora``, a LoRA fine-tuning step instead: PEFT
adapters of rank 16 on the projections named, the base weights frozen (a patched layer's half
with an adapter runs as the model's own modules). Writes bench/results/train.{md,json}
(train_lora_<targets>.{md,json} with --lora).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import markdown_table, require_gpu, write_results  # noqa: E402

VARIANTS = ("hf_eager", "hf_compile", "hf_liger", "hf_codetta")


def build(variant: str, lora: str = ""):
    """The 1B-shape model of ``variant``, with PEFT LoRA adapters on the projections ``lora``
    names (comma-separated) where it names any."""
    import transformers

    if variant == "hf_liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True)
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rope_parameters=dict(rope_type="default",
                                                                                         rope_theta=500000.0),
                                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)
    if variant == "hf_codetta":
        import codetta

        codetta.patch(model)
    if lora:
        import peft

        targets = lora if lora == "all-linear" else lora.split(",")
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                            target_modules=targets))
    if variant == "hf_compile":
        model = torch.compile(model)
    return model


def training_setup(variant: str, args):
    """(model, optimizer, input ids): the model of :func:`build`, fused AdamW, and random tokens
    [args.batch, args.seq] (the labels are the ids)."""
    model = build(variant, args.lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")
    return model, opt, ids


def warmed_up_step(variant: str, args):
    """A function that runs one training step (forward, backward, AdamW) of the model of
    :func:`training_setup`, after ``args.warmup`` such steps (tuning, allocator warm-up);
    its argument ``after_forward``, if given, is called between forward and backward."""
    model, opt, ids = training_setup(variant, args)

    def step(after_forward=None):
        loss = model(input_ids=ids, labels=ids).loss
        if after_forward is not None:
            after_forward()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    return step


def step_arguments(parser, *, steps: int, warmup: int = 3):
    """The shape and length of the runs: --seq, --batch, --steps, --warmup."""
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--lora", default="", help="LoRA fine-tuning: the projections with adapters, comma-separated "
                        "(q_proj,v_proj is PEFT's default), or all-linear (PEFT's every projection but the LM "
                        "head); none: every weight trains")


def run_variant(variant: str, args) -> dict:
    model, opt, ids = training_setup(variant, args)
    times, first = [], None
    start = time.perf_counter()
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if step == args.warmup - 1:
            first = time.perf_counter() - start
            torch.cuda.reset_peak_memory_stats()
    step_s = statistics.median(times[args.warmup:])
    peak = torch.cuda.max_memory_allocated() / 2**30
    # Where the host stands: the same steps issued back to back (no synchronization between
    # them: the host runs ahead), and the host time of one forward call against its GPU time
    # (measured with the host ahead of the GPU).
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    unsynced_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU spin: the host issues the whole forward before it starts
    t0 = time.perf_counter()
    start_event.record()
    loss = model(input_ids=ids, labels=ids).loss
    end_event.record()
    forward_host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    loss.backward()
    opt.zero_grad(set_to_none=True)
    return {"variant": variant, "step_ms": step_s * 1e3, "tokens_per_s": args.batch * args.seq / step_s,
            "peak_GiB": peak, "first_steps_s": first, "loss": loss.item(), "unsynced_step_ms": unsynced_ms,
            "forward_host_ms": forward_host_ms, "forward_gpu_ms": start_event.elapsed_time(end_event)}


def rows_of_variants(script: str, args) -> list[dict]:
    """Each of ``args.variants`` run by ``script --variant v`` in a process of its own (with the
    step arguments of ``args``), its last JSON line as its row; a failed one as its error."""
    rows = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, script, "--variant", variant, "--seq", str(args.seq), "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--lora", args.lora]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            rows.append({"variant": variant, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]})
        else:
            rows.append(json.loads(lines[-1]))
        print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    step_arguments(parser, steps=8)
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant here (used by the driver)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="the variants to compare, comma-separated")
    args = parser.parse_args()
    require_gpu("train_bench")
    if args.variant:
        print(json.dumps(run_variant(args.variant, args)), flush=True)
        return
    rows = rows_of_variants(__file__, args)
    table = markdown_table(rows, sorted({k for r in rows for k in r}, key=str))
    write_results("train_lora_" + args.lora.replace(",", "_") if args.lora else "train", rows, table)
    print(table)


if __name__ == "__main__":
    main()

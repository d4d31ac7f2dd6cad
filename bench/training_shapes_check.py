"""Correctness at training shapes on a GPU, with the tuner on: every operator, forward and backward,
and a patched Hugging Face model, against the same math in fp64 (not a benchmark: no timing).

The test suite runs small shapes untuned (and tests/test_every_config.py forces each tuning
candidate on medium ones); this is what a user's first training step runs: the configs the
tuner picks for Llama-3-8B widths (d 4096, 32 q and 8 kv heads of 128, FFN 14336, vocab
128256) at a row count no multiple of any tile, and a two-layer model of Llama-3.2-1B's widths
on batches of 2 x 2048 tokens.

Each output and each input gradient (random upstream gradients) is compared with an fp64
evaluation of the usual unfused PyTorch code written here (F.rms_norm, F.linear, rotate_half
RoPE, F.silu, F.cross_entropy), by the relative error ||got - ref|| / ||ref||; the same unfused
code in bf16 gives the baseline. The project's rule: codetta's error at most about twice the
baseline's (``ratio`` <= 2). The model rows compare codetta.patch(model) in bf16 with the
unpatched bf16 model, both against the unpatched model in fp64 with the same (bf16-rounded)
weights; there the q/k projection gradients are sums that cancel, whose error is the attention
backward's rounding noise (tests/unfused_roundings.py), so a ratio a little over 2 there is
that noise, not a defect.

    python3 bench/training_shapes_check.py [--m 4093] [--part ops|model|all]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import codetta  # noqa: E402
from codetta import ops  # noqa: E402

from common import markdown_table, require_gpu, write_results  # noqa: E402

D, FFN, HQ, HKV, HEAD, VOCAB, EPS = 4096, 14336, 32, 8, 128, 128256, 1e-5
BF16, FP64 = torch.bfloat16, torch.float64


def _rope(t, cos, sin, heads):
    """Hugging Face's apply_rotary_pos_emb (rotate_half) on t [M, heads * HEAD]."""
    t = t.view(t.shape[0], heads, HEAD)
    half = HEAD // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), -1)
    return (t * cos[:, None] + rotated * sin[:, None]).reshape(t.shape[0], -1)


def _angles(positions, inv_freq, dtype):
    """(cos, sin) [M, HEAD] as a model's rotary embedding returns them (cat(freqs, freqs)), in dtype."""
    freqs = positions.double()[:, None] * inv_freq.double()[None]
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _head_norm(t, weight, heads):
    return F.rms_norm(t.view(t.shape[0], heads, HEAD), (HEAD,), weight, EPS).reshape(t.shape[0], -1)


def cases(m: int, positions, inv_freq, target):
    """name -> (input shapes and scales, codetta's function, the unfused function). Inputs come
    in the order of the shapes; a scale None means a norm weight (1 + 0.1 noise)."""
    x, a = ((m, D), 1.0), ((m, D), 1.0)
    norm = ((D,), None)
    w_q, w_kv = ((HQ * HEAD, D), D**-0.5), ((HKV * HEAD, D), D**-0.5)
    w_gate, w_down = ((FFN, D), D**-0.5), ((D, FFN), FFN**-0.5)
    head_norm = ((HEAD,), None)

    def unfused_qkv(x, g, wq, wk, wv, qn=None, kn=None):
        cos, sin = _angles(positions, inv_freq, x.dtype)
        h = F.rms_norm(x, (D,), g, EPS)
        q, k = F.linear(h, wq), F.linear(h, wk)
        if qn is not None:
            q, k = _head_norm(q, qn, HQ), _head_norm(k, kn, HKV)
        return _rope(q, cos, sin, HQ), _rope(k, cos, sin, HKV), F.linear(h, wv)

    def unfused_swiglu(x, g, wg, wu):
        h = F.rms_norm(x, (D,), g, EPS)
        return F.silu(F.linear(h, wg)) * F.linear(h, wu)

    def producer_consumer(a, wo, r, g, wq):
        x1, stats = ops.linear_residual(a, wo, r, g, EPS)
        return x1, ops.rmsnorm_linear(x1, g, wq, EPS, stats=stats)

    def unfused_producer_consumer(a, wo, r, g, wq):
        x1 = F.linear(a, wo) + r
        return x1, F.linear(F.rms_norm(x1, (D,), g, EPS), wq)

    def cross_entropy(reduction):
        def fused(x, g, w):
            return ops.linear_cross_entropy(x, w, target, norm_weight=g, eps=EPS, reduction=reduction)

        def unfused(x, g, w):
            logits = F.linear(F.rms_norm(x, (D,), g, EPS), w)
            return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), target,
                                   reduction=reduction)
        return [x, norm, ((VOCAB, D), D**-0.5)], fused, unfused

    return {
        "rmsnorm_qkv_rope": ([x, norm, w_q, w_kv, w_kv],
                             lambda x, g, wq, wk, wv: ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, positions, inv_freq,
                                                                           head_dim=HEAD, eps=EPS),
                             unfused_qkv),
        "rmsnorm_qkv_rope, QK-norm": ([x, norm, w_q, w_kv, w_kv, head_norm, head_norm],
                                      lambda x, g, wq, wk, wv, qn, kn: ops.rmsnorm_qkv_rope(
                                          x, g, wq, wk, wv, positions, inv_freq, head_dim=HEAD, eps=EPS,
                                          q_norm_weight=qn, k_norm_weight=kn, qk_norm_eps=EPS),
                                      unfused_qkv),
        "linear_residual + rmsnorm_linear": ([a, ((D, D), D**-0.5), x, norm, w_q], producer_consumer,
                                             unfused_producer_consumer),
        "rmsnorm_swiglu": ([x, norm, w_gate, w_gate], lambda x, g, wg, wu: ops.rmsnorm_swiglu(x, g, wg, wu, EPS),
                           unfused_swiglu),
        "swiglu_mlp": ([x, norm, w_gate, w_gate, w_down],
                       lambda x, g, wg, wu, wd: ops.swiglu_mlp(x, g, wg, wu, wd, EPS),
                       lambda x, g, wg, wu, wd: x + F.linear(unfused_swiglu(x, g, wg, wu), wd)),
        "linear_residual (down)": ([((m, FFN), 1.0), w_down, x], lambda y, wd, r: ops.linear_residual(y, wd, r),
                                   lambda y, wd, r: F.linear(y, wd) + r),
        "linear, with bias": ([x, w_gate, ((FFN,), 0.1)], codetta.linear, lambda x, w, b: F.linear(x, w, b)),
        "linear_cross_entropy, mean": cross_entropy("mean"),
        "linear_cross_entropy, none": cross_entropy("none"),
    }


def _inputs(shapes):
    """fp64 leaves on the GPU: normal(0, scale) of each shape, norm weights 1 + 0.1 normal."""
    return [(1 + 0.1 * torch.randn(shape, device="cuda", dtype=FP64)) if scale is None
            else torch.randn(shape, device="cuda", dtype=FP64) * scale for shape, scale in shapes]


def _run(fn, inputs, dtype, upstream):
    """fn's outputs and the gradients of its inputs (cast to dtype) for the upstream gradients."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if upstream is None:
        upstream = [torch.randn(o.shape, device="cuda", dtype=FP64) for o in outs]
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(upstream, outs)])
    results = [o.detach() for o in outs] + [t.grad for t in leaves]
    del leaves, out, outs
    return results, upstream


def relative_error(got, ref) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def check_ops(m: int) -> list[dict]:
    torch.manual_seed(0)
    positions = torch.randint(0, 8192, (m,), device="cuda")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD, 2, device="cuda", dtype=torch.float32) / HEAD))
    target = torch.randint(0, VOCAB, (m,), device="cuda")
    target[torch.rand(m, device="cuda") < 0.1] = -100
    rows = []
    for name, (shapes, fused, unfused) in cases(m, positions, inv_freq, target).items():
        inputs = _inputs(shapes)
        ref, upstream = _run(unfused, inputs, FP64, None)
        eager, _ = _run(unfused, inputs, BF16, upstream)
        ours, _ = _run(fused, inputs, BF16, upstream)
        labels = ([f"output {i}" for i in range(len(upstream))]
                  + [f"grad {n}" for n in list(inspect.signature(unfused).parameters)[:len(inputs)]])
        for label, got, base, r in zip(labels, ours, eager, ref):
            rows.append(_row(f"{name} [M {m}]", label, got, base, r))
        del inputs, ref, eager, ours
        torch.cuda.empty_cache()
        print(f"{name}: done", flush=True)
    return rows


def _row(case, what, got, base, ref) -> dict:
    err, base_err = relative_error(got, ref), relative_error(base, ref)
    ratio = err / max(base_err, 1e-12)
    return {"case": case, "what": what, "codetta_err": err, "eager_bf16_err": base_err, "ratio": ratio,
            "verdict": "ok" if ratio <= 2 else "OVER 2x"}


def check_model(batch: int = 2, seq: int = 2048, loss_batches: int = 8) -> list[dict]:
    """A two-layer Llama of Llama-3.2-1B's widths: the losses of ``loss_batches`` batches and
    every parameter gradient of the first. One scalar loss's error is a single draw of the
    rounding noise (the mean over tokens cancels most of it, by luck more or less), so the
    loss row compares the vector of losses; the signed differences are printed as well, where
    a bias would show."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                                      max_position_embeddings=8192, tie_word_embeddings=True, rms_norm_eps=EPS)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).to("cuda", FP64)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))  # norm weights other than ones
            p.copy_(p.to(BF16))  # the bf16 models' weights: the error measured is the computation's alone
    batches = [torch.randint(0, VOCAB, (batch, seq), device="cuda") for _ in range(loss_batches)]

    def losses_and_grads(model):
        model.zero_grad(set_to_none=True)
        losses = []
        for i, ids in enumerate(batches):
            loss = model(input_ids=ids, labels=ids).loss
            if i == 0:
                loss.backward()
            losses.append(loss.detach())
        return [torch.stack(losses)] + [p.grad for p in model.parameters()]

    def bf16_copy():
        """The model in bf16 but for its rotary frequencies, kept in fp32, the dtype the rotary
        embedding makes them in (``.to(bf16)`` rounds the inv_freq buffer too: angles off by
        radians at position 2048, the same in both models, which would hide what is compared)."""
        model = copy.deepcopy(reference).to(BF16)
        for name, buffer in reference.named_buffers():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, buffer.float())
        return model

    ref = losses_and_grads(reference)
    eager = losses_and_grads(bf16_copy())
    ours = losses_and_grads(codetta.patch(bf16_copy()))
    for label, got in (("codetta", ours[0]), ("eager bf16", eager[0])):
        print(f"loss - fp64 loss, {label}:", " ".join(f"{d:+.2e}" for d in (got.double() - ref[0]).tolist()))
    names = [f"loss ({loss_batches} batches)"] + [n for n, _ in reference.named_parameters()]
    return [_row(f"patched Llama, 2 layers of 3.2-1B [{batch} x {seq}]", n, got, base, r)
            for n, got, base, r in zip(names, ours, eager, ref)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4093, help="rows (tokens) of the operator checks")
    parser.add_argument("--part", choices=["ops", "model", "all"], default="all")
    args = parser.parse_args()
    require_gpu("bench/training_shapes_check.py")
    rows = (check_ops(args.m) if args.part != "model" else []) + (check_model() if args.part != "ops" else [])
    columns = ["case", "what", "codetta_err", "eager_bf16_err", "ratio", "verdict"]
    table = markdown_table([{**r, "codetta_err": f"{r['codetta_err']:.2e}",
                             "eager_bf16_err": f"{r['eager_bf16_err']:.2e}"} for r in rows], columns)
    over = [r for r in rows if not r["ratio"] <= 2]  # NaN counts
    summary = f"{len(rows)} outputs and gradients, {len(over)} over 2x the unfused bf16 error"
    name = "training_shapes_check" + ("" if args.part == "all" else f"_{args.part}")
    path = write_results(name, rows, f"{table}\n\n{summary}")
    print(table, summary, f"written: {path}", sep="\n")


if __name__ == "__main__":
    main()

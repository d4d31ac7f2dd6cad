"""Transformer operators, forward and forward+backward, against their speed of light and the peers.

    python bench/ops_bench.py [--m 16384,4096] [--no-compile] [--compile-mode MODE] [--ops a,b,c,d,e]
                              [--shapes llama3-8b,paper-d2048,paper-d4096,paper-d8192]

Per op (the peers' ops a-e at Llama-3-8B shapes, or the CODA paper's at d = 2048, 4096, 8192:
FFN = round_up(8d/3, 256), vocabulary 32768): codetta, eager PyTorch written the usual
unfused way (the package's *_reference functions), torch.compile of that eager code
(mode "max-autotune-no-cudagraphs"), Liger-Kernel where it has the op (when importable),
and the SOL: the sum of the op's plain GEMMs timed
alone with torch.matmul (forward GEMMs for "fwd"; plus the dX and dW GEMMs for "fwd+bwd").
Ratios are time / SOL; "host/SOL" is the host's time to enqueue a call (above 1, the call is
bound by Python and launches, not the GPU). Peak memory of each forward+backward too. Writes
bench/results/ops_m<M>.{md,json} for the Llama-3-8B shapes (e.g. ops_m16384; the M list joined
by "_"), ops_<shapes>_m<M> for others."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codetta.ops import (  # noqa: E402
    cross_entropy,
    linear_cross_entropy,
    linear_residual,
    rmsnorm,
    rmsnorm_qkv_rope,
    rmsnorm_swiglu,
    rope,
    swiglu,
)

from common import markdown_table, median_ms, require_gpu, write_results  # noqa: E402

HD, EPS = 128, 1e-5


@dataclass(frozen=True)
class Shape:
    """The widths of one model: d, FFN, query and key/value heads (of HD = 128 each), vocabulary."""

    d: int
    ffn: int
    hq: int
    hkv: int
    vocab: int


def paper_shape(d: int) -> Shape:
    """The CODA paper's block at width d: FFN = round_up(8d/3, 256), 4 q heads per kv head, vocab 32768."""
    hq = d // HD
    return Shape(d, -(-8 * d // 3 // 256) * 256, hq, max(1, hq // 4), 32768)


SHAPES = {"llama3-8b": Shape(4096, 14336, 32, 8, 128256), **{f"paper-d{d}": paper_shape(d) for d in (2048, 4096, 8192)}}


def _param(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16().requires_grad_()


def cases(m, s: Shape):
    """name -> (inputs factory, codetta fn, eager fn, GEMM shapes (M, N, K) of the forward)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device="cuda").float() / HD))
    pos = torch.arange(m, device="cuda") % 8192

    def norm_weight():
        return _param(s.d, scale=0.1).detach().add_(1).requires_grad_()

    def a_inputs():
        return (_param(m, s.d), norm_weight(), _param(s.hq * HD, s.d, scale=s.d**-0.5),
                _param(s.hkv * HD, s.d, scale=s.d**-0.5), _param(s.hkv * HD, s.d, scale=s.d**-0.5))

    def b_inputs():
        return _param(m, s.d), _param(s.d, s.d, scale=s.d**-0.5), _param(m, s.d), norm_weight()

    def c_inputs():
        return _param(m, s.d), norm_weight(), _param(s.ffn, s.d, scale=s.d**-0.5), _param(s.ffn, s.d, scale=s.d**-0.5)

    def f_inputs():  # c with Llama's mlp_bias
        return (*c_inputs(), _param(s.ffn, scale=0.1), _param(s.ffn, scale=0.1))

    def d_inputs():
        return (_param(m, s.ffn), _param(s.d, s.ffn, scale=s.ffn**-0.5), _param(m, s.d))

    def e_inputs():
        return (_param(m, s.d), _param(s.vocab, s.d, scale=s.d**-0.5), torch.randint(0, s.vocab, (m,), device="cuda"),
                norm_weight())

    return {
        "a_qkv_rope": (a_inputs,
                       lambda x, g, wq, wk, wv: rmsnorm_qkv_rope(x, g, wq, wk, wv, pos, inv_freq, head_dim=HD, eps=EPS),
                       lambda x, g, wq, wk, wv: rope.rmsnorm_qkv_rope_reference(x, g, wq, wk, wv, pos, inv_freq,
                                                                                head_dim=HD, eps=EPS),
                       [(m, (s.hq + 2 * s.hkv) * HD, s.d)]),
        "g_qkv_rope_interleaved": (a_inputs,  # a with the interleaved RoPE (adjacent column pairs)
                                   lambda x, g, wq, wk, wv: rmsnorm_qkv_rope(x, g, wq, wk, wv, pos, inv_freq,
                                                                             head_dim=HD, eps=EPS, interleaved=True),
                                   lambda x, g, wq, wk, wv: rope.rmsnorm_qkv_rope_reference(
                                       x, g, wq, wk, wv, pos, inv_freq, head_dim=HD, eps=EPS, interleaved=True),
                                   [(m, (s.hq + 2 * s.hkv) * HD, s.d)]),
        "b_oproj_residual_norm": (b_inputs,
                                  lambda a, w, r, g: linear_residual(a, w, r, g, EPS),
                                  lambda a, w, r, g: _residual_then_norm(a, w, r, g),
                                  [(m, s.d, s.d)]),
        "c_gateup_swiglu": (c_inputs,
                            lambda x, g, wg, wu: rmsnorm_swiglu(x, g, wg, wu, EPS),
                            lambda x, g, wg, wu: swiglu.rmsnorm_swiglu_reference(x, g, wg, wu, EPS),
                            [(m, 2 * s.ffn, s.d)]),
        "h_gateup_geglu_tanh": (c_inputs,  # c gated by GELU's tanh form (Gemma's GeGLU)
                                lambda x, g, wg, wu: rmsnorm_swiglu(x, g, wg, wu, EPS, activation="gelu_tanh"),
                                lambda x, g, wg, wu: swiglu.rmsnorm_swiglu_reference(x, g, wg, wu, EPS,
                                                                                     activation="gelu_tanh"),
                                [(m, 2 * s.ffn, s.d)]),
        "f_gateup_swiglu_bias": (f_inputs,
                                 lambda x, g, wg, wu, bg, bu: rmsnorm_swiglu(x, g, wg, wu, EPS, bias=(bg, bu)),
                                 lambda x, g, wg, wu, bg, bu: swiglu.rmsnorm_swiglu_reference(x, g, wg, wu, EPS,
                                                                                              (bg, bu)),
                                 [(m, 2 * s.ffn, s.d)]),
        "d_down_residual": (d_inputs,
                            lambda y, w, r: linear_residual(y, w, r),
                            lambda y, w, r: rmsnorm.linear_residual_reference(y, w, r),
                            [(m, s.d, s.ffn)]),
        "e_lm_head_ce": (e_inputs,
                         lambda x, w, t, g: linear_cross_entropy(x, w, t, norm_weight=g, eps=EPS),
                         lambda x, w, t, g: cross_entropy.linear_cross_entropy_reference(x, w, t, norm_weight=g, eps=EPS),
                         [(m, s.vocab, s.d)]),
    }


def liger_variants(m, s: Shape):
    """Liger-Kernel versions of the ops it has (rope, rms_norm, fused add+rms_norm, swiglu, geglu,
    fused linear cross-entropy), written the way its Llama patch composes them; {} without it."""
    try:
        from liger_kernel.transformers import functional as lk
    except ImportError:
        return {}
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device="cuda").float() / HD))
    theta = (torch.arange(m, device="cuda") % 8192).float()[:, None] * inv_freq
    cos = torch.cat([theta.cos(), theta.cos()], -1).bfloat16()[None]
    sin = torch.cat([theta.sin(), theta.sin()], -1).bfloat16()[None]
    linear = torch.nn.functional.linear

    def heads(t, n):
        return t.view(1, m, n, HD).transpose(1, 2)

    def a(x, g, wq, wk, wv):
        h = lk.liger_rms_norm(x, g, EPS, in_place=False)
        q, k = lk.liger_rope(heads(linear(h, wq), s.hq), heads(linear(h, wk), s.hkv), cos, sin)
        return q, k, linear(h, wv)

    def b(a_, w, r, g):
        h, x1 = lk.liger_fused_add_rms_norm(linear(a_, w), r, g, EPS, in_place=False)
        return x1, h

    def c(x, g, wg, wu):
        h = lk.liger_rms_norm(x, g, EPS, in_place=False)
        return lk.liger_swiglu(linear(h, wg), linear(h, wu))

    def h(x, g, wg, wu):
        normed = lk.liger_rms_norm(x, g, EPS, in_place=False)
        return lk.liger_geglu(linear(normed, wg), linear(normed, wu))

    def e(x, w, t, g):
        return lk.liger_fused_linear_cross_entropy(lk.liger_rms_norm(x, g, EPS, in_place=False), w, t)

    return {"a_qkv_rope": a, "b_oproj_residual_norm": b, "c_gateup_swiglu": c, "h_gateup_geglu_tanh": h,
            "e_lm_head_ce": e}


def _residual_then_norm(a, w, r, g):
    x = torch.nn.functional.linear(a, w) + r
    return x, torch.nn.functional.rms_norm(x, (x.shape[-1],), g, EPS)


def _differentiable(out):
    """The outputs of an op that carry gradient, flattened out of nested tuples."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    flat = [o for item in outs for o in (item if isinstance(item, (tuple, list)) else (item,))]
    return [o for o in flat if isinstance(o, torch.Tensor) and o.requires_grad]


def sol_ms(gemms, backward):
    total = 0.0
    for m, n, k in gemms:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        total += median_ms(lambda: a @ w.t())
        if backward:
            total += median_ms(lambda: dy @ w) + median_ms(lambda: dy.t() @ a)
    return total


def host_ms(step, calls=20) -> float:
    """Host time of one ``step()`` in ms: the Python and launch cost of enqueueing its kernels,
    timed while the GPU is held busy (a step that waits for the GPU shows that wait). Where it
    exceeds the GPU time, the median of :func:`median_ms` measures the host, not the kernels."""
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 28)  # ~0.13 s of GPU cycles: the queue stays non-empty while the host enqueues
    start = time.perf_counter()
    for _ in range(calls):
        step()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def timed_step(fn, inputs, backward):
    """A call of fn(*inputs), with a backward from fixed random output gradients (made once, so
    that no loss computation is timed) into fresh .grad tensors; run once (compiled, tuned)."""
    outs = _differentiable(fn(*inputs))  # compile, tune
    # a scalar loss gets dL/dL = 1, as in training
    grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs] if backward else None

    def step():
        for t in inputs:  # a fresh .grad each time: no accumulation into the previous one
            t.grad = None
        out = fn(*inputs)
        if backward:
            torch.autograd.backward(_differentiable(out), grads)

    step()
    return step


def measure(fn, inputs, backward):
    """(median ms, host ms, peak GiB) of :func:`timed_step`."""
    step = timed_step(fn, inputs, backward)
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step)
    return ms, host_ms(step), torch.cuda.max_memory_allocated() / 2**30


def compare(row, variants, make, backward):
    """Adds each variant's time / SOL (row["sol_ms"]) and peak GiB to ``row``, inputs from ``make()``;
    a variant that fails is reported and left out, so that it cannot hide the others."""
    for label, fn in variants.items():
        try:
            ms, host, peak = measure(fn, make(), backward)
        except Exception as exc:
            print(f"{row} {label}: {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        row[f"{label}/SOL"], row[f"{label} host/SOL"], row[f"{label} GiB"] = ms / row["sol_ms"], host / row["sol_ms"], peak
    return row


def compare_passes(rows, head, variants, make, gemms, results):
    """The forward, then the forward+backward: a row each (``head``, the pass, its SOL, the
    variants' ratios), appended to ``rows`` and written to bench/results/``results`` at once."""
    for backward in (False, True):
        row = {**head, "pass": "fwd+bwd" if backward else "fwd", "sol_ms": sol_ms(gemms, backward)}
        rows.append(compare(row, variants, make, backward))
        print(row, flush=True)
        write_results(results, rows, table(rows))


def table(rows):
    return markdown_table(rows, list(dict.fromkeys(key for r in rows for key in r)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="16384", help="tokens, comma-separated (the loss op uses half of them, as the peers' anchors)")
    parser.add_argument("--ops", default="a,b,c,d,e", help="of a-h (f: c with biases, Llama's mlp_bias; g: a with the interleaved RoPE; "
                        "h: c with GELU's tanh form, Gemma's GeGLU)")
    parser.add_argument("--shapes", default="llama3-8b", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--compile-mode", default="max-autotune-no-cudagraphs")
    args = parser.parse_args()
    require_gpu("ops_bench")
    names = args.shapes.split(",")
    rows = []
    results = ("ops_" + ("" if names == ["llama3-8b"] else "_".join(names) + "_") + "m" + args.m.replace(",", "_")
               + ("" if args.ops == parser.get_default("ops") else "_ops_" + args.ops.replace(",", "")))
    for shape_name in names:
        shape = SHAPES[shape_name]
        for tokens in (int(v) for v in args.m.split(",")):
            for name in cases(tokens, shape):
                if name[0] not in args.ops.split(","):
                    continue
                m = tokens // 2 if name.startswith("e") else tokens
                make, ours, eager, gemms = cases(m, shape)[name]
                variants = {"codetta": ours, "eager": eager}
                if not args.no_compile:
                    variants["compile"] = torch.compile(eager, mode=args.compile_mode)
                liger = liger_variants(m, shape)
                if name in liger:
                    variants["liger"] = liger[name]
                compare_passes(rows, {"shape": shape_name, "op": name, "M": m}, variants, make, gemms, results)
    print(table(rows))


if __name__ == "__main__":
    main()

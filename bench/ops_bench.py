"""Transformer operators, forward and forward+backward, against their speed of light and the peers.

    python bench/ops_bench.py [--m 16384] [--no-compile] [--ops a,b,c,d,e]

Per op (ANCHORS.md's a-e at Llama-3-8B shapes): codetta, eager PyTorch written the usual
unfused way (the package's *_reference functions), torch.compile of that eager code
(mode "max-autotune-no-cudagraphs"), and the SOL: the sum of the op's plain GEMMs timed
alone with torch.matmul (forward GEMMs for "fwd"; plus the dX and dW GEMMs for "fwd+bwd").
Ratios are time / SOL. Peak memory of each forward+backward too. Writes
bench/results/ops.{md,json}. Status: written 2026-11-29, not yet run on the H200.
"""

from __future__ import annotations

import argparse
import sys
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

from common import markdown_table, median_ms, write_results  # noqa: E402

D, F, HQ, HKV, HD, VOCAB, EPS = 4096, 14336, 32, 8, 128, 128256, 1e-5


def _param(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16().requires_grad_()


def cases(m):
    """name -> (inputs factory, codetta fn, eager fn, GEMM shapes (M, N, K) of the forward)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device="cuda").float() / HD))
    pos = torch.arange(m, device="cuda") % 8192

    def a_inputs():
        return (_param(m, D), _param(D, scale=0.1).detach().add_(1).requires_grad_(),
                _param(HQ * HD, D, scale=D**-0.5), _param(HKV * HD, D, scale=D**-0.5), _param(HKV * HD, D, scale=D**-0.5))

    def b_inputs():
        return (_param(m, D), _param(D, D, scale=D**-0.5), _param(m, D), _param(D).detach().add_(1).requires_grad_())

    def c_inputs():
        return (_param(m, D), _param(D).detach().add_(1).requires_grad_(), _param(F, D, scale=D**-0.5),
                _param(F, D, scale=D**-0.5))

    def d_inputs():
        return (_param(m, F), _param(D, F, scale=F**-0.5), _param(m, D))

    def e_inputs():
        return (_param(m, D), _param(VOCAB, D, scale=D**-0.5), torch.randint(0, VOCAB, (m,), device="cuda"),
                _param(D).detach().add_(1).requires_grad_())

    return {
        "a_qkv_rope": (a_inputs,
                       lambda x, g, wq, wk, wv: rmsnorm_qkv_rope(x, g, wq, wk, wv, pos, inv_freq, head_dim=HD, eps=EPS),
                       lambda x, g, wq, wk, wv: rope.rmsnorm_qkv_rope_reference(x, g, wq, wk, wv, pos, inv_freq,
                                                                                head_dim=HD, eps=EPS),
                       [(m, (HQ + 2 * HKV) * HD, D)]),
        "b_oproj_residual_norm": (b_inputs,
                                  lambda a, w, r, g: linear_residual(a, w, r, g, EPS),
                                  lambda a, w, r, g: _residual_then_norm(a, w, r, g),
                                  [(m, D, D)]),
        "c_gateup_swiglu": (c_inputs,
                            lambda x, g, wg, wu: rmsnorm_swiglu(x, g, wg, wu, EPS),
                            lambda x, g, wg, wu: swiglu.rmsnorm_swiglu_reference(x, g, wg, wu, EPS),
                            [(m, 2 * F, D)]),
        "d_down_residual": (d_inputs,
                            lambda y, w, r: linear_residual(y, w, r),
                            lambda y, w, r: rmsnorm.linear_residual_reference(y, w, r),
                            [(m, D, F)]),
        "e_lm_head_ce": (e_inputs,
                         lambda x, w, t, g: linear_cross_entropy(x, w, t, norm_weight=g, eps=EPS),
                         lambda x, w, t, g: cross_entropy.linear_cross_entropy_reference(x, w, t, norm_weight=g, eps=EPS),
                         [(m, VOCAB, D)]),
    }


def _residual_then_norm(a, w, r, g):
    x = torch.nn.functional.linear(a, w) + r
    return x, torch.nn.functional.rms_norm(x, (x.shape[-1],), g, EPS)


def _loss(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    flat = [o for item in outs for o in (item if isinstance(item, (tuple, list)) else (item,))]
    return sum(o.float().sum() for o in flat if o.requires_grad)


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


def measure(fn, inputs, backward):
    def step():
        out = fn(*inputs)
        if backward:
            _loss(out).backward()

    step()  # compile, tune
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=16384, help="tokens (the loss op uses half of them, as ANCHORS)")
    parser.add_argument("--ops", default="a,b,c,d,e")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ops_bench needs a CUDA GPU")
    rows = []
    for name, (make, ours, eager, gemms) in cases(args.m).items():
        if name[0] not in args.ops.split(","):
            continue
        if name.startswith("e"):
            make, ours, eager, gemms = cases(args.m // 2)[name]
        variants = {"codetta": ours, "eager": eager}
        if not args.no_compile:
            variants["compile"] = torch.compile(eager, mode="max-autotune-no-cudagraphs")
        for backward in (False, True):
            sol = sol_ms(gemms, backward)
            row = {"op": name, "pass": "fwd+bwd" if backward else "fwd", "M": gemms[0][0], "sol_ms": sol}
            for label, fn in variants.items():
                ms, peak = measure(fn, make(), backward)
                row[f"{label}/SOL"] = ms / sol
                row[f"{label} GiB"] = peak
            rows.append(row)
            print(row, flush=True)
            write_results("ops", rows, markdown_table(rows, list(rows[0])))
    print(markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()

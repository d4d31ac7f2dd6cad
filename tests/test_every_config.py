"""Every tile config the GPU tuner may choose, on every operator, forward and backward (GPU only).

The tuner times its candidates and keeps the fastest; it skips a config that fails to
compile, but it cannot see one that computes a wrong result. The rest of the GPU suite runs
untuned (the first candidate), so here each operator runs with its GEMMs forced to the n-th
candidate, for every n, on shapes that leave the last column tile partly (or at most half)
full: d = 896 and V = 1152 (N % 256 = 128), QKV N = 1152, gate/up N = 2432. Each output and
gradient is compared with the operator's plain-PyTorch reference in fp64 (bf16 inputs; a
wrong config gives errors of order 1, bf16 rounding about 4e-3).
"""

import pytest
import torch
import torch.nn.functional as F

from codetta import ops
from codetta.matmul import launch, tuning
from codetta.ops.mlp import swiglu_mlp_reference
from codetta.ops.rmsnorm import linear_residual_reference
from codetta.ops.rope import rmsnorm_qkv_rope_reference
from conftest import DEVICE, INTERPRET

pytestmark = pytest.mark.skipif(INTERPRET, reason="the GPU tuner's candidates; the interpreter has a config of its own")

M, D, FFN, V, HEAD, HQ, HKV, EPS = 300, 896, 1216, 1152, 128, 7, 1, 1e-5
MAX_CANDIDATES = 19  # the Hopper tables with their flattened variants (codetta.matmul.config)
TOL = 3e-2


@pytest.fixture
def nth_candidate(monkeypatch):
    """Make every GEMM of this test take the n-th of its tuning candidates (cycling)."""
    chosen = []

    def use(n):
        def choose(key, configs, bench, prepare=None, cannot_time=None):
            chosen.append(configs[n % len(configs)])
            return chosen[-1]

        monkeypatch.setattr(tuning, "choose", choose)
        monkeypatch.setattr(launch, "_PLANS", {})
        return chosen

    return use


def param(*shape, scale=1.0):
    return (scale * torch.randn(*shape, device=DEVICE)).to(torch.bfloat16).requires_grad_()


def norm_weight(n=None):
    return (1 + 0.2 * torch.randn(n or D, device=DEVICE)).to(torch.bfloat16).requires_grad_()


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check(fused, reference, inputs):
    """Outputs and input gradients (random gradients of the differentiable outputs) of ``fused``
    on bf16 ``inputs`` against ``reference`` on their fp64 copies."""
    outs = fused(*inputs)
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    refs = reference(*leaves64)
    assert len(outs) == len(refs)
    pairs = [(o, r, torch.randn_like(r)) for o, r in zip(outs, refs) if o.requires_grad]  # not the statistics
    grads = torch.autograd.grad(sum((o.double() * dy).sum() for o, _, dy in pairs), inputs, allow_unused=True)
    grads64 = torch.autograd.grad(sum((r * dy).sum() for _, r, dy in pairs), leaves64, allow_unused=True)
    assert [g is None for g in grads] == [g is None for g in grads64]  # e.g. the next norm's weight: no gradient
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert rel_err(o, r) < TOL, f"output {i}: {rel_err(o, r)}"
    for i, (g, r) in enumerate(zip(grads, grads64)):
        if r is not None:
            assert rel_err(g, r) < TOL, f"gradient {i}: {rel_err(g, r)}"


def _rstd(x):
    return torch.rsqrt(x.double().square().mean(-1) + EPS)


@pytest.mark.parametrize("n", range(MAX_CANDIDATES))
def test_linear_residual_with_next_norm_statistics(n, nth_candidate):
    chosen = nth_candidate(n)

    def fused(a, w, residual, g):
        x, (u, rstd) = ops.linear_residual(a, w, residual, g, EPS)
        return x, u, rstd

    def reference(a, w, residual, g):
        x = linear_residual_reference(a, w, residual)
        return x, x * g, _rstd(x)

    check(fused, reference, [param(M, D), param(D, D, scale=D**-0.5), param(M, D), norm_weight()])
    assert chosen


@pytest.mark.parametrize("variant", ["plain", "bias", "bias_qk_norm"])
@pytest.mark.parametrize("n", range(MAX_CANDIDATES))
def test_rmsnorm_qkv_rope(n, variant, nth_candidate):
    """q, k and v stored per part of B; the backward reads them back (plain), or not (bias, QK-norm)."""
    chosen = nth_candidate(n)
    positions = torch.randint(0, 70000, (M,), device=DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD, 2, device=DEVICE).float() / HEAD))
    s = D**-0.5
    extra = [param(HQ * HEAD), param(HKV * HEAD), param(HKV * HEAD)] if variant != "plain" else []
    extra += [norm_weight(HEAD), norm_weight(HEAD)] if variant == "bias_qk_norm" else []

    def keywords(extra):
        return dict(bias=tuple(extra[:3]) or None, **(dict(q_norm_weight=extra[3], k_norm_weight=extra[4],
                                                                qk_norm_eps=EPS) if len(extra) > 3 else {}))

    def fused(x, g, wq, wk, wv, *extra):
        return ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, positions, inv_freq, head_dim=HEAD, eps=EPS, **keywords(extra))

    def reference(x, g, wq, wk, wv, *extra):
        return rmsnorm_qkv_rope_reference(x, g, wq, wk, wv, positions, inv_freq, head_dim=HEAD, eps=EPS,
                                          **keywords(extra))

    check(fused, reference, [param(M, D), norm_weight(), param(HQ * HEAD, D, scale=s), param(HKV * HEAD, D, scale=s),
                             param(HKV * HEAD, D, scale=s), *extra])
    assert chosen


@pytest.mark.parametrize("n", range(MAX_CANDIDATES))
def test_swiglu_mlp_with_next_norm_statistics(n, nth_candidate):
    chosen = nth_candidate(n)

    def fused(x, g, wg, wu, wd, g_next):
        x2, (u2, rstd2) = ops.swiglu_mlp(x, g, wg, wu, wd, EPS, next_norm_weight=g_next, next_eps=EPS)
        return x2, u2, rstd2

    def reference(x, g, wg, wu, wd, g_next):
        x2 = swiglu_mlp_reference(x, g, wg, wu, wd, EPS)
        return x2, x2 * g_next, _rstd(x2)

    check(fused, reference, [param(M, D), norm_weight(), param(FFN, D, scale=D**-0.5), param(FFN, D, scale=D**-0.5),
                             param(D, FFN, scale=FFN**-0.5), norm_weight()])
    assert chosen


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("n", range(MAX_CANDIDATES))
def test_linear_cross_entropy(n, reduction, nth_candidate):
    chosen = nth_candidate(n)
    target = torch.randint(0, V, (M,), device=DEVICE)
    target[::7] = -100

    def fused(x, w, b, g):
        return (ops.linear_cross_entropy(x, w, target, bias=b, norm_weight=g, eps=EPS, reduction=reduction),)

    def reference(x, w, b, g):
        return (F.cross_entropy(F.linear(F.rms_norm(x, (D,), g, EPS), w, b), target, reduction=reduction),)

    check(fused, reference, [param(M, D), param(V, D, scale=D**-0.5), param(V), norm_weight()])
    assert chosen

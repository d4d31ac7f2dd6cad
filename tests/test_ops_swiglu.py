"""RMSNorm -> gate/up -> SwiGLU fused (codetta.ops.rmsnorm_swiglu): output and every gradient.

The reference is the usual unfused module math (F.rms_norm, two F.linear, F.silu) in fp64.
"""

import pytest
import torch
import torch.nn.functional as F

from codetta.ops import linear_residual, rmsnorm_swiglu
from conftest import DEVICE, INTERPRET

EPS = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def unfused(x, g, wg, wu):
    h = F.rms_norm(x, (x.shape[-1],), g, EPS)
    return F.silu(F.linear(h, wg)) * F.linear(h, wu)


def inputs(shape, f):
    d = shape[-1]
    return (torch.randn(*shape, device=DEVICE) * 2, 1 + 0.2 * torch.randn(d, device=DEVICE),
            torch.randn(f, d, device=DEVICE) / d**0.5, torch.randn(f, d, device=DEVICE) / d**0.5)


def run(fn, tensors, dy, dtype):
    leaves = [t.to(dtype).detach().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy.to(dtype))
    return [y] + [t.grad for t in leaves]


@pytest.mark.parametrize("shape,f", [((1, 16), 8), ((37, 24), 20), ((2, 9, 32), 44)], ids=str)
def test_forward_backward_fp32(shape, f):
    tensors = inputs(shape, f)
    dy = torch.randn(*shape[:-1], f, device=DEVICE)
    ours = run(lambda *t: rmsnorm_swiglu(*t, eps=EPS), tensors, dy, torch.float32)
    ref = run(unfused, tensors, dy, torch.float64)
    assert ours[0].shape == ref[0].shape
    for name, a, b in zip(("y", "dx", "dnorm_weight", "dw_gate", "dw_up"), ours, ref):
        assert rel(a, b) < 2e-5, name


def test_bf16_within_twice_eager_error():
    shape, f = ((64, 48), 40) if INTERPRET else ((2048, 1024), 2816)
    tensors = inputs(shape, f)
    dy = torch.randn(*shape[:-1], f, device=DEVICE)
    ours = run(lambda *t: rmsnorm_swiglu(*t, eps=EPS), tensors, dy, torch.bfloat16)
    eager = run(unfused, tensors, dy, torch.bfloat16)
    ref = run(unfused, tensors, dy, torch.float64)
    for name, a, e, r in zip(("y", "dx", "dnorm_weight", "dw_gate", "dw_up"), ours, eager, ref):
        assert rel(a, r) <= 2 * rel(e, r) + 1e-4, name


def test_with_producer_stats():
    m, k, d, f = 21, 16, 32, 24
    a, wo, x = torch.randn(m, k, device=DEVICE), torch.randn(d, k, device=DEVICE) / 4, torch.randn(m, d, device=DEVICE)
    g, wg, wu = 1 + 0.2 * torch.randn(d, device=DEVICE), torch.randn(f, d, device=DEVICE) / 6, torch.randn(f, d, device=DEVICE) / 6
    dy = torch.randn(m, f, device=DEVICE)

    def fused(a, wo, x, g, wg, wu):
        x1, stats = linear_residual(a, wo, x, g, EPS)
        return rmsnorm_swiglu(x1, g, wg, wu, EPS, stats=stats)

    def ref(a, wo, x, g, wg, wu):
        return unfused(F.linear(a, wo) + x, g, wg, wu)

    for ours, theirs in zip(run(fused, (a, wo, x, g, wg, wu), dy, torch.float32),
                            run(ref, (a, wo, x, g, wg, wu), dy, torch.float64)):
        assert rel(ours, theirs) < 2e-5


def test_bad_inputs():
    x, g, wg, wu = inputs((4, 8), 6)
    with pytest.raises(ValueError, match="differ"):
        rmsnorm_swiglu(x, g, wg, wu[:5])
    with pytest.raises(ValueError, match="weight 1 must be"):
        rmsnorm_swiglu(x, g, wg, torch.randn(6, 7, device=DEVICE))


def test_custom_op_passes_opcheck():
    x, g, wg, wu = (t.requires_grad_() for t in inputs((6, 16), 8))
    torch.library.opcheck(torch.ops.codetta.rmsnorm_swiglu.default, (x, g, wg, wu, EPS, None, None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

"""codetta.ops.rms_norm (the standalone RMSNorm) against PyTorch's own F.rms_norm in fp64:
forward, both gradients, odd widths and leading dims, Gemma's fp32 weight with a 16-bit x,
the 2x rule in bf16, bad inputs, and the custom op under opcheck and torch.compile."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from codetta.ops import rms_norm
from conftest import DEVICE

EPS = 1e-6


def reference(x, weight, eps=EPS, dtype=torch.float64):
    """F.rms_norm in ``dtype`` from the same values, and its gradients for ``dh``."""
    x64, w64 = (t.detach().to(dtype).requires_grad_() for t in (x, weight))
    return F.rms_norm(x64, (x.shape[-1],), w64, eps), x64, w64


def rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", [(7, 37), (2, 5, 64), (1, 3), (3, 300)], ids=str)
def test_forward_and_gradients_fp32(shape):
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    weight = (1 + 0.3 * torch.randn(shape[-1], device=DEVICE)).requires_grad_()
    dh = torch.randn(shape, device=DEVICE)
    h = rms_norm(x, weight, EPS)
    dx, dw = torch.autograd.grad(h, (x, weight), dh)
    want, x64, w64 = reference(x, weight)
    dx64, dw64 = torch.autograd.grad(want, (x64, w64), dh.double())
    assert h.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == weight.dtype
    for got, expected in ((h, want), (dx, dx64), (dw, dw64)):
        assert rel(got, expected) < 2e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_eager_error(dtype):
    """Against the fp64 norm; eager PyTorch's F.rms_norm in ``dtype`` is the yardstick."""
    x = (3 * torch.randn(64, 96, device=DEVICE)).to(dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(96, device=DEVICE)).to(dtype).requires_grad_()
    dh = torch.randn(64, 96, device=DEVICE).to(dtype)
    ours = (rms_norm(x, weight, EPS), *torch.autograd.grad(rms_norm(x, weight, EPS), (x, weight), dh))
    eager_h, xe, we = reference(x, weight, dtype=dtype)
    eager = (eager_h, *torch.autograd.grad(eager_h, (xe, we), dh))
    exact_h, x64, w64 = reference(x, weight)
    exact = (exact_h, *torch.autograd.grad(exact_h, (x64, w64), dh.double()))
    for name, got, ref, want in zip(("h", "dx", "dweight"), ours, eager, exact):
        assert got.dtype == dtype, name
        assert rel(got, want) <= 2 * rel(ref, want) + 1e-6, (name, rel(got, want), rel(ref, want))


def test_fp32_weight_with_bf16_x_rounds_once_to_x_dtype():
    """Gemma's norm: (1 + w) made in fp32, x in bf16, the product in fp32 rounded once (its
    ``output.type_as(x)``); the weight's gradient in fp32, x's in bf16."""
    x = torch.randn(9, 40, device=DEVICE).to(torch.bfloat16).requires_grad_()
    w = (0.2 * torch.randn(40, device=DEVICE)).requires_grad_()
    h = rms_norm(x, w.float() + 1.0, EPS)
    expected = (F.rms_norm(x.detach().double(), (40,), w.detach().double() + 1, EPS)).to(torch.bfloat16)
    assert h.dtype == torch.bfloat16
    assert (h.float() - expected.float()).abs().max().item() <= 2 ** -8 * expected.float().abs().max().item()
    h.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


def test_fp16_weight_with_bf16_x():
    """An fp16 model's norm weight beside the bf16 x that bf16 autocast made of its input: the
    norm in fp32, rounded once to x's dtype; each gradient in its input's dtype."""
    x = torch.randn(9, 40, device=DEVICE).to(torch.bfloat16).requires_grad_()
    w = (1 + 0.2 * torch.randn(40, device=DEVICE)).to(torch.float16).requires_grad_()
    dh = torch.randn(9, 40, device=DEVICE).to(torch.bfloat16)
    h = rms_norm(x, w, EPS)
    dx, dw = torch.autograd.grad(h, (x, w), dh)
    want, x64, w64 = reference(x, w)
    dx64, dw64 = torch.autograd.grad(want, (x64, w64), dh.double())
    assert (h.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float16)
    for got, expected in ((h, want), (dx, dx64), (dw, dw64)):
        assert rel(got, expected) < 8e-3


def test_output_dtype_may_be_wider():
    x = torch.randn(4, 24, device=DEVICE).to(torch.bfloat16)
    w = torch.rand(24, device=DEVICE)
    h = rms_norm(x, w, EPS, dtype=torch.float32)
    assert h.dtype == torch.float32
    assert rel(h, reference(x, w)[0]) < 2e-6


def test_no_rows():
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    w = torch.ones(16, device=DEVICE, requires_grad=True)
    h = rms_norm(x, w)
    h.sum().backward()
    assert h.shape == (0, 16) and torch.equal(w.grad, torch.zeros(16, device=DEVICE))


def test_meta_tensors_get_the_shapes_forward_and_backward():
    """On the meta device rms_norm gives shapes and dtypes as F.rms_norm does, like the other
    operators (test_direct_ops.py); a probe found it refusing them."""
    x = torch.randn(2, 3, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, device="meta", requires_grad=True)
    h = rms_norm(x, w, EPS)
    assert h.is_meta and h.shape == x.shape and h.dtype == torch.bfloat16
    h.sum().backward()
    assert (x.grad.shape, x.grad.dtype, w.grad.shape, w.grad.dtype) == (x.shape, x.dtype, w.shape, w.dtype)


@pytest.mark.parametrize("args, message", [
    (lambda x, w: (x.double(), w.double()), "x must be a tensor"),
    (lambda x, w: (x, w[:-1]), "weight must be a \\[16\\] tensor"),
    (lambda x, w: (x, w.double()), "weight must be a \\[16\\] tensor in one of"),
    (lambda x, w: (x, w.reshape(1, 16)), "weight must be"),
    (lambda x, w: ("x", w), "x must be a tensor"),
])
def test_bad_inputs_are_refused(args, message):
    x, w = args(torch.randn(3, 16, device=DEVICE), torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match=message):
        rms_norm(x, w)


def test_bad_eps_and_dtype_are_refused():
    x, w = torch.randn(3, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="^rms_norm: eps must be a number >= 0"):
        rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        rms_norm(x, w, dtype=torch.int32)


def test_opcheck():
    x, w = torch.randn(5, 24, device=DEVICE, requires_grad=True), torch.rand(24, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.codetta.rms_norm.default, (x, w, EPS, torch.float32))
    dh, rstd = torch.randn(5, 24, device=DEVICE), torch.rand(5, device=DEVICE)
    torch.library.opcheck(torch.ops.codetta.rms_norm_backward.default, (dh, x.detach(), w.detach(), rstd))


def test_torch_compile_traces_without_graph_break():
    """Also without a warning of Dynamo's (found by a probe: it warned of tracing through the
    functools caches of codetta's device checks, on every compile without a GPU)."""
    x = torch.randn(2, 6, 32, device=DEVICE, requires_grad=True)
    w = (1 + 0.3 * torch.randn(32, device=DEVICE)).requires_grad_()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: rms_norm(x, w, EPS) * 2, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = compiled(x, w)
    assert not [str(c.message) for c in caught if "Dynamo" in str(c.message)]
    dx, dw = torch.autograd.grad(h.sum(), (x, w))
    want, x64, w64 = reference(x, w)
    dx64, dw64 = torch.autograd.grad((2 * want).sum(), (x64, w64))
    assert rel(h, 2 * want) < 2e-6 and rel(dx, dx64) < 2e-6 and rel(dw, dw64) < 2e-6

"""RMSNorm folded into GEMMs (codetta.ops.rmsnorm): outputs and every gradient.

References are written the usual unfused way (F.rms_norm, F.linear) in float64.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from codetta.kernels.rmsnorm import rmsnorm, rmsnorm_backward, rmsnorm_stats
from codetta.ops import linear_residual, rmsnorm_linear
from codetta.ops.rmsnorm import rmsnorm_linear_reference
from conftest import DEVICE, INTERPRET

EPS = 1e-6


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def leaf(t, dtype=torch.float32):
    return t.to(dtype).detach().requires_grad_()


def unfused(x, g, ws, eps=EPS):
    return F.linear(F.rms_norm(x, (x.shape[-1],), g, eps), torch.cat(ws))


@pytest.mark.parametrize("shape", [(1, 8), (37, 50), (2, 5, 72)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stats_kernel(shape, dtype):
    """u = x g rounded once to x's dtype, rstd = rsqrt(mean x^2 + eps) to fp32 accuracy, from a row view."""
    d = shape[-1]
    x = (torch.randn(*shape[:-1], d + 3, device=DEVICE) * 3).to(dtype)[..., :d]  # rows with a stride
    g = (1 + 0.2 * torch.randn(d, device=DEVICE)).to(dtype)
    u, rstd = rmsnorm_stats(x, g, EPS)
    x64 = x.double().reshape(-1, d)
    assert torch.equal(u, (x64 * g.double()).to(dtype))  # a product of two bf16 is exact in fp32
    assert rel(rstd, torch.rsqrt(x64.square().mean(-1) + EPS)) < 1e-6


@pytest.mark.parametrize("shape", [(1, 8), (37, 50), (2, 5, 72)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rmsnorm_kernel(shape, dtype):
    """h = x rstd g in fp32, rounded once: within fp32 rounding of the fp64 value before that
    rounding (bf16: at most one bf16 step off, from ties), from rows with a stride."""
    d = shape[-1]
    x = (torch.randn(*shape[:-1], d + 3, device=DEVICE) * 3).to(dtype)[..., :d]
    g = (1 + 0.2 * torch.randn(d, device=DEVICE)).to(dtype)
    h, rstd = rmsnorm(x, g, EPS)
    x64 = x.double().reshape(-1, d)
    r64 = torch.rsqrt(x64.square().mean(-1) + EPS)
    h64 = x64 * r64[:, None] * g.double()
    assert h.shape == x64.shape and h.dtype == dtype and rstd.dtype == torch.float32
    assert rel(rstd, r64) < 1e-6
    step = torch.finfo(dtype).eps * h64.abs()
    assert ((h.double() - h64).abs() <= step + 1e-6 * h64.abs().max()).all()


@pytest.mark.parametrize("shape", [(1, 8), (37, 50), (70, 72)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rmsnorm_backward_kernel(shape, dtype):
    """dx and dg of h = RMSNorm(x) against fp64 autograd of F.rms_norm; dx written into a view of
    a NaN-poisoned larger tensor (nothing else written), in fp32 and in x's dtype."""
    m, d = shape
    x = (torch.randn(m, d, device=DEVICE) * 3).to(dtype)
    g = (1 + 0.2 * torch.randn(d, device=DEVICE)).to(dtype)
    dh = torch.randn(m, d, device=DEVICE).to(dtype)
    xr, gr = leaf(x, torch.float64), leaf(g, torch.float64)
    F.rms_norm(xr, (d,), gr, EPS).backward(dh.double())
    _, rstd = rmsnorm(x, g, EPS)
    dx32, dg = rmsnorm_backward(x, g, rstd, dh)
    assert dx32.dtype == torch.float32 and dg.dtype == torch.float32
    assert rel(dx32, xr.grad) < 1e-5 and rel(dg, gr.grad) < 1e-5
    big = torch.full((m + 2, d + 5), float("nan"), device=DEVICE, dtype=dtype)
    dx_out = big[1:m + 1, 2:2 + d]
    dx, dg2 = rmsnorm_backward(x, g, rstd, dh, dx_out=dx_out)
    assert dx.data_ptr() == dx_out.data_ptr() and torch.equal(dg2, dg)
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[1:m + 1, 2:2 + d] = True
    assert big[~inside].isnan().all()
    assert torch.equal(dx_out, dx32.to(dtype))  # rounded once from the same fp32 values


def test_rmsnorm_backward_empty_and_bad_shapes():
    g = torch.ones(8, device=DEVICE)
    dx, dg = rmsnorm_backward(torch.randn(0, 8, device=DEVICE), g, torch.empty(0, device=DEVICE),
                              torch.randn(0, 8, device=DEVICE))
    assert dx.shape == (0, 8) and torch.equal(dg, torch.zeros(8, device=DEVICE))
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="do not match"):
        rmsnorm_backward(x, g, torch.ones(3, device=DEVICE), x)
    with pytest.raises(ValueError, match="dx_out"):
        rmsnorm_backward(x, g, torch.ones(4, device=DEVICE), x, dx_out=torch.empty(8, 4, device=DEVICE).t())


@pytest.mark.parametrize("shape", [(1, 8), (33, 40), (2, 5, 24)], ids=str)
@pytest.mark.parametrize("n_out", [(56,), (24, 16, 16), (8, 16, 8, 24, 8, 16)],
                         ids=["one_weight", "qkv_parts", "more_parts_than_gemm_reads_as_one"])
def test_rmsnorm_linear_forward_backward_fp32(shape, n_out):
    d = shape[-1]
    x = torch.randn(*shape, device=DEVICE) * 3
    g = 1 + 0.2 * torch.randn(d, device=DEVICE)
    ws = [torch.randn(n, d, device=DEVICE) / d**0.5 for n in n_out]
    dz = torch.randn(*shape[:-1], sum(n_out), device=DEVICE)

    xs, gs, wss = leaf(x), leaf(g), [leaf(w) for w in ws]
    z = rmsnorm_linear(xs, gs, wss if len(ws) > 1 else wss[0], EPS)
    z.backward(dz)

    xr, gr, wr = leaf(x, torch.float64), leaf(g, torch.float64), [leaf(w, torch.float64) for w in ws]
    zr = unfused(xr, gr, wr)
    zr.backward(dz.double())

    assert z.shape == zr.shape and z.dtype == torch.float32
    assert rel(z, zr) < 1e-5
    assert rel(rmsnorm_linear_reference(xr, gr, wr if len(wr) > 1 else wr[0], EPS), zr) < 1e-12  # the shipped one
    assert rel(xs.grad, xr.grad) < 1e-5
    assert rel(gs.grad, gr.grad) < 1e-5
    for w, wref in zip(wss, wr):
        assert rel(w.grad, wref.grad) < 1e-5


def test_producer_then_consumer_chain_fp32():
    """x1 = a W_o^T + x; z = RMSNorm(x1) W^T with the producer's (u, rstd): all gradients."""
    m, k, d, n = 29, 24, 40, 48
    a, wo, x = torch.randn(m, k, device=DEVICE), torch.randn(d, k, device=DEVICE) / k**0.5, torch.randn(m, d, device=DEVICE)
    g, w = 1 + 0.2 * torch.randn(d, device=DEVICE), torch.randn(n, d, device=DEVICE) / d**0.5
    dz, dx1 = torch.randn(m, n, device=DEVICE), torch.randn(m, d, device=DEVICE)

    leaves = [leaf(t) for t in (a, wo, x, g, w)]
    x1, stats = linear_residual(leaves[0], leaves[1], leaves[2], leaves[3], EPS)
    z = rmsnorm_linear(x1, leaves[3], leaves[4], EPS, stats=stats)
    ((z * dz).sum() + (x1 * dx1).sum()).backward()

    refs = [leaf(t, torch.float64) for t in (a, wo, x, g, w)]
    x1r = F.linear(refs[0], refs[1]) + refs[2]
    zr = unfused(x1r, refs[3], [refs[4]])
    ((zr * dz.double()).sum() + (x1r * dx1.double()).sum()).backward()

    assert rel(x1, x1r) < 1e-5 and rel(z, zr) < 1e-5
    u, rstd = stats
    assert rel(u, x1r * refs[3]) < 1e-5
    assert rel(rstd, torch.rsqrt(x1r.square().mean(-1) + EPS)) < 1e-6
    for ours, ref in zip(leaves, refs):
        assert rel(ours.grad, ref.grad) < 1e-5


def test_producer_without_norm():
    a, w, r = torch.randn(9, 16, device=DEVICE), torch.randn(24, 16, device=DEVICE), torch.randn(9, 24, device=DEVICE)
    x = linear_residual(a, w, r)
    assert rel(x, a.double() @ w.double().t() + r.double()) < 1e-6


def test_producer_with_bias_gradients():
    """x = a W^T + b + residual (an o_proj with bias): output and the gradients of a, W, b, residual."""
    tensors = [torch.randn(9, 16, device=DEVICE), torch.randn(24, 16, device=DEVICE), torch.randn(24, device=DEVICE),
               torch.randn(9, 24, device=DEVICE)]
    dx = torch.randn(9, 24, device=DEVICE)
    ours = [leaf(t) for t in tensors]
    ref = [leaf(t, torch.float64) for t in tensors]
    x = linear_residual(ours[0], ours[1], ours[3], bias=ours[2])
    (x * dx).sum().backward()
    (F.linear(ref[0], ref[1], ref[2]) + ref[3]).mul(dx.double()).sum().backward()
    assert rel(x, F.linear(*ref[:3]) + ref[3]) < 1e-6
    for a, b in zip(ours, ref):
        assert rel(a.grad, b.grad) < 1e-5


@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "next_norm"])
def test_producer_with_a_frozen_weight_keeps_none_of_its_input(with_norm):
    """A frozen weight (a LoRA model's o_proj, down_proj) needs no wgrad, so the input a [M, K] is
    not kept for the backward (as F.linear keeps none); the gradients of a and residual are still
    right, and a weight unfrozen after the forward gets none, as in PyTorch."""
    a, r = leaf(torch.randn(2, 9, 16, device=DEVICE)), leaf(torch.randn(2, 9, 24, device=DEVICE))
    w = torch.randn(24, 16, device=DEVICE)
    g = 1 + 0.2 * torch.randn(24, device=DEVICE) if with_norm else None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = linear_residual(a, w, r, g, EPS)
    x = out[0] if with_norm else out
    kept = [t for t in saved if t is not w]  # nor a view of a, which would keep all of a's storage
    assert not any(t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for t in kept)
    w.requires_grad_()
    dx = torch.randn(2, 9, 24, device=DEVICE)
    (x * dx).sum().backward()
    assert w.grad is None
    assert rel(a.grad, dx.double() @ w.detach().double()) < 1e-5 and rel(r.grad, dx.double()) < 1e-6


@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "next_norm"])
def test_producer_with_branch_scale(with_norm):
    """x = residual + s (a W^T + b) (Granite's residual multiplier s): output, the next norm's
    statistics of x and the gradients of a, W, b (all scaled by s) and residual (not) against fp64."""
    s = 0.22
    tensors = [torch.randn(2, 9, 16, device=DEVICE), torch.randn(24, 16, device=DEVICE), torch.randn(24, device=DEVICE),
               torch.randn(2, 9, 24, device=DEVICE)]
    g = 1 + 0.2 * torch.randn(24, device=DEVICE)
    dx = torch.randn(2, 9, 24, device=DEVICE)
    ours = [leaf(t) for t in tensors]
    ref = [leaf(t, torch.float64) for t in tensors]
    out = linear_residual(ours[0], ours[1], ours[3], g if with_norm else None, EPS, bias=ours[2], branch_scale=s)
    x = out[0] if with_norm else out
    (x * dx).sum().backward()
    xr = ref[3] + s * F.linear(*ref[:3])
    xr.mul(dx.double()).sum().backward()
    assert rel(x, xr) < 1e-6
    for a, b in zip(ours, ref):
        assert rel(a.grad, b.grad) < 1e-5
    if with_norm:
        u, rstd = out[1]
        assert rel(rstd, torch.rsqrt(xr.detach().square().mean(-1) + EPS).reshape(-1)) < 1e-6
        assert rel(u, (xr.detach() * g.double()).reshape(-1, 24)) < 1e-6
    for bad in (float("nan"), float("inf"), True, "0.5", torch.tensor(0.5)):
        with pytest.raises(ValueError, match="branch_scale must be a finite real number"):
            linear_residual(*tensors[:2], tensors[3], branch_scale=bad)


def test_bf16_within_twice_eager_error():
    """bf16 in and out: errors vs fp64 no more than twice eager PyTorch's bf16 errors.

    The interpreter computes bf16 products exactly in fp32 and rounds stores to nearest
    even, as the GPU does, so this runs on both.
    """
    m, d, n = (64, 48, 80) if INTERPRET else (1024, 512, 768)
    x = torch.randn(m, d, device=DEVICE) * 2
    g = 1 + 0.2 * torch.randn(d, device=DEVICE)
    w = torch.randn(n, d, device=DEVICE) / d**0.5
    dz = torch.randn(m, n, device=DEVICE)
    ref_leaves = [leaf(t, torch.float64) for t in (x, g, w)]
    zr = unfused(ref_leaves[0], ref_leaves[1], [ref_leaves[2]])
    zr.backward(dz.double())
    results = {}
    for name, fn in (("codetta", lambda x, g, w: rmsnorm_linear(x, g, w, EPS)),
                     ("eager", lambda x, g, w: unfused(x, g, [w]))):
        ls = [leaf(t, torch.bfloat16) for t in (x, g, w)]
        z = fn(*ls)
        z.backward(dz.bfloat16())
        results[name] = [z] + [t.grad for t in ls]
    refs = [zr] + [t.grad for t in ref_leaves]
    for ours, eager, ref in zip(results["codetta"], results["eager"], refs):
        assert rel(ours, ref) <= 2 * rel(eager, ref) + 1e-4


def test_bad_inputs():
    x = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="norm_weight must be"):
        rmsnorm_linear(x, torch.ones(7, device=DEVICE), torch.randn(5, 8, device=DEVICE))
    with pytest.raises(ValueError, match="weight must be"):
        rmsnorm_linear(x, torch.ones(8, device=DEVICE), torch.randn(5, 7, device=DEVICE))
    with pytest.raises(ValueError, match="residual"):
        linear_residual(x, torch.randn(6, 8, device=DEVICE), torch.randn(4, 5, device=DEVICE))


def test_stats_must_be_those_of_the_x_norm_weight_and_eps_given():
    """Statistics handed to a consumer are checked to come from that very x (unchanged since),
    with the same norm weight and eps: otherwise the norm would be silently wrong."""
    m, k, d = 5, 16, 32
    a, wo, res = torch.randn(m, k, device=DEVICE), torch.randn(d, k, device=DEVICE) / 4, torch.randn(m, d, device=DEVICE)
    g, w = 1 + 0.1 * torch.randn(d, device=DEVICE), torch.randn(24, d, device=DEVICE) / 6
    x1, stats = linear_residual(a, wo, res, g, EPS)
    u, rstd = stats
    for given in (stats, (u, rstd)):  # as returned, or unpacked and handed on as a plain pair
        z = rmsnorm_linear(x1, g, w, EPS, stats=given)  # the right pair: taken
        assert rel(z, unfused(x1.double(), g.double(), [w.double()])) < 1e-5
        with pytest.raises(ValueError, match="another tensor than x"):
            rmsnorm_linear(torch.randn(m, d, device=DEVICE), g, w, EPS, stats=given)
        with pytest.raises(ValueError, match="another norm_weight"):
            rmsnorm_linear(x1, g.clone(), w, EPS, stats=given)
        with pytest.raises(ValueError, match="made with eps"):
            rmsnorm_linear(x1, g, w, 1e-2, stats=given)
    x1.mul_(2)  # changed in place after the producer
    for given in (stats, (u, rstd)):
        with pytest.raises(ValueError, match="changed in place"):
            rmsnorm_linear(x1, g, w, EPS, stats=given)
    # a pair of the caller's own tensors is taken as it is (here the statistics of x1 before its change)
    z = rmsnorm_linear(x1, g, w, EPS, stats=(u.clone(), rstd.clone()))
    assert rel(z, unfused(x1.double() / 2, g.double(), [w.double()])) < 1e-5


def test_stats_refused_for_a_reordered_view_of_x():
    """A view of x over the same memory whose rows come in another order (x [B, S, d]
    transposed to [S, B, d]) is not x: its statistics would be silently the wrong rows'.
    A reshape that keeps the rows' order is x."""
    b, s, k, d = 2, 3, 16, 32
    a, wo = torch.randn(b, s, k, device=DEVICE), torch.randn(d, k, device=DEVICE) / 4
    res, g = torch.randn(b, s, d, device=DEVICE), 1 + 0.1 * torch.randn(d, device=DEVICE)
    w = torch.randn(24, d, device=DEVICE) / 6
    x1, stats = linear_residual(a, wo, res, g, EPS)
    with pytest.raises(ValueError, match="another tensor than x"):
        rmsnorm_linear(x1.transpose(0, 1), g, w, EPS, stats=stats)
    for view in (x1.reshape(b * s, d), x1[None], x1.unsqueeze(1).unsqueeze(0)):
        z = rmsnorm_linear(view, g, w, EPS, stats=stats)
        assert rel(z, unfused(view.double(), g.double(), [w.double()])) < 1e-5


def test_stats_keep_their_x_alive():
    """Statistics hold their x, so that a new tensor cannot be allocated at its address (as a
    caching allocator would) and pass the check as that x while the statistics live."""
    import weakref
    m, k, d = 5, 16, 32
    a, wo, res = torch.randn(m, k, device=DEVICE), torch.randn(d, k, device=DEVICE) / 4, torch.randn(m, d, device=DEVICE)
    g = 1 + 0.1 * torch.randn(d, device=DEVICE)
    x1, stats = linear_residual(a, wo, res, g, EPS)
    ref = weakref.ref(x1)
    del x1
    assert ref() is not None
    del stats
    assert ref() is None


@pytest.mark.parametrize("call, message", [
    (lambda x, g, w: rmsnorm_linear(x, g, []), "at least one weight"),
    (lambda x, g, w: rmsnorm_linear(x, g, w, stats=(1, 2)), "stats must be the \\(u, rstd\\) pair"),
    (lambda x, g, w: rmsnorm_linear(x, g, w, eps="1e-6"), "eps must be a number"),
    (lambda x, g, w: rmsnorm_linear(x, g.long(), w), "norm_weight is torch.int64; the kernels take"),
    (lambda x, g, w: linear_residual(x, w, x[:, :5], bias=torch.zeros(5, dtype=torch.long, device=DEVICE)),
     r"bias must be an \[5\] tensor"),
    (lambda x, g, w: linear_residual(x, w, x[:, :5], g.long()[:5]), r"norm_weight must be an \[5\]"),
    # not tensors at all: named, as the other operators name them
    (lambda x, g, w: linear_residual(x, w, x[:, :5], 1.0), "norm_weight must be an .* got float"),
    (lambda x, g, w: linear_residual(x, w, x[:, :5], bias=np.zeros(5, np.float32)), "bias must be .* got ndarray"),
    (lambda x, g, w: linear_residual(x.numpy(force=True), w, x[:, :5]), "a must be a tensor"),
    (lambda x, g, w: linear_residual(x, None, x[:, :5]), "weight must be a tensor"),
    (lambda x, g, w: linear_residual(x, w, [0.0] * 5), "residual must be a tensor"),
])
def test_bad_arguments_are_named(call, message):
    x, g, w = torch.randn(4, 8, device=DEVICE), torch.ones(8, device=DEVICE), torch.randn(5, 8, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        call(x, g, w)


def test_custom_ops_pass_opcheck():
    """Schemas, fake implementations and autograd registrations agree with the real ops."""
    x = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    g = torch.rand(16, device=DEVICE, requires_grad=True) + 0.5
    ws = [torch.randn(16, 16, device=DEVICE, requires_grad=True), torch.randn(8, 16, device=DEVICE, requires_grad=True)]
    torch.library.opcheck(torch.ops.codetta.rmsnorm_linear.default, (x, g, ws, EPS, None, None),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    a, res = torch.randn(6, 8, device=DEVICE, requires_grad=True), torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, 8, device=DEVICE, requires_grad=True)
    for scale in (1.0, 0.5):
        torch.library.opcheck(torch.ops.codetta.linear_residual.default, (a, [w], res, None, g, EPS, scale),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_traces_without_graph_break():
    """torch.compile sees one graph through the fused ops, forward and backward (no graph break)."""
    x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    g = torch.rand(16, device=DEVICE) + 0.5
    w = torch.randn(24, 16, device=DEVICE, requires_grad=True)
    wo, a = torch.randn(16, 12, device=DEVICE), torch.randn(8, 12, device=DEVICE)

    def block(x):
        x1, stats = linear_residual(a, wo, x, g, EPS)
        return rmsnorm_linear(x1, g, w, EPS, stats=stats).sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    loss = compiled(x)
    loss.backward()
    x_ref = x.detach().double().requires_grad_()
    ref = unfused(F.linear(a.double(), wo.double()) + x_ref, g.double(), [w.detach().double()]).sum()
    ref.backward()
    assert rel(loss, ref) < 1e-5 and rel(x.grad, x_ref.grad) < 1e-5

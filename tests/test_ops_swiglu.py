"""RMSNorm -> gate/up -> SwiGLU fused (codetta.ops.rmsnorm_swiglu): output and every gradient,
and its SwiGLU-backward kernel (codetta.kernels.swiglu) on its own; the other gate activations
(GeGLU with either GELU, ReGLU) likewise.

The reference is the usual unfused module math (F.rms_norm, two F.linear, F.silu or the
activation's own torch function) in fp64.
"""

import pytest
import torch
import torch.nn.functional as F

from codetta.kernels.swiglu import swiglu_backward
from codetta.ops import linear_residual, rmsnorm_swiglu
from conftest import DEVICE, INTERPRET

EPS = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# each activation as torch computes it (the independent math the kernels are held to)
TORCH_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
                     "relu": F.relu}


def unfused(x, g, wg, wu, bg=None, bu=None, activation="silu"):
    h = F.rms_norm(x, (x.shape[-1],), g, EPS)
    return TORCH_ACTIVATIONS[activation](F.linear(h, wg, bg)) * F.linear(h, wu, bu)


def inputs(shape, f):
    d = shape[-1]
    return (torch.randn(*shape, device=DEVICE) * 2, 1 + 0.2 * torch.randn(d, device=DEVICE),
            torch.randn(f, d, device=DEVICE) / d**0.5, torch.randn(f, d, device=DEVICE) / d**0.5)


def run(fn, tensors, dy, dtype):
    leaves = [t.to(dtype).detach().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy.to(dtype))
    return [y] + [t.grad for t in leaves]


@pytest.mark.parametrize("shape,f", [((1, 16), 8), ((37, 24), 20), ((2, 9, 32), 44), ((19, 16), 130)], ids=str)
def test_forward_backward_fp32(shape, f):
    tensors = inputs(shape, f)
    dy = torch.randn(*shape[:-1], f, device=DEVICE)
    ours = run(lambda *t: rmsnorm_swiglu(*t, eps=EPS), tensors, dy, torch.float32)
    ref = run(unfused, tensors, dy, torch.float64)
    assert ours[0].shape == ref[0].shape
    for name, a, b in zip(("y", "dx", "dnorm_weight", "dw_gate", "dw_up"), ours, ref):
        assert rel(a, b) < 2e-5, name


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("shape,f", [((37, 24), 20), ((2, 9, 32), 44)], ids=str)
def test_other_activations_forward_backward_fp32(shape, f, activation):
    """GeGLU (both GELUs) and ReGLU: act(h W_g^T + b_g) * (h W_u^T + b_u), output and every
    gradient (biases too) against torch's own activation in fp64."""
    tensors = inputs(shape, f) + (torch.randn(f, device=DEVICE), torch.randn(f, device=DEVICE))
    dy = torch.randn(*shape[:-1], f, device=DEVICE)
    ours = run(lambda x, g, wg, wu, bg, bu: rmsnorm_swiglu(x, g, wg, wu, EPS, bias=(bg, bu), activation=activation),
               tensors, dy, torch.float32)
    ref = run(lambda *t: unfused(*t, activation=activation), tensors, dy, torch.float64)
    assert ours[0].shape == ref[0].shape
    for name, a, b in zip(("y", "dx", "dnorm_weight", "dw_gate", "dw_up", "db_gate", "db_up"), ours, ref):
        assert rel(a, b) < 2e-5, name


@pytest.mark.parametrize("biased", [(True, True), (True, False), (False, True)], ids=["both", "gate", "up"])
@pytest.mark.parametrize("shape,f", [((37, 24), 20), ((2, 9, 32), 44), ("transposed", 20)], ids=str)
def test_biases_forward_backward_fp32(shape, f, biased):
    """Llama's mlp_bias: z_g = h W_g^T + b_g, z_u = h W_u^T + b_u (either may be missing); the
    biases' gradients and every other one against fp64 (also for x a transposed view)."""
    transposed = shape == "transposed"
    shape = (13, 24) if transposed else shape
    tensors = inputs(shape, f) + (torch.randn(f, device=DEVICE), torch.randn(f, device=DEVICE))
    if transposed:
        tensors = (tensors[0].t().contiguous().t(),) + tensors[1:]
    dy = torch.randn(*shape[:-1], f, device=DEVICE)

    def fused(x, g, wg, wu, bg, bu):
        return rmsnorm_swiglu(x, g, wg, wu, EPS, bias=(bg if biased[0] else None, bu if biased[1] else None))

    def ref(x, g, wg, wu, bg, bu):
        return unfused(x, g, wg, wu, bg if biased[0] else None, bu if biased[1] else None)

    ours = run(fused, tensors, dy, torch.float32)
    for name, a, b in zip(("y", "dx", "dnorm_weight", "dw_gate", "dw_up", "db_gate", "db_up"), ours,
                          run(ref, tensors, dy, torch.float64)):
        assert (a is None) == (b is None), name
        assert a is None or rel(a, b) < 2e-5, name


@pytest.mark.parametrize("activation", list(TORCH_ACTIVATIONS))
@pytest.mark.parametrize("bias_std", [0, 1, 100], ids=["plain", "bias", "bias_std_100"])
def test_bf16_within_twice_eager_error(bias_std, activation):
    """With biases too, also far larger than the projections (stored z + b would make zdz cancel:
    the norm's row term then comes from dL/dh)."""
    shape, f = ((64, 48), 40) if INTERPRET else ((2048, 1024), 2816)
    with_bias = bias_std > 0
    tensors = inputs(shape, f) + ((bias_std * torch.randn(f, device=DEVICE), bias_std * torch.randn(f, device=DEVICE))
                                  if with_bias else ())
    dy = torch.randn(*shape[:-1], f, device=DEVICE)
    ours = run(lambda x, g, wg, wu, *b: rmsnorm_swiglu(x, g, wg, wu, eps=EPS, bias=b or None, activation=activation),
               tensors, dy, torch.bfloat16)
    eager = run(lambda *t: unfused(*t, activation=activation), tensors, dy, torch.bfloat16)
    ref = run(lambda *t: unfused(*t, activation=activation), tensors, dy, torch.float64)
    for name, a, e, r in zip(("y", "dx", "dnorm_weight", "dw_gate", "dw_up", "db_gate", "db_up"), ours, eager, ref):
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
    with pytest.raises(ValueError, match="w_up must be"):
        rmsnorm_swiglu(x, g, wg, torch.randn(6, 7, device=DEVICE))
    with pytest.raises(ValueError, match="bias must be a tuple"):
        rmsnorm_swiglu(x, g, wg, wu, bias=torch.zeros(6, device=DEVICE))
    with pytest.raises(ValueError, match=r"b_up must be an \[6\]"):
        rmsnorm_swiglu(x, g, wg, wu, bias=(None, torch.zeros(5, device=DEVICE)))
    with pytest.raises(ValueError, match=r"b_gate must be an \[6\] tensor in one of .*got \(6,\) torch.int64"):
        rmsnorm_swiglu(x, g, wg, wu, bias=(torch.zeros(6, dtype=torch.long, device=DEVICE), None))
    with pytest.raises(ValueError, match="activation must be one of 'silu', 'gelu', 'gelu_tanh', 'relu', got 'tanh'"):
        rmsnorm_swiglu(x, g, wg, wu, activation="tanh")


def test_custom_op_passes_opcheck():
    x, g, wg, wu = (t.requires_grad_() for t in inputs((6, 16), 8))
    bu = torch.randn(8, device=DEVICE, requires_grad=True)
    for biases in ((None, None), (None, bu)):
        torch.library.opcheck(torch.ops.codetta.rmsnorm_swiglu.default,
                              (x, g, wg, wu, EPS, None, None, *biases, "gelu_tanh" if bu is None else "silu"),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ---------------------------------------------------------------------------------------
# The SwiGLU-backward kernel alone: dz = d(silu(g) * u)/d[g | u] and zdz = sum_k z_k dz_k


def swiglu_inputs(m, f, dtype):
    z = (torch.randn(m, 2 * f, device=DEVICE) * 3).to(dtype)
    return torch.randn(m, f, device=DEVICE).to(dtype), z


def autograd_swiglu(dy, z, activation="silu"):
    """(dz, zdz) of act(g) * u by autograd, in dy's and z's own dtype (zdz in fp32 or fp64)."""
    f = dy.shape[-1]
    zz = z.detach().clone().requires_grad_()
    (TORCH_ACTIVATIONS[activation](zz[:, :f]) * zz[:, f:]).backward(dy)
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    return zz.grad, (z.to(acc) * zz.grad.to(acc)).sum(-1)


SHAPES = [(1, 5), (1, 64), (37, 150), (16, 128), (50, 1)]


@pytest.mark.parametrize("activation", list(TORCH_ACTIVATIONS))
@pytest.mark.parametrize("m,f", SHAPES, ids=str)
def test_kernel_fp32(m, f, activation):
    dy, z = swiglu_inputs(m, f, torch.float32)
    dz, zdz = swiglu_backward(dy, z, activation=activation)
    dz_ref, zdz_ref = autograd_swiglu(dy.double(), z.double(), activation)
    assert dz.dtype == torch.float32 and dz.shape == (m, 2 * f) and zdz.dtype == torch.float32 and zdz.shape == (m,)
    assert rel(dz, dz_ref) < 1e-6
    # over rows, or (a single row whose sum cancels) per row at fp32's resolution of its terms
    assert rel(zdz, zdz_ref) < 1e-6 or within_rounding_of_terms(zdz, zdz_ref, z, dz_ref, 1e-6)


@pytest.mark.parametrize("activation", list(TORCH_ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,f", SHAPES, ids=str)
def test_kernel_low_precision_within_twice_eager_error(m, f, dtype, activation):
    dy, z = swiglu_inputs(m, f, dtype)
    dz, zdz = swiglu_backward(dy, z, activation=activation)
    assert dz.dtype == dtype and zdz.dtype == torch.float32
    dz_eager, zdz_eager = autograd_swiglu(dy, z, activation)
    dz_ref, zdz_ref = autograd_swiglu(dy.double(), z.double(), activation)
    assert rel(dz, dz_ref) <= 2 * rel(dz_eager, dz_ref) + 1e-6
    # zdz is a sum of dz as stored: per row, one rounding of each term is its error's scale (a row's
    # sum that cancels may come out several times eager's error on one row; over rows the 2x holds)
    assert (rel(zdz, zdz_ref) <= 2 * rel(zdz_eager, zdz_ref) + 1e-6
            or within_rounding_of_terms(zdz, zdz_ref, z, dz_ref, 2.0 ** -8))


def within_rounding_of_terms(zdz, zdz_ref, z, dz_ref, unit):
    """|zdz - zdz_ref| <= unit * sum_k |z_k dz_k| on every row: each term off by at most one
    rounding of relative size ``unit``."""
    scale = (z.double() * dz_ref.double()).abs().sum(-1)
    return bool(((zdz.double() - zdz_ref.double()).abs() <= unit * scale + 1e-30).all())


def test_kernel_zdz_is_from_stored_dz():
    # zdz is the row dot product of z with dz as stored (rounded), up to fp32 summation order
    dy, z = swiglu_inputs(23, 100, torch.bfloat16)
    dz, zdz = swiglu_backward(dy, z)
    exact = (z.double() * dz.double()).sum(-1)
    scale = (z.double() * dz.double()).abs().sum(-1)
    assert ((zdz.double() - exact).abs() <= 1e-6 * scale + 1e-30).all()


@pytest.mark.parametrize("block", [None, (4, 16, 1)], ids=str)
def test_kernel_writes_exactly_its_output(block):
    # strided views in and out: dz goes into a view of a larger NaN-filled tensor
    m, f = 21, 70
    dy_c, z_c = swiglu_inputs(m, f, torch.bfloat16)
    dy = torch.full((m, f + 7), float("nan"), device=DEVICE, dtype=torch.bfloat16)[:, 3:3 + f]
    z = torch.full((m, 2 * f + 5), float("nan"), device=DEVICE, dtype=torch.bfloat16)[:, :2 * f]
    dy.copy_(dy_c)
    z.copy_(z_c)
    big = torch.full((m + 3, 2 * f + 10), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    out = big[1:m + 1, 4:4 + 2 * f]
    dz, zdz = swiglu_backward(dy, z, out=out, block=block)
    assert dz.data_ptr() == out.data_ptr()
    assert not out.isnan().any() and not zdz.isnan().any()
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[1:m + 1, 4:4 + 2 * f] = True
    assert big[~inside].isnan().all()
    dz_c, zdz_c = swiglu_backward(dy_c, z_c, block=block)
    assert torch.equal(out, dz_c)
    assert torch.allclose(zdz, zdz_c, rtol=1e-6, atol=0)
    dz_ref, zdz_ref = autograd_swiglu(dy_c.double(), z_c.double())
    dz_eager, zdz_eager = autograd_swiglu(dy_c, z_c)
    assert rel(dz, dz_ref) <= 2 * rel(dz_eager, dz_ref) + 1e-6


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,f", [(37, 150), (1, 5)], ids=str)
def test_kernel_recomputes_y_into_a_view(m, f, dtype, activation):
    """With y_out the same pass writes y = act(z_g) * z_u of the stored z into exactly that
    view (a NaN-poisoned larger tensor around it), and dz, zdz do not change."""
    act = TORCH_ACTIVATIONS[activation]
    dy, z = swiglu_inputs(m, f, dtype)
    big = torch.full((m + 2, f + 9), float("nan"), device=DEVICE, dtype=dtype)
    y_out = big[1:m + 1, 5:5 + f]
    dz, zdz = swiglu_backward(dy, z, activation=activation, y_out=y_out)
    dz_alone, zdz_alone = swiglu_backward(dy, z, activation=activation)
    assert torch.equal(dz, dz_alone) and torch.equal(zdz, zdz_alone)
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[1:m + 1, 5:5 + f] = True
    assert big[~inside].isnan().all() and not y_out.isnan().any()
    zd = z.double()
    y_ref = act(zd[:, :f]) * zd[:, f:]
    if dtype == torch.float32:
        assert rel(y_out, y_ref) < 1e-6
    else:  # eager: act(gate) * up of the stored bf16 projections
        assert rel(y_out, y_ref) <= 2 * rel(act(z[:, :f]) * z[:, f:], y_ref) + 1e-6


def test_kernel_empty_and_bad_inputs():
    dy, z = swiglu_inputs(0, 8, torch.float32)
    dz, zdz = swiglu_backward(dy, z)
    assert dz.shape == (0, 16) and zdz.shape == (0,)
    dy, z = swiglu_inputs(4, 8, torch.float32)
    with pytest.raises(ValueError, match="need dy"):
        swiglu_backward(dy, z[:, :15])
    with pytest.raises(ValueError, match="differ"):
        swiglu_backward(dy.double(), z)
    with pytest.raises(ValueError, match="out must be"):
        swiglu_backward(dy, z, out=torch.empty(16, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="y_out must be"):
        swiglu_backward(dy, z, y_out=torch.empty(4, 9, device=DEVICE))
    with pytest.raises(ValueError, match="y_out must be"):
        swiglu_backward(dy, z, y_out=torch.empty(4, 8, device=DEVICE, dtype=torch.float64))
    with pytest.raises(ValueError, match="activation must be one of"):
        swiglu_backward(dy, z, activation="gelu_erf")


def test_kernel_relaunch_with_other_alignment_and_sizes():
    """The kernel launched again after a first launch (on a GPU: the compiled kernel kept by
    codetta.kernels.launch): 16-byte aligned tensors, then views 1 element off alignment with odd
    strides, then other sizes; each result against fp64 autograd."""
    m, f = 19, 40
    for shift, extra in ((0, 0), (1, 3), (0, 16)):
        dy_c, z_c = swiglu_inputs(m + extra, f + extra, torch.float32)
        dy = torch.empty(m + extra, f + extra + 5, device=DEVICE)[:, shift:shift + f + extra]
        z = torch.empty(m + extra, 2 * (f + extra) + 3, device=DEVICE)[:, shift:shift + 2 * (f + extra)]
        dy.copy_(dy_c)
        z.copy_(z_c)
        assert (dy.data_ptr() % 16 == 0) == (shift == 0)
        dz, zdz = swiglu_backward(dy, z)
        dz_ref, zdz_ref = autograd_swiglu(dy_c.double(), z_c.double())
        assert rel(dz, dz_ref) < 1e-6 and rel(zdz, zdz_ref) < 1e-6

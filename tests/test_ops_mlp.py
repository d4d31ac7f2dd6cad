"""The MLP half of a block as one operator (codetta.ops.swiglu_mlp): x + SwiGLU(RMSNorm(x)) W_d^T.

Against the unfused module math in fp64 (F.rms_norm, F.linear, F.silu, the residual add):
the output, the next norm's statistics and every gradient; the gradient of x sums its two
paths (norm and residual) in the norm-backward GEMM's epilogue, not in a separate pass.
"""

import pytest
import torch
import torch.nn.functional as F

import codetta.ops.mlp as mlp_module
import codetta.ops.rmsnorm as rmsnorm_module
import codetta.ops.swiglu as swiglu_module
from codetta.ops import linear_residual, rmsnorm_swiglu, swiglu_mlp
from conftest import DEVICE, INTERPRET

EPS = 1e-5
NAMES = ("x2", "dx", "dnorm_weight", "dw_gate", "dw_up", "dw_down")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# each gate activation as torch computes it (the independent math)
TORCH_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
                     "relu": F.relu}


def unfused(x, g, wg, wu, wd, bg=None, bu=None, bd=None, activation="silu"):
    h = F.rms_norm(x, (x.shape[-1],), g, EPS)
    return x + F.linear(TORCH_ACTIVATIONS[activation](F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)


def biases(shape, f):
    return torch.randn(f, device=DEVICE), torch.randn(f, device=DEVICE), torch.randn(shape[-1], device=DEVICE)


def inputs(shape, f):
    d = shape[-1]
    return (torch.randn(*shape, device=DEVICE), 1 + 0.2 * torch.randn(d, device=DEVICE),
            torch.randn(f, d, device=DEVICE) / d**0.5, torch.randn(f, d, device=DEVICE) / d**0.5,
            torch.randn(d, f, device=DEVICE) / f**0.5)


def run(fn, tensors, dy, dtype):
    leaves = [t.to(dtype).detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(dy.to(dtype))
    return [out] + [t.grad for t in leaves]


@pytest.mark.parametrize("shape,f", [((1, 16), 8), ((37, 24), 20), ((2, 9, 32), 44)], ids=str)
def test_forward_backward_fp32(shape, f):
    tensors = inputs(shape, f)
    dy = torch.randn(*shape, device=DEVICE)
    ours = run(lambda *t: swiglu_mlp(*t, eps=EPS), tensors, dy, torch.float32)
    ref = run(unfused, tensors, dy, torch.float64)
    for name, a, b in zip(NAMES, ours, ref):
        assert a.shape == b.shape, name
        assert rel(a, b) < 2e-5, name


@pytest.mark.parametrize("biased", [(1, 1, 1), (0, 1, 1), (1, 0, 0), (0, 0, 1)], ids=str)
def test_biases_forward_backward_fp32(biased):
    """Llama's mlp_bias (b_gate, b_up, b_down, each optional): the output and every gradient,
    the biases' included, against fp64; the next norm's statistics include the down bias."""
    shape, f = (2, 9, 32), 44
    tensors = inputs(shape, f) + biases(shape, f)
    dy = torch.randn(*shape, device=DEVICE)
    g_next = 1 + 0.2 * torch.randn(shape[-1], device=DEVICE)

    def fused(x, g, wg, wu, wd, *b):
        x2, (u2, rstd2) = swiglu_mlp(x, g, wg, wu, wd, EPS, bias=tuple(t if on else None for t, on in zip(b, biased)),
                                     next_norm_weight=g_next, next_eps=1e-6)
        fused.stats = u2, rstd2
        return x2

    def ref(x, g, wg, wu, wd, *b):
        return unfused(x, g, wg, wu, wd, *(t if on else None for t, on in zip(b, biased)))

    ours = run(fused, tensors, dy, torch.float32)
    names = NAMES + ("db_gate", "db_up", "db_down")
    for name, a, b in zip(names, ours, run(ref, tensors, dy, torch.float64)):
        assert (a is None) == (b is None), name
        assert a is None or rel(a, b) < 2e-5, name
    x2 = ours[0].detach().double().reshape(-1, shape[-1])
    assert rel(fused.stats[1], torch.rsqrt(x2.square().mean(-1) + 1e-6)) < 1e-6


def test_branch_scale_forward_backward_fp32():
    """x2 = x + s (SwiGLU(RMSNorm(x)) W_d^T + b_d) (Granite's residual multiplier s): the output
    and every gradient against fp64; x's gradient takes the residual's dx2 unscaled."""
    shape, f, s = (2, 9, 32), 44, 0.22
    tensors = inputs(shape, f) + biases(shape, f)
    dy = torch.randn(*shape, device=DEVICE)
    ours = run(lambda x, g, wg, wu, wd, *b: swiglu_mlp(x, g, wg, wu, wd, EPS, bias=b, branch_scale=s),
               tensors, dy, torch.float32)
    ref = run(lambda x, g, wg, wu, wd, *b: x + s * (unfused(x, g, wg, wu, wd, *b) - x), tensors, dy, torch.float64)
    for name, a, b in zip(NAMES + ("db_gate", "db_up", "db_down"), ours, ref):
        assert rel(a, b) < 2e-5, name
    with pytest.raises(ValueError, match="branch_scale must be a finite real number"):
        swiglu_mlp(*tensors[:5], EPS, branch_scale=float("nan"))


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_other_activations_forward_backward_fp32(activation):
    """GeGLU (both GELUs) and ReGLU MLPs with biases and a branch scale: the output and every
    gradient against torch's own activation in fp64."""
    shape, f, s = (2, 9, 32), 44, 0.5
    tensors = inputs(shape, f) + biases(shape, f)
    dy = torch.randn(*shape, device=DEVICE)
    ours = run(lambda x, g, wg, wu, wd, *b: swiglu_mlp(x, g, wg, wu, wd, EPS, bias=b, branch_scale=s,
                                                       activation=activation), tensors, dy, torch.float32)
    ref = run(lambda x, *t: x + s * (unfused(x, *t, activation=activation) - x), tensors, dy, torch.float64)
    for name, a, b in zip(NAMES + ("db_gate", "db_up", "db_down"), ours, ref):
        assert rel(a, b) < 2e-5, name


def test_backward_epilogues(monkeypatch):
    """The down projection's dgrad is a plain GEMM followed by one SwiGLU-backward kernel, and
    the residual gradient is added in the norm-backward epilogue (no separate sum)."""
    programs, kernels = [], []
    gemm, swiglu_backward = rmsnorm_module.gemm, mlp_module.swiglu_backward

    def recording(a, b, program=None, **operands):
        programs.append(program.name if program is not None else "plain")
        return gemm(a, b, program, **operands)

    def recording_kernel(dy, z, **kwargs):
        kernels.append(dy.shape)
        return swiglu_backward(dy, z, **kwargs)

    for module in (rmsnorm_module, mlp_module):
        monkeypatch.setattr(module, "gemm", recording)
    monkeypatch.setattr(mlp_module, "swiglu_backward", recording_kernel)
    x, *weights = (t.requires_grad_() for t in inputs((12, 16), 8))
    swiglu_mlp(x, *weights, eps=EPS).sum().backward()
    assert kernels == [torch.Size([12, 8])]
    assert programs.count("rmsnorm_linear_backward_residual") == 1 and "rmsnorm_linear_backward" not in programs


def test_keeps_z_not_y():
    """The backward keeps x, the weights, z and rstd, not the activation y = silu(z_g) z_u (its
    kernel recomputes y for dW_down): no [M, F] tensor among the saved ones."""
    m, d, f = 12, 16, 24
    x, *weights = (t.requires_grad_() for t in inputs((m, d), f))
    out = swiglu_mlp(x, *weights, eps=EPS)
    shapes = sorted(tuple(t.shape) for t in out.grad_fn.saved_tensors if t is not None)  # None: no biases
    assert shapes == sorted([(m, d), (d,), (f, d), (f, d), (d, f), (m, 2 * f), (m,)])


@pytest.mark.parametrize("frozen", ["w_down", "w_gate", None])
def test_y_recomputed_only_for_the_down_weights_gradient(monkeypatch, frozen):
    """The backward kernel writes y = silu(z_g) z_u (an [M, F] tensor) only when W_d needs its
    gradient dW_d = dx2^T y: with W_d frozen (LoRA elsewhere) there is no y; the gradients
    asked for are the fp64 math's either way."""
    y_outs, swiglu_backward = [], mlp_module.swiglu_backward

    def recording_kernel(dy, z, **kwargs):
        y_outs.append(kwargs.get("y_out"))
        return swiglu_backward(dy, z, **kwargs)

    monkeypatch.setattr(mlp_module, "swiglu_backward", recording_kernel)
    tensors = inputs((13, 16), 24)
    wanted = [name != frozen for name in ("x", "g", "w_gate", "w_up", "w_down")]
    leaves = [[t.to(dtype).detach().requires_grad_(w) for t, w in zip(tensors, wanted)]
              for dtype in (torch.float32, torch.float64)]
    dy = torch.randn(13, 16, device=DEVICE)
    swiglu_mlp(*leaves[0], eps=EPS).backward(dy)
    unfused(*leaves[1]).backward(dy.double())
    assert (y_outs[0] is None) == (frozen == "w_down")
    for got, ref in zip(*leaves):
        assert (got.grad is None) == (ref.grad is None)
        if ref.grad is not None:
            assert rel(got.grad, ref.grad) < 2e-5


def unfused_gated(x, g, wg, wu):
    h = F.rms_norm(x, (x.shape[-1],), g, EPS)
    return F.silu(F.linear(h, wg)) * F.linear(h, wu)


@pytest.mark.parametrize("retain_graph", [False, True])
@pytest.mark.parametrize("operator", ["swiglu_mlp", "rmsnorm_swiglu"])
def test_dz_written_over_z_only_when_autograd_frees_it(monkeypatch, operator, retain_graph):
    """Where autograd frees the saved tensors after the backward, the backward writes dz over the
    saved z (no second [M, 2F] tensor) and the graph cannot be run again; with retain_graph=True
    z is left alone, and a second backward gives the same gradients. Both are the fp64 math's."""
    module = mlp_module if operator == "swiglu_mlp" else swiglu_module
    written_over_z, kernel = [], module.swiglu_backward

    def recording_kernel(dy, z, **kwargs):
        out = kwargs.get("out")
        written_over_z.append(out is not None and out.data_ptr() == z.data_ptr())
        return kernel(dy, z, **kwargs)

    monkeypatch.setattr(module, "swiglu_backward", recording_kernel)
    m, d, f = 13, 16, 24
    tensors = inputs((m, d), f)[:5 if operator == "swiglu_mlp" else 4]  # rmsnorm_swiglu: no W_d
    fused, reference = ((lambda *t: swiglu_mlp(*t, eps=EPS), unfused) if operator == "swiglu_mlp"
                        else (lambda *t: rmsnorm_swiglu(*t, eps=EPS), unfused_gated))
    leaves = [t.detach().requires_grad_() for t in tensors]
    leaves64 = [t.double().detach().requires_grad_() for t in tensors]
    out = fused(*leaves)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy, retain_graph=retain_graph)
    expected = torch.autograd.grad(reference(*leaves64), leaves64, dy.double())
    assert written_over_z == [not retain_graph]
    for got, ref in zip(grads, expected):
        assert rel(got, ref) < 2e-5
    if not retain_graph:
        with pytest.raises(RuntimeError, match="second time"):
            torch.autograd.grad(out, leaves, dy)
        return
    again = torch.autograd.grad(out, leaves, dy)
    assert written_over_z == [False, True]
    for first, second in zip(grads, again):
        assert torch.equal(first, second)


def test_next_norm_statistics_and_producer_stats():
    """Fed by a producer's statistics, handing the next norm's (u2 = x2 g', rstd2) on."""
    m, k, d, f = 21, 16, 32, 24
    a, wo = torch.randn(m, k, device=DEVICE), torch.randn(d, k, device=DEVICE) / 4
    x, g, wg, wu, wd = inputs((m, d), f)
    g_next = 1 + 0.2 * torch.randn(d, device=DEVICE)
    dy = torch.randn(m, d, device=DEVICE)

    def fused(a, wo, x, g, wg, wu, wd):
        x1, stats = linear_residual(a, wo, x, g, EPS)
        x2, (u2, rstd2) = swiglu_mlp(x1, g, wg, wu, wd, EPS, stats=stats, next_norm_weight=g_next, next_eps=1e-6)
        fused.stats = u2, rstd2
        return x2

    def ref(a, wo, x, g, wg, wu, wd):
        return unfused(F.linear(a, wo) + x, g, wg, wu, wd)

    ours = run(fused, (a, wo, x, g, wg, wu, wd), dy, torch.float32)
    for a_, b_ in zip(ours, run(ref, (a, wo, x, g, wg, wu, wd), dy, torch.float64)):
        assert rel(a_, b_) < 2e-5
    x2 = ours[0].detach().double()
    u2, rstd2 = fused.stats
    assert not u2.requires_grad and not rstd2.requires_grad
    assert rel(u2, x2 * g_next.double()) < 1e-6
    assert rel(rstd2, torch.rsqrt(x2.square().mean(-1) + 1e-6)) < 1e-6


@pytest.mark.parametrize("bias_std,activation", [(0, "silu"), (1, "silu"), (100, "silu"), (0, "gelu_tanh"),
                                                 (1, "gelu"), (0, "relu")])
def test_bf16_within_twice_eager_error(bias_std, activation):
    shape, f = ((64, 48), 40) if INTERPRET else ((2048, 1024), 2816)
    tensors = inputs(shape, f) + (tuple(bias_std * b for b in biases(shape, f)) if bias_std else ())
    dy = torch.randn(*shape, device=DEVICE)
    ours = run(lambda x, g, wg, wu, wd, *b: swiglu_mlp(x, g, wg, wu, wd, eps=EPS, bias=b or None, activation=activation),
               tensors, dy, torch.bfloat16)
    eager = run(lambda *t: unfused(*t, activation=activation), tensors, dy, torch.bfloat16)
    ref = run(lambda *t: unfused(*t, activation=activation), tensors, dy, torch.float64)
    for name, a, e, r in zip(NAMES + ("db_gate", "db_up", "db_down"), ours, eager, ref):
        assert rel(a, r) <= 2 * rel(e, r) + 1e-4, name


def test_bad_inputs():
    x, g, wg, wu, wd = inputs((4, 8), 6)
    with pytest.raises(ValueError, match="w_down"):
        swiglu_mlp(x, g, wg, wu, wd[:, :5])
    with pytest.raises(ValueError, match="differ"):
        swiglu_mlp(x, g, wg, wu[:5], wd)
    with pytest.raises(ValueError, match="next_norm_weight"):
        swiglu_mlp(x, g, wg, wu, wd, next_norm_weight=g[:4])
    with pytest.raises(ValueError, match=r"next_norm_weight must be an \[8\]"):  # as linear_residual's
        swiglu_mlp(x, g, wg, wu, wd, next_norm_weight=torch.ones(g.shape, dtype=torch.long, device=g.device))
    with pytest.raises(ValueError, match="next_norm_weight must be .* got float"):
        swiglu_mlp(x, g, wg, wu, wd, next_norm_weight=1.0)
    with pytest.raises(ValueError, match="bias must be a tuple"):
        swiglu_mlp(x, g, wg, wu, wd, bias=(None, None))
    with pytest.raises(ValueError, match=r"b_down must be an \[8\]"):
        swiglu_mlp(x, g, wg, wu, wd, bias=(None, None, torch.zeros(6, device=DEVICE)))
    with pytest.raises(ValueError, match="activation must be one of"):
        swiglu_mlp(x, g, wg, wu, wd, activation="swish")


@pytest.mark.parametrize("next_norm", [False, True])
def test_custom_ops_pass_opcheck(next_norm):
    x, g, wg, wu, wd = (t.requires_grad_() for t in inputs((6, 16), 8))
    b_up, b_down = torch.randn(8, device=DEVICE, requires_grad=True), torch.randn(16, device=DEVICE, requires_grad=True)
    for b, scale, act, needs in (((None, None, None), 1.0, "silu", [True] * 3),
                                 ((None, b_up, b_down), 0.5, "gelu", [True, False, False])):
        args = (x, g, wg, wu, wd, EPS, None, None, g.detach() if next_norm else None, 1e-6, *b, scale, act)
        torch.library.opcheck(torch.ops.codetta.swiglu_mlp.default, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
        z = torch.randn(6, 16, device=DEVICE)
        zz = torch.randn(6, 16, device=DEVICE)
        torch.library.opcheck(torch.ops.codetta.swiglu_mlp_backward.default,
                              (z, x.detach(), g.detach(), wg.detach(), wu.detach(), wd.detach(), zz,
                               torch.rand(6, device=DEVICE) + 0.5, None, None if b[1] is None else b[1].detach(), scale,
                               act, needs),
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_torch_compile_traces_without_graph_break(with_bias):
    tensors = inputs((2, 5, 16), 8) + (biases((2, 5, 16), 8) if with_bias else ())
    dy = torch.randn(2, 5, 16, device=DEVICE)
    compiled = torch.compile(lambda x, g, wg, wu, wd, *b: swiglu_mlp(x, g, wg, wu, wd, eps=EPS, bias=b or None),
                             backend="aot_eager", fullgraph=True)
    for a, b in zip(run(compiled, tensors, dy, torch.float32), run(unfused, tensors, dy, torch.float64)):
        assert rel(a, b) < 2e-5

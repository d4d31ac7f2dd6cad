"""Legal but unusual inputs to the operators (strided vectors, outputs edited in place, position
layouts, empty dims, inf and NaN, eps = 0), and wrong ones that must be refused with a message
naming the problem.

References are the unfused math in float64 (F.rms_norm, F.linear, HF's rotate_half RoPE).
"""

import pytest
import torch
import torch.nn.functional as F

import codetta
from codetta import ops
from conftest import DEVICE

EPS = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def strided(t):
    """The same values as a view with stride 2 (not contiguous)."""
    return torch.stack((t, torch.full_like(t, float("nan"))), dim=-1)[..., 0]


def test_strided_norm_weights():
    """A norm weight that is a strided view (e.g. a slice of a packed parameter) is read as its values."""
    m, d, n, f, v = 10, 24, 16, 20, 40
    x, g = torch.randn(m, d, device=DEVICE), 1 + 0.3 * torch.randn(d, device=DEVICE)
    w, wg, wu, wd = (torch.randn(*s, device=DEVICE) / s[1] ** 0.5 for s in ((n, d), (f, d), (f, d), (d, f)))
    gs = strided(g)
    assert not gs.is_contiguous()
    h64 = F.rms_norm(x.double(), (d,), g.double(), EPS)
    assert rel(ops.rmsnorm_linear(x, gs, w, EPS), F.linear(h64, w.double())) < 1e-5
    assert rel(ops.rmsnorm_swiglu(x, gs, wg, wu, EPS), F.silu(F.linear(h64, wg.double())) * F.linear(h64, wu.double())) < 1e-5
    mlp = x.double() + F.linear(F.silu(F.linear(h64, wg.double())) * F.linear(h64, wu.double()), wd.double())
    assert rel(ops.swiglu_mlp(x, gs, wg, wu, wd, EPS), mlp) < 1e-5
    w_head, target = torch.randn(v, d, device=DEVICE) / d**0.5, torch.randint(0, v, (m,), device=DEVICE)
    ce = F.cross_entropy(F.linear(h64, w_head.double()), target)
    assert rel(ops.linear_cross_entropy(x, w_head, target, norm_weight=gs, eps=EPS), ce) < 1e-5
    xl, gl = x.clone().requires_grad_(), gs.detach().clone().requires_grad_()
    ops.rmsnorm_linear(xl, strided(gl), w, EPS).sum().backward()
    x64, g64 = x.double().requires_grad_(), g.double().requires_grad_()
    F.linear(F.rms_norm(x64, (d,), g64, EPS), w.double()).sum().backward()
    assert rel(xl.grad, x64.grad) < 1e-5 and rel(gl.grad, g64.grad) < 1e-5


M, D, N, FF = 10, 24, 16, 20
OUTPUT_OPS = {  # name: the operator on (x [M, D], g [D], w [N, D], w_gate, w_up [FF, D], w_down [D, FF])
    "linear": lambda x, g, w, wg, wu, wd: codetta.linear(x, w),
    "rms_norm": lambda x, g, w, wg, wu, wd: ops.rms_norm(x, g, EPS),
    "gated_activation": lambda x, g, w, wg, wu, wd: ops.gated_activation(x @ wg.T, x @ wu.T),
    "apply_rope": lambda x, g, w, wg, wu, wd: ops.apply_rope(
        x @ w.T, x @ w[:8].T, torch.arange(M, device=DEVICE), 1.0 / 100 ** torch.arange(0, 1, 0.25, device=DEVICE),
        head_dim=8)[0],
    "rmsnorm_linear": lambda x, g, w, wg, wu, wd: ops.rmsnorm_linear(x, g, w, EPS),
    "linear_residual": lambda x, g, w, wg, wu, wd: ops.linear_residual(torch.tanh(x) @ wg.T, wd, x, g, EPS)[0],
    "rmsnorm_swiglu": lambda x, g, w, wg, wu, wd: ops.rmsnorm_swiglu(x, g, wg, wu, EPS),
    "swiglu_mlp": lambda x, g, w, wg, wu, wd: ops.swiglu_mlp(x, g, wg, wu, wd, EPS, next_norm_weight=g)[0],
    "rmsnorm_qkv_rope": lambda x, g, w, wg, wu, wd: ops.rmsnorm_qkv_rope(
        x, g, w, w[:8], w[8:], torch.arange(M, device=DEVICE), 1.0 / 100 ** torch.arange(0, 1, 0.25, device=DEVICE),
        head_dim=8)[0],
    "rmsnorm_qkv_rope_with_bias": lambda x, g, w, wg, wu, wd: ops.rmsnorm_qkv_rope(
        x, g, w, w[:8], w[8:], torch.arange(M, device=DEVICE), 1.0 / 100 ** torch.arange(0, 1, 0.25, device=DEVICE),
        head_dim=8, bias=(wd[:16, 0], wd[:8, 1], wd[8:16, 1]))[0],
}


# the backward reads z (zdz = sum z dz; with a bias, as with QK-norm, it does not); q is a split view
SAVE_THEIR_OUTPUT = {"rmsnorm_linear", "rmsnorm_qkv_rope"}


@pytest.mark.parametrize("route", ["direct", "registered"])
@pytest.mark.parametrize("name", sorted(OUTPUT_OPS))
@pytest.mark.parametrize("lead", [(M,), (2, M // 2)], ids=["2d", "3d"])
def test_outputs_edited_in_place(name, lead, route, monkeypatch):
    """y.mul_(2) on an operator's output, then backward: the gradients of 2 y, as for torch's ops;
    or, where the backward reads the output (as torch.sigmoid's does), autograd's error. On either
    route: the direct eager one, and the registered op's (torch.compile's, tensor subclasses'),
    where autograd refused the edit of an output reshaped inside the op."""
    if route == "registered":
        monkeypatch.setattr("codetta.ops.autograd._runs_directly", lambda name, arg_names, args: False)
    torch.manual_seed(0)
    tensors = [torch.randn(*lead, D, device=DEVICE), 1 + 0.2 * torch.randn(D, device=DEVICE),
               *(torch.randn(*s, device=DEVICE) / s[1] ** 0.5 for s in ((N, D), (FF, D), (FF, D), (D, FF)))]

    def grads(in_place):
        leaves = [t.clone().requires_grad_() for t in tensors]
        y = OUTPUT_OPS[name](*leaves)
        y = y.mul_(2.0) if in_place else y * 2.0
        (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).reshape(y.shape)).sum().backward()
        return [t.grad for t in leaves if t.grad is not None]

    expected = grads(False)
    if name in SAVE_THEIR_OUTPUT:
        with pytest.raises(RuntimeError, match="inplace"):  # at backward, or at the edit of a split view
            grads(True)
        return
    got = grads(True)
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def rope_inputs(lead=(2, 3), d=24, head_dim=8):
    x, g = torch.randn(*lead, d, device=DEVICE), torch.ones(d, device=DEVICE)
    wq, wk, wv = (torch.randn(n, d, device=DEVICE) for n in (16, 8, 8))
    inv_freq = 1.0 / 100 ** (torch.arange(0, head_dim, 2, device=DEVICE) / head_dim)
    return x, g, wq, wk, wv, inv_freq


def test_rope_position_layouts():
    """Positions per token ([B, S]), broadcast ([1, S], HF's position_ids) or flat ([B S]) give the
    same result; any other shape is refused."""
    x, g, wq, wk, wv, inv_freq = rope_inputs()
    pos = torch.tensor([[0, 1, 2], [0, 1, 2]], device=DEVICE)
    expected = ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, pos, inv_freq, head_dim=8)
    for layout in (pos[:1], pos.reshape(-1)):
        for a, b in zip(ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, layout, inv_freq, head_dim=8), expected):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"positions \(3, 2\) are not one per token of x's leading dims \(2, 3\)"):
        ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, pos.reshape(3, 2), inv_freq, head_dim=8)
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, pos.float(), inv_freq, head_dim=8)


def test_refused_with_a_message_naming_the_problem():
    x, g, wq, wk, wv, inv_freq = rope_inputs(lead=(6,))
    pos = torch.arange(6, device=DEVICE)
    with pytest.raises(ValueError, match=r"b_q must be an \[16\] tensor .* on .*, got \(20,\)"):
        ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, pos, inv_freq, head_dim=8,
                             bias=(torch.randn(20, device=DEVICE), torch.randn(4, device=DEVICE), torch.randn(8, device=DEVICE)))
    with pytest.raises(ValueError, match="head_dim must be a positive integer, got 0"):
        ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, pos, inv_freq, head_dim=0)
    w12 = [torch.randn(n * 12, 24, device=DEVICE) for n in (2, 1, 1)]
    with pytest.raises(ValueError, match="QK-norm needs a head_dim that is a power of two"):
        ops.rmsnorm_qkv_rope(x, g, *w12, pos, inv_freq[:2], head_dim=12, rotary_dim=4,
                             q_norm_weight=torch.ones(12, device=DEVICE), k_norm_weight=torch.ones(12, device=DEVICE))
    x1, stats = ops.linear_residual(torch.randn(6, 16, device=DEVICE), torch.randn(24, 16, device=DEVICE), x, g)
    with pytest.raises(ValueError, match=r"stats \(u \(6, 24\), rstd \(6,\)\) are not those of x \(4, 24\)"):
        ops.rmsnorm_linear(x1[:4], g, wk, stats=stats)
    with pytest.raises(ValueError, match=r"stats must be \(u in the weights' dtype torch.float32, rstd in torch.float32\)"):
        ops.rmsnorm_linear(x1, g, wk, stats=(stats[0], stats[1].to(torch.bfloat16)))
    with pytest.raises(ValueError, match="stats must be"):
        ops.rmsnorm_linear(x1, g, wk.to(torch.bfloat16), stats=stats)
    meta = [t.to("meta") for t in (x, wk)]
    with pytest.raises(codetta.GemmError, match="meta"):  # a kernel launch: no data
        codetta.gemm(meta[0], meta[1].t())
    # the operators give shapes on the meta device, as PyTorch's own (test_direct_ops.py)
    assert codetta.linear(*meta).shape == ops.rmsnorm_linear(meta[0], g.to("meta"), meta[1]).shape == (6, 8)
    with pytest.raises(ValueError, match="weight is on meta but x is on"):
        ops.rmsnorm_linear(x, g, meta[1])


def test_linear_with_empty_k():
    """K = 0: y = b (or zeros), and the backward gives dW [N, 0], dx [M, 0], db = sum dy, as F.linear's."""
    x = torch.randn(5, 0, device=DEVICE, requires_grad=True)
    w = torch.randn(12, 0, device=DEVICE, requires_grad=True)
    b = torch.randn(12, device=DEVICE, requires_grad=True)
    y = codetta.linear(x, w, b)
    torch.testing.assert_close(y, b.detach().expand(5, 12))
    y.sum().backward()
    assert x.grad.shape == (5, 0) and w.grad.shape == (12, 0)
    torch.testing.assert_close(b.grad, torch.full((12,), 5.0, device=DEVICE))


def _fp64_grads(fn, ref, inputs):
    """(codetta's output and gradients, the fp64 reference's) of fn and ref on inputs, from a random
    upstream gradient; inputs may hold empty dims."""
    def run(f, ins, upstream):
        out = f(*ins)
        out.backward(upstream.to(out.dtype))
        return [out, *(t.grad for t in ins)]

    ins = [t.detach().requires_grad_() for t in inputs]
    upstream = torch.randn_like(fn(*ins))
    return run(fn, ins, upstream), run(ref, [t.detach().double().requires_grad_() for t in inputs], upstream)


def _rms(x, g):
    return F.rms_norm(x, (x.shape[-1],), g, EPS)


INV_FREQ_8 = 1.0 / 10000 ** (torch.arange(0, 8, 2, device=DEVICE, dtype=torch.float64) / 8)

EMPTY = {  # name -> (codetta, fp64 math, input shapes): a dim of 0 somewhere
    "swiglu_no_rows": (lambda x, g, wg, wu: ops.rmsnorm_swiglu(x, g, wg, wu, EPS),
                       lambda x, g, wg, wu: F.silu(F.linear(_rms(x, g), wg)) * F.linear(_rms(x, g), wu),
                       [(0, 8), (8,), (6, 8), (6, 8)]),
    "swiglu_no_features": (lambda x, g, wg, wu: ops.rmsnorm_swiglu(x, g, wg, wu, EPS),
                           lambda x, g, wg, wu: F.silu(F.linear(_rms(x, g), wg)) * F.linear(_rms(x, g), wu),
                           [(3, 8), (8,), (0, 8), (0, 8)]),
    "linear_no_outputs": (lambda x, w: codetta.linear(x, w), lambda x, w: F.linear(x, w), [(3, 8), (0, 8)]),
    "rmsnorm_linear_no_outputs": (lambda x, g, w: ops.rmsnorm_linear(x, g, w, EPS),
                                  lambda x, g, w: F.linear(_rms(x, g), w), [(3, 8), (8,), (0, 8)]),
    "rmsnorm_linear_an_empty_part": (lambda x, g, w, w0: ops.rmsnorm_linear(x, g, [w, w0], EPS),
                                     lambda x, g, w, w0: F.linear(_rms(x, g), torch.cat([w, w0])),
                                     [(3, 8), (8,), (5, 8), (0, 8)]),
    "linear_residual_empty_k": (lambda a, w, r: ops.linear_residual(a, w, r), lambda a, w, r: F.linear(a, w) + r,
                                [(3, 0), (8, 0), (3, 8)]),
    "swiglu_mlp_no_features": (lambda x, g, wg, wu, wd: ops.swiglu_mlp(x, g, wg, wu, wd, EPS),
                               lambda x, g, wg, wu, wd: x + F.linear(F.silu(F.linear(_rms(x, g), wg))
                                                                     * F.linear(_rms(x, g), wu), wd),
                               [(3, 8), (8,), (0, 8), (0, 8), (8, 0)]),
    # a hidden size of 0: the norm of no columns, the GEMMs' empty sums (0) plus what else adds
    "rmsnorm_linear_no_hidden": (lambda x, g, w: ops.rmsnorm_linear(x, g, w, EPS),
                                 lambda x, g, w: F.linear(_rms(x, g), w), [(3, 0), (0,), (5, 0)]),
    "swiglu_mlp_no_hidden": (lambda x, g, wg, wu, wd, b: ops.swiglu_mlp(x, g, wg, wu, wd, EPS, bias=(b, b, None)),
                             lambda x, g, wg, wu, wd, b: x + F.linear(F.silu(F.linear(_rms(x, g), wg, b))
                                                                      * F.linear(_rms(x, g), wu, b), wd),
                             [(2, 3, 0), (0,), (6, 0), (6, 0), (0, 6), (6,)]),
    # the package's own reference too: it reshapes heads of an empty batch
    "qkv_rope_no_rows": (lambda x, g, wq, wk, wv: torch.cat(ops.rmsnorm_qkv_rope(
                             x, g, wq, wk, wv, torch.zeros(0, dtype=torch.long, device=DEVICE),
                             INV_FREQ_8.to(x.dtype), head_dim=8, q_norm_weight=g, k_norm_weight=g), -1),
                         lambda x, g, wq, wk, wv: torch.cat(ops.rope.rmsnorm_qkv_rope_reference(
                             x, g, wq, wk, wv, torch.zeros(0, dtype=torch.long, device=DEVICE),
                             INV_FREQ_8.to(x.dtype), head_dim=8, q_norm_weight=g, k_norm_weight=g), -1),
                         [(0, 8), (8,), (16, 8), (8, 8), (8, 8)]),
    "cross_entropy_final_norm_no_hidden": (
        lambda x, w, g, b: ops.linear_cross_entropy(x, w, torch.arange(3, device=DEVICE), bias=b, norm_weight=g),
        lambda x, w, g, b: F.cross_entropy(F.linear(_rms(x, g), w, b), torch.arange(3, device=DEVICE)),
        [(3, 0), (7, 0), (0,), (7,)]),
}


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_empty_dims_as_pytorch(name):
    """No rows, no output features, an empty weight part, an empty K or no hidden size: what
    PyTorch computes (zeros and empty gradients where a dim is 0, a gradient for every input,
    also one without elements), forward and backward."""
    fn, ref, shapes = EMPTY[name]
    inputs = [torch.randn(*s, device=DEVICE) for s in shapes]
    got, expected = _fp64_grads(fn, ref, inputs)
    for g, e in zip(got, expected):
        assert e is not None and g is not None and g.shape == e.shape
        if e.numel():
            assert rel(g, e) < 1e-5


def test_rope_leaves_unrotated_columns_alone():
    """An inf or NaN in a v column (or a q column past rotary_dim) stays in its column, forward and
    backward, as in PyTorch: a rotation by 0 would spread it into the column's partner."""
    x, g, wq, wk, wv, inv_freq = rope_inputs(lead=(5,))
    pos = torch.arange(5, device=DEVICE)
    bias = [torch.zeros(w.shape[0], device=DEVICE) for w in (wq, wk, wv)]
    bias[2][1] = float("inf")  # v column 1 (its rotate_half partner would be column 5)
    bias[0][7] = float("nan")  # q column 7: past rotary_dim 4 (partner 5)
    dv = torch.zeros(5, wv.shape[0], device=DEVICE)
    dv[:, 2] = float("inf")  # backward: an inf gradient on v column 2 only
    results = []
    for dtype, fn in ((torch.float32, ops.rmsnorm_qkv_rope), (torch.float64, ops.rope.rmsnorm_qkv_rope_reference)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (wq, wk, wv)]
        out = fn(x.to(dtype), g.to(dtype), *leaves, pos, inv_freq[:2].to(dtype), head_dim=8, rotary_dim=4,
                 bias=tuple(b.to(dtype) for b in bias), eps=EPS)
        torch.autograd.backward(out, [torch.ones_like(out[0]), torch.ones_like(out[1]), dv.to(dtype)])
        results.append([*out, *(t.grad for t in leaves)])
    assert results[0][2][:, 1].isinf().all() and results[0][0][:, 7].isnan().all()
    for got, expected in zip(*results):  # where the values are finite: the same places as PyTorch's
        assert torch.equal(got.isfinite(), expected.isfinite())


def test_qk_norm_weight_gradients_with_zero_eps_and_odd_rows():
    """qk_norm_eps = 0 with a row count no multiple of the backward kernel's row block: finite weight
    gradients equal to the fp64 ones (padded rows must not make r = inf poison the sums)."""
    m, d, hd = 7, 16, 8
    x, g = torch.randn(m, d, device=DEVICE), 1 + 0.1 * torch.randn(d, device=DEVICE)
    wq, wk, wv = (torch.randn(n * hd, d, device=DEVICE) / d**0.5 for n in (2, 1, 1))
    qw, kw = (1 + 0.1 * torch.randn(hd, device=DEVICE) for _ in range(2))
    inv_freq = 1.0 / 100 ** (torch.arange(0, hd, 2, device=DEVICE) / hd)
    pos = torch.arange(m, device=DEVICE)
    args = dict(head_dim=hd, eps=EPS, qk_norm_eps=0.0)
    leaves = [t.clone().requires_grad_() for t in (qw, kw)]
    out = ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, pos, inv_freq, q_norm_weight=leaves[0], k_norm_weight=leaves[1],
                               **args)
    upstream = [torch.randn_like(t) for t in out[:2]]  # q and k: what the norm weights reach
    torch.autograd.backward(out[:2], upstream)
    leaves64 = [t.double().requires_grad_() for t in (qw, kw)]
    ref = ops.rope.rmsnorm_qkv_rope_reference(*(t.double() for t in (x, g, wq, wk, wv)), pos, inv_freq.double(),
                                              q_norm_weight=leaves64[0], k_norm_weight=leaves64[1], **args)
    torch.autograd.backward(ref[:2], [u.double() for u in upstream])
    for got, expected in zip(leaves, leaves64):
        assert torch.isfinite(got.grad).all() and rel(got.grad, expected.grad) < 1e-5


def test_fake_implementations_give_the_real_strides_for_transposed_views():
    """Compiled, each operator's fake implementation says the strides its real outputs and
    gradients have, also where an input is a dense transposed view (sequence-first activations,
    a weight given as W.t()): the backend "aot_eager_decomp_partition_crossref" runs every op
    of the graphs both ways and compares them (found by a probe: the fakes took the inputs'
    strides, the ops return contiguous tensors, and inductor's stride asserts failed)."""
    d, f, hd = 32, 48, 16

    def weight(*shape):
        return (torch.randn(*shape, device=DEVICE) * shape[-1] ** -0.5).requires_grad_()

    g = (torch.rand(d, device=DEVICE) + 0.5).requires_grad_()
    x, a = (torch.randn(5, 2, n, device=DEVICE, requires_grad=True) for n in (d, f))  # [S, B, n], read as [B, S, n]
    wq, wk, wv, wg, wu, wd, wo = (weight(*shape) for shape in ((2 * hd, d), (hd, d), (hd, d), (f, d), (f, d), (d, f),
                                                                (d, f)))
    positions, inv_freq = torch.arange(5, device=DEVICE).expand(2, 5), 10000.0 ** -(torch.arange(0, hd, 2) / hd)
    calls = {
        "linear": lambda: codetta.linear(x.transpose(0, 1), wd.t()),
        "rms_norm": lambda: ops.rms_norm(x.transpose(0, 1), g),
        "rmsnorm_linear": lambda: ops.rmsnorm_linear(x.transpose(0, 1), g, wg),
        "linear_residual": lambda: ops.linear_residual(a.transpose(0, 1), wo, x.transpose(0, 1)),
        "rmsnorm_swiglu": lambda: ops.rmsnorm_swiglu(x.transpose(0, 1), g, wg, wu),
        "swiglu_mlp": lambda: ops.swiglu_mlp(x.transpose(0, 1), g, wg, wu, wd),
        "rmsnorm_qkv_rope": lambda: torch.cat(ops.rmsnorm_qkv_rope(x.transpose(0, 1), g, wq, wk, wv, positions,
                                                                   inv_freq.to(DEVICE), head_dim=hd), -1),
        "apply_rope": lambda: torch.cat(ops.apply_rope(x[..., :2 * hd].transpose(0, 1), x[..., hd:].transpose(0, 1),
                                                       positions, inv_freq.to(DEVICE), head_dim=hd), -1),
        "gated_activation": lambda: ops.gated_activation(a.transpose(0, 1), a.transpose(0, 1) * 0.5 + 1),
    }
    leaves = (x, a, g, wq, wk, wv, wg, wu, wd, wo)
    for name, call in calls.items():
        results = []
        for run in (call, torch.compile(call, backend="aot_eager_decomp_partition_crossref", fullgraph=True)):
            for t in leaves:
                t.grad = None
            y = run()
            (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
            results.append([y] + [t.grad for t in leaves])
        torch._dynamo.reset()
        for eager, compiled in zip(*results):
            assert (eager is None) == (compiled is None), name
            if eager is not None:
                torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5, msg=name)


def test_no_double_backward_and_torch_func():
    """backward(create_graph=True) through an operator raises (its second-order terms would be
    missing)."""
    x = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(20, 16, device=DEVICE, requires_grad=True)
    target = torch.randint(0, 20, (6,), device=DEVICE)
    for loss in (ops.linear_cross_entropy(x, w, target), ops.rmsnorm_linear(x, torch.ones(16, device=DEVICE), w).sum(),
                 codetta.linear(x, w).square().sum()):
        with pytest.raises(RuntimeError, match="no second derivative"):
            torch.autograd.grad(loss, x, create_graph=True)


def test_vmap_runs_every_operator_per_sample_forward_and_backward():
    """torch.func.vmap over the operators (those taking a list of weights too, for which PyTorch
    has no fallback) gives the outputs and gradients of one call per sample."""
    xs, w, g, wo = (torch.randn(*shape, device=DEVICE, requires_grad=True) for shape in ((3, 4, 8), (6, 8), (8,), (8, 8)))
    positions, inv_freq = torch.arange(4, device=DEVICE), torch.ones(1, device=DEVICE)

    def residual_then_norm(t):  # the next norm's statistics handed to their consumer (unchecked under vmap)
        x, stats = ops.linear_residual(t, wo, t * 2, g)
        return ops.rmsnorm_linear(x, g, w, stats=stats)

    def mlp_then_norm(t):
        x2, stats = ops.swiglu_mlp(t, g, w, w * 0.5, wo[:, :6], next_norm_weight=g)
        return ops.rmsnorm_linear(x2, g, w, stats=stats)

    calls = {
        "linear": lambda t: codetta.linear(t, w),
        "rms_norm": lambda t: ops.rms_norm(t, g),
        "rmsnorm_linear": lambda t: ops.rmsnorm_linear(t, g, [w[:2], w[2:]]),
        "rmsnorm_swiglu": lambda t: ops.rmsnorm_swiglu(t, g, w, w * 0.5),
        "swiglu_mlp": lambda t: ops.swiglu_mlp(t, g, w, w * 0.5, wo[:, :6]),
        "linear_residual": lambda t: ops.linear_residual(t, wo, t * 2),
        "linear_residual_stats": residual_then_norm,
        "swiglu_mlp_stats": mlp_then_norm,
        "rmsnorm_qkv_rope": lambda t: torch.cat(
            ops.rmsnorm_qkv_rope(t, g, w[:4], w[4:6], wo[:2], positions, inv_freq, head_dim=2)[:3], -1),
        "apply_rope": lambda t: torch.cat(ops.apply_rope(t, t[..., :2] * 2, positions, inv_freq, head_dim=2), -1),
        "gated_activation": lambda t: ops.gated_activation(t, t * 0.5 + 1),
    }
    for name, call in calls.items():
        results = []
        for batched in (lambda: torch.func.vmap(call)(xs), lambda: torch.stack([call(x) for x in xs])):
            for t in (xs, w, g, wo):
                t.grad = None
            y = batched()
            (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
            results.append([y] + [t.grad for t in (xs, w, g, wo)])
        for got, expected in zip(*results):
            assert (got is None) == (expected is None), name
            if got is not None:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


def _forward_ad_calls(x, w, g, target):
    import torch.autograd.forward_ad as fwAD

    v = torch.randn_like(x)

    def dual(fn):
        with fwAD.dual_level():
            fn(fwAD.make_dual(x, v))

    return {
        "func.jvp linear": lambda: torch.func.jvp(lambda t: codetta.linear(t, w), (x,), (v,)),
        "func.jacfwd rmsnorm_linear": lambda: torch.func.jacfwd(lambda t: ops.rmsnorm_linear(t, g, w))(x),
        "forward_ad swiglu_mlp": lambda: dual(lambda t: ops.swiglu_mlp(t, g, w, w, w.t().contiguous())),
        "forward_ad linear_cross_entropy": lambda: dual(lambda t: ops.linear_cross_entropy(t, w, target)),
    }


def test_forward_mode_ad_is_refused():
    """The operators have no forward derivative: PyTorch would give zero or missing tangents."""
    x, w, g = (torch.randn(6, 16, device=DEVICE), torch.randn(16, 16, device=DEVICE),
               torch.ones(16, device=DEVICE))
    target = torch.randint(0, 16, (6,), device=DEVICE)
    for what, call in _forward_ad_calls(x, w, g, target).items():
        with pytest.raises(RuntimeError, match="no forward-mode derivative"):
            call()
            pytest.fail(what)


def test_torch_func_reverse_transforms_are_refused_by_name():
    """torch.func.grad, vjp and jacrev cannot run PyTorch's custom operators: the error names the
    operator and what works instead (PyTorch's own names neither)."""
    x, w, g = (torch.randn(6, 16, device=DEVICE), torch.randn(16, 16, device=DEVICE),
               torch.ones(16, device=DEVICE))
    target = torch.randint(0, 16, (6,), device=DEVICE)
    calls = {
        "func.grad linear": lambda: torch.func.grad(lambda t: codetta.linear(t, w).sum())(x),
        "func.vjp rmsnorm_linear": lambda: torch.func.vjp(lambda t: ops.rmsnorm_linear(t, g, w), x),
        "func.jacrev swiglu_mlp": lambda: torch.func.jacrev(lambda t: ops.swiglu_mlp(t, g, w, w, w))(x),
        "func.grad linear_cross_entropy": lambda: torch.func.grad(lambda t: ops.linear_cross_entropy(t, w, target))(x),
    }
    # RoPE's tables from tensors made inside the transform (wrapped, as a model's cos and sin are)
    positions, inv_freq, w_kv = torch.arange(6, device=DEVICE), torch.rand(4, device=DEVICE), w[:8]

    def by_positions():
        return dict(positions=positions + 0, inv_freq=inv_freq * 1)

    def by_cos_sin():
        half = positions[:, None].float() * inv_freq
        return dict(positions=None, inv_freq=None, cos_sin=(half.cos().repeat(1, 2), half.sin().repeat(1, 2)))

    for rope in (by_positions, by_cos_sin):
        calls[f"func.grad rmsnorm_qkv_rope {rope.__name__}"] = lambda rope=rope: torch.func.grad(
            lambda t: ops.rmsnorm_qkv_rope(t, g, w, w_kv, w_kv, head_dim=8, **rope())[0].sum())(x)
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match=r"codetta::\w+: .*torch\.func\.grad, vjp or jacrev.*torch\.autograd\.grad"):
            call()
            pytest.fail(what)


@pytest.mark.parametrize("op", ["rmsnorm_linear", "rmsnorm_swiglu_relu", "rmsnorm_qkv_rope"])
def test_an_output_that_overflowed_without_a_gradient_leaves_dx_finite(op):
    """An output column that overflowed to +-inf (a huge weight row) but gets no gradient (a loss
    that leaves it out; ReLU's zero at -inf) adds nothing to the norm backward's row term z . dz,
    as it adds nothing to PyTorch's h . dh: dx stays finite (inf * 0 made whole rows NaN)."""
    from test_ops_rope import EPS as HF_STYLE_EPS, hf_style

    torch.manual_seed(0)
    m, d, n = 6, 32, 16
    x = torch.randn(m, d, device=DEVICE).abs()
    g = torch.rand(d, device=DEVICE) + 0.5
    w, w2 = (torch.randn(n, d, device=DEVICE) / d**0.5 for _ in range(2))
    w[0] = -1e38  # column 0 of x-normed W^T overflows to -inf for every token
    keep = torch.ones(n, device=DEVICE)
    keep[0] = 0.0
    positions, inv_freq = torch.arange(m, device=DEVICE), 1.0 / 100 ** torch.linspace(0, 1, 4, device=DEVICE)

    def qkv_masked(qkv):
        q, k, v = qkv[:3]
        return torch.cat((q, k, v * keep[:8].to(v.dtype)), -1)

    def unfused(t, g, w, w2, inv_freq):  # PyTorch's math, in t's dtype
        h = F.rms_norm(t, (d,), g, EPS)  # hf_style's eps is HF_STYLE_EPS
        return {
            "rmsnorm_linear": lambda: F.linear(h, w) * keep.to(t.dtype),
            "rmsnorm_swiglu_relu": lambda: F.relu(F.linear(h, w)) * F.linear(h, w2),
            "rmsnorm_qkv_rope": lambda: qkv_masked(hf_style(t, g, w2, w2[:8], w[:8], positions, inv_freq, 8, 8, 1.0,
                                                            None)),
        }[op]()

    fused = {
        "rmsnorm_linear": lambda t: ops.rmsnorm_linear(t, g, w, EPS) * keep,
        "rmsnorm_swiglu_relu": lambda t: ops.rmsnorm_swiglu(t, g, w, w2, EPS, activation="relu"),
        # w[:8] as W_v: v's first column overflows (v is not rotated), and the loss leaves it out
        "rmsnorm_qkv_rope": lambda t: qkv_masked(ops.rmsnorm_qkv_rope(t, g, w2, w2[:8], w[:8], positions, inv_freq,
                                                                      head_dim=8, eps=HF_STYLE_EPS)),
    }[op]
    grads = []
    for fn, dtype in ((fused, torch.float32), (unfused, torch.float32), (unfused, torch.float64)):
        leaf = x.detach().to(dtype, copy=True).requires_grad_()
        y = fn(leaf) if fn is fused else fn(leaf, *(t.to(dtype) for t in (g, w, w2, inv_freq)))
        y.nan_to_num(0.0, 0.0, 0.0).sum().backward()  # the overflowed column, 0 * inf = NaN, counts nothing
        grads.append(leaf.grad)
    assert torch.isfinite(grads[1]).all()  # PyTorch's, in fp32
    assert torch.isfinite(grads[0]).all(), grads[0]
    # against fp64 (where nothing overflows), as close as PyTorch's fp32 (dx's cancellation loses digits)
    assert rel(grads[0], grads[2]) <= 2 * rel(grads[1], grads[2]) + 1e-6


def test_batched_gradients_are_refused_by_name_and_one_at_a_time_work():
    """torch.autograd.grad(is_grads_batched=True), and jacobian with vectorize=True built on it, hand
    each backward gradients batched by PyTorch's older vmap, which the kernels cannot read: the
    error names the operator and what works; without vectorize the Jacobian is PyTorch's."""
    x, w, g = (torch.randn(3, 8, device=DEVICE, requires_grad=True), torch.randn(5, 8, device=DEVICE),
               torch.rand(8, device=DEVICE) + 0.5)
    target = torch.randint(0, 5, (3,), device=DEVICE)
    positions, inv_freq = torch.arange(3, device=DEVICE), torch.tensor([0.5], device=DEVICE)
    cos, sin = (f(positions[:, None] * inv_freq).repeat(1, 2) for f in (torch.cos, torch.sin))

    def rope(t):  # HF's rotate_half on heads of 2, in plain PyTorch
        heads = t.unflatten(-1, (-1, 2))
        rotated = torch.cat([-heads[..., 1:], heads[..., :1]], -1)
        return (heads * cos[:, None] + rotated * sin[:, None]).flatten(-2)

    functions = {
        "linear": (lambda t: codetta.linear(t, w), lambda t: F.linear(t, w)),
        "rms_norm": (lambda t: ops.rms_norm(t, g), lambda t: F.rms_norm(t, (8,), g, 1e-6)),
        "gated_activation": (lambda t: ops.gated_activation(t, t * 0.5), lambda t: F.silu(t) * t * 0.5),
        # several differentiable outputs: their gradients reach the backward as one list
        "apply_rope": (lambda t: torch.cat(ops.apply_rope(t[:, :4], t[:, 4:], positions, inv_freq, head_dim=2), -1),
                       lambda t: torch.cat([rope(t[:, :4]), rope(t[:, 4:])], -1)),
        "linear_cross_entropy": (lambda t: ops.linear_cross_entropy(t, w, target),
                                 lambda t: F.cross_entropy(F.linear(t, w), target)),
    }
    for name, (fused, unfused) in functions.items():
        y = fused(x)
        basis = torch.eye(y.numel(), device=DEVICE).reshape(y.numel(), *y.shape)
        with pytest.raises(RuntimeError, match=rf"codetta::{name}: .*batched gradients.*vectorize=False"):
            torch.autograd.grad(y, x, basis, is_grads_batched=True)
        with pytest.raises(RuntimeError, match=rf"codetta::{name}: .*batched gradients"):
            torch.autograd.functional.jacobian(fused, x, vectorize=True)
        torch.testing.assert_close(torch.autograd.functional.jacobian(fused, x),
                                   torch.autograd.functional.jacobian(unfused, x), rtol=1e-5, atol=1e-5, msg=name)


class _NoGradient(torch.autograd.Function):
    """Identity whose backward gives its input no gradient (None): what autograd then hands on."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def test_an_output_whose_gradient_never_comes():
    """An operator whose output's gradient arrives as None (undefined: as zeros) gives no
    gradients, and the rest of the graph still back-propagates."""
    x = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, 16, device=DEVICE, requires_grad=True)
    g = torch.ones(16, device=DEVICE)
    target = torch.randint(0, 16, (6,), device=DEVICE)
    outputs = {
        "rmsnorm_linear": lambda: ops.rmsnorm_linear(x, g, w),
        "swiglu_mlp": lambda: ops.swiglu_mlp(x, g, w, w, w),
        "linear_residual": lambda: ops.linear_residual(x, w, x, g)[0],
        "linear_cross_entropy none": lambda: ops.linear_cross_entropy(x, w, target, reduction="none"),
        "linear_cross_entropy mean": lambda: ops.linear_cross_entropy(x, w, target),
    }
    for what, out in outputs.items():
        x.grad = w.grad = None
        (_NoGradient.apply(out()).sum() + 2 * x.sum()).backward()
        assert torch.equal(x.grad, torch.full_like(x, 2.0)), what
        assert w.grad is None, what


def test_vmap_then_backward_through_linear_cross_entropy():
    """Under vmap the loss's gradients are recomputed in the backward (PyTorch's per-sample
    fallback), equal to the per-sample losses' gradients."""
    w = torch.randn(6, 8, device=DEVICE, requires_grad=True)
    xs = torch.randn(2, 3, 8, device=DEVICE, requires_grad=True)
    target = torch.randint(0, 6, (3,), device=DEVICE)
    for reduction in ("mean", "sum"):
        xs.grad = w.grad = None
        torch.vmap(lambda t: ops.linear_cross_entropy(t, w, target, reduction=reduction))(xs).sum().backward()
        x64, w64 = xs.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        sum(torch.nn.functional.cross_entropy(x64[i] @ w64.t(), target, reduction=reduction) for i in range(2)).backward()
        torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)

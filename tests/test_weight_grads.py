"""codetta.ops.accumulate_weight_grads: the wgrad GEMMs add into existing .grad tensors.

Two micro-batches, the second one's backward inside the context: every weight's .grad must
equal the fp64 sum of both micro-batches' gradients (the same math written with
torch.nn.functional), and the additions must have happened in the GEMM (counted), with
autograd handed no second copy. Outside the context, or for a weight with a hook on its
accumulated gradient, autograd accumulates as usual.
"""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import codetta
import codetta.ops.weight_grads as weight_grads
from codetta.ops import (
    accumulate_weight_grads,
    linear_residual,
    rmsnorm_linear,
    rmsnorm_qkv_rope,
    rmsnorm_swiglu,
    swiglu_mlp,
)
from conftest import DEVICE

M, D, EPS = 24, 32, 1e-6
HEAD = 8
INV_FREQ = 1.0 / 10000 ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD)


def _rms(x, g):
    return F.rms_norm(x, (x.shape[-1],), g, EPS)


def _rope(t, pos):
    theta = pos.double()[:, None] * INV_FREQ.to(t.device)
    cos, sin = torch.cat((theta.cos(), theta.cos()), -1)[:, None], torch.cat((theta.sin(), theta.sin()), -1)[:, None]
    heads = t.reshape(t.shape[0], -1, HEAD)
    x1, x2 = heads.chunk(2, dim=-1)
    return (heads * cos + torch.cat((-x2, x1), -1) * sin).reshape(t.shape)


# name -> (weight shapes, codetta op, the same math in plain PyTorch); each takes (x, g, pos, weights)
OPS = {
    "linear_residual": ([(D, 24)],
                        lambda x, g, pos, w: linear_residual(x[:, :24], w[0], x),
                        lambda x, g, pos, w: F.linear(x[:, :24], w[0]) + x),
    "rmsnorm_linear": ([(16, D), (24, D)],
                       lambda x, g, pos, w: rmsnorm_linear(x, g, list(w), EPS),
                       lambda x, g, pos, w: F.linear(_rms(x, g), torch.cat(w))),
    "rmsnorm_swiglu": ([(48, D), (48, D)],
                       lambda x, g, pos, w: rmsnorm_swiglu(x, g, *w, EPS),
                       lambda x, g, pos, w: F.silu(F.linear(_rms(x, g), w[0])) * F.linear(_rms(x, g), w[1])),
    "swiglu_mlp": ([(48, D), (48, D), (D, 48)],
                   lambda x, g, pos, w: swiglu_mlp(x, g, *w, EPS),
                   lambda x, g, pos, w: x + F.linear(F.silu(F.linear(_rms(x, g), w[0])) * F.linear(_rms(x, g), w[1]),
                                                     w[2])),
    "rmsnorm_qkv_rope": ([(32, D), (16, D), (16, D)],
                         lambda x, g, pos, w: torch.cat(rmsnorm_qkv_rope(x, g, *w, pos, INV_FREQ.float().to(x.device),
                                                                         head_dim=HEAD, eps=EPS), -1),
                         lambda x, g, pos, w: torch.cat((_rope(F.linear(_rms(x, g), w[0]), pos),
                                                         _rope(F.linear(_rms(x, g), w[1]), pos),
                                                         F.linear(_rms(x, g), w[2])), -1)),
}


@pytest.fixture
def wgrad_programs(monkeypatch):
    """The program of every wgrad GEMM run, by name ("weight_grad_add": added into a given tensor);
    its ``rows`` attribute: the rows of weight gradient each computed."""
    class Calls(list):
        rows: list

    names = Calls()
    names.rows = []
    gemm = weight_grads.gemm

    def counting(a, b, program=None, **operands):
        names.append(program.name if program is not None else "plain")
        names.rows.append(a.shape[0])
        return gemm(a, b, program, **operands)

    monkeypatch.setattr(weight_grads, "gemm", counting)
    return names


@pytest.fixture
def added_in_gemm(wgrad_programs):
    """The number of wgrad GEMMs that added into a given tensor."""
    return lambda: wgrad_programs.count("weight_grad_add")


def _micro_batches(n_batches):
    return [(torch.randn(M, D, device=DEVICE), torch.randint(0, 4096, (M,), device=DEVICE)) for _ in range(n_batches)]


def _reference_grads(name, weights, g, batches, out_grads):
    shapes, _, reference = OPS[name]
    w64 = [w.detach().double().requires_grad_() for w in weights]
    for (x, pos), dy in zip(batches, out_grads):
        (reference(x.double(), g.double(), pos, w64) * dy.double()).sum().backward()
    return [w.grad for w in w64]


@pytest.mark.parametrize("name", OPS)
def test_second_micro_batch_adds_into_grad_in_the_gemm(name, added_in_gemm):
    shapes, op, _ = OPS[name]
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    g = 1 + 0.2 * torch.randn(D, device=DEVICE)
    batches = _micro_batches(2)
    out_grads = [torch.randn_like(op(x, g, pos, weights)) for x, pos in batches]

    (op(*batches[0][:1], g, batches[0][1], weights) * out_grads[0]).sum().backward()
    assert added_in_gemm() == 0  # no .grad yet: autograd's usual path
    first_grads = [w.grad for w in weights]
    with accumulate_weight_grads():
        (op(batches[1][0], g, batches[1][1], weights) * out_grads[1]).sum().backward()
    assert added_in_gemm() == len(weights)
    for w, ref, first in zip(weights, _reference_grads(name, weights, g, batches, out_grads), first_grads):
        assert w.grad is first  # added in place, not replaced
        err = ((w.grad.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, err


def _forward_backward(op, route, g, weights):
    """(x, positions, dy): op run on a random x that requires grad, eager or through torch.compile
    ("compiled": the registered ops), and backpropagated from a random dy."""
    (x, pos), = _micro_batches(1)
    x.requires_grad_()
    if route == "compiled":
        torch._dynamo.reset()
        op = torch.compile(op, backend="aot_eager", fullgraph=True)
    out = op(x, g, pos, weights)
    dy = torch.randn_like(out)
    (out * dy).sum().backward()
    return x, pos, dy


@pytest.mark.parametrize("route, frozen", [("eager", 0), ("compiled", -1)])
@pytest.mark.parametrize("name", [*OPS, "linear"])
def test_frozen_weights_cost_no_gradient_gemm(name, route, frozen, wgrad_programs):
    """A weight that requires no gradient (frozen, as in partial fine-tuning) gets none and costs
    no wgrad GEMM, in eager mode and through the registered ops (torch.compile: autograd's
    needs_input_grad tells the backward op); the others' gradients and x's are those of the
    fp64 math."""
    shapes, op, reference = OPS.get(name) or ([(24, D)], lambda x, g, pos, w: codetta.linear(x, w[0]),
                                              lambda x, g, pos, w: F.linear(x, w[0]))
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    weights[frozen].requires_grad_(False)
    g = 1 + 0.2 * torch.randn(D, device=DEVICE)
    x, pos, dy = _forward_backward(op, route, g, weights)
    assert sum(wgrad_programs.rows) == sum(w.shape[0] for w in weights if w.requires_grad)
    assert weights[frozen].grad is None
    x64 = x.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_(w.requires_grad) for w in weights]
    (reference(x64, g.double(), pos, w64) * dy.double()).sum().backward()
    for got, ref in zip([x, *weights], [x64, *w64]):
        if ref.requires_grad:
            assert ((got.grad.double() - ref.grad).norm() / ref.grad.norm()).item() < 1e-5


@pytest.mark.parametrize("route", ["eager", "compiled"])
@pytest.mark.parametrize("name", ["rmsnorm_linear", "rmsnorm_swiglu", "swiglu_mlp", "rmsnorm_qkv_rope"])
def test_all_weights_frozen_norm_backward_stores_no_h(name, route, monkeypatch, wgrad_programs):
    """With every weight after the norm frozen (a LoRA model's base), nothing reads h = RMSNorm(x),
    the wgrads' operand: the norm-backward GEMM does not store it; dx and the norm weight's
    gradient are those of the fp64 math."""
    programs = []
    gemm = codetta.ops.rmsnorm.gemm

    def recording(a, b, program=None, **kwargs):
        programs.append(program)
        return gemm(a, b, program, **kwargs)

    monkeypatch.setattr(codetta.ops.rmsnorm, "gemm", recording)
    shapes, op, reference = OPS[name]
    weights = [torch.randn(*s, device=DEVICE) / D**0.5 for s in shapes]
    g = (1 + 0.2 * torch.randn(D, device=DEVICE)).requires_grad_()
    x, pos, dy = _forward_backward(op, route, g, weights)
    backward = [p for p in programs if p is not None and p.name.startswith("rmsnorm_linear_backward")]
    assert len(backward) == 1 and "h" not in backward[0].outputs and "dx" in backward[0].outputs
    assert not wgrad_programs
    x64, g64 = x.detach().double().requires_grad_(), g.detach().double().requires_grad_()
    (reference(x64, g64, pos, [w.double() for w in weights]) * dy.double()).sum().backward()
    for got, ref in ((x.grad, x64.grad), (g.grad, g64.grad)):
        assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_frozen_weight_under_torch_compile(wgrad_programs):
    """Through the registered op (torch.compile): autograd says which gradients it needs."""
    x = torch.randn(M, D, device=DEVICE, requires_grad=True)
    w = torch.randn(24, D, device=DEVICE) / D**0.5
    b = torch.randn(24, device=DEVICE, requires_grad=True)
    out = torch.compile(codetta.linear, backend="aot_eager", fullgraph=True)(x, w, b)
    dy = torch.randn_like(out)
    (out * dy).sum().backward()
    assert not wgrad_programs
    torch.testing.assert_close(x.grad, dy @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.grad, dy.sum(0), rtol=1e-5, atol=1e-5)


def test_outside_the_context_autograd_accumulates(added_in_gemm):
    shapes, op, _ = OPS["rmsnorm_swiglu"]
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    g = torch.ones(D, device=DEVICE)
    batches = _micro_batches(2)
    out_grads = [torch.randn(M, 48, device=DEVICE) for _ in batches]
    for (x, pos), dy in zip(batches, out_grads):
        (op(x, g, pos, weights) * dy).sum().backward()
    assert added_in_gemm() == 0
    for w, ref in zip(weights, _reference_grads("rmsnorm_swiglu", weights, g, batches, out_grads)):
        assert ((w.grad.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_under_autocast_autograd_accumulates_without_warnings(added_in_gemm):
    """Under autocast the operators get cast (non-leaf) copies of the weights: their gradients
    reach the fp32 leaves through autograd, not through the epilogue, and nothing reads the
    .grad of a non-leaf (PyTorch would warn)."""
    shapes, op, _ = OPS["swiglu_mlp"]
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    g = torch.ones(D, device=DEVICE)
    batches = _micro_batches(2)
    out_grads = [torch.randn(M, D, device=DEVICE) for _ in batches]
    expected = None
    for accumulate in (False, True):
        for w in weights:
            w.grad = None
        for (x, pos), dy in zip(batches, out_grads):
            with torch.autocast(DEVICE, dtype=torch.bfloat16), warnings.catch_warnings():
                warnings.simplefilter("error")
                out = op(x, g, pos, weights)
            with accumulate_weight_grads() if accumulate else contextlib.nullcontext(), warnings.catch_warnings():
                warnings.simplefilter("error")
                (out.float() * dy).sum().backward()
        grads = [w.grad.clone() for w in weights]
        expected = expected or grads
        for a, b in zip(grads, expected):
            assert a.dtype == torch.float32 and torch.equal(a, b)
    assert added_in_gemm() == 0


@pytest.mark.parametrize("how", ["autograd_grad", "backward_inputs"])
def test_a_backward_that_leaves_grad_alone_inside_the_context(how, added_in_gemm):
    """torch.autograd.grad returns the gradients asked for and leaves every .grad as it is, and
    backward(inputs=[x]) touches x.grad only (a gradient penalty, a pipeline's dgrad-only pass):
    inside the context, too, nothing is added into the weights' .grad."""
    shapes, op, _ = OPS["swiglu_mlp"]
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    for w in weights:
        w.grad = torch.zeros_like(w)  # an earlier micro-batch's
    g = torch.ones(D, device=DEVICE)
    (x, pos), = _micro_batches(1)
    x.requires_grad_()
    dy = torch.randn(M, D, device=DEVICE)
    with accumulate_weight_grads():
        loss = (op(x, g, pos, weights) * dy).sum()
        if how == "autograd_grad":
            got = torch.autograd.grad(loss, weights)
            for w, dw, ref in zip(weights, got, _reference_grads("swiglu_mlp", weights, g, [(x.detach(), pos)], [dy])):
                assert ((dw.double() - ref).norm() / ref.norm()).item() < 1e-5
        else:
            loss.backward(inputs=[x])
            assert x.grad is not None
    assert added_in_gemm() == 0
    assert all(torch.count_nonzero(w.grad) == 0 for w in weights)


def test_a_weight_with_a_post_accumulate_hook_keeps_autograd_accumulation(added_in_gemm):
    shapes, op, _ = OPS["rmsnorm_qkv_rope"]
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    seen = []
    weights[1].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    g = torch.ones(D, device=DEVICE)
    batches = _micro_batches(2)
    out_grads = [torch.randn(M, 64, device=DEVICE) for _ in batches]
    for (x, pos), dy in zip(batches, out_grads):
        with accumulate_weight_grads():
            (op(x, g, pos, weights) * dy).sum().backward()
    assert added_in_gemm() == 2  # W_q and W_v in the second micro-batch; W_k through autograd, its hook ran
    assert len(seen) == 2
    refs = _reference_grads("rmsnorm_qkv_rope", weights, g, batches, out_grads)
    assert ((seen[1].double() - refs[1]).norm() / refs[1].norm()).item() < 1e-5
    for w, ref in zip(weights, refs):
        assert ((w.grad.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_a_lazily_negated_grad_is_accumulated_by_autograd(added_in_gemm):
    """A .grad that is a lazily negated view (PyTorch's negative bit: its memory holds -values)
    cannot be added into as stored: autograd accumulates it, as without the context."""
    shapes, op, _ = OPS["rmsnorm_linear"]
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    earlier = [torch.randn_like(w) for w in weights]
    weights[0].grad = torch._neg_view(-earlier[0])
    weights[1].grad = earlier[1].clone()
    assert weights[0].grad.is_neg()
    g = torch.ones(D, device=DEVICE)
    (x, pos), = _micro_batches(1)
    dy = torch.randn(M, 40, device=DEVICE)
    with accumulate_weight_grads():
        (op(x, g, pos, weights) * dy).sum().backward()
    assert added_in_gemm() == 1  # W_1 only
    for w, before, ref in zip(weights, earlier, _reference_grads("rmsnorm_linear", weights, g, [(x, pos)], [dy])):
        assert ((w.grad.double() - before.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_a_weight_with_a_gradient_hook_keeps_autograd_accumulation(added_in_gemm):
    """A hook on a weight's gradient (register_hook: here a mask zeroing half of it) sees every
    micro-batch's gradient, as without the context."""
    shapes, op, _ = OPS["rmsnorm_linear"]
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    mask = (torch.arange(shapes[0][0], device=DEVICE) % 2 == 0).float()[:, None]
    seen = []

    def masked(grad):
        seen.append(grad is not None)
        return grad * mask

    weights[0].register_hook(masked)
    g = torch.ones(D, device=DEVICE)
    batches = _micro_batches(2)
    for x, pos in batches:
        with accumulate_weight_grads():
            (op(x, g, pos, weights) * 0.5).sum().backward()
    assert seen == [True, True]
    assert added_in_gemm() == len(weights) - 1  # all but the hooked weight in the second micro-batch
    assert torch.count_nonzero(weights[0].grad[1::2]) == 0
    assert torch.count_nonzero(weights[0].grad[0::2]) > 0


def test_patched_model_micro_batches(added_in_gemm):
    transformers = pytest.importorskip("transformers")
    import codetta

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).to(DEVICE).float()
    patched = codetta.patch(copy.deepcopy(plain))
    batches = [torch.randint(0, 64, (2, 12), device=DEVICE) for _ in range(2)]
    for ids in batches:
        plain(input_ids=ids, labels=ids).loss.backward()
        with accumulate_weight_grads():
            patched(input_ids=ids, labels=ids).loss.backward()
    assert added_in_gemm() == 2 * 7  # per layer: W_q, W_k, W_v, W_o, W_gate, W_up, W_down
    grads = dict(patched.named_parameters())
    for name, p in plain.named_parameters():
        err = ((grads[name].grad - p.grad).norm() / p.grad.norm()).item()
        assert err < 2e-5, (name, err)


def test_bf16_accumulation_within_twice_eager_error(added_in_gemm):
    """bf16: W.grad = round(W.grad + dz^T h) in one rounding, against eager's two (dW, then the sum)."""
    shapes, op, reference = OPS["swiglu_mlp"]

    def bf16(t):  # the inputs as bf16 holds them, for all three computations
        return t.bfloat16().float()

    master = [bf16(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    g = bf16(1 + 0.2 * torch.randn(D, device=DEVICE))
    batches = [(bf16(x), pos) for x, pos in _micro_batches(3)]
    out_grads = [bf16(torch.randn(M, D, device=DEVICE)) for _ in batches]

    def accumulate(fn, fused):
        weights = [torch.nn.Parameter(w.bfloat16()) for w in master]
        for i, ((x, pos), dy) in enumerate(zip(batches, out_grads)):
            with accumulate_weight_grads() if fused and i else contextlib.nullcontext():
                (fn(x.bfloat16(), g.bfloat16(), pos, weights) * dy.bfloat16()).sum().backward()
        return [w.grad for w in weights]

    ours, eager = accumulate(op, True), accumulate(reference, False)
    assert added_in_gemm() == 2 * len(shapes)
    for got, base, ref in zip(ours, eager, _reference_grads("swiglu_mlp", master, g, batches, out_grads)):
        assert got.dtype == torch.bfloat16
        err, eager_err = ((t.double() - ref).norm() / ref.norm() for t in (got, base))
        assert err <= 2 * eager_err, (err, eager_err)


@pytest.mark.parametrize("name", [n for n, (shapes, _, _) in OPS.items() if len(shapes) > 1])
def test_weights_read_as_one_get_one_wgrad_gemm(name, wgrad_programs):
    """Weights read as one (q/k/v, gate/up) get their gradients from one GEMM: their .grad are row
    blocks of one buffer, each contiguous in its weight's shape; a second backward outside the
    context accumulates into them as autograd does, to the fp64 sum of both."""
    shapes, op, _ = OPS[name]
    weights = [torch.nn.Parameter(torch.randn(*s, device=DEVICE) / D**0.5) for s in shapes]
    g = 1 + 0.2 * torch.randn(D, device=DEVICE)
    batches = _micro_batches(2)
    out_grads = [torch.randn_like(op(x, g, pos, weights)) for x, pos in batches]
    wgrad_programs.clear()
    (op(batches[0][0], g, batches[0][1], weights) * out_grads[0]).sum().backward()
    read_as_one = 2 if name == "swiglu_mlp" else len(weights)  # W_down is a GEMM of its own
    assert len(wgrad_programs) == len(weights) - read_as_one + 1
    stacked = weights[:read_as_one]
    assert all(w.grad.shape == w.shape and w.grad.is_contiguous() for w in weights)
    assert len({w.grad.untyped_storage().data_ptr() for w in stacked}) == 1
    (op(batches[1][0], g, batches[1][1], weights) * out_grads[1]).sum().backward()
    for w, ref in zip(weights, _reference_grads(name, weights, g, batches, out_grads)):
        err = ((w.grad.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, err

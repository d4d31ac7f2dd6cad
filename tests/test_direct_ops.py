"""The layer ops' two routes give the same results: direct (eager, plain tensors: their own
autograd.Function) and through the torch.library dispatcher (torch.compile, tensor subclasses).

Both run the same implementation, so outputs and every gradient (weights given as lists
included) must be identical, bit for bit; statistics outputs get no gradient either way.
"""

import pytest
import torch

import codetta
from codetta.ops import autograd, linear_residual, rmsnorm_linear, rmsnorm_qkv_rope, rmsnorm_swiglu, swiglu_mlp
from conftest import DEVICE

EPS = 1e-6
M, D, HD = 12, 32, 16


def leaf(*shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, device=DEVICE) * scale + shift).requires_grad_()


def inputs():
    torch.manual_seed(0)
    return dict(
        x=leaf(M, D), a=leaf(M, 24), g=leaf(D, scale=0.2, shift=1.0), wo=leaf(D, 24, scale=0.2),
        wq=leaf(2 * HD, D, scale=0.2), wk=leaf(HD, D, scale=0.2), wv=leaf(HD, D, scale=0.2),
        bq=leaf(2 * HD, scale=0.1), bk=leaf(HD, scale=0.1), bv=leaf(HD, scale=0.1),
        qn=leaf(HD, scale=0.2, shift=1.0), kn=leaf(HD, scale=0.2, shift=1.0),
        wg=leaf(40, D, scale=0.2), wu=leaf(40, D, scale=0.2), wd=leaf(D, 40, scale=0.2),
    )


def block(t):
    """Every layer op once, fed by a producer's statistics, with list weights, bias and QK-norm."""
    device = t["x"].device
    pos = torch.arange(M, device=device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, device=device).float() / HD))
    x1, stats = linear_residual(t["a"], t["wo"], t["x"], t["g"], EPS)
    q, k, v = rmsnorm_qkv_rope(x1, t["g"], t["wq"], t["wk"], t["wv"], pos, inv_freq, head_dim=HD,
                               bias=(t["bq"], t["bk"], t["bv"]), eps=EPS, stats=stats,
                               q_norm_weight=t["qn"], k_norm_weight=t["kn"])
    y = rmsnorm_swiglu(x1, t["g"], t["wg"], t["wu"], EPS, stats=stats)
    z = rmsnorm_linear(x1, t["g"], [t["wq"], t["wk"]], EPS)
    x2, stats2 = swiglu_mlp(x1, t["g"], t["wg"], t["wu"], t["wd"], EPS, stats=stats, next_norm_weight=t["g"])
    return [q, k, v, y, z, x2, *stats, *stats2]


def run(route_direct: bool, monkeypatch):
    if not route_direct:
        monkeypatch.setattr(autograd, "_runs_directly", lambda name, arg_names, args: False)
    t = inputs()
    outs = block(t)
    torch.manual_seed(1)
    loss = sum((o * torch.randn_like(o)).sum() for o in outs[:6])
    loss.backward()
    monkeypatch.undo()
    return outs, {name: p.grad for name, p in t.items()}


def test_direct_and_dispatched_routes_agree(monkeypatch):
    direct, grads_direct = run(True, monkeypatch)
    dispatched, grads_dispatched = run(False, monkeypatch)
    assert type(direct[3].grad_fn).__name__ == "_DirectBackward"
    assert type(dispatched[3].grad_fn).__name__.startswith("GeneratedBackwardFor_codetta_rmsnorm_swiglu")
    # q, k, v: outputs of the op itself on either route, each in an allocation of its own (their
    # gradients reach the op apart, not concatenated)
    assert {type(t.grad_fn).__name__ for t in direct[:3]} == {"_DirectBackward"}
    assert all(type(t.grad_fn).__name__.startswith("GeneratedBackwardFor_codetta_rmsnorm_qkv_rope")
               for t in dispatched[:3])
    assert len({t.untyped_storage().data_ptr() for t in direct[:3] + dispatched[:3]}) == 6
    for a, b in zip(direct, dispatched):
        assert torch.equal(a, b)
    assert not any(s.requires_grad for s in direct[6:])  # statistics: no gradient
    for name, grad in grads_direct.items():
        assert grad is not None, name
        assert torch.equal(grad, grads_dispatched[name]), name


def test_direct_route_is_taken_for_plain_tensors_only():
    def direct(*args):
        return autograd._runs_directly("codetta::op", [f"t{i}" for i in range(len(args))], args)

    assert direct(torch.zeros(1), [torch.zeros(1)], 1.0, None)
    param = torch.nn.Parameter(torch.zeros(1))
    assert direct(param, [param])

    class Sub(torch.Tensor):
        pass

    sub = torch.zeros(1).as_subclass(Sub)
    assert not direct(sub)
    assert not direct([torch.zeros(1), sub])
    assert not direct(torch.zeros(1, device="meta"), [torch.zeros(1, device="meta")])


def test_meta_tensors_beside_tensors_with_data_are_refused():
    """A weight (or given statistics) on the meta device beside inputs with data is refused,
    naming both: the dispatcher would run the op's fake implementation and hand back
    uninitialized memory on the inputs' device (found by a probe: codetta.linear,
    linear_residual, swiglu_mlp's w_down and rmsnorm_linear's stats did; eager F.linear does)."""
    x, g, w, a = (torch.randn(*shape, device=DEVICE) for shape in ((5, 16), (16,), (12, 16), (5, 8)))
    meta = {name: t.to("meta") for name, t in dict(x=x, g=g, w=w).items()}
    calls = {
        rf"codetta::linear: weight on the meta device \(no data\) but x on {DEVICE}":
            lambda: codetta.linear(x, meta["w"]),
        r"codetta::linear: bias on the meta device": lambda: codetta.linear(x, w, torch.zeros(12, device="meta")),
        rf"codetta::linear_residual: weights on the meta device \(no data\) but a on {DEVICE}":
            lambda: linear_residual(a, torch.randn(16, 8, device="meta"), x, g),
        rf"codetta::swiglu_mlp: w_down on the meta device \(no data\) but x on {DEVICE}":
            lambda: swiglu_mlp(x, g, w, w, torch.randn(16, 12, device="meta")),
        rf"codetta::rmsnorm_linear: u, rstd on the meta device \(no data\) but x on {DEVICE}":
            lambda: rmsnorm_linear(x, g, w, stats=(meta["x"], torch.ones(5, device="meta"))),
    }
    for message, call in calls.items():
        with pytest.raises(ValueError, match=message):
            call()
    # all on the meta device: the shapes, as before
    assert codetta.linear(meta["x"], meta["w"]).shape == (5, 12)


def test_no_op_returns_a_tuple_of_one_tensor():
    """A custom op declared to return ``tuple[Tensor]`` (schema ``-> ((Tensor))``) gets its sizes
    specialized by torch.compile (PyTorch 2.11: a graph per shape under dynamic=True); every
    codetta op returns one tensor, or a tuple of several (importing codetta registered them all)."""
    packets = [getattr(torch.ops.codetta, name) for name in dir(torch.ops.codetta)]
    schemas = [str(getattr(p, overload)._schema) for p in packets if isinstance(p, torch._ops.OpOverloadPacket)
               for overload in p.overloads()]
    assert len(schemas) > 10
    assert not [s for s in schemas if "-> ((" in s]


def test_meta_tensors_get_the_shapes_forward_and_backward():
    """On the meta device (shape inference, deferred initialization) every layer op gives its
    outputs' and gradients' shapes and dtypes, as PyTorch's own ops do, through the registered
    ops' fake implementations (found by a probe: the direct route refused meta tensors)."""
    real = inputs()
    meta = {name: t.detach().to("meta").requires_grad_() for name, t in real.items()}
    outs, meta_outs = block(real), block(meta)
    for o, m in zip(outs, meta_outs):
        assert m.is_meta and (m.shape, m.dtype, m.requires_grad) == (o.shape, o.dtype, o.requires_grad)
    sum(o.sum() for o in outs[:6]).backward()
    sum(o.sum() for o in meta_outs[:6]).backward()
    for name, t in real.items():
        assert meta[name].grad is not None and meta[name].grad.is_meta, name
        assert (meta[name].grad.shape, meta[name].grad.dtype) == (t.grad.shape, t.grad.dtype), name


def test_second_derivatives_are_refused_not_dropped():
    """Backward under create_graph=True fails loudly (the kernels' gradients are not
    differentiable): a second derivative must not come out as zero."""
    a, w, r = leaf(8, 12), leaf(16, 12), leaf(8, 16)
    x = linear_residual(a, w, r)
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad((x * x).sum(), a, create_graph=True)

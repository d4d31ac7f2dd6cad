"""act(gate) * up by itself (codetta.ops.gated_activation): output and gradients against torch's
own activations in fp64, bf16 within twice eager PyTorch's error, both routes (eager and the
registered op under torch.compile), its kernel writing exactly its output, bad inputs refused."""

import pytest
import torch

from codetta.kernels.swiglu import gated_activation as gated_activation_kernel
from codetta.ops import gated_activation
from conftest import DEVICE, INTERPRET
from test_ops_swiglu import TORCH_ACTIVATIONS, rel


def eager(gate, up, activation):
    return TORCH_ACTIVATIONS[activation](gate) * up


def output_and_grads(fn, gate, up, dy, dtype):
    """(y, dL/dgate, dL/dup) for L = sum(y dy), inputs cast to dtype."""
    gate, up = (t.detach().to(dtype).requires_grad_() for t in (gate, up))
    y = fn(gate, up)
    (y * dy.to(dtype)).sum().backward()
    return y, gate.grad, up.grad


@pytest.mark.parametrize("activation", sorted(TORCH_ACTIVATIONS))
@pytest.mark.parametrize("shape", [(1, 1), (37, 70), (2, 9, 130)], ids=str)
def test_forward_backward_fp32(shape, activation):
    """fp32 against fp64 torch; gate and up the two column blocks of one [..., 2F] tensor (as a
    fused gate_up projection returns them: row strides of 2F)."""
    f = shape[-1]
    both = torch.randn(*shape[:-1], 2 * f, device=DEVICE) * 2
    dy = torch.randn(shape, device=DEVICE)

    def ours(gate, up):
        return gated_activation(gate, up, activation)

    def split(fn):
        def run(gate, up):
            return fn(*torch.cat((gate, up), -1).split(f, -1))
        return run

    got = output_and_grads(split(ours), both[..., :f], both[..., f:], dy, torch.float32)
    want = output_and_grads(lambda g, u: eager(g, u, activation), both[..., :f], both[..., f:], dy, torch.float64)
    for name, a, b in zip(("y", "dgate", "dup"), got, want):
        assert a.shape == b.shape and a.dtype == torch.float32, name
        assert rel(a, b) < 1e-6, (name, rel(a, b))


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_bf16_within_twice_eager_error(activation):
    """bf16: output and gradients within twice the error of eager PyTorch's act(gate) * up in
    bf16, both against fp64."""
    m, f = (64, 96) if INTERPRET else (4096, 8192)
    gate, up, dy = (torch.randn(m, f, device=DEVICE) * 2 for _ in range(3))
    got = output_and_grads(lambda g, u: gated_activation(g, u, activation), gate, up, dy, torch.bfloat16)
    base = output_and_grads(lambda g, u: eager(g, u, activation), gate, up, dy, torch.bfloat16)
    want = output_and_grads(lambda g, u: eager(g, u, activation), gate, up, dy, torch.float64)
    for name, a, e, r in zip(("y", "dgate", "dup"), got, base, want):
        assert a.dtype == torch.bfloat16, name
        assert rel(a, r) <= 2 * rel(e, r), (name, rel(a, r), rel(e, r))


@pytest.mark.parametrize("activation", sorted(TORCH_ACTIVATIONS))
def test_non_finite_values_where_pytorch_has_them(activation):
    """NaN and +-inf gates and upstream gradients give NaN and inf exactly where torch's activation
    gives them: relu(NaN) is NaN and passes its gradient; a negative gate selects a zero gradient
    even for a NaN upstream gradient (ReLU's backward selects, it does not multiply); the others
    multiply, so a NaN upstream gradient or an inf up stays NaN where a saturated gate's slope is 0."""
    nan, inf = float("nan"), float("inf")
    gate = torch.tensor([[nan, -1.0, 2.0, inf, -inf, 0.5], [-2.0, 3.0, -0.5, 1.0, nan, -inf],
                         [-200.0, -200.0, -30.0, 1.0, 2.0, -1.0]], device=DEVICE)
    if activation == "gelu":  # torch's erf GELU on a CPU gives NaN for +-inf (x Phi(x) is inf and 0)
        gate = gate.nan_to_num(nan=nan, posinf=30.0, neginf=-30.0)
    up = torch.tensor([[3.0, 5.0, 7.0, 2.0, 4.0, -1.0], [1.0, nan, 2.0, inf, 1.0, 3.0],
                       [1.0, inf, 2.0, 1.0, 1.0, 1.0]], device=DEVICE)
    dy = torch.tensor([[1.0, nan, 1.0, 1.0, 2.0, inf], [nan, 1.0, 1.0, -1.0, 1.0, 1.0],
                       [nan, 1.0, nan, 1.0, 1.0, 1.0]], device=DEVICE)
    got = output_and_grads(lambda g, u: gated_activation(g, u, activation), gate, up, dy, torch.float32)
    expected = output_and_grads(lambda g, u: eager(g, u, activation), gate.cpu(), up.cpu(), dy.cpu(), torch.float32)
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours.cpu(), theirs, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_one_input_requiring_grad_and_compiled_route():
    """Only up requiring grad (gate's gradient not made), and the registered op under
    torch.compile (fullgraph) giving the same output and gradients as the eager route."""
    gate, up, dy = (torch.randn(3, 5, 24, device=DEVICE) for _ in range(3))

    def step(fn):
        up_leaf = up.clone().requires_grad_()
        y = fn(gate, up_leaf, "silu")
        (y * dy).sum().backward()
        return y.detach(), up_leaf.grad

    direct = step(gated_activation)
    compiled = step(torch.compile(gated_activation, backend="aot_eager", fullgraph=True))
    assert rel(direct[1], torch.nn.functional.silu(gate.double()) * dy) < 1e-6
    for got, ref in zip(compiled, direct):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_custom_op_passes_opcheck():
    gate, up = (torch.randn(5, 2, 24, device=DEVICE, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.codetta.gated_activation.default, (gate, up, "gelu", True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("consumed, retain_graph", [(True, False), (True, True), (False, False)])
def test_gradients_over_the_inputs_only_when_handed_over(consumed, retain_graph):
    """With ``inputs_consumed`` and a backward after which autograd frees the graph, dgate and dup
    are written over gate and up (the gradients autograd hands on are those tensors); without it,
    or with retain_graph=True, gate and up are left as they were (a second backward gives the same
    gradients). The gradients are torch's fp64 ones either way."""
    m, f = 13, 24
    leaves = [torch.randn(m, f, device=DEVICE, requires_grad=True) for _ in range(2)]
    gate, up = (t.clone() for t in leaves)  # tensors of their own, as a projection returns them
    before = [t.detach().clone() for t in (gate, up)]
    y = gated_activation(gate, up, "silu", inputs_consumed=consumed)
    dy = torch.randn(m, f, device=DEVICE)
    grads = torch.autograd.grad(y, (gate, up), dy, retain_graph=retain_graph)
    expected = output_and_grads(lambda g, u: eager(g, u, "silu"), *before, dy, torch.float64)[1:]
    for got, want in zip(grads, expected):
        assert rel(got, want) < 1e-6
    written_over = consumed and not retain_graph
    assert [g.data_ptr() == t.data_ptr() for g, t in zip(grads, (gate, up))] == [written_over] * 2
    if not written_over:
        assert all(torch.equal(t, b) for t, b in zip((gate, up), before))
    if retain_graph:
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(y, (gate, up), dy), grads))


def test_handed_over_inputs_saved_by_another_node_raise_not_mislead():
    """gate = exp(a), whose backward reads its saved output: written over by a backward told the
    inputs were handed over, it raises (the version counter bumped) instead of reading dgate as
    exp(a); gate and up of one storage, or leaves (parameters), are never written over."""
    a, b = (torch.randn(6, 8, device=DEVICE, requires_grad=True) for _ in range(2))
    y = gated_activation(a.exp(), b.clone(), inputs_consumed=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    both = torch.randn(2, 6, 8, device=DEVICE, requires_grad=True).clone()
    gate, up = both.unbind()
    before = both.detach().clone()
    gated_activation(gate, up, inputs_consumed=True).sum().backward()
    assert torch.equal(both, before)
    params = [torch.nn.Parameter(torch.randn(6, 8, device=DEVICE)) for _ in range(2)]
    values = [p.detach().clone() for p in params]
    gated_activation(*params, inputs_consumed=True).sum().backward()
    assert all(torch.equal(p, v) and p.grad.data_ptr() != p.data_ptr() for p, v in zip(params, values))


def test_kernel_writes_exactly_its_output():
    """The forward kernel into a view of a larger NaN-filled tensor: every element of the view
    written, nothing outside it; an empty input gives an empty output."""
    m, f = 21, 70
    gate, up = (torch.randn(m, f, device=DEVICE) for _ in range(2))
    big = torch.full((m + 3, f + 10), float("nan"), device=DEVICE)
    out = big[1:m + 1, 4:4 + f]
    y = gated_activation_kernel(gate, up, activation="relu", out=out)
    assert y.data_ptr() == out.data_ptr() and not out.isnan().any()
    inside = torch.zeros_like(big, dtype=torch.bool)
    inside[1:m + 1, 4:4 + f] = True
    assert big[~inside].isnan().all()
    assert rel(out, torch.relu(gate.double()) * up.double()) < 1e-6
    assert gated_activation(gate[:0], up[:0]).shape == (0, f)


def test_bad_inputs():
    gate, up = torch.randn(4, 8, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    cases = [
        (dict(gate=gate.double(), up=up.double()), "gate must be a tensor .* in"),
        (dict(up=up.half()), "gate and up must share their shape, dtype and device"),
        (dict(up=up[:, :7]), "gate and up must share"),
        (dict(up=[1.0]), "up must be a tensor"),
        (dict(activation="gelu_erf"), "^gated_activation: activation must be one of"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            gated_activation(**(dict(gate=gate, up=up) | change))
    with pytest.raises(ValueError, match="out must be"):
        gated_activation_kernel(gate, up, out=torch.empty(8, 4, device=DEVICE).t())

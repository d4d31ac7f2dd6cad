"""The operators and a patched model under torch.autocast (fp32 parameters, bf16 matmuls).

Each operator under autocast must equal the same operator on inputs cast to bf16 by hand
(its GEMM operands in autocast's dtype, the rest as given), and hand fp32 gradients to fp32
leaves. A patched model trained under autocast must be within 2x the error of the
unpatched model under autocast, both against the fp32 model.
"""

import copy

import pytest
import torch

import codetta
from codetta import ops
from conftest import DEVICE

BF16 = torch.bfloat16


def leaf(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).requires_grad_()


def qkv_rope(x, g, wq, wk, wv, positions, inv_freq):
    return ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, positions, inv_freq, head_dim=8)


M, D, F = 12, 32, 48
OPS = {  # name: (operator, its inputs: fp32 leaves, then arguments that keep their dtype)
    "linear": (codetta.linear, lambda: (leaf(M, D), leaf(F, D), leaf(F))),
    "linear_residual": (lambda a, w, r, g: (lambda x, stats: (x, *stats))(*ops.linear_residual(a, w, r, g)),
                        lambda: (leaf(M, F), leaf(D, F, scale=0.2), leaf(M, D), torch.randn(D, device=DEVICE))),
    "rmsnorm_linear": (ops.rmsnorm_linear, lambda: (leaf(M, D), leaf(D), leaf(F, D))),
    "rmsnorm_swiglu": (ops.rmsnorm_swiglu, lambda: (leaf(M, D), leaf(D), leaf(F, D), leaf(F, D))),
    "swiglu_mlp": (ops.swiglu_mlp, lambda: (leaf(M, D), leaf(D), leaf(F, D), leaf(F, D), leaf(D, F, scale=0.2))),
    "rmsnorm_qkv_rope": (qkv_rope, lambda: (leaf(M, D), leaf(D), leaf(32, D), leaf(16, D), leaf(16, D),
                                             torch.arange(M, device=DEVICE),
                                             1.0 / 10000 ** (torch.arange(0, 8, 2, device=DEVICE) / 8))),
    "linear_cross_entropy": (lambda x, w, t: ops.linear_cross_entropy(x, w, t),
                             lambda: (leaf(M, D), leaf(40, D), torch.randint(0, 40, (M,), device=DEVICE))),
}


def _outputs(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", sorted(OPS))
def test_operator_under_autocast_is_the_operator_on_bf16_operands(name):
    op, make = OPS[name]
    inputs = make()
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.autocast(DEVICE, dtype=BF16):
        out = _outputs(op(*inputs))
    cast = [t.detach().to(BF16).requires_grad_(t.requires_grad) if t.is_floating_point() else t for t in inputs]
    if name == "rmsnorm_qkv_rope":  # inv_freq keeps its precision (the RoPE tables are made in fp64)
        cast[-1] = inputs[-1]
    expected = _outputs(op(*cast))
    for o, e in zip(out, expected):
        assert o.dtype == e.dtype and torch.equal(o, e)
    grads = torch.autograd.grad([o.float().sum() for o in out if o.requires_grad], leaves)
    cast_leaves = [c for c, t in zip(cast, inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    expected_grads = torch.autograd.grad([e.float().sum() for e in expected if e.requires_grad], cast_leaves)
    for g, e, t in zip(grads, expected_grads, leaves):
        assert g.dtype == torch.float32 == t.dtype
        torch.testing.assert_close(g, e.float(), rtol=0, atol=0)


def test_patched_model_under_autocast_within_twice_eager_error():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    fp32 = transformers.LlamaForCausalLM(config).to(DEVICE)
    eager, patched = copy.deepcopy(fp32), codetta.patch(copy.deepcopy(fp32))
    ids = torch.randint(0, 96, (4, 33), device=DEVICE)

    def step(model, autocast):
        with torch.autocast(DEVICE, dtype=BF16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}

    loss_ref, grads_ref = step(fp32, False)
    loss_eager, grads_eager = step(eager, True)
    loss, grads = step(patched, True)
    assert all(p.grad.dtype == torch.float32 for p in patched.parameters())
    assert abs(loss - loss_ref) <= 2 * abs(loss_eager - loss_ref) + 1e-4 * abs(loss_ref)
    for name, g_ref in grads_ref.items():
        err = ((grads[name] - g_ref).norm() / g_ref.norm()).item()
        err_eager = ((grads_eager[name] - g_ref).norm() / g_ref.norm()).item()
        assert err <= 2 * err_eager + 1e-6, f"{name}: {err:.2e} vs eager {err_eager:.2e}"


def test_patched_model_under_autocast_compiles_without_graph_break():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = codetta.patch(transformers.LlamaForCausalLM(config).to(DEVICE))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 96, (2, 9), device=DEVICE)
    with torch.autocast(DEVICE, dtype=BF16):
        loss_compiled = compiled(input_ids=ids, labels=ids).loss
        loss = model(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(loss_compiled, loss, rtol=1e-6, atol=1e-6)
    loss_compiled.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())

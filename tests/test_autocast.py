"""The operators and a patched model under torch.autocast (fp32 parameters, bf16 matmuls).

Each operator under autocast must equal the same operator on inputs cast to bf16 by hand
(its GEMM operands in autocast's dtype; the residual stream, norm weights and the rest as
given), and hand fp32 gradients to fp32 leaves. A patched model trained under autocast
must be within 2x the error of the unpatched model under autocast, both against the fp32
model, and keep its residual stream in fp32 as the unpatched model does.
"""

import copy
import warnings

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
OPS = {  # name: (operator, its inputs, which of them autocast casts to bf16: the GEMM operands)
    "linear": (codetta.linear, lambda: (leaf(M, D), leaf(F, D), leaf(F)), "xxx"),
    "linear_residual": (lambda a, w, r, g: (lambda x, stats: (x, *stats))(*ops.linear_residual(a, w, r, g)),
                        lambda: (leaf(M, F), leaf(D, F, scale=0.2), leaf(M, D), torch.randn(D, device=DEVICE)),
                        "xx.."),
    "rmsnorm_linear": (ops.rmsnorm_linear, lambda: (leaf(M, D), leaf(D), leaf(F, D)), "..x"),
    "rmsnorm_swiglu": (ops.rmsnorm_swiglu, lambda: (leaf(M, D), leaf(D), leaf(F, D), leaf(F, D)), "..xx"),
    "swiglu_mlp": (ops.swiglu_mlp, lambda: (leaf(M, D), leaf(D), leaf(F, D), leaf(F, D), leaf(D, F, scale=0.2)),
                   "..xxx"),
    "rmsnorm_qkv_rope": (qkv_rope, lambda: (leaf(M, D), leaf(D), leaf(32, D), leaf(16, D), leaf(16, D),
                                             torch.arange(M, device=DEVICE),
                                             1.0 / 10000 ** (torch.arange(0, 8, 2, device=DEVICE) / 8)), "..xxx.."),
    "linear_cross_entropy": (lambda x, w, t: ops.linear_cross_entropy(x, w, t),
                             lambda: (leaf(M, D), leaf(40, D), torch.randint(0, 40, (M,), device=DEVICE)), "xx."),
    # with a final norm x is a stream (fp32, normalized in fp32 and rounded once), its weight as given
    "linear_cross_entropy_final_norm": (
        lambda x, w, t, g: ops.linear_cross_entropy(x, w, t, norm_weight=g),
        lambda: (leaf(M, D), leaf(40, D), torch.randint(0, 40, (M,), device=DEVICE), leaf(D)), ".x.."),
}


def _outputs(out):
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("name", sorted(OPS))
def test_operator_under_autocast_is_the_operator_on_bf16_operands(name):
    op, make, casts = OPS[name]
    inputs = make()
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.autocast(DEVICE, dtype=BF16):
        out = _outputs(op(*inputs))
    cast = [t.detach().to(BF16 if c == "x" else t.dtype).requires_grad_(t.requires_grad) for t, c in zip(inputs, casts)]
    expected = _outputs(op(*cast))
    for o, e in zip(out, expected):
        assert o.dtype == e.dtype and torch.equal(o, e)
    grads = torch.autograd.grad([o.float().sum() for o in out if o.requires_grad], leaves)
    cast_leaves = [c for c, t in zip(cast, inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    expected_grads = torch.autograd.grad([e.float().sum() for e in expected if e.requires_grad], cast_leaves)
    for g, e, t in zip(grads, expected_grads, leaves):
        assert g.dtype == torch.float32 == t.dtype
        torch.testing.assert_close(g, e.float(), rtol=0, atol=0)


@pytest.mark.parametrize("op, names, make", [
    (codetta.linear, ("x", "weight"), lambda: (leaf(M, D), leaf(F, D))),
    (ops.rmsnorm_linear, ("x", "norm_weight", "weight"), lambda: (leaf(M, D), leaf(D), leaf(F, D))),
    (ops.linear_cross_entropy, ("x", "weight", "target"),
     lambda: (leaf(M, D), leaf(40, D), torch.randint(0, 40, (M,), device=DEVICE))),
], ids=["linear", "rmsnorm_linear", "linear_cross_entropy"])
def test_arguments_passed_by_name_are_cast_as_by_position(op, names, make):
    """Autocast's device comes from the first argument, whether given by position or by name."""
    inputs = make()
    with torch.autocast(DEVICE, dtype=BF16):
        by_position = op(*inputs)
        by_name = op(**dict(zip(names, inputs)))
    assert by_name.dtype == by_position.dtype and torch.equal(by_name, by_position)


@pytest.mark.parametrize("name, params, autocast", [
    ("LlamaForCausalLM", torch.float32, BF16), ("Gemma2ForCausalLM", torch.float32, BF16),
    ("Glm4ForCausalLM", torch.float32, BF16), ("LlamaForCausalLM", torch.float16, BF16),
    ("Glm4ForCausalLM", BF16, torch.float16),
], ids=["llama", "gemma2", "glm4", "llama_fp16_params", "glm4_bf16_params_fp16_autocast"])
def test_patched_model_under_autocast_within_twice_eager_error(name, params, autocast):
    """Llama, and the norms of the sublayers' outputs (codetta.ops.rms_norm) in the dtypes their
    modules return: Gemma 2's in its input's (bf16), GLM-4's promoted with its fp32 weight. And
    16-bit parameters under the other 16-bit dtype: the embeddings' output plus the first
    residual branch make an fp32 stream in the model; fused from the first layer on."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, name)
    config = cls.config_class(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
                              eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    fp32 = cls(config).to(DEVICE)
    eager, patched = copy.deepcopy(fp32).to(params), codetta.patch(copy.deepcopy(fp32).to(params))
    ids = torch.randint(0, 96, (4, 33), device=DEVICE)

    def step(model, enabled):
        with torch.autocast(DEVICE, dtype=autocast, enabled=enabled):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}

    loss_ref, grads_ref = step(fp32, False)
    loss_eager, grads_eager = step(eager, True)
    streams = {}  # each layer's output: the residual stream
    for i, layer in enumerate(patched.model.layers):
        layer.register_forward_hook(lambda module, args, out, i=i: streams.setdefault(i, out))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="codetta")  # no layer falls back to the model's own forward
        loss, grads = step(patched, True)
    assert all(p.grad.dtype == params for p in patched.parameters())
    assert [s.dtype for s in streams.values()] == [torch.float32] * config.num_hidden_layers
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


# A wider residual stream without autocast: fp32 x with bf16 weights (what autocast hands the ops).

EPS = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def mlp_unfused(x, g, wg, wu, wd, operand):
    """The MLP half as transformers computes it under autocast: the norm in x's dtype, each
    matmul on ``operand`` inputs, the residual add in x's dtype."""
    fn = torch.nn.functional
    h = fn.rms_norm(x, (x.shape[-1],), g, EPS).to(operand)
    y = fn.silu(fn.linear(h, wg.to(operand))) * fn.linear(h, wu.to(operand))
    return x + fn.linear(y, wd.to(operand))


def test_fp32_stream_with_bf16_weights_within_twice_the_unfused_error():
    """swiglu_mlp (norm-folded SwiGLU GEMM, producer GEMM, norm backward with the residual
    gradient) on an fp32 x and bf16 weights: x2 and dx stay fp32, and every result is within
    2x the error of the same mixed computation unfused (both against float64)."""
    m, d, f = 40, 32, 48
    x, g = torch.randn(m, d, device=DEVICE), 1 + 0.2 * torch.randn(d, device=DEVICE)
    ws = [torch.randn(f, d, device=DEVICE) / d**0.5, torch.randn(f, d, device=DEVICE) / d**0.5,
          torch.randn(d, f, device=DEVICE) / f**0.5]
    dy = torch.randn(m, d, device=DEVICE)

    def run(fn, stream, weights):
        leaves = [t.to(dt).detach().requires_grad_() for t, dt in zip((x, g, *ws), (stream, stream, *[weights] * 3))]
        out = fn(*leaves)
        out.backward(dy.to(out.dtype))
        return [out] + [t.grad for t in leaves]

    ours = run(lambda *t: ops.swiglu_mlp(*t, eps=EPS), torch.float32, BF16)
    eager = run(lambda *t: mlp_unfused(*t, BF16), torch.float32, BF16)
    ref = run(lambda *t: mlp_unfused(*t, torch.float64), torch.float64, torch.float64)
    assert [t.dtype for t in ours] == [t.dtype for t in eager] == [torch.float32] * 3 + [BF16] * 3
    for name, a, e, r in zip(("x2", "dx", "dg", "dw_gate", "dw_up", "dw_down"), ours, eager, ref):
        assert rel(a, r) <= 2 * rel(e, r) + 1e-6, f"{name}: {rel(a, r):.2e} vs unfused {rel(e, r):.2e}"


def test_cross_entropy_final_norm_on_an_fp32_stream_within_twice_the_unfused_error():
    """linear_cross_entropy with norm_weight on fp32 x and bf16 weights (as under autocast): the
    norm in fp32 rounded once, as the unfused model under autocast computes it; loss and every
    gradient within 2x that computation's error against float64 (summed over seeds: one seed's
    errors are noisy)."""
    m, d, vocab = 64, 64, 200
    errors = {}
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        x = (torch.randn(m, d, generator=gen) * 3).to(DEVICE)
        w = (torch.randn(vocab, d, generator=gen) / 4).to(DEVICE)
        g = (1 + 0.2 * torch.randn(d, generator=gen)).to(DEVICE)
        t = torch.randint(0, vocab, (m,), generator=gen).to(DEVICE)

        def run(fn, stream, weights):
            leaves = [v.to(dt).detach().requires_grad_() for v, dt in zip((x, w, g), (stream, weights, stream))]
            loss = fn(*leaves)
            loss.backward()
            return [loss] + [v.grad for v in leaves]

        def unfused(xx, ww, gg):
            h = torch.nn.functional.rms_norm(xx, (d,), gg, EPS).to(ww.dtype)
            return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, ww).float(), t)

        runs = (run(lambda *v: ops.linear_cross_entropy(v[0], v[1], t, norm_weight=v[2], eps=EPS), torch.float32, BF16),
                run(unfused, torch.float32, BF16), run(unfused, torch.float64, torch.float64))
        assert [v.dtype for v in runs[0][1:]] == [torch.float32, BF16, torch.float32]
        for name, a, e, r in zip(("loss", "dx", "dW", "dg"), *runs):
            ours, theirs = errors.get(name, (0.0, 0.0))
            errors[name] = (ours + rel(a, r), theirs + rel(e, r))
    for name, (ours, theirs) in errors.items():
        assert ours <= 2 * theirs + 1e-6, f"{name}: {ours:.2e} vs unfused {theirs:.2e}"


def test_stream_dtypes_that_do_not_fit_are_refused():
    x, g = torch.randn(4, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    w = torch.randn(6, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x is torch.float16 but the weights are torch.bfloat16"):
        ops.rmsnorm_linear(x.half(), g, w.to(BF16))
    with pytest.raises(ValueError, match="x is torch.bfloat16 but the weights are torch.float32"):
        ops.rmsnorm_linear(x.to(BF16), g, w)
    with pytest.raises(ValueError, match="residual is torch.float16 but a is torch.bfloat16"):
        ops.linear_residual(x[:, :6].to(BF16), w.t().to(BF16), x.half())
    with torch.autocast(DEVICE, dtype=BF16), pytest.raises(ValueError, match="x is torch.float64"):
        ops.rmsnorm_linear(x.double(), g, w)  # autocast leaves fp64 as it is, as torch.autocast does


def test_fp32_stream_ops_pass_opcheck():
    """The fake implementations give the real ops' dtypes with an fp32 stream and bf16 weights."""
    m, d, f = 6, 16, 8

    def t(*shape, dtype=torch.float32):
        return torch.randn(*shape, device=DEVICE).to(dtype).requires_grad_()

    x, g = t(m, d), t(d)
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.codetta.rmsnorm_linear.default, (x, g, [t(f, d, dtype=BF16)], EPS, None, None),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.codetta.linear_residual.default,
                          (t(m, f, dtype=BF16), [t(d, f, dtype=BF16)], x, None, g, EPS, 1.0), test_utils=utils)
    torch.library.opcheck(torch.ops.codetta.rmsnorm_swiglu.default,
                          (x, g, t(f, d, dtype=BF16), t(f, d, dtype=BF16), EPS, None, None, t(f, dtype=BF16), None,
                           "silu"),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.codetta.swiglu_mlp.default,
                          (x, g, t(f, d, dtype=BF16), t(f, d, dtype=BF16), t(d, f, dtype=BF16), EPS, None, None,
                           g.detach(), EPS, None, None, t(d, dtype=BF16), 1.0, "gelu_tanh"), test_utils=utils)

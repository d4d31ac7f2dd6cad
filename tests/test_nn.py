"""codetta.nn.Decoder: loss, logits and every gradient equal the same Llama written unfused.

The reference below is plain PyTorch in float64 (F.rms_norm, F.linear, HF's rotate_half
RoPE, SDPA, SiLU, F.cross_entropy) over the very same parameters.
"""

import pytest
import torch
import torch.nn.functional as F

import codetta
import codetta.nn as cnn
from codetta.kernels import rmsnorm as rmsnorm_kernels
from conftest import DEVICE

CFG = cnn.DecoderConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=500.0)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference_hidden(model, input_ids, input_shifts=None):
    """The residual stream after the last layer, unfused, in the parameters' dtype (layer i's input
    shifted by ``input_shifts[i]`` where given)."""
    cfg = model.cfg
    b, s = input_ids.shape
    x = F.embedding(input_ids, model.embed)
    inv_freq = cfg.rope_theta ** -(torch.arange(0, cfg.head_dim, 2, device=x.device, dtype=torch.float64) / cfg.head_dim)
    angles = torch.arange(s, device=x.device, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    for i, layer in enumerate(model.layers):
        x = x + (input_shifts or {}).get(i, 0.0)
        h = F.rms_norm(x, (cfg.hidden_size,), layer.input_norm, cfg.rms_norm_eps)
        q, k, v = (F.linear(h, w).view(b, s, -1, cfg.head_dim).transpose(1, 2)
                   for w in (layer.q_proj, layer.k_proj, layer.v_proj))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + F.linear(a, layer.o_proj)
        h = F.rms_norm(x, (cfg.hidden_size,), layer.post_attention_norm, cfg.rms_norm_eps)
        x = x + F.linear(F.silu(F.linear(h, layer.gate_proj)) * F.linear(h, layer.up_proj), layer.down_proj)
    return x


def reference_logits(model, input_ids, input_shifts=None):
    x = reference_hidden(model, input_ids, input_shifts)
    return F.linear(F.rms_norm(x, (x.shape[-1],), model.final_norm, model.cfg.rms_norm_eps), model.output_weight)


def make_model(tie=False, seed=0):
    torch.manual_seed(seed)
    model = cnn.Decoder(cnn.DecoderConfig(**{**CFG.__dict__, "tie_embeddings": tie}))
    with torch.no_grad():  # non-trivial norm weights, so that a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.to(DEVICE)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("tie, reduction", [(False, "mean"), (True, "mean"), (False, "sum"), (True, "none")])
def test_loss_and_every_gradient_match_the_unfused_model(tie, reduction):
    model = make_model(tie)
    ids = torch.randint(0, CFG.vocab_size, (2, 7), device=DEVICE)
    targets = torch.roll(ids, -1, dims=1)
    targets[:, -1] = -100
    # "none": the losses' gradients weighted at random, so that each token's shows
    token_weights = torch.rand(ids.shape, device=DEVICE, dtype=torch.float64) if reduction == "none" else 1.0
    loss = model(ids, targets, reduction=reduction)
    assert loss.shape == (ids.shape if reduction == "none" else ())
    (loss.double() * token_weights).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    ref = make_model(tie).double()
    ref_loss = F.cross_entropy(reference_logits(ref, ids).transpose(1, 2), targets, ignore_index=-100,
                               reduction=reduction)
    (ref_loss * token_weights).sum().backward()
    assert rel(loss, ref_loss) < 1e-5
    for name, p in ref.named_parameters():
        assert rel(got[name], p.grad) < 1e-4, name


def test_built_on_the_meta_device_then_loaded():
    """A model made on the meta device, materialized with to_empty and loaded from a state_dict
    (how large models are built) computes what the original does: nothing it needs lies
    outside the state_dict (RoPE's frequencies come from the config)."""
    model = make_model(False)
    with torch.device("meta"):
        copy = cnn.Decoder(CFG)
    copy = copy.to_empty(device=DEVICE)
    copy.load_state_dict(model.state_dict())
    ids = torch.randint(0, CFG.vocab_size, (2, 7), device=DEVICE)
    torch.testing.assert_close(copy(ids, ids), model(ids, ids), rtol=0, atol=0)


def test_logits_without_targets():
    model = make_model()
    ids = torch.randint(0, CFG.vocab_size, (1, 9), device=DEVICE)
    with torch.no_grad():
        assert rel(model(ids), reference_logits(make_model().double(), ids)) < 1e-5


def test_norm_statistics_come_from_the_producers(monkeypatch):
    """Only the first layer's norm reads its input once by itself; every other norm's statistics
    come out of the GEMM before it."""
    calls = []
    original = rmsnorm_kernels.rmsnorm_stats

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr("codetta.ops.rmsnorm.rmsnorm_stats", counting)  # every consumer's stats come from there
    model = make_model()
    ids = torch.randint(0, CFG.vocab_size, (2, 5), device=DEVICE)
    model(ids, ids).backward()
    assert len(calls) == 1


HOOKS_SHIFTING_LAYER_1_INPUT = {  # a shift, not a scale: RMSNorm would hide a scale from the QKV GEMM
    "pre_hook": lambda m: m.layers[1].register_forward_pre_hook(lambda mod, args: (args[0] + 0.5, *args[1:])),
    "new_output": lambda m: m.layers[0].register_forward_hook(lambda mod, args, out: (out[0] + 0.5, out[1])),
    "in_place": lambda m: m.layers[0].register_forward_hook(lambda mod, args, out: [out[0].add_(0.5)] and None),
}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "compiled"])
@pytest.mark.parametrize("hook", list(HOOKS_SHIFTING_LAYER_1_INPUT))
def test_a_hook_that_changes_a_layers_input(hook, mode):
    """A hook that replaces or changes x between layers: the next layer does not take the
    statistics made of the old x (it makes them itself), so the logits are those of the changed
    model (found by a probe: it raised "stats were made for another tensor than x", stats the
    user never passed; in place under inference_mode nothing can tell, so nothing is handed on;
    traced by torch.compile, nothing told: the stale statistics were taken)."""
    model = make_model()
    HOOKS_SHIFTING_LAYER_1_INPUT[hook](model)
    ids = torch.randint(0, CFG.vocab_size, (2, 6), device=DEVICE)
    run = torch.compile(model, backend="eager", fullgraph=True) if mode == "compiled" else model
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        logits = run(ids)
    assert rel(logits, reference_logits(make_model().double(), ids, {1: 0.5})) < 1e-5


def test_compiled_decoder_equals_eager():
    """torch.compile traces the decoder through the operators' custom ops (no Triton launch
    outside them): the same loss and gradients as eager."""
    ids = torch.randint(0, CFG.vocab_size, (2, 7), device=DEVICE)
    results = []
    for compiled in (False, True):
        model = make_model()
        fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        loss = fn(ids, torch.roll(ids, -1, dims=1))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss, grads), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-6)
    for name, g in grads.items():
        assert rel(grads_c[name], g) < 1e-5, name


def test_compiled_decoder_with_dynamic_shapes():
    """torch.compile(dynamic=True) passes sizes and the operators' float defaults (branch_scale)
    as symbols: one graph serves several batch sizes and lengths (PyTorch's size-1
    specialization aside), each call equal to eager; and ops.rms_norm (the norm of Gemma 2's
    sublayer outputs) keeps a dim marked dynamic symbolic."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = make_model()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for i, shape in enumerate(((2, 7), (3, 5), (2, 9), (4, 6))):
        ids = torch.randint(0, CFG.vocab_size, shape, device=DEVICE)
        targets = torch.roll(ids, -1, dims=1)
        torch.testing.assert_close(compiled(ids, targets), model(ids, targets), rtol=1e-5, atol=1e-6)
        if i == 0:
            graphs = counter.frame_count  # Dynamo's own restart of its first trace may count twice
    assert counter.frame_count == graphs  # no graph for the other shapes
    weight = torch.rand(CFG.hidden_size, device=DEVICE) + 0.5
    x = torch.randn(3, 5, CFG.hidden_size, device=DEVICE)
    torch._dynamo.mark_dynamic(x, 0)
    norm = torch.compile(lambda t: codetta.ops.rms_norm(t, weight), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (CFG.hidden_size,), weight, 1e-6), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad, match", [(dict(head_dim=24), "power of two"), (dict(head_dim=1), "2 or more"),
                                        (dict(num_kv_heads=3), "multiple"),
                                        (dict(num_layers=0), "num_layers"), (dict(hidden_size=32.0), "hidden_size"),
                                        (dict(rms_norm_eps=0.0), "positive"), (dict(vocab_size=True), "vocab_size"),
                                        (dict(rope_theta=float("inf")), "rope_theta must be a positive finite"),
                                        (dict(init_std=-0.1), "init_std must be a non-negative"),
                                        (dict(tie_embeddings="no"), "tie_embeddings must be a bool")], ids=str)
def test_config_rejects_what_the_decoder_cannot_run(bad, match):
    with pytest.raises(ValueError, match=match):
        cnn.DecoderConfig(**{**CFG.__dict__, **bad})


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)], ids=["no_tokens", "no_sequences"])
def test_an_empty_batch_gives_what_pytorch_gives(shape):
    """Logits [B, S, V] with no elements, and the mean loss over no token NaN with zero gradients,
    as F.cross_entropy gives (found by a probe: a reshape with -1 of an empty tensor failed)."""
    model = make_model()
    ids = torch.zeros(shape, dtype=torch.long, device=DEVICE)
    assert model(ids).shape == (*shape, CFG.vocab_size)
    loss = model(ids, ids)
    assert loss.isnan() and F.cross_entropy(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)).isnan()
    loss.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_input_ids_must_be_batch_by_sequence():
    with pytest.raises(ValueError, match=r"input_ids must be a tensor \[B, S\], got \(5,\)"):
        make_model()(torch.zeros(5, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("params, autocast", [(torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
                                              (torch.bfloat16, torch.float16)], ids=["fp32", "fp16", "bf16"])
def test_under_autocast_within_twice_the_error_of_the_unfused_model_under_autocast(params, autocast):
    """Parameters under autocast (fp32 ones, as usual; or 16-bit ones under the other 16-bit
    dtype, whose norm weights autocast leaves as they are): the GEMMs run on operands in
    autocast's dtype and the residual stream is what the unfused model under autocast makes of
    it; codetta must be within 2x that model's error (both against float64), and each parameter
    gets its gradient in its own dtype."""
    ids = torch.randint(0, CFG.vocab_size, (2, 16), device=DEVICE)
    targets = torch.roll(ids, -1, dims=1)

    def loss_and_grads(model, fn, enabled):
        with torch.autocast(DEVICE, dtype=autocast, enabled=enabled):
            loss = fn(model)
        loss.backward()
        return loss.double(), {n: p.grad.double() for n, p in model.named_parameters()}

    def unfused(model):
        return F.cross_entropy(reference_logits(model, ids).flatten(0, 1).float(), targets.flatten())

    loss64, grads64 = loss_and_grads(make_model().double(), unfused, False)
    loss_ac, grads_ac = loss_and_grads(make_model().to(params), unfused, True)
    model = make_model().to(params)
    loss, grads = loss_and_grads(model, lambda m: m(ids, targets), True)
    assert all(p.grad.dtype == params for p in model.parameters())
    assert abs(loss - loss64) <= 2 * abs(loss_ac - loss64) + 1e-4 * abs(loss64)
    for name, g64 in grads64.items():
        assert rel(grads[name], g64) <= 2 * rel(grads_ac[name], g64) + 1e-6, name

"""codetta.patch on real transformers models (tiny random configs, no downloads).

Parity: the loss and every parameter gradient of the patched model equal the unpatched
model's (fp32 here: the fused algebra must match to fp32 precision). Plus what a user of
the patched model relies on: generate(), gradient checkpointing, padding masks, the
state_dict, unpatch, and clear errors for what is not supported.
"""

import contextlib
import copy
import functools
import gc
import importlib
import inspect
import io
import shutil
import sys
import threading
import warnings
import weakref

import pytest
import torch

import codetta
from conftest import DEVICE
from unfused_roundings import worse_of_two_roundings

transformers = pytest.importorskip("transformers")
from codetta.integrations.hf import layer as layer_module  # noqa: E402 (it imports transformers)
from codetta.integrations.hf.architectures import ATTENTION, MLP  # noqa: E402
from codetta.ops import apply_rope  # noqa: E402

VOCAB = 96


def tiny_config(name, **overrides):
    """(the model class ``name`` of transformers, a tiny config of it with ``overrides``)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa")
    common.update(overrides)
    model_cls = getattr(transformers, name)
    return model_cls, model_cls.config_class(**common)


def tiny(name, **overrides):
    model_cls, config = tiny_config(name, **overrides)
    torch.manual_seed(0)
    model = model_cls(config).to(DEVICE).float()
    with torch.no_grad():  # transformers initializes biases and the norms' weights to constants: make them count
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias") or "norm" in param_name:
                param.add_(torch.empty_like(param).uniform_(-0.5, 0.5))
    return model


MODELS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama_bias_tied": ("LlamaForCausalLM", dict(attention_bias=True, tie_word_embeddings=True)),
    "llama_mlp_bias": ("LlamaForCausalLM", dict(mlp_bias=True)),
    "llama_mha_rope_scaling": ("LlamaForCausalLM", dict(num_key_value_heads=4, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral_sliding": ("MistralForCausalLM", dict(sliding_window=6)),
    "qwen2_bias": ("Qwen2ForCausalLM", {}),
    "qwen3_qk_norm": ("Qwen3ForCausalLM", {}),
    "gqa8_head64": ("LlamaForCausalLM", dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1, head_dim=64)),
    "llama_eager_attention": ("LlamaForCausalLM", dict(attn_implementation="eager")),
    # the other families, each with what sets it apart from Llama
    "ministral_sliding_layers": ("MinistralForCausalLM", dict(sliding_window=6,
                                                              layer_types=["sliding_attention", "full_attention"])),
    "ministral3_query_scale": ("Ministral3ForCausalLM", dict(sliding_window=6, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, llama_4_scaling_beta=0.1, original_max_position_embeddings=4))),
    "cwm_sliding_layers": ("CwmForCausalLM", dict(sliding_window=6, layer_types=["full_attention", "sliding_attention"])),
    "smollm3_nope_layer": ("SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=6,
                                                      pad_token_id=0,
                                                      layer_types=["sliding_attention", "full_attention"])),
    "helium_interleaved_rope": ("HeliumForCausalLM", {}),
    "ernie4_5_interleaved_rope_biases": ("Ernie4_5ForCausalLM", dict(use_bias=True)),
    "phi3_fused_projections_partial_rope": ("Phi3ForCausalLM", dict(partial_rotary_factor=0.5, sliding_window=6,
                                                                     pad_token_id=0, eos_token_id=2)),
    "glm_fused_gate_up_partial_interleaved_rope": ("GlmForCausalLM", dict(attention_bias=True, pad_token_id=0,
                                                                          eos_token_id=2)),
    "granite_multipliers": ("GraniteForCausalLM", dict(residual_multiplier=0.3, logits_scaling=4.0,
                                                       embedding_multiplier=3.0, attention_multiplier=0.2,
                                                       attention_bias=True, mlp_bias=True)),
    "seed_oss_biases_no_dropout": ("SeedOssForCausalLM", dict(attention_bias=True, attention_out_bias=True,
                                                              residual_dropout=0.0, attention_dropout=0.0,
                                                              pad_token_id=0, eos_token_id=2)),
    "gemma_norm_offset_gelu_tanh": ("GemmaForCausalLM", dict(pad_token_id=0, eos_token_id=2, bos_token_id=1)),
    "llama_gelu_mlp": ("LlamaForCausalLM", dict(hidden_act="gelu")),
    "arcee_ungated_mlp_bias": ("ArceeForCausalLM", dict(mlp_bias=True, pad_token_id=0, eos_token_id=2, bos_token_id=1)),
    # caps small enough to matter on these logits; eager attention applies the attention's cap (sdpa drops it)
    "gemma2_sandwich_norms_softcaps": ("Gemma2ForCausalLM", dict(
        pad_token_id=0, eos_token_id=2, bos_token_id=1, sliding_window=6, final_logit_softcapping=0.5,
        attn_logit_softcapping=1.0, query_pre_attn_scalar=24, attn_implementation="eager")),
    "glm4_sandwich_norms": ("Glm4ForCausalLM", dict(attention_bias=True, pad_token_id=0, eos_token_id=2)),
    "vaultgemma_mlp_norm_softcaps": ("VaultGemmaForCausalLM", dict(
        pad_token_id=0, eos_token_id=2, bos_token_id=1, sliding_window=6, final_logit_softcapping=0.5,
        attn_logit_softcapping=1.0, query_pre_attn_scalar=24, attn_implementation="eager",
        layer_types=["sliding_attention", "full_attention"])),
    "gemma3_qk_norm_rope_per_layer_type": ("Gemma3ForCausalLM", dict(  # and Gemma 3's head_dim of 256
        pad_token_id=0, eos_token_id=2, bos_token_id=1, sliding_window=6, final_logit_softcapping=0.5,
        layer_types=["sliding_attention", "full_attention"], head_dim=256, query_pre_attn_scalar=256)),
    # mixtures of experts (the MLP run as the model's module, the routers' load-balancing loss in the fused loss),
    # with a dense layer (fused) where the family has them
    "moe_mixtral_router_loss": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                                           output_router_logits=True, router_aux_loss_coef=0.3)),
    "moe_qwen2_shared_expert_dense_layer": ("Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.3)),
    "moe_qwen3_qk_norm_sparse_step": ("Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=3, moe_intermediate_size=24, decoder_sparse_step=2, norm_topk_prob=True,
        output_router_logits=True, router_aux_loss_coef=0.3)),
    "moe_ernie4_5_dense_first_layer_biases": ("Ernie4_5_MoeForCausalLM", dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=24, moe_num_shared_experts=1, moe_layer_start_index=1,
        use_bias=True, output_router_logits=True, router_aux_loss_coef=0.3)),
    "moe_glm4_qk_norm_partial_rope_no_router_loss": ("Glm4MoeForCausalLM", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
        use_qk_norm=True, partial_rotary_factor=0.5, attention_bias=True, routed_scaling_factor=2.5,
        output_router_logits=True)),
    "moe_dots1_qk_norm_sliding_layers_grouped_router": ("Dots1ForCausalLM", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1,
        n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True, sliding_window=6,
        max_window_layers=1, output_router_logits=True)),
    "moe_solar_open_grouped_router": ("SolarOpenForCausalLM", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, attention_bias=True, output_router_logits=True)),
}
NEW_FAMILIES = [key for key in MODELS if not key.startswith(("llama", "mistral", "qwen", "gqa"))]


def loss_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_training_step(ref, model, tol=2e-5, **batch):
    loss_ref, grads_ref = loss_and_grads(ref, **batch)
    loss, grads = loss_and_grads(model, **batch)
    assert abs(loss.item() - loss_ref.item()) <= tol * abs(loss_ref.item())
    assert grads.keys() == grads_ref.keys()
    for name, g in grads_ref.items():
        err = ((grads[name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert err < tol * 10, f"{name}: {err}"


@contextlib.contextmanager
def calls_of(function):
    """The ``self`` of each call of ``function`` (a method; by its code, so the class is left as
    transformers defines it: a replaced class forward would make codetta run it) in this thread."""
    code, selves = inspect.unwrap(function).__code__, []

    def profile(frame, event, _):
        if event == "call" and frame.f_code is code:
            selves.append(frame.f_locals["self"])

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield selves
    finally:
        sys.setprofile(previous)


@pytest.mark.parametrize("key", sorted(MODELS))
def test_loss_and_every_gradient_match_unpatched(key):
    name, overrides = MODELS[key]
    ref = tiny(name, **overrides)
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 13), device=DEVICE)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    # fused, not matched by the model's own forward running in its place
    assert not [str(w.message) for w in seen if "codetta" in str(w.message)]
    assert all(layer._codetta_plan.unfusable is None for layer in model.model.layers)


OTHER_KINDS = {  # each family once, each kind at least once: (model, its loss from an output and the batch)
    "LlamaModel": lambda out, ids: (out.last_hidden_state * _fixed_randn(out.last_hidden_state.shape)).sum(),
    "Qwen3ForSequenceClassification": lambda out, ids: out.loss,
    "Qwen2ForTokenClassification": lambda out, ids: out.loss,
    "MistralForQuestionAnswering": lambda out, ids: out.loss,
}


def _fixed_randn(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)


def _task_batch(name, ids):
    if name.endswith("SequenceClassification"):
        return dict(labels=torch.tensor([0, 2], device=DEVICE))
    if name.endswith("TokenClassification"):
        return dict(labels=(ids % 3))
    if name.endswith("QuestionAnswering"):
        return dict(start_positions=torch.tensor([1, 3], device=DEVICE), end_positions=torch.tensor([4, 9], device=DEVICE))
    return {}


@pytest.mark.parametrize("name", sorted(OTHER_KINDS))
def test_bare_decoders_and_other_heads_match_unpatched(name):
    """The families' bare decoder stacks and their classification / QA heads: the decoder layers
    fused, the head and its loss the model's own (no LM loss to fuse); output, loss and every
    gradient as the unpatched model's."""
    ref = tiny(name, pad_token_id=0, num_labels=3, classifier_dropout=0.0)
    model = codetta.patch(copy.deepcopy(ref))
    assert model._codetta_patched["cross_entropy"] is False and "forward" not in model.__dict__
    assert all(layer._codetta_plan is not None for layer in model.base_model.layers)
    ids = torch.randint(1, VOCAB, (2, 13), device=DEVICE)
    results = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        loss = OTHER_KINDS[name](m(input_ids=ids, **_task_batch(name, ids)), ids)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (loss_ref, grads_ref), (loss, grads) = results
    assert abs(loss.item() - loss_ref.item()) <= 2e-5 * abs(loss_ref.item())
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model.parameters()))
    # relative to the largest gradient: a QA head's bias gets ~0 exactly (the softmax's gradients sum to 0)
    scale = max(g.norm() for g in grads_ref.values())
    for param_name, g in grads_ref.items():
        err = ((grads[param_name] - g).norm() / torch.maximum(g.norm(), 1e-3 * scale)).item()
        assert err < 2e-4, f"{param_name}: {err}"
    assert not any(layer._codetta_plan.unfusable for layer in model.base_model.layers)
    codetta.unpatch(model)
    assert all("forward" not in layer.__dict__ for layer in model.base_model.layers)


_ATTENTION_CALLS = []


def _recording_attention(module, q, k, v, attention_mask, **kwargs):
    """sdpa, recording every keyword argument the attention function is given (its values
    where they are not tensors) as flash attention would read them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _ATTENTION_CALLS.append({key: value if not isinstance(value, torch.Tensor) else value.tolist()
                             for key, value in kwargs.items()})
    return sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)


@pytest.mark.parametrize("name, overrides", [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", dict(sliding_window=3)),  # an extra config key: Llama passes no window
    ("MistralForCausalLM", dict(sliding_window=6)),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
], ids=["llama", "llama_window_key", "mistral", "qwen2_window", "qwen3_window"])
def test_attention_function_gets_the_models_arguments(name, overrides):
    """Packed sequences (position_ids restarting in a row, no mask): flash attention finds the
    documents from the position_ids it is given; and each family's sliding_window, per layer."""
    transformers.AttentionInterface.register("codetta_recording", _recording_attention)
    transformers.masking_utils.AttentionMaskInterface.register(
        "codetta_recording", transformers.masking_utils.sdpa_mask)
    ref = tiny(name, attn_implementation="codetta_recording", **overrides)
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (1, 12), device=DEVICE)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]], device=DEVICE)
    calls = []
    for m in (ref, model):
        _ATTENTION_CALLS.clear()
        m(input_ids=ids, position_ids=position_ids, labels=ids)
        calls.append(list(_ATTENTION_CALLS))
    assert len(calls[0]) == 2 and calls[1] == calls[0]
    assert calls[0][0]["position_ids"] == position_ids.tolist()


def _errors(model, ref64, ids):
    """{"loss" and every parameter's name: relative error of ``model``'s against the fp64 model's}."""
    loss64, grads64 = loss_and_grads(ref64, input_ids=ids, labels=ids)
    loss, grads = loss_and_grads(model, input_ids=ids, labels=ids)
    errors = {name: ((grads[name].double() - g).norm() / g.norm()).item() for name, g in grads64.items()}
    return {"loss": abs(loss.double() - loss64).item() / loss64.item(), **errors}


@pytest.mark.parametrize("key", ["llama", "mistral_sliding", "qwen2_bias", "qwen3_qk_norm", "llama_mlp_bias",
                                 "gemma_norm_offset_gelu_tanh", "llama_gelu_mlp"])
def test_bf16_model_within_twice_the_unpatched_error(key):
    """A model cast to bf16: the loss and every gradient of the patched model are within 2x the
    unpatched bf16 model's error (the worse of two equally valid roundings of its norms:
    :mod:`unfused_roundings`), both against the same model in fp64 (plus a floor of a quarter
    of bf16's epsilon, for gradients the unpatched model happens to hit closely)."""
    name, overrides = MODELS[key]
    ref = tiny(name, **overrides)
    assert_bf16_within_twice_the_unpatched_error(ref, codetta.patch(copy.deepcopy(ref).to(torch.bfloat16)))


def assert_bf16_within_twice_the_unpatched_error(ref, model):
    """``model`` (patched, bf16) against ``ref`` (unpatched, fp32) cast to bf16, both against ``ref`` in fp64."""
    ref64 = copy.deepcopy(ref).double()
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 16), device=DEVICE)
    errs_ref = worse_of_two_roundings(lambda m: _errors(m, ref64, ids), ref16)
    errs = _errors(model, ref64, ids)
    floor = 2e-3
    worse = {n: (errs[n], errs_ref[n]) for n in errs_ref if not errs[n] <= 2 * errs_ref[n] + floor}  # NaN fails
    assert not worse, worse


def test_patched_in_fp32_on_the_cpu_then_cast_to_bf16_and_moved(monkeypatch):
    """A model patched as it was built (fp32, on the CPU), then cast to bf16 and moved to the
    test's device (a CUDA GPU in the GPU suite): it runs fused there (its QK-norm modules are not
    called), within 2x the error of the unpatched model."""
    name, overrides = MODELS["qwen3_qk_norm"]
    ref = tiny(name, **overrides)
    model = codetta.patch(copy.deepcopy(ref).cpu()).to(DEVICE, torch.bfloat16)
    assert_bf16_within_twice_the_unpatched_error(ref, model)
    ids = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    with calls_of(type(model.model.layers[0].self_attn.q_norm).forward) as calls:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    qk_norms = [n for layer in model.model.layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    assert not any(c is n for c in calls for n in qk_norms)


@pytest.mark.parametrize("bias, rope", [(False, True), (True, True), (False, False)], ids=["fused", "fused_bias",
                                                                                           "rope_false"])
def test_qwen3_qk_norm_fused_into_the_qkv_epilogue(bias, rope, monkeypatch):
    """QK-norm runs in rmsnorm_qkv_rope (the model's q_norm/k_norm modules are not called) and
    its weight gradients land in q_norm.weight / k_norm.weight; with rope=False (the model's own
    RoPE code after a norm-folded QKV GEMM) as codetta.ops.rms_norm's row kernel."""
    ref = tiny("Qwen3ForCausalLM", attention_bias=bias)
    with torch.no_grad():  # non-trivial norm weights (they are initialized to ones)
        for layer in ref.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.mul_(1 + 0.3 * torch.randn_like(norm.weight))
    model = codetta.patch(copy.deepcopy(ref), rope=rope)
    assert model._codetta_patched["rope"] == rope
    ids = torch.randint(0, VOCAB, (2, 11), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    # counted by the forward's code: a hook on the modules would make the layers run unfused
    with calls_of(type(model.model.layers[0].self_attn.q_norm).forward) as calls:
        model(input_ids=ids, labels=ids)
    qk_norms = [n for layer in model.model.layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    assert not any(c is n for c in calls for n in qk_norms)
    assert all(layer.self_attn.q_norm.weight.grad is not None and layer.self_attn.k_norm.weight.grad is not None
               for layer in model.model.layers)


@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
def test_an_lm_head_without_a_weight_runs_the_models_own_loss(when):
    """An lm_head that is no nn.Linear at all (a Sequential around one): the model's own head and
    loss run, with a warning (found by a probe: the check read lm_head.weight first and failed)."""
    ref = tiny("LlamaForCausalLM")
    patched_first = codetta.patch(copy.deepcopy(ref))
    ref.lm_head = torch.nn.Sequential(ref.lm_head)
    if when == "before_patch":
        model = codetta.patch(copy.deepcopy(ref))
    else:
        model = patched_first
        model.lm_head = copy.deepcopy(ref.lm_head)
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    with pytest.warns(UserWarning, match="lm_head is a torch.nn.modules.container.Sequential"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def test_qk_norm_epsilons_made_different_after_patching_run_unfused():
    """The fused QK-norm takes one epsilon for q and k (checked at patch time): a k_norm epsilon
    changed after patching makes the layer run the model's own forward, with a warning."""
    ref = tiny("Qwen3ForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    for m in (ref, model):
        m.model.layers[1].self_attn.k_norm.variance_epsilon = 0.5
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    with pytest.warns(UserWarning, match="different epsilons"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)


@pytest.mark.parametrize("name, head_dim, share", [("LlamaForCausalLM", 24, None), ("Qwen3ForCausalLM", 24, None),
                                                   ("LlamaForCausalLM", 96, None), ("Phi3ForCausalLM", 24, 0.75),
                                                   ("Phi3ForCausalLM", 32, 0.75), ("Phi3ForCausalLM", 15, 0.5)])
def test_rotary_dims_the_epilogue_cannot_take_rotate_by_codettas_kernel(name, head_dim, share, monkeypatch):
    """head_dim 24 or 96 (Phi-3-mini's), or partial rotary dims that do not divide head_dim (18
    of 24; 24 of 32, as Phi-4-mini's 96 of 128; 8 of an odd 15, the model's frequencies rounding
    its 7.5 up to whole pairs): the epilogue's segments are power-of-two blocks of a tile, so
    RoPE (after Qwen3's QK-norm) runs by codetta.ops.apply_rope after the norm-folded QKV GEMM,
    not by the model's own code, without a warning; parity holds."""
    extra = {} if share is None else dict(partial_rotary_factor=share, pad_token_id=0, eos_token_id=2)
    ref = tiny(name, hidden_size=2 * head_dim if share else 48, num_attention_heads=2, num_key_value_heads=1,
               head_dim=head_dim, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = codetta.patch(copy.deepcopy(ref))
    assert model._codetta_patched["rope"] is True and model._codetta_patched["swiglu"] is True
    modeling = importlib.import_module(type(ref).__module__)
    ours, models = [], []
    monkeypatch.setattr(layer_module, "apply_rope", lambda *a, **k: ours.append(1) or apply_rope(*a, **k))
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb",
                        lambda *a, real=modeling.apply_rotary_pos_emb, **k: models.append(1) or real(*a, **k))
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert len(ours) == len(models) == len(ref.model.layers)  # the model's own RoPE in the unpatched run only


@pytest.mark.parametrize("share, rotated, where", [(1 / 3, 32, "epilogue"), (2 / 3, 64, "kernel")])
def test_power_of_two_rotary_dims_of_a_head_of_96(share, rotated, where, monkeypatch):
    """Phi-3 with heads of 96 rotating a power of two of their dims: 32 divide 96, so segments of
    32 columns tile the heads and the QKV epilogue rotates them; 64 do not (the epilogue's
    segments would straddle heads), so codetta's rotation kernel does, after the norm-folded QKV
    GEMM. Both silently, both with the unpatched model's loss and gradients."""
    ref = tiny("Phi3ForCausalLM", hidden_size=192, num_attention_heads=2, num_key_value_heads=1, head_dim=96,
               partial_rotary_factor=share, pad_token_id=0, eos_token_id=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = codetta.patch(copy.deepcopy(ref))
    calls = {"epilogue": [], "kernel": []}
    fused, rotate = layer_module.rmsnorm_qkv_rope, layer_module.apply_rope
    monkeypatch.setattr(layer_module, "rmsnorm_qkv_rope",
                        lambda *a, **k: calls["epilogue"].append(k["rotary_dim"]) or fused(*a, **k))
    monkeypatch.setattr(layer_module, "apply_rope", lambda *a, **k: calls["kernel"].append(k["rotary_dim"])
                        or rotate(*a, **k))
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    other = "kernel" if where == "epilogue" else "epilogue"
    assert calls[where] == [rotated] * len(ref.model.layers) and not calls[other]


@pytest.mark.parametrize("flags", [dict(rope=False), dict(swiglu=False), dict(cross_entropy=False),
                                   dict(rms_norm=False, rope=False, swiglu=False)], ids=str)
@pytest.mark.parametrize("key", ["qwen2_bias", "granite_multipliers", "phi3_fused_projections_partial_rope"])
def test_partial_patches_match(key, flags):
    """Each part left to the model's own code (its RoPE, partial included, after the norm-folded
    QKV GEMM; its activation between the gate/up and the down GEMMs, Granite's multiplier
    in the latter's epilogue; its loss; the whole layer), the rest fused: parity."""
    name, overrides = MODELS[key]
    ref = tiny(name, **overrides)
    model = codetta.patch(copy.deepcopy(ref), **flags)
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def test_padding_mask_and_ignored_labels():
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (3, 10), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    assert_same_training_step(ref, model, input_ids=ids, attention_mask=mask, labels=labels)


def test_num_items_in_batch_and_shift_labels():
    ref = tiny("MistralForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    n = torch.tensor(11, device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids, num_items_in_batch=n)
    shifted = torch.roll(ids, -1, dims=1)
    assert_same_training_step(ref, model, input_ids=ids, shift_labels=shifted, labels=ids)


def test_labels_flattened_as_the_model_flattens_them():
    """The model's loss flattens its logits and labels: a batch of one may come with 1-d labels
    (and shift_labels); labels of another count of tokens are refused, as by the model."""
    ref = tiny("Qwen2ForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (1, 11), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids[0])
    assert_same_training_step(ref, model, input_ids=ids, labels=ids[0], shift_labels=torch.roll(ids[0], -1))
    for m in (ref, model):
        with pytest.raises(ValueError):
            m(input_ids=ids, labels=ids[0, :7])


def test_a_second_backward_of_the_fused_loss_says_how_to_unfuse_it():
    """The fused loss hands out gradients computed in its forward once: a second backward through
    it (retain_graph=True) is refused, naming codetta.patch's cross_entropy=False, whose loss (the
    model's own) takes it."""
    ids = torch.randint(0, VOCAB, (2, 6), device=DEVICE)
    loss = codetta.patch(tiny("LlamaForCausalLM"))(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"backpropagated already.*codetta.patch\(model, cross_entropy=False\)"):
        loss.backward()
    loss = codetta.patch(tiny("LlamaForCausalLM"), cross_entropy=False)(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    loss.backward()


def test_a_batch_without_targets_and_num_items_in_batch_zero():
    """The Trainer's num_items_in_batch is 0 when an accumulated batch has no target token (completion-
    only fine-tuning, a truncated response): the loss is nan, every gradient exactly 0 (not nan: one
    optimizer step would turn the parameters into nan for good)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    batch = dict(input_ids=ids, labels=torch.full_like(ids, -100), num_items_in_batch=torch.tensor(0, device=DEVICE))
    (loss_ref, grads_ref), (loss, grads) = loss_and_grads(ref, **batch), loss_and_grads(model, **batch)
    assert loss_ref.isnan() and loss.isnan() and grads.keys() == grads_ref.keys()
    assert all(torch.equal(grads[name], g) and not g.any() for name, g in grads_ref.items())


def test_loss_options_the_model_takes():
    """An ``ignore_index`` passed to the model (it goes on to its loss), ``logits_to_keep`` with
    labels for the kept positions, and a ``loss_function`` set on the model (run unfused, warned)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids % 5, ignore_index=0)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids[:, -3:], logits_to_keep=3)
    kept = torch.tensor([0, 4, 8], device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids[:, kept], logits_to_keep=kept)
    if hasattr(importlib.import_module("transformers.modeling_utils"), "slice_logits_to_keep"):  # 2-d, or a mask
        kept = torch.tensor([[0, 3, 5, 8], [1, 2, 7, 8]], device=DEVICE)
        labels = torch.take_along_dim(ids, kept, 1)
        assert_same_training_step(ref, model, input_ids=ids, labels=labels, logits_to_keep=kept)
        mask = torch.rand(ids.shape, device=DEVICE) < 0.5
        assert_same_training_step(ref, model, input_ids=ids, labels=ids[mask], logits_to_keep=mask)

    def smoothed(logits, labels, vocab_size, **kwargs):
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), shifted.flatten(), label_smoothing=0.1)

    ref.loss_function = model.loss_function = smoothed
    with pytest.warns(UserWarning, match="loss_function"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def _with_hook(module):
    module.register_forward_hook(lambda mod, args, out: (out[0] * 0.9, out[1] * 0.9))
    return module


def _half_positions(rotary):
    cls = type(rotary)
    rotary.__class__ = type(f"Custom{cls.__name__}", (cls,),
                            {"forward": lambda self, x, position_ids: cls.forward(self, x, position_ids // 2)})
    return rotary


def _context_extended(rotary):
    config = copy.deepcopy(rotary.config)
    config.rope_parameters = dict(rope_type="linear", rope_theta=10000.0, factor=4.0)
    return type(rotary)(config).to(rotary.inv_freq.device)


@pytest.mark.parametrize("change, fused", [(_context_extended, True), (_with_hook, True), (_half_positions, False)],
                         ids=["replaced", "hooked", "own_forward"])
@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
def test_the_models_rotary_embedding_as_it_is_at_each_call(change, fused, when):
    """RoPE rotates by the position_embeddings the model's rotary_emb makes at each call: a new
    one (context extension), one whose hooks change them; one of a class with a forward of its
    own (whose cos and sin may not have two equal halves) makes the layers apply them as the
    model's own code does, with a warning."""
    ref = tiny("LlamaForCausalLM")
    model = copy.deepcopy(ref)
    if when == "after_patch":
        codetta.patch(model)
    for m in (ref, model):
        torch.manual_seed(1)
        m.model.rotary_emb = change(m.model.rotary_emb)
    if when == "before_patch":
        codetta.patch(model)
    ids = torch.randint(0, VOCAB, (2, 12), device=DEVICE)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert any("rotary_emb" in str(w.message) for w in seen) == (not fused)


def _unequal_halves_hook(rotary):
    def hook(mod, args, out):
        half = out[0].shape[-1] // 2
        scale = torch.cat([torch.ones(half), torch.full((half,), 0.5)]).to(out[0].device)
        return out[0] * scale, out[1] * scale

    rotary.register_forward_hook(hook)
    return rotary


def test_a_rotary_hook_giving_unequal_halves_is_applied_as_the_model_does():
    """The fused RoPE reads the first halves of cos and sin (the model's rotary class makes two
    equal ones): where a hook on rotary_emb makes them differ, RoPE runs as the model's own
    code, with a warning (found by a probe: k_proj's gradient was 60% off, silently)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    for m in (ref, model):
        _unequal_halves_hook(m.model.rotary_emb)
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    with pytest.warns(UserWarning, match="unequal halves"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def test_hooked_rotary_halves_are_checked_once_per_forward(monkeypatch):
    """The check of a hooked rotary embedding's halves synchronizes with the GPU: once for the
    pair all layers share, not once per layer."""
    model = codetta.patch(tiny("LlamaForCausalLM", num_hidden_layers=3))
    _with_hook(model.model.rotary_emb)
    compared = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(a.shape) or equal(a, b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # halves equal: fused
        model(input_ids=torch.randint(0, VOCAB, (2, 9), device=DEVICE), labels=None)
    assert len(compared) == 2  # cos and sin, once


@pytest.mark.parametrize("hook", [_with_hook, _unequal_halves_hook], ids=["equal-halves", "unequal-halves"])
def test_a_hooked_rotary_embedding_under_inference_mode(hook):
    """Under inference_mode the hooked rotary embedding's cos and sin are inference tensors, with
    no version counter to key the halves check on (found by a probe: "Inference tensors do not
    track version counter"): checked per layer then, and the logits are the model's."""
    ref = tiny("LlamaForCausalLM", num_hidden_layers=2).eval()
    model = codetta.patch(copy.deepcopy(ref))
    for m in (ref, model):
        hook(m.model.rotary_emb)
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unequal halves' fallback warns
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_partial_rotary_fails_as_the_model_fails():
    """A config's partial_rotary_factor gives angles for part of head_dim, which these models'
    own RoPE does not take (it raises): the patched model raises the same, instead of rotating
    part of each head (found by a probe: it trained, evaluated and generated silently)."""
    ref = tiny("LlamaForCausalLM", rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0,
                                                        partial_rotary_factor=0.5))
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    with pytest.raises(RuntimeError) as expected:
        ref(input_ids=ids, labels=ids)
    with pytest.warns(UserWarning, match="partial rotary"), pytest.raises(RuntimeError) as got:
        model(input_ids=ids, labels=ids)
    assert str(got.value) == str(expected.value)


def _trainable_angle_scale(rotary):
    rotary.angle_scale = torch.nn.Parameter(torch.tensor(0.9, device=rotary.inv_freq.device))
    rotary.register_forward_hook(lambda mod, args, out: (out[0] * mod.angle_scale, out[1] * mod.angle_scale))
    return rotary


def test_rotary_angles_that_require_grad_get_their_gradient():
    """cos and sin made by a trainable module (here a hook scaling them by a parameter): the fused
    RoPE gives the angles no gradient, so RoPE runs as the model's own code after the
    norm-folded GEMM, with a warning, and the parameter gets its gradient (found by a probe:
    it was dropped silently)."""
    ref = tiny("LlamaForCausalLM")
    ref.model.rotary_emb = _trainable_angle_scale(ref.model.rotary_emb)
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 12), device=DEVICE)
    with pytest.warns(UserWarning, match="rotary angles require grad"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert model.model.rotary_emb.angle_scale.grad is not None


def test_position_embeddings_replaced_before_a_layer_are_applied():
    """A layer's forward pre-hook that replaces the position_embeddings it is given (position
    interpolation done in a hook), and a layer called with position_ids and position_embeddings
    of another rotary embedding: the patched layer applies the position_embeddings, as the
    model's own layer does, not angles of its own from position_ids."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))

    def interpolated(layer, args, kwargs):
        kwargs["position_embeddings"] = layer._rotary(args[0] if args else kwargs["hidden_states"],
                                                      kwargs["position_ids"] // 4)
        return args, kwargs

    for m in (ref, model):
        for layer in m.model.layers:
            layer._rotary = m.model.rotary_emb
            layer.register_forward_pre_hook(interpolated, with_kwargs=True)
    ids = torch.randint(0, VOCAB, (2, 24), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    x = torch.randn(2, 24, 64, device=DEVICE, requires_grad=True)
    positions = torch.arange(24, device=DEVICE)[None]
    cos_sin = _context_extended(ref.model.rotary_emb)(x, positions)
    outs = [m.model.layers[1](x, position_ids=positions, position_embeddings=cos_sin) for m in (ref, model)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_long_positions_match_the_models_own_rope():
    """At positions near 10^5 the model's fp32 angle products are off by ~1e-2 radians from exact
    ones; the patched model rotates by the model's own cos and sin, so loss and gradients match."""
    ref = tiny("LlamaForCausalLM", max_position_embeddings=2**17)
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    positions = torch.arange(100_000, 100_008, device=DEVICE)[None]
    assert_same_training_step(ref, model, input_ids=ids, labels=ids, position_ids=positions)


def test_a_layer_called_with_position_embeddings_alone_applies_them():
    """Llama's own layer reads only the (cos, sin) it is given; a pipeline stage may call it without
    position_ids. The patched layer then applies those, not positions of its own invention."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    x = torch.randn(2, 8, 64, device=DEVICE, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]], device=DEVICE)  # two packed documents
    cos_sin = ref.model.rotary_emb(x, positions)
    outs = [m.model.layers[0](x, position_embeddings=cos_sin) for m in (ref, model)]
    grads = [torch.autograd.grad(out.square().sum(), x)[0] for out in outs]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("key", ["llama", "gemma3_qk_norm_rope_per_layer_type"])
def test_a_layer_called_with_position_ids_alone_rotates_by_the_models_rotary_embedding(key):
    """Without position_embeddings a patched layer takes the model's rotary_emb at those positions
    (Gemma 3's: the frequencies of the layer's own type, local or global): what the model's own
    layer computes given that rotary embedding's (cos, sin) (it cannot run without them)."""
    name, overrides = MODELS[key]
    ref = tiny(name, **overrides)
    model = codetta.patch(copy.deepcopy(ref))
    x = torch.randn(2, 8, 64, device=DEVICE, requires_grad=True)
    positions = torch.arange(3, 11, device=DEVICE)[None]
    for own, patched in zip(ref.model.layers, model.model.layers):
        per_type = (own.self_attn.layer_type,) if name.startswith("Gemma3") else ()
        cos_sin = ref.model.rotary_emb(x, positions, *per_type)
        outs = [own(x, position_ids=positions, position_embeddings=cos_sin), patched(x, position_ids=positions)]
        grads = [torch.autograd.grad(out.square().sum(), x)[0] for out in outs]
        for got, want in (outs[::-1], grads[::-1]):  # fp32 precision, in norm (sums over 256-wide heads)
            assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_return_dict_false_gives_the_models_tuple_layout():
    """(loss, logits, past_key_values): logits None but in its place, so unpacking by position works."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (1, 6), device=DEVICE)
    out = model(input_ids=ids, labels=ids, return_dict=False)
    expected = ref(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(expected) and out[1] is None
    torch.testing.assert_close(out[0], expected[0], rtol=1e-5, atol=1e-6)
    assert type(out[2]) is type(expected[2])


def test_eval_mode_with_labels_returns_the_logits_and_the_loss():
    """An evaluation loop (model.eval(), labels given) reads the logits: the model's own head and
    loss run; in training mode the loss is fused (logits None)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    assert model.training and model(input_ids=ids, labels=ids).logits is None
    ref.eval(), model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a fallback: nothing to warn about
        out, expected = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "training", "compiled"])
@pytest.mark.parametrize("where", ["output_hook", "input_pre_hook"])
def test_hooks_editing_the_residual_stream_in_place(where, mode):
    """Activation steering: a hook adds a vector to a layer's output (or the next layer's input)
    in place. The next layer must not use the norm statistics handed on before the edit (also
    when torch.compile traces the hook), and autograd must allow the edit, as for the
    unpatched model."""
    ref = tiny("LlamaForCausalLM", num_hidden_layers=3)
    model = codetta.patch(copy.deepcopy(ref))
    steer = torch.randn(64, device=DEVICE)

    def output_hook(module, args, output):
        output.add_(steer)

    def input_pre_hook(module, args, kwargs):
        (args[0] if args else kwargs["hidden_states"]).add_(steer)

    for m in (ref, model):
        if where == "output_hook":
            m.model.layers[0].register_forward_hook(output_hook)
        else:
            m.model.layers[1].register_forward_pre_hook(input_pre_hook, with_kwargs=True)
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    if mode == "training":
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    elif mode == "compiled":
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            torch.testing.assert_close(compiled(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    else:
        with getattr(torch, mode)():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_logits_without_labels_and_generate():
    ref = tiny("Qwen3ForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        out_ref = ref.generate(ids, max_new_tokens=5, do_sample=False)
        out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, out_ref)


_ATTENTION_READS = []  # (q, k, v) storages' addresses per attention call


def _attention_recording_what_it_reads(module, q, k, v, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _ATTENTION_READS.append(tuple(t.untyped_storage().data_ptr() for t in (q, k, v)))
    return sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)


def _held_after_forward(model, ids, use_cache):
    """(the bytes of the distinct storages autograd keeps for the backward of one training forward,
    the bytes of the KV cache's copies of a k or v that attention read from elsewhere while autograd
    keeps that too: held twice until the cache is dropped), and the cache."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    _ATTENTION_READS.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids, use_cache=use_cache)
    assert (out.past_key_values is not None) == use_cache
    twice = 0
    for (_, *read), layer in zip(_ATTENTION_READS, out.past_key_values.layers if use_cache else []):
        for ptr, held in zip(read, (layer.keys, layer.values)):
            if held.untyped_storage().data_ptr() != ptr and ptr in storages:
                twice += held.untyped_storage().nbytes()
    out.loss.backward()
    return sum(storages.values()), twice, out.past_key_values


@pytest.mark.parametrize("key", ["llama", "mistral_sliding", "qwen3_qk_norm"])
@pytest.mark.parametrize("rope", [True, False], ids=["qkv_rope_fused", "q_proj_called"])
def test_the_kv_cache_of_a_training_forward_holds_no_second_copy(key, rope):
    """With the cache on in training (transformers' default): a fresh DynamicLayer holds the k and
    v that lie in allocations of their own (the fused QKV GEMM's; apply_rope's k; a called
    v_proj's output) themselves, not copies, and attention reads them; other caches (sliding
    windows) copy, and attention reads the given k and v where autograd keeps them anyway (the
    fused op saves them), else the cache's copy (apply_rope's k and a called v_proj's output are
    then not kept beside it). So autograd keeps as many bytes as with use_cache=False, and k or v
    is held twice only where a copy cannot be avoided. The cache holds the model's keys and values."""
    transformers.AttentionInterface.register("codetta_reads", _attention_recording_what_it_reads)
    transformers.masking_utils.AttentionMaskInterface.register("codetta_reads", transformers.masking_utils.sdpa_mask)
    name, overrides = MODELS[key]
    ref = tiny(name, **overrides)
    if not rope:
        for i in range(len(ref.model.layers)):
            _wrap(ref, f"model.layers.{i}.self_attn.q_proj", LoraLike)
    model = codetta.patch(copy.deepcopy(ref))
    model.set_attn_implementation("codetta_reads")
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    saved, twice, cache = _held_after_forward(model, ids, True)
    assert saved == _held_after_forward(model, ids, False)[0]
    sliding = key == "mistral_sliding"
    k_bytes = sum(layer.keys.untyped_storage().nbytes() for layer in cache.layers)  # as many as v's (a sliding
    # window's keys: a slice of the whole update's)
    # a sliding window's layer copies k and v (attention reads the fused GEMM's, which its backward keeps)
    assert twice == (2 * k_bytes if sliding and rope else 0)
    _ATTENTION_READS.clear()
    cache = model(input_ids=ids, labels=ids).past_key_values
    assert len(_ATTENTION_READS) == len(cache.layers) == 2
    for (q, k, v), layer in zip(_ATTENTION_READS, cache.layers):
        held = layer.keys.untyped_storage().data_ptr(), layer.values.untyped_storage().data_ptr()
        assert len({q, k, v}) == 3  # apart
        if rope and sliding:  # the fused op's own, beside the cache's copies
            assert k != held[0] and v != held[1]
        else:  # the cache's: the given themselves (a DynamicLayer), or its copies
            assert (k, v) == held
    with torch.no_grad():
        cached, cached_ref = (m(input_ids=ids, use_cache=True).past_key_values for m in (model, ref))
        given, given_ref = (m(input_ids=ids, past_key_values=transformers.DynamicCache()).past_key_values
                            for m in (model, ref))  # a cache made without a config: no sliding layers
    for layer, layer_ref, layer_given, layer_given_ref in zip(cached.layers, cached_ref.layers, given.layers,
                                                              given_ref.layers):
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(layer, name), getattr(layer_ref, name), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(getattr(layer_given, name), getattr(layer_given_ref, name), rtol=1e-5,
                                       atol=1e-5)
        if not sliding:  # the given k and v themselves, each its whole allocation
            assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
                       for t in (layer.keys, layer.values, layer_given.keys, layer_given.values))


def test_training_on_top_of_a_cached_prefix_matches_unpatched():
    """A training forward given a cache that already holds a prefix (prompt or prefix tuning):
    attention reads the cache's keys and values, the prefix's included."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    prefix, ids = (torch.randint(0, VOCAB, (2, n), device=DEVICE) for n in (5, 7))
    grads = []
    for m in (ref, model):
        with torch.no_grad():
            cache = m(input_ids=prefix, use_cache=True).past_key_values
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids, past_key_values=cache).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (loss_ref, grads_ref), (loss, got) = grads
    torch.testing.assert_close(loss, loss_ref, rtol=2e-5, atol=0)
    assert got.keys() == grads_ref.keys()
    for n, g in grads_ref.items():
        torch.testing.assert_close(got[n], g, rtol=2e-4, atol=2e-5, msg=n)


# the families whose attention or RoPE differ from Llama's (the others differ in what training covers)
ATTENTION_FAMILIES = [key for key in NEW_FAMILIES if not key.startswith(("gemma_", "arcee", "granite", "seed_oss"))]


@pytest.mark.parametrize("key", ATTENTION_FAMILIES)
def test_generate_in_the_other_families(key):
    """Greedy generation with the KV cache, left-padded: the same tokens as the unpatched model
    (NoPE layers, query scaling by position, interleaved RoPE, per-layer windows, Gemma 2's and 3's
    soft caps and rotary frequencies per layer type included; mixtures of experts without their
    router loss, which transformers' own code fails to compute at a cached step)."""
    name, overrides = MODELS[key]
    if key.startswith("moe_"):
        overrides = dict(overrides, output_router_logits=False)
    ref = tiny(name, **overrides).eval()
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(1, VOCAB, (2, 7), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits,
                                   ref(input_ids=ids, attention_mask=mask).logits, rtol=1e-4, atol=1e-4)
        out_ref = ref.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out, out_ref)


@pytest.mark.parametrize("rotated", [12, 18])
def test_partial_rotary_angles_a_caller_hands_a_layer(rotated):
    """A Phi-3 layer handed cos and sin for more of its 16 dims than the model's 8 (a caller's):
    12 of 16 rotate by codetta's kernel after the norm-folded GEMM (segments of 12 columns do not
    tile heads of 16), silently; 18 of 16 are more than a head has, so the model's own RoPE runs
    (warned; it fails as the model fails). The layer's output is the unpatched layer's."""
    ref = tiny("Phi3ForCausalLM", partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=2)
    model = codetta.patch(copy.deepcopy(ref))
    x = torch.randn(2, 5, 64, device=DEVICE)
    positions = torch.arange(5, device=DEVICE)[None].expand(2, -1)
    angles = positions[..., None].float() * torch.rand(rotated // 2, device=DEVICE)
    cos_sin = (torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin())
    layer = model.model.layers[0]
    if rotated > 16:
        with pytest.warns(UserWarning, match="the rotary angles cover 18 of head_dim 16 dims"):
            with pytest.raises(RuntimeError):
                layer(x, position_ids=positions, position_embeddings=cos_sin)
        with pytest.raises(RuntimeError):
            ref.model.layers[0](x, position_ids=positions, position_embeddings=cos_sin)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = layer(x, position_ids=positions, position_embeddings=cos_sin)
    torch.testing.assert_close(out, ref.model.layers[0](x, position_ids=positions, position_embeddings=cos_sin),
                               rtol=1e-5, atol=1e-5)


def test_granite_logits_scaling_with_a_head_bias():
    """Granite's loss is on (h W^T + b) / logits_scaling: with a bias on the head too (Granite's
    has none, a fine-tuned one might), the fused loss and every gradient as the model's own."""
    ref = tiny("GraniteForCausalLM", logits_scaling=4.0, residual_multiplier=0.5)
    head = ref.lm_head
    ref.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True, device=DEVICE)
    with torch.no_grad():
        ref.lm_head.weight.copy_(head.weight)
        ref.lm_head.bias.uniform_(-2, 2)
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 11), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fused: no warning
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def _no_residual_dropout(layer):
    if hasattr(layer, "resid_attn_dropout"):  # Phi-3's modules
        layer.resid_attn_dropout.p = layer.resid_mlp_dropout.p = 0.0
    else:  # Seed-OSS's rates
        layer.self_attn.residual_dropout = layer.mlp.residual_dropout = 0.0


def _same_step_with_the_same_masks(ref, model, ids, warning):
    """The patched model's training step (warned as ``warning`` says) equals the unpatched
    model's from the same random state: the same dropout masks drawn."""
    torch.manual_seed(1)
    loss_ref, grads_ref = loss_and_grads(ref, input_ids=ids, labels=ids)
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match=warning):
        loss, grads = loss_and_grads(model, input_ids=ids, labels=ids)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
    for param, g in grads_ref.items():
        torch.testing.assert_close(grads[param], g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name, dropout", [("Phi3ForCausalLM", dict(resid_pdrop=0.25)),
                                           ("SeedOssForCausalLM", dict(residual_dropout=0.25, attention_dropout=0.0))])
def test_residual_dropout_in_training_runs_the_models_own_layer(name, dropout):
    """Phi-3 and Seed-OSS drop out each sublayer's output before its residual add, which the
    fused residual add does not: in training with p > 0 the layers run the model's own forward
    (warned; the same dropout masks drawn), in eval mode or with p = 0 they run fused."""
    ref = tiny(name, pad_token_id=0, eos_token_id=2, **dropout)
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    _same_step_with_the_same_masks(ref, model, ids, r"runs the model's own forward.*residual dropout \(p = 0.25\)")
    torch.manual_seed(1)
    assert loss_and_grads(ref, input_ids=ids, labels=ids)[0] != loss_and_grads(ref.eval(), input_ids=ids, labels=ids)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fused from here on: no warning
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(input_ids=ids).logits, ref(input_ids=ids).logits,
                                       rtol=1e-4, atol=1e-4)
        for layer in (*ref.model.layers, *model.model.layers):
            _no_residual_dropout(layer)
        assert_same_training_step(ref.train(), model.train(), input_ids=ids, labels=ids)


@pytest.mark.parametrize("name, dropout", [("Phi3ForCausalLM", dict(resid_pdrop=0.25)),
                                           ("SeedOssForCausalLM", dict(residual_dropout=0.25, attention_dropout=0.0))])
def test_residual_dropout_in_one_half_runs_that_half_as_its_modules(name, dropout, monkeypatch):
    """The MLP's residual dropout on in training, the attention's off: the MLP half runs as the
    model's own modules (the same masks drawn), the attention half fused."""
    ref = tiny(name, pad_token_id=0, eos_token_id=2, **dropout)
    model = codetta.patch(copy.deepcopy(ref))
    for layer in (*ref.model.layers, *model.model.layers):
        if name.startswith("Phi3"):
            layer.resid_attn_dropout.p = 0.0
        else:
            layer.self_attn.residual_dropout = 0.0
    fused_attention = count_calls(monkeypatch, "codetta.integrations.hf.layer._rotated_qkv")
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    _same_step_with_the_same_masks(ref, model, ids, r"MLP half runs as the model's own modules.*residual dropout "
                                                    r"\(p = 0.25\)")
    assert len(fused_attention) == len(model.model.layers)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_evaluation_loss_and_generate_without_autograd(mode):
    """An evaluation loss and generate() under no_grad and inference_mode (inference tensors have
    no version counter: the RoPE tables are then made per call, not reused)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    with mode():
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss,
                                   rtol=1e-5, atol=1e-6)
        out_ref = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(out, out_ref)


def enable_checkpointing(model, every_n_layers=1, **checkpoint_kwargs):
    """Activation checkpointing through the name transformers gives it (``activation_checkpointing_enable``
    since 5.23, ``gradient_checkpointing_enable`` before), with torch.utils.checkpoint's
    ``checkpoint_kwargs`` (use_reentrant) where given."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    kwargs = dict(activation_checkpointing_kwargs=checkpoint_kwargs) if checkpoint_kwargs else {}
    if enable is None:
        if every_n_layers != 1:
            pytest.skip("this transformers checkpoints every layer or none")
        enable = model.gradient_checkpointing_enable
        kwargs = dict(gradient_checkpointing_kwargs=checkpoint_kwargs) if checkpoint_kwargs else {}
    enable(**kwargs, **({} if every_n_layers == 1 else dict(every_n_layers=every_n_layers)))
    model.train()


def count_calls(monkeypatch, target):
    """A list that gets an entry at each call of ``target`` (a "module.function" path): the call's
    keyword arguments."""
    module_name, _, name = target.rpartition(".")
    module = importlib.import_module(module_name)
    calls, original = [], getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("every_n_layers", [1, 2])
@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GemmaForCausalLM", "MixtralForCausalLM"])
def test_gradient_checkpointing_recomputes_the_fused_layers(name, every_n_layers, monkeypatch):
    """Loss and gradients as the unpatched model's, and each checkpointed layer's fused forward run
    again in the backward (its activations not kept: transformers checkpoints in the layer's
    ``__call__`` up to 5.22, in its class's forward, which the patched one replaces, from 5.23).
    No norm statistics are handed to or from a checkpointed layer (a recomputed layer would not find
    them): each layer computes its own, in the forward and again when recomputed. Gemma: the norm
    weight 1 + w, made once for two layers where statistics are handed on."""
    ref = tiny(name, num_hidden_layers=3)
    model = codetta.patch(copy.deepcopy(ref))
    for m in (ref, model):
        enable_checkpointing(m, every_n_layers)
    fused_calls = count_calls(monkeypatch, "codetta.integrations.hf.layer.rmsnorm_qkv_rope")
    stats_calls = count_calls(monkeypatch, "codetta.ops.rmsnorm.rmsnorm_stats")  # every consumer's own statistics
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    recomputed = len(range(0, 3, every_n_layers))
    assert len(fused_calls) == 3 + recomputed
    assert len(stats_calls) == 3 + recomputed
    assert all(layer._codetta_plan.incoming.stats is None and layer._codetta_plan.incoming.norm_weight is None
               for layer in model.model.layers)


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "GemmaForCausalLM"])
def test_norm_statistics_handed_across_layers(name, monkeypatch):
    """Each layer's down projection makes the next layer's input-norm statistics: only the first
    layer computes its own (Gemma's norm weight 1 + w, made once for the two layers)."""
    ref = tiny(name, num_hidden_layers=3)
    model = codetta.patch(copy.deepcopy(ref))
    calls = count_calls(monkeypatch, "codetta.ops.rmsnorm.rmsnorm_stats")
    ids = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert len(calls) == 1
    assert all(layer._codetta_plan.incoming.stats is None and layer._codetta_plan.incoming.norm_weight is None
               for layer in model.model.layers)


CHANGES_TO_A_NORM = {
    "a new weight": lambda norm: setattr(norm, "weight", torch.nn.Parameter(norm.weight.detach() * 2)),
    "its weight scaled in place": lambda norm: norm.weight.mul_(2),
    "another epsilon": lambda norm: setattr(norm, "variance_epsilon", 0.5),
}


@pytest.mark.parametrize("change", list(CHANGES_TO_A_NORM))
@pytest.mark.parametrize("grad", [False, True])
def test_layers_run_one_by_one_with_the_next_norm_changed_in_between(change, grad):
    """As calibration loops do (AWQ, SmoothQuant fold scales into the next layer's input norm
    between running one layer and the next on its output): the statistics the first layer made
    for the norm as it was are not used, and the second layer computes what the unpatched one
    does (it raised, or silently used the old weight)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    outputs = []
    for m in (ref, model):
        decoder = m.model
        with torch.set_grad_enabled(grad):
            h = decoder.embed_tokens(ids)
            positions = decoder.rotary_emb(h, torch.arange(7, device=DEVICE)[None])
            h = decoder.layers[0](h, position_embeddings=positions)
            with torch.no_grad():
                CHANGES_TO_A_NORM[change](decoder.layers[1].input_layernorm)
            outputs.append(decoder.layers[1](h, position_embeddings=positions))
    expected, got = outputs
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if grad:
        weights = [m.model.layers[0].mlp.down_proj.weight for m in (ref, model)]
        grads = [torch.autograd.grad(out.square().sum(), w)[0] for out, w in zip(outputs, weights)]
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)


def test_mixture_of_experts_runs_its_own_module(monkeypatch):
    """A mixture of experts runs as the model's module (hooks on it run, and do not unfuse the
    layer) on the MLP norm's output; a dense layer's MLP is fused and makes the next layer's norm
    statistics, an expert layer's plain residual add makes none (that layer computes its own)."""
    ref = tiny("Qwen2MoeForCausalLM", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
               shared_expert_intermediate_size=40, mlp_only_layers=[1])
    model = codetta.patch(copy.deepcopy(ref))
    inputs = []
    for m in (ref, model):
        m.model.layers[0].mlp.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
    stats_calls = count_calls(monkeypatch, "codetta.ops.rmsnorm.rmsnorm_stats")
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert [layer._codetta_plan.mlp_fused for layer in model.model.layers] == [False, True, False]
    assert all(layer._codetta_plan.unfusable is None and layer._codetta_plan.hooked is None
               for layer in model.model.layers)
    assert len(inputs) == 2 and (inputs[1] - inputs[0]).abs().max() < 1e-5  # the norm's output, as the model's
    assert len(stats_calls) == 2  # layers 0 and 1 (after an expert layer); layer 2's come from layer 1's down GEMM


@pytest.mark.parametrize("asked", [None, False, True])
def test_mixture_of_experts_router_loss_as_the_model_adds_it(asked):
    """``output_router_logits`` (the argument, else the config's) adds the routers' load-balancing
    loss to the fused loss, also with num_items_in_batch and a padding mask; aux_loss and
    router_logits come out as the model's, and the tuple of return_dict=False keeps the model's
    layout with the logits None in their place."""
    ref = tiny("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
               router_aux_loss_coef=0.3)
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=asked, num_items_in_batch=11)
    assert_same_training_step(ref, model, **batch)
    out, expected = model(**batch), ref(**batch)
    assert out.logits is None and (out.aux_loss is None) == (asked is False) == (expected.aux_loss is None)
    if asked is not False:
        torch.testing.assert_close(out.aux_loss, expected.aux_loss, rtol=1e-5, atol=1e-6)
        assert len(out.router_logits) == len(expected.router_logits) == 2
        for got, want in zip(out.router_logits, expected.router_logits):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    as_tuple, expected_tuple = model(**batch, return_dict=False), ref(**batch, return_dict=False)
    assert len(as_tuple) == len(expected_tuple) and as_tuple[2 if asked is not False else 1] is None
    assert [type(t) for t in as_tuple if t is not None] == [type(t) for t in expected_tuple if not isinstance(
        t, torch.Tensor) or t.dim() != 3]
    torch.testing.assert_close(as_tuple[0], expected_tuple[0], rtol=1e-5, atol=1e-6)


def test_parameters_and_state_dict_unchanged_and_unpatch():
    ref = tiny("LlamaForCausalLM")
    model = copy.deepcopy(ref)
    before = {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()}
    codetta.patch(model)
    assert {k: (v.shape, v.dtype, v.data_ptr()) for k, v in model.state_dict().items()} == before
    assert model._codetta_patched["rope"] and "forward" in model.model.layers[0].__dict__
    codetta.unpatch(model)
    assert "forward" not in model.model.layers[0].__dict__ and "forward" not in model.__dict__
    # its bare decoder patched by itself, then the whole model: one patch, whose flags the modules say
    codetta.patch(model.model, rope=False, swiglu=False)
    codetta.patch(model)
    assert "_codetta_patched" not in model.model.__dict__ and model._codetta_patched["rope"]
    assert model.model.layers[0]._codetta_plan.fuse_rope
    codetta.patch(model.model)
    codetta.unpatch(model)  # the bare decoder's patch too
    assert not any(k.startswith("_codetta") or "forward" in m.__dict__ for m in model.modules() for k in m.__dict__)
    ids = torch.randint(0, VOCAB, (1, 6), device=DEVICE)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_copied_pickled_and_inspected_like_the_model():
    """deepcopy and torch.save/torch.load of a whole patched model give patched models of their
    own; the patched forwards keep the model's signature (generate() and the Trainer read it)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    assert inspect.signature(model.forward).parameters.keys() == inspect.signature(ref.forward).parameters.keys()
    layer = model.model.layers[0]
    assert (inspect.signature(layer.forward).parameters.keys()
            == inspect.signature(ref.model.layers[0].forward).parameters.keys())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert other._codetta_patched == model._codetta_patched
        assert layer_module.next_layer_of(other.model.layers[0]._codetta_plan) is other.model.layers[1]
        assert_same_training_step(ref, other, input_ids=ids, labels=ids)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def test_a_frozen_first_layer_is_left_out_of_the_backward(monkeypatch):
    """Embeddings and layer 0 frozen (partial fine-tuning): layer 0's output needs no gradient, so
    autograd keeps nothing for its backward and runs none, as for the unpatched model (found by a
    probe: the trainable norm weight of layer 1, from which layer 0's last GEMM makes that norm's
    statistics, made layer 0's output require grad, and its MLP backward ran)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    backward_calls = count_calls(monkeypatch, "codetta.ops.mlp.swiglu_mlp_backward")
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    for m in (ref, model):
        for p in (*m.model.embed_tokens.parameters(), *m.model.layers[0].parameters()):
            p.requires_grad_(False)
        hidden = m(input_ids=ids, output_hidden_states=True).hidden_states
        assert not hidden[1].requires_grad and hidden[2].requires_grad
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert len(backward_calls) == 1  # layer 1's alone


def test_a_layer_output_whose_memory_was_swapped_gets_its_norm_made_again():
    """Layers run by hand, a layer's output given new memory through ``.data =`` (which no version
    counter sees) before the next layer: that layer normalizes the new values, as the unpatched one
    does (found by a probe: the statistics handed on were taken, and the operator refused them)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    outputs = []
    for m in (ref, model):
        x = m.model.embed_tokens(ids)
        angles = m.model.rotary_emb(x, torch.arange(8, device=DEVICE)[None])
        with torch.no_grad():
            x1 = m.model.layers[0](x, position_embeddings=angles, attention_mask=None)
            x1.data = x1.data * 3 + 1
            outputs.append(m.model.layers[1](x1, position_embeddings=angles, attention_mask=None))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


def test_hub_kernels_of_from_pretrained_are_turned_off(tmp_path, monkeypatch):
    """transformers' from_pretrained turns its hub kernels on by default (5.2x, with the ``kernels``
    package): each change between train() and eval() kernelizes the model again, which removed the
    forward codetta sets on the final norm (found by a probe: after the Trainer's model.train() the
    final norm ran unfused). patch turns them off; the model trains as the unpatched one."""
    ref = tiny("LlamaForCausalLM")
    ref.save_pretrained(tmp_path)
    model = type(ref).from_pretrained(tmp_path).to(DEVICE)
    if not getattr(model, "use_kernels", False):
        pytest.skip("this transformers (or its kernels package) does not turn hub kernels on")
    codetta.patch(model)
    assert model.use_kernels is False
    final_norms = count_calls(monkeypatch, "codetta.integrations.hf.layer.rms_norm")
    model.eval().train().eval().train()  # the Trainer's mode changes
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    assert_same_training_step(ref.train(), model, input_ids=ids, labels=ids)
    assert len(final_norms) == 1


def test_one_layer_copied_copies_that_layer_alone():
    """copy.deepcopy of one patched layer (PEFT's layer_replication, depth up-scaling) copies that
    layer's parameters alone, as for the unpatched model (found by a probe: its plan's references to
    the decoder and the next layer copied the whole model along, once per copied layer); the copy
    appended to the model trains as the unpatched model's copy does."""
    ref = tiny("LlamaForCausalLM", num_hidden_layers=3)
    model = codetta.patch(copy.deepcopy(ref))
    for m in (ref, model):
        memo = {}
        m.model.layers.append(copy.deepcopy(m.model.layers[1], memo))
        copied = {name for name, p in m.named_parameters() if id(p) in memo}
        assert copied and all(name.startswith("model.layers.1.") for name in copied), sorted(copied)
    assert layer_module.next_layer_of(model.model.layers[3]._codetta_plan) is None  # its slot is no layer's
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)


@pytest.mark.parametrize("key", ["llama", "qwen3_qk_norm"])
def test_a_patched_model_on_the_meta_device_runs_as_the_models_own(key):
    """A model built on the meta device (shape and FLOP estimates before to_empty()) runs patched
    as it runs unpatched: training with labels and its backward, and evaluation's logits, all meta
    tensors of the unpatched model's shapes (autocast knows no meta device: not asked there)."""
    model_cls, config = tiny_config(MODELS[key][0], **MODELS[key][1])
    with torch.device("meta"):
        ref, model = model_cls(config), model_cls(copy.deepcopy(config))
    codetta.patch(model)
    ids = torch.zeros(2, 12, dtype=torch.long, device="meta")
    for m in (ref, model):
        m.train()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        assert loss.device.type == "meta" and loss.shape == ()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in m.parameters())
    assert model.eval()(input_ids=ids).logits.shape == ref.eval()(input_ids=ids).logits.shape == (2, 12, VOCAB)


def test_a_layer_removed_after_patching_is_freed():
    """Pruning a patched model (model.model.layers[:1]) frees the removed layers, as for the
    unpatched model: the layer before them holds its next layer weakly, and hands it nothing."""
    ref = tiny("LlamaForCausalLM", num_hidden_layers=3)
    model = codetta.patch(copy.deepcopy(ref))
    removed = weakref.ref(model.model.layers[1])
    for m in (ref, model):
        m.model.layers = m.model.layers[:1]
    gc.collect()
    assert removed() is None
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def test_copied_after_a_step_in_which_a_layers_next_layer_did_not_run():
    """Layers cut after patching (or skipped): the last one run leaves its statistics for a layer
    that does not run. A copy (EMA, keeping the best model) or a checkpoint of the whole model
    taken after that training step works as for the unpatched model, without those activations."""
    ref = tiny("LlamaForCausalLM", num_hidden_layers=3)
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    for m in (ref, model):
        m.model.layers = m.model.layers[:2]
        m(input_ids=ids, labels=ids).loss.backward()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        plans = [layer._codetta_plan for layer in other.model.layers]
        assert plans[0].outgoing is plans[1].incoming and plans[1].outgoing.tensor is None
        assert_same_training_step(ref, other, input_ids=ids, labels=ids)


def test_a_layer_that_does_not_run_keeps_no_activations():
    """The last layer run hands its output and statistics to a layer that does not run (layers cut
    after patching but kept elsewhere, so alive; an exception raised before the next layer takes
    them): once the caller has let go of the forward's outputs, that slot keeps nothing, not the
    autograd graph of a forward whose loss was only read (an evaluation with grad mode on), nor
    its activations."""
    model = codetta.patch(tiny("LlamaForCausalLM", num_hidden_layers=3))
    slot = model.model.layers[1]._codetta_plan.outgoing
    cut = model.model.layers[2]  # alive, not run
    assert slot is cut._codetta_plan.incoming
    model.model.layers = model.model.layers[:2]
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    out = model(input_ids=ids, labels=ids)
    handed = weakref.ref(slot.tensor)
    assert slot.stats is not None and handed().grad_fn is not None
    out.loss.item()
    del out
    gc.collect()
    assert handed() is None and slot.tensor is None and slot.stats is None


def test_a_statistics_slot_shared_by_threads_hands_each_its_own_or_none():
    """Two threads running one model (an eval forward beside training) put and take in one slot:
    a take gets the statistics put with its own tensor, or none (the layer then computes its own),
    never another thread's (the slot holds one record, replaced whole; parts of two records
    mixed made a take raise about statistics the caller never passed)."""
    from codetta.integrations.hf.layer import StatsHandoff

    slot, wrong, barrier = StatsHandoff(), [], threading.Barrier(2)
    norm = torch.nn.RMSNorm(1)

    def run(tag):
        x = torch.zeros(1)
        barrier.wait()
        for i in range(20_000):
            slot.put(x, (tag, i), tag, norm, 1e-6)
            stats, weight = slot.take(x, norm, 1e-6)
            if stats is not None and (stats != (tag, i) or weight != tag):
                wrong.append((tag, i, stats, weight))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(tag,)) for tag in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong, wrong[:3]


def test_a_layer_interrupted_before_taking_its_statistics_keeps_nothing():
    model = codetta.patch(tiny("LlamaForCausalLM"))
    _wrap(model, "model.layers.1.post_attention_layernorm", _with_own_forward)  # unreadable: the layer warns
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    with warnings.catch_warnings(), pytest.raises(UserWarning, match="unfused"):
        warnings.simplefilter("error")
        model(input_ids=ids, labels=ids)
    slot = model.model.layers[1]._codetta_plan.incoming
    gc.collect()
    assert slot.tensor is None and slot.stats is None


def test_deleted_patched_model_is_freed_without_the_garbage_collector():
    """As the unpatched model: ``del model`` frees its parameters at once (a reference cycle would
    keep them, on a GPU too, until Python's cycle collector happens to run)."""
    model = codetta.patch(tiny("LlamaForCausalLM"))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    refs = [weakref.ref(model), weakref.ref(model.model.embed_tokens.weight), weakref.ref(model.lm_head.weight)]
    gc.collect()
    gc.disable()
    try:
        del model
        assert [r() is None for r in refs] == [True] * 3
    finally:
        gc.enable()


def test_a_transformers_release_older_than_the_code_followed_is_refused(monkeypatch):
    model = tiny("LlamaForCausalLM")
    from codetta.integrations import hf

    # the module codetta reads: transformers swaps its own module object on lazy imports
    monkeypatch.setattr(hf.transformers, "__version__", "5.16.1")
    with pytest.raises(codetta.UnsupportedModelError,
                       match=r"transformers 5\.17 and later; this is transformers 5\.16\.1"):
        codetta.patch(model)
    assert "forward" not in model.__dict__ and not any("forward" in m.__dict__ for m in model.model.layers)


def test_unsupported_models_and_options_are_refused_untouched():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    from codetta.integrations.hf import UnsupportedModelError

    assert codetta.UnsupportedModelError is UnsupportedModelError and issubclass(UnsupportedModelError, ValueError)

    with pytest.raises(UnsupportedModelError, match="supports"):
        codetta.patch(gpt2)
    with pytest.raises(UnsupportedModelError, match="need rms_norm"):
        codetta.patch(tiny("LlamaForCausalLM"), rms_norm=False)
    with pytest.raises(UnsupportedModelError, match="float64"):
        codetta.patch(tiny("LlamaForCausalLM").double())
    custom_layer = tiny("LlamaForCausalLM")
    _wrap(custom_layer, "model.layers.1", _with_own_forward)  # the fused forward would replace its forward
    with pytest.raises(UnsupportedModelError, match="forward of its own.*added after patching"):
        codetta.patch(custom_layer)
    assert all("forward" not in layer.__dict__ for layer in custom_layer.model.layers)
    llama = tiny("LlamaForCausalLM")
    for wrapper, inner in ((torch.compile(llama), "_orig_mod"), (torch.nn.DataParallel(llama), "module")):
        with pytest.raises(UnsupportedModelError, match=rf"a wrapper of a LlamaForCausalLM: .*model\.{inner}\)"):
            codetta.patch(wrapper)
    assert all("forward" not in layer.__dict__ for layer in llama.model.layers)
    sharded = tiny("LlamaForCausalLM")  # FSDP2's fully_shard(model) swaps in a class of its own
    sharded.__class__ = type("FSDPLlamaForCausalLM", (transformers.LlamaForCausalLM,), {})
    with pytest.raises(UnsupportedModelError, match="subclass of LlamaForCausalLM.*patch, then wrap"):
        codetta.patch(sharded)
    remote = tiny("LlamaForCausalLM")  # a class of the same name from elsewhere (a model's remote code)
    remote.__class__ = type("LlamaForCausalLM", (transformers.LlamaForCausalLM,), {"__module__": "remote_llama"})
    with pytest.raises(UnsupportedModelError, match="got LlamaForCausalLM from remote_llama, not transformers' own"):
        codetta.patch(remote)
    resized = tiny("Phi3ForCausalLM", pad_token_id=0, eos_token_id=2)  # a fused projection the config does not describe
    resized.model.layers[1].self_attn.qkv_proj = torch.nn.Linear(64, 80, bias=False, device=DEVICE)
    with pytest.raises(UnsupportedModelError, match="layer 1.*qkv_proj's 80 outputs are not the config's q, k and v"):
        codetta.patch(resized)
    assert all("forward" not in layer.__dict__ for layer in resized.model.layers)
    multimodal = transformers.Gemma3Model(transformers.Gemma3Config(  # its text decoder inside is patched
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        vision_config=dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14), mm_tokens_per_image=4))
    with pytest.raises(UnsupportedModelError, match=r"Gemma3Model .a model around a Gemma3TextModel.*text decoder.*: "
                                                    r"patch that one, model\.language_model; the model's own head"):
        codetta.patch(multimodal)
    assert codetta.patch(multimodal.language_model).layers[0]._codetta_plan is not None


def test_a_multimodal_model_names_its_text_decoder_whose_patch_keeps_its_loss_and_gradients():
    """Mistral 3 (Pixtral vision, a Mistral text decoder): refused as a whole, with the path of the
    decoder inside; that decoder patched, the model's text-only training step is the unpatched one."""
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    vision = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, head_dim=8,
                  image_size=16, patch_size=8)
    ref = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=VOCAB - 1, spatial_merge_size=1)).to(DEVICE)
    model = copy.deepcopy(ref)
    with pytest.raises(codetta.UnsupportedModelError, match=r"got Mistral3ForConditionalGeneration .a model around "
                                                            r"a MistralModel.*model\.model\.language_model;"):
        codetta.patch(model)
    assert "forward" not in model.model.language_model.layers[0].__dict__
    codetta.patch(model.model.language_model)
    assert all(layer._codetta_plan.unfusable is None for layer in model.model.language_model.layers)
    ids = torch.randint(0, VOCAB - 1, (2, 11), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)


class LoraLike(torch.nn.Module):
    """A wrapper such as PEFT's LoRA layer: the base layer's weight, plus a low-rank term."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.lora_a = torch.nn.Linear(base.in_features, 2, bias=False, device=base.weight.device)
        self.lora_b = torch.nn.Linear(2, base.out_features, bias=False, device=base.weight.device)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_b(self.lora_a(x))


class ScaledLinear(torch.nn.Linear):
    """An nn.Linear subclass that computes something else (as quantized layers do)."""

    def forward(self, x):
        return 2 * super().forward(x)


def _wrap(model, path, make):
    parent, _, name = path.rpartition(".")
    owner = model.get_submodule(parent)
    setattr(owner, name, make(getattr(owner, name)))


def _wrapped_and_patched(ref, path, make, when):
    """The module at ``path`` of ``ref`` wrapped (``make``), and a patched copy of ref with that
    same module, wrapped before or after patching (``when``)."""
    plain = copy.deepcopy(ref)
    _wrap(ref, path, make)
    if when == "before_patch":
        return codetta.patch(copy.deepcopy(ref))
    model = codetta.patch(plain)
    owner, _, name = path.rpartition(".")
    setattr(model.get_submodule(owner), name, copy.deepcopy(ref.get_submodule(path)))
    return model


def _scaled(linear):
    new = ScaledLinear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                       device=linear.weight.device)
    new.load_state_dict(linear.state_dict())
    return new


def _with_own_forward(module):
    """The module as an instance of a subclass (defined here, outside transformers) whose forward
    computes something else: half of its class's output; an RMSNorm Gemma's way, (1 + w)."""
    cls = type(module)
    if cls.__name__.endswith("RMSNorm"):
        def forward(self, x):
            return cls.forward(self, x) + (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    else:
        def forward(self, *args, **kwargs):
            out = cls.forward(self, *args, **kwargs)
            return (out[0] * 0.5, *out[1:]) if isinstance(out, tuple) else out * 0.5
    new = copy.copy(module)
    new.__class__ = type(f"Custom{cls.__name__}", (cls,), {"forward": forward})
    return new


UNFUSABLE = {  # (the module wrapped, the wrapper, the half of its layer then unfused: None for the loss)
    "lora_lm_head": ("lm_head", LoraLike, None),
    "attention_with_own_forward": ("model.layers.1.self_attn", _with_own_forward, ATTENTION),
    "mlp_with_own_forward": ("model.layers.0.mlp", _with_own_forward, MLP),
    "norm_with_own_forward": ("model.layers.1.post_attention_layernorm", _with_own_forward, MLP),
    "input_norm_with_own_forward": ("model.layers.0.input_layernorm", _with_own_forward, ATTENTION),
}


@pytest.mark.parametrize("key", sorted(UNFUSABLE))
@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
def test_modules_the_fused_forward_cannot_read_run_unfused(key, when):
    """A norm, attention or MLP of a class with a forward of its own cannot be read, nor an LM head
    whose own forward adds something (a LoRA wrapper): replaced before or after patching, the half
    of its layer it belongs to (or the loss) runs as the model's own modules, with a warning, and
    the training step equals the unpatched model's; the other half and the other layers stay fused."""
    path, make, half = UNFUSABLE[key]
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    torch.manual_seed(1)
    model = _wrapped_and_patched(ref, path, make, when)
    with pytest.warns(UserWarning, match="unfused"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    plans = [layer._codetta_plan for layer in model.model.layers]
    wrapped_layer = int(path.split(".")[2]) if path.startswith("model.layers") else None
    assert [p.unfused_half for p in plans] == [half if i == wrapped_layer else None for i in range(len(plans))]
    assert all(p.unfusable is None for p in plans)


class Opaque(torch.nn.Module):
    """A projection wrapped so that nothing of it shows (no weight: a quantized layer's storage)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _torch_rms_norm(norm):
    """torch.nn.RMSNorm computing what the model's norm computes (its epsilon under another name)."""
    new = torch.nn.RMSNorm(norm.weight.shape, eps=norm.variance_epsilon, device=norm.weight.device)
    with torch.no_grad():
        new.weight.copy_(norm.weight)
    return new


@pytest.mark.parametrize("name, path, make, half", [
    ("Qwen3ForCausalLM", "model.layers.1.self_attn.q_norm", _torch_rms_norm, ATTENTION),
    ("LlamaForCausalLM", "model.layers.1.input_layernorm", _torch_rms_norm, ATTENTION),  # layer 0 hands nothing on
    ("Phi3ForCausalLM", "model.layers.1.resid_mlp_dropout", lambda _: torch.nn.Identity(), MLP),
], ids=["qk_norm_without_variance_epsilon", "next_input_norm_of_another_class",
        "dropout_replaced_by_identity"])
@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
def test_a_half_whose_modules_lack_what_the_fused_forward_reads(name, path, make, half, when):
    """A module replaced by one without what the fused forward would read (an epsilon of that
    name, a dropout rate): its half runs as the model's modules, nothing of it is read (a
    projection without a weight is called: test_projections_it_cannot_read_are_called_the_rest_fused)."""
    ref = tiny(name, pad_token_id=0, eos_token_id=2)
    model = _wrapped_and_patched(ref, path, make, when)
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    with pytest.warns(UserWarning, match=f"'s {half} half runs as the model's own modules"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert [layer._codetta_plan.unfused_half for layer in model.model.layers] == [None, half]


@pytest.mark.parametrize("key, checkpointing, half", [
    (key, checkpointing, half) for key, checkpointing in (
        ("granite_multipliers", False), ("llama", False), ("llama", True),  # residual multipliers
        ("phi3_fused_projections_partial_rope", False), ("qwen3_qk_norm", False))  # residual dropout modules
    for half in (ATTENTION, MLP)] + [("moe_qwen2_shared_expert_dense_layer", False, ATTENTION)])  # layer 1 dense
def test_one_half_as_the_models_modules_the_other_fused(key, checkpointing, half, monkeypatch):
    """Layer 1's attention or MLP of a class with a forward of its own (in a family with a mixture
    of experts, an MLP of another class just runs as its module): that half of the layer runs
    as the model's own modules (its attention or MLP, the residual add as the layer makes it; its
    norm by codetta's row kernel), the other half fused (its GEMMs counted), the first layer
    whole; the training step equals the unpatched model's, with gradient checkpointing too."""
    name, overrides = MODELS[key]
    ref = tiny(name, num_hidden_layers=2, **overrides)
    _wrap(ref, "model.layers.1.self_attn" if half == ATTENTION else "model.layers.1.mlp", _with_own_forward)
    model = codetta.patch(copy.deepcopy(ref))
    if checkpointing:
        enable_checkpointing(ref), enable_checkpointing(model)
    fused_attention = count_calls(monkeypatch, "codetta.integrations.hf.layer._rotated_qkv")
    fused_mlp = count_calls(monkeypatch, "codetta.integrations.hf.layer._mlp_residual")
    norm_kernels = count_calls(monkeypatch, "codetta.integrations.hf.layer._norm_like_module")
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    with pytest.warns(UserWarning, match=f"'s {half} half runs as the model's own modules, unfused"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    forwards = 2 if checkpointing else 1  # recomputed in the backward
    fused = (1, 2) if half == ATTENTION else (2, 1)  # (layers with a fused attention half, with a fused MLP half)
    assert (len(fused_attention), len(fused_mlp)) == (fused[0] * forwards, fused[1] * forwards)
    moe_layers = 1 if key.startswith("moe") else 0  # layer 0's experts read their norm's output from the kernel too
    assert len(norm_kernels) == (1 + moe_layers) * forwards + 1  # and the decoder's final norm, not recomputed
    assert [layer._codetta_plan.unfused_half for layer in model.model.layers] == [None, half]


def _halve_input_grad(module, grad_in, grad_out):
    return (0.5 * grad_in[0],)


CALLED = [  # (a model of MODELS, layer 1's projections each with the wrapper given, one with a hook)
    ("llama", {"self_attn.q_proj": LoraLike, "self_attn.v_proj": LoraLike}, None),  # PEFT's default targets
    ("llama", {"mlp.gate_proj": Opaque, "mlp.down_proj": LoraLike}, "self_attn.k_proj"),  # no weight to read
    ("llama", {"mlp.up_proj": _scaled}, "mlp.down_proj:backward"),  # a subclass with a forward of its own
    ("granite_multipliers", {"self_attn.o_proj": LoraLike, "mlp.down_proj": LoraLike}, None),  # residual multipliers
    ("phi3_fused_projections_partial_rope", {"self_attn.qkv_proj": LoraLike, "mlp.gate_up_proj": LoraLike}, None),
    ("qwen3_qk_norm", {"self_attn.k_proj": LoraLike, "mlp.up_proj": LoraLike}, None),  # QK-norm after the projections
    ("arcee_ungated_mlp_bias", {"mlp.up_proj": LoraLike}, None),  # no gate
    ("gemma2_sandwich_norms_softcaps", {"self_attn.q_proj": LoraLike, "mlp.gate_proj": LoraLike}, "mlp.down_proj"),
]


def _called_id(key, wrapped, hooked):
    names = "+".join(path.rpartition(".")[2] for path in wrapped)
    return f"{key}-{names}" + (f"-hooked_{hooked.rpartition('.')[2].replace(':', '_')}" if hooked else "")


@pytest.mark.parametrize("key, wrapped, hooked", CALLED, ids=[_called_id(*case) for case in CALLED])
def test_projections_it_cannot_read_are_called_the_rest_fused(key, wrapped, hooked, monkeypatch):
    """Wrappers on layer 1's projections (PEFT-LoRA-like, without a weight, a subclass with its own
    forward), or a forward pre-hook or full backward hook on one: the fused forward calls those modules where the model's
    attention and MLP do (the QKV projections on the input norm's output, RoPE after them by
    codetta.ops.apply_rope; o_proj on the attention's output; gate and up on the MLP norm's output,
    then act(gate) * up by codetta.ops.gated_activation, which leaves these modules' outputs alone
    (they are not PEFT's); down_proj on its output; a called o_proj's and down_proj's added to
    the residual stream as the layer adds them), without a warning; the rest of the layer stays
    fused and the training step equals the unpatched model's."""
    name, overrides = MODELS[key]
    ref = tiny(name, num_hidden_layers=2, **overrides)
    for path, make in wrapped.items():
        _wrap(ref, f"model.layers.1.{path}", make)
    model = codetta.patch(copy.deepcopy(ref))
    if hooked is not None:
        hooked, _, kind = hooked.partition(":")
        for m in (ref, model):
            module = m.get_submodule(f"model.layers.1.{hooked}")
            if kind == "backward":
                module.register_full_backward_hook(_halve_input_grad)
            else:
                module.register_forward_pre_hook(_shift_input)
    rope_kernels = count_calls(monkeypatch, "codetta.integrations.hf.layer.apply_rope")
    fused_attention = count_calls(monkeypatch, "codetta.integrations.hf.layer._rotated_qkv")
    activation_kernels = count_calls(monkeypatch, "codetta.integrations.hf.layer.gated_activation")
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    called = {*(p.rpartition(".")[2] for p in wrapped), *([hooked.rpartition(".")[2]] if hooked else [])}
    assert (len(rope_kernels), len(fused_attention)) == (1 if called & {"q_proj", "k_proj", "v_proj", "qkv_proj"} else 0,
                                                         2)
    gated = model.config.model_type != "arcee"  # Arcee's MLP has no gate: act(up) is its module's
    assert len(activation_kernels) == (1 if gated and called & {"gate_proj", "up_proj", "gate_up_proj"} else 0)
    assert not any(kwargs["inputs_consumed"] for kwargs in activation_kernels)
    assert [(layer._codetta_plan.unfused_half, layer._codetta_plan.unfusable) for layer in model.model.layers] == [
        (None, None)] * 2


@pytest.mark.parametrize("wrapped, made", [((), 3), (("1.self_attn.q_proj",), 2), (("0.mlp.up_proj",), 2),
                                            (("0.mlp.up_proj", "1.self_attn.v_proj"), 1)],
                         ids=["plain", "next_qkv_called", "gate_up_called", "both"])
def test_norm_statistics_made_only_for_a_gemm_that_reads_them(wrapped, made, monkeypatch):
    """A residual add's GEMM makes the next norm's statistics (o_proj's for the MLP norm, down_proj's
    for the next layer's input norm) only where the GEMM after that norm reads them: not where
    the gate/up or QKV projections are called (LoRA-like), which get the norm's output made whole;
    the training step equals the unpatched model's either way."""
    ref = tiny("LlamaForCausalLM")
    for path in wrapped:
        _wrap(ref, f"model.layers.{path}", LoraLike)
    model = codetta.patch(copy.deepcopy(ref))
    residual_adds = []  # whether each fused residual add (linear_residual, swiglu_mlp) makes statistics
    for name, next_norm in (("linear_residual", "norm_weight"), ("swiglu_mlp", "next_norm_weight")):
        def recording(*args, original=getattr(codetta.integrations.hf.layer, name), next_norm=next_norm, **kwargs):
            residual_adds.append(inspect.signature(original).bind(*args, **kwargs).arguments.get(next_norm) is not None)
            return original(*args, **kwargs)

        monkeypatch.setattr(codetta.integrations.hf.layer, name, recording)
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert sum(residual_adds) == made and len(residual_adds) == 4  # 2 layers' o_proj and down_proj fused


def test_projections_wrapped_after_patching_are_called():
    """Projections wrapped after patching (PEFT's get_peft_model on a patched model) are seen at
    the next forward and called; replacing the wrappers by the plain nn.Linears again (PEFT's
    merge_and_unload) makes their weights read again."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    paths = ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.up_proj")
    plain = [model.get_submodule(path) for path in paths]
    for m in (ref, model):
        torch.manual_seed(3)
        for path in paths:
            _wrap(m, path, LoraLike)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    for path, linear in zip(paths, plain):
        _wrap(model, path, lambda _: linear)
        _wrap(ref, path, lambda m: m.base_layer)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def test_both_halves_unfusable_run_the_layers_own_forward():
    """A layer both of whose halves have modules the fused forward cannot read runs its own
    forward whole; so does a half-unfusable layer of a family whose halves do not separate (a
    norm on each sublayer's output: Gemma 2)."""
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    _wrap(ref, "model.layers.1.self_attn", _with_own_forward)
    _wrap(ref, "model.layers.1.mlp", _with_own_forward)
    model = codetta.patch(copy.deepcopy(ref))
    with pytest.warns(UserWarning, match="a LlamaDecoderLayer runs the model's own forward, unfused: self_attn is a Cu"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert [(p.unfusable is not None, p.unfused_half) for p in (l._codetta_plan for l in model.model.layers)] == [
        (False, None), (True, None)]
    name, overrides = MODELS["gemma2_sandwich_norms_softcaps"]
    ref = tiny(name, **overrides)
    _wrap(ref, "model.layers.0.mlp", _with_own_forward)
    model = codetta.patch(copy.deepcopy(ref))
    with pytest.warns(UserWarning, match="a Gemma2DecoderLayer runs the model's own forward, unfused: mlp is a Cu"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert model.model.layers[0]._codetta_plan.unfusable is not None


def test_a_layer_fuses_again_once_its_modules_are_plain():
    """Putting the model's own MLP back in place of one with a forward of its own makes the layer
    fused again."""
    ids = torch.randint(0, VOCAB, (1, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    layer = model.model.layers[0]
    plain_mlp = layer.mlp
    layer.mlp = _with_own_forward(plain_mlp)
    with pytest.warns(UserWarning, match="unfused"):
        model(input_ids=ids, labels=ids)
    assert model.model.layers[0]._codetta_plan.unfused_half == MLP
    layer.mlp = plain_mlp
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert model.model.layers[0]._codetta_plan.unfused_half is None


def _with_same_adapters(peft, base, lora):
    """(unpatched, patched) copies of ``base`` with the same PEFT adapters of ``lora``
    (get_peft_model after codetta.patch), lora_B drawn at random (PEFT starts it at 0, where
    the adapters would change nothing)."""
    ref = peft.get_peft_model(copy.deepcopy(base), lora)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    model = peft.get_peft_model(codetta.patch(copy.deepcopy(base)), lora)
    model.load_state_dict(ref.state_dict())
    return ref, model


def test_peft_lora_adapters_on_a_patched_model(monkeypatch):
    """PEFT's LoRA on a patched model (get_peft_model after codetta.patch), on PEFT's default
    targets (q_proj, v_proj) of one layer: the fused forward calls the adapted projections, the
    rest of that layer and the other layer stay fused, nothing is warned; the loss and every
    gradient (the adapters' too) equal the unpatched model's with the same adapters;
    merge_and_unload gives plain projections, read again. The PEFT wrapper itself is refused,
    naming the model inside."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1],
                           lora_dropout=0.0)
    base = tiny("LlamaForCausalLM")
    ref, model = _with_same_adapters(peft, base, lora)
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    rope_kernels = count_calls(monkeypatch, "codetta.integrations.hf.layer.apply_rope")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert len(rope_kernels) == 1  # layer 1's, after its called projections
    layers = model.get_base_model().model.layers
    assert [layer._codetta_plan.unfused_half for layer in layers] == [None, None]
    assert any(p.grad is not None and "lora_A" in n for n, p in model.named_parameters())
    with pytest.raises(codetta.UnsupportedModelError, match=r"got PeftModel.*model.get_base_model\(\)"):
        codetta.patch(peft.get_peft_model(copy.deepcopy(base), lora))
    with pytest.raises(codetta.UnsupportedModelError, match=r"got LoraModel .a model around a LlamaForCausalLM.*"
                                                            r"patch that one, model\.model; its head and loss fused"):
        codetta.patch(peft.get_peft_model(copy.deepcopy(base), lora).base_model)
    ref, model = ref.merge_and_unload().requires_grad_(), model.merge_and_unload().requires_grad_()  # PEFT froze them
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert all(layer._codetta_plan.unfused_half is None for layer in model.model.layers)


@pytest.mark.parametrize("targets, reentrant", [(["q_proj", "v_proj"], False), ("all-linear", True)],
                         ids=["q_v-nonreentrant", "all_linear-reentrant"])
def test_peft_lora_under_gradient_checkpointing(targets, reentrant, monkeypatch):
    """The usual LoRA recipe: adapters on a patched model, its base frozen, gradient
    checkpointing on (reentrant or not) with enable_input_require_grads: the loss and every
    adapter's gradient equal the unpatched model's; with adapters on every projection the
    layers' activations run by codetta.ops.gated_activation, again in the recomputation."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    base = tiny("LlamaForCausalLM")
    ref, model = _with_same_adapters(peft, base, lora)
    for m in (ref, model):
        enable_checkpointing(m, use_reentrant=reentrant)
        m.enable_input_require_grads()
    activation_kernels = count_calls(monkeypatch, "codetta.integrations.hf.layer.gated_activation")
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*(use_cache|checkpointing)")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert len(activation_kernels) == (2 * 2 if targets == "all-linear" else 0)  # 2 layers, each recomputed
    assert all(kwargs["inputs_consumed"] for kwargs in activation_kernels)  # PEFT's plain LoRA outputs: written over
    assert sum("lora_A" in n and p.grad is not None for n, p in model.named_parameters()) == \
        sum("lora_A" in n for n, _ in model.named_parameters())


class _SigmoidProjection(torch.nn.Linear):
    """A projection whose last operation's backward reads its output (sigmoid's)."""

    def forward(self, x):
        return torch.sigmoid(super().forward(x))


@pytest.mark.parametrize("variant", ["lora", "dora", "hooked_lora_B", "sigmoid_projection"])
def test_gradients_written_over_only_plain_peft_lora_outputs(variant, monkeypatch):
    """The gate and up outputs that codetta.ops.gated_activation's backward may write its
    gradients over (inputs_consumed) are PEFT's plain LoRA ones only, which no autograd node saves
    and no module keeps: not DoRA's, not where a hook sits inside the adapter, not a projection whose
    last operation's backward reads its output (under non-reentrant checkpointing, whose saved-tensor
    hooks bypass autograd's version check, that would be read as gradients). The training step
    equals the unpatched model's in every case."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj"], lora_dropout=0.0,
                           use_dora=variant == "dora")
    base = tiny("LlamaForCausalLM")
    ref, model = _with_same_adapters(peft, base, lora)
    for m in (ref, model):
        mlp = m.get_base_model().model.layers[1].mlp
        if variant == "hooked_lora_B":
            mlp.gate_proj.lora_B["default"].register_forward_hook(lambda module, args, out: None)
        if variant == "sigmoid_projection":
            adapted = mlp.up_proj
            mlp.up_proj = _SigmoidProjection(adapted.in_features, adapted.out_features, bias=False, device=DEVICE)
            mlp.up_proj.load_state_dict({"weight": adapted.base_layer.weight.detach()})
        enable_checkpointing(m, use_reentrant=False)
    activation_kernels = count_calls(monkeypatch, "codetta.integrations.hf.layer.gated_activation")
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(use_cache|checkpointing)")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    consumed = [kwargs["inputs_consumed"] for kwargs in activation_kernels]  # each layer's, again when recomputed
    layer_0, layer_1 = variant != "dora", variant == "lora"  # DoRA on both layers, the other variants on layer 1
    assert sorted(consumed) == sorted([layer_0, layer_1] * 2)


@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
@pytest.mark.parametrize("activation, fused_as", [(torch.nn.GELU(approximate="tanh"), "gelu_tanh"),
                                                  (torch.nn.GELU(), "gelu"), (torch.nn.ReLU(), "relu"),
                                                  (torch.nn.Tanh(), None)], ids=["gelu_tanh", "gelu", "relu", "tanh"])
def test_a_replaced_mlp_activation_runs_in_the_epilogue_or_as_itself(activation, fused_as, when):
    """An MLP activation swapped in before or after patching: one the epilogue computes (SiLU,
    both GELUs, ReLU) runs there, with no warning; any other runs as its module between the
    norm-folded gate/up GEMM and the down projection, warned once. Either way the training step
    equals the unpatched model's and the layer stays fused."""
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    plain = copy.deepcopy(ref)
    ref.model.layers[0].mlp.act_fn = activation
    if when == "before_patch":
        model = codetta.patch(copy.deepcopy(ref))
    else:
        model = codetta.patch(plain)
        model.model.layers[0].mlp.act_fn = copy.deepcopy(activation)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    messages = [str(w.message) for w in seen if "codetta" in str(w.message)]
    assert len(messages) == (fused_as is None)
    assert all("Tanh, which the gate/up GEMM's epilogue does not compute" in m for m in messages)
    plans = [layer._codetta_plan for layer in model.model.layers]
    assert [p.activation for p in plans] == [fused_as, "silu"] and all(p.unfusable is None for p in plans)


def _doubled(forward):
    """A class forward replaced by another library's or the user's (functools.wraps keeps its name)."""
    @functools.wraps(forward)
    def doubled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return (2 * out[0], *out[1:]) if isinstance(out, tuple) else 2 * out
    return doubled


@pytest.mark.parametrize("role", ["RMSNorm", "MLP", "Attention", "DecoderLayer", "rebound RMSNorm"])
def test_a_class_replaced_before_patching_is_refused(role, monkeypatch):
    """A forward set on the model's class (as Liger-Kernel and Unsloth set theirs), or another class
    bound under the modeling module's name before the model was built, computes what the fused
    forward would not: patching refuses, naming it, and changes nothing."""
    from transformers.models.llama import modeling_llama

    if role == "rebound RMSNorm":
        class CenteredNorm(modeling_llama.LlamaRMSNorm):
            def forward(self, x):
                return super().forward(x - x.mean(-1, keepdim=True))
        monkeypatch.setattr(modeling_llama, "LlamaRMSNorm", CenteredNorm)
    else:
        cls = getattr(modeling_llama, "Llama" + role)
        monkeypatch.setattr(cls, "forward", _doubled(cls.forward))
    model = tiny("LlamaForCausalLM")
    with pytest.raises(codetta.UnsupportedModelError, match="LlamaRMSNorm or its forward is not transformers' own"
                       if role.endswith("RMSNorm") else f"Llama{role} or its forward is not transformers' own"):
        codetta.patch(model)
    assert not any(hasattr(layer, "_codetta_plan") for layer in model.model.layers)


@pytest.mark.parametrize("role", ["RMSNorm", "MLP", "Attention", "DecoderLayer"])
def test_a_class_forward_replaced_after_patching_runs(role, monkeypatch):
    """A forward set on the model's class after patching (and a fused step) runs where the model
    would run it: the layers it touches run unfused, warned; the training step equals the unpatched
    model's with the same forward."""
    from transformers.models.llama import modeling_llama

    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    loss_and_grads(model, input_ids=ids, labels=ids)
    cls = getattr(modeling_llama, "Llama" + role)
    monkeypatch.setattr(cls, "forward", _doubled(cls.forward))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert any("codetta" in str(w.message) and "transformers" in str(w.message) for w in seen)


def test_an_activation_changed_in_place_after_a_fused_step():
    """GELU's approximate set on the module after a fused step: the epilogue computes the new one."""
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    with torch.no_grad():  # gate pre-activations of several units, where the two GELUs differ
        ref.model.layers[0].mlp.gate_proj.weight.mul_(40)
    ref.model.layers[0].mlp.act_fn = torch.nn.GELU()
    model = codetta.patch(copy.deepcopy(ref))
    loss_and_grads(model, input_ids=ids, labels=ids)
    for m in (ref, model):
        m.model.layers[0].mlp.act_fn.approximate = "tanh"
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert model.model.layers[0]._codetta_plan.activation == "gelu_tanh"


def _with_bias(linear):
    new = torch.nn.Linear(linear.in_features, linear.out_features, bias=True, device=linear.weight.device)
    with torch.no_grad():
        new.weight.copy_(linear.weight)
        new.bias.uniform_(0.25, 0.5)
    return new


@pytest.mark.parametrize("path, when", [
    ("model.layers.1.self_attn.k_proj", "before_patch"),
    ("model.layers.0.self_attn.q_proj", "after_patch"),
    ("model.layers.1.self_attn.v_proj", "set_on_the_module"),
    ("model.layers.0.self_attn.o_proj", "after_patch"),
    ("model.layers.0.mlp.down_proj", "before_patch"),
    ("model.layers.0.mlp.gate_proj", "after_patch"),
    ("model.layers.1.mlp.up_proj", "set_on_the_module"),
])
@pytest.mark.parametrize("epilogues", [True, False], ids=["rope_swiglu", "norm_folded_only"])
def test_a_single_projection_bias_is_added_fused(path, when, epilogues):
    """Any projection may have a bias of its own (Qwen2 gives q/k/v theirs, config.mlp_bias the
    MLP's): one given a bias before or after patching, or set on the module itself after a fused
    step, is added by the fused forward (the others count as zero), with RoPE and SwiGLU in their
    epilogues or after the norm-folded GEMMs, with no warning."""
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    model = copy.deepcopy(ref)
    _wrap(ref, path, _with_bias)
    if when == "before_patch":
        model = codetta.patch(copy.deepcopy(ref), rope=epilogues, swiglu=epilogues)
    else:
        codetta.patch(model, rope=epilogues, swiglu=epilogues)
        assert_same_training_step(tiny("LlamaForCausalLM"), model, input_ids=ids, labels=ids)
        if when == "after_patch":
            _wrap(model, path, lambda linear: copy.deepcopy(ref.get_submodule(path)))
        else:
            model.get_submodule(path).bias = torch.nn.Parameter(ref.get_submodule(path).bias.detach().clone())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert all(layer._codetta_plan.unfusable is None for layer in model.model.layers)


class _TimesOneAndAHalf(torch.nn.Module):
    def forward(self, weight):
        return 1.5 * weight


@pytest.mark.parametrize("norm", ["model.layers.1.input_layernorm", "model.layers.0.post_attention_layernorm"])
@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
def test_a_parametrized_norm_weight(norm, when):
    """A norm weight under torch.nn.utils.parametrize is a new tensor at each read: the fused
    forward reads it once per use (found by a probe: the statistics' check refused it, a crash in
    training and in eval)."""
    ref = tiny("LlamaForCausalLM")
    model = copy.deepcopy(ref)
    if when == "after_patch":
        codetta.patch(model)
    for m in (ref, model):
        torch.nn.utils.parametrize.register_parametrization(m.get_submodule(norm), "weight", _TimesOneAndAHalf())
    if when == "before_patch":
        codetta.patch(model)
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
        ref.eval(), model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


class _CountedScale(torch.nn.Module):
    """w -> 1.25 w, counting its runs (one per read of the parametrized weight)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def forward(self, weight):
        self.runs += 1
        return 1.25 * weight


def test_parametrized_weights_are_read_as_often_as_the_model_reads_them():
    """Each read of a parametrized weight reruns its parametrization, which can have state
    (spectral_norm steps its power iteration in training): the fused forward reads lm_head's,
    q_proj's and the norms' weights as many times per step as the model's own (found by a probe:
    3 reads of lm_head's against 1, 2 of q_proj's, and spectral_norm's results drifted apart)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    paths = ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.1.input_layernorm",
             "model.layers.1.self_attn.o_proj"]
    counters = {}
    for name, m in (("ref", ref), ("model", model)):
        for path in paths:
            counters[name, path] = _CountedScale()
            torch.nn.utils.parametrize.register_parametrization(m.get_submodule(path), "weight", counters[name, path])
    for counter in counters.values():
        counter.runs = 0  # registering ran each once, to check its output
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert {p: counters["model", p].runs for p in paths} == {p: counters["ref", p].runs for p in paths}
    assert all(counters["ref", p].runs == 1 for p in paths)


def _norm_with_offset(norm):
    """The norm's class swapped in place for one with a forward of its own (Gemma's (1 + w))."""
    cls = type(norm)

    def forward(self, x):
        eps = getattr(self, "variance_epsilon", None) or self.eps  # Llama's name, Gemma's
        return cls.forward(self, x) + x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    norm.__class__ = type("OffsetRMSNorm", (cls,), {"forward": forward})


def test_a_module_class_swapped_in_place_after_a_fused_step():
    """module.__class__ changed after the layer was checked (the same object): checked again, and
    run as the model's own forward with a warning (found by a probe: the old verdict stood)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 9), device=DEVICE)
    model(input_ids=ids, labels=ids)
    for m in (ref, model):
        _norm_with_offset(m.model.layers[1].post_attention_layernorm)
    with pytest.warns(UserWarning, match="OffsetRMSNorm"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)


@pytest.mark.parametrize("key", ["llama_bias_tied", "gemma_norm_offset_gelu_tanh", "granite_multipliers"])
def test_the_final_norm_runs_as_codettas_row_kernel(key, monkeypatch):
    """The decoder's final norm (what the LM head reads) runs as codetta.ops.rms_norm, in training
    with the fused loss and in evaluation, the model's RMSNorm.forward never called; a forward
    hook on it still runs; with its class swapped after patching, it runs as that class; unpatch
    restores the module's own forward."""
    name, overrides = MODELS[key]
    ref = tiny(name, num_hidden_layers=1, **overrides)
    model = codetta.patch(copy.deepcopy(ref))
    kernels = count_calls(monkeypatch, "codetta.integrations.hf.layer.rms_norm")
    ids = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    with calls_of(type(model.model.norm).forward) as calls:
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
        model.eval(), ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert len(kernels) == 2  # the training step and the evaluation
    assert any(norm is ref.model.norm for norm in calls) and not any(norm is model.model.norm for norm in calls)
    for m in (model, ref):
        m.model.norm.register_forward_hook(_scale_output)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        for m in (model, ref):
            _norm_with_offset(m.model.norm)
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert len(kernels) == 3
    codetta.unpatch(model)
    assert "forward" not in model.model.norm.__dict__ and "_codetta_norm" not in model.model.norm.__dict__


def _scale_output(module, args, output):
    return 0.5 * output


def _shift_input(module, args):
    return (args[0] + 0.25,)


HOOKS = {  # a module the fused forward (or loss) would skip, and a hook that changes what it computes
    "mlp_forward_hook": ("model.layers.0.mlp", lambda m: m.register_forward_hook(_scale_output)),
    "attention_forward_hook": ("model.layers.1.self_attn", lambda m: m.register_forward_hook(
        lambda mod, args, out: (0.5 * out[0], *out[1:]))),
    "norm_forward_hook": ("model.layers.0.post_attention_layernorm", lambda m: m.register_forward_hook(_scale_output)),
    "lm_head_forward_hook": ("lm_head", lambda m: m.register_forward_hook(_scale_output)),
    "norm_backward_pre_hook": ("model.layers.1.input_layernorm", lambda m: m.register_full_backward_pre_hook(
        lambda mod, grad_out: (0.5 * grad_out[0],))),
    "lm_head_backward_hook": ("lm_head", lambda m: m.register_full_backward_hook(
        lambda mod, grad_in, grad_out: (0.5 * grad_in[0],))),
}


@pytest.mark.parametrize("key", sorted(HOOKS))
def test_modules_with_hooks_run_as_the_model_runs_them(key):
    """Hooks on a module whose forward the fused layer (or loss) skips would not run: that layer
    (or the loss) runs the model's own forward, with a warning once, and the training step with
    the hook equals the unpatched model's with the same hook; removing the hook fuses again."""
    path, register = HOOKS[key]
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    handles = [register(m.get_submodule(path)) for m in (ref, model)]
    with pytest.warns(UserWarning, match="unfused"):
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    for handle in handles:
        handle.remove()
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert all(layer._codetta_plan.hooked is None for layer in model.model.layers)


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "backward"])
def test_global_module_hooks_run_as_the_model_runs_them(kind):
    """A hook for every module (torch.nn.modules.module.register_module_*_hook) also applies to
    the modules the fused forward skips: while one is registered the model runs its own forward."""
    from torch.nn.modules import module as nn_module

    def scale_linear_outputs(mod, args, out):
        return 0.5 * out if isinstance(mod, torch.nn.Linear) else None

    def shift_linear_inputs(mod, args):
        return (args[0] + 0.25,) if isinstance(mod, torch.nn.Linear) else None

    def scale_linear_input_grads(mod, grad_in, grad_out):
        return (0.5 * grad_in[0],) if isinstance(mod, torch.nn.Linear) else None

    register = {"forward": (nn_module.register_module_forward_hook, scale_linear_outputs),
                "forward_pre": (nn_module.register_module_forward_pre_hook, shift_linear_inputs),
                "backward": (nn_module.register_module_full_backward_hook, scale_linear_input_grads)}[kind]
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    handle = register[0](register[1])
    try:
        with pytest.warns(UserWarning, match="unfused"):
            assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    finally:
        handle.remove()
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)


def _instance_forward(module, scale=0.5):
    """A forward set on the module instance around the one it had, as accelerate's add_hook_to_module
    (device_map dispatch, offloading) and transformers' parallelism wrappers set one: scales the output
    (a layer's hidden states, a model output's loss)."""
    old = module.forward

    def forward(*args, **kwargs):
        out = old(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out * scale
        out.loss = out.loss * scale
        return out

    module.forward = forward


@pytest.mark.parametrize("path", ["model.layers.1", "model.norm", ""], ids=["layer", "final_norm", "causal_lm"])
def test_a_forward_set_on_the_instance(path):
    """patch() would replace a forward set on a decoder layer's (its final norm's, the causal LM's) instance, dropping
    what it adds: it refuses, changing nothing (without cross_entropy the causal LM's is kept). Set
    after patching, it wraps the patched forward, and after unpatch() it calls the model's own."""
    from codetta.integrations.hf import FusedForward, UnsupportedModelError

    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    ref, model, patched = tiny("LlamaForCausalLM"), tiny("LlamaForCausalLM"), codetta.patch(tiny("LlamaForCausalLM"))
    for m in (ref, model, patched):
        _instance_forward(m.get_submodule(path))
    with pytest.raises(UnsupportedModelError, match="forward set on its instance"):
        codetta.patch(model)
    assert not any(isinstance(m.__dict__.get("forward"), FusedForward) for m in model.modules())
    if path == "":
        codetta.patch(model, cross_entropy=False)
        assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert_same_training_step(ref, patched, input_ids=ids, labels=ids)
    codetta.unpatch(patched)
    assert_same_training_step(ref, patched, input_ids=ids, labels=ids)


def test_positional_arguments_bind_as_the_models_forward():
    """The patched forwards take arguments by position as the model's own do (the KV cache after
    position_ids in a decoder layer; labels sixth in the causal LM)."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    pos = torch.arange(8, device=DEVICE)[None]
    caches = []
    for m in (ref, model):
        cache = transformers.DynamicCache(config=m.config)
        h = m.model.embed_tokens(ids)
        with torch.no_grad():
            m.model.layers[0](h, None, pos, cache, position_embeddings=m.model.rotary_emb(h, pos))
        caches.append(cache)
    assert caches[1].get_seq_length(0) == caches[0].get_seq_length(0) == 8
    with torch.no_grad():
        losses = [m(ids, None, None, None, None, ids).loss for m in (ref, model)]
        logits = [m(ids, torch.ones_like(ids), None, transformers.DynamicCache(config=m.config)).logits
                  for m in (ref, model)]
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-5, atol=0)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-5)


def test_a_model_cast_to_fp64_after_patching_runs_as_its_own():
    """patch() refuses fp64 models; one cast after patching (e.g. for gradcheck) runs unfused, with a warning."""
    ref = tiny("LlamaForCausalLM").double()
    model = codetta.patch(tiny("LlamaForCausalLM")).double()
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    with pytest.warns(UserWarning, match="fp64"):
        assert_same_training_step(ref, model, tol=1e-12, input_ids=ids, labels=ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_embeds_in_an_fp32_model(dtype):
    """16-bit inputs_embeds given to an fp32 model: the model's own first layer upcasts the stream
    (its norm and residual add make fp32); the patched first layer runs unfused, with a warning
    (the kernels take an fp32 stream with 16-bit weights, not the reverse), the others fused.
    The model's rotary embedding rounds cos/sin to the embeddings' dtype: the loss and gradients
    are compared with the fp64 model's, as for bf16 models."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    ref64 = copy.deepcopy(ref).double()
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    embeds = ref.model.embed_tokens(ids).detach().to(dtype)

    def errors(m, e):
        loss64, grads64 = loss_and_grads(ref64, inputs_embeds=embeds.double(), labels=ids)
        loss, grads = loss_and_grads(m, inputs_embeds=e, labels=ids)
        return abs(loss.double() - loss64).item() / loss64.item(), {
            name: ((grads[name].double() - g).norm() / g.norm()).item() for name, g in grads64.items()}

    loss_err_ref, errs_ref = errors(ref, embeds)
    with pytest.warns(UserWarning, match="unfused"):
        loss_err, errs = errors(model, embeds)
    assert loss_err <= 2 * loss_err_ref + 1e-6
    assert errs.keys() == errs_ref.keys()
    for name, err in errs.items():
        assert err <= 2 * errs_ref[name] + 1e-5, f"{name}: {err} vs {errs_ref[name]}"
    with torch.no_grad(), pytest.warns(UserWarning, match="unfused"):
        out = model(inputs_embeds=embeds, output_hidden_states=True)
    out_ref = ref(inputs_embeds=embeds, output_hidden_states=True)
    assert [h.dtype for h in out.hidden_states] == [h.dtype for h in out_ref.hidden_states]
    torch.testing.assert_close(out.hidden_states[1], out_ref.hidden_states[1], rtol=1e-6, atol=1e-6)  # the unfused layer
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-2, atol=1e-3)


def test_attention_weights_when_asked_for():
    """output_attentions=True (eager attention): transformers records the weights with a hook on the
    attention module, which the fused layer skips; the layers then run unfused and return them."""
    ref = tiny("LlamaForCausalLM", attn_implementation="eager")
    model = codetta.patch(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (2, 8), device=DEVICE)
    out_ref, out = (m(input_ids=ids, labels=ids, output_attentions=True) for m in (ref, model))
    assert len(out.attentions) == len(out_ref.attentions) == 2
    for a, a_ref in zip(out.attentions, out_ref.attentions):
        torch.testing.assert_close(a, a_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)  # fused again without output_attentions


def test_linear_subclasses_that_keep_linears_forward_are_fused():
    """A subclass that keeps nn.Linear.forward (as FSDP2's FSDPLinear) computes F.linear: fused."""
    ids = torch.randint(0, VOCAB, (1, 8), device=DEVICE)
    ref = tiny("LlamaForCausalLM")
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        layer.mlp.down_proj.__class__ = type("ShardedLinear", (torch.nn.Linear,), {})
    codetta.patch(model)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert all(layer._codetta_plan.unfusable is None for layer in model.model.layers)


_NO_CXX = DEVICE == "cpu" and not (shutil.which("c++") or shutil.which("g++"))



def test_each_patched_layer_compiled_by_itself():
    """Per-layer torch.compile (as torchtitan and FSDP2 setups do), fullgraph: the fused layer traces."""
    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    for layer in model.model.layers:
        layer.compile(backend="eager", fullgraph=True)
    ids = torch.randint(0, VOCAB, (2, 10), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)

@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied: the code objects of the forwards traced by earlier tests (other
    models, each a guard of its own) would count toward the recompile limit of this one's."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    _NO_CXX, reason="inductor on a CPU needs a C++ compiler"))])
@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_whole_patched_model_without_graph_break(backend):
    """fullgraph=True: one graph through the patched layers, codetta's custom ops and the fused loss;
    with inductor, the code around the ops is generated (C++ on a CPU, Triton on a GPU). A second
    call reuses it: the fused forward sets nothing its first traced call guards on (the layers'
    modules are checked at patch time)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    ref = tiny("LlamaForCausalLM")
    model = codetta.patch(copy.deepcopy(ref))
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    ids = torch.randint(0, VOCAB, (2, 10), device=DEVICE)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    loss_ref, grads_ref = loss_and_grads(ref, input_ids=ids, labels=ids)
    assert abs(loss.item() - loss_ref.item()) < 2e-5 * loss_ref.item()
    for name, p in model.named_parameters():
        assert ((p.grad - grads_ref[name]).norm() / grads_ref[name].norm()).item() < 2e-4, name
    compiled(input_ids=ids, labels=ids)
    assert counter.frame_count == 1


@pytest.mark.parametrize("when", ["before_patch", "after_patch"])
@pytest.mark.usefixtures("fresh_dynamo")
def test_torch_compile_fullgraph_with_a_half_as_the_models_modules(when):
    """fullgraph=True where a half runs as the model's own modules (layer 0's MLP of a class with a
    forward of its own), an attention projection is called (a wrapper on layer 1's q_proj, put
    on before or after patching) and the loss runs unfused (a hook on the LM head): the checks and
    their warnings do not break the graph (a compiled forward says nothing, as transformers' own
    forwards); the step equals the unpatched model's; a wrapper put on after patching, first seen
    by the traced forward, costs one recompilation, no more."""
    from torch._dynamo.testing import CompileCounterWithBackend

    ref = tiny("LlamaForCausalLM")
    _wrap(ref, "model.layers.0.mlp", _with_own_forward)
    model = _wrapped_and_patched(ref, "model.layers.1.self_attn.q_proj", LoraLike, when)
    for m in (ref, model):
        m.lm_head.register_forward_hook(lambda module, args, out: out)
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter, fullgraph=True)
    ids = torch.randint(0, VOCAB, (2, 10), device=DEVICE)
    assert_same_training_step(ref, model, input_ids=ids, labels=ids)
    assert [layer._codetta_plan.unfused_half for layer in model.model.layers] == [MLP, None]
    for _ in range(2):
        model(input_ids=ids, labels=ids)
    assert counter.frame_count == (1 if when == "before_patch" else 2)

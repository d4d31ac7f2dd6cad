"""Which Hugging Face models codetta patches, and the checks that refuse anything else.

A supported decoder layer is Llama-shaped: ``input_layernorm`` and
``post_attention_layernorm`` (RMSNorm: ``weight``, ``variance_epsilon``), ``self_attn``
with ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (optionally ``q_norm``, ``k_norm``:
QK-norm, RMSNorms over ``head_dim`` with one epsilon) and ``mlp`` with ``gate_proj``,
``up_proj``, ``down_proj`` and SiLU. A new architecture of that shape is one more entry in :data:`ARCHITECTURES`.

The fused forward reads the projections' ``weight`` and ``bias`` and the norms' ``weight``
and ``variance_epsilon`` directly. That computes what the modules compute only when each
projection is a plain ``nn.Linear`` (a subclass is fine if it keeps ``nn.Linear.forward``,
as FSDP2's do), not a wrapper whose forward adds something (PEFT's LoRA layers) or
computes otherwise (quantized layers), and each norm an RMSNorm without an offset.
:func:`why_unfusable` says when a layer's modules are not so; such a layer runs the
model's own forward instead (see :mod:`codetta.integrations.hf.layer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedModelError(ValueError):
    """The model (or an option of it) is not one codetta can patch; nothing was changed."""


@dataclass(frozen=True)
class Architecture:
    """What differs between the supported families."""

    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE (fused with RoPE)
    # Where the attention module takes the ``sliding_window`` it passes to the attention function:
    # None (it passes none: Llama), "config" (``config.sliding_window``: Mistral) or "module" (its
    # own ``sliding_window``, set per layer type: Qwen2, Qwen3).
    sliding_window: str | None = None

    def attention_kwargs(self, attn) -> dict:
        """The arguments of the attention function that the model's attention module adds."""
        if self.sliding_window is None:
            return {}
        owner = attn.config if self.sliding_window == "config" else attn
        return {"sliding_window": getattr(owner, "sliding_window", None)}


ARCHITECTURES = {
    "LlamaForCausalLM": Architecture(),
    "MistralForCausalLM": Architecture(sliding_window="config"),
    "Qwen2ForCausalLM": Architecture(sliding_window="module"),
    "Qwen3ForCausalLM": Architecture(qk_norm=True, sliding_window="module"),
}


_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def _fused_paths(arch: Architecture) -> tuple:
    return (*_PROJECTIONS, *_NORMS, *(_QK_NORMS if arch.qk_norm else ()))


def fused_modules(layer, arch: Architecture) -> tuple:
    """The modules of a layer whose parameters the fused forward reads in their place."""
    return tuple(layer.get_submodule(path) for path in _fused_paths(arch))


def is_plain_linear(module) -> bool:
    """An ``nn.Linear`` whose output is ``F.linear(x, weight, bias)``: nothing overrides its forward."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def _is_plain_rmsnorm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and not getattr(module, "offset", 0.0)


_SKIPPED = ("self_attn", "mlp")  # modules whose forward the fused forward replaces, besides fused_modules'
_TRANSFORMERS_RECORDER = "output_capturing_hook"  # transformers' recorder of attentions and hidden states


def is_hooked(module) -> bool:
    """Whether calling ``module`` runs more than its class's forward: forward hooks or pre-hooks,
    or a ``forward`` set on the instance (as accelerate's hooks set it). transformers' own
    output recorders are left out: they record only when the caller asks for attention weights
    (see :func:`codetta.integrations.hf.layer.attention_weights_requested`)."""
    return "forward" in module.__dict__ or bool(module._forward_pre_hooks) or any(
        getattr(h, "__name__", None) != _TRANSFORMERS_RECORDER for h in module._forward_hooks.values())


def hooks_between(layer, next_layer) -> bool:
    """Whether hooks run between ``layer``'s forward and ``next_layer``'s (the first's forward
    hooks, the second's pre-hooks, global ones), which may change the residual stream in
    place (activation steering); transformers' own recorders are left out (they only record)."""
    from torch.nn.modules import module as nn_module

    return (any(getattr(h, "__name__", None) != _TRANSFORMERS_RECORDER for h in layer._forward_hooks.values())
            or bool(next_layer._forward_pre_hooks) or bool(nn_module._global_forward_hooks)
            or bool(nn_module._global_forward_pre_hooks))


def hooked_module(layer, modules: tuple, arch: Architecture):
    """The path of a module whose forward the fused forward skips (its :func:`fused_modules`, the
    attention and the MLP) that :func:`is_hooked`, or None."""
    for path, module in zip((*_SKIPPED, *_fused_paths(arch)), (*map(layer.get_submodule, _SKIPPED), *modules)):
        if is_hooked(module):
            return path
    return None


def why_unfusable(modules: tuple, arch: Architecture):
    """None when the fused forward can read these :func:`fused_modules` in their place, else why not."""
    for path, module in zip(_fused_paths(arch), modules):
        if path in _PROJECTIONS:
            if not is_plain_linear(module):
                return f"{path} is a {type(module).__name__}, not a plain nn.Linear"
        elif not _is_plain_rmsnorm(module):
            return f"{path} is a {type(module).__name__}, not an RMSNorm without offset"
    return None


def architecture_of(model) -> Architecture:
    name = type(model).__name__
    if name not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"codetta.patch supports {sorted(ARCHITECTURES)}; got {name}. Nothing was patched."
        )
    return ARCHITECTURES[name]


def _need(obj, path, what):
    for part in path.split("."):
        if not hasattr(obj, part):
            raise UnsupportedModelError(f"{what}: missing {path!r}. Nothing was patched.")
        obj = getattr(obj, part)
    return obj


def check_model(model, arch: Architecture):
    """Raise UnsupportedModelError unless every layer has the shape the fused forward assumes."""
    config = model.config
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"the MLP activation is {act!r}; codetta fuses SwiGLU (silu). Nothing was patched.")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported (SwiGLU without biases). Nothing was patched.")
    rotary = _need(model, "model.rotary_emb.inv_freq", type(model).__name__)
    if rotary.dim() != 1:
        raise UnsupportedModelError(f"rotary inv_freq of shape {tuple(rotary.shape)} is not supported (e.g. mrope)")
    for i, layer in enumerate(_need(model, "model.layers", type(model).__name__)):
        what = f"layer {i} ({type(layer).__name__})"
        for path in ("input_layernorm.weight", "input_layernorm.variance_epsilon", "post_attention_layernorm.weight",
                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "self_attn.head_dim", "self_attn.scaling", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            _need(layer, path, what)
        attn = layer.self_attn
        if arch.qk_norm:
            for path in ("q_norm.weight", "q_norm.variance_epsilon", "k_norm.weight", "k_norm.variance_epsilon"):
                _need(attn, path, what)
            norms = (attn.q_norm, attn.k_norm)
            if any(n.weight.shape != (attn.head_dim,) for n in norms) or len({n.variance_epsilon for n in norms}) > 1:
                raise UnsupportedModelError(f"{what}: q_norm and k_norm must be RMSNorms of head_dim "
                                            f"{attn.head_dim} with one epsilon. Nothing was patched.")
        biases = {attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}
        if len(biases) > 1:
            raise UnsupportedModelError(f"{what}: some of q/k/v have a bias and some not. Nothing was patched.")
        if attn.q_proj.out_features % attn.head_dim:
            raise UnsupportedModelError(f"{what}: q_proj's {attn.q_proj.out_features} outputs are no whole number of "
                                        f"heads of {attn.head_dim}. Nothing was patched.")


def rope_fusable(layer) -> bool:
    """Whether RoPE can run in this layer's QKV epilogue: its head_dim a power of two (the
    epilogue rotates within power-of-two column segments)."""
    head_dim = layer.self_attn.head_dim
    return head_dim & (head_dim - 1) == 0

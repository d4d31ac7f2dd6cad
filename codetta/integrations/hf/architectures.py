"""Which Hugging Face models codetta patches, and the checks that refuse anything else.

A supported decoder layer is Llama-shaped: ``input_layernorm`` and
``post_attention_layernorm`` (RMSNorm: ``weight``, ``variance_epsilon``; Gemma's: 1 + ``weight``,
``eps``; Gemma 2's and GLM-4's also norms of the sublayers' outputs: ``Architecture.output_norms``;
VaultGemma's MLP norm is ``pre_feedforward_layernorm``: ``Architecture.mlp_norm``),
``self_attn`` with ``q_proj``, ``k_proj``, ``v_proj`` (or one ``qkv_proj``: Phi-3),
``o_proj`` (optionally ``q_norm``, ``k_norm``: QK-norm, RMSNorms over ``head_dim`` with one
epsilon) and an ``mlp``: ``gate_proj``, ``up_proj`` (or one ``gate_up_proj``: Phi-3, GLM),
``down_proj`` and an activation of the gate (or, without a gate, of the up projection:
Arcee); in a family with a mixture of experts (``Architecture.moe``) the MLP may be any
module instead, which runs as itself. A new family of that shape is one more entry in
:data:`ARCHITECTURES`.

The fused forward reads the projections' ``weight`` and ``bias`` and the norms' ``weight``
and epsilon directly, and replaces the forwards of the layer, its attention and its MLP.
That computes what the modules compute only when each projection is a plain ``nn.Linear``
(a subclass is fine if it keeps ``nn.Linear.forward``, as FSDP2's do), not a wrapper whose
forward adds something (PEFT's LoRA layers) or computes otherwise (quantized layers), and
when the attention, the MLP and each norm run the forward of the model's own class
(:class:`ModelClasses`). :func:`why_unfusable` says when a layer's modules are not so; the
half of the layer they belong to (:func:`halves`), or the layer, then runs as the model's own
modules instead (see :mod:`codetta.integrations.hf.layer`); the projections are the
exception: where they are not plain, the fused forward calls them as modules
(:func:`reads_weight`). A
decoder layer whose class has a forward of its own is refused at patch time: the fused
forward would replace it. The MLP's activation runs in the gate/up GEMM's epilogue where
:func:`gate_activation` names it (SiLU, both GELUs, ReLU), else as the module it is, between
that GEMM and the down projection.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch
from torch.nn.modules import module as nn_module
from torch.nn.utils import parametrize
from transformers import activations

from ...ops.rmsnorm import hooks_between as runs_hooks_between
from .. import UnsupportedModelError


@dataclass(frozen=True)
class Architecture:
    """What differs between the supported families."""

    # Whether the attention normalizes q and k per head before RoPE (Qwen3: fused with RoPE): True, or the
    # name of the attention's attribute that says whether it does (GLM-4.5's ``use_qk_norm``)
    qk_norm: bool | str = False
    # Where the attention module takes the ``sliding_window`` it passes to the attention function:
    # None (it passes none: Llama), "config" (``config.sliding_window``: Mistral) or "module" (its
    # own ``sliding_window``, set per layer type: Qwen2, Qwen3).
    sliding_window: str | None = None
    # RoPE's column pairs: rotate_half's (t, t + D/2), or adjacent ones (2t, 2t + 1: Helium, Ernie 4.5)
    interleaved_rope: bool = False
    # Whether the attention module's ``use_rope`` says if its layer applies RoPE (SmolLM3's NoPE layers)
    rope_per_layer: bool = False
    # Whether the attention scales q after RoPE by 1 + beta log(1 + floor(position / original max
    # positions)) (Ministral 3, Llama 4's attention temperature; beta and the original maximum
    # from ``config.rope_parameters``), through the modeling module's ``get_llama_4_attn_scale``
    query_position_scale: bool = False
    # Whether the attention projects q, k and v with one ``qkv_proj`` (its rows: the q heads, the k
    # heads, the v heads: Phi-3) rather than ``q_proj``, ``k_proj``, ``v_proj``
    fused_qkv: bool = False
    # Whether the MLP projects gate and up with one ``gate_up_proj`` (its rows: gate, then up) and
    # names its activation ``activation_fn`` (Phi-3, GLM), rather than ``gate_proj``, ``up_proj``, ``act_fn``
    fused_gate_up: bool = False
    # Whether the model's RoPE rotates only the first dims of each head, as many as its cos and sin
    # have (a config's ``partial_rotary_factor``: Phi-3, GLM); Llama's needs them to cover head_dim
    partial_rotary: bool = False
    # Where the layer drops out each sublayer's output before the residual add, which the fused
    # residual add does not (fused only while that dropout does nothing): None (nowhere), "modules"
    # (the layer's ``resid_attn_dropout``, ``resid_mlp_dropout``: Phi-3) or "rates" (a float
    # ``residual_dropout`` of the attention and of the MLP, applied in their forwards: Seed-OSS)
    residual_dropout: str | None = None
    # Whether the layer scales each sublayer's output by its ``residual_multiplier`` before the
    # residual add, and the causal LM divides its logits by ``config.logits_scaling`` (Granite;
    # its attention's ``scaling`` and embedding multiplier are the model's own code's)
    multipliers: bool = False
    # What the RMSNorms multiply the normalized input by: ``weight`` + this offset (Gemma's
    # 1 + weight, computed in fp32 as its norm does), and the name of their epsilon attribute
    norm_weight_offset: float = 0.0
    norm_eps: str = "variance_epsilon"
    # Whether the MLP gates: act(h W_g^T) * (h W_u^T), or act(h W_u^T) with no ``gate_proj`` (Arcee)
    gated_mlp: bool = True
    # The path of the norm of the MLP's input (``input_layernorm`` is the attention's), and where
    # each sublayer's output goes through a norm of its own before the residual add, the paths of
    # (the attention output's norm, the MLP output's) (Gemma 2's post_attention_layernorm and
    # post_feedforward_layernorm, GLM-4's post_self_attn_layernorm and post_mlp_layernorm)
    mlp_norm: str = "post_attention_layernorm"
    output_norms: tuple | None = None
    # Whether the attention passes its ``attn_logit_softcapping`` to the attention function as
    # ``softcap`` (Gemma 2, VaultGemma), and whether the causal LM caps its logits to s tanh(logits / s),
    # s its config's ``final_logit_softcapping`` when that is not None (Gemma 2, Gemma 3, VaultGemma)
    attention_softcap: bool = False
    logit_softcap: bool = False
    # Whether the rotary embedding keeps frequencies per attention layer type (``{type}_inv_freq``,
    # ``{type}_attention_scaling``, the type the config's ``layer_types`` gives the layer: Gemma 3's
    # local and global layers) rather than one ``inv_freq`` and ``attention_scaling``
    rotary_per_layer_type: bool = False
    # Whether the layer's MLP may be a mixture of experts (Mixtral's MixtralSparseMoeBlock, ...: any
    # MLP but the family's dense ``XMLP``, see :func:`mlp_is_fused`), which runs as its own module on
    # the MLP norm's output (the causal LM's output then a ``MoeCausalLMOutputWithPast``), and whether
    # the causal LM adds its routers' load-balancing loss to the loss where ``output_router_logits``
    # asks (the modeling module's ``load_balancing_loss_func``: Mixtral, ...; not GLM-4.5, dots.llm1,
    # Solar Open)
    moe: bool = False
    router_loss: bool = False

    @property
    def projections(self) -> tuple:
        """The paths of the layer's projections (``nn.Linear``), in the layer's order."""
        qkv = ("self_attn.qkv_proj",) if self.fused_qkv else ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        if self.fused_gate_up:
            gate_up = ("mlp.gate_up_proj",)
        else:
            gate_up = ("mlp.gate_proj", "mlp.up_proj") if self.gated_mlp else ("mlp.up_proj",)
        return (*qkv, "self_attn.o_proj", *gate_up, "mlp.down_proj")

    @property
    def norms(self) -> tuple:
        """The paths of the layer's RMSNorms (of the sublayers' inputs and outputs)."""
        return ("input_layernorm", self.mlp_norm, *(self.output_norms or ()))

    @property
    def activation(self) -> str:
        """The path of the MLP's activation module."""
        return "mlp.activation_fn" if self.fused_gate_up else "mlp.act_fn"

    def has_qk_norm(self, attn) -> bool:
        """Whether this attention module normalizes q and k per head before RoPE."""
        return self.qk_norm is True or (bool(self.qk_norm) and bool(getattr(attn, self.qk_norm)))

    def qkv_weights(self, attn) -> tuple[tuple, tuple]:
        """((W_q, W_k, W_v), (b_q, b_k, b_v)) of the attention module, each bias possibly None;
        row blocks (views) of ``qkv_proj``'s weight and bias where the model fuses them."""
        if not self.fused_qkv:
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            return tuple(p.weight for p in projections), tuple(p.bias for p in projections)
        qkv, widths = attn.qkv_proj, qkv_widths(attn)
        bias = qkv.bias
        return tuple(qkv.weight.split(widths)), (None,) * 3 if bias is None else tuple(bias.split(widths))

    def qkv_projections(self, attn) -> tuple:
        """The attention module's QKV projection modules: (q_proj, k_proj, v_proj) or (qkv_proj,)."""
        return (attn.qkv_proj,) if self.fused_qkv else (attn.q_proj, attn.k_proj, attn.v_proj)

    def qkv_of_modules(self, attn, h) -> tuple:
        """(q, k, v) [..., width] each, by calling the attention's projection modules on h as its
        forward calls them (a fused ``qkv_proj``'s output split)."""
        if self.fused_qkv:
            return tuple(torch.split(attn.qkv_proj(h), qkv_widths(attn), dim=-1))
        return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)

    def gate_up_projections(self, mlp) -> tuple:
        """The MLP's gate and up projection modules: (gate_proj, up_proj), (gate_up_proj,) or (up_proj,)."""
        if not self.gated_mlp:
            return (mlp.up_proj,)
        return (mlp.gate_up_proj,) if self.fused_gate_up else (mlp.gate_proj, mlp.up_proj)

    def gate_up_of_modules(self, mlp, h) -> tuple:
        """(gate, up) [..., F] each, by calling the MLP's projection modules on h as its forward
        calls them (a fused ``gate_up_proj``'s output chunked, gate first); gate None without a gate."""
        if not self.gated_mlp:
            return None, mlp.up_proj(h)
        if self.fused_gate_up:
            return tuple(mlp.gate_up_proj(h).chunk(2, dim=-1))
        return mlp.gate_proj(h), mlp.up_proj(h)

    def gate_up_weights(self, mlp) -> tuple[tuple, tuple]:
        """((W_gate, W_up), (b_gate, b_up)) of the MLP module, each bias possibly None; halves
        (views) of ``gate_up_proj``'s weight and bias where the model fuses them; W_gate and b_gate
        None for an MLP without a gate."""
        if not self.gated_mlp:
            return (None, mlp.up_proj.weight), (None, mlp.up_proj.bias)
        if not self.fused_gate_up:
            return (mlp.gate_proj.weight, mlp.up_proj.weight), (mlp.gate_proj.bias, mlp.up_proj.bias)
        bias = mlp.gate_up_proj.bias
        return tuple(mlp.gate_up_proj.weight.chunk(2)), (None, None) if bias is None else tuple(bias.chunk(2))

    def residual_dropout_rate(self, layer, half: str) -> float:
        """The dropout probability of the output of one half's sublayer (:data:`ATTENTION`, :data:`MLP`)."""
        if self.residual_dropout == "modules":
            return layer.get_submodule(RESIDUAL_DROPOUTS[half == MLP]).p
        if self.residual_dropout == "rates":
            return (layer.mlp if half == MLP else layer.self_attn).residual_dropout
        return 0.0

    def norm_weight(self, norm) -> torch.Tensor:
        """The weight an RMSNorm module multiplies by (its ``weight``, or ``weight`` + offset in fp32:
        autograd takes the gradient back to ``weight``). Read once per use: a parametrized weight is
        made anew at each read."""
        if self.norm_weight_offset:
            return norm.weight.float() + self.norm_weight_offset
        return norm.weight

    def norm_epsilon(self, norm) -> float:
        return getattr(norm, self.norm_eps)

    def branch_scale(self, layer) -> float:
        """What the layer multiplies each sublayer's output by before the residual add."""
        return float(layer.residual_multiplier) if self.multipliers else 1.0

    def rotary_frequencies(self, rotary, attn) -> tuple:
        """(inv_freq, attention_scaling) of the rotary embedding for this attention module's layer."""
        prefix = f"{attn.config.layer_types[attn.layer_idx]}_" if self.rotary_per_layer_type else ""
        return getattr(rotary, prefix + "inv_freq"), getattr(rotary, prefix + "attention_scaling")

    def applies_rope(self, attn) -> bool:
        """Whether the layer of this attention module rotates q and k."""
        return not self.rope_per_layer or bool(attn.use_rope)

    def attention_kwargs(self, attn) -> dict:
        """The arguments of the attention function that the model's attention module adds."""
        kwargs = {}
        if self.sliding_window is not None:
            owner = attn.config if self.sliding_window == "config" else attn
            kwargs["sliding_window"] = getattr(owner, "sliding_window", None)
        if self.attention_softcap:
            kwargs["softcap"] = attn.attn_logit_softcapping
        return kwargs


def qkv_widths(attn) -> list[int]:
    """The q, k and v widths of a fused ``qkv_proj``: the config's heads of head_dim."""
    config = attn.config
    return [n * attn.head_dim for n in (config.num_attention_heads, config.num_key_value_heads,
                                        config.num_key_value_heads)]


GEMMA2_OUTPUT_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")  # Gemma 2's and 3's

# The model families, by their transformers class prefix; each is patched in any of the
# :data:`MODEL_KINDS`.
ARCHITECTURES = {
    "Llama": Architecture(),
    "Mistral": Architecture(sliding_window="config"),
    "Qwen2": Architecture(sliding_window="module"),
    "Qwen3": Architecture(qk_norm=True, sliding_window="module"),
    "Ministral": Architecture(sliding_window="module"),
    "Ministral3": Architecture(sliding_window="config", query_position_scale=True),
    "Cwm": Architecture(sliding_window="module"),
    "SmolLM3": Architecture(sliding_window="module", rope_per_layer=True),
    "Helium": Architecture(interleaved_rope=True),
    "Ernie4_5": Architecture(interleaved_rope=True),
    "Phi3": Architecture(sliding_window="config", fused_qkv=True, fused_gate_up=True, partial_rotary=True,
                         residual_dropout="modules"),
    "SeedOss": Architecture(residual_dropout="rates"),
    "Granite": Architecture(multipliers=True),
    "Glm": Architecture(interleaved_rope=True, fused_gate_up=True, partial_rotary=True),
    "Glm4": Architecture(interleaved_rope=True, fused_gate_up=True, partial_rotary=True,
                         output_norms=("post_self_attn_layernorm", "post_mlp_layernorm")),
    "Gemma": Architecture(norm_weight_offset=1.0, norm_eps="eps"),
    "Arcee": Architecture(gated_mlp=False),
    "Gemma2": Architecture(norm_weight_offset=1.0, norm_eps="eps", sliding_window="module", attention_softcap=True,
                           logit_softcap=True, mlp_norm="pre_feedforward_layernorm", output_norms=GEMMA2_OUTPUT_NORMS),
    "Gemma3": Architecture(norm_weight_offset=1.0, norm_eps="eps", sliding_window="module", logit_softcap=True,
                           qk_norm=True, rotary_per_layer_type=True, mlp_norm="pre_feedforward_layernorm",
                           output_norms=GEMMA2_OUTPUT_NORMS),
    "VaultGemma": Architecture(norm_weight_offset=1.0, norm_eps="eps", sliding_window="module", attention_softcap=True,
                               logit_softcap=True, mlp_norm="pre_feedforward_layernorm"),
    "Mixtral": Architecture(sliding_window="config", moe=True, router_loss=True),
    "Qwen2Moe": Architecture(moe=True, router_loss=True),
    "Qwen3Moe": Architecture(qk_norm=True, sliding_window="module", moe=True, router_loss=True),
    "Ernie4_5_Moe": Architecture(interleaved_rope=True, moe=True, router_loss=True),
    "Glm4Moe": Architecture(qk_norm="use_qk_norm", partial_rotary=True, moe=True),
    "Dots1": Architecture(qk_norm=True, sliding_window="module", moe=True),
    "SolarOpen": Architecture(moe=True),
}
# The classes of a family that codetta patches: the causal LM (its decoder layers, and its LM head +
# loss), the bare decoder stack and the other task heads on it (their decoder layers).
CAUSAL_LM = "ForCausalLM"
MODEL_KINDS = (CAUSAL_LM, "Model", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
# Classes of a family under another prefix: Gemma 3's text-only decoder stack and heads
# (Gemma3TextModel, ...; its causal LM is Gemma3ForCausalLM). Its Gemma3Model and
# Gemma3ForSequenceClassification are the multimodal ones (a vision tower, and the text decoder
# inside: patch their ``language_model``), not patched.
CLASS_PREFIXES = {"Gemma3Text": "Gemma3"}
MULTIMODAL = ("Gemma3Model", "Gemma3ForSequenceClassification")


def family_and_kind(cls: type, *, any_module: bool = False):
    """("Llama", "ForCausalLM") for transformers' LlamaForCausalLM, and so on; None for a class not
    patched (with ``any_module``: for a class of such a name defined anywhere)."""
    if cls.__name__ in MULTIMODAL:
        return None
    for kind in MODEL_KINDS:
        prefix = cls.__name__.removesuffix(kind)
        family = CLASS_PREFIXES.get(prefix, prefix)
        if prefix != cls.__name__ and family in ARCHITECTURES and (
                any_module or cls.__module__.startswith("transformers.")):
            return family, kind
    return None


def decoder_of(model):
    """The model's decoder stack (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``): the
    model itself for an ``XModel``, else its transformers base model (``base_model``: ``model.model``,
    or ``model.transformer`` for Llama's, Qwen2's and Qwen3's question-answering heads)."""
    return model.base_model


@dataclass(frozen=True)
class ModelClasses:
    """A model's own transformers classes, whose forwards the fused forward computes, and those
    forwards as they were when the model was patched (checked to be transformers' own then)."""

    layer: type
    attention: type
    mlp: type | None  # the dense MLP (None in a family of experts only: Mixtral)
    rms_norm: type
    rotary: type  # the rotary embedding (inv_freq, attention_scaling)
    patched_forwards: tuple = ()

    def computes_as(self, module, cls) -> bool:
        """Whether ``module`` computes as ``cls`` (one of these classes) as transformers defines it:
        its class's forward is cls's, still the one checked at patch time (a forward set on the
        class since then is left to run), or transformers' wrapper of it in a subclass that
        defines no forward of its own (FSDP2's ``FSDP<Layer>``: see :func:`_subclass_wrapper`)."""
        if cls is None or cls.forward not in self.patched_forwards:
            return False
        forward = type(module).forward
        while forward is not cls.forward:
            if not _subclass_wrapper(forward):
                return False
            forward = forward.__wrapped__
        return True

    @property
    def modeling(self) -> ModuleType:
        """The transformers module that defines them (attention functions, apply_rotary_pos_emb)."""
        return sys.modules[self.layer.__module__]


def _package_dir(name: str) -> str | None:
    """The folder of the installed package ``name`` (with a trailing separator), None if there is none."""
    spec = importlib.util.find_spec(name)
    return None if spec is None or not spec.submodule_search_locations else \
        os.path.join(list(spec.submodule_search_locations)[0], "")


_TRANSFORMERS_DIR = _package_dir("transformers")
# transformers' forwards may be wrapped by its own decorators, by torch's (@torch.no_grad() on the
# rotary embeddings' forward in some releases) and by those of the hub-kernels library it uses
# (`kernels`: use_kernel_forward_from_hub), which compute the same function
_WRAPPER_DIRS = tuple(d for d in map(_package_dir, ("transformers", "torch", "kernels")) if d is not None)


def _subclass_wrapper(forward) -> bool:
    """Whether ``forward`` is the wrapper that transformers (>= 5.23) puts around the forward of
    every subclass of a decoder layer (``GradientCheckpointingLayer.__init_subclass__``): for a
    subclass that inherits its forward, as the ``FSDP<Layer>`` class FSDP2's ``fully_shard``
    makes does, the inherited forward, run as it is but for the checkpointing, which the fused
    forward does itself (:mod:`codetta.integrations.hf.checkpointing`)."""
    code = getattr(forward, "__code__", None)
    return code is not None and code.co_name == "forward_with_checkpointing" \
        and code.co_filename.startswith(_TRANSFORMERS_DIR) and hasattr(forward, "__wrapped__")


def transformers_own(forward) -> bool:
    """Whether ``forward`` is transformers' code (defined there, wrapped only by the decorators of
    transformers, torch and the hub-kernels library), not a replacement: a class's forward set by another library (as Liger-Kernel
    and Unsloth do) or by the user, whose computation the fused forward would silently skip."""
    innermost = forward
    while forward is not None:
        code = getattr(forward, "__code__", None)
        if code is None or not code.co_filename.startswith(_WRAPPER_DIRS):
            return False
        innermost, forward = forward, getattr(forward, "__wrapped__", None)
    return innermost.__code__.co_filename.startswith(_TRANSFORMERS_DIR)


def model_classes(model) -> ModelClasses:
    """The classes of the modeling module that defines the model's class: for LlamaForCausalLM,
    LlamaDecoderLayer, LlamaAttention, LlamaMLP, LlamaRMSNorm and LlamaRotaryEmbedding of
    ``modeling_llama``; a family with a mixture of experts may have no dense MLP class."""
    modeling = sys.modules[type(model).__module__]
    family, _ = family_and_kind(type(model))
    found = {family + role: getattr(modeling, family + role, None)
             for role in ("DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding")}
    optional = {family + "MLP"} if ARCHITECTURES[family].moe else set()
    missing = [name for name, cls in found.items() if not isinstance(cls, type) and name not in optional]
    if missing:
        raise UnsupportedModelError(f"{type(model).__name__} is not defined beside {missing} (a transformers "
                                    "modeling module). Nothing was patched.")
    for name, cls in found.items():
        if cls is not None and not (cls.__module__.startswith("transformers.") and transformers_own(cls.forward)):
            where = getattr(getattr(cls.forward, "__code__", None), "co_filename", repr(cls.forward)) \
                if cls.__module__.startswith("transformers.") else f"module {cls.__module__}"
            raise UnsupportedModelError(
                f"{modeling.__name__}.{name} or its forward is not transformers' own (it comes from {where}): "
                "another library (Liger-Kernel, Unsloth) or your code replaced it, and the fused forward would "
                "compute transformers' math in its place. Patch a model with transformers' own classes. Nothing "
                "was patched.")
    return ModelClasses(*found.values(),
                        patched_forwards=tuple(cls.forward for cls in found.values() if cls is not None))


_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
RESIDUAL_DROPOUTS = ("resid_attn_dropout", "resid_mlp_dropout")


def mlp_is_fused(layer, arch: Architecture, classes: ModelClasses) -> bool:
    """Whether the fused forward computes the layer's MLP itself, reading its projections: in a
    family of dense MLPs, always (an MLP of another class makes the layer unfusable, see
    :func:`why_unfusable`); in a family with a mixture of experts, where the MLP is the family's
    dense one (Qwen2-MoE's ``mlp_only_layers``, Ernie 4.5 MoE's first layers); any other MLP
    runs as its own module."""
    return not arch.moe or classes.computes_as(layer.mlp, classes.mlp)


def _fused_paths(layer, arch: Architecture, classes: ModelClasses) -> tuple:
    """The modules whose forward the fused forward computes itself (the attention, the MLP and its
    activation, where :func:`mlp_is_fused`; else it calls the MLP), the projections and norms whose
    parameters it reads, the dropouts it skips."""
    attention = tuple(path for path in arch.projections if path.startswith("self_attn."))
    mlp = ("mlp", arch.activation, *(path for path in arch.projections if path.startswith("mlp."))) \
        if mlp_is_fused(layer, arch, classes) else ()
    return ("self_attn", *attention, *mlp, *arch.norms, *(_QK_NORMS if arch.has_qk_norm(layer.self_attn) else ()),
            *(RESIDUAL_DROPOUTS if arch.residual_dropout == "modules" else ()))


def fused_modules(layer, arch: Architecture, classes: ModelClasses) -> dict:
    """{path: module} of the modules of a layer whose forward the fused forward computes in their
    place, reading their parameters."""
    return {path: layer.get_submodule(path) for path in _fused_paths(layer, arch, classes)}


# The two halves of a decoder layer, each a norm, a sublayer and a residual add: where the modules of
# one half cannot be fused (a PEFT adapter on its projections, hooks on them), that half runs as the
# model's own modules and the other stays fused (:func:`halves_separate`).
ATTENTION, MLP = "attention", "MLP"
_ATTENTION_PATHS = ("self_attn", "input_layernorm", "resid_attn_dropout")


def halves(modules: dict) -> dict:
    """{ATTENTION: {path: module}, MLP: {path: module}}: a layer's :func:`fused_modules` by the half
    they belong to (the attention's: its module, projections and QK-norm, the input norm, Phi-3's
    attention residual dropout; the MLP's: the rest)."""
    attention = {p: m for p, m in modules.items() if p.split(".")[0] in _ATTENTION_PATHS}
    return {ATTENTION: attention, MLP: {p: m for p, m in modules.items() if p not in attention}}


def halves_separate(arch: Architecture) -> bool:
    """Whether one half of a layer can run as the model's modules with the other fused: each half
    is x + s sublayer(norm(x)) (not where a norm of each sublayer's output sits between the
    two: Gemma 2's, GLM-4's; that layer runs whole as the model's own forward)."""
    return not arch.output_norms


def is_plain_linear(module) -> bool:
    """An ``nn.Linear`` whose output is ``F.linear(x, weight, bias)``: nothing overrides its forward."""
    return isinstance(module, torch.nn.Linear) and type(module).forward is torch.nn.Linear.forward


def stored_weight(module) -> torch.Tensor:
    """What ``module.weight`` is made from, for its dtype and device: a parametrized weight's
    original (``torch.nn.utils.parametrize``; each read of ``.weight`` reruns the
    parametrization, and a stateful one such as spectral_norm's power iteration steps on), else
    the weight itself. The fused forward reads each ``.weight`` once, where the model's would."""
    if parametrize.is_parametrized(module, "weight"):
        parametrization = module.parametrizations.weight
        return parametrization.original if hasattr(parametrization, "original") else parametrization.original0
    return module.weight


# activation modules by what they compute (as :func:`codetta.ops.swiglu_mlp` names it); transformers'
# GELUActivation and GELUTanh compute their GELU in PyTorch or in Python by the same formula,
# NewGELUActivation is the tanh form in Python
_GATE_ACTIVATIONS = {
    torch.nn.SiLU: "silu", torch.nn.ReLU: "relu",
    **{getattr(activations, cls): name for cls, name in (
        ("SiLUActivation", "silu"), ("GELUActivation", "gelu"), ("GELUTanh", "gelu_tanh"),
        ("NewGELUActivation", "gelu_tanh")) if hasattr(activations, cls)},
}


def gate_activation(module):
    """What an MLP's activation module computes, by the name :func:`codetta.ops.swiglu_mlp` takes
    ("silu", "gelu", "gelu_tanh", "relu"); None for any other module, or one with a forward set
    on the instance."""
    if "forward" in module.__dict__:
        return None
    if type(module) is torch.nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return _GATE_ACTIVATIONS.get(type(module))


_TRANSFORMERS_RECORDER = "output_capturing_hook"  # transformers' recorder of attentions and hidden states


def global_hooks(backward: bool) -> bool:
    """Whether hooks for every module are registered (``torch.nn.modules.module.register_module_*``):
    forward hooks and pre-hooks, and with ``backward`` also backward ones."""
    return (bool(nn_module._global_forward_hooks) or bool(nn_module._global_forward_pre_hooks)
            or (backward and (bool(nn_module._global_backward_hooks) or bool(nn_module._global_backward_pre_hooks))))


def is_hooked(module) -> bool:
    """Whether calling ``module`` runs more than its class's forward: forward or backward hooks
    or pre-hooks, its own or global ones (``register_module_forward_hook``, ...), or a
    ``forward`` set on the instance (as accelerate's hooks set it). transformers' own output
    recorders are left out: they record only when the caller asks for attention weights (see
    :func:`codetta.integrations.hf.layer.attention_weights_requested`)."""
    return ("forward" in module.__dict__ or bool(module._forward_pre_hooks) or bool(module._backward_hooks)
            or bool(module._backward_pre_hooks)
            or any(getattr(h, "__name__", None) != _TRANSFORMERS_RECORDER for h in module._forward_hooks.values())
            or global_hooks(backward=True))


_PEFT_LORA = "peft.tuners.lora.layer"


def output_owned_by_caller(module) -> bool:
    """Whether a projection's output is its caller's alone, so that the caller may let a backward
    write gradients over it (:func:`codetta.ops.gated_activation`'s ``inputs_consumed``): a PEFT
    LoRA ``Linear`` (its class's forward PEFT's own) over a plain ``nn.Linear``, plain LoRA on
    each adapter (no DoRA or other variant), no hook in it or global. Its output is then
    base(h) + B(A(h)) s (cast to base's dtype), or base(h) alone: a new tensor that no other
    autograd node saves (none of them keeps its output) and that the module does not keep. Any
    other module may keep its output, return a parameter, or end in an operation whose backward
    reads its output."""
    cls = type(module)
    return (cls.__name__ == "Linear" and cls.__module__ == _PEFT_LORA
            and getattr(cls.forward, "__module__", None) == _PEFT_LORA
            and type(getattr(module, "base_layer", None)) is torch.nn.Linear
            and not getattr(module, "lora_variant", True)
            and not any(map(is_hooked, module.modules())))


def hooks_between(layer, next_layer) -> bool:
    """:func:`codetta.ops.rmsnorm.hooks_between`, transformers' own recorders left out (they only record)."""
    return runs_hooks_between(layer, next_layer, lambda hook: getattr(hook, "__name__", None) == _TRANSFORMERS_RECORDER)


def hooked_module(modules: dict, arch: Architecture):
    """The path of one of a layer's :func:`fused_modules` that :func:`is_hooked`, or None (the
    projections left out: the fused forward calls those that have hooks, see :func:`reads_weight`)."""
    for path, module in modules.items():
        if is_hooked(module) and path not in arch.projections:
            return path
    return None


def reads_weight(module) -> bool:
    """Whether the fused forward reads a projection's weight and bias (a plain ``nn.Linear``
    without hooks), or calls the module where the model's attention or MLP calls it (a PEFT LoRA
    adapter, a quantized layer, hooks): the rest of the layer stays fused either way."""
    return is_plain_linear(module) and not is_hooked(module)


def class_name(module) -> str:
    """The module's class with its module path (PEFT's LoRA layer, for one, is also named Linear)."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def why_unfusable(modules: dict, arch: Architecture, classes: ModelClasses):
    """None when the fused forward computes what these :func:`fused_modules` compute, else why not."""
    own = {"self_attn": classes.attention, "mlp": classes.mlp}
    for path, module in modules.items():
        if path in arch.projections or path == arch.activation:
            # any module: a projection's weight read where it is a plain nn.Linear, else the module called
            # (reads_weight); the activation run in the epilogue where gate_activation names it, else as itself
            continue
        if path in RESIDUAL_DROPOUTS:
            if type(module).forward is not torch.nn.Dropout.forward:
                return f"{path} is a {type(module).__name__}, not torch.nn.Dropout"
        else:
            cls = own.get(path, classes.rms_norm)
            if not classes.computes_as(module, cls):
                return (f"{path} is a {type(module).__name__} whose forward is not {cls.__name__}'s as transformers "
                        "defines it")
    return None


def _wrapped_model(model):
    """(the model, how to reach it) where ``model`` wraps one codetta patches: torch.compile's
    OptimizedModule (``_orig_mod``), DataParallel's and DDP's ``module``, a PEFT model's
    ``get_base_model()``; else None."""
    get_base_model = getattr(model, "get_base_model", None)
    for inner, where in ((getattr(model, "_orig_mod", None), "model._orig_mod"),
                         (getattr(model, "module", None), "model.module"),
                         (get_base_model() if callable(get_base_model) else None, "model.get_base_model()")):
        if isinstance(inner, torch.nn.Module) and family_and_kind(type(inner)):
            return inner, where
    return None


def _decoder_inside(model):
    """(the class name, the path, the kind) of the first module inside ``model`` that codetta patches,
    such as a multimodal model's text decoder (Mistral3Model's MistralModel at ``language_model``) or
    a PEFT tuner's causal LM (LoraModel's at ``model``); else None."""
    for path, module in model.named_modules():
        found = family_and_kind(type(module)) if path else None
        if found:
            return type(module).__name__, path, found[1]
    return None


def architecture_of(model) -> Architecture:
    found = family_and_kind(type(model))
    if found is None:
        base = next((c.__name__ for c in type(model).__mro__[1:] if family_and_kind(c)), None)
        wrapped = _wrapped_model(model)
        if family_and_kind(type(model), any_module=True):  # e.g. a model's remote code (trust_remote_code=True)
            why = f" from {type(model).__module__}, not transformers' own class of that name, whose forward codetta computes"
        elif wrapped:
            inner, where = wrapped
            why = (f" (a wrapper of a {type(inner).__name__}: patch the model before wrapping it, or the model it "
                   f"wraps, {where})")
        elif base:
            why = (f" (a subclass of {base}: codetta patches transformers' classes themselves, not a subclass that "
                   "may compute otherwise; a wrapper's, as FSDP2's fully_shard(model) makes, is patched before "
                   "wrapping: patch, then wrap)")
        elif decoder := _decoder_inside(model):
            around = "its head and loss fused too" if decoder[2] == "ForCausalLM" else \
                "the model's own head and loss run around it"
            why = (f" (a model around a {decoder[0]}, as a multimodal model holds its text decoder or PEFT's tuner "
                   f"its model: patch that one, model.{decoder[1]}; {around})")
        else:
            why = ""
        raise UnsupportedModelError(
            f"codetta.patch supports the {', '.join(ARCHITECTURES)} families' transformers classes "
            f"(X{', X'.join(MODEL_KINDS)}); got {type(model).__name__}{why}. Nothing was patched."
        )
    return ARCHITECTURES[found[0]]


def is_causal_lm(model) -> bool:
    """Whether the model is one of the supported causal LMs (an LM head and its loss to fuse)."""
    found = family_and_kind(type(model))
    return found is not None and found[1] == CAUSAL_LM


def _need(obj, path, what):
    for part in path.split("."):
        if not hasattr(obj, part):
            raise UnsupportedModelError(f"{what}: missing {path!r}. Nothing was patched.")
        obj = getattr(obj, part)
    return obj


def is_models_norm(module, classes: ModelClasses) -> bool:
    """Whether ``module`` computes as the model's RMSNorm class (whose weight and epsilon the fused
    forward reads in its place)."""
    return classes.computes_as(module, classes.rms_norm)


def _has_models_norm(owner, path: str, classes: ModelClasses) -> bool:
    """Whether ``owner`` has a module at ``path`` of the model's RMSNorm class."""
    try:
        return is_models_norm(owner.get_submodule(path), classes)
    except AttributeError:
        return False


def check_model(model, arch: Architecture, classes: ModelClasses):
    """Raise UnsupportedModelError unless every layer has the shape the fused forward assumes."""
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise UnsupportedModelError(f"the model is in {dtype}; codetta's kernels take float16, bfloat16 and "
                                    "float32. Nothing was patched.")
    decoder = decoder_of(model)
    rotary = _need(decoder, "rotary_emb", f"{type(model).__name__}'s {type(decoder).__name__}")
    for i, layer in enumerate(_need(decoder, "layers", f"{type(model).__name__}'s {type(decoder).__name__}")):
        what = f"layer {i} ({type(layer).__name__})"
        try:
            inv_freq, _ = arch.rotary_frequencies(rotary, _need(layer, "self_attn", what))
        except (AttributeError, IndexError, TypeError) as e:
            raise UnsupportedModelError(
                f"{what}: its rotary frequencies are missing ({e}). Nothing was patched.") from e
        if inv_freq.dim() != 1:
            raise UnsupportedModelError(
                f"rotary inv_freq of shape {tuple(inv_freq.shape)} is not supported (e.g. mrope)")
        if not classes.computes_as(layer, classes.layer):
            raise UnsupportedModelError(f"{what} has a forward of its own (not {classes.layer.__name__}'s), which the "
                                        "fused forward would replace; a wrapper of the layer (activation checkpointing, "
                                        "FSDP) is added after patching. Nothing was patched.")
        _need(layer, "mlp", what)
        if isinstance(arch.qk_norm, str):
            _need(layer, f"self_attn.{arch.qk_norm}", what)
        mlp_fused = mlp_is_fused(layer, arch, classes)
        # the weights and epsilons of the norms the fused forward reads (a norm of another class runs as itself)
        norms = [norm for norm in arch.norms if _has_models_norm(layer, norm, classes)]
        for path in (*(f"{norm}.{attribute}" for norm in norms for attribute in ("weight", arch.norm_eps)),
                     "self_attn.head_dim", "self_attn.scaling", *_fused_paths(layer, arch, classes),
                     *(("self_attn.attn_logit_softcapping",) if arch.attention_softcap else ()),
                     *(("self_attn.residual_dropout", "mlp.residual_dropout") if arch.residual_dropout == "rates" else ()),
                     *(("residual_multiplier",) if arch.multipliers else ())):
            _need(layer, path, what)
        attn = layer.self_attn
        if arch.has_qk_norm(attn) and all(_has_models_norm(attn, path, classes) for path in ("q_norm", "k_norm")):
            for path in ("q_norm.weight", f"q_norm.{arch.norm_eps}", "k_norm.weight", f"k_norm.{arch.norm_eps}"):
                _need(attn, path, what)
            norms = (attn.q_norm, attn.k_norm)
            if any(n.weight.shape != (attn.head_dim,) for n in norms) or len({arch.norm_epsilon(n) for n in norms}) > 1:
                raise UnsupportedModelError(f"{what}: q_norm and k_norm must be RMSNorms of head_dim "
                                            f"{attn.head_dim} with one epsilon. Nothing was patched.")
        if arch.rope_per_layer:
            _need(attn, "use_rope", what)
        # the widths of the projections the fused forward reads (a wrapper, PEFT's, runs as the model's own)
        if arch.fused_qkv:
            if is_plain_linear(attn.qkv_proj) and sum(qkv_widths(attn)) != attn.qkv_proj.out_features:
                raise UnsupportedModelError(f"{what}: qkv_proj's {attn.qkv_proj.out_features} outputs are not the "
                                            f"config's q, k and v heads of {attn.head_dim}. Nothing was patched.")
        elif is_plain_linear(attn.q_proj) and attn.q_proj.out_features % attn.head_dim:
            raise UnsupportedModelError(f"{what}: q_proj's {attn.q_proj.out_features} outputs are no whole number of "
                                        f"heads of {attn.head_dim}. Nothing was patched.")
        if arch.fused_gate_up and mlp_fused and is_plain_linear(layer.mlp.gate_up_proj) \
                and layer.mlp.gate_up_proj.out_features % 2:
            raise UnsupportedModelError(f"{what}: gate_up_proj's {layer.mlp.gate_up_proj.out_features} outputs are no "
                                        "gate and up halves. Nothing was patched.")


def why_rotary_unfusable(rotary, classes: ModelClasses):
    """None when the fused RoPE computes what the model's rotary embedding module does (its
    class's forward, from inv_freq and attention_scaling, no hooks), else why not."""
    if not classes.computes_as(rotary, classes.rotary):
        return f"rotary_emb is a {type(rotary).__name__} whose forward is not {classes.rotary.__name__}'s"
    if is_hooked(rotary):
        return "rotary_emb has hooks or its own forward"
    return None


def why_rotary_dims_unfit(rotated: int, head_dim: int):
    """None when codetta can apply RoPE to the first ``rotated`` dims of each head (an even
    number, at most head_dim), else why not. In the QKV epilogue where it takes them
    (:func:`codetta.ops.rope.fits_qkv_epilogue`), else by codetta's rotation kernel after the QKV
    GEMM."""
    if rotated <= 0 or rotated % 2 or rotated > head_dim:
        return f"the rotary dims {rotated} of head_dim {head_dim} are not an even number up to it"
    return None


def why_rope_unfusable(model, arch: Architecture):
    """None when codetta can apply the layers' RoPE, else why not: R (the rotary dims: head_dim,
    or as many as the rotary frequencies give angles for where the family's RoPE is partial)
    even and at most head_dim (:func:`why_rotary_dims_unfit`)."""
    decoder = decoder_of(model)
    for layer in decoder.layers:
        head_dim = layer.self_attn.head_dim
        rotated = 2 * arch.rotary_frequencies(decoder.rotary_emb, layer.self_attn)[0].shape[-1] \
            if arch.partial_rotary else head_dim
        why_not = why_rotary_dims_unfit(rotated, head_dim)
        if why_not is not None:
            return why_not
    return None

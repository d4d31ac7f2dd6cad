"""The fused forward of a Llama-shaped decoder layer.

    q, k, v = RoPE(RMSNorm(x) W_qkv^T)                 rmsnorm_qkv_rope (norm folded, RoPE in the epilogue;
                                                       Qwen3's QK-norm too, before RoPE)
    a       = attention(q, k, v)                       the model's own attention function (sdpa, flash, eager)
    x1, s   = a W_o^T + x, with RMSNorm stats of x1    linear_residual (the next norm's producer; Granite
                                                       scales a W_o^T by its residual multiplier, likewise
                                                       the MLP's output)
    x2, s'  = x1 + (act(RMSNorm(x1) W_g^T)             swiglu_mlp: rmsnorm_swiglu (norm folded, gate/up side
              * (... W_u^T)) W_d^T, with the next       by side, the activation in the epilogue: SiLU, GELU
              layer's input-norm stats of x2            or ReLU), then linear_residual (the next layer's norm
                                                       producer); x1's two gradients summed in an epilogue

With a norm on each sublayer's output (Gemma 2, GLM-4) those norms run as
:func:`codetta.ops.rms_norm` before the residual adds (:func:`_sandwiched_residuals`); the
input norm and the MLP's are folded into the QKV and gate/up GEMMs, nothing is handed on.
A mixture of experts (Mixtral, Qwen2-MoE, ...) runs as the model's own module on the MLP
norm's output made by :func:`codetta.ops.rms_norm` (:func:`_mlp_residual`); the input
norm, RoPE and the O-projection's residual add are fused as above.

Where the fused forward cannot read a projection's weight (a PEFT LoRA adapter on it, a
quantized layer, hooks on it: :func:`.architectures.reads_weight`), it calls that module where
the model's attention or MLP does and fuses the rest: the QKV projections on the input norm's
output (:func:`codetta.ops.rms_norm`), then RoPE by :func:`codetta.ops.apply_rope`; o_proj on
the attention's output; gate and up on the MLP norm's output, then act(gate) * up by
:func:`codetta.ops.gated_activation` (the activation module where the kernels do not compute
it, or with ``swiglu=False``); down_proj on the activation's; a called o_proj's or down_proj's
output added to the residual stream as the model's layer adds it. Where one half of the layer (the attention's,
x1 = x + attention(norm(x)), or the MLP's) has another module the fused forward cannot read
(a norm, attention or MLP of another class) or one with hooks it would skip, that half runs
as the model's own modules (:func:`_own_half`) and the other stays fused
(:func:`_unfused_halves`); where both do, the layer runs its own forward.

The next layer's input norm reads s' (a :class:`StatsHandoff` between the two layers)
when it is given exactly x2, unchanged, as in the model's own layer loop; otherwise (the
first layer, gradient checkpointing's recomputation, a caller passing another tensor, x2
changed in place) it computes its statistics itself. No statistics are handed to or from a
layer that gradient checkpointing recomputes, so that recomputed layers leave nothing
behind; nor when the next norm's weight is not a plain tensor (FSDP2 shards it until the
next layer's own forward), nor when hooks run between the two layers (they may change x2 in
place).

Attention, its mask, the KV cache and sliding windows are the model's own: codetta calls
the attention interface the model is configured with, exactly as its attention module
would. Where a part is not fused (``rope=False``, ``swiglu=False``), that part runs as
the model's own PyTorch code on the output of a norm-folded GEMM; so does an MLP activation
that the epilogue does not compute (:func:`.architectures.gate_activation`).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
from torch.nn.utils import parametrize

from ...ops import (apply_rope, gated_activation, linear_residual, rms_norm, rmsnorm_linear, rmsnorm_qkv_rope,
                    rmsnorm_swiglu, swiglu_mlp)
from ...matmul import KERNEL_DTYPES
from ...matmul.memory import overlaps_itself
from ...ops.autocast import autocast_enabled, stream_under_autocast
from ...ops.rmsnorm import NormStats, scaled, stream_fits, weight_readable_ahead
from ...ops.rope import angles_need_grad, fits_qkv_epilogue, saves_qkv
from .. import warn_unless_traced
from . import checkpointing
from .architectures import (ATTENTION, MLP, RESIDUAL_DROPOUTS, Architecture, ModelClasses, fused_modules,
                            gate_activation, halves, halves_separate, hooked_module, hooks_between, is_hooked,
                            is_models_norm, mlp_is_fused, output_owned_by_caller, reads_weight, stored_weight,
                            why_rotary_dims_unfit, why_rotary_unfusable, why_unfusable)

try:  # transformers' collector of recorded outputs (output_attentions=True, output_hidden_states=True)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # earlier releases wrap the recording module's forward instead: hooked_module sees that
    _active_collector = None


BOTH = frozenset((ATTENTION, MLP))  # a layer's halves: both unfused is the layer's own forward


class StatsHandoff:
    """The RMSNorm statistics (u, rstd) of one residual stream tensor, from the GEMM that made
    it, for the next layer's input norm: one slot between two consecutive layers.

    ``take`` returns them only for that very tensor, unchanged since, and for that norm as it
    was when they were made: its weight the same parameter, unchanged since, its epsilon the same
    (anything else: None, and the norm computes its own; e.g. after a forward hook changed the
    layer's output in place, or where layers are run one by one and the next one's norm changed
    in between, as calibration loops fold scales into it); and it empties the slot, so nothing
    is kept past the next layer's start.

    In eager mode the slot holds the tensor only through a weak reference, and empties itself
    when that tensor dies: where the next layer does not run (layers cut or skipped after
    patching, an exception raised between the two layers), the slot would otherwise keep the
    tensor, and with it the whole autograd graph of the forward that made it, until the next
    forward. Nor do the statistics it holds keep the tensor (:meth:`NormStats.apart_from_x`):
    the slot's own identity check stands in for their reference.
    """

    def __init__(self):
        self._held: Optional[_Held] = None

    @property
    def tensor(self) -> Optional[torch.Tensor]:
        """The tensor whose statistics the slot holds (None when empty, or when it has died)."""
        held = self._held
        return None if held is None else held.ref() if held.ref is not None else held.traced

    @property
    def stats(self) -> Optional[tuple]:
        held = self._held
        return None if held is None else held.stats

    @property
    def norm_weight(self) -> Optional[torch.Tensor]:
        held = self._held
        return None if held is None else held.norm_weight

    def put(self, tensor, stats, norm_weight, norm, eps: float):
        """Hold ``stats`` of ``tensor``, made with ``norm_weight`` (what the module ``norm`` multiplies
        by) and ``eps``: one record, replaced whole, so that two threads running one model (an eval
        forward beside training) never see parts of each other's."""
        if torch.compiler.is_compiling():  # traced: an in-place change is in the graph, no counter to read
            self._held = _Held(None, tensor, None, stats, norm_weight, (norm.weight, None, eps))
        elif tensor.is_inference() or norm.weight.is_inference():  # no version counter to tell an in-place change
            self._held = None
        else:
            slot = weakref.ref(self)

            def died(ref):  # the tensor is gone: so are the statistics (unless the slot was refilled since)
                handoff = slot()
                if handoff is not None and handoff._held is not None and handoff._held.ref is ref:
                    handoff._held = None

            stats = stats.apart_from_x() if isinstance(stats, NormStats) else stats
            self._held = _Held(weakref.ref(tensor, died), None, tensor._version, stats, norm_weight,
                               (norm.weight, norm.weight._version, eps))

    def drop(self):
        """Empty the slot: the statistics handed on go unused."""
        self._held = None

    def take(self, tensor, norm, eps: float):
        """(the statistics, the norm weight they were made with) of ``tensor`` for the module ``norm``
        with ``eps``, or (None, None)."""
        held, self._held = self._held, None
        if held is None:
            return None, None
        same = (held.ref() if held.ref is not None else held.traced) is tensor
        fresh = same and (held.version is None or tensor._version == held.version)
        weight, weight_version, made_eps = held.norm
        same_norm = norm.weight is weight and eps == made_eps and (
            weight_version is None or norm.weight._version == weight_version)
        # the same tensor whose memory was swapped (``x.data = ...``, which no version counter sees): its
        # statistics, which the operator would refuse, are left for the norm to make again
        moved = isinstance(held.stats, NormStats) \
            and held.stats.mismatch(tensor, held.norm_weight, made_eps) is not None
        return (held.stats, held.norm_weight) if fresh and same_norm and not moved else (None, None)

    def __getstate__(self):
        """A copy (deepcopy, pickle: torch.save of a whole model) starts empty: what the slot holds
        belongs to one forward, and is left there when the next layer does not run (layers cut or
        skipped after patching): a non-leaf tensor that deepcopy refuses, activations a checkpoint
        has no use for (and a weak reference, which neither copies)."""
        return {**self.__dict__, "_held": None}


class _Held(NamedTuple):
    """What a :class:`StatsHandoff` holds: the tensor (a weak reference in eager mode, the tensor
    itself while traced), its version counter at put (None when traced), its statistics, the
    weight the norm multiplies by, as the statistics were made with it (Gemma's 1 + w: a tensor
    made once for both layers, which the next layer's norm then reuses), and what they were made
    of: (the norm module's weight parameter, its version counter (None when traced), epsilon)."""

    ref: Optional[weakref.ref]
    traced: Optional[torch.Tensor]
    version: Optional[int]
    stats: Optional[tuple]
    norm_weight: Optional[torch.Tensor]
    norm: tuple


class WeakModule:
    """A module referred to without keeping it alive: what a patched module holds of itself or of
    the model around it (its own patched forward, the decoder stack whose rotary embedding a
    layer reads). Held strongly, these would be reference cycles, and a deleted patched model
    (its parameters, on the GPU too) would stay allocated until Python's cycle collector ran,
    where the unpatched model is freed by ``del`` at once. ``weak()`` is the module (an error
    once it is gone), ``weak.get()`` the module or None. A deep copy refers to the module's copy
    where the same deepcopy made one before (a whole model copied: its decoder stack), else to
    the module itself, which it does not copy (one layer copied, as PEFT's layer replication
    does: not the whole decoder with it); a pickle refers to the module, which it stores."""

    __slots__ = ("_ref",)

    def __init__(self, module):
        self._ref = weakref.ref(module)

    def get(self):
        return self._ref()

    def __call__(self):
        module = self._ref()
        if module is None:
            raise RuntimeError("codetta: the patched module this belongs to was deleted")
        return module

    def __deepcopy__(self, memo):
        module, copy = self._ref(), WeakModule.__new__(WeakModule)
        copy.__setstate__((memo.get(id(module), module) if module is not None else None,))
        return copy

    def __getstate__(self):
        return (self._ref(),)

    def __setstate__(self, state):
        self._ref = weakref.ref(state[0]) if state[0] is not None else (lambda: None)


@dataclass
class LayerPlan:
    """What the fused forward of one layer does (stored on the layer while it is patched)."""

    arch: Architecture
    classes: ModelClasses
    base_model: WeakModule  # the model's decoder stack: its rotary_emb (inv_freq, attention_scaling), as it is now
    fuse_rope: bool
    fuse_swiglu: bool
    modules: tuple = ()  # the layer's modules and their classes as last seen (architectures.fused_modules)
    mlp_fused: bool = True  # whether the fused forward computes the MLP (architectures.mlp_is_fused), or calls it
    unfusable: Optional[str] = None  # why the fused forward cannot read them, if it cannot (the whole layer)
    unfused_half: Optional[str] = None  # the half (ATTENTION or MLP) whose modules it cannot read, if only one
    hooked: Optional[str] = None  # the last module found with hooks the fused forward would skip (warned once)
    activation: Optional[str] = None  # the MLP activation's name for the epilogue (None: it runs as its module)
    to_warn: tuple = ()  # what the last check of the modules found, for the next forward to say
    incoming: StatsHandoff = field(default_factory=StatsHandoff)  # stats of this layer's input
    # the next decoder layer, if any: weakly, so that a layer removed from the model after patching
    # (pruning) is freed, and no statistics are made for it
    next_layer: Optional[WeakModule] = None
    outgoing: Optional[StatsHandoff] = None  # the next layer's incoming slot


def _rope_arguments(plan: LayerPlan, x, attn, position_ids, position_embeddings):
    """(the RoPE arguments of rmsnorm_qkv_rope, None), or (None, why RoPE runs as the model's own
    code after the norm-folded GEMM: None where the model's own layer would fail as well).

    The position_embeddings (cos, sin) the layer is given are what the model's own attention
    applies (also when a hook or a caller replaced them): the fused RoPE rotates by exactly
    those. They have the two equal halves of the model's own rotary class (cat(freqs, freqs));
    a rotary embedding of another class may not, nor one whose hooks change them (checked then:
    one host synchronization per new pair). A layer called with position_ids alone takes
    positions and the model's rotary_emb (its inv_freq and attention_scaling, as they are now; the
    layer type's where the family keeps them per type).
    Angles for fewer dims than head_dim (a config's partial_rotary_factor, which these models'
    own RoPE does not take) leave RoPE to the model's code, which fails as the model does; in a
    family whose RoPE is partial (Phi-3, GLM) they are the rotary dims."""
    base = plan.base_model.get()  # None for a layer copied by itself: its model's copy is gone
    rotary = base.rotary_emb if base is not None else None
    if position_embeddings is not None:
        if rotary is not None and not plan.classes.computes_as(rotary, plan.classes.rotary):
            return None, f"rotary_emb is a {type(rotary).__name__} whose forward is not {plan.classes.rotary.__name__}'s"
        rope = dict(cos_sin=tuple(position_embeddings))
        if rotary is not None and is_hooked(rotary) and not _halves_equal(*position_embeddings):
            return None, "rotary_emb's hooks give cos and sin two unequal halves"
        rotated = position_embeddings[0].shape[-1]
    elif position_ids is None:
        return None, None
    else:
        why_not = "the model this layer was patched in is gone" if base is None else \
            why_rotary_unfusable(rotary, plan.classes)
        if why_not is not None:
            return None, why_not
        inv_freq, attention_scaling = plan.arch.rotary_frequencies(rotary, attn)
        rope = dict(positions=position_ids.expand(x.shape[:-1]), inv_freq=inv_freq, attention_scaling=attention_scaling)
        rotated = 2 * inv_freq.shape[-1]
    head_dim = attn.head_dim
    if plan.arch.partial_rotary and rotated < head_dim:
        why_not = why_rotary_dims_unfit(rotated, head_dim)  # patch checked the model's own; these may be a caller's
        if why_not is not None:
            return None, why_not
        rope["rotary_dim"] = rotated
    elif rotated != head_dim:
        return None, f"the rotary angles cover {rotated} of head_dim {head_dim} dims (partial rotary)"
    if angles_need_grad(rope.get("inv_freq"), rope.get("cos_sin")):
        return None, "the rotary angles require grad (the fused RoPE gives them no gradient)"
    return rope, None


_LAST_HALVES = [None]  # (weak references to cos and sin, their versions, the answer): the layers share one pair


def _halves_equal(cos, sin) -> bool:
    """Whether cos and sin are each two equal halves, as the model's rotary class makes them (a
    host synchronization, once per pair the layers share, or per layer for inference tensors,
    which have no version counter to tell a pair changed in place; not while torch.compile
    traces or a CUDA graph captures: taken as so)."""
    if torch.compiler.is_compiling() or (cos.is_cuda and torch.cuda.is_current_stream_capturing()):
        return True
    cacheable = not (cos.is_inference() or sin.is_inference())
    versions, last = (cos._version, sin._version) if cacheable else None, _LAST_HALVES[0]
    if cacheable and last is not None and last[0]() is cos and last[1]() is sin and last[2] == versions:
        return last[3]
    half = cos.shape[-1] // 2
    equal = all(torch.equal(t[..., :half], t[..., half:2 * half]) for t in (cos, sin))
    if cacheable:
        _LAST_HALVES[0] = (weakref.ref(cos), weakref.ref(sin), versions, equal)
    return equal


def _qkv(layer, plan: LayerPlan, x, norm, position_ids, position_embeddings):
    """(q, k, v, whether autograd keeps k and v for the backward anyway): q, k, v as
    [..., heads * head_dim] each, RoPE applied where the layer applies it (and QK-norm where the
    model has it), q scaled by position where the model scales it; ``norm``: the input norm's
    (statistics or None, weight)."""
    attn = layer.self_attn
    q, k, v, kept = _rotated_qkv(layer, plan, x, norm, position_ids, position_embeddings)
    if plan.arch.query_position_scale:  # after RoPE, in q's dtype, as the model's attention does
        params = attn.config.rope_parameters
        scale = plan.classes.modeling.get_llama_4_attn_scale(
            position_ids, params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings"))
        heads = (*q.shape[:-1], -1, attn.head_dim)  # scale: [B, 1, S, 1] for [B, heads, S, D]
        q = (q.reshape(heads) * scale.transpose(1, 2).to(q.dtype)).flatten(-2)
    return q, k, v, kept


def _rotated_qkv(layer, plan: LayerPlan, x, norm, position_ids, position_embeddings):
    """(q, k, v, whether autograd keeps k and v for the backward anyway) of the norm-folded QKV
    GEMM, RoPE (and QK-norm) in its epilogue where it fuses (q, k and v apart in memory).
    Where the fused forward cannot read a QKV projection (:func:`.architectures.reads_weight`: a
    PEFT LoRA adapter on it, hooks), the projection modules on the input norm's output (codetta's
    row kernel), QK-norm likewise, RoPE by :func:`codetta.ops.apply_rope` (one kernel each way);
    after the norm-folded GEMM likewise where the epilogue cannot take the heads
    (:func:`codetta.ops.rope.fits_qkv_epilogue`: Phi-3-mini's head_dim 96, Phi-4-mini's 96 of 128).
    Where codetta cannot apply RoPE, the model's own code applies it after either (none in a layer
    without RoPE)."""
    attn, ln, arch = layer.self_attn, layer.input_layernorm, plan.arch
    (stats, g1), eps = norm, arch.norm_epsilon(ln)
    rotates = arch.applies_rope(attn)
    rope, why_not = (_rope_arguments(plan, x, attn, position_ids, position_embeddings)
                     if plan.fuse_rope and rotates else (None, None))
    if why_not is not None:
        warn_unless_traced(f"codetta: {why_not}; RoPE runs as the model's own code on its position_embeddings",
                           stacklevel=5)
    weights, biases = arch.qkv_weights(attn) if all(map(reads_weight, arch.qkv_projections(attn))) else (None, None)
    if rope is not None and weights is not None and fits_qkv_epilogue(
            rope.get("rotary_dim", attn.head_dim), attn.head_dim, arch.has_qk_norm(attn)):
        qk_norm = {}
        if arch.has_qk_norm(attn):  # the modules' own weights: their gradients land there
            qk_norm = dict(q_norm_weight=arch.norm_weight(attn.q_norm), k_norm_weight=arch.norm_weight(attn.k_norm),
                           qk_norm_eps=arch.norm_epsilon(attn.q_norm))
        q, k, v = rmsnorm_qkv_rope(x, g1, *weights, head_dim=attn.head_dim, bias=biases,
                                   interleaved=arch.interleaved_rope, eps=eps, stats=stats, **qk_norm, **rope)
        return q, k, v, k.requires_grad and saves_qkv(biases, qk_norm.get("q_norm_weight"))
    if weights is None:
        q, k, v = arch.qkv_of_modules(attn, _norm_like_module(arch, ln, x, g1))
    else:
        qkv = rmsnorm_linear(x, g1, list(weights), eps, stats=stats)
        q, k, v = (z if b is None else z + b for z, b in zip(torch.split(qkv, [w.shape[0] for w in weights], dim=-1),
                                                              biases))
    heads = (*x.shape[:-1], -1, attn.head_dim)
    if arch.has_qk_norm(attn):
        q, k = (_norm_like_module(arch, norm, t.reshape(heads)) for norm, t in ((attn.q_norm, q), (attn.k_norm, k)))
    q, k = q.reshape(*heads[:-2], -1), k.reshape(*heads[:-2], -1)
    if rope is not None:
        return (*apply_rope(q, k, head_dim=attn.head_dim, interleaved=arch.interleaved_rope, **rope), v, False)
    if rotates:
        cos, sin = position_embeddings
        q, k = plan.classes.modeling.apply_rotary_pos_emb(q.reshape(heads), k.reshape(heads), cos, sin, unsqueeze_dim=2)
    return q.reshape(*heads[:-2], -1), k.reshape(*heads[:-2], -1), v, False


_CACHE_NAMES = ("cache", "past_key_values")  # the KV cache's argument: transformers 5.24 renamed it


def _attention(attn, plan: LayerPlan, q, k, v, attention_mask, kwargs, kv_kept=False):
    """The model's attention on [..., heads * head_dim] q, k, v, as its attention module runs it:
    the same attention function with the same arguments (``kwargs``: what the decoder layer
    passes its attention module, position_ids and use_cache included: flash attention reads
    packed sequences' boundaries from position_ids), after the KV cache's update. The cache
    comes as ``cache`` (transformers >= 5.24, whose update also takes the attention's keyword
    arguments) or ``past_key_values`` (earlier). ``kv_kept``: autograd keeps k and v for the
    backward anyway (see :func:`_updated_cache`)."""
    lead = q.shape[:-1]
    q, k, v = (t.reshape(*lead, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
    kwargs = dict(kwargs)
    caches = {name: kwargs.pop(name) for name in _CACHE_NAMES if name in kwargs}
    if caches.get("cache") is not None:
        k, v = _updated_cache(caches["cache"], attn.layer_idx, q, k, v, kv_kept, kwargs=kwargs)
    elif caches.get("past_key_values") is not None:
        k, v = _updated_cache(caches["past_key_values"], attn.layer_idx, q, k, v, kv_kept)
    modeling = plan.classes.modeling
    interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                               modeling.eager_attention_forward)
    out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0 if not attn.training else attn.attention_dropout,
                       scaling=attn.scaling, **plan.arch.attention_kwargs(attn), **kwargs)
    return out.reshape(*lead, -1)


def _updated_cache(cache, layer_idx: int, q, k, v, kv_kept: bool, **update_kwargs):
    """The keys and values attention reads after the cache's update.

    Where the cache's layer held nothing before and is transformers' DynamicLayer (the default,
    in training too, where the cache lives until the step's outputs are dropped), whose update
    would concatenate k and v to empty tensors (copies), the layer holds k or v itself where it
    lies in an allocation of its own (the fused QKV GEMM stores q, k and v apart, apply_rope q and
    k; a called v_proj's output): the same values, without a copy; a caller keeping the cache
    keeps the memory of k and v only, as with the copies. Elsewhere the cache updates as it does,
    and where its layer held nothing before (it then gives back copies of k and v) attention reads
    the given k or v where autograd keeps it for the backward anyway (``kv_kept``: the op that
    made them saved them; or it lies in q's memory, which attention keeps: views of one QKV GEMM's
    output where RoPE is not fused): no second copy is then held for the backward once the cache
    is dropped. Under torch.compile, the cache's update and the cache's k and v."""
    layers = getattr(cache, "layers", None)
    fresh = isinstance(layers, list) and not torch.compiler.is_compiling() and (
        layer_idx >= len(layers) or getattr(layers[layer_idx], "is_initialized", True) is False)
    layer = _fresh_dynamic_layer(cache, layer_idx) if fresh else None
    if layer is not None:
        layer.lazy_initialization(k, v)
        layer.keys = k if _alone(k) else torch.cat([layer.keys, k], dim=-2)
        layer.values = v if _alone(v) else torch.cat([layer.values, v], dim=-2)
        k_all, v_all = layer.keys, layer.values
    else:
        k_all, v_all = cache.update(k, v, layer_idx, **update_kwargs)
    if not fresh:
        return k_all, v_all
    in_q = q.untyped_storage().data_ptr()

    def read(given, copy):
        same = copy.shape == given.shape and copy.dtype == given.dtype and copy.device == given.device
        return given if same and (kv_kept or given.untyped_storage().data_ptr() == in_q) else copy

    return read(k, k_all), read(v, v_all)


def _fresh_dynamic_layer(cache, layer_idx: int):
    """The fresh layer ``layer_idx`` of the cache where it may hold the given k and v themselves:
    transformers' own DynamicLayer (not a subclass: sliding windows keep a slice) in a cache whose
    update is transformers' own and that does not offload layers (a cache made without a config
    gets its layers appended, as its update would); else None."""
    from transformers import cache_utils

    if type(cache).update is not cache_utils.Cache.update or getattr(cache, "offloading", False):
        return None
    layers = cache.layers
    if getattr(cache, "layer_class_to_replicate", None) is cache_utils.DynamicLayer:
        while len(layers) <= layer_idx:
            layers.append(cache_utils.DynamicLayer())
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    return layer if type(layer) is cache_utils.DynamicLayer and not layer.is_initialized else None


def _alone(t) -> bool:
    """Whether t is all that its memory holds (a whole allocation, in any order of dims)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size() \
        and not overlaps_itself(t)


def attention_weights_requested() -> bool:
    """Whether the caller asked for attention weights (``output_attentions=True``): transformers
    records them with a hook on the attention module, whose forward the fused layer does not
    call, so the layer then runs the model's own forward. Not seen in a layer compiled by
    itself (torch.compile cannot read transformers' context variable): there, ask for
    attention weights in eager mode."""
    if _active_collector is None or torch.compiler.is_compiling():  # dynamo cannot read a ContextVar
        return False
    collected = _active_collector.get()
    return bool(collected) and "attentions" in collected


def check_modules(layer, plan: LayerPlan) -> dict:
    """The modules the fused forward reads in the layer's place; where they (or their classes)
    changed since the last check, whether it can read them and how the MLP's activation runs,
    the warnings for it left in ``plan.to_warn``. Called at patch time too, so that a traced
    forward (torch.compile) does not set them, which would make its graph's guards fail at the
    next call."""
    modules = fused_modules(layer, plan.arch, plan.classes)
    act = modules.get(plan.arch.activation)
    activation = None if act is None else gate_activation(act)
    # a module replaced, a class swapped in place (module.__class__ = ...) or its forward replaced (the
    # layer's too), an activation changed in place (GELU's approximate)
    seen = (tuple(modules.items()), tuple(map(type, modules.values())),
            tuple(type(module).forward for module in modules.values()), type(layer).forward, activation)
    if seen == plan.modules:
        return modules
    plan.modules, plan.mlp_fused, plan.activation = seen, mlp_is_fused(layer, plan.arch, plan.classes), activation
    whys = {half: why_unfusable(part, plan.arch, plan.classes) for half, part in halves(modules).items()}
    unreadable = {half: why for half, why in whys.items() if why is not None}
    one_half = len(unreadable) == 1 and halves_separate(plan.arch)
    if not plan.classes.computes_as(layer, plan.classes.layer):  # its class's forward set after patching: it runs
        unreadable = {BOTH: f"{type(layer).__name__}.forward is not transformers' own (replaced after patching)"}
        one_half = False
    plan.unfused_half = next(iter(unreadable)) if one_half else None
    plan.unfusable = None if one_half else next(iter(unreadable.values()), None)
    if unreadable:
        (half, why), = list(unreadable.items())[:1]
        plan.to_warn = (_unfused_message(layer, {half} if one_half else BOTH, why),)
    elif plan.fuse_swiglu and plan.arch.gated_mlp and act is not None and plan.activation is None:
        plan.to_warn = (f"codetta: a {type(layer).__name__}'s MLP activation is a {type(act).__name__}, which the "
                        "gate/up GEMM's epilogue does not compute (SiLU, GELU, ReLU): it runs as that module, "
                        "between the norm-folded gate/up GEMM and the down projection",)
    else:
        plan.to_warn = ()
    return modules


def _unfused_message(layer, own: set, why: str) -> str:
    if len(own) == 2:
        return f"codetta: a {type(layer).__name__} runs the model's own forward, unfused: {why}"
    half, = own
    other = MLP if half == ATTENTION else ATTENTION
    return (f"codetta: a {type(layer).__name__}'s {half} half runs as the model's own modules, unfused (its {other} "
            f"half stays fused): {why}")


def _unfused_halves(layer, plan: LayerPlan, hidden_states) -> frozenset:
    """The halves of the layer (:data:`.architectures.ATTENTION`, ``MLP``) that must run as the
    model's own modules for the layer to compute what its own forward would; both: the layer
    runs its own forward. A half's modules are checked again whenever they change (PEFT
    wrapping a projection after patching, or merging it back), with a warning when a half has to
    run unfused; so is a half with a module whose forward the fused one would skip and that has
    hooks (warned once per module). The whole layer runs its own forward where attention weights
    are asked for, or it computes in a precision codetta's kernels do not take (a model cast to
    fp64 after patching), or its halves do not separate (:func:`.architectures.halves_separate`)."""
    def warn_unfused(why, own=BOTH):
        warn_unless_traced(_unfused_message(layer, own, why), stacklevel=3)

    if hidden_states.dtype == torch.float64:
        warn_unfused("fp64 (codetta's kernels take fp32, fp16 and bf16)")
        return BOTH

    modules = check_modules(layer, plan)
    if plan.to_warn and not torch.compiler.is_compiling():  # what the last check found, said by the
        for message in plan.to_warn:                        # first forward that runs with it untraced
            warnings.warn(message, stacklevel=3)
        plan.to_warn = ()
    if plan.unfusable is not None:
        return BOTH
    # what follows reads the modules of the halves the fused forward reads (those of a half whose
    # modules it cannot read may lack what it would read: a wrapper's weight, a norm's epsilon)
    parts = halves(modules)
    readable = [half for half in (ATTENTION, MLP) if half != plan.unfused_half]
    attn = layer.self_attn
    if ATTENTION in readable and plan.arch.has_qk_norm(attn) \
            and plan.arch.norm_epsilon(attn.q_norm) != plan.arch.norm_epsilon(attn.k_norm):
        warn_unfused("q_norm and k_norm have different epsilons (the fused QK-norm takes one)")
        return BOTH
    # a stream the kernels cannot take with these weights (bf16 inputs_embeds given to an fp32 model):
    # the model's own layer upcasts it (its norm and residual add make an fp32 stream for the next layer);
    # under autocast the operators make a 16-bit stream of the other dtype fp32 (codetta.ops.autocast)
    projections = [parts[half][path] for half in readable for path in parts[half]
                   if path in plan.arch.projections and reads_weight(parts[half][path])]
    device_type = hidden_states.device.type
    if projections:  # (none where the attention half runs as its modules and the MLP is a mixture of experts)
        operand, stream = stored_weight(projections[0]).dtype, hidden_states.dtype
        if autocast_enabled(device_type):
            operand = torch.get_autocast_dtype(device_type)
            stream = stream_under_autocast(stream, operand)
        if not stream_fits(stream, operand):
            warn_unfused(f"its input is {hidden_states.dtype} and its GEMMs run in {operand}")
            return BOTH
    own = {plan.unfused_half} if plan.unfused_half else set()
    # a half whose residual dropout is on in training (none in the fused residual adds) runs as its
    # modules, which drop out as the model's layer does
    rates = {half: plan.arch.residual_dropout_rate(layer, half) if layer.training else 0.0 for half in readable}
    dropping = {half for half, rate in rates.items() if rate > 0}
    if dropping:
        own |= dropping
        warn_unfused(f"its residual dropout (p = {max(rates.values())}) is on in training (the fused residual add "
                     "has no dropout)", BOTH if len(own) == 2 or not halves_separate(plan.arch) else own)
    # (no assignment expressions here: torch.compile traces this at each call)
    paths = {half: hooked_module(part, plan.arch) for half, part in parts.items()}
    hooked = {half: path for half, path in paths.items() if path is not None}
    own |= set(hooked)
    if own and not halves_separate(plan.arch):
        own = set(BOTH)
    first_hooked = next(iter(hooked.values()), None)
    if first_hooked is not None and first_hooked != plan.hooked:
        warn_unfused(f"{first_hooked} has hooks or its own forward, which the fused forward would skip", own)
    plan.hooked = first_hooked
    return BOTH if attention_weights_requested() else frozenset(own)


def fused_decoder_forward(layer, hidden_states, attention_mask=None, position_ids=None, use_cache=False,
                          position_embeddings=None, **kwargs):
    """Drop-in for the layer's ``forward`` (same arguments, same result, the norms folded); the KV
    cache comes in ``kwargs`` under the name the installed transformers uses."""
    plan: LayerPlan = layer._codetta_plan
    own = _unfused_halves(layer, plan, hidden_states)
    if own == BOTH:
        plan.incoming.drop()  # the statistics handed to this layer go unused
        return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    return checkpointing.run(_fused_layer, layer, hidden_states, attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=use_cache, position_embeddings=position_embeddings,
                             own_half=next(iter(own), None), **kwargs)


def _fused_layer(layer, x, attention_mask, position_ids, use_cache, position_embeddings, own_half=None, **kwargs):
    """The fused forward of a layer (what a checkpoint recomputes); ``own_half``: the half that
    runs as the model's own modules (:func:`_unfused_halves`), if one does."""
    plan: LayerPlan = layer._codetta_plan
    arch, attn = plan.arch, layer.self_attn
    if own_half == ATTENTION:
        plan.incoming.drop()
        x1 = _own_half(layer, plan, ATTENTION, x, dict(attention_mask=attention_mask, position_ids=position_ids,
                                                         use_cache=use_cache, position_embeddings=position_embeddings,
                                                         **kwargs))
        return _mlp_residual(layer, plan, x1)
    ln = layer.input_layernorm
    stats, g1 = plan.incoming.take(x, ln, arch.norm_epsilon(ln))
    norm = (stats, g1 if stats is not None else arch.norm_weight(ln))
    q, k, v, kv_kept = _qkv(layer, plan, x, norm, position_ids, position_embeddings)
    a = _attention(attn, plan, q, k, v, attention_mask, dict(position_ids=position_ids, use_cache=use_cache, **kwargs),
                   kv_kept)
    if arch.output_norms:
        return _sandwiched_residuals(layer, plan, x, a)
    if own_half == MLP:
        return _own_half(layer, plan, MLP, _attention_residual(layer, plan, x, a))
    return _residuals(layer, plan, x, a)


def _own_half(layer, plan: LayerPlan, half: str, x, attention_kwargs=None):
    """x + s sublayer(norm(x)) of one half of the layer by the model's own modules (its attention
    or MLP, Phi-3's residual dropout module), as the layer's own forward computes it (s:
    Granite's residual multiplier, else 1). The norm is :func:`_norm_like_module` (one row
    kernel each way in place of the module's chain of elementwise ones) where the fused
    forward could read it (a norm of the model's class without hooks), else the module."""
    arch = plan.arch
    norm_path = "input_layernorm" if half == ATTENTION else arch.mlp_norm
    norm = layer.get_submodule(norm_path)
    readable = not is_hooked(norm) and is_models_norm(norm, plan.classes)
    h = _norm_like_module(arch, norm, x) if readable else norm(x)
    out = layer.self_attn(hidden_states=h, **attention_kwargs)[0] if half == ATTENTION else layer.mlp(h)
    if arch.residual_dropout == "modules":  # the model's dropout module (on in training is why the half runs so)
        out = layer.get_submodule(RESIDUAL_DROPOUTS[half == MLP])(out)
    return x + scaled(out, arch.branch_scale(layer))


def _attention_residual(layer, plan: LayerPlan, x, a):
    """x1 = x + s a W_o^T (+ b_o): the O-projection's GEMM with the residual add in its epilogue,
    or, where the fused forward cannot read o_proj (:func:`.architectures.reads_weight`), the
    module's output added as the model's layer adds it (s: Granite's residual multiplier, else 1)."""
    attn, scale = layer.self_attn, plan.arch.branch_scale(layer)
    if not reads_weight(attn.o_proj):
        return x + scaled(attn.o_proj(a), scale)
    return linear_residual(a, attn.o_proj.weight, x, bias=attn.o_proj.bias, branch_scale=scale)


def _residuals(layer, plan: LayerPlan, x, a):
    """x2 from the layer's input x and the attention's output a: the O-projection's residual add
    (making the MLP norm's statistics where the MLP is fused and o_proj and the gate/up
    projections are read), then :func:`_mlp_residual`."""
    arch, attn = plan.arch, layer.self_attn
    # a mixture of experts; o_proj called; gate/up called (on the norm's output made whole: no statistics read)
    if not plan.mlp_fused or not reads_weight(attn.o_proj) \
            or not all(map(reads_weight, arch.gate_up_projections(layer.mlp))):
        return _mlp_residual(layer, plan, _attention_residual(layer, plan, x, a))
    ln2 = layer.get_submodule(arch.mlp_norm)
    # each norm weight read once: a parametrized weight is new at each read (and Gemma's 1 + w a new
    # tensor), and NormStats checks that its consumer gets the same one
    g2 = arch.norm_weight(ln2)
    x1, stats = linear_residual(a, attn.o_proj.weight, x, g2, arch.norm_epsilon(ln2), bias=attn.o_proj.bias,
                                branch_scale=arch.branch_scale(layer))
    return _mlp_residual(layer, plan, x1, stats, g2)


def _mlp_residual(layer, plan: LayerPlan, x1, stats=None, g2=None):
    """x2 = x1 + s MLP(RMSNorm(x1)): the MLP with its norm folded (its statistics ``stats`` of x1
    made by the O-projection's GEMM, if given, with the norm's weight ``g2`` read then), its
    residual add making the next layer's input-norm statistics (handed on where the next layer
    will take them); where the fused forward cannot read down_proj, that module's output added as
    the model's layer adds it (see :func:`_mlp_hidden` for gate and up). A mixture of experts
    (``Architecture.moe``) runs as the model's own module on the norm's output made whole by
    :func:`codetta.ops.rms_norm`; its router reads it, each token's experts their rows of it;
    nothing is folded or handed on."""
    arch, mlp, ln2 = plan.arch, layer.mlp, layer.get_submodule(plan.arch.mlp_norm)
    if not plan.mlp_fused:
        return x1 + mlp(_norm_like_module(arch, ln2, x1))
    g2 = arch.norm_weight(ln2) if g2 is None else g2
    eps2 = arch.norm_epsilon(ln2)
    branch_scale = arch.branch_scale(layer)  # Granite's residual multiplier, else 1
    down = mlp.down_proj
    if not reads_weight(down):  # called: its output added as the model's layer adds it, nothing handed on
        return x1 + scaled(down(_mlp_hidden(layer, plan, x1, g2, eps2, stats)), branch_scale)
    next_layer = next_layer_of(plan)
    ln_next = next_layer.input_layernorm if next_layer is not None else None
    hand_on = (
        next_layer is not None
        # hooks may change x2 in place: traced by torch.compile, there is no version counter to tell
        # (StatsHandoff.take checks it in eager mode)
        and not hooks_between(layer, next_layer)
        # a recomputed layer would make them again, or find none when recomputed
        and not (checkpointing.recomputed(layer) or checkpointing.recomputed(next_layer))
        # a parametrized weight is made anew at each read (not read here: that would run its
        # parametrization once more than the model does); the next layer's would not be this one
        and not parametrize.is_parametrized(ln_next)
        # the model's own norm (one replaced after patching may have no weight or epsilon to read)
        and is_models_norm(ln_next, plan.classes)
        and weight_readable_ahead(ln_next, ln_next.weight)
        and _reads_qkv_weights(next_layer.self_attn, plan)
    )
    next_norm = dict(next_norm_weight=arch.norm_weight(ln_next), next_eps=arch.norm_epsilon(ln_next)) if hand_on else {}
    if _gate_in_epilogue(plan, mlp):
        (w_gate, w_up), (b_gate, b_up) = arch.gate_up_weights(mlp)  # biases: Llama's mlp_bias
        out = swiglu_mlp(x1, g2, w_gate, w_up, down.weight, eps2, stats=stats, bias=(b_gate, b_up, down.bias),
                         branch_scale=branch_scale, activation=plan.activation, **next_norm)
    else:
        y = _mlp_hidden(layer, plan, x1, g2, eps2, stats)
        out = linear_residual(y, down.weight, x1, *next_norm.values(), bias=down.bias, branch_scale=branch_scale)
    if not hand_on:
        return out
    x2, stats2 = out
    plan.outgoing.put(x2, stats2, next_norm["next_norm_weight"], ln_next, next_norm["next_eps"])
    return x2


def next_layer_of(plan: LayerPlan):
    """The layer that takes what this one hands on (``plan.outgoing`` is its incoming slot), or None.
    A deep copy of a whole model copies the layers in order, so a copied layer's reference to the
    next one, not copied yet, names the original's (:class:`WeakModule`): then the copy's decoder
    holds the layer whose slot it is, found and remembered; a layer copied alone hands on nothing
    (its slot, copied with it, is no layer's)."""
    layer = plan.next_layer.get() if plan.next_layer is not None else None
    if layer is None or _incoming_slot(layer) is plan.outgoing:
        return layer
    base = plan.base_model.get()
    layer = next((other for other in getattr(base, "layers", ()) if _incoming_slot(other) is plan.outgoing), None)
    plan.next_layer = WeakModule(layer) if layer is not None else None
    return layer


def _incoming_slot(layer) -> Optional[StatsHandoff]:
    plan = getattr(layer, "_codetta_plan", None)
    return plan.incoming if isinstance(plan, LayerPlan) else None


def _reads_qkv_weights(attn, plan: LayerPlan) -> bool:
    """Whether the fused forward reads this attention's QKV projections' weights (the model's
    attention module, each projection a plain ``nn.Linear`` without hooks): the only reader of
    the input-norm statistics a previous layer hands on (called projections get the norm's
    output made whole, an attention of another class runs as its module)."""
    return (plan.classes.computes_as(attn, plan.classes.attention)
            and all(map(reads_weight, plan.arch.qkv_projections(attn))))


def _sandwiched_residuals(layer, plan: LayerPlan, x, a):
    """x2 from the layer's input x and the attention's output a where each sublayer's output is
    normalized before its residual add (Gemma 2, GLM-4; ``Architecture.output_norms``):

        x1 = x + RMSNorm_attn_out(a W_o^T)
        x2 = x1 + RMSNorm_mlp_out(MLP(RMSNorm_mlp_in(x1)))

    The MLP's input norm is folded into the gate/up GEMM (its activation in the epilogue); the
    output projections are the model's modules, the output norms :func:`codetta.ops.rms_norm`
    (an output norm needs its whole row before the add: nothing is handed on)."""
    arch, attn, mlp = plan.arch, layer.self_attn, layer.mlp
    attn_out_norm, mlp_out_norm = (layer.get_submodule(path) for path in arch.output_norms)
    mlp_in_norm = layer.get_submodule(arch.mlp_norm)
    x1 = x + _norm_like_module(arch, attn_out_norm, attn.o_proj(a))
    y = _mlp_hidden(layer, plan, x1, arch.norm_weight(mlp_in_norm), arch.norm_epsilon(mlp_in_norm), None)
    return x1 + _norm_like_module(arch, mlp_out_norm, mlp.down_proj(y))


def _norm_like_module(arch: Architecture, norm, t, weight=None):
    """What the RMSNorm module ``norm`` returns for t, by :func:`codetta.ops.rms_norm` (one row
    kernel each way, rounded once) in the dtype the module returns: t's for Gemma's norm (1 + w
    in fp32, ``type_as`` its input), else t's and its weight's promoted (Llama's norm multiplies
    its weight by the normalized t); the module itself where its weight's dtype is neither t's
    nor fp32. ``weight``: the norm's weight as already read (``arch.norm_weight``), if it was."""
    weight = arch.norm_weight(norm) if weight is None else weight
    if weight.dtype not in (t.dtype, torch.float32):
        return norm(t)
    dtype = t.dtype if arch.norm_weight_offset else torch.promote_types(weight.dtype, t.dtype)
    return rms_norm(t, weight, arch.norm_epsilon(norm), dtype=dtype)


def fused_final_norm_forward(norm, hidden_states):
    """The decoder's final RMSNorm (which the LM head, or the fused loss, reads) by
    :func:`codetta.ops.rms_norm`: one row kernel each way instead of the module's chain of
    elementwise kernels (:func:`_norm_like_module`). The module's own forward where it no longer
    computes as the model's RMSNorm (its class swapped after patching), or where the kernel does
    not take the dtypes (an fp64 model, a weight in neither the input's dtype nor fp32)."""
    arch, classes = norm._codetta_norm
    if not is_models_norm(norm, classes) or hidden_states.dtype not in KERNEL_DTYPES:
        return type(norm).forward(norm, hidden_states)
    weight = arch.norm_weight(norm)
    if weight.dtype not in (hidden_states.dtype, torch.float32):
        return type(norm).forward(norm, hidden_states)
    return _norm_like_module(arch, norm, hidden_states, weight)


def _gate_in_epilogue(plan: LayerPlan, mlp) -> bool:
    """Whether the MLP's activation runs in the gate/up GEMM's epilogue: a gated MLP whose
    activation the epilogue computes and whose gate and up projections the fused forward reads
    (:func:`.architectures.reads_weight`), with ``swiglu`` fusion on."""
    return (plan.arch.gated_mlp and plan.fuse_swiglu and plan.activation is not None
            and all(map(reads_weight, plan.arch.gate_up_projections(mlp))))


def _mlp_hidden(layer, plan: LayerPlan, x1, g2, eps2, stats):
    """What the MLP's down projection multiplies: act(h W_g^T + b_g) * (h W_u^T + b_u), or
    act(h W_u^T + b_u) without a gate (Arcee), h = RMSNorm(x1) folded into the gate/up GEMM; the
    activation in its epilogue where :func:`_gate_in_epilogue`, else the model's module after it.
    Where the fused forward cannot read a gate or up projection (:func:`.architectures.reads_weight`),
    the modules on h made by :func:`codetta.ops.rms_norm` (the weight g2 as read), then
    :func:`_gated_activation_of_modules`."""
    arch, mlp = plan.arch, layer.mlp
    act = layer.get_submodule(arch.activation)
    projections = arch.gate_up_projections(mlp)
    if not all(map(reads_weight, projections)):
        gate, up = arch.gate_up_of_modules(mlp, _norm_like_module(arch, layer.get_submodule(arch.mlp_norm), x1, g2))
        if gate is None:
            return act(up)
        return _gated_activation_of_modules(plan, act, gate, up, all(map(output_owned_by_caller, projections)))
    (w_gate, w_up), (b_gate, b_up) = arch.gate_up_weights(mlp)
    if _gate_in_epilogue(plan, mlp):
        return rmsnorm_swiglu(x1, g2, w_gate, w_up, eps2, stats=stats, bias=(b_gate, b_up), activation=plan.activation)
    if w_gate is None:
        up = rmsnorm_linear(x1, g2, [w_up], eps2, stats=stats)
        return act(up if b_up is None else up + b_up)
    gate, up = torch.chunk(rmsnorm_linear(x1, g2, [w_gate, w_up], eps2, stats=stats), 2, dim=-1)
    gate, up = (z if b is None else z + b for z, b in ((gate, b_gate), (up, b_up)))
    return act(gate) * up


def _gated_activation_of_modules(plan: LayerPlan, act, gate, up, owned: bool):
    """act(gate) * up for gate and up projections the model's modules made: one kernel each way
    (:func:`codetta.ops.gated_activation`, which keeps gate and up for the backward, not also
    act(gate), and writes their gradients over them where they are this function's alone:
    ``owned``, see :func:`.architectures.output_owned_by_caller`) where the epilogue's
    activations include the module's (``plan.activation``), swiglu fusion is on and the two are
    alike; else the activation module, as the model's MLP."""
    if plan.fuse_swiglu and plan.activation is not None and gate.shape == up.shape and gate.dtype == up.dtype:
        return gated_activation(gate, up, plan.activation, inputs_consumed=owned)
    return act(gate) * up

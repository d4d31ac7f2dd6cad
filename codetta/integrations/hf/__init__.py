"""``codetta.patch`` / ``codetta.unpatch`` for Hugging Face Llama-family models.

The model keeps its own parameters (names, shapes, layouts, state_dict), so optimizers,
FSDP, PEFT and checkpoints keep working and gradients land in them. Patching replaces
the ``forward`` of each decoder layer (and of the causal-LM head) on the instances, not
on the classes: other models in the process are untouched.
"""

from __future__ import annotations

import inspect
import warnings

import transformers

from ...versions import MIN_TRANSFORMERS, release
from .architectures import (ARCHITECTURES, MODEL_KINDS, UnsupportedModelError, architecture_of, check_model,
                            decoder_of, is_causal_lm, is_models_norm, model_classes, why_rope_unfusable)
from .layer import LayerPlan, WeakModule, check_modules, fused_decoder_forward, fused_final_norm_forward
from .loss import fused_causal_lm_forward

__all__ = ["ARCHITECTURES", "MODEL_KINDS", "UnsupportedModelError", "patch", "unpatch"]


class FusedForward:
    """A patched module's ``forward``: ``function(module, ...)``, with the signature of the module's
    own bound ``forward`` (transformers reads it: which inputs generate() and the Trainer pass,
    under the names the installed version uses, e.g. the KV cache's). Arguments after the first
    passed by position are bound by that signature and handed on by name, as the module's own
    forward would take them (``layer(h, mask, positions, cache)``). Unlike a bound method of a
    module-level function, it survives pickling (``torch.save`` of a whole model). It holds the
    module weakly (:class:`WeakModule`): the module holds it. ``patched_by`` is the attribute that
    :func:`patch` sets on the module and :func:`unpatch` removes: without it, the module's own
    forward runs."""

    def __init__(self, function, module, patched_by):
        self.function, self._module, self.patched_by = function, WeakModule(module), patched_by

    @property
    def module(self):
        return self._module()

    def __call__(self, *args, **kwargs):
        module = self.module
        if self.patched_by not in module.__dict__:
            # unpatched, but still called through a forward set on the instance after patching (accelerate's
            # hooks, transformers' tensor-parallel wrappers keep the forward they found): the module's own
            return type(module).forward(module, *args, **kwargs)
        if len(args) > 1:  # transformers passes all but the first by name: the usual call skips this
            args, kwargs = self._by_name(args, kwargs)
        return self.function(module, *args, **kwargs)

    def _by_name(self, args, kwargs):
        bound = self.__signature__.bind(*args, **kwargs)
        first, *rest = bound.signature.parameters.values()
        named = {}
        for p in rest:
            if p.name not in bound.arguments:
                continue
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                raise TypeError(f"codetta: the patched {type(self.module).__name__}.forward takes no extra "
                                "positional arguments")
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                named.update(bound.arguments[p.name])
            else:
                named[p.name] = bound.arguments[p.name]
        return (bound.arguments[first.name],), named

    @property
    def __signature__(self):
        return inspect.signature(type(self.module).forward.__get__(self.module))


def patch(model, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True, cross_entropy: bool = True):
    """Patch an already built transformers model in place; returns it.

    Models: the causal LMs of the families in :data:`.architectures.ARCHITECTURES` (Llama, Mistral,
    Qwen2, Qwen3, Ministral, Ministral3, Cwm, SmolLM3, Helium, Ernie4_5, Phi3, Glm, SeedOss,
    Granite, Gemma, Arcee, Gemma2, Gemma3 (its text models), Glm4, VaultGemma; the mixtures of
    experts Mixtral, Qwen2Moe, Qwen3Moe, Ernie4_5_Moe, Glm4Moe, Dots1, SolarOpen, whose experts run
    as the model's module: ``LlamaForCausalLM``, ...),
    their bare decoder stacks (``LlamaModel``, ...) and the other heads transformers puts on them
    (``...ForSequenceClassification``, ``...ForTokenClassification``, ``...ForQuestionAnswering``).

    rms_norm: fold each RMSNorm that a GEMM reads into that GEMM (and its statistics into the
        GEMM before it); the others (the decoder's final norm, Gemma 2's and GLM-4's output norms,
        a mixture of experts' MLP norm) run as :func:`codetta.ops.rms_norm`; without it no layer
        is patched (pass ``rope=False, swiglu=False`` with it: both need it).
    rope: RoPE in the QKV GEMM's epilogue (with Qwen3's QK-norm before it, in the same
        epilogue); where the rotary dims, or head_dim with QK-norm, are no power of two, as
        Phi-3-mini's head_dim 96, or do not divide head_dim, as Phi-4-mini's 96 of 128, by
        codetta's rotation kernel after the norm-folded QKV GEMM (an odd head_dim too).
    swiglu: the gated MLP's activation in the gate/up GEMM's epilogue (SwiGLU; GELU and ReLU
        gates too, see :func:`.architectures.gate_activation`; any other activation module runs
        as itself after that GEMM, with a warning).
    cross_entropy: LM head + loss fused when labels are given in training mode (``logits`` is
        then None; in eval mode the model's own head and loss run and return the logits). A
        causal LM's only: the other models have no LM loss, and their heads and losses run as
        the model's own code.

    ``rope`` and ``swiglu`` need ``rms_norm``.

    Raises UnsupportedModelError (a ValueError) for a model or option it cannot patch,
    before changing anything.
    """
    if release(transformers.__version__) < MIN_TRANSFORMERS:
        raise UnsupportedModelError(f"codetta.patch follows the model code of transformers "
                                    f"{'.'.join(map(str, MIN_TRANSFORMERS))} and later; this is transformers "
                                    f"{transformers.__version__}. Nothing was patched.")
    arch = architecture_of(model)
    if (rope or swiglu) and not rms_norm:
        raise UnsupportedModelError("rope and swiglu fusion need rms_norm=True (the norm is folded into their GEMMs). "
                                    "Nothing was patched.")
    classes = model_classes(model)
    check_model(model, arch, classes)
    cross_entropy = cross_entropy and is_causal_lm(model)
    _check_instance_forwards(model, classes, rms_norm, cross_entropy)
    _turn_off_hub_kernels(model)
    unpatch(model)
    decoder = decoder_of(model)
    if rms_norm:
        layers = list(decoder.layers)
        why_not = why_rope_unfusable(model, arch) if rope else None
        if why_not is not None:
            rope = False
            warnings.warn(f"codetta.patch: {why_not}; RoPE runs as the model's own code after the norm-folded QKV "
                          "GEMM", stacklevel=2)
        plans = [LayerPlan(arch, classes, WeakModule(decoder), rope, swiglu) for _ in layers]
        for i, (layer, plan) in enumerate(zip(layers, plans)):
            if i + 1 < len(layers):  # this layer's last GEMM makes the next layer's norm statistics
                plan.next_layer, plan.outgoing = WeakModule(layers[i + 1]), plans[i + 1].incoming
            layer._codetta_plan = plan
            check_modules(layer, plan)
            layer.forward = FusedForward(fused_decoder_forward, layer, "_codetta_plan")
        final_norm = _final_norm(decoder, classes)
        if final_norm is not None:
            final_norm._codetta_norm = (arch, classes)
            final_norm.forward = FusedForward(fused_final_norm_forward, final_norm, "_codetta_norm")
    if cross_entropy:
        model.forward = FusedForward(fused_causal_lm_forward, model, "_codetta_patched")
    # what the fused loss needs of the family, taken now: a wrapper (FSDP2) swaps the model's class later
    model._codetta_patched = dict(rms_norm=rms_norm, rope=rope and rms_norm, swiglu=swiglu and rms_norm,
                                  cross_entropy=cross_entropy, logits_scaling=arch.multipliers,
                                  logit_softcap=arch.logit_softcap,
                                  moe=arch.moe,
                                  load_balancing_loss=classes.modeling.load_balancing_loss_func if arch.router_loss else None)
    return model


def _check_instance_forwards(model, classes, rms_norm: bool, cross_entropy: bool):
    """Raise UnsupportedModelError if a module whose forward :func:`patch` would set (the decoder layers
    and its final norm, the causal LM with ``cross_entropy``) has a forward set on its instance other than codetta's:
    accelerate's hooks (device_map dispatch, offloading), transformers' tensor- or pipeline-parallel
    wrappers. Replacing it would drop what it adds; patched first, the wrapper calls the patched forward."""
    decoder = decoder_of(model)
    final_norm = _final_norm(decoder, classes)
    replaced = ([("the model", model)] if cross_entropy else []) + (
        [(f"layer {i}", layer) for i, layer in enumerate(decoder.layers)] if rms_norm else []) + (
        [("the final norm", final_norm)] if rms_norm and final_norm is not None else [])
    for where, module in replaced:
        forward = module.__dict__.get("forward")
        if forward is not None and not isinstance(forward, FusedForward) and "_kernel_repo" not in module.__dict__:
            raise UnsupportedModelError(f"{where} has a forward set on its instance (accelerate's hooks or a "
                                        "parallelism wrapper set one), which patching would replace; patch the model "
                                        "before adding them. Nothing was patched.")


def _turn_off_hub_kernels(model) -> None:
    """transformers' hub kernels off (``model.use_kernels``, which ``from_pretrained`` turns on by default
    from transformers 5.2x where the ``kernels`` package is installed): at each change between train()
    and eval() it kernelizes the model again, setting on each RMSNorm instance (and other modules its
    decorators name) the forward of a hub kernel, or, where none applies (on a CPU, without the hub),
    removing the forward set on the instance: codetta's on the final norm too (found by a probe: after
    the Trainer's model.train() the final norm ran unfused). codetta's fused operators take their
    place; ``model.use_kernels = True`` after :func:`unpatch` turns them on again."""
    if getattr(model, "use_kernels", False) is True:
        model.use_kernels = False  # transformers' setter: the modules' own forwards back, and no kernelize after


def _final_norm(decoder, classes):
    """The decoder's norm after its last layer (``norm``), where it is the model's RMSNorm; else None."""
    norm = getattr(decoder, "norm", None)
    return norm if norm is not None and is_models_norm(norm, classes) else None


def unpatch(model):
    """Undo :func:`patch`, of the model and of any of its submodules patched by themselves (a
    causal LM's bare decoder, say); a model that is not patched is returned unchanged."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), FusedForward):
            del module.forward
        module.__dict__.pop("_codetta_plan", None)
        module.__dict__.pop("_codetta_patched", None)
        module.__dict__.pop("_codetta_norm", None)
    return model

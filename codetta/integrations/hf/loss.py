"""The causal-LM forward with the LM head and the loss fused (no [tokens, vocab] logits).

Same loss as transformers' ``ForCausalLMLoss``: labels shifted left by one (or the
``shift_labels`` given), ``ignore_index`` -100 (or the one passed), mean over the counted
tokens, or the sum divided by ``num_items_in_batch`` when the trainer passes it; over the
positions ``logits_to_keep`` selects. A model with another ``loss_function`` runs its own. In
training mode with labels, the output's ``logits`` is None: not materializing them is the
point. Without labels, or in eval mode (an evaluation loop reads the logits, and has no
backward to keep memory for), the model's own forward runs. Granite divides its logits by
``config.logits_scaling``: the loss takes h / s and b / s, which give the same logits. Gemma 2,
Gemma 3 and VaultGemma cap their logits to s tanh(logits / s) (``config.final_logit_softcapping``,
where not None): so does the loss. A mixture of experts returns a ``MoeCausalLMOutputWithPast``
(with the router logits where asked for); Mixtral's and the others of ``Architecture.router_loss``
add their routers' load-balancing loss where ``output_router_logits`` (the argument, else the
config's) asks for it, by the modeling module's ``load_balancing_loss_func``, as their own forward does.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

from ...ops import linear_cross_entropy
from .. import warn_unless_traced
from .architectures import class_name, is_hooked, is_plain_linear, stored_weight

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
except ImportError:  # no such module: nothing to compare the model's loss_function with
    ForCausalLMLoss = None

try:  # the positions of the last hidden state whose logits the model computes, as it selects them
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # before transformers 5.2x: an int (the last k; 0: all) or a 1-d tensor of positions
    def slice_logits_to_keep(hidden_states, logits_to_keep):
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, kept, :]

IGNORE_INDEX = -100


def why_loss_unfusable(model):
    """None when the fused loss computes what the model's own does, else why not: a head that is
    not a plain nn.Linear (PEFT/LoRA, quantized) computes more than its weight, hooks on it
    expect to run, and a loss_function set on the model (or another config.loss_type) is not
    transformers' causal-LM cross-entropy."""
    head = model.lm_head
    if not is_plain_linear(head):
        return f"lm_head is a {class_name(head)}, not a plain torch.nn.Linear"
    if stored_weight(head).dtype == torch.float64:
        return "lm_head is fp64 (codetta's kernels take fp32, fp16 and bf16)"
    if is_hooked(head):
        return "lm_head has hooks or its own forward"
    if ForCausalLMLoss is not None and model.loss_function is not ForCausalLMLoss:
        return f"the model's loss_function is {getattr(model.loss_function, '__name__', model.loss_function)!r}"
    return None


def fused_causal_lm_forward(model, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                            labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """Drop-in for the causal LM's ``forward``; the KV cache (``cache`` or ``past_key_values``, as
    the installed transformers names it) is passed through in ``kwargs``."""
    fused = labels is not None and model.training  # no labels: as transformers, no loss (shift_labels only refines them)
    why = why_loss_unfusable(model) if fused else None
    if why is not None:
        warn_unless_traced(f"codetta: {why}; the loss runs unfused", stacklevel=2)
    if not fused or why is not None:
        return type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids, inputs_embeds=inputs_embeds, labels=labels,
                                   use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    return_dict = kwargs.pop("return_dict", None)
    load_balancing_loss = model._codetta_patched["load_balancing_loss"]  # None where the model adds no router loss
    if load_balancing_loss is not None:
        asked = kwargs.pop("output_router_logits", None)
        kwargs["output_router_logits"] = model.config.output_router_logits if asked is None else asked
    outputs = model.model(return_dict=True, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    ignore_index = kwargs.get("ignore_index", IGNORE_INDEX)  # as the model, which passes kwargs to its loss too
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = model.lm_head
    weight = head.weight  # read once, as the model's head reads it (a parametrization runs at each read)
    hidden, bias = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep), head.bias
    if model._codetta_patched["logits_scaling"]:  # Granite's logits (h W^T + b) / s, as (h / s) W^T + b / s
        scale = model.config.logits_scaling
        hidden, bias = hidden / scale, None if bias is None else bias / scale
    softcap = model.config.final_logit_softcapping if model._codetta_patched["logit_softcap"] else None
    # the rows and the labels flattened, as the model's loss flattens its logits and labels (a batch
    # of one may come with 1-d labels)
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, shift_labels.reshape(-1).to(weight.device),
                                bias=bias, ignore_index=ignore_index, reduction="mean" if num_items is None else "sum",
                                softcap=softcap)
    if num_items is not None:
        loss = loss / num_items
    # the base model's outputs but its last hidden state (the cache's field is named as the installed transformers names it)
    fields = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    if load_balancing_loss is not None and kwargs["output_router_logits"]:
        fields["aux_loss"] = load_balancing_loss(outputs.router_logits, model.num_experts, model.num_experts_per_tok,
                                                 attention_mask)
        loss = loss + model.router_aux_loss_coef * fields["aux_loss"].to(loss.device)
    output = MoeCausalLMOutputWithPast if model._codetta_patched["moe"] else CausalLMOutputWithPast
    result = output(loss=loss, logits=None, **fields)
    if return_dict is False:  # to_tuple() drops None fields: keep the logits' place, as callers unpack by position
        return tuple(getattr(result, f.name) for f in dataclasses.fields(result)
                     if f.name == "logits" or getattr(result, f.name) is not None)
    return result

"""The causal-LM forward with the LM head and the loss fused (no [tokens, vocab] logits).

Same loss as transformers' ``ForCausalLMLoss``: labels shifted left by one (or the
``shift_labels`` given), ``ignore_index`` -100, mean over the counted tokens, or the sum
divided by ``num_items_in_batch`` when the trainer passes it. With labels, the output's
``logits`` is None: not materializing them is the point. Without labels the model's own
forward runs.
"""

from __future__ import annotations

import warnings

import torch.nn.functional as F
from transformers.modeling_outputs import CausalLMOutputWithPast

from ...ops import linear_cross_entropy
from .architectures import is_hooked, is_plain_linear

IGNORE_INDEX = -100


def fused_causal_lm_forward(model, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                            inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    # a head that is not a plain nn.Linear (PEFT/LoRA, quantized) computes more than its weight, and hooks on it
    # expect to run: the model's own loss
    head = model.lm_head
    why = (f"is a {type(head).__name__}, not a plain nn.Linear" if not is_plain_linear(head)
           else "has hooks or its own forward" if is_hooked(head) else None)
    unfusable = why is not None
    if unfusable:
        warnings.warn(f"codetta: lm_head {why}; the loss runs unfused", stacklevel=2)
    if labels is None or unfusable:  # no labels: as transformers, no loss (shift_labels only refines labels)
        return type(model).forward(model, input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids, past_key_values=past_key_values,
                                   inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                   logits_to_keep=logits_to_keep, **kwargs)
    shift_labels = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    return_dict = kwargs.pop("return_dict", None)
    outputs = model.model(return_dict=True, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss = linear_cross_entropy(outputs.last_hidden_state, head.weight, shift_labels.to(head.weight.device),
                                bias=head.bias, ignore_index=IGNORE_INDEX,
                                reduction="mean" if num_items is None else "sum")
    if num_items is not None:
        loss = loss / num_items
    result = CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                    hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    if return_dict is False:  # to_tuple() drops None fields: keep the logits' place, as callers unpack by position
        return (loss, None, *result.to_tuple()[1:])
    return result

"""The bf16 error of an unpatched model, as the worse of two equally valid roundings of its RMSNorms.

transformers' Llama-style RMSNorm rounds the normalized input to bf16 and then multiplies by
its weight (two roundings); Helium's and Gemma's multiply in fp32 and round once. Some
gradients are sums that cancel (q/k projections and biases: a softmax row's gradients sum to
zero), whose error is the rounding noise of the attention's backward, reshuffled by any
change of rounding upstream. Measured on the CPU (2-layer Qwen2, 10 seeds): the unpatched
model with the one-rounding norm had q/k bias gradient errors 0.87-2.12x (median 1.33x) its
own; codetta's were 0.74-2.06x (median 1.13x); on tiny Llamas with random norm weights,
layer 1's q/k weight gradients were 5-20% off in both, patched/unpatched 0.5-1.3x. So a
patched model is held to 2x the worse of the two, not to one draw of that noise.
"""

import torch

from codetta.integrations.hf.architectures import model_classes


def one_rounding_rms_norm(self, hidden_states):
    """A Llama-style RMSNorm as Helium's computes it: the weight multiplied in fp32, then one rounding."""
    dtype, h = hidden_states.dtype, hidden_states.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight.float() * h).to(dtype)


def worse_of_two_roundings(errors, model):
    """{name: error}: the larger of ``errors(model)`` and the same with the model's RMSNorms rounding
    once (where they round twice: a norm with ``variance_epsilon``; Gemma's rounds once already)."""
    errs = errors(model)
    rms_norm = model_classes(model).rms_norm
    if not any(isinstance(m, rms_norm) and hasattr(m, "variance_epsilon") for m in model.modules()):
        return errs
    own = rms_norm.forward
    rms_norm.forward = one_rounding_rms_norm
    try:
        errs_alt = errors(model)
    finally:
        rms_norm.forward = own
    return {n: max(e, errs_alt[n]) for n, e in errs.items()}

"""``codetta.nn``: a Llama-family decoder whose every RMSNorm is folded into GEMM epilogues.

A block runs from one layer's O-projection to the next layer's QKV projection, so that the
GEMM that makes a residual stream also makes the statistics of the norm that reads it
(:mod:`codetta.ops.rmsnorm`). With x the residual stream [..., d], per layer l:

    q, k, v = RoPE(RMSNorm_l(x) W_qkv^T)          rmsnorm_qkv_rope, reading (u, rstd) of x
    a       = SDPA(q, k, v), causal               torch.nn.functional.scaled_dot_product_attention
    x1, s1  = a W_o^T + x, stats of x1            linear_residual: producer of RMSNorm'_l
    x, s    = x1 + SwiGLU(RMSNorm'_l(x1) W_gu^T)  swiglu_mlp, reading s1; producer of RMSNorm_{l+1}
              W_d^T, stats of x                   (x1's two gradients summed in an epilogue)

Only the first layer's norm computes its statistics by itself (one memory-bound pass over
the embeddings); the last down projection makes none, and the loss folds the final norm
into the LM head (:func:`codetta.ops.linear_cross_entropy` with ``norm_weight``). The
statistics carry no gradient of their own: every norm's gradient flows through its x and
weight (see :mod:`codetta.ops.rmsnorm`).

Parameters are plain ``nn.Parameter`` tensors laid out as ``nn.Linear`` and Hugging Face
store them ([out, in] weights): a Llama state dict's tensors map one to one onto these, under
other names (``embed``, ``layers.i.q_proj``, ``layers.i.input_norm``, ``final_norm``, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ops import linear_cross_entropy, linear_residual, rmsnorm_qkv_rope, swiglu_mlp
from .ops.rmsnorm import NormStats, hooks_between, weight_readable_ahead

__all__ = ["Decoder", "DecoderConfig", "DecoderLayer"]


@dataclass(frozen=True)
class DecoderConfig:
    """The shape of a Llama-family decoder (defaults: a tiny one)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim < 2 or self.head_dim & (self.head_dim - 1):
            raise ValueError(f"head_dim {self.head_dim} must be a power of two, 2 or more (RoPE runs in the QKV epilogue)")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"DecoderConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        for name, least in (("rms_norm_eps", "positive"), ("rope_theta", "positive"), ("init_std", "non-negative")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and least == "positive"):
                raise ValueError(f"DecoderConfig.{name} must be a {least} finite number, got {value!r}")


def _linear_weight(out_features: int, in_features: int, std: float) -> nn.Parameter:
    return nn.Parameter(torch.randn(out_features, in_features) * std)


def _still_fit(stats, x: Tensor, norm_weight: Tensor, eps: float) -> bool:
    """Whether a layer may take the statistics the previous one made of its output x: not where x
    was replaced or changed in place since (:meth:`NormStats.mismatch`), nor under inference_mode,
    whose tensors have no version counter to tell (a plain pair then); taken as they are while
    torch.compile traces (none are made where hooks run between the layers: :meth:`Decoder.hidden_states`)."""
    if isinstance(stats, NormStats):
        return stats.mismatch(x, norm_weight, eps) is None
    return torch.compiler.is_compiling()


class DecoderLayer(nn.Module):
    """One layer's parameters, and its fused forward from QKV to the down projection."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        d, hd, std = cfg.hidden_size, cfg.head_dim, cfg.init_std
        self.cfg = cfg
        self.input_norm = nn.Parameter(torch.ones(d))
        self.q_proj = _linear_weight(cfg.num_heads * hd, d, std)
        self.k_proj = _linear_weight(cfg.num_kv_heads * hd, d, std)
        self.v_proj = _linear_weight(cfg.num_kv_heads * hd, d, std)
        self.o_proj = _linear_weight(d, cfg.num_heads * hd, std)
        self.post_attention_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = _linear_weight(cfg.intermediate_size, d, std)
        self.up_proj = _linear_weight(cfg.intermediate_size, d, std)
        self.down_proj = _linear_weight(d, cfg.intermediate_size, std)

    def forward(self, x: Tensor, stats, positions: Tensor, inv_freq: Tensor, next_norm: Tensor | None):
        """(x_out, stats of x_out for ``next_norm``, or None) from x [B, S, d] and (u, rstd) of x."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        if stats is not None and not _still_fit(stats, x, self.input_norm, eps):
            stats = None  # the QKV operator makes its norm's statistics itself
        b, s, _ = x.shape
        q, k, v = rmsnorm_qkv_rope(x, self.input_norm, self.q_proj, self.k_proj, self.v_proj, positions, inv_freq,
                                   head_dim=cfg.head_dim, eps=eps, stats=stats)
        q, k, v = (t.reshape(b, s, heads, cfg.head_dim).transpose(1, 2)  # not -1: b or s may be 0
                   for t, heads in zip((q, k, v), (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        a = a.transpose(1, 2).reshape(b, s, cfg.num_heads * cfg.head_dim)
        x1, stats1 = linear_residual(a, self.o_proj, x, self.post_attention_norm, eps)
        mlp = (x1, self.post_attention_norm, self.gate_proj, self.up_proj, self.down_proj, eps)
        if next_norm is None:
            return swiglu_mlp(*mlp, stats=stats1), None
        return swiglu_mlp(*mlp, stats=stats1, next_norm_weight=next_norm, next_eps=eps)


class Decoder(nn.Module):
    """A causal LM: embeddings, ``num_layers`` :class:`DecoderLayer`, final RMSNorm, LM head."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size) * cfg.init_std)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_embeddings else _linear_weight(cfg.vocab_size, cfg.hidden_size, cfg.init_std)

    @property
    def output_weight(self) -> Tensor:
        """The LM head's weight [V, d]: the embedding's where they are tied."""
        return self.embed if self.lm_head is None else self.lm_head

    def rope_frequencies(self, device) -> Tensor:
        """RoPE's inverse frequencies theta^(-2j / head_dim), fp32 [head_dim / 2], made from the
        config at each call: not a buffer, which a model built on the meta device and loaded
        from a state_dict would lack, and a cast to bf16 would round."""
        cfg = self.cfg
        exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device=device) / cfg.head_dim
        return (1.0 / cfg.rope_theta**exponents).float()

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """The residual stream after the last layer (before the final norm), [B, S, d]."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a tensor [B, S], got "
                             f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__}")
        x = F.embedding(input_ids, self.embed)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        inv_freq = self.rope_frequencies(input_ids.device)  # one tensor for all layers: they share RoPE's tables
        stats = None  # the first layer's QKV operator makes its norm's statistics itself (inside the custom op)
        for i, layer in enumerate(self.layers):
            next_layer = self.layers[i + 1] if i + 1 < len(self.layers) else None
            # none, under FSDP2, or with hooks in between: that layer then makes its norm's statistics itself
            handed_on = next_layer is not None and weight_readable_ahead(next_layer, next_layer.input_norm) \
                and not hooks_between(layer, next_layer)
            x, stats = layer(x, stats, positions, inv_freq, next_layer.input_norm if handed_on else None)
        return x

    def forward(self, input_ids: Tensor, targets: Tensor | None = None, *, ignore_index: int = -100,
                reduction: str = "mean"):
        """The cross-entropy against ``targets`` (aligned with input_ids: shift them yourself),
        reduced as :func:`codetta.ops.linear_cross_entropy` does ("mean", "sum", or "none": one
        loss per token, [B, S]), or the logits [B, S, V] when no targets are given."""
        x = self.hidden_states(input_ids)
        if targets is None:
            h = F.rms_norm(x, (x.shape[-1],), self.final_norm, self.cfg.rms_norm_eps)
            return F.linear(h, self.output_weight)
        return linear_cross_entropy(x, self.output_weight, targets, ignore_index=ignore_index, reduction=reduction,
                                    norm_weight=self.final_norm, eps=self.cfg.rms_norm_eps)

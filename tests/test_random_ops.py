"""Every operator of codetta.ops on random shapes and options (hypothesis), forward and
backward, in fp32 against the same math written here unfused in fp64.

The sizes are drawn with no regard for tiles (1 to a few tile widths, odd values), the
leading dims with one or two axes, the options each operator takes drawn together (GQA
ratios 1-8, head_dim 2-128 with partial rotary (apply_rope: any head_dim up to 160 and any even
rotary dims up to it), interleaved pairs, QK-norm, biases, long
positions; reductions, ignored rows, label smoothing, z-loss, soft cap, chunking; gate
activations, branch scales, the next norm's statistics). The loss is a fixed random
weighting of every differentiable output, so that each gradient is exercised.

Tolerance: max |codetta - fp64| <= 1e-4 max |fp64| per output and per gradient (fp32
precision after short reductions). The norms' hidden size is at least 4: with one or two
columns the gradient of x through an RMSNorm is a cancellation of equal terms (exactly 0
for one column, but for epsilon), and its relative error is that of nothing.

``CODETTA_OPS_EXAMPLES`` sets the examples per operator (default 3, about 1 s each in the
interpreter). With 120 each all passed on the CPU, with 30 each on the H200 (compiled
kernels, TMA and pointer paths as the shapes fall).
"""

import math
import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codetta import ops
from conftest import DEVICE

_SETTINGS = settings(max_examples=int(os.environ.get("CODETTA_OPS_EXAMPLES", "3")), deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TOL = 1e-4
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"), "relu": F.relu}


def rms_norm64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def leading_shape(data):
    return data.draw(st.sampled_from([1, 2]).flatmap(
        lambda n: st.tuples(st.integers(1, 40)) if n == 1 else st.tuples(st.integers(1, 3), st.integers(1, 17))))


def param(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE, dtype=torch.float64) * scale).float().requires_grad_()


def outputs_and_grads(fn, inputs):
    """fn's outputs and the gradients of the inputs for a fixed random weighting of the outputs
    that require grad (fp64 inputs for the reference: a copy of each, same values)."""
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    gen = torch.Generator().manual_seed(1)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
               for o in outs if o.requires_grad)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in inputs]


def check(fused, reference, inputs):
    """The operator and its fp64 reference, on the same values, output by output and gradient by gradient."""
    got, got_grads = outputs_and_grads(fused, inputs)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    want, want_grads = outputs_and_grads(reference, wide)
    assert len(got) == len(want)
    named = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(got, want))]
    named += [(f"grad of input {i}", a, b) for i, (a, b) in enumerate(zip(got_grads, want_grads))]
    for name, a, b in named:
        assert (a is None) == (b is None), name
        if b is None:
            continue
        assert a.shape == b.shape, (name, a.shape, b.shape)
        scale = b.abs().nan_to_num().max().item() if b.numel() else 0.0
        torch.testing.assert_close(a.double(), b, rtol=0, atol=TOL * scale + 1e-30, equal_nan=True, msg=name)


@_SETTINGS
@given(data=st.data())
def test_rmsnorm_qkv_rope(data):
    head_dim = data.draw(st.sampled_from([2, 4, 8, 16, 32, 64, 128]), "head_dim")
    rotary_dim = data.draw(st.sampled_from([r for r in (2, 4, 8, 16, 32, 64, 128) if head_dim % r == 0]), "rotary_dim")
    n_kv = data.draw(st.integers(1, 3), "n_kv")
    n_q = n_kv * data.draw(st.sampled_from([1, 2, 4, 8]), "group")
    d = data.draw(st.integers(4, 80), "d")
    lead = leading_shape(data)
    interleaved, qk_norm, with_bias = (data.draw(st.booleans(), name) for name in ("interleaved", "qk_norm", "bias"))
    eps = data.draw(st.sampled_from([1e-6, 1e-5, 0.1]), "eps")
    scaling = data.draw(st.sampled_from([1.0, 0.7]), "attention_scaling")
    positions = torch.randint(0, 1 << data.draw(st.sampled_from([4, 12, 20]), "log2 positions"), lead, device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=DEVICE, dtype=torch.float64) / rotary_dim))
    inv_freq = inv_freq.float()
    widths = (n_q * head_dim, n_kv * head_dim, n_kv * head_dim)
    inputs = [param(*lead, d), param(d), *(param(n, d, scale=d**-0.5) for n in widths)]
    inputs += [param(n) for n in widths] if with_bias else []
    inputs += [param(head_dim), param(head_dim)] if qk_norm else []

    def split(args):
        x, g, wq, wk, wv, *rest = args
        bias, rest = (tuple(rest[:3]), rest[3:]) if with_bias else (None, rest)
        return x, g, wq, wk, wv, bias, (rest if qk_norm else (None, None))

    def fused(*args):
        x, g, wq, wk, wv, bias, (qn, kn) = split(args)
        return ops.rmsnorm_qkv_rope(x, g, wq, wk, wv, positions, inv_freq, head_dim=head_dim, rotary_dim=rotary_dim,
                                    attention_scaling=scaling, interleaved=interleaved, bias=bias, eps=eps,
                                    q_norm_weight=qn, k_norm_weight=kn, qk_norm_eps=eps)

    def reference(*args):
        x, g, wq, wk, wv, bias, (qn, kn) = split(args)
        h = rms_norm64(x, g, eps)
        q, k, v = (F.linear(h, w, b) for w, b in zip((wq, wk, wv), bias or (None,) * 3))
        if qk_norm:
            q, k = (rms_norm64(t.unflatten(-1, (-1, head_dim)), w, eps).flatten(-2) for t, w in ((q, qn), (k, kn)))
        return (*(rope64(t, positions, inv_freq, scaling, head_dim, rotary_dim, interleaved) for t in (q, k)), v)

    check(fused, reference, inputs)


def rope64(t, positions, inv_freq, scaling, head_dim, rotary_dim, interleaved):
    """RoPE on t [..., heads * head_dim] in fp64: each head's first rotary_dim columns rotated
    (rotate_half's halves, or adjacent pairs), the others as they are."""
    angles = positions.double().unsqueeze(-1) * inv_freq.double()
    cos, sin = ((f(angles) * scaling).unsqueeze(-2) for f in (torch.cos, torch.sin))
    heads = t.unflatten(-1, (-1, head_dim))
    rot, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, -1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    return torch.cat([rotated, rest], -1).flatten(-2)


@_SETTINGS
@given(data=st.data())
def test_apply_rope(data):
    """Any head_dim (no power of two needed, odd too) and any even rotary dims up to it; q and k
    as column slices of wider tensors (row strides of their own)."""
    head_dim = data.draw(st.integers(2, 160), "head_dim")
    rotary_dim = 2 * data.draw(st.integers(1, head_dim // 2), "rotary_dim / 2")
    n_kv = data.draw(st.integers(1, 3), "n_kv")
    n_q = n_kv * data.draw(st.sampled_from([1, 2, 4, 8]), "group")
    lead = leading_shape(data)
    interleaved = data.draw(st.booleans(), "interleaved")
    scaling = data.draw(st.sampled_from([1.0, 0.7]), "attention_scaling")
    positions = torch.randint(0, 1 << data.draw(st.sampled_from([4, 12, 20]), "log2 positions"), lead, device=DEVICE)
    exponents = torch.arange(0, rotary_dim, 2, device=DEVICE, dtype=torch.float64) / rotary_dim
    inv_freq = (1.0 / 10000**exponents).float()
    pad = data.draw(st.integers(0, 3), "columns around q and k")
    q_wide, k_wide = param(*lead, n_q * head_dim + pad), param(*lead, n_kv * head_dim + pad)

    def fused(q_wide, k_wide):
        return ops.apply_rope(q_wide[..., pad:], k_wide[..., :n_kv * head_dim], positions, inv_freq, head_dim=head_dim,
                              rotary_dim=rotary_dim, attention_scaling=scaling, interleaved=interleaved)

    def reference(q_wide, k_wide):
        return tuple(rope64(t, positions, inv_freq, scaling, head_dim, rotary_dim, interleaved)
                     for t in (q_wide[..., pad:], k_wide[..., :n_kv * head_dim]))

    check(fused, reference, [q_wide, k_wide])


@_SETTINGS
@given(data=st.data())
def test_linear_cross_entropy(data):
    vocab, d, lead = data.draw(st.integers(1, 300), "vocab"), data.draw(st.integers(4, 70), "d"), leading_shape(data)
    reduction = data.draw(st.sampled_from(["mean", "sum", "none"]), "reduction")
    ignore_index = data.draw(st.sampled_from([-100, 0, 3]), "ignore_index")
    label_smoothing = data.draw(st.sampled_from([0.0, 0.1]), "label_smoothing")
    z_loss = data.draw(st.sampled_from([0.0, 1e-3]), "z_loss")
    softcap = data.draw(st.sampled_from([None, 5.0]), "softcap")
    with_norm, with_bias = data.draw(st.booleans(), "norm"), data.draw(st.booleans(), "bias")
    chunk_size = data.draw(st.one_of(st.none(), st.integers(1, 20)), "chunk_size")
    target = torch.randint(0, vocab, lead, device=DEVICE)
    target[torch.rand(lead, device=DEVICE) < data.draw(st.sampled_from([0.0, 0.3, 1.0]), "ignored")] = ignore_index
    inputs = [param(*lead, d), param(vocab, d, scale=d**-0.5)]
    inputs += [param(vocab)] if with_bias else []
    inputs += [param(d)] if with_norm else []

    def split(args):
        x, w, *rest = args
        return x, w, rest.pop(0) if with_bias else None, rest.pop(0) if with_norm else None

    def fused(*args):
        x, w, b, g = split(args)
        return ops.linear_cross_entropy(x, w, target, bias=b, ignore_index=ignore_index, reduction=reduction,
                                        norm_weight=g, chunk_size=chunk_size, label_smoothing=label_smoothing,
                                        z_loss=z_loss, softcap=softcap)

    def reference(*args):
        x, w, b, g = split(args)
        z = F.linear(x if g is None else rms_norm64(x, g, 1e-6), w, b).flatten(0, -2)
        if softcap:
            z = torch.tanh(z / softcap) * softcap
        flat = target.flatten()
        valid = flat != ignore_index
        losses = F.cross_entropy(z, flat, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
        losses = losses + z_loss * torch.logsumexp(z, -1).pow(2) * valid
        if reduction == "none":
            return losses.reshape(lead)
        if reduction == "sum":
            return losses.sum()
        # PyTorch's mean over no valid row: a NaN loss, and gradients of 0 (nll_loss skips ignored rows)
        return losses.sum() / valid.sum().clamp_min(1) + (0.0 if valid.any() else math.nan)

    check(fused, reference, inputs)


def _mlp_inputs(data, with_down):
    d, f, lead = data.draw(st.integers(4, 70), "d"), data.draw(st.integers(1, 150), "F"), leading_shape(data)
    activation = data.draw(st.sampled_from(sorted(ACTIVATIONS)), "activation")
    with_bias = data.draw(st.booleans(), "bias")
    inputs = [param(*lead, d), param(d), param(f, d, scale=d**-0.5), param(f, d, scale=d**-0.5)]
    inputs += [param(d, f, scale=f**-0.5)] if with_down else []
    inputs += [param(n) for n in ((f, f, d) if with_down else (f, f))] if with_bias else []
    return d, activation, with_bias, inputs


@_SETTINGS
@given(data=st.data())
def test_rmsnorm_swiglu(data):
    d, activation, with_bias, inputs = _mlp_inputs(data, with_down=False)

    def fused(x, g, wg, wu, *bias):
        return ops.rmsnorm_swiglu(x, g, wg, wu, 1e-6, bias=bias or None, activation=activation)

    def reference(x, g, wg, wu, *bias):
        h = rms_norm64(x, g, 1e-6)
        bg, bu = bias or (None, None)
        return ACTIVATIONS[activation](F.linear(h, wg, bg)) * F.linear(h, wu, bu)

    check(fused, reference, inputs)


@_SETTINGS
@given(data=st.data())
def test_swiglu_mlp(data):
    d, activation, with_bias, inputs = _mlp_inputs(data, with_down=True)
    branch_scale = data.draw(st.sampled_from([1.0, 0.5]), "branch_scale")
    next_norm = torch.randn(d, device=DEVICE) if data.draw(st.booleans(), "next norm") else None

    def fused(x, g, wg, wu, wd, *bias):
        out = ops.swiglu_mlp(x, g, wg, wu, wd, 1e-6, bias=bias or None, branch_scale=branch_scale,
                             activation=activation, next_norm_weight=next_norm)
        return out if next_norm is None else (out[0], *out[1])

    def reference(x, g, wg, wu, wd, *bias):
        h = rms_norm64(x, g, 1e-6)
        bg, bu, bd = bias or (None,) * 3
        x2 = x + branch_scale * F.linear(ACTIVATIONS[activation](F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)
        return x2 if next_norm is None else (x2, *_next_norm_stats(x2, next_norm))

    check(fused, reference, inputs)


def _next_norm_stats(x, norm_weight):
    """(u, rstd) of the norm after x, as the producers return them: [M, d] and [M], no gradient."""
    rows = x.detach().flatten(0, -2)
    return rows * norm_weight.double(), torch.rsqrt(rows.pow(2).mean(-1) + 1e-6)


@_SETTINGS
@given(data=st.data())
def test_linear_residual(data):
    k, d, lead = data.draw(st.integers(1, 90), "K"), data.draw(st.integers(1, 90), "d"), leading_shape(data)
    with_bias = data.draw(st.booleans(), "bias")
    branch_scale = data.draw(st.sampled_from([1.0, 0.25]), "branch_scale")
    norm = torch.randn(d, device=DEVICE) if data.draw(st.booleans(), "next norm") else None
    inputs = [param(*lead, k), param(d, k, scale=k**-0.5), param(*lead, d)] + ([param(d)] if with_bias else [])

    def fused(a, w, residual, *bias):
        out = ops.linear_residual(a, w, residual, norm, bias=bias[0] if bias else None, branch_scale=branch_scale)
        return out if norm is None else (out[0], *out[1])

    def reference(a, w, residual, *bias):
        x = branch_scale * F.linear(a, w, bias[0] if bias else None) + residual
        return x if norm is None else (x, *_next_norm_stats(x, norm))

    check(fused, reference, inputs)


@_SETTINGS
@given(data=st.data())
def test_rmsnorm_linear(data):
    k, lead = data.draw(st.integers(4, 90), "K"), leading_shape(data)
    widths = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=5), "weight parts")
    inputs = [param(*lead, k), param(k)] + [param(n, k, scale=k**-0.5) for n in widths]

    def fused(x, g, *weights):
        return ops.rmsnorm_linear(x, g, list(weights) if len(weights) > 1 else weights[0])

    def reference(x, g, *weights):
        return F.linear(rms_norm64(x, g, 1e-6), torch.cat(weights))

    check(fused, reference, inputs)


def test_tolerance_catches_a_wrong_gradient():
    """The check fails for an operator whose backward is off by one part in 10^3."""
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * (1 + 1e-3)

    x = param(5, 3)
    try:
        check(Scaled.apply, lambda t: t * 1.0, [x])
    except AssertionError:
        return
    raise AssertionError("a gradient off by 1e-3 passed")

"""RMSNorm -> QKV -> RoPE fused (codetta.ops.rmsnorm_qkv_rope): outputs and every gradient.

The reference is written here the Hugging Face way (rotate_half, cos/sin of head_dim
entries, v untouched, partial rotary on the first rotary_dim columns; Qwen3's QK-norm as
F.rms_norm per head of q and k before RoPE; the interleaved convention as Helium's and Ernie
4.5's apply_rotary_pos_emb, the first halves of cos/sin repeated pairwise), in fp64, with fp64
angles: codetta's epilogue must match it even at positions near 2^20.
"""

import pytest
import torch
import torch.nn.functional as F

from codetta.ops import apply_rope, rmsnorm_qkv_rope
from codetta.ops.rope import rope_tables
from conftest import DEVICE, INTERPRET

EPS = 1e-6
QK_EPS = 1e-5


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_half_interleaved(x):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def hf_style(x, g, wq, wk, wv, pos, inv_freq, head_dim, rotary_dim, scale, bias, qk_norm=None, cos_sin=None,
             interleaved=False):
    """With ``cos_sin`` ([..., R] each), RoPE by those instead of positions, inv_freq and scale."""
    h = F.rms_norm(x, (x.shape[-1],), g, EPS)
    bq, bk, bv = bias if bias is not None else (None, None, None)
    q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
    if qk_norm is not None:  # Qwen3: q_norm(q.view(..., heads, head_dim)), k_norm likewise
        q, k = (F.rms_norm(t.reshape(*t.shape[:-1], -1, head_dim), (head_dim,), w, QK_EPS).reshape(t.shape)
                for t, w in zip((q, k), qk_norm))
    if cos_sin is None:
        freqs = pos.double()[..., None] * inv_freq.double()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos_sin = emb.cos() * scale, emb.sin() * scale
    cos, sin = (t.to(x.dtype)[..., None, :] for t in cos_sin)
    if interleaved:
        cos, sin = (t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
    rotate = rotate_half_interleaved if interleaved else rotate_half

    def apply(t):
        heads = t.reshape(*t.shape[:-1], -1, head_dim)
        rot, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
        return torch.cat((rot * cos + rotate(rot) * sin, rest), dim=-1).reshape(t.shape)

    return apply(q), apply(k), v


def make(m, d, head_dim, hq, hkv, rotary_dim, bias, max_pos):
    tensors = [torch.randn(m, d, device=DEVICE), 1 + 0.2 * torch.randn(d, device=DEVICE)]
    tensors += [torch.randn(h * head_dim, d, device=DEVICE) / d**0.5 for h in (hq, hkv, hkv)]
    biases = [0.1 * torch.randn(h * head_dim, device=DEVICE) for h in (hq, hkv, hkv)] if bias else []
    pos = torch.randint(0, max_pos, (m,), device=DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rotary_dim, 2, device=DEVICE).float() / rotary_dim))
    return tensors, biases, pos, inv_freq


def make_qk_norm(head_dim):
    return [1 + 0.3 * torch.randn(head_dim, device=DEVICE) for _ in range(2)]


def run(fn, tensors, biases, grads, dtype, qk_norm=()):
    leaves = [t.to(dtype).detach().requires_grad_() for t in tensors + biases + list(qk_norm)]
    if qk_norm:
        *leaves, qn, kn = leaves
        outs = fn(leaves[:5], leaves[5:] or None, (qn, kn))
        leaves += [qn, kn]
    else:
        outs = fn(leaves[:5], leaves[5:] or None)
    sum((o * g.to(dtype)).sum() for o, g in zip(outs, grads)).backward()
    return list(outs) + [t.grad for t in leaves]


CASES = [  # (head_dim, hq, hkv, rotary_dim, bias, scale)
    (16, 2, 2, 16, False, 1.0),  # MHA (GQA ratio 1)
    (16, 4, 1, 16, True, 1.0),  # GQA 4 with q/k/v bias (Qwen2)
    (16, 8, 1, 8, False, 1.3),  # GQA 8, partial rotary, scaled (rope scaling types)
    (64, 2, 1, 64, False, 1.0),
    (256, 2, 1, 256, False, 1.0),  # Gemma 2's and 3's head_dim: a rotary segment as wide as the widest tile
]
if not INTERPRET:
    CASES += [(128, 32, 8, 128, False, 1.0), (64, 16, 4, 32, True, 1.0)]


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_backward_fp32_long_positions(case, interleaved):
    head_dim, hq, hkv, rotary_dim, bias, scale = case
    m, d = (13, 32) if INTERPRET else (300, 512)
    tensors, biases, pos, inv_freq = make(m, d, head_dim, hq, hkv, rotary_dim, bias, max_pos=2**20)
    grads = [torch.randn(m, h * head_dim, device=DEVICE) for h in (hq, hkv, hkv)]

    def ours(ts, bs):
        return rmsnorm_qkv_rope(*ts, pos, inv_freq, head_dim=head_dim, rotary_dim=rotary_dim,
                                attention_scaling=scale, bias=bs, eps=EPS, interleaved=interleaved)

    def ref(ts, bs):
        return hf_style(*ts, pos, inv_freq, head_dim, rotary_dim, scale, bs, interleaved=interleaved)

    got = run(ours, tensors, biases, grads, torch.float32)
    want = run(ref, tensors, biases, grads, torch.float64)
    names = ["q", "k", "v", "dx", "dnorm_weight", "dw_q", "dw_k", "dw_v", "db_q", "db_k", "db_v"]
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        assert rel(a, b) < 3e-5, name


@pytest.mark.parametrize("given", ["q,k", "k,v", "v", "q,k,v"])
def test_gradients_of_some_of_q_k_v_with_strides_of_their_own(given):
    """q, k and v carry their gradients apart (the backward reads them where they lie, with no
    concatenation): any subset of them, each with a row stride of its own or a column stride
    other than 1, gives the reference's gradients."""
    head_dim, hq, hkv, rotary_dim = 16, 4, 2, 8
    m, d = (13, 32) if INTERPRET else (300, 512)
    (x, g, wq, wk, wv), _, pos, inv_freq = make(m, d, head_dim, hq, hkv, rotary_dim, False, max_pos=2**10)
    widths = {"q": hq * head_dim, "k": hkv * head_dim, "v": hkv * head_dim}
    grads = {"q": torch.randn(m, widths["q"] + 5, device=DEVICE)[:, 3:3 + widths["q"]],  # row stride of its own
             "k": torch.randn(m, 2 * widths["k"], device=DEVICE)[:, ::2],  # column stride 2
             "v": torch.randn(widths["v"], m, device=DEVICE).t()}  # transposed
    names = given.split(",")

    def gradients(fn, dtype):
        leaves = [t.to(dtype).detach().requires_grad_() for t in (x, g, wq, wk, wv)]
        outs = dict(zip("qkv", fn(*leaves)))
        torch.autograd.backward([outs[n] for n in names], [grads[n].to(dtype) for n in names])
        return [t.grad for t in leaves]

    got = gradients(lambda *ts: rmsnorm_qkv_rope(*ts, pos, inv_freq, head_dim=head_dim, rotary_dim=rotary_dim,
                                                 eps=EPS), torch.float32)
    want = gradients(lambda *ts: hf_style(*ts, pos, inv_freq, head_dim, rotary_dim, 1.0, None), torch.float64)
    for name, a, b in zip(["dx", "dnorm_weight", "dw_q", "dw_k", "dw_v"], got, want):
        if b is None or not b.any():  # a weight whose output got no gradient
            assert a is None or not a.any(), name
            continue
        assert rel(a, b) < 3e-5, name


QK_CASES = [  # (head_dim, hq, hkv, rotary_dim, bias, scale, interleaved)
    (16, 2, 2, 16, False, 1.0, False),  # MHA (GQA ratio 1)
    (16, 4, 1, 8, True, 1.3, False),  # GQA 4, partial rotary, q/k/v bias, scaled
    (16, 4, 2, 8, False, 1.0, True),  # interleaved RoPE, partial
]


@pytest.mark.parametrize("case", QK_CASES, ids=str)
def test_qk_norm_forward_backward_fp32(case):
    """Qwen3's QK-norm fused before RoPE: outputs and every gradient, q/k norm weights included."""
    head_dim, hq, hkv, rotary_dim, bias, scale, interleaved = case
    m, d = (13, 32) if INTERPRET else (300, 512)  # odd M: masked rows
    tensors, biases, pos, inv_freq = make(m, d, head_dim, hq, hkv, rotary_dim, bias, max_pos=2**16)
    qk_norm = make_qk_norm(head_dim)
    grads = [torch.randn(m, h * head_dim, device=DEVICE) for h in (hq, hkv, hkv)]

    def ours(ts, bs, qk):
        return rmsnorm_qkv_rope(*ts, pos, inv_freq, head_dim=head_dim, rotary_dim=rotary_dim, attention_scaling=scale,
                                bias=bs, eps=EPS, q_norm_weight=qk[0], k_norm_weight=qk[1], qk_norm_eps=QK_EPS,
                                interleaved=interleaved)

    def ref(ts, bs, qk):
        return hf_style(*ts, pos, inv_freq, head_dim, rotary_dim, scale, bs, qk_norm=qk, interleaved=interleaved)

    got = run(ours, tensors, biases, grads, torch.float32, qk_norm)
    want = run(ref, tensors, biases, grads, torch.float64, qk_norm)
    names = ["q", "k", "v", "dx", "dnorm_weight", "dw_q", "dw_k", "dw_v"]
    names += ["db_q", "db_k", "db_v"] * bias + ["dq_norm_weight", "dk_norm_weight"]
    assert len(got) == len(want) == len(names)
    for name, a, b in zip(names, got, want):
        assert a is not None and a.shape == b.shape, name
        assert rel(a, b) < 3e-5, (name, rel(a, b))


@pytest.mark.parametrize("case", [(16, 4, 2, 16, True, False), (16, 2, 1, 8, False, False), (16, 4, 2, 16, True, True)],
                         ids=str)
def test_cos_sin_of_a_hf_rotary_embedding(case):
    """cos_sin: a model's own (cos, sin), [1, S, R] for x [B, S, d], fp32 angle products and the
    attention scaling in them as HF makes them: RoPE rotates by exactly those (also partially,
    and in the interleaved convention)."""
    head_dim, hq, hkv, rotary_dim, bias, interleaved = case
    b, s, d = 2, 7, 32
    tensors, biases, _, inv_freq = make(b * s, d, head_dim, hq, hkv, rotary_dim, bias, max_pos=2)
    tensors[0] = tensors[0].reshape(b, s, d)
    freqs = torch.arange(3000, 3000 + s, device=DEVICE)[None, :, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos_sin = emb.cos() * 1.2, emb.sin() * 1.2
    grads = [torch.randn(b, s, h * head_dim, device=DEVICE) for h in (hq, hkv, hkv)]

    def ours(ts, bs):
        return rmsnorm_qkv_rope(*ts, head_dim=head_dim, cos_sin=cos_sin, bias=bs, eps=EPS, interleaved=interleaved)

    def ref(ts, bs):
        return hf_style(*ts, None, None, head_dim, rotary_dim, None, bs, cos_sin=[t.double() for t in cos_sin],
                        interleaved=interleaved)

    got = run(ours, tensors, biases, grads, torch.float32)
    want = run(ref, tensors, biases, grads, torch.float64)
    for i, (a, b_) in enumerate(zip(got, want)):
        assert a.shape == b_.shape and rel(a, b_) < 3e-5, i


def test_cos_sin_refused_when_ambiguous_or_misshapen():
    tensors, _, pos, inv_freq = make(6, 16, 16, 2, 1, 16, False, 64)
    cos = torch.ones(6, 16, device=DEVICE)
    calls = {
        "not both": (dict(cos_sin=(cos, cos)), (pos, inv_freq), "not both"),
        "scaling": (dict(cos_sin=(cos, cos), attention_scaling=2.0), (), "attention_scaling is part of cos_sin"),
        "shape": (dict(cos_sin=(torch.ones(5, 16, device=DEVICE),) * 2), (), "for each token"),
        "pair": (dict(cos_sin=(cos, cos[:, :8])), (), "of one shape"),
        "rotary_dim": (dict(cos_sin=(cos, cos), rotary_dim=8), (), "differs"),
        "neither": ({}, (), "positions and inv_freq, or cos_sin"),
    }
    for what, (kwargs, rope_args, message) in calls.items():
        with pytest.raises(ValueError, match=message):
            rmsnorm_qkv_rope(*tensors, *rope_args, head_dim=16, **kwargs)
            pytest.fail(what)


@pytest.mark.parametrize("trainable", ["inv_freq", "cos", "sin"])
def test_rotary_angles_requiring_grad_are_refused_not_dropped(trainable):
    """The fused RoPE gives no gradient for inv_freq or cos_sin: one that requires grad is refused
    (found by a probe: its .grad stayed None), and taken under no_grad."""
    tensors, _, pos, inv_freq = make(6, 16, 16, 2, 1, 16, False, 64)
    theta = pos[:, None].double() * inv_freq.double()
    cos, sin = (torch.cat((f(theta), f(theta)), -1).float() for f in (torch.cos, torch.sin))
    grad = {name: t.clone().requires_grad_(name == trainable) for name, t in
            dict(inv_freq=inv_freq, cos=cos, sin=sin).items()}
    call = (dict(positions=pos, inv_freq=grad["inv_freq"]) if trainable == "inv_freq"
            else dict(cos_sin=(grad["cos"], grad["sin"])))
    with pytest.raises(ValueError, match="requires grad"):
        rmsnorm_qkv_rope(*tensors, head_dim=16, **call)
    with torch.no_grad():
        q = rmsnorm_qkv_rope(*tensors, head_dim=16, **call)[0]
    assert rel(q, rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16)[0].detach()) < 1e-6


def test_integer_arguments_of_any_integral_type():
    """head_dim and rotary_dim as numpy integers (read from a config array) give what ints give."""
    import numpy as np

    tensors, _, pos, inv_freq = make(6, 16, 16, 2, 1, 16, False, 64)
    q = rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=np.int64(16), rotary_dim=np.int32(16))[0]
    assert torch.equal(q, rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16)[0])


def test_positions_of_a_single_token_in_any_shape():
    """A 1-d x is one token: its position as a 0-d tensor or a flat [1] gives one result; a batch
    of tokens takes flat positions [M] as well as positions shaped like its leading dims."""
    tensors, _, pos, inv_freq = make(6, 16, 16, 2, 1, 16, False, 64)
    x, rest = tensors[0], tensors[1:]
    one = [rmsnorm_qkv_rope(x[3], *rest, p, inv_freq, head_dim=16)[0] for p in (pos[3], pos[3:4])]
    assert torch.equal(one[0], one[1])
    batched = rmsnorm_qkv_rope(x.view(2, 3, -1), *rest, pos, inv_freq, head_dim=16)[0]
    assert torch.equal(batched, rmsnorm_qkv_rope(x.view(2, 3, -1), *rest, pos.view(2, 3), inv_freq, head_dim=16)[0])
    torch.testing.assert_close(one[0], batched.view(6, -1)[3], rtol=1e-5, atol=1e-6)


def test_angles_beat_fp32_tables_at_long_positions():
    """At positions near 2^20, fp32 angle tables (as HF builds them) are off by ~1e-2 rad; codetta is not."""
    m, d, head_dim = 16, 32, 64
    tensors, _, _, inv_freq = make(m, d, head_dim, 1, 1, head_dim, False, max_pos=2)
    pos = torch.arange(2**20 - m, 2**20, device=DEVICE)
    q = rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=head_dim, eps=EPS)[0]
    q64 = hf_style(*[t.double() for t in tensors], pos, inv_freq, head_dim, head_dim, 1.0, None)[0]
    fp32_tables = pos.float()[:, None] * inv_freq[None, :]  # HF: inv_freq @ position_ids in fp32
    assert (fp32_tables.double() - pos.double()[:, None] * inv_freq.double()).abs().max() > 1e-3
    assert rel(q, q64) < 1e-5


def test_rope_tables_reused_only_for_unchanged_inputs():
    """The layers share one pair of tables; positions changed in place, or new ones, get new tables."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, device=DEVICE, dtype=torch.float32) / 16)
    pos = torch.arange(8, device=DEVICE)
    first = rope_tables(pos.expand(2, 8), inv_freq, 1.0)
    assert rope_tables(pos.expand(2, 8), inv_freq, 1.0) is first  # another view of the same memory
    pos.add_(100)  # in place: the version counter moves
    moved = rope_tables(pos.expand(2, 8), inv_freq, 1.0)
    theta = pos.double().repeat(2).reshape(-1, 1) * inv_freq.double()  # [2 * 8, 8], rows of both sequences
    assert moved is not first and torch.equal(moved[0], torch.cos(theta).float())
    assert not torch.equal(rope_tables(pos.expand(2, 8), inv_freq, 0.5)[1], moved[1])  # another scale
    assert torch.equal(rope_tables(pos.clone().expand(2, 8), inv_freq, 1.0)[1], torch.sin(theta).float())


def test_rope_tables_not_kept_past_their_inputs():
    """The cache keeps nothing alive: once the positions (a step's) or inv_freq (a deleted model's)
    are gone, so are the tables and the other input."""
    import weakref

    inv_freq = 1.0 / 10000 ** (torch.arange(0, 16, 2, device=DEVICE, dtype=torch.float32) / 16)
    pos = torch.arange(8, device=DEVICE)
    tables = rope_tables(pos.expand(2, 8), inv_freq, 1.0)
    assert rope_tables(pos.expand(2, 8), inv_freq, 1.0) is tables
    refs = [weakref.ref(t) for t in (*tables, pos)]
    del tables, pos
    assert [r() is None for r in refs] == [True] * 3
    pos = torch.arange(8, device=DEVICE)
    rope_tables(pos.expand(2, 8), inv_freq, 1.0)
    ref = weakref.ref(inv_freq)
    del inv_freq
    assert ref() is None


def test_layers_share_one_pair_of_tables_with_a_bf16_inv_freq(monkeypatch):
    """A model cast to bf16 holds inv_freq in bf16: two layers' forward and backward still make
    the tables once, from the bf16 values as they are (what the model's own rotary uses)."""
    tensors, _, pos, inv_freq = make(24, 32, 8, 2, 1, 8, False, max_pos=4096)
    inv_freq = inv_freq.bfloat16()
    calls = []
    cos = torch.cos
    monkeypatch.setattr(torch, "cos", lambda t: calls.append(t.shape) or cos(t))
    x = tensors[0].requires_grad_()
    outs = [rmsnorm_qkv_rope(x, *tensors[1:], pos, inv_freq, head_dim=8, eps=EPS) for _ in range(2)]
    sum(t.sum() for q_k_v in outs for t in q_k_v).backward()
    assert len(calls) == 1
    q_ref = hf_style(tensors[0].detach(), *tensors[1:], pos, inv_freq, 8, 8, 1.0, None)[0]
    assert rel(outs[0][0], q_ref) < 1e-5


@pytest.mark.parametrize("bias_std", [0, 100], ids=["no_bias", "bias_std_100"])
@pytest.mark.parametrize("qk_norm,interleaved", [(False, False), (True, False), (False, True)],
                         ids=["plain", "qk_norm", "interleaved"])
def test_bf16_within_twice_eager_error(qk_norm, interleaved, bias_std):
    """Also with q/k/v biases far larger than the projections (Qwen2's k biases reach the
    hundreds): stored z + b would make zdz cancel, so the norm's row term comes from dL/dh
    (found by a probe: dx was 5.7x eager's error at a bias std of 100)."""
    head_dim, hq, hkv = (16, 4, 2) if INTERPRET else (128, 8, 2)
    m, d = (48, 64) if INTERPRET else (2048, 1024)
    tensors, _, pos, inv_freq = make(m, d, head_dim, hq, hkv, head_dim, False, max_pos=8192)
    biases = [bias_std * torch.randn(h * head_dim, device=DEVICE) for h in (hq, hkv, hkv)] if bias_std else []
    grads = [torch.randn(m, h * head_dim, device=DEVICE) for h in (hq, hkv, hkv)]
    norms = make_qk_norm(head_dim) if qk_norm else []

    def ours(ts, bs, qk=(None, None)):
        return rmsnorm_qkv_rope(*ts, pos, inv_freq, head_dim=head_dim, bias=bs, eps=EPS, q_norm_weight=qk[0],
                                k_norm_weight=qk[1], qk_norm_eps=QK_EPS, interleaved=interleaved)

    def eager(ts, bs, qk=None):
        return hf_style(*ts, pos, inv_freq, head_dim, head_dim, 1.0, bs, qk_norm=qk, interleaved=interleaved)

    got = run(ours, tensors, biases, grads, torch.bfloat16, norms)
    base = run(eager, tensors, biases, grads, torch.bfloat16, norms)
    want = run(eager, tensors, biases, grads, torch.float64, norms)
    for i, (a, e, r) in enumerate(zip(got, base, want)):
        assert rel(a, r) <= 2 * rel(e, r) + 1e-4, i


def test_bad_inputs():
    tensors, _, pos, inv_freq = make(4, 16, 16, 2, 1, 16, False, 8)
    with pytest.raises(ValueError, match="whole heads"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq[:4], head_dim=24, rotary_dim=8)
    with pytest.raises(ValueError, match="power of two dividing head_dim 16 .*apply_rope after rmsnorm_linear"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq[:3], head_dim=16, rotary_dim=6)
    with pytest.raises(ValueError, match="inv_freq"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq[:3], head_dim=16)
    with pytest.raises(ValueError, match="positions"):
        rmsnorm_qkv_rope(*tensors, pos.float(), inv_freq, head_dim=16)
    with pytest.raises(ValueError, match="rotary_dim must be an integer"):  # was truncated to 8 silently
        rmsnorm_qkv_rope(*tensors, pos, inv_freq[:4], head_dim=16, rotary_dim=8.5)
    with pytest.raises(ValueError, match="interleaved must be a bool"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, interleaved="yes")
    # was taken as float(s): "2" as 2.0, True as 1.0, NaN into every q and k, a tensor's gradient dropped
    for scaling in ("2", True, float("nan"), float("inf"), None, torch.tensor(2.0, requires_grad=True)):
        with pytest.raises(ValueError, match="attention_scaling must be a finite real number"):
            rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, attention_scaling=scaling)
        with pytest.raises(ValueError, match="attention_scaling must be a finite real number"):
            apply_rope(tensors[0], tensors[0], pos, inv_freq, head_dim=16, attention_scaling=scaling)
    qn, kn = make_qk_norm(16)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, q_norm_weight=qn)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, k_norm_weight=kn)
    with pytest.raises(ValueError, match=r"k_norm_weight must be an \[16\] tensor"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, q_norm_weight=qn, k_norm_weight=kn[:8])
    with pytest.raises(ValueError, match=r"q_norm_weight must be an \[16\] tensor"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, q_norm_weight=qn.repeat(2, 1), k_norm_weight=kn)
    with pytest.raises(ValueError, match=r"q_norm_weight must be an \[16\] tensor"):  # was taken
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, q_norm_weight=qn.long(), k_norm_weight=kn.long())
    b_q, b_kv = torch.zeros(32, device=DEVICE), torch.zeros(16, device=DEVICE)
    with pytest.raises(ValueError, match=r"bias must be a tuple \(b_q, b_k, b_v\), each a tensor or None, got a Tensor"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, bias=torch.zeros(64, device=DEVICE))
    with pytest.raises(ValueError, match=r"b_k must be an \[16\] tensor"):  # was promoted silently
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, bias=(b_q, b_kv.long(), b_kv))
    with pytest.raises(ValueError, match=r"b_v must be an \[16\] tensor"):
        rmsnorm_qkv_rope(*tensors, pos, inv_freq, head_dim=16, bias=(b_q, b_kv, b_kv[:8]))


@pytest.mark.parametrize("given", [(True, False, True), (False, True, False)], ids=["q_v", "k"])
def test_some_of_q_k_v_biased(given):
    """A missing bias adds 0: the others' outputs and gradients as with all three given."""
    head_dim, hq, hkv = 16, 4, 2
    tensors, biases, pos, inv_freq = make(12, 32, head_dim, hq, hkv, head_dim, True, max_pos=64)
    grads = [torch.randn(12, h * head_dim, device=DEVICE) for h in (hq, hkv, hkv)]
    kept = [b for b, g in zip(biases, given) if g]

    def ours(ts, bs):
        it = iter(bs)
        return rmsnorm_qkv_rope(*ts, pos, inv_freq, head_dim=head_dim, eps=EPS,
                                bias=tuple(next(it) if g else None for g in given))

    def ref(ts, bs):
        it = iter(bs)
        return hf_style(*ts, pos, inv_freq, head_dim, head_dim, 1.0, tuple(next(it) if g else None for g in given))

    for a, b in zip(run(ours, tensors, kept, grads, torch.float32), run(ref, tensors, kept, grads, torch.float64)):
        assert rel(a, b) < 2e-5


@pytest.mark.parametrize("qk_norm,interleaved", [(False, False), (True, False), (False, True)],
                         ids=["plain", "qk_norm", "interleaved"])
def test_custom_op_passes_opcheck(qk_norm, interleaved):
    tensors, _, pos, inv_freq = make(6, 16, 16, 2, 1, 16, False, 64)
    x, g, wq, wk, wv = (t.requires_grad_() for t in tensors)
    qn, kn = (t.requires_grad_() for t in make_qk_norm(16)) if qk_norm else (None, None)
    torch.library.opcheck(
        torch.ops.codetta.rmsnorm_qkv_rope.default,
        (x, g, [wq, wk, wv], None, *rope_tables(pos, inv_freq, 1.0), 2, 1, 16, 16, interleaved, EPS, None, None, qn, kn,
         QK_EPS),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


def test_traces_with_dynamic_shapes():
    """torch.compile(dynamic=True) of a function taking the weights as arguments: the head
    arithmetic works on symbolic sizes; a second shape reuses the graph, results equal eager's."""
    def qkv(x, g, wq, wk, wv, pos, inv_freq):
        return rmsnorm_qkv_rope(x, g, wq, wk, wv, pos, inv_freq, head_dim=16)

    compiled = torch.compile(qkv, backend="eager", dynamic=True, fullgraph=True)
    for m, d in ((9, 32), (13, 48)):
        tensors, _, pos, inv_freq = make(m, d, 16, 4, 2, 16, False, 100)
        for got, want in zip(compiled(*tensors, pos, inv_freq), qkv(*tensors, pos, inv_freq)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "forward"])
@pytest.mark.parametrize("head_dim, rotary_dim, interleaved", [(8, 8, False), (64, 32, False), (64, 64, False),
                                                               (16, 8, True), (128, 128, True), (12, 8, False),
                                                               (24, 24, False), (16, 6, True), (10, 10, True),
                                                               (15, 8, False), (9, 6, True)])
def test_rotation_kernel_either_way(head_dim, rotary_dim, interleaved, transposed):
    """The rotation kernel by itself (fp32): q, k, v as three parts with row strides of their
    own, an odd row count, five heads (two groups of a program's four in the interpreter); rotary
    dims whole heads, a share, no power of two (24, 10: padded runs) or no divisor of head_dim
    (8 of 12, 6 of 16, 8 of an odd 15, 6 of 9): the rotation of the q and k heads' first
    rotary_dim columns (transposed: RoPE's backward, with zdz = sum_k qkv_ik dqkv_ik; else RoPE's
    forward), applied here pair by pair in fp64, every other column passing through."""
    from codetta.kernels.rope import rotate

    m, n_q, n_kv = 37, 3, 1
    g = torch.Generator().manual_seed(head_dim + rotary_dim + interleaved)
    widths = [n_q * head_dim, n_kv * head_dim, n_kv * head_dim]
    parts = [torch.randn(m, w + 8, generator=g)[:, 3:3 + w].to(DEVICE) for w in widths]  # strides of their own
    qkv = torch.randn(m, sum(widths), generator=g).to(DEVICE)
    angles = torch.rand(m, rotary_dim // 2, generator=g, dtype=torch.float64) * 6.3
    cos, sin = (0.9 * f(angles) for f in (torch.cos, torch.sin))  # an attention scaling of 0.9
    dz, zdz = rotate(parts, qkv if transposed else None, cos.float().to(DEVICE), sin.float().to(DEVICE),
                     n_rotated=(n_q + n_kv) * head_dim, head_dim=head_dim, interleaved=interleaved,
                     transposed=transposed)

    d = torch.cat(parts, dim=1).double().cpu()
    want = d.clone()
    t = torch.arange(rotary_dim // 2)
    first, second = (2 * t, 2 * t + 1) if interleaved else (t, t + rotary_dim // 2)
    s = sin if transposed else -sin
    for head in range(n_q + n_kv):  # the q and k heads; v passes through
        a, b = d[:, head * head_dim + first], d[:, head * head_dim + second]
        want[:, head * head_dim + first] = cos * a + s * b
        want[:, head * head_dim + second] = cos * b - s * a
    assert rel(dz.cpu(), want) < 1e-6
    if transposed:
        assert rel(zdz.cpu(), (qkv.double().cpu() * d).sum(1)) < 1e-6
    else:
        assert zdz is None

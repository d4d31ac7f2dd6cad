"""RoPE on q and k by itself (codetta.ops.apply_rope): outputs and gradients against the
Hugging Face way of applying it (rotate_half or the interleaved convention, partial rotary)
written here in fp64, bf16 within twice eager PyTorch's error, both routes (eager and the
registered op under torch.compile), bad inputs refused."""

import pytest
import torch

from codetta.ops import apply_rope, rmsnorm_qkv_rope
from conftest import DEVICE, INTERPRET
from test_ops_rope import rel, rotate_half, rotate_half_interleaved


def hf_rope(t, cos, sin, head_dim, rotary_dim, interleaved):
    """RoPE as transformers' apply_rotary_pos_emb applies it to [..., heads * head_dim], with cos
    and sin [..., R] (two equal halves: cat(freqs, freqs)), in t's dtype."""
    cos, sin = (c.to(t.dtype)[..., None, :] for c in (cos, sin))
    if interleaved:
        cos, sin = (c[..., : c.shape[-1] // 2].repeat_interleave(2, dim=-1) for c in (cos, sin))
    rotate = rotate_half_interleaved if interleaved else rotate_half
    heads = t.reshape(*t.shape[:-1], -1, head_dim)
    rot, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
    return torch.cat((rot * cos + rotate(rot) * sin, rest), dim=-1).reshape(t.shape)


def angles(lead, rotary_dim, max_pos, scale):
    """(positions [lead], inv_freq [R/2], cos [lead, R] fp64, sin likewise)."""
    positions = torch.randint(0, max_pos, lead, device=DEVICE)
    inv_freq = 10000.0 ** -(torch.arange(0, rotary_dim, 2, device=DEVICE, dtype=torch.float32) / rotary_dim)
    freqs = positions.double()[..., None] * inv_freq.double()
    emb = torch.cat((freqs, freqs), dim=-1)
    return positions, inv_freq, emb.cos() * scale, emb.sin() * scale


def rope_and_grads(fn, q, k, dq, dk, dtype):
    """(RoPE(q), RoPE(k), dL/dq, dL/dk) for L = sum(RoPE(q) dq) + sum(RoPE(k) dk), inputs cast to dtype."""
    q, k = (t.detach().to(dtype).requires_grad_() for t in (q, k))
    rq, rk = fn(q, k)
    ((rq * dq.to(dtype)).sum() + (rk * dk.to(dtype)).sum()).backward()
    return rq, rk, q.grad, k.grad


CASES = {  # lead dims, q heads, kv heads, head_dim, rotary_dim, interleaved
    "gqa": ((2, 7), 4, 2, 16, 16, False),
    "partial_rotary": ((13,), 3, 1, 32, 16, False),
    "interleaved": ((3, 5), 2, 2, 16, 16, True),
    "one_token": ((1, 1), 2, 1, 8, 8, False),
    # no power of two (Phi-3-mini's head_dim is 96): runs of 12 and 48 columns read pair by pair
    "head_dim_24": ((2, 5), 4, 1, 24, 24, False),
    "head_dim_96": ((7,), 2, 1, 96, 96, False),
    "partial_rotary_6_of_12": ((9,), 2, 2, 12, 6, False),
    "interleaved_head_dim_24": ((11,), 2, 1, 24, 24, True),
    # rotary dims no divisor of head_dim (Phi-4-mini: 96 of 128): runs of R/2, then of (D - R)/2
    "partial_rotary_6_of_8": ((2, 3), 2, 1, 8, 6, False),
    "partial_rotary_24_of_32": ((5,), 3, 1, 32, 24, False),
    "partial_rotary_interleaved_6_of_8": ((7,), 2, 2, 8, 6, True),
    "partial_rotary_4_of_6": ((6,), 1, 1, 6, 4, False),
    # an odd head_dim: its D - R columns pass through, no pairs needed
    "head_dim_15_rotating_8": ((2, 4), 2, 1, 15, 8, False),
    "interleaved_head_dim_9_rotating_6": ((5,), 2, 2, 9, 6, True),
}


@pytest.mark.parametrize("by", ["positions", "cos_sin"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_backward_fp32(case, by):
    """fp32 against fp64 HF-style RoPE, the angles given as positions and inv_freq (with an
    attention scaling) or as a rotary embedding's (cos, sin); q and k column slices of wider
    tensors (row strides of their own)."""
    lead, hq, hkv, head_dim, rotary_dim, interleaved = CASES[case]
    positions, inv_freq, cos, sin = angles(lead, rotary_dim, 4096, 0.8)
    q = torch.randn(*lead, hq * head_dim + 5, device=DEVICE)[..., 5:]
    k = torch.randn(*lead, hkv * head_dim + 3, device=DEVICE)[..., :-3]
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    given = (dict(positions=positions, inv_freq=inv_freq, attention_scaling=0.8) if by == "positions"
             else dict(cos_sin=(cos.float(), sin.float())))

    def ours(q, k):
        return apply_rope(q, k, head_dim=head_dim, rotary_dim=None if by == "cos_sin" else rotary_dim,
                          interleaved=interleaved, **given)

    def ref(q, k):
        return tuple(hf_rope(t, cos, sin, head_dim, rotary_dim, interleaved) for t in (q, k))

    got, want = rope_and_grads(ours, q, k, dq, dk, torch.float32), rope_and_grads(ref, q, k, dq, dk, torch.float64)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == torch.float32, i
        assert rel(a, b) < 1e-6, i
    for t in ours(q, k):  # each in an allocation of its own (a KV cache may hold k alone)
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_bf16_within_twice_eager_error(interleaved):
    """bf16: outputs and gradients within twice the error of eager PyTorch's RoPE in bf16 (HF's
    apply_rotary_pos_emb with bf16 cos and sin), both against fp64."""
    m, hq, hkv, head_dim = (40, 4, 2, 16) if INTERPRET else (4096, 32, 8, 128)
    positions, inv_freq, cos, sin = angles((m,), head_dim, 8192, 1.0)
    q, k = torch.randn(m, hq * head_dim, device=DEVICE), torch.randn(m, hkv * head_dim, device=DEVICE)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    cos_sin16 = (cos.to(torch.bfloat16), sin.to(torch.bfloat16))  # what a bf16 model's rotary embedding returns

    def ours(q, k):
        return apply_rope(q, k, cos_sin=cos_sin16, head_dim=head_dim, interleaved=interleaved)

    def eager(q, k):
        return tuple(hf_rope(t, *cos_sin16, head_dim, head_dim, interleaved) for t in (q, k))

    def exact(q, k):  # the same angles as the two bf16 runs
        return tuple(hf_rope(t, *(c.double() for c in cos_sin16), head_dim, head_dim, interleaved) for t in (q, k))

    got = rope_and_grads(ours, q, k, dq, dk, torch.bfloat16)
    base = rope_and_grads(eager, q, k, dq, dk, torch.bfloat16)
    want = rope_and_grads(exact, q, k, dq, dk, torch.float64)
    for i, (a, e, r) in enumerate(zip(got, base, want)):
        assert a.dtype == torch.bfloat16, i
        assert rel(a, r) <= 2 * rel(e, r), (i, rel(a, r), rel(e, r))


def test_gradient_of_q_alone_and_compiled_route():
    """Only q's output used (k's gradient zero, not missing), q alone requiring grad; and the
    registered op under torch.compile (fullgraph) gives the same outputs and gradients."""
    positions, inv_freq, cos, sin = angles((2, 6), 16, 512, 1.0)
    q, k = torch.randn(2, 6, 32, device=DEVICE), torch.randn(2, 6, 16, device=DEVICE, requires_grad=True)
    dq = torch.randn_like(q)

    def step(fn):
        q_leaf, k.grad = q.clone().requires_grad_(), None
        rq, _ = fn(q_leaf, k, positions, inv_freq, head_dim=16)
        (rq * dq).sum().backward()
        return rq.detach(), q_leaf.grad, k.grad

    eager = step(apply_rope)
    compiled = step(torch.compile(apply_rope, backend="aot_eager", fullgraph=True))
    want = hf_rope(q.double(), cos, sin, 16, 16, False)
    assert rel(eager[0], want) < 1e-6
    assert rel(eager[1], hf_rope(dq.double(), cos, -sin, 16, 16, False)) < 1e-6  # the transposed rotation
    for got, ref in zip(compiled, eager):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert eager[2] is not None and not eager[2].any() and not compiled[2].any()


@pytest.mark.parametrize("route", ["eager", "compiled"])
def test_an_output_asks_for_a_gradient_only_where_its_input_does(route):
    """k frozen (a first layer under LoRA on q_proj): RoPE(k) requires no gradient, as HF's
    rotation of k would not (attention then keeps nothing for dk), and q's gradient is right."""
    positions, inv_freq, cos, sin = angles((2, 6), 16, 512, 1.0)
    q, k = torch.randn(2, 6, 32, device=DEVICE, requires_grad=True), torch.randn(2, 6, 16, device=DEVICE)
    fn = apply_rope if route == "eager" else torch.compile(apply_rope, backend="aot_eager", fullgraph=True)
    rq, rk = fn(q, k, positions, inv_freq, head_dim=16)
    assert rq.requires_grad and not rk.requires_grad
    dq = torch.randn_like(rq)
    (rq * dq).sum().backward()
    assert rel(q.grad, hf_rope(dq.double(), cos, -sin, 16, 16, False)) < 1e-6
    with torch.no_grad():
        assert not any(t.requires_grad for t in fn(q, k, positions, inv_freq, head_dim=16))


def test_one_graph_for_every_shape_under_dynamic_compile():
    """torch.compile(dynamic=True) keeps q's and k's sizes symbolic through the op: one graph for
    several token counts, and a dim marked dynamic stays so (found by a probe: the op returned a
    tuple of one tensor, which PyTorch specialized, a graph per shape)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(apply_rope, backend=counter, fullgraph=True, dynamic=True)
    for i, tokens in enumerate((5, 7, 12)):
        positions, inv_freq, _, _ = angles((tokens,), 16, 512, 1.0)
        q, k = torch.randn(tokens, 32, device=DEVICE), torch.randn(tokens, 16, device=DEVICE)
        for got, want in zip(compiled(q, k, positions, inv_freq, head_dim=16),
                             apply_rope(q, k, positions, inv_freq, head_dim=16)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        if i == 0:
            graphs = counter.frame_count  # Dynamo's own restart of its first trace may count twice
    assert counter.frame_count == graphs
    torch._dynamo.reset()
    q, k = torch.randn(6, 32, device=DEVICE), torch.randn(6, 16, device=DEVICE)
    positions, inv_freq, _, _ = angles((6,), 16, 512, 1.0)
    for t in (q, k, positions):
        torch._dynamo.mark_dynamic(t, 0)
    torch.compile(apply_rope, backend="aot_eager", fullgraph=True)(q, k, positions, inv_freq, head_dim=16)


def test_custom_op_passes_opcheck():
    q, k = torch.randn(5, 32, device=DEVICE, requires_grad=True), torch.randn(5, 16, device=DEVICE, requires_grad=True)
    cos, sin = torch.rand(5, 8, device=DEVICE), torch.rand(5, 8, device=DEVICE)
    torch.library.opcheck(torch.ops.codetta.apply_rope.default, (q, k, cos, sin, 16, False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_bad_inputs():
    positions, inv_freq = torch.arange(4, device=DEVICE), torch.ones(4, device=DEVICE)
    q, k = torch.randn(4, 16, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    cases = [
        (dict(q=q.double(), k=k.double()), "q must be a tensor .* in"),
        (dict(k=k.half()), "q and k must share their leading dims, dtype and device"),
        (dict(k=k[:3]), "q and k must share"),
        (dict(k=torch.randn(4, 12, device=DEVICE)), "not whole heads of 8"),
        (dict(rotary_dim=10), "rotary_dim 10 must be even and at most head_dim 8"),
        (dict(rotary_dim=3, head_dim=6, q=q[:, :12], k=k[:, :6]), "rotary_dim 3 must be even and at most head_dim 6"),
        (dict(inv_freq=torch.ones(4, device=DEVICE, requires_grad=True)), "requires grad"),
        (dict(positions=torch.arange(3, device=DEVICE)), "positions .* are not one per token"),
        (dict(cos_sin=(torch.ones(4, 8, device=DEVICE),) * 2), "give positions and inv_freq, or cos_sin, not both"),
        (dict(head_dim=0), "head_dim must be a positive integer"),
    ]
    for change, message in cases:
        args = dict(q=q, k=k, positions=positions, inv_freq=inv_freq, head_dim=8) | change
        with pytest.raises(ValueError, match=message):
            apply_rope(**args)


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU unequal halves raise a device-side assert (no host sync), "
                    "fatal to the process")
@pytest.mark.parametrize("unequal", ["cos", "sin"])
def test_cos_sin_with_unequal_halves_are_refused(unequal):
    """cos and sin repeated per adjacent pair ([c0, c0, c1, c1, ...], as other libraries make them
    for the interleaved convention) are refused, by apply_rope and the QKV epilogue's op alike:
    the kernels read the first halves, which were then other angles (found by a probe: accepted
    silently). NaNs in both halves alike are not a mismatch."""
    _, _, cos, sin = angles((5,), 8, 100, 1.0)
    q, k = torch.randn(5, 16, device=DEVICE), torch.randn(5, 8, device=DEVICE)
    pair_repeated = {name: t[..., :4].repeat_interleave(2, dim=-1).float()
                     for name, t in dict(cos=cos, sin=sin).items()}
    tables = dict(cos=cos.float(), sin=sin.float()) | {unequal: pair_repeated[unequal]}
    with pytest.raises(ValueError, match=r"cos and sin \(5, 8\) must each be two equal halves"):
        apply_rope(q, k, head_dim=8, cos_sin=(tables["cos"], tables["sin"]), interleaved=True)
    x, w = torch.randn(5, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="must each be two equal halves"):
        rmsnorm_qkv_rope(x, torch.ones(8, device=DEVICE), w, w, w, head_dim=8, cos_sin=(tables["cos"], tables["sin"]))
    nan = torch.full((5, 8), float("nan"), device=DEVICE)
    rq, rk = apply_rope(q, k, head_dim=8, cos_sin=(nan, sin.float()))
    assert rq.isnan().all() and rk.isnan().all()

"""linear_cross_entropy (LM head + RMSNorm + cross-entropy) against PyTorch's own ops.

The expected values are ``F.cross_entropy(F.linear(F.rms_norm(x), W, b), target)`` and
their autograd gradients, computed in float64 from the same inputs: independent of the
module's reference function (which is checked against them too). Vocabulary sizes are
no multiple of any tile, and chunks are smaller than the batch and do not divide it.
"""

import pytest
import torch
import torch.nn.functional as F

import codetta
from codetta.ops import cross_entropy as ce
from codetta.ops import linear_cross_entropy
from conftest import DEVICE

EPS = 1e-6
PARAMS = ("x", "weight", "bias", "norm_weight")


def make(lead=(19,), d=20, vocab=37, *, bias=False, norm=False, ignored=0, dtype=torch.float32,
         requires_grad=PARAMS):
    """Inputs as a dict of linear_cross_entropy's arguments (the first ``ignored`` rows are ignored)."""
    x = torch.randn(*lead, d, device=DEVICE)
    inputs = {
        "x": x,
        "weight": torch.randn(vocab, d, device=DEVICE) / d**0.5,
        "bias": torch.randn(vocab, device=DEVICE) if bias else None,
        "norm_weight": 1 + 0.3 * torch.randn(d, device=DEVICE) if norm else None,
    }
    for name, t in inputs.items():
        if t is not None:
            inputs[name] = t.to(dtype).requires_grad_(name in requires_grad)
    target = torch.randint(0, vocab, lead, device=DEVICE)
    target.view(-1)[:ignored] = -100
    inputs["target"] = target
    return inputs


def grads_of(loss, inputs, grad_output):
    """loss and the gradients of every input that requires grad, by autograd."""
    wrt = {k: v for k, v in inputs.items() if k in PARAMS and v is not None and v.requires_grad}
    grads = torch.autograd.grad(loss, list(wrt.values()), grad_output) if wrt else ()
    return loss.detach(), dict(zip(wrt, grads))


def pytorch(inputs, reduction="mean", ignore_index=-100, grad_output=None, dtype=torch.float64):
    """F.cross_entropy(F.linear(h, W, b)) with h = x or F.rms_norm(x), in ``dtype``, and its gradients."""
    cast = {k: (v.detach().to(dtype).requires_grad_(v.requires_grad) if k in PARAMS and v is not None else v)
            for k, v in inputs.items()}
    h = cast["x"]
    if cast["norm_weight"] is not None:
        h = F.rms_norm(h, (h.shape[-1],), cast["norm_weight"], EPS)
    logits = F.linear(h, cast["weight"], cast["bias"])
    logits = logits if dtype == torch.float64 else logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), cast["target"].reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    if reduction == "none":
        loss = loss.view(cast["target"].shape)
    return grads_of(loss, cast, None if grad_output is None else grad_output.to(loss.dtype))


def ours(inputs, reduction="mean", grad_output=None, **options):
    loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                norm_weight=inputs["norm_weight"], reduction=reduction, eps=EPS, **options)
    return grads_of(loss, inputs, grad_output)


def random_grad_output(reduction, target):
    return torch.rand(target.shape if reduction == "none" else (), device=DEVICE) + 0.5


def close(out, ref, tol=1e-5):
    """max |out - ref| <= tol * max |ref| (fp32 precision relative to the tensor's scale)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    ref = ref.to(out.device, torch.float64)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item() if ref.numel() else 0.0
    assert err <= tol * ref.abs().max().clamp_min(1e-12).item(), err


def check(inputs, reduction="mean", ignore_index=-100, tol=1e-5, **options):
    grad_output = random_grad_output(reduction, inputs["target"])
    loss, grads = ours(inputs, reduction, grad_output, ignore_index=ignore_index, **options)
    ref_loss, ref_grads = pytorch(inputs, reduction, ignore_index, grad_output)
    assert loss.dtype == torch.float32
    close(loss, ref_loss, tol)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert grads[name].dtype == inputs[name].dtype, name
        close(grads[name], ref_grads[name], tol)


# --------------------------------------------------------------------------------------
# Against PyTorch, fp32


@pytest.mark.parametrize("norm", [False, True], ids=["linear", "rmsnorm"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_pytorch(reduction, bias, norm):
    """19 rows in chunks of 5 (4 chunks, the last one short), 3 ignored targets, V = 37."""
    check(make(bias=bias, norm=norm, ignored=3), reduction, chunk_size=5)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_single_row_vocab_131(reduction):
    check(make(lead=(1,), d=16, vocab=131, bias=True, norm=True), reduction)


@pytest.mark.parametrize("chunk_size", [1, 4, 9, 64])
def test_chunk_sizes(chunk_size):
    check(make(lead=(9,), vocab=131, bias=True, ignored=2), "mean", chunk_size=chunk_size)


def test_leading_batch_dims():
    inputs = make(lead=(2, 3, 4), d=16, norm=True, ignored=5)
    check(inputs, "none", chunk_size=7)  # the loss has x's leading shape (checked by close)
    check(inputs, "mean", chunk_size=7)


def test_unbatched_input():
    """x [d] and a 0-d target, as F.cross_entropy takes unbatched logits."""
    inputs = make(lead=(), d=16, bias=True)
    check(inputs, "mean")
    check(inputs, "none")


def test_ignore_index_inside_the_vocabulary():
    inputs = make(lead=(16,), vocab=37, bias=True)
    inputs["target"][:5] = 0
    check(inputs, "mean", ignore_index=0, chunk_size=6)


def test_only_some_inputs_require_grad():
    check(make(bias=True, norm=True, requires_grad=("x",)), "sum", chunk_size=8)
    check(make(bias=True, norm=True, requires_grad=("weight", "norm_weight")), "mean", chunk_size=8)
    check(make(bias=True, requires_grad=("bias",)), "none", chunk_size=8)


def test_weight_grad_accumulates():
    """A second backward adds into .grad, like any PyTorch op."""
    inputs = make(bias=True, norm=True, ignored=2)
    loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                norm_weight=inputs["norm_weight"], eps=EPS, chunk_size=6)
    (2 * loss).backward()
    loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                norm_weight=inputs["norm_weight"], eps=EPS, chunk_size=6)
    loss.backward()
    _, ref = pytorch(inputs, "mean", grad_output=torch.tensor(3.0))
    for name in PARAMS:
        close(inputs[name].grad, ref[name])


# --------------------------------------------------------------------------------------
# Edge cases: what PyTorch gives, exactly


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("rows", [0, 6], ids=["empty", "all_ignored"])
def test_no_valid_target(reduction, rows):
    """Mean over no valid target is NaN (as in PyTorch), the gradients are zero."""
    inputs = make(lead=(rows,), bias=True, norm=True, ignored=rows)
    grad_output = random_grad_output(reduction, inputs["target"])
    loss, grads = ours(inputs, reduction, grad_output, chunk_size=4)
    ref_loss, ref_grads = pytorch(inputs, reduction, grad_output=grad_output, dtype=torch.float32)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0, equal_nan=True)
    for name in PARAMS:
        assert torch.equal(grads[name], ref_grads[name]) and not grads[name].any(), name


# --------------------------------------------------------------------------------------
# bf16 / fp16: error of ours <= 2 x error of eager PyTorch in that dtype (both against fp64)


@pytest.mark.parametrize("dtype, reduction", [(torch.bfloat16, "mean"), (torch.bfloat16, "none"),
                                              (torch.float16, "mean")])
def test_half_precision_within_twice_eager_error(dtype, reduction):
    inputs = make(lead=(40,), d=32, vocab=131, bias=True, norm=True, ignored=4, dtype=dtype)
    grad_output = random_grad_output(reduction, inputs["target"])
    loss, grads = ours(inputs, reduction, grad_output, chunk_size=16)
    eager_loss, eager_grads = pytorch(inputs, reduction, grad_output=grad_output, dtype=dtype)
    ref_loss, ref_grads = pytorch(inputs, reduction, grad_output=grad_output)

    def err(t, ref):
        return (t.double() - ref).abs().max().item()

    for name, got, eager, ref in [("loss", loss, eager_loss, ref_loss)] + [
        (n, grads[n], eager_grads[n], ref_grads[n]) for n in PARAMS
    ]:
        assert got.dtype == eager.dtype, name
        assert err(got, ref) <= 2 * err(eager, ref) + 1e-6 * ref.abs().max().item(), (name, err(got, ref), err(eager, ref))


# --------------------------------------------------------------------------------------
# Memory: the logits exist only one chunk at a time


def test_logits_never_exceed_a_chunk(monkeypatch):
    seen = []

    def recording_gemm(a, b, epilogue=None, **kwargs):
        out = codetta.gemm(a, b, epilogue, **kwargs)
        seen.append((epilogue.name if epilogue else "plain", a.shape[0], b.shape[1]))
        return out

    monkeypatch.setattr(ce, "gemm", recording_gemm)
    inputs = make(lead=(23,), vocab=37, bias=True, norm=True)
    ours(inputs, "mean", chunk_size=6)
    logits_rows = [rows for name, rows, cols in seen if name.startswith(("lce_loss", "lce_dlogits")) and cols == 37]
    assert logits_rows == [6, 6, 6, 5] * 2  # 4 chunks, forward then backward
    assert [rows for name, rows, _ in seen if name == "plain"] == [6, 6, 6, 5]  # dh = dlogits W, per chunk


def test_default_chunk_size():
    assert ce.default_chunk_size(128256) == 512
    assert ce.default_chunk_size(37) % 128 == 0
    assert ce.default_chunk_size(2**24 - 1) == 4
    assert ce.default_chunk_size(2**27) == 1
    for vocab in (37, 1000, 32000, 128256, 262144, 2**27):
        assert ce.default_chunk_size(vocab) * vocab * 4 <= 2**28 or ce.default_chunk_size(vocab) == 1


# --------------------------------------------------------------------------------------
# Errors


def _call(**changes):
    inputs = make(lead=(4,), d=8, vocab=11, bias=True, norm=True)
    inputs.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
                   for k, v in changes.items()})
    return linear_cross_entropy(inputs.pop("x"), inputs.pop("weight"), inputs.pop("target"), **inputs)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"target": torch.zeros(4, 1, dtype=torch.long)}, "leading shape"),
        ({"target": torch.zeros(5, dtype=torch.long)}, "leading shape"),
        ({"target": torch.zeros(4)}, "integer"),
        ({"target": torch.zeros(4, dtype=torch.bool)}, "integer"),
        ({"weight": torch.zeros(11 * 8)}, "2-d"),
        ({"weight": torch.zeros(11, 9)}, "d differs"),
        ({"weight": torch.zeros(11, 8, dtype=torch.bfloat16)}, "dtype"),
        ({"bias": torch.zeros(12)}, "bias must have shape"),
        ({"norm_weight": torch.zeros(7)}, "norm_weight must have shape"),
        ({"x": torch.zeros(4, 8, dtype=torch.float64)}, "dtype"),
        ({"reduction": "avg"}, "reduction"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"weight": torch.zeros(11, 8, device="meta")}, "weight is on meta"),
        ({"target": torch.tensor([0, 3, 11, 2])}, r"\[0, 11\).*target\[2\] = 11"),
        ({"target": torch.tensor([0, -1, 1, 2])}, r"target\[1\] = -1"),
        ({"target": torch.tensor([0, -1, 1, 2]), "ignore_index": 11}, r"target\[1\] = -1"),
    ],
)
def test_bad_inputs(changes, message):
    if DEVICE == "cuda" and "target\\[" in message:
        pytest.skip("on a GPU out-of-range targets raise a device-side assert (no host sync), fatal to the process")
    with pytest.raises(ValueError, match=message):
        _call(**changes)


def test_ignore_index_outside_the_vocabulary_is_no_error():
    assert torch.isfinite(_call(target=torch.tensor([0, 11, 1, 2]), ignore_index=11)).item()


# --------------------------------------------------------------------------------------
# The reference function, the custom op, torch.compile


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_reference_function_matches_pytorch(reduction):
    inputs = make(lead=(3, 5), bias=True, norm=True, ignored=4)
    grad_output = random_grad_output(reduction, inputs["target"])
    loss = ce.linear_cross_entropy_reference(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                             norm_weight=inputs["norm_weight"], reduction=reduction, eps=EPS)
    got_loss, got = grads_of(loss, inputs, grad_output)
    ref_loss, ref = pytorch(inputs, reduction, grad_output=grad_output)
    close(got_loss, ref_loss)
    for name in PARAMS:
        close(got[name], ref[name])


def test_opcheck():
    inputs = make(lead=(5,), d=8, vocab=11, bias=True, norm=True, ignored=1)
    args = (inputs["x"], inputs["weight"], inputs["target"], inputs["bias"], inputs["norm_weight"], -100, "mean", EPS, 2)
    torch.library.opcheck(torch.ops.codetta.linear_cross_entropy.default, args)


def test_torch_compile_traces_without_graph_break():
    inputs = make(lead=(2, 5), d=8, vocab=11, bias=True, norm=True, ignored=2)

    def step(x, weight, target, bias, norm_weight):
        return linear_cross_entropy(x, weight, target, bias=bias, norm_weight=norm_weight, eps=EPS, chunk_size=4) * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    args = [inputs[k] for k in ("x", "weight", "target", "bias", "norm_weight")]
    loss, grads = grads_of(compiled(*args), inputs, None)
    ref_loss, ref = pytorch(inputs, "mean", grad_output=torch.tensor(2.0))
    close(loss, 2 * ref_loss)
    for name in PARAMS:
        close(grads[name], ref[name])

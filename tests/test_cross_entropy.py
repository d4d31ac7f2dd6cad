"""linear_cross_entropy (LM head + RMSNorm + cross-entropy) against PyTorch's own ops.

The expected values are ``F.cross_entropy(F.linear(F.rms_norm(x), W, b), target)`` and
their autograd gradients, computed in float64 from the same inputs: independent of the
module's reference function (which is checked against them too). Vocabulary sizes are
no multiple of any tile, and chunks are smaller than the batch and do not divide it.
"""

import numpy as np
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


def pytorch(inputs, reduction="mean", ignore_index=-100, grad_output=None, dtype=torch.float64, label_smoothing=0.0,
            z_loss=0.0, softcap=None, cap_in_fp32=False):
    """F.cross_entropy(F.linear(h, W, b)) with h = x or F.rms_norm(x), in ``dtype``, and its gradients;
    with ``z_loss`` c, plus c logsumexp(logits)^2 for each row not ignored, reduced alike; with
    ``softcap`` s, of the logits s tanh(logits / s) (in ``dtype``, as Gemma 2 caps them, or
    ``cap_in_fp32`` after the logits' upcast)."""
    cast = {k: (v.detach().to(dtype).requires_grad_(v.requires_grad) if k in PARAMS and v is not None else v)
            for k, v in inputs.items()}
    h = cast["x"]
    if cast["norm_weight"] is not None:
        h = F.rms_norm(h, (h.shape[-1],), cast["norm_weight"], EPS)
    logits = F.linear(h, cast["weight"], cast["bias"])
    if softcap and not cap_in_fp32:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits if dtype == torch.float64 else logits.float()
    if softcap and cap_in_fp32:
        logits = torch.tanh(logits / softcap) * softcap
    flat, target = logits.reshape(-1, logits.shape[-1]), cast["target"].reshape(-1)
    loss = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        valid = target != ignore_index
        penalty = torch.where(valid, z_loss * torch.logsumexp(flat, -1).square(), 0.0)
        loss = loss + {"none": penalty, "sum": penalty.sum(), "mean": penalty.sum() / valid.sum()}[reduction]
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


def check(inputs, reduction="mean", ignore_index=-100, tol=1e-5, label_smoothing=0.0, z_loss=0.0, softcap=None,
          **options):
    grad_output = random_grad_output(reduction, inputs["target"])
    loss, grads = ours(inputs, reduction, grad_output, ignore_index=ignore_index, label_smoothing=label_smoothing,
                       z_loss=z_loss, softcap=softcap, **options)
    ref_loss, ref_grads = pytorch(inputs, reduction, ignore_index, grad_output, label_smoothing=label_smoothing,
                                  z_loss=z_loss, softcap=softcap)
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


@pytest.mark.parametrize("default_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction, grad_output", [("mean", 1.0), ("mean", 2.5), ("sum", 1.0), ("none", 1.0)])
def test_the_default_dtype_does_not_round_the_gradients(default_dtype, reduction, grad_output):
    """fp32 inputs under ``torch.set_default_dtype(bf16 or fp16)`` (models built that way): the
    gradients scale by 1 / n_valid in fp32 (17 valid rows: no power of two), as PyTorch's do.
    Found by a probe: a bf16 default rounded the scale, every gradient off by up to 0.4%."""
    inputs = make(ignored=2)
    grad = torch.full(inputs["target"].shape if reduction == "none" else (), grad_output, device=DEVICE)
    prior = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        loss, grads = ours(inputs, reduction, grad, chunk_size=5)
    finally:
        torch.set_default_dtype(prior)
    ref_loss, ref_grads = pytorch(inputs, reduction, grad_output=grad)
    close(loss, ref_loss)
    for name in grads:
        close(grads[name], ref_grads[name])


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_confident_rows_keep_their_small_loss_and_gradient(reduction):
    """Every target wins by 16 to 19 (losses ~1e-7 to 1e-6, under the fp32 spacing of lse ~ 45, 4e-6):
    lse's parts kept apart, (m - z_t) + log s, keep the loss and 1 - p as eager fp32's
    log_softmax does ((z - max) - log sum): within 2x its error (found by a precision probe:
    lse - z_t lost them, 5-7x eager's error). Margins and logits vary by row, so that the
    rounding of each row's sum (1 + ~1e-6: its fp32 spacing is 1e-7) is not one draw for all."""
    inputs = make(lead=(96,), d=40, vocab=37, bias=True)
    with torch.no_grad():  # orthonormal weight rows: logits 26 to 29, the target's 29 + the margin
        inputs["weight"].copy_(torch.linalg.qr(torch.randn(40, 37, device=DEVICE))[0].t())
        inputs["bias"].copy_(26.0 + 3.0 * torch.rand(37, device=DEVICE))
        margin = 16.0 + 3.0 * torch.rand(96, 1, device=DEVICE)
        inputs["x"].copy_((29.0 + margin - inputs["bias"][inputs["target"]][:, None]) * inputs["weight"][inputs["target"]])
    grad_output = random_grad_output(reduction, inputs["target"])
    loss, grads = ours(inputs, reduction, grad_output)
    ref_loss, ref_grads = pytorch(inputs, reduction, grad_output=grad_output)
    eager_loss, eager_grads = pytorch(inputs, reduction, grad_output=grad_output, dtype=torch.float32)
    assert 1e-8 < ref_loss.min() and ref_loss.max() < (1e-4 if reduction == "sum" else 2e-6)

    def err(t, ref):
        return ((t.double() - ref).norm() / ref.norm()).item()

    assert err(loss, ref_loss) <= 2 * err(eager_loss, ref_loss) + 1e-9
    for name in grads:
        assert err(grads[name], ref_grads[name]) <= 2 * err(eager_grads[name], ref_grads[name]) + 1e-9, name


@pytest.mark.parametrize("label_smoothing, z_loss", [(0.1, 0.0), (0.0, 1e-2), (0.3, 1e-3), (1.0, 0.0)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_and_z_loss(reduction, label_smoothing, z_loss):
    """As F.cross_entropy(label_smoothing=e) plus c lse^2 per row: loss and every gradient, with
    ignored rows and chunks that do not divide the rows."""
    check(make(bias=True, norm=True, ignored=3), reduction, chunk_size=5, label_smoothing=label_smoothing,
          z_loss=z_loss)


def test_label_smoothing_and_z_loss_reference():
    inputs = make(lead=(7,), bias=True, ignored=2)
    loss = ce.linear_cross_entropy_reference(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                             label_smoothing=0.2, z_loss=1e-2)
    close(loss.detach(), pytorch(inputs, label_smoothing=0.2, z_loss=1e-2)[0])


@pytest.mark.parametrize("option, value", [
    ("label_smoothing", -0.1), ("label_smoothing", 1.5), ("z_loss", -1.0), ("z_loss", float("nan")),
    ("z_loss", float("inf")), ("label_smoothing", "0.1"), ("z_loss", True), ("eps", -1.0)])
def test_bad_label_smoothing_or_z_loss(option, value):
    """Refused with a message naming the function and the argument (z_loss = inf made the loss inf)."""
    inputs = make()
    with pytest.raises(ValueError, match=f"linear_cross_entropy: {option} must be"):
        linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], **{option: value})


@pytest.mark.parametrize("softcap, logit_scale", [(1.5, 1.0), (0.5, 8.0)], ids=["mild", "saturated"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_soft_capped_logits(reduction, softcap, logit_scale):
    """Gemma 2's final_logit_softcapping: the loss of s tanh(logits / s), every gradient, also
    where tanh saturates (logits ~16 s: 1 - tanh^2 ~ 1e-13 must not become 0 or noise)."""
    inputs = make(bias=True, norm=True, ignored=3)
    with torch.no_grad():
        inputs["weight"].mul_(logit_scale)
    check(inputs, reduction, chunk_size=5, softcap=softcap)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_soft_capped_loss_without_gradients(reduction):
    """No backward: the capped loss from the epilogue's fp32 logits (tanh in the epilogue)."""
    inputs = make(lead=(11,), bias=True, ignored=2)
    with torch.no_grad():
        loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                    reduction=reduction, chunk_size=4, softcap=0.7)
        reference = ce.linear_cross_entropy_reference(inputs["x"], inputs["weight"], inputs["target"],
                                                      bias=inputs["bias"], reduction=reduction, softcap=0.7)
    expected = pytorch(inputs, reduction, grad_output=random_grad_output(reduction, inputs["target"]), softcap=0.7)[0]
    close(loss, expected)
    close(reference, expected)


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan"), True, "30"])
def test_bad_softcap(value):
    inputs = make()
    with pytest.raises(ValueError, match="softcap must be None or a positive finite number"):
        linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], softcap=value)


def test_numpy_scalars_taken_as_numbers():
    """label_smoothing, z_loss and softcap as NumPy scalars (as F.cross_entropy takes them): the
    loss of the same Python floats."""
    import numpy as np
    inputs = make(ignored=1)
    options = dict(label_smoothing=0.25, z_loss=1e-2, softcap=0.75)  # exact in fp32
    as_numpy = {name: np.float32(value) for name, value in options.items()}
    with torch.no_grad():
        loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], **as_numpy)
    close(loss, pytorch(inputs, **options)[0])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_single_row_vocab_131(reduction):
    check(make(lead=(1,), d=16, vocab=131, bias=True, norm=True), reduction)


@pytest.mark.parametrize("chunk_size", [1, 4, 9, 64, np.int64(5)])
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


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("grad_output", [float("inf"), float("nan")])
def test_no_valid_target_with_a_non_finite_grad_output(reduction, grad_output):
    """PyTorch gives ignored rows no gradient whatever grad_output is: with no target counted every
    gradient is exactly zero, also when grad_output is inf or nan (a "sum" divided by a count of 0,
    as transformers' Trainer does with num_items_in_batch = 0), not 0 * inf = nan."""
    inputs = make(lead=(6,), bias=True, norm=True, ignored=6)
    grad_output = torch.full(inputs["target"].shape if reduction == "none" else (), grad_output, device=DEVICE)
    _, grads = ours(inputs, reduction, grad_output, chunk_size=4)
    _, ref_grads = pytorch(inputs, reduction, grad_output=grad_output, dtype=torch.float32)
    for name in PARAMS:
        assert torch.equal(grads[name], ref_grads[name]) and not grads[name].any(), name


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("grad_output", [float("inf"), float("nan")])
def test_ignored_rows_get_no_gradient_from_a_non_finite_grad_output(reduction, grad_output):
    """With some targets ignored and an inf or nan grad_output, PyTorch's dx is exactly 0 on the
    ignored rows and not finite on the others (so is every weight gradient); so is codetta's."""
    inputs = make(lead=(6,), bias=True, norm=True, ignored=2)
    grad_output = torch.full(inputs["target"].shape if reduction == "none" else (), grad_output, device=DEVICE)
    _, grads = ours(inputs, reduction, grad_output, chunk_size=4)
    _, ref_grads = pytorch(inputs, reduction, grad_output=grad_output, dtype=torch.float32)
    for dx in (grads["x"], ref_grads["x"]):
        assert torch.equal(dx[:2], torch.zeros_like(dx[:2])) and not dx[2:].isfinite().any(dim=-1).any()
    for name in PARAMS[1:]:
        assert not grads[name].isfinite().all() and not ref_grads[name].isfinite().all(), name


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_logit_of_plus_inf_gives_nan_as_pytorch(reduction, grad):
    """A +inf logit (two columns of overflowed bias; a -inf one too) makes every row's loss NaN in
    F.cross_entropy (log_softmax: inf - inf), and in ours, whether the logits are stored
    (training) or only reduced in the epilogue (no gradient; the forward of "none"). Targets on a
    +inf column, the -inf one and elsewhere, over several chunks."""
    inputs = make(lead=(9,), vocab=37, bias=True, requires_grad=("x", "weight") if grad else ())
    with torch.no_grad():
        inputs["bias"][[3, 30]] = float("inf")
        inputs["bias"][7] = float("-inf")
    inputs["weight"].data[[3, 30], :] = 0.0  # so that inf + x w stays inf
    inputs["target"][:3] = torch.tensor([3, 7, 0], device=DEVICE)
    loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                reduction=reduction, chunk_size=4)
    ref = F.cross_entropy(F.linear(inputs["x"], inputs["weight"], inputs["bias"]).double(), inputs["target"],
                          reduction=reduction)
    assert torch.isnan(ref).all()
    assert torch.isnan(loss).all(), loss
    if grad:
        loss.sum().backward()
        assert torch.isnan(inputs["x"].grad).any() and torch.isnan(inputs["weight"].grad).any()


# --------------------------------------------------------------------------------------
# bf16 / fp16: error of ours <= 2 x error of eager PyTorch in that dtype (both against fp64)


@pytest.mark.parametrize("dtype, reduction, options", [
    (torch.bfloat16, "mean", {}), (torch.bfloat16, "sum", {}), (torch.bfloat16, "none", {}), (torch.float16, "mean", {}),
    (torch.bfloat16, "mean", dict(label_smoothing=0.1, z_loss=1e-3)),
    (torch.bfloat16, "none", dict(label_smoothing=0.1, z_loss=1e-3)),
    (torch.bfloat16, "mean", dict(softcap=1.0)), (torch.float16, "sum", dict(softcap=1.0)),
])
def test_half_precision_within_twice_eager_error(dtype, reduction, options):
    """With a soft cap, eager PyTorch may cap the logits in their dtype (Gemma 2's code) or after
    their upcast (as codetta, from the same rounded logits): the worse of the two is eager's error.
    The loss is a sum of the logits' roundings that cancel by chance: on the H200 (fp16, "sum",
    code 75a3b89) codetta's loss error was 4.1x the first's (6.9e-4 against 1.7e-4, on a loss of
    186), whose capped logits are rounded once more; over 18 draws (fp16 and bf16, code 6a49bf7)
    it equalled the second's in each, 0.3-7x the first's."""
    inputs = make(lead=(40,), d=32, vocab=131, bias=True, norm=True, ignored=4, dtype=dtype)
    grad_output = random_grad_output(reduction, inputs["target"])
    loss, grads = ours(inputs, reduction, grad_output, chunk_size=16, **options)
    eagers = [pytorch(inputs, reduction, grad_output=grad_output, dtype=dtype, cap_in_fp32=in_fp32, **options)
              for in_fp32 in ((False, True) if options.get("softcap") else (False,))]
    ref_loss, ref_grads = pytorch(inputs, reduction, grad_output=grad_output, **options)

    def err(t, ref):
        return (t.double() - ref).abs().max().item()

    for name, got, ref in [("loss", loss, ref_loss)] + [(n, grads[n], ref_grads[n]) for n in PARAMS]:
        eager = [e_loss if name == "loss" else e_grads[name] for e_loss, e_grads in eagers]
        assert got.dtype == eager[0].dtype, name
        eager_err = max(err(e, ref) for e in eager)
        assert err(got, ref) <= 2 * eager_err + 1e-6 * ref.abs().max().item(), (name, err(got, ref), eager_err)


@pytest.mark.parametrize("norm_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_other_norm_weight_dtype_with_half_precision_x_and_weight(reduction, norm_dtype):
    """A final norm whose weight stays fp32 (Gemma's 1 + w), or fp16 (an fp16 model under bf16
    autocast, which casts x and the LM head only), over a bf16 x and LM head, as rms_norm and
    rmsnorm_linear take it: the loss and every gradient within 2x the error of the eager model
    (the norm in fp32, its output rounded to bf16, as transformers' norms do), against fp64; the
    norm weight's gradient in its dtype."""
    inputs = make(lead=(2, 20), d=32, vocab=131, norm=True, ignored=3, dtype=torch.bfloat16)
    inputs["norm_weight"] = inputs["norm_weight"].detach().to(norm_dtype).requires_grad_()
    grad_output = random_grad_output(reduction, inputs["target"])
    loss, grads = ours(inputs, reduction, grad_output)
    ref_loss, ref_grads = pytorch(inputs, reduction, grad_output=grad_output)

    def eager(x, weight, norm_weight):
        h = F.rms_norm(x.float(), (x.shape[-1],), norm_weight.float(), EPS).to(x.dtype)
        flat = F.linear(h, weight).float().flatten(0, -2)
        return F.cross_entropy(flat, inputs["target"].flatten(), reduction=reduction).view(grad_output.shape)

    wrt = [inputs[name].detach().requires_grad_() for name in ("x", "weight", "norm_weight")]
    eager_loss = eager(*wrt)
    eager_grads = dict(zip(("x", "weight", "norm_weight"), torch.autograd.grad(eager_loss, wrt, grad_output)))
    assert grads["norm_weight"].dtype == norm_dtype and grads["x"].dtype == torch.bfloat16

    def err(t, ref):
        return (t.double() - ref).abs().max().item()

    for name, got, e, ref in [("loss", loss, eager_loss, ref_loss)] + [
            (n, grads[n], eager_grads[n], ref_grads[n]) for n in ("x", "weight", "norm_weight")]:
        assert err(got, ref) <= 2 * err(e, ref) + 1e-6 * ref.abs().max().item(), (name, err(got, ref), err(e, ref))


@pytest.mark.parametrize("x_scale", [1.0, 1e-3])
def test_fp16_loss_scaling_keeps_small_gradients(x_scale):
    """fp16 with a loss scale (GradScaler's (loss * S).backward()): the scale must reach the
    small logit gradients before anything rounds to fp16, as in eager PyTorch; the errors of
    dx and dW (divided by S) within 2x eager's, against fp64. "mean" over 2048 rows puts
    p / n_valid far below fp16's normal range when dz is scaled before being stored; small
    activations put dW there too unless it stays fp32 until the scale reaches it."""
    m, d, vocab, loss_scale = 2048, 16, 512, 2.0**16
    gen = torch.Generator().manual_seed(0)
    x0 = (torch.randn(m, d, generator=gen) * x_scale).to(DEVICE)
    w0 = (torch.randn(vocab, d, generator=gen) * 0.2).to(DEVICE)
    target = torch.randint(0, vocab, (m,), generator=gen).to(DEVICE)

    def grads(fn, dtype):
        x, w = x0.to(dtype).requires_grad_(), w0.to(dtype).requires_grad_()
        (fn(x, w) * loss_scale).backward()
        return x.grad.double() / loss_scale, w.grad.double() / loss_scale

    ref = grads(lambda x, w: F.cross_entropy(F.linear(x, w), target), torch.float64)
    eager = grads(lambda x, w: F.cross_entropy(F.linear(x, w).float(), target), torch.float16)
    got = grads(lambda x, w: linear_cross_entropy(x, w, target), torch.float16)
    for name, g, e, r in zip(("dx", "dW"), got, eager, ref):
        err, err_eager = ((g - r).norm() / r.norm()).item(), ((e - r).norm() / r.norm()).item()
        assert err <= 2 * err_eager, f"{name}: {err:.2e} vs eager {err_eager:.2e}"
        assert (g == 0).sum() <= (e == 0).sum(), f"{name}: gradients flushed to zero"


# --------------------------------------------------------------------------------------
# The work done: three GEMMs per chunk, in the forward; the logits one chunk at a time


def record_gemms(monkeypatch):
    """(program name, a's rows, b's columns, data_ptr of its output "out" or None) of every GEMM."""
    seen = []

    def recording_gemm(a, b, epilogue=None, **kwargs):
        out = kwargs.get("out")
        out = out.get("out") if isinstance(out, dict) else out
        seen.append((epilogue.name if epilogue else "plain", a.shape[0], b.shape[1],
                     None if out is None else out.data_ptr()))
        return codetta.gemm(a, b, epilogue, **kwargs)

    monkeypatch.setattr(ce, "gemm", recording_gemm)
    return seen


def test_three_gemms_per_chunk_in_the_forward(monkeypatch):
    seen = record_gemms(monkeypatch)
    inputs = make(lead=(23,), vocab=37, bias=True, norm=True)
    loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                norm_weight=inputs["norm_weight"], eps=EPS, chunk_size=6)
    expected = []
    for i, rows in enumerate([6, 6, 6, 5]):  # logits; dW = dz^T h (written, then added); dh = dz W
        expected += [("linear_bias", rows, 37), ("weight_grad_add" if i else "weight_grad", 37, 20),
                     ("plain", rows, 20)]
    assert [s[:3] for s in seen] == expected
    assert len({s[3] for s in seen if s[0] == "linear_bias"}) == 1  # one logits buffer for every chunk
    seen.clear()
    (3.7 * loss).backward()
    assert seen == []  # the backward only scales the saved gradients


def test_reduction_none_recomputes_in_the_backward(monkeypatch):
    seen = record_gemms(monkeypatch)
    inputs = make(lead=(23,), vocab=37, bias=True, norm=True)
    ours(inputs, "none", random_grad_output("none", inputs["target"]), chunk_size=6)
    logits = [(name, rows) for name, rows, cols, _ in seen if cols == 37]
    assert logits == [("lce_loss_bias", r) for r in (6, 6, 6, 5)] + [("linear_bias", r) for r in (6, 6, 6, 5)]
    assert len(seen) == 4 + 3 * 4


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_requires_grad"])
def test_no_gradient_work_without_backward(monkeypatch, mode):
    """Evaluation: only the loss GEMMs, nothing stored, no dz kernel; the loss as PyTorch's."""
    seen = record_gemms(monkeypatch)
    monkeypatch.setattr(ce, "softmax_grad_", None)  # would fail if called
    inputs = make(lead=(11,), vocab=37, bias=True, norm=True, ignored=2,
                  requires_grad=() if mode == "no_requires_grad" else PARAMS)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
               "no_requires_grad": torch.enable_grad}[mode]
    for reduction in ("mean", "sum", "none"):
        seen.clear()
        with context():
            loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                        norm_weight=inputs["norm_weight"], reduction=reduction, eps=EPS,
                                        chunk_size=4)
        assert loss.grad_fn is None
        assert [s[:2] for s in seen] == [("lce_loss_bias", 4), ("lce_loss_bias", 4), ("lce_loss_bias", 3)]
        close(loss, pytorch(inputs, reduction, grad_output=random_grad_output(reduction, inputs["target"]))[0])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("grad_output", [1.0, 3.7])
def test_grad_output_scales_the_saved_gradients(reduction, grad_output):
    """loss * 3.7 (the saved gradients are multiplied in place) and loss itself (nothing to do)."""
    inputs = make(bias=True, norm=True, ignored=3)
    loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                norm_weight=inputs["norm_weight"], reduction=reduction, eps=EPS, chunk_size=8)
    (loss * grad_output if grad_output != 1 else loss).backward()
    _, ref = pytorch(inputs, reduction, grad_output=torch.tensor(grad_output))
    for name in PARAMS:
        close(inputs[name].grad, ref[name])


@pytest.mark.parametrize("options, message", [
    (dict(ignore_index=-100.5), "ignore_index must be an int"),
    (dict(ignore_index=True), "ignore_index must be an int"),
    (dict(ignore_index=2**63), "ignore_index must be an int"),  # beyond int64: the custom op's schema refused it obscurely
    (dict(eps="1e-6"), "eps must be a number"),
])
def test_bad_option_values_are_refused(options, message):
    inputs = make()
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], **options)


@pytest.mark.parametrize("grad_output", [2.0, 1.0])
def test_second_backward_through_saved_gradients_raises_clearly(grad_output):
    """The saved gradients are handed out (scaled in place) by the first backward: a retained graph
    cannot be run twice, and the error says so and what to do instead."""
    inputs = make()
    loss = grad_output * linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], eps=EPS)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated already.*reduction='none'"):
        loss.backward()
    loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], eps=EPS)
    torch.autograd.grad(loss, inputs["x"], retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated already"):
        torch.autograd.grad(loss, inputs["x"])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("edited", ["weight", "norm_weight"])
def test_weights_edited_in_place_before_the_backward_raise_as_in_pytorch(edited, reduction):
    """The gradients made in the forward are those of the weights it read: an in-place edit of one
    between forward and backward raises autograd's error, as eager's backward does (which reads
    them; not the bias)."""
    inputs = make(bias=True, norm=True)
    for fn in (lambda: linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], bias=inputs["bias"],
                                            norm_weight=inputs["norm_weight"], reduction=reduction, eps=EPS),
               lambda: torch.nn.functional.cross_entropy(
                   torch.nn.functional.linear(torch.nn.functional.rms_norm(
                       inputs["x"], (inputs["x"].shape[-1],), inputs["norm_weight"], EPS),
                       inputs["weight"], inputs["bias"]), inputs["target"], reduction=reduction)):
        loss = fn().sum()
        with torch.no_grad():
            inputs[edited].mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_reduction_none_backpropagated_twice():
    """reduction='none' recomputes the logits in its backward: a retained graph runs twice, as eager's."""
    inputs = make()
    loss = linear_cross_entropy(inputs["x"], inputs["weight"], inputs["target"], reduction="none", eps=EPS).mean()
    first = torch.autograd.grad(loss, [inputs["x"], inputs["weight"]], retain_graph=True)
    second = torch.autograd.grad(loss, [inputs["x"], inputs["weight"]])
    _, ref = pytorch(inputs, "mean")
    for got in (first, second):
        close(got[0], ref["x"])
        close(got[1], ref["weight"])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_several_chunks_match_one_chunk(reduction):
    """bf16: 40 rows in chunks of 16 (fp32 dW accumulator) or in one chunk (dW written in bf16)."""
    inputs = make(lead=(40,), d=32, vocab=131, bias=True, norm=True, ignored=4, dtype=torch.bfloat16)
    grad_output = random_grad_output(reduction, inputs["target"])
    loss, grads = ours(inputs, reduction, grad_output, chunk_size=16)
    one_loss, one = ours(inputs, reduction, grad_output)  # the default chunk holds all 40 rows
    close(loss, one_loss)
    for name in PARAMS:
        assert grads[name].dtype == one[name].dtype == torch.bfloat16
        close(grads[name].float(), one[name].float(), tol=2**-7)


def test_default_chunk_size():
    assert ce.default_chunk_size(128256) == 4096  # bf16: 1 GiB of logits
    assert ce.default_chunk_size(128256, torch.float32) == 2048
    assert ce.default_chunk_size(37) % 128 == 0
    assert ce.default_chunk_size(2**24 - 1) == 32
    assert ce.default_chunk_size(2**30) == 1
    # all rows in one chunk when that takes no more than a chunk + the fp32 [V, d] dW accumulator
    assert ce.default_chunk_size(128256, rows=8192, d=4096) == 8192
    assert ce.default_chunk_size(128256, rows=8192, d=2048) == 8192
    assert ce.default_chunk_size(128256, rows=16384, d=4096) == 4096
    assert ce.default_chunk_size(128256, rows=100, d=4096) == 4096
    # a frozen weight has no dW accumulator: the rows stay in chunks of a quarter as many bytes (2^28)
    assert ce.default_chunk_size(128256, rows=8192, d=4096, weight_grad=False) == 1024
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for vocab in (37, 1000, 32000, 128256, 262144, 2**30):
            rows = ce.default_chunk_size(vocab, dtype)
            assert rows * vocab * dtype.itemsize <= 2**30 or rows == 1


# --------------------------------------------------------------------------------------
# The dz kernel alone


def _half_ulp(ref, dtype):
    """Half a unit in the last place of dtype at |ref| (the bound of round-to-nearest)."""
    bits = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    _, exponent = torch.frexp(ref)
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the subnormal spacing
    return torch.maximum(torch.ldexp(torch.ones_like(ref), exponent - bits - 1), torch.full_like(ref, tiny / 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_softmax_grad_kernel(dtype):
    """13 x 37 in blocks of 4 x 16 (edges masked) inside a NaN-filled buffer that stays untouched;
    ignored rows (scale 0, target -100), dz rounded to nearest (also in the interpreter)."""
    from codetta.kernels.softmax_grad import softmax_grad_

    m, n = 13, 37
    buffer = torch.full((m + 3, n + 7), float("nan"), device=DEVICE, dtype=dtype)
    z = buffer[1 : m + 1, 2 : n + 2]
    z.copy_(4 * torch.randn(m, n, device=DEVICE))
    z64 = z.double()
    lse = torch.logsumexp(z64, 1).float()
    target = torch.randint(0, n, (m,), device=DEVICE)
    target[[0, 5]] = -100
    scale = torch.rand(m, device=DEVICE) + 0.5
    scale[[0, 5]] = 0.0
    onehot = F.one_hot(target.clamp_min(0), n).double() * (target >= 0).double()[:, None]
    ref = (torch.exp(z64 - lse.double()[:, None]) - onehot) * scale.double()[:, None]
    outside = buffer.clone()
    outside[1 : m + 1, 2 : n + 2] = 0

    assert softmax_grad_(z, lse, target, scale, block_m=4, block_n=16) is z
    assert z.dtype == dtype and not z[[0, 5]].any()
    err = (z.double() - ref).abs()
    if dtype == torch.float32:
        assert err.max() <= 1e-6 * ref.abs().max()
    else:
        assert (err <= _half_ulp(ref, dtype) * (1 + 1e-4) + 1e-7 * ref.abs()).all()
    rest = buffer.clone()
    rest[1 : m + 1, 2 : n + 2] = 0
    torch.testing.assert_close(rest, outside, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_stats_kernel(dtype):
    """Rows of a 13 x 75 view (row stride wider than the row) in blocks of 4 x 16 (edges masked):
    lse's parts, the target's logit and the row sum against fp64; a target in the last column,
    beyond the vocabulary, negative, or in a block's first column; a row of -inf and a row with
    one finite logit; the buffer around the view untouched."""
    from codetta.kernels.logsumexp import row_stats

    m, n = 13, 75
    buffer = torch.full((m + 2, n + 5), float("nan"), device=DEVICE, dtype=dtype)
    z = buffer[1 : m + 1, :n]
    z.copy_(6 * torch.randn(m, n, device=DEVICE) + 20)
    z[3] = float("-inf")
    z[4] = float("-inf")
    z[4, 40] = -3.0
    before = buffer.clone()
    target = torch.randint(0, n, (m,), device=DEVICE)
    target[[0, 1, 2, 5]] = torch.tensor([n - 1, n, -100, 16], device=DEVICE)
    (row_max, log_sum), target_logit, logit_sum = row_stats(z, target, logit_sum=True, block_m=4, block_n=16)
    z64 = z.double()
    lse = torch.logsumexp(z64, 1)
    finite = torch.isfinite(lse)
    assert row_max.dtype == log_sum.dtype == target_logit.dtype == logit_sum.dtype == torch.float32
    torch.testing.assert_close(row_max.double(), torch.where(finite, z64.amax(1), 0.0), rtol=0, atol=0)
    torch.testing.assert_close((row_max.double() + log_sum.double())[finite], lse[finite], rtol=1e-6, atol=1e-6)
    assert (log_sum[~finite] == float("-inf")).all() and not finite[3] and finite[4]
    inside = (target >= 0) & (target < n)
    want = torch.where(inside, z64.gather(1, target.clamp(0, n - 1)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(target_logit.double(), want, rtol=0, atol=0)
    torch.testing.assert_close(logit_sum[finite].double(), z64.sum(1)[finite], rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(buffer, before, rtol=0, atol=0, equal_nan=True)
    assert row_stats(z, target)[2] is None


def test_softmax_grad_kernel_label_smoothing_and_z_loss():
    """dz = (p (1 + 2 c lse) - (1 - e) onehot - e / N) * scale, fp32, ignored rows untouched by the one-hot."""
    from codetta.kernels.softmax_grad import softmax_grad_

    m, n, e, c = 9, 37, 0.2, 0.05
    z = 3 * torch.randn(m, n, device=DEVICE)
    z64 = z.double()
    lse = torch.logsumexp(z64, 1)
    target = torch.randint(0, n, (m,), device=DEVICE)
    target[2] = -100
    scale = torch.rand(m, device=DEVICE) + 0.5
    onehot = F.one_hot(target.clamp_min(0), n).double() * (target >= 0).double()[:, None]
    p = torch.exp(z64 - lse[:, None])
    ref = (p * (1 + 2 * c * lse[:, None]) - (1 - e) * onehot - e / n) * scale.double()[:, None]
    softmax_grad_(z, lse.float(), target, scale, label_smoothing=e, z_loss=c, block_m=4, block_n=16)
    assert (z.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


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


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU out-of-range targets raise a device-side assert")
def test_an_out_of_range_target_raises_the_index_error_pytorch_raises():
    x, weight, target = torch.randn(3, 8), torch.randn(11, 8), torch.tensor([0, 11, 1])
    with pytest.raises(IndexError):
        F.cross_entropy(F.linear(x, weight), target)
    with pytest.raises(IndexError, match=r"target\[1\] = 11"):
        linear_cross_entropy(x, weight, target)


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


@pytest.mark.parametrize("reduction, in_forward", [("mean", True), ("sum", False), ("none", True)])
def test_opcheck(reduction, in_forward):
    """The forward with its gradients ("mean"), or recomputing them in the backward op.

    With the gradients in the forward, the AOT test is left out: it returns the op's gradient
    outputs to the caller, and the backward scales them in place (linear_cross_entropy never
    returns them; torch.compile through AOT autograd's partitioners is tested below).
    """
    inputs = make(lead=(5,), d=8, vocab=11, bias=True, norm=True, ignored=1)
    args = (inputs["x"], inputs["weight"], inputs["target"], inputs["bias"], inputs["norm_weight"], -100, reduction,
            EPS, 0.1, 1e-3, 0.9, 2, *[in_forward] * 4)
    fused = in_forward and reduction != "none"
    utils = ("test_schema", "test_autograd_registration", "test_faketensor") if fused else None
    torch.library.opcheck(torch.ops.codetta.linear_cross_entropy.default, args,
                          **({"test_utils": utils} if utils else {}))


def test_opcheck_scale():
    torch.library.opcheck(torch.ops.codetta.linear_cross_entropy_scale_.default,
                          (torch.tensor(2.5, device=DEVICE), torch.randn(5, 4, device=DEVICE)))


@pytest.mark.parametrize("backend", ["aot_eager", "aot_eager_decomp_partition"])
def test_torch_compile_traces_without_graph_break(backend):
    """aot_eager_decomp_partition partitions forward and backward as inductor does."""
    inputs = make(lead=(2, 5), d=8, vocab=11, bias=True, norm=True, ignored=2)

    def step(x, weight, target, bias, norm_weight):
        return linear_cross_entropy(x, weight, target, bias=bias, norm_weight=norm_weight, eps=EPS, chunk_size=4) * 2

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    args = [inputs[k] for k in ("x", "weight", "target", "bias", "norm_weight")]
    loss, grads = grads_of(compiled(*args), inputs, None)
    ref_loss, ref = pytorch(inputs, "mean", grad_output=torch.tensor(2.0))
    close(loss, 2 * ref_loss)
    for name in PARAMS:
        close(grads[name], ref[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.37, -2.0, 0.0])
def test_scale_unless_one_kernel(dtype, scale):
    """t *= s in place, the fp32 product rounded once to t's dtype; s == 1 leaves t untouched
    (decided on the device)."""
    from codetta.kernels.scale import scale_unless_one_

    t = torch.randn(7, 131, device=DEVICE).to(dtype)  # 917 elements: no multiple of the block
    expected = (t.float() * torch.tensor(scale, dtype=torch.float32)).to(dtype)
    scale_unless_one_(t, torch.tensor(scale, device=DEVICE))
    assert torch.equal(t, expected)

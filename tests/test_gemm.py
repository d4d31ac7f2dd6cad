"""The GEMM itself: every layout, both paths, dtypes, odd shapes, B in parts, batch dims.

Each result is compared with fp64 torch.matmul of the same inputs. On a CPU the
kernels run in Triton's interpreter (bf16 operands upcast there: see
codetta.matmul.mainloop), on a GPU compiled.
"""

import threading

import pytest
import torch
import torch.nn.functional as F

import codetta
from codetta import Config
from codetta import epilogue as ep
from codetta.matmul import launch
from conftest import DEVICE, INTERPRET

SHAPES = [(1, 1, 1), (1, 24, 8), (37, 50, 70), (64, 48, 16), (5, 130, 33)] if INTERPRET else [
    (1, 1, 1), (1, 24, 8), (37, 50, 70), (300, 500, 200), (1000, 768, 1024), (129, 257, 65)
]


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def tolerance(dtype, k):
    """Relative error allowed: fp32 accumulation over k, plus the output's own rounding."""
    return {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype] + 1e-6 * k**0.5


def operands(m, n, k, layout, dtype):
    """(a, b) for layout 'fwd' (x, W^T), 'dgrad' (dy, W) or 'wgrad' (dy^T, x)."""
    if layout == "fwd":
        return torch.randn(m, k, device=DEVICE, dtype=dtype), torch.randn(n, k, device=DEVICE, dtype=dtype).t()
    if layout == "dgrad":
        return torch.randn(m, k, device=DEVICE, dtype=dtype), torch.randn(k, n, device=DEVICE, dtype=dtype)
    return torch.randn(k, m, device=DEVICE, dtype=dtype).t(), torch.randn(k, n, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("layout", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("path", ["tma", "ptr"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_layouts_and_paths(layout, path, shape, monkeypatch):
    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    m, n, k = shape
    a, b = operands(m, n, k, layout, torch.float32)
    out = codetta.gemm(a, b)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_err(out, a.double() @ b.double()) < tolerance(torch.float32, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["fwd", "wgrad"])
def test_dtypes(dtype, layout):
    m, n, k = (45, 64, 48) if INTERPRET else (515, 1024, 768)
    a, b = operands(m, n, k, layout, dtype)
    out = codetta.gemm(a, b)
    assert out.dtype == dtype
    ref = a.double() @ b.double()
    assert rel_err(out, ref) < tolerance(dtype, k)
    # no worse than twice what torch's own GEMM in this dtype gives (rounding of the output)
    assert rel_err(out, ref) <= 2 * rel_err((a.float() @ b.float()).to(dtype), ref) + 1e-6


def test_batch_dims_flatten():
    x = torch.randn(2, 3, 40, device=DEVICE)
    w = torch.randn(24, 40, device=DEVICE)
    out = codetta.gemm(x, w.t())
    assert out.shape == (2, 3, 24)
    assert rel_err(out, x.double() @ w.double().t()) < 1e-5


@pytest.mark.parametrize("path", ["tma", "ptr"])
@pytest.mark.parametrize("sizes", [(16, 32, 16), (32, 64), (8, 40, 24, 8)], ids=str)
def test_b_in_parts_reads_as_concatenated(path, sizes, monkeypatch):
    """B as several [K, N_i] weights (QKV, gate/up) equals the concatenated matrix, no copy needed.

    Part sizes that are no multiple of the tile width (40, 24) must still be right: the
    launcher then takes the pointer path, which selects the part per column.
    """
    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    k = 36
    x = torch.randn(29, k, device=DEVICE)
    ws = [torch.randn(n, k, device=DEVICE) for n in sizes]
    out = codetta.gemm(x, [w.t() for w in ws])
    ref = x.double() @ torch.cat(ws).double().t()
    assert out.shape == (29, sum(sizes))
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("path", ["tma", "ptr"])
@pytest.mark.parametrize("sizes", [(32, 16, 16), (20, 13), (8, 40, 5, 11)], ids=str)
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_b_in_parts_along_k(path, sizes, layout, monkeypatch):
    """dx = dq W_q + dk W_k + dv W_v: B parts [K_i, N] read as concatenated along K, any K_i."""
    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    n = 24
    dy = torch.randn(19, sum(sizes), device=DEVICE)
    ws = [torch.randn(k, n, device=DEVICE) if layout == "kn" else torch.randn(n, k, device=DEVICE).t() for k in sizes]
    out = codetta.gemm(dy, ws)
    assert out.shape == (19, n)
    assert rel_err(out, dy.double() @ torch.cat(ws).double()) < 1e-5


@pytest.mark.parametrize("a_transposed", [False, True], ids=["a_mk", "a_km"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_b_in_parts_along_k_keeps_inf_of_the_next_part(dtype, a_transposed):
    """A part's last, partial K step reads A's next columns, which belong to the next part:
    an inf there must not meet the zero fill of this part's B (inf * 0 = NaN). With A and B
    positive, a row holding an inf is +inf everywhere, as torch gives, and the rest exact."""
    sizes, n = (40, 24), 32
    k = sum(sizes)
    a = torch.rand(k, 24, device=DEVICE).t() if a_transposed else torch.rand(24, k, device=DEVICE)
    a[3, sizes[0] + 3] = float("inf")  # in part 1, inside part 0's partial K step for any BK >= 8
    ws = [torch.rand(size, n, device=DEVICE) + 0.5 for size in sizes]
    a, ws = a.to(dtype), [w.to(dtype) for w in ws]
    assert codetta.explain(a, ws)["path"] == "tma"
    out = codetta.gemm(a, ws).double()
    ref = a.double() @ torch.cat(ws).double()
    assert torch.equal(out[3], ref[3]) and bool(torch.isinf(ref[3]).all())
    finite = torch.arange(24, device=DEVICE) != 3
    assert rel_err(out[finite], ref[finite]) < tolerance(dtype, k)


def test_b_parts_in_dgrad_layout():
    x = torch.randn(20, 24, device=DEVICE)
    parts = [torch.randn(24, 16, device=DEVICE), torch.randn(24, 32, device=DEVICE)]
    out = codetta.gemm(x, parts)
    assert rel_err(out, x.double() @ torch.cat(parts, 1).double()) < 1e-5


@pytest.mark.parametrize("split, flatten", [(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)])
def test_explicit_config_and_epilogue_split(split, flatten):
    """A config given by the caller is used as is; EPI_SPLIT=2 (4) runs the epilogue on tile halves (quarters);
    FLATTEN compiles one flattened loop (on a GPU; the interpreter runs the same code)."""
    cfg = Config(BM=16, BN=32, BK=16, GROUP_M=2, STAGES=1, num_warps=4, EPI_SPLIT=split, FLATTEN=flatten) if INTERPRET \
        else Config(BM=128, BN=128, BK=64, GROUP_M=8, STAGES=3, num_warps=8, EPI_SPLIT=split, FLATTEN=flatten)
    a, b = operands(70, 100, 40, "fwd", torch.float32)
    assert codetta.explain(a, b, config=cfg)["config"] == cfg
    assert rel_err(codetta.gemm(a, b, config=cfg), a.double() @ b.double()) < 1e-5


@pytest.mark.parametrize("bn, path", [(16, "ptr"), (32, "tma")])
def test_a_given_config_whose_tma_blocks_are_too_narrow_takes_the_pointer_path(bn, path):
    """bf16 output tiles of BN / EPI_SPLIT columns: 4 columns are 8 bytes, under TMA's 16-byte
    minimum, so the pointer path runs them (found by a probe: Triton's descriptor error)."""
    cfg = Config(BM=16, BN=bn, BK=16, GROUP_M=2, STAGES=1, num_warps=4, EPI_SPLIT=4)
    a, b = operands(32, 64, 32, "fwd", torch.bfloat16)
    assert codetta.explain(a, b, config=cfg)["path"] == path
    assert rel_err(codetta.gemm(a, b, config=cfg), a.double() @ b.double()) < 8e-3


_GPU_SCHEDULES = {
    "flatten": Config(BM=128, BN=256, BK=64, GROUP_M=8, STAGES=3, num_warps=8, EPI_SPLIT=2, FLATTEN=True),
    "two_ctas_per_sm": Config(BM=128, BN=128, BK=64, GROUP_M=8, STAGES=3, num_warps=4, EPI_SPLIT=2, CTAS_PER_SM=2),
    "two_ctas_per_sm_register_cap": Config(BM=128, BN=128, BK=64, GROUP_M=8, STAGES=2, num_warps=8, CTAS_PER_SM=2),
}


@pytest.mark.parametrize("schedule", _GPU_SCHEDULES)
def test_persistent_schedules_run_an_epilogue_program(schedule):
    """FLATTEN, or two CTAs per SM, with an epilogue that reads an aux tile, stores two outputs
    and reduces rows and columns: each tile's accumulator must reach its own epilogue (on a
    GPU, more tiles than programs: 32 x 12 tiles of 128 x 128 for 2 x 132 programs)."""
    from codetta import epilogue as ep

    m, n, k = (70, 100, 40) if INTERPRET else (4000, 1536, 1024)
    gpu = _GPU_SCHEDULES[schedule]
    cfg = Config(BM=16, BN=32, BK=16, GROUP_M=2, STAGES=1, num_warps=gpu.num_warps, FLATTEN=gpu.FLATTEN,
                 CTAS_PER_SM=gpu.CTAS_PER_SM) if INTERPRET else gpu
    p = ep.Program("flattened_residual")
    x = p.acc + p.aux("residual")
    p.store("x", x)
    p.store("y", ep.silu(x) * p.row("r"))
    p.row_sumsq("ss", x)
    p.col_sum("cs", x)
    a, b = operands(m, n, k, "fwd", torch.bfloat16)
    res, r = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16), torch.randn(m, device=DEVICE)
    out = codetta.gemm(a, b, p, config=cfg, residual=res, r=r)
    ref = a.double() @ b.double() + res.double()
    assert rel_err(out["x"], ref) < 8e-3
    assert rel_err(out["y"], ref * torch.sigmoid(ref) * r.double()[:, None]) < 8e-3
    assert rel_err(out["ss"], (ref * ref).sum(1)) < 1e-3
    assert rel_err(out["cs"], ref.sum(0)) < 1e-3


@pytest.mark.parametrize("path", ["tma", "ptr"])
def test_repeated_calls_reuse_the_plan_with_new_tensors(path, monkeypatch):
    """A second call with the same signature but other tensors and scalars (the plan's path, and on
    a GPU the compiled-kernel launch) writes its own results: every operand kind and output kind."""
    from codetta import epilogue as ep

    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    m, n, k = (37, 48, 40) if INTERPRET else (700, 512, 320)
    p = ep.Program("repeated_call")
    x = p.acc * p.row("r") + p.col("c") + p.aux("res") * p.scalar("s")
    p.store("x", x)
    p.store("acc_into", x, accumulate=True)
    p.row_sumsq("ss", x)
    p.col_sum("cs", x)
    p.row_logsumexp("lse", x)
    for call in range(3):
        a, b = operands(m, n, k, "fwd", torch.float32)
        r, c = torch.randn(m, device=DEVICE), torch.randn(n, device=DEVICE)
        res, into, s = torch.randn(m, n, device=DEVICE), torch.randn(m, n, device=DEVICE), float(call + 0.5)
        before = into.double()
        out = codetta.gemm(a, b, p, r=r, c=c, res=res, s=s, acc_into=into)
        if call == 0:
            plans = len(launch._PLANS)
        ref = (a.double() @ b.double()) * r.double()[:, None] + c.double() + res.double() * s
        assert out["acc_into"] is into and rel_err(into, before + ref) < 1e-5
        assert rel_err(out["x"], ref) < 1e-5
        assert rel_err(out["ss"], (ref * ref).sum(1)) < 1e-5
        assert rel_err(out["cs"], ref.sum(0)) < 1e-5
        assert rel_err(out["lse"], torch.logsumexp(ref, 1)) < 1e-5
    assert len(launch._PLANS) == plans


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's tiles; a GPU tunes its own")
def test_large_interpreter_tiles_within_and_the_usual_ones_after():
    """Inside ``large_interpreter_tiles`` a small GEMM runs on the interpreter's 64-wide tiles and
    is still exact; outside, before and after, it gets the usual 16-wide ones and the plans made
    outside are the same objects."""
    a, b = operands(40, 48, 24, "fwd", torch.float32)
    small = codetta.explain(a, b)["config"]
    plans = dict(launch._PLANS)
    with codetta.matmul.large_interpreter_tiles():
        large = codetta.explain(a, b)["config"]
        assert rel_err(codetta.gemm(a, b), a.double() @ b.double()) < 1e-5
    assert (small.BM, small.BN, large.BM, large.BN) == (16, 16, 64, 64)
    assert codetta.explain(a, b)["config"] == small and launch._PLANS == plans


@pytest.mark.parametrize("x_shape", [(3, 7, 40), (40,), (1, 40)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_linear_matches_torch_forward_and_backward(x_shape, with_bias):
    """codetta.linear against F.linear in fp64: output and the gradients of x, W and b."""
    x = torch.randn(*x_shape, device=DEVICE, requires_grad=True)
    w = torch.randn(56, 40, device=DEVICE, requires_grad=True)
    bias = torch.randn(56, device=DEVICE, requires_grad=True) if with_bias else None
    leaves = [t for t in (x, w, bias) if t is not None]
    refs = [t.detach().double().requires_grad_() for t in leaves]
    ref = torch.nn.functional.linear(*refs[:2], refs[2] if with_bias else None)
    y = codetta.linear(x, w, bias)
    assert y.shape == ref.shape and rel_err(y, ref) < 1e-5
    dy = torch.randn(ref.shape, device=DEVICE)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_grads = torch.autograd.grad(ref, refs, dy.double())
    for name, g, g_ref in zip("xwb", grads, ref_grads):
        assert g.shape == g_ref.shape and rel_err(g, g_ref) < 1e-5, name


def test_linear_custom_ops_pass_opcheck():
    x, w, b = (torch.randn(*s, device=DEVICE, requires_grad=True) for s in ((5, 8), (6, 8), (6,)))
    torch.library.opcheck(torch.ops.codetta.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.codetta.linear.default, (x, w, None))
    for needs in ((True, True), (False, True), (True, False)):  # dx, dW: what autograd asks for
        torch.library.opcheck(torch.ops.codetta.linear_backward.default, (torch.randn(5, 6, device=DEVICE), x.detach(),
                                                                           w.detach(), True, *needs))


def test_explain_reports_path():
    a, b = operands(33, 48, 32, "fwd", torch.float32)
    assert codetta.explain(a, b)["path"] == "tma"
    # rows of 5 fp32 values are not 16-byte aligned: TMA cannot read them
    a5 = torch.randn(33, 5, device=DEVICE)
    assert codetta.explain(a5, torch.randn(5, 48, device=DEVICE))["path"] == "ptr"


def test_explain_refuses_what_gemm_may_not_write():
    """explain tunes (on a GPU) by launching the kernel into out= as gemm would: an out= that
    overlaps a, or a leaf that requires grad, is refused by explain as by gemm, and what it may
    write counts as written."""
    a, b = torch.randn(16, 16, device=DEVICE), torch.randn(16, 16, device=DEVICE)
    with pytest.raises(codetta.GemmError, match="shares memory with a"):
        codetta.explain(a, b, out=a)
    with pytest.raises(codetta.GemmError, match="would write out\\['out'\\] in place, which requires grad"):
        codetta.explain(a, b, out=torch.zeros(16, 16, device=DEVICE, requires_grad=True))
    out = torch.empty(16, 16, device=DEVICE)
    before = out._version
    assert codetta.explain(a, b, out=out)["path"] in ("tma", "ptr")
    assert out._version > before


# How the TMA mainloop reads interleave(b0, b1) of two weights W [f, k] (b = W.t()): through one descriptor of
# both, whichever lies below in memory; through two where they cannot share one.
INTERLEAVED_READING = {"nk": "interleave_one", "nk_b1_below_b0": "interleave_one_swapped",
                       "nk_row_strides_differ": "interleave", "nk_one_tensor_twice": "interleave", "kn": "interleave"}


def interleaved_parts(layout, k, f):
    rows = torch.randn(2, f, k + 8, device=DEVICE)
    w0, w1 = rows[0, :, :k], rows[1, :, :k]  # row stride k + 8, w0 below w1
    return {"nk": (w0.t(), w1.t()), "nk_b1_below_b0": (w1.t(), w0.t()),
            "nk_row_strides_differ": (w0.t(), w1.contiguous().t()), "nk_one_tensor_twice": (w0.t(), w0.t()),
            "kn": (torch.randn(k, f, device=DEVICE), torch.randn(k, f, device=DEVICE))}[layout]


@pytest.mark.parametrize("path", ["tma", "ptr"])
@pytest.mark.parametrize("layout", list(INTERLEAVED_READING))
def test_interleaved_b(path, layout, monkeypatch):
    """interleave(b0, b1): column 2j from b0, 2j + 1 from b1 (gate/up side by side), no copy."""
    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    k, f = 40, 24
    x = torch.randn(27, k, device=DEVICE)
    b0, b1 = interleaved_parts(layout, k, f)
    out = codetta.gemm(x, codetta.interleave(b0, b1))
    ref = x.double() @ torch.stack([b0, b1], dim=2).reshape(k, 2 * f).double()
    assert out.shape == (27, 2 * f)
    assert rel_err(out, ref) < 1e-5
    plan = codetta.explain(x, codetta.interleave(b0, b1))
    assert (plan["path"], plan["b_parts"]) == (path, INTERLEAVED_READING[layout] if path == "tma" else "interleave")


@pytest.mark.parametrize("layout", ["nk", "nk_b1_below_b0"])
def test_interleaved_b_with_a_flattened_loop_and_a_pair_epilogue(layout):
    """Two weights through one descriptor, one K loop per tile: a flattened tile loop (FLATTEN) and
    an epilogue over the (b0, b1) column pairs, on epilogue slices."""
    cfg = Config(BM=16, BN=32, BK=16, GROUP_M=2, STAGES=1, num_warps=4, EPI_SPLIT=2, FLATTEN=True) if INTERPRET \
        else Config(BM=128, BN=128, BK=32, GROUP_M=8, STAGES=3, num_warps=8, EPI_SPLIT=2, FLATTEN=True)
    m, k, f = (45, 40, 56) if INTERPRET else (700, 320, 1088)
    p = ep.Program("interleaved_silu_glu")
    gate, up = ep.pairs(p.acc)
    p.store("y", ep.silu(gate) * up, dtype=torch.float32)
    x = torch.randn(m, k, device=DEVICE)
    b0, b1 = interleaved_parts(layout, k, f)
    y = codetta.gemm(x, codetta.interleave(b0, b1), p, config=cfg)["y"]
    ref = F.silu(x.double() @ b0.double()) * (x.double() @ b1.double())
    assert codetta.explain(x, codetta.interleave(b0, b1), p, config=cfg)["b_parts"] == INTERLEAVED_READING[layout]
    assert rel_err(y, ref) < 1e-5


@pytest.mark.skipif(INTERPRET, reason="gigabytes of GPU memory between the weights")
@pytest.mark.parametrize("gib_apart, reading", [(1.5, "interleave_one"), (3, "interleave")])
@pytest.mark.parametrize("b1_below_b0", [False, True])
def test_interleaved_weights_far_apart_in_memory(gib_apart, reading, b1_below_b0):
    """Two weights GiBs apart, as two parameters may lie on an H200: one descriptor of both where
    it spans less than 2^31 bytes, else two (Triton sums the span in a C int); exact either way."""
    k, f = 128, 320
    gap = int(gib_apart * 2**29)  # elements of bf16
    memory = torch.randn(gap + f * k, device=DEVICE, dtype=torch.bfloat16)
    low, high = memory[: f * k].view(f, k), memory[gap:].view(f, k)
    w0, w1 = (high, low) if b1_below_b0 else (low, high)
    x = torch.randn(300, k, device=DEVICE, dtype=torch.bfloat16)
    out = codetta.gemm(x, codetta.interleave(w0.t(), w1.t()))
    ref = torch.stack([x.double() @ w0.double().t(), x.double() @ w1.double().t()], dim=2).reshape(300, 2 * f)
    if reading == "interleave_one" and b1_below_b0:
        reading = "interleave_one_swapped"
    assert codetta.explain(x, codetta.interleave(w0.t(), w1.t()))["b_parts"] == reading
    assert rel_err(out, ref) < 1e-2


def test_interleaved_parts_too_far_apart_for_one_descriptor_take_two(monkeypatch):
    """Where one descriptor of both parts would span too many bytes, each part has its own."""
    from codetta.matmul import path
    k, f = 32, 24
    x, w = torch.randn(27, k, device=DEVICE), torch.randn(2, f, k, device=DEVICE)
    last_byte = w[1].data_ptr() - w[0].data_ptr() + (w[1].numel() - 1) * w.element_size()
    for limit, reading in ((last_byte, "interleave"), (last_byte + 1, "interleave_one")):
        monkeypatch.setattr(path, "_MAX_PAIR_SPAN", limit)
        monkeypatch.setattr(launch, "_PLANS", {})
        out = codetta.gemm(x, codetta.interleave(w[0].t(), w[1].t()))
        assert codetta.explain(x, codetta.interleave(w[0].t(), w[1].t()))["b_parts"] == reading
        assert rel_err(out, torch.stack([x.double() @ w[0].double().t(), x.double() @ w[1].double().t()], 2)
                       .reshape(27, 2 * f)) < 1e-5


@pytest.mark.parametrize("n_parts", [1, 3])
def test_interleaved_of_other_than_two_parts_is_refused(n_parts):
    from codetta.matmul.call import Interleaved
    b = torch.randn(8, 4, device=DEVICE)
    with pytest.raises(codetta.GemmError, match="interleave"):
        codetta.gemm(torch.randn(2, 8, device=DEVICE), Interleaved((b,) * n_parts))


def test_calls_from_several_threads_at_once():
    """Threads calling codetta.gemm at the same time each get their own, right result (under
    Triton's interpreter, whose kernels patch triton.language while they run, they take turns)."""
    p = ep.Program("threads_swiglu_rowsum")
    gate, up = ep.pairs(p.acc)
    p.store("y", ep.silu(gate) * up + p.scalar("shift"), dtype=torch.float32)
    p.row_sum("s", p.acc)
    failures = []

    def work(seed):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        for _ in range(6):
            a = torch.randn(20, 8, generator=gen).to(DEVICE)
            b = torch.randn(8, 32, generator=gen).to(DEVICE)
            try:
                out = codetta.gemm(a, b, p, shift=float(seed))
            except Exception as exc:  # noqa: BLE001 - reported below, with the thread's seed
                failures.append((seed, repr(exc)))
                return
            acc = a.double() @ b.double()
            want = F.silu(acc[:, 0::2]) * acc[:, 1::2] + seed
            if not (torch.allclose(out["y"].double(), want, atol=1e-4) and torch.allclose(out["s"].double(), acc.sum(1),
                                                                                           atol=1e-4)):
                failures.append((seed, "wrong result"))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures

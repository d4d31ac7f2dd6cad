"""Epilogue programs under the split-epilogue schedule, and names that the generated kernel also uses.

* EPI_SPLIT = 2 (4) runs the program on the column halves (quarters) of each tile one after the
  other. When the last tile is at most half (three quarters) full its last slices hold no
  column: whole-row reductions must then write no partial (it would land in the next row's
  first partial). The tuner picks such configs on a GPU (e.g. 128 x 256, split 2, for N = 384).
* Operand and output names become identifiers of the generated kernel: a scalar named
  ``tile`` or ``M``, a row vector named ``mma``, a store named ``a`` must mean that
  operand, not the kernel's own variable.

Expected values are fp64 math written here.
"""

import pytest
import torch

import codetta
from codetta import Config
from codetta import epilogue as ep
from conftest import DEVICE, INTERPRET


def split_config(bn, dtype=torch.float32, split=2):
    """EPI_SPLIT = split with BN columns: on a GPU with 16-bit inputs the config the tuner picked where
    the bug showed (N = 384, split 2), with fp32 inputs one that fits their shared memory."""
    if INTERPRET:
        return Config(BM=16, BN=bn, BK=16, GROUP_M=2, STAGES=1, num_warps=4, EPI_SPLIT=split)
    if dtype == torch.float32:
        return Config(BM=64, BN=bn, BK=32, GROUP_M=8, STAGES=2, num_warps=4, EPI_SPLIT=split)
    return Config(BM=128, BN=bn, BK=64, GROUP_M=8, STAGES=3, num_warps=8, EPI_SPLIT=split)


def rel_err(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# (BN, N): the last tile holds 1/4, 1/2 or 3/4 of BN, or a single tile 1/4 (quarters empty or
# not, halves empty or not).
SPLIT_CASES = [(32, 40), (32, 48), (32, 56), (32, 8)] if INTERPRET else [(256, 320), (256, 384), (256, 640), (256, 448)]


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("bn, n", SPLIT_CASES)
def test_whole_row_reductions_under_split_epilogue(bn, n, split):
    m, k = (37, 24) if INTERPRET else (1000, 256)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    a = torch.randn(m, k, device=DEVICE).to(dtype)
    b = (torch.randn(k, n, device=DEVICE) / k**0.5).to(dtype)
    p = ep.Program("split_row_reductions")
    x = p.acc * p.row("r")
    p.row_sum("s", x)
    p.row_sumsq("ss", x)
    p.row_max("mx", x)
    p.row_logsumexp("lse", x)
    p.row_sum("half_s", ep.pairs(x)[1])  # over the N/2 pairs
    p.col_sum("cs", x)
    r = torch.rand(m, device=DEVICE) + 0.5
    out = codetta.gemm(a, b, p, config=split_config(bn, dtype, split), r=r)
    ref = (a.double() @ b.double()) * r.double()[:, None]
    assert rel_err(out["s"], ref.sum(1)) < 1e-5
    assert rel_err(out["ss"], (ref * ref).sum(1)) < 1e-5
    assert rel_err(out["mx"], ref.amax(1)) < 1e-5
    assert rel_err(out["lse"], ref.logsumexp(1)) < 1e-5
    assert rel_err(out["half_s"], ref[:, 1::2].sum(1)) < 1e-5
    assert rel_err(out["cs"], ref.sum(0)) < 1e-5


def test_logsumexp_of_rows_holding_inf():
    """+inf in a row gives +inf (as torch.logsumexp), whole-row and per segment; -inf rows give -inf."""
    m, n = 5, 40
    x = torch.randn(m, n, device=DEVICE)
    x[0, 3] = float("inf")
    x[1, 17] = float("inf")
    x[1, 30] = float("inf")
    x[2] = float("-inf")
    x[3, 9] = float("-inf")
    p = ep.Program("lse_of_inf")
    v = p.acc * 0.0 + p.aux("x")
    p.row_logsumexp("lse", v)
    p.row_logsumexp("seg_lse", v, segment=8)
    a = torch.randn(m, 4, device=DEVICE)
    out = codetta.gemm(a, torch.randn(4, n, device=DEVICE), p, x=x)
    ref = x.double().cpu()
    torch.testing.assert_close(out["lse"].cpu().double(), ref.logsumexp(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out["seg_lse"].cpu().double(), ref.reshape(m, 5, 8).logsumexp(2), rtol=1e-6, atol=1e-6)
    ref_prog = codetta.run_reference(p, a, torch.randn(4, n, device=DEVICE), {"x": x})
    torch.testing.assert_close(ref_prog["lse"].cpu().double(), ref.logsumexp(1), rtol=1e-6, atol=1e-6)


# Identifiers of the generated kernel and its module (parameters, locals, imported functions).
KERNEL_NAMES = ["tile", "num_tiles", "left", "right", "q0", "q3", "column_halves", "M", "N", "K", "acc", "BM", "off_m", "pid_n", "b_starts",
                "stride_a0", "INTERPRET", "EMULATE_RNE", "tl", "triton", "cast", "rows", "rows64", "row_ok", "cols",
                "first", "second", "v0", "v1", "slice_ok", "epilogue_fn", "for", "mma", "tile_coords"]


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("path", ["tma", "ptr"])
def test_operand_and_output_names_of_the_kernels_own(path, split, monkeypatch):
    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    m, n, k = (21, 64, 16) if INTERPRET else (300, 512, 64)
    a = torch.randn(m, k, device=DEVICE)
    b = torch.randn(k, n, device=DEVICE) / k**0.5
    acc = a.double() @ b.double()
    p = ep.Program("kernel_names")
    scalars = KERNEL_NAMES[: len(KERNEL_NAMES) // 2]
    y = p.acc
    for i, name in enumerate(scalars):
        y = y + p.scalar(name) * float(i + 1)
    y = y * p.row("mma") + p.col("a_s0") + p.aux("cast")
    p.store("a", y)
    p.store("b", y * 2.0, dtype=torch.float32)
    p.row_sum("M_part", y)
    operands = {name: 0.01 * (i + 1) for i, name in enumerate(scalars)}
    r, c, aux = torch.rand(m, device=DEVICE) + 0.5, torch.randn(n, device=DEVICE), torch.randn(m, n, device=DEVICE)
    bn = 32 if INTERPRET else 256
    cfg = split_config(bn, split=split) if split > 1 else None
    out = codetta.gemm(a, b, p, config=cfg, mma=r, a_s0=c, cast=aux, **operands)
    shift = sum(0.01 * (i + 1) * (i + 1) for i in range(len(scalars)))
    ref = (acc + shift) * r.double()[:, None] + c.double() + aux.double()
    assert rel_err(out["a"], ref) < 1e-5
    assert rel_err(out["b"], 2 * ref) < 1e-5
    assert rel_err(out["M_part"], ref.sum(1)) < 1e-5


@pytest.mark.parametrize("name", ["out", "a", "b", "epilogue", "config"])
def test_accumulating_store_named_like_a_gemm_parameter_is_refused(name):
    p = ep.Program("accumulate_named_" + name)
    with pytest.raises(codetta.EpilogueError, match="parameter of codetta.gemm"):
        p.store(name, p.acc, accumulate=True)

"""A store per part of B (``Program.store(..., per_b_part=True)``): each part's columns in a tensor
of its own, on both paths and in the reference executor, against fp64 PyTorch."""

import pytest
import torch

import codetta
from codetta import epilogue as ep
from conftest import DEVICE, INTERPRET


def scaled_program(name="per_part"):
    """y = 2 r acc, stored per part of B; the row sums of r acc beside it (a second output)."""
    p = ep.Program(name)
    z = p.acc * p.row("r")
    p.store("y", z * 2.0, per_b_part=True)
    p.row_sum("s", z)
    return p


def expected(a, weights, r):
    z = a.double().reshape(-1, a.shape[-1]) @ torch.cat(weights).double().t() * r.double().reshape(-1, 1)
    return z * 2.0, z.sum(1)


# (M, K, part widths, dtype): parts whole tiles of the TMA path, and parts of any width (pointers)
CASES = [(37, 24, (32, 16, 16), torch.float32), (37, 24, (16, 8, 24), torch.float32),
         (5, 3, (3, 5), torch.float32), (70, 64, (64, 8, 16, 24), torch.bfloat16),
         (130, 48, (64, 64, 128), torch.float16)] if INTERPRET else \
        [(1000, 512, (2048, 512, 512), torch.bfloat16), (777, 328, (40, 8, 24), torch.float16),
         (4096, 1024, (1024, 256, 256, 512), torch.bfloat16), (300, 256, (384, 128), torch.float32)]


@pytest.mark.parametrize("path", ["auto", "ptr"])
@pytest.mark.parametrize("m, k, widths, dtype", CASES, ids=str)
def test_each_part_in_a_tensor_of_its_own(m, k, widths, dtype, path, monkeypatch):
    if path == "ptr":
        monkeypatch.setenv("CODETTA_PATH", "ptr")
    torch.manual_seed(m + k)
    a = torch.randn(m, k, device=DEVICE, dtype=dtype)
    weights = [torch.randn(n, k, device=DEVICE, dtype=dtype) / k ** 0.5 for n in widths]
    r = torch.rand(m, device=DEVICE) + 0.5
    p = scaled_program()
    b = [w.t() for w in weights]
    out = codetta.gemm(a, b, p, r=r)
    y, s = expected(a, weights, r)
    assert isinstance(out["y"], tuple) and [t.shape for t in out["y"]] == [(m, n) for n in widths]
    assert all(t.dtype == dtype and t.is_contiguous() for t in out["y"])
    assert len({t.untyped_storage().data_ptr() for t in out["y"]}) == len(widths)  # apart
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(out["y"], y.split(widths, dim=1)):
        assert (got.double() - want).abs().max() <= tol * (1 + want.abs().max())
    assert torch.allclose(out["s"].double(), s, rtol=1e-4, atol=1e-3 * k ** 0.5)
    ref = ep.run_reference(p, a, b, dict(r=r))
    assert isinstance(ref["y"], tuple) and [t.shape for t in ref["y"]] == [t.shape for t in out["y"]]
    for got, want in zip(out["y"], ref["y"]):  # the two executors: the same roundings but for fp32 sums
        assert (got.double() - want.double()).abs().max() <= tol * (1 + want.double().abs().max())
    if path == "auto" and all(n % 16 == 0 for n in widths):
        assert codetta.explain(a, b, p, r=r)["path"] == "tma"


def test_leading_dims_and_a_single_part():
    a = torch.randn(2, 9, 16, device=DEVICE)
    w = torch.randn(24, 16, device=DEVICE)
    r = torch.rand(2, 9, device=DEVICE)
    (y,) = codetta.gemm(a, w.t(), scaled_program(), r=r)["y"]
    assert y.shape == (2, 9, 24)
    assert torch.allclose(y.double(), expected(a, [w], r)[0].reshape(2, 9, 24), rtol=1e-5, atol=1e-5)


def test_an_empty_part_keeps_its_place():
    a = torch.randn(9, 8, device=DEVICE)
    weights = [torch.randn(8, 8, device=DEVICE), torch.randn(0, 8, device=DEVICE), torch.randn(16, 8, device=DEVICE)]
    r = torch.rand(9, device=DEVICE)
    out = codetta.gemm(a, [w.t() for w in weights], scaled_program(), r=r)["y"]
    assert [t.shape for t in out] == [(9, 8), (9, 0), (9, 16)]
    want = expected(a, weights, r)[0]
    assert torch.allclose(out[0].double(), want[:, :8], rtol=1e-5, atol=1e-5)
    assert torch.allclose(out[2].double(), want[:, 8:], rtol=1e-5, atol=1e-5)
    empty_rows = codetta.gemm(a[:0], [w.t() for w in weights], scaled_program(), r=r[:0])["y"]
    assert [t.shape for t in empty_rows] == [(0, 8), (0, 0), (0, 16)]


def test_refused_where_it_cannot_be():
    p = ep.Program("per_part_refused")
    with pytest.raises(ep.EpilogueError, match="per_b_part must be a bool"):
        p.store("y", p.acc, per_b_part=1)
    with pytest.raises(ep.EpilogueError, match="not accumulated"):
        p.store("y", p.acc, accumulate=True, per_b_part=True)
    gate, up = ep.pairs(p.acc)
    with pytest.raises(ep.EpilogueError, match="over all N columns"):
        p.store("y", gate * up, per_b_part=True)
    a = torch.randn(8, 16, device=DEVICE)
    w = torch.randn(32, 16, device=DEVICE)
    q = scaled_program("per_part_calls")
    with pytest.raises(ep.EpilogueError, match="interleaved"):
        codetta.gemm(a, codetta.interleave(w[:16].t(), w[16:].t()), q, r=torch.ones(8, device=DEVICE))
    with pytest.raises(ep.EpilogueError, match="parts along K"):
        codetta.gemm(a, [w[:, :8].t(), w[:, 8:].t()], q, r=torch.ones(8, device=DEVICE))  # [K_i, N] along K
    with pytest.raises(ep.EpilogueError, match="allocated by the call"):
        codetta.gemm(a, w.t(), q, r=torch.ones(8, device=DEVICE), out={"y": torch.empty(8, 32, device=DEVICE)})


def test_the_program_names_its_structure():
    """per_b_part changes the kernel (its fingerprint), not only the call."""
    def program(per_b_part):
        p = ep.Program("fingerprint")
        p.store("y", p.acc, per_b_part=per_b_part)
        return p

    assert program(True).fingerprint() != program(False).fingerprint()

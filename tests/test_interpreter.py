"""Triton's CPU interpreter as codetta runs it: triton.language patched once per launch
(codetta.interpreter.skip_repeated_language_patches), kernels with nested jit functions still
right, and triton.language as it was after each launch."""

import pytest
import torch
import triton
import triton.language as tl

from codetta.interpreter import skip_repeated_language_patches  # importing codetta turns it on
from conftest import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="Triton's CPU interpreter")


@triton.jit
def _softplus(x):
    return tl.log(1.0 + tl.exp(x))


@triton.jit
def _plain_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, tl.log(1.0 + tl.exp(x)), mask=offs < n)


@triton.jit
def _nested_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, TIMES: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    for _ in tl.static_range(TIMES):
        x = _softplus(x)
    tl.store(out_ptr + offs, x, mask=offs < n)


def _attributes_set(monkeypatch, launch) -> int:
    """How many attributes Triton's interpreter sets to patch triton.language during ``launch()``."""
    from triton.runtime import interpreter

    count = [0]
    original = interpreter._LangPatchScope.set_attr

    def counting(self, obj, name, value):
        count[0] += 1
        original(self, obj, name, value)

    monkeypatch.setattr(interpreter._LangPatchScope, "set_attr", counting)
    launch()
    monkeypatch.setattr(interpreter._LangPatchScope, "set_attr", original)
    return count[0]


def test_nested_jit_calls_do_not_patch_the_language_again(monkeypatch):
    assert skip_repeated_language_patches()  # applied at codetta's import; a second call changes nothing
    x = torch.randn(37, dtype=torch.float32)
    plain, nested = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    n_plain = _attributes_set(monkeypatch, lambda: _plain_kernel[(3,)](x, plain, x.numel(), BLOCK=16))
    n_nested = _attributes_set(monkeypatch, lambda: _nested_kernel[(3,)](x, nested, x.numel(), BLOCK=16, TIMES=3))
    assert n_plain > 100 and n_nested == n_plain  # 3 programs x 3 nested calls would set 10x as many
    want = x.double()
    for _ in range(3):
        want = torch.nn.functional.softplus(want)
    torch.testing.assert_close(plain, torch.nn.functional.softplus(x.double()).float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(nested, want.float(), rtol=1e-6, atol=1e-6)


def test_the_language_is_as_it_was_after_a_launch():
    before = {name: getattr(tl, name) for name in ("range", "static_range", "program_id", "load", "exp")}
    x = torch.randn(20)
    out = torch.empty_like(x)
    _nested_kernel[(2,)](x, out, x.numel(), BLOCK=16, TIMES=2)
    _nested_kernel[(2,)](x, out, x.numel(), BLOCK=16, TIMES=2)  # a second launch patches (and restores) again
    assert {name: getattr(tl, name) for name in before} == before
    want = torch.nn.functional.softplus(torch.nn.functional.softplus(x.double())).float()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)

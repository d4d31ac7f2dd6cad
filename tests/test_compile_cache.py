"""torch.compile's on-disk caches are keyed on codetta's code (codetta.ops.compile_cache).

PyTorch keys a cached compiled backward on the forward graph alone (pytorch/pytorch#144344):
without codetta's digest in the key, a graph cached under another codetta would be reused
(seen: its backward op called with arguments this codetta's no longer takes).
"""

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

import codetta
from conftest import DEVICE

_NO_CXX = DEVICE == "cpu" and not (shutil.which("c++") or shutil.which("g++"))


def test_the_cache_key_tag_holds_a_digest_of_codettas_source():
    package = Path(codetta.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    assert f"codetta-{digest.hexdigest()[:16]}" in torch.compiler.config.cache_key_tag.split("+")


@pytest.mark.skipif(_NO_CXX, reason="inductor on a CPU needs a C++ compiler")
def test_a_graph_cached_under_other_codetta_code_is_not_reused(tmp_path, monkeypatch):
    """The same compiled function, three times from an empty cache: a miss, a hit, and a miss once
    the tag names other code (as another codetta's digest would)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    counters = torch._dynamo.utils.counters
    x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(12, 16, device=DEVICE, requires_grad=True)

    def cache_hits_of_a_fresh_compile():
        torch._dynamo.reset()
        counters.clear()
        torch.compile(codetta.linear, backend="inductor", fullgraph=True)(x, w).sum().backward()
        return counters["aot_autograd"]["autograd_cache_hit"]

    try:
        assert cache_hits_of_a_fresh_compile() == 0
        assert cache_hits_of_a_fresh_compile() == 1
        tag = torch.compiler.config.cache_key_tag
        with torch.compiler.config.patch(cache_key_tag=tag.replace("codetta-", "codetta-other-")):
            assert cache_hits_of_a_fresh_compile() == 0
        assert torch.compiler.config.cache_key_tag == tag  # restored (pytest's monkeypatch deleted the entry)
    finally:
        torch._dynamo.reset()

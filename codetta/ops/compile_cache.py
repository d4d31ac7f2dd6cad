"""torch.compile's on-disk caches keyed on codetta's code.

PyTorch keys a cached compiled graph (AOTAutograd's and TorchInductor's caches, on disk
across processes) on the graph traced by Dynamo, which names codetta's custom ops but holds
neither their code nor their schemas (pytorch/pytorch#144344): a cache written under another
codetta would hand this one's ops a stale backward: an error where a backward op's arguments
changed ("missing value for argument"), silently wrong gradients where only its math did.
So codetta adds a digest of its own source to ``torch.compiler.config.cache_key_tag``, a
string PyTorch puts in every such cache key; a user's own tag is kept in front of it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

_PACKAGE = Path(__file__).resolve().parents[1]


def source_digest() -> str:
    """A digest of every Python file of the installed codetta (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(_PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def key_compile_caches_on_source() -> None:
    """Append ``codetta-<digest>`` to the compile caches' key tag (once)."""
    config = torch.compiler.config
    mark = f"codetta-{source_digest()}"
    if hasattr(config, "cache_key_tag") and mark not in config.cache_key_tag:
        config.cache_key_tag = f"{config.cache_key_tag}+{mark}" if config.cache_key_tag else mark

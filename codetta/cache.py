"""Where codetta keeps what it writes between runs: generated kernels and tuning results."""

import os
from pathlib import Path


def cache_root() -> Path:
    """``$CODETTA_CACHE_DIR``, or ``~/.cache/codetta`` when it is unset or empty."""
    return Path(os.environ.get("CODETTA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "codetta"))

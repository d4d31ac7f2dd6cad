"""Where codetta keeps what it writes between runs (generated kernels and tuning results), and
how it writes there."""

import os
import threading
from pathlib import Path


def cache_root() -> Path:
    """``$CODETTA_CACHE_DIR`` (``~`` expanded), or ``~/.cache/codetta`` when it is unset or empty."""
    return Path(os.environ.get("CODETTA_CACHE_DIR") or os.path.join("~", ".cache", "codetta")).expanduser()


def write_atomically(file: Path, text: str):
    """Write ``text`` to ``file`` through a temporary file beside it and one rename: a reader sees
    the old file or the new one, never a part of one. The file gets the permissions ``open``
    gives a new file (the umask's: another user of a shared cache folder may read it), and a
    failed write leaves no temporary file behind."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, file)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

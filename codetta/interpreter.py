"""Whether codetta's kernels run in Triton's CPU interpreter."""

import functools
import os
import threading

# Triton's interpreter patches triton.language's functions for the duration of a kernel: two
# kernels interpreted at once from two threads see each other's patches come and go (a launch
# then fails with "Did you forget to add @triton.jit ?"). codetta's interpreted launches take
# turns under this lock.
INTERPRETER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, or true, yes, on,
    y: Triton's own reading). Triton decides that when it decorates the kernels, at import; so
    it is read once."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")

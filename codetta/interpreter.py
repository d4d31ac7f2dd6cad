"""Whether codetta's kernels run in Triton's CPU interpreter."""

import threading

from triton import knobs

from .versions import release

# Triton's interpreter patches triton.language's functions for the duration of a kernel: two
# kernels interpreted at once from two threads see each other's patches come and go (a launch
# then fails with "Did you forget to add @triton.jit ?"). codetta's interpreted launches take
# turns under this lock.
INTERPRETER_LOCK = threading.Lock()


# Read at codetta's import, once (codetta/__init__.py sets it first where there is no GPU), as
# Triton reads it when it decorates the kernels. A module constant, not a cached function:
# torch.compile takes it as a constant (it warns about tracing through functools' caches). Triton's
# own reading of the variable, so that the two never disagree (" 1" is not true to Triton).
_INTERPRETING = bool(knobs.runtime.interpret)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, or true, yes, on,
    y, as Triton reads it)."""
    return _INTERPRETING


def interpreter_problem():
    """Why Triton's interpreter cannot run codetta's kernels with the installed packages, or None.
    Triton 3.6 and earlier convert one-element numpy arrays to Python scalars, which numpy 2.4
    refuses ("only 0-dimensional arrays can be converted to Python scalars", in every launch)."""
    import numpy
    import triton

    if release(triton.__version__) < (3, 7) and release(numpy.__version__) >= (2, 4):
        return (f"Triton {triton.__version__}'s CPU interpreter cannot run under numpy {numpy.__version__} (it "
                "needs numpy < 2.4, or Triton 3.7 or newer)")
    return None

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


def skip_repeated_language_patches() -> bool:
    """Make Triton's interpreter patch triton.language once per launch, not once per call of a
    @triton.jit function inside the kernel too; whether it could (False: this Triton has no such
    patching, and is left as it is).

    The interpreter runs a kernel as Python with triton.language's functions swapped for numpy
    ones (``_patch_lang``: some 200 attributes set), at each launch and again at each call of a
    jit function from inside it, which sets the same attributes to equivalent values. Those
    repeated patches took half the time of codetta's interpreted training steps (the epilogue
    helpers are jit functions, called by every program of the grid). A call that finds every
    triton.language module its function sees already patched (by this launch: the launch's own
    patch is undone when it ends) now skips them; the launch's own patch runs as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch, scope_class = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if patch is None or scope_class is None or getattr(patch, "skips_repeats", False):
        return patch is not None and scope_class is not None
    patched_range = {}  # id(module) -> the `range` the last patch of that module set

    def patch_once(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        if langs and all(patched_range.get(id(lang)) is getattr(lang, "range", None) for lang in langs):
            return scope_class()  # nothing to undo
        scope = patch(fn)
        patched_range.update((id(lang), getattr(lang, "range", None)) for lang in langs)
        return scope

    patch_once.skips_repeats = True
    interpreter._patch_lang = patch_once
    return True

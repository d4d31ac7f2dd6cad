"""Launching codetta's row-wise Triton kernels with little host time.

Triton's JIT launch binds the arguments, works out their specialization and looks up the
compiled kernel on every call: about 50 µs of host time per launch on the H200 machine's
CPU, more than many of these kernels take on the GPU. :func:`launch` does that once per
specialization and then calls the compiled kernel directly. Its key is at least as fine as
Triton's own specialization: per tensor its dtype, device and 16-byte alignment; per
integer its width class, divisibility by 16 and equality to 1; floats by type only (Triton
does not specialize on them); the constexprs and num_warps by value.

Triton launches on the current CUDA device (its stream, the kernel loaded there), which need
not be the one that holds the tensors (a model on cuda:1 while cuda:0 is current, layers spread
over GPUs by a device map): :func:`on_device` makes the tensors' device current for a launch.
"""

from __future__ import annotations

import contextlib

import torch

from ..interpreter import INTERPRETER_LOCK, interpreting

_COMPILED = {}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a grid: ``triton.cdiv`` is a constexpr function in Triton 3.9, whose call
    from Python costs several µs of host time, as much as a launch of a compiled kernel."""
    return -(-a // b)


def with_contiguous_columns(t: torch.Tensor) -> torch.Tensor:
    """t itself where its last dim is contiguous (the row kernels take any row stride), else a
    contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (n >= 1), in plain Python for the reason of :func:`cdiv`."""
    return 1 << (n - 1).bit_length()


def _spec(value):
    if isinstance(value, torch.Tensor):
        if value.is_neg():
            raise ValueError("a tensor with PyTorch's negative bit set (a lazily negated view, as z.conj().imag is): "
                             "the kernels read and write memory as it is stored; resolve it first (resolve_neg())")
        return value.dtype, value.device, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int, value % 16 == 0, value == 1, -(2**31) <= value < 2**31, -(2**63) <= value < 2**63
    if isinstance(value, float):
        return float
    raise TypeError(f"launch() takes tensors, numbers, bools and None as runtime arguments, got {type(value).__name__}")


def on_device(tensor):
    """A context in which ``tensor``'s GPU is the current device (nothing to do where it already
    is, or for a CPU tensor or anything else)."""
    device = tensor.device if isinstance(tensor, torch.Tensor) else None
    if device is None or device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)


def launch(kernel, grid, *args, num_warps: int = 4, **constexprs):
    """``kernel[grid](*args, **constexprs, num_warps=num_warps)``: ``args`` are the kernel's
    runtime parameters in order, ``constexprs`` all the others by name."""
    names = kernel.arg_names
    full = [*args, *(constexprs[name] for name in names[len(args):])]
    specs = tuple(map(_spec, args))
    if interpreting():
        with INTERPRETER_LOCK:
            kernel[grid](*full, num_warps=num_warps)
        return
    key = (kernel, num_warps, specs, tuple(full[len(args):]))
    compiled = _COMPILED.get(key)
    with on_device(next((a for a in args if isinstance(a, torch.Tensor)), None)):
        if compiled is not None:
            compiled[(*grid, 1, 1)[:3]](*full)  # a compiled kernel takes a 3-d grid
        else:
            _COMPILED[key] = kernel[grid](*full, num_warps=num_warps)

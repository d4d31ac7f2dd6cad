"""Autograd plumbing shared by the custom ops: a direct eager path, and outputs without gradients.

Each operator is a ``torch.library`` custom op with a fake implementation and autograd, so
that torch.compile traces models that use it without graph breaks. Through the dispatcher,
a call of such an op (argument binding, pytree handling of list arguments, a generated
autograd.Function, a redispatch) costs several times the op's own Python on the H200
machine's CPU, and a training step of a small model is then bound by the host. So
:func:`direct_op` makes ops that, in eager PyTorch with plain tensors, run the same
implementation, setup_context and backward through an autograd.Function of their own; under
torch.compile, or with any tensor subclass (fake, functional, distributed tensors), they go
through the registered op.
"""

from __future__ import annotations

import functools

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def only_first_output_differentiable(ctx, outputs, n: int = 1):
    """In a custom op's setup_context: its outputs after the first (the first ``n``: see
    :class:`DirectOp`'s ``differentiable``; statistics, saved pre-activations) carry no
    gradient, and autograd passes None, not a tensor of zeros, for gradients that never
    arrived. Without this, every step would allocate and fill a zero gradient for each such
    output (on the host ~20 µs each, on the GPU a memset)."""
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*outputs[n:])


def refuse_double_backward(name: str, grads) -> None:
    """In an op's backward: raise when it runs under ``backward(create_graph=True)`` (grad mode
    on), whose second-order terms would be silently missing: the kernels' gradients are not
    differentiable. Not while torch.compile traces the backward (its tensors are not plain)."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and all(
            type(g) in _PLAIN for g in grads if isinstance(g, torch.Tensor)):
        raise RuntimeError(f"{name}: codetta's operators have no second derivative; backward with "
                           "create_graph=True (double backward) through them is not supported")


def refuse_batched_gradients(name: str, grads) -> None:
    """In an op's backward: raise when autograd hands it gradients batched by vmap
    (``torch.autograd.grad(..., is_grads_batched=True)``, ``torch.autograd.functional.jacobian``
    or ``hessian`` with ``vectorize=True``), which the kernels cannot read (PyTorch's own error
    names none of codetta's)."""
    functorch = torch._C._functorch  # is_grads_batched batches with PyTorch's older vmap ("legacy" batched tensors)
    if any(isinstance(g, torch.Tensor) and (functorch.is_legacy_batchedtensor(g) or functorch.is_batchedtensor(g))
           for grad in grads for g in (grad if isinstance(grad, list) else (grad,))):  # (several outputs': a list)
        raise RuntimeError(f"{name}: codetta's operators cannot take batched gradients in their backward "
                           "(torch.autograd.grad(is_grads_batched=True), jacobian or hessian with vectorize=True); "
                           "backpropagate one gradient at a time (vectorize=False)")


def refuse_unsupported_autodiff(name: str, args) -> None:
    """Raise when an operator would run under a kind of automatic differentiation it does not have:
    forward mode (torch.func.jvp, jacfwd, torch.autograd.forward_ad dual tensors), whose tangents
    PyTorch would drop silently (zeros, or None), and torch.func's reverse-mode transforms
    (grad, vjp, jacrev), which PyTorch's custom operators do not support (PyTorch's own error
    names none of codetta's). Reverse mode through autograd (``backward``, ``torch.autograd.grad``) works."""
    if torch.compiler.is_compiling():
        return
    transforms = ({interpreter.key() for interpreter in retrieve_all_functorch_interpreters()}
                  if torch._C._are_functorch_transforms_active() else set())
    dual = forward_ad._current_level >= 0 and any(
        isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
        for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)))
    if TransformType.Jvp in transforms or dual:
        raise RuntimeError(f"{name}: codetta's operators have no forward-mode derivative (torch.func.jvp, jacfwd, "
                           "torch.autograd.forward_ad); use reverse mode (loss.backward(), torch.autograd.grad)")
    if TransformType.Grad in transforms:
        raise RuntimeError(f"{name}: codetta's operators do not run under torch.func.grad, vjp or jacrev (PyTorch's "
                           "custom operators have no functorch autograd); use loss.backward() or torch.autograd.grad")


def _guarded_backward(name: str, backward, n_inputs: int, differentiable: int):
    """An op's backward that returns no gradients when its first output's gradient did not come
    (None: a downstream function gave none), as autograd would for zeros: the other outputs carry
    no gradient (see :func:`only_first_output_differentiable`), so nothing flows back; and that
    refuses batched gradients (:func:`refuse_batched_gradients`). With several ``differentiable``
    outputs, their gradients come to ``backward`` as one list (see :class:`DirectOp`)."""
    def guarded(ctx, *grads):
        if differentiable > 1:
            grads = (_gradient_parts(grads[:differentiable], ctx.differentiable), *grads[differentiable:])
        if grads[0] is None:
            return (None,) * n_inputs
        refuse_batched_gradients(name, grads)
        return backward(ctx, *grads)

    return guarded


def arguments_needing_grad(ctx) -> tuple:
    """In an op's backward, on either route: ``ctx.needs_input_grad`` per argument of the op
    (the direct Function's ctx has two arguments of its own first). For ops without list
    arguments (the direct route flattens lists)."""
    return ctx.needs_input_grad[2:] if getattr(ctx, "direct", None) is not None else ctx.needs_input_grad


def saved_tensors_freed_after(ctx) -> bool:
    """In an op's backward: whether this backward is the last reader of the tensors the op saved,
    so that it may write over one it reads for the last time (a gradient over the activation
    it came from) instead of allocating another of its size. True on the direct eager route
    (:class:`DirectOp`) when autograd frees the saved tensors after this backward: not with
    ``retain_graph=True`` (a second backward reads them again), not under torch.compile (whose
    traced ops must not mutate their inputs undeclared), and not on a PyTorch that cannot say."""
    keeps_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return getattr(ctx, "direct", None) is not None and keeps_graph is not None \
        and not torch.compiler.is_compiling() and not keeps_graph()


def _runs_directly(name: str, arg_names, args) -> bool:
    """Not under torch.compile nor a torch.func transform (vmap, grad: its wrapped tensors look
    plain), and every tensor argument (also in lists) a plain Tensor or Parameter with data (on
    the meta device the registered op's fake implementation gives the shapes). Tensors on the
    meta device beside tensors with data are refused: the dispatcher would run the fake
    implementation and return uninitialized memory on the other device."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    plain, meta, data = True, [], None
    for arg_name, a in zip(arg_names, args):
        for t in (a if isinstance(a, list) else (a,)):
            if isinstance(t, torch.Tensor):
                if type(t) not in _PLAIN:
                    plain = False
                elif t.is_meta:
                    meta.append(arg_name)
                elif data is None:
                    data = (arg_name, t.device)
    if meta and data is not None:
        raise ValueError(f"{name}: {', '.join(dict.fromkeys(meta))} on the meta device (no data) but {data[0]} on "
                         f"{data[1]}: give every tensor on one device")
    return plain and not meta


def _flatten(args):
    """(the arguments with each list spread out, the list lengths per argument or None)."""
    flat, layout = [], []
    for a in args:
        if isinstance(a, list):
            flat += a
            layout.append(len(a))
        else:
            flat.append(a)
            layout.append(None)
    return flat, tuple(layout)


def _unflatten(flat, layout):
    args, i = [], 0
    for n in layout:
        if n is None:
            args.append(flat[i])
            i += 1
        else:
            args.append(list(flat[i:i + n]))
            i += n
    return args


def _not_views(output):
    """The op's outputs with views (an output reshaped from the GEMM's [M, N]) detached from their
    bases: autograd refuses in-place changes to a view made inside a custom Function, as a user's
    ``y.add_(...)`` or an in-place forward hook would be, but not to a plain output."""
    def own(t):
        return t.detach() if isinstance(t, torch.Tensor) and t._is_view() else t

    return tuple(map(own, output)) if isinstance(output, tuple) else own(output)


def _returning_no_views(impl):
    """``impl`` with its outputs as :func:`_not_views` makes them: what the registered op runs
    (the route of torch.compile, tensor subclasses), whose autograd refuses in-place changes to
    view outputs just as the direct route's Function does."""
    @functools.wraps(impl)
    def run(*args):
        return _not_views(impl(*args))

    return run


class _Direct(torch.autograd.Function):
    """An op's implementation with its own setup_context and backward, lists flattened."""

    @staticmethod
    def forward(ctx, op, layout, *flat):
        inputs = _unflatten(flat, layout)
        output = _not_views(op.impl(*inputs))
        op.setup_context(ctx, inputs, output)
        ctx.direct = (op, layout)
        return output

    @staticmethod
    def backward(ctx, *grads):
        op, layout = ctx.direct
        refuse_double_backward(op.op._qualname, grads)
        result = op.backward(ctx, *grads)
        flat = []
        for g, n in zip(result, layout):
            if n is None:
                flat.append(g)
            else:
                flat += g if g is not None else [None] * n
        return (None, None, *flat)


def _gradient_parts(grads, parts):
    """The gradients of the first outputs (see :class:`DirectOp`'s ``differentiable``), as a
    list for the op's backward (zeros for one whose gradient never came), or None when none came."""
    if all(g is None for g in grads):
        return None
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, parts)]


def _per_sample(op):
    """A vmap rule for ``op``: the op once per sample (the batched arguments' slices), its outputs
    stacked. PyTorch's own fallback does this for ops without list arguments and cannot for
    ops with them (``rmsnorm_linear``'s weights)."""
    def sample(arg, dim, i):
        if isinstance(dim, (list, tuple)):
            return [sample(a, d, i) for a, d in zip(arg, dim)]
        return arg if dim is None else arg.select(dim, i)

    def rule(info, in_dims, *args):
        outputs = [op(*(sample(a, d, i) for a, d in zip(args, in_dims))) for i in range(info.batch_size)]
        if isinstance(outputs[0], tuple):
            return tuple(torch.stack(parts) for parts in zip(*outputs)), (0,) * len(outputs[0])
        return torch.stack(outputs), 0

    return rule


class DirectOp:
    """A custom op (``.op``, registered with torch.library) that eager calls with plain tensors
    run without the dispatcher. ``register_fake`` and ``register_autograd`` as on the op.

    ``differentiable`` (default 1): how many of the first outputs carry gradients; with more
    than one the op's backward gets theirs as one list (zeros for those that did not come,
    None when none did), on either route: outputs computed together, each in an allocation of
    its own (q, k and v), whose gradients autograd hands back apart (an op returning views of
    one tensor would get them concatenated into one first: a copy of all of them)."""

    def __init__(self, name: str, impl, differentiable: int = 1):
        self.impl = impl
        self.op = torch.library.custom_op(name, _returning_no_views(impl), mutates_args=(),
                                          schema=torch.library.infer_schema(impl, mutates_args=()))
        self.op.register_vmap(_per_sample(self.op))
        self.setup_context = self.backward = None
        self.differentiable = differentiable
        self._arg_names = [a.name for a in self.op._opoverload._schema.arguments]

    def register_fake(self, fake):
        self.op.register_fake(fake)
        return fake

    def register_autograd(self, backward, *, setup_context):
        n = self.differentiable
        backward = _guarded_backward(self.op._qualname, backward, len(self.op._opoverload._schema.arguments), n)
        if n > 1:
            def setup(ctx, inputs, output, setup_context=setup_context):
                ctx.differentiable = [(t.shape, t.dtype, t.device) for t in output[:n]]  # for zero gradients
                setup_context(ctx, inputs, output)
        else:
            setup = setup_context
        self.op.register_autograd(backward, setup_context=setup)
        self.backward, self.setup_context = backward, setup

    def __call__(self, *args):
        refuse_unsupported_autodiff(self.op._qualname, args)
        if not _runs_directly(self.op._qualname, self._arg_names, args):
            return self.op(*args)
        flat, layout = _flatten(args)
        if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            return self.impl(*args)
        if self.backward is None:  # e.g. a backward op under create_graph=True: the op says it has no derivative
            return self.op(*args)
        return _Direct.apply(self, layout, *flat)


def direct_op(name: str, differentiable: int = 1):
    """Decorator: ``@direct_op("codetta::name")`` on the implementation makes a :class:`DirectOp`."""
    return lambda impl: DirectOp(name, impl, differentiable)

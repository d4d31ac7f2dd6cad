"""RMSNorm folded into the GEMMs around it, forward and backward.

Notation: x [M, d] is the residual stream, g [d] the norm weight,
r_i = rsqrt(mean_j x_ij^2 + eps), h = x ⊙row r ⊙col g = RMSNorm(x) and a linear layer
z = h W^T with W [N, d] as nn.Linear stores it.

Producer (:func:`linear_residual`): the GEMM that makes x also writes u = x ⊙col g and
the per-row sums of squares of x, from which r is finished (a [M] vector):

    x = a W_o^T + residual;  u = x ⊙col g;  ss_i = sum_j x_ij^2;  r = rsqrt(ss / d + eps)

The statistics are taken from x *after* its rounding to the stored dtype: exactly what
eager PyTorch would see when it normalizes the stored x. With a branch scale s (Granite's
residual multiplier) the producer makes x = s (a W_o^T) + residual, the product in fp32
before the one rounding; its backward hands the branch s dx and the residual dx.

Consumer (:func:`rmsnorm_linear`): a row scale commutes with a right matrix product, so

    z = RMSNorm(x) W^T = r ⊙row (u W^T)

is one GEMM on u whose epilogue scales rows by r.

Backward of the consumer, given dz (one GEMM, one epilogue; dgrad layout):

    acc = dz W                                  (= dL/dh)
    zdz_i = sum_k z_ik dz_ik                    (= r_i · dL/dr_i)
    dx = r ⊙row (acc ⊙col g) - (zdz r^2 / d) ⊙row x
    dg_j = sum_i r_i acc_ij x_ij                (column sums in the epilogue, finished after)
    h = x ⊙row r ⊙col g                         (stored: the operand of dW = dz^T h; not
                                                 where every weight W is frozen)

Where a bias b is added to the GEMM's output before it is stored (q/k/v biases, Llama's
``mlp_bias``), the backward's kernels see only the stored z + b, and zdz = (z + b) . dz - b . dz
cancels: with |b| >> |z| (Qwen2's k biases reach the hundreds) the rounding of the stored
z + b, relative to |b|, swamps z . dz. There the row term is taken from dL/dh instead, as
eager PyTorch does: a plain dgrad GEMM acc = dz W, then one memory-bound kernel
(:func:`codetta.kernels.rmsnorm.rmsnorm_backward`) for dx and dg, and h made apart for dW.

When x also feeds a residual branch (x2 = x + f(RMSNorm(x)), as in a block's MLP half), the
gradient that branch hands x, dres, can be given: the epilogue then writes dx + dres, the
sum autograd would otherwise make in a separate pass (see :mod:`codetta.ops.mlp`).

The residual stream may be wider than the GEMMs: x in fp32 with bf16 (or fp16) weights, as
under ``torch.autocast`` with fp32 parameters, where transformers keeps the residual
stream in fp32 and casts only each matmul's inputs. Then x, dx and the residual
gradients stay fp32, u and h (the GEMMs' operands) are in the weights' dtype, and the
statistics come from the fp32 x, as the model's own fp32 norm computes them.

The weights may be given as several tensors (W_q, W_k, W_v) read as one, concatenated
along the output features, without a copy: the forward GEMM reads them as parts along
N, the dgrad GEMM as parts along K, and one wgrad GEMM gives all their gradients (cut into
row views of one tensor; a GEMM per weight only when accumulating into existing ``.grad``s,
:mod:`codetta.ops.weight_grads`).

Each operator is a ``torch.library`` custom op with a fake (shape) implementation and
its backward registered, so torch.compile traces models that use it without graph breaks;
eager calls with plain tensors skip the dispatcher (:mod:`codetta.ops.autograd`).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import torch
from torch import Tensor

from .. import epilogue as ep
from ..kernels.rmsnorm import rmsnorm_backward, rmsnorm_stats, rstd_of_partial_sums
from ..matmul import KERNEL_DTYPES, check_device, gemm
from ..matmul.call import MAX_B_PARTS
from ..matmul.memory import merged_leading_dims
from .autocast import casts_under_autocast
from .autograd import direct_op, only_first_output_differentiable
from .weight_grads import any_weight_grad, for_autograd, run_backward, skipping, weight_grads, weight_grads_like
from .shapes import check_vector, dense_tensors_only, described, rows

# ---------------------------------------------------------------------------------------
# Programs


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


@functools.lru_cache(maxsize=None)
def _producer(dtype: torch.dtype, with_norm: bool, with_bias: bool, wide: bool = False,
              scaled: bool = False) -> ep.Program:
    """x = acc (+ bias) + residual stored in ``dtype``, the residual's; ``wide``: fp32 x from 16-bit
    operands (u is stored in the operands' dtype either way); ``scaled``: the branch acc (+ bias)
    times the scalar ``branch_scale``."""
    name = "linear_residual" + ("_bias" if with_bias else "") + ("_scaled" if scaled else "") \
        + ("_rmsnorm" if with_norm else "")
    p = ep.Program(f"{name}_{_dtype_name(dtype)}" + ("_wide" if wide else ""))
    branch = p.acc + p.col("bias") if with_bias else p.acc
    x = (branch * p.scalar("branch_scale") if scaled else branch) + p.aux("residual")
    p.store("x", x, dtype=dtype if wide else None)
    if with_norm:
        stored = ep.round_to(x, dtype) if dtype != torch.float32 else x
        p.store("u", stored * p.col("norm_weight"))
        p.row_sumsq("sumsq", stored)
    return p


@functools.lru_cache(maxsize=None)
def _consumer() -> ep.Program:
    p = ep.Program("rmsnorm_linear")
    p.store("z", p.acc * p.row("rstd"))
    return p


@functools.lru_cache(maxsize=None)
def _consumer_backward(with_residual_grad: bool = False, dx_dtype: Optional[torch.dtype] = None,
                       with_h: bool = True) -> ep.Program:
    """dx stored in ``dx_dtype`` (x's, when wider than the GEMM's operands), h in the operands' dtype
    (``with_h``: where a weight gradient reads it; not for frozen weights)."""
    p = ep.Program("rmsnorm_linear_backward" + ("_residual" if with_residual_grad else "")
                   + (f"_{_dtype_name(dx_dtype)}" if dx_dtype else "") + ("" if with_h else "_no_h"))
    acc, r, g, x = p.acc, p.row("rstd"), p.col("norm_weight"), p.aux("x")
    dx = r * g * acc - p.row("zdz") * r * r * p.scalar("inv_d") * x
    p.store("dx", p.aux("residual_grad") + dx if with_residual_grad else dx, dtype=dx_dtype)
    p.col_sum("dnorm_weight", acc * r * x)
    if with_h:
        p.store("h", x * r * g)
    return p


# ---------------------------------------------------------------------------------------
# Checks


def stream_fits(stream: torch.dtype, operand: torch.dtype) -> bool:
    """Whether a residual stream of dtype ``stream`` may feed GEMMs on ``operand`` inputs: the same
    dtype, or an fp32 stream for 16-bit GEMMs (see the module doc)."""
    return stream == operand or (stream == torch.float32 and operand in (torch.bfloat16, torch.float16))


def check_eps(prefix: str = "", **values) -> None:
    """Each epsilon given by name must be a real number >= 0 (not a string, nor a bool); the
    error starts with ``prefix`` (the operator's name, where its other messages give it)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
            raise ValueError(f"{prefix}{name} must be a number >= 0, got {value!r}")


def named_weights(weight) -> dict[str, Tensor]:
    """An operator's ``weight`` argument (one tensor, or a list) by the names its error messages
    give: "weight", or "weight[i]"."""
    if isinstance(weight, (list, tuple)):
        return {f"weight[{i}]": w for i, w in enumerate(weight)}
    return {"weight": weight}


def _check_norm_inputs(x: Tensor, norm_weight: Tensor, weights: dict[str, Tensor], eps):
    """The checks of a norm-folded GEMM's inputs; ``weights`` by the names the caller gave them."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor [..., d], got {described(x)}")
    if not weights or not all(isinstance(w, Tensor) for w in (norm_weight, *weights.values())):
        raise ValueError(f"norm_weight and {', '.join(weights) or 'the weights'} must be tensors (at least one weight)")
    check_eps(eps=eps)
    d = x.shape[-1]
    if not x.is_meta:  # on the meta device the registered op's fake implementation gives the shapes
        check_device(x.device, "x")
    for name, t in (("norm_weight", norm_weight), *weights.items()):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if norm_weight.shape != (d,):
        raise ValueError(f"norm_weight must be [{d}] for x [..., {d}], got {tuple(norm_weight.shape)}")
    (first, w0), *_ = weights.items()
    for name, w in weights.items():
        if w.dim() != 2 or w.shape[1] != d:
            raise ValueError(f"{name} must be [out_features, {d}], got {tuple(w.shape)}")
        if w.dtype != w0.dtype:
            raise ValueError(f"{name} is {w.dtype} but {first} is {w0.dtype}")
    if w0.dtype not in KERNEL_DTYPES:
        raise ValueError(f"the weights are {w0.dtype}; the kernels take {KERNEL_DTYPES}")
    if norm_weight.dtype not in KERNEL_DTYPES:
        raise ValueError(f"norm_weight is {norm_weight.dtype}; the kernels take {KERNEL_DTYPES}")
    if not stream_fits(x.dtype, w0.dtype):
        raise ValueError(f"x is {x.dtype} but the weights are {w0.dtype}: x must be in the weights' dtype, "
                         "or fp32 with 16-bit weights")


def weight_readable_ahead(module, weight) -> bool:
    """Whether a layer may read ``weight``, of the next layer's ``module``, before that layer runs
    (to make its norm's statistics): not under FSDP2, which gathers the weight and reduces its
    gradient for the unit that holds it: sharded (a DTensor) until that unit's forward, and where
    gathered ahead (reshard_after_forward=False, a unit around a checkpoint wrapper) the weight's
    gradient went astray, or the weight reached the layer as another tensor (found by a probe)."""
    return not getattr(module, "_is_fsdp_managed_module", False) and type(weight) in (Tensor, torch.nn.Parameter)


def hooks_between(layer, next_layer, only_records=lambda hook: False) -> bool:
    """Whether hooks run between ``layer``'s forward and ``next_layer``'s (the first's forward
    hooks, the second's pre-hooks, global ones, but those that ``only_records``), which may replace
    or change the residual stream in place (activation steering): the statistics a layer makes of
    its output for the next layer's norm are then not handed on. In eager mode the version counter
    and the tensor's identity would tell (:class:`NormStats`); not while torch.compile traces."""
    hooks = torch.nn.modules.module
    return (any(not only_records(h) for h in layer._forward_hooks.values()) or bool(next_layer._forward_pre_hooks)
            or bool(hooks._global_forward_hooks) or bool(hooks._global_forward_pre_hooks))


def _row_layout(t: Tensor) -> tuple:
    """Where the rows of t [..., d] lie, in order: (address, d, the stride along a row, the merged
    leading dims): equal for x and its reshapes, not for a transposed view of the same memory."""
    lead = merged_leading_dims(t) if t.numel() else ()
    return t.data_ptr(), t.shape[-1], t.stride(-1) if t.shape[-1] > 1 else 0, lead


# u -> what NormStats.of made it of (x's rows, versions, norm weight, eps; not x itself), while u lives
_SOURCES_BY_U = torch.utils.weak.WeakIdKeyDictionary()


class NormStats(tuple):
    """The statistics ``(u, rstd)`` of the RMSNorm of one tensor x with one norm weight g and
    epsilon, as :func:`linear_residual` and :func:`codetta.ops.swiglu_mlp` return them (u = x g
    in the GEMM operands' dtype, rstd fp32 [M]); it unpacks as that pair.

    It also remembers what it was made of (x itself, where its rows lie and its version
    counter, g and its version counter, epsilon), so that the operator it is handed to checks
    it gets that very x, unchanged since, with the same g and epsilon, its rows in the same
    order (x or a reshape of it, not a transposed view of the same memory): stale or borrowed
    statistics would give a silently wrong norm. It holds a reference to x, so that a new
    tensor cannot take x's memory (and pass for it) while the statistics live. Unpacked and
    handed on as a plain ``(u, rstd)`` pair, they are checked alike by their u (:meth:`made_for`),
    but for x's identity (a new tensor in x's memory, with x's shape, would pass); a pair of
    other tensors is taken as it is. Writes that PyTorch does not count in the version counter
    (through ``.data``, or numpy memory shared with x) cannot be seen.
    """

    source: tuple

    @staticmethod
    def of(u: Tensor, rstd: Tensor, x: Tensor, norm_weight: Tensor, eps: float):
        """The pair, as NormStats where it can be checked later (eager, tensors with version
        counters and memory), else as a plain tuple (traced by torch.compile, inference tensors,
        under torch.func's transforms: vmap's wrapped tensors have no memory to locate x's rows)."""
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active() \
                or x.is_inference() or norm_weight.is_inference():
            return u, rstd
        stats = tuple.__new__(NormStats, (u, rstd))
        stats.source = (x, _row_layout(x), x._version, norm_weight, norm_weight._version, float(eps))
        _SOURCES_BY_U[u] = (None, *stats.source[1:])
        return stats

    @staticmethod
    def made_for(u: Tensor, rstd: Tensor) -> Optional["NormStats"]:
        """The statistics (without x itself) that :meth:`of` made with this very u, as a plain
        pair hands them on; None for a u it did not make."""
        source = _SOURCES_BY_U.get(u)
        if source is None:
            return None
        stats = tuple.__new__(NormStats, (u, rstd))
        stats.source = source
        return stats

    def with_u(self, u: Tensor) -> "NormStats":
        """The same statistics with u replaced (cast under autocast)."""
        stats = tuple.__new__(NormStats, (u, self[1]))
        stats.source = self.source
        return stats

    def apart_from_x(self) -> "NormStats":
        """The same statistics without the reference to x (their check does not read x itself), for a
        holder that keeps x's identity by other means (a weak reference, see
        :class:`codetta.integrations.hf.layer.StatsHandoff`): held with x, they would keep x, and
        the autograd graph behind it, alive."""
        stats = tuple.__new__(NormStats, (self[0], self[1]))
        stats.source = (None, *self.source[1:])
        return stats

    def mismatch(self, x: Tensor, norm_weight: Tensor, eps: float) -> str | None:
        """Why these statistics are not those of x's norm with norm_weight and eps, or None."""
        _, layout, version, weight, weight_version, made_eps = self.source
        if _row_layout(x) != layout or x._version != version:
            return ("stats were made for another tensor than x (or for its rows in another order, as in a "
                    "transposed view of x), or x was changed in place since: pass the "
                    "(x, stats) pair an operator returned, unchanged, or no stats")
        if norm_weight is not weight or norm_weight._version != weight_version:
            return "stats were made with another norm_weight (or it was changed in place since)"
        if float(eps) != made_eps:
            return f"stats were made with eps {made_eps}, not {float(eps)}"
        return None

    def check(self, x: Tensor, norm_weight: Tensor, eps: float) -> None:
        """Raise ValueError where :meth:`mismatch` finds these statistics are not x's."""
        problem = self.mismatch(x, norm_weight, eps)
        if problem is not None:
            raise ValueError(problem)


def given_stats(x: Tensor, stats, operand_dtype: torch.dtype, norm_weight: Tensor,
                eps: float) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(u, rstd) of ``stats`` (or (None, None)), checked to be x's: u [M, d] in the GEMM's
    ``operand_dtype`` (the weights'), rstd fp32 [M]; a :class:`NormStats` also made from this x,
    norm_weight and eps."""
    if stats is None:
        return None, None
    if not isinstance(stats, (tuple, list)) or len(stats) != 2 or not all(isinstance(t, Tensor) for t in stats):
        raise ValueError(f"stats must be the (u, rstd) pair of tensors an operator returned, got {type(stats).__name__}")
    u, rstd = stats
    m, d = x.numel() // x.shape[-1], x.shape[-1]
    if u.shape[-1] != d or u.numel() != m * d or rstd.numel() != m:
        raise ValueError(f"stats (u {tuple(u.shape)}, rstd {tuple(rstd.shape)}) are not those of x {tuple(x.shape)}")
    if u.dtype != operand_dtype or rstd.dtype != torch.float32:
        raise ValueError(f"stats must be (u in the weights' dtype {operand_dtype}, rstd in torch.float32), got "
                         f"({u.dtype}, {rstd.dtype})")
    if not (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()):
        made = stats if isinstance(stats, NormStats) else NormStats.made_for(u, rstd)
        if made is not None:
            made.check(x, norm_weight, eps)
    return u, rstd


def _as_list(weight) -> list[Tensor]:
    return list(weight) if isinstance(weight, (list, tuple)) else [weight]


def _weight_t(weights: list[Tensor]):
    """The forward GEMM's B: W^T, or the W_i^T read as one along N (concatenated, a copy, when
    there are more than the GEMM reads as one: MAX_B_PARTS)."""
    if len(weights) == 1:
        return weights[0].t()
    return torch.cat(weights).t() if len(weights) > MAX_B_PARTS else [w.t() for w in weights]


def _weight_k(weights: list[Tensor]):
    """The dgrad GEMM's B: W, or the W_i read as one along K (those with rows: with none, one
    [0, d] W reads as K = 0, where several would read as parts along N; concatenated beyond
    MAX_B_PARTS)."""
    held = [w for w in weights if w.shape[0]] or weights[:1]
    if len(held) == 1:
        return held[0]
    return torch.cat(held) if len(held) > MAX_B_PARTS else held


def rms_rstd(x: Tensor, eps: float) -> Tensor:
    """rsqrt(mean_j x_ij^2 + eps) over the last dim, fp32, reading x once (fp32 accumulation)."""
    norm = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    return torch.rsqrt(norm.square() / x.shape[-1] + eps)


# ---------------------------------------------------------------------------------------
# Consumer: z = RMSNorm(x) W^T


@direct_op("codetta::rmsnorm_linear")
def _rmsnorm_linear_op(
    x: Tensor, norm_weight: Tensor, weights: list[Tensor], eps: float, u: Optional[Tensor], rstd: Optional[Tensor]
) -> tuple[Tensor, Tensor]:
    x2 = rows(x)
    u, rstd, rstd_out = norm_operands(x2, norm_weight, eps, weights[0].dtype, u, rstd)
    z = gemm(u.reshape(x2.shape), _weight_t(weights), _consumer(), rstd=rstd)["z"]
    return z.reshape(*x.shape[:-1], z.shape[-1]), rstd_out


@_rmsnorm_linear_op.register_fake
def _(x, norm_weight, weights, eps, u, rstd):
    n = sum(w.shape[0] for w in weights)
    return x.new_empty(*x.shape[:-1], n, dtype=weights[0].dtype), rstd_like(x, u, rstd)


def norm_operands(x2: Tensor, norm_weight: Tensor, eps: float, dtype: torch.dtype, u: Optional[Tensor],
                  rstd: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(u, rstd, the rstd a consumer operator returns) of x2 [M, d]: the statistics given (both u and
    rstd), or made from x2. A consumer returns the rstd it made, or an empty tensor for one it was
    given (an output must not alias an input; :func:`used_rstd` finds it again)."""
    if u is None or rstd is None:
        u, rstd = rmsnorm_stats(x2, norm_weight, eps, dtype)
        return u, rstd, rstd
    return u, rstd.reshape(-1), rstd.new_empty(0)


def used_rstd(u: Optional[Tensor], rstd: Optional[Tensor], returned: Tensor) -> Tensor:
    """In a consumer's setup_context: the rstd it normalized with, given (with u) or ``returned``."""
    return returned if u is None or rstd is None else rstd.reshape(-1)


def rstd_like(x: Tensor, u: Optional[Tensor], rstd: Optional[Tensor]) -> Tensor:
    """The rstd a consumer operator returns, as an empty tensor of its shape (a fake implementation's)."""
    return x.new_empty(x.numel() // x.shape[-1] if u is None or rstd is None else 0, dtype=torch.float32)


def row_dot(z: Tensor, dz: Tensor) -> Tensor:
    """sum_k z_ik dz_ik in fp32, [M] (zdz of the norm backward); a z that overflowed to inf adds
    nothing where its gradient is 0 (as in the kernels' ``times_gradient``)."""
    z, dz = rows(z).float(), rows(dz).float()
    return torch.where(dz == 0, 0.0, z * dz).sum(-1)


def rmsnorm_linear_backward(dz: Tensor, zdz: Optional[Tensor], x: Tensor, norm_weight: Tensor, weights: list[Tensor],
                            rstd: Tensor, dweights_into=(), residual_grad: Optional[Tensor] = None):
    """(dx, dnorm_weight, [dW_i]) of z = RMSNorm(x) W^T given dz and zdz_i = sum_k z_ik dz_ik.

    z here is the GEMM's own output r ⊙row (u W^T), before any bias (see the module doc).
    ``zdz=None``: the row term taken from dL/dh instead (the module doc's biased case).
    ``dweights_into``: see :func:`codetta.ops.weight_grads.weight_grads`. ``residual_grad``
    (x's shape): a gradient of x from elsewhere, added to dx in the epilogue.
    """
    d = x.shape[-1]
    x2, dz2 = rows(x), rows(dz).to(weights[0].dtype).contiguous()
    if zdz is None:
        return _rmsnorm_linear_backward_unfused(dz2, x2, x.shape, norm_weight, weights, rstd, dweights_into,
                                                residual_grad)
    extra = {} if residual_grad is None else {"residual_grad": rows(residual_grad)}
    with_h = any_weight_grad(dweights_into)
    program = _consumer_backward(residual_grad is not None, x.dtype if x.dtype != dz2.dtype else None, with_h)
    out = gemm(dz2, _weight_k(weights), program, rstd=rstd,
               norm_weight=norm_weight, x=x2, zdz=zdz, inv_d=1.0 / max(d, 1), **extra)
    dweights = weight_grads(dz2, out.get("h"), weights, dweights_into)
    return out["dx"].reshape(x.shape), out["dnorm_weight"].to(norm_weight.dtype), dweights


def _rmsnorm_linear_backward_unfused(dz2, x2, shape, norm_weight, weights, rstd, dweights_into, residual_grad):
    """:func:`rmsnorm_linear_backward` with the row term from dL/dh = dz W, as eager PyTorch takes it:
    a plain dgrad GEMM, then the norm's backward kernel (dx, dnorm_weight), h for dW made apart."""
    dh = gemm(dz2, _weight_k(weights))
    dx, dg = rmsnorm_backward(x2, norm_weight, rstd, dh, dx_out=x2.new_empty(x2.shape))  # contiguous, x's dtype
    if residual_grad is not None:
        dx += rows(residual_grad)
    h = (x2.float() * rstd[:, None] * norm_weight.float()).to(dz2.dtype) if any_weight_grad(dweights_into) else None
    return dx.reshape(shape), dg.to(norm_weight.dtype), weight_grads(dz2, h, weights, dweights_into)


def _rmsnorm_linear_backward_from_z(dz, z, x, norm_weight, weights, rstd, dweights_into=()):
    return rmsnorm_linear_backward(dz, row_dot(z, dz), x, norm_weight, weights, rstd, dweights_into)


@direct_op("codetta::rmsnorm_linear_backward")
def _rmsnorm_linear_backward_op(
    dz: Tensor, z: Tensor, x: Tensor, norm_weight: Tensor, weights: list[Tensor], rstd: Tensor, needs: list[bool]
) -> tuple[Tensor, Tensor, list[Tensor]]:
    return _rmsnorm_linear_backward_from_z(dz, z, x, norm_weight, weights, rstd, skipping(weights, needs))


@_rmsnorm_linear_backward_op.register_fake
def _(dz, z, x, norm_weight, weights, rstd, needs):
    return x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), weight_grads_like(weights, needs)


def _rmsnorm_linear_setup(ctx, inputs, output):
    only_first_output_differentiable(ctx, output)
    x, norm_weight, weights, eps, u, rstd = inputs
    z, rstd_out = output
    ctx.save_for_backward(z, x, norm_weight, used_rstd(u, rstd, rstd_out), *weights)


def _rmsnorm_linear_backward(ctx, dz, _drstd):
    z, x, norm_weight, rstd, *weights = ctx.saved_tensors
    dx, dg, dws = run_backward(ctx, weights, _rmsnorm_linear_backward_op, _rmsnorm_linear_backward_from_z,
                               dz, z, x, norm_weight, weights, rstd, weight_args=(2,))
    return dx, dg, for_autograd(dws, weights), None, None, None


_rmsnorm_linear_op.register_autograd(_rmsnorm_linear_backward, setup_context=_rmsnorm_linear_setup)


@dense_tensors_only
@casts_under_autocast("weight", "stats", streams=("x",))
def rmsnorm_linear(x: Tensor, norm_weight: Tensor, weight, eps: float = 1e-6, *, stats=None) -> Tensor:
    """``F.linear(F.rms_norm(x, (d,), norm_weight, eps), W)`` with the norm folded into the GEMM.

    Args:
        x: [..., d]; norm_weight: [d]; weight: [N, d], or a list of [N_i, d] (e.g. W_q, W_k,
            W_v) used as their concatenation along the output features, without a copy for up
            to four (more are concatenated first).
        stats: optional (u, rstd) from :func:`linear_residual` (u = x g, rstd fp32 [M]); they
            are not differentiated: the gradient of the norm flows through x and norm_weight.
        x may be fp32 with 16-bit weights (a wider residual stream: see the module doc).
    Returns:
        z [..., N] in the weights' dtype.
    """
    _check_norm_inputs(x, norm_weight, named_weights(weight), eps)
    weights = _as_list(weight)
    u, rstd = given_stats(x, stats, weights[0].dtype, norm_weight, eps)
    return _rmsnorm_linear_op(x, norm_weight, weights, float(eps), u, rstd)[0]


# ---------------------------------------------------------------------------------------
# Producer: x = a W^T + residual, with the next norm's u and rstd


@direct_op("codetta::linear_residual")
def _linear_residual_op(
    a: Tensor, weights: list[Tensor], residual: Tensor, bias: Optional[Tensor], norm_weight: Optional[Tensor], eps: float,
    branch_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    a2 = rows(a)
    operands = {"residual": rows(residual)}
    if bias is not None:
        operands["bias"] = bias
    if branch_scale != 1.0:
        operands["branch_scale"] = branch_scale
    program = _producer(residual.dtype, norm_weight is not None, bias is not None, residual.dtype != a.dtype,
                        branch_scale != 1.0)
    if norm_weight is None:
        x = gemm(a2, _weight_t(weights), program, **operands)["x"]
        return x.reshape(residual.shape), x.new_empty(0), x.new_empty(0, dtype=torch.float32)
    # the sums of squares finished straight into r (one small kernel)
    finish = {"sumsq": functools.partial(rstd_of_partial_sums, d=residual.shape[-1], eps=eps)}
    out = gemm(a2, _weight_t(weights), program, norm_weight=norm_weight, finish=finish, **operands)
    return out["x"].reshape(residual.shape), out["u"], out["sumsq"]


@_linear_residual_op.register_fake
def _(a, weights, residual, bias, norm_weight, eps, branch_scale):
    m = residual.numel() // residual.shape[-1]
    if norm_weight is None:
        return residual.new_empty(residual.shape), residual.new_empty(0), residual.new_empty(0, dtype=torch.float32)
    return (residual.new_empty(residual.shape), residual.new_empty(m, residual.shape[-1], dtype=a.dtype),
            residual.new_empty(m, dtype=torch.float32))


def linear_residual_backward(dx: Tensor, a: Tensor, weights: list[Tensor], dweights_into=()):
    """(da, [dW_i]) of x = a W^T + residual given dx (the residual's gradient is dx itself; the GEMMs
    take it in a's dtype, as autograd hands a 16-bit matmul output the gradient of a wider sum).
    ``a`` is read by the weight gradients only: where none is computed, it may have no rows."""
    dx2 = rows(dx).to(a.dtype).contiguous()
    da = gemm(dx2, _weight_k(weights))
    return da.reshape(*dx.shape[:-1], da.shape[-1]), weight_grads(dx2, rows(a), weights, dweights_into)


@direct_op("codetta::linear_residual_backward")
def _linear_residual_backward_op(dx: Tensor, a: Tensor, weights: list[Tensor],
                                 needs: list[bool]) -> tuple[Tensor, list[Tensor]]:
    return linear_residual_backward(dx, a, weights, skipping(weights, needs))


@_linear_residual_backward_op.register_fake
def _(dx, a, weights, needs):
    return a.new_empty(*dx.shape[:-1], a.shape[-1]), weight_grads_like(weights, needs)


def _linear_residual_setup(ctx, inputs, output):
    only_first_output_differentiable(ctx, output)
    a, weights, residual, bias, norm_weight, eps, branch_scale = inputs
    ctx.has_bias, ctx.branch_scale = bias is not None, branch_scale
    # a is read by the weight gradients only: where every weight is frozen (a LoRA model's base
    # weights), none of its rows is kept, as F.linear keeps no input for a frozen weight
    ctx.weights_frozen = not any(w.requires_grad for w in weights)
    ctx.save_for_backward(a.new_empty(0, a.shape[-1]) if ctx.weights_frozen else a, *weights)  # not a view of a


def _linear_residual_backward(ctx, dx, _du, _drstd):
    a, *weights = ctx.saved_tensors
    branch_grad = scaled(dx, ctx.branch_scale)  # the branch's gradient: the residual's is dx itself
    if ctx.weights_frozen:  # da alone (a weight unfrozen since the forward gets no gradient, as in PyTorch)
        da, dws = _linear_residual_backward_op(branch_grad, a, weights, [False] * len(weights))
    else:
        da, dws = run_backward(ctx, weights, _linear_residual_backward_op, linear_residual_backward, branch_grad, a,
                               weights, weight_args=(1,))
    dbias = rows(branch_grad).sum(0) if ctx.has_bias else None
    return da, for_autograd(dws, weights), dx, dbias, None, None, None


_linear_residual_op.register_autograd(_linear_residual_backward, setup_context=_linear_residual_setup)


@dense_tensors_only
@casts_under_autocast("a", "weight", "bias", streams=("residual",))
def linear_residual(a: Tensor, weight, residual: Tensor, norm_weight: Tensor | None = None, eps: float = 1e-6, *,
                    bias: Tensor | None = None, branch_scale: float = 1.0):
    """x = s (a W^T (+ bias)) + residual in one GEMM (s = ``branch_scale``: 1, or Granite's
    residual multiplier); with ``norm_weight`` also the next RMSNorm's (u, rstd).

    Args:
        a: [..., K]; weight: [d, K] (or a list of [d_i, K] read as one); residual: [..., d]; bias: [d].
        norm_weight: [d] of the RMSNorm that will consume x, or None.
        The residual may be fp32 with 16-bit a and weights: x is then fp32, u in a's dtype.
    Returns:
        x (in the residual's dtype), or (x, (u, rstd)) with u = x g [M, d] in a's dtype and rstd
        fp32 [M]: pass the pair as ``stats``
        to :func:`rmsnorm_linear` (they carry no gradient of their own).
    """
    weights, named = _as_list(weight), named_weights(weight)
    for name, t in (("a", a), ("residual", residual), *named.items()):
        if not isinstance(t, Tensor) or t.dim() < 1:
            raise ValueError(f"{name} must be a tensor of at least 1 dim, got {described(t)}")
    if a.dtype not in KERNEL_DTYPES:
        raise ValueError(f"a has dtype {a.dtype}; the kernels take {KERNEL_DTYPES}")
    if residual.shape[:-1] != a.shape[:-1] or residual.shape[-1] != sum(w.shape[0] for w in weights):
        raise ValueError(f"residual {tuple(residual.shape)} does not match a {tuple(a.shape)} @ W^T")
    for name, w in named.items():
        if w.dim() != 2 or w.shape[1] != a.shape[-1] or w.dtype != a.dtype:
            raise ValueError(f"{name} must be [out, {a.shape[-1]}] of {a.dtype}, got {tuple(w.shape)} {w.dtype}")
    if not stream_fits(residual.dtype, a.dtype):
        raise ValueError(f"residual is {residual.dtype} but a is {a.dtype}: the residual must be in a's dtype, "
                         "or fp32 with 16-bit a and weights")
    for name, vec in (("norm_weight", norm_weight), ("bias", bias)):
        if vec is not None:
            check_vector(name, vec, residual.shape[-1], residual.device)
    check_eps(eps=eps)
    branch_scale = finite_real("branch_scale", branch_scale)
    # g makes only the statistics, which carry no gradient: detached, it does not make x need one (a frozen
    # layer before a trainable norm, found by a probe: its output required grad, its backward ran)
    x, u, rstd = _linear_residual_op(a, weights, residual, bias, detached(norm_weight), float(eps), branch_scale)
    return x if norm_weight is None else (x, NormStats.of(u, rstd, x, norm_weight, eps))


def detached(t: Tensor | None) -> Tensor | None:
    """t.detach() (None for None): a norm weight that makes only statistics, which carry no gradient."""
    return None if t is None else t.detach()


def finite_real(name: str, value) -> float:
    """A scale argument (``branch_scale``, ``attention_scaling``) as a float, or a clear error
    naming it for anything but a finite real number: a bool, a string, a tensor (whose gradient
    would be dropped), NaN or inf (checked by a comparison, which torch.compile(dynamic=True)
    traces on the symbolic float it passes, where ``math.isfinite`` cannot be traced)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not abs(value) < math.inf:
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


def scaled(grad: Tensor, branch_scale: float) -> Tensor:
    """A residual sum's gradient as its scaled branch receives it: s dx (dx itself for s = 1)."""
    return grad if branch_scale == 1.0 else grad * branch_scale


# ---------------------------------------------------------------------------------------
# References: the same math written the usual way, unfused


def rmsnorm_linear_reference(x, norm_weight, weight, eps=1e-6):
    """:func:`rmsnorm_linear` unfused: F.rms_norm, then F.linear against the weights concatenated."""
    w = torch.cat(_as_list(weight))
    return torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (x.shape[-1],), norm_weight, eps), w)


def linear_residual_reference(a, weight, residual, bias=None, branch_scale=1.0):
    """The x of :func:`linear_residual` unfused: branch_scale * F.linear(a, W, bias) + residual."""
    w = torch.cat(_as_list(weight))
    return branch_scale * torch.nn.functional.linear(a, w, bias) + residual

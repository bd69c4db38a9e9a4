"""One JAX primitive for every gpucoll op inside ``jax.jit``, with an ordered effect.

``gpucoll_p.bind(*xs, kind=..., attrs=..., result_avals=..., alias=...)`` stands for the
op ``kind``. Its abstract evaluation declares :data:`EFFECT`, an *ordered* effect (JAX's
``ordered_effects``): JAX then threads a token through every gpucoll call of a program,
in program order, and across jitted calls. The lowering hands that token to the FFI call
as its last operand and takes the new token from its last result, so XLA cannot reorder
two gpucoll calls, run them concurrently, or drop one whose result is unused.

``has_side_effect=True`` alone (what ``jax.ffi.ffi_call`` offers) does not do this: XLA's
CPU runtime runs independent custom calls in any order or at once, so a ring of
``send``/``recv`` could post every rank's recv first and wait forever.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

import jax
from jax._src import core, effects
from jax._src import dispatch as _dispatch
from jax._src.interpreters import ad as _ad, batching as _batching, mlir
from jax.extend.core import Primitive

# JAX's internals are partly untyped: used through Any.
ad: Any = _ad
batching: Any = _batching
dispatch: Any = _dispatch


@dataclasses.dataclass(frozen=True)
class GpucollEffect(effects.Effect):
    """The ordered effect of a gpucoll call (one for all groups: one program order)."""

    def __str__(self) -> str:
        return "gpucoll"


EFFECT = GpucollEffect()
effects.lowerable_effects.add_type(GpucollEffect)
effects.ordered_effects.add_type(GpucollEffect)
effects.control_flow_allowed_effects.add_type(GpucollEffect)   # inside fori_loop/scan/cond
effects.custom_derivatives_allowed_effects.add_type(GpucollEffect)  # inside custom_vjp rules

gpucoll_p: Any = Primitive("gpucoll")
gpucoll_p.multiple_results = True

# Where each op wants the vmap batch axis on its input and gives it on its output: 0 for
# ops that act on every element alike (a batched call is one bigger call); 1 for ops that
# split or stack along the leading axis (that axis stays first, the batch axis follows it).
BATCH_AXES: dict[str, tuple[int, int]] = {
    "all_reduce": (0, 0), "broadcast": (0, 0), "reduce": (0, 0), "send": (0, 0), "recv": (0, 0),
    "barrier": (0, 0), "all_gather": (0, 1), "gather": (0, 1), "reduce_scatter": (1, 1),
    "scatter": (1, 1), "all_to_all_single": (1, 1),
}


def bind(kind: str, xs: list[Any], attrs: dict[str, Any], results: list[tuple[tuple[int, ...], Any]],
         alias: bool = False) -> list[Any]:
    """The op ``kind`` on ``xs``; ``results`` are the (shape, dtype) of its outputs."""
    avals = tuple(core.ShapedArray(shape, np.dtype(dtype)) for shape, dtype in results)
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else int(v)) for k, v in attrs.items()))
    return list(gpucoll_p.bind(*xs, kind=kind, attrs=frozen, result_avals=avals, alias=alias))


def _abstract_eval(*avals: Any, kind: str, attrs: Any, result_avals: Any, alias: bool) -> Any:
    return list(result_avals), {EFFECT}


def _lowering(ctx: Any, *operands: Any, kind: str, attrs: Any, result_avals: Any, alias: bool,
              platform: str = "cpu") -> Any:
    from . import handler

    token = ctx.tokens_in.get(EFFECT)
    with_token = ctx.replace(avals_in=(*ctx.avals_in, core.abstract_token),
                             avals_out=(*ctx.avals_out, core.abstract_token))
    rule = jax.ffi.ffi_lowering(handler.target(kind, platform), has_side_effect=True,
                                operand_output_aliases={0: 0} if alias else None)
    plan = handler.plan_id(kind, attrs, [(a.shape, a.dtype) for a in ctx.avals_in],
                           [(a.shape, a.dtype) for a in ctx.avals_out])
    results = list(rule(with_token, *operands, token, plan=np.int64(plan)))
    ctx.set_tokens_out(mlir.TokenSet({EFFECT: results.pop()}))
    return results


def _batch(args: Any, dims: Any, *, kind: str, attrs: Any, result_avals: Any, alias: bool) -> Any:
    if kind not in BATCH_AXES:
        raise NotImplementedError(f"gpucoll.functional.{kind} inside jax.vmap is not supported")
    into, out_axis = BATCH_AXES[kind]
    (x,), (d,) = args, dims  # one operand, batched (vmap batches only calls with one)
    size = x.shape[d]
    moved = [batching.moveaxis(x, d, into)]
    avals = tuple(core.ShapedArray(r.shape[:out_axis] + (size,) + r.shape[out_axis:], r.dtype) for r in result_avals)
    outs = gpucoll_p.bind(*moved, kind=kind, attrs=attrs, result_avals=avals, alias=alias)
    return outs, [out_axis] * len(outs)


def _jvp(primals: Any, tangents: Any, *, kind: str, attrs: Any, result_avals: Any, alias: bool) -> Any:
    """send, recv and barrier only (all_reduce SUM has a custom_vjp in calls.py): a send
    has no output; a received value does not depend on the template's values (zero
    tangent); a barrier passes its value through (tangent passed through too)."""
    if kind not in ("send", "recv", "barrier"):
        raise NotImplementedError(
            f"gpucoll.functional.{kind} inside jax.grad/jvp: no differentiation rule (all_reduce and "
            "reduce_scatter with ReduceOp.SUM, all_gather, send, recv and barrier have one; see docs/arrays.md)")
    outs = gpucoll_p.bind(*primals, kind=kind, attrs=attrs, result_avals=result_avals, alias=alias)
    if kind == "barrier":
        tan = tangents[0]
        return outs, [ad.instantiate_zeros(tan)]
    return outs, [ad.Zero(r.to_tangent_aval()) for r in result_avals]


gpucoll_p.def_impl(lambda *xs, **params: dispatch.apply_primitive(gpucoll_p, *xs, **params))
gpucoll_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(gpucoll_p, _lowering, platform="cpu")
# On GPUs the handler runs the group's NCCL op on XLA's stream (handler.make_gpu_handler).
mlir.register_lowering(gpucoll_p, functools.partial(_lowering, platform="cuda"), platform="cuda")
batching.primitive_batchers[gpucoll_p] = _batch
ad.primitive_jvps[gpucoll_p] = _jvp

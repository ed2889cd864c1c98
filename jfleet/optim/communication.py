"""How data-parallel replicas combine their gradients: the engine's replica hook.

Under plain SPMD the engine differentiates the loss of the global batch and GSPMD
all-reduces fp32 gradients where it sees fit. A meta-optimizer that changes *how*
gradients travel (``fp16_allreduce``, DGC) needs each replica's own gradient instead.
A :class:`GradientCommunication` says what to do with it: the engine
(:mod:`jfleet.replicas`) runs the forward and backward of each data-parallel replica
on its shard of the batch inside ``jax.shard_map`` with the data axes (``dp`` x
``sharding``) manual and the other axes automatic, then calls ``reduce`` there with the
replica's gradients and its own state. The state lives in the optimizer
(``opt.comm_state``) with a leading replica dimension sharded over the data axes, so
``nnx.state(optimizer)`` and checkpoints carry it.

Both functions see one replica's values and may use collectives over the data axes;
:func:`data_axes` names the ones present in the mesh the step runs on.

Example:
  >>> import jax.numpy as jnp
  >>> comm = fp16_allreduce()
  >>> comm.init({"w": jnp.zeros(2)})
  ()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jfleet.mesh.topology import DATA_AXES

__all__ = [
    "GradientCommunication",
    "data_axes",
    "fp16_allreduce",
    "mean_communication",
]


class GradientCommunication(NamedTuple):
    """How data-parallel replicas combine their gradients.
    Both functions run per replica inside shard_map with the data axes manual."""

    init: Callable[[Any], Any]  # one replica's grads -> its state
    reduce: Callable[[Any, Any], tuple[Any, Any]]  # (local grads, state) -> (mean grads, new state)


def data_axes(axes: tuple[str, ...] = DATA_AXES) -> tuple[str, ...]:
    """The axes of ``axes`` that are manual where this runs (inside the replica shard_map).

    Outside ``shard_map`` nothing is manual and the answer is ``()``.

    Example:
      >>> data_axes()
      ()
    """
    manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    return tuple(a for a in axes if a in manual)


def _no_state(grads: Any) -> tuple:
    del grads
    return ()


def mean_communication(axes: tuple[str, ...] = DATA_AXES) -> GradientCommunication:
    """The plain average of the replicas' gradients (``pmean`` over ``axes``), in their dtype.

    What data parallelism does; the reference the other communications are measured
    against. ``axes`` absent from the mesh are left out.

    Example:
      >>> mean_communication().init({"w": jnp.zeros(2)})
      ()
    """

    def reduce(grads: Any, state: Any) -> tuple[Any, Any]:
        present = data_axes(axes)
        if not present:
            return grads, state
        return jax.lax.pmean(grads, present), state

    return GradientCommunication(init=_no_state, reduce=reduce)


def fp16_allreduce(
    dtype: Any = jnp.float16, axes: tuple[str, ...] = DATA_AXES
) -> GradientCommunication:
    """Paddle's ``strategy.fp16_allreduce``: gradients travel in half precision.

    Each replica divides its gradient by the replica count in fp32 (Paddle scales the
    gradient by ``1/n`` before its all-reduce too, which keeps the sum in range), casts
    it to ``dtype``, the replicas sum it in ``dtype`` (an all-reduce of half the bytes),
    and the sum is cast back to the gradient's dtype. Leaves that are not wider than
    ``dtype`` (already half, or integer) are averaged as they are.

    The strategy compiler passes ``float16`` (Paddle's choice), or ``bfloat16`` when
    ``strategy.amp`` computes in bfloat16 (fp16's range is too small for unscaled bf16
    gradients). No state.

    Example:
      >>> fp16_allreduce(jnp.bfloat16).init({"w": jnp.zeros(2)})
      ()
    """
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(
            f"fp16_allreduce(dtype={dtype}): the reduction dtype must be float16 or bfloat16."
        )

    def one(g: Any, present: tuple[str, ...], n: int) -> Any:
        g = jnp.asarray(g)
        if not jnp.issubdtype(g.dtype, jnp.floating) or g.dtype.itemsize <= dtype.itemsize:
            return jax.lax.pmean(g, present)
        half = (g / n).astype(dtype)
        return jax.lax.psum(half, present).astype(g.dtype)

    def reduce(grads: Any, state: Any) -> tuple[Any, Any]:
        present = data_axes(axes)
        if not present:
            return grads, state
        n = jax.lax.psum(1, present)
        return jax.tree.map(lambda g: one(g, present, n), grads), state

    return GradientCommunication(init=_no_state, reduce=reduce)

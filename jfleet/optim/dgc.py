"""Deep Gradient Compression (Paddle's ``strategy.dgc``): sparse gradient exchange.

DGC (Lin et al., ICLR 2018) sends only the largest entries of each replica's gradient.
Each data-parallel replica keeps, per parameter, a momentum-corrected accumulation ``u``
and a local gradient accumulation ``v``; every step after ``rampup_begin_step``::

    u = m * u + g              # momentum correction: the momentum is applied locally
    v = v + u                  # local gradient accumulation
    send the top-k entries of |v|, k = floor(numel * (1 - sparsity))
    u, v = 0 where sent        # momentum factor masking

and the replicas' sent entries are averaged: only the ``k`` values and indices of each
replica travel (``2 * k`` numbers per replica instead of the dense tensor). The optimizer then
takes a plain SGD step with the user's learning rate on that average, the momentum being
inside ``u`` already. Before ``rampup_begin_step`` the step is the user's momentum SGD on
the dense average. ``sparsity`` ramps up through its list: at step
``t >= rampup_begin_step`` it is ``sparsity[min(i, len - 1)]`` with
``i = floor((t - rampup_begin_step) * len(sparsity) / rampup_step)`` (Paddle's rule).

As in Paddle, parameters with fewer than ``min_numel`` (16384) entries are not compressed:
they are averaged densely and always take the momentum step.

Two halves plug into the engine: :func:`dgc_communication` is a
:class:`~jfleet.optim.communication.GradientCommunication` (run per replica inside
``shard_map``; its state is each replica's ``u`` and ``v``), :func:`dgc_momentum` is the
optimizer on the averaged gradient.

Limits: the momentum is read once from the optimizer (a momentum schedule is not
followed); Nesterov momentum, weight decay inside the optimizer and gradient clipping are
not supported with DGC (Paddle allows only ``ClipGradByNorm``, applied locally).

Example:
  >>> import jax.numpy as jnp
  >>> comm = dgc_communication(0.9, sparsity=[0.999])
  >>> state = comm.init({"w": jnp.zeros((128, 128)), "b": jnp.zeros(4)})
  >>> state.u["w"].shape, state.u["b"].shape
  ((128, 128), (0,))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jfleet.mesh.topology import DATA_AXES
from jfleet.optim.communication import GradientCommunication, data_axes
from jfleet.optim.hyperparams import inner_hyperparams, learning_rate_state, readable_fix

__all__ = [
    "DGCMomentumState",
    "DGCState",
    "dgc_communication",
    "dgc_momentum",
    "momentum_of",
    "sparsity_index",
]

MIN_NUMEL = 16384
"""Paddle's threshold: smaller parameters are reduced densely (no compression)."""

DEFAULT_SPARSITY = (0.999,)


class DGCState(NamedTuple):
    """One replica's DGC state.

    Attributes:
      count: steps reduced so far (int32).
      u: the momentum-corrected accumulation per parameter (empty for dense ones).
      v: the local gradient accumulation per parameter (empty for dense ones).
    """

    count: jax.Array
    u: Any
    v: Any


class DGCMomentumState(NamedTuple):
    """The DGC optimizer's state: its step count and the user's momentum optimizer's."""

    count: jax.Array
    inner_state: Any


def _check_schedule(
    rampup_begin_step: int, rampup_step: int, sparsity: Sequence[float] | None
) -> tuple[float, ...]:
    for name, value, low in (
        ("rampup_begin_step", rampup_begin_step, 0),
        ("rampup_step", rampup_step, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"dgc_configs {name}={value!r} must be an int >= {low}.")
    values = tuple(sparsity) if sparsity else DEFAULT_SPARSITY
    if not all(isinstance(s, int | float) and 0.0 <= s < 1.0 for s in values):
        raise ValueError(
            f"dgc_configs sparsity={list(sparsity or [])!r}: every value must be in [0, 1), "
            "e.g. [0.75, 0.9375, 0.984375, 0.996, 0.999]."
        )
    return tuple(float(s) for s in values)


def sparsity_index(
    step: jax.Array | int, rampup_begin_step: int, rampup_step: int, levels: int
) -> jax.Array:
    """Which sparsity applies at ``step``: -1 before ``rampup_begin_step`` (dense), else the
    index into the sparsity list (Paddle's ramp-up rule, clamped to the last entry).

    Example:
      >>> [int(sparsity_index(t, 2, 4, 2)) for t in range(8)]
      [-1, -1, 0, 0, 1, 1, 1, 1]
    """
    step = jnp.asarray(step, jnp.int32)
    index = jnp.minimum((step - rampup_begin_step) * levels // rampup_step, levels - 1)
    return jnp.where(step < rampup_begin_step, -1, index)


def _compressed(x: Any, min_numel: int) -> bool:
    return jnp.size(x) >= min_numel and jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _top_k_count(numel: int, sparsity: float) -> int:
    return max(1, int(numel * (1.0 - sparsity)))


def dgc_communication(
    momentum: float,
    *,
    rampup_begin_step: int = 0,
    rampup_step: int = 1,
    sparsity: Sequence[float] | None = None,
    min_numel: int = MIN_NUMEL,
    axes: tuple[str, ...] = DATA_AXES,
) -> GradientCommunication:
    """DGC's gradient exchange between data-parallel replicas (momentum correction, top-k).

    Args:
      momentum: the momentum factor ``m`` of the user's Momentum optimizer.
      rampup_begin_step: steps of dense momentum SGD before compression starts.
      rampup_step: steps over which the sparsity walks through ``sparsity``.
      sparsity: the fractions of entries *not* sent, in order (default ``[0.999]``).
      min_numel: parameters with fewer entries are averaged densely.
      axes: the data-parallel mesh axes (those present where it runs are used).

    Returns:
      A ``GradientCommunication`` whose state is a :class:`DGCState` per replica.

    Raises:
      ValueError: a setting out of range.

    Example:
      >>> import jax.numpy as jnp
      >>> comm = dgc_communication(0.9, rampup_begin_step=5)
      >>> int(comm.init({"w": jnp.zeros(4)}).count)
      0
    """
    levels = _check_schedule(rampup_begin_step, rampup_step, sparsity)
    m = float(momentum)

    def init(grads: Any) -> DGCState:
        def slot(g: Any) -> jax.Array:
            return jnp.zeros_like(g) if _compressed(g, min_numel) else jnp.zeros((0,), g.dtype)

        u = jax.tree.map(slot, grads)
        return DGCState(count=jnp.zeros((), jnp.int32), u=u, v=jax.tree.map(jnp.copy, u))

    def reduce(grads: Any, state: DGCState) -> tuple[Any, DGCState]:
        present = data_axes(axes)
        treedef = jax.tree.structure(grads)
        gs = treedef.flatten_up_to(grads)
        us, vs = treedef.flatten_up_to(state.u), treedef.flatten_up_to(state.v)

        def dense(_: Any) -> tuple[list, list, list]:
            return [_mean(g, present) for g in gs], us, vs

        def sparse(level: float):
            def run(_: Any) -> tuple[list, list, list]:
                out, new_u, new_v = [], [], []
                for g, u, v in zip(gs, us, vs, strict=True):
                    if not _compressed(g, min_numel):
                        out.append(_mean(g, present))
                        new_u.append(u)
                        new_v.append(v)
                        continue
                    u = m * u + g
                    v = v + u
                    mean, sent = _exchange(v, _top_k_count(g.size, level), present)
                    out.append(mean.astype(g.dtype))
                    new_u.append(jnp.where(sent, 0, u))
                    new_v.append(jnp.where(sent, 0, v))
                return out, new_u, new_v

            return run

        index = sparsity_index(state.count, rampup_begin_step, rampup_step, len(levels))
        branches = [sparse(s) for s in levels]
        if rampup_begin_step > 0:  # a dense phase first
            branches, index = [dense, *branches], index + 1
        if len(branches) == 1:
            out, new_u, new_v = branches[0](None)
        else:
            out, new_u, new_v = jax.lax.switch(index, branches, None)
        new_state = DGCState(
            count=state.count + 1, u=treedef.unflatten(new_u), v=treedef.unflatten(new_v)
        )
        return treedef.unflatten(out), new_state

    return GradientCommunication(init=init, reduce=reduce)


def _mean(g: jax.Array, present: tuple[str, ...]) -> jax.Array:
    return jax.lax.pmean(g, present) if present else g


def _exchange(v: jax.Array, k: int, present: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """The replicas' average of each one's top-``k`` entries of ``v`` (by magnitude), and the
    mask of the entries this replica sent.

    Only values and indices travel: each replica writes its ``k`` pairs into its row of an
    ``(replicas, k)`` table and the tables are summed (an all-reduce of ``replicas * k``
    values and as many indices, the all-gather of the pairs with a replicated result).
    """
    flat = v.reshape(-1)
    _, index = jax.lax.top_k(jnp.abs(flat), k)
    values = flat[index]
    sent = jnp.zeros(flat.shape, bool).at[index].set(True).reshape(v.shape)
    n = 1
    if present:
        n = math.prod(jax.lax.axis_size(a) for a in present)
        row = jax.lax.axis_index(present)
        index = jax.lax.psum(jnp.zeros((n, k), index.dtype).at[row].set(index), present)
        values = jax.lax.psum(jnp.zeros((n, k), values.dtype).at[row].set(values), present)
    total = jnp.zeros(flat.shape, v.dtype).at[index.reshape(-1)].add(values.reshape(-1))
    return (total / n).reshape(v.shape), sent


def dgc_momentum(
    inner: optax.GradientTransformation,
    *,
    rampup_begin_step: int = 0,
    min_numel: int = MIN_NUMEL,
) -> optax.GradientTransformationExtraArgs:
    """The optimizer step of DGC on the replicas' averaged gradient.

    Before ``rampup_begin_step``: the user's Momentum update. From then on, parameters
    that DGC compresses (``min_numel`` entries or more) take plain SGD,
    ``p -= lr * g`` with the optimizer's current learning rate (schedules followed), since
    their momentum was applied before the exchange; the others keep the Momentum update.

    Args:
      inner: the user's Momentum optimizer with readable hyperparameters
        (``jfleet.optim.hyperparams.momentum(lr, momentum)``).
      rampup_begin_step: as in :func:`dgc_communication` (the two count steps alike).
      min_numel: as in :func:`dgc_communication`.

    Raises:
      ValueError: ``inner`` is not a Momentum optimizer with a readable learning rate.

    Example:
      >>> import jax.numpy as jnp
      >>> from jfleet.optim import hyperparams
      >>> tx = dgc_momentum(hyperparams.momentum(0.1), min_numel=1)
      >>> u, _ = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}))
      >>> [round(float(x), 6) for x in u["w"]]
      [-0.1, -0.1]
    """
    momentum_of(inner)  # the checks, at construction
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> DGCMomentumState:
        return DGCMomentumState(count=jnp.zeros((), jnp.int32), inner_state=inner.init(params))

    def update_fn(
        updates: Any, state: DGCMomentumState, params: Any = None, **extra: Any
    ) -> tuple[Any, DGCMomentumState]:
        steps, inner_state = inner.update(updates, state.inner_state, params, **extra)
        lr = learning_rate_state(inner_state).hyperparams["learning_rate"]
        compressing = state.count >= rampup_begin_step

        def one(g: jax.Array, step: jax.Array) -> jax.Array:
            if not _compressed(g, min_numel):
                return step
            return jnp.where(compressing, (-lr * g).astype(step.dtype), step)

        out = jax.tree.map(one, updates, steps)
        return out, DGCMomentumState(count=state.count + 1, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def momentum_of(tx: optax.GradientTransformation) -> float:
    """The momentum factor of the user's optimizer, which DGC requires to be a Momentum.

    Raises:
      ValueError: another optimizer family (Paddle's DGC needs ``Momentum`` too), Nesterov
        momentum, or hyperparameters hidden in closures; the message shows the fix.

    Example:
      >>> from jfleet.optim import hyperparams
      >>> momentum_of(hyperparams.momentum(0.1, momentum=0.8))
      0.8
    """
    try:
        family, hp = inner_hyperparams(tx)
    except ValueError as error:
        raise ValueError(
            f"strategy.dgc needs a Momentum optimizer with readable hyperparameters: {error}"
        ) from error
    if family != "momentum":
        raise ValueError(
            f"strategy.dgc needs a Momentum optimizer (as Paddle's DGCMomentumOptimizer "
            f"does), got {family!r}; build it as {readable_fix('momentum')}."
        )
    probe = jnp.ones((), jnp.float32)
    first, _ = tx.update(probe, tx.init(jnp.zeros((), jnp.float32)))  # Nesterov: lr * (1 + m)
    if not jnp.allclose(first, -hp["learning_rate"], rtol=1e-6):
        raise ValueError(
            "strategy.dgc applies plain momentum (DGC's momentum correction); the optimizer "
            "has nesterov=True: build it with nesterov=False."
        )
    return round(float(hp["momentum"]), 7)

"""The engine's per-replica step: each data-parallel replica on its own shard of the batch.

Plain data parallelism in jfleet differentiates the loss of the global batch and lets
GSPMD reduce the gradients. Meta-optimizers that change how replicas combine their work
(the gradient hook of :mod:`jfleet.optim.communication`: ``fp16_allreduce``, DGC;
LocalSGD, :mod:`jfleet.optim.localsgd`) need the replicas' own values, so the engine
runs that part of the step in ``jax.shard_map`` with the data axes (``dp`` x
``sharding``, :attr:`jfleet.placement.Placement.data_axes`) manual and every other axis
(``mp``, ``sep``) automatic.

Inside, each replica sees the model with its parameters (cast to vary over the data
axes, so its gradient is its own, not the replicas' sum) and its rows of the batch.
What leaves the replica step, per kind:

* the loss: the replicas' losses averaged (for a loss that is a mean over the batch, the
  loss of the global batch);
* the model's other state (``nnx.BatchStat``, counters): values that differ between
  replicas are averaged (floating) — a state that differs and is not floating is an
  error; values equal on every replica pass through;
* the ``aux`` of a ``(loss, aux)`` loss function: a per-example array (rank >= 1) that
  differs between replicas is gathered along its first axis (as the global batch would
  give it), a differing scalar is averaged (floating), summed (integer) or and-ed (bool).

Replica-local state (the hook's ``comm_state``, LocalSGD's parameters) is stored with a
leading replica dimension sharded over the data axes: replica ``i`` owns row ``i``.

Not supported (clear errors naming both switches, :func:`check_supported`): ZeRO-3
(parameters sharded over a data axis between steps) and pipeline parallelism (its own
``shard_map`` over ``pp``).

Example:
  >>> from jfleet.placement import Placement
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True, log_level="WARNING")
  >>> replica_count(Placement.from_fleet())
  8
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.optim.communication import GradientCommunication
from jfleet.placement import Placement
from jfleet.topology import PP

__all__ = [
    "check_supported",
    "combine_aux",
    "combine_state",
    "init_replica_state",
    "replica_count",
    "replica_gradients",
    "stack_spec",
    "vary",
    "varying_axes",
]

Objective = Callable[[nnx.Module, Any, jax.Array], tuple[jax.Array, tuple[jax.Array, Any]]]


def replica_count(placement: Placement) -> int:
    """How many data-parallel replicas a step has (the product of the data axes)."""
    return math.prod(placement.mesh.shape[a] for a in placement.data_axes)


def check_supported(placement: Placement, switch: str) -> None:
    """Raises for layouts the per-replica step cannot run; ``switch`` names the user's switch.

    Raises:
      ValueError: ZeRO-3, or a pipeline axis (``pp`` > 1).
    """
    if placement.zero_stage >= 3:
        raise ValueError(
            f"{switch} cannot be combined with ZeRO stage 3 (strategy.sharding with "
            "sharding_configs['stage']=3, or group_sharded_parallel level 'p_g_os'): it keeps "
            "parameters sharded over a data axis, and each replica needs whole ones. Use "
            f"stage 1 or 2, or turn {switch.split('=')[0]} off."
        )
    pp = dict(placement.mesh.shape).get(PP, 1)
    if pp > 1:
        raise ValueError(
            f"{switch} cannot be combined with pipeline parallelism (hybrid_configs "
            f"pp_degree={pp}): the pipeline runs its own shard_map over 'pp'. Set "
            f"pp_degree=1 or turn {switch.split('=')[0]} off."
        )


def varying_axes(x: Any) -> frozenset:
    """The manual axes ``x`` varies over (its type inside shard_map; empty outside)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def _varying(x: Any, axes: tuple[str, ...]) -> bool:
    return bool(set(axes) & varying_axes(x))


def vary(x: Any, axes: tuple[str, ...]) -> Any:
    """``x`` cast to vary over the ``axes`` it does not vary over yet (inside shard_map)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def stack_spec(axes: tuple[str, ...]) -> P:
    """The layout of replica-local state: the leading (replica) dimension over ``axes``."""
    return P(axes)


def _batch_specs(batch: Any, axes: tuple[str, ...]) -> Any:
    return jax.tree.map(lambda x: P(axes) if jnp.ndim(x) else P(), batch)


def combine_state(tree: Any, axes: tuple[str, ...]) -> Any:
    """The model's non-parameter state leaving the replicas: differing floats averaged.

    Raises:
      ValueError: a non-floating value differs between replicas.
    """

    def one(path: Any, x: Any) -> Any:
        if not _varying(x, axes):
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.pmean(x, axes)
        raise ValueError(
            f"the model's state {jax.tree_util.keystr(path)} ({x.dtype}) differs between "
            "data-parallel replicas and is not floating, so it cannot be averaged; keep such "
            "state out of the forward, or train without the per-replica meta-optimizer."
        )

    return jax.tree_util.tree_map_with_path(one, tree)


def combine_aux(tree: Any, axes: tuple[str, ...]) -> Any:
    """A loss function's ``aux`` leaving the replicas (see the module docstring)."""

    def one(x: Any) -> Any:
        x = jnp.asarray(x)
        if not _varying(x, axes):
            return x
        if x.ndim:
            return jax.lax.all_gather(x, axes, axis=0, tiled=True)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.pmean(x, axes)
        if x.dtype == jnp.bool_:
            return jax.lax.pmin(x.astype(jnp.int32), axes).astype(jnp.bool_)
        return jax.lax.psum(x, axes)

    return jax.tree.map(one, tree)


def init_replica_state(init: Callable[[Any], Any], like: Any, placement: Placement) -> Any:
    """``init`` run on every replica, stacked: each leaf gets a leading replica dimension.

    Args:
      init: one replica's state from a tree shaped like ``like``.
      like: a pure tree of arrays (zeros shaped like the gradients).
      placement: the step's placement (mesh, data axes).

    Returns:
      The state, each leaf ``[replicas, ...]`` sharded over the data axes.
    """
    axes = placement.data_axes

    def body(tree: Any) -> Any:
        return jax.tree.map(lambda x: vary(jnp.asarray(x)[None], axes), init(tree))

    mapped = jax.shard_map(
        body,
        mesh=placement.mesh,
        in_specs=(P(),),
        out_specs=stack_spec(axes),
        axis_names=set(axes),
    )
    return jax.jit(mapped)(like)


def local_rows(tree: Any) -> Any:
    """One replica's row of stacked replica-local state (inside shard_map)."""
    return jax.tree.map(lambda x: x[0], tree)


def restack(tree: Any, axes: tuple[str, ...]) -> Any:
    """A replica's state as its row of the stacked state (inside shard_map)."""
    return jax.tree.map(lambda x: vary(jnp.asarray(x), axes)[None], tree)


def _pure_like(tree: Any, pure: Any) -> Any:
    """``pure``'s leaves in ``tree``'s structure (a State of Variables from pure arrays)."""
    return jax.tree.unflatten(jax.tree.structure(tree), jax.tree.leaves(pure))


def replica_gradients(
    model: nnx.Module,
    wrt: Any,
    objective: Objective,
    batch: Any,
    scale: jax.Array,
    placement: Placement,
    comm: GradientCommunication,
    comm_state: Any,
) -> tuple[Any, jax.Array, Any, Any]:
    """Each replica's gradient of its batch shard, combined by ``comm.reduce``.

    Runs inside the engine's jitted step. The model's non-parameter state is updated in
    place (:func:`combine_state`).

    Args:
      model: the merged model (parameters replicated over the data axes).
      wrt: the optimizer's filter of the differentiated variables.
      objective: ``objective(model, batch, scale) -> (scaled loss, (loss, aux))``.
      batch: the global batch (leading dimension split over the data axes).
      scale: the loss scale (1.0 without loss scaling).
      placement: the step's placement.
      comm: the communication.
      comm_state: its stacked state (pure arrays, ``[replicas, ...]``).

    Returns:
      ``(grads, loss, aux, new_comm_state)``: the combined gradients (an ``nnx.State``
      shaped like the parameters), the replicas' mean loss, the combined aux, the new
      stacked state.
    """
    axes = placement.data_axes
    graphdef, params, rest = nnx.split(model, wrt, ...)

    def body(params, rest, batch, scale, state):
        params = jax.tree.map(lambda x: vary(x, axes), params)
        local = nnx.merge(graphdef, params, rest)
        grads, (loss, aux) = nnx.grad(objective, argnums=nnx.DiffState(0, wrt), has_aux=True)(
            local, batch, scale
        )
        pure = nnx.as_pure(grads)
        reduced, new_state = comm.reduce(pure, local_rows(state))
        _, _, new_rest = nnx.split(local, wrt, ...)
        return (
            reduced,
            combine_state(new_rest, axes),
            jax.lax.pmean(loss, axes),
            combine_aux(aux, axes),
            restack(new_state, axes),
        )

    mapped = jax.shard_map(
        body,
        mesh=placement.mesh,
        in_specs=(P(), P(), _batch_specs(batch, axes), P(), stack_spec(axes)),
        out_specs=(P(), P(), P(), P(), stack_spec(axes)),
        axis_names=set(axes),
    )
    reduced, new_rest, loss, aux, new_state = mapped(params, rest, batch, scale, comm_state)
    nnx.update(model, new_rest)
    return _pure_like(params, reduced), loss, aux, new_state

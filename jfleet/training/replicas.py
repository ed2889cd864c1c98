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

Random streams (``nnx.Rngs`` in the model, e.g. for ``nnx.Dropout``) are the same on
every replica, so replica ``i`` draws for its rows what replica 0 draws for its own: the
masks differ from those one global-batch step would draw, as they do between Paddle's
data-parallel workers seeded alike.

Replica-local state (the hook's ``comm_state``, LocalSGD's parameters) is stored with a
leading replica dimension sharded over the data axes: replica ``i`` owns row ``i``.

Not supported (clear errors naming both switches, :func:`check_supported`): ZeRO-3
(parameters sharded over a data axis between steps) and pipeline parallelism (its own
``shard_map`` over ``pp``).

Example:
  >>> from jfleet.mesh.placement import Placement
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
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import PP
from jfleet.optim import hyperparams
from jfleet.optim.communication import GradientCommunication
from jfleet.optim.localsgd import adaptive_k_steps, sync_due
from jfleet.optim.loss_scale import finite_flags
from jfleet.runtime.log import logger

__all__ = [
    "check_localsgd",
    "check_supported",
    "combine_aux",
    "combine_state",
    "init_replica_state",
    "localsgd_step",
    "per_replica_leaves",
    "replica_count",
    "replica_gradients",
    "stack_localsgd_state",
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


def check_localsgd(placement: Placement, switch: str) -> None:
    """Raises for layouts LocalSGD cannot run: those of :func:`check_supported`, and ZeRO
    (its optimizer state is split over replicas that LocalSGD keeps apart)."""
    check_supported(placement, switch)
    if placement.zero_stage >= 1:
        raise ValueError(
            f"{switch} cannot be combined with ZeRO (stage {placement.zero_stage} over "
            f"'{placement.zero_axis}', from strategy.sharding or group_sharded_parallel): each "
            "replica keeps its own optimizer state, which ZeRO would split between them. "
            f"Turn one of them off."
        )


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


def _backward(graphdef, params, rest, wrt, objective, batch, scale):
    """One replica's forward and backward: its pure gradients, loss, aux, and its model."""
    model = nnx.merge(graphdef, params, rest)
    grads, (loss, aux) = nnx.grad(objective, argnums=nnx.DiffState(0, wrt), has_aux=True)(
        model, batch, scale
    )
    return nnx.as_pure(grads), loss, aux, model


def _leaving(model, wrt, loss, aux, axes):
    """What leaves a replica besides its own state: the model's other state, loss, aux."""
    _, _, rest = nnx.split(model, wrt, ...)
    return combine_state(rest, axes), jax.lax.pmean(loss, axes), combine_aux(aux, axes)


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
        grads, loss, aux, local = _backward(graphdef, params, rest, wrt, objective, batch, scale)
        reduced, new_state = comm.reduce(grads, local_rows(state))
        return (reduced, *_leaving(local, wrt, loss, aux, axes), restack(new_state, axes))

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


# ------------------------------------------------------------------ LocalSGD
def _stack_like(tree: Any, mask: tuple[bool, ...], placement: Placement) -> Any:
    """``tree`` with the leaves ``mask`` marks stacked per replica (as plain arrays)."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_var)
    picked = [x.get_value() if is_var(x) else x for x, m in zip(leaves, mask, strict=True) if m]
    stacked = iter(init_replica_state(lambda t: t, picked, placement) if picked else [])
    return jax.tree.unflatten(
        treedef, [next(stacked) if m else x for x, m in zip(leaves, mask, strict=True)]
    )


def per_replica_leaves(tx: Any, params: Any, placement: Placement) -> tuple[bool, ...]:
    """Which leaves of ``tx``'s state differ between replicas that step on their own.

    Traced (never run): each replica updates its own parameters with its own gradients;
    a state leaf that comes out varying over the data axes (moments, accumulators, a
    finite-step counter) is kept per replica, the others (step counts, the learning rate)
    once. Repeated until no new leaf varies.

    Args:
      tx: the compiled chain.
      params: a pure tree of the parameters (arrays or shape structs).
      placement: the step's placement.
    """
    axes = placement.data_axes
    state = jax.eval_shape(tx.init, params)
    leaves, treedef = jax.tree.flatten(state)
    mask = [False] * len(leaves)
    for _ in range(len(leaves) + 1):
        found: list[bool] = []

        def body(params, leaves, mask=tuple(mask), found=found):
            params = jax.tree.map(lambda x: vary(x, axes), params)
            st = [vary(x, axes) if m else x for x, m in zip(leaves, mask, strict=True)]
            _, new = tx.update(params, jax.tree.unflatten(treedef, st), params)
            found[:] = [_varying(x, axes) for x in jax.tree.leaves(new)]
            return ()

        mapped = jax.shard_map(
            body, mesh=placement.mesh, in_specs=(P(), P()), out_specs=(), axis_names=set(axes)
        )
        jax.eval_shape(mapped, params, leaves)
        new = [a or b for a, b in zip(mask, found, strict=True)]
        if new == mask:
            break
        mask = new
    return tuple(mask)


def stack_localsgd_state(tx: Any, params: Any, state: Any, config: Any, placement: Placement):
    """``(inner state, LocalSGD state, mask)`` for an optimizer bound under LocalSGD.

    ``state`` is ``tx.init(params)``; its per-replica leaves (:func:`per_replica_leaves`)
    get a leading replica dimension, and every replica starts from ``params``.
    """
    pure = nnx.as_pure(params)
    mask = per_replica_leaves(tx, pure, placement)
    local = config.init(init_replica_state(lambda t: t, pure, placement))
    replicated = placement.named(P())
    local = local._replace(
        **{f: jax.device_put(getattr(local, f), replicated) for f in local._fields[1:]}
    )
    return _stack_like(state, mask, placement), local, mask


def localsgd_step(
    model: nnx.Module,
    opt: Any,
    objective: Objective,
    batch: Any,
    scale: jax.Array,
    placement: Placement,
) -> tuple[jax.Array, Any, jax.Array]:
    """One LocalSGD step: every replica steps on its own parameters; averages when due.

    Runs inside the engine's jitted step and updates ``model`` (the parameters of the
    last average, :mod:`jfleet.optim.localsgd`) and ``opt`` (per-replica parameters and
    state, counters) in place.

    Returns:
      ``(loss, aux, flags)``: the replicas' mean loss, the combined aux, and the finite
      flags of the loss and the gradients (a replica's non-finite value counts for all).
    """
    config, tx, wrt = opt.localsgd, opt.tx, opt.wrt
    axes = placement.data_axes
    graphdef, params, rest = nnx.split(model, wrt, ...)
    leaves, treedef = jax.tree.flatten(nnx.as_pure(opt.opt_state))
    mask = opt.replica_leaves
    specs = [stack_spec(axes) if m else P() for m in mask]
    local = nnx.as_pure(opt.local_state)
    local_specs = local._replace(params=stack_spec(axes), **dict.fromkeys(local._fields[1:], P()))

    def body(snapshot, rest, batch, scale, leaves, local):
        mine = local_rows(local.params)
        grads, loss, aux, replica = _backward(
            graphdef, _pure_like(snapshot, mine), rest, wrt, objective, batch, scale
        )
        flags = finite_flags((loss, grads)).astype(jnp.int32)
        flags = jax.lax.pmin(flags, axes).astype(jnp.bool_)
        state = [x[0] if m else x for x, m in zip(leaves, mask, strict=True)]
        updates, new_state = tx.update(grads, jax.tree.unflatten(treedef, state), mine)
        stepped = optax.apply_updates(mine, updates)
        step = local.step + 1
        due = sync_due(step, local.last_sync, local.k_steps, config.begin_step)
        adapt = config.adaptive and due & (step > config.begin_step)
        first = step == 1
        pure_snapshot = nnx.as_pure(snapshot)
        synced = jax.lax.cond(due, lambda: jax.lax.pmean(stepped, axes), lambda: pure_snapshot)
        new_local = local._replace(
            params=restack(
                jax.tree.map(lambda s, p: jnp.where(due, vary(s, axes), p), synced, stepped),
                axes,
            ),
            step=step,
            last_sync=jnp.where(due, step, local.last_sync),
        )
        if config.adaptive:
            avg_loss = jax.lax.cond(
                first | adapt, lambda: jax.lax.pmean(loss, axes), lambda: jnp.float32(0)
            )
            lr = _learning_rate(new_state, opt.inner_tx)
            loss0 = jnp.where(first, avg_loss, local.loss0)
            lr0 = jnp.where(first, lr, local.lr0)
            k = adaptive_k_steps(lr0, loss0, lr, avg_loss, config.k_steps)
            new_local = new_local._replace(
                k_steps=jnp.where(adapt, k, local.k_steps), loss0=loss0, lr0=lr0
            )
        new_leaves = [
            restack(x, axes) if m else x
            for x, m in zip(jax.tree.leaves(new_state), mask, strict=True)
        ]
        combined, mean_loss, aux = _leaving(replica, wrt, loss, aux, axes)
        return synced, combined, mean_loss, aux, flags, new_leaves, new_local

    mapped = jax.shard_map(
        body,
        mesh=placement.mesh,
        in_specs=(P(), P(), _batch_specs(batch, axes), P(), specs, local_specs),
        out_specs=(P(), P(), P(), P(), P(), specs, local_specs),
        axis_names=set(axes),
    )
    synced, new_rest, loss, aux, flags, new_leaves, new_local = mapped(
        params, rest, batch, scale, leaves, local
    )
    nnx.update(model, _pure_like(params, synced), new_rest)
    nnx.update(opt.opt_state, nnx.state(jax.tree.unflatten(treedef, new_leaves)))
    nnx.update(opt.local_state, nnx.state(new_local))
    opt.step[...] += 1
    return loss, aux, flags


def _learning_rate(state: Any, inner_tx: Any) -> jax.Array:
    """The learning rate the step applied, from the injected hyperparameters; 1.0 (a
    constant rate: the adaptive ratio's ``lr0 / lr`` is 1) when it is not readable."""
    try:
        node = hyperparams.learning_rate_state(state, inner_tx)
    except ValueError:
        logger.warning(
            "adaptive LocalSGD: the optimizer's learning rate is not readable, so it is taken "
            "as constant (lr0 / lr = 1); build it with jfleet.optim.hyperparams (e.g. "
            "hyperparams.sgd(0.1)) to let a changing rate into the interval"
        )
        return jnp.float32(1.0)
    return jnp.asarray(node.hyperparams["learning_rate"], jnp.float32)

"""``fleet.distributed_model`` and ``group_sharded_parallel``: place a model for the strategy.

``distributed_model(model)`` applies the strategy's model-side settings to an NNX
model and places its variables on the mesh:

  * AMP (``strategy.amp``): compute dtype per module class, fp16/bf16 parameters for O2;
  * recompute (``strategy.recompute``): named sub-modules run under ``jax.checkpoint``;
  * placement: parameters replicated for data parallel, sharded over the
    ``sharding`` axis for ZeRO stage 3, laid out by their ``out_sharding``
    metadata for tensor parallel.

It returns a :class:`DistributedModel`, an ``nnx.Module`` that holds the model as
``.module``, forwards calls to it, and trains through the engine with
:meth:`DistributedModel.train_batch`.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True)
  >>> model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
  >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))}
  >>> loss = model.train_batch(batch, opt, loss_fn=loss_fn)
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
from flax import nnx

from jfleet.distributed_optimizer import DistributedOptimizer
from jfleet.engine import EvalStep, LossFn, TrainStep
from jfleet.placement import ParallelPlan

_LEVELS = {"os": 1, "os_g": 2, "p_g_os": 3}
_train_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_eval_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DistributedModel(nnx.Module):
    """An NNX model placed for a parallel plan, with Paddle's ``train_batch`` / ``eval_batch``.

    Calls go to the wrapped module. Inside your own ``@nnx.jit`` step pass the
    ``DistributedModel`` (or ``.module``) consistently with the optimizer.
    """

    def __init__(self, module: nnx.Module, plan: ParallelPlan) -> None:
        self.module = module
        self.plan = plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train_batch(
        self,
        batch: Any,
        optimizer: DistributedOptimizer,
        loss_fn: LossFn | None = None,
    ) -> jax.Array:
        """One training step on ``batch`` through the engine; returns the fp32 loss.

        Args:
          batch: a pytree of arrays whose leading dimension is the global batch
            (divisible by dp x sharding).
          optimizer: from ``fleet.distributed_optimizer``.
          loss_fn: ``loss_fn(model, batch)`` returning a scalar or ``(loss, aux)``.
        """
        if loss_fn is None:
            raise TypeError("train_batch needs loss_fn=loss_fn(model, batch) -> loss.")
        step = _cached(_train_steps, loss_fn, self.plan, TrainStep)
        return step(self, optimizer, batch)

    def eval_batch(self, batch: Any, loss_fn: LossFn | None = None) -> jax.Array:
        """The loss on ``batch`` without updating anything."""
        if loss_fn is None:
            raise TypeError("eval_batch needs loss_fn=loss_fn(model, batch) -> loss.")
        step = _cached(_eval_steps, loss_fn, self.plan, EvalStep)
        return step(self, batch)


def _cached(table, loss_fn, plan, cls):
    per_fn = table.setdefault(loss_fn, {})
    if plan not in per_fn:
        per_fn[plan] = cls(loss_fn, plan)
    return per_fn[plan]


def apply_model_settings(model: nnx.Module, strategy: Any) -> nnx.Module:
    """The strategy's model-side settings, in place: AMP dtypes (``amp``), recompute.

    The same call a single-device reference run uses to build the identical model.
    """
    if strategy.amp:
        from jfleet.amp import apply_amp
        from jfleet.optim.compiler import amp_settings

        settings = amp_settings(strategy)
        apply_amp(
            model,
            dtype=settings.dtype,
            level=settings.level,
            custom_white_list=tuple(strategy.amp_configs["custom_white_list"]),
            custom_black_list=tuple(strategy.amp_configs["custom_black_list"]),
        )
    if strategy.recompute:
        from jfleet.recompute import apply_recompute

        configs = strategy.recompute_configs
        apply_recompute(
            model, configs["checkpoints"], enable_offload=bool(configs["enable_offload"])
        )
    return model


def prepare_model(model: nnx.Module, strategy: Any, plan: ParallelPlan) -> DistributedModel:
    """Applies the strategy's AMP and recompute settings, places the model, wraps it."""
    if isinstance(model, DistributedModel):
        raise ValueError("the model is already a DistributedModel; pass it on as it is.")
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model={type(model).__name__} is not a flax.nnx.Module; jfleet distributes NNX "
            "modules."
        )
    if strategy is not None:
        apply_model_settings(model, strategy)
    plan.place_params(model)
    return DistributedModel(model, plan)


def group_sharded_parallel(
    model: nnx.Module,
    optimizer: Any,
    level: str,
    scaler: Any = None,
    group: Any = None,
    offload: bool = False,
    sync_buffers: bool = False,
    buffer_max_size: int = 2**23,
    segment_size: int = 2**20,
    sync_comm: bool = False,
    dp_group: Any = None,
    exclude_layer: Any = None,
) -> tuple[DistributedModel, DistributedOptimizer, Any]:
    """Paddle's ZeRO entry point: ``level`` 'os' (stage 1), 'os_g' (2) or 'p_g_os' (3).

    Shards over the mesh's ``sharding`` axis when its degree is above 1, else over
    ``dp`` (every device, for a pure data-parallel fleet). Without ``fleet.init``
    a default fleet (data parallel over all devices) is started. The buffer and
    communication knobs (``buffer_max_size``, ``segment_size``, ``sync_comm``,
    ``sync_buffers``) mean nothing under SPMD and are ignored (logged).

    Returns:
      ``(model, optimizer, scaler)`` as Paddle does.

    Raises:
      ValueError: an unknown level, or offload / exclude_layer, which jfleet does
        not provide.
    """
    from jfleet import fleet
    from jfleet._logging import logger

    if level not in _LEVELS:
        raise ValueError(
            f"level={level!r} is not a group_sharded_parallel level; expected one of "
            f"{list(_LEVELS)} (ZeRO stage 1, 2, 3)."
        )
    if offload:
        raise ValueError("group_sharded_parallel(offload=True) is not available in jfleet yet.")
    if exclude_layer:
        raise ValueError(
            f"group_sharded_parallel(exclude_layer={exclude_layer!r}) is not available in "
            "jfleet yet; every parameter is sharded."
        )
    if group is not None or dp_group is not None:
        raise ValueError(
            "group_sharded_parallel(group=..., dp_group=...) is not needed in jfleet: the "
            "sharding axis of the fleet's mesh is the group; drop these arguments."
        )
    logger.info(
        "group_sharded_parallel: buffer_max_size, segment_size, sync_comm and sync_buffers "
        "mean nothing under SPMD and are ignored"
    )
    if fleet._fleet._role_maker is None:
        logger.info("group_sharded_parallel: no fleet.init yet; starting a data-parallel fleet")
        fleet.init(is_collective=True)
    mesh = fleet.get_hybrid_communicate_group().mesh
    axis = "sharding" if mesh.shape["sharding"] > 1 else "dp"
    plan = ParallelPlan(mesh=mesh, zero_stage=_LEVELS[level], zero_axis=axis)
    if not isinstance(optimizer, DistributedOptimizer):
        optimizer = fleet.distributed_optimizer(optimizer)
    wrapped = prepare_model(model, None, plan)
    optimizer.init(wrapped, plan)
    return wrapped, optimizer, scaler

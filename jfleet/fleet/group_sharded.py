"""Paddle's ZeRO entry point ``group_sharded_parallel(model, optimizer, level)``.

It starts a data-parallel fleet when none is running and wraps the optimizer with
``fleet.distributed_optimizer``, so it belongs to the facade.

Example:
  >>> import optax
  >>> from flax import nnx
  >>> model, opt, _ = group_sharded_parallel(
  ...     nnx.Linear(8, 8, rngs=nnx.Rngs(0)), optax.adam(1e-3), "os_g")
  >>> model.placement.zero_stage, model.placement.zero_axis
  (2, 'dp')
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jfleet.fleet.fleet_base import fleet
from jfleet.mesh import context as _context
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import DP, SHARDING
from jfleet.optim.compiler import META_ORDER
from jfleet.precision.grad_scaler import GradScaler
from jfleet.runtime.log import logger
from jfleet.training.distributed_model import DistributedModel, prepare_model
from jfleet.training.distributed_optimizer import DistributedOptimizer

_LEVELS = {"os": 1, "os_g": 2, "p_g_os": 3}


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

    ``scaler`` (a ``jfleet.amp.GradScaler``) attaches its fp16 loss scaling to the
    optimizer before its state is made, and is returned as the third item (Paddle wraps
    it for sharded unscaling; under SPMD the finite check is already global).
    The optimizer's ``applied_meta_list`` then names the ZeRO stage it applied
    (``"ShardingOptimizer"``, Paddle's ``GroupShardedOptimizerStage2`` /
    ``GroupShardedStage3`` as ``zero_stage`` on the model's placement), after the
    meta-optimizers the strategy applied.

    Returns:
      ``(model, optimizer, scaler)`` as Paddle does.

    Raises:
      ValueError: an unknown level, or offload / exclude_layer, which jfleet does
        not provide.
      TypeError: ``scaler`` is not a ``GradScaler``.

    Example:
      >>> import optax
      >>> from jfleet import fleet
      >>> from jfleet.models import TinyLM, lm_batches, lm_loss
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> from jfleet import group_sharded_parallel
      >>> strategy = fleet.DistributedStrategy()
      >>> strategy.hybrid_configs = {"sharding_degree": 8}
      >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
      >>> model, opt, _ = group_sharded_parallel(TinyLM(), optax.adam(1e-3), level="os_g")
      >>> opt.applied_meta_list
      ('ShardingOptimizer',)
    """
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
    if _context.current() is None:
        logger.info("group_sharded_parallel: no fleet.init yet; starting a data-parallel fleet")
        fleet.init(is_collective=True)
    mesh = fleet.get_hybrid_communicate_group().mesh
    axis = SHARDING if mesh.shape[SHARDING] > 1 else DP
    placement = Placement(mesh=mesh, zero_stage=_LEVELS[level], zero_axis=axis)
    if scaler is not None and not isinstance(scaler, GradScaler):
        raise TypeError(
            f"group_sharded_parallel(scaler={scaler!r}): expected a jfleet.amp.GradScaler "
            "(Paddle's paddle.amp.GradScaler) or None."
        )
    if not isinstance(optimizer, DistributedOptimizer):
        optimizer = fleet.distributed_optimizer(optimizer)
    if scaler is not None:
        scaler.attach(optimizer)
    applied = {*optimizer.applied_meta_list, "ShardingOptimizer"}
    optimizer.applied_meta_list = tuple(sorted(applied, key=META_ORDER.index))
    wrapped = prepare_model(model, None, placement)
    optimizer.init(wrapped, placement)
    return wrapped, optimizer, scaler

"""Paddle's optimizer wrapper classes as ``isinstance`` checks on jfleet's one optimizer.

Paddle wraps the user's optimizer in layers (``HybridParallelOptimizer`` around
``DygraphShardingOptimizer``; static meta-optimizers such as ``AMPOptimizer``), and
ported code asks ``isinstance(optimizer, DygraphShardingOptimizer)``. jfleet has one
object, :class:`~jfleet.distributed_optimizer.DistributedOptimizer`, whose
``applied_meta_list`` says what the strategy applied; each class here answers
``isinstance`` from it:

- ``HybridParallelOptimizer``: every ``DistributedOptimizer`` (what
  ``fleet.distributed_optimizer`` returns in Paddle's eager mode);
- ``DygraphShardingOptimizer``: sharding applied and ``split_param`` off;
  ``DygraphShardingOptimizerV2``: sharding applied and
  ``hybrid_configs["sharding_configs"].split_param`` on (Paddle's choice between them);
- ``ShardingOptimizer``, ``AMPOptimizer``, ``GradientMergeOptimizer``,
  ``RecomputeOptimizer``, ``LambOptimizer``, ``LarsOptimizer``: that name in
  ``applied_meta_list``;
- ``HybridParallelGradScaler``: every :class:`~jfleet.amp.GradScaler` (what
  ``fleet.distributed_scaler`` returns).

Calling ``HybridParallelOptimizer(optimizer, hcg, strategy)`` (or a sharding class)
builds the optimizer with ``fleet.distributed_optimizer(optimizer, strategy)``.

Example:
  >>> import optax
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "sharding_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
  >>> isinstance(opt, DygraphShardingOptimizer), isinstance(opt, DygraphShardingOptimizerV2)
  (True, False)
"""

from __future__ import annotations

from typing import Any

from jfleet.mesh import context as _context
from jfleet.precision.grad_scaler import GradScaler
from jfleet.training.distributed_optimizer import DistributedOptimizer

__all__ = [
    "AMPOptimizer",
    "DygraphShardingOptimizer",
    "DygraphShardingOptimizerV2",
    "GradientMergeOptimizer",
    "HybridParallelGradScaler",
    "HybridParallelOptimizer",
    "LambOptimizer",
    "LarsOptimizer",
    "RecomputeOptimizer",
    "ShardingOptimizer",
]


class _Kind(type):
    """Metaclass: ``isinstance`` asks the class's ``_matches``."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj) or cls._matches(obj)


class _OptimizerKind(metaclass=_Kind):
    _name = ""

    @classmethod
    def _matches(cls, obj: Any) -> bool:
        return isinstance(obj, DistributedOptimizer) and cls._name in obj.applied_meta_list

    def __new__(cls, optimizer: Any, hcg: Any = None, strategy: Any = None) -> Any:
        from jfleet.fleet.fleet_base import fleet  # the facade's Fleet object, at call time

        return fleet.distributed_optimizer(optimizer, strategy)


def _split_param() -> bool:
    run = _context.current()
    if run is None:
        return False
    return bool(run.strategy.hybrid_configs["sharding_configs"].split_param)


class HybridParallelOptimizer(_OptimizerKind):
    """Every jfleet ``DistributedOptimizer`` (Paddle's eager hybrid optimizer)."""

    @classmethod
    def _matches(cls, obj: Any) -> bool:
        return isinstance(obj, DistributedOptimizer)


class ShardingOptimizer(_OptimizerKind):
    """A ``DistributedOptimizer`` with ``"ShardingOptimizer"`` applied."""

    _name = "ShardingOptimizer"


class DygraphShardingOptimizer(_OptimizerKind):
    """Sharding applied, ``sharding_configs.split_param`` off (Paddle's stage-1 V1)."""

    @classmethod
    def _matches(cls, obj: Any) -> bool:
        return ShardingOptimizer._matches(obj) and not _split_param()


class DygraphShardingOptimizerV2(_OptimizerKind):
    """Sharding applied, ``sharding_configs.split_param`` on (Paddle's V2)."""

    @classmethod
    def _matches(cls, obj: Any) -> bool:
        return ShardingOptimizer._matches(obj) and _split_param()


class AMPOptimizer(_OptimizerKind):
    """A ``DistributedOptimizer`` with ``"AMPOptimizer"`` applied."""

    _name = "AMPOptimizer"


class GradientMergeOptimizer(_OptimizerKind):
    """A ``DistributedOptimizer`` with ``"GradientMergeOptimizer"`` applied."""

    _name = "GradientMergeOptimizer"


class RecomputeOptimizer(_OptimizerKind):
    """A ``DistributedOptimizer`` with ``"RecomputeOptimizer"`` applied."""

    _name = "RecomputeOptimizer"


class LambOptimizer(_OptimizerKind):
    """A ``DistributedOptimizer`` with ``"LambOptimizer"`` applied."""

    _name = "LambOptimizer"


class LarsOptimizer(_OptimizerKind):
    """A ``DistributedOptimizer`` with ``"LarsOptimizer"`` applied."""

    _name = "LarsOptimizer"


class HybridParallelGradScaler(metaclass=_Kind):
    """Every :class:`~jfleet.amp.GradScaler`; calling it returns ``distributed_scaler(scaler)``."""

    @classmethod
    def _matches(cls, obj: Any) -> bool:
        return isinstance(obj, GradScaler)

    def __new__(cls, scaler: Any, hcg: Any = None) -> Any:
        from jfleet.precision.grad_scaler import distributed_scaler

        return distributed_scaler(scaler)

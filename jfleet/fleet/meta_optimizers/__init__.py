"""Paddle's ``fleet.meta_optimizers`` names, answering ``isinstance`` for jfleet's optimizer.

jfleet has one optimizer object (``fleet.distributed_optimizer``'s
:class:`~jfleet.distributed_optimizer.DistributedOptimizer`); each class here is true
for it when the strategy applied what the class stands for (read from
``applied_meta_list``; details in :mod:`jfleet.fleet.meta_optimizers._kinds`).

Example:
  >>> import optax
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True, log_level="WARNING")
  >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
  >>> isinstance(opt, HybridParallelOptimizer), isinstance(opt, ShardingOptimizer)
  (True, False)
"""

from jfleet.fleet.meta_optimizers import dygraph_optimizer as dygraph_optimizer
from jfleet.fleet.meta_optimizers._kinds import AMPOptimizer as AMPOptimizer
from jfleet.fleet.meta_optimizers._kinds import (
    DygraphShardingOptimizer as DygraphShardingOptimizer,
)
from jfleet.fleet.meta_optimizers._kinds import (
    DygraphShardingOptimizerV2 as DygraphShardingOptimizerV2,
)
from jfleet.fleet.meta_optimizers._kinds import GradientMergeOptimizer as GradientMergeOptimizer
from jfleet.fleet.meta_optimizers._kinds import (
    HybridParallelGradScaler as HybridParallelGradScaler,
)
from jfleet.fleet.meta_optimizers._kinds import HybridParallelOptimizer as HybridParallelOptimizer
from jfleet.fleet.meta_optimizers._kinds import LambOptimizer as LambOptimizer
from jfleet.fleet.meta_optimizers._kinds import LarsOptimizer as LarsOptimizer
from jfleet.fleet.meta_optimizers._kinds import RecomputeOptimizer as RecomputeOptimizer
from jfleet.fleet.meta_optimizers._kinds import ShardingOptimizer as ShardingOptimizer

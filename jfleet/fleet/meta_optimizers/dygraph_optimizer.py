"""Paddle's ``fleet.meta_optimizers.dygraph_optimizer``: the eager hybrid optimizer classes.

See :mod:`jfleet.fleet.meta_optimizers` for what ``isinstance`` against them means.

Example:
  >>> from jfleet.fleet.meta_optimizers.dygraph_optimizer import HybridParallelOptimizer
  >>> isinstance(object(), HybridParallelOptimizer)
  False
"""

from jfleet.fleet.meta_optimizers._kinds import (
    DygraphShardingOptimizer as DygraphShardingOptimizer,
)
from jfleet.fleet.meta_optimizers._kinds import (
    DygraphShardingOptimizerV2 as DygraphShardingOptimizerV2,
)
from jfleet.fleet.meta_optimizers._kinds import (
    HybridParallelGradScaler as HybridParallelGradScaler,
)
from jfleet.fleet.meta_optimizers._kinds import HybridParallelOptimizer as HybridParallelOptimizer

"""Paddle's ``fleet.meta_parallel`` names: tensor-, sequence- and pipeline-parallel layers, RNGs.

Importable as ``jfleet.fleet.meta_parallel`` (Paddle's path); also ``jfleet.meta_parallel``.

Paddle's model wrappers ``TensorParallel``, ``ShardingParallel``, ``SegmentParallel``
and ``DataParallel`` answer ``isinstance`` for what ``fleet.distributed_model`` returns
(a :class:`~jfleet.distributed_model.DistributedModel`) by the run's parallel mode, as
Paddle's ``distributed_model`` picks the wrapper (``hcg.get_parallel_mode()``: pipeline,
then tensor, segment, sharding, data); a pipelined model is a ``PipelineParallel``.
Calling one, ``TensorParallel(layers, hcg, strategy=...)``, is
``fleet.distributed_model(layers)``.

Example:
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> from flax import nnx
  >>> layer = fleet.meta_parallel.ColumnParallelLinear(8, 16, rngs=nnx.Rngs(0))
  >>> layer.kernel.sharding.spec
  P(None, 'mp')
  >>> model = fleet.distributed_model(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
  >>> isinstance(model, TensorParallel), isinstance(model, ShardingParallel)
  (True, False)
"""

from typing import Any

from jfleet.fleet.meta_optimizers._kinds import _Kind
from jfleet.mesh import context as _context
from jfleet.mesh.topology import ParallelMode
from jfleet.parallel.cross_entropy import ParallelCrossEntropy as ParallelCrossEntropy
from jfleet.parallel.cross_entropy import parallel_cross_entropy as parallel_cross_entropy
from jfleet.parallel.layers import ColumnParallelLinear as ColumnParallelLinear
from jfleet.parallel.layers import RowParallelLinear as RowParallelLinear
from jfleet.parallel.layers import VocabParallelEmbedding as VocabParallelEmbedding
from jfleet.parallel.pipeline_layer import LayerDesc as LayerDesc
from jfleet.parallel.pipeline_layer import PipelineLayer as PipelineLayer
from jfleet.parallel.pipeline_layer import SharedLayerDesc as SharedLayerDesc
from jfleet.parallel.random import RNGStatesTracker as RNGStatesTracker
from jfleet.parallel.random import get_init_mode as get_init_mode
from jfleet.parallel.random import get_rng_state_tracker as get_rng_state_tracker
from jfleet.parallel.random import model_parallel_random_seed as model_parallel_random_seed
from jfleet.parallel.random import set_init_mode as set_init_mode
from jfleet.parallel.sequence import AllGatherOp as AllGatherOp
from jfleet.parallel.sequence import ColumnSequenceParallelLinear as ColumnSequenceParallelLinear
from jfleet.parallel.sequence import GatherOp as GatherOp
from jfleet.parallel.sequence import ReduceScatterOp as ReduceScatterOp
from jfleet.parallel.sequence import RowSequenceParallelLinear as RowSequenceParallelLinear
from jfleet.parallel.sequence import ScatterOp as ScatterOp
from jfleet.parallel.sequence import all_gather_sequence as all_gather_sequence
from jfleet.parallel.sequence import (
    gather_from_sequence_parallel as gather_from_sequence_parallel,
)
from jfleet.parallel.sequence import (
    is_sequence_parallel_parameter as is_sequence_parallel_parameter,
)
from jfleet.parallel.sequence import (
    mark_as_sequence_parallel_parameter as mark_as_sequence_parallel_parameter,
)
from jfleet.parallel.sequence import reduce_scatter_sequence as reduce_scatter_sequence
from jfleet.parallel.sequence import (
    register_sequence_parallel_allreduce_hooks as register_sequence_parallel_allreduce_hooks,
)
from jfleet.parallel.sequence import (
    scatter_to_sequence_parallel as scatter_to_sequence_parallel,
)
from jfleet.training.distributed_model import DistributedModel
from jfleet.training.pipeline_parallel import PipelineParallel as PipelineParallel


class _ModelKind(metaclass=_Kind):
    _mode: ParallelMode = ParallelMode.DATA_PARALLEL

    @classmethod
    def _matches(cls, obj: Any) -> bool:
        run = _context.current()
        return (
            isinstance(obj, DistributedModel)
            and run is not None
            and run.hcg.get_parallel_mode() == cls._mode
        )

    def __new__(cls, layers: Any, hcg: Any = None, strategy: Any = None, **kwargs: Any) -> Any:
        from jfleet.fleet.fleet_base import fleet  # the facade's Fleet object, at call time

        return fleet.distributed_model(layers)


class TensorParallel(_ModelKind):
    """A distributed model of a run whose parallel mode is tensor parallel (mp > 1, pp 1)."""

    _mode = ParallelMode.TENSOR_PARALLEL


class ShardingParallel(_ModelKind):
    """A distributed model of a run whose parallel mode is sharding (sharding > 1 only)."""

    _mode = ParallelMode.SHARDING_PARALLEL


class SegmentParallel(_ModelKind):
    """A distributed model of a run whose parallel mode is segment (sep) parallel."""

    _mode = ParallelMode.SEGMENT_PARALLEL


class DataParallel(_ModelKind):
    """A distributed model of a pure data-parallel run (Paddle's ``paddle.DataParallel``)."""

    _mode = ParallelMode.DATA_PARALLEL

"""Paddle's ``fleet.utils.sequence_parallel_utils``: sequence parallelism over ``mp``.

The ops and layers are :mod:`jfleet.parallel.sequence`'s: on global arrays a layout
change of one value, inside ``shard_map`` manual over ``mp`` Paddle's collectives with
Paddle's gradients. ``scatter`` / ``all_gather`` / ``reduce_scatter`` are Paddle's
functions on dim 0 (``[s, b, h]``) with the gradients of :class:`ScatterOp` /
:class:`AllGatherOp` / :class:`ReduceScatterOp`.

Example:
  >>> import jax.numpy as jnp
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> scatter(jnp.ones((8, 2, 4))).sharding.spec[0]
  'mp'
"""

from __future__ import annotations

import jax

from jfleet.parallel.sequence import AllGatherOp as AllGatherOp
from jfleet.parallel.sequence import ColumnSequenceParallelLinear as ColumnSequenceParallelLinear
from jfleet.parallel.sequence import GatherOp as GatherOp
from jfleet.parallel.sequence import ReduceScatterOp as ReduceScatterOp
from jfleet.parallel.sequence import RowSequenceParallelLinear as RowSequenceParallelLinear
from jfleet.parallel.sequence import ScatterOp as ScatterOp
from jfleet.parallel.sequence import (
    is_sequence_parallel_parameter as is_sequence_parallel_parameter,
)
from jfleet.parallel.sequence import (
    mark_as_sequence_parallel_parameter as mark_as_sequence_parallel_parameter,
)
from jfleet.parallel.sequence import (
    register_sequence_parallel_allreduce_hooks as register_sequence_parallel_allreduce_hooks,
)


def scatter(input: jax.Array) -> jax.Array:
    """This rank's ``[s / n, ...]`` piece of a replicated ``[s, ...]`` (global: split dim 0)."""
    return ScatterOp.apply(input)


def all_gather(input: jax.Array) -> jax.Array:
    """The group's ``[s / n, ...]`` pieces joined on dim 0 (global: dim 0 replicated)."""
    return AllGatherOp.apply(input)


def reduce_scatter(input: jax.Array) -> jax.Array:
    """This rank's piece of the sum over mp on dim 0 (global: the value, dim 0 split)."""
    return ReduceScatterOp.apply(input)


def is_fused_matmul_bias_supported() -> bool:
    """False: XLA fuses the bias add itself; there is no separate fused kernel to pick.

    Example:
      >>> is_fused_matmul_bias_supported()
      False
    """
    return False

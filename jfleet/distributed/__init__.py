"""Paddle's ``paddle.distributed`` names: ``import jfleet.distributed as dist``.

The facade layer above ``fleet`` (Paddle's ``paddle.distributed`` holds ``fleet``).

May import: runtime, mesh, optim, parallel, models, precision, training, auto_parallel,
checkpoint, launch, ps, fleet.

The collectives are :mod:`jfleet.collective`'s (group collectives inside ``shard_map``
and on global arrays); ``fleet`` is :mod:`jfleet.fleet`; ``dist.sharding`` holds
``group_sharded_parallel`` and ``save_group_sharded_model``; ``save_state_dict`` /
``load_state_dict`` are :mod:`jfleet.checkpoint.state_dict`'s (sharded, Orbax). Groups
are mesh axes: :func:`new_group` finds the axes whose groups are the ranks given
(:func:`jfleet.collective.new_group`).

Example:
  >>> import jfleet.distributed as dist
  >>> dist.init_parallel_env()
  >>> dist.get_world_size(), dist.new_group([0, 1, 2, 3, 4, 5, 6, 7]).nranks
  (8, 8)
"""

from __future__ import annotations

from jfleet import fleet
from jfleet.checkpoint.state_dict import load_state_dict as load_state_dict
from jfleet.checkpoint.state_dict import save_state_dict as save_state_dict
from jfleet.distributed import sharding as sharding
from jfleet.mesh import context as _context
from jfleet.mesh.collective import ReduceOp as ReduceOp
from jfleet.mesh.collective import all_gather as all_gather
from jfleet.mesh.collective import all_reduce as all_reduce
from jfleet.mesh.collective import barrier as barrier
from jfleet.mesh.collective import broadcast as broadcast
from jfleet.mesh.collective import get_backend as get_backend
from jfleet.mesh.collective import get_rank as get_rank
from jfleet.mesh.collective import get_world_size as get_world_size
from jfleet.mesh.collective import local_value as local_value
from jfleet.mesh.collective import new_group as new_group
from jfleet.mesh.collective import reduce as reduce
from jfleet.mesh.collective import reduce_scatter as reduce_scatter
from jfleet.mesh.collective import scatter as scatter
from jfleet.mesh.collective import wait as wait

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "fleet",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_parallel_env",
    "is_initialized",
    "load_state_dict",
    "local_value",
    "new_group",
    "reduce",
    "reduce_scatter",
    "save_state_dict",
    "scatter",
    "sharding",
    "wait",
]


def init_parallel_env() -> None:
    """Paddle's ``init_parallel_env``: ``fleet.init(is_collective=True)`` unless a run exists.

    Starts the processes of a multi-process job and builds the mesh (pure data parallel
    over every device); a run that ``fleet.init`` already set up is kept as it is.

    Example:
      >>> import jfleet.distributed as dist
      >>> dist.init_parallel_env()
      >>> dist.is_initialized(), dist.get_world_size()  # a rank per device
      (True, 8)
    """
    if _context.current() is None:
        fleet.init(is_collective=True, log_level="WARNING")


def is_initialized() -> bool:
    """Whether ``fleet.init`` / :func:`init_parallel_env` has set up a run.

    Example:
      >>> from jfleet.mesh import context as _context
      >>> _context.clear(); is_initialized()
      False
    """
    return _context.current() is not None

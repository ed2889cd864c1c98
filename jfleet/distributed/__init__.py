"""Paddle's ``paddle.distributed`` names: ``import jfleet.distributed as dist``.

The collectives are :mod:`jfleet.collective`'s (group collectives inside ``shard_map``
and on global arrays); ``fleet`` is :mod:`jfleet.fleet`; ``dist.sharding`` holds
``group_sharded_parallel`` and ``save_group_sharded_model``. Groups are mesh axes:
:func:`new_group` finds the axes whose groups are the ranks given.

Example:
  >>> import jfleet.distributed as dist
  >>> dist.init_parallel_env()
  >>> dist.get_world_size(), dist.new_group([0, 1, 2, 3, 4, 5, 6, 7]).nranks
  (8, 8)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from jfleet import _context, fleet
from jfleet.collective import ReduceOp as ReduceOp
from jfleet.collective import all_gather as all_gather
from jfleet.collective import all_reduce as all_reduce
from jfleet.collective import barrier as barrier
from jfleet.collective import broadcast as broadcast
from jfleet.collective import get_backend as get_backend
from jfleet.collective import get_rank as get_rank
from jfleet.collective import get_world_size as get_world_size
from jfleet.collective import reduce as reduce
from jfleet.collective import reduce_scatter as reduce_scatter
from jfleet.collective import scatter as scatter
from jfleet.collective import wait as wait
from jfleet.distributed import sharding as sharding
from jfleet.topology import Group

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
    "new_group",
    "reduce",
    "reduce_scatter",
    "scatter",
    "sharding",
    "wait",
]


def init_parallel_env() -> None:
    """Paddle's ``init_parallel_env``: ``fleet.init(is_collective=True)`` unless a run exists.

    Starts the processes of a multi-process job and builds the mesh (pure data parallel
    over every device); a run that ``fleet.init`` already set up is kept as it is.
    """
    if _context.current() is None:
        fleet.init(is_collective=True, log_level="WARNING")


def is_initialized() -> bool:
    """Whether ``fleet.init`` / :func:`init_parallel_env` has set up a run.

    Example:
      >>> from jfleet import _context
      >>> _context.clear(); is_initialized()
      False
    """
    return _context.current() is not None


def new_group(
    ranks: Sequence[int] | None = None, backend: Any = None, timeout: Any = None
) -> Group:
    """The group of the given global ranks, as the mesh axes whose groups they form.

    In SPMD a group is a set of mesh axes (its collectives run over those axes, every
    group of the kind at once), so ``ranks`` must be one of the groups that some axes of
    the fleet mesh form, e.g. ``[0, 1, 2, 3]`` for ``mp`` at dp2 x mp4 (the ranks of
    a group in the order the axes count them). ``ranks=None`` is every rank.
    ``backend`` and ``timeout`` are accepted and not needed.

    Raises:
      RuntimeError: before ``fleet.init`` / :func:`init_parallel_env`.
      ValueError: ranks that no set of mesh axes groups together (the message lists
        the groups there are).
    """
    hcg = _context.require("new_group").hcg
    topo = hcg.topology()
    names = topo.get_hybrid_group_names()
    world = list(range(topo.world_size()))
    wanted = world if ranks is None else [int(r) for r in ranks]
    useful = [n for n in names if topo.get_dim(n) > 1]
    seen = []
    for k in range(1, len(useful) + 1):
        for axes in itertools.combinations(useful, k):
            groups = topo.get_fused_ranks(list(axes))
            seen.append((axes, groups[0]))
            if wanted in groups:
                own = hcg.create_fuse_group(list(axes))
                if own.ranks == tuple(wanted):
                    return own
                return Group(
                    own.axis_name,
                    tuple(wanted),
                    rank=-1,
                    id=groups.index(wanted),
                    name=own.name,
                    mesh=hcg.mesh,
                )
    raise ValueError(
        f"new_group(ranks={list(ranks) if ranks is not None else None}): these ranks are not "
        "the group of any set of mesh axes, which is what a group is under SPMD; groups "
        "there are (axes: first group): " + "; ".join(f"{'+'.join(a)}: {g}" for a, g in seen) + "."
    )

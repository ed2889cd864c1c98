"""Paddle's ``fleet.base.topology``: the topology classes of :mod:`jfleet.topology`.

``_HYBRID_PARALLEL_GROUP`` (read by Paddle code as
``topology._HYBRID_PARALLEL_GROUP``) is the current run's hybrid group, None before
``fleet.init``.

Example:
  >>> from jfleet import fleet
  >>> from jfleet.fleet.base import topology as tp
  >>> tp._HYBRID_PARALLEL_GROUP is None
  True
  >>> _ = fleet.init(is_collective=True, log_level="WARNING")
  >>> tp._HYBRID_PARALLEL_GROUP is fleet.get_hybrid_communicate_group()
  True
"""

from typing import Any

from jfleet.mesh import context as _context
from jfleet.mesh.hybrid_group import HybridCommunicateGroup as HybridCommunicateGroup
from jfleet.mesh.topology import CommunicateTopology as CommunicateTopology
from jfleet.mesh.topology import ParallelMode as ParallelMode


def __getattr__(name: str) -> Any:
    if name == "_HYBRID_PARALLEL_GROUP":
        run = _context.current()
        return None if run is None else run.hcg
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

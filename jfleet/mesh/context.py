"""The current run: its hybrid group (mesh and topology), strategy and role maker.

``fleet.init`` sets it; parallel layers, placement, the engine and the planner read it.
This module sits below everything in the package (it imports no other jfleet module at
run time), so nothing needs to reach up into the :mod:`jfleet.fleet` facade to learn
the mesh a run lives on.

Example:
  >>> from jfleet import fleet
  >>> from jfleet.mesh import context as _context
  >>> _ = fleet.init(is_collective=True, log_level="WARNING")
  >>> dict(_context.require("example").mesh.shape)["dp"]
  8
  >>> _context.clear(); _context.current() is None
  True
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from jfleet.mesh.hybrid_group import HybridCommunicateGroup
    from jfleet.training.strategy import DistributedStrategy


@dataclasses.dataclass(frozen=True)
class Run:
    """What ``fleet.init`` set up.

    Attributes:
      role_maker: where the process layout came from.
      strategy: the strategy in force (``fleet.init``'s, or the one a later
        ``fleet.distributed_optimizer(strategy=...)`` gave).
      hcg: the hybrid group: the one mesh and Paddle's group getters.
      optimizer: the run's distributed optimizer, once ``fleet.distributed_optimizer``
        or ``to_distributed`` made one (what ``fleet.get_loss_scaling`` and the other
        optimizer getters read).
      planned_from: for a run ``to_distributed`` started, the user's strategy it started
        from (its defaults when none was given), before it set the plan's degrees and
        gradient merge; a later ``to_distributed`` call plans from it. None for a run
        ``fleet.init`` started.
    """

    role_maker: Any
    strategy: DistributedStrategy
    hcg: HybridCommunicateGroup
    optimizer: Any = None
    planned_from: DistributedStrategy | None = None

    @property
    def mesh(self) -> Mesh:
        """The run's one hybrid mesh."""
        return self.hcg.mesh


_current: Run | None = None


def set_run(run: Run) -> None:
    """Makes ``run`` the current run (``fleet.init`` calls it)."""
    global _current
    _current = run


def replace(**changes: Any) -> None:
    """The current run with some fields replaced (a new strategy, say).

    Raises:
      RuntimeError: no current run.
    """
    set_run(dataclasses.replace(require("the run's settings"), **changes))


def clear() -> None:
    """Forgets the current run (``fleet`` resets between tests and notebook runs)."""
    global _current
    _current = None


def current() -> Run | None:
    """The current run, or None before ``fleet.init``."""
    return _current


def require(what: str) -> Run:
    """The current run; an error naming ``what`` needed it when there is none.

    Raises:
      RuntimeError: ``fleet.init`` not called.
    """
    if _current is None:
        raise RuntimeError(
            f"{what} needs fleet.init() first; call "
            "`fleet.init(is_collective=True, strategy=...)` at the start of the script."
        )
    return _current


def current_mesh() -> Mesh | None:
    """The current run's mesh, or None before ``fleet.init``."""
    return None if _current is None else _current.mesh

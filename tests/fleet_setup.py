"""``fleet.init`` for tests: one call from keyword settings, returning what tests look at."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jfleet import fleet
from jfleet.strategy import DistributedStrategy
from jfleet.testing import make_strategy


def init_fleet(hybrid: dict | None = None, **settings: Any) -> DistributedStrategy:
    """Starts a fleet on the test devices with ``hybrid_configs=hybrid``; returns the strategy."""
    strategy = make_strategy(hybrid, **settings)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    return strategy


def fleet_mesh() -> Mesh:
    """The running fleet's mesh."""
    return fleet.get_hybrid_communicate_group().mesh

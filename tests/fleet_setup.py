"""``fleet.init`` for tests: one call from keyword settings, returning what tests look at."""

from __future__ import annotations

from typing import Any

from jax.sharding import Mesh

from jfleet import fleet
from jfleet.testing import make_strategy
from jfleet.training.strategy import DistributedStrategy

#: The variables that describe a job's processes (Paddle's, JAX's and jfleet's timeouts).
PROCESS_ENV_VARS = (
    "PADDLE_TRAINER_ID",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_TRAINER_ENDPOINTS",
    "PADDLE_CURRENT_ENDPOINT",
    "PADDLE_MASTER",
    "PADDLE_RANK_IN_NODE",
    "PADDLE_TRAINING_ROLE",
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JFLEET_INIT_TIMEOUT",
    "JFLEET_HEARTBEAT_TIMEOUT",
)


def clear_process_env(monkeypatch: Any) -> None:
    """Removes every process variable for this test: a one-process job."""
    for name in PROCESS_ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def init_fleet(hybrid: dict | None = None, **settings: Any) -> DistributedStrategy:
    """Starts a fleet on the test devices with ``hybrid_configs=hybrid``; returns the strategy."""
    strategy = make_strategy(hybrid, **settings)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    return strategy


def fleet_mesh() -> Mesh:
    """The running fleet's mesh."""
    return fleet.get_hybrid_communicate_group().mesh

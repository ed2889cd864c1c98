"""Paddle's federated-learning names on Fleet: present, and saying why federated mode is absent.

Paddle's federated mode (``strategy.with_coordinator``) runs a coordinator process that picks
clients each round and merges their models (``init_coordinator``, ``make_fl_strategy``,
``get_fl_client``, ``is_coordinator``), on top of its parameter-server runtime. jfleet runs
SPMD: one program over one mesh, every process running the same step on its rows of the
batch, with the collectives XLA inserts. There is no process with another role to coordinate
from, no client running its own rounds, and no per-client model to merge, so the three
calls that start or reach those roles raise :class:`NotImplementedError` with this reason.
``is_coordinator()`` answers truthfully: no process is a coordinator, so it returns False.

Example:
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True, log_level="WARNING")
  >>> fleet.is_coordinator()
  False
"""

from __future__ import annotations

from typing import Any, NoReturn

from jfleet.mesh import context as _context

__all__ = ["FEDERATED_REASON", "FederatedMethods"]

FEDERATED_REASON = (
    "federated learning (a coordinator choosing clients and merging their models) is not "
    "offered by jfleet: it runs SPMD, one program over one mesh in which every process runs "
    "the same step, so there is no coordinator or client role to start or reach"
)


def _refuse(name: str) -> NoReturn:
    raise NotImplementedError(
        f"fleet.{name}(): {FEDERATED_REASON}. Train collectively (fleet.init(is_collective=True)); "
        "data-parallel replicas already average gradients every step."
    )


class FederatedMethods:
    """Paddle's federated-learning calls, mixed into :class:`~jfleet.fleet.Fleet`."""

    def init_coordinator(self, scopes: Any = None) -> NoReturn:
        """Paddle starts the coordinator here; raises :class:`NotImplementedError` (why: above).

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> try:
          ...     fleet.init_coordinator()
          ... except NotImplementedError as err:
          ...     print(str(err).split(":")[0])
          fleet.init_coordinator()
        """
        _refuse("init_coordinator")

    def make_fl_strategy(self) -> NoReturn:
        """Paddle builds the clients' federated strategy; raises :class:`NotImplementedError`.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> try:
          ...     fleet.make_fl_strategy()
          ... except NotImplementedError as err:
          ...     print(str(err).split(":")[0])
          fleet.make_fl_strategy()
        """
        _refuse("make_fl_strategy")

    def get_fl_client(self) -> NoReturn:
        """Paddle returns this worker's federated client; raises :class:`NotImplementedError`.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> try:
          ...     fleet.get_fl_client()
          ... except NotImplementedError as err:
          ...     print(str(err).split(":")[0])
          fleet.get_fl_client()
        """
        _refuse("get_fl_client")

    def is_coordinator(self) -> bool:
        """Whether this process is the federated coordinator: always False (no such role).

        Raises:
          RuntimeError: ``fleet.init`` was not called (as for the other role questions).

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.is_coordinator()
          False
        """
        _context.require("fleet.is_coordinator()")
        return False

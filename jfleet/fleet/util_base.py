"""``fleet.util``: Paddle's host-side helpers for scripts run on several processes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from jfleet.mesh import collective


class Workers(Protocol):
    """What ``fleet.util`` reads of the fleet facade (``jfleet.fleet.fleet_base.Fleet``),
    named here so that this module does not import the facade that holds it."""

    def worker_num(self) -> int: ...

    def worker_index(self) -> int: ...

    def _require_init(self, what: str) -> Any: ...


class UtilBase:
    """Host-level collectives and file sharding across worker processes.

    Example:
      >>> from jfleet import fleet
      >>> _ = fleet.init(is_collective=True)
      >>> fleet.util.get_file_shard(["a", "b", "c"])
      ['a', 'b', 'c']
    """

    def __init__(self, fleet: Workers) -> None:
        self._fleet = fleet

    def all_reduce(self, input: Any, mode: str = "sum", comm_world: str = "worker") -> Any:
        """Reduces ``input`` across worker processes; ``mode`` is sum, mean, max or min.

        ``comm_world`` is Paddle's group selector; only ``"worker"`` (and its
        synonym ``"all"``, there being no servers) exists in collective mode.
        """
        self._check_world(comm_world, "all_reduce")
        return collective.all_reduce(input, mode)

    def all_gather(self, input: Any, comm_world: str = "worker") -> list[Any]:
        """Every worker's ``input``, in worker order."""
        self._check_world(comm_world, "all_gather")
        return collective.all_gather(input)

    def barrier(self, comm_world: str = "worker") -> None:
        """Blocks until every worker reaches this call."""
        self._check_world(comm_world, "barrier")
        collective.barrier()

    def get_file_shard(self, files: Sequence[str]) -> list[str]:
        """This worker's contiguous share of ``files``.

        Files are split into ``worker_num`` contiguous blocks; the first
        ``len(files) % worker_num`` workers get one file more (Paddle's rule).

        Raises:
          TypeError: ``files`` is not a list or tuple of str.
        """
        if not isinstance(files, list | tuple) or not all(isinstance(f, str) for f in files):
            raise TypeError(
                f"files={files!r} ({type(files).__name__}) must be a list of file names (str)."
            )
        self._fleet._require_init("util.get_file_shard")
        n, i = self._fleet.worker_num(), self._fleet.worker_index()
        base, extra = divmod(len(files), n)
        start = i * base + min(i, extra)
        end = start + base + (1 if i < extra else 0)
        return list(files[start:end])

    def print_on_rank(self, message: Any, rank_id: int) -> None:
        """Prints ``message`` on worker ``rank_id`` only."""
        self._fleet._require_init("util.print_on_rank")
        num = self._fleet.worker_num()
        if isinstance(rank_id, bool) or not isinstance(rank_id, int) or not 0 <= rank_id < num:
            raise ValueError(f"rank_id={rank_id!r} must be an int in [0, {num}).")
        if self._fleet.worker_index() == rank_id:
            print(message, flush=True)

    def _check_world(self, comm_world: str, what: str) -> None:
        self._fleet._require_init(f"util.{what}")
        if comm_world not in ("worker", "all"):
            raise ValueError(
                f"comm_world={comm_world!r}: collective mode has only the 'worker' group "
                "('all' is the same group); parameter servers are not available."
            )

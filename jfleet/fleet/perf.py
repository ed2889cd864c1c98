"""``fleet.collective_perf`` and Paddle's five ``fleet.*_perf`` methods, as a Fleet mixin.

The measurement is :mod:`jfleet.collective_perf`; these methods give it Paddle's
signatures. A group is a mesh-axis group (``hcg.get_data_parallel_group()``, ...), or a
name: a mesh axis, axes joined by ``+``, or ``"world"``. Results come back as
:class:`~jfleet.collective_perf.PerfResult` records (Paddle returns None); a size slower
than its threshold logs Paddle's ``[Perf Warning] ... Test Timeout!`` on the ``jfleet``
logger and has ``slow=True``.

Example:
  >>> from jfleet import fleet
  >>> from jfleet.fleet.perf import PerfMethods
  >>> s = fleet.DistributedStrategy(); s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> [r.group for r in PerfMethods().collective_perf("allgather", 2, {1024: -1})]
  ['mp']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jfleet.mesh.collective_perf import PerfResult, collective_perf, perf_once
from jfleet.mesh.hybrid_group import HybridCommunicateGroup
from jfleet.mesh.topology import Group

__all__ = ["PerfMethods"]


class PerfMethods:
    """Paddle's collective performance checks, mixed into :class:`Fleet`.

    They need ``fleet.init`` (or ``hcg=``): groups live on the run's mesh.
    """

    def collective_perf(
        self,
        comm_type: str,
        round: int = 50,
        size_and_time: Mapping[int, float] | None = None,
        hcg: HybridCommunicateGroup | None = None,
        *,
        group: Group | str | None = None,
    ) -> list[PerfResult]:
        """Times ``comm_type`` for each size of ``size_and_time`` over Paddle's group for it.

        Args:
          comm_type: ``"allreduce"``, ``"reduce"``, ``"broadcast"``, ``"allgather"`` or
            ``"reduce_scatter"``.
          round: timed calls per size (their mean is compared with the threshold).
          size_and_time: ``{bytes: seconds}`` (a threshold <= -1 or None: no check).
            None or empty: 1MB, 2MB, ..., 1GB without thresholds (Paddle's documented
            default; Paddle's code measures nothing then).
          hcg: the hybrid group; default the current run's.
          group: (jfleet) the group to measure over; default Paddle's: the data group
            (``dp``, else ``sharding``) for allreduce / reduce / broadcast, ``mp`` for
            allgather / reduce_scatter.

        Returns:
          One :class:`~jfleet.collective_perf.PerfResult` per size; ``[]`` with a logged
          warning when the group has one rank (Paddle's "group invalid").

        Raises:
          ValueError: an unknown ``comm_type`` (the message lists the valid ones),
            ``round`` < 1, a size that is not a positive int of at least 4 bytes, a
            threshold that is not a number, an unknown group name.
          RuntimeError: no ``hcg`` and ``fleet.init`` not called.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")  # dp8
          >>> [r.nranks for r in PerfMethods().collective_perf("allreduce", 2, {256: 1.0})]
          [8]
        """
        return collective_perf(comm_type, round, size_and_time, hcg, group=group)

    def allreduce_perf(
        self,
        iteration: int,
        x: Any,
        group: Group | str | None,
        perf_size: int,
        perf_threshold_time: float,
        warmup: bool = False,
    ) -> PerfResult | None:
        """Times ``iteration`` all-reduces (``lax.psum``) of ``x`` over ``group``.

        Args:
          iteration: timed calls.
          x: each rank's tensor (at least 1-d): a global array laid out on the mesh, whose
            piece on device ``d`` is rank ``d``'s, or an array every rank passes whole.
          group: a ``Group`` of the run's mesh or a group name (``"world"``, ``"dp+mp"``);
            None or a one-rank group: nothing is measured (a logged warning, as Paddle).
          perf_size: the message size in bytes for Paddle's log (the bandwidths use the
            bytes ``x`` has).
          perf_threshold_time: seconds; a slower mean logs a warning (<= -1: no check).
          warmup: run without logging and return None (Paddle's warm-up call).

        Returns:
          The :class:`~jfleet.collective_perf.PerfResult`, or None.

        Example:
          >>> import numpy as np
          >>> from jfleet import fleet
          >>> strategy = fleet.DistributedStrategy()
          >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
          >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
          >>> x = np.ones(1024, np.float32)
          >>> hcg = fleet.get_hybrid_communicate_group()
          >>> fleet.allreduce_perf(3, x, hcg.get_data_parallel_group(), x.nbytes, -1).op
          'allreduce'
        """
        result = perf_once(
            "allreduce", iteration, x, group, perf_size, perf_threshold_time, log=not warmup
        )
        return None if warmup else result

    def reduce_perf(
        self,
        iteration: int,
        x: Any,
        group: Group | str | None,
        perf_size: int,
        perf_threshold_time: float,
    ) -> PerfResult | None:
        """Times reduces of ``x`` to the group's first rank (a psum kept there; XLA has no
        reduce-to-one collective). Arguments and result as :meth:`allreduce_perf`.

        Example:
          >>> import numpy as np
          >>> from jfleet import fleet
          >>> strategy = fleet.DistributedStrategy()
          >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
          >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
          >>> x = np.ones(1024, np.float32)
          >>> hcg = fleet.get_hybrid_communicate_group()
          >>> fleet.reduce_perf(3, x, hcg.get_data_parallel_group(), x.nbytes, -1).op
          'reduce'
        """
        return perf_once("reduce", iteration, x, group, perf_size, perf_threshold_time)

    def broadcast_perf(
        self,
        iteration: int,
        x: Any,
        group: Group | str | None,
        perf_size: int,
        perf_threshold_time: float,
    ) -> PerfResult | None:
        """Times broadcasts of ``x`` from the group's first rank (collective-broadcast on
        GPU, a masked psum on CPU). Arguments and result as :meth:`allreduce_perf`.

        Example:
          >>> import numpy as np
          >>> from jfleet import fleet
          >>> strategy = fleet.DistributedStrategy()
          >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
          >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
          >>> x = np.ones(1024, np.float32)
          >>> hcg = fleet.get_hybrid_communicate_group()
          >>> fleet.broadcast_perf(3, x, hcg.get_data_parallel_group(), x.nbytes, -1).op
          'broadcast'
        """
        return perf_once("broadcast", iteration, x, group, perf_size, perf_threshold_time)

    def allgather_perf(
        self,
        iteration: int,
        x: Any,
        group: Group | str | None,
        perf_size: int,
        perf_threshold_time: float,
    ) -> PerfResult | None:
        """Times all-gathers (``lax.all_gather`` along dimension 0) of ``x``; the bandwidth
        counts the gathered ``nranks * nbytes``. Arguments and result as
        :meth:`allreduce_perf`.

        Example:
          >>> import numpy as np
          >>> from jfleet import fleet
          >>> strategy = fleet.DistributedStrategy()
          >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
          >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
          >>> x = np.ones(1024, np.float32)
          >>> hcg = fleet.get_hybrid_communicate_group()
          >>> fleet.allgather_perf(3, x, hcg.get_model_parallel_group(), x.nbytes, -1).op
          'allgather'
        """
        return perf_once("allgather", iteration, x, group, perf_size, perf_threshold_time)

    def reduce_scatter_perf(
        self,
        iteration: int,
        x: Any,
        group: Group | str | None,
        perf_size: int,
        perf_threshold_time: float,
    ) -> PerfResult | None:
        """Times reduce-scatters (``lax.psum_scatter`` along dimension 0) of ``x``, whose
        first dimension the group size must divide (a ValueError says so; Paddle logs and
        stops). Arguments and result as :meth:`allreduce_perf`.

        Example:
          >>> import numpy as np
          >>> from jfleet import fleet
          >>> strategy = fleet.DistributedStrategy()
          >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
          >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
          >>> x = np.ones(1024, np.float32)
          >>> hcg = fleet.get_hybrid_communicate_group()
          >>> fleet.reduce_scatter_perf(3, x, hcg.get_model_parallel_group(), x.nbytes, -1).op
          'reduce_scatter'
        """
        return perf_once("reduce_scatter", iteration, x, group, perf_size, perf_threshold_time)

"""Collective performance: Paddle's ``fleet.collective_perf`` over mesh-axis groups.

Times the five collectives Paddle's ``fleet.collective_perf`` checks (``allreduce``,
``reduce``, ``broadcast``, ``allgather``, ``reduce_scatter``), each a compiled
``jax.shard_map`` over the fleet mesh whose collective runs over one group's mesh axes
(every group of that kind at once, as every Paddle rank calls with its own group). A
result is a :class:`PerfResult`: time per call (mean and min of ``round`` timed calls,
after one compile and a warm-up), algorithm and bus bandwidth by nccl-tests' formulas,
and whether the mean passed its threshold (Paddle's warning).

Sizes: ``nbytes`` is the size of the tensor each rank passes (Paddle's ``perf_size``);
the bandwidths use nccl-tests' size ``S``: the gathered output for ``allgather``
(``nranks * nbytes``), the input for ``reduce_scatter`` (``nbytes``, each rank keeping
``nbytes / nranks``), ``nbytes`` for the others. ``algbw = S / time``; ``busbw`` is
``algbw * 2(n-1)/n`` (allreduce), ``algbw * (n-1)/n`` (allgather, reduce_scatter) and
``algbw`` (broadcast, reduce). GB/s are 1e9 bytes per second; ``1KB`` is 1024 bytes.

What runs: ``allreduce`` is ``lax.psum``; ``reduce`` is the psum kept on the group's
first rank (others keep their tensor; XLA has no reduce-to-one collective, so it costs
an all-reduce); ``broadcast`` from the group's first rank is XLA's collective-broadcast
on GPU and a masked psum elsewhere (XLA:CPU has no collective-broadcast);
``allgather`` is ``lax.all_gather`` and ``reduce_scatter`` ``lax.psum_scatter``, both
along dimension 0. :attr:`PerfResult.kernel` names it.

As a script (under ``python -m jfleet.launch`` too; only process 0 prints)::

    python -m jfleet.collective_perf --mesh dp=2,mp=4 --groups dp,mp,world \\
        --sizes 1KB,1MB,16MB --round 20 --devices 8 --plot perf.png --json perf.json

Modules: :mod:`~jfleet.collective_perf.timing` (programs, timing, formulas, groups),
:mod:`~jfleet.collective_perf.report` (table, sizes, plot), ``__main__`` (the script).
``fleet.collective_perf`` and the five ``fleet.*_perf`` methods are
:class:`jfleet.fleet.perf.PerfMethods`.

Example:
  >>> from jfleet import collective_perf as cp
  >>> cp.bus_factor("allreduce", 8), cp.bus_factor("allgather", 4), cp.bus_factor("broadcast", 8)
  (1.75, 0.75, 1.0)
"""

from jfleet.mesh.collective_perf.report import format_size as format_size
from jfleet.mesh.collective_perf.report import format_table as format_table
from jfleet.mesh.collective_perf.report import parse_size as parse_size
from jfleet.mesh.collective_perf.report import plot as plot
from jfleet.mesh.collective_perf.timing import DEFAULT_SIZES as DEFAULT_SIZES
from jfleet.mesh.collective_perf.timing import OPS as OPS
from jfleet.mesh.collective_perf.timing import WORLD as WORLD
from jfleet.mesh.collective_perf.timing import PerfResult as PerfResult
from jfleet.mesh.collective_perf.timing import bandwidths as bandwidths
from jfleet.mesh.collective_perf.timing import bus_factor as bus_factor
from jfleet.mesh.collective_perf.timing import collective_fn as collective_fn
from jfleet.mesh.collective_perf.timing import collective_perf as collective_perf
from jfleet.mesh.collective_perf.timing import default_group as default_group
from jfleet.mesh.collective_perf.timing import group_of as group_of
from jfleet.mesh.collective_perf.timing import measure as measure
from jfleet.mesh.collective_perf.timing import perf_once as perf_once
from jfleet.mesh.collective_perf.timing import sweep as sweep
from jfleet.mesh.collective_perf.timing import total_bytes as total_bytes

"""Measuring one collective: the programs, the timing, nccl-tests' bandwidth formulas.

The overview (sizes, formulas, what runs) is in :mod:`jfleet.collective_perf`.

Example:
  >>> from jfleet.mesh.collective_perf.timing import bus_factor, total_bytes
  >>> bus_factor("allreduce", 8), bus_factor("allgather", 4), total_bytes("allgather", 8, 4)
  (1.75, 0.75, 32)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh import context as _context
from jfleet.mesh.group_collective import ReduceOp, _mesh_for, _spec_on, kernel
from jfleet.mesh.hybrid_group import HybridCommunicateGroup
from jfleet.mesh.topology import DP, MP, SHARDING, Group
from jfleet.runtime.log import logger

__all__ = [
    "DEFAULT_SIZES",
    "OPS",
    "WORLD",
    "PerfResult",
    "bandwidths",
    "bus_factor",
    "collective_fn",
    "collective_perf",
    "default_group",
    "group_of",
    "measure",
    "perf_once",
    "sweep",
    "total_bytes",
]

#: Paddle's ``comm_type`` names, in its order.
OPS = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")
#: The group name for every device of the mesh.
WORLD = "world"
#: Paddle's tags in its log lines (``[AllReduceTest] ...``).
_TAGS = {
    "allreduce": "AllReduce",
    "reduce": "Reduce",
    "broadcast": "Broadcast",
    "allgather": "Allgather",
    "reduce_scatter": "ReduceScatter",
}
#: Sizes measured when ``size_and_time`` is empty: 1MB, 2MB, ..., 1GB (Paddle's docstring).
DEFAULT_SIZES = tuple(1 << k for k in range(20, 31))
#: Untimed calls after the compile, before the timed ones.
WARMUP = 3
_DTYPE = np.float32


@dataclasses.dataclass(frozen=True)
class PerfResult:
    """One measured (operation, group, size).

    Attributes:
      op: Paddle's ``comm_type`` (``"allreduce"``, ...).
      group: the group's name (``"dp"``, ``"mp"``, ``"world"``, ``"dp+mp"``, ...).
      axes: the mesh axes the collective runs over.
      nranks: ranks per group.
      nbytes: bytes of the tensor each rank passes (Paddle's ``perf_size``).
      total_bytes: nccl-tests' size ``S`` (see :func:`total_bytes`).
      round: timed calls.
      time_s: mean seconds per call (what Paddle compares with the threshold).
      min_time_s: fastest call.
      algbw_gbps: ``total_bytes / time_s`` in GB/s (1e9 bytes).
      busbw_gbps: ``algbw_gbps * bus_factor(op, nranks)``.
      threshold_s: the time threshold, or None for none.
      slow: ``time_s`` exceeded ``threshold_s`` (a warning was logged).
      kernel: what ran (``"psum"``, ``"all_gather"``, ...).
    """

    op: str
    group: str
    axes: tuple[str, ...]
    nranks: int
    nbytes: int
    total_bytes: int
    round: int
    time_s: float
    min_time_s: float
    algbw_gbps: float
    busbw_gbps: float
    threshold_s: float | None
    slow: bool
    kernel: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return {**dataclasses.asdict(self), "axes": list(self.axes)}


# ----- formulas ---------------------------------------------------------------------------


def _check_op(op: Any, what: str = "comm_type") -> str:
    if op not in OPS:
        raise ValueError(f"{what}={op!r} is not a collective to measure; expected one of {OPS}.")
    return op


def bus_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth factor: ``busbw = algbw * bus_factor(op, nranks)``.

    Example:
      >>> bus_factor("allreduce", 2), bus_factor("reduce_scatter", 8)
      (1.0, 0.875)
    """
    _check_op(op, "op")
    n = int(nranks)
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("allgather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


def total_bytes(op: str, nbytes: int, nranks: int) -> int:
    """nccl-tests' size ``S`` of ``op`` when each rank passes ``nbytes``.

    ``allgather``: the gathered output, ``nranks * nbytes``; every other op: ``nbytes``
    (for ``reduce_scatter`` the input, of which each rank keeps ``nbytes / nranks``).

    Example:
      >>> total_bytes("allgather", 1024, 4), total_bytes("reduce_scatter", 1024, 4)
      (4096, 1024)
    """
    _check_op(op, "op")
    return int(nbytes) * int(nranks) if op == "allgather" else int(nbytes)


def bandwidths(op: str, nbytes: int, nranks: int, time_s: float) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 bytes) of ``op`` moving ``nbytes`` per rank in ``time_s``.

    Example:
      >>> bandwidths("allreduce", 10**9, 8, 0.5)
      (2.0, 3.5)
    """
    algbw = total_bytes(op, nbytes, nranks) / time_s / 1e9
    return algbw, algbw * bus_factor(op, nranks)


# ----- groups -----------------------------------------------------------------------------


def _axes(group: Group) -> tuple[str, ...]:
    name = group.axis_name
    return (name,) if isinstance(name, str) else tuple(name)


def group_of(hcg: HybridCommunicateGroup, name: str) -> Group:
    """The group called ``name`` on ``hcg``'s mesh: a mesh axis, axes joined by ``+``
    (``"dp+mp"``) or ``"world"`` (every axis).

    Raises:
      ValueError: an unknown or repeated axis.

    Example:
      >>> from jfleet.mesh.hybrid_group import build_hybrid_communicate_group
      >>> hcg = build_hybrid_communicate_group({"dp_degree": 2, "mp_degree": 4})
      >>> group_of(hcg, "world").nranks, group_of(hcg, "dp+mp").nranks
      (8, 8)
    """
    axes = tuple(hcg.mesh.axis_names)
    parts = axes if name == WORLD else tuple(str(name).split("+"))
    unknown = [a for a in parts if a not in axes]
    if not isinstance(name, str) or unknown or len(set(parts)) != len(parts) or not parts:
        raise ValueError(
            f"group {name!r} is not a group of this mesh; expected {WORLD!r}, a mesh axis "
            f"{list(axes)} or several joined by '+' (each once), e.g. {axes[0]}+{axes[-1]}."
        )
    return dataclasses.replace(hcg.create_fuse_group(list(parts)), name=name)


def default_group(comm_type: str, hcg: HybridCommunicateGroup) -> Group | None:
    """Paddle's group for ``comm_type``: the data group (``dp``, or ``sharding`` when
    ``dp`` has one rank; None when both have one) for allreduce, reduce and broadcast;
    the model-parallel group (``mp``) for allgather and reduce_scatter.

    Example:
      >>> from jfleet.mesh.hybrid_group import build_hybrid_communicate_group
      >>> hcg = build_hybrid_communicate_group({"dp_degree": 2, "mp_degree": 4})
      >>> default_group("broadcast", hcg).name, default_group("allgather", hcg).nranks
      ('dp', 4)
    """
    _check_op(comm_type)
    if comm_type in ("allgather", "reduce_scatter"):
        return hcg.get_model_parallel_group()
    for group in (hcg.get_data_parallel_group(), hcg.get_sharding_parallel_group()):
        if group.nranks > 1:
            return group
    return None


def _resolve(group: Any, fn: str) -> Group | None:
    """``group`` as a :class:`Group` (a name is looked up on the current run), or None."""
    if group is None or isinstance(group, Group):
        return group
    if isinstance(group, str):
        return group_of(_context.require(f"{fn} with group={group!r}").hcg, group)
    raise TypeError(
        f"{fn}: group={group!r} ({type(group).__name__}) is not a group; pass a Group from "
        "the hybrid group (hcg.get_data_parallel_group(), ...) or a name such as "
        f"{WORLD!r}."
    )


# ----- the measured programs ----------------------------------------------------------------


def _is_gpu(mesh: Mesh) -> bool:
    return mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")


def _body(op: str, axes: tuple[str, ...], gpu: bool) -> tuple[Callable, str]:
    """The per-device body of ``op`` over ``axes`` and the name of what it runs."""
    if op == "allreduce":
        return kernel("all_reduce", axes, ReduceOp.SUM, 0), "psum"
    if op == "reduce":
        return kernel("reduce", axes, ReduceOp.SUM, 0), "psum kept on rank 0"
    if op == "broadcast":
        if gpu:
            return (lambda x: jax.lax.pbroadcast(x, axes, 0)), "collective-broadcast"
        return kernel("broadcast", axes, ReduceOp.SUM, 0), "masked psum"
    if op == "allgather":
        return (lambda x: jax.lax.all_gather(x, axes, axis=0, tiled=True)), "all_gather"
    return (
        lambda x: jax.lax.psum_scatter(x, axes, scatter_dimension=0, tiled=True)
    ), "psum_scatter"


@functools.lru_cache(maxsize=128)
def _program(op: str, mesh: Mesh, axes: tuple[str, ...], spec: P) -> tuple[Callable, str]:
    body, name = _body(op, axes, _is_gpu(mesh))
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=spec, out_specs=P(tuple(mesh.axis_names)), check_vma=False
    )
    return jax.jit(mapped), name


@functools.lru_cache(maxsize=128)
def _compiled(program: Callable, shape: tuple, dtype: Any, sharding: Any) -> Callable:
    """``program`` compiled for one input signature: one compile per (op, group, size)."""
    return program.lower(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)).compile()


def collective_fn(op: str, mesh: Mesh, axes: Sequence[str], spec: P | None = None) -> Callable:
    """The jitted program :func:`measure` times: ``op`` over ``axes`` on every device.

    Its input is a global array whose piece on device ``d`` (laid out by ``spec``) is
    rank ``d``'s tensor; its output stacks every device's result along dimension 0
    (device order of the mesh), so ``out.reshape(mesh.size, -1)[d]`` is rank ``d``'s.
    ``spec`` None: every device gets the whole input (``P()``).

    Example:
      >>> import numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> from jfleet.mesh.hybrid_group import build_hybrid_communicate_group
      >>> mesh = build_hybrid_communicate_group({"dp_degree": 8}).mesh
      >>> f = collective_fn("allreduce", mesh, mesh.axis_names)
      >>> np.asarray(f(np.ones(2, np.float32))).reshape(8, 2)[3]
      array([8., 8.], dtype=float32)
    """
    return _program(_check_op(op, "op"), mesh, tuple(axes), P() if spec is None else spec)[0]


# ----- one measurement --------------------------------------------------------------------


def _positive_int(value: Any, what: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{what}={value!r} must be a positive int; {fix}.")
    return int(value)


def _threshold(value: Any, what: str) -> float | None:
    """A threshold in seconds; None and values <= -1 (Paddle's "none") mean no check."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ValueError(
            f"{what}={value!r} is not a time; expected seconds as a number (-1 or None: "
            "no threshold)."
        )
    if not math.isfinite(value):
        raise ValueError(f"{what}={value!r} must be finite seconds (-1 or None: no threshold).")
    return None if value <= -1 else float(value)


def measure(
    op: str,
    x: Any,
    group: Group,
    *,
    round: int = 50,
    threshold_s: float | None = None,
    warmup: int = WARMUP,
    log: bool = True,
) -> PerfResult:
    """Times ``op`` on tensor ``x`` over ``group``: one compile, ``warmup`` calls, then
    ``round`` timed calls, each waited for (``block_until_ready``).

    Args:
      op: one of :data:`OPS`.
      x: each rank's tensor, at least 1-d: a global ``jax.Array`` laid out on the mesh
        (rank ``d``'s tensor is device ``d``'s piece, as in :mod:`jfleet.collective`),
        or an array every rank passes whole.
      group: a group of the fleet mesh with at least 2 ranks.
      round: timed calls (Paddle's ``round`` / ``iteration``).
      threshold_s: log a warning and set ``slow`` when the mean exceeds it (None or
        <= -1: no check).
      warmup: untimed calls before the timed ones.
      log: log the INFO line and the slow warning.

    Returns:
      The :class:`PerfResult`; an INFO log line as Paddle's (``[AllReduceTest] ...``).

    Raises:
      ValueError: an unknown op, ``round`` < 1, a 0-d tensor, a group of one rank, a
        reduce_scatter tensor whose first dimension the group size does not divide.

    Example:
      >>> import numpy as np
      >>> from jfleet.mesh.hybrid_group import build_hybrid_communicate_group
      >>> hcg = build_hybrid_communicate_group({"dp_degree": 2, "mp_degree": 4})
      >>> r = measure("allgather", np.zeros(256, np.float32), group_of(hcg, "mp"), round=2)
      >>> r.nbytes, r.total_bytes, r.busbw_gbps == r.algbw_gbps * 0.75
      (1024, 4096, True)
    """
    _check_op(op, "op")
    fn = f"{op}_perf"
    rounds = _positive_int(round, "round", "time at least one call, e.g. round=50")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an int >= 0.")
    threshold = _threshold(threshold_s, "threshold_s")
    if group.nranks < 2:
        raise ValueError(
            f"{fn}: group {group.name!r} has {group.nranks} rank; a collective needs at "
            "least 2; measure over an axis of degree > 1 or 'world'."
        )
    mesh = _mesh_for(group, x, fn)
    array, spec = _spec_on(x, mesh, fn)
    piece = NamedSharding(mesh, spec).shard_shape(array.shape)
    if not piece:
        raise ValueError(f"{fn}: x is 0-d (a scalar); pass a 1-d tensor, e.g. np.zeros(256).")
    n = group.nranks
    if op == "reduce_scatter" and piece[0] % n:
        raise ValueError(
            f"{fn}: each rank's tensor has {piece[0]} rows (shape {piece}), which the "
            f"{n} ranks of group {group.name!r} cannot share equally; use a first "
            f"dimension divisible by {n}."
        )
    nbytes = math.prod(piece) * array.dtype.itemsize
    program, name = _program(op, mesh, _axes(group), spec)
    compiled = _compiled(program, array.shape, array.dtype, array.sharding)
    for _ in range(warmup):
        jax.block_until_ready(compiled(array))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(compiled(array))
        times.append(time.perf_counter() - start)
    mean = sum(times) / rounds
    algbw, busbw = bandwidths(op, nbytes, n, mean)
    slow = threshold is not None and mean > threshold
    result = PerfResult(
        op, str(group.name), _axes(group), n, nbytes, total_bytes(op, nbytes, n), rounds,
        mean, min(times), algbw, busbw, threshold, slow, name,
    )  # fmt: skip
    if not log:
        return result
    logger.info(
        "[%sTest] nbytes %dB over %s (%d ranks) test result: %.6g s/iter (min %.6g), "
        "algbw %.4g GB/s, busbw %.4g GB/s",
        _TAGS[op], nbytes, group.name, n, mean, min(times), algbw, busbw,
    )  # fmt: skip
    if slow:
        logger.warning(
            "[Perf Warning] %s Test Timeout! %s over %s (%d ranks), nbytes %dB: %.6g s/iter "
            "> threshold %.6g s",
            _TAGS[op], op, group.name, n, nbytes, mean, threshold,
        )  # fmt: skip
    return result


def perf_once(
    op: str,
    iteration: int,
    x: Any,
    group: Group | str | None,
    perf_size: int,
    perf_threshold_time: float,
    *,
    log: bool = True,
) -> PerfResult | None:
    """What Paddle's ``fleet.<op>_perf(iteration, x, group, perf_size,
    perf_threshold_time)`` does: measure, or log that the group is invalid (None or one
    rank) and return None. ``perf_size`` is Paddle's label of the size; the bandwidths
    use the bytes ``x`` has."""
    fn = f"{op}_perf"
    _positive_int(iteration, "iteration", "time at least one call, e.g. iteration=50")
    _positive_int(perf_size, "perf_size", "pass the message size in bytes, e.g. 1 << 20")
    resolved = _resolve(group, fn)
    if resolved is None or resolved.nranks <= 1:
        shown = "None" if resolved is None else f"{resolved.name!r} with 1 rank"
        logger.warning(
            "%s is invalid, group invalid! (group %s: nothing to measure; pass a group with "
            "at least 2 ranks, e.g. hcg.get_data_parallel_group() on a mesh with dp > 1)",
            fn, shown,
        )  # fmt: skip
        return None
    threshold = _threshold(perf_threshold_time, fn)
    return measure(op, x, resolved, round=iteration, threshold_s=threshold, log=log)


def _message(op: str, nbytes: int, nranks: int) -> np.ndarray:
    """The float32 tensor of ``nbytes`` bytes Paddle measures with (zeros); for
    reduce_scatter its length is rounded down to a multiple of ``nranks``."""
    count = nbytes // np.dtype(_DTYPE).itemsize
    if op == "reduce_scatter":
        count = max(nranks, count - count % nranks)
    return np.zeros(count, _DTYPE)


def _sizes(size_and_time: Any) -> dict[int, float | None]:
    if size_and_time is None or (isinstance(size_and_time, Mapping) and not size_and_time):
        return dict.fromkeys(DEFAULT_SIZES)
    if not isinstance(size_and_time, Mapping):
        raise ValueError(
            f"size_and_time={size_and_time!r} ({type(size_and_time).__name__}) must be a dict "
            "of message size in bytes -> time threshold in seconds, e.g. {1 << 20: 0.5}."
        )
    out = {}
    for size, limit in size_and_time.items():
        nbytes = _positive_int(size, "size_and_time key", "sizes are bytes, e.g. 1 << 20")
        if nbytes < np.dtype(_DTYPE).itemsize:
            raise ValueError(
                f"size_and_time key={size!r} bytes is smaller than one float32 (4 bytes); "
                "measure at least 4 bytes."
            )
        out[nbytes] = _threshold(limit, f"size_and_time[{size!r}]")
    return out


def collective_perf(
    comm_type: str,
    round: int = 50,
    size_and_time: Mapping[int, float] | None = None,
    hcg: HybridCommunicateGroup | None = None,
    *,
    group: Group | str | None = None,
) -> list[PerfResult]:
    """Paddle's ``fleet.collective_perf``: times ``comm_type`` for each size and warns
    (the ``jfleet`` logger) for each one slower than its threshold.

    Args:
      comm_type: one of :data:`OPS`.
      round: timed calls per size.
      size_and_time: ``{bytes: seconds}``; a threshold <= -1 or None checks nothing.
        Empty or None: 1MB, 2MB, ..., 1GB without thresholds (Paddle's documented
        default; its code measures nothing then).
      hcg: the hybrid group; default the current run's.
      group: a jfleet addition: the group (a ``Group`` or a name for
        :func:`group_of`); default Paddle's, :func:`default_group`.

    Returns:
      One :class:`PerfResult` per size; ``[]`` (and a logged warning) when the group
      has fewer than 2 ranks.

    Raises:
      ValueError: an unknown ``comm_type``, ``round`` < 1, a size that is not a positive
        int of at least 4 bytes, a threshold that is not a number, an unknown group.

    Example:
      >>> from jfleet.mesh.hybrid_group import build_hybrid_communicate_group
      >>> hcg = build_hybrid_communicate_group({"dp_degree": 2, "mp_degree": 4})
      >>> [(r.op, r.group, r.nbytes) for r in collective_perf("reduce", 2, {64: -1}, hcg)]
      [('reduce', 'dp', 64)]
    """
    _check_op(comm_type)
    rounds = _positive_int(round, "round", "time at least one call, e.g. round=50")
    sizes = _sizes(size_and_time)
    if hcg is None:
        hcg = _context.require("fleet.collective_perf").hcg
    chosen = default_group(comm_type, hcg) if group is None else group
    if isinstance(chosen, str):
        chosen = group_of(hcg, chosen)
    chosen = _resolve(chosen, f"{comm_type}_perf")
    if chosen is None or chosen.nranks < 2:
        logger.warning(
            "%s_perf is invalid, group invalid! (no group with 2 or more ranks: %s; nothing "
            "measured; pass group=... or use a mesh whose %s axis has degree > 1)",
            comm_type,
            "data group: dp and sharding have 1 rank each"
            if chosen is None
            else f"{chosen.name!r} has {chosen.nranks} rank",
            MP if comm_type in ("allgather", "reduce_scatter") else f"{DP} or {SHARDING}",
        )
        return []
    return [
        measure(comm_type, _message(comm_type, size, chosen.nranks), chosen, round=rounds,
                threshold_s=limit)
        for size, limit in sizes.items()
    ]  # fmt: skip


# ----- tables -----------------------------------------------------------------------------


def sweep(
    hcg: HybridCommunicateGroup,
    ops: Sequence[str] = OPS,
    groups: Sequence[str] = (DP, MP, WORLD),
    sizes: Sequence[int] = (1 << 10, 1 << 20),
    round: int = 20,
) -> list[PerfResult]:
    """Every op over every group at every size, in that order (sizes outermost);
    groups of one rank are skipped with an INFO line.

    Example:
      >>> from jfleet.mesh.hybrid_group import build_hybrid_communicate_group
      >>> hcg = build_hybrid_communicate_group({"dp_degree": 2, "mp_degree": 4})
      >>> len(sweep(hcg, ["allreduce"], ["dp", "mp", "pp"], [64], round=1))  # pp: 1 rank
      2
    """
    for op in ops:
        _check_op(op, "op")
    rounds = _positive_int(round, "round", "time at least one call, e.g. round=20")
    found = {name: group_of(hcg, name) for name in groups}
    for name, g in found.items():
        if g.nranks < 2:
            logger.info("collective_perf: group %r has %d rank; skipped", name, g.nranks)
    sizes = list(_sizes(dict.fromkeys(sizes)))
    return [
        measure(op, _message(op, size, g.nranks), g, round=rounds)
        for size in sizes
        for op in ops
        for g in found.values()
        if g.nranks > 1
    ]

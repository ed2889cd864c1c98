"""Collectives: ``paddle.distributed``'s group collectives and ``fleet.util``'s host ones.

``all_reduce``, ``all_gather``, ``broadcast``, ``reduce``, ``scatter``, ``reduce_scatter``
and ``barrier`` take Paddle's arguments (``group=`` a :class:`~jfleet.topology.Group`,
``None`` for the world; ``src`` / ``dst`` global ranks; ``op`` a :class:`ReduceOp`).
JAX arrays cannot change in place, so each *returns* its result (Paddle returns None):
write ``x = all_reduce(x, group=g)``. A "rank" is a device of the fleet mesh, and a
call works in two settings:

- **Inside** ``jax.shard_map`` over the mesh (the group's axes manual): the value is
  this device's, and the call is ``lax.psum`` / ``pmax`` / ``psum_scatter`` over the
  group's axis names, each device with its own group. Results equal on every member
  (``all_reduce``, ``all_gather``, ``broadcast``) are typed invariant over the group's
  axes, so ``out_specs`` may leave those axes out.
- **On a global** ``jax.Array`` (the host view): rank ``r``'s tensor is what device
  ``r`` holds, its piece under the array's ``NamedSharding`` (an array not laid out on
  a mesh, a NumPy array, a number: every rank holds all of it). The call is compiled
  as a ``shard_map`` over the mesh (the group's, else the run's) and returns a global
  array laid out like the input, device ``r`` holding rank ``r``'s result. Where the
  ranks' results differ (``reduce``, ``scatter``, ``reduce_scatter``) under a layout
  that replicates over the group's axes, the devices then hold different values under
  that one layout, as each Paddle rank holds its own tensor: ``np.asarray`` reads the
  host rank's (this process's first device, ``hcg.global_rank``), as a Paddle script on
  that rank sees it; collectives and element-wise operations go on per device, and
  ``x.addressable_shards`` shows every rank's. Before handing such a result to code
  that assumes one value on every device, split it over the group's axes instead (one
  row per rank: shape ``[nranks, ...]``, ``PartitionSpec(group.axis_name)``).

Paddle passes ``src`` / ``dst`` as global ranks of the caller's group; in SPMD every
group of the kind uses the member at that position (``group.get_group_rank(src)``),
e.g. ``broadcast(x, src=hcg.get_model_parallel_group_src_rank(), group=mp)`` sends from
``mp`` index 0 in every ``mp`` group.

``fleet.util``'s host-level form stays: ``all_reduce(value, "sum"|"mean"|"max"|"min")``
(a mode string), ``all_gather(value)`` (one argument), and ``all_reduce`` /
``all_gather`` of a Python number or NumPy value with no group reduce or gather one
value per *process* (small host values: a loss to log, a sample count). Values travel
as raw bytes, so float64 and int64 survive whatever ``jax_enable_x64`` says.

Example (dp2 x mp4 on 8 devices; one row per rank, row ``r`` holds ``r``):
  >>> import jax, numpy as np
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> from jfleet import fleet
  >>> from jfleet.mesh.collective import all_reduce, broadcast, scatter
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> hcg = fleet.get_hybrid_communicate_group()
  >>> world = hcg.mesh.axis_names
  >>> x = jax.device_put(np.arange(8.0)[:, None], NamedSharding(hcg.mesh, P(world)))
  >>> mp = hcg.get_model_parallel_group()
  >>> np.asarray(all_reduce(x, group=mp))[:, 0].tolist()  # 0+1+2+3, then 4+5+6+7
  [6.0, 6.0, 6.0, 6.0, 22.0, 22.0, 22.0, 22.0]
  >>> np.asarray(broadcast(x, src=1, group=mp))[:, 0].tolist()
  [1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0]
  >>> dp = hcg.get_data_parallel_group()  # ranks (0, 4): dp index 0 gets entry 0
  >>> y = scatter(np.zeros(2), [np.ones(2), np.full(2, 2.0)], src=0, group=dp)
  >>> np.asarray(y).tolist(), np.asarray(y.addressable_shards[4].data).tolist()  # rank 0, 4
  ([1.0, 1.0], [2.0, 2.0])
  >>> all_reduce(3), all_reduce(2.0, "mean"), all_gather(7)  # host values, one process
  (3, 2.0, [7])
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from jfleet.mesh import context as _context
from jfleet.mesh.group_collective import ReduceOp, group_size, manual_axes, run
from jfleet.mesh.topology import Group
from jfleet.runtime.consistency import describe_ranks
from jfleet.runtime.log import logger

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_one_to_all",
    "get_backend",
    "get_rank",
    "get_world_size",
    "local_value",
    "new_group",
    "reduce",
    "reduce_scatter",
    "scatter",
    "wait",
]

_MODES = ("sum", "mean", "max", "min")
_HEADER_BYTES = 512
_MISSING: Any = object()

Value = int | float | complex | np.ndarray | np.generic | jax.Array


_OP_TO_MODE = {
    ReduceOp.SUM: "sum",
    ReduceOp.MAX: "max",
    ReduceOp.MIN: "min",
    ReduceOp.PROD: "prod",
    ReduceOp.AVG: "mean",
}


# ----- arguments ----------------------------------------------------------------------


def _check_op(op: Any, fn: str) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, (int, np.integer)) and not isinstance(op, bool) and 0 <= op <= 4:
        return ReduceOp(int(op))
    raise ValueError(
        f"{fn}: op={op!r} is not a reduction; pass one of "
        f"{[f'ReduceOp.{o.name}' for o in ReduceOp]} (or the fleet.util mode strings "
        f"{_MODES} to all_reduce)."
    )


def _check_group(group: Any, fn: str) -> Group | None:
    if group is None or isinstance(group, Group):
        return group
    raise TypeError(
        f"{fn}: group={group!r} ({type(group).__name__}) is not a Group; pass one from the "
        "hybrid group, e.g. fleet.get_hybrid_communicate_group().get_model_parallel_group(), "
        "or None for every rank."
    )


def _check_list(tensor_list: Any, n: int, fn: str, *, allow_empty: bool) -> list:
    if not isinstance(tensor_list, (list, tuple)):
        shape = getattr(tensor_list, "shape", None)
        given = f"of shape {tuple(shape)}" if shape is not None else f"{tensor_list!r}"
        raise TypeError(
            f"{fn}: tensor_list is a {type(tensor_list).__name__} {given}, not a list; "
            f"pass a list of the group's {n} tensors."
        )
    if len(tensor_list) != n and not (allow_empty and not tensor_list):
        raise ValueError(
            f"{fn}: tensor_list has {len(tensor_list)} entries but the group has {n} ranks; "
            f"pass {n} tensors, one per rank of the group"
            + (" (or an empty list)." if allow_empty else ".")
        )
    return list(tensor_list)


_sync_logged: list[bool] = []


def _note_sync(sync_op: Any, fn: str) -> None:
    if sync_op is not True and not _sync_logged:
        _sync_logged.append(True)
        logger.info(
            "%s(sync_op=%r): ignored; XLA dispatches every collective asynchronously and "
            "orders it with the computation (jax.block_until_ready waits).",
            fn,
            sync_op,
        )


# ----- Paddle's collectives -----------------------------------------------------------------


def _is_host_value(value: Any) -> bool:
    return not isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer)


def all_reduce(
    tensor: Value,
    op: ReduceOp | str = ReduceOp.SUM,
    group: Group | None = None,
    sync_op: bool = True,
) -> Any:
    """Reduces ``tensor`` over the ranks of ``group``; every rank gets the result.

    Args:
      tensor: this rank's tensor (see the module docstring for the two settings).
      op: a :class:`ReduceOp`; or one of fleet.util's mode strings ``"sum"``,
        ``"mean"``, ``"max"``, ``"min"``, which reduce one host value per *process*.
      group: the group; None for every rank.
      sync_op: accepted; XLA runs collectives asynchronously (logged once).

    Returns:
      The reduction, laid out like ``tensor``. A Python number or NumPy value with no
      group (or a mode string) is reduced across processes and comes back as the same
      kind (an int stays an int except for ``"mean"`` / ``AVG``).

    Raises:
      ValueError: an unknown ``op`` or mode, a group with a mode string, shapes that
        differ between processes.
      TypeError: ``group`` is not a Group; a host value that is not a number or array.

    Example:
      >>> from jfleet.mesh.collective import ReduceOp, all_reduce
      >>> all_reduce(5, ReduceOp.MAX), all_reduce(5, "max")  # one process
      (5, 5)
    """
    if isinstance(op, str):
        if op not in _MODES:
            raise ValueError(
                f"all_reduce mode={op!r} is not supported; use one of {_MODES} (or a ReduceOp)."
            )
        if group is not None:
            raise ValueError(
                f"all_reduce: mode={op!r} is fleet.util's per-process form and takes no "
                f"group (got group {getattr(group, 'name', group)!r}); pass op=ReduceOp."
                f"{op.upper() if op != 'mean' else 'AVG'} to reduce over a group's ranks."
            )
        return _host_reduce(tensor, op, "all_reduce")
    op = _check_op(op, "all_reduce")
    group = _check_group(group, "all_reduce")
    _note_sync(sync_op, "all_reduce")
    if group is None and _is_host_value(tensor):
        return _host_reduce(tensor, _OP_TO_MODE[op], "all_reduce")
    return run("all_reduce", group, tensor, "all_reduce", op=op)


def all_gather(
    tensor_list: Any,
    tensor: Any = _MISSING,
    group: Group | None = None,
    sync_op: bool = True,
) -> list[Any]:
    """Every rank's ``tensor``, in group order, on every rank.

    Paddle's form ``all_gather(tensor_list, tensor, group)`` fills ``tensor_list``
    (empty, or one entry per rank, replaced) and jfleet also returns it. fleet.util's
    form ``all_gather(value)`` (one argument) gathers one host value per process.

    Args:
      tensor_list: the list to fill; in the one-argument form, the value.
      tensor: this rank's tensor.
      group: the group; None for every rank.
      sync_op: accepted; XLA runs collectives asynchronously.

    Returns:
      A list of ``group.nranks`` tensors, each laid out like ``tensor`` (entry ``j``:
      group member ``j``'s tensor). A number or NumPy value with no group: a list of
      ``jax.process_count()`` values, converted like the input.

    Raises:
      TypeError: ``tensor_list`` is not a list, ``group`` is not a Group.
      ValueError: ``tensor_list`` is neither empty nor one entry per rank.

    Example:
      >>> from jfleet.mesh.collective import all_gather
      >>> out = []
      >>> all_gather(out, 1.5), out  # a host value, one process
      ([1.5], [1.5])
    """
    if tensor is _MISSING:
        gathered = _gather_arrays(_to_numpy(tensor_list, "all_gather"))
        return [_like_input(tensor_list, g) for g in gathered]
    group = _check_group(group, "all_gather")
    _note_sync(sync_op, "all_gather")
    if group is None and _is_host_value(tensor):
        n = jax.process_count()
        _check_list(tensor_list, n, "all_gather", allow_empty=True)
        result = [_like_input(tensor, g) for g in _gather_arrays(_to_numpy(tensor, "all_gather"))]
    else:
        n = group_size(group, tensor, "all_gather")
        _check_list(tensor_list, n, "all_gather", allow_empty=True)
        result = list(run("all_gather", group, tensor, "all_gather"))
    if isinstance(tensor_list, list):
        tensor_list[:] = result
        return tensor_list
    return result


def broadcast(tensor: Any, src: int, group: Group | None = None, sync_op: bool = True) -> Any:
    """Rank ``src``'s tensor on every rank of the group.

    Args:
      tensor: this rank's tensor (only ``src``'s is used).
      src: a global rank in ``group``; every group of the kind sends from the member at
        ``src``'s position.
      group: the group; None for every rank.
      sync_op: accepted; XLA runs collectives asynchronously.

    Returns:
      ``src``'s tensor, laid out like ``tensor``.

    Raises:
      ValueError: ``src`` is not a rank of the group.
      TypeError: ``group`` is not a Group.

    Example:
      >>> # inside shard_map over hcg.mesh: x = broadcast(x, src=mp.ranks[0], group=mp)
    """
    group = _check_group(group, "broadcast")
    _note_sync(sync_op, "broadcast")
    return run("broadcast", group, tensor, "broadcast", rank=src)


def reduce(
    tensor: Any,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    group: Group | None = None,
    sync_op: bool = True,
) -> Any:
    """The reduction over the group on rank ``dst``; the other ranks keep their tensor.

    Args:
      tensor: this rank's tensor.
      dst: a global rank in ``group`` (its position is used in every group).
      op: a :class:`ReduceOp`.
      group: the group; None for every rank.
      sync_op: accepted; XLA runs collectives asynchronously.

    Returns:
      The reduction at ``dst``'s position, ``tensor`` elsewhere, laid out like ``tensor``.

    Raises:
      ValueError: ``dst`` not in the group, an unknown ``op``.
      TypeError: ``group`` is not a Group.

    Example:
      >>> # inside shard_map: y = reduce(x, dst=dp.ranks[0], group=dp)
    """
    op = _check_op(op, "reduce")
    group = _check_group(group, "reduce")
    _note_sync(sync_op, "reduce")
    return run("reduce", group, tensor, "reduce", op=op, rank=dst, what="dst")


def scatter(
    tensor: Any,
    tensor_list: Sequence[Any] | None = None,
    src: int = 0,
    group: Group | None = None,
    sync_op: bool = True,
) -> Any:
    """Group member ``i`` gets entry ``i`` of rank ``src``'s ``tensor_list``.

    Args:
      tensor: the output buffer: gives the result's shape, dtype and layout.
      tensor_list: one tensor per rank of the group, each shaped like ``tensor`` (the
        rank ``src`` holds is used). Paddle lets other ranks pass None; one SPMD program
        runs everywhere, so it is required.
      src: a global rank in ``group``.
      group: the group; None for every rank.
      sync_op: accepted; XLA runs collectives asynchronously.

    Returns:
      This rank's entry, laid out like ``tensor``.

    Raises:
      ValueError: ``src`` not in the group, ``tensor_list`` None, without one entry per
        rank or with entries whose pieces are shaped unlike ``tensor``'s.
      TypeError: ``group`` is not a Group or ``tensor_list`` not a list.

    Example:
      >>> # inside shard_map: y = scatter(x, [a, b], src=dp.ranks[0], group=dp)
    """
    group = _check_group(group, "scatter")
    _note_sync(sync_op, "scatter")
    if tensor_list is None:
        raise ValueError(
            "scatter: tensor_list=None; in SPMD one program runs on every rank, so pass the "
            "list the src rank sends (one tensor per rank of the group) everywhere."
        )
    xs = _check_list(
        tensor_list, group_size(group, tensor, "scatter"), "scatter", allow_empty=False
    )
    return run("scatter", group, tensor, "scatter", rank=src, extra=xs)


def reduce_scatter(
    tensor: Any,
    tensor_list: Sequence[Any],
    op: ReduceOp = ReduceOp.SUM,
    group: Group | None = None,
    sync_op: bool = True,
) -> Any:
    """Group member ``i`` gets the reduction over the group of every rank's entry ``i``.

    Args:
      tensor: the output buffer: gives the result's shape, dtype and layout.
      tensor_list: this rank's list, one tensor per rank of the group, each shaped like
        ``tensor``.
      op: a :class:`ReduceOp`.
      group: the group; None for every rank.
      sync_op: accepted; XLA runs collectives asynchronously.

    Returns:
      This rank's reduced entry, laid out like ``tensor``.

    Raises:
      ValueError: an unknown ``op``, a list without one entry per rank or with entries
        whose pieces are shaped unlike ``tensor``'s.
      TypeError: ``group`` is not a Group or ``tensor_list`` not a list.

    Example:
      >>> # inside shard_map: y = reduce_scatter(y, [a, b], group=dp)
    """
    op = _check_op(op, "reduce_scatter")
    group = _check_group(group, "reduce_scatter")
    _note_sync(sync_op, "reduce_scatter")
    n = group_size(group, tensor, "reduce_scatter")
    xs = _check_list(tensor_list, n, "reduce_scatter", allow_empty=False)
    return run("reduce_scatter", group, tensor, "reduce_scatter", op=op, extra=xs)


def barrier(group: Group | str | None = None) -> None:
    """Blocks until every process reaches the barrier.

    SPMD runs one program on every rank and XLA orders its collectives, so a group
    barrier is a barrier of every process (a no-op with one process, and inside
    ``shard_map``, logged once). A string is fleet.util's barrier name: every process
    must use the same one.

    Args:
      group: a Group, None (every rank), or a barrier name.

    Raises:
      TypeError: ``group`` is neither a Group, None nor a string.
      RuntimeError: processes reached barriers of different names.

    Example:
      >>> from jfleet.mesh.collective import barrier
      >>> barrier()  # one process: returns at once
    """
    if isinstance(group, str):
        name = group
    else:
        _check_group(group, "barrier")
        name = "jfleet_barrier"
        if manual_axes():
            logger.info("barrier inside shard_map: nothing to do, XLA orders the collectives")
            return
    if jax.process_count() == 1:
        return
    try:
        multihost_utils.sync_global_devices(name)
    except AssertionError as e:
        raise RuntimeError(
            f"barrier({name!r}): processes reached barriers with different names; "
            "call barrier with the same name on every process."
        ) from e


def new_group(
    ranks: Sequence[int] | None = None,
    backend: str | None = None,
    timeout: Any = None,
    nccl_config: Any = None,
) -> Group:
    """The group of ``ranks``, as the set of mesh axes that joins them (Paddle's new_group).

    Under SPMD a group is a set of mesh axes: ``ranks`` must be the ranks of one group
    along some axes of the run's mesh (its ``mp`` group, a ``dp`` x ``mp`` group...); in
    SPMD every other group of that kind exists with it. Ranks are sorted, as in Paddle.
    ``backend`` and Paddle's other options (``timeout``, ``nccl_config``) are accepted
    and unused: XLA makes the communicators.

    Args:
      ranks: global ranks; None for every rank.
      backend: accepted, unused (as ``timeout`` and ``nccl_config``).

    Returns:
      A :class:`~jfleet.topology.Group` (``rank`` -1 where this process is not in it).

    Raises:
      ValueError: a rank out of range or repeated; ranks that no set of mesh axes joins.
      RuntimeError: no ``fleet.init``.

    Example:
      >>> from jfleet import fleet
      >>> from jfleet.mesh.collective import new_group
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")  # dp 8
      >>> g = new_group([6, 2, 4, 0])
      Traceback (most recent call last):
      ...
      ValueError: new_group: ranks=[6, 2, 4, 0] are not one group along mesh axes ...
      >>> new_group([0, 1, 2, 3, 4, 5, 6, 7]).axis_name
      'dp'
    """
    hcg = _context.require("new_group").hcg
    mesh = hcg.mesh
    grid = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    given = list(range(grid.size)) if ranks is None else list(ranks)
    bad = [r for r in given if isinstance(r, bool) or not isinstance(r, (int, np.integer))]
    bad += [r for r in given if r not in bad and not 0 <= r < grid.size]
    if bad or not given or len(set(given)) != len(given):
        raise ValueError(
            f"new_group: ranks={given} must be distinct global ranks in 0..{grid.size - 1} "
            f"(bad: {bad or 'repeated or empty'}); pass each rank of the group once."
        )
    want = sorted(int(r) for r in given)
    coord = np.unravel_index(want[0], grid.shape)
    split = [i for i, d in enumerate(grid.shape) if d > 1]
    for k in range(len(split) + 1):
        for axes in itertools.combinations(split, k):
            pick = tuple(slice(None) if i in axes else int(c) for i, c in enumerate(coord))
            if sorted(grid[pick].ravel().tolist()) == want:
                names = tuple(mesh.axis_names[i] for i in axes)
                me = hcg.global_rank
                return Group(
                    names[0] if len(names) == 1 else names,
                    tuple(want),
                    rank=want.index(me) if me in want else -1,
                    name="new_group",
                    mesh=mesh,
                )
    raise ValueError(
        f"new_group: ranks={given} are not one group along mesh axes {mesh.axis_names} "
        f"(shape {tuple(grid.shape)}); under SPMD a group spans whole mesh axes: pass the "
        "ranks of one, e.g. hcg.get_model_parallel_group().ranks."
    )


def wait(tensor: Any, group: Group | None = None, use_calc_stream: bool = True) -> None:
    """Blocks until ``tensor`` (any pytree of arrays) is computed.

    Paddle syncs a stream with a group's communication; XLA has no separate streams, so
    waiting for the value is the whole of it (``group`` / ``use_calc_stream`` accepted).

    Example:
      >>> from jfleet.mesh.collective import wait
      >>> wait(all_reduce(1.0))
    """
    _check_group(group, "wait")
    jax.block_until_ready(tensor)


def get_backend(group: Group | None = None) -> str:
    """``"XLA"``: the backend that runs every group's collectives (Paddle: ``"NCCL"``...).

    Example:
      >>> from jfleet.mesh.collective import get_backend
      >>> get_backend()
      'XLA'
    """
    group = _check_group(group, "get_backend")
    return "XLA" if group is None else group.backend


def local_value(tensor: Any, rank: int | None = None) -> jax.Array:
    """Rank ``rank``'s tensor: the piece of ``tensor`` that device ``rank`` holds.

    Paddle's ``Tensor._local_value()``. In the host view of this module a rank's tensor
    is its device's piece, so code that Paddle runs on a rank's own tensor (concatenating
    an ``all_gather``'s list, say) runs on these pieces.

    Args:
      tensor: a global array (anything else is returned as an array, every rank's).
      rank: a global rank, i.e. a position in the array's mesh; default the host rank
        (this process's first device on the mesh).

    Raises:
      ValueError: ``rank`` is not a device of the mesh this process holds.

    Example:
      >>> import jax.numpy as jnp
      >>> from jfleet.mesh.collective import local_value
      >>> local_value(jnp.arange(3)).tolist()
      [0, 1, 2]
    """
    sharding = getattr(tensor, "sharding", None)
    if not isinstance(tensor, jax.Array) or not isinstance(sharding, NamedSharding):
        return jnp.asarray(tensor)
    devices = list(sharding.mesh.devices.flat)
    mine = {s.device: s for s in tensor.addressable_shards}
    if rank is None:
        rank = next(r for r, d in enumerate(devices) if d in mine)
    if (
        isinstance(rank, bool)
        or not isinstance(rank, (int, np.integer))
        or not (0 <= rank < len(devices) and devices[rank] in mine)
    ):
        held = [r for r, d in enumerate(devices) if d in mine]
        raise ValueError(
            f"local_value: rank={rank!r} is not a rank whose piece this process holds; "
            f"pass one of {held} (the mesh has {len(devices)} ranks)."
        )
    return jnp.asarray(mine[devices[int(rank)]].data)


def get_rank(group: Group | None = None) -> int:
    """Host view: this process's rank in ``group`` (its global rank with None).

    Before ``fleet.init`` it is the index in ``jax.devices()`` of the first local
    device. Inside ``shard_map`` use :func:`jfleet.topology.axis_index`.

    Example:
      >>> from jfleet.mesh.collective import get_rank
      >>> get_rank()  # one process
      0
    """
    group = _check_group(group, "get_rank")
    if group is not None:
        return group.rank
    run = _context.current()
    if run is not None:
        return run.hcg.global_rank
    return jax.devices().index(jax.local_devices()[0])


def get_world_size(group: Group | None = None) -> int:
    """The number of ranks in ``group`` (every device of the run with None).

    Example:
      >>> from jfleet.mesh.collective import get_world_size
      >>> get_world_size()  # 8 devices
      8
    """
    group = _check_group(group, "get_world_size")
    if group is not None:
        return group.nranks
    run = _context.current()
    return run.hcg.nranks if run is not None else jax.device_count()


# ----- host values, one per process (fleet.util) ------------------------------------------


def _to_numpy(value: Any, fn: str) -> np.ndarray:
    """A host-local numpy copy of ``value``; rejects what cannot be one."""
    if isinstance(value, jax.Array):
        if not value.is_fully_addressable:
            raise ValueError(
                f"{fn}: got a global jax.Array of shape {value.shape} sharded over several "
                "processes; pass a host-local value (e.g. np.asarray(x.addressable_data(0)) "
                "or a Python number). A global array is already one value for all processes."
            )
        return np.asarray(value)
    if isinstance(value, (bool, int, float, complex, np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype == object:
            raise TypeError(f"{fn}: cannot send an object array; got {value!r}.")
        return array
    raise TypeError(
        f"{fn}: expected a Python number, a numpy array or a jax.Array; got "
        f"{type(value).__name__} {value!r}."
    )


def _gather_arrays(array: np.ndarray) -> list[np.ndarray]:
    """Every process's array, in process order; shapes and dtypes may differ."""
    if jax.process_count() == 1:
        return [array]
    array = np.ascontiguousarray(array)
    meta = json.dumps({"shape": list(array.shape), "dtype": array.dtype.str}).encode()
    if len(meta) > _HEADER_BYTES - 8:
        raise ValueError(f"array of shape {array.shape} has too many dimensions to send.")
    header = np.zeros(_HEADER_BYTES, np.uint8)
    header[:8] = np.frombuffer(np.int64(array.nbytes).tobytes(), np.uint8)
    header[8 : 8 + len(meta)] = np.frombuffer(meta, np.uint8)
    headers = np.asarray(multihost_utils.process_allgather(header))
    sizes = [int(np.frombuffer(h[:8].tobytes(), np.int64)[0]) for h in headers]
    metas = [json.loads(h[8:].tobytes().rstrip(b"\0")) for h in headers]
    payload = np.zeros(max(max(sizes), 1), np.uint8)
    payload[: array.nbytes] = np.frombuffer(array.tobytes(), np.uint8)
    payloads = np.asarray(multihost_utils.process_allgather(payload))
    return [
        np.frombuffer(p[:size].tobytes(), np.dtype(m["dtype"])).reshape(m["shape"])
        for p, size, m in zip(payloads, sizes, metas, strict=True)
    ]


def _like_input(value: Any, result: np.ndarray) -> Any:
    """Python numbers come back as Python numbers, numpy scalars as numpy scalars."""
    if isinstance(value, (bool, int, float, complex)):
        return result.item()
    if isinstance(value, np.generic):
        return result[()]
    return np.asarray(result)


def _host_reduce(value: Value, mode: str, fn: str) -> Any:
    """Reduces one host value per process (``sum|mean|max|min|prod``)."""
    array = _to_numpy(value, fn)
    gathered = _gather_arrays(array)
    shapes = {(g.shape, g.dtype.str) for g in gathered}
    if len(shapes) > 1:
        described = describe_ranks({i: f"{g.dtype}{list(g.shape)}" for i, g in enumerate(gathered)})
        raise ValueError(f"{fn} needs the same shape and dtype on every process; got {described}.")
    stacked = np.stack(gathered)
    dtype = None if stacked.dtype == np.bool_ else stacked.dtype
    if mode == "sum":
        result = stacked.sum(axis=0, dtype=dtype)
    elif mode == "prod":
        result = stacked.prod(axis=0, dtype=dtype)
    elif mode == "mean":
        result = stacked.mean(axis=0)
    elif mode == "max":
        result = stacked.max(axis=0)
    else:
        result = stacked.min(axis=0)
    return _like_input(value, np.asarray(result))


def broadcast_one_to_all(value: Value, src: int = 0) -> Any:
    """Process ``src``'s value, on every process.

    Args:
      value: this process's value (only ``src``'s is used; the others may be
        placeholders of any shape).
      src: the process whose value is sent.

    Returns:
      ``src``'s value, converted like the input.

    Raises:
      ValueError: ``src`` is not a process index.

    Example:
      >>> from jfleet.mesh.collective import broadcast_one_to_all
      >>> broadcast_one_to_all(42)
      42
    """
    count = jax.process_count()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < count:
        raise ValueError(f"src={src!r} must be a process index in 0..{count - 1}.")
    return all_gather(value)[src]

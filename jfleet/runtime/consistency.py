"""Cross-process consistency: every process of a job must run the same program.

With several processes nothing in JAX checks that they agree: two processes given
different strategies build different meshes and hang in their first collective, and two
processes passing local batches of different shapes assemble different "global" batches
and drift apart silently. jfleet compares, through the coordination service's key-value
store (:mod:`jfleet.runtime.coordination`), cheaply and out of band:

- **at** ``fleet.init`` (:func:`check_init`): a fingerprint of each process's run — its
  :class:`~jfleet.strategy.DistributedStrategy` (every setting, hashed; the changed ones
  and the hybrid degrees kept readable), the mesh (axis names, shape, device ids), the
  process count and the jfleet, JAX, jaxlib, Flax and Optax versions;
- **on the first batch of each new shape** (:func:`check_batch`, called by
  :meth:`jfleet.placement.Placement.shard_batch`): the local batch's structure and each
  leaf's shape and dtype. A batch whose signature equals this process's previous one
  costs a local comparison only (no coordination traffic); already global arrays are not
  checked.

A disagreement raises :class:`InconsistentJobError` (:class:`InconsistentBatchError` for
batches), a ``ValueError`` naming each process's value for every field that differs and
the fix; at ``fleet.init`` every process raises it, for batches every process that sees it.
A batch change on one process only (its peers kept their shape, so they publish nothing
for that call) is named by that process from the peers' latest published signatures: at
once when a peer's watchdog heartbeat (:func:`batch_progress`) shows it went past the
call, else after the wait. Waits are bounded by ``$JFLEET_CONSISTENCY_TIMEOUT`` seconds
(default 60); a peer that published nothing at all by then raises
:class:`ConsistencyTimeoutError` naming it. Each process keeps only its last two batch
signatures in the store. In a single process every check returns at once.

Example:
  >>> from jfleet.runtime.consistency import describe_ranks
  >>> describe_ranks({0: "dp2·mp4", 1: "dp4·mp2", 2: "dp2·mp4"})
  'ranks 0, 2 dp2·mp4; rank 1 dp4·mp2'
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

import jax
import numpy as np

from jfleet.runtime import coordination as _coordination
from jfleet.runtime import watchdog
from jfleet.runtime.env import seconds
from jfleet.runtime.log import logger

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "TIMEOUT_ENV",
    "ConsistencyTimeoutError",
    "InconsistentBatchError",
    "InconsistentJobError",
    "batch_progress",
    "batch_signature",
    "check_batch",
    "check_init",
    "compare_batches",
    "compare_fingerprints",
    "describe_batch",
    "describe_ranks",
    "fingerprint",
    "timeout_s",
]

TIMEOUT_ENV = "JFLEET_CONSISTENCY_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
_VERSIONED = ("jax", "jaxlib", "flax", "optax")
_POLL_S = 0.5
#: The watchdog's heartbeat record of a rank: where a peer's :func:`batch_progress` is read.
PROGRESS_FIELD = "batch_progress"
_HYBRID_KEYS_END = "_degree"


class InconsistentJobError(ValueError):
    """The processes of one job disagree on what they run (strategy, mesh, versions).

    Example:
      >>> issubclass(InconsistentJobError, ValueError)
      True
    """


class InconsistentBatchError(InconsistentJobError):
    """The processes of one job pass local batches of different structure, shape or dtype.

    Example:
      >>> issubclass(InconsistentBatchError, InconsistentJobError)
      True
    """


class ConsistencyTimeoutError(TimeoutError):
    """A peer published nothing to compare within ``$JFLEET_CONSISTENCY_TIMEOUT`` seconds.

    Example:
      >>> issubclass(ConsistencyTimeoutError, TimeoutError)
      True
    """


def timeout_s() -> float:
    """Seconds to wait for the peers' fingerprints: ``$JFLEET_CONSISTENCY_TIMEOUT`` or 60.

    Raises:
      ValueError: the variable is not a positive number.

    Example:
      >>> timeout_s()
      60.0
    """
    return seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


# ----------------------------------------------------------------- messages


def _rank_list(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0-3, 6``."""
    runs: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {', '.join(runs)}"


def describe_ranks(values: Mapping[int, str]) -> str:
    """Each process's value, ranks with equal values grouped: ``rank 0 a; ranks 1-3 b``.

    Example:
      >>> describe_ranks({1: "int32[4, 4]", 0: "int32[4, 8]"})
      'rank 0 int32[4, 8]; rank 1 int32[4, 4]'
    """
    groups: dict[str, list[int]] = {}
    for rank in sorted(values):
        groups.setdefault(values[rank], []).append(rank)
    return "; ".join(f"{_rank_list(ranks)} {value}" for value, ranks in groups.items())


# -------------------------------------------------------------- fingerprints


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def _version(name: str) -> str:
    if name == "jfleet":
        return str(getattr(sys.modules.get("jfleet"), "__version__", "unknown"))
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        module = sys.modules.get(name)
        return str(getattr(module, "__version__", "unknown"))


def fingerprint(strategy: Any, mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """What must be equal on every process, as a small JSON-serialisable dict.

    Args:
      strategy: the run's ``DistributedStrategy`` (anything with ``to_dict()``).
      mesh: the run's mesh.

    Example:
      >>> import jax
      >>> from jfleet.training.strategy import DistributedStrategy
      >>> mesh = jax.make_mesh((8,), ("dp",))
      >>> fp = fingerprint(DistributedStrategy(), mesh)
      >>> fp["mesh shape"], fp["process count"], fp["strategy"]
      ([8], 1, {})
    """
    values = strategy.to_dict()
    defaults = _flatten(type(strategy)().to_dict())
    flat = _flatten(values)
    changed = {k: v for k, v in flat.items() if k not in defaults or defaults[k] != v}
    canonical = json.dumps(values, sort_keys=True, default=repr)
    hybrid = values.get("hybrid_configs", {})
    out: dict[str, Any] = {
        "process count": jax.process_count(),
        "jfleet version": _version("jfleet"),
    }
    out.update({f"{name} version": _version(name) for name in _VERSIONED})
    out.update(
        {
            "hybrid_configs": {
                k: v for k, v in hybrid.items() if k.endswith(_HYBRID_KEYS_END) or k == "order"
            },
            "strategy hash": hashlib.sha256(canonical.encode()).hexdigest()[:16],
            "strategy": json.loads(json.dumps(changed, default=repr)),
            "mesh axes": list(mesh.axis_names),
            "mesh shape": [int(mesh.shape[a]) for a in mesh.axis_names],
            "mesh devices": [int(d.id) for d in mesh.devices.flat],
        }
    )
    return out


def _degrees(hybrid: Mapping[str, Any], with_order: bool) -> str:
    parts = []
    for key, value in hybrid.items():
        if key.endswith(_HYBRID_KEYS_END) and value != 1:
            name = key[: -len(_HYBRID_KEYS_END)]
            parts.append(f"{name}(auto)" if value == -1 else f"{name}{value}")
    text = "·".join(parts) or "all degrees 1"
    if with_order:
        text += f" (order {'/'.join(map(str, hybrid.get('order', [])))})"
    return text


def _mesh_shape(fp: Mapping[str, Any]) -> str:
    pairs = [f"{a}{n}" for a, n in zip(fp["mesh axes"], fp["mesh shape"], strict=False) if n != 1]
    return "·".join(pairs) or f"{math.prod(fp['mesh shape'])} device"


_DEFAULT = "(default)"


def _plain(key: str) -> Callable[[Mapping[str, Any]], str]:
    return lambda fp: str(fp[key])


def _devices(ids: list[int]) -> str:
    return "[" + ", ".join(map(str, ids[:16])) + (", ...]" if len(ids) > 16 else "]")


def compare_fingerprints(prints: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """One line per field on which the processes' fingerprints differ (empty: they agree).

    Args:
      prints: each process's :func:`fingerprint`, by rank.

    Example:
      >>> a = {"process count": 2, "mesh axes": ["x"], "mesh shape": [8]}
      >>> compare_fingerprints({0: a, 1: {**a, "process count": 3}})
      ['process count differs: rank 0 2; rank 1 3']
    """
    ranks = sorted(prints)
    lines = []

    def field(key: str, show: Callable[[Mapping[str, Any]], str] | None = None) -> None:
        values = {json.dumps(prints[r].get(key), sort_keys=True) for r in ranks}
        if len(values) > 1:
            shown = {
                r: "(missing)" if prints[r].get(key) is None else (show or _plain(key))(prints[r])
                for r in ranks
            }
            lines.append(f"{key} differs: {describe_ranks(shown)}")

    field("process count")
    for name in ("jfleet", *_VERSIONED):
        field(f"{name} version")
    orders = {json.dumps((prints[r].get("hybrid_configs") or {}).get("order")) for r in ranks}
    field("hybrid_configs", lambda fp: _degrees(fp["hybrid_configs"], len(orders) > 1))
    if len({prints[r].get("strategy hash") for r in ranks}) > 1:
        settings = {r: prints[r].get("strategy") or {} for r in ranks}
        for path in sorted({p for s in settings.values() for p in s}):
            section, _, key = path.partition(".")
            if section == "hybrid_configs" and (key.endswith(_HYBRID_KEYS_END) or key == "order"):
                continue  # reported above, as degrees
            values = {r: settings[r].get(path, _DEFAULT) for r in ranks}
            if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
                shown = {r: v if v == _DEFAULT else repr(v) for r, v in values.items()}
                lines.append(f"strategy.{path} differs: {describe_ranks(shown)}")
    field("mesh axes", lambda fp: "(" + ", ".join(fp["mesh axes"]) + ")")
    field("mesh shape", _mesh_shape)
    field("mesh devices", lambda fp: _devices(fp["mesh devices"]))
    return lines


_INIT_FIX = (
    "Every process must run the same program: give every process the same "
    "DistributedStrategy and fleet.init arguments (build them from one shared config, "
    "not from per-rank values), install the same jfleet, JAX, Flax and Optax versions "
    "everywhere, and start the same number of processes."
)


@dataclasses.dataclass
class _State:
    """This process's consistency bookkeeping (reset by each multi-process ``fleet.init``)."""

    generation: int = 0
    calls: int = 0
    passed: int = 0
    last: Any = None
    published: list[int] = dataclasses.field(default_factory=list)


_state = _State()
_generation = 0


def _layout() -> tuple[int, int]:
    """(this process's rank, the process count)."""
    return jax.process_index(), jax.process_count()


def _gather(
    prefix: str,
    rank: int,
    count: int,
    timeout: float,
    gone: Callable[[int], bool] | None = None,
) -> tuple[dict, list[int]]:
    """Every peer's value under ``prefix/<peer>`` (shared deadline); and the ranks missing.

    ``gone(peer)``, checked every ``_POLL_S`` while waiting, stops the wait for a peer
    that will not publish (it is missing then).
    """
    deadline = time.monotonic() + timeout
    got: dict[int, Any] = {}
    missing = []
    for peer in range(count):
        if peer == rank:
            continue
        key = f"{prefix}/{peer}"
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                got[peer] = _coordination.wait_get(
                    key, min(remaining, _POLL_S) if gone else remaining
                )
                break
            except TimeoutError:
                if gone is not None and gone(peer):
                    break
        if peer in got:
            continue
        value = _coordination.try_get(key)
        if value is None:
            missing.append(peer)
        else:
            got[peer] = value
    return got, missing


def check_init(strategy: Any, mesh: jax.sharding.Mesh) -> None:
    """Compares this run's :func:`fingerprint` with every other process's (``fleet.init``).

    Each call is one numbered round (a job may call ``fleet.init`` more than once; every
    process must call it as often). In a single process it does nothing.

    Raises:
      InconsistentJobError: the fingerprints differ; raised on every process.
      ConsistencyTimeoutError: a peer did not reach this check within
        ``$JFLEET_CONSISTENCY_TIMEOUT`` seconds.

    Example:
      >>> import jax
      >>> from jfleet.training.strategy import DistributedStrategy
      >>> check_init(DistributedStrategy(), jax.make_mesh((8,), ("dp",)))  # one process
    """
    global _state, _generation
    rank, count = _layout()
    if count == 1:
        logger.debug("consistency: one process, nothing to compare at fleet.init")
        return
    if not _coordination.available():
        logger.warning(
            "consistency: %d processes but no coordination service (jax.distributed not "
            "initialised by jfleet?): the strategies and batches of the processes are not "
            "compared",
            count,
        )
        return
    timeout = timeout_s()
    _generation += 1
    _state = _State(generation=_generation)
    prefix = f"init/{_generation}"
    mine = fingerprint(strategy, mesh)
    _coordination.put(f"{prefix}/{rank}", mine)
    peers, missing = _gather(prefix, rank, count, timeout)
    if missing:
        raise ConsistencyTimeoutError(
            f"{_rank_list(missing)} did not reach fleet.init call #{_generation} (its "
            f"consistency check) within {timeout:g} s ({TIMEOUT_ENV}); this is rank {rank} of "
            f"{count}. Every process must call fleet.init the same number of times, right "
            f"after start; if {_rank_list(missing)} is only slow, raise {TIMEOUT_ENV}."
        )
    lines = compare_fingerprints({rank: mine, **peers})
    if lines:
        raise InconsistentJobError(
            f"the {count} processes of this job disagree at fleet.init (call #{_generation}; "
            f"this is rank {rank}):\n  " + "\n  ".join(lines) + f"\n{_INIT_FIX}"
        )
    logger.debug("consistency: %d processes agree at fleet.init #%d", count, _generation)


# ------------------------------------------------------------------- batches


def batch_signature(batch: Any) -> tuple | None:
    """A cheap, comparable signature of a local batch: structure, shapes and dtypes.

    Already global ``jax.Array`` leaves (sharded over several processes) count as a
    placeholder; a batch made of them only has no signature (None): there is nothing
    local to compare.

    Example:
      >>> import numpy as np
      >>> a = batch_signature({"x": np.zeros((4, 8), np.int32)})
      >>> a == batch_signature({"x": np.ones((4, 8), np.int32)})
      True
      >>> a == batch_signature({"x": np.zeros((4, 4), np.int32)})
      False
    """
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    parts = []
    local = False
    for x in leaves:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            parts.append(None)
            continue
        local = True
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None:
            array = np.asarray(x)
            shape, dtype = array.shape, array.dtype
        parts.append((tuple(shape), dtype))
    return (treedef, tuple(parts)) if local else None


def describe_batch(batch: Any) -> list[list[Any]]:
    """``[path, dtype, shape]`` per leaf (``"global"`` for global arrays), JSON-ready.

    Example:
      >>> import numpy as np
      >>> describe_batch({"x": np.zeros((4, 8), np.int32), "y": 1.0})
      [["['x']", 'int32', [4, 8]], ["['y']", 'float64', []]]
    """
    out: list[list[Any]] = []
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        name = jax.tree_util.keystr(path) or "batch"
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            out.append([name, "global", list(x.shape)])
            continue
        shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
        if shape is None or dtype is None:
            array = np.asarray(x)
            shape, dtype = array.shape, array.dtype
        out.append([name, np.dtype(dtype).name, [int(d) for d in shape]])
    return out


def _leaf(dtype: str, shape: list[int]) -> str:
    return f"{dtype}[{', '.join(map(str, shape))}]"


def _rows(leaves: list[list[Any]]) -> int | None:
    """The leading dimension of a batch's first local leaf with one."""
    return next((shape[0] for _, dtype, shape in leaves if dtype != "global" and shape), None)


def _whole(leaves: list[list[Any]]) -> str:
    shown = ", ".join(f"{p} {_leaf(d, s)}" for p, d, s in leaves[:8])
    return "{" + shown + (", ..." if len(leaves) > 8 else "") + "}"


_BATCH_FIX = (
    "Every process must pass a local batch of the same structure, shapes and dtypes at "
    "every step: each process's rows become one part of the global batch (process count x "
    "local rows). Pad the shorter batches (sequence length too), or drop the last, "
    "incomplete batch on every process (e.g. drop_last=True)."
)


def compare_batches(
    batches: Mapping[int, list[list[Any]] | None],
    *,
    count: int,
    notes: Mapping[int, str] | None = None,
) -> list[str]:
    """One line per difference between the processes' :func:`describe_batch` (empty: equal).

    Args:
      batches: each process's batch description by rank; None for a process known to
        have kept an earlier, different shape.
      count: the process count (for the global batch size).
      notes: text appended to a rank's value (where it came from).

    Example:
      >>> x4, x8 = [["['x']", "int32", [4, 4]]], [["['x']", "int32", [4, 8]]]
      >>> compare_batches({0: x8, 1: x4}, count=2)
      ["['x'] differs: rank 0 int32[4, 8]; rank 1 int32[4, 4]"]
    """
    notes = notes or {}
    ranks = sorted(batches)
    if len({json.dumps(batches[r]) for r in ranks}) == 1:
        return []
    known = {r: b for r, b in batches.items() if b is not None}
    lines = []
    paths = {r: [leaf[0] for leaf in b] for r, b in known.items()}
    if len({json.dumps(p) for p in paths.values()}) > 1:
        shown = {r: _whole(b) + notes.get(r, "") for r, b in known.items()}
        lines.append(f"the batch's structure differs: {describe_ranks(shown)}")
    else:
        for i, path in enumerate(next(iter(paths.values()), [])):
            leaves = {r: b[i] for r, b in known.items()}
            if len({json.dumps(leaf) for leaf in leaves.values()}) > 1:
                shown = {r: _leaf(*leaf[1:]) + notes.get(r, "") for r, leaf in leaves.items()}
                lines.append(f"{path} differs: {describe_ranks(shown)}")
        rows = {
            r: next((s[0] for _, d, s in b if d != "global" and s), None) for r, b in known.items()
        }
        if len(set(rows.values()) - {None}) > 1:
            shown = {r: f"{count} x {n} = {count * n}" for r, n in rows.items() if n is not None}
            lines.append(
                f"so the global batch size would be (processes x local rows): "
                f"{describe_ranks(shown)}"
            )
    for r in ranks:
        if batches[r] is None:
            lines.append(f"rank {r} kept its earlier batch shape{notes.get(r, '')}")
    return lines


def check_batch(batch: Any) -> None:
    """Compares this process's local batch with its peers' when its signature changes.

    Called by :meth:`jfleet.placement.Placement.shard_batch` with several processes.
    Unchanged signature (the common case): one local comparison, no coordination traffic.
    A new signature (the first batch included) is published under this process's
    ``shard_batch`` call number and compared with the peers' for the same call; a peer
    that published nothing for it within ``$JFLEET_CONSISTENCY_TIMEOUT`` seconds kept its
    earlier signature, which is compared instead.

    Raises:
      InconsistentBatchError: the processes' batches differ (named leaf by leaf).
      ConsistencyTimeoutError: a peer has published no batch at all within the timeout.

    Example:
      >>> import numpy as np
      >>> check_batch({"x": np.zeros((4, 8), np.int32)})  # one process: nothing to do
    """
    rank, count = _layout()
    if count == 1:
        return
    signature = batch_signature(batch)
    if signature is None:
        return
    state = _state
    call = state.calls
    state.calls += 1
    if signature == state.last:
        state.passed = state.calls
        return
    state.last = signature
    try:
        _compare_batch(batch, call, rank, count, state)
    except (InconsistentBatchError, ConsistencyTimeoutError):
        state.last = None  # check again next time: the job is still inconsistent
        raise
    state.passed = state.calls


def batch_progress() -> list[int]:
    """``[fleet.init round, shard_batch calls checked]`` of this process, for heartbeats.

    Published in the watchdog's heartbeat record (field ``batch_progress``), it lets a
    process whose batch changed shape learn at once that a peer went past the same call
    without a change (instead of waiting ``$JFLEET_CONSISTENCY_TIMEOUT``).

    Example:
      >>> batch_progress()
      [0, 0]
    """
    return [_state.generation, _state.passed]


watchdog.publish_field(PROGRESS_FIELD, batch_progress)


def _passed(peer: int, call: int, generation: int) -> bool:
    """Whether ``peer``'s heartbeat says it went past shard_batch call ``call``."""
    record = watchdog.peer_record(peer)
    progress = record.get(PROGRESS_FIELD) if record is not None else None
    return (
        isinstance(progress, list)
        and len(progress) == 2
        and progress[0] == generation
        and progress[1] > call
    )


def _compare_batch(batch: Any, call: int, rank: int, count: int, state: _State) -> None:
    timeout = timeout_s()
    mine = describe_batch(batch)
    prefix = f"batch/{state.generation}"
    _coordination.put(f"{prefix}/{call}/{rank}", mine)
    _coordination.put(f"{prefix}/latest/{rank}", {"call": call, "batch": mine})
    # Keep this process's last two numbered keys: every peer has read the older ones (it
    # published the previous call's key only after reading ours before it), so a job whose
    # shapes change every step keeps a bounded store.
    state.published.append(call)
    if len(state.published) > 2:
        _coordination.delete(f"{prefix}/{state.published.pop(0)}/{rank}")
    early: set[int] = set()

    def gone(peer: int) -> bool:
        if _passed(peer, call, state.generation):
            early.add(peer)
        return peer in early

    peers, missing = _gather(f"{prefix}/{call}", rank, count, timeout, gone)
    batches: dict[int, Any] = {rank: mine, **peers}
    notes: dict[int, str] = {}
    silent = []
    for peer in missing:
        latest = _coordination.try_get(f"{prefix}/latest/{peer}")
        if latest is None:
            silent.append(peer)
        elif latest["call"] < call:
            batches[peer] = latest["batch"]
            why = (
                f"it went past call #{call} without a new shape"
                if peer in early
                else f"it published no new shape for call #{call} within {timeout:g} s"
            )
            notes[peer] = f" (its batch since shard_batch call #{latest['call']}; {why})"
        else:
            batches[peer] = None
            notes[peer] = (
                f" at shard_batch call #{call} (it published a new shape at call "
                f"#{latest['call']}: {_whole(latest['batch'])})"
            )
    lines = compare_batches(batches, count=count, notes=notes)
    if lines:
        raise InconsistentBatchError(
            f"the {count} processes of this job pass different local batches (shard_batch "
            f"call #{call}, a new shape on this process, rank {rank}):\n  "
            + "\n  ".join(lines)
            + f"\n{_BATCH_FIX}"
        )
    if silent:
        raise ConsistencyTimeoutError(
            f"{_rank_list(silent)} published no batch within {timeout:g} s of this process's "
            f"shard_batch call #{call} ({TIMEOUT_ENV}); this is rank {rank} of {count}. It has "
            "not reached its first step (still loading data or building the model?), is "
            f"stuck, or died; if it is only slow, raise {TIMEOUT_ENV}."
        )

"""Static pipeline schedule tables: which op each stage runs at each tick (1F1B, VPP, ZB-H1).

A table is ``[T ticks x P devices]`` of ``(op, micro-batch, chunk)`` built in Python by
simulating the schedule: each device runs its next op as soon as the op's inputs exist
(an activation or cotangent made at tick ``t`` on a neighbour arrives at ``t + 1``, one
``ppermute``). :mod:`jfleet.parallel.pipeline_executor` runs any table in one ``lax.scan``.

Ops: ``F`` (a chunk's forward; on the model's last chunk also the head's loss and its
cotangent), ``B`` (the chunk's whole backward: input and weight gradient), ``BI`` (input
gradient only) and ``W`` (weight gradient only), ``IDLE`` and ``BUSY`` (the second tick of
a ``B``).

Tick-cost convention (Qi et al. 2023): ``F``, ``BI`` and ``W`` take one tick each and
``B = BI + W`` two, so every schedule does ``3 v M`` ticks of work per device; the bubble
is the idle share ``idle slots / (T x P)``. With ``v`` chunks per device each chunk op is a
``1 / v`` of a stage's work.

Schedules (``P`` devices, ``M`` micro-batches, ``v`` chunks per device; virtual stage
``k = c P + s`` is chunk ``c`` of device ``s``, so the last device's chunk wraps to device
0's next chunk):

* ``"1F1B"`` (``v = 1``): device ``s`` runs ``min(P - s - 1, M)`` forwards, then
  alternates forward and backward, then the remaining backwards. ``T = 3(M + P - 1)``,
  bubble ``(P - 1) / (M + P - 1)``.
* ``"VPP"`` (interleaved 1F1B, Megatron / Paddle order, ``v >= 2``, ``M`` a multiple of
  ``P``): device ``s``'s ``n``-th forward is micro-batch ``(n // Pv) P + n % P`` of chunk
  ``(n // P) % v`` (backward: chunk ``v - 1 - (n // P) % v``), with
  ``2(P - s - 1) + (v - 1) P`` warm-up forwards. ``T = 3(vM + P - 1)``, bubble
  ``(P - 1) / (vM + P - 1)``.
* ``"ZBH1"`` (zero-bubble H1, ``v = 1``): backward split into ``BI`` and ``W``; a device
  runs a ready ``BI`` first, else a forward while it holds fewer than ``P - s``
  micro-batches before their ``BI`` (1F1B's bound) and fewer than ``2P - s - 1`` before
  their ``W``, else a deferred ``W``. ``T = 3M + P - 1``: ``P - 1`` idle ticks per
  device, a third of 1F1B's ``3(P - 1)``.

Example:
  >>> stats = schedule_stats(schedule_table("VPP", 4, 8, 2))
  >>> stats["ticks"], stats["bubble_fraction"] == 3 / (2 * 8 + 3)
  (57, True)
  >>> schedule_stats(schedule_table("ZBH1", 4, 8))["bubble_ticks"]
  3
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

__all__ = ["BI", "BUSY", "IDLE", "TABLE_SCHEDULES", "B", "F", "ScheduleTable", "W"]
__all__ += ["check_table", "schedule_stats", "schedule_table", "slot_plan", "taken_branches"]

IDLE, F, B, BI, W, BUSY = range(6)
OP_NAMES = ("idle", "F", "B", "BI", "W", "busy")
_TICKS = {F: 1, B: 2, BI: 1, W: 1}
_WORK = {F: 1, B: 3, BI: 2, W: 3}  # chunk forwards each op runs (backward ops recompute)

#: The schedules :func:`schedule_table` builds.
TABLE_SCHEDULES = ("1F1B", "VPP", "ZBH1")

Op = tuple[int, int, int]  # (op, virtual stage k, micro-batch i)


@dataclasses.dataclass(frozen=True, eq=False)
class ScheduleTable:
    """A schedule as ``[T, P]`` integer arrays: ``op``, micro-batch ``mb`` and ``chunk``
    (the device's chunk, virtual stage ``chunk * P + device``); ``-1`` where idle."""

    schedule: str
    num_stages: int
    num_microbatches: int
    num_virtual: int
    op: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray

    @property
    def ticks(self) -> int:
        """``T``, the ticks of one step."""
        return self.op.shape[0]

    def rows(self) -> list[list[str]]:
        """The table as text, ``"F3.1"`` (op, micro-batch, chunk) per slot: for reading."""
        return [
            [
                OP_NAMES[o] if o in (IDLE, BUSY) else f"{OP_NAMES[o]}{i}.{c}"
                for o, i, c in zip(ops, mbs, cs, strict=True)
            ]
            for ops, mbs, cs in zip(self.op, self.mb, self.chunk, strict=True)
        ]


def _check_counts(schedule: Any, p: Any, m: Any, v: Any) -> None:
    if schedule not in TABLE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} has no table; use one of {list(TABLE_SCHEDULES)}.")
    for name, value in (("num_stages", p), ("num_microbatches", m), ("num_virtual", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1.")
    if schedule == "VPP" and (v < 2 or m % p):
        raise ValueError(
            f"schedule 'VPP' needs num_virtual >= 2 chunks per device (got {v}) and "
            f"num_microbatches a multiple of num_stages (got M={m}, P={p}); use '1F1B' for "
            "one chunk, or a micro-batch count in multiples of the pipeline degree."
        )
    if schedule != "VPP" and v != 1:
        raise ValueError(
            f"schedule {schedule!r} runs one chunk per device; got num_virtual={v}. Use "
            "'VPP' for interleaved (virtual) stages."
        )


@functools.lru_cache(maxsize=64)
def schedule_table(
    schedule: str, num_stages: int, num_microbatches: int, v: int = 1
) -> ScheduleTable:
    """The table of ``schedule`` for ``P`` devices, ``M`` micro-batches, ``v`` chunks each.

    Raises:
      ValueError: an unknown schedule, counts below 1, ``VPP`` with ``v < 2`` or ``M`` not
        a multiple of ``P``, another schedule with ``v > 1``.

    Example:
      >>> schedule_table("1F1B", 2, 2).rows()[:3]
      [['F0.0', 'idle'], ['F1.0', 'F0.0'], ['idle', 'B0.0']]
    """
    _check_counts(schedule, num_stages, num_microbatches, v)
    p, m = num_stages, num_microbatches
    if schedule == "ZBH1":
        placed = _simulate(p, p, m, policy=_zbh1_policy(p, m))
    else:
        placed = _simulate(p, p * v, m, orders=_orders(schedule, p, m, v))
    t_end = max(t + _TICKS[key[0]] for key, t in placed.items())
    op = np.full((t_end, p), IDLE, np.int32)
    mb = np.full((t_end, p), -1, np.int32)
    chunk = np.full((t_end, p), -1, np.int32)
    for (kind, k, i), t in placed.items():
        s = k % p
        op[t, s], mb[t, s], chunk[t, s] = kind, i, k // p
        if kind == B:
            op[t + 1, s] = BUSY
    table = ScheduleTable(schedule, p, m, v, op, mb, chunk)
    check_table(table)
    return table


def _deps(kind: int, k: int, i: int, stages: int) -> list[Op]:
    """The ops whose results ``(kind, k, i)`` reads (``stages``: virtual stages ``K``)."""
    if kind == F:
        return [(F, k - 1, i)] if k else []
    if kind in (B, BI):
        return [(F, k, i)] + ([(kind, k + 1, i)] if k < stages - 1 else [])
    return [(BI, k, i)]  # W


def _orders(schedule: str, p: int, m: int, v: int) -> list[list[Op]]:
    """Each device's ops in order, for 1F1B and VPP (Megatron's interleaved order)."""
    orders = []
    for s in range(p):
        n = v * m
        mbs = [(j // (p * v)) * p + j % p for j in range(n)]
        fwd = [(F, ((j // p) % v) * p + s, mbs[j]) for j in range(n)]
        bwd = [(B, (v - 1 - (j // p) % v) * p + s, mbs[j]) for j in range(n)]
        warm = min(2 * (p - s - 1) + (v - 1) * p if v > 1 else p - s - 1, n)
        order = fwd[:warm]
        for j in range(n - warm):
            order += [fwd[warm + j], bwd[j]]
        orders.append(order + bwd[n - warm :])
    return orders


def _zbh1_policy(p: int, m: int) -> Any:
    """ZB-H1's choice for device ``s``: a ready BI, else a bounded F, else a deferred W."""

    def choose(s: int, ready: Any, done: dict, t: int, n: list[int]) -> Op | None:
        n_f, n_bi, n_w = n
        if n_bi < n_f and ready((BI, s, n_bi)):
            return (BI, s, n_bi)
        if n_f < m and n_f - n_bi < p - s and n_f - n_w < 2 * p - s - 1 and ready((F, s, n_f)):
            return (F, s, n_f)
        if n_w < n_bi and done[(BI, s, n_w)] < t:
            return (W, s, n_w)
        return None

    return choose


def _simulate(p: int, stages: int, m: int, *, orders=None, policy=None) -> dict[Op, int]:
    """Start ticks of every op: each device starts its next op once its inputs exist."""
    finish: dict[Op, int] = {}
    start: dict[Op, int] = {}
    free, pos = [0] * p, [0] * p
    counts = [[0, 0, 0] for _ in range(p)]  # F, BI, W started (the ZB-H1 policy's state)
    total = sum(map(len, orders)) if orders else 3 * stages * m
    t = 0
    while len(start) < total:
        if t > 8 * total + 8 * p:
            raise RuntimeError(f"the schedule simulation did not finish ({len(start)}/{total})")
        for s in range(p):
            if free[s] > t:
                continue

            def ready(key: Op, t: int = t) -> bool:
                return all(finish.get(d, t) < t for d in _deps(*key, stages))

            key = None
            if orders is not None:
                if pos[s] < len(orders[s]) and ready(orders[s][pos[s]]):
                    key = orders[s][pos[s]]
                    pos[s] += 1
            else:
                key = policy(s, ready, finish, t, counts[s])
                if key is not None:
                    counts[s][(F, BI, W).index(key[0])] += 1
            if key is not None:
                start[key] = t
                finish[key] = t + _TICKS[key[0]] - 1
                free[s] = t + _TICKS[key[0]]
        t += 1
    return start


# ------------------------------------------------------------------ checks and stats
def _placed(table: ScheduleTable) -> dict[Op, int]:
    p = table.num_stages
    out: dict[Op, int] = {}
    for t, s in zip(*np.nonzero((table.op != IDLE) & (table.op != BUSY)), strict=True):
        key = (int(table.op[t, s]), int(table.chunk[t, s]) * p + int(s), int(table.mb[t, s]))
        if key in out:
            raise ValueError(f"the table runs {key} twice (ticks {out[key]} and {t}).")
        out[key] = int(t)
    return out


def check_table(table: ScheduleTable) -> None:
    """Checks that every op runs once, after the ops it reads, and B's second tick is BUSY.

    Raises:
      ValueError: the first violation found.
    """
    p, m = table.num_stages, table.num_microbatches
    stages = p * table.num_virtual
    placed = _placed(table)
    split = table.schedule == "ZBH1"
    kinds = (F, BI, W) if split else (F, B)
    want = {(kind, k, i) for kind in kinds for k in range(stages) for i in range(m)}
    if set(placed) != want:
        missing, extra = sorted(want - set(placed)), sorted(set(placed) - want)
        raise ValueError(f"the table's ops are wrong: missing {missing[:4]}, extra {extra[:4]}.")
    for key, t in placed.items():
        for dep in _deps(*key, stages):
            if placed[dep] + _TICKS[dep[0]] - 1 >= t:
                raise ValueError(f"{key} at tick {t} reads {dep}, which ends at tick "
                                 f"{placed[dep] + _TICKS[dep[0]] - 1}.")  # fmt: skip
        if key[0] == B and table.op[t + 1, key[1] % p] != BUSY:
            raise ValueError(f"{key} at tick {t} needs tick {t + 1} marked busy.")


def _intervals(table: ScheduleTable) -> dict[str, dict[tuple[int, int], tuple[int, int, int]]]:
    """Stashed values per kind: ``{(k, i): (device, first tick, last tick)}``.

    ``x``: a chunk's input (not the first chunk's: it is re-read from the batch), from its
    arrival to its last use (B or W); ``g``: the cotangent of a chunk's output, from its
    arrival (or the head's F on the last chunk) to its last use.
    """
    p, stages = table.num_stages, table.num_stages * table.num_virtual
    placed = _placed(table)
    last = {(k, i): t for (kind, k, i), t in placed.items() if kind in (B, W)}
    xs, gs = {}, {}
    for (kind, k, i), t in placed.items():
        if kind == F and k + 1 < stages:
            xs[(k + 1, i)] = ((k + 1) % p, t + 1, last[(k + 1, i)])
        if kind == F and k == stages - 1:
            gs[(k, i)] = (k % p, t, last[(k, i)])
        if kind in (B, BI) and k > 0:
            gs[(k - 1, i)] = ((k - 1) % p, t + 1, last[(k - 1, i)])
    return {"x": xs, "g": gs}


def _allocate(items: dict) -> tuple[dict, int]:
    """Slots for intervals, per device: a slot is reused once its last reader has run."""
    slots, ends, width = {}, {}, 0
    for key, (dev, first, end) in sorted(items.items(), key=lambda kv: kv[1][1]):
        free = [j for j, e in enumerate(ends.setdefault(dev, [])) if e < first]
        j = free[0] if free else len(ends[dev])
        if j == len(ends[dev]):
            ends[dev].append(end)
        ends[dev][j] = end
        slots[key] = j
        width = max(width, len(ends[dev]))
    return slots, width


def schedule_stats(table: ScheduleTable) -> dict[str, Any]:
    """Ticks, bubble, stash and collectives of one step of a table.

    Returns a dict with ``schedule``, ``num_stages``, ``num_microbatches``,
    ``num_virtual`` and

    * ``ticks``: ``T``;
    * ``idle_per_stage``: idle slots of each device; ``bubble_ticks``: their maximum;
    * ``bubble_fraction``: idle slots / all slots (unit-cost ticks, ``B`` = two);
    * ``stash_slots``: the most chunk inputs (``x``) and output cotangents (``g``) a
      device holds at once, ``{"x": n, "g": n}`` (bounded by ``P``, not ``M``);
    * ``collective_permutes``: ``ppermute`` executions per step, ``2T`` (one activation and
      one cotangent per tick, ring-wise), 0 when ``P == 1``;
    * ``recomputes``: stage forwards recomputed per chunk and micro-batch (``B``: 1;
      ``BI`` and ``W``: 1 each, so 2);
    * ``work_per_stage``: the schedule's ideal work on each device in chunk forwards,
      the head's loss and gradient on the last chunk's ``F`` not included: ``F`` 1,
      ``B`` 3 (recompute, input and weight gradient), ``BI`` 2 (recompute, input
      gradient) and ``W`` 3 (recompute, the cotangent chain through the chunk's layers
      that their weight gradients need, weight gradients; a chunk of one layer has no
      chain and runs 2). Per chunk and micro-batch 1F1B and VPP do 4, ZB-H1 6: it trades
      two thirds of 1F1B's bubble ticks for half again the work under recompute.

    Example:
      >>> schedule_stats(schedule_table("1F1B", 4, 8))["bubble_ticks"]
      9
    """
    idle = [int(np.sum(table.op[:, s] == IDLE)) for s in range(table.num_stages)]
    work = [
        int(sum(np.sum(table.op[:, s] == op) * u for op, u in _WORK.items()))
        for s in range(table.num_stages)
    ]
    stash = {name: _allocate(items)[1] for name, items in _intervals(table).items()}
    p = table.num_stages
    return {
        "schedule": table.schedule,
        "num_stages": p,
        "num_microbatches": table.num_microbatches,
        "num_virtual": table.num_virtual,
        "ticks": table.ticks,
        "idle_per_stage": idle,
        "bubble_ticks": max(idle),
        "bubble_fraction": sum(idle) / (table.ticks * p),
        "stash_slots": stash,
        "collective_permutes": 2 * table.ticks if p > 1 else 0,
        "recomputes": 2 if table.schedule == "ZBH1" else 1,
        "work_per_stage": work,
    }


# ------------------------------------------------------------------ executor plan
#: The executor's branches (:func:`slot_plan`'s ``branch``).
RUN_IDLE, RUN_F, RUN_F_LAST, RUN_B, RUN_BI, RUN_W = range(6)


def slot_plan(table: ScheduleTable) -> dict[str, Any]:
    """What each device does at each tick, as ``[T, P]`` int32 arrays, for the executor.

    ``branch`` (``RUN_*``), ``mb``, ``chunk``, ``first`` (1 on virtual stage 0: its input is
    the batch and its input gradient the result), ``x_slot`` / ``g_slot`` (the stash slots
    the op reads; F on the last chunk writes its head cotangent to ``g_slot``),
    ``recv_x`` / ``recv_g`` (where this tick's incoming activation / cotangent goes; the
    spare last slot when nothing arrives), and ``x_slots`` / ``g_slots`` (stash sizes,
    spare slot included).
    """
    p, stages = table.num_stages, table.num_stages * table.num_virtual
    items = _intervals(table)
    x_of, x_n = _allocate(items["x"])
    g_of, g_n = _allocate(items["g"])
    shape = table.op.shape
    plan = {n: np.zeros(shape, np.int32) for n in ("branch", "mb", "chunk", "first")}
    plan |= {n: np.full(shape, x_n, np.int32) for n in ("x_slot", "recv_x")}
    plan |= {n: np.full(shape, g_n, np.int32) for n in ("g_slot", "recv_g")}
    codes = {F: RUN_F, B: RUN_B, BI: RUN_BI, W: RUN_W}
    for (kind, k, i), t in _placed(table).items():
        s = k % p
        code = RUN_F_LAST if kind == F and k == stages - 1 else codes[kind]
        plan["branch"][t, s], plan["mb"][t, s], plan["chunk"][t, s] = code, i, k // p
        plan["first"][t, s] = int(k == 0)
        plan["x_slot"][t, s] = x_of.get((k, i), x_n)
        plan["g_slot"][t, s] = g_of.get((k, i), g_n)
    for name, of in (("x", x_of), ("g", g_of)):
        for (k, i), (dev, first, _) in items[name].items():
            if name == "x" or k < stages - 1:  # the last chunk's cotangent is made, not received
                plan[f"recv_{name}"][first, dev] = of[(k, i)]
    plan["x_slots"], plan["g_slots"] = x_n + 1, g_n + 1
    return plan


def taken_branches(table: ScheduleTable, stage: int) -> Any:
    """``taken(conditional)`` for :func:`jfleet.testing.hlo.executed_flops`: how often
    device ``stage`` takes each branch of the executor's ``lax.switch`` (``RUN_*`` order).

    Raises:
      ValueError: a conditional that is not the executor's six-way switch over ``T`` ticks.

    Example:
      >>> from types import SimpleNamespace as C
      >>> taken = taken_branches(schedule_table("1F1B", 2, 2), 1)
      >>> taken(C(name="c", weight=9, branch_flops=(0,) * 6))
      (5, 0, 2, 2, 0, 0)
    """
    counts = tuple(int(n) for n in np.bincount(slot_plan(table)["branch"][:, stage], minlength=6))

    def taken(c: Any) -> tuple[int, ...]:
        if len(c.branch_flops) != len(counts) or c.weight != table.ticks:
            raise ValueError(
                f"conditional {c.name!r} ({len(c.branch_flops)} branches, {c.weight} runs) is "
                f"not the executor's switch ({len(counts)} branches, {table.ticks} ticks)."
            )
        return counts

    return taken

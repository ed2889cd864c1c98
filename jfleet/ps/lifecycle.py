"""A sparse table's days and evictions: Paddle's ``set_date`` and ``shrink``.

``set_date(table, day)`` moves the table to ``day``. Advancing ``d`` days multiplies every
row's ``show`` and ``click`` by ``show_click_decay_rate ** d`` and adds ``d`` to the
``unseen_days`` of every present row (a push sets it back to 0). Paddle decays show / click
inside each ``shrink`` call and ages ``unseen_days`` in its daily cache save (mode 3); here
the day drives both, so calling ``shrink`` twice in a day does not decay twice.

``shrink(table, threshold)`` evicts, as Paddle's ``CtrCommonAccessor::Shrink``, every present
row whose score ``(show - click) * nonclk_coeff + click * click_coeff`` is below
``threshold`` (default the accessor's ``delete_threshold``) or whose ``unseen_days`` exceed
``delete_after_unseen_days``. An evicted row is created anew: fresh random weights, fresh
optimizer slots, zero statistics, not present. Both are whole-table, elementwise programs
on the sharded arrays (no collective but the count).

Example:
  >>> import numpy as np
  >>> from jfleet import fleet
  >>> from jfleet.ps.table import SparseTable
  >>> _ = fleet.init(is_collective=False, log_level="WARNING")
  >>> t = SparseTable(64, 2)
  >>> b = t.prepare(np.array([[1]]), labels=[0.0])
  >>> t.state = t.push(t.state, b.rows, np.zeros((1, 2)), b.show, b.click)
  >>> set_date(t, "20250101"), set_date(t, "20250103")
  (0, 2)
  >>> round(float(t.state.show.sum()), 4), shrink(t, threshold=0.5)  # 0.1*0.98**2 < 0.5
  (0.9604, 1)
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jfleet.ps.table import SparseTable, TableState
from jfleet.runtime.log import logger

__all__ = ["day_number", "set_date", "shrink"]


def day_number(day: Any) -> int:
    """A day as an int: an int as is, or a ``"YYYYMMDD"`` string (Paddle's ``day_id``) as
    its proleptic Gregorian ordinal.

    Example:
      >>> day_number("20250102") - day_number("20241231")
      2
    """
    if isinstance(day, bool):
        raise TypeError(f"day={day!r}: expected an int or a 'YYYYMMDD' string.")
    if isinstance(day, int):
        return day
    if isinstance(day, str):
        try:
            return datetime.datetime.strptime(day.strip(), "%Y%m%d").date().toordinal()
        except ValueError:
            pass
    raise ValueError(
        f"day={day!r}: expected an int (a day number) or a date string 'YYYYMMDD', e.g. '20250101'."
    )


def _age(s: TableState, factor: jax.Array, days: jax.Array) -> TableState:
    unseen = jnp.where(s.present, s.unseen_days + days, s.unseen_days)
    return s._replace(show=s.show * factor, click=s.click * factor, unseen_days=unseen)


def _evict(
    acc: Any, fresh_rows: Any, s: TableState, key: jax.Array, threshold: jax.Array
) -> tuple[TableState, jax.Array]:
    score = acc.score(s.show, s.click)
    gone = s.present & ((score < threshold) | (s.unseen_days > acc.delete_after_unseen_days))
    fresh = fresh_rows(key)

    def pick(a: jax.Array, f: jax.Array) -> jax.Array:
        return jnp.where(gone.reshape(gone.shape + (1,) * (a.ndim - 1)), f, a)

    return jax.tree.map(pick, s, fresh), jnp.sum(gone)


def set_date(table: SparseTable, day: Any) -> int:
    """Moves ``table`` to ``day``, decaying and ageing its rows by the days that passed.

    The first call only sets the day. Returns the days advanced.

    Raises:
      ValueError: ``day`` before the table's current day; an unreadable day.
    """
    new = day_number(day)
    old, table.day = table.day, new
    if old is None:
        logger.info("sparse table %d: day set to %r", table.table_id, day)
        return 0
    if new < old:
        table.day = old
        raise ValueError(
            f"set_date(table_id={table.table_id}, day={day!r}): that is {old - new} day(s) "
            "before the table's current day; days only move forward."
        )
    days = new - old
    if days:
        factor = jnp.float32(table.accessor.show_click_decay_rate**days)
        build = lambda: jax.jit(_age, donate_argnums=0, out_shardings=table.sharding)  # noqa: E731
        table.state = table.program("age", build)(table.state, factor, jnp.float32(days))
        logger.info("sparse table %d: %d day(s) passed, statistics decayed", table.table_id, days)
    return days


def shrink(table: SparseTable, threshold: float | None = None) -> int:
    """Evicts ``table``'s rows by Paddle's rule (module docstring); returns how many.

    Raises:
      TypeError: ``threshold`` not a number.
    """
    acc = table.accessor
    if threshold is None:
        threshold = acc.delete_threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"shrink(threshold={threshold!r}): expected a number or None.")
    table.evictions += 1
    key = jax.random.fold_in(jax.random.key(table.seed), table.evictions)
    evict = functools.partial(_evict, acc, table.fresh_rows)
    build = lambda: jax.jit(  # noqa: E731
        evict, donate_argnums=0, out_shardings=(table.sharding, None)
    )
    table.state, count = table.program("shrink", build)(table.state, key, jnp.float32(threshold))
    count = int(count)
    logger.info("sparse table %d: shrink evicted %d row(s)", table.table_id, count)
    return count

"""The sparse tables of this process, by ``table_id`` (what ``fleet.save_one_table(0, ...)`` means).

A :class:`~jfleet.ps.table.SparseTable` registers itself when built; a new table with a
taken id replaces the old one (logged: a notebook re-running a cell).

Example:
  >>> from jfleet.ps import registry
  >>> registry.table_ids()
  []
"""

from __future__ import annotations

from typing import Any

from jfleet.runtime.log import logger

__all__ = ["clear", "get", "next_id", "register", "table_ids", "tables"]

_tables: dict[int, Any] = {}


def register(table: Any) -> None:
    """Makes ``table`` the table of id ``table.table_id``."""
    old = _tables.get(table.table_id)
    if old is not None and old is not table:
        logger.warning("sparse table %d is replaced by a new table: %r", table.table_id, table)
    _tables[table.table_id] = table


def next_id() -> int:
    """The smallest table id not in use."""
    return next(i for i in range(len(_tables) + 1) if i not in _tables)


def get(table_id: int) -> Any:
    """The table of id ``table_id``.

    Raises:
      ValueError: no such table (the message lists the ids there are).
    """
    if isinstance(table_id, bool) or not isinstance(table_id, int):
        raise TypeError(f"table_id={table_id!r} ({type(table_id).__name__}) must be an int.")
    if table_id not in _tables:
        raise ValueError(
            f"table_id={table_id}: no sparse table has this id; the tables are "
            f"{sorted(_tables) or 'none'} (build one with jfleet.ps.SparseTable(..., "
            f"table_id={table_id}))."
        )
    return _tables[table_id]


def table_ids() -> list[int]:
    """The ids of the tables, sorted."""
    return sorted(_tables)


def tables() -> list[Any]:
    """The tables, by id."""
    return [_tables[i] for i in table_ids()]


def clear() -> None:
    """Forgets every table (``fleet`` resets between runs)."""
    _tables.clear()

"""Saving and loading sparse tables: Paddle's ``save_one_table`` / ``load_one_table`` modes,
and the cache (``save_cache_table`` / ``save_cache_model``).

A saved table is a directory ``<path>/<table_id>/``: ``meta.json`` (row count, dim, accessor,
mode, day, process count) and one ``part-<process>.npz`` per process holding the selected
rows of the shards that process owns (plain NumPy: row numbers, weights, optimizer slots,
statistics). Which rows, by mode (Paddle's ``CtrCommonAccessor::Save``):

* 0 (all): every present row;
* 1 (delta): rows with score >= ``base_threshold``, ``delta_score`` >= ``delta_threshold``
  and ``unseen_days`` <= ``delta_keep_days`` (the rows that changed enough since they were
  last saved); their ``delta_score`` is reset to 0 afterwards;
* 2 (base): rows with score >= ``base_threshold`` and ``unseen_days`` <= ``delta_keep_days``;
  their ``delta_score`` is reset to 0 afterwards.

Loading mode 0 or 2 replaces the table by the saved rows (other rows empty); mode 1 writes
the saved rows over the current table (a delta on top of a base). Rows are hash buckets, so
a table loads only into a table of the same ``num_rows``, ``dim`` and SGD rule (any mesh).

Example:
  >>> import tempfile, numpy as np
  >>> from jfleet import fleet
  >>> from jfleet.ps.table import SparseTable
  >>> _ = fleet.init(is_collective=False, log_level="WARNING")
  >>> t = SparseTable(64, 2)
  >>> b = t.prepare(np.array([[1, 2]]), labels=[1.0])
  >>> t.state = t.push(t.state, b.rows, np.ones((2, 2)), b.show, b.click)
  >>> path = tempfile.mkdtemp()
  >>> save_table(t, path, 0), load_table(SparseTable(64, 2, table_id=t.table_id), path, 0)
  (2, 2)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh import collective
from jfleet.ps.accessor import CtrAccessor
from jfleet.ps.table import STATS, SparseTable, TableState
from jfleet.ps.table_files import TableFileError, read_meta, read_parts
from jfleet.runtime.log import logger

__all__ = ["MODES", "load_table", "save_cache", "save_cache_table", "save_table"]

#: Paddle's save / load modes offered.
MODES = {0: "all", 1: "delta", 2: "base"}
_CACHE = "cache"


def _check_mode(what: str, mode: Any) -> int:
    if isinstance(mode, bool) or mode not in MODES:
        extra = (
            " (Paddle's mode 3, the daily save that ages rows, is set_date's job here; "
            "the cache is save_cache_model)"
            if mode == 3
            else ""
        )
        raise ValueError(f"{what}(mode={mode!r}): expected 0 (all), 1 (delta) or 2 (base){extra}.")
    return int(mode)


def _fields(state: TableState) -> dict[str, jax.Array]:
    out = {"emb": state.emb, **{f"slot.{k}": v for k, v in state.slots.items()}}
    out.update({name: getattr(state, name) for name in STATS})
    return out


def _from_fields(fields: dict[str, Any]) -> TableState:
    slots = {k[len("slot.") :]: v for k, v in fields.items() if k.startswith("slot.")}
    return TableState(emb=fields["emb"], slots=slots, **{n: fields[n] for n in STATS})


def _eligible(acc: CtrAccessor, s: TableState) -> jax.Array:
    """Rows a base save (and the cache) may take."""
    score = acc.score(s.show, s.click)
    return s.present & (score >= acc.base_threshold) & (s.unseen_days <= acc.delta_keep_days)


def _select(acc: CtrAccessor, mode: int | str, s: TableState, min_show: jax.Array) -> jax.Array:
    if mode == 0:
        return s.present
    keep = _eligible(acc, s)
    if mode == 1:
        keep = keep & (s.delta_score >= acc.delta_threshold)
    if mode == _CACHE:
        keep = keep & (s.show > min_show)
    return keep


def _mask(table: SparseTable, mode: int | str) -> jax.Array:
    select = functools.partial(_select, table.accessor, mode)
    build = lambda: jax.jit(select, out_shardings=table.sharding)  # noqa: E731
    threshold = -np.inf if table.cache_threshold is None else table.cache_threshold
    return table.program(f"mask-{mode}", build)(table.state, jnp.float32(threshold))


def _reset_delta(s: TableState, mask: jax.Array) -> TableState:
    return s._replace(delta_score=jnp.where(mask, 0.0, s.delta_score))


def _local_rows(mask: jax.Array, fields: dict[str, jax.Array]) -> dict[str, np.ndarray]:
    """The masked rows of the shards this process holds, with their global row numbers."""
    by_device = {name: {s.device: s for s in a.addressable_shards} for name, a in fields.items()}
    parts: dict[str, list[np.ndarray]] = {"rows": [], **{name: [] for name in fields}}
    for shard in mask.addressable_shards:
        keep = np.asarray(shard.data)
        start = shard.index[0].start or 0
        parts["rows"].append(np.nonzero(keep)[0].astype(np.int32) + start)
        for name in fields:
            parts[name].append(np.asarray(by_device[name][shard.device].data)[keep])
    return {name: np.concatenate(p) for name, p in parts.items()}


def _write(table: SparseTable, path: Any, mode: int | str) -> int:
    out = Path(path) / str(table.table_id)
    out.mkdir(parents=True, exist_ok=True)
    mask = _mask(table, mode)
    local = _local_rows(mask, _fields(table.state))
    np.savez(out / f"part-{jax.process_index():05d}.npz", **local)
    count = int(jnp.sum(mask))
    if jax.process_index() == 0:
        meta = {
            "table_id": table.table_id,
            "num_rows": table.num_rows,
            "dim": table.dim,
            "accessor": table.accessor.to_dict(),
            "mode": mode,
            "day": table.day,
            "rows_saved": count,
            "processes": jax.process_count(),
        }
        (out / "meta.json").write_text(json.dumps(meta, indent=1))
    collective.barrier()
    if mode in (1, 2):  # Paddle: the saved rows start a new delta
        build = lambda: jax.jit(_reset_delta, donate_argnums=0, out_shardings=table.sharding)  # noqa: E731
        table.state = table.program("reset-delta", build)(table.state, mask)
    logger.info(
        "sparse table %d: saved %d row(s) (mode %s) to %s", table.table_id, count, mode, out
    )
    return count


def save_table(table: SparseTable, path: str | Path, mode: int = 0) -> int:
    """Saves ``table``'s rows chosen by ``mode`` under ``path/<table_id>``; returns how many.

    Raises:
      ValueError: a mode other than 0, 1, 2.
    """
    return _write(table, path, _check_mode("save_one_table", mode))


def load_table(table: SparseTable, path: str | Path, mode: int = 0) -> int:
    """Loads ``path/<table_id>`` (:func:`save_table` output) into ``table``; returns rows read.

    Raises:
      FileNotFoundError: nothing saved there.
      ValueError: a mode other than 0, 1, 2; a saved table of another ``num_rows``, ``dim``
        or SGD rule; a damaged or inconsistent file (:class:`~jfleet.ps.table_files.TableFileError`,
        naming the file and the field).
    """
    mode = _check_mode("load_one_table", mode)
    src = Path(path) / str(table.table_id)
    if not (src / "meta.json").exists():
        raise FileNotFoundError(
            f"load_one_table(table_id={table.table_id}, path={str(path)!r}): no saved table at "
            f"{src} (expected {src / 'meta.json'}); save one with fleet.save_one_table."
        )
    meta = read_meta(src / "meta.json")
    try:
        saved = CtrAccessor.from_dict(meta["accessor"]).embed_sgd_rule.name
    except (TypeError, KeyError, ValueError) as error:
        raise TableFileError(
            f"{src / 'meta.json'}: accessor is not a saved CtrAccessor ({error!r}); save the "
            "table again with fleet.save_one_table, or load another copy."
        ) from None
    here = (table.num_rows, table.dim, table.accessor.embed_sgd_rule.name)
    if (meta["num_rows"], meta["dim"], saved) != here:
        raise ValueError(
            f"the table saved at {src} has num_rows={meta['num_rows']}, dim={meta['dim']}, "
            f"rule={saved!r}; table {table.table_id} has num_rows={here[0]}, dim={here[1]}, "
            f"rule={here[2]!r}. Rows are hash buckets: build the table with the saved settings."
        )
    if meta["table_id"] != table.table_id:
        raise TableFileError(
            f"{src / 'meta.json'}: table_id={meta['table_id']} but it lies in the directory of "
            f"table {table.table_id}; load the directory of the table it was saved from."
        )
    spec = {k: (v.shape[1:], np.dtype(v.dtype)) for k, v in _fields(table.state).items()}
    rows, data = read_parts(src, meta, spec)
    base = table.state if mode == 1 else table.fresh_state()
    table.state = table.set_rows(base, rows, _from_fields(data))
    if mode != 1 and meta.get("day") is not None:
        table.day = meta["day"]
    logger.info(
        "sparse table %d: loaded %d row(s) (mode %d) from %s", table.table_id, rows.size, mode, src
    )
    return int(rows.size)


def _eligible_shows(acc: CtrAccessor, s: TableState) -> jax.Array:
    """Every row's show count, -1 where the cache may not take the row, largest first."""
    return jnp.sort(jnp.where(_eligible(acc, s), s.show, -1.0))[::-1]


def save_cache_table(
    table: SparseTable, pass_id: int = 0, mem_cache_key_threshold: int = 4_000_000_000
) -> int:
    """Chooses the rows to cache: the hottest (by show) of those a base save would take, at
    most ``mem_cache_key_threshold``; returns how many (Paddle's feasign count).

    Sets ``table.cache_threshold`` (the show count a cached row must exceed), which
    :func:`save_cache` uses. ``pass_id`` is recorded on the table (``table.cache_pass``).
    """
    if isinstance(mem_cache_key_threshold, bool) or not isinstance(mem_cache_key_threshold, int):
        raise TypeError(
            f"mem_cache_key_threshold={mem_cache_key_threshold!r}: expected an int (rows)."
        )
    if mem_cache_key_threshold < 0:
        raise ValueError(f"mem_cache_key_threshold={mem_cache_key_threshold}: expected >= 0.")

    sort = functools.partial(_eligible_shows, table.accessor)
    build = lambda: jax.jit(sort, out_shardings=NamedSharding(table.mesh, P()))  # noqa: E731
    shows = np.asarray(table.program("eligible-shows", build)(table.state))
    k = mem_cache_key_threshold
    t = float(max(shows[k], -1.0)) if k < shows.size else -1.0
    count = int(np.sum(shows > t))
    table.cache_threshold, table.cache_pass = t, pass_id
    logger.info(
        "sparse table %d: pass %s caches %d row(s) (show > %g)",
        table.table_id,
        pass_id,
        count,
        t,
    )
    return count


def save_cache(table: SparseTable, dirname: str | Path) -> int:
    """Saves the rows :func:`save_cache_table` chose (all base-eligible rows if it was not
    called) under ``dirname/<table_id>``; returns how many. :func:`load_table` mode 0 reads it.
    """
    if table.cache_threshold is None:
        logger.info(
            "sparse table %d: save_cache_table was not called; caching every row a base save "
            "would take",
            table.table_id,
        )
    return _write(table, dirname, _CACHE)

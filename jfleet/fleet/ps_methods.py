"""Paddle's parameter-server methods of ``fleet``, as a Fleet mixin, over SPMD sparse tables.

``fleet.init(is_collective=False)`` starts parameter-server mode
(:mod:`jfleet.ps.role_maker`): one SPMD job in which every process holds a shard of every
:class:`~jfleet.ps.table.SparseTable` and trains, so each is both a worker and a server.
What Paddle's calls mean here:

* ``init_server(dirname=None)``: with a directory, loads every table from it
  (:func:`jfleet.ps.storage.load_table`, ``mode`` keyword, default 0); the tables already
  live on the devices, so without one there is nothing to start.
* ``run_server()``: returns at once (logged): serving is the collective lookups inside each
  training step. The script must then run its worker part on the same process.
* ``init_worker()``: marks this process's training started (there is no communicator).
* ``stop_worker()``: waits until every process reaches it (the end of training).
* ``save_one_table`` / ``load_one_table`` (modes 0 all, 1 delta, 2 base),
  ``save_cache_table`` / ``save_cache_model``, ``set_date``, ``shrink``: per table id, see
  :mod:`jfleet.ps.storage` and :mod:`jfleet.ps.lifecycle`.

Example:
  >>> import tempfile, numpy as np
  >>> from jfleet import fleet
  >>> from jfleet.ps import SparseTable
  >>> _ = fleet.init(is_collective=False, log_level="WARNING")
  >>> fleet.is_server(), fleet.is_worker(), fleet.server_num(), fleet.server_index()
  (True, True, 1, 0)
  >>> t = SparseTable(64, 2, table_id=0)
  >>> fleet.set_date(0, "20250101")
  >>> fleet.save_one_table(0, tempfile.mkdtemp(), 0)  # nothing pushed yet
  0
"""

from __future__ import annotations

import atexit
from pathlib import Path
from typing import Any

import jax

from jfleet.mesh import collective
from jfleet.mesh import context as _context
from jfleet.ps import lifecycle, registry, storage
from jfleet.runtime.log import logger

__all__ = ["PSMethods"]


class PSMethods:
    """Paddle's parameter-server calls, mixed into :class:`~jfleet.fleet.fleet_base.Fleet`."""

    _ps_worker_started = False
    _ps_exit_check = False

    def _ps_reset(self) -> None:
        """Forgets the tables and the worker state (``fleet``'s reset)."""
        registry.clear()
        self._ps_worker_started = False

    def _ps_started(self, strategy: Any) -> None:
        """Logs what parameter-server mode means here (``fleet.init(is_collective=False)``)."""
        logger.info(
            "parameter-server mode: %d process(es), each a worker and a server holding a shard "
            "of every sparse table; training is synchronous (one SPMD step), so a_sync=%s and "
            "a_sync_configs are kept as data",
            jax.process_count(),
            strategy.a_sync,
        )

    def _ps_run(self, what: str) -> Any:
        return _context.require(f"fleet.{what}()")

    # ---------------------------------------------------------------- roles
    def server_index(self) -> int:
        """This process's index among the table-shard hosts (its process index).

        Raises:
          ValueError: collective mode (no servers there).

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.server_index()
          0
        """
        role_maker = self._ps_run("server_index").role_maker
        if role_maker.is_collective:
            raise ValueError(
                "fleet.server_index(): collective mode has no parameter servers; start "
                "parameter-server mode with fleet.init(is_collective=False)."
            )
        return role_maker.server_index()

    def server_endpoints(self, to_string: bool = False) -> list[str] | str:
        """The table-shard hosts' endpoints (see :mod:`jfleet.ps.role_maker`); ``[]`` in
        collective mode.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> len(fleet.server_endpoints())
          0
        """
        endpoints = list(self._ps_run("server_endpoints").role_maker._get_pserver_endpoints())
        return ",".join(endpoints) if to_string else endpoints

    # ------------------------------------------------------------ lifecycle
    def init_server(self, *args: Any, **kwargs: Any) -> None:
        """Loads every table from ``dirname`` (first argument) if given; else nothing to do.

        Keywords: ``mode`` (0 all, 1 delta, 2 base); Paddle's ``var_names`` is ignored (logged).

        Raises:
          ValueError: a directory but no table built yet.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.init_server()  # no directory: the tables are already on the devices
        """
        self._ps_run("init_server")
        dirname = args[0] if args else kwargs.pop("dirname", None)
        mode = kwargs.pop("mode", 0)
        if args[1:] or kwargs:
            logger.info("fleet.init_server ignores %s", [*args[1:], *sorted(kwargs)])
        if dirname is None:
            logger.info("fleet.init_server: the sparse tables live on the devices already")
            return
        if not registry.table_ids():
            raise ValueError(
                f"fleet.init_server({str(dirname)!r}): no sparse table is built yet; build the "
                "tables (jfleet.ps.SparseTable) before loading them."
            )
        for table in registry.tables():
            storage.load_table(table, Path(dirname), mode)

    def run_server(self) -> None:
        """Returns at once: the tables are served by the collectives inside each step (logged).

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.run_server()  # returns at once: serving happens inside the steps
        """
        self._ps_run("run_server")
        logger.info(
            "fleet.run_server: nothing to run; every process holds a shard of every sparse "
            "table and serves it inside the training step. Run the worker part next."
        )
        if not self._ps_exit_check:
            type(self)._ps_exit_check = True
            atexit.register(self._ps_check_worker_ran)

    def _ps_check_worker_ran(self) -> None:
        if _context.current() is not None and not self._ps_worker_started:
            logger.warning(
                "fleet.run_server was called but fleet.init_worker never was: under jfleet "
                "every process is also a worker; write `if fleet.is_worker():` (not `elif`) "
                "after the server part so that this process trains."
            )

    def init_worker(self, scopes: Any = None) -> None:
        """Marks this process's training started (no communicator to start; logged).

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.init_worker()
        """
        self._ps_run("init_worker")
        if scopes is not None:
            logger.info("fleet.init_worker ignores scopes (no static scopes under JAX)")
        self._ps_worker_started = True
        logger.info("fleet.init_worker: training on process %d", jax.process_index())

    def stop_worker(self) -> None:
        """Blocks until every process has finished training (a barrier).

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.init_worker()
          >>> fleet.stop_worker()  # waits for every process
        """
        self._ps_run("stop_worker")
        collective.barrier()
        logger.info("fleet.stop_worker: every process has stopped training")

    # --------------------------------------------------------------- tables
    def save_one_table(self, table_id: int, path: str, mode: int) -> int:
        """Saves table ``table_id`` under ``path/<table_id>`` (0 all, 1 delta, 2 base); returns
        the rows saved.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.save_one_table(0, tempfile.mkdtemp(), 0)  # rows saved: none pushed yet
          0
        """
        self._ps_run("save_one_table")
        return storage.save_table(registry.get(table_id), path, mode)

    def load_one_table(self, table_id: int, path: str, mode: int) -> int:
        """Loads table ``table_id`` from ``path/<table_id>``; returns the rows read.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> path = tempfile.mkdtemp()
          >>> fleet.save_one_table(0, path, 0)
          0
          >>> fleet.load_one_table(0, path, 0)
          0
        """
        self._ps_run("load_one_table")
        return storage.load_table(registry.get(table_id), path, mode)

    def save_cache_table(
        self, table_id: int, pass_id: int, mem_cache_key_threshold: int = 4000000000
    ) -> int:
        """Chooses table ``table_id``'s hottest rows to cache; returns how many.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.save_cache_table(0, 0)
          0
        """
        self._ps_run("save_cache_table")
        table = registry.get(table_id)
        return storage.save_cache_table(table, pass_id, mem_cache_key_threshold)

    def save_cache_model(self, dirname: str, **configs: Any) -> int:
        """Saves the cache rows of table ``configs["table_id"]`` (default 0) under ``dirname``;
        returns how many. Paddle's ``mode`` and other keys are ignored (logged).

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.save_cache_model(tempfile.mkdtemp(), table_id=0)
          0
        """
        self._ps_run("save_cache_model")
        table = registry.get(configs.pop("table_id", 0))
        if configs:
            logger.info("fleet.save_cache_model ignores %s", sorted(configs))
        return storage.save_cache(table, dirname)

    def check_save_pre_patch_done(self) -> bool:
        """Whether the tables' pre-patch save has finished: always True here, since every
        save writes its files before it returns (Paddle's PS saves in the background).

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.check_save_pre_patch_done()
          True
        """
        self._ps_run("check_save_pre_patch_done")
        return True

    def set_date(self, table_id: int, day_id: int | str) -> None:
        """Moves table ``table_id`` to day ``day_id`` (``"YYYYMMDD"`` or an int), decaying it.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.set_date(0, "20250101")
        """
        self._ps_run("set_date")
        lifecycle.set_date(registry.get(table_id), day_id)

    def shrink(self, threshold: float | None = None) -> dict[int, int]:
        """Evicts low-score and long-unseen rows of every table; returns ``{table_id: rows}``.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.ps import SparseTable
          >>> _ = fleet.init(is_collective=False, log_level="WARNING")
          >>> table = SparseTable(64, 2, table_id=0)
          >>> fleet.shrink()
          {0: 0}
        """
        self._ps_run("shrink")
        return {t.table_id: lifecycle.shrink(t, threshold) for t in registry.tables()}

"""A sparse embedding table whose rows are sharded over every device of the mesh.

The SPMD form of a parameter-server sparse table: each device (of every process) holds
``num_rows / devices`` contiguous rows, laid out with ``NamedSharding(mesh, P(all axes))``.
A step works on the batch's unique rows only (:func:`jfleet.ps.hashing.prepare`, on the
host, gives them):

* :meth:`SparseTable.pull` — each device gathers the requested rows it owns (zeros for the
  others) and one ``psum`` of ``[rows, dim]`` over the mesh completes the lookup;
* :meth:`SparseTable.push` — each device updates the requested rows it owns, in place (the
  accessor's statistics and sparse SGD rule, :mod:`jfleet.ps.accessor`); no collective.

Both are ``jax.shard_map`` kernels, usable inside the user's ``jax.jit`` step with the
table state donated, so compiled temporary memory and collective bytes scale with the
batch, never the table. Rows given to ``push`` must be unique (``prepare`` makes them so);
``-1`` rows are padding.

Example:
  >>> import jax, numpy as np
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=False, log_level="WARNING")
  >>> table = SparseTable(1024, 4)
  >>> b = table.prepare(np.array([[3, 5]], np.int64), labels=[1.0])
  >>> pulled = table.pull(table.state, b.rows)
  >>> table.state = table.push(table.state, b.rows, np.ones_like(pulled), b.show, b.click)
  >>> float(table.state.show.sum()), float(table.state.click.sum())
  (2.0, 2.0)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh import context as _context
from jfleet.mesh.layer_mesh import layer_mesh
from jfleet.ps import registry
from jfleet.ps.accessor import CtrAccessor
from jfleet.ps.hashing import SparseBatch, prepare

__all__ = ["STATS", "SparseTable", "TableState"]

#: The per-row statistics of a table state, besides the weights and optimizer slots.
STATS = ("show", "click", "delta_score", "unseen_days", "present")


class TableState(NamedTuple):
    """The arrays of a sparse table, every one sharded by rows.

    Attributes:
      emb: ``[num_rows, dim]`` float32 weights.
      slots: the sparse SGD rule's per-row state (``{}`` for naive).
      show / click: decayed show and click counts (float32 ``[num_rows]``).
      delta_score: score gained since the row was last saved in a base / delta save.
      unseen_days: days since the row was last pushed.
      present: bool, the row was pushed since it was created or evicted.
    """

    emb: jax.Array
    slots: dict[str, jax.Array]
    show: jax.Array
    click: jax.Array
    delta_score: jax.Array
    unseen_days: jax.Array
    present: jax.Array


def _table_mesh(mesh: Mesh | None) -> Mesh:
    if mesh is None and _context.current() is None:
        raise RuntimeError(
            "a SparseTable lives on the fleet's mesh: call fleet.init(is_collective=False) "
            "first (or pass mesh=...)."
        )
    return layer_mesh(mesh)


class SparseTable:
    """A hashed sparse embedding table, rows sharded over all devices (Paddle's sparse table).

    Args:
      num_rows: rows (hash buckets); a multiple of the mesh's device count.
      dim: floats per row.
      accessor: the :class:`~jfleet.ps.accessor.CtrAccessor` (statistics, SGD rule,
        eviction and save rules); default Paddle's defaults with adagrad.
      table_id: the id ``fleet.save_one_table`` and friends use; default the smallest free.
      mesh: default the ``fleet.init`` mesh; rows are split over all its axes.
      seed: seed of the initial weights (and of rows re-created after eviction).

    Attributes:
      state: the current :class:`TableState`; a donated step returns the next one, assign
        it back (``table.state = step(table.state, ...)``).
      day: the table's current day (:func:`jfleet.ps.lifecycle.set_date`), None before.
      cache_threshold: the show count rows must exceed to be cached
        (:func:`jfleet.ps.storage.save_cache_table`).

    Raises:
      ValueError: ``num_rows`` not a positive multiple of the device count; ``dim`` < 1.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        accessor: CtrAccessor | None = None,
        *,
        table_id: int | None = None,
        mesh: Mesh | None = None,
        seed: int = 0,
    ) -> None:
        self.mesh = _table_mesh(mesh)
        devices = self.mesh.size
        for name, value in (("num_rows", num_rows), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SparseTable({name}={value!r}): expected a positive int.")
        if num_rows % devices or num_rows >= 2**31:
            raise ValueError(
                f"SparseTable(num_rows={num_rows}): the rows are split over the mesh's "
                f"{devices} devices, so num_rows must be a multiple of {devices} below 2**31; "
                f"e.g. num_rows={max(devices, num_rows // devices * devices)}."
            )
        self.accessor = CtrAccessor() if accessor is None else accessor
        if not isinstance(self.accessor, CtrAccessor):
            raise TypeError(f"accessor={accessor!r} is not a jfleet.ps.CtrAccessor.")
        self.num_rows, self.dim, self.seed = num_rows, dim, seed
        self.table_id = registry.next_id() if table_id is None else table_id
        if isinstance(self.table_id, bool) or not isinstance(self.table_id, int):
            raise TypeError(f"table_id={table_id!r} must be an int.")
        self.axes = tuple(self.mesh.axis_names)
        self.sharding = NamedSharding(self.mesh, P(self.axes))
        self.day: int | None = None
        self.cache_threshold: float | None = None
        self.evictions = 0
        self.state = self.fresh_state()
        registry.register(self)

    def __repr__(self) -> str:
        return (
            f"SparseTable(table_id={self.table_id}, num_rows={self.num_rows}, dim={self.dim}, "
            f"rule={self.accessor.embed_sgd_rule.name!r}, devices={self.mesh.size})"
        )

    # ------------------------------------------------------------------ state
    @property
    def fresh_rows(self) -> Any:
        """``key -> TableState``: a whole table of new rows (weights from ``key``), traceable."""
        return functools.partial(_fresh_rows, self.num_rows, self.dim, self.accessor.embed_sgd_rule)

    def fresh_state(self) -> TableState:
        """A new, empty table laid out on the mesh (nothing is ever whole on one device)."""
        build = lambda: jax.jit(self.fresh_rows, out_shardings=self.sharding)  # noqa: E731
        return self.program("fresh", build)(jax.random.key(self.seed))

    def program(self, name: str, build: Any) -> Any:
        """The compiled program ``name`` of tables like this one (rows, dim, accessor, mesh):
        ``build()`` (a jitted function that must not hold the table) runs once per kind."""
        key = (name, self.num_rows, self.dim, self.accessor, self.sharding)
        if key not in _PROGRAMS:
            _PROGRAMS[key] = build()
        return _PROGRAMS[key]

    def prepare(self, ids: Any, labels: Any = None, size: int | None = None) -> SparseBatch:
        """:func:`jfleet.ps.hashing.prepare` for this table's row count."""
        return prepare(ids, self.num_rows, labels, size)

    # ---------------------------------------------------------------- kernels
    def pull(self, state: TableState, rows: Any) -> jax.Array:
        """The weights of ``rows`` (``[n]`` int32, ``-1`` padding reads zeros): ``[n, dim]``.

        Traceable; collective traffic: one all-reduce of ``[n, dim]`` float32.
        """
        f = _kernel("pull", self.mesh, self.axes, self.accessor)
        return f(state.emb, jnp.asarray(rows, jnp.int32))

    def push(
        self,
        state: TableState,
        rows: Any,
        grads: Any,
        show: Any,
        click: Any,
    ) -> TableState:
        """``state`` after the accessor's update of ``rows`` (unique; ``-1`` is padding).

        Args:
          state: the table state (donate it in a jitted step: the update is in place).
          rows: ``[n]`` int32, as :meth:`prepare` gives.
          grads: ``[n, dim]``: the gradient of the batch's summed loss by each row (with a
            mean loss, multiply by the batch size: Paddle's
            ``scale_sparse_gradient_with_batch_size``).
          show / click: ``[n]``: the batch's shows and clicks per row.

        Traceable; no collective: each device writes only the rows it owns.
        """
        f = _kernel("push", self.mesh, self.axes, self.accessor)
        floats = (jnp.asarray(x, jnp.float32) for x in (grads, show, click))
        return f(state, jnp.asarray(rows, jnp.int32), *floats)

    def set_rows(self, state: TableState, rows: Any, values: TableState) -> TableState:
        """``state`` with ``rows`` (unique; ``-1`` skipped) set to ``values`` (their rows)."""
        f = _kernel("set", self.mesh, self.axes, self.accessor)
        return f(state, jnp.asarray(rows, jnp.int32), values)

    # ------------------------------------------------------------- host views
    def lookup(self, ids: Any) -> np.ndarray:
        """The current weights of ``ids`` (any shape): ``ids.shape + (dim,)``, NumPy.

        Example:
          >>> # table.lookup(np.array([3, 5])).shape == (2, table.dim)
        """
        batch = self.prepare(ids)
        pulled = np.asarray(self.pull(self.state, batch.rows))
        return pulled[batch.inverse]

    def present_rows(self) -> int:
        """How many rows hold a feature (pushed since created or evicted)."""
        return int(jnp.sum(self.state.present))


_PROGRAMS: dict[tuple, Any] = {}


def _fresh_rows(num_rows: int, dim: int, rule: Any, key: jax.Array) -> TableState:
    zeros = jnp.zeros((num_rows,), jnp.float32)
    slots = {
        name: jnp.full((num_rows, *shape), rule.slot_init(name), jnp.float32)
        for name, shape in rule.slot_shapes(dim).items()
    }
    emb = rule.init_rows(key, (num_rows, dim))
    return TableState(emb, slots, zeros, zeros, zeros, zeros, jnp.zeros((num_rows,), bool))


def _local(axes: tuple[str, ...], n_local: int, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(row index in this device's shard, whether this device owns the row)."""
    local = rows - lax.axis_index(axes) * n_local
    ok = (rows >= 0) & (local >= 0) & (local < n_local)
    return jnp.where(ok, local, 0), ok


def _pull_local(axes: tuple[str, ...], emb: jax.Array, rows: jax.Array) -> jax.Array:
    idx, ok = _local(axes, emb.shape[0], rows)
    return lax.psum(jnp.where(ok[:, None], emb[idx], 0.0), axes)


def _push_local(
    axes: tuple[str, ...],
    acc: CtrAccessor,
    s: TableState,
    rows: jax.Array,
    g: jax.Array,
    sh: jax.Array,
    cl: jax.Array,
) -> TableState:
    n_local = s.show.shape[0]
    idx, ok = _local(axes, n_local, rows)
    scale = jnp.where(sh > 0, sh, 1.0) if acc.show_scale else jnp.ones_like(sh)
    slots = {k: v[idx] for k, v in s.slots.items()}
    w, slots = acc.embed_sgd_rule.apply(s.emb[idx], slots, g / scale[:, None])
    new = TableState(
        emb=w,
        slots=slots,
        show=s.show[idx] + sh,
        click=s.click[idx] + cl,
        delta_score=s.delta_score[idx] + acc.score(sh, cl),
        unseen_days=jnp.zeros_like(sh),
        present=jnp.ones(sh.shape, bool),
    )
    return _write(s, jnp.where(ok, idx, n_local), new)


def _set_local(axes: tuple[str, ...], s: TableState, rows: jax.Array, v: TableState) -> TableState:
    n_local = s.show.shape[0]
    idx, ok = _local(axes, n_local, rows)
    return _write(s, jnp.where(ok, idx, n_local), v)


@functools.cache
def _kernel(kind: str, mesh: Mesh, axes: tuple[str, ...], acc: CtrAccessor) -> Any:
    """The jitted shard_map kernel ``kind`` ("pull", "push", "set"), one per table layout."""
    rows_spec = P(axes)
    if kind == "pull":
        f, in_specs, out_specs = functools.partial(_pull_local, axes), (rows_spec, P()), P()
    elif kind == "push":
        f = functools.partial(_push_local, axes, acc)
        in_specs, out_specs = (rows_spec, P(), P(), P(), P()), rows_spec
    else:
        f, in_specs, out_specs = (
            functools.partial(_set_local, axes),
            (rows_spec, P(), P()),
            rows_spec,
        )
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _write(state: TableState, idx: jax.Array, new: TableState) -> TableState:
    """Scatters ``new`` (rows ``idx`` of a shard; out-of-range indices dropped) into ``state``."""
    return jax.tree.map(lambda a, v: a.at[idx].set(v.astype(a.dtype), mode="drop"), state, new)

"""The machinery behind :mod:`jfleet.collective`'s group collectives.

Per-device kernels (``lax.psum`` / ``all_gather`` over a group's mesh axes, for code
inside ``shard_map``) and the host view, which runs the same kernel as a compiled
``shard_map`` over the fleet mesh on global arrays, rank ``r``'s tensor being the piece
device ``r`` holds. The public functions, their arguments and semantics are documented
in :mod:`jfleet.collective`.

Example:
  >>> from jfleet.mesh.group_collective import ReduceOp, kernel
  >>> f = kernel("all_reduce", ("mp",), ReduceOp.MAX, 0)  # lax.pmax over "mp"
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh import context as _context
from jfleet.mesh.topology import Group

__all__ = ["ReduceOp", "group_size", "kernel", "manual_axes", "run"]


class ReduceOp(enum.IntEnum):
    """Paddle's reduction kinds, with Paddle's integer values.

    Example:
      >>> ReduceOp.SUM, ReduceOp(4).name
      (<ReduceOp.SUM: 0>, 'AVG')
    """

    SUM = 0
    MAX = 1
    MIN = 2
    PROD = 3
    AVG = 4


@functools.lru_cache(maxsize=32)
def _world(mesh: Mesh) -> Group:
    axes = tuple(mesh.axis_names)
    return Group(axes, tuple(range(mesh.devices.size)), rank=0, name="world")


def _axes(group: Group) -> tuple[str, ...]:
    name = group.axis_name
    return (name,) if isinstance(name, str) else tuple(name)


def _position(rank: Any, group: Group, what: str, fn: str) -> int:
    """The index in ``group`` of global rank ``rank`` (Paddle's src / dst)."""
    index = group.get_group_rank(rank) if isinstance(rank, (int, np.integer)) else -1
    if isinstance(rank, bool) or index < 0:
        shown = list(group.ranks) if group.nranks <= 16 else f"{group.ranks[:16]}..."
        raise ValueError(
            f"{fn}: {what}={rank!r} is not a rank of group {group.name!r} (global ranks "
            f"{shown}); pass one of them, e.g. {what}=group.ranks[0] or "
            f"group.get_global_rank(i)."
        )
    return index


def manual_axes() -> tuple[str, ...]:
    """The mesh axes that are manual here: those of the enclosing ``shard_map``, or ()."""
    return tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def _inside(group: Group | None, value: Any, fn: str) -> Group | None:
    """The group to run per device if inside ``shard_map``; None for the host view."""
    manual = manual_axes()
    if not manual:
        if isinstance(value, jax.core.Tracer):
            raise ValueError(
                f"{fn}: got a traced value outside shard_map (inside jax.jit), where a rank's "
                "piece is not defined; call it inside jax.shard_map(..., mesh=hcg.mesh) or "
                "on a concrete global jax.Array."
            )
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if group is None:
        group = Group(tuple(mesh.axis_names), tuple(range(mesh.size)), rank=0, name="world")
    axes = _axes(group)
    missing = [a for a in axes if a not in manual]
    if missing:
        raise ValueError(
            f"{fn}: group {group.name!r} spans mesh axes {list(axes)} but {missing} are not "
            f"manual in this shard_map (manual: {list(manual)}); add them to "
            "shard_map's axis_names (or leave axis_names out)."
        )
    size = int(np.prod([mesh.shape[a] for a in axes]))
    if size != group.nranks:
        raise ValueError(
            f"{fn}: group {group.name!r} has {group.nranks} ranks but its axes {list(axes)} "
            f"have {size} devices on this mesh; take the group from this mesh's hybrid group."
        )
    return group


# ----- per-device kernels (inside shard_map) ----------------------------------------------


def _psum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    if x.dtype == jnp.bool_:
        return jax.lax.psum(x.astype(jnp.int32), axes) > 0
    return jax.lax.psum(x, axes)


def _gather(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``[n, ...]``: member ``j``'s ``x`` in row ``j``, the same on every member.

    A psum of each member's row in place of ``lax.all_gather``, so that the result is
    typed invariant over ``axes`` (``out_specs`` may leave them out) and exact.
    """
    mesh = jax.sharding.get_abstract_mesh()
    n = int(np.prod([mesh.shape[a] for a in axes]))
    rows = jnp.zeros((n, *x.shape), jnp.int32 if x.dtype == jnp.bool_ else x.dtype)
    rows = jax.lax.dynamic_update_index_in_dim(rows, x.astype(rows.dtype), _index(axes), 0)
    return jax.lax.psum(rows, axes).astype(x.dtype)


def _index(axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.axis_index(axes) if axes else jnp.int32(0)


def _reduce_all(x: jax.Array, op: ReduceOp, axes: tuple[str, ...]) -> jax.Array:
    if op == ReduceOp.SUM:
        return _psum(x, axes)
    if op == ReduceOp.MAX:
        return jax.lax.pmax(x, axes)
    if op == ReduceOp.MIN:
        return jax.lax.pmin(x, axes)
    if op == ReduceOp.AVG:
        return jax.lax.pmean(x, axes).astype(x.dtype)
    return jnp.prod(_gather(x, axes), axis=0).astype(x.dtype)


def _from(x: jax.Array, index: int, axes: tuple[str, ...]) -> jax.Array:
    """Every device gets the value of the member at ``index`` of its group (a masked psum,
    as ``lax.pbroadcast`` is defined; that one has no CPU lowering)."""
    return _psum(jnp.where(_index(axes) == index, x, jnp.zeros_like(x)), axes)


def _mine(stacked: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Row ``i`` of ``stacked`` on the group's member ``i``."""
    return jax.lax.dynamic_index_in_dim(stacked, _index(axes), axis=0, keepdims=False)


def _reduce_scatter(x: jax.Array, xs: tuple, op: ReduceOp, axes: tuple[str, ...]) -> jax.Array:
    stacked = jnp.stack(xs)
    if op == ReduceOp.SUM and stacked.dtype != jnp.bool_ and axes:
        out = jax.lax.psum_scatter(stacked, axes, scatter_dimension=0, tiled=False)
    else:
        out = _mine(_reduce_all(stacked, op, axes), axes)
    return out.astype(x.dtype)


def kernel(kind: str, axes: tuple[str, ...], op: ReduceOp, index: int) -> Callable:
    """The per-device body of collective ``kind`` over ``axes`` (called inside shard_map)."""
    if kind == "all_reduce":
        return lambda x: _reduce_all(x, op, axes)
    if kind == "all_gather":
        return lambda x: tuple(_gather(x, axes))
    if kind == "broadcast":
        return lambda x: _from(x, index, axes)
    if kind == "reduce":
        return lambda x: jnp.where(_index(axes) == index, _reduce_all(x, op, axes), x)
    if kind == "scatter":
        return lambda x, *xs: _mine(_from(jnp.stack(xs), index, axes), axes).astype(x.dtype)
    if kind == "reduce_scatter":
        return lambda x, *xs: _reduce_scatter(x, xs, op, axes)
    raise AssertionError(kind)


# ----- the host view: a compiled shard_map over the fleet mesh ------------------------------


def _spec_on(value: Any, mesh: Mesh, fn: str) -> tuple[jax.Array, P]:
    """``value`` as a jax array and the ``PartitionSpec`` that gives each rank its piece."""
    sharding = getattr(value, "sharding", None)
    if not isinstance(value, jax.Array) or not isinstance(sharding, NamedSharding):
        # Every rank holds all of it: each process places its own value on its devices.
        local = np.asarray(value if isinstance(value, jax.Array) else jnp.asarray(value))
        return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), local), P()
    used = [a for e in sharding.spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    unknown = [a for a in used if a not in mesh.axis_names]
    if unknown:
        raise ValueError(
            f"{fn}: the array of shape {value.shape} is split over {unknown} "
            f"(PartitionSpec {sharding.spec}), which are not axes of the fleet mesh "
            f"{tuple(mesh.axis_names)}; lay it out on hcg.mesh (jax.device_put)."
        )
    return value, sharding.spec


def _mesh_for(group: Group | None, tensor: Any, fn: str) -> Mesh:
    """The group's mesh, else the run's, else the one ``tensor`` is laid out on."""
    if group is not None and group.mesh is not None:
        return group.mesh
    run = _context.current()
    if run is not None:
        return run.mesh
    if isinstance(tensor, jax.Array) and isinstance(tensor.sharding, NamedSharding):
        return tensor.sharding.mesh
    raise RuntimeError(
        f"{fn}: no mesh to run on: the group carries none, fleet.init() was not called and "
        "the tensor is not laid out on a mesh; take the group from a HybridCommunicateGroup "
        "or call fleet.init(is_collective=True, strategy=...) first."
    )


@functools.lru_cache(maxsize=256)
def _compiled(
    kind: str, mesh: Mesh, axes: tuple, op: ReduceOp, index: int, specs: tuple, out: Any
) -> Callable:
    body = jax.shard_map(
        kernel(kind, axes, op, index),
        mesh=mesh,
        in_specs=specs,
        out_specs=out,
        check_vma=False,
    )
    return jax.jit(body)


def run(
    kind: str,
    group: Group | None,
    tensor: Any,
    fn: str,
    *,
    op: ReduceOp = ReduceOp.SUM,
    rank: Any = None,
    what: str = "src",
    extra: Sequence[Any] = (),
) -> Any:
    """Runs collective ``kind`` per device (inside shard_map) or over global arrays."""
    inner = _inside(group, tensor, fn)
    if inner is not None:
        index = 0 if rank is None else _position(rank, inner, what, fn)
        for i, t in enumerate(extra):
            if jnp.shape(t) != jnp.shape(tensor):
                raise ValueError(
                    f"{fn}: tensor_list[{i}] has shape {jnp.shape(t)} but tensor has "
                    f"{jnp.shape(tensor)}; every entry must have the tensor's shape."
                )
        return kernel(kind, _axes(inner), op, index)(tensor, *extra)
    mesh = _mesh_for(group, tensor, fn)
    group = _world(mesh) if group is None else group
    index = 0 if rank is None else _position(rank, group, what, fn)
    tensor, spec = _spec_on(tensor, mesh, fn)
    piece = NamedSharding(mesh, spec).shard_shape(tensor.shape)
    arrays, specs = [tensor], [spec]
    for i, t in enumerate(extra):
        t, s = _spec_on(t, mesh, fn)
        if NamedSharding(mesh, s).shard_shape(t.shape) != piece:
            raise ValueError(
                f"{fn}: tensor_list[{i}] of shape {t.shape} (PartitionSpec {s}) gives each "
                f"rank a piece of shape {NamedSharding(mesh, s).shard_shape(t.shape)}, but "
                f"tensor's pieces have shape {piece} (shape {tensor.shape}, PartitionSpec "
                f"{spec}); lay every entry out with the tensor's piece shape."
            )
        arrays.append(t)
        specs.append(s)
    out = tuple([spec] * group.nranks) if kind == "all_gather" else spec
    return _compiled(kind, mesh, _axes(group), op, index, tuple(specs), out)(*arrays)


def group_size(group: Group | None, tensor: Any, fn: str) -> int:
    """The number of ranks of ``group`` (None: of the mesh the call runs on)."""
    if group is not None:
        return group.nranks
    if manual_axes():
        return jax.sharding.get_abstract_mesh().size
    return _mesh_for(None, tensor, fn).devices.size

"""The mesh parallel layers live on, and the one way they constrain activations.

Parallel layers are built after ``fleet.init`` (as in Paddle, where they need the
model-parallel group): they take the fleet's hybrid mesh when constructed, create
their parameters already sharded on it, and pin activations with
``with_sharding_constraint`` to ``NamedSharding``\\ s on that mesh, so they work in
the engine, in a user's own ``nnx.jit`` step and eagerly, with no mesh context.

Example:
  >>> import jax.numpy as jnp
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True)
  >>> mesh = layer_mesh()
  >>> from jfleet.mesh.topology import DATA_AXES
  >>> x = constrain(jnp.ones((8, 4)), mesh, DATA_AXES, None)
  >>> x.sharding.spec
  P(('dp', 'sharding', 'ep'), None)
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh import context as _context
from jfleet.mesh.topology import MP


def layer_mesh(mesh: Mesh | None = None) -> Mesh:
    """``mesh`` if given, else the fleet's hybrid mesh.

    Raises:
      RuntimeError: no mesh given and ``fleet.init`` not called.
    """
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh={mesh!r} is not a jax.sharding.Mesh.")
        return mesh
    run = _context.current()
    if run is None:
        raise RuntimeError(
            "parallel layers are built on the fleet's mesh: call fleet.init(is_collective=True, "
            "strategy=...) before constructing them (or pass mesh=...)."
        )
    return run.mesh


def mp_degree(mesh: Mesh) -> int:
    """The size of the ``mp`` axis (1 if the mesh has none)."""
    return mesh.shape.get(MP, 1)


def named(mesh: Mesh, *entries: Any) -> NamedSharding:
    """``NamedSharding(mesh, P(*entries))`` with axes the mesh lacks dropped: the one builder.

    Inside a ``jax.shard_map`` that is manual over some axes (a pipeline stage, manual
    over ``pp`` and the data axes), the sharding is built on the context's abstract mesh
    instead, with the manual axes dropped too: a constraint there may only name the
    automatic axes (``mp``), and the values are already per-device over the manual ones.

    Example:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("dp", "mp"), devices=jax.devices()[:8])
      >>> named(mesh, ("dp", "sharding"), "mp").spec
      P('dp', 'mp')
      >>> seen = []
      >>> def body(x):
      ...     seen.append(named(mesh, "dp", "mp").spec)
      ...     return x
      >>> _ = jax.shard_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"),
      ...                   axis_names={"dp"})(jax.numpy.ones((2, 4)))
      >>> seen
      [P(None, 'mp')]
    """
    context = jax.sharding.get_abstract_mesh()
    manual = frozenset(getattr(context, "manual_axes", ()) or ())
    if manual:
        return NamedSharding(context, P(*(_keep(context, e, manual) for e in entries)))
    return NamedSharding(mesh, P(*(_keep(mesh, e) for e in entries)))


def shard_map_mesh(mesh: Mesh) -> Any:
    """The mesh to give a ``jax.shard_map`` a layer opens on ``mesh``.

    ``mesh`` itself, except inside a partly manual ``shard_map`` (a pipeline stage),
    where a nested ``shard_map`` must name the context's abstract mesh.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((8,), ("mp",), devices=jax.devices()[:8])
      >>> shard_map_mesh(mesh) is mesh
      True
    """
    context = jax.sharding.get_abstract_mesh()
    return context if getattr(context, "manual_axes", ()) else mesh


def constrain(x: jax.Array, mesh: Mesh, *entries: Any) -> jax.Array:
    """Pins ``x`` to ``P(*entries)`` on ``mesh``; trailing dimensions stay unconstrained.

    Inside a partly manual ``shard_map`` only the automatic axes are pinned (see
    :func:`named`).
    """
    entries = entries + (None,) * (x.ndim - len(entries))
    return jax.lax.with_sharding_constraint(x, named(mesh, *entries))


def _keep(mesh: Any, entry: Any, manual: frozenset = frozenset()) -> Any:
    if entry is None or entry is P.UNCONSTRAINED:
        return entry
    axes = entry if isinstance(entry, tuple) else (entry,)
    axes = tuple(a for a in axes if a in mesh.axis_names and a not in manual)
    if not axes:
        return None
    return axes if len(axes) > 1 else axes[0]

"""Creating a model in its planned layout: no device and no host ever holds it whole.

A model too big for one device cannot be built and then placed. :func:`create_placed`
runs the model's constructor (and whatever restructures it for the plan) inside one
``jax.jit`` whose outputs are the parameters in their planned shardings: XLA partitions
the initialisers, so each device computes and keeps only its own shards (JAX's
partitionable threefry draws the same random bits for a shard as the whole array would
hold there, so the values equal the one-device construction's). MaxText builds its state
this way (``jax.jit(init, out_shardings=...)``), and Paddle's ``LazyGuard`` and
torchtitan's meta-device construction serve the same end.

One split propagation cannot make: a pipeline stacks the blocks the constructor made one
by one along the ``pp`` axis, and XLA partitions that stack by computing every block on
every device (each device would hold all stages' blocks before keeping its own). So a
layout that splits along ``pp`` is created one stage at a time: a program per stage, on
that stage's devices, computes the stage's slice of every variable (XLA drops the other
stages' blocks from it), and the global arrays are assembled from the stages' shards
without a copy.

Example:
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> from jfleet.mesh.placement import Placement
  >>> strategy = fleet.DistributedStrategy()
  >>> strategy.hybrid_configs = {"mp_degree": 8}
  >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
  >>> def build():
  ...     model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
  ...     model.kernel.set_metadata(out_sharding=(None, "mp"))
  ...     return model
  >>> model = create_placed(build, Placement.from_fleet())
  >>> model.kernel[...].sharding.shard_shape(model.kernel.shape)
  (4, 2)
  >>> bool((model.kernel[...] == build().kernel[...]).all())
  True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import PP

__all__ = ["create_placed", "stage_sharding"]


def create_placed(build: Callable[[], nnx.Module], placement: Placement) -> nnx.Module:
    """The model ``build()`` returns, created directly in ``placement``'s layout.

    Args:
      build: makes the model (a constructor call, then any restructuring and metadata its
        layout needs); traced once for shapes and once per program, so it must be pure:
        the same structure each call, no side effects on arrays outside it.
      placement: where each variable goes (its ``out_sharding`` metadata, ZeRO).

    Returns:
      A new model of ``build``'s structure whose variables are laid out as
      :meth:`~jfleet.mesh.placement.Placement.place_params` would place them.

    Raises:
      TypeError: ``build`` returns something other than an ``nnx.Module``.
    """
    made: dict[str, Any] = {}

    def state() -> tuple[nnx.State, nnx.State]:
        model = build()
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"the model factory returned a {type(model).__name__}, not an nnx.Module; "
                "pass a function that builds the model, e.g. lambda: Model(rngs=nnx.Rngs(0))."
            )
        made["shardings"] = placement.state_shardings(model)
        made["graphdef"], params, rest = nnx.split(model, nnx.Param, ...)
        return params, rest

    shapes = jax.eval_shape(state)  # the structure and the layouts, nothing computed
    shardings = made["shardings"]
    if _stage_dims(shardings) is None:
        params, rest = _program(state, shardings)()
    else:
        params, rest = _created_by_stage(state, shapes, shardings)
    return nnx.merge(made["graphdef"], params, rest)


def _stage_dims(shardings: Any) -> list[int | None] | None:
    """Per leaf, the dimension split along ``pp`` (None: not split); None when no leaf is.

    Only ``pp`` as the whole or the major part of a dimension's entry can be created a
    stage at a time (a stage then holds a contiguous block of that dimension).
    """
    dims: list[int | None] = []
    for sharding in jax.tree.leaves(shardings):
        dim = None
        for d, entry in enumerate(sharding.spec):
            names = entry if isinstance(entry, tuple) else (entry,)
            if PP in names[1:]:
                return None
            if names[0] == PP:
                dim = d
        dims.append(dim)
    return dims if any(d is not None for d in dims) else None


def stage_sharding(sharding: NamedSharding, dim: int | None, stage: int) -> NamedSharding:
    """``sharding`` restricted to one pipeline stage's devices, ``pp`` dropped from its spec
    (from dimension ``dim``, which ``pp`` splits; None: it splits none).

    Example:
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((2, 4), ("pp", "mp"))
      >>> part = stage_sharding(NamedSharding(mesh, P("pp", None, "mp")), 0, 1)
      >>> part.spec, [d.id for d in part.mesh.devices.flat]
      (P(None, None, 'mp'), [4, 5, 6, 7])
    """
    mesh = sharding.mesh
    at = mesh.axis_names.index(PP)
    names = tuple(n for n in mesh.axis_names if n != PP)
    types = tuple(t for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if n != PP)
    sub = Mesh(np.take(mesh.devices, stage, axis=at), names, axis_types=types)
    spec = list(sharding.spec)
    if dim is not None:
        rest = tuple(spec[dim][1:]) if isinstance(spec[dim], tuple) else ()
        spec[dim] = rest if len(rest) > 1 else (rest[0] if rest else None)
    return NamedSharding(sub, P(*spec), memory_kind=sharding.memory_kind)


def _created_by_stage(state: Callable, shapes: Any, shardings: Any) -> Any:
    """``state()`` made one pipeline stage at a time and assembled (see the module doc)."""
    leaves, tree = jax.tree.flatten(shardings)
    dims = _stage_dims(shardings)
    shape_leaves = tree.flatten_up_to(shapes)
    stages = dict(zip(leaves[0].mesh.axis_names, leaves[0].mesh.axis_sizes, strict=True))[PP]
    local = {d.id for d in jax.local_devices()}
    pieces: list[dict[int, jax.Array]] = [{} for _ in leaves]

    for stage in range(stages):
        out = [stage_sharding(s, d, stage) for s, d in zip(leaves, dims, strict=True)]
        if not any(d.id in local for d in out[0].mesh.devices.flat):
            continue  # another process's stage

        def stage_state(stage: int = stage) -> list[jax.Array]:
            with nnx.use_eager_sharding(False):  # no layouts on the whole mesh in here
                made = jax.tree.leaves(state())  # (the metadata differs: not the treedef)
            return [
                x if d is None else _stage_block(x, d, stage, stages)
                for x, d in zip(made, dims, strict=True)
            ]

        made = _program(stage_state, out)()
        for i, array in enumerate(made):
            for shard in array.addressable_shards:
                pieces[i].setdefault(shard.device.id, shard.data)
    arrays = [
        jax.make_array_from_single_device_arrays(
            shape.shape,
            sharding,
            [piece[d.id] for d in sharding.addressable_devices_indices_map(shape.shape)],
        )
        for shape, sharding, piece in zip(shape_leaves, leaves, pieces, strict=True)
    ]
    return jax.tree.unflatten(tree, arrays)


def _program(fn: Callable, out_shardings: Any) -> jax.stages.Compiled:
    """``fn`` compiled with its outputs laid out as ``out_shardings`` (one creation program)."""
    return jax.jit(fn, out_shardings=out_shardings).lower().compile()


def _stage_block(x: jax.Array, dim: int, stage: int, stages: int) -> jax.Array:
    """Pipeline stage ``stage``'s contiguous block of ``x`` along ``dim``."""
    size = x.shape[dim] // stages
    return jax.lax.slice_in_dim(x, stage * size, (stage + 1) * size, axis=dim)

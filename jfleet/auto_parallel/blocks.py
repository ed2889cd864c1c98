"""How ``to_distributed`` runs a model's decoder blocks without touching its forward code.

A model written ``for layer in self.layers: x = layer(x)`` keeps that loop. When the plan
pipelines the blocks, :func:`pipeline_blocks` puts a :class:`PipelinedBlocks` where the
list was: its iteration yields one callable that runs every block as pipeline stages
(:func:`jfleet.parallel.pipeline_schedule.pipeline_forward`, an FThenB / GPipe loop inside a
``shard_map`` over ``pp``). Without a pipeline, :func:`wrap_blocks` gives the blocks
activation recompute and sequence-parallel constraints in place (parameter paths and
classes unchanged).

Example:
  >>> import jax
  >>> from jfleet.models.llama import TinyLlama
  >>> mesh = jax.make_mesh((2, 4), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> model = TinyLlama(layers=4)
  >>> tokens = jax.numpy.zeros((4, 8), int)
  >>> before = model(tokens)
  >>> stand_in = pipeline_blocks(model, "layers", mesh=mesh, num_microbatches=2)
  >>> len(model.layers), type(model.layers).__name__
  (1, 'PipelinedBlocks')
  >>> bool(jax.numpy.allclose(model(tokens), before, atol=1e-5))
  True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jfleet.parallel.mesh_context import constrain
from jfleet.parallel.pipeline_layer import _narrow, _run_layers, _stack, _widen, annotate_stack
from jfleet.parallel.pipeline_schedule import pipeline_forward
from jfleet.topology import DATA_AXES

__all__ = ["PipelinedBlocks", "container_of", "module_at", "pipeline_blocks", "wrap_blocks"]


class PipelinedBlocks(nnx.Module):
    """Stands in for a list of identical blocks and runs them as pipeline stages.

    Iterating yields a single callable, :meth:`run`, so ``for layer in blocks: x =
    layer(x, ...)`` runs the whole stack once. Its parameters are the blocks'
    parameters stacked to ``[P, L/P, ...]`` (``self.body``: one block of the blocks'
    class), the leading axis sharded on ``pp``.

    Arguments after the activation are handed to every block: per-sample arrays are split
    into micro-batches with the activation (masks, positions), other arrays go whole to
    every micro-batch (rotary tables), anything else is passed as it is. Which arrays are
    per-sample: those of the arguments named in ``per_sample``; without it, those whose
    leading dimension is the batch size (an error when that size is also another of the
    activation's dimensions, so a ``[seq, dim]`` table is never split by mistake). The
    extra arguments get no gradient.

    Attributes:
      body: the stacked block.
      num_layers: ``L``, the blocks replaced.
      num_stages: ``P``, the mesh's ``pp`` size.
      num_microbatches: micro-batches per call.
      recompute: recompute each block in the backward pass.
      seq_axes: mesh axes the sequence dimension is split over between blocks (sequence
        parallel), or None.
      per_sample: positions (after the activation) or keyword names of the per-sample
        block arguments, or None (decided by shape).
    """

    def __init__(
        self,
        blocks: Sequence[nnx.Module],
        *,
        mesh: Mesh,
        num_microbatches: int,
        recompute: bool = False,
        seq_axes: tuple[str, ...] | None = None,
        per_sample: tuple[int | str, ...] | None = None,
    ) -> None:
        blocks = list(blocks)
        self.num_layers = len(blocks)
        self.num_stages = int(mesh.shape["pp"])
        if self.num_layers % self.num_stages:
            raise ValueError(
                f"{self.num_layers} blocks do not split evenly into {self.num_stages} pipeline "
                f"stages; use a pp degree dividing {self.num_layers}."
            )
        self.body = _stack(blocks, self.num_stages, type(blocks[0]).__name__)
        annotate_stack(self.body, mesh, self.num_stages)
        self.mesh = mesh
        self.num_microbatches = num_microbatches
        self.recompute = recompute
        self.seq_axes = seq_axes
        self.per_sample = None if per_sample is None else tuple(per_sample)

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[Callable[..., Any]]:
        return iter((self.run,))

    def __getitem__(self, index: int) -> Callable[..., Any]:
        if index in (0, -1):
            return self.run
        raise IndexError(
            f"index {index}: the {self.num_layers} blocks run as one pipelined stack; "
            "iterate over it (for layer in layers: x = layer(x)) instead of indexing blocks."
        )

    def run(self, x: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        """``x`` through all ``L`` blocks, pipelined over ``pp``; same result as the loop."""
        graphdef, state = nnx.split(self.body)
        params = nnx.to_pure_dict(state)
        leaves, treedef, kinds = _argument_kinds(x, args, kwargs, self.per_sample)
        side = [leaf for leaf, k in zip(leaves, kinds, strict=True) if k == "side"]
        shared = [leaf for leaf, k in zip(leaves, kinds, strict=True) if k == "shared"]
        # XLA:CPU aborts compiling a 16-bit all-reduce inside a partly manual shard_map,
        # so on CPU half-precision values cross the pipeline in float32 (same values).
        wide = self.mesh.devices.flat[0].platform == "cpu"
        dtypes = jax.tree.map(lambda a: a.dtype, (params, x))
        mesh, seq_axes = self.mesh, self.seq_axes
        after = None if seq_axes is None else (lambda y: constrain(y, mesh, None, seq_axes))
        interval = 1 if self.recompute else 0

        def stage_fn(w: Any, h: jax.Array, side: list, shared: list) -> jax.Array:
            w, h = _narrow((w, h), dtypes)
            it_side, it_shared = iter(side), iter(shared)
            merged = [
                next(it_side) if k == "side" else next(it_shared) if k == "shared" else leaf
                for leaf, k in zip(leaves, kinds, strict=True)
            ]
            a, kw = jax.tree.unflatten(treedef, merged)
            return _widen(_run_layers(graphdef, interval, w, h, a, kw, after), wide)

        y = pipeline_forward(
            stage_fn,
            _widen(params, wide),
            _widen(x, wide),
            side,
            shared,
            mesh=mesh,
            num_microbatches=self.num_microbatches,
        )
        return y.astype(x.dtype)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray))


def _argument_kinds(
    x: jax.Array, args: tuple, kwargs: dict, per_sample: tuple[int | str, ...] | None
) -> tuple[list, Any, list[str]]:
    """Flattens a block's extra arguments; each leaf is "side", "shared" or "static".

    With ``per_sample`` (argument positions after the activation, or keyword names) the
    arrays of those arguments are per-sample and every other array is shared. Without
    it an array whose leading dimension is the batch size is per-sample, and one that
    could also be read as a sequence-indexed table (the batch size equals another of
    the activation's dimensions) is an error asking for ``per_sample``.
    """
    batch = x.shape[0]
    leaves, kinds = [], []
    named = [*enumerate(args), *sorted(kwargs.items())]  # jax.tree.flatten's order
    for key, value in named:
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            leaves.append(leaf)
            if not _is_array(leaf):
                kinds.append("static")
            elif per_sample is not None:
                kinds.append("side" if key in per_sample else "shared")
            elif leaf.ndim >= 1 and leaf.shape[0] == batch:
                if batch in x.shape[1:]:
                    where = f"argument {key!r}{jax.tree_util.keystr(path)}"
                    raise ValueError(
                        f"{where} of the pipelined blocks has shape {leaf.shape}, and its leading "
                        f"{batch} is both the batch size and another dimension of the activation "
                        f"{x.shape}: it is unclear whether it holds one row per sample. Say which "
                        "block arguments are per-sample: ToDistributedConfig(per_sample_args=(0, "
                        "'mask', ...)) (positions after the activation, or keyword names)."
                    )
                kinds.append("side")
            else:
                kinds.append("shared")
    _, treedef = jax.tree.flatten((args, kwargs))
    return leaves, treedef, kinds


def module_at(root: nnx.Module, path: str) -> Any:
    """The node at dotted ``path`` (``layers.0``) under ``root``."""
    node = root
    for part in path.split(".") if path else ():
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def container_of(model: nnx.Module, blocks: Sequence[str]) -> str:
    """The path of the list holding exactly the blocks at ``blocks`` (in order).

    Raises:
      ValueError: the blocks are not the items ``0 .. L-1`` of one list.
    """
    parents = {b.rsplit(".", 1)[0] if "." in b else "" for b in blocks}
    indices = [b.rsplit(".", 1)[-1] for b in blocks]
    if len(parents) == 1 and indices == [str(i) for i in range(len(blocks))]:
        (parent,) = parents
        container = module_at(model, parent)
        if parent and len(container) == len(blocks):
            return parent
    raise ValueError(
        f"the decoder blocks {list(blocks)[:4]}... are not the whole of one list (nnx.List or "
        "list attribute), so they cannot be replaced by a pipelined stack; keep them in one "
        "list, or plan without a pipeline (config force_mesh with pp 1)."
    )


def pipeline_blocks(
    model: nnx.Module,
    container: str,
    *,
    mesh: Mesh,
    num_microbatches: int,
    recompute: bool = False,
    seq_axes: tuple[str, ...] | None = None,
    per_sample: tuple[int | str, ...] | None = None,
) -> PipelinedBlocks:
    """Replaces the list at ``container`` (a dotted path) by a :class:`PipelinedBlocks`.

    Raises:
      ValueError: blocks holding state other than ``nnx.Param`` (dropout RNG streams,
        batch statistics), or a block count the ``pp`` size does not divide.
    """
    blocks = list(module_at(model, container))
    stand_in = PipelinedBlocks(
        blocks,
        mesh=mesh,
        num_microbatches=num_microbatches,
        recompute=recompute,
        seq_axes=seq_axes,
        per_sample=per_sample,
    )
    parent, _, name = container.rpartition(".")
    setattr(module_at(model, parent), name, stand_in)
    return stand_in


_WRAPPED: dict[tuple[type, bool, Any, Any], type] = {}  # one subclass per setting


def wrap_blocks(
    blocks: Sequence[nnx.Module],
    *,
    recompute: bool,
    mesh: Mesh | None = None,
    seq_axes: tuple[str, ...] | None = None,
) -> None:
    """Gives each block recompute and a sequence-parallel output constraint, in place.

    The blocks keep their parameters, paths and ``__init__``; their class becomes a
    subclass of the same name whose ``__call__`` runs the original under ``nnx.remat``
    (``recompute``) and pins the output's sequence dimension to ``seq_axes``.
    """
    if not recompute and seq_axes is None:
        return
    for block in blocks:
        cls = type(block)
        key = (cls, recompute, mesh, seq_axes)
        sub = _WRAPPED.get(key)
        if sub is None:
            sub = _subclass(cls, recompute, mesh, seq_axes)
            _WRAPPED[key] = sub
        block.__class__ = sub


def _subclass(cls: type, recompute: bool, mesh: Mesh | None, seq_axes: Any) -> type:
    def call(self: Any, x: jax.Array, *args: Any, **kwargs: Any) -> Any:
        if not recompute:
            return cls.__call__(self, x, *args, **kwargs)
        # Only arrays cross the remat boundary; flags (deterministic=True) stay Python values.
        leaves, treedef = jax.tree.flatten((args, kwargs))
        arrays = [leaf for leaf in leaves if _is_array(leaf)]

        def inner(module: Any, x: jax.Array, arrays: list) -> Any:
            it = iter(arrays)
            merged = [next(it) if _is_array(leaf) else leaf for leaf in leaves]
            a, kw = jax.tree.unflatten(treedef, merged)
            return cls.__call__(module, x, *a, **kw)

        return nnx.remat(inner)(self, x, arrays)

    def wrapped_call(self: Any, x: jax.Array, *args: Any, **kwargs: Any) -> Any:
        y = call(self, x, *args, **kwargs)
        if seq_axes is not None and isinstance(y, jax.Array) and y.ndim >= 2:
            y = constrain(y, mesh, DATA_AXES, seq_axes)
        return y

    return type(
        cls.__name__,
        (cls,),
        {
            "__call__": wrapped_call,
            "__module__": cls.__module__,
            "__qualname__": f"{cls.__qualname__}[to_distributed]",
        },
    )

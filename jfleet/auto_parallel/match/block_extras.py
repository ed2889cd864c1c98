"""What a pipelined block does besides mapping its activation: other outputs and RNG streams.

:class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks` runs a model's blocks as pipeline
stages and hands on one activation from block to block. Blocks people write do more:

* **Other outputs** (``(cache, x)``, ``(x, conv_state, ssm_state)``, ``{"hidden": x,
  "aux": loss}``). The traced forward's dataflow
  (:func:`~jfleet.auto_parallel.match.block_calls.record_block_calls`) gives each output leaf a
  role (:class:`BlockOutputs`): the next block's **activation** crosses the stages; a leaf
  the forward adds up over the blocks (``total = total + aux``) is a **sum**, carried
  through the stages as a running sum per row (:func:`handing_class`); a leaf reaching
  nothing the forward returns is **dropped** (the stack returns zeros of its shape). A sum
  of a per-sample leaf (leading dimension the batch) comes back row by row; any other sum
  comes back as the mean over the micro-batches and data-parallel replicas of each one's
  sum over the blocks: exactly the unpipelined value for the mean of per-row terms (an
  auxiliary loss averaged over the batch), gradient accumulation's value otherwise.
* **RNG streams** (``nnx.Dropout(rate, rngs=rngs)``, an ``nnx.Rngs`` kept in a block).
  A pipelined block draws exactly what the unpipelined block draws on the whole batch in
  the same step: its streams' keys are nnx's (``fold_in(stream key, count)``, the count
  advancing by one per draw), and each micro-batch on each replica takes its own rows of
  that whole-batch draw (:func:`~jfleet.parallel.row_keys.row_keys`). So the pipelined
  model equals the unpipelined one, whatever the mesh and the micro-batches, and a seed
  fixes every mask. After the step each stream's count has advanced by the draws of one
  block call (counted by tracing one block: :func:`draws_per_call`), as the unpipelined
  forward advances it.

Example:
  >>> import jax
  >>> tree = jax.tree.structure((0, 0))
  >>> outputs = BlockOutputs(tree, (DROPPED, ACTIVATION), (None, None), 4)
  >>> outputs.activation, outputs.sums
  (1, ())
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jfleet.parallel.alike import GENERATED
from jfleet.parallel.row_keys import row_keys

__all__ = [
    "ACTIVATION",
    "DROPPED",
    "SUM",
    "UNITS",
    "USED",
    "BlockOutputs",
    "advance_streams",
    "drawing_stage",
    "draws_per_call",
    "handing",
    "handing_class",
    "on_activation",
]

ACTIVATION = "activation"
"""Role of a block output leaf that is the next block's activation."""
SUM = "sum"
"""Role of a block output leaf summed over the blocks into the forward's output."""
DROPPED = "dropped"
"""Role of a block output leaf that reaches nothing the forward returns."""
USED = "used"
"""Role of a block output leaf that reaches the forward's output other than as a sum."""


@dataclasses.dataclass(frozen=True)
class BlockOutputs:
    """What one block returns, as the traced forward uses it.

    Attributes:
      tree: the pytree structure of a block's output.
      roles: per output leaf, :data:`ACTIVATION` (exactly one), :data:`SUM` or
        :data:`DROPPED`.
      avals: per output leaf, its ``jax.ShapeDtypeStruct`` at the traced batch.
      batch: the traced batch's rows (a leaf whose leading dimension it is is per-sample).
    """

    tree: Any
    roles: tuple[str, ...]
    avals: tuple
    batch: int

    @property
    def activation(self) -> int:
        """The position of the activation among the output leaves."""
        return self.roles.index(ACTIVATION)

    @property
    def sums(self) -> tuple[int, ...]:
        """The positions of the leaves summed over the blocks."""
        return tuple(j for j, r in enumerate(self.roles) if r == SUM)

    def per_sample(self, j: int) -> bool:
        """Whether output leaf ``j`` holds one row per sample."""
        return tuple(self.avals[j].shape[:1]) == (self.batch,)

    def shape(self, j: int, batch: int) -> tuple[int, ...]:
        """Leaf ``j``'s shape for a batch of ``batch`` rows."""
        shape = tuple(self.avals[j].shape)
        return (batch, *shape[1:]) if self.per_sample(j) else shape

    def start(self, x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The stack's state entering block 0: ``x`` and a zero running sum per summed leaf
        (one row per sample: a per-row copy of a leaf that is not per-sample)."""
        rows = x.shape[0]
        zeros = []
        for j in self.sums:
            shape = self.shape(j, rows) if self.per_sample(j) else (rows, *self.avals[j].shape)
            zeros.append(jnp.zeros(shape, self.avals[j].dtype))
        return x, tuple(zeros)

    def returned(self, state: tuple[jax.Array, tuple[jax.Array, ...]]) -> Any:
        """What the stack returns in place of one block's output, from its final state."""
        x, sums = state
        rows = x.shape[0]
        running = dict(zip(self.sums, sums, strict=True))
        leaves = []
        for j, role in enumerate(self.roles):
            if role == ACTIVATION:
                leaves.append(x)
            elif role == SUM:
                total = running[j]
                leaves.append(total if self.per_sample(j) else jnp.mean(total, axis=0))
            else:
                leaves.append(jnp.zeros(self.shape(j, rows), self.avals[j].dtype))
        return jax.tree.unflatten(self.tree, leaves)


@functools.cache
def handing_class(cls: type, outputs: BlockOutputs) -> type:
    """A subclass of the block class ``cls`` mapping the stack's state ``(x, sums)`` to the
    next: the activation its output hands on, and each summed leaf added to its running sum.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> class Block(nnx.Module):
      ...     def __call__(self, x):
      ...         return {"hidden": x + 1, "aux": jnp.mean(x)}
      >>> tree = jax.tree.structure({"hidden": 0, "aux": 0})
      >>> avals = (jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32))
      >>> outputs = BlockOutputs(tree, (SUM, ACTIVATION), avals, 2)
      >>> block = Block()
      >>> block.__class__ = handing_class(Block, outputs)
      >>> x, (aux,) = block(outputs.start(jnp.zeros(2)))
      >>> x.tolist(), aux.tolist()
      ([1.0, 1.0], [0.0, 0.0])
    """
    original = cls.__call__

    def __call__(self: Any, state: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        x, sums = state
        leaves = outputs.tree.flatten_up_to(original(self, x, *args, **kwargs))
        added = tuple(
            total + jnp.broadcast_to(leaves[j], total.shape).astype(total.dtype)
            for total, j in zip(sums, outputs.sums, strict=True)
        )
        return leaves[outputs.activation], added

    sub = type(cls.__name__, (cls,), {"__call__": __call__, GENERATED: True})
    sub.__qualname__ = f"{cls.__qualname__}[pipelined]"
    sub.__module__ = cls.__module__
    return sub


@contextlib.contextmanager
def handing(blocks: Sequence[nnx.Module], outputs: BlockOutputs | None) -> Iterator[None]:
    """Inside the ``with``, each block is of its :func:`handing_class` (a stack built from
    them then maps the state ``(x, sums)``); their own classes come back after. Nothing
    changes when ``outputs`` is None.

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> block = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> outputs = BlockOutputs(jax.tree.structure((None, 0)), (ACTIVATION,), (None,), 1)
      >>> with handing([block], outputs):
      ...     type(block).__qualname__
      'Linear[pipelined]'
      >>> type(block).__qualname__
      'Linear'
    """
    classes = [type(b) for b in blocks]
    if outputs is not None:
        for block in blocks:
            block.__class__ = handing_class(type(block), outputs)
    try:
        yield
    finally:
        for block, cls in zip(blocks, classes, strict=True):
            block.__class__ = cls


def on_activation(after: Callable | None, outputs: BlockOutputs | None) -> Callable | None:
    """``after`` (a sharding constraint of each block's output) applied to the activation
    of the stack's state ``(x, sums)`` when ``outputs`` is set, else as it is.

    Example:
      >>> outputs = BlockOutputs(jax.tree.structure((None, 0)), (ACTIVATION,), (None,), 1)
      >>> on_activation(lambda x: x + 1, outputs)((1, (5,)))
      (2, (5,))
      >>> on_activation(None, outputs) is None
      True
    """
    if after is None or outputs is None:
        return after
    return lambda state: (after(state[0]), state[1])


# ------------------------------------------------------------------ RNG streams
_DRAWN: list[int] = []


@functools.cache
def _counting_class(cls: type) -> type:
    def __call__(self: Any) -> Any:  # noqa: N807
        _DRAWN.append(id(self))
        return cls.__call__(self)

    return type(cls.__name__, (cls,), {"__call__": __call__})


def draws_per_call(unit: nnx.Module, x: Any, args: tuple = (), kwargs: dict | None = None) -> dict:
    """Per RNG stream of ``unit`` (its graph path), how many keys one call ``unit(x, *args,
    **kwargs)`` draws: traced abstractly on a copy (``jax.eval_shape``), ``unit`` unchanged.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> drop = nnx.Dropout(0.5, rngs=nnx.Rngs(0))
      >>> draws_per_call(drop, jnp.ones((2, 3)))
      {('rngs',): 1}
    """
    kwargs = kwargs or {}
    graphdef, state = nnx.split(unit)

    def run(state: Any, x: Any) -> None:
        module = nnx.merge(graphdef, state)
        streams = {}
        for path, node in nnx.iter_graph(module):
            if isinstance(node, nnx.RngStream):
                streams[id(node)] = tuple(path)
                node.__class__ = _counting_class(type(node))
        del _DRAWN[:]
        module(x, *args, **kwargs)
        drawn = [streams[i] for i in _DRAWN if i in streams]
        del _DRAWN[:]
        counts.update({p: drawn.count(p) for p in streams.values()})

    counts: dict = {}
    jax.eval_shape(run, state, x)
    return counts


def advance_streams(body: nnx.Module, draws: dict) -> None:
    """Adds to each RNG stream's count in ``body`` the draws ``draws`` gives its path."""
    for path, node in nnx.iter_graph(body):
        n = draws.get(tuple(path), 0)
        if isinstance(node, nnx.RngStream) and n:
            node.count[...] = node.count[...] + jnp.asarray(n, node.count[...].dtype)


UNITS = "__stacked_unit__"
"""Key of the parameter entry :func:`drawing_stage` adds: each stacked unit's index."""


def drawing_stage(
    stage_fn: Callable, body: nnx.Module, params: dict, rows: int
) -> tuple[Callable, dict, Any, list]:
    """A stage function whose block draws are slices of the whole batch's draws.

    Returns ``(stage, params, side_extra, shared_extra)``: ``stage(params, carried, side,
    shared)`` takes the returned ``params`` (``params`` with each stacked unit's index,
    ``[P, U]`` float32 under :data:`UNITS`: the stage, or under interleaved stages the
    chunk, finds its units' streams by it), ``side_extra`` (the rows' indices in the batch,
    int32 ``[rows]``) appended to the side inputs and ``shared_extra`` (every unit's key
    data ``[P U, 2]`` and counts ``[P U]``) to the shared inputs; it gives ``stage_fn`` the
    parameters with the streams of its units, their keys made
    :func:`~jfleet.parallel.row_keys.row_keys` for the micro-batch's first row.
    """
    flat = nnx.to_flat_state(nnx.state(body, nnx.RngState))
    paths = [tuple(path) for path, _ in flat]
    is_key = [isinstance(var, nnx.RngKey) for _, var in flat]
    values = [
        jax.random.key_data(v[...]) if key else v[...]
        for (_, v), key in zip(flat, is_key, strict=True)
    ]
    stages, units = values[0].shape[:2]
    values = [a.reshape(stages * units, *a.shape[2:]) for a in values]
    unit_ids = jnp.arange(stages * units, dtype=jnp.float32).reshape(stages, units)

    def stage(params: Any, carried: Any, side: Any, shared: Any) -> Any:
        *side, row_ids = side
        *shared, streams = shared
        full = jax.tree.map(lambda a: a, params)
        at = lax.stop_gradient(full.pop(UNITS)).astype(jnp.int32)
        local = jax.tree.leaves(carried)[0].shape[0]
        for path, key, value in zip(paths, is_key, streams, strict=True):
            value = value[at]
            if key:
                value = row_keys(value, row0=row_ids[0], rows=local)
            node = full
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
        return stage_fn(full, carried, list(side), list(shared))

    extended = {**params, UNITS: unit_ids}
    return stage, extended, jnp.arange(rows, dtype=jnp.int32), values

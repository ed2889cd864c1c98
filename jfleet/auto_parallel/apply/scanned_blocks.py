"""Scan over layers: a model's alike decoder blocks run as one ``lax.scan`` without a pipeline.

Unrolled, a step's compiled program grows with the number of blocks (every block's
forward and backward is its own code); scanned, it holds one block's body whatever the
depth. When ``to_distributed`` does not pipeline the blocks (``pp == 1``) and they are
alike (or repeat with a period, Gemma's local / global attention: super-blocks of ``p``),
:func:`scan_blocks` puts a :class:`ScannedBlocks` where the model's list of blocks was,
as :class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks` does for a pipeline: the model's
own ``for layer in self.layers: x = layer(x, ...)`` runs the whole stack once. The
stacking and the scan are :mod:`jfleet.parallel.stack`'s (one code with the pipelines);
recompute runs inside the scan (``jax.checkpoint`` of each scanned block), and sequence
parallel pins each block's output as the unrolled blocks do. Without recompute each block
still runs under ``jax.checkpoint`` with the ``dots_saveable`` policy: its matmul outputs
are kept and only the cheap elementwise work is redone in the backward pass, as XLA does
for unrolled blocks (a plain scan would keep every residual: 1.4x the unrolled step's
temporary memory at 32 blocks, ``benchmarks/RESULTS.md``, section compile_scaling).

Blocks may return more than their activation: ``(cache, x)`` with the cache None in
training, ``(x, aux)``, ``{"hidden": x, "cache": None}``. The scan then carries what the
traced forward's dataflow says of each output leaf
(:class:`~jfleet.auto_parallel.match.block_extras.BlockOutputs`, as the pipeline does): the
activation is carried, a leaf the forward adds up over the blocks is carried as a running
sum, a leaf reaching nothing the forward returns is dropped, and the stack returns the
block's output structure around them (``(None, x)`` stays ``(None, x)`` for the model's own
loop; a dropped array comes back as zeros of its shape).

Checkpoints keep the unscanned model's per-block names (``layers.3.mlp.up_proj.kernel``,
:mod:`jfleet.checkpoint.layout`), so one moves between scanned, pipelined and plain runs.

Example:
  >>> import jax
  >>> from jfleet.models.llama import TinyLlama
  >>> model = TinyLlama(layers=4)
  >>> tokens = jax.numpy.zeros((2, 8), int)
  >>> before = model(tokens)
  >>> stand_in = scan_blocks(model, "layers")
  >>> type(model.layers).__name__, model.layers.body.mlp.up_proj.kernel.shape[:2]
  ('ScannedBlocks', (1, 4))
  >>> bool(jax.numpy.allclose(model(tokens), before, atol=1e-5))
  True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jfleet.auto_parallel.apply.blocks import SequenceConstraint
from jfleet.auto_parallel.match.block_extras import BlockOutputs, handing, on_activation
from jfleet.auto_parallel.match.matched import module_at
from jfleet.parallel import layer_gather, merged_backward, stack
from jfleet.parallel.recompute import selective_policy

__all__ = ["ScannedBlocks", "scan_blocks"]


class ScannedBlocks(nnx.Module, layer_gather.GathersLayers):
    """Stands in for a list of alike blocks and runs them with one ``lax.scan``.

    Iterating yields a single callable, :meth:`run`, so ``for layer in blocks: x =
    layer(x, ...)`` runs all ``L`` blocks once, every block getting the same further
    arguments (masks, positions, rotary tables, keyword flags). Indexing one block is an
    error: the blocks no longer exist one by one. Parameters are the blocks' stacked to
    ``[1, L/p, ...]`` (``self.body``, one block of the blocks' class, or a
    :class:`~jfleet.parallel.stack.SuperBlock` of ``p`` blocks when they repeat every
    ``p``): the layout of a one-stage pipeline, so checkpoints and
    :func:`~jfleet.parallel.stack.run_stack` treat both alike. The stacked axes are not
    sharded; each block's own (tensor-parallel, ZeRO) layout stays on the dimensions
    behind them.

    Attributes:
      body: the stacked block (or super-block).
      num_layers: ``L``, the blocks replaced.
      period: ``p``, the blocks per stacked unit (1: every block alike).
      recompute: recompute each block in the backward pass (inside the scan); False
        keeps each block's matmul outputs (``dots_saveable``).
      selective: (without ``recompute``) keep only each block's weight-matmul outputs and
        recompute its attention core and elementwise work (selective recompute,
        ``dots_with_no_batch_dims_saveable``).
      mesh: the mesh of the sequence-parallel constraint, or None.
      seq_axes: mesh axes the sequence dimension is split over between blocks, or None.
      outputs: how the forward uses a block's output when it is more than the activation
        (:class:`~jfleet.auto_parallel.match.block_extras.BlockOutputs`, from the traced
        forward: carried, summed, dropped), or None (a block returns its activation).

    Example:
      >>> import jax.numpy as jnp
      >>> blocks = [nnx.Linear(3, 3, rngs=nnx.Rngs(i)) for i in range(4)]
      >>> x = jnp.ones((2, 3))
      >>> want = blocks[3](blocks[2](blocks[1](blocks[0](x))))
      >>> scanned = ScannedBlocks(blocks, recompute=True)
      >>> bool(jnp.allclose(next(iter(scanned))(x), want, atol=1e-6))
      True
    """

    def __init__(
        self,
        blocks: Sequence[nnx.Module],
        *,
        period: int | None = None,
        recompute: bool = False,
        mesh: Mesh | None = None,
        seq_axes: tuple[str, ...] | None = None,
        selective: bool = False,
        outputs: BlockOutputs | None = None,
    ) -> None:
        blocks = list(blocks)
        if not blocks:
            raise ValueError("ScannedBlocks(blocks=[]): pass the model's decoder blocks.")
        if seq_axes is not None and mesh is None:
            raise ValueError(
                f"ScannedBlocks(seq_axes={seq_axes!r}) needs the mesh those axes belong to; "
                "pass mesh=..."
            )
        if period is None:  # none found: stack_layers names the first difference
            period = stack.block_period(blocks) or 1
        self.num_layers = len(blocks)
        self.period = period
        name = f"scanned {type(blocks[0]).__name__}"
        self.outputs = outputs
        with handing(blocks, outputs):  # the scan's carry: (activation, running sums)
            self.body = stack.stack_layers(blocks, 1, name, period=period)
        self.recompute = bool(recompute)
        self.selective = bool(selective)
        self.mesh = mesh
        self.seq_axes = None if seq_axes is None else tuple(seq_axes)

    def __len__(self) -> int:
        return 1

    def __iter__(self) -> Iterator[Callable[..., Any]]:
        return iter((self.run,))

    def __getitem__(self, index: Any) -> Any:
        raise IndexError(
            f"index {index!r}: the {self.num_layers} blocks run as one scanned stack and "
            "cannot be reached one by one; iterate over it (for layer in layers: x = "
            "layer(x)), or keep the blocks unrolled with ToDistributedConfig(scan_layers=False)."
        )

    def run(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """``x`` through all ``L`` blocks in order (one scan); same result as the loop.

        Blocks returning more than the activation return, from the whole stack, what
        :attr:`outputs` says: the last activation in the block's output structure, sums
        over the blocks, zeros for dropped parts.
        """
        outputs = self.outputs
        graphdef, state = nnx.split(self.body)
        stacked = nnx.to_pure_dict(state)
        params = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stacked)
        # ZeRO-2 / 3 inside a training step: each block gathers its own weights and
        # reduce-scatters its gradient in the loop body (FSDP; jfleet.parallel.layer_gather)
        placement = layer_gather.current()
        gathers = None
        if placement is not None:  # each layer's weights gathered in its compute dtype
            gathers = layer_gather.unit_shardings(placement, state, 2, body=self.body)
        accumulate = self._accumulators(stacked, params)
        after = None if self.seq_axes is None else SequenceConstraint(self.mesh, self.seq_axes)
        y = stack.run_layers(
            graphdef,
            params,
            x if outputs is None else outputs.start(x),
            args,
            kwargs,
            remat_interval=1,
            after=on_activation(after, outputs),
            remat_policy=self._policy(),
            gathers=gathers,
            accumulate=accumulate,
        )
        return y if outputs is None else outputs.returned(y)

    def _accumulators(self, stacked: Any, params: Any) -> merged_backward.Accumulate | None:
        """Gradient merge in the backward pass (:mod:`jfleet.parallel.merged_backward`):
        the accumulators of the stack's parameters, laid out like ``params``, when the
        step merges into them and the blocks recompute in full; else None."""
        accumulators = merged_backward.current()
        if accumulators is None or self._policy() is not None:
            return None
        taken = accumulators.take(jax.tree.leaves(stacked))
        if taken is None:
            return None
        leaves = [a.reshape(p.shape) for a, p in zip(taken, jax.tree.leaves(params), strict=True)]
        acc = jax.tree.unflatten(jax.tree.structure(params), leaves)
        return merged_backward.Accumulate(acc, accumulators.fresh)

    def _policy(self) -> Any:
        """What each scanned block keeps for the backward pass: nothing (recompute), its
        weight-matmul outputs (selective recompute), or every matmul output."""
        if self.recompute:
            return None
        if self.selective:
            return selective_policy()
        return jax.checkpoint_policies.dots_saveable


def scan_blocks(
    model: nnx.Module,
    container: str,
    *,
    period: int | None = None,
    recompute: bool = False,
    mesh: Mesh | None = None,
    seq_axes: tuple[str, ...] | None = None,
    selective: bool = False,
    outputs: BlockOutputs | None = None,
) -> ScannedBlocks:
    """Replaces the list at ``container`` (a dotted path) by a :class:`ScannedBlocks`.

    The blocks must hold only ``nnx.Param``\\ s (no dropout RNG streams or batch
    statistics) and be alike or repeat with a period; the other arguments are
    :class:`ScannedBlocks`'.

    Raises:
      ValueError: blocks holding other state, or neither alike nor repeating (the message
        names the first differing attribute).

    Example:
      >>> from jfleet.models.llama import TinyLlama
      >>> model = TinyLlama(layers=4)
      >>> scan_blocks(model, "layers", recompute=True).num_layers
      4
    """
    blocks = list(module_at(model, container))
    stand_in = ScannedBlocks(
        blocks,
        period=period,
        recompute=recompute,
        mesh=mesh,
        seq_axes=seq_axes,
        selective=selective,
        outputs=outputs,
    )
    parent, _, name = container.rpartition(".")
    setattr(module_at(model, parent), name, stand_in)
    return stand_in

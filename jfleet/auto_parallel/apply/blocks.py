"""How ``to_distributed`` runs a model's decoder blocks without touching its forward code.

A model written ``for layer in self.layers: x = layer(x)`` keeps that loop. When the plan
pipelines the blocks, :func:`pipeline_blocks` puts a :class:`PipelinedBlocks` where the
list was: its iteration yields one callable that runs every block as pipeline stages
(:func:`jfleet.parallel.pipeline_forward.pipeline_forward`: FThenB, or 1F1B's recomputing
backward loop, inside a ``shard_map`` over ``pp``). When the batch splits over the data
axes x ``pp`` the stack takes its rows split that way and returns them so, so the embedding
before it and the head and loss after it run on ``1 / P`` of the rows per device. Without
a pipeline, :func:`wrap_blocks` gives the blocks activation recompute and sequence-parallel
constraints in place (parameter paths and classes unchanged).

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

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jfleet.auto_parallel.match.block_extras import (
    BlockOutputs,
    advance_streams,
    drawing_stage,
    draws_per_call,
    handing,
    on_activation,
)
from jfleet.auto_parallel.match.matched import module_at
from jfleet.mesh.layer_mesh import constrain
from jfleet.mesh.topology import DATA_AXES, PP
from jfleet.parallel import stack
from jfleet.parallel import virtual_stages as virtual
from jfleet.parallel.pipeline_forward import pipeline_forward, rows_fit
from jfleet.parallel.recompute import SELECTIVE_POLICY, remat_class
from jfleet.runtime.log import logger

__all__ = [
    "PipelinedBlocks",
    "SequenceConstraint",
    "container_of",
    "pipeline_blocks",
    "wrap_blocks",
]


@dataclasses.dataclass(frozen=True)
class SequenceConstraint:
    """Pins a block output's sequence dimension to ``seq_axes`` (sequence parallel).

    Hashable, so it can key :func:`jfleet.recompute.remat_class`'s cache. Outputs that are
    not arrays of rank >= 2 pass unchanged. Inside the pipeline's ``shard_map`` the manual
    (data) axes are dropped from the constraint.

    Example:
      >>> import jax
      >>> auto = (jax.sharding.AxisType.Auto,) * 2
      >>> mesh = jax.make_mesh((2, 4), ("dp", "sep"), axis_types=auto, devices=jax.devices()[:8])
      >>> pin = SequenceConstraint(mesh, ("sep",))
      >>> jax.jit(pin)(jax.numpy.ones((2, 8, 3))).sharding.spec
      P('dp', 'sep')
    """

    mesh: Mesh
    seq_axes: tuple[str, ...]

    def __call__(self, y: Any) -> Any:
        if isinstance(y, jax.Array) and y.ndim >= 2:
            return constrain(y, self.mesh, DATA_AXES, self.seq_axes)
        return y


class PipelinedBlocks(nnx.Module):
    """Stands in for a list of blocks and runs them as pipeline stages.

    Iterating yields a single callable, :meth:`run`, so ``for layer in blocks: x =
    layer(x, ...)`` runs the whole stack once. Its parameters are the blocks'
    parameters stacked to ``[P, L/P, ...]`` (``self.body``: one block of the blocks'
    class), the leading axis sharded on ``pp``. When ``P`` (x virtual stages) does not
    divide the blocks, stages hold ``ceil`` or ``floor`` of ``L/P`` blocks (the larger
    first) or ``stage_sizes``: the stack is padded to the largest stage, ``[P, K, ...]``,
    and the padded slots are skipped exactly (:func:`jfleet.parallel.stack.padded_stage`;
    their gradients are exactly zero and checkpoints hold only the real blocks).

    The blocks must be alike, static settings included (:func:`jfleet.parallel.stack.
    first_difference`), or repeat with a period ``p`` (Gemma's local / global attention
    alternating: ``p = 2``): then each ``p`` consecutive blocks run as one super-block
    (``self.body`` is a :class:`~jfleet.parallel.stack.SuperBlock` whose parameters are
    ``[P, L/(pP), ...]``), and ``P`` must divide ``L/p``. Blocks that neither are alike
    nor repeat are refused with the first attribute that differs: running them all as
    block 0 would be silently wrong.

    Arguments after the activation are handed to every block: per-sample arrays are split
    into micro-batches with the activation (masks, positions), other arrays go whole to
    every micro-batch (rotary tables), anything else is passed as it is. Which arrays are
    per-sample: those of the arguments named in ``per_sample``; without it, those whose
    leading dimension is the batch size (an error when that size is also another of the
    activation's dimensions, so a ``[seq, dim]`` table is never split by mistake). The
    extra arguments get no gradient. The activation may be a tuple whose non-floating
    arrays (integer ids, boolean masks) the blocks return unchanged: they travel as
    per-sample side inputs too. The split, the stacking and the stage function are
    :mod:`jfleet.parallel.stack`'s, shared with ``PipelineLayer``.

    Blocks may return more than the activation (``outputs``: the next activation, parts
    summed over the blocks, parts dropped) and hold RNG streams (dropout): each pipelined
    draw is its rows of the unpipelined block's whole-batch draw, and the streams' counts
    advance as the unpipelined forward's (:mod:`~jfleet.auto_parallel.match.block_extras`).

    Attributes:
      body: the stacked block.
      num_layers: ``L``, the blocks replaced.
      period: ``p``, the blocks per stacked unit (1: every block alike).
      num_stages: ``P``, the mesh's ``pp`` size.
      num_microbatches: micro-batches per call.
      recompute: recompute in the backward pass: each stage from its stashed input
        (FThenB then runs 1F1B's program, as the cost model charges it); under 1F1B and
        VPP each block inside that recomputation too.
      selective: (without ``recompute``) selective recompute: each stage stashes, per
        micro-batch in flight, its input and its blocks' weight-matmul outputs, and the
        backward recomputes only their attention cores and elementwise work, under
        ``"FThenB"`` and ``"1F1B"`` alike, and ``"VPP"`` per chunk (``selective`` of
        :func:`~jfleet.parallel.pipeline_forward.pipeline_forward`).
      schedule: ``"FThenB"``, ``"1F1B"`` or ``"VPP"`` (:mod:`jfleet.parallel.pipeline_forward`).
      num_virtual_stages: ``v``, chunks per stage (``"VPP"``: at least 2); device ``s``
        holds chunks ``s, s + P, ...`` of the units
        (:func:`~jfleet.parallel.virtual_stages.slot_units`).
      chunk_sizes: units (blocks, or super-blocks) per chunk, ``P v`` of them
        (:func:`~jfleet.parallel.virtual_stages.even_sizes` unless ``stage_sizes`` was
        given); stage_sizes: blocks per stage; padded: they are uneven.
      split_rows: take and return the batch's rows split over the data axes x ``pp`` when
        they divide (else split over the data axes only, logged).
      seq_axes: mesh axes the sequence dimension is split over between blocks (sequence
        parallel), or None.
      per_sample: positions (after the activation) or keyword names of the per-sample
        block arguments, or None (decided by shape).
      outputs: what a block returns besides its activation, or None.
      streams: the blocks hold RNG streams.
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
        period: int | None = None,
        schedule: str = "FThenB",
        split_rows: bool = True,
        num_virtual_stages: int = 1,
        outputs: BlockOutputs | None = None,
        stage_sizes: Sequence[int] | None = None,
        selective: bool = False,
    ) -> None:
        blocks = list(blocks)
        if not blocks:
            raise ValueError("PipelinedBlocks(blocks=[]): pass the model's decoder blocks.")
        name = type(blocks[0]).__name__
        self.num_layers = len(blocks)
        self.num_stages = int(mesh.shape[PP])
        if period is None:
            period = stack.block_period(blocks)
            if period is None:
                i, j, difference = stack.first_mismatch(blocks) or (0, 0, "?")
                raise ValueError(
                    f"the {self.num_layers} {name} blocks are not alike and do not repeat with "
                    f"any period shorter than {self.num_layers}: block {i} differs from block "
                    f"{j} in {difference}. Pipelined blocks run one definition (static "
                    "settings included), so these cannot be pipelined; plan without a "
                    "pipeline (pp 1), or give the blocks settings that repeat."
                )
        v = virtual.check_virtual(num_virtual_stages)
        units = self.num_layers // period if self.num_layers % period == 0 else 0
        self.period = period
        self.num_virtual_stages = v
        self.streams = bool(jax.tree.leaves(nnx.state(blocks[0], nnx.RngState)))
        self.outputs = outputs
        sizes = None
        if units:  # else stack_layers names the period that does not divide the blocks
            sizes = _chunk_sizes(stage_sizes, units, self.num_stages, v, name, period)
            if self.streams and not virtual.is_even(sizes):
                raise NotImplementedError(
                    f"the {self.num_layers} {name} blocks hold RNG streams (dropout) and split "
                    f"unevenly ({virtual.sizes_text(sizes, self.num_stages)}): uneven "
                    "pipelined stages do not draw from streams yet; use a pp degree dividing "
                    f"{units}, or blocks without rngs."
                )
        self.chunk_sizes = sizes
        with handing(blocks, outputs):  # the stack's state: (activation, running sums)
            self.body = stack.stack_layers(
                blocks,
                self.num_stages,
                name,
                period=period,
                streams=self.streams,
                chunk_sizes=sizes,
            )
        stack.annotate_stack(self.body, mesh, self.num_stages)
        self.mesh = mesh
        self.num_microbatches = num_microbatches
        self.recompute = recompute
        self.selective = bool(selective) and not recompute
        self.schedule = schedule
        self.split_rows = split_rows
        self.seq_axes = seq_axes
        self.per_sample = None if per_sample is None else tuple(per_sample)

    @property
    def padded(self) -> bool:
        """Whether the stages hold different numbers of blocks (padded slots skipped)."""
        return not virtual.is_even(self.chunk_sizes or ())

    @property
    def stage_sizes(self) -> tuple[int, ...]:
        """Blocks per pipeline stage (device), e.g. ``(3, 2)`` for 5 blocks on pp 2."""
        sizes = self.chunk_sizes or ()
        return tuple(self.period * sum(sizes[s :: self.num_stages]) for s in range(self.num_stages))

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

    def run(self, x: jax.Array, *args: Any, **kwargs: Any) -> Any:
        """``x`` through all ``L`` blocks, pipelined over ``pp``; same result as the loop.

        Blocks returning more than the activation return, from the whole stack, what
        :class:`~jfleet.auto_parallel.match.block_extras.BlockOutputs` says (the last activation,
        sums over the blocks, zeros for dropped parts); blocks holding RNG streams draw
        what the unpipelined blocks draw (:mod:`~jfleet.auto_parallel.match.block_extras`).
        """
        outputs = self.outputs
        entering = x if outputs is None else outputs.start(x)
        graphdef, state = nnx.split(self.body)
        inputs, carried, side, shared = stack.stage_inputs(entering, args, kwargs, self.per_sample)
        seq_axes = self.seq_axes
        after = None if seq_axes is None else SequenceConstraint(self.mesh, tuple(seq_axes))
        stage_fn = stack.stage_function(
            graphdef,
            inputs,
            remat_interval=self._remat_interval,
            after=on_activation(after, outputs),
        )
        params = nnx.to_pure_dict(nnx.state(self.body, nnx.Param))
        if self.padded:  # uneven stages: each slot's real flag rides with its parameters
            graphdef, params = stack.padded_stage(
                self.body, params, self.chunk_sizes, self.num_stages, self.mesh
            )
            stage_fn = stack.stage_function(
                graphdef,
                inputs,
                remat_interval=self._remat_interval,
                after=on_activation(after, outputs),
            )
        side_in, shared_in = list(side), list(shared)
        if self.streams:
            unit = nnx.merge(graphdef, jax.tree.map(lambda a: a[0, 0], nnx.to_pure_dict(state)))
            draws = draws_per_call(unit, entering, args, kwargs)
            rows = jax.tree.leaves(carried)[0].shape[0]
            stage_fn, params, row_ids, streams = drawing_stage(stage_fn, self.body, params, rows)
            side_in, shared_in = [*side_in, row_ids], [*shared_in, streams]
        stage_fn, params, carried_in = stack.widened_stage(
            stage_fn, params, carried, mesh=self.mesh
        )
        y = pipeline_forward(
            stage_fn,
            params,
            carried_in,
            side_in,
            shared_in,
            mesh=self.mesh,
            num_microbatches=self.num_microbatches,
            schedule=self.schedule,
            rows_over_pp=self._rows_over_pp(carried_in),
            num_virtual=self.num_virtual_stages,
            remat=self.recompute and self.schedule == "FThenB",
            selective=self.selective,
        )
        if self.streams:  # the unpipelined forward advances each stream once per call
            advance_streams(self.body, draws)
        y = inputs.activation_of(stack.narrow(y, carried), side, shared)
        return y if outputs is None else outputs.returned(y)

    @property
    def _remat_interval(self) -> int:
        """Blocks recomputed one by one inside the stage (1) or not (0). FThenB with
        ``recompute`` runs 1F1B's program (``pipeline_forward(remat=True)``: the stage
        recomputed whole from its stashed input, as the cost model charges it); 1F1B and
        VPP with ``recompute`` also recompute each block inside that recomputation."""
        return 1 if self.recompute and self.schedule != "FThenB" else 0

    def _rows_over_pp(self, carried: Any) -> bool:
        if not self.split_rows:
            return False
        rows = jax.tree.leaves(carried)[0].shape[0]
        if rows_fit(rows, self.mesh, self.num_microbatches):
            return True
        logger.info(
            "pipelined blocks: a batch of %d rows does not split over the data axes x pp "
            "(%s); the layers before and after the stack run on every stage's whole batch",
            rows,
            dict(self.mesh.shape),
        )
        return False


def _chunk_sizes(
    stage_sizes: Sequence[int] | None, units: int, num_stages: int, v: int, name: str, period: int
) -> tuple[int, ...]:
    """Units per chunk: the even split, or ``stage_sizes`` (blocks per stage or chunk).

    Raises:
      ValueError: ``stage_sizes`` of another length, not in whole super-blocks, summing
        to another count or leaving a stage empty.
    """
    if stage_sizes is None:
        return virtual.check_sizes(None, units, num_stages, v, name=f"{name} blocks")
    sizes = list(stage_sizes)
    if period > 1:
        if any(not isinstance(n, int) or n % period for n in sizes):
            raise ValueError(
                f"stage_sizes={sizes!r}: the {name} blocks repeat every {period} and stack as "
                f"super-blocks of {period}; give block counts that are multiples of {period}."
            )
        sizes = [n // period for n in sizes]
    return virtual.check_sizes(sizes, units, num_stages, v, name=f"{name} blocks")


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
    period: int | None = None,
    schedule: str = "FThenB",
    num_virtual_stages: int = 1,
    outputs: BlockOutputs | None = None,
    stage_sizes: Sequence[int] | None = None,
    selective: bool = False,
) -> PipelinedBlocks:
    """Replaces the list at ``container`` (a dotted path) by a :class:`PipelinedBlocks`.

    ``period``: blocks per stacked unit, or None to find it (:func:`jfleet.parallel.stack.
    block_period`); the other arguments are :class:`PipelinedBlocks`'.

    ``outputs``: how the forward uses a block's output when it is more than the
    activation (:class:`~jfleet.auto_parallel.match.block_extras.BlockOutputs`, from the traced
    forward), or None.

    ``stage_sizes``: blocks per stage (``pp`` counts, or ``pp x v`` counts per chunk with
    virtual stages), or None for the even split (``ceil`` / ``floor``, larger first).

    ``selective``: selective recompute in the stages (without ``recompute``; any
    schedule): each stage (chunk) stashes per micro-batch its input and its blocks'
    weight-matmul outputs, and recomputes their attention cores and elementwise work.

    Raises:
      ValueError: blocks holding state other than ``nnx.Param`` and RNG streams (batch
        statistics, caches); blocks that are not
        alike and do not repeat (the message names the first differing attribute);
        or ``stage_sizes`` that do not sum to the blocks or leave a stage empty.

    Example:
      >>> import jax
      >>> from jfleet.models.llama import TinyLlama
      >>> auto = (jax.sharding.AxisType.Auto,) * 2
      >>> mesh = jax.make_mesh((4, 2), ("dp", "pp"), axis_types=auto)
      >>> model = TinyLlama(layers=4)
      >>> pipeline_blocks(model, "layers", mesh=mesh, num_microbatches=2).period
      1
    """
    blocks = list(module_at(model, container))
    stand_in = PipelinedBlocks(
        blocks,
        mesh=mesh,
        num_microbatches=num_microbatches,
        recompute=recompute,
        seq_axes=seq_axes,
        per_sample=per_sample,
        period=period,
        schedule=schedule,
        num_virtual_stages=num_virtual_stages,
        outputs=outputs,
        stage_sizes=stage_sizes,
        selective=selective,
    )
    parent, _, name = container.rpartition(".")
    setattr(module_at(model, parent), name, stand_in)
    return stand_in


def wrap_blocks(
    blocks: Sequence[nnx.Module],
    *,
    recompute: bool,
    mesh: Mesh | None = None,
    seq_axes: tuple[str, ...] | None = None,
    selective: bool = False,
) -> None:
    """Gives each block recompute and a sequence-parallel output constraint, in place.

    The blocks keep their parameters, paths and ``__init__``; their class becomes a
    subclass of the same name (:func:`jfleet.recompute.remat_class`, qualified name
    ``Block[to_distributed]``) whose ``__call__`` runs the original under ``nnx.remat``
    (``recompute``; ``selective``: keeping its weight-matmul outputs,
    ``dots_with_no_batch_dims_saveable``) and pins the output's sequence dimension to
    ``seq_axes``.
    """
    if not (recompute or selective) and seq_axes is None:
        return
    after = None if seq_axes is None else SequenceConstraint(mesh, tuple(seq_axes))
    policy = SELECTIVE_POLICY if selective and not recompute else None
    for block in blocks:
        block.__class__ = remat_class(
            type(block),
            policy=policy,
            after=after,
            recompute=recompute or selective,
            tag="to_distributed",
        )

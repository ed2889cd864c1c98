"""Paddle's ``PipelineLayer``, ``LayerDesc`` and ``SharedLayerDesc`` as NNX modules.

A :class:`PipelineLayer` is built from a list of layer descriptions, as in Paddle, and
split into stages by ``seg_method`` exactly as Paddle's ``SegmentLayers``
(:mod:`jfleet.parallel.segment`: ``"uniform"``, ``"layer:<Regex>"``, explicit bounds).
Layers are built one by one from one ``nnx.Rngs`` sequence, so a seed builds the same
parameters whatever ``num_stages`` is. The stages are held in one of two ways:

* **stacked body**: when a run of identical consecutive :class:`LayerDesc`\\ s (the decoder
  blocks) falls on every stage, the layers before it on stage 0 (**pre**: the
  embedding) and those after it on the last stage (**post**: norm, LM head), the run's
  parameters are stacked to ``[P, N/P, ...]`` with ``out_sharding`` ``('pp', None,
  *inner)`` (the layer's tensor-parallel layout kept) and each stage is a ``lax.scan``;
  stages holding different numbers of blocks (5 blocks on 2 stages) pad the stack to the
  largest, ``[P, max, ...]``, and skip the padded slots exactly
  (:func:`jfleet.parallel.stack.padded_stage`; ``chunk_sizes`` says the split);
* **stages of different layers** (any other split: four layer types over two stages, a
  parameter-free stage): :class:`~jfleet.parallel.stages.FlatStages` keeps
  each stage's parameters as a row of per-dtype ``[P, n]`` buffers sharded on ``pp`` and
  runs a device's stage by ``lax.switch`` on its ``pp`` index. Stage 0's layers until the
  activation has the shape the stages exchange run before the pipeline, the last stage's
  layers after it last has it run in its head.

``__call__`` runs the whole model sequentially; :meth:`PipelineLayer.pipeline_loss` trains
it through :func:`jfleet.parallel.pipeline_schedule.pipeline_loss` (FThenB or 1F1B over
``pp``) or :func:`jfleet.parallel.pipeline_executor.table_pipeline_loss` (interleaved VPP,
zero-bubble ZBH1); ``fleet.distributed_model`` wraps it in a
:class:`~jfleet.parallel.pipeline_parallel.PipelineParallel` for ``train_batch``.
:class:`SharedLayerDesc`\\ s with one key share one parameter (a tied embedding and LM
head, even written as two classes), whose gradient sums both uses. The activation may be
any pytree of arrays, as Paddle's layers pass ``(hidden, attention_mask, position_ids)``:
its batch-first floating arrays go from stage to stage and are differentiated; its other
batch-first arrays (integer position ids) reach every stage with their micro-batch and its
arrays that are not batch first (an ``[L, L]`` mask) whole, neither getting a gradient, so
layers must return them unchanged (:func:`jfleet.parallel.stack.stage_inputs`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> layers = [LayerDesc(nnx.Linear, 4, 4)] * 4 + [LayerDesc(nnx.Linear, 4, 2)]
  >>> model = PipelineLayer(layers, num_stages=2, seed=0)
  >>> model.body.kernel.shape, model(jnp.ones((3, 4))).shape
  ((2, 2, 4, 4), (3, 2))
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.mesh import context as _context
from jfleet.mesh.layer_mesh import layer_mesh
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import EP, MP, PP
from jfleet.parallel import pipeline_executor, pipeline_schedule, segment, stack
from jfleet.parallel import virtual_stages as virtual
from jfleet.parallel.layer_desc import (
    LayerDesc,
    SharedLayerDesc,
    build_entry,
    entry_name,
)
from jfleet.parallel.loss import cast_floating, scalar_loss
from jfleet.parallel.stages import FlatStages, ParamView, Run, params_in_order
from jfleet.runtime.log import logger

__all__ = ["LayerDesc", "PipelineLayer", "SharedLayerDesc"]


_Run = Run  # the entries of ``pre`` / ``post``


class _Head(nnx.Module):
    """What the pipeline's head runs besides the post layers: the tied layers and the loss."""

    def __init__(self, shared: Any, loss: Any) -> None:
        self.shared = shared
        self.loss = loss


# ------------------------------------------------------------------ the layer
class PipelineLayer(nnx.Module):
    """A model as pre layers, a stacked pipelined body and post layers (Paddle's PipelineLayer).

    Args:
      layers: the model in order: :class:`LayerDesc`, :class:`SharedLayerDesc`, built
        ``nnx.Module``\\ s (pre / post only) and parameter-free functions ``f(x)`` (pre /
        post only).
      num_stages: pipeline stages ``P``; default: the fleet's ``pp_degree`` (the
        ``topology``'s ``pipe`` size if given; 1 without ``fleet.init``).
      topology: Paddle's :class:`~jfleet.topology.CommunicateTopology` (only its ``pipe``
        size is read).
      loss_fn: ``loss_fn(output, labels) -> scalar``, the mean loss of a micro-batch;
        a list of them for ``train_batch(loss_fn_idx=...)``. The output is cast to
        float32 first. In training it runs with the post layers inside the pipeline's
        ``shard_map``: use a plain loss such as optax's cross-entropy on the (possibly
        mp-split) logits; functions that open their own ``shard_map`` on the fleet's mesh
        (``ParallelCrossEntropy``) cannot run there yet.
      seg_method: the stage boundaries, as Paddle: ``"uniform"`` (``n // P`` layers per
        stage, the remainder to the last stages), ``"layer:ClassNameRegex"`` (balanced by
        the layers whose class name matches, case-insensitive; when the stages do not
        divide their number, the extra ones to the last stages) or explicit boundaries
        ``[0, b1, ..., len(layers)]``. Stages may hold different numbers of the identical
        blocks: the stacked body is padded to the largest and the padded slots skipped.
      recompute_interval: ``k > 0`` runs each group of ``k`` layers of a stage under
        ``jax.checkpoint`` (the last group may be shorter).
      recompute_ctx: accepted for Paddle; its process-group settings mean nothing here.
      num_virtual_pipeline_stages: ``v``, chunks per stage (None: 1). With ``v > 1`` the
        layers split into ``P v`` chunks (``seg_method`` over ``P v`` parts) and stage
        ``s`` holds chunks ``s, s + P, ...`` (:mod:`~jfleet.parallel.virtual_stages`),
        trained by the interleaved schedule (``"VPP"``); identical body layers only.
      seed: the seed of the ``nnx.Rngs`` the layers are built with (when ``rngs`` is None).
      rngs: the ``nnx.Rngs`` to build with.

    Attributes:
      pre, post: ``nnx.List``\\ s of the layers before / after a stacked body (empty
        with stages of different layers).
      body: one module of the body's class whose parameters are ``[P, N/P, ...]``, or None.
      stages: the :class:`~jfleet.parallel.stages.FlatStages` of stages of different
        layers, or None; ``shared_layers`` then holds the tied layers by key.
      num_stages, num_layers, layers_per_stage: ``P``, ``N`` and ``N/P`` (the stacked
        body's, the largest stage's when uneven; all layers and None with stages of
        different layers).
      chunk_sizes: the stacked body's layers per chunk (``P v`` of them; stage ``s`` holds
        chunks ``s, s + P, ...``), unequal when the stages are uneven; None without one.
      num_virtual_stages: ``v``; with ``v > 1`` body row ``s`` holds chunks ``s, s + P,
        ...`` in order (unit ``(s, c L + j)`` is body layer ``(c P + s) L + j``).
      segment_parts: the boundaries over ``layers`` of the ``P v`` chunks (Paddle's
        attribute; stage boundaries when ``v == 1``).
      body_range: ``(start, end)``, the stacked body's indices in ``layers``, or None.

    Raises:
      ValueError: an unknown seg_method, one matching nothing (the message lists the
        class names), more stages than
        layers, a stage layer holding non-``Param`` state, tied layers of different shapes.
      TypeError: malformed ``layers`` entries or arguments, a loss class for an instance.
      ValueError: ``num_virtual_pipeline_stages > 1`` for stages of different layers.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> descs = [LayerDesc(nnx.Embed, 16, 4)] + [LayerDesc(nnx.Linear, 4, 4)] * 6
      >>> model = PipelineLayer(descs, num_stages=3, seg_method="layer:Linear", seed=0)
      >>> model.num_layers, model.layers_per_stage, model.segment_parts
      (6, 2, (0, 3, 5, 7))
      >>> model(jnp.array([[1, 2, 3]])).shape
      (1, 3, 4)
      >>> uneven = PipelineLayer(descs[:6], num_stages=2, seg_method="layer:Linear", seed=0)
      >>> uneven.chunk_sizes, uneven.body.kernel.shape  # 5 blocks: stages of 2 and 3
      ((2, 3), (2, 3, 4, 4))
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        seg_method: str | Sequence[int] = "uniform",
        recompute_interval: int = 0,
        recompute_ctx: Any = None,
        num_virtual_pipeline_stages: int | None = None,
        *,
        seed: int = 0,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        layers = _check_layers(layers)
        v = virtual.check_virtual(num_virtual_pipeline_stages)
        if not isinstance(recompute_interval, int) or recompute_interval < 0:
            raise ValueError(
                f"recompute_interval={recompute_interval!r} must be an int >= 0 (0: no "
                "recompute; k: jax.checkpoint over each group of k layers of a stage)."
            )
        if recompute_ctx is not None:
            logger.info("PipelineLayer: recompute_ctx means nothing under SPMD and is ignored")
        stages = _resolve_stages(num_stages, topology)
        self.loss_fns = _check_loss_fns(loss_fn)
        names = [entry_name(e) for e in layers]
        parts = segment.segment_layers(names, stages * v, seg_method)
        self.num_stages = stages
        self.num_virtual_stages = v
        self.recompute_interval = recompute_interval
        self.segment_parts = tuple(parts)

        rngs = rngs if rngs is not None else nnx.Rngs(seed)
        shared: dict[Any, list[tuple[SharedLayerDesc, str, Any]]] = {}
        built = [build_entry(d, rngs, shared) for d in layers]
        body = _stacked_body(layers, parts, built, stages)
        if body is None and v > 1:
            raise ValueError(
                f"num_virtual_pipeline_stages={v} needs a stacked body of identical layers "
                f"with every stage holding at least one of them over its {v} chunks; the "
                f"{len(layers)} layers split at {list(parts)} do not: use "
                "seg_method='layer:<BlockClass>' (the blocks split as evenly as they go), or "
                "num_virtual_pipeline_stages=1."
            )
        if body is not None:  # identical layers on every stage: one stacked module
            start, end, sizes = body
            self.num_layers = end - start
            self.chunk_sizes = sizes
            self.layers_per_stage = max(sizes) * v  # the largest stage's (padded rows)
            self.body_range = (start, end)
            self.pre = nnx.List([Run(layer, func) for layer, func, _ in built[:start]])
            self.post = nnx.List([Run(layer, func) for layer, func, _ in built[end:]])
            layers_ = [layer for layer, _, _ in built[start:end]]
            self.body = stack.stack_layers(
                layers_, stages, layers[start].name, chunk_sizes=sizes, outputs=True
            )
            self._body_order = tuple(path for path, _ in params_in_order(layers_[0]))
            self.stages = None
            if not virtual.is_even(sizes):
                logger.info(
                    "PipelineLayer: uneven stages, %s (boundaries %s); the stacked body is "
                    "padded to the largest and the padded slots are skipped",
                    virtual.sizes_text(sizes, stages),
                    list(parts),
                )
        else:  # stages of different layers: flat buffers per stage (jfleet.parallel.stages)
            self.num_layers = len(layers)
            self.layers_per_stage = None
            self.chunk_sizes = None
            self.body_range = None
            self.pre, self.post, self.body = nnx.List([]), nnx.List([]), None
            self.shared_layers = nnx.Dict(
                {name: layer for entries in shared.values() for _, name, layer in entries}
            )
            runs = [Run(None, func, key) if key else Run(layer, func) for layer, func, key in built]
            self.stages = FlatStages([runs[a:b] for a, b in itertools.pairwise(parts)])
            self._shared_at = tuple(i for i, (_, _, key) in enumerate(built) if key)
            _log_flat(self.stages, parts, layers)
        mesh = _context.current_mesh()
        if mesh is not None:
            self.place(mesh)

    # -------------------------------------------------------------- running
    @property
    def loss_fn(self) -> Callable[..., Any] | None:
        """The (first) loss function, or None."""
        return self.loss_fns[0] if self.loss_fns else None

    def parameters(self) -> list[Any]:
        """Paddle's ``parameters()``: every parameter once, in Paddle's order (the loss
        module's, the tied layers', then layer by layer in attribute order).

        Parameters held in a stacked body or a stage buffer come as
        :class:`~jfleet.parallel.stages.ParamView`\\ s (``view[...]`` reads,
        ``view.set_value(v)`` writes); the others as their ``nnx.Param``.
        """
        out: list[Any] = []
        for loss in self.loss_fns:
            out += [v for _, v in params_in_order(loss)]
        if self.stages is not None:
            out += [v for _, v in params_in_order(self.shared_layers)]
            for s in range(self.num_stages):
                out += self.stages.parameters(s)
        else:
            out += [v for _, v in params_in_order(self.pre)]
            body = [functools.reduce(_attr, path, self.body) for path in self._body_order]
            table = virtual.slot_units(self.chunk_sizes, self.num_stages)
            for u in range(self.num_layers):  # layer by layer (padded slots left out)
                s, j = (int(i[0]) for i in np.nonzero(table == u))
                out += [ParamView(v, (s, j), v.shape[2:]) for v in body]
            out += [v for _, v in params_in_order(self.post)]
        seen: set[int] = set()
        return [v for v in out if not (id(v) in seen or seen.add(id(v)))]

    @property
    def v(self) -> int:
        """Virtual stages (chunks) per stage."""
        return getattr(self, "num_virtual_stages", 1)

    def get_num_virtual_stages(self) -> int:
        """``num_virtual_pipeline_stages`` (1 without interleaving; Paddle's method)."""
        return self.v

    def get_stage_from_index(self, layer_idx: int) -> int:
        """The stage a layer of ``layers`` belongs to (pre layers: 0, post layers: the last;
        with virtual stages, chunk ``k``'s layers are on stage ``k % P``)."""
        for part in range(len(self.segment_parts) - 1):
            if 0 <= layer_idx < self.segment_parts[part + 1]:
                return part % self.num_stages
        raise ValueError(
            f"layer_idx={layer_idx} is out of range; the model has {self.segment_parts[-1]} layers."
        )

    def place(self, mesh: jax.sharding.Mesh) -> PipelineLayer:
        """Lays the stacked parameters out on ``mesh`` and moves every parameter onto it.

        Sets each body parameter's ``out_sharding`` metadata to ``('pp', None, *inner)``
        (``inner``: the layer's own tensor-parallel layout; ``pp`` only when the mesh's
        ``pp`` size is ``num_stages``) and its ``mesh``, then places the model as its
        metadata says. Done at construction after ``fleet.init``, and by
        ``fleet.distributed_model``. Built inside a trace (created in its layout by
        :func:`~jfleet.mesh.create.create_placed`, or abstractly), it is only annotated: the
        enclosing program places what it makes.
        """
        self.annotate(mesh)
        leaves = jax.tree.leaves(nnx.state(self, nnx.Param))
        if not any(isinstance(x, jax.core.Tracer) for x in leaves):
            Placement(mesh=mesh).place_params(self)
        return self

    def annotate(self, mesh: jax.sharding.Mesh) -> None:
        """Sets the stage parameters' ``out_sharding`` and ``mesh`` metadata for ``mesh``."""
        if self.stages is not None:
            self.stages.annotate(mesh)
        else:
            stack.annotate_stack(self.body, mesh, self.num_stages)

    def run_pre(self, inputs: Any) -> Any:
        """The layers before the stacked body (none with stages of different layers)."""
        for run in self.pre:
            inputs = run(inputs)
        return inputs

    def run_body(self, x: Any) -> Any:
        """The body's layers in order: a ``lax.scan`` over the stacked parameters, or every
        stage of different layers in turn.

        ``x`` is an array or a pytree such as ``(hidden, mask, position_ids)`` that every
        body layer takes and returns.
        """
        if self.stages is not None:
            return self.stages(x, self.shared_layers, remat_interval=self.recompute_interval)
        return stack.run_stack(
            self.body, x, remat_interval=self.recompute_interval, chunk_sizes=self.chunk_sizes
        )

    def run_post(self, x: Any) -> Any:
        """The layers after the stacked body."""
        for run in self.post:
            x = run(x)
        return x

    def __call__(self, inputs: Any) -> Any:
        """The whole model, sequentially: pre, body, post (no loss)."""
        return self.run_post(self.run_body(self.run_pre(inputs)))

    def loss(self, inputs: Any, labels: Any, *, loss_fn_idx: int = 0) -> jax.Array:
        """``loss_fn(model(inputs), labels)`` run sequentially (the output cast to float32)."""
        return _loss_value(self._loss_fn(loss_fn_idx), self(inputs), labels)

    def pipeline_loss(
        self,
        inputs: Any,
        labels: Any,
        *,
        schedule: str = "1F1B",
        num_microbatches: int = 1,
        mesh: jax.sharding.Mesh | None = None,
        loss_fn_idx: int = 0,
        micro_losses: bool = False,
    ) -> Any:
        """The mean micro-batch loss with the stages pipelined over the mesh's ``pp`` axis.

        Stacked body: the pre layers run on the whole batch, then
        :func:`~jfleet.parallel.pipeline_schedule.pipeline_loss` with one stage = a scan
        over the stage's layers and the head = post layers + ``loss_fn``. Stages of
        different layers: the layers of stage 0 until the activation has the shape the
        stages exchange run first, and those of the last stage after it last has it run in
        the head (:func:`~jfleet.parallel.stages` buffers). Differentiate it with
        ``nnx.grad`` (the engine does): gradients reach every ``nnx.Param``, a loss
        module's included. The activation's integer / boolean leaves and its leaves that
        are not batch first travel to every stage and to the head (see the module docstring).

        Args:
          inputs: the first layer's input, batch first.
          labels: ``loss_fn``'s second argument, batch first.
          schedule: ``"1F1B"``, ``"FThenB"``, ``"VPP"`` or ``"ZBH1"``; with virtual
            stages ``"1F1B"`` runs ``"VPP"`` (as Paddle interleaves then).
          num_microbatches: micro-batches ``M``; each data-parallel replica's rows are
            split into ``M`` consecutive micro-batches.
          mesh: the mesh (default: the fleet's); its ``pp`` size must be ``num_stages``.
          loss_fn_idx: which of the loss functions.
          micro_losses: also return the ``[M]`` micro-batch losses (not differentiated).

        Returns:
          The float32 mean over micro-batches (and data-parallel replicas) of
          ``loss_fn(output, labels)``; with ``micro_losses``, ``(mean, losses)``.

        Raises:
          ValueError: no ``loss_fn``, a mesh whose ``pp`` size is not ``num_stages``,
            stages exchanging activations of different shapes, a tied layer inside a
            pipelined stage, and :func:`~jfleet.parallel.pipeline_schedule.pipeline_loss`'s
            errors.
          NotImplementedError: stages of different layers running tensor-parallel layers at
            ``mp > 1`` (split identical blocks evenly instead).
        """
        loss_fn = self._loss_fn(loss_fn_idx)
        schedule = virtual.pipeline_schedule_for(schedule, self.v)
        virtual.check_microbatches(schedule, self.num_stages, num_microbatches)
        mesh = layer_mesh(mesh)
        size = mesh.shape.get(PP, 1)
        if size != self.num_stages:
            raise ValueError(
                f"the PipelineLayer has num_stages={self.num_stages} but the mesh's {PP!r} axis "
                f"has size {size}; build it with num_stages={size} (pp_degree)."
            )
        parts = self._stage_parts(inputs, mesh)
        carried, side, shared = parts.carried, parts.side, parts.shared
        head_fn, head_params = _head_function(parts, loss_fn)
        stage_fn, stage_params = parts.stage_fn, parts.stage_params

        # On CPU half-precision values cross the pipeline in float32 (stack.widened_stage).
        wide = stack.widens_on(mesh)
        stage_fn, stage_params, carried_in = stack.widened_stage(
            stage_fn, stage_params, carried, mesh=mesh
        )
        run, extra = pipeline_schedule.pipeline_loss, {}
        if parts.stage_specs is not None:  # expert kernels stay split over ep in the stage
            extra["stage_specs"] = parts.stage_specs
        if schedule in virtual.TABLE_RUN:  # stage leaves [P, v, ...]: chunk c of each stage
            if extra:
                raise ValueError(
                    f"schedule={schedule!r} cannot run a body whose parameters stay split over "
                    f"{EP!r} in the stage (an MoELayer's experts); use schedule '1F1B' or "
                    "'FThenB' without virtual stages."
                )
            run, extra = pipeline_executor.table_pipeline_loss, {"num_virtual": self.v}
            stage_params = virtual.chunked(stage_params, self.v)
        pooled = _pooled_leaves(parts.split)
        if schedule == "FThenB" and any(pooled):
            extra["pooled"] = pooled  # router statistics summed over the micro-batches
        elif any(pooled) and num_microbatches > 1:
            _note_per_microbatch(schedule, num_microbatches)
        return run(
            stage_fn,
            stack.widened(head_fn, (head_params, carried), wide=wide),
            stage_params,
            stack.widen(head_params, wide),
            carried_in,
            (labels, side),  # the head rebuilds the body's output from its side leaves
            side,
            shared,
            mesh=mesh,
            schedule=schedule,
            num_microbatches=num_microbatches,
            micro_losses=micro_losses,
            **extra,
        )

    def _stage_parts(self, inputs: Any, mesh: jax.sharding.Mesh) -> _StageParts:
        """The stage function, its parameters and the activation's leaves, split for the
        schedule: from the per-stage buffers (stages of different layers) or the stacked
        body."""
        batch = jax.tree.leaves(inputs)[0].shape[0]
        if self.stages is not None:
            parts = self.stages.pipeline_parts(
                self.segment_parts, inputs, self.shared_layers, self._shared_at,
                remat_interval=self.recompute_interval, tensor_parallel=mesh.shape.get(MP, 1),
            )  # fmt: skip
            x, run_stage, stage_params, rows, post, tied, pre = parts
            first = stack.batch_first_leaves(pre, inputs)
            split, carried, side, shared = stack.stage_inputs(x, batch=batch, batch_first=first)

            def stage_fn(rows: Any, carried: Any, side: Any, shared: Any) -> list:
                return split.carried_of(run_stage(rows, split.activation_of(carried, side, shared)))
        else:
            x = self.run_pre(inputs)
            first = stack.batch_first_leaves(self.run_pre, inputs)
            split, carried, side, shared = stack.stage_inputs(x, batch=batch, batch_first=first)
            body_def, body_state, outputs = nnx.split(self.body, nnx.Param, ...)
            stage_params = nnx.to_pure_dict(body_state)
            specs = _stage_specs(body_state)
            # what the layers report (stack.CallOutput) lives in per-stage scratch copies
            scratch = nnx.to_pure_dict(outputs)
            scratch = jax.tree.map(lambda a: np.zeros(a.shape[1:], a.dtype), scratch)
            if not virtual.is_even(self.chunk_sizes):  # padded slots skipped exactly
                body_def, stage_params = stack.padded_stage(
                    self.body, stage_params, self.chunk_sizes, self.num_stages, mesh
                )
                scratch = {"unit": scratch}
                specs = specs and {"unit": specs, "real": P(PP)}
            stage_fn = _with_scratch(
                stack.stage_function(body_def, split, remat_interval=self.recompute_interval),
                scratch,
            )
            rows, tied = {}, self.post

            def post(rows: Any, out: Any, runs: Any) -> Any:
                for run in runs:
                    out = run(out)
                return out

            return _StageParts(
                stage_fn, stage_params, rows, post, tied, split, carried, side, shared, specs
            )
        return _StageParts(stage_fn, stage_params, rows, post, tied, split, carried, side, shared)

    def _loss_fn(self, idx: int) -> Callable[..., Any]:
        if not self.loss_fns:
            raise ValueError(
                "the PipelineLayer has no loss_fn; build it with PipelineLayer(..., "
                "loss_fn=lambda output, labels: scalar_loss)."
            )
        if not isinstance(idx, int) or not 0 <= idx < len(self.loss_fns):
            raise ValueError(
                f"loss_fn_idx={idx!r} is out of range: the PipelineLayer has "
                f"{len(self.loss_fns)} loss function(s)."
            )
        return self.loss_fns[idx]


# ------------------------------------------------------------------ running helpers
_NOTED: set[str] = set()


def _pooled_leaves(split: stack.StageInputs) -> tuple[bool, ...]:
    """Per carried leaf of the activation, whether it lies in a node whose class sets
    ``pooled_over_microbatches`` (router statistics,
    :class:`~jfleet.parallel.moe.load_stats.LoadStats`)."""
    kinds = split.act_kinds
    numbered = jax.tree.unflatten(split.activation, list(range(len(kinds))))
    marked = lambda node: getattr(type(node), "pooled_over_microbatches", False)  # noqa: E731
    inside = {
        i
        for node in jax.tree.leaves(numbered, is_leaf=marked)
        if marked(node)
        for i in jax.tree.leaves(node)
    }
    return tuple(i in inside for i, k in enumerate(kinds) if k == stack.CARRIED)


def _note_per_microbatch(schedule: str, num_microbatches: int) -> None:
    """Says once per schedule that the router statistics' loss is each micro-batch's."""
    if schedule in _NOTED:
        return
    _NOTED.add(schedule)
    logger.warning(
        "PipelineLayer: schedule=%r runs a backward before the last forward, so the MoE "
        "load-balancing loss of the activation's router statistics (LoadStats) is each of "
        "the %d micro-batches' values, averaged (gradient accumulation's value); "
        "schedule_mode='FThenB' gives the whole batch's, at the cost of keeping every "
        "micro-batch's activations until the backward",
        schedule,
        num_microbatches,
    )


def _loss_value(loss_fn: Callable[..., Any], output: Any, labels: Any) -> jax.Array:
    """The float32 scalar loss; a per-token loss (``ParallelCrossEntropy``'s) is averaged."""
    loss = loss_fn(cast_floating(output, jnp.float32), labels)
    loss = jnp.mean(loss) if jnp.ndim(loss) else loss
    return scalar_loss(loss, "loss_fn(output, labels)")


def _attr(node: Any, name: str) -> Any:
    return node[int(name)] if isinstance(node, nnx.List | list | tuple) else getattr(node, name)


def _check_layers(layers: Any) -> list[Any]:
    if isinstance(layers, nnx.Module) or not isinstance(layers, Sequence | nnx.List):
        raise TypeError(
            f"layers must be a list of LayerDesc / SharedLayerDesc / nnx.Module / functions; "
            f"got {type(layers).__name__}."
        )
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty; pass the model's layers as a list of LayerDesc.")
    bad = [
        f"{i}: {entry!r}"
        for i, entry in enumerate(layers)
        if not (isinstance(entry, LayerDesc | nnx.Module) or callable(entry))
    ]
    if bad:
        raise TypeError(
            "layers entries must be LayerDesc, SharedLayerDesc, nnx.Module or functions; "
            f"these are not: {'; '.join(bad)}."
        )
    return layers


def _check_loss_fns(loss_fn: Any) -> nnx.List:
    if loss_fn is None:
        return nnx.List([])
    fns = tuple(loss_fn) if isinstance(loss_fn, list | tuple) else (loss_fn,)
    bad = [repr(f) for f in fns if not callable(f)]
    if bad or not fns:
        raise TypeError(
            f"loss_fn={loss_fn!r} must be a callable loss_fn(output, labels) (or a list of them)."
        )
    classes = [f.__name__ for f in fns if isinstance(f, type)]
    if classes:
        raise TypeError(
            f"loss_fn={loss_fn!r} is a class ({', '.join(classes)}); pass an instance, "
            f"loss_fn={classes[0]}(), whose __call__(output, labels) returns the loss."
        )
    return nnx.List(list(fns))


def _resolve_stages(num_stages: Any, topology: Any) -> int:
    from_topology = None
    if topology is not None:
        if not hasattr(topology, "get_dim"):
            raise TypeError(
                f"topology={topology!r} is not a CommunicateTopology; pass "
                "fleet.get_hybrid_parallel_topology() or None."
            )
        from_topology = int(topology.get_dim("pipe"))
    if num_stages is None:
        if from_topology is not None:
            return from_topology
        run = _context.current()
        return run.hcg.get_pipe_parallel_world_size() if run is not None else 1
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r} must be an int >= 1.")
    if from_topology is not None and from_topology != num_stages:
        raise ValueError(
            f"num_stages={num_stages} disagrees with the topology's pipe degree "
            f"{from_topology}; pass one of them."
        )
    return num_stages


def _runs(layers: list[Any]) -> list[tuple[int, int]]:
    """Maximal runs ``(start, end)`` of identical consecutive plain ``LayerDesc``\\ s."""
    runs, i = [], 0
    while i < len(layers):
        if type(layers[i]) is not LayerDesc:
            i += 1
            continue
        j = i + 1
        while j < len(layers) and layers[i].same_as(layers[j]):
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _stacked_body(
    layers: list[Any], parts: list[int], built: list, num_stages: int
) -> tuple[int, int, tuple[int, ...]] | None:
    """The run of identical layers every stage holds some of, with its layers per chunk.

    A run ``(start, end)`` is the stacked body when the layers before it are on chunk 0,
    those after it on the last chunk (``parts[1] >= start``, ``parts[-2] <= end``), every
    stage (device: chunks ``s, s + P, ...``) holds at least one of its layers and they
    hold parameters. Chunk ``i`` then holds ``sizes[i]`` of them: equal sizes stack as
    before, others pad the stack (:func:`jfleet.parallel.stack.padded_stage`).
    """
    chunks = len(parts) - 1
    for start, end in sorted(_runs(layers), key=lambda r: (r[0] - r[1], r[0])):
        if parts[1] < start or parts[-2] > end:
            continue
        sizes = tuple(max(0, min(end, b) - max(start, a)) for a, b in itertools.pairwise(parts))
        if len(sizes) != chunks or sum(sizes) != end - start:
            continue
        if any(not sum(sizes[s::num_stages]) for s in range(num_stages)):
            continue
        if jax.tree.leaves(nnx.state(built[start][0], nnx.Param)):
            return start, end, sizes
    return None


def _log_flat(stages: FlatStages, parts: list[int], layers: list[Any]) -> None:
    """Says how the stages are held, and which ``seg_method`` would stack identical blocks."""
    hint = ""
    runs = [(a, b) for a, b in _runs(layers) if b - a >= stages.num_stages]
    if runs:
        a, b = max(runs, key=lambda r: r[1] - r[0])
        if (b - a) % stages.num_stages == 0:
            hint = (
                f"; seg_method='layer:^{layers[a].name}$' would split its {b - a} identical "
                f"{layers[a].name} layers evenly into one stacked body"
            )
    logger.info(
        "PipelineLayer: stages of different layers (boundaries %s) hold %s parameters; each "
        "device holds the largest stage's %d per dtype buffer%s",
        parts,
        list(stages.sizes),
        max(stages.sizes or (0,)),
        hint,
    )


class _StageParts(NamedTuple):
    """What ``PipelineLayer.pipeline_loss`` hands the schedule, besides the head."""

    stage_fn: Callable[..., Any]
    stage_params: Any
    rows: Any
    post: Callable[..., Any]
    tied: Any
    split: Any
    carried: Any
    side: Any
    shared: Any
    stage_specs: Any = None


def _stage_specs(params: nnx.State) -> Any:
    """Per stacked parameter, ``P(pp, ...)`` keeping the expert axis of its layout (an
    MoELayer's expert kernels stay split over ``ep`` inside the stage), or None when no
    parameter is split over ``ep``."""

    def one(var: Any) -> P:
        layout = tuple(var.get_metadata("out_sharding", None) or ())[1:]
        return P(
            PP, *(EP if e == EP or (isinstance(e, tuple) and EP in e) else None for e in layout)
        )

    flat = {path: one(var) for path, var in nnx.to_flat_state(params)}
    named = any(EP in tuple(s) for s in flat.values())
    return nnx.traversals.unflatten_mapping(flat) if named else None


def _with_scratch(stage_fn: Callable[..., Any], scratch: Any) -> Callable[..., Any]:
    """``stage_fn`` given the stage's parameters with zero ``scratch`` merged in: the
    stacked :class:`~jfleet.parallel.stack.CallOutput` state each layer overwrites."""
    if not jax.tree.leaves(scratch):
        return stage_fn
    flat_scratch = nnx.traversals.flatten_mapping(scratch)

    def run(params: Any, carried: Any, side: Any, shared: Any) -> Any:
        flat = {**nnx.traversals.flatten_mapping(params), **flat_scratch}
        return stage_fn(nnx.traversals.unflatten_mapping(flat), carried, side, shared)

    return run


def _head_function(parts: _StageParts, loss_fn: Callable[..., Any]) -> tuple[Callable, Any]:
    """The last stage's head (post layers + ``loss_fn``) as a function of its parameters,
    and those parameters."""
    head_def, head_state, head_rest = nnx.split(_Head(parts.tied, loss_fn), nnx.Param, ...)
    head_params = (parts.rows, nnx.to_pure_dict(head_state))
    whole = jax.lax.stop_gradient(parts.shared[: parts.split.num_shared])  # whole leaves
    split, post = parts.split, parts.post

    def head_fn(params: Any, y: list, target: tuple) -> jax.Array:
        (rows, pure), (labels, side) = params, target
        h = nnx.merge(head_def, pure, head_rest)
        out = post(rows, split.activation_of(y, side, whole), h.shared)
        return _loss_value(h.loss, out, labels)

    return head_fn, head_params

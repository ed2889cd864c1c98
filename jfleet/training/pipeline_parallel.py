"""Paddle's ``PipelineParallel``: a :class:`PipelineLayer` placed for the fleet, trained per batch.

``fleet.distributed_model(pipeline_layer)`` returns a :class:`PipelineParallel`. Its
:meth:`~PipelineParallel.train_batch` runs one step of the one training engine
(:class:`jfleet.engine.TrainStep`) whose loss is
:meth:`PipelineLayer.pipeline_loss <jfleet.parallel.pipeline_layer.PipelineLayer.pipeline_loss>`,
so AMP loss scaling, ZeRO, gradient clipping and buffer donation apply as for any model.
The strategy's ``pipeline_configs`` choose the schedule (``schedule_mode``: ``"1F1B"``,
``"FThenB"`` / ``"F-then-B"``, ``"VPP"`` (interleaved; the PipelineLayer needs
``num_virtual_pipeline_stages >= 2``, and then ``"1F1B"`` runs it too, as in Paddle),
``"ZBH1"`` (zero-bubble H1)) and the micro-batching: ``accumulate_steps`` micro-batches
of ``micro_batch_size`` rows per data-parallel replica, so a batch has
``micro_batch_size x accumulate_steps x (dp x sharding x ep)`` rows.

``train_batch(lr_scheduler=..., scaler=...)`` binds a ``GradScaler`` and applies a
scheduler's learning rate as every ``train_batch`` does
(:func:`jfleet.distributed_model.run_train_batch`).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 4, "pp_degree": 2}
  >>> s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> mse = lambda out, y: jnp.mean((out - y) ** 2)
  >>> net = PipelineLayer([LayerDesc(nnx.Linear, 4, 4)] * 4, loss_fn=mse)
  >>> model = fleet.distributed_model(net)
  >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
  >>> x, y = jnp.ones((16, 4)), jnp.zeros((16, 4))
  >>> first = model.train_batch((x, y), opt)
  >>> bool(model.train_batch((x, y), opt) < first)
  True
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import EP, PP
from jfleet.parallel.pipeline_layer import PipelineLayer
from jfleet.parallel.pipeline_schedule import SCHEDULES
from jfleet.parallel.virtual_stages import TABLE_RUN, check_microbatches, pipeline_schedule_for
from jfleet.training.distributed_model import DistributedModel, prepare_model, run_train_batch
from jfleet.training.distributed_optimizer import DistributedOptimizer
from jfleet.training.engine import EvalStep, TrainStep, cached_step

__all__ = ["PipelineParallel", "pipeline_model"]

#: Paddle's ``schedule_mode`` names jfleet does not run yet.
UNAVAILABLE_SCHEDULES = ("Eager1F1B", "ZBVPP")
_ALIASES = {"F-then-B": "FThenB"}


def resolve_schedule(name: Any) -> str:
    """The schedule :func:`~jfleet.parallel.pipeline_schedule.pipeline_loss` runs for a name.

    Raises:
      NotImplementedError: a Paddle schedule jfleet does not have yet (``"VPP"``...).
      ValueError: any other unknown name.

    Example:
      >>> resolve_schedule("F-then-B")
      'FThenB'
    """
    name = _ALIASES.get(name, name)
    if name in SCHEDULES or name in TABLE_RUN:
        return name
    available = [*SCHEDULES, *TABLE_RUN, *_ALIASES]
    if name in UNAVAILABLE_SCHEDULES:
        raise NotImplementedError(
            f"pipeline_configs['schedule_mode']={name!r} is not available in jfleet yet; "
            f"the available schedules are {available}."
        )
    raise ValueError(
        f"pipeline_configs['schedule_mode']={name!r} is not a pipeline schedule; use one of "
        f"{available}."
    )


class PipelineParallel(DistributedModel):
    """A :class:`PipelineLayer` placed on the mesh, with Paddle's ``train_batch`` / ``eval_batch``.

    Build it with ``fleet.distributed_model(pipeline_layer)``. Calling it runs the model
    sequentially (``PipelineLayer.__call__``); ``train_batch`` pipelines it.

    Attributes:
      module: the :class:`PipelineLayer`.
      placement: where the arrays live (mesh, ZeRO stage).
      micro_batch_size: rows per micro-batch per data-parallel replica.
      accumulate_steps: micro-batches per step (``M``).
      schedule: ``"1F1B"``, ``"FThenB"``, ``"VPP"`` or ``"ZBH1"`` (what runs).
    """

    def __init__(
        self,
        layers: PipelineLayer,
        placement: Placement,
        *,
        micro_batch_size: int = 1,
        accumulate_steps: int = 1,
        schedule: str = "1F1B",
    ) -> None:
        if not isinstance(layers, PipelineLayer):
            raise TypeError(f"PipelineParallel needs a PipelineLayer; got {type(layers).__name__}.")
        for name, value in (
            ("micro_batch_size", micro_batch_size),
            ("accumulate_steps", accumulate_steps),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"pipeline_configs['{name}']={value!r} must be an int >= 1.")
        super().__init__(layers, placement)
        self.micro_batch_size = micro_batch_size
        self.accumulate_steps = accumulate_steps
        self.schedule = pipeline_schedule_for(resolve_schedule(schedule), layers.v)
        check_microbatches(self.schedule, layers.num_stages, accumulate_steps)

    def parameters(self) -> list[Any]:
        """The PipelineLayer's ``parameters()`` (Paddle's order; stage-held ones as views)."""
        return self.module.parameters()

    @property
    def num_stages(self) -> int:
        """The pipeline stages (the ``pp`` degree)."""
        return self.module.num_stages

    def train_batch(
        self,
        data: Any,
        optimizer: DistributedOptimizer,
        lr_scheduler: Any = None,
        scaler: Any = None,
        loss_fn_idx: int = 0,
        return_micro_batch_loss: bool = False,
    ) -> jax.Array:
        """One pipelined training step on ``data``; returns the mean loss over micro-batches.

        Args:
          data: ``(inputs, labels)`` (Paddle's form), or a dict with ``"labels"`` and one
            other key (the inputs, e.g. ``"tokens"``). Batch first; ``micro_batch_size x
            accumulate_steps x (dp x sharding x ep)`` rows.
          optimizer: from ``fleet.distributed_optimizer``.
          lr_scheduler: a Paddle-style scheduler or an optax schedule whose learning rate
            the step applies (:func:`~jfleet.distributed_model.run_train_batch`).
          scaler: a ``jfleet.amp.GradScaler`` (fp16 loss scaling), or None.
          loss_fn_idx: which of the PipelineLayer's loss functions.
          return_micro_batch_loss: return each micro-batch's loss (``[accumulate_steps]``,
            the mean over data-parallel replicas) instead of their mean.

        Returns:
          The float32 mean loss (replicated), or the micro-batch losses.

        Raises:
          ValueError: a batch that is not ``micro_batch_size x accumulate_steps`` per
            replica (the message has the numbers), malformed ``data``.
          TypeError: a ``scaler`` or ``lr_scheduler`` of the wrong kind.
        """
        self.module._loss_fn(loss_fn_idx)
        batch = self._checked(data)
        micro = bool(return_micro_batch_loss)
        step = cached_step(TrainStep, _PipelineObjective(loss_fn_idx, micro), self.placement)
        loss = run_train_batch(
            self, step, batch, optimizer, lr_scheduler=lr_scheduler, scaler=scaler
        )
        return step.last_aux if micro else loss

    def eval_batch(self, data: Any, compute_loss: bool = False, loss_fn_idx: int = 0) -> Any:
        """The model's output on ``data`` (Paddle 3.x's default), or the mean loss.

        Args:
          data: as for :meth:`train_batch`.
          compute_loss: False: the last layer's output for every row (the model run
            sequentially, the compiler moving the stage weights); True: the mean loss
            over micro-batches (the schedule's forward loop over ``pp``).
          loss_fn_idx: which of the loss functions.

        Returns:
          The outputs, or a float32 scalar.
        """
        batch = self._checked(data, check_rows=compute_loss)
        if compute_loss:
            self.module._loss_fn(loss_fn_idx)
            return cached_step(EvalStep, _PipelineObjective(loss_fn_idx), self.placement)(
                self, batch
            )
        step = cached_step(EvalStep, _outputs, self.placement)
        step(self, batch)
        return step.last_aux

    def _checked(self, data: Any, *, check_rows: bool = True) -> tuple[Any, Any]:
        inputs, labels = split_data(data)
        if check_rows:
            self._check_rows(inputs)
        return inputs, labels

    def _check_rows(self, inputs: Any) -> None:
        leaves = jax.tree.leaves(inputs)
        if not leaves or not jnp.shape(leaves[0]):
            raise ValueError("the inputs need a leading batch dimension.")
        rows = jnp.shape(leaves[0])[0]
        if jax.process_count() > 1 and not isinstance(leaves[0], jax.Array):
            rows *= jax.process_count()  # each process passes its part
        mbs, acc = self.micro_batch_size, self.accumulate_steps
        dp = self.placement.data_parallel_size
        if rows == mbs * acc * dp:
            return
        if dp == 1:
            where = f"the batch size {rows}"
        else:
            shape = self.placement.mesh.shape
            axes = " x ".join(
                f"{a} {shape[a]}" for a in self.placement.data_axes if a != EP or shape[a] > 1
            )
            per = f"{rows // dp}" if rows % dp == 0 else f"{rows / dp:g}"
            where = (
                f"the batch size per data-parallel replica, {per} (a batch of {rows} rows over "
                f"{axes} = {dp} replicas)"
            )
        raise ValueError(
            f"pipeline_configs micro_batch_size={mbs} x accumulate_steps={acc} = {mbs * acc} "
            f"must equal {where}; pass batches of {mbs * acc * dp} rows or change "
            "strategy.pipeline_configs."
        )


def split_data(data: Any) -> tuple[Any, Any]:
    """``(inputs, labels)`` from Paddle's tuple or a dict with ``"labels"`` and one other key.

    Example:
      >>> split_data({"tokens": 1, "labels": 2})
      (1, 2)
    """
    if isinstance(data, dict):
        others = [k for k in data if k != "labels"]
        if "labels" in data and len(others) == 1:
            return data[others[0]], data["labels"]
        raise ValueError(
            f"data is a dict with keys {sorted(map(str, data))}; pass (inputs, labels) or a dict "
            "with 'labels' and one other key holding the inputs (e.g. 'tokens')."
        )
    if isinstance(data, tuple | list) and len(data) == 2:
        return data[0], data[1]
    raise ValueError(
        f"data must be (inputs, labels) or a dict with 'labels' and the inputs; got "
        f"{type(data).__name__}{f' of length {len(data)}' if hasattr(data, '__len__') else ''}."
    )


# ------------------------------------------------------------------ engine steps
def _pipeline_objective(
    model: PipelineParallel, batch: Any, *, loss_fn_idx: int, micro: bool = False
) -> Any:
    inputs, labels = batch
    return model.module.pipeline_loss(
        inputs,
        labels,
        schedule=model.schedule,
        num_microbatches=model.accumulate_steps,
        mesh=model.placement.mesh,
        loss_fn_idx=loss_fn_idx,
        micro_losses=micro,
    )


def _outputs(model: PipelineParallel, batch: Any) -> tuple[jax.Array, Any]:
    return jnp.zeros((), jnp.float32), model.module(batch[0])


@dataclasses.dataclass(frozen=True)
class _PipelineObjective:
    """The engine's loss function for loss function ``loss_fn_idx`` (with ``micro``: ``(loss,
    micro-batch losses)``); equal ones share a step."""

    loss_fn_idx: int
    micro: bool = False

    def __call__(self, model: PipelineParallel, batch: Any) -> Any:
        return _pipeline_objective(model, batch, loss_fn_idx=self.loss_fn_idx, micro=self.micro)


# ------------------------------------------------------------------ fleet entry
def pipeline_model(model: Any, strategy: Any, placement: Placement) -> PipelineParallel:
    """``fleet.distributed_model`` for a pipeline: checks, AMP / recompute / placement, wrap.

    Raises:
      TypeError: ``model`` is not a :class:`PipelineLayer` (with ``pp_degree > 1``).
      ValueError: ``num_stages`` is not the ``pp`` degree; bad ``pipeline_configs``.
      NotImplementedError: a Paddle schedule jfleet does not have yet.
      ValueError: a schedule that does not fit the virtual stages (``"VPP"`` without them,
        ``"FThenB"`` / ``"ZBH1"`` with them), VPP with ``accumulate_steps`` not a multiple
        of the ``pp`` degree.
    """
    pp = placement.mesh.shape.get(PP, 1)
    if not isinstance(model, PipelineLayer):
        raise TypeError(
            f"pp_degree={pp} needs the model as a PipelineLayer, got "
            f"{type(model).__name__}: describe it as PipelineLayer([LayerDesc(Embedding, ...), "
            "LayerDesc(Block, ...), ..., LayerDesc(Head, ...)], loss_fn=...) (from "
            "jfleet.fleet.meta_parallel); or keep the plain model and let "
            "jfleet.to_distributed(model, optimizer, loader, config=ToDistributedConfig("
            f"force_mesh={{'pp': {pp}, ...}})) pipeline its repeated blocks; or set pp_degree=1."
        )
    if model.num_stages != pp:
        raise ValueError(
            f"the PipelineLayer was built with num_stages={model.num_stages}, but the fleet's "
            f"pp_degree is {pp}; build it with num_stages={pp} (or num_stages=None after "
            "fleet.init)."
        )
    configs = strategy.pipeline_configs if strategy is not None else {}
    schedule = resolve_schedule(configs.get("schedule_mode", "1F1B"))
    # a PipelineLayer built before fleet.init (or inside LazyGuard) has no layout yet
    wrapped = prepare_model(model, strategy, placement, shape=lambda m: m.annotate(placement.mesh))
    return PipelineParallel(
        wrapped.module,
        wrapped.placement,
        micro_batch_size=int(configs.get("micro_batch_size", 1)),
        accumulate_steps=int(configs.get("accumulate_steps", 1)),
        schedule=schedule,
    )

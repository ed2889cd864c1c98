"""``fleet.distributed_model``: place a model for the strategy, wrap it for ``train_batch``.

``distributed_model(model)`` applies the strategy's model-side settings to an NNX
model and places its variables on the mesh:

  * AMP (``strategy.amp``): compute dtype per module class, fp16/bf16 parameters for O2;
  * recompute (``strategy.recompute``): named sub-modules run under ``jax.checkpoint``;
  * QAT (``strategy.qat``): projections fake-quantise weights and inputs
    (:mod:`jfleet.quantization`);
  * batch norm (``strategy.sync_batch_norm``): ``nnx.BatchNorm`` statistics per
    data-parallel replica (off, Paddle's default) or over the global batch (on); see
    :mod:`jfleet.batch_norm`;
  * placement: parameters replicated for data parallel, sharded over the
    ``sharding`` axis for ZeRO stage 3, laid out by their ``out_sharding``
    metadata for tensor parallel.

It returns a :class:`DistributedModel`, an ``nnx.Module`` that holds the model as
``.module``, forwards calls to it, and trains through the engine with
:meth:`DistributedModel.train_batch`.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True)
  >>> model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
  >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))}
  >>> loss = model.train_batch(batch, opt, loss_fn=loss_fn)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jfleet.mesh.create import create_placed
from jfleet.mesh.lazy import unbuilt
from jfleet.mesh.placement import Placement
from jfleet.optim.compiler import amp_settings
from jfleet.parallel.recompute import apply_recompute
from jfleet.precision.amp import apply_amp
from jfleet.precision.batch_norm import apply_batch_norm
from jfleet.precision.quantization import QatConfig, quantize_model
from jfleet.training.distributed_optimizer import DistributedOptimizer, check_scheduler
from jfleet.training.engine import EvalStep, LossFn, TrainStep, cached_step


class DistributedModel(nnx.Module):
    """An NNX model placed for a parallel plan, with Paddle's ``train_batch`` / ``eval_batch``.

    Calls go to the wrapped module. Inside your own ``@nnx.jit`` step pass the
    ``DistributedModel`` (or ``.module``) consistently with the optimizer.

    Example:
      >>> import optax
      >>> from jfleet import fleet
      >>> from jfleet.models import TinyLM, lm_batches, lm_loss
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> model = fleet.distributed_model(TinyLM())
      >>> isinstance(model, DistributedModel), type(model.module).__name__
      (True, 'TinyLM')
    """

    def __init__(self, module: nnx.Module, placement: Placement) -> None:
        self.module = module
        self.placement = placement

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def train_batch(
        self,
        batch: Any,
        optimizer: DistributedOptimizer,
        loss_fn: LossFn | None = None,
        lr_scheduler: Any = None,
        scaler: Any = None,
    ) -> jax.Array:
        """One training step on ``batch`` through the engine; returns the fp32 loss.

        Args:
          batch: a pytree of arrays whose leading dimension is the global batch
            (divisible by dp x sharding x ep).
          optimizer: from ``fleet.distributed_optimizer``.
          loss_fn: ``loss_fn(model, batch)`` returning a scalar or ``(loss, aux)``.
          lr_scheduler: a Paddle-style scheduler (``jfleet.optim.lr``) or an optax
            schedule; its learning rate is applied (see :func:`run_train_batch`).
          scaler: a ``jfleet.amp.GradScaler``: fp16 loss scaling for this optimizer.
        """
        if loss_fn is None:
            raise TypeError("train_batch needs loss_fn=loss_fn(model, batch) -> loss.")
        step = cached_step(TrainStep, loss_fn, self.placement)
        return run_train_batch(
            self, step, batch, optimizer, lr_scheduler=lr_scheduler, scaler=scaler
        )

    def eval_batch(
        self, batch: Any, loss_fn: LossFn | None = None, compute_loss: bool | None = None
    ) -> Any:
        """Evaluates ``batch`` without updating anything: the loss, or the model's outputs.

        ``compute_loss=False`` returns the outputs of the model on the batch's inputs
        (``batch[0]`` of Paddle's ``[inputs, labels]`` pair, else the whole batch);
        ``compute_loss=True`` returns ``loss_fn(model, batch)``. The default (``None``)
        is the loss when a ``loss_fn`` is given, else the outputs, which is Paddle 3.x's
        ``eval_batch(data)`` default (``compute_loss=False``).

        Raises:
          TypeError: ``compute_loss=True`` without a ``loss_fn``.
        """
        if compute_loss is None:
            compute_loss = loss_fn is not None
        if not compute_loss:
            step = cached_step(EvalStep, _forward, self.placement)
            step(self, batch)
            return step.last_aux
        if loss_fn is None:
            raise TypeError(
                "eval_batch(compute_loss=True) needs loss_fn=loss_fn(model, batch) -> loss; "
                "pass one, or compute_loss=False for the model's outputs."
            )
        step = cached_step(EvalStep, loss_fn, self.placement)
        return step(self, batch)


def _forward(model: nnx.Module, batch: Any) -> tuple[float, Any]:
    """``eval_batch(compute_loss=False)``: the outputs on the batch's inputs, as the aux."""
    inputs = batch[0] if isinstance(batch, tuple | list) else batch
    return 0.0, model(inputs)


def run_train_batch(
    model: nnx.Module,
    step: Any,
    batch: Any,
    optimizer: DistributedOptimizer,
    *,
    lr_scheduler: Any = None,
    scaler: Any = None,
) -> jax.Array:
    """One ``train_batch`` step: binds the scaler, applies the scheduler's learning rate,
    runs ``step(model, optimizer, batch)``, then steps the scheduler.

    The one place where ``train_batch`` (this module's and the pipeline's) meets a
    scaler and a scheduler:

    * ``scaler`` (a ``jfleet.amp.GradScaler``) attaches its loss-scale transform to the
      optimizer before its state is made (an optimizer created without an fp16
      strategy); see :meth:`GradScaler.attach`.
    * ``lr_scheduler``: Paddle semantics, the update of a step applies the scheduler's
      current learning rate (``last_lr``), then ``lr_scheduler.step()`` is called. A
      Paddle-style object has ``step()`` and ``last_lr`` (or ``__call__()``); an optax
      schedule is a callable of the update count (``optax.cosine_decay_schedule(...)``),
      evaluated at the optimizer's count. The value is written into the optimizer
      state (no recompile), so ``optimizer.get_lr()`` reads back the rate of the next
      step. The optimizer's learning rate must be readable
      (``jfleet.optim.hyperparams.adam``). Without ``lr_scheduler``, a scheduler given
      to ``optimizer.set_lr_scheduler`` is applied (and not stepped: you step it).

    Raises:
      TypeError: ``lr_scheduler`` is neither kind, ``scaler`` not a ``GradScaler``.
      ValueError: see ``GradScaler.attach`` and ``DistributedOptimizer.set_lr``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jfleet import fleet
      >>> from jfleet.training.engine import TrainStep
      >>> from jfleet.optim import hyperparams, lr
      >>> _ = fleet.init(is_collective=True)
      >>> model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
      >>> opt = fleet.distributed_optimizer(hyperparams.sgd(1.0))
      >>> sched = lr.StepDecay(0.1, step_size=1, gamma=0.5)
      >>> step = TrainStep(lambda m, b: jnp.mean(m(b) ** 2), model.placement)
      >>> _ = run_train_batch(model, step, jnp.ones((8, 4)), opt, lr_scheduler=sched)
      >>> sched.last_epoch, round(opt.get_lr(), 6)
      (1, 0.05)
    """
    if scaler is not None:
        from jfleet.precision.grad_scaler import GradScaler

        if not isinstance(scaler, GradScaler):
            raise TypeError(
                f"train_batch(scaler={scaler!r}): expected a jfleet.amp.GradScaler (Paddle's "
                "paddle.amp.GradScaler), e.g. scaler=jfleet.amp.GradScaler()."
            )
        scaler.attach(optimizer)
    if lr_scheduler is not None:
        check_scheduler(lr_scheduler, f"train_batch(lr_scheduler={lr_scheduler!r})")
    optimizer.apply_lr_scheduler(lr_scheduler)  # also one set with set_lr_scheduler
    loss = step(model, optimizer, batch)
    if lr_scheduler is not None:
        if callable(getattr(lr_scheduler, "step", None)):
            lr_scheduler.step()
        optimizer.apply_lr_scheduler(lr_scheduler)
    return loss


def apply_strategy_amp(model: nnx.Module, strategy: Any) -> nnx.Module:
    """The strategy's AMP policy (``amp``, ``amp_configs``) applied to ``model`` in place:
    compute dtypes, and at O2 half-precision parameters (:func:`jfleet.amp.apply_amp`).
    Nothing without ``strategy.amp``. Returns ``model``.

    Example:
      >>> from flax import nnx
      >>> from jfleet import DistributedStrategy
      >>> strategy = DistributedStrategy()
      >>> strategy.amp, strategy.amp_configs = True, {"use_pure_bf16": True}
      >>> apply_strategy_amp(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), strategy).kernel.dtype
      dtype(bfloat16)
    """
    settings = amp_settings(strategy) if strategy.amp else None
    if settings is None:
        return model
    return apply_amp(
        model,
        dtype=settings.dtype,
        level=settings.level,
        custom_white_list=tuple(strategy.amp_configs["custom_white_list"]),
        custom_black_list=tuple(strategy.amp_configs["custom_black_list"]),
    )


def apply_model_settings(model: nnx.Module, strategy: Any) -> nnx.Module:
    """The strategy's model-side settings, in place: AMP dtypes (``amp``), recompute, QAT
    fake quantisation (``qat``, :mod:`jfleet.quantization`).

    The same call a single-device reference run uses to build the identical model.
    """
    if strategy.amp:
        apply_strategy_amp(model, strategy)
    if strategy.recompute:
        configs = strategy.recompute_configs
        apply_recompute(
            model, configs["checkpoints"], enable_offload=bool(configs["enable_offload"])
        )
    if strategy.qat:  # after recompute, which finds its checkpoints by the layers' class names
        quantize_model(model, QatConfig.from_strategy(strategy))
    return model


def apply_distributed_settings(model: nnx.Module, strategy: Any, plan: Placement) -> nnx.Module:
    """:func:`apply_model_settings`, then the settings that depend on the mesh: batch-norm
    statistics per data-parallel replica unless ``strategy.sync_batch_norm`` (no strategy:
    Paddle's default, per replica). In place; returns ``model``."""
    if strategy is not None:
        apply_model_settings(model, strategy)
    sync = bool(getattr(strategy, "sync_batch_norm", False))
    return apply_batch_norm(model, sync=sync, mesh=plan.mesh, data_axes=plan.data_axes)


def prepare_model(
    model: nnx.Module | Callable[[], nnx.Module],
    strategy: Any,
    plan: Placement,
    shape: Callable[[nnx.Module], None] | None = None,
) -> DistributedModel:
    """Applies the strategy's model settings (:func:`apply_distributed_settings`), places the
    model, wraps it.

    ``model`` may be unbuilt (a :class:`~jfleet.mesh.lazy.LazyGuard` model, or a function
    that builds one): it is then created directly in its layout
    (:func:`~jfleet.mesh.create.create_placed`). ``shape`` annotates or restructures the
    built model for its layout first (a pipeline's stage layout).
    """
    if isinstance(model, DistributedModel):
        raise ValueError("the model is already a DistributedModel; pass it on as it is.")
    factory = unbuilt(model, "fleet.distributed_model")
    if factory is not None:

        def build() -> nnx.Module:
            made = factory()
            _check_module(made, f"the model factory {factory!r} returned a ")
            if shape is not None:
                shape(made)
            apply_distributed_settings(made, strategy, plan)
            return made

        return DistributedModel(create_placed(build, plan), plan)
    _check_module(model, "model=")
    if shape is not None:
        shape(model)
    apply_distributed_settings(model, strategy, plan)
    plan.place_params(model)
    return DistributedModel(model, plan)


def _check_module(model: Any, what: str) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"{what}{type(model).__name__}, not a flax.nnx.Module; jfleet distributes NNX "
            "modules (or a function that builds one, or a model built inside "
            "jfleet.LazyGuard())."
        )

"""``fleet.distributed_model``: place a model for the strategy, wrap it for ``train_batch``.

``distributed_model(model)`` applies the strategy's model-side settings to an NNX
model and places its variables on the mesh:

  * AMP (``strategy.amp``): compute dtype per module class, fp16/bf16 parameters for O2;
  * recompute (``strategy.recompute``): named sub-modules run under ``jax.checkpoint``;
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

from typing import Any

import jax
from flax import nnx

from jfleet.amp import apply_amp
from jfleet.distributed_optimizer import DistributedOptimizer
from jfleet.engine import EvalStep, LossFn, TrainStep, cached_step
from jfleet.optim.compiler import amp_settings
from jfleet.placement import Placement
from jfleet.recompute import apply_recompute


class DistributedModel(nnx.Module):
    """An NNX model placed for a parallel plan, with Paddle's ``train_batch`` / ``eval_batch``.

    Calls go to the wrapped module. Inside your own ``@nnx.jit`` step pass the
    ``DistributedModel`` (or ``.module``) consistently with the optimizer.
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
    ) -> jax.Array:
        """One training step on ``batch`` through the engine; returns the fp32 loss.

        Args:
          batch: a pytree of arrays whose leading dimension is the global batch
            (divisible by dp x sharding).
          optimizer: from ``fleet.distributed_optimizer``.
          loss_fn: ``loss_fn(model, batch)`` returning a scalar or ``(loss, aux)``.
        """
        if loss_fn is None:
            raise TypeError("train_batch needs loss_fn=loss_fn(model, batch) -> loss.")
        step = cached_step(TrainStep, loss_fn, self.placement)
        return step(self, optimizer, batch)

    def eval_batch(self, batch: Any, loss_fn: LossFn | None = None) -> jax.Array:
        """The loss on ``batch`` without updating anything."""
        if loss_fn is None:
            raise TypeError("eval_batch needs loss_fn=loss_fn(model, batch) -> loss.")
        step = cached_step(EvalStep, loss_fn, self.placement)
        return step(self, batch)


def apply_model_settings(model: nnx.Module, strategy: Any) -> nnx.Module:
    """The strategy's model-side settings, in place: AMP dtypes (``amp``), recompute.

    The same call a single-device reference run uses to build the identical model.
    """
    if strategy.amp:
        settings = amp_settings(strategy)
        apply_amp(
            model,
            dtype=settings.dtype,
            level=settings.level,
            custom_white_list=tuple(strategy.amp_configs["custom_white_list"]),
            custom_black_list=tuple(strategy.amp_configs["custom_black_list"]),
        )
    if strategy.recompute:
        configs = strategy.recompute_configs
        apply_recompute(
            model, configs["checkpoints"], enable_offload=bool(configs["enable_offload"])
        )
    return model


def prepare_model(model: nnx.Module, strategy: Any, plan: Placement) -> DistributedModel:
    """Applies the strategy's AMP and recompute settings, places the model, wraps it."""
    if isinstance(model, DistributedModel):
        raise ValueError("the model is already a DistributedModel; pass it on as it is.")
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model={type(model).__name__} is not a flax.nnx.Module; jfleet distributes NNX "
            "modules."
        )
    if strategy is not None:
        apply_model_settings(model, strategy)
    plan.place_params(model)
    return DistributedModel(model, plan)

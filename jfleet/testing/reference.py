"""The same training on one device: what every parallel mode is checked against.

:func:`train_one_device` runs a plain ``nnx.jit`` step (no mesh, no engine) with the
strategy's model-side settings (AMP dtypes, recompute) and meta-optimizer chain when a
strategy is given, scaling the loss for fp16 as the engine does. A parallel run of the
same model, optimizer, strategy and batches must give the same losses and parameters
within the precision's tolerance.

Example:
  >>> import optax
  >>> from jfleet.models import TinyLM, lm_batches, lm_loss
  >>> losses, params = train_one_device(TinyLM(), optax.sgd(0.5), lm_batches(2), lm_loss)
  >>> losses.shape, bool(losses[1] < losses[0])
  ((2,), True)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jfleet.optim.compiler import amp_settings, compile_strategy
from jfleet.optim.loss_scale import loss_scale_of
from jfleet.training.distributed_model import apply_model_settings
from jfleet.training.strategy import DistributedStrategy

__all__ = ["train_one_device"]


def train_one_device(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    batches: Iterable[Any],
    loss_fn: Callable[[nnx.Module, Any], jax.Array],
    *,
    strategy: DistributedStrategy | None = None,
) -> tuple[np.ndarray, nnx.State]:
    """Trains ``model`` in place on the first device, one step per batch.

    Args:
      model: the model, built as the parallel run builds it (same seed).
      tx: the optimizer; with ``strategy``, wrapped in the strategy's meta-optimizers.
      batches: pytrees of arrays (NumPy or JAX), each a whole global batch.
      loss_fn: ``loss_fn(model, batch) -> scalar``.
      strategy: the parallel run's strategy, for its AMP, recompute and meta-optimizers
        (its hybrid degrees are ignored); None: plain ``tx``.

    Returns:
      The float losses of the steps, and the model's parameters after them.

    Example:
      >>> import optax
      >>> from jfleet.models import TinyLM, lm_batches, lm_loss
      >>> losses, params = train_one_device(TinyLM(), optax.sgd(0.5), lm_batches(2), lm_loss)
      >>> losses.shape
      (2,)
    """
    scaled = False
    if strategy is not None:
        apply_model_settings(model, strategy)
        amp = amp_settings(strategy)
        scaled = bool(amp and amp.loss_scaling)
        tx = compile_strategy(tx, strategy).tx
    with jax.default_device(jax.devices()[0]):
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model: nnx.Module, opt: nnx.Optimizer, batch: Any) -> jax.Array:
            scale = loss_scale_of(nnx.as_pure(opt.opt_state)) if scaled else 1.0

            def objective(m: nnx.Module) -> tuple[jax.Array, jax.Array]:
                loss = jnp.asarray(loss_fn(m, batch)).astype(jnp.float32)
                return loss * scale, loss

            grads, loss = nnx.grad(objective, has_aux=True)(model)
            opt.update(model, grads)
            return loss

        losses = [float(step(model, opt, jax.tree.map(jnp.asarray, b))) for b in batches]
    return np.array(losses), nnx.state(model, nnx.Param)

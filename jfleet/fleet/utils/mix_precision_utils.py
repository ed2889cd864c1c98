"""Paddle's ``fleet.utils.mix_precision_utils``: fp32 master gradients and weights for
half-precision (O2) parameters.

Paddle's trainers pair ``paddle.amp.decorate(level="O2")`` (half parameters) with these
three wrappers so that gradients accumulate and the optimizer updates in float32
(``main_grad``). jfleet does the same with one Optax transform,
:func:`jfleet.optim.master_weights.master_weights`, which casts half gradients to
float32 and keeps fp32 masters of the half parameters:

- :class:`MixPrecisionLayer` returns the model itself (nothing to attach: no
  ``main_grad`` buffers; the float32 gradient is formed in the optimizer);
- :class:`MixPrecisionOptimizer` returns ``master_weights(optimizer)``;
- :class:`MixPrecisionScaler` returns the :class:`~jfleet.amp.GradScaler` itself (it
  unscales the gradient the optimizer receives, whatever its dtype).

Example:
  >>> import jax.numpy as jnp, optax
  >>> tx = MixPrecisionOptimizer(optax.sgd(0.5))
  >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
  >>> updates, _ = tx.update({"w": jnp.full(2, 2**-9, jnp.bfloat16)}, tx.init(params), params)
  >>> updates["w"].dtype
  dtype('float32')
"""

from __future__ import annotations

from typing import Any

import optax
from flax import nnx

from jfleet.optim.master_weights import master_weights
from jfleet.precision.amp import GradScaler

__all__ = ["MixPrecisionLayer", "MixPrecisionOptimizer", "MixPrecisionScaler"]

_DTYPES = ("float16", "bfloat16")


class MixPrecisionLayer:
    """``MixPrecisionLayer(layers, dtype)``: returns ``layers`` itself (see the module doc).

    Raises:
      TypeError: ``layers`` is not an ``nnx.Module``.
      ValueError: ``dtype`` is not ``"float16"`` or ``"bfloat16"``.
    """

    def __new__(cls, layers: nnx.Module, dtype: str = "float16") -> Any:
        if not isinstance(layers, nnx.Module):
            raise TypeError(
                f"MixPrecisionLayer(layers={type(layers).__name__}): expected the nnx.Module "
                "model (cast it to half precision first with jfleet.amp.decorate(level='O2'))."
            )
        if dtype not in _DTYPES:
            raise ValueError(
                f"MixPrecisionLayer(dtype={dtype!r}): expected one of {list(_DTYPES)}, the "
                "half-precision dtype the parameters were cast to."
            )
        return layers


class MixPrecisionOptimizer:
    """``MixPrecisionOptimizer(optimizer)``: the optimizer run on fp32 master weights.

    Args:
      optimizer: an ``optax.GradientTransformation`` (an ``nnx.Optimizer``'s ``tx`` is
        taken).

    Returns:
      ``master_weights(optimizer)``: pass it to ``fleet.distributed_optimizer`` (a
      strategy with ``use_pure_fp16`` / ``use_pure_bf16`` adds the same transform
      itself, so use one or the other).

    Raises:
      TypeError: not an Optax transformation.
    """

    def __new__(cls, optimizer: Any) -> Any:
        if isinstance(optimizer, nnx.Optimizer):
            optimizer = optimizer.tx
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(
                f"MixPrecisionOptimizer(optimizer={optimizer!r}): expected an optax "
                "GradientTransformation such as optax.adamw(1e-4)."
            )
        return master_weights(optimizer)


class MixPrecisionScaler:
    """``MixPrecisionScaler(scaler)``: returns the :class:`~jfleet.amp.GradScaler` itself.

    Raises:
      TypeError: ``scaler`` is not a GradScaler.
    """

    def __new__(cls, scaler: GradScaler) -> Any:
        if not isinstance(scaler, GradScaler):
            raise TypeError(
                f"MixPrecisionScaler(scaler={scaler!r}): expected a jfleet.amp.GradScaler."
            )
        return scaler

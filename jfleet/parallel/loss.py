"""The loss a step or a pipeline's last stage computes: float32 outputs, one scalar check.

Both the training engine and the pipeline executors call these, so a loss is checked and
cast the same way wherever it is computed.

Example:
  >>> import jax.numpy as jnp
  >>> out = cast_floating(jnp.ones(2, jnp.bfloat16), jnp.float32)
  >>> float(scalar_loss(out.sum(), "loss_fn"))
  2.0
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts every floating array in ``tree`` to ``dtype``; other leaves are unchanged.

    Use it to bring half-precision model outputs to float32 before the loss.

    Args:
        tree: a pytree (arrays, scalars, ``None``...).
        dtype: the target floating dtype, e.g. ``jnp.float32``.

    Returns:
        The tree with floating leaves cast.

    Example:
        >>> out = cast_floating({"y": jnp.ones(2, jnp.bfloat16), "n": jnp.arange(2)}, jnp.float32)
        >>> out["y"].dtype, out["n"].dtype
        (dtype('float32'), dtype('int32'))
    """

    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def scalar_loss(loss: Any, what: str) -> jax.Array:
    """``loss`` as a float32 scalar: the one loss check of every step and pipeline.

    Raises:
      ValueError: ``loss`` is not a scalar; ``what`` names who returned it.

    Example:
      >>> scalar_loss(3, "loss_fn").dtype
      dtype('float32')
    """
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(
            f"{what} returned a loss of shape {loss.shape}; it must be a scalar "
            "(reduce it with .mean() or .sum())."
        )
    return loss.astype(jnp.float32)

"""Gradient clipping with Paddle's names: by global norm, by norm, by value.

``paddle.nn.ClipGradByGlobalNorm(clip_norm)`` scales every gradient by
``clip_norm / max(global_norm, clip_norm)``: nothing changes while the global norm is at
most ``clip_norm``. Paddle's hybrid-parallel version (``HybridParallelClipGrad``) applies
``clip_norm / (max(global_norm, clip_norm) + 1e-6)`` *always*, so gradients below the
threshold are still shrunk by a factor ``clip_norm / (clip_norm + 1e-6)``; its global
norm was also repeatedly wrong under hybrid parallelism (Paddle PRs 35691, 36555, 65259,
74409). jfleet copies neither: there is no epsilon, no clipping at or below the
threshold, and the norm is computed over the global (SPMD) arrays, so on any mesh and
with any shardings it is the single-device norm; XLA inserts the reductions.

Squares of float16 / bfloat16 gradients are summed in float32 (as Paddle does); the
scale factor is cast back to each gradient's dtype.

Example:
    >>> import jax.numpy as jnp
    >>> tx = clip_by_global_norm(1.0)
    >>> g = {"a": jnp.array([3.0]), "b": jnp.array([4.0])}
    >>> u, _ = tx.update(g, tx.init(g))
    >>> [round(float(u[k][0]), 4) for k in ("a", "b")]
    [0.6, 0.8]
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "ClipGradByGlobalNorm",
    "ClipGradByNorm",
    "ClipGradByValue",
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "global_norm",
]


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a positive float.")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} must be finite and > 0.")
    return float(value)


def _sum_dtype(x: jax.Array) -> jnp.dtype:
    return jnp.promote_types(x.dtype, jnp.float32)


def _sum_squares(x: jax.Array) -> jax.Array:
    x = x.astype(_sum_dtype(x))
    return jnp.sum(jnp.real(x * jnp.conj(x)))


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves of ``tree`` together (float32 at least).

    Over global arrays, so the result does not depend on the mesh or the shardings.

    Args:
        tree: a pytree of arrays.

    Returns:
        A scalar.

    Example:
        >>> import jax.numpy as jnp
        >>> float(global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
        5.0
    """
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(_sum_squares(x) for x in leaves))


def _scale(x: jax.Array, factor: jax.Array) -> jax.Array:
    return (x.astype(_sum_dtype(x)) * factor).astype(x.dtype)


def clip_by_global_norm(clip_norm: float) -> optax.GradientTransformation:
    """Scales all gradients by ``clip_norm / max(global_norm, clip_norm)``.

    Args:
        clip_norm: the largest global norm let through, > 0.

    Returns:
        An ``optax.GradientTransformation`` (state ``optax.EmptyState``).

    Raises:
        ValueError, TypeError: ``clip_norm`` is not a finite positive number.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = clip_by_global_norm(10.0)
        >>> u, _ = tx.update(jnp.array([3.0, 4.0]), tx.init(None))
        >>> u.tolist()
        [3.0, 4.0]
    """
    c = _check_positive("clip_norm", clip_norm)

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        norm = global_norm(updates)
        factor = jnp.where(norm > c, c / jnp.maximum(norm, c), 1.0).astype(norm.dtype)
        return jax.tree.map(lambda g: _scale(g, factor), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def clip_by_norm(clip_norm: float) -> optax.GradientTransformation:
    """Scales each gradient tensor whose own L2 norm exceeds ``clip_norm`` down to it.

    Paddle's ``ClipGradByNorm``: ``g * clip_norm / norm(g)`` where ``norm(g) > clip_norm``,
    ``g`` unchanged otherwise.

    Args:
        clip_norm: the largest per-tensor norm let through, > 0.

    Returns:
        An ``optax.GradientTransformation`` (state ``optax.EmptyState``).

    Raises:
        ValueError, TypeError: ``clip_norm`` is not a finite positive number.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = clip_by_norm(1.0)
        >>> u, _ = tx.update({"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.5])}, None)
        >>> [round(x, 4) for x in u["a"].tolist()], u["b"].tolist()
        ([0.6, 0.8], [0.5])
    """
    c = _check_positive("clip_norm", clip_norm)

    def clip_one(g: jax.Array) -> jax.Array:
        norm = jnp.sqrt(_sum_squares(g))
        return _scale(g, jnp.where(norm > c, c / jnp.maximum(norm, c), 1.0).astype(norm.dtype))

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        return jax.tree.map(clip_one, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def clip_by_value(max: float, min: float | None = None) -> optax.GradientTransformation:
    """Clips every gradient element to ``[min, max]`` (Paddle's ``ClipGradByValue``).

    Args:
        max: the upper bound.
        min: the lower bound; ``None`` means ``-max``, and then ``max`` must be > 0.

    Returns:
        An ``optax.GradientTransformation`` (state ``optax.EmptyState``).

    Raises:
        ValueError, TypeError: a bound is not a finite number, or ``min > max``.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = clip_by_value(1.0)
        >>> tx.update(jnp.array([-3.0, 0.5, 2.0]), None)[0].tolist()
        [-1.0, 0.5, 1.0]
    """
    for name, value in (("max", max), ("min", min)):
        if value is None and name == "min":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name}={value!r} must be a float.")
        if not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be finite.")
    if min is None and max <= 0:
        raise ValueError(f"max={max!r} must be > 0 when min is not given (min = -max).")
    lo, hi = (-float(max) if min is None else float(min)), float(max)
    if lo > hi:
        raise ValueError(f"min={min!r} must be <= max={max!r}.")

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        return jax.tree.map(lambda g: jnp.clip(g, lo, hi).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def ClipGradByGlobalNorm(clip_norm: float) -> optax.GradientTransformation:
    """Paddle's name for :func:`clip_by_global_norm` (without the hybrid epsilon).

    Example:
        >>> import jax.numpy as jnp
        >>> tx = ClipGradByGlobalNorm(clip_norm=1.0)
        >>> round(float(global_norm(tx.update(jnp.array([3.0, 4.0]), None)[0])), 4)
        1.0
    """
    return clip_by_global_norm(clip_norm)


def ClipGradByNorm(clip_norm: float) -> optax.GradientTransformation:
    """Paddle's name for :func:`clip_by_norm`.

    Example:
        >>> import jax.numpy as jnp
        >>> ClipGradByNorm(clip_norm=10.0).update(jnp.array([3.0, 4.0]), None)[0].tolist()
        [3.0, 4.0]
    """
    return clip_by_norm(clip_norm)


def ClipGradByValue(max: float, min: float | None = None) -> optax.GradientTransformation:
    """Paddle's name for :func:`clip_by_value` (same argument order: ``max``, then ``min``).

    Example:
        >>> import jax.numpy as jnp
        >>> ClipGradByValue(max=1.0, min=0.0).update(jnp.array([-1.0, 2.0]), None)[0].tolist()
        [0.0, 1.0]
    """
    return clip_by_value(max, min)

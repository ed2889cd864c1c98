"""What the zoo's models share: the longest sequence, rotary embeddings, positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["MAX_SEQ", "arange_positions", "rope"]

MAX_SEQ = 32
"""Longest sequence the learned position tables and the KV cache hold."""


def rope(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotary embedding of ``x: [b, s, heads, d]`` at integer ``positions: [b, s]``."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def arange_positions(tokens: jax.Array) -> jax.Array:
    """Positions ``0..s-1`` for every row of ``tokens: [b, s]``."""
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

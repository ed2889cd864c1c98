"""Random keys whose draws are a slice of rows of the whole batch's draw.

A pipeline runs each block on one micro-batch of one data-parallel replica at a time: the
block sees ``k`` rows of the ``B`` its unpipelined twin would see at once. A dropout layer
inside it draws ``jax.random.bernoulli(key, p, (k, ...))``, which is not the slice of the
unpipelined ``bernoulli(key, p, (B, ...))``. :func:`row_keys` wraps a threefry key with the
position of those rows: its draws of a leading dimension ``k`` are exactly rows ``row0 ..
row0 + k - 1`` of the draw of the whole batch (``jax_threefry_partitionable``, JAX's default,
makes each drawn element a function of the key and of its flat index only). Draws of any
other leading dimension (shared by every row) are the whole batch's draw itself; ``fold_in``
and ``split`` act on the threefry key and keep the rows.

Example:
  >>> import jax, jax.numpy as jnp
  >>> key = jax.random.key(0)
  >>> whole = jax.random.bernoulli(key, 0.5, (8, 3))
  >>> rows = row_keys(jax.random.key_data(key), row0=4, rows=2)
  >>> bool(jnp.array_equal(jax.random.bernoulli(rows, 0.5, (2, 3)), whole[4:6]))
  True
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import define_prng_impl, threefry2x32_p

__all__ = ["ROW_KEYS", "row_keys"]

_U32 = np.uint32


def _threefry(data: jax.Array) -> jax.Array:
    return jax.random.wrap_key_data(data, impl="threefry2x32")


def _seed(seed: jax.Array) -> jax.Array:
    base = jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))
    return jnp.concatenate([base, jnp.zeros((2,), _U32)])


def _split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    parts = jax.random.key_data(jax.random.split(_threefry(key[:2]), shape))
    rows = jnp.broadcast_to(key[2:], (*parts.shape[:-1], 2))
    return jnp.concatenate([parts, rows], axis=-1)


def _fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
    folded = jax.random.key_data(jax.random.fold_in(_threefry(key[:2]), data))
    return jnp.concatenate([folded, key[2:]])


def _mul_64(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """``a * b`` (``a`` a uint32 array, ``0 <= b < 2**32``) as 64 bits: ``(hi, lo)``."""
    mask = _U32(0xFFFF)
    a_lo, a_hi = a & mask, a >> _U32(16)
    b_lo, b_hi = _U32(b & 0xFFFF), _U32(b >> 16)
    p0, p1, p2, p3 = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
    mid = (p1 & mask) + (p2 & mask) + (p0 >> _U32(16))
    lo = (mid << _U32(16)) | (p0 & mask)
    hi = p3 + (p1 >> _U32(16)) + (p2 >> _U32(16)) + (mid >> _U32(16))
    return hi, lo


def _bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    """Threefry's partitionable bits of ``shape``, counted from the key's first row."""
    if bit_width not in (8, 16, 32, 64):
        raise TypeError(f"bit_width={bit_width}: row keys draw 8, 16, 32 or 64 bits.")
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if size >= 2**32:
        raise NotImplementedError(f"a draw of {size} elements (2**32 or more) from row keys")
    lo = jnp.zeros(shape, _U32)
    stride = 1
    for dim in reversed(range(len(shape))):  # the flat index, elementwise (partitionable)
        lo = lo + lax.broadcasted_iota(_U32, shape, dim) * _U32(stride)
        stride *= shape[dim]
    hi = jnp.zeros(shape, _U32)
    if shape and shape[0]:
        row0 = jnp.where(key[3] == shape[0], key[2], _U32(0))
        off_hi, off_lo = _mul_64(row0, size // shape[0])
        moved = lo + off_lo
        hi = hi + off_hi + (moved < lo).astype(_U32)
        lo = moved
    k1, k2 = (jnp.broadcast_to(k, shape) for k in (key[0], key[1]))
    bits1, bits2 = threefry2x32_p.bind(k1, k2, hi, lo)
    dtype = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[bit_width]
    if bit_width == 64:
        wide = lax.convert_element_type(bits1, dtype)
        return lax.shift_left(wide, jnp.asarray(32, dtype)) | lax.convert_element_type(bits2, dtype)
    if bit_width == 32:
        return bits1 ^ bits2
    return lax.convert_element_type(bits1 ^ bits2, dtype)


ROW_KEYS = define_prng_impl(
    key_shape=(4,),
    seed=_seed,
    split=_split,
    random_bits=_bits,
    fold_in=_fold_in,
    name="jfleet_row_keys",
    tag="jfleet_rows",
)
"""The PRNG implementation of :func:`row_keys`: key data ``[k1, k2, row0, rows]``."""


def row_keys(data: jax.Array, *, row0: jax.Array | int, rows: int) -> jax.Array:
    """Threefry keys (``data``: ``jax.random.key_data``, ``[..., 2]`` uint32) drawing rows
    ``row0 .. row0 + rows - 1`` of what they would draw for the whole batch.

    A draw whose leading dimension is ``rows`` is that slice of the same draw with the
    leading dimension of the whole batch; any other draw is the plain threefry draw. Needs
    ``jax_threefry_partitionable`` (JAX's default).

    Args:
      data: threefry key data, ``[..., 2]`` uint32.
      row0: the first row's index in the whole batch (traced allowed).
      rows: the rows drawn at a time (the leading dimension of the local draws).

    Returns:
      Typed keys of :data:`ROW_KEYS`, of shape ``data.shape[:-1]``.

    Raises:
      ValueError: ``jax_threefry_partitionable`` is off (the whole batch's draw is then
        not elementwise), or ``data`` is not ``[..., 2]``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> key = jax.random.fold_in(jax.random.key(1), 3)
      >>> whole = jax.random.uniform(key, (6, 2))
      >>> mine = row_keys(jax.random.key_data(jax.random.key(1)), row0=2, rows=4)
      >>> part = jax.random.uniform(jax.random.fold_in(mine, 3), (4, 2))
      >>> bool(jnp.array_equal(part, whole[2:]))
      True
    """
    if not jax.config.jax_threefry_partitionable:
        raise ValueError(
            "jax_threefry_partitionable is False: a pipelined block's dropout draws would not "
            "be slices of the unpipelined draws; set jax.config.update("
            "'jax_threefry_partitionable', True) (JAX's default)."
        )
    if data.shape[-1:] != (2,):
        raise ValueError(f"row_keys(data of shape {data.shape}): give threefry key data [..., 2].")
    data = jnp.asarray(data, _U32)
    where = jnp.stack([jnp.asarray(row0, _U32), _U32(rows)])
    where = jnp.broadcast_to(where, (*data.shape[:-1], 2))
    return jax.random.wrap_key_data(jnp.concatenate([data, where], axis=-1), impl=ROW_KEYS)

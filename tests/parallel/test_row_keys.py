"""Row keys (:mod:`jfleet.parallel.row_keys`): a local draw is its rows of the whole batch's
draw, bit for bit, at any row offset, shape, bit width, under ``fold_in`` / ``split`` / vmap,
and inside a ``shard_map`` whose rows are split over the devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jfleet.parallel.row_keys import row_keys


@pytest.mark.parametrize("shape", [(8,), (8, 5, 3), (8, 1, 7)])
def test_a_draw_of_local_rows_is_that_slice_of_the_whole_batch_draw(shape):
    key = jax.random.fold_in(jax.random.key(7), 2)
    whole = {bits: jax.random.bits(key, shape, jnp.dtype(f"uint{bits}")) for bits in (8, 16, 32)}
    for row0 in range(0, 8, 2):
        mine = jax.random.fold_in(row_keys(jax.random.key_data(jax.random.key(7)), row0=row0,
                                           rows=2), 2)  # fmt: skip
        for bits, want in whole.items():
            got = jax.random.bits(mine, (2, *shape[1:]), jnp.dtype(f"uint{bits}"))
            np.testing.assert_array_equal(got, want[row0 : row0 + 2])
    mask = jax.random.bernoulli(key, 0.9, shape)
    mine = row_keys(jax.random.key_data(key), row0=6, rows=2)
    np.testing.assert_array_equal(jax.random.bernoulli(mine, 0.9, (2, *shape[1:])), mask[6:])


def test_draws_of_another_leading_size_are_the_whole_draw_and_split_keeps_the_rows():
    key = jax.random.key(3)
    mine = row_keys(jax.random.key_data(key), row0=4, rows=2)
    np.testing.assert_array_equal(jax.random.bits(mine, (3, 4)), jax.random.bits(key, (3, 4)))
    keys = jax.random.split(key, 3)
    rows = row_keys(jax.random.key_data(keys), row0=jnp.uint32(4), rows=4)
    got = jax.vmap(lambda k: jax.random.uniform(k, (4, 3)))(rows)
    want = jax.vmap(lambda k: jax.random.uniform(k, (8, 3)))(keys)[:, 4:]
    np.testing.assert_array_equal(got, want)
    parts = jax.random.split(mine, 2)
    whole = jax.random.split(key, 2)
    np.testing.assert_array_equal(
        jax.random.bits(parts[1], (2, 5)), jax.random.bits(whole[1], (8, 5))[4:6]
    )


def test_inside_a_shard_map_each_device_draws_its_rows():
    mesh = jax.make_mesh((4,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    key = jax.random.key(11)
    data, rows = jax.random.key_data(key), jnp.arange(16, dtype=jnp.int32)

    def local(row_ids):
        keys = row_keys(data, row0=row_ids[0], rows=row_ids.shape[0])
        return jax.random.bernoulli(keys, 0.5, (row_ids.shape[0], 6))

    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")))(rows)
    np.testing.assert_array_equal(got, jax.random.bernoulli(key, 0.5, (16, 6)))


def test_bad_key_data_is_refused():
    with pytest.raises(ValueError, match=r"give threefry key data \[\.\.\., 2\]"):
        row_keys(jnp.zeros((3,), jnp.uint32), row0=0, rows=1)

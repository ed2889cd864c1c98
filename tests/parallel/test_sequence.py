"""Sequence-parallel ops and layers: layouts, values, Paddle's constraints as clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfleet import DistributedStrategy, fleet
from jfleet.parallel.sequence import (
    AllGatherOp,
    ColumnSequenceParallelLinear,
    GatherOp,
    ReduceScatterOp,
    RowSequenceParallelLinear,
    ScatterOp,
    is_sequence_parallel_parameter,
    mark_as_sequence_parallel_parameter,
)


@pytest.fixture
def mp4():
    s = DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
    fleet.init(is_collective=True, strategy=s, log_level="WARNING")


def test_ops_change_the_layout_not_the_value(mp4):
    x = jnp.arange(8 * 2 * 4, dtype=jnp.float32).reshape(8, 2, 4)  # [s, b, h]
    for op in (ScatterOp, ReduceScatterOp):
        y = op.apply(x)
        assert y.sharding.spec[0] == "mp"
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    for op in (GatherOp, AllGatherOp):
        y = op.apply(ScatterOp.apply(x))
        assert "mp" not in jax.tree.leaves(tuple(y.sharding.spec))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def test_column_then_row_sequence_parallel_equals_plain_linears(mp4):
    x = jax.random.normal(jax.random.key(1), (8, 2, 16))  # [s, b, h]
    col = ColumnSequenceParallelLinear(16, 32, has_bias=True, rngs=nnx.Rngs(0))
    row = RowSequenceParallelLinear(32, 16, has_bias=True, rngs=nnx.Rngs(1))
    plain_col = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    plain_row = nnx.Linear(32, 16, rngs=nnx.Rngs(1))
    want = plain_row(jax.nn.gelu(plain_col(x)))
    got = row(jax.nn.gelu(col(ScatterOp.apply(x))))
    assert got.sharding.spec[0] == "mp"  # the output is sequence-split again
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_sequence_not_divisible_by_mp(mp4):
    col = ColumnSequenceParallelLinear(16, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"sequence length 6 .* mp degree 4"):
        col(jnp.ones((6, 2, 16)))
    with pytest.raises(ValueError, match=r"sequence length 10 .* mp degree 4"):
        ScatterOp.apply(jnp.ones((10, 2, 16)))


def test_paddles_layer_constraints_are_errors(mp4):
    with pytest.raises(ValueError, match="gather_output=True"):
        ColumnSequenceParallelLinear(16, 32, gather_output=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="input_is_parallel=False"):
        RowSequenceParallelLinear(32, 16, input_is_parallel=False, rngs=nnx.Rngs(0))


def test_wrong_input_width(mp4):
    col = ColumnSequenceParallelLinear(16, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"last dim is 8, expected in_features=16"):
        col(jnp.ones((8, 2, 8)))


def test_mark_as_sequence_parallel_parameter(mp4):
    norm = nnx.LayerNorm(16, rngs=nnx.Rngs(0))
    assert not is_sequence_parallel_parameter(norm.scale)
    mark_as_sequence_parallel_parameter(norm.scale)
    assert is_sequence_parallel_parameter(norm.scale)
    with pytest.raises(TypeError, match="parameter=ndarray"):
        mark_as_sequence_parallel_parameter(np.ones(3))

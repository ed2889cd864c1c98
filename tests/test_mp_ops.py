"""fleet.layers.mpu.mp_ops and the sequence-parallel ops: per device (inside shard_map, with
and without check_vma) they are Paddle's collectives with Paddle's gradients; on global
arrays they are layout changes of one value. Every result is compared with the one-device
computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.fleet.layers.mpu.mp_ops import (
    _c_concat,
    _c_identity,
    _c_lookup_table,
    _c_softmax_with_cross_entropy,
    _c_split,
    _mp_allreduce,
)
from jfleet.fleet.utils.sequence_parallel_utils import GatherOp, ScatterOp
from jfleet.mesh.collective import ReduceOp
from jfleet.testing import make_strategy

K = jax.random.split(jax.random.key(0), 6)
X = jax.random.normal(K[0], (4, 8))
W1 = jax.random.normal(K[1], (8, 16)) / 3
W2 = jax.random.normal(K[2], (16, 8)) / 3
W = jax.random.normal(K[3], (4, 8))
TABLE = jax.random.normal(K[4], (16, 8))
IDS = jnp.array([0, 5, 9, 15])
LABELS = jnp.array([3, -100, 12, 7])


def one_device(x, w1, w2, w, table):
    """The Megatron MLP, the split/concat round trip, embedding and cross entropy, whole."""
    mlp = jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)
    split = jnp.sum((x * w) ** 2)
    logits = table[IDS] @ w1
    logp = jax.nn.log_softmax(logits)
    keep = LABELS != -100
    ce = -jnp.sum(jnp.where(keep, jnp.take_along_axis(logp, LABELS[:, None] % 16, 1)[:, 0], 0))
    return mlp + split + ce


def per_device(x, w1, w2, w, table):
    """The same with Paddle's ops on each mp rank's pieces (w1 / w / table split over mp)."""
    h = jnp.tanh(_c_identity(x) @ w1)
    mlp = jnp.sum(jnp.tanh(_mp_allreduce(h @ w2)) ** 2)
    split = jnp.sum(_c_concat(_c_split(x) * w) ** 2)
    rows = table.shape[0]
    start = jax.lax.axis_index("mp") * rows
    emb = _mp_allreduce(_c_lookup_table(table, IDS, start_index=start))
    logits = _c_identity(emb) @ w1  # vocabulary (16) split over mp
    ce = jnp.sum(_c_softmax_with_cross_entropy(logits, LABELS[:, None]))
    return mlp + split + ce


@pytest.fixture
def hcg():
    s = make_strategy({"dp_degree": 2, "mp_degree": 4})
    return fleet.init(is_collective=True, strategy=s, log_level="WARNING")._hcg


def test_per_device_ops_give_the_one_device_values_and_gradients(hcg):
    """With and without check_vma, and the sequence ops; one compile for all of it."""
    args = (X, W1, W2, W, TABLE)
    specs = (P(), P(None, "mp"), P("mp"), P(None, "mp"), P("mp"))
    argnums = tuple(range(5))
    seq_x, seq_w = jax.random.normal(K[5], (2, 8, 2, 4))  # [s, b, h]

    def body(*args):  # each rank differentiates its own program, as in Paddle
        return jax.value_and_grad(per_device, argnums=argnums)(*args)

    def seq_body(x, w):
        return jax.grad(lambda x, w: jnp.sum(GatherOp.apply(ScatterOp.apply(x) * w) ** 2))(x, w)

    @jax.jit
    def run(*args):
        out = [
            jax.shard_map(
                body, mesh=hcg.mesh, in_specs=specs, out_specs=(P(), specs), check_vma=check
            )(*args)
            for check in (True, False)
        ]
        seq = jax.shard_map(seq_body, mesh=hcg.mesh, in_specs=(P(), P("mp")), out_specs=P())
        want = jax.value_and_grad(one_device, argnums)(*args)
        return out, seq(seq_x, seq_w), want

    out, seq_grad, (want, want_grads) = run(*args)
    for value, grads in out:
        np.testing.assert_allclose(value, want, rtol=1e-5)
        for got, ref in zip(grads, want_grads, strict=True):
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(seq_grad, 2 * seq_x * seq_w**2, rtol=1e-5)


def test_global_arrays_keep_the_value_and_take_the_layout(hcg):
    @jax.jit
    def f(x):
        split = _c_split(x)
        return split, _c_concat(split * 2), _mp_allreduce(x + 1), _c_identity(x)

    x = jnp.arange(32.0).reshape(4, 8)
    split, whole, summed, same = f(x)
    np.testing.assert_array_equal(split, x)
    np.testing.assert_array_equal(whole, 2 * x)
    np.testing.assert_array_equal(summed, x + 1)
    np.testing.assert_array_equal(same, x)
    assert split.sharding.spec == P(None, "mp")
    assert whole.sharding.is_fully_replicated and summed.sharding.is_fully_replicated
    seq = ScatterOp.apply(jnp.ones((8, 2, 4)))  # [s, b, h]: s split over mp
    assert seq.sharding.spec[0] == "mp" and GatherOp.apply(seq).sharding.spec[0] is None


def test_mp_ops_bad_arguments_name_the_value(hcg):
    with pytest.raises(TypeError, match=r"_c_identity: group='mp' \(str\) is not a Group"):
        _c_identity(X, group="mp")
    with pytest.raises(ValueError, match=r"op=<ReduceOp.MAX: 1>; .* pass op=ReduceOp.SUM"):
        _mp_allreduce(X, op=ReduceOp.MAX)
    with pytest.raises(ValueError, match=r"last dim of shape \(4, 6\) is 6, not divisible by"):
        _c_split(jnp.ones((4, 6)))

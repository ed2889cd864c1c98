"""The sparse table: hashing, pull / push against Paddle's accessor formulas written in NumPy,
and the compiled step's memory and traffic (batch-sized). One device against eight, for a
whole training step: test_nnx_step.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh.topology import DP
from jfleet.ps import CtrAccessor, SparseSGDRule, SparseTable, hash_ids, prepare
from jfleet.testing import hlo

DIM = 4


def mesh_of(n: int) -> jax.sharding.Mesh:
    return jax.make_mesh((n,), (DP,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


def reference_push(rule: SparseSGDRule, acc: CtrAccessor, w, slots, g, show, click):
    """Paddle's CtrCommonAccessor::Update and sparse SGD rules, per row, in float64 NumPy."""
    w, g = w.astype(np.float64).copy(), g / np.maximum(show, 1.0)[:, None]
    slots = {k: v.astype(np.float64).copy() for k, v in slots.items()}
    lr = rule.learning_rate
    for i in range(len(w)):
        if rule.name == "naive":
            w[i] -= lr * g[i]
        elif rule.name == "adagrad":
            ratio = lr * np.sqrt(rule.initial_g2sum / (rule.initial_g2sum + slots["g2sum"][i]))
            w[i] -= g[i] * ratio
            slots["g2sum"][i] += np.sum(g[i] ** 2) / len(g[i])
        else:
            b1, b2 = rule.beta1_decay_rate, rule.beta2_decay_rate
            lr_t = lr * np.sqrt(1 - slots["beta2_pow"][i]) / (1 - slots["beta1_pow"][i])
            slots["gsum"][i] = b1 * slots["gsum"][i] + (1 - b1) * g[i]
            slots["g2sum"][i] = b2 * slots["g2sum"][i] + (1 - b2) * g[i] ** 2
            w[i] -= lr_t * slots["gsum"][i] / (np.sqrt(slots["g2sum"][i]) + rule.ada_epsilon)
            slots["beta1_pow"][i] *= b1
            slots["beta2_pow"][i] *= b2
        w[i] = np.clip(w[i], *rule.weight_bounds)
    delta = (show - click) * acc.nonclk_coeff + click * acc.click_coeff
    return w, slots, delta


def test_hashing_groups_a_batch_by_row():
    ids = np.array([[5, -3, 5], [2**62, 5, -3]], np.int64)
    b = prepare(ids, 1 << 20, labels=[1.0, 0.0])
    rows = hash_ids(ids, 1 << 20)
    assert np.array_equal(b.rows[b.inverse], rows)  # every id finds its row
    assert (b.rows[:3] >= 0).all() and (b.rows[3:] == -1).all() and b.rows.size == ids.size
    assert b.show[b.inverse[0, 0]] == 3 and b.show[b.inverse[0, 1]] == 2
    assert b.click[b.inverse[0, 0]] == 2 and b.click[b.inverse[1, 0]] == 0
    as_uint = hash_ids(np.array([2**63 + 1], np.uint64), 97)
    assert np.array_equal(as_uint, hash_ids([-(2**63) + 1], 97))  # two's complement
    assert len(set(hash_ids(np.arange(10_000), 1 << 24).tolist())) > 9_990  # ~0.03% collide
    with pytest.raises(TypeError, match="not integers"):
        prepare(np.ones((2, 2)), 64)
    with pytest.raises(ValueError, match="size=1"):
        prepare(ids, 64, size=1)


@pytest.mark.parametrize("name", ["adagrad", "adam", "naive"])
def test_push_is_paddles_update_on_the_touched_rows_only(name):
    rule = SparseSGDRule(name, learning_rate=0.1, weight_bounds=(-0.3, 0.3))
    acc = CtrAccessor(rule)
    ids = np.array([[1, 2, 1], [3, 1, 7]], np.int64)
    table = SparseTable(64, DIM, acc, mesh=mesh_of(8), seed=3)  # 1 device: test_nnx_step.py
    b = table.prepare(ids, labels=[1.0, 0.0])
    g = np.random.default_rng(0).normal(size=(b.rows.size, DIM)).astype(np.float32)
    before = jax.tree.map(np.asarray, table.state)
    step = jax.jit(table.push, donate_argnums=0)
    for _ in range(2):  # the second push sees the first one's slots
        table.state = step(table.state, b.rows, g, b.show, b.click)
    after = jax.tree.map(np.asarray, table.state)
    live = b.rows[b.rows >= 0]
    w, slots = before.emb[live], {k: v[live] for k, v in before.slots.items()}
    sh, cl = b.show[: live.size], b.click[: live.size]
    for _ in range(2):
        w, slots, delta = reference_push(rule, acc, w, slots, g[: live.size], sh, cl)
    np.testing.assert_allclose(after.emb[live], w, rtol=1e-5, atol=1e-6)
    for k in slots:
        np.testing.assert_allclose(after.slots[k][live], slots[k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(after.show[live], 2 * sh)
    np.testing.assert_allclose(after.delta_score[live], 2 * delta, rtol=1e-6)
    assert after.present[live].all() and after.present.sum() == live.size
    others = np.setdiff1d(np.arange(64), live)
    np.testing.assert_array_equal(after.emb[others], before.emb[others])  # untouched
    pulled = np.asarray(table.pull(table.state, b.rows))
    np.testing.assert_array_equal(pulled[: live.size], after.emb[live])
    assert (pulled[live.size :] == 0).all()  # padding reads zeros


def compiled_step(num_rows: int, batch_rows: int):
    """lookup + sparse adagrad update of a table on 8 devices, state donated."""
    table = SparseTable(num_rows, 8, mesh=mesh_of(8))

    def step(state, rows, show, click):
        pulled = table.pull(state, rows)
        return table.push(state, rows, jnp.tanh(pulled) + 1.0, show, click)

    rows, ones = np.arange(batch_rows, dtype=np.int32), np.ones(batch_rows, np.float32)
    return jax.jit(step, donate_argnums=0).lower(table.state, rows, ones, ones).compile()


def dense_step(num_rows: int, batch_rows: int):
    """The dense baseline: the gradient of the whole table and optax adagrad on all of it."""
    emb = jax.device_put(jnp.zeros((num_rows, 8)), NamedSharding(mesh_of(8), P(DP)))
    tx = optax.adagrad(0.05)

    def step(emb, opt, rows):
        g = jax.grad(lambda e: jnp.sum(jnp.tanh(e[rows])))(emb)
        updates, opt = tx.update(g, opt, emb)
        return optax.apply_updates(emb, updates), opt

    rows = np.arange(batch_rows, dtype=np.int32)
    return jax.jit(step, donate_argnums=(0, 1)).lower(emb, tx.init(emb), rows).compile()


def test_a_step_on_a_million_rows_costs_the_batch_not_the_table():
    small, big = 1 << 17, 1 << 20
    cost = {}
    for rows, batch in ((small, 512), (big, 512), (big, 2048)):
        c = compiled_step(rows, batch)
        m = c.memory_analysis()
        cost[rows, batch] = (m.temp_size_in_bytes, hlo.signature(c.as_text()), m)
    # 8x the table: the same temporaries and the same traffic
    assert cost[small, 512][:2] == cost[big, 512][:2]
    for batch in (512, 2048):
        # the traffic is one all-reduce of the pulled rows: batch x dim float32
        assert cost[big, batch][1] == {"all-reduce": (1, batch * 8 * 4)}
        # the update is in place: the whole state is aliased to the output
        m = cost[big, batch][2]
        assert m.alias_size_in_bytes >= m.argument_size_in_bytes - batch * 3 * 4 - 16
    # 4x the batch: about 4x the temporaries, which are far below one table shard
    assert 3 < cost[big, 2048][0] / cost[big, 512][0] <= 4.5
    shard_bytes = big // 8 * 8 * 4
    assert cost[big, 2048][0] < shard_bytes / 10
    # the dense baseline's temporaries grow with the table
    dense = [dense_step(rows, 512).memory_analysis().temp_size_in_bytes for rows in (small, big)]
    assert dense[1] > 6 * dense[0] and dense[1] > 20 * cost[big, 512][0]

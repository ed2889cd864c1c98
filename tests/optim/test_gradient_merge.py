"""Tests for jfleet.optim.gradient_merge: Paddle's gradient merge on MultiSteps semantics."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.optim.gradient_merge import GradientMergeState, gradient_merge, has_updated

K = 4
MICRO = 8


def _data(n_rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_rows, 5)).astype(np.float32)
    y = rng.normal(size=(n_rows, 3)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def _params():
    rng = np.random.default_rng(1)
    return {
        "w": jnp.asarray(rng.normal(size=(5, 3)).astype(np.float32)),
        "b": jnp.asarray(rng.normal(size=(3,)).astype(np.float32)),
    }


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)  # mean-reduced


_grad = jax.jit(jax.grad(_loss))


def _train(tx, params, batches):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for x, y in batches:
        updates, state = update(_grad(params, x, y), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.parametrize(
    "make_inner",
    [lambda: optax.sgd(0.1), lambda: optax.adam(0.05), lambda: optax.sgd(0.1, momentum=0.9)],
    ids=["sgd", "adam", "momentum"],
)
def test_k_merged_steps_equal_one_step_on_the_concatenated_batch(make_inner):
    x, y = _data(2 * K * MICRO)
    micro = [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, len(x), MICRO)]
    big = [(x[i : i + K * MICRO], y[i : i + K * MICRO]) for i in range(0, len(x), K * MICRO)]
    merged, mstate = _train(gradient_merge(make_inner(), k_steps=K), _params(), micro)
    direct, _ = _train(make_inner(), _params(), big)
    for k in direct:
        np.testing.assert_allclose(merged[k], direct[k], rtol=1e-6, atol=1e-7)
    assert int(mstate.gradient_step) == 2 and int(mstate.mini_step) == 0


def test_avg_false_sums_the_gradients():
    params = {"w": jnp.zeros(2)}
    tx = gradient_merge(optax.sgd(1.0), k_steps=3, avg=False)
    state = tx.init(params)
    for g in (1.0, 2.0, 4.0):
        updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
    np.testing.assert_array_equal(updates["w"], [-7.0, -7.0])
    tx = gradient_merge(optax.sgd(1.0), k_steps=3, avg=True)
    state = tx.init(params)
    for g in (1.0, 2.0, 4.0):
        updates, state = tx.update({"w": jnp.full(2, g)}, state, params)
    np.testing.assert_allclose(updates["w"], [-7.0 / 3, -7.0 / 3], rtol=1e-7)


def test_between_merges_updates_are_zero_and_inner_state_untouched():
    params = _params()
    tx = gradient_merge(optax.adam(0.1), k_steps=3)
    state = tx.init(params)
    inner0 = state.inner_state
    update = jax.jit(tx.update)
    seen = []
    for step in range(6):
        grads = jax.tree.map(lambda p, s=step: jnp.full_like(p, s + 1.0), params)
        updates, state = update(grads, state, params)
        emitted = step % 3 == 2
        seen.append(bool(has_updated(state)))
        if not emitted:
            for u in jax.tree.leaves(updates):
                assert u.dtype == jnp.float32 and not np.any(u)
            jax.tree.map(np.testing.assert_array_equal, state.inner_state, inner0)
        else:
            assert all(np.all(u != 0) for u in jax.tree.leaves(updates))
            assert all(not np.any(a) for a in jax.tree.leaves(state.acc_grads))
            inner0 = state.inner_state
    assert seen == [False, False, True, False, False, True]
    assert isinstance(state, GradientMergeState)


def test_k_steps_1_is_the_inner_optimizer():
    params = _params()
    x, y = _data(3 * MICRO)
    batches = [(x[i : i + MICRO], y[i : i + MICRO]) for i in range(0, len(x), MICRO)]
    merged, state = _train(gradient_merge(optax.adam(0.05), k_steps=1), params, batches)
    direct, _ = _train(optax.adam(0.05), params, batches)
    jax.tree.map(np.testing.assert_array_equal, merged, direct)
    assert state.acc_grads == () and int(state.gradient_step) == 3


def test_bf16_gradients_accumulate_in_fp32():
    params = {"w": jnp.ones(4, jnp.bfloat16)}
    tx = gradient_merge(optax.sgd(1.0), k_steps=3, avg=False)
    state = tx.init(params)
    assert state.acc_grads["w"].dtype == jnp.float32
    for g in (256.0, 0.75, 0.75):  # in bfloat16, 256 + 0.75 rounds back to 256
        updates, state = tx.update({"w": jnp.full(4, g, jnp.bfloat16)}, state, params)
    assert updates["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(updates["w"].astype(np.float32), -258.0)  # bf16(257.5)


def test_state_sharding_kept_on_8_devices():
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    specs = {"w": P("x", "y"), "b": P("y"), "c": P()}
    rng = np.random.default_rng(0)
    shapes = {"w": (8, 4), "b": (4,), "c": (3,)}
    params = {
        k: jax.device_put(rng.normal(size=shapes[k]).astype(np.float32), NamedSharding(mesh, s))
        for k, s in specs.items()
    }
    tx = gradient_merge(optax.adam(0.1), k_steps=2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    ref_tx = gradient_merge(optax.adam(0.1), k_steps=2)
    host = {k: jnp.asarray(np.asarray(v)) for k, v in params.items()}
    ref_state = ref_tx.init(host)
    for step in range(2):
        grads = jax.tree.map(lambda p, s=step: p * (s + 1.0), params)
        updates, state = update(grads, state, params)
        ref_updates, ref_state = ref_tx.update(
            {k: jnp.asarray(np.asarray(v)) for k, v in grads.items()}, ref_state, host
        )
        for k, p in params.items():
            for tree in (state.acc_grads, state.inner_state[0].mu, state.inner_state[0].nu):
                assert tree[k].sharding.is_equivalent_to(p.sharding, p.ndim), (k, step)
            assert updates[k].sharding.is_equivalent_to(p.sharding, p.ndim)
            np.testing.assert_allclose(updates[k], ref_updates[k], rtol=1e-6, atol=1e-8)


def test_with_nnx_optimizer():
    model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, gradient_merge(optax.sgd(0.1), k_steps=2), wrt=nnx.Param)
    x, y = _data(2 * MICRO)
    kernel0 = jnp.copy(model.kernel[...])

    @nnx.jit
    def step(model, opt, x, y):
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        opt.update(model, grads)

    step(model, opt, x[:MICRO], y[:MICRO])
    np.testing.assert_array_equal(model.kernel[...], kernel0)
    step(model, opt, x[MICRO:], y[MICRO:])
    assert not np.allclose(model.kernel[...], kernel0)


BAD = [
    ("k_steps 0", dict(k_steps=0), ValueError, "k_steps=0"),
    ("k_steps -1", dict(k_steps=-1), ValueError, "k_steps=-1"),
    ("k_steps 1.5", dict(k_steps=1.5), ValueError, "k_steps=1.5"),
    ("k_steps True", dict(k_steps=True), ValueError, "k_steps=True"),
    ("k_steps str", dict(k_steps="4"), ValueError, "k_steps='4'"),
    ("avg not bool", dict(avg="yes"), TypeError, "avg='yes'"),
]


@pytest.mark.parametrize("kwargs,error,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_name_the_value(kwargs, error, text):
    with pytest.raises(error, match=re.escape(text)):
        gradient_merge(optax.sgd(0.1), **kwargs)

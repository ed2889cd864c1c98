"""Tests for jfleet.optim.master_weights: fp32 master copies of half-precision params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.optim.loss_scale import dynamic_loss_scaling, loss_scale_of
from jfleet.optim.master_weights import MasterWeightsState, master_weights

HALF = [jnp.bfloat16, jnp.float16]


def _init_params(half):
    key = jax.random.PRNGKey(0)
    # Small values so that several entries change sign during training.
    return {
        "w": (jax.random.normal(key, (64, 8)) * 0.05).astype(half),
        "b": jnp.zeros(8, half),
    }


def _grads(step, half):
    k1, k2 = jax.random.split(jax.random.PRNGKey(step + 1))
    return {
        "w": jax.random.normal(k1, (64, 8)).astype(half),
        "b": jax.random.normal(k2, (8,)).astype(half),
    }


@pytest.mark.parametrize("half", HALF)
@pytest.mark.parametrize("use_jit", [False, True])
def test_master_tracks_fp32_reference_and_params_are_rounded_master(half, use_jit):
    params = _init_params(half)
    tx = master_weights(optax.adam(1e-2))
    ref_tx = optax.adam(1e-2)
    ref_params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    state, ref_state = tx.init(params), ref_tx.init(ref_params)
    assert isinstance(state, MasterWeightsState)
    jax.tree.map(np.testing.assert_array_equal, state.master_params, ref_params)

    update = jax.jit(tx.update) if use_jit else tx.update
    ref_update = jax.jit(ref_tx.update) if use_jit else ref_tx.update
    for step in range(6):
        grads = _grads(step, half)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        ref_updates, ref_state = ref_update(ref_grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)

        for name in params:
            master = state.master_params[name]
            assert master.dtype == jnp.float32 and params[name].dtype == half
            assert updates[name].dtype == jnp.float32
            if use_jit:  # XLA fuses ``master + u`` with adam's math: one float32 ulp
                np.testing.assert_allclose(master, ref_params[name], rtol=1e-6, atol=1e-7)
            else:
                np.testing.assert_array_equal(master, ref_params[name])
            np.testing.assert_array_equal(
                np.asarray(params[name], np.float32), np.asarray(master.astype(half), np.float32)
            )
    # Training moved the params by many half-precision ulps, sign changes included.
    assert np.any(
        np.sign(np.asarray(params["w"], np.float32))
        != np.sign(np.asarray(_init_params(half)["w"], np.float32))
    )


def test_fp32_and_non_floating_leaves_pass_through():
    params = {"h": jnp.ones(3, jnp.bfloat16), "f": jnp.ones(3), "i": jnp.arange(3)}
    tx = master_weights(optax.identity())
    state = tx.init(params)
    assert state.master_params["h"].dtype == jnp.float32
    assert isinstance(state.master_params["f"], optax.MaskedNode)
    assert isinstance(state.master_params["i"], optax.MaskedNode)
    grads = {"h": jnp.full(3, 0.5, jnp.bfloat16), "f": jnp.full(3, 0.25), "i": jnp.arange(3)}
    updates, state = tx.update(grads, state, params)
    assert updates["f"] is grads["f"] and updates["i"] is grads["i"]
    np.testing.assert_array_equal(state.master_params["h"], [1.5, 1.5, 1.5])


def test_fp32_leaves_match_plain_inner_updates():
    params = {"h": jnp.ones(4, jnp.float16), "f": jnp.linspace(0.0, 1.0, 4)}
    grads = {"h": jnp.full(4, 0.5, jnp.float16), "f": jnp.full(4, -0.5)}
    tx, ref = master_weights(optax.adam(1e-2)), optax.adam(1e-2)
    updates, _ = tx.update(grads, tx.init(params), params)
    ref_params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    ref_grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    ref_updates, _ = ref.update(ref_grads, ref.init(ref_params), ref_params)
    np.testing.assert_array_equal(updates["f"], ref_updates["f"])


@pytest.mark.parametrize("half", HALF)
def test_skipped_step_under_loss_scaling_keeps_master(half):
    params = _init_params(half)
    tx = dynamic_loss_scaling(master_weights(optax.adam(1e-2)), init_loss_scaling=128.0)
    state = tx.init(params)
    scaled = jax.tree.map(lambda g: g * loss_scale_of(state).astype(half), _grads(0, half))
    updates, state = tx.update(scaled, state, params)
    params = optax.apply_updates(params, updates)
    before = jax.tree.map(np.asarray, state.inner_state)

    poisoned = dict(scaled, b=scaled["b"].at[0].set(jnp.inf))
    updates, new_state = tx.update(poisoned, state, params)
    new_params = optax.apply_updates(params, updates)
    jax.tree.map(np.testing.assert_array_equal, new_params, params)
    after = jax.tree.map(np.asarray, new_state.inner_state)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert int(new_state.bad_steps) == 1


def test_master_copy_keeps_sharding():
    mesh = jax.make_mesh((4, 2), ("sharding", "mp"), axis_types=(AxisType.Auto,) * 2)
    params = {
        "w": jax.device_put(
            jnp.ones((8, 4), jnp.bfloat16), NamedSharding(mesh, P("sharding", "mp"))
        ),
        "b": jax.device_put(jnp.ones(4, jnp.bfloat16), NamedSharding(mesh, P(None))),
    }
    tx = master_weights(optax.adam(1e-3))
    state = tx.init(params)

    def check(state):
        for name in params:
            for leaf in (state.master_params[name], state.inner_state[0].mu[name]):
                assert leaf.dtype == jnp.float32
                assert leaf.sharding.is_equivalent_to(params[name].sharding, leaf.ndim)

    check(state)
    grads = jax.tree.map(lambda p: p * 0.5, params)
    _, eager_state = tx.update(grads, state, params)
    check(eager_state)
    updates, jit_state = jax.jit(tx.update)(grads, state, params)
    check(jit_state)
    new_params = optax.apply_updates(params, updates)
    assert new_params["w"].dtype == jnp.bfloat16
    assert new_params["w"].sharding.is_equivalent_to(params["w"].sharding, 2)


def test_update_without_params_raises():
    tx = master_weights(optax.sgd(0.1))
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    with pytest.raises(ValueError, match="params=None"):
        tx.update(params, tx.init(params))


def test_inner_must_be_a_transformation():
    with pytest.raises(TypeError, match=r"inner='adam' must be an optax.GradientTransformation"):
        master_weights("adam")

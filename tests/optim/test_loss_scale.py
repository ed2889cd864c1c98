"""Tests for jfleet.optim.loss_scale: Paddle's dynamic loss scaling as an Optax transform."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.optim.loss_scale import (
    DynamicLossScalingState,
    all_finite,
    dynamic_loss_scaling,
    loss_scale_of,
)

FIN, INF, NAN = "finite", "inf", "nan"


def _grads(kind, scale=1.0):
    g = jnp.array([0.5, -0.25], jnp.float32) * scale
    if kind == INF:
        g = g.at[1].set(jnp.inf)
    elif kind == NAN:
        g = g.at[0].set(jnp.nan)
    return {"w": g}


def _trace(kinds, **kwargs):
    """Runs a scripted finite/non-finite sequence; returns (scale, good, bad) after each step."""
    tx = dynamic_loss_scaling(optax.sgd(1.0), **kwargs)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    out = []
    for kind in kinds:
        _, state = tx.update(_grads(kind), state, params)
        out.append((float(state.loss_scale), int(state.good_steps), int(state.bad_steps)))
    return out


def test_paddle_rule_decrease_and_increase_sequence():
    got = _trace(
        [INF, FIN, INF, INF, FIN, FIN, FIN, INF, NAN],
        init_loss_scaling=1024.0,
        incr_every_n_steps=3,
        decr_every_n_nan_or_inf=2,
        incr_ratio=2.0,
        decr_ratio=0.5,
    )
    assert got == [
        (1024.0, 0, 1),  # inf: bad 1
        (1024.0, 1, 0),  # finite resets bad
        (1024.0, 0, 1),
        (512.0, 0, 0),  # second consecutive bad: scale *= 0.5, bad = 0
        (512.0, 1, 0),
        (512.0, 2, 0),
        (1024.0, 0, 0),  # third good: scale *= 2, good = 0
        (1024.0, 0, 1),
        (512.0, 0, 0),  # nan counts like inf
    ]


def test_paddle_rule_every_step_with_default_ratios():
    # decr_every_n_nan_or_inf=1, incr_every_n_steps=1: every step changes the scale.
    got = _trace(
        [INF, INF, FIN, FIN],
        init_loss_scaling=32768.0,
        incr_every_n_steps=1,
        decr_every_n_nan_or_inf=1,
    )
    s1 = np.float32(32768.0) * np.float32(0.8)  # 26214.4 in float32
    s2 = s1 * np.float32(0.8)
    assert s1 == np.float32(26214.400390625)
    assert got == [
        (float(s1), 0, 0),
        (float(s2), 0, 0),
        (float(s2 * np.float32(2.0)), 0, 0),
        (float(s2 * np.float32(4.0)), 0, 0),
    ]


def test_paddle_defaults_need_two_bad_steps():
    got = _trace([INF, INF, INF])
    assert got == [
        (32768.0, 0, 1),
        (float(np.float32(32768.0) * np.float32(0.8)), 0, 0),
        (float(np.float32(32768.0) * np.float32(0.8)), 0, 1),
    ]


def test_decrease_floors_at_one():
    got = _trace([INF, INF, INF], init_loss_scaling=2.0, decr_every_n_nan_or_inf=1, decr_ratio=0.5)
    assert got == [(1.0, 0, 0), (1.0, 0, 0), (1.0, 0, 0)]


def test_decrease_keeps_a_scale_already_below_one():
    got = _trace([INF, FIN], init_loss_scaling=0.5, decr_every_n_nan_or_inf=1)
    assert got == [(0.5, 0, 0), (0.5, 1, 0)]


def test_increase_that_overflows_keeps_the_scale():
    big = 2.0**127
    got = _trace([FIN, FIN], init_loss_scaling=big, incr_every_n_steps=1)
    assert got == [(big, 0, 0), (big, 0, 0)]


def test_fixed_scale_still_skips_non_finite_steps():
    tx = dynamic_loss_scaling(
        optax.sgd(1.0),
        init_loss_scaling=8.0,
        use_dynamic_loss_scaling=False,
        decr_every_n_nan_or_inf=1,
        incr_every_n_steps=1,
    )
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    for kind in [INF, FIN, NAN, FIN]:
        updates, state = tx.update(_grads(kind, 8.0), state, params)
        assert (float(state.loss_scale), int(state.good_steps), int(state.bad_steps)) == (8.0, 0, 0)
        expected = np.zeros(2) if kind != FIN else -np.array([0.5, -0.25])
        np.testing.assert_array_equal(updates["w"], expected)


@pytest.mark.parametrize("bad", [INF, NAN, "-inf"])
def test_non_finite_step_is_skipped_bit_identically(bad):
    tx = dynamic_loss_scaling(optax.adam(1e-2), init_loss_scaling=4.0)
    params = {"a": jnp.ones((3, 2)), "b": jnp.ones(4, jnp.bfloat16)}
    state = tx.init(params)
    grads = {"a": jnp.full((3, 2), 0.7 * 4.0), "b": jnp.full(4, 0.3 * 4.0, jnp.bfloat16)}
    _, state = tx.update(grads, state, params)  # a real step so moments are non-zero
    before = jax.tree.map(np.asarray, state.inner_state)

    value = {INF: jnp.inf, NAN: jnp.nan, "-inf": -jnp.inf}[bad]
    poisoned = {"a": grads["a"], "b": grads["b"].at[2].set(value)}
    updates, new_state = tx.update(poisoned, state, params)

    for leaf in jax.tree.leaves(updates):
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0.0)
    assert updates["b"].dtype == jnp.bfloat16
    after = jax.tree.map(np.asarray, new_state.inner_state)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert x.dtype == y.dtype
        assert np.array_equal(x, y)
    assert int(new_state.bad_steps) == 1 and int(new_state.good_steps) == 0


def test_finite_steps_match_the_unscaled_optimizer():
    tx = dynamic_loss_scaling(optax.adam(1e-2), init_loss_scaling=1024.0, incr_every_n_steps=2)
    ref = optax.adam(1e-2)
    params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.zeros(3)}
    ref_params = params
    state, ref_state = tx.init(params), ref.init(params)
    for step in range(5):
        g = jax.tree.map(lambda p, s=step: jnp.sin(p * (s + 1)) + 0.1, params)
        scale = loss_scale_of(state)
        updates, state = tx.update(jax.tree.map(lambda x, s=scale: x * s, g), state, params)
        ref_updates, ref_state = ref.update(g, ref_state, ref_params)
        params = optax.apply_updates(params, updates)
        ref_params = optax.apply_updates(ref_params, ref_updates)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=0), updates, ref_updates
        )
    assert float(loss_scale_of(state)) == 1024.0 * 4  # grew after steps 2 and 4


def test_unscale_keeps_grad_dtype():
    tx = dynamic_loss_scaling(optax.identity(), init_loss_scaling=256.0)
    params = {"h": jnp.ones(3, jnp.bfloat16), "f": jnp.ones(3)}
    state = tx.init(params)
    grads = {
        "h": jnp.array([256.0, 512.0, -128.0], jnp.bfloat16),
        "f": jnp.array([256.0, 1.0, 0.0]),
    }
    updates, _ = tx.update(grads, state, params)
    assert updates["h"].dtype == jnp.bfloat16 and updates["f"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(updates["h"], np.float32), [1.0, 2.0, -0.5])
    np.testing.assert_array_equal(updates["f"], [1.0, 1.0 / 256.0, 0.0])


def test_jit_matches_eager_and_state_types():
    tx = dynamic_loss_scaling(optax.adam(1e-3), incr_every_n_steps=2)
    params = {"w": jnp.ones((4, 4))}
    state = tx.init(params)
    assert isinstance(state, DynamicLossScalingState)
    assert state.loss_scale.dtype == jnp.float32 and state.loss_scale.shape == ()
    assert state.good_steps.dtype == jnp.int32 and state.bad_steps.dtype == jnp.int32
    jitted = jax.jit(tx.update)
    eager_state = jit_state = state
    for kind in [FIN, INF, FIN, FIN, NAN]:
        g = _grads(kind)["w"].sum() * jnp.ones((4, 4))
        ue, eager_state = tx.update({"w": g}, eager_state, params)
        uj, jit_state = jitted({"w": g}, jit_state, params)
        np.testing.assert_array_equal(ue["w"], uj["w"])
        jax.tree.map(np.testing.assert_array_equal, eager_state, jit_state)
        assert jax.tree.map(lambda x: x.dtype, eager_state) == jax.tree.map(
            lambda x: x.dtype, jit_state
        )


def _assert_same_shardings(a, b):
    """Our scalars and the adam moments; optax's own ``count`` is created uncommitted."""

    def picked(state):
        adam = state.inner_state[0]
        return [state.loss_scale, state.good_steps, state.bad_steps, adam.mu, adam.nu]

    for x, y in zip(jax.tree.leaves(picked(a)), jax.tree.leaves(picked(b)), strict=True):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_params_keep_state_shardings(axis_type):
    mesh = jax.make_mesh((4, 2), ("dp", "mp"), axis_types=(axis_type, axis_type))
    params = {
        "w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp", "mp"))),
        "b": jax.device_put(jnp.ones(4), NamedSharding(mesh, P())),
    }
    tx = dynamic_loss_scaling(optax.adam(1e-3), init_loss_scaling=2.0)
    state = tx.init(params)
    mu = state.inner_state[0].mu
    assert mu["w"].sharding.is_equivalent_to(params["w"].sharding, 2)
    replicated = NamedSharding(mesh, P())
    for scalar in (state.loss_scale, state.good_steps, state.bad_steps):
        assert scalar.sharding.is_equivalent_to(replicated, 0)

    grads = jax.tree.map(lambda p: p * 2.0, params)
    _, eager_state = tx.update(grads, state, params)
    updates, jit_state = jax.jit(tx.update)(grads, state, params)
    _assert_same_shardings(state, eager_state)
    _assert_same_shardings(state, jit_state)
    assert updates["w"].sharding.is_equivalent_to(params["w"].sharding, 2)
    # A non-finite element on one shard skips the step globally.
    host = np.asarray(grads["w"]).copy()
    host[7, 3] = np.inf
    bad = {"w": jax.device_put(host, params["w"].sharding), "b": grads["b"]}
    updates, skipped = jax.jit(tx.update)(bad, jit_state, params)
    assert not np.any(np.asarray(updates["w"])) and int(skipped.bad_steps) == 1
    _assert_same_shardings(state, skipped)


def test_loss_scale_of_finds_nested_state():
    params = {"w": jnp.ones(3)}
    inner = dynamic_loss_scaling(optax.adam(1e-3), init_loss_scaling=64.0)
    chained = optax.chain(optax.add_decayed_weights(1e-4), inner)
    assert float(loss_scale_of(chained.init(params))) == 64.0
    multi = optax.MultiSteps(inner, every_k_schedule=2)
    assert float(loss_scale_of(multi.init(params))) == 64.0
    injected = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    both = optax.chain(inner, injected)
    assert float(loss_scale_of(both.init(params))) == 64.0


def test_loss_scale_of_nnx_optimizer():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    tx = dynamic_loss_scaling(optax.adam(1e-3), init_loss_scaling=16.0)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    assert float(loss_scale_of(optimizer)) == 16.0
    assert float(loss_scale_of(optimizer.opt_state)) == 16.0


def test_loss_scale_of_errors():
    with pytest.raises(ValueError, match=r"no DynamicLossScalingState.*dynamic_loss_scaling"):
        loss_scale_of(optax.adam(1e-3).init({"w": jnp.ones(2)}))
    twice = optax.chain(dynamic_loss_scaling(optax.sgd(1.0)), dynamic_loss_scaling(optax.sgd(1.0)))
    with pytest.raises(ValueError, match="2 DynamicLossScalingState"):
        loss_scale_of(twice.init({"w": jnp.ones(2)}))


def test_under_gradient_merge():
    """MultiSteps(dls(inner)): scaled micro-grads accumulate at one fixed scale."""
    tx = optax.MultiSteps(dynamic_loss_scaling(optax.sgd(1.0), init_loss_scaling=8.0), 2)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    for g in ([1.0, 2.0], [3.0, 4.0]):
        scaled = {"w": jnp.array(g) * loss_scale_of(state)}
        updates, state = tx.update(scaled, state, params)
    np.testing.assert_allclose(updates["w"], [-2.0, -3.0])  # mean of the unscaled grads
    assert int(state.inner_opt_state.good_steps) == 1


def test_extra_args_reach_the_inner_transform():
    def update_fn(updates, state, params=None, *, multiplier=1.0, **_):
        return jax.tree.map(lambda u: u * multiplier, updates), state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update_fn)
    tx = dynamic_loss_scaling(inner, init_loss_scaling=2.0)
    params = {"w": jnp.ones(2)}
    updates, _ = tx.update({"w": jnp.ones(2) * 2.0}, tx.init(params), params, multiplier=3.0)
    np.testing.assert_array_equal(updates["w"], [3.0, 3.0])


def test_all_finite():
    assert bool(all_finite({"a": jnp.ones(3), "b": [jnp.zeros((2, 2), jnp.bfloat16)]}))
    assert not bool(all_finite({"a": jnp.ones(3), "b": jnp.array([jnp.nan])}))
    assert not bool(all_finite([jnp.array([1.0, -jnp.inf], jnp.float16)]))
    assert bool(all_finite({"i": jnp.arange(3), "none": None}))
    assert bool(jax.jit(all_finite)({"a": jnp.ones(2)}))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"init_loss_scaling": 0.0}, ValueError, r"init_loss_scaling=0\.0 must be > 0"),
        ({"init_loss_scaling": -1.0}, ValueError, r"init_loss_scaling=-1\.0"),
        ({"init_loss_scaling": float("inf")}, ValueError, r"init_loss_scaling=inf"),
        ({"init_loss_scaling": "big"}, TypeError, r"init_loss_scaling='big'"),
        ({"incr_every_n_steps": 0}, ValueError, r"incr_every_n_steps=0 must be >= 1"),
        ({"incr_every_n_steps": 2.5}, TypeError, r"incr_every_n_steps=2\.5 must be an int"),
        ({"decr_every_n_nan_or_inf": -1}, ValueError, r"decr_every_n_nan_or_inf=-1"),
        ({"decr_every_n_nan_or_inf": True}, TypeError, r"decr_every_n_nan_or_inf=True"),
        ({"incr_ratio": 1.0}, ValueError, r"incr_ratio=1\.0 must be > 1"),
        ({"decr_ratio": 1.0}, ValueError, r"decr_ratio=1\.0 must be in the open interval"),
        ({"decr_ratio": 0.0}, ValueError, r"decr_ratio=0\.0"),
        ({"use_dynamic_loss_scaling": 1}, TypeError, r"use_dynamic_loss_scaling=1 must be a bool"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        dynamic_loss_scaling(optax.sgd(0.1), **kwargs)


def test_inner_must_be_a_transformation():
    with pytest.raises(TypeError, match=r"inner=0\.1 must be an optax.GradientTransformation"):
        dynamic_loss_scaling(0.1)

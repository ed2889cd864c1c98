"""One contract every meta-optimizer transform passes (optax's contrib suite, for jfleet).

Each transform: jits; keeps parameter dtypes; keeps its state's sharding through
init -> update -> jitted update on an 8-device mesh; and composes with gradient merge
(two merged calls equal one call on the mean gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.optim import hyperparams
from jfleet.optim.clip import clip_by_global_norm
from jfleet.optim.gradient_merge import gradient_merge
from jfleet.optim.lamb_lars import lamb_from, lars_from
from jfleet.optim.loss_scale import dynamic_loss_scaling
from jfleet.optim.master_weights import master_weights

TRANSFORMS = {
    "loss_scale": (
        lambda: dynamic_loss_scaling(optax.adam(1e-2), init_loss_scaling=8.0),
        "float32",
    ),
    "master_weights": (lambda: master_weights(optax.adam(1e-2)), "bfloat16"),
    "gradient_merge": (lambda: gradient_merge(optax.adam(1e-2), k_steps=2), "float32"),
    "lamb": (lambda: lamb_from(hyperparams.adam(1e-2)), "float32"),
    "lars": (lambda: lars_from(hyperparams.momentum(1e-1)), "float32"),
    "clip": (lambda: optax.chain(clip_by_global_norm(0.5), optax.sgd(1e-1)), "float32"),
}  # fmt: skip


def mesh():
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


def make_params(dtype: str):
    m = mesh()
    rng = np.random.default_rng(0)
    raw = {
        "w": rng.normal(size=(8, 16)).astype(np.float32),
        "v": rng.normal(size=(16, 4)).astype(np.float32),
        "bias": rng.normal(size=(4,)).astype(np.float32),
    }
    specs = {"w": P("x", None), "v": P(None, "y"), "bias": P()}
    return {
        k: jax.device_put(jnp.asarray(v, dtype), NamedSharding(m, specs[k])) for k, v in raw.items()
    }


def make_grads(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda p: jax.device_put(jnp.asarray(rng.normal(size=p.shape), p.dtype), p.sharding), params
    )


def shardings(state):
    return [(x.shape, x.sharding) for x in jax.tree.leaves(state) if isinstance(x, jax.Array)]


def assert_same_layout(a, b):
    assert len(a) == len(b)
    for (shape, sa), (_, sb) in zip(a, b, strict=True):
        if len(shape) == 0:
            assert sa.is_fully_replicated and sb.is_fully_replicated
        else:
            assert sa.is_equivalent_to(sb, len(shape)), (shape, sa, sb)


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_jits_and_keeps_dtypes(name):
    make, dtype = TRANSFORMS[name]
    tx = make()
    params = make_params(dtype)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(make_grads(params, 1), state, params)
    new = optax.apply_updates(params, updates)
    for k in params:
        assert new[k].dtype == params[k].dtype
        assert new[k].shape == params[k].shape
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(new))


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_state_sharding_survives_init_update_and_jitted_update(name):
    make, dtype = TRANSFORMS[name]
    tx = make()
    params = make_params(dtype)
    state = tx.init(params)
    after_init = shardings(state)
    param_shaped = [s for s in after_init if s[0] in {p.shape for p in params.values()}]
    if name != "clip":  # clipping keeps no state; the others keep parameter-shaped state
        assert param_shaped, "the transform keeps no parameter-shaped state"
    for shape, sharding in param_shaped:
        match = [p.sharding for p in params.values() if p.shape == shape]
        assert any(sharding.is_equivalent_to(m, len(shape)) for m in match), (shape, sharding)
    _, eager = tx.update(make_grads(params, 1), state, params)
    assert_same_layout(after_init, shardings(eager))
    _, jitted = jax.jit(tx.update)(make_grads(params, 1), state, params)
    assert_same_layout(after_init, shardings(jitted))


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_composes_with_gradient_merge(name):
    make, dtype = TRANSFORMS[name]
    params = make_params(dtype)
    g1, g2 = make_grads(params, 1), make_grads(params, 2)
    merged = gradient_merge(make(), k_steps=2, avg=True)
    state = merged.init(params)
    step = jax.jit(merged.update)
    u1, state = step(g1, state, params)
    assert all(float(jnp.max(jnp.abs(u))) == 0.0 for u in jax.tree.leaves(u1))
    u2, _ = step(g2, state, params)
    single = make()
    mean = jax.tree.map(lambda a, b: ((a.astype(jnp.float32) + b) / 2).astype(a.dtype), g1, g2)
    want, _ = jax.jit(single.update)(mean, single.init(params), params)
    tol = 1e-5 if dtype == "float32" else 1e-2
    for a, b in zip(jax.tree.leaves(u2), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol * 1e-2
        )

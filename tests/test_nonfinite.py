"""The non-finite guard: skip keeps the state bit-identical, raise names step and leaf."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet, make_train_step
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.precision.nonfinite import NonFiniteError
from jfleet.training.strategy import DistributedStrategy
from tests.fleet_setup import init_fleet


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(bad_at: int | None = None, n: int = 3) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        x = rng.normal(size=(16, 4)).astype(np.float32)
        if i == bad_at:
            x[3, 1] = np.nan  # one poisoned input element
        out.append({"x": x, "y": rng.normal(size=(16, 2)).astype(np.float32)})
    return out


def host_state(model, opt):
    return jax.device_get((nnx.state(model), nnx.state(opt)))


def assert_identical(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(x, y)


def linear_run(mode: str, data: list[dict], hybrid=None, **settings):
    """Adam on a Linear; the host state after each step, and the train step."""
    init_fleet(hybrid or {"dp_degree": 8}, **settings)
    model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.adam(0.1))
    step = make_train_step(mse, nonfinite=mode)
    states = [host_state(model.module, opt)]
    for batch in data:
        step(model.module, opt, batch)
        states.append(host_state(model.module, opt))
    return states, step


def test_skip_keeps_params_and_moments_bit_identical_and_later_steps_train_normally():
    data = batches(bad_at=1)
    states, step = linear_run("skip", data)
    assert_identical(states[2], states[1])  # params, both moments and the count
    assert int(states[2][1]["step"][...]) == 1
    assert np.isfinite(states[3][0]["kernel"][...]).all()
    assert step.nonfinite_steps == 1
    clean, _ = linear_run("skip", [data[0], data[2]])  # never saw the bad batch
    assert_identical(states[3], clean[2])


def test_warn_applies_the_update_logs_once_and_counts(caplog):
    data = batches(bad_at=1, n=4)
    data[2]["x"][0, 0] = np.inf
    with caplog.at_level(logging.WARNING, logger="jfleet"):
        states, step = linear_run("warn", data)
        assert step.nonfinite_steps == 3  # steps 2, 3 and 4 (the NaN reached the params)
    assert not np.isfinite(states[2][0]["kernel"][...]).all()  # warn keeps the update
    logged = [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()]
    assert len(logged) == 1 and "at step 2" in logged[0] and "nonfinite='warn'" in logged[0]


def test_raise_names_the_step_and_the_gradient_leaf_and_skips_the_update():
    init_fleet({"dp_degree": 8})
    model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.sgd(0.1))

    def loss_fn(m, batch):  # finite loss; sqrt's gradient at 0 is 0/0 once scale is 0
        return mse(m, batch) + jnp.sqrt(jnp.sum((batch["scale"] * m.bias[...]) ** 2) + 0.0)

    step = make_train_step(loss_fn, nonfinite="raise")
    data = batches(n=2)
    for b in data:
        b["scale"] = np.float32(1.0)
    model.module.bias[...] = jnp.ones(2)
    step(model.module, opt, data[0])
    model.module.bias[...] = jnp.zeros(2)  # d sqrt(|b|^2)/db at b = 0: nan
    before = host_state(model.module, opt)
    with pytest.raises(NonFiniteError, match=r"step 2: grads\['bias'\] is inf or nan") as info:
        step(model.module, opt, data[1])
    assert info.value.step == 2 and info.value.leaf == "grads['bias']"
    assert_identical(host_state(model.module, opt), before)  # the update was skipped


def test_raise_on_out_of_range_token_ids_names_the_loss_and_the_embedding_cause():
    init_fleet({"dp_degree": 8})
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    good, bad = lm_batches(2)
    bad["tokens"] = bad["tokens"].copy()
    bad["tokens"][0, 0] = 64  # == vocab: nnx.Embed returns a NaN row
    step = make_train_step(lm_loss, nonfinite="raise")
    step(model.module, opt, good)
    before = host_state(model.module, opt)
    with pytest.raises(NonFiniteError, match=r"step 2: loss is inf or nan.*token ids >= the voc"):
        step(model.module, opt, bad)
    assert_identical(host_state(model.module, opt), before)  # nothing poisoned


def test_skip_under_zero3_keeps_the_sharded_state_bit_identical():
    hybrid = {"dp_degree": 1, "sharding_degree": 8}
    states, step = linear_run("skip", batches(bad_at=1, n=2), hybrid, sharding_configs={"stage": 3})
    assert_identical(states[2], states[1])
    first, start = jax.tree.leaves(states[1]), jax.tree.leaves(states[0])
    assert not all(np.array_equal(a, b) for a, b in zip(first, start, strict=True))  # it trains
    assert step.nonfinite_steps == 1


def test_strategy_switch_reaches_train_batch_and_loss_scaling_still_raises_on_a_nan_loss():
    init_fleet({"dp_degree": 8}, nonfinite="raise", amp=True, amp_configs={"dtype": "float16"})
    model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    with pytest.raises(NonFiniteError, match=r"step 1: loss is inf or nan"):
        model.train_batch(batches(bad_at=0, n=1)[0], opt, loss_fn=mse)


def test_bad_modes_are_clear_errors():
    with pytest.raises(ValueError, match=r"nonfinite='ignore' is not valid.*'warn'.*'skip'.*"):
        DistributedStrategy().nonfinite = "ignore"
    with pytest.raises(TypeError, match=r"nonfinite expects a str, got 1"):
        DistributedStrategy().nonfinite = 1
    with pytest.raises(ValueError, match=r"nonfinite='Skip' is not a non-finite mode.*'raise'"):
        make_train_step(mse, nonfinite="Skip")

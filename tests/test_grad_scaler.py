"""GradScaler: fp16 loss scaling given at train time, through the one loss-scale transform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import DistributedStrategy, fleet, group_sharded_parallel
from jfleet.optim import hyperparams
from jfleet.precision.amp import GradScaler, auto_cast
from jfleet.precision.grad_scaler import distributed_scaler
from jfleet.testing import assert_trees_close

FP16 = dict(rtol=2e-3, atol=5e-4)


def loss_fn(model, batch):
    # batch["k"] is 1.0 for a normal step and inf for a poisoned one: the loss, and so
    # every gradient, is then non-finite.
    err = model(batch["x"]).astype(jnp.float32) - batch["y"]
    return jnp.mean(err**2) * jnp.mean(batch["k"])


def make_batch(i: int, poisoned: bool) -> dict:
    rng = np.random.default_rng(i)
    return {
        "x": rng.normal(size=(8, 4)).astype(np.float32),
        "y": rng.normal(size=(8, 2)).astype(np.float32),
        "k": np.full((8,), np.inf if poisoned else 1.0, np.float32),
    }


def paddle_rule(pattern, scale, incr_n, decr_n, incr_ratio, decr_ratio):
    """Paddle's documented update_loss_scaling rule, step by step: the scale after each."""
    good = bad = 0
    out = []
    for finite in pattern:
        if finite:
            bad, good = 0, good + 1
            if good == incr_n:
                scale, good = scale * incr_ratio, 0
        else:
            good, bad = 0, bad + 1
            if bad == decr_n:
                scale, bad = max(scale * decr_ratio, 1.0), 0
        out.append(scale)
    return out, good, bad


PATTERN = [True, True, False, True, False, False, True, True]


def test_fp16_scaler_skips_inf_steps_and_follows_paddles_rule():
    fleet.init(is_collective=True, log_level="WARNING")
    model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    init_params = jax.tree.map(np.asarray, nnx.state(model.module, nnx.Param))
    opt = fleet.distributed_optimizer(hyperparams.momentum(0.1))
    scaler = distributed_scaler(
        GradScaler(init_loss_scaling=1024.0, incr_every_n_steps=2, decr_every_n_nan_or_inf=1)
    )
    assert scaler.get_loss_scaling() == 1024.0  # nothing bound yet: the initial scale
    scales = []
    with auto_cast(model, dtype="float16"):
        assert model.module.dtype == jnp.float16
        for i, finite in enumerate(PATTERN):
            batch = make_batch(i, poisoned=not finite)
            bound = opt.is_bound  # the first step makes the optimizer state
            before = jax.tree.map(np.asarray, (nnx.state(model), nnx.state(opt) if bound else ()))
            if i == 3:  # Paddle's scaler.minimize(opt, scaled_loss), functionally
                loss = scaler.minimize(opt, loss_fn, model, batch)
            else:
                loss = model.train_batch(batch, opt, loss_fn=loss_fn, scaler=scaler)
            after = jax.tree.map(np.asarray, (nnx.state(model), nnx.state(opt) if bound else ()))
            params_moments = [
                (b, a)
                for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True)
                if b.ndim > 0  # the parameters and the momentum trace
            ]
            unchanged = all(np.array_equal(b, a) for b, a in params_moments)
            assert unchanged == (not finite), i
            assert np.isfinite(float(loss)) == finite
            scales.append(scaler.get_loss_scaling())
    assert model.module.dtype is None  # auto_cast restored the compute dtype

    want, good, bad = paddle_rule(PATTERN, 1024.0, 2, 1, 2.0, 0.5)
    assert scales == want  # [1024, 2048, 1024, 1024, 512, 256, 256, 512]
    state = scaler.state_dict()
    assert (state["incr_count"], state["decr_count"]) == (good, bad)
    assert float(state["scale"]) == want[-1]
    assert opt.applied_meta_list == ("AMPOptimizer",)

    # The finite steps are momentum SGD on the unscaled gradients, on one device in fp32.
    ref = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    nnx.update(ref, init_params)
    tx = optax.sgd(0.1, momentum=0.9)
    params = nnx.state(ref, nnx.Param)
    tx_state = tx.init(params)
    for i, finite in enumerate(PATTERN):
        if not finite:
            continue
        batch = {k: jnp.asarray(v) for k, v in make_batch(i, False).items()}
        grads = nnx.grad(loss_fn)(ref, batch)
        updates, tx_state = tx.update(grads, tx_state, params)
        params = optax.apply_updates(params, updates)
        nnx.update(ref, params)
    assert_trees_close(nnx.state(model.module, nnx.Param), params, **FP16)

    # Saved and loaded into a new scaler before its optimizer has state: written at init.
    model2 = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    opt2 = fleet.distributed_optimizer(hyperparams.momentum(0.1))
    scaler2 = GradScaler()
    scaler2.load_state_dict(state)
    scaler2.attach(opt2).init(model2)
    assert scaler2.get_loss_scaling() == want[-1]
    restored = scaler2.state_dict()
    assert restored.keys() == state.keys()
    assert all(np.array_equal(restored[k], state[k]) for k in state)
    # Loaded after attaching, before the state exists: the chain is compiled anew.
    scaler3 = GradScaler(init_loss_scaling=2.0)
    opt3 = fleet.distributed_optimizer(hyperparams.momentum(0.1))
    scaler3.attach(opt3)
    scaler3.load_state_dict({**state, "incr_every_n_steps": 5})
    opt3.init(fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0))))
    assert scaler3.state_dict() == {**restored, "incr_every_n_steps": 5}


def test_group_sharded_parallel_takes_a_scaler_and_lists_sharding():
    scaler = GradScaler(init_loss_scaling=256.0)
    model, opt, got = group_sharded_parallel(
        nnx.Linear(8, 8, rngs=nnx.Rngs(0)), optax.adam(1e-3), "os_g", scaler=scaler
    )
    assert got is scaler
    assert opt.applied_meta_list == ("ShardingOptimizer", "AMPOptimizer")
    assert model.placement.zero_stage == 2
    assert scaler.get_loss_scaling() == 256.0  # read from the optimizer's state
    assert float(opt.loss_scale) == 256.0
    _, opt_plain, none = group_sharded_parallel(
        nnx.Linear(8, 8, rngs=nnx.Rngs(1)), optax.adam(1e-3), "os"
    )
    assert none is None and opt_plain.applied_meta_list == ("ShardingOptimizer",)


def test_disabled_scaler_is_a_pass_through():
    scaler = GradScaler(enable=False)
    assert not scaler.is_enable() and not scaler.is_use_dynamic_loss_scaling()
    assert scaler.scale(3.0) == 3.0 and scaler.state_dict() == {}
    assert scaler.get_loss_scaling() == 1.0
    fleet.init(is_collective=True, log_level="WARNING")
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    assert scaler.attach(opt) is opt and not opt.has_loss_scaling


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"incr_ratio": 0.5}, ValueError, r"incr_ratio=0\.5 must be > 1"),
        ({"decr_ratio": 2.0}, ValueError, r"decr_ratio=2\.0 must be in the open interval"),
        ({"incr_every_n_steps": 0}, ValueError, r"incr_every_n_steps=0 must be >= 1"),
        ({"init_loss_scaling": "big"}, TypeError, r"init_loss_scaling='big' must be a real"),
        ({"enable": "yes"}, TypeError, r"enable='yes'.*True or False"),
    ],
)
def test_bad_scaler_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradScaler(**kwargs)


def test_bad_scaler_use():
    with pytest.raises(TypeError, match=r"distributed_scaler\(scaler=3\).*GradScaler"):
        distributed_scaler(3)
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\{\}\).*disabled"):
        scaler.load_state_dict({})
    with pytest.raises(KeyError, match=r"\['incr_ratio'.*missing"):
        scaler.load_state_dict({"scale": 2.0})
    with pytest.raises(TypeError, match=r"optimizer=GradientTransformation.*DistributedOptimizer"):
        scaler.attach(optax.sgd(0.1))

    strategy = DistributedStrategy()
    strategy.amp = True
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    fp16_opt = fleet.distributed_optimizer(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"already has fp16 loss scaling from strategy\.amp"):
        scaler.attach(fp16_opt)

    fleet.init(is_collective=True, log_level="WARNING")
    model = fleet.distributed_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    bound = fleet.distributed_optimizer(optax.sgd(0.1)).init(model)
    with pytest.raises(ValueError, match=r"already made without loss scaling"):
        scaler.attach(bound)
    first = scaler.attach(fleet.distributed_optimizer(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"already serves another optimizer"):
        scaler.attach(fleet.distributed_optimizer(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"already has fp16 loss scaling from another GradScaler"):
        GradScaler(init_loss_scaling=8.0).attach(first)
    with pytest.raises(TypeError, match=r"train_batch\(scaler='fp16'\).*GradScaler"):
        model.train_batch({"x": jnp.ones((8, 2))}, first, loss_fn=loss_fn, scaler="fp16")
    with pytest.raises(TypeError, match=r"group_sharded_parallel\(scaler=3\)"):
        group_sharded_parallel(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1), "os", 3)


def test_scaler_step_with_grads_of_the_scaled_loss():
    # Paddle: scaled = scaler.scale(loss); scaled.backward(); scaler.step(opt); scaler.update()
    fleet.init(is_collective=True, log_level="WARNING")
    model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.sgd(0.5))
    scaler = GradScaler(init_loss_scaling=64.0, incr_every_n_steps=1)
    batch = jax.tree.map(jnp.asarray, make_batch(0, poisoned=False))
    w0 = np.asarray(model.module.kernel[...])
    grads = nnx.grad(lambda m: scaler.scale(loss_fn(m, batch)))(model)
    scaler.step(opt, model, grads)
    scaler.update()
    plain = nnx.grad(loss_fn)(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), batch)
    want = w0 - 0.5 * np.asarray(plain["kernel"][...])
    np.testing.assert_allclose(np.asarray(model.module.kernel[...]), want, rtol=1e-5, atol=1e-6)
    assert scaler.get_loss_scaling() == 128.0  # one finite step, incr_every_n_steps=1

    poisoned = jax.tree.map(lambda g: g * jnp.inf, grads)
    scaler.step(opt, model, poisoned)
    np.testing.assert_array_equal(np.asarray(model.module.kernel[...]), want)  # skipped
    assert scaler.get_loss_scaling() == 64.0
    saved = scaler.state_dict()
    scaler.step(opt, model, grads)
    scaler.load_state_dict(saved)  # the optimizer has state: written in place
    assert scaler.state_dict()["scale"] == 64.0 and scaler.state_dict()["decr_count"] == 0

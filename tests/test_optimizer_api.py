"""Paddle's optimizer object on the distributed optimizer, and LR schedulers honoured."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet
from jfleet.optim import hyperparams
from jfleet.optim.lr import PiecewiseDecay, StepDecay
from jfleet.testing import assert_trees_close

FP32 = dict(rtol=1e-5, atol=1e-6)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batch(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {
        "x": rng.normal(size=(8, 4)).astype(np.float32),
        "y": rng.normal(size=(8, 2)).astype(np.float32),
    }


def numpy_sgd_step(w, b, batch, lr):
    """One SGD step on mean((x @ w + b - y) ** 2), with the gradient written out by hand."""
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    err = x @ w + b - y
    scale = 2.0 / err.size
    return w - lr * scale * x.T @ err, b - lr * scale * err.sum(0)


def linear_params(model):
    state = nnx.state(model.module, nnx.Param)
    return np.asarray(state["kernel"][...], np.float64), np.asarray(state["bias"][...], np.float64)


def test_lr_scheduler_is_applied_and_set_lr_never_recompiles():
    fleet.init(is_collective=True, log_level="WARNING")
    model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(hyperparams.sgd(1.0))
    sched = PiecewiseDecay(boundaries=[1, 2], values=[0.1, 0.05, 0.02])
    w, b = linear_params(model)
    applied = []
    for i in range(3):
        # Paddle: the update of this step applies the scheduler's current last_lr.
        applied.append(sched())
        model.train_batch(make_batch(i), opt, loss_fn=loss_fn, lr_scheduler=sched)
        w, b = numpy_sgd_step(w, b, make_batch(i), applied[-1])
        got_w, got_b = linear_params(model)
        np.testing.assert_allclose(got_w, w, **FP32)
        np.testing.assert_allclose(got_b, b, **FP32)
        assert opt.get_lr() == pytest.approx(sched(), rel=1e-6)  # the next step's rate
    assert applied == [0.1, 0.05, 0.02] and sched.last_epoch == 3

    # set_lr writes into the optimizer state: the same executable runs the next steps.
    step_fn = next(iter(_compiled(model)))
    sizes = step_fn._cache_size()
    opt.set_lr(0.5)
    assert opt.get_lr() == 0.5
    model.train_batch(make_batch(3), opt, loss_fn=loss_fn)
    w, b = numpy_sgd_step(w, b, make_batch(3), 0.5)
    np.testing.assert_allclose(linear_params(model)[0], w, **FP32)
    # An optax schedule as lr_scheduler: evaluated at the optimizer's update count (4).
    schedule = optax.linear_schedule(0.4, 0.0, transition_steps=8)
    model.train_batch(make_batch(4), opt, loss_fn=loss_fn, lr_scheduler=schedule)
    w, b = numpy_sgd_step(w, b, make_batch(4), 0.2)
    np.testing.assert_allclose(linear_params(model)[1], b, **FP32)
    assert opt.get_lr() == pytest.approx(0.15)  # schedule(5), for the next update
    assert step_fn._cache_size() == sizes and len(_compiled(model)) == 1


def _compiled(model):
    from jfleet.training.engine import TrainStep, cached_step

    cache = cached_step(TrainStep, loss_fn, model.placement)._cache
    return list(cache._hashed.values()) + [fn for _, fn in cache._unhashable]


def test_step_minimize_clear_grad_and_state_dict():
    fleet.init(is_collective=True, log_level="WARNING")
    model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(hyperparams.adam(0.05))
    assert opt._inner_opt is opt.inner_tx
    assert opt.get_lr() == pytest.approx(0.05)  # readable before the state exists
    opt.set_lr(0.1)  # kept, written in when the state is made
    ref = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    ref_tx = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    ref_params = nnx.state(ref, nnx.Param)
    ref_state = ref_tx.init(ref_params)

    def ref_step(batch, lr=0.1):
        nonlocal ref_params, ref_state
        ref_state.hyperparams["learning_rate"] = jnp.asarray(lr)
        grads = nnx.grad(loss_fn)(ref, jax.tree.map(jnp.asarray, batch))
        updates, ref_state = ref_tx.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        nnx.update(ref, ref_params)

    # Paddle: loss.backward(); opt.step(); opt.clear_grad()
    batch = jax.tree.map(jnp.asarray, make_batch(0))
    grads = nnx.grad(loss_fn)(model, batch)
    opt.init(model)
    opt.step(model, grads)
    opt.clear_grad()
    ref_step(make_batch(0))
    assert int(opt.step[...]) == 1 and opt.get_lr() == pytest.approx(0.1)
    # Paddle: opt.minimize(loss), as a function of the model and the batch.
    loss = opt.minimize(loss_fn, model, make_batch(1))
    np.testing.assert_allclose(float(loss), float(loss_fn(ref, make_batch(1))), rtol=1e-5)
    ref_step(make_batch(1))
    assert_trees_close(nnx.state(model.module, nnx.Param), ref_params, **FP32)

    saved = opt.state_dict()
    assert saved["step"] == 2 and saved["learning_rate"] == pytest.approx(0.1)
    assert any(key.endswith("mu/module/kernel") for key in saved)
    other = fleet.distributed_optimizer(hyperparams.adam(0.05)).init(model)
    other.set_state_dict(saved)  # into a fresh optimizer: state, step and rate
    again = other.state_dict()
    assert again.keys() == saved.keys() and other.get_lr() == pytest.approx(0.1)
    assert all(np.array_equal(again[k], saved[k]) for k in saved)

    # Paddle: Adam(learning_rate=sched); loss.backward(); opt.step(); sched.step()
    sched = StepDecay(0.1, step_size=1, gamma=0.5)
    opt.set_lr_scheduler(sched)
    with pytest.raises(ValueError, match=r"set_lr\(value=0\.3\).*set_lr_scheduler"):
        opt.set_lr(0.3)
    for i in (2, 3):
        batch = jax.tree.map(jnp.asarray, make_batch(i))
        opt.step(model, nnx.grad(loss_fn)(model, batch))
        ref_step(make_batch(i), lr=sched())
        sched.step()
        assert opt.get_lr() == sched()
    assert_trees_close(nnx.state(model.module, nnx.Param), ref_params, **FP32)
    assert float(opt.opt_state.hyperparams["learning_rate"][...]) == pytest.approx(0.05)


# ------------------------------------------------------------------------- bad input


def test_bad_optimizer_api_use():
    fleet.init(is_collective=True, log_level="WARNING")
    opt = fleet.distributed_optimizer(hyperparams.sgd(0.1))
    with pytest.raises(ValueError, match=r"set_lr\(value=-1\.0\).*finite and >= 0"):
        opt.set_lr(-1)
    with pytest.raises(TypeError, match=r"set_lr\(value='fast'\).*must be a number"):
        opt.set_lr("fast")
    with pytest.raises(RuntimeError, match=r"opt\.state_dict\(\).*no state yet.*opt\.init"):
        opt.state_dict()
    with pytest.raises(ValueError, match=r"not readable.*inject_hyperparams\(optax\.adam\)"):
        fleet.distributed_optimizer(optax.adam(1e-3)).get_lr()
    scheduled = fleet.distributed_optimizer(hyperparams.sgd(optax.linear_schedule(1.0, 0.0, 4)))
    with pytest.raises(ValueError, match=r"set_lr: .* an optax schedule"):
        scheduled.set_lr(0.1)
    with pytest.raises(TypeError, match=r"step count.*train_batch\(\.\.\., lr_scheduler"):
        hyperparams.sgd(StepDecay(0.1, step_size=2)).init(jnp.zeros(2))

    model = fleet.distributed_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    opt.init(model)
    with pytest.raises(TypeError, match=r"opt\.step\(model=DistributedModel, grads=NoneType\)"):
        opt.step(model)
    with pytest.raises(TypeError, match=r"model=Linear, batch\).*make_train_step"):
        opt.minimize(loss_fn, model.module, make_batch(0))
    saved = opt.state_dict()
    with pytest.raises(KeyError, match=r"missing keys \['step'\]"):
        opt.set_state_dict({k: v for k, v in saved.items() if k != "step"})
    key = next(k for k in saved if k.endswith("kernel") or k.endswith("learning_rate"))
    with pytest.raises(ValueError, match=r"has shape \(3,\)"):
        opt.set_state_dict({**saved, key: np.zeros(3)})
    with pytest.raises(TypeError, match=r"lr_scheduler=3.*Paddle-style scheduler"):
        model.train_batch(make_batch(0), opt, loss_fn=loss_fn, lr_scheduler=3)
    with pytest.raises(TypeError, match=r"compute_loss=True\) needs loss_fn"):
        model.eval_batch(make_batch(0), compute_loss=True)

"""The engine's fast path: no split, no optimizer init, no cache key after the first step,
and every change a user makes to the model or the optimizer between steps still seen."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import DistributedOptimizer, fleet, make_train_step
from jfleet.optim import hyperparams
from jfleet.training.engine import _CompileCache
from tests.fleet_setup import init_fleet

FP32 = dict(rtol=1e-5, atol=1e-6)


class MLP(nnx.Module):
    def __init__(self, width: int = 8, *, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.up = nnx.Linear(4, width, rngs=rngs)
        self.down = nnx.Linear(width, 2, rngs=rngs)
        self.scale = 1.0  # a static attribute

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x))) * self.scale


def mlp_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(16, 4)).astype(np.float32),
            "y": rng.normal(size=(16, 2)).astype(np.float32),
        }
        for _ in range(n)
    ]


@pytest.fixture
def counters(monkeypatch):
    """Counts nnx.split, optimizer init and compile-cache lookups (key building) calls."""
    counts = {"split": 0, "init": 0, "key": 0}

    def counting(name, owner, attr):
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, attr, wrapper)

    counting("split", nnx, "split")
    counting("init", DistributedOptimizer, "init")
    counting("key", _CompileCache, "get_or_build")
    return counts


def setup(lr=0.1, module=None):
    init_fleet({"dp_degree": 8})
    model = fleet.distributed_model(module or MLP())
    opt = fleet.distributed_optimizer(hyperparams.sgd(lr))
    return model, opt, make_train_step(mlp_loss)


def eager_loss(model, batch):
    return float(mlp_loss(model.module, jax.tree.map(jnp.asarray, batch)))


def test_no_split_init_or_key_after_the_first_step(counters):
    model, opt, step = setup()
    data = batches(4)
    step(model, opt, data[0])
    assert counters == {"split": 2, "init": 1, "key": 1}  # model and optimizer split once
    for b in data[1:]:
        want = eager_loss(model, b)
        np.testing.assert_allclose(float(step(model, opt, b)), want, **FP32)
    assert counters == {"split": 2, "init": 1, "key": 1}
    # the model's values are the step's outputs, and the program compiled once
    assert len(step._cache) == 1
    assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.state(model)))


def test_values_written_between_steps_are_used_without_the_full_path(counters):
    model, opt, step = setup()
    data = batches(3)
    step(model, opt, data[0])
    # nnx.update in place (as loading a checkpoint into the model does): same shardings
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 0.5, params))
    want = eager_loss(model, data[1])
    np.testing.assert_allclose(float(step(model, opt, data[1])), want, **FP32)
    # opt.set_lr writes into the optimizer state: lr 0 leaves the parameters where they are
    opt.set_lr(0.0)
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    step(model, opt, data[2])
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    opt.set_lr(0.1)
    step(model, opt, data[2])
    assert not np.array_equal(
        np.asarray(model.module.up.kernel[...]), before["module"]["up"]["kernel"]
    )
    assert counters["split"] == 2 and counters["key"] == 1  # all on the fast path


def test_structure_and_static_changes_take_the_full_path(counters):
    model, opt, step = setup()
    data = batches(4)
    step(model, opt, data[0])
    # a static attribute assigned: the program traced with the old value must not run
    model.module.scale = 3.0
    want = eager_loss(model, data[1])
    np.testing.assert_allclose(float(step(model, opt, data[1])), want, **FP32)
    assert counters["key"] == 2
    # a submodule swapped for one with the same shapes: its parameters are read and trained
    new = model.placement.place_params(nnx.Linear(8, 2, rngs=nnx.Rngs(7)))
    model.module.down = new
    want = eager_loss(model, data[2])
    kernel = np.asarray(new.kernel[...])
    np.testing.assert_allclose(float(step(model, opt, data[2])), want, **FP32)
    assert model.module.down is new and not np.array_equal(np.asarray(new.kernel[...]), kernel)
    assert counters["key"] == 3
    # a value of another sharding (split over dp, not replicated): another program
    split = NamedSharding(model.placement.mesh, P("dp"))
    model.module.up.bias.set_value(jax.device_put(np.ones(8, np.float32), split))
    want = eager_loss(model, data[3])
    np.testing.assert_allclose(float(step(model, opt, data[3])), want, **FP32)
    assert counters["key"] == 4


def test_another_model_or_mode_rebinds_and_a_dead_model_is_let_go(counters):
    model, opt, step = setup()
    data = batches(2)
    step(model, opt, data[0])
    other = fleet.distributed_model(MLP(seed=1))
    other_opt = fleet.distributed_optimizer(hyperparams.sgd(0.1))
    want = eager_loss(other, data[1])
    np.testing.assert_allclose(float(step(other, other_opt, data[1])), want, **FP32)
    assert counters["init"] == 2  # the other optimizer is bound to the other model
    want = eager_loss(model, data[1])
    np.testing.assert_allclose(float(step(model, opt, data[1])), want, **FP32)
    bound = step._bound
    del model, opt
    gc.collect()
    assert bound.variables is None  # the binding holds no arrays of a dead model

"""Bad input to the engine, the strategy compiler and the model wrapper: clear errors."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import DistributedStrategy, fleet, group_sharded_parallel, make_train_step
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.parallel.recompute import apply_recompute
from tests.fleet_setup import init_fleet


def test_lamb_over_sgd_names_the_family():
    init_fleet(lamb=True)
    with pytest.raises(ValueError, match="(?i)adam.*(sgd|momentum)|(sgd|momentum).*adam"):
        fleet.distributed_optimizer(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))


def test_lars_over_adam_names_the_family():
    init_fleet(lars=True)
    with pytest.raises(ValueError, match="(?i)momentum.*adam|adam.*momentum"):
        fleet.distributed_optimizer(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))


def test_lamb_over_plain_adam_shows_the_fix():
    init_fleet(lamb=True)
    with pytest.raises(ValueError, match="inject_hyperparams"):
        fleet.distributed_optimizer(optax.adam(1e-3))


@pytest.mark.parametrize("k", [0, -1])
def test_gradient_merge_k_steps_below_one(k):
    with pytest.raises(ValueError, match=f"k_steps.*{k}|{k}.*k_steps"):
        s = DistributedStrategy()
        s.gradient_merge = True
        s.gradient_merge_configs = {"k_steps": k}
        fleet.init(strategy=s, log_level="WARNING")
        fleet.distributed_optimizer(optax.sgd(0.1))


def test_sharding_stage_4():
    with pytest.raises(ValueError, match="stage.*4|4.*stage"):
        init_fleet({"dp_degree": 2, "sharding_degree": 4}, sharding_configs={"stage": 4})


def test_sharding_degree_not_dividing_devices():
    with pytest.raises(ValueError, match="sharding_degree=3"):
        init_fleet({"dp_degree": -1, "sharding_degree": 3})


def test_recompute_checkpoint_matching_nothing():
    init_fleet(recompute=True, recompute_configs={"checkpoints": ["NoSuchBlock"]})
    with pytest.raises(ValueError, match="NoSuchBlock.*matches no sub-module"):
        fleet.distributed_model(TinyLM())


def test_batch_not_divisible_by_data_parallel_size():
    init_fleet({"dp_degree": 2, "sharding_degree": 4})
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    batch = lm_batches(1, batch=6)[0]
    with pytest.raises(ValueError, match=r"batch size 6.*data-parallel size 8"):
        model.train_batch(batch, opt, loss_fn=lm_loss)


def test_lamb_with_lars_names_both_switches():
    init_fleet(lamb=True, lars=True)
    with pytest.raises(ValueError, match=r"strategy\.lamb=True and strategy\.lars=True"):
        fleet.distributed_optimizer(optax.sgd(0.1))


def test_dgc_with_amp_names_both_switches():
    init_fleet(dgc=True, amp=True)
    with pytest.raises(ValueError, match=r"strategy\.dgc=True and strategy\.amp=True"):
        fleet.distributed_optimizer(optax.sgd(0.1))


def test_group_sharded_parallel_bad_level():
    with pytest.raises(ValueError, match="level='p_os'"):
        group_sharded_parallel(TinyLM(), optax.sgd(0.1), level="p_os")


def test_loss_fn_returning_a_vector():
    init_fleet()
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    step = make_train_step(lambda m, b: m(b["tokens"]).mean(axis=(1, 2)))
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        step(model, opt, lm_batches(1)[0])


def test_optimizer_reused_for_another_model():
    init_fleet()
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    fleet.distributed_model(TinyLM()).train_batch(lm_batches(1)[0], opt, loss_fn=lm_loss)
    other = fleet.distributed_model(nnx.Linear(3, 3, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="one distributed optimizer per model"):
        opt.init(other)


def test_not_an_optimizer():
    init_fleet()
    with pytest.raises(TypeError, match="optimizer='adam'"):
        fleet.distributed_optimizer("adam")


def test_not_a_module():
    init_fleet()
    with pytest.raises(TypeError, match="model=dict"):
        fleet.distributed_model({"w": np.ones(3)})


def test_get_loss_scaling_without_fp16():
    init_fleet()
    fleet.distributed_optimizer(optax.sgd(0.1))
    with pytest.raises(RuntimeError, match="no fp16 loss scaling"):
        fleet.get_loss_scaling()


def count_checkpoints(model):
    graphdef, state = nnx.split(model)
    batch = jax.tree.map(np.asarray, lm_batches(1)[0])

    def grads(state):
        return nnx.grad(lm_loss)(nnx.merge(graphdef, state), batch)

    return str(jax.make_jaxpr(grads)(state)).count("remat2[")  # jax.checkpoint's primitive


def test_recompute_puts_named_modules_under_checkpoint():
    assert count_checkpoints(TinyLM()) == 0
    assert count_checkpoints(apply_recompute(TinyLM(), ["Block"])) == 2
    assert count_checkpoints(apply_recompute(TinyLM(), ["blocks.1"])) == 1
    assert count_checkpoints(apply_recompute(TinyLM(), ["blocks.*.up", "head"])) == 3

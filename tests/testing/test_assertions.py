"""jfleet.testing's assertions: each passes on correct parallel code and names what is wrong."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.testing import (
    NotEnoughDevicesError,
    assert_collectives,
    assert_peak_memory_below,
    assert_sharded_as,
    assert_trains_like_one_device,
    assert_trees_close,
    emulate_cpu_devices,
    make_strategy,
    require_devices,
)

#: fp32 Adam over a few steps (reductions run in another order on 8 devices).
TOL = dict(rtol=1e-4, atol=1e-4)


def llama() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2)


def test_llama_trains_like_one_device_under_three_layouts():
    for layout in ({"dp": 8}, {"dp": 2, "mp": 4}, {"dp": 2, "pp": 2, "mp": 2}):
        assert_trains_like_one_device(
            llama, optax.adam(1e-2), lm_batches(3), loss_fn=lm_loss, layout=layout, **TOL
        )


def dp_trainer(mesh, drop: str | None = None):
    """A shard_map data-parallel trainer; ``drop`` names a parameter whose gradient it
    leaves un-averaged (the planted bug: a missing all-reduce)."""

    def train(model, tx, batches, loss_fn):
        graphdef, params = nnx.split(model)
        opt_state = tx.init(params)

        def average(path, g):
            name = ".".join(str(k.key) for k in path if hasattr(k, "key"))
            return g if name == drop else jax.lax.pmean(g, "dp")

        @jax.jit
        @partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(P(), P(), P("dp")),
            out_specs=P(),
            check_vma=False,  # lets the bug through: device 0's gradient is kept
        )
        def step(params, opt_state, batch):
            grad_fn = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))
            loss, grads = grad_fn(params)
            grads = jax.tree_util.tree_map_with_path(average, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "dp")

        losses = []
        for batch in batches:
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(loss)
        nnx.update(model, params)
        return losses

    return train


def test_a_dropped_gradient_all_reduce_is_caught_naming_the_step_and_the_leaf(mesh_factory):
    mesh = mesh_factory(dp=8)
    args = (TinyLM, optax.adam(1e-2), lm_batches(3))
    assert_trains_like_one_device(*args, loss_fn=lm_loss, layout=dp_trainer(mesh), **TOL)
    with pytest.raises(AssertionError) as caught:
        assert_trains_like_one_device(
            *args, loss_fn=lm_loss, layout=dp_trainer(mesh, drop="head.kernel"), **TOL
        )
    message = str(caught.value)
    assert "losses diverge first at step 1" in message
    first_update = message.split("after the first 1 update(s) the parameters differ at:")[1]
    first_update = first_update.split("losses (got)")[0]
    # only the leaf whose all-reduce was dropped is wrong after the first update
    assert first_update.strip().startswith("'head.kernel'")
    assert first_update.count("'") == 2


def test_a_fleet_strategy_trains_like_one_device():
    assert_trains_like_one_device(
        TinyLM,
        optax.adam(1e-2),
        lm_batches(2),
        loss_fn=lm_loss,
        layout=make_strategy({"dp_degree": 4, "mp_degree": 2}),
        **TOL,
    )


def test_layouts_needing_more_devices_say_how_to_get_them():
    with pytest.raises(NotEnoughDevicesError, match="--jfleet-devices 16"):
        assert_trains_like_one_device(
            TinyLM, optax.sgd(0.1), lm_batches(1), loss_fn=lm_loss, layout={"dp": 16}
        )
    with pytest.raises(TypeError, match="layout="):
        assert_trains_like_one_device(
            TinyLM, optax.sgd(0.1), lm_batches(1), loss_fn=lm_loss, layout="dp8"
        )
    require_devices(8)
    with pytest.raises(RuntimeError, match="already started with 8 device"):
        emulate_cpu_devices(4)


def test_assert_sharded_as_checks_every_match_and_lists_problems(mesh_factory):
    mesh = mesh_factory(dp=2, mp=4)
    model = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
    model.kernel.set_value(jax.device_put(model.kernel[...], NamedSharding(mesh, P(None, "mp"))))
    model.bias.set_value(jax.device_put(model.bias[...], NamedSharding(mesh, P("mp"))))
    assert_sharded_as(model, {"kernel": (None, "mp"), "b*": P("mp", None)})
    with pytest.raises(AssertionError) as caught:
        assert_sharded_as(model, {"*": ("mp",), "layers.*": None})
    message = str(caught.value)
    assert "'kernel': P(None, 'mp'), want P('mp',)" in message
    assert "'bias'" not in message  # P("mp") is what the bias has
    assert "'layers.*' matches no array (paths: bias, kernel)" in message


def mp_sum(mesh):
    """One all-reduce over 'mp' of each device's 4 floats."""
    return jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "mp"), mesh=mesh, in_specs=P("mp"),
                                 out_specs=P()))  # fmt: skip


def test_assert_collectives_counts_kinds_and_bytes(mesh_factory):
    step, x = mp_sum(mesh_factory(mp=4)), jnp.ones(16)
    per_device = 4 * 4  # f32[4] on each device
    summary = assert_collectives(
        step, x, expected={"all-reduce": 1, "all-gather": 0}, expected_bytes={"all-reduce": 16}
    )
    assert summary["all-reduce"].bytes == per_device
    compiled = step.lower(x).compile()
    with pytest.raises(AssertionError, match="all-reduce: 1, want 2") as caught:
        assert_collectives(compiled, expected={"all-reduce": 2})
    assert "16 bytes x1, groups of 4" in str(caught.value)
    with pytest.raises(ValueError, match="all_reduce"):
        assert_collectives(compiled.as_text(), expected={"all_reduce": 1})


def test_assert_peak_memory_below_counts_arguments_outputs_and_temporaries():
    x = np.zeros((256, 1024), np.float32)  # 1 MiB in, 1 MiB out
    step = jax.jit(lambda x: x + 1)
    need = assert_peak_memory_below(step, 64 * 2**20, x)
    assert need >= 2 * x.nbytes
    with pytest.raises(AssertionError, match="not below the limit 1,572,864"):
        assert_peak_memory_below(step, 1.5 * 2**20, x)
    with pytest.raises(ValueError, match="limit=0"):
        assert_peak_memory_below(step, 0, x)


def test_the_tolerance_rule_scales_with_the_leaf_and_the_reduction_depth():
    want = {"w": np.array([100.0, 0.0], np.float32)}
    near_zero = {"w": np.array([100.0, 2e-3], np.float32)}  # a reordered sum's rounding
    assert_trees_close(near_zero, want, devices=8)  # 4e-5 x max |w| = 4e-3
    with pytest.raises(AssertionError, match=r"\['w'\] \(devices=1\)"):
        assert_trees_close(near_zero, want)  # 1e-5 x 100 = 1e-3 on one reordering
    with pytest.raises(AssertionError, match="devices=8"):
        assert_trees_close({"w": np.array([100.0, 5e-3], np.float32)}, want, devices=8)
    with pytest.raises(ValueError, match="devices=0"):
        assert_trees_close(want, want, devices=0)

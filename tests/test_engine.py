"""The engine trains every mode exactly like the same computation on one device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet, make_train_step
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.optim import hyperparams
from jfleet.optim.clip import clip_by_global_norm, global_norm
from jfleet.testing import assert_trees_close, make_strategy, train_one_device
from tests.fleet_setup import init_fleet

STEPS = 4


def fleet_run(strategy, tx, batches, loss_fn=lm_loss):
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(tx)
    losses = [float(model.train_batch(b, opt, loss_fn=loss_fn)) for b in batches]
    return np.array(losses), nnx.state(model.module, nnx.Param), model, opt


ADAM = lambda: optax.adam(1e-2)  # noqa: E731
# Half-precision modes train with SGD: Adam divides by sqrt(v), so a gradient element
# near zero whose rounding differs flips its update from +lr to -lr, which says nothing
# about the engine. With SGD a parameter moves by lr * grad (lr 0.5, grads ~1e-2).
SGD = lambda: optax.sgd(0.5)  # noqa: E731
FP32 = dict(rtol=1e-5, atol=1e-6)
# Half precision: O1 computes each Linear (and its backward) in the half type, so a
# gradient such as the head bias's is a half-precision sum over the 128 tokens of a
# batch, and the sharded run sums in another order: relative error ~ eps * sqrt(128)
# (bf16 eps 7.8e-3 -> ~9e-2 of a gradient of ~1.6e-2). Over 4 SGD steps of lr 0.5 that
# moves a parameter by up to ~3e-3 (bf16) / ~4e-4 (fp16, eps 9.8e-4). A wrong loss
# scale, a skipped update or a missing cast moves parameters by lr * grad ~ 8e-3 per
# step, several steps over, so these tolerances still catch them.
BF16 = dict(rtol=2e-2, atol=4e-3)
FP16 = dict(rtol=2e-3, atol=5e-4)

DP8 = {"dp_degree": 8}
ZERO = {"dp_degree": 2, "sharding_degree": 4}

MODES = {
    "dp8": (DP8, {}, ADAM, FP32),
    "zero1": (ZERO, {"sharding_configs": {"stage": 1}}, ADAM, FP32),
    "zero2": (ZERO, {"sharding_configs": {"stage": 2}}, ADAM, FP32),
    "zero3": (ZERO, {"sharding_configs": {"stage": 3}}, ADAM, FP32),
    "amp_bf16_o1": (DP8, {"amp": True, "amp_configs": {"dtype": "bfloat16"}}, SGD, BF16),
    "amp_bf16_o2": (DP8, {"amp": True, "amp_configs": {"use_pure_bf16": True}}, SGD, BF16),
    "amp_fp16_dynamic": (DP8, {"amp": True, "amp_configs": {"dtype": "float16"}}, SGD, FP16),
    "gradient_merge_k4": (
        {"dp_degree": 8},
        {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 4, "avg": True}},
        SGD,
        FP32,
    ),
    "lamb": ({"dp_degree": 8}, {"lamb": True}, lambda: hyperparams.adam(1e-2), FP32),
    "lars": ({"dp_degree": 8}, {"lars": True}, lambda: hyperparams.momentum(1e-1), FP32),
    # the clip norm is far below the gradients' global norm (~1), so every step clips;
    # a norm taken per shard instead of over the whole mesh would scale differently
    "clip_global_norm_zero2": (
        {"dp_degree": 2, "sharding_degree": 4},
        {"sharding_configs": {"stage": 2}},
        lambda: optax.chain(clip_by_global_norm(0.05), optax.sgd(0.5)),
        FP32,
    ),
    "recompute": (
        {"dp_degree": 4, "sharding_degree": 2},
        {"recompute": True, "recompute_configs": {"checkpoints": ["Block"]}},
        ADAM,
        FP32,
    ),
}  # fmt: skip


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_matches_single_device(mode):
    hybrid, settings, make_tx, tol = MODES[mode]
    batches = lm_batches(STEPS if "merge" not in mode else 8)
    want_losses, want_params = train_one_device(
        TinyLM(), make_tx(), batches, lm_loss, strategy=make_strategy(hybrid, **settings)
    )
    got_losses, got_params, _, _ = fleet_run(make_strategy(hybrid, **settings), make_tx(), batches)
    np.testing.assert_allclose(got_losses, want_losses, rtol=tol["rtol"])
    assert_trees_close(got_params, want_params, **tol)
    # the run really trained (a no-op engine would keep the initial parameters)
    initial = nnx.state(TinyLM(), nnx.Param)
    moved = max(
        float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
        for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(initial), strict=True)
    )
    assert moved > 1e-3


def test_gradient_merge_moves_params_every_kth_call_only():
    strategy = make_strategy(
        {"dp_degree": 8}, gradient_merge=True, gradient_merge_configs={"k_steps": 4}
    )
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    before = jax.tree.map(np.asarray, nnx.state(model.module, nnx.Param))
    changed = []
    for batch in lm_batches(8):
        model.train_batch(batch, opt, loss_fn=lm_loss)
        now = jax.tree.map(np.asarray, nnx.state(model.module, nnx.Param))
        changed.append(
            any(
                not np.array_equal(a, b)
                for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(before), strict=True)
            )
        )
        before = now
    assert changed == [False, False, False, True] * 2


def test_gradient_merge_equals_one_step_on_concatenated_batch():
    parts = lm_batches(4, batch=8)
    whole = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    merged = make_strategy(
        {"dp_degree": 8}, gradient_merge=True, gradient_merge_configs={"k_steps": 4, "avg": True}
    )
    _, merged_params, _, _ = fleet_run(merged, optax.sgd(0.5), parts)
    fleet._reset()
    _, one_params, _, _ = fleet_run(make_strategy({"dp_degree": 8}), optax.sgd(0.5), [whole])
    assert_trees_close(merged_params, one_params, rtol=1e-5, atol=1e-6)


def test_fp16_injected_inf_skips_step_and_follows_paddles_rule():
    strategy = make_strategy(
        {"dp_degree": 8},
        amp=True,
        amp_configs={"dtype": "float16", "incr_every_n_steps": 3, "decr_every_n_nan_or_inf": 2},
    )
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.adam(1e-2))

    def loss_fn(m, batch):
        return lm_loss(m, batch) * batch["poison"][0]

    def batch(poison: float):
        b = lm_batches(1)[0]
        b["poison"] = np.full((16,), poison, np.float32)
        return b

    def snapshot():
        return jax.tree.map(np.asarray, (nnx.state(model.module, nnx.Param), nnx.state(opt)))

    model.train_batch(batch(1.0), opt, loss_fn=loss_fn)  # one finite step: good=1
    assert fleet.get_loss_scaling() == 32768.0
    before = snapshot()
    model.train_batch(batch(np.inf), opt, loss_fn=loss_fn)
    after = snapshot()
    params_b, opt_b = before
    params_a, opt_a = after
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        assert np.array_equal(a, b)  # bit-identical parameters
    moments_b = [x for x in jax.tree.leaves(opt_b) if x.ndim > 0]
    moments_a = [x for x in jax.tree.leaves(opt_a) if x.ndim > 0]
    assert all(np.array_equal(a, b) for a, b in zip(moments_a, moments_b, strict=True))
    assert fleet.get_loss_scaling() == 32768.0  # one bad step of two
    model.train_batch(batch(np.nan), opt, loss_fn=loss_fn)
    assert fleet.get_loss_scaling() == pytest.approx(32768.0 * 0.8)
    for _ in range(3):
        model.train_batch(batch(1.0), opt, loss_fn=loss_fn)
    assert fleet.get_loss_scaling() == pytest.approx(32768.0 * 0.8 * 2.0)


def test_make_train_step_is_the_same_step_as_train_batch():
    batches = lm_batches(3)
    strategy = make_strategy({"dp_degree": 8})
    want, _, _, _ = fleet_run(strategy, optax.adam(1e-2), batches)
    fleet._reset()
    fleet.init(is_collective=True, strategy=make_strategy({"dp_degree": 8}), log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    step = make_train_step(lm_loss)
    got = np.array([float(step(model, opt, b)) for b in batches])
    np.testing.assert_array_equal(got, want)


def test_users_own_nnx_jit_step_keeps_working():
    fleet.init(
        is_collective=True,
        strategy=make_strategy(
            {"dp_degree": 2, "sharding_degree": 4}, sharding_configs={"stage": 1}
        ),
        log_level="WARNING",
    )
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.adam(1e-2)).init(model)
    batches = lm_batches(3)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    got = [float(step(model, opt, jax.tree.map(jnp.asarray, b))) for b in batches]
    want, _ = train_one_device(
        TinyLM(), optax.adam(1e-2), batches, lm_loss, strategy=make_strategy({"dp_degree": 8})
    )
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_eval_batch_does_not_update():
    fleet.init(is_collective=True, log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    batch = lm_batches(1)[0]
    before = jax.tree.map(np.asarray, nnx.state(model.module))
    loss = model.eval_batch(batch, loss_fn=lm_loss)
    np.testing.assert_allclose(float(loss), float(lm_loss(TinyLM(), batch)), rtol=1e-5)
    # Paddle 3.x's default, compute_loss=False: the outputs on the [inputs, labels] inputs.
    logits = model.eval_batch((batch["tokens"], batch["labels"]))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(TinyLM()(batch["tokens"])), **FP32)
    after = jax.tree.map(np.asarray, nnx.state(model.module))
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)
    )


def test_aux_is_returned_and_loss_is_fp32():
    fleet.init(is_collective=True, log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    step = make_train_step(lambda m, b: (lm_loss(m, b), {"n": b["tokens"].shape[0]}))
    loss = step(model, opt, lm_batches(1)[0])
    assert loss.dtype == jnp.float32
    assert int(step.last_aux["n"]) == 16


def test_clip_norm_in_the_clip_mode_is_really_exceeded():
    model = TinyLM()
    grads = nnx.grad(lm_loss)(model, jax.tree.map(jnp.asarray, lm_batches(1)[0]))
    assert float(global_norm(nnx.state(grads, nnx.Param))) > 4 * 0.05


@dataclasses.dataclass
class MLPConfig:
    """A config object with list fields: not hashable, so neither is a graph def holding it."""

    sizes: list[int]
    scales: list[float]


class ListConfigMLP(nnx.Module):
    """A two-layer MLP whose config holds lists, as plain attributes or in a dataclass."""

    def __init__(self, sizes=(4, 8, 2), scales=(1.0, 2.0), *, in_dataclass=False):
        config = MLPConfig(list(sizes), list(scales))
        if in_dataclass:
            self.config = config
        else:
            self.sizes, self.scales = config.sizes, config.scales
        rngs = nnx.Rngs(0)
        self.up = nnx.Linear(config.sizes[0], config.sizes[1], rngs=rngs)
        self.down = nnx.Linear(config.sizes[1], config.sizes[2], rngs=rngs)

    def __call__(self, x):
        scales = self.config.scales if hasattr(self, "config") else self.scales
        return self.down(nnx.relu(self.up(x)) * scales[0]) * scales[1]


def mlp_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def mlp_batches(n, batch=16):
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(batch, 4)).astype(np.float32),
            "y": rng.normal(size=(batch, 2)).astype(np.float32),
        }
        for _ in range(n)
    ]


def plain_nnx_jit_run(model, batches):
    """The reference: a hand-written ``nnx.jit`` step on one device."""
    with jax.default_device(jax.devices()[0]):
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, batch):
            loss, grads = nnx.value_and_grad(mlp_loss)(model, batch)
            opt.update(model, grads)
            return loss

        losses = [float(step(model, opt, jax.tree.map(jnp.asarray, b))) for b in batches]
    return np.array(losses), nnx.state(model, nnx.Param)


@pytest.mark.parametrize("in_dataclass", [False, True], ids=["list_attribute", "dataclass"])
def test_make_train_step_trains_a_model_whose_config_holds_a_list(in_dataclass):
    with pytest.raises(TypeError, match="unhashable"):
        hash(nnx.graphdef(ListConfigMLP(in_dataclass=in_dataclass)))  # what broke the cache
    batches = mlp_batches(3)
    want_losses, want_params = plain_nnx_jit_run(ListConfigMLP(in_dataclass=in_dataclass), batches)
    init_fleet({"dp_degree": 8})
    model = fleet.distributed_model(ListConfigMLP(in_dataclass=in_dataclass))
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    step = make_train_step(mlp_loss)
    got_losses = np.array([float(step(model, opt, b)) for b in batches])
    assert_trees_close(got_losses, want_losses, devices=8)  # dp8 against one device
    assert_trees_close(nnx.state(model.module, nnx.Param), want_params, devices=8)
    assert not np.allclose(got_losses[0], got_losses[-1])  # it trained


def test_step_with_unhashable_config_compiles_once_and_again_for_another_structure():
    traces = []

    def loss_fn(model, batch):
        traces.append(1)  # runs once per trace, i.e. once per compile
        return mlp_loss(model, batch)

    batches = mlp_batches(3)
    init_fleet({"dp_degree": 8})
    step = make_train_step(loss_fn)

    def train(module):
        model = fleet.distributed_model(module)
        opt = fleet.distributed_optimizer(optax.sgd(0.1))
        return model, opt, [float(step(model, opt, b)) for b in batches]

    model, opt, _ = train(ListConfigMLP())
    assert len(traces) == 1  # three calls, one compile

    # The same parameters but another value in the config's list: only the graph
    # definition differs, and reusing the first program would scale by the old value.
    _, _, got = train(ListConfigMLP(scales=(1.0, 3.0)))
    want, _ = plain_nnx_jit_run(ListConfigMLP(scales=(1.0, 3.0)), batches)
    assert len(traces) == 2
    assert_trees_close(np.array(got), np.array(want), devices=8)

    # Other layer sizes: another structure, another compile.
    train(ListConfigMLP(sizes=(4, 16, 2)))
    assert len(traces) == 3

    # The first model again: its program is still cached.
    step(model, opt, batches[0])
    assert len(traces) == 3

    # The config's list edited in place: the program traced with the old value must
    # not be reused (a hand-written nnx.jit step would reuse it).
    model.module.scales[1] = 5.0
    want_loss = float(mlp_loss(model.module, jax.tree.map(jnp.asarray, batches[1])))
    got_loss = float(step(model, opt, batches[1]))
    assert len(traces) == 4
    assert_trees_close(np.float32(got_loss), np.float32(want_loss), devices=8)

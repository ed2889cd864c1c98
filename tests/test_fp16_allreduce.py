"""The replica hook (jfleet.optim.communication) and strategy.fp16_allreduce on it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import fleet, make_train_step
from jfleet.mesh.topology import DATA_AXES
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.optim.communication import GradientCommunication, data_axes, mean_communication
from jfleet.testing import assert_trees_close, hlo, make_strategy, train_one_device

STEPS = 3
# fp16 keeps 11 significant bits: each replica's gradient (~1e-2) rounds by ~5e-6 before
# the sum, so over 3 SGD steps of lr 0.5 a parameter moves by ~1e-5 from the fp32 run,
# while the update itself is lr * grad ~ 5e-3 per step.
FP16_TOL = dict(rtol=1e-3, atol=1e-4)


def _run(strategy, tx, batches, *, communication=None, hlo_text=False, wrap=True):
    fleet._reset()
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    model = fleet.distributed_model(TinyLM()) if wrap else TinyLM()
    opt = fleet.distributed_optimizer(tx)
    if communication is not None:
        opt.communication = communication
    step = make_train_step(lm_loss)
    text = step.lower(model, opt, batches[0]).compile().as_text() if hlo_text else None
    losses = np.array([float(step(model, opt, b)) for b in batches])
    return losses, nnx.state(getattr(model, "module", model), nnx.Param), opt, text


@pytest.fixture(scope="module")
def dp_and_fp16():
    batches = lm_batches(STEPS)
    dp = _run(make_strategy({"dp_degree": 8}), optax.sgd(0.5), batches, hlo_text=True)
    half = _run(
        make_strategy({"dp_degree": 8}, fp16_allreduce=True),
        optax.sgd(0.5),
        batches,
        hlo_text=True,
    )
    fleet._reset()
    return dp, half


def test_fp16_allreduce_halves_gradient_all_reduce_bytes(dp_and_fp16):
    (_, _, _, fp32_text), (_, _, opt, fp16_text) = dp_and_fp16
    assert opt.applied_meta_list == ("FP16AllReduceOptimizer",)
    fp32 = hlo.summarize(fp32_text)["all-reduce"].bytes
    fp16 = hlo.summarize(fp16_text)["all-reduce"].bytes
    params = sum(x.size for x in jax.tree.leaves(nnx.state(TinyLM(), nnx.Param)))
    assert fp32 >= 4 * params  # the fp32 run reduces every gradient element in 4 bytes
    # half of it, plus at most the fp32 loss scalar the replicas average
    assert 2 * params <= fp16 <= fp32 / 2 + 8
    assert re.search(r"f16\[[0-9,]*\][^\n]* all-reduce\(", fp16_text)


def test_fp16_allreduce_trains_like_data_parallel(dp_and_fp16):
    (dp_losses, dp_params, _, _), (losses, params, _, _) = dp_and_fp16
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-4)
    assert_trees_close(params, dp_params, **FP16_TOL)
    assert losses[-1] < losses[0]


def test_fp16_allreduce_reduces_in_bfloat16_under_bf16_amp():
    from jfleet.optim.compiler import compile_strategy

    bf16 = make_strategy(fp16_allreduce=True, amp=True, amp_configs={"dtype": "bfloat16"})
    fp16 = make_strategy(fp16_allreduce=True)
    mesh = jax.make_mesh((8,), DATA_AXES[:1], axis_types=(jax.sharding.AxisType.Auto,))
    # replica i holds 1 + i / 1000: bf16 (8 bits) rounds that to 1.0, fp16 (11 bits) keeps it
    x = 1.0 + jnp.arange(8, dtype=jnp.float32) / 1000

    def mean_of(strategy):
        comm = compile_strategy(optax.sgd(0.1), strategy).communication
        body = lambda v: comm.reduce(v * 8, ())[0]  # noqa: E731
        mapped = jax.shard_map(body, mesh=mesh, in_specs=P(DATA_AXES[0]), out_specs=P())
        return float(jax.jit(mapped)(x)[0])

    exact = float(jnp.mean(x) * 8)
    assert mean_of(fp16) == pytest.approx(exact, rel=1e-3)
    assert mean_of(bf16) == pytest.approx(8.0, rel=1e-6)  # every 1 + i/1000 rounded to 1


def test_hook_with_plain_mean_equals_one_device_fp32():
    """The hook itself (per-replica gradients, pmean) on dp2 x sharding2 x mp2 with ZeRO-2."""
    batches = lm_batches(STEPS)
    strategy = make_strategy(
        {"dp_degree": 2, "sharding_degree": 2, "mp_degree": 2}, sharding_configs={"stage": 2}
    )
    want_losses, want = train_one_device(TinyLM(), optax.adam(1e-2), batches, lm_loss)
    losses, got, _, _ = _run(
        strategy, optax.adam(1e-2), batches, communication=mean_communication()
    )
    fleet._reset()
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)


def _summing_communication() -> GradientCommunication:
    """Keeps each replica's running sum of its own gradients (a DGC-like residual)."""

    def reduce(grads, state):
        total = jax.tree.map(jnp.add, state, grads)
        return jax.lax.pmean(grads, data_axes()), total

    return GradientCommunication(init=lambda g: jax.tree.map(jnp.zeros_like, g), reduce=reduce)


def test_hook_state_is_per_replica_and_holds_each_replicas_own_gradient():
    batch = lm_batches(1)[0]
    model0 = TinyLM()
    # replica i's gradient, computed on one device from its rows of the batch
    grad = nnx.jit(nnx.grad(lm_loss))
    rows = {k: v.reshape(8, 2, *v.shape[1:]) for k, v in batch.items()}
    want = [grad(model0, {k: v[i] for k, v in rows.items()}) for i in range(8)]
    _, _, opt, _ = _run(
        make_strategy({"dp_degree": 8}),
        optax.sgd(0.0),
        [batch],
        communication=_summing_communication(),
    )
    fleet._reset()
    state = nnx.as_pure(opt.comm_state)
    flat = {path[-2:]: x for path, x in nnx.to_flat_state(state)}
    kernel = flat[("head", "kernel")]
    assert kernel.shape == (8, 32, 64)
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(1, 32, 64)}
    assert any(path[0] == "comm_state" for path, _ in nnx.to_flat_state(nnx.state(opt)))
    for i in range(8):
        assert_trees_close(
            [x[i] for x in jax.tree.leaves(state)],
            jax.tree.leaves(nnx.as_pure(want[i])),
            rtol=1e-5,
            atol=1e-6,
        )
    assert not np.allclose(kernel[0], kernel[1])


@pytest.mark.parametrize(
    "hybrid, settings, match",
    [
        ({"dp_degree": 2, "sharding_degree": 4}, {"sharding_configs": {"stage": 3}}, "stage 3"),
        ({"dp_degree": 4, "pp_degree": 2}, {}, "pp_degree=2"),
    ],
)
def test_fp16_allreduce_unsupported_layouts_name_both_switches(hybrid, settings, match):
    strategy = make_strategy(hybrid, fp16_allreduce=True, **settings)
    if "sharding_configs" in settings:
        strategy.sharding = True
    with pytest.raises(ValueError, match=rf"strategy\.fp16_allreduce=True.*{match}"):
        _run(strategy, optax.sgd(0.1), lm_batches(1), wrap="pp_degree" not in hybrid)
    fleet._reset()

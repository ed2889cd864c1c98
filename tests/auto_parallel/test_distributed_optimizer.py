"""Megatron's distributed optimizer: AMP O2 parameters with fp32 masters and moments split
over every rank holding the same parameters (``dp x sharding x sep``), from
``to_distributed``, the Fleet strategy and the shape-built planner."""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import DistributedStrategy, fleet, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, plan_for, to_distributed
from jfleet.auto_parallel.cost.layout import Layout
from jfleet.auto_parallel.cost.profiles import get_profile
from jfleet.auto_parallel.search.cluster_plan import Cluster, plan
from jfleet.auto_parallel.search.model_shapes import MODEL_SHAPES, abstract_model
from jfleet.mesh.placement import Placement
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.testing import train_one_device

STEPS = 3
SPAN = ("dp", "sharding", "sep")


def llama() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2)


def pure_bf16() -> DistributedStrategy:
    strategy = DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"use_pure_bf16": True}
    return strategy


def _leaf_axes(x: jax.Array) -> set[str]:
    axes: set[str] = set()
    for entry in x.sharding.spec:
        axes.update(entry if isinstance(entry, tuple) else (entry,) if entry else ())
    return axes


def _fp32_state(opt) -> list[jax.Array]:
    """The optimizer state's parameter-sized fp32 arrays (masters, mu, nu)."""
    return [
        x
        for x in jax.tree.leaves(nnx.state(opt))
        if getattr(x, "ndim", 0) >= 1 and x.dtype == jnp.float32 and x.size >= 64
    ]


def test_o2_distributed_optimizer_trains_like_one_device():
    """bf16 parameters, fp32 masters and Adam moments split 8 ways over dp x sharding x
    sep, against the same O2 training on one device (the strategy's master weights,
    Adam 1e-2).

    Tolerance: bf16 keeps 8 significant bits (a relative step of 2^-8 = 3.9e-3). The
    distributed step sums the same products in another order (over the sep halves of the
    sequence, over the data shards) and rounds the bf16 activations of the forward at
    other points, so the losses agree to a few bf16 roundings, not to fp32's 1e-5:
    rtol 1e-3 (measured 2.7e-4 at step 3). The parameters are bf16 values of size ~0.1-1:
    after 3 steps 99% of them agree to 2^-6 (2 bf16 ulps of 1); Adam moves an entry
    whose gradient is near zero by up to lr a step whatever its size, so the rest (0.5%
    measured) stay within 3 lr + 2^-6.
    """
    batches = lm_batches(STEPS, batch=16)
    want, trained = train_one_device(
        llama(), optax.adam(1e-2), batches, lm_loss, strategy=pure_bf16()
    )
    config = ToDistributedConfig(
        force_mesh={"dp": 2, "sharding": 2, "sep": 2},
        sequence_parallel=True,
        zero_stage=1,
        distributed_optimizer=True,
        strategy=pure_bf16(),
    )
    model, opt, loader = to_distributed(llama(), optax.adam(1e-2), batches, config=config)
    lay = get_plan(model).layout
    assert lay.zero_spans_data and lay.zero_axes == SPAN
    kernel = model.layers.body.mlp.up_proj.kernel
    assert kernel.dtype == jnp.bfloat16  # O2 stores the parameters in half precision
    state = _fp32_state(opt)
    n_params = len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert len(state) >= 2 * n_params  # masters and moments (norms' masters are the params)
    for x in state:  # each split over all three data axes: 1/8 per device
        assert _leaf_axes(x) >= set(SPAN), x.sharding.spec
        assert x.addressable_shards[0].data.size * 8 == x.size, (x.shape, x.sharding.spec)
    step = make_train_step(lm_loss)
    losses = [float(step(model, opt, batch)) for batch in loader]
    np.testing.assert_allclose(losses, want, rtol=1e-3)
    ref = trained["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()
    got = np.asarray(kernel[...], np.float32).reshape(-1, *ref.shape)[0]
    _agree_as_adam_allows(got, ref)
    embed = model.embed_tokens.embedding[...]
    _agree_as_adam_allows(embed, trained["embed_tokens"]["embedding"].get_value())


def _agree_as_adam_allows(got, want, lr: float = 1e-2) -> None:
    gap = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert np.mean(gap > 2**-6) < 0.01, np.mean(gap > 2**-6)
    assert gap.max() <= STEPS * lr + 2**-6, gap.max()


@functools.cache
def _one_device_losses() -> tuple[float, ...]:
    """llama()'s Adam steps on one device at batch 16 (both stages compare to it)."""
    losses = train_one_device(llama(), optax.adam(1e-2), lm_batches(STEPS, batch=16), lm_loss)[0]
    return tuple(float(x) for x in losses)


@pytest.mark.parametrize("stage", [1, 3])
def test_fleet_dp_as_optimizer_sharding_spans_dp_and_sharding(stage):
    """Paddle's ``sharding_configs["_dp_as_optimizer_sharding"]``: ZeRO over dp x sharding,
    fp32, against one device (rtol 1e-5)."""
    strategy = DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "sharding_degree": 4}
    strategy.sharding_configs = {"stage": stage, "_dp_as_optimizer_sharding": True}
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    placement = Placement.from_fleet()
    assert placement.zero_axis == ("dp", "sharding") and placement.zero_degree == 8
    batches = lm_batches(STEPS, batch=16)
    want = _one_device_losses()
    model = fleet.distributed_model(llama())
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    opt.init(model)
    kernel = model.module.layers[0].mlp.up_proj.kernel
    mu = [x for x in jax.tree.leaves(nnx.state(opt)) if getattr(x, "shape", ()) == kernel.shape]
    assert mu and all(x.addressable_shards[0].data.size * 8 == x.size for x in mu)
    if stage == 3:
        assert kernel[...].addressable_shards[0].data.size * 8 == kernel.size
    step = make_train_step(lm_loss)
    got = [float(step(model, opt, batch)) for batch in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_o2_plans_half_parameters_and_split_masters():
    """plan_for(amp_level="O2"): half-precision parameters and gradients, fp32 masters
    beside the moments; the distributed optimizer splits those dp x sep times finer."""
    kw = dict(device_num=8, batch_size=16, seq_len=8, zero_stage=1, sequence_parallel=True)
    force = {"dp": 2, "sharding": 2, "sep": 2}
    model = llama()
    o1 = plan_for(model, force_mesh=force, distributed_optimizer=False, **kw).chosen.memory
    o2 = plan_for(
        model, force_mesh=force, amp_level="O2", distributed_optimizer=False, **kw
    ).chosen.memory
    spans = plan_for(
        model, force_mesh=force, amp_level="O2", distributed_optimizer=True, **kw
    ).chosen.memory
    params = nnx.state(model, nnx.Param)
    norms = sum(x.size for p, x in nnx.to_flat_state(params) if any("norm" in str(k) for k in p))
    total = sum(x.size for x in jax.tree.leaves(params))
    assert o1.params == 4 * total
    assert o2.params == 2 * (total - norms) + 4 * norms  # the norms stay fp32
    assert o2.grads == o2.params
    # Adam's two moments and an fp32 master for each half parameter, split by ZeRO
    assert o2.optimizer == pytest.approx((2 * 4 * total + 4 * (total - norms)) / 2, rel=0.02)
    assert spans.optimizer == pytest.approx(o2.optimizer / 4, rel=0.02)
    assert model.layers[0].mlp.up_proj.kernel.dtype == jnp.float32  # planned on a copy


def test_llama3_8b_with_context_parallel_fits_only_as_megatron_keeps_it():
    """The issue's Llama 3 8B run (8 H100, context parallel 2, seq 8192, distributed
    optimizer): fp32 parameters do not fit; bf16 ones with the masters and moments over
    all 8 ranks do, and the optimizer state is 1/8 of 12 bytes a parameter."""
    model = abstract_model(MODEL_SHAPES["llama3-8b"])
    kw = dict(
        force_mesh={"sharding": 4, "sep": 2}, zero_stage=1, sequence_parallel=True,
        accumulate_steps=32, recompute=False,
    )  # fmt: skip
    cluster = Cluster(nodes=1, profile="h100")
    budget = get_profile("h100").usable_memory
    o1 = plan(model, (128, 8192), cluster, amp_level="O1", **kw).chosen
    o2 = plan(model, (128, 8192), cluster, amp_level="O2", distributed_optimizer=True, **kw)
    assert o1.memory.total > budget >= o2.chosen.memory.total
    assert o2.layout.zero_axes == ("sharding", "sep")
    n = MODEL_SHAPES["llama3-8b"].params
    # masters + 2 moments (12 bytes) and gradient merge's bf16 accumulator (2 bytes)
    assert o2.chosen.memory.optimizer == pytest.approx(14 * n / 8, rel=0.02)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: plan_for(llama(), device_num=8, batch_size=16, seq_len=8, amp_level="O3"),
         ValueError, "amp_level='O3' is not an AMP level"),
        (lambda: plan_for(llama(), device_num=8, batch_size=16, seq_len=8, amp_level="O2",
                          dtype="float32"), ValueError, "half precision"),
        (lambda: plan_for(llama(), device_num=8, batch_size=16, seq_len=8,
                          distributed_optimizer="yes"), TypeError, "True, False or None"),
        (lambda: Layout(dp=2, zero_spans_data=True), ValueError, "zero_spans_data=True"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1),
                                config=ToDistributedConfig(distributed_optimizer=1)),
         TypeError, "config.distributed_optimizer=1"),
    ],
)  # fmt: skip
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_zero_spec_over_several_axes():
    mesh = jax.make_mesh((2, 1, 2, 2, 1), ("dp", "pp", "sharding", "sep", "mp"))
    placement = Placement(mesh=mesh, zero_stage=1, zero_axis=["dp", "sharding", "sep"])
    spec = placement.zero_spec(jax.sharding.PartitionSpec(None, "mp"), (12, 16))
    assert spec == jax.sharding.PartitionSpec(None, ("dp", "sharding", "sep", "mp"))
    chex.assert_equal(placement.zero_degree, 8)
    assert math.prod(mesh.shape[a] for a in placement.zero_axis) == 8

"""Paddle's ``MoELayer`` (issue 39): a Paddle MoE script's model trained through fleet on
an expert-parallel mesh equals the same model on one device (fp32, 3 Adam steps), dropless
and with GShard's capacity (its drops counted and equal to the one-device run's with the
same token groups); expert weights split ``1 / ep`` per device; the gates' rules.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

import jfleet.distributed as dist
from jfleet import fleet, make_train_step
from jfleet.auto_parallel import get_plan, to_distributed
from jfleet.auto_parallel.cost.cost_moe import moe_exchange, moe_exchange_bytes
from jfleet.incubate.distributed.models.moe import MoELayer
from jfleet.incubate.distributed.models.moe.gate import NaiveGate
from jfleet.mesh.topology import AXIS_NAMES
from jfleet.models import TinyMoELM, moe_lm_loss
from jfleet.parallel.moe import moe_stats
from jfleet.testing import assert_trees_close, hlo, make_strategy, train_one_device

VOCAB, D_MODEL, HIDDEN, EXPERTS, BATCH, SEQ = 64, 16, 32, 8, 8, 16


def MoELM(gate, *, mesh=None, groups=1, mp=False):
    return TinyMoELM(
        VOCAB, D_MODEL, HIDDEN, EXPERTS, gate=gate, split_mp=mp, groups=groups, mesh=mesh
    )


moe_loss = moe_lm_loss


def batches(n=3):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(AXIS_NAMES)), AXIS_NAMES)


def fleet_train(hybrid, gate, data, *, mp=False):
    fleet.init(is_collective=True, strategy=make_strategy(hybrid), log_level="WARNING")
    model = fleet.distributed_model(MoELM(gate, mp=mp))
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    losses, dropped = [], []
    for b in data:
        losses.append(float(model.train_batch(b, opt, loss_fn=moe_loss)))
        dropped.append(int(moe_stats(model.module)["dropped"]))  # the step's own count
    return np.array(losses), dropped, nnx.state(model.module, nnx.Param), model


_REFERENCES: dict[str, tuple] = {}


def reference(gate, data, groups=1):
    """The same model on one device (token groups: the sharded run's devices); a run
    already made for the same gate, data and groups is reused (read only)."""
    arrays = [(k, np.asarray(v).tobytes()) for b in data for k, v in sorted(b.items())]
    key = repr((sorted(gate.items()), arrays, groups))
    if key not in _REFERENCES:
        model = MoELM(gate, mesh=one_device_mesh(), groups=groups)
        losses, params = train_one_device(model, optax.adam(1e-2), data, moe_loss)
        _REFERENCES[key] = losses, params, int(moe_stats(model)["dropped"])
    return _REFERENCES[key]


LAYOUTS = {
    "dp2_ep4": ({"dp_degree": 2, "ep_degree": 4}, False),
    "ep4_mp2": ({"ep_degree": 4, "mp_degree": 2}, True),
}
DROPLESS = {"type": "gshard", "top_k": 2, "capacity": None, "random_routing": False}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dropless_moe_lm_trains_like_one_device(layout):
    hybrid, mp = LAYOUTS[layout]
    data = batches()
    want_losses, want_params, _ = reference(DROPLESS, data)
    got_losses, dropped, got_params, model = fleet_train(hybrid, DROPLESS, data, mp=mp)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert_trees_close(got_params, want_params, devices=8)
    assert dropped == [0, 0, 0]
    # each device holds E / ep experts of every expert kernel
    kernel = model.module.moes[0].experts.htoh4.kernel[...]
    assert kernel.shape == (1, EXPERTS, D_MODEL, HIDDEN)
    assert kernel.sharding.shard_shape(kernel.shape) == (1, EXPERTS // 4, D_MODEL, HIDDEN)


def test_capacity_drops_like_one_device_with_the_same_token_groups():
    """GShard's capacity 1.0 drops tokens per device's group; a one-device run with those
    eight groups drops the same ones and trains the same."""
    gate = {"type": "gshard", "top_k": 2, "capacity": (1.0, 1.0), "random_routing": False}
    data = batches()
    want_losses, want_params, want_dropped = reference(gate, data, groups=8)
    got_losses, dropped, got_params, _ = fleet_train({"dp_degree": 2, "ep_degree": 4}, gate, data)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert_trees_close(got_params, want_params, devices=8)
    assert all(d > 0 for d in dropped) and dropped[-1] == want_dropped, (dropped, want_dropped)
    # a one-device run of one group drops otherwise (the rule depends on the groups)
    other, _, _ = reference(gate, data[:1], groups=1)
    assert abs(other[0] - want_losses[0]) > 1e-6


@pytest.mark.parametrize("capacity", [None, (1.0, 1.0)], ids=["dropless", "capacity1"])
def test_all_to_all_bytes_per_layer_match_the_cost_model(capacity):
    """The compiled training step's all-to-alls, per MoE layer: two forward and two
    backward buffers of ``E x C x D`` (``C`` the capacity of a device's 16 tokens), as
    ``jfleet.auto_parallel.cost.cost_moe`` charges them (within 15%; here exact)."""
    gate = {"type": "gshard", "top_k": 2, "capacity": capacity, "random_routing": False}
    fleet.init(
        is_collective=True,
        strategy=make_strategy({"dp_degree": 2, "ep_degree": 4}),
        log_level="WARNING",
    )
    model = fleet.distributed_model(MoELM(gate))
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    step = make_train_step(moe_loss).lower(model, opt, batches(1)[0]).compile()
    found = [c for c in hlo.collectives(step.as_text()) if c.kind == "all-to-all"]
    layers = len(model.module.moes)
    tokens = BATCH * SEQ // 8
    factor = None if capacity is None else capacity[0]
    buffer = moe_exchange_bytes(
        tokens=tokens, width=D_MODEL, k=2, experts=EXPERTS, capacity_factor=factor
    )
    predicted = moe_exchange(buffer, ep=4, bandwidth=1.0)
    assert all(c.group_size == 4 for c in found)
    assert sum(c.weight for c in found) == predicted.count * layers
    measured = sum(c.weight * c.bytes for c in found) / layers
    assert measured == pytest.approx(predicted.count * buffer, rel=0.15)
    wire = sum(c.weight * c.wire_bytes for c in found) / layers
    assert wire == pytest.approx(predicted.wire_bytes, rel=0.15)


def _experts(n, width=D_MODEL):
    return [nnx.Linear(width, width, rngs=nnx.Rngs(i)) for i in range(n)]


BAD = {
    "experts_not_over_ep": (lambda: MoELayer(D_MODEL, _experts(6), rngs=nnx.Rngs(0)), "6 experts"),
    "no_experts": (lambda: MoELayer(D_MODEL, [], rngs=nnx.Rngs(0)), "experts is empty"),
    "gate_type": (
        lambda: MoELayer(D_MODEL, _experts(8), gate={"type": "topk"}, rngs=nnx.Rngs(0)),
        "'topk' is not one of",
    ),
    "gate_setting": (
        lambda: MoELayer(
            D_MODEL, _experts(8), gate={"type": "naive", "capacity": None}, rngs=nnx.Rngs(0)
        ),
        "not settings of a 'naive' gate",
    ),
    "gshard_top3": (
        lambda: MoELayer(D_MODEL, _experts(8), gate={"top_k": 3}, rngs=nnx.Rngs(0)),
        "topk=2",
    ),
    "switch_top2": (
        lambda: MoELayer(
            D_MODEL, _experts(8), gate={"type": "switch", "top_k": 2}, rngs=nnx.Rngs(0)
        ),
        "topk=1",
    ),
    "gate_experts": (
        lambda: MoELayer(D_MODEL, _experts(8), gate=NaiveGate(D_MODEL, 2, 2, rngs=nnx.Rngs(0))),
        "routes over 4 experts but there are 8",
    ),
    "no_rngs": (lambda: MoELayer(D_MODEL, _experts(8)), "rngs=nnx.Rngs"),
    "groups": (
        lambda: MoELayer(D_MODEL, _experts(8), groups=1.5, rngs=nnx.Rngs(0)),
        "groups=1.5",
    ),
    "capacity": (
        lambda: MoELayer(D_MODEL, _experts(8), gate={"capacity": (0, 1)}, rngs=nnx.Rngs(0)),
        "two positive factors",
    ),
    "two_axis_group": (
        lambda: MoELayer(
            D_MODEL,
            _experts(8),
            moe_group=dist.new_group(list(range(8))),  # dp and ep
            rngs=nnx.Rngs(0),
        ),
        "spans the mesh axes",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_get_clear_errors(case):
    fleet.init(
        is_collective=True,
        strategy=make_strategy({"dp_degree": 2, "ep_degree": 4}),
        log_level="WARNING",
    )
    build, message = BAD[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_input_width_is_checked():
    fleet.init(
        is_collective=True,
        strategy=make_strategy({"dp_degree": 2, "ep_degree": 4}),
        log_level="WARNING",
    )
    layer = MoELayer(D_MODEL, _experts(8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="does not end in d_model=16"):
        layer(jnp.ones((8, 4, D_MODEL + 1)))


def test_to_distributed_replans_a_model_built_on_an_expert_mesh():
    """A model whose MoE layers were built on a dp2 x ep4 fleet, handed to
    ``to_distributed``: the plan's mesh (no ep yet) replaces the fleet's, the layers run on
    it, and training equals one device."""
    fleet.init(
        is_collective=True,
        strategy=make_strategy({"dp_degree": 2, "ep_degree": 4}),
        log_level="WARNING",
    )
    data = batches()
    model, opt, loader = to_distributed(MoELM(DROPLESS), optax.adam(1e-2), data, device_num=8)
    assert get_plan(model).mesh_shape.get("ep", 1) == 1
    step = make_train_step(moe_loss)
    got = [float(step(model, opt, b)) for b in loader]
    want, _, _ = reference(DROPLESS, data)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_random_routing_and_switch_noise_train_like_one_device():
    """GShard's random routing of second choices (drawn from the gate's stream in
    training) routes the same tokens on dp2 x ep4 as on one device: the draws are the
    whole batch's, split like it."""
    gate = {"type": "gshard", "top_k": 2, "capacity": None, "random_routing": True}
    data = batches()
    want_losses, want_params, _ = reference(gate, data)
    got_losses, _, got_params, model = fleet_train({"dp_degree": 2, "ep_degree": 4}, gate, data)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert_trees_close(got_params, want_params, devices=8)
    # the draws dropped some second choices: fewer routed than two a token
    assert int(moe_stats(model.module)["routed"]) < 2 * BATCH * SEQ * len(model.module.moes)


def test_eval_mode_uses_the_evaluation_capacity_and_no_noise():
    fleet.init(
        is_collective=True,
        strategy=make_strategy({"dp_degree": 2, "ep_degree": 4}),
        log_level="WARNING",
    )
    gate = {"type": "switch", "capacity": (0.5, 4.0)}
    model = MoELM(gate)
    tokens = jnp.asarray(batches(1)[0]["tokens"])
    call = nnx.jit(lambda m, t: m(t))  # one compile a mode (eager dispatch is slow)
    call(model, tokens)
    assert int(moe_stats(model)["dropped"]) > 0  # training: half an even share an expert
    model.eval()
    first = call(model, tokens)
    assert int(moe_stats(model)["dropped"]) == 0  # evaluation: 4x an even share
    np.testing.assert_array_equal(np.asarray(call(model, tokens)), np.asarray(first))  # no noise

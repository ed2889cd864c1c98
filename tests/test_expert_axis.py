"""The expert-parallel mesh axis ``ep`` (``hybrid_configs["ep_degree"]``).

``ep`` is a mesh axis of its own that reuses data ranks (EP inside DP, as in Megatron-Core
and MaxText): a batch is split over it, dense gradients are reduced over it, and Paddle's
``get_expert_parallel_*`` getters answer for it. A degree-1 ``ep`` changes no compiled
program.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.auto_parallel.cost.layout import Layout
from jfleet.auto_parallel.search.planner import plan_for
from jfleet.mesh.hybrid_group import (
    HybridCommunicateGroup,
    build_hybrid_communicate_group,
    moe_sharding_problem,
)
from jfleet.mesh.placement import Placement, zero_axes
from jfleet.mesh.topology import DATA_AXES, DEFAULT_ORDER, EP, CommunicateTopology
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.testing import assert_trees_close, make_strategy, train_one_device
from jfleet.training.strategy import DistributedStrategy
from tests.fleet_setup import init_fleet

DP2_EP4 = {"dp_degree": 2, "ep_degree": 4}


# ----- the vocabulary -----------------------------------------------------------------------


def test_ep_is_in_the_vocabulary_innermost_among_the_data_axes():
    assert EP == "ep"
    assert DEFAULT_ORDER == ("dp", "pp", "sharding", "sep", "ep", "mp")
    assert DATA_AXES == ("dp", "sharding", "ep")


def test_every_mesh_has_an_ep_axis_of_degree_one_by_default():
    hcg = init_fleet({"dp_degree": 8})
    assert hcg is not None
    mesh = fleet.get_hybrid_communicate_group().mesh
    assert mesh.axis_names == ("dp", "pp", "sharding", "sep", "ep", "mp")
    assert dict(mesh.shape)["ep"] == 1
    assert fleet.get_hybrid_communicate_group().get_expert_parallel_world_size() == 1


# ----- the mesh and Paddle's getters ---------------------------------------------------------


def test_dp2_ep4_builds_a_mesh_with_an_expert_axis():
    init_fleet(DP2_EP4)
    hcg = fleet.get_hybrid_communicate_group()
    assert dict(hcg.mesh.shape) == {"dp": 2, "pp": 1, "sharding": 1, "sep": 1, "ep": 4, "mp": 1}
    assert all(t == AxisType.Auto for t in hcg.mesh.axis_types)
    assert hcg.get_expert_parallel_world_size() == 4
    assert hcg.get_data_parallel_world_size() == 2
    # ep is innermost among the data axes: ep neighbours are contiguous ranks
    assert hcg.get_expert_parallel_group().ranks == (0, 1, 2, 3)
    assert hcg.get_data_parallel_group().ranks == (0, 4)
    assert hcg.topology().get_hybrid_group_names() == [
        "data", "pipe", "sharding", "sep", "expert", "model",
    ]  # fmt: skip
    # Paddle's mode for a run whose only other axis is data-like
    assert hcg.get_parallel_mode().name == "DATA_PARALLEL"


@pytest.mark.parametrize(
    "hybrid",
    [
        DP2_EP4,
        {"dp_degree": 2, "ep_degree": 2, "mp_degree": 2},
        {"pp_degree": 2, "ep_degree": 2, "sharding_degree": 2},
        {"ep_degree": 2, "mp_degree": 2, "order": ["ep", "dp", "pp", "sharding", "sep", "mp"]},
    ],
)
@pytest.mark.parametrize("rank", [0, 3, 6])
def test_getters_match_paddle_comm_lists_for_every_rank(hybrid, rank):
    """Each host-view getter answers as Paddle's rank ``rank`` would: the devices are
    rotated so that this process's first device is Paddle rank ``rank``."""
    devices = jax.devices()
    rotated = devices[-rank:] + devices[:-rank] if rank else devices
    assert rotated[rank] == devices[0]
    hcg = build_hybrid_communicate_group(hybrid, rotated)
    topo = hcg.topology()
    assert hcg.global_rank == rank
    for getter, topo_name in (
        ("expert", "expert"),
        ("data", "data"),
        ("model", "model"),
        ("sharding", "sharding"),
        ("pipe", "pipe"),
    ):
        group = getattr(hcg, f"get_{getter}_parallel_group")()
        mine = [g for g in topo.get_comm_list(topo_name) if rank in g]
        assert [list(group.ranks)] == mine, getter
        assert group.nranks == topo.get_dim(topo_name)
    coord = topo.get_coord(rank)
    assert hcg.get_expert_parallel_rank() == coord.expert
    assert hcg.get_expert_parallel_world_size() == topo.get_dim("expert")
    assert hcg.get_expert_parallel_group().rank == coord.expert
    assert hcg.get_expert_parallel_group_src_rank() == hcg.get_expert_parallel_group().ranks[0]
    assert hcg.get_data_parallel_rank() == coord.data


def test_the_ep_group_reduces_over_its_ranks_inside_shard_map():
    hcg = build_hybrid_communicate_group(DP2_EP4)
    group = hcg.get_expert_parallel_group()
    mesh = hcg.mesh

    def body(x):
        return jax.lax.psum(x, group.axis_name), hcg.get_axis_rank("ep")[None]

    x = jnp.arange(8.0)
    summed, ep_rank = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(("dp", "ep")), out_specs=P(("dp", "ep")))
    )(x)
    # rows 0..3 (dp 0) sum to 6, rows 4..7 (dp 1) to 22: the groups of get_comm_list
    np.testing.assert_array_equal(summed, [6.0] * 4 + [22.0] * 4)
    np.testing.assert_array_equal(ep_rank, [0, 1, 2, 3, 0, 1, 2, 3])


def test_a_topology_without_the_expert_axis_gets_it_as_degree_one():
    hcg = HybridCommunicateGroup(CommunicateTopology(("data", "model"), (4, 2)))
    assert dict(hcg.mesh.shape)["ep"] == 1
    assert hcg.get_expert_parallel_group().ranks == (0,)
    assert hcg.get_expert_parallel_rank() == 0


# ----- order and the world-size arithmetic ---------------------------------------------------


PADDLE5 = ["dp", "pp", "sharding", "sep", "mp"]


@pytest.mark.parametrize(
    ("order", "stored", "axes"),
    [
        # Paddle's default order, kept in the strategy; the mesh puts ep just outside mp
        (None, PADDLE5, ("dp", "pp", "sharding", "sep", "ep", "mp")),
        (PADDLE5, PADDLE5, ("dp", "pp", "sharding", "sep", "ep", "mp")),
        # Paddle's MoE order: moe_sharding and cp dropped, ep where it is named
        (
            ["sharding", "moe_sharding", "pp", "sep", "cp", "dp", "ep", "mp"],
            ["sharding", "pp", "sep", "dp", "ep", "mp"],
            ("sharding", "pp", "sep", "dp", "ep", "mp"),
        ),
        (
            ["ep", "dp", "pp", "sharding", "sep", "mp"],
            ["ep", "dp", "pp", "sharding", "sep", "mp"],
            ("ep", "dp", "pp", "sharding", "sep", "mp"),
        ),
    ],
)
def test_order_may_name_ep_or_leave_it_out(order, stored, axes):
    hybrid = dict(DP2_EP4, **({"order": order} if order else {}))
    strategy = make_strategy(hybrid)
    assert strategy.hybrid_configs["order"] == stored
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    hcg = fleet.get_hybrid_communicate_group()
    assert hcg.mesh.axis_names == axes
    topo = hcg.topology()
    assert [list(hcg.get_expert_parallel_group().ranks)] == [
        g for g in topo.get_comm_list("expert") if 0 in g
    ]
    # the same order straight into build_hybrid_communicate_group
    assert build_hybrid_communicate_group(hybrid).mesh.axis_names == axes


@pytest.mark.parametrize(
    ("hybrid", "dp"),
    [({"ep_degree": 4}, 2), ({"ep_degree": 2, "mp_degree": 2}, 2), ({"ep_degree": 8}, 1)],
)
def test_dp_minus_one_is_the_rest_of_the_devices_after_ep(hybrid, dp):
    init_fleet(hybrid)
    hcg = fleet.get_hybrid_communicate_group()
    assert hcg.get_data_parallel_world_size() == dp
    assert hcg.get_expert_parallel_world_size() == hybrid["ep_degree"]


# ----- bad values ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "error", "needle"),
    [
        (0, ValueError, "hybrid_configs.ep_degree=0 is not valid; set it to >= 1"),
        (-1, ValueError, "hybrid_configs.ep_degree=-1 is not valid; set it to >= 1"),
        (2.0, TypeError, "hybrid_configs.ep_degree expects an int"),
        ("4", TypeError, "hybrid_configs.ep_degree expects an int"),
        (True, TypeError, "hybrid_configs.ep_degree expects an int"),
    ],
)
def test_bad_ep_degree_in_the_strategy_is_named(value, error, needle):
    strategy = DistributedStrategy()
    with pytest.raises(error) as err:
        strategy.hybrid_configs = {"ep_degree": value}
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("hybrid", "needle"),
    [
        ({"ep_degree": 0}, "ep_degree=0 is not valid; expected an int >= 1"),
        ({"ep_degree": 2.0}, "ep_degree=2.0 is not valid; expected an int >= 1"),
        ({"ep_degree": 3}, "ep_degree=3 x mp_degree=1 = 3 does not divide the 8 devices"),
        (
            {"dp_degree": 2, "ep_degree": 8},
            "ep_degree=8 x mp_degree=1 = 16, but there are 8 devices; make the product equal "
            "the device count or set dp_degree=-1. ep_degree counts in the product",
        ),
    ],
)
def test_bad_ep_degree_at_init_is_named(hybrid, needle):
    with pytest.raises(ValueError) as err:
        build_hybrid_communicate_group(hybrid)
    assert needle in str(err.value)
    if isinstance(hybrid["ep_degree"], int) and hybrid["ep_degree"] > 1:
        with pytest.raises(ValueError, match="ep_degree"):
            init_fleet(hybrid)


# ----- moe_sharding_degree: refused with the reason -------------------------------------------


def test_moe_sharding_degree_above_one_is_refused_with_the_reason():
    strategy = DistributedStrategy()
    with pytest.raises(ValueError) as err:
        strategy.hybrid_configs = {"ep_degree": 4, "moe_sharding_degree": 2}
    text = str(err.value)
    assert "hybrid_configs.moe_sharding_degree=2 is not valid; set it to 1" in text
    assert "not built" in text and "dp_degree" in text
    with pytest.raises(ValueError, match=r"moe_sharding_degree=2 is not supported; expected 1"):
        build_hybrid_communicate_group({"ep_degree": 4, "moe_sharding_degree": 2})
    assert moe_sharding_problem(1) is None
    assert "moe_sharding_degree=4" in moe_sharding_problem(4)


def test_moe_sharding_getters_answer_as_paddle_with_and_without_ep():
    # with ep: Paddle's expert-parallel group, moe_sharding_degree 1
    hcg = build_hybrid_communicate_group(dict(DP2_EP4, moe_sharding_degree=1))
    assert hcg.get_moe_sharding_parallel_world_size() == 1
    group = hcg.get_moe_sharding_parallel_group()
    assert group.ranks == (hcg.global_rank,) and group.nranks == 1
    assert hcg.get_moe_sharding_parallel_rank() == 0
    # without ep: Paddle's plain hybrid group says 0
    assert (
        build_hybrid_communicate_group({"dp_degree": 8}).get_moe_sharding_parallel_world_size() == 0
    )


# ----- training: dense parameters see ep as data ---------------------------------------------


TRAINED = {
    "dp2xep4": (DP2_EP4, {}, P(("dp", "ep"))),
    # ZeRO-2 of the dense parameters stays on sharding; the batch is split over all three
    "dp2xsharding2xep2-zero2": (
        {"dp_degree": 2, "sharding_degree": 2, "ep_degree": 2},
        {"sharding_configs": {"stage": 2}},
        P(("dp", "sharding", "ep")),
    ),
}


@functools.cache
def _one_device():
    """TinyLM's 3 Adam steps on one device: losses and parameters (read only)."""
    return train_one_device(TinyLM(), optax.adam(1e-2), lm_batches(3), lm_loss)


@pytest.mark.parametrize("layout", list(TRAINED))
def test_dense_training_with_ep_equals_one_device_with_the_batch_split_8_ways(layout):
    hybrid, settings, batch_spec = TRAINED[layout]
    batches = lm_batches(3)
    want_losses, want_params = _one_device()
    init_fleet(hybrid, **settings)
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    rows = []

    def loss_fn(m, batch):
        jax.debug.inspect_array_sharding(
            batch["tokens"], callback=lambda s: rows.append(s.shard_shape((16, 8))[0])
        )
        return lm_loss(m, batch)

    losses = [float(model.train_batch(b, opt, loss_fn=loss_fn)) for b in batches]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(nnx.state(model.module, nnx.Param), want_params, rtol=1e-5, atol=1e-6)
    # the step saw 16 / 8 = 2 rows per device: the batch is split over the data axes, ep too
    assert rows and set(rows) == {2}
    placement = Placement.from_fleet()
    assert placement.data_axes == ("dp", "sharding", "ep")
    assert placement.data_parallel_size == 8
    assert placement.zero_axis == "sharding"
    assert placement.zero_stage == (2 if settings else 0)
    placed = placement.shard_batch(batches[0])["tokens"]
    assert placed.sharding.is_equivalent_to(NamedSharding(placement.mesh, batch_spec), 2)
    assert {s.data.shape for s in placed.addressable_shards} == {(2, 8)}


def test_zero_spanning_the_data_ranks_leaves_ep_out():
    mesh = AbstractMesh((2, 1, 2, 1, 2, 1), DEFAULT_ORDER)
    assert zero_axes(mesh, True) == ("dp", "sharding")
    assert zero_axes(mesh, False) == "sharding"


# ----- a degree-1 ep changes no compiled program ---------------------------------------------


def test_a_degree_one_ep_axis_compiles_the_same_program():
    devices = np.array(jax.devices())
    five = jax.sharding.Mesh(devices.reshape(2, 1, 4, 1, 1), ("dp", "pp", "sharding", "sep", "mp"))
    six = jax.sharding.Mesh(devices.reshape(2, 1, 4, 1, 1, 1), DEFAULT_ORDER)
    w = np.ones((8, 8), np.float32)

    def compiled(mesh, data_axes):
        def f(x, w):
            return jnp.mean(jnp.tanh(x @ w) ** 2)

        x = jax.device_put(np.ones((16, 8), np.float32), NamedSharding(mesh, P(data_axes)))
        wp = jax.device_put(w, NamedSharding(mesh, P()))
        text = jax.jit(jax.grad(f, argnums=1)).lower(x, wp).compile().as_text()
        # source locations differ between the two calls; the program must not
        text = re.sub(r", metadata=\{[^{}]*\}", "", text)
        return [
            line
            for line in text.splitlines()
            if not re.match(r"(\d+ |FileNames|FunctionNames|FileLocations|StackFrames)", line)
        ]

    program = compiled(six, DATA_AXES)
    assert any("all-reduce" in line for line in program)
    assert program == compiled(five, ("dp", "sharding"))


# ----- the planner plans ep only for routed experts it knows ----------------------------------


def test_the_planner_keeps_ep_at_one_without_experts_and_refuses_it_when_forced():
    assert Layout(dp=4, ep=2).data_degree == 8  # ep is a data axis
    assert Layout(dp=8).degrees == {"dp": 8, "pp": 1, "sharding": 1, "sep": 1, "ep": 1, "mp": 1}
    plan = plan_for(TinyLM(), device_num=8, batch_size=16, seq_len=8, force_mesh={"dp": 2, "mp": 4})
    assert plan.mesh_shape == {"dp": 2, "pp": 1, "sharding": 1, "sep": 1, "mp": 4}
    assert "ep" not in plan.to_dict()["candidates"][0]["layout"]  # plans read as before
    with pytest.raises(ValueError, match="does not plan expert parallelism yet"):
        plan_for(TinyLM(), device_num=8, batch_size=16, seq_len=8, force_mesh={"dp": 2, "ep": 4})

"""Tests for jfleet.topology: Paddle's rank arithmetic, the mesh layout, groups, builder.

Expected numbers are literal and hand-derived from Paddle's row-major semantics (the 3-D,
4-D and 5-D cases are the ones in Paddle's own test_hybrid_parallel_topology.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jfleet.mesh.hybrid_group import HybridCommunicateGroup, build_hybrid_communicate_group
from jfleet.mesh.topology import CommunicateTopology, Group, ParallelMode, axis_index

NAMES5 = ("data", "pipe", "sharding", "sep", "model")


def _hcg(dp=1, pp=1, sharding=1, sep=1, mp=1, devices=None):
    topo = CommunicateTopology(NAMES5, (dp, pp, sharding, sep, mp))
    return HybridCommunicateGroup(topo, devices)


# ----- CommunicateTopology: Paddle's numbers ----------------------------------------------


def test_topology_3d_dp_mp_pp():
    topo = CommunicateTopology(["dp", "mp", "pp"], [2, 2, 2])
    assert topo.get_comm_list("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_comm_list("mp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_comm_list("pp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_hybrid_group_names() == ["dp", "mp", "pp"]
    assert topo.world_size() == 8
    assert [topo.get_dim(n) for n in ("dp", "mp", "pp")] == [2, 2, 2]
    assert topo.get_dim_size("mp") == 2
    coords = [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    for rank, (dp, mp, pp) in enumerate(coords):
        assert topo.get_rank(dp=dp, mp=mp, pp=pp) == rank
        assert topo.get_coord(rank) == topo.coordinate(dp, mp, pp)
        assert tuple(topo.get_coord(rank)) == (dp, mp, pp)
    assert topo.get_coord(6).mp == 1 and topo.get_coord(6).pp == 0
    assert topo.get_axis_list("dp", 0) == [0, 1, 2, 3]
    assert topo.get_axis_list("dp", 1) == [4, 5, 6, 7]
    assert topo.get_axis_list("mp", 0) == [0, 1, 4, 5]
    assert topo.get_axis_list("mp", 1) == [2, 3, 6, 7]
    assert topo.get_axis_list("pp", 0) == [0, 2, 4, 6]
    assert topo.get_axis_list("pp", 1) == [1, 3, 5, 7]


def test_topology_4d_dp_pp_sharding_mp():
    topo = CommunicateTopology(["dp", "pp", "sharding", "mp"], [2, 2, 2, 2])
    assert topo.world_size() == 16
    assert topo.get_comm_list("dp") == [[i, i + 8] for i in range(8)]
    assert topo.get_comm_list("mp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert topo.get_comm_list("pp") == [
        [0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15],
    ]  # fmt: skip
    assert topo.get_comm_list("sharding") == [
        [0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15],
    ]  # fmt: skip
    assert topo.get_rank(dp=1, pp=0, sharding=1, mp=0) == 10
    assert tuple(topo.get_coord(13)) == (1, 1, 0, 1)
    assert topo.get_axis_list("mp", 0) == [0, 2, 4, 6, 8, 10, 12, 14]
    assert topo.get_axis_list("pp", 1) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert topo.get_axis_list("sharding", 0) == [0, 1, 4, 5, 8, 9, 12, 13]


def test_topology_5d_comm_lists_and_fused_ranks():
    topo = CommunicateTopology(["dp", "pp", "sharding", "sep", "mp"], [2, 2, 2, 2, 2])
    assert topo.get_comm_list("dp") == [[i, i + 16] for i in range(16)]
    assert topo.get_comm_list("sep")[:6] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11]]
    assert topo.get_comm_list("sharding")[:5] == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12]]
    assert topo.get_comm_list("pp")[8:10] == [[16, 24], [17, 25]]
    assert topo.get_rank(dp=1, pp=0, sharding=1, sep=1, mp=0) == 22
    assert topo.get_fused_ranks(["dp", "sep"]) == [
        [0, 2, 16, 18], [1, 3, 17, 19], [4, 6, 20, 22], [5, 7, 21, 23],
        [8, 10, 24, 26], [9, 11, 25, 27], [12, 14, 28, 30], [13, 15, 29, 31],
    ]  # fmt: skip
    assert topo.get_fused_ranks(["pp", "mp"]) == [
        [0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15],
        [16, 17, 24, 25], [18, 19, 26, 27], [20, 21, 28, 29], [22, 23, 30, 31],
    ]  # fmt: skip
    # Within a group the ranks run over the fused axes in the order given, as in Paddle.
    assert topo.get_fused_ranks(["sep", "dp"])[0] == [0, 16, 2, 18]


def test_topology_default_names_dp2_pp2_mp2():
    topo = CommunicateTopology(NAMES5, (2, 2, 1, 1, 2))
    assert topo.get_comm_list("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_comm_list("pipe") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_comm_list("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_comm_list("sharding") == [[r] for r in range(8)]
    assert tuple(topo.get_coord(6)) == (1, 1, 0, 0, 0)
    assert topo.get_coord(3)._fields == NAMES5
    assert topo.get_rank_from_stage(5, pipe=1) == 7
    assert topo.get_rank_from_stage(7, pipe=0, model=0) == 4


def test_topology_sharding4_mp2():
    topo = CommunicateTopology(NAMES5, (1, 1, 4, 1, 2))
    assert topo.get_comm_list("sharding") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert topo.get_comm_list("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_comm_list("data") == [[r] for r in range(8)]
    assert tuple(topo.get_coord(5)) == (0, 0, 2, 0, 1)


def test_topology_non_default_order_pp_dp_mp():
    topo = CommunicateTopology(("pipe", "data", "sharding", "sep", "model"), (2, 2, 1, 1, 2))
    assert topo.get_comm_list("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.get_comm_list("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_comm_list("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_coord(5)._asdict() == {
        "pipe": 1,
        "data": 0,
        "sharding": 0,
        "sep": 0,
        "model": 1,
    }
    assert topo.get_axis_list("data", 1) == [2, 3, 6, 7]


def test_default_topology_is_one_rank():
    topo = CommunicateTopology()
    assert topo.get_hybrid_group_names() == list(NAMES5)
    assert topo.world_size() == 1
    assert topo.get_comm_list("model") == [[0]]


# ----- HybridCommunicateGroup: the mesh ---------------------------------------------------


@pytest.mark.parametrize(
    "names,dims,axes",
    [
        (NAMES5, (2, 2, 1, 1, 2), ("dp", "pp", "sharding", "sep", "mp", "ep")),
        (NAMES5, (1, 1, 4, 1, 2), ("dp", "pp", "sharding", "sep", "mp", "ep")),
        (("pipe", "data", "sharding", "sep", "model"), (2, 2, 1, 1, 2),
         ("pp", "dp", "sharding", "sep", "mp", "ep")),
        (("dp", "sep", "mp"), (2, 2, 2), ("dp", "sep", "mp", "pp", "sharding", "ep")),
    ],
)  # fmt: skip
def test_mesh_layout_equals_topology_ranks(names, dims, axes):
    topo = CommunicateTopology(names, dims)
    hcg = HybridCommunicateGroup(topo)
    mesh = hcg.mesh
    assert mesh.axis_names == axes
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    devices = jax.devices()
    for r in range(8):
        assert mesh.devices.flat[r].id == devices[r].id
        where = tuple(int(i) for i in np.argwhere(mesh.devices == devices[r])[0])
        assert where[: len(names)] == tuple(topo.get_coord(r))
        assert all(i == 0 for i in where[len(names) :])


def test_groups_host_view_dp2_pp2_mp2():
    hcg = _hcg(dp=2, pp=2, mp=2)
    assert hcg.get_global_rank() == 0 and hcg.nranks == 8
    assert hcg.get_data_parallel_group() == Group("dp", (0, 4), rank=0, id=0, name="dp")
    assert hcg.get_model_parallel_group().ranks == (0, 1)
    assert hcg.get_model_parallel_group().axis_name == "mp"
    assert hcg.get_pipe_parallel_group().ranks == (0, 2)
    assert hcg.get_sharding_parallel_group().ranks == (0,)
    assert hcg.get_sep_parallel_group().nranks == 1
    assert hcg.get_dp_sep_parallel_group().ranks == (0, 4)
    assert hcg.get_pp_mp_parallel_group().ranks == (0, 1, 2, 3)
    check = hcg.get_check_parallel_group()
    assert check.axis_name == ("pp", "sharding", "sep", "mp", "ep")
    assert check.ranks == (0, 1, 2, 3)
    assert hcg.get_check_parallel_group(sharding=True).ranks == tuple(range(8))
    assert [hcg.get_data_parallel_world_size(), hcg.get_pipe_parallel_world_size()] == [2, 2]
    assert [hcg.get_model_parallel_world_size(), hcg.get_sharding_parallel_world_size()] == [2, 1]
    assert hcg.get_sep_parallel_world_size() == 1
    assert hcg.get_stage_id() == 0 and hcg.is_first_stage and not hcg.is_last_stage
    assert hcg.get_rank_from_stage(1) == 2
    assert hcg.get_rank_from_stage(1, model=1) == 3
    assert hcg.get_rank_from_stage(1, dp=1) == 6
    assert hcg.topology().get_dim("model") == 2


def test_host_view_follows_device_order():
    # Reversed device list: this process's first device is rank 7 = (dp 1, pp 1, mp 1).
    hcg = _hcg(dp=2, pp=2, mp=2, devices=jax.devices()[::-1])
    assert hcg.get_global_rank() == 7
    assert hcg.get_data_parallel_rank() == 1
    assert hcg.get_model_parallel_rank() == 1
    assert hcg.get_sharding_parallel_rank() == 0 and hcg.get_sep_parallel_rank() == 0
    assert hcg.get_stage_id() == 1 and hcg.is_last_stage and not hcg.is_first_stage
    mp = hcg.get_model_parallel_group()
    assert (mp.ranks, mp.rank, mp.id) == ((6, 7), 1, 3)
    assert hcg.get_model_parallel_group_src_rank() == 6
    assert hcg.get_data_parallel_group_src_rank() == 3
    assert hcg.get_sharding_parallel_group_src_rank() == 7
    assert hcg.get_sep_parallel_group_src_rank() == 7
    assert hcg.get_check_parallel_group().ranks == (4, 5, 6, 7)
    assert hcg.get_p2p_next_rank() == 5 and hcg.get_p2p_prev_rank() == 5
    send_next, send_prev, recv_next, recv_prev = hcg.get_p2p_groups()
    assert send_next.ranks == recv_next.ranks == (7, 5)
    assert send_prev.ranks == recv_prev.ranks == (5, 7)


def test_p2p_ring_pp4():
    hcg = _hcg(pp=4, mp=2)
    assert hcg.get_pipe_parallel_group().ranks == (0, 2, 4, 6)
    assert hcg.get_p2p_next_rank() == 2 and hcg.get_p2p_prev_rank() == 6
    assert hcg.get_p2p_permutation("next") == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert hcg.get_p2p_permutation("prev") == [(0, 3), (1, 0), (2, 1), (3, 2)]


def test_group_dataclass():
    g = Group(("pp", "mp"), [0, 1, 2, 3], rank=2, name="pp_mp")
    assert g.nranks == g.world_size == 4 and g.ranks == (0, 1, 2, 3)
    assert g.is_member() and g.get_group_rank(3) == 3 and g.get_group_rank(9) == -1
    assert not Group("mp", (4, 5)).is_member()
    with pytest.raises(AttributeError):
        g.rank = 0  # frozen


def test_group_paddle_surface_backend_process_group_global_rank():
    hcg = _hcg(dp=2, mp=4)
    dp, mp = hcg.get_data_parallel_group(), hcg.get_model_parallel_group()
    assert dp.ranks == (0, 4) and mp.ranks == (0, 1, 2, 3)
    # get_global_rank inverts get_group_rank, position by position.
    assert [dp.get_global_rank(i) for i in range(2)] == [0, 4]
    assert [mp.get_group_rank(mp.get_global_rank(i)) for i in range(4)] == [0, 1, 2, 3]
    assert mp.backend == "XLA" and dp.process_group.name() == "XLA"
    pg = Group(("pp", "mp"), (4, 5, 6, 7), rank=2, name="pp_mp").process_group
    assert (pg.rank(), pg.size()) == (2, 4) and pg.group.ranks == (4, 5, 6, 7)
    assert Group("mp", (4, 5)).process_group.rank() == -1


def test_moe_sharding_getters_without_moe_axis():
    hcg = _hcg(dp=2, mp=4)
    # Paddle's hybrid group without expert parallelism reports world size 0.
    assert hcg.get_moe_sharding_parallel_world_size() == 0
    assert hcg.get_moe_sharding_parallel_rank() == 0
    g = hcg.get_moe_sharding_parallel_group()
    assert g.ranks == (hcg.global_rank,) and g.rank == 0 and g.axis_name == ()
    assert hcg.get_moe_sharding_parallel_group_src_rank() == hcg.global_rank


# ----- groups inside shard_map ------------------------------------------------------------


def _per_device(hcg, fn):
    """Runs ``fn()`` on every device; returns its scalar per Paddle rank."""
    axes = hcg.mesh.axis_names

    def body():
        return jnp.reshape(fn(), (1,) * len(axes))

    out = jax.shard_map(body, mesh=hcg.mesh, in_specs=(), out_specs=P(*axes))()
    return np.asarray(out).ravel()


@pytest.mark.parametrize("dims", [(2, 2, 1, 1, 2), (1, 1, 4, 1, 2), (2, 1, 1, 2, 2)])
def test_psum_over_groups_in_shard_map(dims):
    hcg = _hcg(*dims)
    for group, size in [
        (hcg.get_model_parallel_group(), hcg.get_model_parallel_world_size()),
        (hcg.get_data_parallel_group(), hcg.get_data_parallel_world_size()),
        (hcg.get_sharding_parallel_group(), hcg.get_sharding_parallel_world_size()),
        (hcg.get_check_parallel_group(), 8 // hcg.get_data_parallel_world_size()),
    ]:
        got = _per_device(hcg, lambda g=group: jax.lax.psum(jnp.ones(()), g.axis_name))
        np.testing.assert_array_equal(got, np.full(8, size))
        assert group.nranks == size


def test_traced_axis_index_matches_topology():
    hcg = _hcg(dp=2, pp=2, mp=2)
    topo = hcg.topology()
    mp = _per_device(hcg, lambda: hcg.get_axis_rank("model"))
    np.testing.assert_array_equal(mp, [0, 1, 0, 1, 0, 1, 0, 1])
    dp = _per_device(hcg, lambda: axis_index("dp"))
    np.testing.assert_array_equal(dp, [topo.get_coord(r).data for r in range(8)])
    # The index in a fused group counts in the order of its ``ranks``.
    check = hcg.get_check_parallel_group().axis_name
    idx = _per_device(hcg, lambda: axis_index(check))
    for r in range(8):
        members = topo.get_axis_list("data", topo.get_coord(r).data)
        assert idx[r] == members.index(r)
    # A psum over the mp group adds exactly the ranks of Paddle's mp comm list.
    sums = _per_device(hcg, lambda: jax.lax.psum(jnp.float32(1) * _rank(hcg), "mp"))
    for ranks in topo.get_comm_list("model"):
        for r in ranks:
            assert sums[r] == sum(ranks)


def _rank(hcg):
    """The traced Paddle rank of this device."""
    strides = np.cumprod((1, *hcg.mesh.devices.shape[::-1]))[:-1][::-1]
    return sum(int(s) * axis_index(a) for s, a in zip(strides, hcg.mesh.axis_names, strict=True))


def test_ppermute_next_stage():
    hcg = _hcg(pp=4, mp=2)
    perm = hcg.get_p2p_permutation("next")
    got = _per_device(hcg, lambda: jax.lax.ppermute(axis_index("pp"), "pp", perm))
    np.testing.assert_array_equal(got, [3, 3, 0, 0, 1, 1, 2, 2])


# ----- parallel mode ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "dp,pp,sharding,sep,mp,mode",
    [
        (8, 1, 1, 1, 1, ParallelMode.DATA_PARALLEL),
        (2, 1, 4, 1, 1, ParallelMode.SHARDING_PARALLEL),
        (1, 1, 8, 1, 1, ParallelMode.SHARDING_PARALLEL),
        (2, 1, 2, 2, 1, ParallelMode.SEGMENT_PARALLEL),
        (2, 1, 1, 2, 2, ParallelMode.TENSOR_PARALLEL),
        (1, 1, 4, 1, 2, ParallelMode.TENSOR_PARALLEL),
        (2, 2, 1, 1, 2, ParallelMode.PIPELINE_PARALLEL),
        (1, 2, 4, 1, 1, ParallelMode.PIPELINE_PARALLEL),
    ],
)
def test_parallel_mode(dp, pp, sharding, sep, mp, mode):
    assert _hcg(dp, pp, sharding, sep, mp).get_parallel_mode() == mode


def test_parallel_mode_single_device_is_data():
    hcg = _hcg(devices=jax.devices()[:1])
    assert hcg.get_parallel_mode() == ParallelMode.DATA_PARALLEL
    assert int(ParallelMode.SEGMENT_PARALLEL) == 4 and int(ParallelMode.SHARDING_PARALLEL) == 3


# ----- build_hybrid_communicate_group ----------------------------------------------------


def test_build_infers_dp_and_uses_paddle_names():
    hcg = build_hybrid_communicate_group({"dp_degree": -1, "mp_degree": 2, "pp_degree": 2})
    assert hcg.get_data_parallel_world_size() == 2
    assert hcg.topology().get_hybrid_group_names() == [
        "data",
        "pipe",
        "sharding",
        "sep",
        "expert",
        "model",
    ]
    assert dict(hcg.mesh.shape) == {"dp": 2, "pp": 2, "sharding": 1, "sep": 1, "ep": 1, "mp": 2}
    # jfleet divides by sharding and sep too (Paddle would infer dp=8 // 2 = 4 here).
    hcg = build_hybrid_communicate_group({"dp_degree": -1, "sharding_degree": 2, "mp_degree": 2})
    assert hcg.get_data_parallel_world_size() == 2


def test_build_order_drops_cp_and_ignores_other_keys():
    configs = {
        "dp_degree": 2,
        "pp_degree": 2,
        "mp_degree": 2,
        "cp_degree": 1,
        "mp_configs": {},
        "order": ["pp", "dp", "cp", "sharding", "sep", "mp"],
    }
    hcg = build_hybrid_communicate_group(configs)
    assert hcg.mesh.axis_names == ("pp", "dp", "sharding", "sep", "ep", "mp")
    assert hcg.topology().get_comm_list("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hcg.get_data_parallel_group().ranks == (0, 2)
    assert hcg.get_pipe_parallel_group().ranks == (0, 4)


def test_build_with_given_devices():
    hcg = build_hybrid_communicate_group({"mp_degree": 2}, devices=jax.devices()[:4])
    assert hcg.get_data_parallel_world_size() == 2 and hcg.mesh.devices.size == 4


@pytest.mark.parametrize(
    "configs,needle",
    [
        (
            {"dp_degree": 2, "pp_degree": 2, "mp_degree": 4},
            "dp_degree=2 x pp_degree=2 x sharding_degree=1 x sep_degree=1 x ep_degree=1 x "
            "mp_degree=4 = 16, but there are 8 devices",
        ),
        ({"dp_degree": -1, "pp_degree": 3}, "pp_degree=3"),
        ({"mp_degree": 0}, "mp_degree=0"),
        ({"pp_degree": -1}, "pp_degree=-1"),
        ({"dp_degree": 0}, "dp_degree=0"),
        ({"sharding_degree": 2.0}, "sharding_degree=2.0"),
        ({"sep_degree": True}, "sep_degree=True"),
        ({"order": ["dp", "pp", "sharding", "mp"]}, "order=['dp', 'pp', 'sharding', 'mp']"),
        ({"order": ["dp", "dp", "sharding", "sep", "mp"]}, "order=['dp', 'dp'"),
        ({"order": ["dp", "pp", "sharding", "sep", "tp"]}, "'tp'"),
        ({"order": "dp,pp,sharding,sep,mp"}, "order='dp,pp,sharding,sep,mp'"),
    ],
)
def test_build_bad_configs(configs, needle):
    with pytest.raises(ValueError) as err:
        build_hybrid_communicate_group(configs)
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "make,needle",
    [
        (lambda: CommunicateTopology(["data", "model"], [2, 2, 2]), "dims=[2, 2, 2]"),
        (lambda: CommunicateTopology(["data", "data"], [2, 4]), "repeats ['data']"),
        (lambda: CommunicateTopology(["data", "model"], [2, 0]), "model=0"),
        (lambda: CommunicateTopology(["data", "my-axis"], [2, 4]), "'my-axis'"),
        (lambda: CommunicateTopology(NAMES5, (2, 2, 1, 1, 2)).get_comm_list("tensor"), "'tensor'"),
        (lambda: CommunicateTopology(NAMES5, (2, 2, 1, 1, 2)).get_dim("mp"), "'data'"),
        (lambda: CommunicateTopology(["dp", "mp"], [2, 4]).get_coord(8), "rank=8"),
        (lambda: CommunicateTopology(["dp", "mp"], [2, 4]).get_rank(dp=0, tp=1), "['tp']"),
        (lambda: CommunicateTopology(["dp", "mp"], [2, 4]).get_rank(dp=0, mp=4), "mp=4"),
        (lambda: CommunicateTopology(["dp", "mp"], [2, 4]).get_axis_list("mp", 5), "index=5"),
        (lambda: CommunicateTopology(["dp", "mp"], [2, 4]).get_fused_ranks(["mp", "mp"]), "mp"),
        (lambda: _hcg(dp=2, mp=2), "but there are 8 devices"),
        (lambda: _hcg(dp=8, devices=jax.devices()[:1] * 8), "repeat a device"),
        (lambda: _hcg(dp=8).get_axis_rank("tensor"), "'tensor'"),
        (lambda: _hcg(pp=2, mp=4).get_rank_from_stage(2), "pp=2"),
        (lambda: Group("mp", (0, 1), rank=0, name="mp").get_global_rank(2), "group_rank=2"),
        (lambda: Group("mp", (0, 1), rank=0, name="mp").get_global_rank(-1), "group_rank=-1"),
    ],
)
def test_bad_input_names_the_value(make, needle):
    with pytest.raises(ValueError) as err:
        make()
    assert needle in str(err.value)

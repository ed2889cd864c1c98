"""Tests for the group collectives of jfleet/mesh/collective.py (jfleet/mesh/group_collective.py).

Every result is compared with Paddle's per-rank semantics computed in NumPy from the
group membership written out by hand for dp2 x mp4 (rank = 4 * dp + mp): each rank holds
its own row, inside ``shard_map`` and as the pieces of a global array (one row per rank).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.mesh import collective
from jfleet.mesh.collective import (
    ReduceOp,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    get_backend,
    get_rank,
    get_world_size,
    local_value,
    new_group,
    reduce,
    reduce_scatter,
    scatter,
    wait,
)
from jfleet.mesh.hybrid_group import HybridCommunicateGroup
from jfleet.mesh.topology import DP, MP, CommunicateTopology
from tests.fleet_setup import init_fleet

WORLD = 8
K = 3  # each rank's tensor: a row of K values
MP_GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]
DP_GROUPS = [[0, 4], [1, 5], [2, 6], [3, 7]]
WORLD_GROUPS = [list(range(8))]
MP_DP_GROUPS = [[0, 4, 1, 5, 2, 6, 3, 7]]  # fused (mp, dp): row-major over mp then dp

_RED = {
    ReduceOp.SUM: lambda v: v.sum(0),
    ReduceOp.MAX: lambda v: v.max(0),
    ReduceOp.MIN: lambda v: v.min(0),
    ReduceOp.PROD: lambda v: v.prod(0),
    ReduceOp.AVG: lambda v: v.mean(0),
}

RNG = np.random.default_rng(0)
T = RNG.uniform(0.5, 1.5, (WORLD, K)).astype(np.float32)  # T[r]: rank r's tensor
LISTS = RNG.uniform(-1, 1, (4, WORLD, K)).astype(np.float32)  # LISTS[j, r]: rank r's entry j


def _ref(kind, groups, op=ReduceOp.SUM, pos=0, n_list=0):
    """Paddle's result on every rank, from the per-rank tensors ``T`` / ``LISTS``."""
    if kind == "all_gather":
        out = np.zeros((len(groups[0]), WORLD, K), np.float32)
    else:
        out = np.zeros((WORLD, K), np.float32)
    for g in groups:
        vals = T[g]
        for i, r in enumerate(g):
            if kind == "all_reduce":
                out[r] = _RED[op](vals)
            elif kind == "broadcast":
                out[r] = vals[pos]
            elif kind == "reduce":
                out[r] = _RED[op](vals) if i == pos else T[r]
            elif kind == "all_gather":
                out[:, r] = vals
            elif kind == "scatter":
                out[r] = LISTS[i, g[pos]]
            elif kind == "reduce_scatter":
                out[r] = _RED[op](LISTS[i, g])
    return out


@pytest.fixture
def hcg():
    init_fleet({"dp_degree": 2, "mp_degree": 4})
    return fleet.get_hybrid_communicate_group()


def _rows(hcg, array):
    """``array`` [8, ...] as a global array, row ``r`` on device (rank) ``r``."""
    return jax.device_put(array, NamedSharding(hcg.mesh, P(hcg.mesh.axis_names)))


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


# ----- on global arrays (the host view) --------------------------------------------------------


def test_all_reduce_every_op_on_global_rows(hcg):
    x = _rows(hcg, T)
    mp, dp = hcg.get_model_parallel_group(), hcg.get_data_parallel_group()
    for op, group, groups in [
        (ReduceOp.SUM, mp, MP_GROUPS),
        (ReduceOp.MAX, dp, DP_GROUPS),
        (ReduceOp.MIN, None, WORLD_GROUPS),
        (ReduceOp.PROD, mp, MP_GROUPS),
        (ReduceOp.AVG, dp, DP_GROUPS),
    ]:
        out = all_reduce(x, op, group=group)
        assert out.sharding.is_equivalent_to(x.sharding, 2)
        _close(out, _ref("all_reduce", groups, op))


def test_replicated_input_every_rank_holds_it(hcg):
    # A value not laid out on the mesh is every rank's tensor: the mp sum is 4x it.
    mp = hcg.get_model_parallel_group()
    out = all_reduce(jnp.asarray(T[0]), group=mp)
    _close(out, 4 * T[0])
    out = broadcast(np.asarray(T[1]), src=2, group=mp)
    _close(out, T[1])


def test_gather_broadcast_reduce_scatter_on_global_rows(hcg):
    x = _rows(hcg, T)
    mp, dp = hcg.get_model_parallel_group(), hcg.get_data_parallel_group()
    fused = hcg.create_fuse_group([MP, DP])
    assert fused.ranks == tuple(MP_DP_GROUPS[0])

    filled = [None] * 8
    out = all_gather(filled, x, group=fused)
    assert out is filled and len(out) == 8
    _close(np.stack([np.asarray(o) for o in out]), _ref("all_gather", MP_DP_GROUPS))

    _close(broadcast(x, src=2, group=new_group([3, 2, 1, 0])), _ref("broadcast", MP_GROUPS, pos=2))
    _close(broadcast(x, src=5, group=None), _ref("broadcast", WORLD_GROUPS, pos=5))
    # dst=4 is dp index 1: every dp group reduces onto its dp=1 member.
    _close(reduce(x, dst=4, op=ReduceOp.MAX, group=dp), _ref("reduce", DP_GROUPS, ReduceOp.MAX, 1))
    lists = [_rows(hcg, LISTS[j]) for j in range(4)]
    _close(scatter(x, lists, src=3, group=mp), _ref("scatter", MP_GROUPS, pos=3))
    _close(reduce_scatter(x, lists[:2], group=dp), _ref("reduce_scatter", DP_GROUPS))


def _per_rank(mesh, y):
    """What each device (rank) holds of ``y``, stacked in rank order."""
    rank = {d: r for r, d in enumerate(mesh.devices.flat)}
    held = {rank[s.device]: np.asarray(s.data) for s in y.addressable_shards}
    return np.stack([held[r] for r in range(mesh.devices.size)])


def test_replicated_buffers_hold_each_ranks_result_as_in_paddle(hcg):
    # Paddle's hybrid_parallel_communicate_group.py on dp2 x mp4: every rank starts from
    # the same tensors; results that differ between ranks stay per device.
    t1, t2 = jnp.asarray([1.0, 2.0, 3.0]), jnp.asarray([2.0, 3.0, 4.0])
    dp = hcg.get_data_parallel_group()
    dp_index = np.arange(8) // 4  # rank = 4 * dp + mp
    result = scatter(jnp.zeros(3), [t2, t1], src=dp.ranks[0], group=dp)
    _close(_per_rank(hcg.mesh, result), np.where(dp_index[:, None] == 0, t2, t1))
    _close(result, t2)  # the host reads rank 0's, as Paddle's rank 0 does
    _close(local_value(result), t2)
    _close(local_value(result, 5), t1)
    _close(local_value(_rows(hcg, T), 6), T[6:7])
    result = broadcast(result, src=4, group=dp)  # rank 4: dp index 1 holds t1
    _close(_per_rank(hcg.mesh, result), np.tile(t1, (8, 1)))
    result = reduce(result, dst=0, group=dp)
    _close(_per_rank(hcg.mesh, result), np.where(dp_index[:, None] == 0, 2 * t1, t1))
    result = all_reduce(result)  # four ranks hold 2 * t1, four hold t1
    _close(_per_rank(hcg.mesh, result), np.tile(12 * t1, (8, 1)))


def test_group_from_a_hybrid_group_without_fleet_init():
    # The group carries its mesh; group=None takes the mesh the tensor is laid out on.
    hcg = HybridCommunicateGroup(CommunicateTopology(["data", "model"], [2, 4]))
    mp = hcg.get_model_parallel_group()
    x = jax.device_put(T, NamedSharding(hcg.mesh, P(hcg.mesh.axis_names)))
    y = all_reduce(x, group=mp)
    _close(y, _ref("all_reduce", MP_GROUPS))
    _close(all_reduce(y), np.tile(_ref("all_reduce", MP_GROUPS).sum(0), (8, 1)))


# ----- inside shard_map ------------------------------------------------------------------------


def test_every_collective_inside_shard_map(hcg):
    mp, dp = hcg.get_model_parallel_group(), hcg.get_data_parallel_group()
    fused = hcg.create_fuse_group([MP, DP])
    axes = hcg.mesh.axis_names
    row = P(axes)

    def body(x, lists):
        xs = [lists[j] for j in range(4)]
        return {
            "sum_mp": all_reduce(x, group=mp),
            "max_dp": all_reduce(x, ReduceOp.MAX, group=dp),
            "prod_world": all_reduce(x, ReduceOp.PROD),
            "gather_fused": jnp.stack(all_gather([], x, group=fused)),
            "bcast_mp": broadcast(x, src=1, group=mp),
            "reduce_dp": reduce(x, dst=0, op=ReduceOp.AVG, group=dp),
            "scatter_mp": scatter(x, xs, src=2, group=mp),
            "rs_dp_min": reduce_scatter(x, xs[:2], ReduceOp.MIN, group=dp),
        }

    out_specs = {k: row for k in ("sum_mp", "max_dp", "bcast_mp")}
    out_specs["prod_world"] = P()  # equal on every rank, and typed so: no axis needed
    out_specs |= {"reduce_dp": row, "scatter_mp": row, "rs_dp_min": row}
    out_specs["gather_fused"] = P(None, axes)
    f = jax.jit(
        jax.shard_map(body, mesh=hcg.mesh, in_specs=(row, P(None, axes)), out_specs=out_specs)
    )
    out = f(_rows(hcg, T), jax.device_put(LISTS, NamedSharding(hcg.mesh, P(None, axes))))
    _close(out["sum_mp"], _ref("all_reduce", MP_GROUPS))
    _close(out["max_dp"], _ref("all_reduce", DP_GROUPS, ReduceOp.MAX))
    _close(out["prod_world"], _ref("all_reduce", WORLD_GROUPS, ReduceOp.PROD)[:1])
    _close(out["gather_fused"], _ref("all_gather", MP_DP_GROUPS))
    _close(out["bcast_mp"], _ref("broadcast", MP_GROUPS, pos=1))
    _close(out["reduce_dp"], _ref("reduce", DP_GROUPS, ReduceOp.AVG, 0))
    _close(out["scatter_mp"], _ref("scatter", MP_GROUPS, pos=2))
    _close(out["rs_dp_min"], _ref("reduce_scatter", DP_GROUPS, ReduceOp.MIN))


def test_new_group_finds_the_mesh_axes_that_join_the_ranks(hcg):
    g = new_group([3, 1, 0, 2])
    assert (g.axis_name, g.ranks, g.rank, g.mesh) == (MP, (0, 1, 2, 3), 0, hcg.mesh)
    assert (new_group([4, 0]).axis_name, new_group([4, 0]).ranks) == (DP, (0, 4))
    assert new_group().axis_name == (DP, MP) and new_group().nranks == 8
    assert (new_group([5]).axis_name, new_group([5]).rank) == ((), -1)


def test_sync_op_is_accepted_and_logged_once(hcg, caplog, monkeypatch):
    monkeypatch.setattr(collective, "_sync_logged", [])
    x = jnp.asarray(T[0])
    with caplog.at_level(logging.INFO, logger="jfleet"):
        _close(all_reduce(x, sync_op=False), 8 * T[0])
        all_reduce(x, sync_op=False)
    notes = [r.getMessage() for r in caplog.records if "sync_op" in r.getMessage()]
    assert len(notes) == 1 and "all_reduce(sync_op=False): ignored" in notes[0]


def test_rank_world_size_barrier_and_moe_group(hcg):
    mp = hcg.get_model_parallel_group()
    assert get_rank() == 0 and get_world_size() == 8
    assert get_rank(mp) == 0 and get_world_size(mp) == 4
    assert barrier(mp) is None and barrier() is None
    assert get_backend() == get_backend(mp) == "XLA" and wait(jnp.ones(2), mp) is None
    # The one-rank moe-sharding group: a collective over it returns its input.
    moe = hcg.get_moe_sharding_parallel_group()
    row = P(hcg.mesh.axis_names)
    f = jax.shard_map(
        lambda v: all_reduce(v, group=moe), mesh=hcg.mesh, in_specs=row, out_specs=row
    )
    _close(f(_rows(hcg, T)), T)


# ----- bad input ------------------------------------------------------------------------------


def _partial_manual(hcg, fn):
    """Traces ``fn`` inside a shard_map that leaves every axis but mp automatic."""
    f = jax.shard_map(fn, mesh=hcg.mesh, in_specs=P(MP), out_specs=P(MP), axis_names={MP})
    return jax.jit(f).trace(jnp.zeros((4, K)))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda h, x: all_reduce(x, group="mp"), TypeError, r"group='mp' \(str\) is not a Group"),
        (lambda h, x: reduce(x, 0, op="sum"), ValueError, r"op='sum' is not a reduction"),
        (lambda h, x: all_reduce(x, op=9), ValueError, r"op=9 is not a reduction"),
        (
            lambda h, x: all_reduce(x, "sum", group=h.get_model_parallel_group()),
            ValueError,
            r"mode='sum' is fleet.util's per-process form and takes no group",
        ),
        (
            lambda h, x: broadcast(x, src=1, group=h.get_data_parallel_group()),
            ValueError,
            r"src=1 is not a rank of group 'dp' \(global ranks \[0, 4\]\)",
        ),
        (
            lambda h, x: reduce(x, dst=8),
            ValueError,
            r"dst=8 is not a rank of group 'world'",
        ),
        (
            lambda h, x: scatter(x, [x, x, x], group=h.get_model_parallel_group()),
            ValueError,
            r"tensor_list has 3 entries but the group has 4 ranks",
        ),
        (
            lambda h, x: all_gather((x,), x, group=h.get_data_parallel_group()),
            ValueError,
            r"tensor_list has 1 entries but the group has 2 ranks",
        ),
        (
            lambda h, x: reduce_scatter(x, x, group=h.get_data_parallel_group()),
            TypeError,
            r"tensor_list is a ArrayImpl of shape \(8, 3\), not a list",
        ),
        (
            lambda h, x: scatter(x, None, src=0, group=h.get_data_parallel_group()),
            ValueError,
            r"scatter: tensor_list=None",
        ),
        (
            lambda h, x: scatter(x, [x, x[:, :2]], group=h.get_data_parallel_group()),
            ValueError,
            r"tensor_list\[1\] of shape \(8, 2\) .* piece of shape \(1, 2\), but tensor's "
            r"pieces have shape \(1, 3\)",
        ),
        (
            lambda h, x: jax.jit(lambda v: all_reduce(v))(x),
            ValueError,
            r"traced value outside shard_map \(inside jax.jit\)",
        ),
        (
            lambda h, x: _partial_manual(
                h, lambda v: all_reduce(v, group=h.get_data_parallel_group())
            ),
            ValueError,
            r"group 'dp' spans mesh axes \['dp'\] but \['dp'\] are not manual",
        ),
        (
            lambda h, x: _partial_manual(
                h, lambda v: scatter(v, [v, v[:, :2], v, v], group=h.get_model_parallel_group())
            ),
            ValueError,
            r"tensor_list\[1\] has shape \(1, 2\) but tensor has \(1, 3\)",
        ),
        (lambda h, x: barrier(3), TypeError, r"group=3 \(int\) is not a Group"),
        (lambda h, x: local_value(x, 8), ValueError, r"rank=8 is not a rank whose piece"),
        (lambda h, x: new_group([0, 2]), ValueError, r"ranks=\[0, 2\] are not one group along"),
        (lambda h, x: new_group([1, 1]), ValueError, r"ranks=\[1, 1\] must be distinct"),
        (lambda h, x: new_group([0, 9]), ValueError, r"\(bad: \[9\]\)"),
    ],
)
def test_bad_input_names_the_value(hcg, call, error, match):
    x = _rows(hcg, T)
    with pytest.raises(error, match=match):
        call(hcg, x)


def test_array_on_a_foreign_mesh_is_refused(hcg):
    other = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(T, NamedSharding(other, P("batch")))
    with pytest.raises(ValueError, match=r"split over \['batch'\] .* not axes of the fleet mesh"):
        all_reduce(x, group=hcg.get_model_parallel_group())

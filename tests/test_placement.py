"""Tests for jfleet/mesh/placement.py on its own: where parameters, ZeRO state and batches live."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.mesh.placement import (
    ParallelPlan,
    Placement,
    check_divides,
    put,
    resolve_placement,
)
from jfleet.mesh.topology import DP, EP, MP, SHARDING
from jfleet.training.distributed_model import DistributedModel
from tests.fleet_setup import fleet_mesh, init_fleet

HYBRID = {"dp_degree": 2, "sharding_degree": 2, "mp_degree": 2}


class Annotated(nnx.Module):
    """One kernel laid out on mp by its metadata, one plain bias."""

    def __init__(self) -> None:
        self.kernel = nnx.Param(jnp.ones((8, 4)))
        self.kernel.set_metadata(out_sharding=(None, MP))
        self.bias = nnx.Param(jnp.zeros((6,)))


def test_from_fleet_reads_the_run():
    init_fleet(HYBRID, sharding_configs={"stage": 2})
    placement = Placement.from_fleet()
    assert placement.mesh is fleet_mesh()
    assert placement.zero_stage == 2
    assert placement.zero_axis == SHARDING
    assert placement.data_axes == (DP, SHARDING, EP)
    assert placement.data_parallel_size == 4
    assert placement.zero_degree == 2


def test_without_a_sharding_axis_zero_is_off():
    init_fleet({"dp_degree": 8}, sharding_configs={"stage": 3})
    assert Placement.from_fleet().zero_stage == 0


def test_from_fleet_needs_a_run():
    with pytest.raises(RuntimeError, match=r"fleet\.init"):
        Placement.from_fleet()


def test_sharding_switch_without_a_sharding_axis_is_refused():
    init_fleet({"dp_degree": 8}, sharding=True)
    with pytest.raises(ValueError, match="sharding_degree"):
        Placement.from_fleet()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"zero_stage": 4}, "zero_stage=4"), ({"zero_axis": "zz"}, "zero_axis='zz'")],
)
def test_bad_settings_are_named(kwargs, match):
    init_fleet(HYBRID)
    with pytest.raises(ValueError, match=match):
        Placement(mesh=fleet_mesh(), **kwargs)


def test_the_old_name_is_the_same_class():
    assert ParallelPlan is Placement


def test_zero_spec_picks_the_largest_free_dimension_it_divides():
    init_fleet({"dp_degree": 2, "sharding_degree": 4})
    placement = Placement(mesh=fleet_mesh(), zero_stage=1)
    assert placement.zero_spec(P(), (8, 16)) == P(None, SHARDING)
    assert placement.zero_spec(P(), (16, 6)) == P(SHARDING, None)


def test_zero_spec_joins_a_split_dimension_when_no_free_one_divides():
    init_fleet(HYBRID)
    placement = Placement(mesh=fleet_mesh(), zero_stage=1)
    assert placement.zero_spec(P(None, MP), (3, 8)) == P(None, (SHARDING, MP))


def test_zero_spec_leaves_what_no_dimension_divides():
    init_fleet(HYBRID)
    placement = Placement(mesh=fleet_mesh(), zero_stage=1)
    assert placement.zero_spec(P(), (3, 5)) == P()
    assert placement.zero_spec(P(SHARDING), (4,)) == P(SHARDING)  # already there


def test_place_params_lays_out_metadata_and_zero3_shards_the_rest():
    init_fleet(HYBRID)
    model = Annotated()
    Placement(mesh=fleet_mesh(), zero_stage=3).place_params(model)
    assert model.kernel.sharding.spec == P(SHARDING, MP)
    assert model.bias.sharding.spec == P(SHARDING)
    assert model.kernel.get_metadata("optimizer_sharding") == (SHARDING, MP)


def test_place_params_without_zero_keeps_the_tensor_parallel_layout():
    init_fleet(HYBRID)
    model = Annotated()
    placement = Placement(mesh=fleet_mesh())
    placement.place_params(model)
    assert model.kernel.sharding.spec == P(None, MP)
    assert model.bias.sharding.spec == P()
    params = nnx.state(model, nnx.Param)
    assert placement.param_shardings(params)["kernel"].spec == P(None, MP)
    assert placement.param_shardings(params, zero=True)["kernel"].spec == P(SHARDING, MP)
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), np.ones((8, 4)))


def test_put_splits_one_device_arrays_over_the_mesh_like_device_put_without_compiling(caplog):
    init_fleet(HYBRID)
    mesh = fleet_mesh()
    # Shapes no other test places, so a compile would be a fresh one.
    tree = {"w": jnp.arange(7 * 12.0).reshape(7, 12), "b": jnp.arange(20, dtype=jnp.bfloat16)}
    shardings = {
        "w": Placement(mesh=mesh).named(P(None, MP)),
        "b": Placement(mesh=mesh).named(P(DP)),
    }
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        placed = put(tree, shardings)
        jax.block_until_ready(placed)
    assert not [r for r in caplog.records if "compil" in r.getMessage().lower()], caplog.text
    expected = jax.device_put(tree, shardings)
    for name in tree:
        assert placed[name].sharding == expected[name].sharding
        assert placed[name].dtype == tree[name].dtype
        np.testing.assert_array_equal(np.asarray(placed[name]), np.asarray(expected[name]))


def test_put_leaves_weak_types_keys_and_placed_arrays_to_device_put():
    init_fleet(HYBRID)
    replicated = Placement(mesh=fleet_mesh()).named(P())
    weak = put(jnp.asarray(2.0), replicated)  # a Python scalar's weak type survives
    assert weak.weak_type and weak.sharding == replicated
    key = jax.random.key(3)  # a typed key has no NumPy form (an nnx.Rngs stream's count)
    placed_key = put(key, replicated)
    assert placed_key.sharding == replicated and placed_key.dtype == key.dtype
    np.testing.assert_array_equal(jax.random.key_data(placed_key), jax.random.key_data(key))
    sharded = put(jnp.arange(8.0), Placement(mesh=fleet_mesh()).named(P(DP)))
    assert put(sharded, sharded.sharding) is sharded  # already there: device_put's no-op


def test_shard_batch_splits_the_leading_dimension_over_the_data_axes():
    init_fleet(HYBRID)
    placement = Placement(mesh=fleet_mesh())
    batch = placement.shard_batch({"x": np.arange(16).reshape(8, 2), "step": np.int32(3)})
    assert batch["x"].sharding.spec == P((DP, SHARDING, EP))
    assert batch["step"].sharding.spec == P()
    np.testing.assert_array_equal(np.asarray(batch["x"]), np.arange(16).reshape(8, 2))
    again = placement.shard_batch(batch)  # a global array is re-laid out, not copied in
    assert again["x"].sharding == batch["x"].sharding


def test_shard_batch_refuses_a_batch_the_data_axes_do_not_divide():
    init_fleet(HYBRID)
    with pytest.raises(ValueError, match=r"\['x'\] has batch size 6.*size 4 \(dp 2 x sharding 2\)"):
        Placement(mesh=fleet_mesh()).shard_batch({"x": np.zeros((6, 2))})


def test_resolve_placement_prefers_the_given_then_the_models_then_the_runs():
    init_fleet(HYBRID, sharding_configs={"stage": 1})
    given = Placement(mesh=fleet_mesh(), zero_stage=3)
    own = Placement(mesh=fleet_mesh(), zero_stage=2)
    wrapped = DistributedModel(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), own)
    assert resolve_placement(given, wrapped) is given
    assert resolve_placement(None, wrapped) is own
    assert resolve_placement(None, nnx.Linear(2, 2, rngs=nnx.Rngs(0))).zero_stage == 1


def test_check_divides_names_the_parts_and_the_fix():
    check_divides("8 rows", 8, [("dp", 2), ("sharding", 4)], "unused")
    with pytest.raises(ValueError, match=r"^10 rows, which the micro-batches 4 \(M 4\) does not"):
        check_divides("10 rows", 10, [("M", 4)], "use 12", label="micro-batches")


def test_the_fleet_facade_builds_the_same_placement():
    init_fleet(HYBRID, sharding_configs={"stage": 3})
    model = fleet.distributed_model(nnx.Linear(8, 8, rngs=nnx.Rngs(0)))
    assert model.placement == Placement.from_fleet()
    assert model.module.kernel.sharding.spec == P(SHARDING, None)


def test_a_given_zero_layout_is_kept_and_used_when_it_fits():
    init_fleet(HYBRID)
    placement = Placement(mesh=fleet_mesh(), zero_stage=1)
    model = Annotated()
    model.kernel.set_metadata(optimizer_sharding=(None, (SHARDING, MP)))  # a plan's choice
    model.bias.set_metadata(optimizer_sharding=(DP,))  # set by hand
    placement.place_params(model)
    assert model.kernel.get_metadata("optimizer_sharding") == (None, (SHARDING, MP))
    shardings = placement.param_shardings(nnx.state(model, nnx.Param), zero=True)
    assert shardings["kernel"].spec == P(None, (SHARDING, MP))  # zero_spec: P(sharding, mp)
    assert shardings["bias"].spec == P(DP)  # zero_spec: P(sharding)


def test_a_zero_layout_that_does_not_fit_the_mesh_is_recomputed():
    init_fleet(HYBRID)
    model = Annotated()
    model.kernel.set_metadata(optimizer_sharding=(None, (SHARDING, MP, DP)))  # 8 does not split 4
    placement = Placement(mesh=fleet_mesh(), zero_stage=1)
    placement.place_params(model)
    assert model.kernel.get_metadata("optimizer_sharding") == (SHARDING, MP)

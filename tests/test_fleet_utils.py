"""Paddle's fleet package tree: fleet.utils (hybrid_parallel_util, mix_precision_utils),
meta_optimizers / meta_parallel isinstance answers, base.topology, the Fleet object's
attributes, and jfleet.distributed (new_group, save_group_sharded_model)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jfleet.distributed as dist
from jfleet import fleet
from jfleet.distributed.sharding import load_group_sharded_model, save_group_sharded_model
from jfleet.fleet import _noop
from jfleet.fleet import meta_optimizers as mo
from jfleet.fleet import meta_parallel as mpar
from jfleet.fleet.base import topology
from jfleet.fleet.utils import hybrid_parallel_util as hpu
from jfleet.fleet.utils import mix_precision_utils as mpu
from jfleet.precision.amp import GradScaler
from jfleet.testing import make_strategy


def init(**hybrid):
    return fleet.init(is_collective=True, strategy=make_strategy(hybrid), log_level="WARNING")


def test_spmd_noops_return_at_once_and_log_once(caplog, monkeypatch):
    monkeypatch.setattr(_noop, "_logged", set())  # as in a fresh process
    hcg = init(dp_degree=8)._hcg
    with caplog.at_level("INFO", logger="jfleet"):
        for _ in range(2):
            assert hpu.fused_allreduce_gradients([], hcg) is None
            assert hpu.broadcast_mp_parameters(None, hcg) is None
            assert (
                hpu.fused_allreduce_gradients_with_group([], hcg.get_data_parallel_group()) is None
            )
    said = [r.getMessage() for r in caplog.records]
    assert sum("fused_allreduce_gradients does nothing under SPMD" in m for m in said) == 1
    assert sum("broadcast_mp_parameters does nothing under SPMD" in m for m in said) == 1


def test_unwrap_optimizer_peels_paddle_wrappers_and_keeps_the_jfleet_optimizer():
    class Wrapper:
        def __init__(self, inner):
            self._inner_opt = inner

    class Other(Wrapper):
        pass

    inner = optax.sgd(0.1)
    stack = Wrapper(Other(inner))
    assert hpu.unwrap_optimizer(stack, Wrapper) is inner
    assert hpu.unwrap_optimizer(stack, ()) is stack
    assert hpu.unwrap_optimizer(Other(stack), Other) is stack  # a Wrapper is not an Other
    init(dp_degree=8)
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    assert hpu.unwrap_optimizer(opt, (mo.HybridParallelOptimizer,)) is opt


def test_meta_optimizer_classes_answer_isinstance_from_what_was_applied():
    init(dp_degree=2, sharding_degree=4)
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    assert isinstance(opt, mo.HybridParallelOptimizer) and isinstance(opt, mo.ShardingOptimizer)
    assert isinstance(opt, mo.DygraphShardingOptimizer)
    assert not isinstance(opt, mo.DygraphShardingOptimizerV2)
    assert not isinstance(opt, mo.AMPOptimizer) and not isinstance(opt, mo.LambOptimizer)
    fleet.fleet._user_defined_strategy.hybrid_configs["sharding_configs"].split_param = True
    assert isinstance(opt, mo.dygraph_optimizer.DygraphShardingOptimizerV2)
    assert not isinstance(opt, mo.DygraphShardingOptimizer)
    assert not isinstance(optax.sgd(0.1), mo.HybridParallelOptimizer)
    assert isinstance(GradScaler(), mo.HybridParallelGradScaler)
    assert not isinstance(opt, mo.HybridParallelGradScaler)
    init(dp_degree=8)
    plain = mo.HybridParallelOptimizer(optax.sgd(0.1), fleet.get_hybrid_communicate_group())
    assert isinstance(plain, mo.HybridParallelOptimizer)
    assert not isinstance(plain, mo.DygraphShardingOptimizer)


def test_meta_parallel_model_classes_follow_the_parallel_mode():
    init(dp_degree=2, mp_degree=4)
    model = fleet.distributed_model(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    assert isinstance(model, mpar.TensorParallel)
    assert not isinstance(model, mpar.ShardingParallel | mpar.DataParallel)
    init(dp_degree=2, sharding_degree=4)
    assert isinstance(model, mpar.ShardingParallel)  # asks the run in force
    init(dp_degree=8)
    model = mpar.DataParallel(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    assert isinstance(model, mpar.DataParallel) and not isinstance(model, mpar.TensorParallel)


def test_fleet_object_topology_and_group_names():
    assert topology._HYBRID_PARALLEL_GROUP is None and not dist.is_initialized()
    init(dp_degree=2, mp_degree=4)
    hcg = fleet.get_hybrid_communicate_group()
    assert fleet.fleet is fleet._fleet and fleet.fleet._hcg is hcg
    assert topology._HYBRID_PARALLEL_GROUP is hcg
    assert fleet.nranks() == fleet.fleet.worker_num() == 1 and fleet.rank_in_node() == 0
    assert fleet.utils.recompute is fleet.recompute.recompute
    mp = dist.new_group([0, 1, 2, 3])  # jfleet.collective's new_group, Paddle's path
    assert (mp.axis_name, mp.ranks) == ("mp", hcg.get_model_parallel_group().ranks)


def test_mix_precision_optimizer_updates_fp32_masters_of_half_params():
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    grads = {"w": jnp.full(2, 2.0**-10, jnp.bfloat16)}

    def train(tx, params, steps=4):
        state = tx.init(params)
        for _ in range(steps):
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params["w"]

    # 1 - 2**-10 rounds back to 1 in bfloat16; four fp32 master steps reach 1 - 2**-8
    np.testing.assert_array_equal(train(optax.sgd(1.0), params), [1.0, 1.0])
    got = train(mpu.MixPrecisionOptimizer(optax.sgd(1.0)), params)
    np.testing.assert_array_equal(got.astype(jnp.float32), [1 - 2.0**-8] * 2)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    assert mpu.MixPrecisionLayer(model, dtype="bfloat16") is model
    scaler = GradScaler()
    assert mpu.MixPrecisionScaler(scaler) is scaler


def test_save_group_sharded_model_writes_the_inner_models_paths(tmp_path):
    init(dp_degree=2, sharding_degree=4)
    model = fleet.distributed_model(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.adam(0.1))
    opt.init(model)
    save_group_sharded_model(model, str(tmp_path / "out"), optimizer=opt)
    assert os.path.isdir(tmp_path / "out" / "model.pdmodel")
    assert os.path.isdir(tmp_path / "out" / "model.pdopt")
    other = nnx.Linear(8, 4, rngs=nnx.Rngs(1))  # other values; loaded back from the files
    load_group_sharded_model(other, str(tmp_path / "out"))
    np.testing.assert_array_equal(other.kernel[...], nnx.Linear(8, 4, rngs=nnx.Rngs(0)).kernel[...])
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"a_file'\) is a file; give a directory"):
        save_group_sharded_model(model, str(tmp_path / "a_file"))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: hpu.fused_allreduce_gradients([], "hcg"),
            TypeError,
            r"fused_allreduce_gradients: hcg='hcg' \(str\) is not a HybridCommunicateGroup",
        ),
        (
            lambda: hpu.fused_allreduce_gradients_with_group([], "dp"),
            TypeError,
            r"group='dp' \(str\) is not a Group",
        ),
        (
            lambda: hpu.unwrap_optimizer(optax.sgd(0.1), "HybridParallelOptimizer"),
            TypeError,
            r"optimizer_instances='HybridParallelOptimizer' must be a class or a tuple",
        ),
        (
            lambda: mpu.MixPrecisionLayer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), dtype="float32"),
            ValueError,
            r"MixPrecisionLayer\(dtype='float32'\): expected one of \['float16', 'bfloat16'\]",
        ),
        (
            lambda: mpu.MixPrecisionLayer([1, 2]),
            TypeError,
            r"MixPrecisionLayer\(layers=list\): expected the nnx.Module",
        ),
        (
            lambda: mpu.MixPrecisionOptimizer("adam"),
            TypeError,
            r"MixPrecisionOptimizer\(optimizer='adam'\): expected an optax",
        ),
        (
            lambda: mpu.MixPrecisionScaler(1.0),
            TypeError,
            r"MixPrecisionScaler\(scaler=1.0\): expected a jfleet.amp.GradScaler",
        ),
        (
            lambda: save_group_sharded_model({"w": 1}, "out"),
            TypeError,
            r"save_group_sharded_model\(model=dict\): expected the nnx.Module",
        ),
    ],
)
def test_fleet_utils_bad_arguments_name_the_value(call, error, match):
    with pytest.raises(error, match=match):
        call()

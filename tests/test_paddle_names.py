"""Every Paddle name that issue 12 lists imports by its Paddle path, with the swap
``paddle.distributed.fleet`` → ``jfleet.fleet``, ``paddle.distributed`` →
``jfleet.distributed``, ``paddle.amp`` → ``jfleet.amp``.

A name is ``"module:attr.attr"``: the module is imported as Paddle code imports it, then
each attribute is read (a class's methods and properties, a dataclass's fields)."""

from __future__ import annotations

import dataclasses
import importlib

import optax
import pytest
from flax import nnx

from jfleet import fleet

SWAP = (
    ("paddle.distributed.fleet", "jfleet.fleet"),
    ("paddle.distributed", "jfleet.distributed"),
    ("paddle.amp", "jfleet.amp"),
)

FLEET = "paddle.distributed.fleet"
SEQ = f"{FLEET}.utils.sequence_parallel_utils"
HPU = f"{FLEET}.utils.hybrid_parallel_util"
MIX = f"{FLEET}.utils.mix_precision_utils"
MPU = f"{FLEET}.layers.mpu"
META_OPT = f"{FLEET}.meta_optimizers"
META_PAR = f"{FLEET}.meta_parallel"
TOPO = f"{FLEET}.base.topology"
HCG = f"{TOPO}:HybridCommunicateGroup"


def names(module: str, *attrs: str) -> list[str]:
    return [f"{module}:{a}" for a in attrs]


TP_LAYERS = ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding")
HYBRID_OPTS = (
    "HybridParallelOptimizer",
    "DygraphShardingOptimizer",
    "DygraphShardingOptimizerV2",
    "HybridParallelGradScaler",
)
AXES = ("data", "model", "sharding", "sep")
PADDLE_NAMES = [
    # fleet.utils and fleet.recompute
    *names(f"{FLEET}.utils", "recompute", "recompute_sequential", "is_in_recompute"),
    *names(f"{FLEET}.recompute", "recompute", "recompute_sequential", "recompute_hybrid"),
    *names(
        SEQ,
        "ScatterOp",
        "GatherOp",
        "AllGatherOp",
        "ReduceScatterOp",
        "mark_as_sequence_parallel_parameter",
        "is_sequence_parallel_parameter",
        "register_sequence_parallel_allreduce_hooks",
        "scatter",
        "all_gather",
        "reduce_scatter",
        "ColumnSequenceParallelLinear",
        "RowSequenceParallelLinear",
        "ScatterOp.apply",
    ),
    *names(
        HPU,
        "fused_allreduce_gradients",
        "fused_allreduce_gradients_with_group",
        "broadcast_dp_parameters",
        "broadcast_mp_parameters",
        "broadcast_sharding_parameters",
        "broadcast_sep_parameters",
        "sharding_reduce_gradients",
        "unwrap_optimizer",
    ),
    *names(MIX, "MixPrecisionLayer", "MixPrecisionOptimizer", "MixPrecisionScaler"),
    *names(f"{FLEET}.utils.log_util", "logger", "set_log_level"),
    # fleet.layers.mpu
    *names(
        f"{MPU}.mp_ops",
        "_c_identity",
        "_c_concat",
        "_c_split",
        "_mp_allreduce",
        "_c_lookup_table",
        "_c_softmax_with_cross_entropy",
        "_linear",
    ),
    *names(f"{MPU}.mp_layers", *TP_LAYERS, "ParallelCrossEntropy"),
    *names(MPU, *TP_LAYERS, "ParallelCrossEntropy", "get_rng_state_tracker"),
    *names(f"{MPU}.random", "get_rng_state_tracker", "model_parallel_random_seed"),
    *names(f"{MPU}.random", "RNGStatesTracker"),
    # fleet.meta_optimizers, fleet.meta_parallel
    *names(META_OPT, *HYBRID_OPTS, "ShardingOptimizer"),
    *names(f"{META_OPT}.dygraph_optimizer", *HYBRID_OPTS),
    *names(
        META_PAR,
        "LayerDesc",
        "SharedLayerDesc",
        "PipelineLayer",
        "PipelineParallel",
        "TensorParallel",
        "ShardingParallel",
        "SegmentParallel",
        *TP_LAYERS,
        "ParallelCrossEntropy",
        "get_rng_state_tracker",
        "model_parallel_random_seed",
        "PipelineLayer.get_stage_from_index",
        "PipelineParallel.train_batch",
        "PipelineParallel.eval_batch",
    ),
    # fleet.base.topology, the fleet module and its Fleet object
    *names(TOPO, "CommunicateTopology", "HybridCommunicateGroup", "ParallelMode"),
    *names(
        FLEET,
        "fleet",
        "fleet.worker_num",
        "fleet.worker_index",
        "fleet.get_hybrid_communicate_group",
        "fleet._hcg",
        "fleet._user_defined_strategy",
        "scaler",
        "scaler.distributed_scaler",
        "nranks",
        "rank_in_node",
        "distributed_scaler",
        "recompute",
        "utils",
        "meta_parallel",
        "meta_optimizers",
        "init",
        "DistributedStrategy",
        "distributed_model",
        "distributed_optimizer",
        "get_hybrid_communicate_group",
        "worker_num",
        "worker_index",
        "local_rank",
        "is_first_worker",
        "UtilBase",
        "util.get_file_shard",
    ),
    *names(f"{FLEET}.scaler", "distributed_scaler"),
    # the hybrid group's getters and the Group's attributes
    *names(
        TOPO,
        *(
            f"HybridCommunicateGroup.get_{axis}_parallel_{what}"
            for axis in AXES
            for what in ("rank", "world_size", "group", "group_src_rank")
        ),
    ),
    *(
        f"{HCG}.{getter}"
        for getter in (
            "get_pipe_parallel_world_size",
            "get_pipe_parallel_group",
            "get_stage_id",
            "is_first_stage",
            "is_last_stage",
            "get_check_parallel_group",
            "get_p2p_groups",
            "get_rank_from_stage",
            "get_parallel_mode",
            "create_fuse_group",
            "get_global_rank",
            "get_moe_sharding_parallel_world_size",
            "get_moe_sharding_parallel_rank",
            "get_dp_sep_parallel_group",
            "get_pp_mp_parallel_group",
            "topology",
        )
    ),
    *(
        f"{FLEET}.base.topology:CommunicateTopology.{m}"
        for m in ("get_rank", "get_coord", "get_axis_list", "get_comm_list", "get_dim")
    ),
    *(
        f"jfleet.topology:Group.{a}"  # Paddle's Group class has no public path of its own
        for a in (
            "nranks",
            "rank",
            "ranks",
            "id",
            "name",
            "world_size",
            "process_group",
            "backend",
            "get_global_rank",
            "get_group_rank",
            "is_member",
        )
    ),
    # paddle.distributed: collectives, groups, sharding
    *names(
        "paddle.distributed",
        "fleet",
        "all_reduce",
        "all_gather",
        "broadcast",
        "reduce",
        "scatter",
        "reduce_scatter",
        "barrier",
        "wait",
        "get_rank",
        "get_world_size",
        "get_backend",
        "ReduceOp.SUM",
        "ReduceOp.MAX",
        "ReduceOp.MIN",
        "ReduceOp.PROD",
        "ReduceOp.AVG",
        "new_group",
        "init_parallel_env",
        "is_initialized",
        "sharding",
    ),
    *names("paddle.distributed.sharding", "group_sharded_parallel", "save_group_sharded_model"),
    # checkpoints (issue 13): Paddle's sharded state dicts and Fleet's save / load names
    *names("paddle.distributed", "save_state_dict", "load_state_dict"),
    *names(
        FLEET,
        "save",
        "load_model",
        "save_persistables",
        "save_dense_params",
        "save_inference_model",
        "load_inference_model",
    ),
    # paddle.amp
    *names("paddle.amp", "GradScaler", "auto_cast", "decorate"),
    *(
        f"paddle.amp:GradScaler.{m}"
        for m in (
            "scale",
            "minimize",
            "step",
            "update",
            "unscale_",
            "state_dict",
            "load_state_dict",
            "is_enable",
            "is_use_dynamic_loss_scaling",
            "get_init_loss_scaling",
            "get_loss_scaling",
        )
    ),
]


def jfleet_path(paddle_module: str) -> str:
    for paddle, ours in SWAP:
        if paddle_module == paddle or paddle_module.startswith(paddle + "."):
            return ours + paddle_module[len(paddle) :]
    return paddle_module


def resolve(name: str):
    module, _, attrs = name.partition(":")
    obj = importlib.import_module(jfleet_path(module))
    for attr in attrs.split("."):
        if dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
            return attr  # a field (set per instance)
        owner = obj if isinstance(obj, type) else type(obj)
        if isinstance(getattr(owner, attr, None), property):
            return getattr(owner, attr)  # a property: exists without a run to answer it
        obj = getattr(obj, attr)
    return obj


@pytest.mark.parametrize("name", PADDLE_NAMES)
def test_paddle_name_imports_by_its_paddle_path(name):
    assert resolve(name) is not None, name


def test_the_list_has_no_repeats():
    assert len(PADDLE_NAMES) == len(set(PADDLE_NAMES))


OPTIMIZER_API = ("get_lr", "set_lr", "step", "clear_grad", "state_dict", "set_state_dict")


def test_the_distributed_optimizer_has_paddles_optimizer_methods():
    fleet.init(is_collective=True, log_level="WARNING")
    model = fleet.distributed_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.sgd(0.1)).init(model)  # opt.step: once bound
    assert all(callable(getattr(opt, m)) for m in (*OPTIMIZER_API, "minimize")), [
        m for m in OPTIMIZER_API if not callable(getattr(opt, m, None))
    ]
    assert opt._inner_opt is not None

"""The schema of ``DistributedStrategy``: every setting, its default, its range, its SPMD status.

Private to :mod:`jfleet.strategy`, which validates and stores values against it. Names
and defaults are Paddle 3.3's ``distributed_strategy.proto``, plus jfleet's own keys
(``nonfinite``, ``amp_configs['dtype']``); a setting's type is its default's type. Three
tables hang off the schema, all keyed by dotted path:

- ``RULES``: the value check of every numeric field (and of the enumerated strings),
  with Paddle's ranges; ``tests/test_strategy_sections.py`` checks that no int or float
  field is left without one. Floats must also be finite (checked for every float).
- ``SPMD_NOOP_SETTINGS``: settings accepted for compatibility that have no effect under
  SPMD, each with the reason. ``fleet.init`` logs the ones set to a non-default value.
- ``NORMALIZE``: values stored in a canonical form (``'F-then-B'`` -> ``'FThenB'``, the
  hybrid ``order`` completed, see :func:`complete_order`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jfleet.mesh.hybrid_group import ORDER_DROPPED
from jfleet.mesh.topology import DEFAULT_ORDER, EP, MP, SEP
from jfleet.precision.nonfinite import MODES as NONFINITE_MODES

PADDLE_ORDER = tuple(a for a in DEFAULT_ORDER if a != EP)
"""Paddle's default ``hybrid_configs["order"]`` (no ``ep``: the mesh puts it just outside
``mp``, :func:`~jfleet.mesh.hybrid_group.build_hybrid_communicate_group`)."""


class ListOf:
    """Schema marker: a list of ``item`` (str, int, float, or a dict schema), default ``[]``."""

    __slots__ = ("default", "item")

    def __init__(self, item: Any, default: tuple = ()) -> None:
        self.item = item
        self.default = default

    def describe(self) -> str:
        return "dicts" if isinstance(self.item, dict) else f"{self.item.__name__}s"


_NCCL = {  # NCCLConfig: per-communicator NCCL tuning.
    "commName": "", "ll_buffsize": 0, "ll128_buffsize": 0, "simple_buffsize": 0,
    "buffsize_align": 0, "nchannels": 0, "algoStr": "", "protoStr": "",
}  # fmt: skip


def _nccl(*names: str) -> dict[str, Any]:
    return {name: dict(_NCCL) for name in names}


# Every setting, with Paddle's default. Top level: switches, then sections.
SCHEMA: dict[str, Any] = {
    "amp": False, "recompute": False, "localsgd": False, "dgc": False, "gradient_merge": False,
    "lars": False, "lamb": False, "pipeline": False, "elastic": False, "auto": False,
    "a_sync": True, "sync_nccl_allreduce": True, "nccl_comm_num": 1,
    "use_hierarchical_allreduce": False, "hierarchical_allreduce_inter_nranks": 1,
    "sync_batch_norm": False, "fuse_all_reduce_ops": True, "fuse_grad_size_in_MB": 32,
    "fuse_grad_size_in_TFLOPS": 50.0, "cudnn_exhaustive_search": False,
    "conv_workspace_size_limit": 512, "cudnn_batchnorm_spatial_persistent": False,
    "adaptive_localsgd": False, "fp16_allreduce": False, "sharding": False,
    "last_comm_group_size_MB": 1.0, "find_unused_parameters": False, "tensor_parallel": False,
    "without_graph_optimization": True, "fuse_grad_size_in_num": 8,
    "calc_comm_same_stream": False, "asp": False, "fuse_grad_merge": False, "semi_auto": False,
    "adam_d2sum": False, "auto_search": False, "heter_ccl_mode": False, "is_fl_ps_mode": False,
    "with_coordinator": False, "qat": False, "split_data": True,
    "nonfinite": "warn",  # jfleet setting: the engine's non-finite guard (jfleet.nonfinite)
    "recompute_configs": {
        "checkpoints": ListOf(str), "enable_offload": False, "checkpoint_shape": ListOf(int),
        "enable_tuning": False,
        "refined_ops_patterns": ListOf({
            "main_ops": ListOf(str), "num": 0, "pre_ops": ListOf(str), "suf_ops": ListOf(str),
        }),
    },
    "amp_configs": {
        "init_loss_scaling": 32768.0, "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0, "decr_ratio": 0.8, "use_dynamic_loss_scaling": True,
        "custom_white_list": ListOf(str), "custom_black_list": ListOf(str),
        "custom_black_varnames": ListOf(str), "use_pure_fp16": False, "use_fp16_guard": True,
        "use_optimizer_fp16": False, "use_pure_bf16": False,
        "dtype": "float16",  # jfleet key: the O1 compute dtype ("float16" or "bfloat16")
    },
    "localsgd_configs": {"k_steps": 1, "begin_step": 1},
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1},
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    "dgc_configs": {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": ListOf(float)},
    "lars_configs": {
        "lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0.0,
        "exclude_from_weight_decay": ListOf(str),
    },
    "lamb_configs": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": ListOf(str)},
    "pipeline_configs": {
        "micro_batch_size": 1, "accumulate_steps": 1, "schedule_mode": "1F1B",
        "p2p_cache_shape": True, "enable_partial_send_recv": True,
    },
    "tensor_parallel_configs": {"tensor_parallel_degree": 1, "tensor_init_seed": -1},
    "sharding_configs": {  # Paddle's static ShardingConfig; ZeRO `stage` lives here.
        "sharding_segment_strategy": "segment_broadcast_MB", "segment_broadcast_MB": 32.0,
        "segment_anchors": ListOf(str), "sharding_degree": 8, "mp_degree": 1, "dp_degree": 1,
        "hybrid_dp": False, "gradient_merge_acc_step": 1, "optimize_offload": False,
        "pp_allreduce_in_optimize": False, "pp_degree": 1, "optimize_cast": False,
        "_dp_as_optimizer_sharding": False, "stage": 1, "enable_tuning": False,
        "use_calc_stream": False,
    },
    "hybrid_configs": {
        "dp_degree": -1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1, "sep_degree": 1,
        "cp_degree": 1, "ep_degree": 1, "moe_sharding_degree": 1, "cp_sharding_degree": 1,
        "order": ListOf(str, PADDLE_ORDER),
        "mp_configs": {
            "sync_param": True, "sync_grad": False, "sync_moment": False,
            "sync_mode": "broadcast", "mp_async_allreduce": False, "mp_skip_c_identity": False,
            "mp_fused_linear_param_grad_add": False, "need_broadcast_data": True,
            "recompute_allgather": False, "sp_async_reduce_scatter": False,
            "sync_param_name": ListOf(str, ("embedding", "layer_norm", ".b_")),
            **_nccl("nccl_config"),
        },
        "pp_configs": {
            "dp_comm_overlap": False, "delay_scale_loss": False, "enable_timer": False,
            "sharding_comm_overlap": False, "profiling": False, "release_gradients": False,
            "overlap_p2p_comm": False, "clear_every_step_cache": False,
            "use_batch_p2p_comm": True, "best_unbalanced_scheduler": False,
            "enable_offload_queue": False, "enable_dynamic_shape": False,
            "use_dualpipev": False, "forward_backward_overlap_scheduler": False,
            **_nccl("coll_nccl_config", "p2p_nccl_config", "shared_nccl_config"),
            "sync_param": False, "sync_moment": False, "sync_mode": "broadcast",
        },
        "sharding_configs": {  # Paddle's DygraphShardingConfig.
            "tensor_fusion": False, "accumulate_steps": 1, "comm_overlap": False,
            "split_param": False, "fuse_optimizer": True, "use_reduce_avg": True,
            "comm_buffer_size_MB": 256, "release_gradients": False, "free_grads_in_comm": False,
            "enable_fuse_optimizer_states": False,
            **_nccl("nccl_config", "check_nccl_config"), "offload_opt_buffer_size": -1,
        },
        "enable_optimizer_timer": False, "split_norm_comm": False,
        "dp_configs": _nccl("nccl_config", "check_nccl_config"),
        "sep_configs": _nccl("nccl_config"), "dp_sep_configs": _nccl("nccl_config"),
        "pp_tp_configs": _nccl("nccl_config"),
        "ep_configs": _nccl("nccl_config", "grad_nccl_config"),
        "moe_sharding_configs": _nccl("nccl_config", "check_nccl_config"),
        "default_comm_group_configs": _nccl("nccl_config"), "cp_configs": _nccl("nccl_config"),
        "cp_sharding_configs": _nccl("nccl_config"), "dp_cp_configs": _nccl("nccl_config"),
        "cp_mp_configs": _nccl("nccl_config"),
    },
    "a_sync_configs": {  # parameter server only: kept as data
        "k_steps": -1, "max_merge_var_num": 1, "send_queue_size": 16,
        "independent_recv_thread": False, "min_send_grad_num_before_recv": 1,
        "thread_pool_size": 1, "send_wait_times": 1, "runtime_split_send_recv": False,
        "launch_barrier": True, "heter_worker_device_guard": "cpu", "lr_decay_steps": 10,
        "use_ps_gpu": 0, "use_gpu_graph": 0,
    },
    "trainer_desc_configs": {
        "dump_fields_path": "", "dump_fields": ListOf(str), "dump_param": ListOf(str),
        "stat_var_names": ListOf(str), "trainer": "", "device_worker": "",
        "local_sparse": ListOf(str), "remote_sparse": ListOf(str),
    },
    "fs_client_param": {"uri": "", "user": "", "passwd": "", "hadoop_bin": ""},
    "qat_configs": {
        "channel_wise_abs_max": True, "weight_bits": 8, "activation_bits": 8,
        "not_quant_pattern": ListOf(str), "algo": "",
    },
    "build_strategy": {  # Paddle takes a static BuildStrategy object; jfleet a dict.
        "fuse_elewise_add_act_ops": False, "fuse_bn_act_ops": False,
        "fuse_relu_depthwise_conv": False, "fuse_broadcast_ops": False,
        "fuse_all_optimizer_ops": False, "enable_inplace": False,
        "enable_backward_optimizer_op_deps": True, "cache_runtime_context": False,
        "fuse_bn_add_act_ops": True, "enable_auto_fusion": False, "enable_addto": False,
        "allow_cuda_graph_capture": False, "reduce_strategy": 0, "fuse_gemm_epilogue": False,
        "debug_graphviz_path": "", "fused_attention": False, "fused_feedforward": False,
        "fuse_dot_product_attention": False, "fuse_resunit": False,
    },
    "gradient_scale_configs": {"scale_strategy": "avg", "scale_gradient": False},
}  # fmt: skip

# Paddle attribute names that read or write another place in the schema.
ALIASES: dict[str, tuple[str, ...]] = {
    "hybrid_parallel_order": ("hybrid_configs", "order"),
    "sync_param_name": ("hybrid_configs", "mp_configs", "sync_param_name"),
    "is_with_coordinator": ("with_coordinator",),
    "_fuse_grad_size_in_TFLOPS": ("fuse_grad_size_in_TFLOPS",),
    "_calc_comm_same_stream": ("calc_comm_same_stream",),
}
NOT_MODELLED = ("sparse_table_configs", "fleet_desc_configs", "execution_strategy", "mode")

Rule = tuple[Callable[[Any], bool], str | Callable[[Any], str]]


def _nccl_sections(schema: dict, path: str = "") -> list[str]:
    out = []
    for key, spec in schema.items():
        sub = f"{path}.{key}" if path else key
        if spec == _NCCL:
            out.append(sub)
        elif isinstance(spec, dict):
            out.extend(_nccl_sections(spec, sub))
    return out


NCCL_SECTIONS = _nccl_sections(SCHEMA)
"""Dotted paths of every ``NCCLConfig`` section (communicator tuning, kept as data)."""

_NCCL_WHY = "NCCL communicator tuning; XLA creates and tunes its own collectives"
_TIMER_WHY = "Paddle's host timers; profile with jax.profiler instead"
_STATIC_WHY = "a static-graph pass; jit compiles the whole step"
_STATIC_SHARDING_WHY = (
    "Paddle's static-graph sharding pass; the degrees are hybrid_configs', the ZeRO stage is "
    "sharding_configs['stage']"
)
_REPLICA_WHY = "SPMD replicas run one program on one global array, so they cannot drift"
SPMD_NOOP_SETTINGS: dict[str, str] = {
    "sync_nccl_allreduce": "XLA orders collectives itself; there is no NCCL stream to sync",
    "nccl_comm_num": "XLA manages communicators; there are no NCCL rings to count",
    "use_hierarchical_allreduce": "XLA picks the all-reduce algorithm",
    "hierarchical_allreduce_inter_nranks": "XLA picks the all-reduce algorithm",
    "fuse_all_reduce_ops": "XLA fuses and combines gradient all-reduces itself",
    "fuse_grad_size_in_MB": "XLA sizes its own all-reduce buckets",
    "fuse_grad_size_in_TFLOPS": "XLA sizes its own all-reduce buckets",
    "fuse_grad_size_in_num": "XLA sizes its own all-reduce buckets",
    "last_comm_group_size_MB": "XLA sizes its own all-reduce buckets",
    "fuse_grad_merge": "XLA fuses the gradient-merge buffers",
    "calc_comm_same_stream": "XLA schedules compute and communication",
    "find_unused_parameters": "jax.grad returns zeros for unused parameters; no hook waits",
    "cudnn_exhaustive_search": "XLA autotunes its kernels",
    "conv_workspace_size_limit": "XLA autotunes its kernels",
    "cudnn_batchnorm_spatial_persistent": "XLA autotunes its kernels",
    "without_graph_optimization": "XLA always compiles the whole step",
    "build_strategy": "static-graph fusion passes; XLA does its own fusion",
    "pipeline_configs.p2p_cache_shape": "shapes are static under jit",
    "pipeline_configs.enable_partial_send_recv": "XLA lowers stage transfers itself",
    "sharding_configs.sharding_segment_strategy": "XLA schedules the sharding collectives",
    "sharding_configs.segment_broadcast_MB": "XLA schedules the sharding collectives",
    "sharding_configs.segment_anchors": "XLA schedules the sharding collectives",
    "sharding_configs.use_calc_stream": "XLA schedules compute and communication",
    "hybrid_configs.mp_configs.sync_param": _REPLICA_WHY,
    "hybrid_configs.mp_configs.sync_grad": _REPLICA_WHY,
    "hybrid_configs.mp_configs.sync_moment": _REPLICA_WHY,
    "hybrid_configs.mp_configs.sync_mode": _REPLICA_WHY,
    "hybrid_configs.mp_configs.sync_param_name": _REPLICA_WHY,
    "hybrid_configs.mp_configs.need_broadcast_data": "one global batch is sharded, not broadcast",
    "hybrid_configs.mp_configs.mp_async_allreduce": "XLA overlaps collectives with matmuls",
    "hybrid_configs.mp_configs.mp_skip_c_identity": "XLA inserts the mp collectives",
    "hybrid_configs.mp_configs.mp_fused_linear_param_grad_add": "XLA fuses the weight grad add",
    "hybrid_configs.mp_configs.sp_async_reduce_scatter": "XLA overlaps collectives",
    "hybrid_configs.mp_configs.nccl_config": _NCCL_WHY,
    "hybrid_configs.pp_configs.use_batch_p2p_comm": "XLA lowers stage transfers itself",
    "hybrid_configs.pp_configs.overlap_p2p_comm": "XLA schedules stage transfers",
    "hybrid_configs.pp_configs.dp_comm_overlap": "XLA overlaps the dp gradient reduction",
    "hybrid_configs.pp_configs.sharding_comm_overlap": "XLA overlaps the sharding collectives",
    "hybrid_configs.pp_configs.clear_every_step_cache": "there is no p2p meta cache under jit",
    "hybrid_configs.pp_configs.enable_dynamic_shape": "shapes are static under jit",
    "hybrid_configs.pp_configs.release_gradients": "XLA frees buffers itself",
    "hybrid_configs.pp_configs.sync_param": _REPLICA_WHY,
    "hybrid_configs.pp_configs.sync_moment": _REPLICA_WHY,
    "hybrid_configs.pp_configs.sync_mode": _REPLICA_WHY,
    "hybrid_configs.pp_configs.coll_nccl_config": _NCCL_WHY,
    "hybrid_configs.pp_configs.p2p_nccl_config": _NCCL_WHY,
    "hybrid_configs.pp_configs.shared_nccl_config": _NCCL_WHY,
    "hybrid_configs.sharding_configs.tensor_fusion": "XLA fuses the sharded buffers",
    "hybrid_configs.sharding_configs.comm_overlap": "XLA overlaps the sharding collectives",
    "hybrid_configs.sharding_configs.comm_buffer_size_MB": "XLA sizes its own buffers",
    "hybrid_configs.sharding_configs.split_param": "PartitionSpecs always split each array",
    "hybrid_configs.sharding_configs.fuse_optimizer": "XLA fuses the optimizer update",
    "hybrid_configs.sharding_configs.use_reduce_avg": "XLA picks how the reduction averages",
    "hybrid_configs.sharding_configs.release_gradients": "XLA frees buffers itself",
    "hybrid_configs.sharding_configs.free_grads_in_comm": "XLA frees buffers itself",
    "hybrid_configs.sharding_configs.enable_fuse_optimizer_states": "XLA lays out the states",
    "hybrid_configs.sharding_configs.nccl_config": _NCCL_WHY,
    "hybrid_configs.sharding_configs.check_nccl_config": _NCCL_WHY,
    "hybrid_configs.split_norm_comm": "XLA inserts the norm all-reduces",
    "hybrid_configs.enable_optimizer_timer": _TIMER_WHY,
    "hybrid_configs.mp_configs.recompute_allgather": "XLA decides what to rematerialise",
    "hybrid_configs.pp_configs.delay_scale_loss": (
        "the compiled step averages the micro-batch gradients once; where the division "
        "happens changes only rounding"
    ),
    "hybrid_configs.pp_configs.enable_timer": _TIMER_WHY,
    "hybrid_configs.pp_configs.profiling": _TIMER_WHY,
    "hybrid_configs.pp_configs.best_unbalanced_scheduler": "XLA schedules the stages' work",
    "hybrid_configs.pp_configs.enable_offload_queue": "XLA places activations itself",
    "hybrid_configs.pp_configs.use_dualpipev": (
        "DualPipeV only reorders work; pipeline_configs['schedule_mode'] picks the schedule "
        "and the result is the same"
    ),
    "hybrid_configs.pp_configs.forward_backward_overlap_scheduler": "XLA overlaps the passes",
    "hybrid_configs.sharding_configs.offload_opt_buffer_size": "XLA places the optimizer states",
    "recompute_configs.enable_tuning": _STATIC_WHY,
    "recompute_configs.checkpoint_shape": "shapes are static under jit",
    "amp_configs.custom_black_varnames": "there are no program variables to name under jit",
    "amp_configs.use_fp16_guard": "there is no fp16_guard scope under jit; the dtype is per layer",
    "tensor_parallel_configs.tensor_parallel_degree": (
        "static-graph tensor parallelism; the degree is hybrid_configs['mp_degree']"
    ),
    **{
        f"sharding_configs.{name}": _STATIC_SHARDING_WHY
        for name in (
            "sharding_degree", "mp_degree", "dp_degree", "pp_degree", "hybrid_dp",
            "gradient_merge_acc_step", "optimize_offload", "pp_allreduce_in_optimize",
            "optimize_cast", "enable_tuning",
        )
    },
    "gradient_scale_configs.scale_gradient": "the mean loss already scales the gradients",
    **{
        f"hybrid_configs.{name}": _NCCL_WHY
        for name in (
            "dp_configs", "sep_configs", "dp_sep_configs", "pp_tp_configs", "ep_configs",
            "moe_sharding_configs", "default_comm_group_configs", "cp_configs",
            "cp_sharding_configs", "dp_cp_configs", "cp_mp_configs",
        )
    },
}  # fmt: skip

CP = "cp"
"""Paddle 3.x's context-parallel axis name in ``order``; jfleet has no such mesh axis."""
_REQUIRED_AXES = tuple(a for a in DEFAULT_ORDER if a not in (SEP, EP))


def order_problem(order: list[str]) -> str | None:
    """Why ``order`` is not a hybrid order Paddle accepts, or ``None`` if it is one."""
    unknown = [a for a in order if a not in (*DEFAULT_ORDER, *ORDER_DROPPED)]
    if unknown:
        return f"{unknown[0]!r} is not an axis"
    twice = sorted({a for a in order if order.count(a) > 1})
    if twice:
        return f"{twice[0]!r} is listed twice"
    missing = [a for a in _REQUIRED_AXES if a not in order]
    if missing:
        return f"it lacks {', '.join(map(repr, missing))}"
    return None


def complete_order(order: list[str]) -> list[str]:
    """The order a Paddle order stands for (outermost first), as jfleet stores it.

    Paddle's ``fleet.init`` builds its topology from the axes ``order`` names, in that
    order (its completeness check never fires: it compares two ``list.sort()`` results,
    both ``None``). Orders written for Paddles without the sep axis have four, without
    ``sep`` (PaddleNLP's trainer still falls back to ``["dp", "pp", "sharding", "mp"]`` when
    ``HybridCommunicateGroup`` has no ``get_sep_parallel_world_size``); Paddle 3.x's
    default has six, with ``cp`` between ``sep`` and ``mp``, and its MoE orders eight
    (``["sharding", "moe_sharding", "pp", "sep", "cp", "dp", "ep", "mp"]``). So: a missing
    ``sep`` is put just outside ``mp`` (where Paddle's default and PaddleNLP's five-axis
    orders have it; with ``sep_degree`` 1, as an order without ``sep`` needs in Paddle, its
    place changes no rank; with a larger ``sep_degree`` Paddle's topology would not match
    the device count, jfleet's puts ``sep`` there), and ``cp`` and ``moe_sharding`` are
    dropped (their degrees must be 1: jfleet has no context-parallel axis, and no ZeRO
    group for expert weights alone). ``ep`` stays where it is named; an order without it
    (Paddle's default) is stored as it is, and the mesh puts ``ep`` just outside ``mp``.

    Example:
      >>> complete_order(["dp", "pp", "sharding", "mp"])
      ['dp', 'pp', 'sharding', 'sep', 'mp']
      >>> complete_order(["dp", "pp", "sharding", "sep", "cp", "mp"])
      ['dp', 'pp', 'sharding', 'sep', 'mp']
      >>> complete_order(["sharding", "moe_sharding", "pp", "sep", "cp", "dp", "ep", "mp"])
      ['sharding', 'pp', 'sep', 'dp', 'ep', 'mp']
    """
    out = [a for a in order if a not in ORDER_DROPPED]
    if SEP not in out:
        out.insert(out.index(MP), SEP)
    return out


def _order_expected(order: Any) -> str:
    known = [a for a in dict.fromkeys(order) if a in (*DEFAULT_ORDER, *ORDER_DROPPED)]
    missing = [a for a in _REQUIRED_AXES if a not in known]
    fix = list(PADDLE_ORDER) if missing else complete_order(known)
    dropped = " and ".join(repr(a) for a in ORDER_DROPPED)
    return (
        f"a permutation of {list(PADDLE_ORDER)}, outermost first ({order_problem(order)}); "
        f"'{SEP}' may be left out (Paddle's four-axis order), '{EP}' may be added (without "
        f"it, it goes just outside '{MP}') and {dropped} may appear (dropped), e.g. {fix}"
    )


def _not_available(what: str) -> Rule:
    return (lambda v: v == 1), f"1, because {what} is not available in jfleet yet (no mesh axis)"


_GE0, _GE1 = ((lambda v: v >= 0), ">= 0"), ((lambda v: v >= 1), ">= 1")
_GT0, _GE_M1 = ((lambda v: v > 0), "> 0"), ((lambda v: v >= -1), "-1 (unset) or >= 0")
_SHAPE = ((lambda v: all(d == -1 or d >= 1 for d in v)), "dims >= 1 (or -1 for any size)")
_SCHEDULES = ("1F1B", "FThenB", "F-then-B", "VPP", "Eager1F1B", "ZBH1", "ZBVPP")
_SYNC_MODES = ((lambda v: v in ("broadcast", "average")), "'broadcast' or 'average'")
_NCCL_RULES = {name: _GE0 for name, default in _NCCL.items() if isinstance(default, int)}
# Value checks by dotted path (list items of dict lists drop their index): (predicate, what
# is expected: a str, or a function of the bad value giving one).
RULES: dict[str, Rule] = {
    "nccl_comm_num": _GE1, "hierarchical_allreduce_inter_nranks": _GE1,
    "fuse_grad_size_in_MB": _GT0, "fuse_grad_size_in_num": _GE1,
    "fuse_grad_size_in_TFLOPS": _GT0, "conv_workspace_size_limit": _GT0,
    "last_comm_group_size_MB": _GT0,  # Paddle's setter: ValueError unless > 0
    "nonfinite": (
        (lambda v: v in NONFINITE_MODES),
        "one of 'warn' (log once, keep the update), 'skip' (drop the update) or 'raise' "
        "(drop it and raise NonFiniteError)",
    ),
    "recompute_configs.checkpoint_shape": _SHAPE,
    "recompute_configs.refined_ops_patterns.num": _GE_M1,
    "amp_configs.dtype": ((lambda v: v in ("float16", "bfloat16")), "'float16' or 'bfloat16'"),
    "amp_configs.init_loss_scaling": _GT0, "amp_configs.incr_every_n_steps": _GE1,
    "amp_configs.decr_every_n_nan_or_inf": _GE1,
    "amp_configs.incr_ratio": ((lambda v: v > 1.0), "> 1.0 (it grows the loss scale)"),
    "amp_configs.decr_ratio": ((lambda v: 0.0 < v < 1.0), "in (0, 1) (it shrinks the scale)"),
    "gradient_merge_configs.k_steps": _GE1, "localsgd_configs.k_steps": _GE1,
    "localsgd_configs.begin_step": _GE0, "adaptive_localsgd_configs.init_k_steps": _GE1,
    "adaptive_localsgd_configs.begin_step": _GE0, "dgc_configs.rampup_begin_step": _GE0,
    "dgc_configs.rampup_step": _GE1,
    "dgc_configs.sparsity": ((lambda v: all(0.0 <= s < 1.0 for s in v)), "values in [0, 1)"),
    "lars_configs.lars_coeff": _GT0, "lars_configs.lars_weight_decay": _GE0,
    "lars_configs.epsilon": _GE0, "lamb_configs.lamb_weight_decay": _GE0,
    "pipeline_configs.micro_batch_size": _GE1, "pipeline_configs.accumulate_steps": _GE1,
    "pipeline_configs.schedule_mode": ((lambda v: v in _SCHEDULES), f"one of {list(_SCHEDULES)}"),
    "tensor_parallel_configs.tensor_parallel_degree": _GE1,
    "tensor_parallel_configs.tensor_init_seed": _GE_M1,
    "sharding_configs.stage": ((lambda v: v in (1, 2, 3)), "1, 2 or 3 (the ZeRO stage)"),
    "sharding_configs.sharding_degree": _GE1, "sharding_configs.dp_degree": _GE1,
    "sharding_configs.mp_degree": _GE1, "sharding_configs.pp_degree": _GE1,
    "sharding_configs.gradient_merge_acc_step": _GE1, "sharding_configs.segment_broadcast_MB": _GT0,
    "sharding_configs.sharding_segment_strategy": (
        (lambda v: v in ("segment_broadcast_MB", "segment_anchors")),
        "'segment_broadcast_MB' or 'segment_anchors'",
    ),
    "hybrid_configs.dp_degree": ((lambda v: v == -1 or v >= 1), "-1 (infer) or an int >= 1"),
    "hybrid_configs.mp_degree": _GE1, "hybrid_configs.pp_degree": _GE1,
    "hybrid_configs.sharding_degree": _GE1, "hybrid_configs.sep_degree": _GE1,
    "hybrid_configs.cp_degree": _not_available("context parallelism"),
    "hybrid_configs.ep_degree": _GE1,
    "hybrid_configs.moe_sharding_degree": (
        (lambda v: v == 1),
        "1: jfleet splits expert weights over the 'ep' axis (ep_degree) and keeps each expert "
        "shard replicated over the other data axes; ZeRO over the expert weights alone "
        "(Paddle's moe_sharding group) is not built, so give its ranks to dp_degree (or to "
        "sharding_degree, which shards the dense parameters)",
    ),
    "hybrid_configs.cp_sharding_degree": _not_available("context-parallel sharding"),
    "hybrid_configs.order": ((lambda v: order_problem(v) is None), _order_expected),
    "hybrid_configs.mp_configs.sync_mode": _SYNC_MODES,
    "hybrid_configs.pp_configs.sync_mode": _SYNC_MODES,
    "hybrid_configs.sharding_configs.accumulate_steps": _GE1,
    "hybrid_configs.sharding_configs.comm_buffer_size_MB": _GT0,
    "hybrid_configs.sharding_configs.offload_opt_buffer_size": _GE_M1,
    "a_sync_configs.k_steps": _GE_M1, "a_sync_configs.max_merge_var_num": _GE1,
    "a_sync_configs.send_queue_size": _GE1, "a_sync_configs.min_send_grad_num_before_recv": _GE1,
    "a_sync_configs.thread_pool_size": _GE1, "a_sync_configs.send_wait_times": _GE1,
    "a_sync_configs.lr_decay_steps": _GE1, "a_sync_configs.use_ps_gpu": _GE0,
    "a_sync_configs.use_gpu_graph": _GE0,
    "build_strategy.reduce_strategy": (
        (lambda v: v in (0, 1)), "0 (AllReduce) or 1 (Reduce), Paddle's ReduceStrategy"
    ),
    "gradient_scale_configs.scale_strategy": (
        (lambda v: v == "avg"),
        "'avg': jfleet's loss is the mean over the global batch, so gradients are averaged "
        "(for Paddle's 'sum', multiply your loss by the data-parallel world size)",
    ),
    "qat_configs.weight_bits": _GE1, "qat_configs.activation_bits": _GE1,
    **{f"{path}.{name}": rule for path in NCCL_SECTIONS for name, rule in _NCCL_RULES.items()},
}  # fmt: skip
NORMALIZE: dict[str, Callable[[Any], Any]] = {
    "pipeline_configs.schedule_mode": lambda v: "FThenB" if v == "F-then-B" else v,
    "hybrid_configs.order": complete_order,
}


def rule_path(path: str) -> str:
    """The ``RULES`` key of a dotted ``path``: items of a list of sections drop ``[i]``."""
    return re.sub(r"\[\d+\]\.", ".", path)

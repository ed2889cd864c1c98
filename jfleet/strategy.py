"""``DistributedStrategy``: every switch and ``*_configs`` section of Paddle Fleet's strategy.

Names and defaults are those of Paddle 3.3's ``distributed_strategy.proto``, plus the two
settings Paddle keeps outside the proto (``hybrid_configs['order']``, alias
``hybrid_parallel_order``, and ``hybrid_configs['mp_configs']['sync_param_name']``) and one
jfleet key, ``amp_configs['dtype']`` (the O1 compute dtype, ``"float16"`` or
``"bfloat16"``; O2 comes from ``use_pure_fp16`` / ``use_pure_bf16`` as in Paddle). The
whole schema is the one dict ``_SCHEMA``; a setting's type is its default's type.

Semantics, and where they differ from Paddle on purpose:

- ``strategy.amp = True`` sets a switch; a wrong type is a ``TypeError``.
- ``strategy.amp_configs = {...}`` MERGES into the current values, nested sections too
  (``hybrid_configs={'mp_configs': {...}}``). A list value replaces the old list (Paddle
  appends to it, so assigning a section twice duplicated entries).
- Getting a section returns a copy (a :class:`ConfigDict`, whose keys also read as
  attributes: ``strategy.hybrid_configs['pp_configs'].use_dualpipev``).
- An unknown setting is a :class:`StrategyKeyError` (``TypeError`` as in Paddle, and
  ``AttributeError``); an unknown key inside a section is a :class:`ConfigKeyError`
  (``KeyError`` and ``ValueError``); a value out of range is a ``ValueError``. All name
  the culprit and list what is valid.
- ``hybrid_configs['order']`` is validated (Paddle's check never fires) and survives
  ``save_to_prototxt`` / ``load_from_prototxt`` (Paddle loses it).
- Paddle's ``a_sync`` setter also resets ``a_sync_configs['k_steps']`` to 0; jfleet keeps
  parameter-server settings as plain data and does not.
"""

from __future__ import annotations

import copy
import difflib
import numbers
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from jfleet import _prototxt
from jfleet.topology import DEFAULT_ORDER

__all__ = [
    "SPMD_NOOP_SETTINGS",
    "ConfigDict",
    "ConfigKeyError",
    "DistributedStrategy",
    "StrategyKeyError",
]


class StrategyKeyError(TypeError, AttributeError):
    """An unknown ``DistributedStrategy`` setting (Paddle raises ``TypeError``)."""


class ConfigKeyError(KeyError, ValueError):
    """An unknown key inside a ``*_configs`` section."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class _ListOf:
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
_SCHEMA: dict[str, Any] = {
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
    "recompute_configs": {
        "checkpoints": _ListOf(str), "enable_offload": False, "checkpoint_shape": _ListOf(int),
        "enable_tuning": False,
        "refined_ops_patterns": _ListOf({
            "main_ops": _ListOf(str), "num": 0, "pre_ops": _ListOf(str), "suf_ops": _ListOf(str),
        }),
    },
    "amp_configs": {
        "init_loss_scaling": 32768.0, "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0, "decr_ratio": 0.8, "use_dynamic_loss_scaling": True,
        "custom_white_list": _ListOf(str), "custom_black_list": _ListOf(str),
        "custom_black_varnames": _ListOf(str), "use_pure_fp16": False, "use_fp16_guard": True,
        "use_optimizer_fp16": False, "use_pure_bf16": False,
        "dtype": "float16",  # jfleet key: the O1 compute dtype ("float16" or "bfloat16")
    },
    "localsgd_configs": {"k_steps": 1, "begin_step": 1},
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1},
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    "dgc_configs": {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": _ListOf(float)},
    "lars_configs": {
        "lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0.0,
        "exclude_from_weight_decay": _ListOf(str),
    },
    "lamb_configs": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": _ListOf(str)},
    "pipeline_configs": {
        "micro_batch_size": 1, "accumulate_steps": 1, "schedule_mode": "1F1B",
        "p2p_cache_shape": True, "enable_partial_send_recv": True,
    },
    "tensor_parallel_configs": {"tensor_parallel_degree": 1, "tensor_init_seed": -1},
    "sharding_configs": {  # Paddle's static ShardingConfig; ZeRO `stage` lives here.
        "sharding_segment_strategy": "segment_broadcast_MB", "segment_broadcast_MB": 32.0,
        "segment_anchors": _ListOf(str), "sharding_degree": 8, "mp_degree": 1, "dp_degree": 1,
        "hybrid_dp": False, "gradient_merge_acc_step": 1, "optimize_offload": False,
        "pp_allreduce_in_optimize": False, "pp_degree": 1, "optimize_cast": False,
        "_dp_as_optimizer_sharding": False, "stage": 1, "enable_tuning": False,
        "use_calc_stream": False,
    },
    "hybrid_configs": {
        "dp_degree": -1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1, "sep_degree": 1,
        "cp_degree": 1, "ep_degree": 1, "moe_sharding_degree": 1, "cp_sharding_degree": 1,
        "order": _ListOf(str, DEFAULT_ORDER),
        "mp_configs": {
            "sync_param": True, "sync_grad": False, "sync_moment": False,
            "sync_mode": "broadcast", "mp_async_allreduce": False, "mp_skip_c_identity": False,
            "mp_fused_linear_param_grad_add": False, "need_broadcast_data": True,
            "recompute_allgather": False, "sp_async_reduce_scatter": False,
            "sync_param_name": _ListOf(str, ("embedding", "layer_norm", ".b_")),
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
        "dump_fields_path": "", "dump_fields": _ListOf(str), "dump_param": _ListOf(str),
        "stat_var_names": _ListOf(str), "trainer": "", "device_worker": "",
        "local_sparse": _ListOf(str), "remote_sparse": _ListOf(str),
    },
    "fs_client_param": {"uri": "", "user": "", "passwd": "", "hadoop_bin": ""},
    "qat_configs": {
        "channel_wise_abs_max": True, "weight_bits": 8, "activation_bits": 8,
        "not_quant_pattern": _ListOf(str), "algo": "",
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
_ALIASES: dict[str, tuple[str, ...]] = {
    "hybrid_parallel_order": ("hybrid_configs", "order"),
    "sync_param_name": ("hybrid_configs", "mp_configs", "sync_param_name"),
    "is_with_coordinator": ("with_coordinator",),
    "_fuse_grad_size_in_TFLOPS": ("fuse_grad_size_in_TFLOPS",),
    "_calc_comm_same_stream": ("calc_comm_same_stream",),
}
_NOT_MODELLED = ("sparse_table_configs", "fleet_desc_configs", "execution_strategy", "mode")

_NCCL_WHY = "NCCL communicator tuning; XLA creates and tunes its own collectives"
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
    "sync_batch_norm": "batch statistics over the dp-sharded global batch are already global",
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
    **{
        f"hybrid_configs.{name}": _NCCL_WHY
        for name in (
            "dp_configs", "sep_configs", "dp_sep_configs", "pp_tp_configs", "ep_configs",
            "moe_sharding_configs", "default_comm_group_configs", "cp_configs",
            "cp_sharding_configs", "dp_cp_configs", "cp_mp_configs",
        )
    },
}  # fmt: skip


def _not_available(what: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v == 1), f"1, because {what} is not available in jfleet yet (no mesh axis)"


def _valid_order(v: list[str]) -> bool:
    return sorted(a for a in v if a != "cp") == sorted(DEFAULT_ORDER)


_GE0, _GE1 = ((lambda v: v >= 0), ">= 0"), ((lambda v: v >= 1), ">= 1")
_GT0 = ((lambda v: v > 0), "> 0")
_SCHEDULES = ("1F1B", "FThenB", "F-then-B", "VPP", "Eager1F1B", "ZBH1", "ZBVPP")
_SYNC_MODES = ((lambda v: v in ("broadcast", "average")), "'broadcast' or 'average'")
# Value checks by dotted path: (predicate, what is expected).
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "nccl_comm_num": _GE1, "hierarchical_allreduce_inter_nranks": _GE1,
    "fuse_grad_size_in_MB": _GT0, "fuse_grad_size_in_num": _GE1,
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
    "tensor_parallel_configs.tensor_init_seed": ((lambda v: v >= -1), "-1 (unset) or >= 0"),
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
    "hybrid_configs.ep_degree": _not_available("expert parallelism"),
    "hybrid_configs.moe_sharding_degree": _not_available("MoE sharding"),
    "hybrid_configs.cp_sharding_degree": _not_available("context-parallel sharding"),
    "hybrid_configs.order": (
        _valid_order,
        f"a permutation of {list(DEFAULT_ORDER)}, outermost first ('cp' may appear and is dropped)",
    ),
    "hybrid_configs.mp_configs.sync_mode": _SYNC_MODES,
    "hybrid_configs.pp_configs.sync_mode": _SYNC_MODES,
    "hybrid_configs.sharding_configs.accumulate_steps": _GE1,
    "gradient_scale_configs.scale_strategy": (
        (lambda v: v in ("avg", "sum", "customized")), "'avg', 'sum' or 'customized'"
    ),
    "qat_configs.weight_bits": _GE1, "qat_configs.activation_bits": _GE1,
}  # fmt: skip
_NORMALIZE: dict[str, Callable[[Any], Any]] = {
    "pipeline_configs.schedule_mode": lambda v: "FThenB" if v == "F-then-B" else v,
    "hybrid_configs.order": lambda v: [a for a in v if a != "cp"],
}


def _defaults(spec: Any) -> Any:
    if isinstance(spec, dict):
        return {key: _defaults(sub) for key, sub in spec.items()}
    if isinstance(spec, _ListOf):
        return list(spec.default)
    return spec


def _suggest(name: object, valid: Any) -> str:
    close = difflib.get_close_matches(str(name), list(valid), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _expected(spec: Any) -> str:
    if isinstance(spec, bool):
        return "a bool (True or False)"
    return {int: "an int", float: "a float (an int is fine)", str: "a str"}[type(spec)]


def _coerce(path: str, spec: Any, value: Any) -> Any:
    """Type-checks ``value`` against the default ``spec``, value-checks it, normalises it."""
    got = f"got {value!r} of type {type(value).__name__}"
    if isinstance(spec, _ListOf):
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            raise TypeError(f"{path} expects a list of {spec.describe()}, {got}.")
        if isinstance(spec.item, dict):
            out = [_merged(spec.item, {}, v, f"{path}[{i}]") for i, v in enumerate(value)]
        else:
            out = [_coerce(f"{path}[{i}]", spec.item(), v) for i, v in enumerate(value)]
    elif isinstance(spec, bool):
        if not isinstance(value, bool):
            raise TypeError(f"{path} expects {_expected(spec)}, {got}.")
        out = value
    elif isinstance(spec, int):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{path} expects {_expected(spec)}, {got}.")
        out = int(value)
    elif isinstance(spec, float):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{path} expects {_expected(spec)}, {got}.")
        out = float(value)
    else:
        if not isinstance(value, str):
            raise TypeError(f"{path} expects {_expected(spec)}, {got}.")
        out = value
    rule = _RULES.get(path)
    if rule is not None and not rule[0](out):
        raise ValueError(f"{path}={value!r} is not valid; set it to {rule[1]}.")
    return _NORMALIZE.get(path, lambda v: v)(out)


def _merged(schema: dict, current: dict, update: Any, path: str) -> dict:
    """A copy of ``current`` (defaults filled in) with ``update`` merged in, all checked."""
    if not isinstance(update, Mapping):
        raise TypeError(
            f"{path or 'DistributedStrategy.from_dict'} expects a dict, got {update!r} of type "
            f"{type(update).__name__}; e.g. {{{next(iter(schema))!r}: ...}}."
        )
    out = {key: copy.deepcopy(current[key]) if key in current else _defaults(spec)
           for key, spec in schema.items()}  # fmt: skip
    for key, value in update.items():
        if key not in schema:
            if not path:
                raise StrategyKeyError(_unknown_setting(key))
            raise ConfigKeyError(
                f"{key!r} is not a key of {path}.{_suggest(key, schema)} "
                f"Valid keys: {', '.join(schema)}."
            )
        spec, sub = schema[key], _join(path, key)
        if isinstance(spec, dict):
            out[key] = _merged(spec, out[key], value, sub)
        else:
            out[key] = _coerce(sub, spec, value)
    return out


def _unknown_setting(name: object) -> str:
    if name in _NOT_MODELLED:
        return f"{name!r} is a Paddle setting that jfleet does not model (static graph / PS)."
    valid = [*_SCHEMA, *(alias for alias in _ALIASES if not alias.startswith("_"))]
    return (
        f"{name!r} is not a DistributedStrategy setting.{_suggest(name, valid)} "
        f"Valid settings: {', '.join(valid)}."
    )


def _diff(values: dict, defaults: dict) -> dict:
    out = {}
    for key, default in defaults.items():
        value = values[key]
        if value != default:
            out[key] = _diff(value, default) if isinstance(default, dict) else value
    return out


class ConfigDict(dict):
    """A copy of a ``*_configs`` section; keys also read as attributes (as Paddle's do).

    Writing to it changes nothing in the strategy; assign the section instead.
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"{name!r} is not a key of this section.{_suggest(name, self)} "
                f"Valid keys: {', '.join(self)}."
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        path = self.__dict__.get("_path", ())
        example: Any = {name: value}
        for key in reversed(path[1:]):
            example = {key: example}
        where = f"strategy.{path[0]} = {example!r}" if path else "assigning the section"
        raise TypeError(
            f"Setting .{name} on a section that a DistributedStrategy returned changes only a "
            f"copy. Assign the section instead: {where}."
        )


def _view(value: Any, path: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        out = ConfigDict({key: _view(sub, (*path, key)) for key, sub in value.items()})
        out.__dict__["_path"] = path
        return out
    if isinstance(value, list):
        return [_view(item, ()) for item in value]
    return value


def _from_entries(schema: dict, entries: list[_prototxt.Entry], path: str) -> dict:
    """Types and checks parsed text-format entries against ``schema``; errors name the line."""
    out: dict[str, Any] = {}
    first_line: dict[str, int] = {}
    for entry in entries:
        sub, spec = _join(path, entry.name), schema.get(entry.name)
        where = f"line {entry.line}: "
        if entry.name not in schema:
            where_key = f"in {path}" if path else "at the top level"
            raise ValueError(
                f"{where}unknown field {entry.name!r} {where_key}.{_suggest(entry.name, schema)} "
                f"Valid fields: {', '.join(schema)}."
            )
        is_list = isinstance(spec, _ListOf)
        if entry.name in first_line and not is_list:
            raise ValueError(
                f"{where}{sub} is set twice (first on line {first_line[entry.name]}); keep one."
            )
        first_line.setdefault(entry.name, entry.line)
        if isinstance(spec, dict) or (is_list and isinstance(spec.item, dict)):
            ok, form = entry.kind != "scalar", f"{entry.name} {{ ... }}"
        elif is_list:
            ok, form = entry.kind != "block", f"{entry.name}: [value, ...]"
        else:
            ok, form = entry.kind == "scalar", f"{entry.name}: value"
        if not ok or (isinstance(spec, dict) and entry.kind == "list"):
            raise ValueError(f"{where}{sub} has the wrong form; write it as `{form}`.")
        try:
            if isinstance(spec, dict):
                out[entry.name] = _from_entries(spec, entry.value, sub)
            elif is_list and entry.kind == "block":
                out.setdefault(entry.name, []).append(_from_entries(spec.item, entry.value, sub))
            elif is_list and isinstance(spec.item, dict):
                if entry.value:
                    raise ValueError(f"{sub} takes blocks `{entry.name} {{ ... }}`, not values.")
                out.setdefault(entry.name, [])
            elif is_list:
                items = entry.value if entry.kind == "list" else [entry.value]
                out.setdefault(entry.name, []).extend(_scalar(spec.item(), s) for s in items)
            else:
                out[entry.name] = _coerce(sub, spec, _scalar(spec, entry.value))
        except (TypeError, ValueError) as err:  # a nested error already names its line
            msg = str(err)
            raise ValueError(msg if msg.startswith("line ") else where + msg) from None
    for name, value in out.items():  # lists are checked whole, once all lines are read
        spec = schema[name]
        if isinstance(spec, _ListOf) and not isinstance(spec.item, dict):
            try:
                out[name] = _coerce(_join(path, name), spec, value)
            except ValueError as err:
                raise ValueError(f"line {first_line[name]}: {err}") from None
    return out


def _scalar(spec: Any, scalar: _prototxt.Scalar) -> Any:
    if isinstance(spec, bool):
        return _prototxt.to_bool(scalar)
    if isinstance(spec, int):
        return _prototxt.to_int(scalar)
    if isinstance(spec, float):
        return _prototxt.to_float(scalar)
    return _prototxt.to_str(scalar)


class DistributedStrategy:
    """Paddle Fleet's ``DistributedStrategy``: switches and ``*_configs`` sections.

    Every setting of Paddle 3.3 with Paddle's name and default. Switches are plain
    attributes; assigning a ``*_configs`` dict merges it into the current values (nested
    sections too) and getting one returns a copy. In SPMD only some settings act (the
    hybrid degrees and ``order``, AMP, gradient merge, recompute, sharding stage, pipeline
    micro-batching, LAMB/LARS...); :meth:`spmd_noop_settings` lists those set to no effect,
    and parameter-server settings (``a_sync`` ...) are kept as data only.

    The ZeRO stage is ``sharding_configs['stage']`` (1, 2 or 3), as in Paddle. The mesh
    axis order is ``hybrid_configs['order']`` (alias ``hybrid_parallel_order``).

    Raises:
      StrategyKeyError: an unknown setting, on get or set (a ``TypeError`` and an
        ``AttributeError``).
      ConfigKeyError: an unknown key in a section (a ``KeyError`` and a ``ValueError``).
      TypeError: a value of the wrong type (bool for switches, the default's type for
        config values; an int is fine where a float is expected, a bool never is a number).
      ValueError: a value out of range, e.g. ``sharding_configs={'stage': 4}``.

    Example:
      >>> strategy = DistributedStrategy()
      >>> strategy.amp = True
      >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> strategy.hybrid_configs["mp_degree"]
      4
      >>> strategy
      DistributedStrategy(amp=True, hybrid_configs={'dp_degree': 2, 'mp_degree': 4})
    """

    __slots__ = ("_values",)

    def __init__(self) -> None:
        object.__setattr__(self, "_values", _defaults(_SCHEMA))

    # ------------------------------------------------------------------ attributes
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_values":
            raise AttributeError(name)
        path = _ALIASES.get(name, (name,))
        if path[0] not in _SCHEMA:
            raise StrategyKeyError(_unknown_setting(name))
        value = self._values
        for key in path:
            value = value[key]
        return _view(value, path)

    def __setattr__(self, name: str, value: Any) -> None:
        path = _ALIASES.get(name, (name,))
        if path[0] not in _SCHEMA:
            raise StrategyKeyError(_unknown_setting(name))
        for key in reversed(path[1:]):
            value = {key: value}
        top = path[0]
        self._values[top] = _merged(_SCHEMA, self._values, {top: value}, "")[top]

    def __delattr__(self, name: str) -> None:
        raise TypeError(f"DistributedStrategy settings cannot be deleted ({name!r}); assign one.")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *_SCHEMA, *_ALIASES})

    # ------------------------------------------------------------------ value semantics
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistributedStrategy):
            return NotImplemented
        return self._values == other._values

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        diff = _diff(self._values, _defaults(_SCHEMA))
        return f"DistributedStrategy({', '.join(f'{k}={v!r}' for k, v in diff.items())})"

    def __copy__(self) -> DistributedStrategy:
        return self.from_dict(self._values)

    def __deepcopy__(self, memo: dict) -> DistributedStrategy:
        return self.from_dict(self._values)

    def __getstate__(self) -> dict[str, Any]:
        return self.to_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", _merged(_SCHEMA, _defaults(_SCHEMA), state, ""))

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of every setting, as plain nested dicts and lists."""
        return copy.deepcopy(self._values)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DistributedStrategy:
        """A strategy with ``values`` (any subset of :meth:`to_dict`'s keys) over the defaults.

        Raises:
          StrategyKeyError: an unknown top-level setting.
          ConfigKeyError: an unknown key in a section.
          TypeError: a value of the wrong type.
          ValueError: a value out of range.
        """
        strategy = cls()
        object.__setattr__(strategy, "_values", _merged(_SCHEMA, strategy._values, values, ""))
        return strategy

    # ------------------------------------------------------------------ SPMD
    def spmd_noop_settings(self) -> list[str]:
        """The settings set to a non-default value that mean nothing under SPMD.

        Returns:
          Dotted names, keys of :data:`SPMD_NOOP_SETTINGS`, in its order, e.g.
          ``["fuse_grad_size_in_MB", "hybrid_configs.mp_configs.sync_grad"]``.
        """
        defaults = _defaults(_SCHEMA)
        out = []
        for name in SPMD_NOOP_SETTINGS:
            value, default = self._values, defaults
            for key in name.split("."):
                value, default = value[key], default[key]
            if value != default:
                out.append(name)
        return out

    # ------------------------------------------------------------------ files
    def save_to_prototxt(self, output: str | os.PathLike, *, only_changed: bool = False) -> None:
        """Writes the settings to ``output`` in protobuf text format (no protobuf needed).

        Unlike Paddle's, the file keeps ``hybrid_configs { order: ... }`` and
        ``sync_param_name``, so :meth:`load_from_prototxt` restores an equal strategy.

        Args:
          output: the file to write.
          only_changed: write only the settings that differ from the defaults (a short
            file; loading it into a fresh strategy still gives an equal one). By default
            every setting is written, so loading it into any strategy restores this one.
        """
        values = _diff(self._values, _defaults(_SCHEMA)) if only_changed else self._values
        which = "the settings that differ from the defaults" if only_changed else "every setting"
        header = f"jfleet DistributedStrategy in protobuf text format: {which}."
        Path(output).write_text(_prototxt.dump(values, header), encoding="utf-8")

    def load_from_prototxt(self, pb_file: str | os.PathLike) -> None:
        """Merges the settings in text-format file ``pb_file`` into this strategy.

        Fields the file leaves out keep their current values (Paddle merges too); a file
        from :meth:`save_to_prototxt` sets every field. Nothing changes if the file is bad.

        Raises:
          ValueError: the file is malformed, or holds an unknown field or a bad value;
            the message names the file and the line.
        """
        text = Path(pb_file).read_text(encoding="utf-8")
        try:
            update = _from_entries(_SCHEMA, _prototxt.parse(text), "")
        except ValueError as err:
            raise ValueError(f"{os.fspath(pb_file)}: {err}") from None
        object.__setattr__(self, "_values", _merged(_SCHEMA, self._values, update, ""))

"""Tests for ``jfleet.strategy.DistributedStrategy``.

The expected defaults are literals copied from Paddle 3.3.1's
``distributed_strategy.proto`` (and ``distributed_strategy.py`` for ``order`` and
``sync_param_name``), not read back from jfleet.
"""

from __future__ import annotations

import copy
import doctest
import pickle

import numpy as np
import pytest

from jfleet.training import strategy as strategy_module
from jfleet.training.strategy import (
    SPMD_NOOP_SETTINGS,
    ConfigKeyError,
    DistributedStrategy,
    StrategyKeyError,
)

_NCCL = {
    "commName": "",
    "ll_buffsize": 0,
    "ll128_buffsize": 0,
    "simple_buffsize": 0,
    "buffsize_align": 0,
    "nchannels": 0,
    "algoStr": "",
    "protoStr": "",
}

PADDLE_SWITCHES = {
    "amp": False,
    "recompute": False,
    "localsgd": False,
    "dgc": False,
    "gradient_merge": False,
    "lars": False,
    "lamb": False,
    "pipeline": False,
    "elastic": False,
    "auto": False,
    "a_sync": True,
    "sync_nccl_allreduce": True,
    "nccl_comm_num": 1,
    "use_hierarchical_allreduce": False,
    "hierarchical_allreduce_inter_nranks": 1,
    "sync_batch_norm": False,
    "fuse_all_reduce_ops": True,
    "fuse_grad_size_in_MB": 32,
    "fuse_grad_size_in_TFLOPS": 50.0,
    "cudnn_exhaustive_search": False,
    "conv_workspace_size_limit": 512,
    "cudnn_batchnorm_spatial_persistent": False,
    "adaptive_localsgd": False,
    "fp16_allreduce": False,
    "sharding": False,
    "last_comm_group_size_MB": 1.0,
    "find_unused_parameters": False,
    "tensor_parallel": False,
    "without_graph_optimization": True,
    "fuse_grad_size_in_num": 8,
    "calc_comm_same_stream": False,
    "asp": False,
    "fuse_grad_merge": False,
    "semi_auto": False,
    "adam_d2sum": False,
    "auto_search": False,
    "heter_ccl_mode": False,
    "is_fl_ps_mode": False,
    "with_coordinator": False,
    "qat": False,
    "split_data": True,
}

PADDLE_SECTIONS = {
    "recompute_configs": {
        "checkpoints": [],
        "enable_offload": False,
        "checkpoint_shape": [],
        "enable_tuning": False,
        "refined_ops_patterns": [],
    },
    "amp_configs": {
        "init_loss_scaling": 32768.0,
        "incr_every_n_steps": 1000,
        "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0,
        "decr_ratio": 0.8,
        "use_dynamic_loss_scaling": True,
        "custom_white_list": [],
        "custom_black_list": [],
        "custom_black_varnames": [],
        "use_pure_fp16": False,
        "use_fp16_guard": True,
        "use_optimizer_fp16": False,
        "use_pure_bf16": False,
    },
    "localsgd_configs": {"k_steps": 1, "begin_step": 1},
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1},
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    "dgc_configs": {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": []},
    "lars_configs": {
        "lars_coeff": 0.001,
        "lars_weight_decay": 0.0005,
        "epsilon": 0.0,
        "exclude_from_weight_decay": [],
    },
    "lamb_configs": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": []},
    "pipeline_configs": {
        "micro_batch_size": 1,
        "accumulate_steps": 1,
        "schedule_mode": "1F1B",
        "p2p_cache_shape": True,
        "enable_partial_send_recv": True,
    },
    "tensor_parallel_configs": {"tensor_parallel_degree": 1, "tensor_init_seed": -1},
    "sharding_configs": {
        "sharding_segment_strategy": "segment_broadcast_MB",
        "segment_broadcast_MB": 32.0,
        "segment_anchors": [],
        "sharding_degree": 8,
        "mp_degree": 1,
        "dp_degree": 1,
        "hybrid_dp": False,
        "gradient_merge_acc_step": 1,
        "optimize_offload": False,
        "pp_allreduce_in_optimize": False,
        "pp_degree": 1,
        "optimize_cast": False,
        "_dp_as_optimizer_sharding": False,
        "stage": 1,
        "enable_tuning": False,
        "use_calc_stream": False,
    },
    "hybrid_configs": {
        "dp_degree": -1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sharding_degree": 1,
        "sep_degree": 1,
        "cp_degree": 1,
        "ep_degree": 1,
        "moe_sharding_degree": 1,
        "cp_sharding_degree": 1,
        "order": ["dp", "pp", "sharding", "sep", "mp"],
        "mp_configs": {
            "sync_param": True,
            "sync_grad": False,
            "sync_moment": False,
            "sync_mode": "broadcast",
            "mp_async_allreduce": False,
            "mp_skip_c_identity": False,
            "mp_fused_linear_param_grad_add": False,
            "need_broadcast_data": True,
            "recompute_allgather": False,
            "sp_async_reduce_scatter": False,
            "sync_param_name": ["embedding", "layer_norm", ".b_"],
            "nccl_config": _NCCL,
        },
        "pp_configs": {
            "dp_comm_overlap": False,
            "delay_scale_loss": False,
            "enable_timer": False,
            "sharding_comm_overlap": False,
            "profiling": False,
            "release_gradients": False,
            "overlap_p2p_comm": False,
            "clear_every_step_cache": False,
            "use_batch_p2p_comm": True,
            "best_unbalanced_scheduler": False,
            "enable_offload_queue": False,
            "enable_dynamic_shape": False,
            "use_dualpipev": False,
            "forward_backward_overlap_scheduler": False,
            "coll_nccl_config": _NCCL,
            "p2p_nccl_config": _NCCL,
            "shared_nccl_config": _NCCL,
            "sync_param": False,
            "sync_moment": False,
            "sync_mode": "broadcast",
        },
        "sharding_configs": {
            "tensor_fusion": False,
            "accumulate_steps": 1,
            "comm_overlap": False,
            "split_param": False,
            "fuse_optimizer": True,
            "use_reduce_avg": True,
            "comm_buffer_size_MB": 256,
            "release_gradients": False,
            "free_grads_in_comm": False,
            "enable_fuse_optimizer_states": False,
            "nccl_config": _NCCL,
            "check_nccl_config": _NCCL,
            "offload_opt_buffer_size": -1,
        },
        "enable_optimizer_timer": False,
        "split_norm_comm": False,
        "dp_configs": {"nccl_config": _NCCL, "check_nccl_config": _NCCL},
        "sep_configs": {"nccl_config": _NCCL},
        "dp_sep_configs": {"nccl_config": _NCCL},
        "pp_tp_configs": {"nccl_config": _NCCL},
        "ep_configs": {"nccl_config": _NCCL, "grad_nccl_config": _NCCL},
        "moe_sharding_configs": {"nccl_config": _NCCL, "check_nccl_config": _NCCL},
        "default_comm_group_configs": {"nccl_config": _NCCL},
        "cp_configs": {"nccl_config": _NCCL},
        "cp_sharding_configs": {"nccl_config": _NCCL},
        "dp_cp_configs": {"nccl_config": _NCCL},
        "cp_mp_configs": {"nccl_config": _NCCL},
    },
    "a_sync_configs": {
        "k_steps": -1,
        "max_merge_var_num": 1,
        "send_queue_size": 16,
        "independent_recv_thread": False,
        "min_send_grad_num_before_recv": 1,
        "thread_pool_size": 1,
        "send_wait_times": 1,
        "runtime_split_send_recv": False,
        "launch_barrier": True,
        "heter_worker_device_guard": "cpu",
        "lr_decay_steps": 10,
        "use_ps_gpu": 0,
        "use_gpu_graph": 0,
    },
    "trainer_desc_configs": {
        "dump_fields_path": "",
        "dump_fields": [],
        "dump_param": [],
        "stat_var_names": [],
        "trainer": "",
        "device_worker": "",
        "local_sparse": [],
        "remote_sparse": [],
    },
    "fs_client_param": {"uri": "", "user": "", "passwd": "", "hadoop_bin": ""},
    "qat_configs": {
        "channel_wise_abs_max": True,
        "weight_bits": 8,
        "activation_bits": 8,
        "not_quant_pattern": [],
        "algo": "",
    },
    "build_strategy": {
        "fuse_elewise_add_act_ops": False,
        "fuse_bn_act_ops": False,
        "fuse_relu_depthwise_conv": False,
        "fuse_broadcast_ops": False,
        "fuse_all_optimizer_ops": False,
        "enable_inplace": False,
        "enable_backward_optimizer_op_deps": True,
        "cache_runtime_context": False,
        "fuse_bn_add_act_ops": True,
        "enable_auto_fusion": False,
        "enable_addto": False,
        "allow_cuda_graph_capture": False,
        "reduce_strategy": 0,
        "fuse_gemm_epilogue": False,
        "debug_graphviz_path": "",
        "fused_attention": False,
        "fused_feedforward": False,
        "fuse_dot_product_attention": False,
        "fuse_resunit": False,
    },
    "gradient_scale_configs": {"scale_strategy": "avg", "scale_gradient": False},
}


def _non_default_strategy() -> DistributedStrategy:
    s = DistributedStrategy()
    s.amp = True
    s.recompute = True
    s.a_sync = False
    s.nccl_comm_num = 3
    s.fuse_grad_size_in_TFLOPS = 12.5
    s.amp_configs = {
        "init_loss_scaling": 1024.0,
        "decr_ratio": 0.5,
        "custom_white_list": ["matmul", 'quote"d'],
        "custom_black_list": ["exp"],
        "use_pure_bf16": True,
    }
    s.recompute_configs = {
        "checkpoints": ["layer_1", "layer_2"],
        "checkpoint_shape": [4, 8],
        "refined_ops_patterns": [{"main_ops": ["matmul"], "num": 2}, {"pre_ops": ["add"]}],
    }
    s.hybrid_configs = {
        "dp_degree": 2,
        "mp_degree": 2,
        "pp_degree": 2,
        "order": ["mp", "dp", "pp", "sharding", "sep"],
        "mp_configs": {"sync_grad": True, "sync_mode": "average", "sync_param_name": []},
        "pp_configs": {"use_dualpipev": True},
        "sharding_configs": {"comm_buffer_size_MB": 64},
        "dp_configs": {"nccl_config": {"commName": "dp", "nchannels": 4}},
    }
    s.sharding_configs = {"stage": 3, "segment_anchors": ["a", "b"]}
    s.pipeline_configs = {"micro_batch_size": 4, "accumulate_steps": 8, "schedule_mode": "FThenB"}
    s.dgc_configs = {"sparsity": [0.75, 0.999]}
    s.lars_configs = {"epsilon": 1e-8, "exclude_from_weight_decay": ["bias"]}
    s.gradient_merge_configs = {"k_steps": 4, "avg": False}
    s.a_sync_configs = {"k_steps": 10, "heter_worker_device_guard": "gpu"}
    s.fs_client_param = {"uri": "hdfs://x", "passwd": "p\\w\n"}
    return s


# --------------------------------------------------------------------------- defaults
# Keys jfleet adds to Paddle's sections (not Paddle's).
JFLEET_EXTRA = {"amp_configs": {"dtype": "float16"}}


def _expected_defaults() -> dict:
    expected = copy.deepcopy({**PADDLE_SWITCHES, **PADDLE_SECTIONS})
    for section, extra in JFLEET_EXTRA.items():
        expected[section].update(extra)
    expected["nonfinite"] = "warn"  # jfleet's non-finite guard (not in Paddle)
    return expected


def test_every_default_matches_paddle():
    assert DistributedStrategy().to_dict() == _expected_defaults()


@pytest.mark.parametrize("name", sorted(PADDLE_SWITCHES))
def test_switch_default_and_type(name):
    value = getattr(DistributedStrategy(), name)
    assert value == PADDLE_SWITCHES[name]
    assert type(value) is type(PADDLE_SWITCHES[name])


@pytest.mark.parametrize("name", sorted(PADDLE_SECTIONS))
def test_section_default(name):
    section = getattr(DistributedStrategy(), name)
    extra = JFLEET_EXTRA.get(name, {})
    assert {k: v for k, v in section.items() if k not in extra} == PADDLE_SECTIONS[name]
    assert {k: section[k] for k in extra} == extra


def test_named_defaults_from_the_issue():
    s = DistributedStrategy()
    assert s.tensor_parallel_configs == {"tensor_parallel_degree": 1, "tensor_init_seed": -1}
    assert s.hybrid_configs["order"] == ["dp", "pp", "sharding", "sep", "mp"]
    assert s.hybrid_parallel_order == ["dp", "pp", "sharding", "sep", "mp"]
    assert s.sharding_configs["stage"] == 1
    assert s.sharding_configs["sharding_degree"] == 8
    assert s.gradient_scale_configs["scale_strategy"] == "avg"
    assert s.sync_param_name == ["embedding", "layer_norm", ".b_"]


# --------------------------------------------------------------------------- semantics
def test_switch_set_and_get():
    s = DistributedStrategy()
    s.amp = True
    s.fuse_grad_size_in_MB = 64
    s.fuse_grad_size_in_TFLOPS = 20  # an int is fine for a float
    assert s.amp is True
    assert s.fuse_grad_size_in_MB == 64
    assert s.fuse_grad_size_in_TFLOPS == 20.0
    assert isinstance(s.fuse_grad_size_in_TFLOPS, float)


def test_configs_merge_never_reset():
    s = DistributedStrategy()
    s.amp_configs = {"init_loss_scaling": 1024}
    s.amp_configs = {"incr_ratio": 4.0}
    cfg = s.amp_configs
    assert cfg["init_loss_scaling"] == 1024.0 and isinstance(cfg["init_loss_scaling"], float)
    assert cfg["incr_ratio"] == 4.0
    assert cfg["decr_ratio"] == 0.8


def test_nested_configs_merge():
    s = DistributedStrategy()
    s.hybrid_configs = {"mp_degree": 2, "mp_configs": {"sync_grad": True}}
    s.hybrid_configs = {"pp_degree": 2, "mp_configs": {"sync_moment": True}}
    h = s.hybrid_configs
    assert (h["mp_degree"], h["pp_degree"], h["dp_degree"]) == (2, 2, -1)
    assert h["mp_configs"]["sync_grad"] is True
    assert h["mp_configs"]["sync_moment"] is True
    assert h["mp_configs"]["sync_param"] is True
    assert h["mp_configs"]["sync_mode"] == "broadcast"


def test_list_value_replaces_the_old_list():
    s = DistributedStrategy()
    s.amp_configs = {"custom_white_list": ["a", "b"]}
    s.amp_configs = {"custom_white_list": ("c",)}
    assert s.amp_configs["custom_white_list"] == ["c"]


def test_section_and_list_writes_go_through():
    s = DistributedStrategy()
    h = s.hybrid_configs
    h["mp_degree"] = 8
    h["mp_configs"]["sync_grad"] = True
    assert s.hybrid_configs["mp_degree"] == 8 and h["mp_degree"] == 8
    assert s.hybrid_configs["mp_configs"]["sync_grad"] is True
    h["order"].reverse()
    assert s.hybrid_parallel_order == ["mp", "sep", "sharding", "pp", "dp"]
    wl = s.amp_configs["custom_white_list"]
    wl.append("x")
    wl += ["y"]
    assert s.amp_configs["custom_white_list"] == ["x", "y"] == wl
    order = s.hybrid_parallel_order
    with pytest.raises(ValueError, match="'zz' is not an axis"):
        order.append("zz")
    assert order == s.hybrid_parallel_order == ["mp", "sep", "sharding", "pp", "dp"]
    s.sync_param_name.clear()
    assert s.hybrid_configs["mp_configs"]["sync_param_name"] == []
    expected = DistributedStrategy()
    expected.hybrid_configs = {
        "mp_degree": 8,
        "mp_configs": {"sync_grad": True, "sync_param_name": []},
        "order": ["mp", "sep", "sharding", "pp", "dp"],
    }
    expected.amp_configs = {"custom_white_list": ["x", "y"]}
    assert s == expected
    assert type(copy.deepcopy(wl)) is list and type(pickle.loads(pickle.dumps(wl))) is list


def test_config_dict_attribute_read_and_write():
    s = DistributedStrategy()
    assert s.hybrid_configs["pp_configs"].use_batch_p2p_comm is True
    assert s.amp_configs.init_loss_scaling == 32768.0
    s.hybrid_configs["pp_configs"].use_dualpipev = True
    assert s.hybrid_configs["pp_configs"]["use_dualpipev"] is True
    with pytest.raises(AttributeError, match="use_dualpipv"):
        _ = s.hybrid_configs["pp_configs"].use_dualpipv


def test_failed_assignment_changes_nothing():
    s = DistributedStrategy()
    with pytest.raises(ValueError, match="pp_degree=0"):
        s.hybrid_configs = {"mp_degree": 2, "pp_degree": 0}
    with pytest.raises(ConfigKeyError):
        s.hybrid_configs = {"mp_configs": {"sync_grad": True, "bogus": 1}}
    assert s == DistributedStrategy()


def test_aliases_and_normalisation():
    s = DistributedStrategy()
    s.hybrid_configs = {"order": ["dp", "cp", "pp", "sharding", "sep", "mp"]}
    assert s.hybrid_configs["order"] == ["dp", "pp", "sharding", "sep", "mp"]
    s.hybrid_parallel_order = ["mp", "sep", "sharding", "pp", "dp"]
    assert s.hybrid_configs["order"] == ["mp", "sep", "sharding", "pp", "dp"]
    s.sync_param_name = ["embedding"]
    assert s.hybrid_configs["mp_configs"]["sync_param_name"] == ["embedding"]
    s.is_with_coordinator = True
    assert s.with_coordinator is True
    s.pipeline_configs = {"schedule_mode": "F-then-B"}
    assert s.pipeline_configs["schedule_mode"] == "FThenB"
    s.hybrid_configs = {"mp_degree": np.int64(2), "cp_degree": 1, "ep_degree": 1}
    assert s.hybrid_configs["mp_degree"] == 2 and type(s.hybrid_configs["mp_degree"]) is int


def test_parameter_server_settings_are_data():
    s = DistributedStrategy()
    s.a_sync = False
    s.a_sync_configs = {"k_steps": 100, "send_queue_size": 4}
    assert s.a_sync is False
    assert s.a_sync_configs["k_steps"] == 100


def test_equality_and_hash():
    a, b = DistributedStrategy(), DistributedStrategy()
    assert a == b
    b.amp = True
    assert a != b
    a.amp = True
    assert a == b
    a.hybrid_configs = {"mp_configs": {"sync_grad": True}}
    assert a != b
    assert a != {"amp": True}
    with pytest.raises(TypeError):
        hash(a)


def test_repr():
    s = DistributedStrategy()
    assert repr(s) == "DistributedStrategy()"
    s.amp = True
    s.hybrid_configs = {"mp_degree": 2}
    assert repr(s) == "DistributedStrategy(amp=True, hybrid_configs={'mp_degree': 2})"
    s.hybrid_configs = {"mp_configs": {"sync_grad": True}}
    assert repr(s) == (
        "DistributedStrategy(amp=True, "
        "hybrid_configs={'mp_degree': 2, 'mp_configs': {'sync_grad': True}})"
    )


def test_to_dict_is_a_deep_copy_and_from_dict_round_trips():
    s = _non_default_strategy()
    d = s.to_dict()
    d["hybrid_configs"]["mp_configs"]["sync_grad"] = False
    d["amp_configs"]["custom_white_list"].clear()
    assert s.hybrid_configs["mp_configs"]["sync_grad"] is True
    assert s.amp_configs["custom_white_list"] == ["matmul", 'quote"d']
    assert DistributedStrategy.from_dict(s.to_dict()) == s
    assert DistributedStrategy.from_dict({"amp": True}) == DistributedStrategy.from_dict(
        {"amp": True, "amp_configs": {}}
    )


def test_copy_and_pickle():
    s = _non_default_strategy()
    assert copy.copy(s) == s
    assert copy.deepcopy(s) == s
    assert pickle.loads(pickle.dumps(s)) == s
    c = copy.deepcopy(s)
    c.amp = False
    assert s.amp is True


def test_unknown_attribute_get_and_hasattr():
    s = DistributedStrategy()
    assert not hasattr(s, "ampp")
    with pytest.raises(StrategyKeyError, match=r"'ampp'.*Did you mean 'amp'"):
        _ = s.ampp
    with pytest.raises(TypeError, match="ampp"):  # Paddle raises TypeError on set
        s.ampp = True
    assert issubclass(StrategyKeyError, TypeError) and issubclass(StrategyKeyError, AttributeError)
    assert issubclass(ConfigKeyError, KeyError) and issubclass(ConfigKeyError, ValueError)
    assert "hybrid_configs" in dir(s)


def test_docstring_examples_run():
    assert doctest.testmod(strategy_module).failed == 0


# --------------------------------------------------------------------------- prototxt
def test_prototxt_round_trip_keeps_every_field(tmp_path):
    s = _non_default_strategy()
    path = tmp_path / "strategy.prototxt"
    s.save_to_prototxt(path)
    text = path.read_text()
    assert "amp: true" in text
    assert 'order: "mp"' in text
    assert "amp_configs {" in text and "init_loss_scaling: 1024.0" in text
    loaded = DistributedStrategy()
    loaded.load_from_prototxt(str(path))
    assert loaded == s
    assert loaded.hybrid_configs["order"] == ["mp", "dp", "pp", "sharding", "sep"]
    # A full file restores the saved strategy whatever the target held before.
    other = DistributedStrategy()
    other.lamb = True
    other.hybrid_configs = {"sep_degree": 2}
    other.load_from_prototxt(path)
    assert other == s


def test_prototxt_only_changed(tmp_path):
    s = _non_default_strategy()
    path = tmp_path / "short.prototxt"
    s.save_to_prototxt(path, only_changed=True)
    text = path.read_text()
    assert "lamb: false" not in text
    assert "sync_param_name: []" in text
    loaded = DistributedStrategy()
    loaded.load_from_prototxt(path)
    assert loaded == s
    DistributedStrategy().save_to_prototxt(path, only_changed=True)
    fresh = DistributedStrategy()
    fresh.load_from_prototxt(path)
    assert fresh == DistributedStrategy()


def test_load_paddle_style_text_merges(tmp_path):
    path = tmp_path / "paddle.prototxt"
    path.write_text(
        "# written by hand, Paddle style\n"
        "amp: true\n"
        "amp_configs {\n"
        "  init_loss_scaling: 1024\n"
        '  custom_white_list: "a"\n'
        "  custom_white_list: 'b'\n"
        "}\n"
        "hybrid_configs: { mp_degree: 2, mp_configs { sync_param: false } }\n"
        "dgc_configs { sparsity: [0.5, 0.9] }\n"
    )
    s = DistributedStrategy()
    s.lamb = True
    s.load_from_prototxt(path)
    assert s.lamb is True  # fields the file leaves out keep their values
    assert s.amp is True
    assert s.amp_configs["init_loss_scaling"] == 1024.0
    assert s.amp_configs["custom_white_list"] == ["a", "b"]
    assert s.hybrid_configs["mp_degree"] == 2
    assert s.hybrid_configs["mp_configs"]["sync_param"] is False
    assert s.dgc_configs["sparsity"] == [0.5, 0.9]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("amp: true\namp_configs {\n  incr_ratio: 2.0\n", r"line 2: .*never closed"),
        ("amp: true\n}\n", r"line 2: '\}' closes no open block"),
        ("amp: true\nampp: false\n", r"line 2: unknown field 'ampp'.*'amp'"),
        ("amp: yes\n", r"line 1: expected true or false, got 'yes'"),
        ("nccl_comm_num: 1.5\n", r"line 1: expected an integer, got '1.5'"),
        ("pipeline_configs {\n  schedule_mode: 1F1B\n}\n", r"line 2: expected a quoted string"),
        ("\n\nsharding_configs {\n  stage: 7\n}\n", r"line 4: sharding_configs\.stage=7"),
        ("amp: true\namp: false\n", r"line 2: amp is set twice \(first on line 1\)"),
        ("amp true\n", r"line 1: expected ':' or '\{' after 'amp'"),
        ('amp_configs {\n  custom_white_list: "ab\n}\n', r"line 2: a string .* never closed"),
        ("amp_configs: 3\n", r"line 1: amp_configs has the wrong form"),
        ('hybrid_configs {\n  order: "dp"\n  order: "mp"\n}\n', r"line 2: .*order="),
        ('amp_configs {\n  custom_white_list: ["a" "b"]\n}\n', r"line 2: list"),
        ("hybrid_configs {\n  mp_configs {\n    sync_grd: true\n  }\n}\n", r"line 3: .*sync_grd"),
    ],
)
def test_malformed_prototxt_names_the_line(tmp_path, text, match):
    path = tmp_path / "bad.prototxt"
    path.write_text(text)
    s = DistributedStrategy()
    with pytest.raises(ValueError, match=match) as info:
        s.load_from_prototxt(path)
    assert str(path) in str(info.value)
    assert s == DistributedStrategy()  # nothing applied


# --------------------------------------------------------------------------- SPMD
def test_spmd_noop_settings():
    s = DistributedStrategy()
    assert s.spmd_noop_settings() == []
    s.amp = True  # acts in SPMD: not listed
    s.fuse_grad_size_in_MB = 64
    s.nccl_comm_num = 2
    s.find_unused_parameters = True
    s.hybrid_configs = {
        "mp_degree": 2,
        "mp_configs": {"sync_grad": True, "sync_mode": "average"},
        "sharding_configs": {"comm_overlap": True},
        "dp_configs": {"nccl_config": {"nchannels": 2}},
    }
    assert s.spmd_noop_settings() == [
        "nccl_comm_num",
        "fuse_grad_size_in_MB",
        "find_unused_parameters",
        "hybrid_configs.mp_configs.sync_grad",
        "hybrid_configs.mp_configs.sync_mode",
        "hybrid_configs.sharding_configs.comm_overlap",
        "hybrid_configs.dp_configs",
    ]
    s.fuse_grad_size_in_MB = 32  # back to the default: no longer listed
    assert "fuse_grad_size_in_MB" not in s.spmd_noop_settings()


def test_spmd_noop_table_names_real_settings():
    defaults = DistributedStrategy().to_dict()
    for name, why in SPMD_NOOP_SETTINGS.items():
        node = defaults
        for key in name.split("."):
            assert key in node, name
            node = node[key]
        assert isinstance(why, str) and why
    for name in ("amp", "hybrid_configs.mp_degree", "sharding_configs.stage"):
        assert name not in SPMD_NOOP_SETTINGS


# --------------------------------------------------------------------------- bad input
def _assign(name, value):
    def run():
        setattr(DistributedStrategy(), name, value)

    return run


@pytest.mark.parametrize(
    ("action", "error", "match"),
    [
        (_assign("ampp", True), StrategyKeyError, r"'ampp'.*Did you mean 'amp'.*Valid settings"),
        (_assign("mode", 1), StrategyKeyError, r"'mode' is a Paddle setting"),
        (_assign("amp", 1), TypeError, r"amp expects a bool.*got 1 of type int"),
        (_assign("amp", "True"), TypeError, r"got 'True' of type str"),
        (_assign("nccl_comm_num", True), TypeError, r"nccl_comm_num expects an int.*True"),
        (_assign("nccl_comm_num", 2.0), TypeError, r"got 2\.0 of type float"),
        (_assign("nccl_comm_num", 0), ValueError, r"nccl_comm_num=0.*>= 1"),
        (_assign("amp_configs", [1]), TypeError, r"amp_configs expects a dict, got \[1\]"),
        (
            _assign("amp_configs", {"init_loss_scale": 1.0}),
            ConfigKeyError,
            r"'init_loss_scale' is not a key of amp_configs.*'init_loss_scaling'",
        ),
        (
            _assign("amp_configs", {"init_loss_scaling": "big"}),
            TypeError,
            r"amp_configs\.init_loss_scaling expects a finite float.*'big' of type str",
        ),
        (_assign("amp_configs", {"incr_ratio": 0.5}), ValueError, r"incr_ratio=0\.5"),
        (_assign("amp_configs", {"dtype": "fp16"}), ValueError, r"dtype='fp16'.*'bfloat16'"),
        (_assign("amp_configs", {"decr_ratio": 1.5}), ValueError, r"decr_ratio=1\.5"),
        (_assign("amp_configs", {"init_loss_scaling": -1}), ValueError, r"init_loss_scaling=-1"),
        (
            _assign("amp_configs", {"custom_white_list": "matmul"}),
            TypeError,
            r"custom_white_list expects a list of strs, got 'matmul'",
        ),
        (
            _assign("amp_configs", {"custom_black_list": ["exp", 3]}),
            TypeError,
            r"custom_black_list\[1\] expects a str, got 3",
        ),
        (_assign("gradient_merge_configs", {"k_steps": 0}), ValueError, r"k_steps=0"),
        (_assign("sharding_configs", {"stage": 4}), ValueError, r"sharding_configs\.stage=4"),
        (
            _assign("pipeline_configs", {"schedule_mode": "GPipe"}),
            ValueError,
            r"schedule_mode='GPipe'.*'1F1B'",
        ),
        (_assign("hybrid_configs", {"dp_degree": 0}), ValueError, r"dp_degree=0.*-1"),
        (_assign("hybrid_configs", {"mp_degree": -1}), ValueError, r"mp_degree=-1"),
        (_assign("hybrid_configs", {"mp_degree": 2.0}), TypeError, r"mp_degree expects an int"),
        (
            _assign("hybrid_configs", {"cp_degree": 2}),
            ValueError,
            r"cp_degree=2.*context parallelism is not available",
        ),
        (
            _assign("hybrid_configs", {"ep_degree": 0}),
            ValueError,
            r"ep_degree=0 is not valid; set it to >= 1",
        ),
        (
            _assign("hybrid_configs", {"moe_sharding_degree": 2}),
            ValueError,
            r"moe_sharding_degree=2 is not valid; set it to 1: jfleet splits expert weights",
        ),
        (
            _assign("hybrid_configs", {"order": ["dp", "mp"]}),
            ValueError,
            r"order=\['dp', 'mp'\].*lacks 'pp', 'sharding'.*\['dp', 'pp', 'sharding', 'sep',",
        ),
        (
            _assign("hybrid_configs", {"order": ["dp", "pp", "sharding", "sep", "tp"]}),
            ValueError,
            r"'tp'",
        ),
        (
            _assign("hybrid_parallel_order", ["dp", "dp", "pp", "sharding", "sep", "mp"]),
            ValueError,
            r"hybrid_configs\.order=",
        ),
        (
            _assign("hybrid_configs", {"mp_configs": {"sync_grd": True}}),
            ConfigKeyError,
            r"'sync_grd' is not a key of hybrid_configs\.mp_configs.*'sync_grad'",
        ),
        (
            _assign("hybrid_configs", {"mp_configs": {"sync_mode": "sum"}}),
            ValueError,
            r"sync_mode='sum'.*'broadcast' or 'average'",
        ),
        (_assign("hybrid_configs", {"pp_configs": True}), TypeError, r"pp_configs expects a dict"),
        (_assign("dgc_configs", {"sparsity": [0.5, 1.0]}), ValueError, r"sparsity=\[0\.5, 1\.0\]"),
        (
            _assign("recompute_configs", {"refined_ops_patterns": [{"nums": 1}]}),
            ConfigKeyError,
            r"'nums' is not a key of recompute_configs\.refined_ops_patterns\[0\]",
        ),
        (
            _assign("gradient_scale_configs", {"scale_strategy": "mean"}),
            ValueError,
            r"scale_strategy='mean'",
        ),
        (
            lambda: DistributedStrategy.from_dict({"hybrid_config": {}}),
            StrategyKeyError,
            r"'hybrid_config'.*Did you mean 'hybrid_configs'",
        ),
        (lambda: DistributedStrategy().nope, AttributeError, r"'nope' is not a"),
    ],
)
def test_bad_input_names_the_culprit(action, error, match):
    with pytest.raises(error, match=match):
        action()

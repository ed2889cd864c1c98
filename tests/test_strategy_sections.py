"""Writable ``*_configs`` sections, Paddle's orders, range checks and suggested fixes.

Paddle's sections are protobuf messages: ``strategy.hybrid_configs["pp_configs"].x = v``
writes through, an unknown field is an ``AttributeError``. Expected values here are
literals or computed from the defaults, never read back from the code under test.
"""

from __future__ import annotations

import ast
import math
import re

import numpy as np
import pytest

from jfleet import fleet
from jfleet.training.strategy import (
    ConfigAttributeError,
    ConfigKeyError,
    DistributedStrategy,
    StrategyKeyError,
)
from jfleet.training.strategy_schema import NCCL_SECTIONS, RULES, SCHEMA, ListOf, complete_order


def _sections(schema: dict = SCHEMA, path: tuple = ()) -> list[tuple[str, ...]]:
    out = []
    for key, spec in schema.items():
        if isinstance(spec, dict):
            out.append((*path, key))
            out.extend(_sections(spec, (*path, key)))
    return out


def _fields(schema: dict = SCHEMA, path: str = "") -> list[tuple[str, object]]:
    out = []
    for key, spec in schema.items():
        sub = f"{path}.{key}" if path else key
        if isinstance(spec, dict):
            out.extend(_fields(spec, sub))
        elif isinstance(spec, ListOf) and isinstance(spec.item, dict):
            out.extend(_fields(spec.item, sub))
        else:
            out.append((sub, spec))
    return out


SECTIONS = _sections()
FLOAT_FIELDS = [path for path, spec in _fields() if type(spec) is float]


def _view(strategy: DistributedStrategy, path: tuple[str, ...]):
    section = getattr(strategy, path[0])
    for key in path[1:]:
        section = section[key]
    return section


def _stored(strategy: DistributedStrategy, path: tuple[str, ...]):
    value = strategy.to_dict()
    for key in path:
        value = value[key]
    return value


def _a_new_value(section: dict) -> tuple[str, object, object]:
    """A key of ``section``, a valid new value for it, and the value stored afterwards."""
    for key, default in section.items():
        if isinstance(default, bool):
            return key, not default, not default
    for key, default in section.items():
        if isinstance(default, str) and key in ("commName", "dump_fields_path", "uri", "algo"):
            return key, "changed", "changed"
    for key, default in section.items():
        if isinstance(default, int | float):
            return key, default + 1, default + 1
    key, sub = next(iter(section.items()))  # only sections inside: merge into the first one
    inner_key, inner, stored = _a_new_value(sub)
    return key, {inner_key: inner}, {**sub, inner_key: stored}


@pytest.mark.parametrize("path", SECTIONS, ids=".".join)
def test_every_section_writes_through_by_item_and_attribute(path):
    strategy = DistributedStrategy()
    view = _view(strategy, path)
    key, value, stored = _a_new_value(dict(view))
    setattr(view, key, value)
    assert _stored(strategy, (*path, key)) == stored
    assert getattr(view, key) == stored  # the snapshot follows its own writes
    fresh = DistributedStrategy()
    _view(fresh, path)[key] = value
    assert _stored(fresh, (*path, key)) == stored
    assert fresh == strategy


def test_issue_statements_write_through_and_read_back():
    strategy = DistributedStrategy()
    strategy.hybrid_configs["sharding_configs"].tensor_fusion = True
    strategy.hybrid_configs["pp_configs"].delay_scale_loss = True
    strategy.hybrid_configs["sharding_configs"].split_param = 0  # protobuf reads 0 as False
    strategy.hybrid_configs["mp_configs"].sync_grad = True
    strategy.hybrid_configs["dp_configs"]["nccl_config"].nchannels = 4
    strategy.hybrid_configs["mp_degree"] = 2
    strategy.pipeline_configs["accumulate_steps"] = 4
    strategy.recompute_configs.enable_offload = True
    strategy.gradient_merge_configs.update(k_steps=2, avg=False)
    values = strategy.to_dict()
    hybrid = values["hybrid_configs"]
    assert hybrid["sharding_configs"]["tensor_fusion"] is True
    assert hybrid["pp_configs"]["delay_scale_loss"] is True
    assert hybrid["sharding_configs"]["split_param"] is False
    assert hybrid["mp_configs"]["sync_grad"] is True
    assert hybrid["dp_configs"]["nccl_config"]["nchannels"] == 4
    assert hybrid["mp_degree"] == 2
    assert values["pipeline_configs"]["accumulate_steps"] == 4
    assert values["recompute_configs"]["enable_offload"] is True
    assert values["gradient_merge_configs"] == {"k_steps": 2, "avg": False}
    assert "hybrid_configs.pp_configs.delay_scale_loss" in strategy.spmd_noop_settings()
    # A bad write changes nothing, and the snapshot keeps its value.
    section = strategy.hybrid_configs["sharding_configs"]
    with pytest.raises(ValueError, match="accumulate_steps=0"):
        section.accumulate_steps = 0
    assert (
        section.accumulate_steps == 1
        and _stored(strategy, ("hybrid_configs", "sharding_configs", "accumulate_steps")) == 1
    )


def test_sections_and_lists_inside_lists_write_through():
    strategy = DistributedStrategy()
    strategy.recompute_configs = {"refined_ops_patterns": [{"num": 1}, {"num": 2}]}
    patterns = strategy.recompute_configs["refined_ops_patterns"]
    patterns[1].num = 3
    patterns[0]["main_ops"].append("matmul")
    with pytest.raises(ValueError, match=r"refined_ops_patterns\[1\]\.num=-3"):
        patterns[1]["num"] = -3
    patterns.append({"pre_ops": ["relu"]})
    with pytest.raises(ConfigKeyError, match=r"'nums' is not a key of .*refined_ops_patterns\[3\]"):
        patterns.append({"nums": 1})
    stored = strategy.to_dict()["recompute_configs"]["refined_ops_patterns"]
    assert [(p["num"], p["main_ops"], p["pre_ops"]) for p in stored] == [
        (1, ["matmul"], []),
        (3, [], []),
        (0, [], ["relu"]),
    ]
    assert patterns == stored and patterns[1].num == 3


def test_fleet_init_sees_item_and_attribute_writes():
    strategy = DistributedStrategy()
    strategy.hybrid_configs["mp_degree"] = 4
    strategy.hybrid_configs.pp_degree = 2
    strategy.hybrid_configs["order"] = ["pp", "dp", "sharding", "mp"]
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    hcg = fleet.get_hybrid_communicate_group()
    assert hcg.get_model_parallel_world_size() == 4
    assert hcg.get_pipe_parallel_world_size() == 2
    assert hcg.get_data_parallel_world_size() == 1
    names = fleet.get_hybrid_parallel_topology().get_hybrid_group_names()
    # ep, which the order leaves out, goes just outside mp
    assert list(names) == ["pipe", "data", "sharding", "sep", "expert", "model"]


def test_unknown_keys_raise_what_paddle_raises_and_write_nothing():
    strategy = DistributedStrategy()
    pp = strategy.hybrid_configs["pp_configs"]
    with pytest.raises(AttributeError, match=r"'delay_scale_los'.*'delay_scale_loss'.*Valid keys"):
        pp.delay_scale_los = True
    with pytest.raises(KeyError, match=r"'bogus' is not a key of hybrid_configs\.pp_configs"):
        pp["bogus"] = True
    with pytest.raises(KeyError, match="'bogus'"):
        pp.setdefault("bogus", 1)
    with pytest.raises(KeyError):  # the trainer's `except (KeyError, AttributeError)` catches
        strategy.hybrid_configs["sharding_configs"].nonexistent = 1
    assert issubclass(ConfigAttributeError, AttributeError)
    assert issubclass(ConfigAttributeError, KeyError)
    assert strategy == DistributedStrategy()


def test_paddle_orders_are_completed():
    # Paddle's own test order (four axes), PaddleNLP's four- and five-axis orders, and
    # Paddle 3.x's six-axis default: a missing sep goes just outside mp; cp is dropped.
    cases = {
        ("sharding", "mp", "dp", "pp"): ["sharding", "sep", "mp", "dp", "pp"],
        ("dp", "pp", "sharding", "mp"): ["dp", "pp", "sharding", "sep", "mp"],
        ("dp", "sharding", "pp", "mp"): ["dp", "sharding", "pp", "sep", "mp"],
        ("pp", "dp", "sharding", "mp"): ["pp", "dp", "sharding", "sep", "mp"],
        ("dp", "pp", "sharding", "sep", "cp", "mp"): ["dp", "pp", "sharding", "sep", "mp"],
        ("mp", "sep", "sharding", "pp", "dp"): ["mp", "sep", "sharding", "pp", "dp"],
    }
    for given, expected in cases.items():
        strategy = DistributedStrategy()
        strategy.hybrid_configs["order"] = list(given)
        assert strategy.hybrid_parallel_order == expected, given
        assert complete_order(list(given)) == expected


def test_every_numeric_field_has_a_range():
    numeric = [
        path
        for path, spec in _fields()
        if type(spec) in (int, float) or (isinstance(spec, ListOf) and spec.item in (int, float))
    ]
    assert len(numeric) > 60
    assert [path for path in numeric if path not in RULES] == []
    assert len(NCCL_SECTIONS) == 20  # 1 mp, 3 pp, 2 sharding, 2 dp, 2 ep, 2 moe, 8 single


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, np.float32("nan")])
def test_every_float_field_must_be_finite(bad):
    for path in FLOAT_FIELDS:
        top, *rest = path.split(".")
        update: object = bad
        for key in reversed(rest):
            update = {key: update}
        with pytest.raises(ValueError, match=rf"{re.escape(f'{path}={bad!r}')} is not finite"):
            setattr(DistributedStrategy(), top, update)


# --------------------------------------------------------------------------- fixes
def _code(message: str) -> str:
    return re.search(r"(strategy\.\S+ = .+?)\.( Valid|$)", message).group(1)


def _after_eg(message: str):
    return ast.literal_eval(re.search(r"e\.g\. (.+)\.$", message).group(1))


def _did_you_mean(message: str) -> str:
    return re.search(r"Did you mean '(\w+)'", message).group(1)


def _section_code(message: str) -> str:
    return re.search(r"(section\[.+\] = .+)\.$", message).group(1)


def _set_order(order):
    def run(strategy):
        strategy.hybrid_configs["order"] = order

    return run


FIXES = [
    # (bad statement, error, the fix read from the message, applied, then checked)
    (
        "strategy.sharding_configs.split_param = 0",
        AttributeError,
        lambda s, m: exec(_code(m), {"strategy": s}),
        lambda s: s.hybrid_configs["sharding_configs"]["split_param"] is False,
    ),
    (
        "strategy.sharding_configs = {'tensor_fusion': True}",
        KeyError,
        lambda s, m: exec(_code(m), {"strategy": s}),
        lambda s: s.hybrid_configs["sharding_configs"]["tensor_fusion"] is True,
    ),
    (
        "strategy.amp_configs['init_loss_scale'] = 8.0",
        KeyError,
        lambda s, m: s.amp_configs.__setitem__(_did_you_mean(m), 8.0),
        lambda s: s.amp_configs["init_loss_scaling"] == 8.0,
    ),
    (
        "strategy.ampp = True",
        StrategyKeyError,
        lambda s, m: setattr(s, _did_you_mean(m), True),
        lambda s: s.amp is True,
    ),
    (
        "strategy.hybrid_configs['order'] = ['dp', 'mp']",
        ValueError,
        lambda s, m: _set_order(_after_eg(m))(s),
        lambda s: s.hybrid_parallel_order == ["dp", "pp", "sharding", "sep", "mp"],
    ),
    (
        "strategy.hybrid_configs['order'] = ['pp', 'dp', 'dp', 'sharding', 'mp']",
        ValueError,
        lambda s, m: _set_order(_after_eg(m))(s),
        lambda s: s.hybrid_parallel_order == ["pp", "dp", "sharding", "sep", "mp"],
    ),
    (
        "strategy.hybrid_configs['order'] = ['dp', 'pp', 'sharding', 'moe', 'mp']",
        ValueError,
        lambda s, m: _set_order(_after_eg(m))(s),
        lambda s: s.hybrid_parallel_order == ["dp", "pp", "sharding", "sep", "mp"],
    ),
    (
        "strategy.amp_configs.init_loss_scaling = float('nan')",
        ValueError,
        lambda s, m: setattr(s.amp_configs, "init_loss_scaling", _after_eg(m)),
        lambda s: s.amp_configs["init_loss_scaling"] == 32768.0,
    ),
    (
        "strategy.amp_configs = [1]",
        TypeError,
        lambda s, m: setattr(s, "amp_configs", _after_eg(m)),
        lambda s: s.amp_configs["init_loss_scaling"] == 32768.0,
    ),
    (
        "del strategy.amp_configs['incr_ratio']",
        TypeError,
        lambda s, m: exec(_section_code(m), {"section": s.amp_configs}),
        lambda s: s.amp_configs["incr_ratio"] == 2.0,
    ),
    (
        "strategy.amp_configs.clear()",
        TypeError,
        lambda s, m: exec(_section_code(m), {"section": s.amp_configs}),
        lambda s: s.amp_configs["init_loss_scaling"] == 32768.0,
    ),
    (
        "strategy.hybrid_configs['sharding_configs'].split_param = 2",
        TypeError,
        lambda s, m: setattr(s.hybrid_configs["sharding_configs"], "split_param", True),
        lambda s: s.hybrid_configs["sharding_configs"]["split_param"] is True,
    ),
    (
        "strategy.gradient_scale_configs['scale_strategy'] = 'sum'",
        ValueError,
        lambda s, m: s.gradient_scale_configs.__setitem__(
            "scale_strategy", re.search(r"set it to '(\w+)'", m).group(1)
        ),
        lambda s: s.gradient_scale_configs["scale_strategy"] == "avg",
    ),
    (
        "strategy.hybrid_configs['cp_degree'] = 2",
        ValueError,
        lambda s, m: s.hybrid_configs.__setitem__(
            "cp_degree", int(re.search(r"set it to (\d+)", m).group(1))
        ),
        lambda s: s.hybrid_configs["cp_degree"] == 1,
    ),
    (
        "strategy.pipeline_configs.schedule_mode = 'GPipe'",
        ValueError,
        lambda s, m: setattr(
            s.pipeline_configs, "schedule_mode", _after_list(m, r"one of (\[.+?\])")[0]
        ),
        lambda s: s.pipeline_configs["schedule_mode"] == "1F1B",
    ),
]


def _after_list(message: str, pattern: str):
    return ast.literal_eval(re.search(pattern, message).group(1))


@pytest.mark.parametrize(("statement", "error", "fix", "check"), FIXES, ids=[f[0] for f in FIXES])
def test_each_suggested_fix_is_accepted(statement, error, fix, check):
    strategy = DistributedStrategy()
    strategy.recompute_configs = {"refined_ops_patterns": [{"num": 1}]}
    with pytest.raises(error) as info:
        exec(statement, {"strategy": strategy})
    fix(strategy, str(info.value))
    assert check(strategy)


@pytest.mark.parametrize(
    ("text", "match", "fixed"),
    [
        ("amp_configs: 1", r"write it as `amp_configs \{ \.\.\. \}`", "amp_configs { }"),
        ("amp_configs { dtype: bfloat16 }", "add quotes", 'amp_configs { dtype: "bfloat16" }'),
        ("amp_configs { incr_ratio: 3.0", r"add a '\}'", "amp_configs { incr_ratio: 3.0 }"),
    ],
)
def test_prototxt_suggested_fixes_load(tmp_path, text, match, fixed):
    path = tmp_path / "s.prototxt"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        DistributedStrategy().load_from_prototxt(path)
    path.write_text(fixed)
    DistributedStrategy().load_from_prototxt(path)


# --------------------------------------------------------------------------- bad input
def _setting(statement: str):
    def run():
        exec(statement, {"strategy": DistributedStrategy()})

    return run


@pytest.mark.parametrize(
    ("statement", "error", "match"),
    [
        ("strategy.last_comm_group_size_MB = -1", ValueError, r"last_comm_group_size_MB=-1.*> 0"),
        ("strategy.last_comm_group_size_MB = 0.0", ValueError, r"last_comm_group_size_MB=0\.0"),
        ("strategy.fuse_grad_size_in_TFLOPS = float('inf')", ValueError, r"=inf is not finite"),
        ("strategy.conv_workspace_size_limit = 0", ValueError, r"conv_workspace_size_limit=0"),
        (
            "strategy.hybrid_configs['sharding_configs'].comm_buffer_size_MB = 0",
            ValueError,
            r"sharding_configs\.comm_buffer_size_MB=0.*> 0",
        ),
        (
            "strategy.hybrid_configs['sharding_configs'].accumulate_steps = 1.5",
            TypeError,
            r"accumulate_steps expects an int, got 1\.5 of type float",
        ),
        (
            "strategy.hybrid_configs['sharding_configs'].tensor_fusion = 'yes'",
            TypeError,
            r"tensor_fusion expects a bool \(True or False, or 0 / 1\), got 'yes'",
        ),
        (
            "strategy.hybrid_configs['pp_configs'].delay_scale_loss = 2",
            TypeError,
            r"delay_scale_loss expects a bool.*got 2 of type int",
        ),
        ("strategy.amp = 0", TypeError, r"amp expects a bool \(True or False\), got 0"),
        (
            "strategy.hybrid_configs['mp_configs']['nccl_config'].nchannels = -1",
            ValueError,
            r"mp_configs\.nccl_config\.nchannels=-1.*>= 0",
        ),
        (
            "strategy.a_sync_configs['send_queue_size'] = 0",
            ValueError,
            r"a_sync_configs\.send_queue_size=0",
        ),
        (
            "strategy.hybrid_configs['sharding_configs'].offload_opt_buffer_size = -2",
            ValueError,
            r"offload_opt_buffer_size=-2.*-1 \(unset\) or >= 0",
        ),
        (
            "strategy.build_strategy = {'reduce_strategy': 3}",
            ValueError,
            r"reduce_strategy=3.*0 \(AllReduce\) or 1",
        ),
        (
            "strategy.recompute_configs.checkpoint_shape = [4, 0]",
            ValueError,
            r"checkpoint_shape=\[4, 0\].*dims >= 1",
        ),
        (
            "strategy.recompute_configs = {'refined_ops_patterns': [{'num': -2}]}",
            ValueError,
            r"refined_ops_patterns\[0\]\.num=-2",
        ),
        (
            "strategy.hybrid_configs['order'] = ['dp', 'pp', 'sharding', 'moe', 'mp']",
            ValueError,
            r"order=\[.*'moe'.*'moe' is not an axis",
        ),
        (
            "strategy.hybrid_configs['order'] = ['dp', 'pp', 'pp', 'sharding', 'mp']",
            ValueError,
            r"'pp' is listed twice",
        ),
        (
            "strategy.gradient_scale_configs.scale_strategy = 'sum'",
            ValueError,
            r"scale_strategy='sum'.*'avg'",
        ),
        (
            "strategy.hybrid_configs['pp_configs']['nope'] = 1",
            ConfigKeyError,
            r"'nope' is not a key of hybrid_configs\.pp_configs",
        ),
        (
            "strategy.tensor_parallel_configs.tensor_init_seed = -5",
            ValueError,
            r"tensor_init_seed=-5.*-1 \(unset\)",
        ),
    ],
)
def test_bad_input_names_field_value_and_expectation(statement, error, match):
    with pytest.raises(error, match=match):
        _setting(statement)()

"""The plan: golden sharding specs, choices that move the right way, errors, JSON, text.

Golden files: ``tests/auto_parallel/golden/<model>__<mesh>.json`` pin every parameter's role,
PartitionSpec, ZeRO spec and pipeline stage. To rewrite them after an intended change
(check the diff by hand against Megatron's roles first)::

    JFLEET_REGENERATE_GOLDEN=1 python -m pytest tests/auto_parallel/test_plan.py -k golden
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel import (
    HardwareProfile,
    Plan,
    match_patterns,
    plan_for,
    planner,
    split_devices,
)
from jfleet.auto_parallel.search.plan import spec_to_json
from jfleet.models.gpt2 import TinyGPT2
from jfleet.models.llama import TinyLlama
from tests.auto_parallel.conv_net import CONV_NET_PATHS, ConvNet

GOLDEN = Path(__file__).parent / "golden"
REGENERATE = os.environ.get("JFLEET_REGENERATE_GOLDEN") == "1"
MiB = 2**20

MODELS = {
    "llama": lambda: TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=4, hidden=64),
    "gpt2": lambda: TinyGPT2(vocab=64, width=32, heads=4, layers=4),
}
MESHES = {
    "dp2_mp4": ({"dp": 2, "mp": 4}, None),
    "dp2_pp2_mp2": ({"dp": 2, "pp": 2, "mp": 2}, None),
    "dp2_sharding2_mp2_zero3": ({"dp": 2, "sharding": 2, "mp": 2}, 3),
}


def shapes(name: str) -> nnx.Module:
    return nnx.eval_shape(MODELS[name])


def golden_table(plan: Plan) -> dict:
    return {
        "mesh": plan.mesh_shape,
        "zero_stage": plan.zero_stage,
        "stages": [list(s) for s in plan.stages],
        "params": {
            p.path: {
                "role": p.role,
                "spec": spec_to_json(p.spec),
                "zero_spec": spec_to_json(p.zero_spec),
                "stage": p.stage,
            }
            for p in plan.params
        },
    }


def dump_golden(table: dict) -> str:
    """JSON with one line per parameter, so a diff shows exactly which layout changed."""
    head = {k: v for k, v in table.items() if k != "params"}
    lines = ["{"]
    lines += [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines.append('  "params": {')
    items = sorted(table["params"].items())
    for i, (k, v) in enumerate(items):
        comma = "," if i < len(items) - 1 else ""
        lines.append(f"    {json.dumps(k)}: {json.dumps(v, sort_keys=True)}{comma}")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("mesh", sorted(MESHES))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_golden_specs(model, mesh):
    degrees, stage = MESHES[mesh]
    plan = plan_for(
        shapes(model),
        device_num=8,
        batch_size=16,
        seq_len=16,
        force_mesh=degrees,
        zero_stage=stage,
        recompute=False,
    )
    table = golden_table(plan)
    path = GOLDEN / f"{model}__{mesh}.json"
    if REGENERATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(dump_golden(table))
    assert path.exists(), f"{path} is missing; run with JFLEET_REGENERATE_GOLDEN=1"
    expected = json.loads(path.read_text())
    diff = [
        f"{k}: expected {expected['params'].get(k)}, got {table['params'].get(k)}"
        for k in sorted(set(expected["params"]) | set(table["params"]))
        if expected["params"].get(k) != table["params"].get(k)
    ]
    assert not diff, "\n".join(diff)
    assert {k: v for k, v in table.items() if k != "params"} == {
        k: v for k, v in expected.items() if k != "params"
    }


def test_golden_specs_follow_megatron():
    """What the golden files hold, stated as rules rather than as a copy."""
    for name in MODELS:
        for mesh in MESHES:
            table = json.loads((GOLDEN / f"{name}__{mesh}.json").read_text())["params"]
            for path, entry in table.items():
                role, spec = entry["role"], entry["spec"]
                leaf = path.rsplit(".", 1)[-1]
                if role in ("q", "k", "v", "qkv", "gate", "up", "head"):
                    assert spec == ([None, "mp"] if leaf != "bias" else ["mp"]), path
                elif role in ("o", "down"):
                    assert spec == (["mp", None] if leaf != "bias" else []), path
                elif role == "embedding":
                    assert spec == ["mp", None], path
                else:
                    assert role in ("norm", "position_embedding") and spec == [], path
                if "zero3" not in mesh:
                    assert entry["zero_spec"] == spec, path


# ------------------------------------------------------------------ the choice moves
def test_small_model_large_batch_is_pure_data_parallel():
    model = nnx.eval_shape(lambda: TinyLlama(vocab=64, width=32, heads=4, layers=2))
    for profile in ("cpu", "h100"):
        plan = plan_for(model, device_num=8, batch_size=512, seq_len=64, profile=profile)
        assert plan.mesh_shape == {"dp": 8, "pp": 1, "sharding": 1, "sep": 1, "mp": 1}, profile
        assert plan.zero_stage == 0 and not plan.recompute
        assert plan.candidates[0].reason == "best"
        assert all(c.reason for c in plan.candidates[1:])


def test_a_tight_memory_budget_forces_zero_tensor_or_pipeline_parallel():
    model = nnx.eval_shape(
        lambda: TinyLlama(vocab=512, width=128, heads=8, kv_heads=4, layers=4, hidden=256)
    )
    free = plan_for(model, device_num=8, batch_size=16, seq_len=64)
    assert free.layout.mesh_name == "dp8"
    need = free.chosen.memory.total
    tight = plan_for(model, device_num=8, batch_size=16, seq_len=64, memory_budget=0.8 * need)
    lay = tight.layout
    assert lay.sharding > 1 or lay.mp > 1 or lay.pp > 1
    assert tight.chosen.memory.total <= 0.8 * need
    dp8 = next(
        c for c in tight.candidates if c.layout.mesh_name == "dp8" and not c.layout.recompute
    )
    assert not dp8.fits and dp8.reason.startswith("does not fit: ")
    tighter = plan_for(model, device_num=8, batch_size=16, seq_len=64, memory_budget=0.4 * need)
    assert tighter.chosen.memory.total <= 0.4 * need
    with pytest.raises(ValueError, match="no layout fits the memory budget"):
        plan_for(model, device_num=8, batch_size=16, seq_len=64, memory_budget=0.05 * need)


def test_two_nodes_keep_tensor_parallel_inside_a_node():
    # a wide model with a small batch: tensor parallelism beats gradient all-reduces
    model = nnx.eval_shape(
        lambda: TinyLlama(vocab=1024, width=1024, heads=16, layers=2, hidden=4096)
    )
    one = plan_for(model, device_num=8, batch_size=8, seq_len=32, profile="h100")
    assert one.layout.mp == 8
    two = plan_for(model, device_num=4, node_num=2, batch_size=8, seq_len=32, profile="h100")
    assert 1 < two.layout.mp <= 4
    assert all(c.layout.mp <= 4 for c in two.candidates)
    assert any("exceeds the 4 devices of a node" in r for _, r in two.excluded)


@pytest.mark.parametrize("devices", [6, 12])
def test_six_and_twelve_devices_give_valid_plans(devices):
    model = nnx.eval_shape(lambda: TinyLlama(vocab=96, width=48, heads=6, kv_heads=6, layers=6))
    plan = plan_for(model, device_num=devices, batch_size=24, seq_len=16)
    assert math.prod(plan.axis_sizes) == devices
    forced = plan_for(
        model,
        device_num=devices,
        batch_size=24,
        seq_len=16,
        force_mesh={"dp": devices // 6, "mp": 2, "pp": 3},
    )
    sizes = forced.mesh_shape
    for p in forced.params:
        for dim, entry in zip(p.shape, p.spec, strict=False):
            if entry is not None:
                assert dim % sizes[entry] == 0, p.path
    if forced.layout.num_virtual_stages == 1:
        assert forced.stages == ((0, 1), (2, 3), (4, 5))
    else:  # interleaved: stage s holds chunks s and s + 3
        assert forced.layout.num_virtual_stages == 2
        assert forced.stages == ((0, 3), (1, 4), (2, 5))
    one = plan_for(model, device_num=devices, batch_size=24, seq_len=16,
                   force_mesh={"dp": devices // 6, "mp": 2, "pp": 3}, schedule="1F1B")  # fmt: skip
    assert one.stages == ((0, 1), (2, 3), (4, 5))


def test_sequence_parallel_adds_sep_candidates():
    model = nnx.eval_shape(lambda: TinyLlama(vocab=64, width=32, heads=4, layers=2))
    plan = plan_for(model, device_num=4, batch_size=8, seq_len=16, sequence_parallel=True)
    assert any(c.layout.sep > 1 for c in plan.candidates)
    assert plan.sequence_parallel
    plain = plan_for(model, device_num=4, batch_size=8, seq_len=16)
    assert all(c.layout.sep == 1 for c in plain.candidates)


# ------------------------------------------------------------------ errors
def test_bad_inputs_are_errors_naming_the_values():
    model = shapes("llama")
    kw = {"batch_size": 16, "seq_len": 16}
    with pytest.raises(ValueError, match=r"device_num=0 must be an int >= 1"):
        plan_for(model, device_num=0, **kw)
    with pytest.raises(ValueError, match=r"node_num=0 must be an int >= 1"):
        plan_for(model, device_num=8, node_num=0, **kw)
    with pytest.raises(
        ValueError,
        match=r"multiplies out to dp2 x mp2 = 4, but device_num x "
        r"node_num = 8 x 1 = 8",
    ):
        plan_for(model, device_num=8, force_mesh={"dp": 2, "mp": 2}, **kw)
    with pytest.raises(ValueError, match=r"unknown axes \['tp'\]"):
        plan_for(model, device_num=8, force_mesh={"dp": 2, "tp": 4}, **kw)
    with pytest.raises(ValueError, match=r"pp=8 is more than the \d+ blocks.*use pp <= \d+"):
        plan_for(model, device_num=8, force_mesh={"pp": 8}, **kw)
    with pytest.raises(ValueError, match=r"sep=2 but sequence_parallel=False"):
        plan_for(model, device_num=8, force_mesh={"dp": 4, "sep": 2}, **kw)
    with pytest.raises(ValueError, match=r"schedule='GPipe' is not one of"):
        plan_for(model, device_num=8, schedule="GPipe", **kw)
    with pytest.raises(ValueError, match=r"dp x sharding = 8 does not divide batch_size=4"):
        plan_for(model, device_num=8, batch_size=4, seq_len=16, force_mesh={"dp": 8})
    with pytest.raises(ValueError, match=r"node_num=3 does not divide the 8 devices"):
        split_devices(8, 3)

    class Empty(nnx.Module):
        pass

    with pytest.raises(ValueError, match="Empty has no nnx.Param"):
        plan_for(Empty(), device_num=8, **kw)


def test_patterns_found_once_are_planned_without_matching_again(monkeypatch):
    model = shapes("llama")
    kw = {"device_num": 8, "batch_size": 16, "seq_len": 16, "force_mesh": {"dp": 2, "mp": 4}}
    found = match_patterns(model)
    fresh = plan_for(model, **kw)

    def no_second_match(model):
        raise AssertionError("plan_for matched the model again")

    monkeypatch.setattr(planner, "match_patterns", no_second_match)
    assert plan_for(model, patterns=found, **kw) == fresh
    with pytest.raises(TypeError, match=r"patterns=\{'mp': 4\} \(dict\) is not a ModelPatterns"):
        plan_for(model, patterns={"mp": 4}, **kw)
    other = match_patterns(shapes("gpt2"))
    with pytest.raises(
        ValueError, match="patterns were found in another model than this TinyLlama"
    ):
        plan_for(model, patterns=other, **kw)


def test_an_unrecognised_model_gets_a_data_parallel_plan_and_a_warning(caplog):
    model = nnx.eval_shape(ConvNet)
    with caplog.at_level(logging.WARNING, logger="jfleet"):
        plan = plan_for(model, device_num=8, batch_size=32, seq_len=1)
    assert plan.layout.mp == 1 and plan.layout.pp == 1
    assert all(c.layout.mp == 1 and c.layout.pp == 1 for c in plan.candidates)
    (record,) = [r for r in caplog.records if r.name == "jfleet" and r.levelno == logging.WARNING]
    for path in CONV_NET_PATHS:
        assert path in record.getMessage()
    assert set(plan.unmatched) == {p.path for p in plan.params}
    with pytest.raises(ValueError, match="asks for tensor or pipeline parallelism"):
        plan_for(model, device_num=8, batch_size=32, seq_len=1, force_mesh={"dp": 4, "mp": 2})


# ------------------------------------------------------------------ data and text
def test_json_round_trip_and_reproduction():
    model = shapes("llama")
    plan = plan_for(
        model,
        device_num=8,
        batch_size=16,
        seq_len=16,
        profile="a100",
        force_mesh={"dp": 2, "pp": 2, "mp": 2},
        num_microbatches=4,
        schedule="1F1B",
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.profile.name == "a100" and again.layout.schedule == "1F1B"
    replay = plan_for(
        model,
        device_num=plan.device_num,
        batch_size=plan.batch_size,
        seq_len=plan.seq_len,
        profile=plan.profile,
        force_mesh=plan.mesh_shape,
        zero_stage=plan.zero_stage,
        schedule=plan.schedule,
        num_microbatches=plan.num_microbatches,
        recompute=plan.recompute,
    )
    assert replay.layout == plan.layout and replay.specs == plan.specs
    custom = HardwareProfile(
        name="mine",
        peak_flops={"float32": 1e12},
        memory_bytes=2**30,
        intra_node_bandwidth=1e10,
        inter_node_bandwidth=1e9,
    )
    mine = plan_for(model, device_num=8, batch_size=16, seq_len=16, profile=custom)
    assert Plan.from_json(mine.to_json()).profile == custom
    with pytest.raises(ValueError, match="plan format"):
        Plan.from_dict({"format": 0})


def test_printed_plan_is_a_readable_table():
    plan = plan_for(
        shapes("gpt2"),
        device_num=8,
        batch_size=16,
        seq_len=16,
        force_mesh={"dp": 2, "pp": 2, "mp": 2},
        schedule="FThenB",
    )
    text = str(plan)
    assert text.startswith("jfleet plan: dp2 x pp2 x mp2")
    assert "| rank | layout | memory/device | step |" in text
    assert "| h[*].attn.c_attn.kernel | 32x96 | qkv | P(None, 'mp') |" in text
    assert "stages: 0: blocks 0-1; 1: blocks 2-3" in text
    assert "| wpe.embedding | 64x32 | position_embedding | P() |" in text
    interleaved = plan_for(
        shapes("gpt2"), device_num=8, batch_size=16, seq_len=16,
        force_mesh={"dp": 2, "pp": 2, "mp": 2}, schedule="VPP", num_microbatches=2,
    )  # fmt: skip
    text = str(interleaved)
    assert text.startswith("jfleet plan: dp2 x pp2 x mp2 (VPP v=2 M=2)")
    assert "pipeline VPP, 2 micro-batches, 2 virtual stages" in text
    assert "stages: 0: blocks 0, 2; 1: blocks 1, 3" in text


def test_partition_specs_and_validation():
    model = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2)
    plan = plan_for(
        model,
        device_num=8,
        batch_size=16,
        seq_len=16,
        force_mesh={"sharding": 4, "mp": 2},
        zero_stage=1,
    )
    params = nnx.state(model, nnx.Param)
    specs = plan.partition_specs(params)
    assert specs["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value() == P(None, "mp")
    zero = plan.partition_specs(params, zero=True)
    assert zero["layers"][0]["self_attn"]["q_proj"]["kernel"].get_value() == P("sharding", "mp")
    other = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=3)
    with pytest.raises(ValueError, match=r"not in the plan: \['layers.2"):
        plan.validate(other)
    with pytest.raises(KeyError, match="'nope' is not a parameter of this plan"):
        plan.spec("nope")

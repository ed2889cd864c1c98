"""The planner charges the reference models' attention as the planned platform runs it (issue
37, item 5): fused (cuDNN flash, no ``s x s`` scores) on a GPU profile, materialised on the
CPU profile and when asked (``materialised_attention`` / ``--materialised-attention``)."""

from __future__ import annotations

import dataclasses

import pytest

from jfleet.auto_parallel.cost.profiles import get_profile
from jfleet.auto_parallel.cost.step_work import ATTN_SCORE_ELEMS
from jfleet.auto_parallel.match.attention_trace import attention_as_run, scores_materialised
from jfleet.auto_parallel.match.patterns import match_patterns
from jfleet.auto_parallel.search.cluster_plan import Cluster, main, plan
from jfleet.auto_parallel.search.model_shapes import MODEL_SHAPES, abstract_model
from jfleet.auto_parallel.search.planner import plan_for
from jfleet.models.gpt2 import TinyGPT2
from jfleet.models.llama import TinyLlama

NAMED = "megatron-1.7b"  # 24 layers, width 2304, 24 heads (head_dim 96), seq 2048


@pytest.fixture(scope="module")
def named():
    shape = MODEL_SHAPES[NAMED]
    model = abstract_model(shape)
    return shape, model, match_patterns(model)


def _pinned(named, materialised, profile="h100"):
    """One layout (dp8, no recompute, blocks unrolled): the activations differ by scores only."""
    shape, model, found = named
    return plan(
        model,
        (8, shape.seq_len),
        Cluster(nodes=1, profile=profile),
        patterns=found,
        materialised_attention=materialised,
        force_mesh={"dp": 8},
        zero_stage=0,
        recompute=False,
        accumulate_steps=1,
        scan_layers=False,
        wide_search=False,
    )


def test_named_shape_on_a_gpu_keeps_no_scores_unless_asked(named):
    shape = named[0]
    fused, full = _pinned(named, False), _pinned(named, True)
    assert fused.layout == full.layout
    assert fused.chosen.memory.activations < full.chosen.memory.activations
    # the difference is the scores term: 2 x heads x seq elements a token, every layer
    tokens = 8 * shape.seq_len // 8
    act_bytes = 2  # bfloat16
    scores = tokens * ATTN_SCORE_ELEMS * shape.heads * shape.seq_len * shape.layers * act_bytes
    diff = full.chosen.memory.activations - fused.chosen.memory.activations
    assert diff == pytest.approx(scores, abs=2)
    # the fused kernel's FLOPs are charged from the shapes (4 s^2 q_dim a layer): the same
    assert fused.chosen.flops == pytest.approx(full.chosen.flops, rel=0.02)
    assert fused.chosen.time.total <= full.chosen.time.total
    # the decision and its reason are in the plan
    assert any(n.startswith("attention: fused (gpu, bfloat16, head_dim 96)") for n in fused.notes)
    assert any(n.startswith("attention: materialised as asked") for n in full.notes)
    assert "note: attention: fused" in str(fused)


def test_fp32_and_wide_heads_on_a_gpu_stay_materialised(named):
    """cuDNN's flash attention takes bf16 / fp16 and head_dim up to the profile's maximum."""
    _, _, found = named
    fp32, note = attention_as_run(found, "gpu", "float32")
    assert fp32 is found and "materialised (gpu, float32" in note
    narrow, note = attention_as_run(found, "gpu", "bfloat16", max_head_dim=64)
    assert narrow is found and "at most 64" in note
    assert scores_materialised(attention_as_run(found, "gpu", "bfloat16")[0]) is False


def test_cpu_profile_charges_the_materialised_scores():
    """XLA:CPU runs the XLA implementation: the trace as it is, no note (plans unchanged)."""
    for model in (TinyLlama(vocab=64, width=64, heads=8, kv_heads=4, layers=2), TinyGPT2()):
        found = match_patterns(model)
        assert scores_materialised(found)
        marked = [d for d in found.dots if d.attention]
        assert marked and all(d.platform_attention for d in marked)  # traced in the scope
        assert attention_as_run(found, "cpu", "bfloat16") == (found, "")
        a = plan_for(model, device_num=8, batch_size=16, seq_len=8, patterns=found)
        b = plan_for(
            model,
            device_num=8,
            batch_size=16,
            seq_len=8,
            patterns=found,
            materialised_attention=True,
        )
        assert a.chosen == b.chosen and not any(n.startswith("attention") for n in a.notes)


def test_cli_flag_and_bad_values(capsys):
    argv = ["--arch", "llama", "--layers", "2", "--width", "256", "--heads", "2",
            "--ffn", "512", "--vocab", "1024", "--seq", "1024", "--batch", "16"]  # fmt: skip
    assert main(argv) == 0
    assert "note: attention: fused (gpu, bfloat16, head_dim 128)" in capsys.readouterr().out
    assert main([*argv, "--materialised-attention"]) == 0
    assert "note: attention: materialised as asked" in capsys.readouterr().out
    model = TinyLlama()
    with pytest.raises(TypeError, match="materialised_attention='yes'"):
        plan_for(model, device_num=8, batch_size=8, seq_len=8, materialised_attention="yes")
    with pytest.raises(ValueError, match="platform='npu'"):
        dataclasses.replace(get_profile("h100"), platform="npu")
    with pytest.raises(ValueError, match="flash_max_head_dim"):
        dataclasses.replace(get_profile("h100"), flash_max_head_dim=0)

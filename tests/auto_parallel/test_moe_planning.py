"""Planning mixtures of experts from shapes: ``ep`` searched and priced (issue 39, item 4).

Each test asserts what the cost model's own numbers imply, not numbers copied from its
output: the published parameter totals of the named shapes, ``ep > 1`` chosen where the
replicated experts do not fit, ``ep = 1`` kept where the all-to-alls cost more than they
save, and the all-to-all bytes as the dispatch's buffers.
"""

from __future__ import annotations

import dataclasses

import pytest

from jfleet.auto_parallel.cost import cost_moe
from jfleet.auto_parallel.cost.cost_moe import moe_exchange_bytes
from jfleet.auto_parallel.match.moe_spec import MoESpec
from jfleet.auto_parallel.search.cluster_plan import Cluster, plan
from jfleet.auto_parallel.search.layouts import shape_problem
from jfleet.auto_parallel.search.model_shapes import MODEL_SHAPES, ModelShape, abstract_model

#: (total, active) parameters as published (module docstring of model_shapes: Mixtral
#: paper / Mistral's release, Qwen3 Technical Report Table 2), in billions.
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9),
    "mixtral-8x22b": (141, 39),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235, 22),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_named_moe_shapes_have_the_published_total_and_active_parameters(name):
    total, active = PUBLISHED[name]
    shape = MODEL_SHAPES[name]
    # within 2% of the published (rounded) figures: Qwen3-30B-A3B's 3.35B active (the
    # embedding and head counted) is published as 3.3B
    assert shape.params / 1e9 == pytest.approx(total, rel=0.02)
    assert shape.active_params / 1e9 == pytest.approx(active, rel=0.02)
    assert shape.active_params < shape.params / 3


def _small_moe(**moe) -> ModelShape:
    spec = dict(experts=8, top_k=2, expert_ffn=1024, layers=4) | moe
    return ModelShape(
        arch="llama", layers=4, width=256, heads=4, kv_heads=4, ffn=0, vocab=1024,
        seq_len=128, moe=MoESpec(**spec),
    )  # fmt: skip


def test_experts_that_do_not_fit_replicated_are_split_over_ep_and_the_plan_says_why():
    shape = _small_moe()
    # every device holds whole layers (no pipeline), experts whole over mp and, without
    # ZeRO, over the data ranks: only ep splits them
    p = plan(
        abstract_model(shape), (16, 128), Cluster(nodes=1, profile="h100",
                                                  memory_bytes=300e6),
        amp_level="O1", wide_search=False, zero_stage=0, pipeline=False,
    )  # fmt: skip
    best = p.chosen
    assert best.layout.ep > 1 and best.fits
    ep1 = [c for c in p.candidates if c.layout.ep == 1]
    assert ep1 and not any(c.fits for c in ep1)  # the cost model's own reason
    # the replicated experts' fp32 weights, gradients and Adam moments alone exceed it
    assert 16 * shape.moe.expert_params(shape.width) > 300e6
    assert best.time.expert_parallel > 0 and best.collectives.all_to_all > 0
    note = next(n for n in p.notes if n.startswith(f"ep{best.layout.ep} chosen"))
    assert f"{8 // best.layout.ep} of the 8 experts" in note and "does not fit" in note
    assert "within a node" in note
    assert "expert token exchange" in str(p)


def test_a_small_moe_keeps_ep1_where_the_all_to_all_costs_more_than_it_saves(monkeypatch):
    # balanced routing: ep costs nothing but its all-to-alls (and saves gradient bytes)
    monkeypatch.setattr(cost_moe, "LOAD_IMBALANCE", 1.0)
    shape = _small_moe(expert_ffn=64)  # small experts, many tokens: little to split
    p = plan(
        abstract_model(shape), (512, 128), Cluster(nodes=2, profile="h100"), amp_level="O1",
        wide_search=False, zero_stage=0, pipeline=False,
    )  # fmt: skip
    assert p.chosen.layout.ep == 1
    other = next(c for c in p.candidates if c.layout.ep > 1 and c.fits)  # searched, fits
    # slower by its all-to-alls: without them it would be as fast or faster
    assert other.time.expert_parallel > 0 and other.reason.endswith("expert token exchange time")
    assert other.time.total - other.time.expert_parallel <= p.chosen.time.total * (1 + 1e-9)
    assert any(n.startswith("ep1 chosen") for n in p.notes)


def test_the_all_to_all_bytes_are_the_dispatch_buffers_four_times_a_layer_and_call():
    shape = _small_moe(capacity_factor=1.25)
    p = plan(
        abstract_model(shape), (64, 128), Cluster(nodes=1, profile="h100"), amp_level="O1",
        force_mesh={"dp": 2, "ep": 4}, zero_stage=0, accumulate_steps=2,
    )  # fmt: skip
    c = p.chosen
    tokens = 64 * 128 // 8 // 2  # a device's tokens a call (ep is a data axis)
    buffer = moe_exchange_bytes(
        tokens=tokens, width=256, k=2, experts=8, capacity_factor=1.25, act_bytes=2,
        ragged=True, imbalance=min(cost_moe.LOAD_IMBALANCE, 1.25),
    )  # fmt: skip
    assert c.collectives.all_to_all == 4 * 4 * 2 * buffer  # 4 a layer, 4 layers, 2 calls


def test_ep_needs_experts_and_must_divide_them():
    dense = dataclasses.replace(_small_moe(), moe=None, ffn=512)
    from jfleet.auto_parallel.cost.layout import Workload
    from jfleet.auto_parallel.match.patterns import match_patterns

    work = Workload(batch_size=16, seq_len=128)
    found = match_patterns(abstract_model(dense))
    assert "needs routed experts" in shape_problem(found, work, {"ep": 2}, 8)
    moe = dataclasses.replace(found, moe=MoESpec(experts=6, top_k=2, expert_ffn=64, layers=4))
    assert "does not divide the 6 experts" in shape_problem(moe, work, {"ep": 4}, 8)
    assert shape_problem(moe, work, {"ep": 2, "dp": 4}, 8) is None
    with pytest.raises(ValueError, match="ffn=0 must be an int >= 1"):
        dataclasses.replace(dense, ffn=0)

"""How much work a wide search does (issue 37: planning a published row in <= 10 s).

Counted, not timed: planning a 14-block GPT on 4 nodes of 8 (uneven pipeline splits, every
``v``, accumulation, ZeRO) must take each expensive step once a mesh or degree, not once a
layout. The wide search prices thousands of layouts, most of a mesh differing only in
micro-batches, ``v`` or accumulation; these counts grew with the layouts before (the 1T row
of ``benchmarks/published_configs.py`` built 148,417 step shapes and summed its parameter
bytes 36,836 times for 3,088 meshes and ZeRO settings).
"""

from __future__ import annotations

import dataclasses
import gc

import pytest

from jfleet.auto_parallel.cost import cost_comm, cost_memory, cost_model, cost_moe, step_shape
from jfleet.auto_parallel.cost import layout as layout_module
from jfleet.auto_parallel.cost.cost_types import Candidate, Collectives, Memory, StepTime
from jfleet.auto_parallel.cost.layout import Layout, Workload
from jfleet.auto_parallel.match.matched import ModelPatterns, ParamInfo
from jfleet.auto_parallel.match.moe_spec import MoESpec
from jfleet.auto_parallel.match.patterns import match_patterns
from jfleet.auto_parallel.search import planner
from jfleet.auto_parallel.search.cluster_plan import Cluster, plan
from jfleet.auto_parallel.search.model_shapes import ModelShape, abstract_model

SHAPE = ModelShape(
    arch="gpt", layers=14, width=512, heads=8, kv_heads=8, ffn=2048, vocab=4096, seq_len=512
)
BATCH = (96, 512)
CLUSTER = Cluster(nodes=4, devices_per_node=8, profile="a100")


class _Counter:
    """Wraps ``owner.name``, counting calls (and keeping what it was asked with)."""

    def __init__(self, monkeypatch, owner, name):
        self.calls, self.args = 0, []
        inner = getattr(owner, name)

        def counted(*args, **kwargs):
            self.calls += 1
            self.args.append(args)
            return inner(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


@pytest.fixture(scope="module")
def model():
    return abstract_model(SHAPE)


@pytest.fixture
def counted(monkeypatch, model):
    """Plans SHAPE (wide search) with the expensive steps counted; returns the counters,
    the layouts priced and the plan."""
    counters = {
        "stage_bytes": _Counter(monkeypatch, step_shape, "_stage_bytes"),
        "per_layer": _Counter(monkeypatch, cost_memory, "_per_layer_elems"),
        "efficiency": _Counter(monkeypatch, cost_model, "matmul_efficiency"),
        "replicated_at": _Counter(monkeypatch, ModelPatterns, "replicated_at"),
        "init": _Counter(monkeypatch, step_shape.StepShape, "__init__"),
        **{
            f"init_{cls.__name__}": _Counter(monkeypatch, cls, "__init__")
            for cls in (Candidate, Memory, StepTime, Collectives)
        },
        "estimate": _Counter(monkeypatch, planner, "estimate"),
        "reduction": _Counter(monkeypatch, cost_comm, "_one_call_reduction"),
    }
    result = plan(model, BATCH, CLUSTER, patterns=match_patterns(model))
    layouts = [args[2] for args in counters["estimate"].args]
    return counters, layouts, result


def _stage_blocks(lay: Layout) -> int:
    return step_shape.largest_stage_blocks(SHAPE.layers, 1, lay.pp, lay.num_virtual_stages)


def test_the_search_is_wide_and_uneven(counted):
    """The shape this file counts on: thousands of layouts, uneven splits of a mesh."""
    _, layouts, result = counted
    assert len(layouts) > 3000
    meshes = {tuple(lay.degrees.values()) for lay in layouts}
    assert len(layouts) > 10 * len(meshes)
    sizes = {(tuple(lay.degrees.values()), _stage_blocks(lay)) for lay in layouts}
    assert len(sizes) > 2 * len(meshes)  # uneven VPP: a mesh holds stages of many sizes
    assert result.chosen.fits


def test_parameter_bytes_once_a_mesh_and_zero_setting(counted):
    """A stage's parameter bytes are summed (block 0 and the rest) once a mesh and
    whether ZeRO splits them, whatever the stage's size, micro-batches or ZeRO stage."""
    counters, layouts, _ = counted
    keys = {(tuple(lay.degrees.values()), lay.zero_stage > 0, lay.zero_spans_data)
            for lay in layouts}  # fmt: skip
    assert counters["stage_bytes"].calls <= 2 * len(keys)


def test_gradient_reduction_once_a_mesh_zero_setting_and_stage(counted):
    """A call's gradient reduction and ZeRO gathers are priced once a mesh, ZeRO setting,
    stage size and whether recompute waits (the layouts of one differ in micro-batches,
    ``v`` or accumulation, which only repeat it)."""
    counters, layouts, _ = counted
    keys = {(tuple(lay.degrees.values()), lay.zero_stage, lay.zero_spans_data,
             _stage_blocks(lay)) for lay in layouts}  # fmt: skip
    assert counters["reduction"].calls <= 2 * len(keys) < len(layouts) / 4


def test_no_dataclass_init_per_layout(counted):
    """Each layout's StepShape and predictions (candidate, memory, time, collective bytes)
    are assembled (their frozen ``__init__`` was half the step's time, and a fifth of the
    estimate), with every field of the dataclass, in order; only the ranked candidates
    (``rank`` marks each) are built by ``__init__``."""
    counters, layouts, result = counted
    assert counters["init"].calls == 0
    for cls in (Memory, StepTime, Collectives):
        assert counters[f"init_{cls.__name__}"].calls == 0
    assert counters["init_Candidate"].calls <= len(result.candidates) < len(layouts) / 10
    work = Workload(batch_size=BATCH[0], seq_len=BATCH[1], dtype="bfloat16")
    found = match_patterns(abstract_model(SHAPE))
    s = step_shape.step_shape(found, work, layouts[-1], "a100", devices_per_node=8)
    assert set(vars(s)) == {f.name for f in dataclasses.fields(step_shape.StepShape)}
    c = cost_model.estimate(found, work, layouts[-1], "a100", devices_per_node=8)
    for made in (c, c.memory, c.time, c.collectives):
        assert list(vars(made)) == [f.name for f in dataclasses.fields(made)]


def test_model_terms_once_a_degree(counted):
    """What depends on the model and ``mp`` (or the micro-batch) only is derived once for
    it: the per-layer activations, the matmul efficiency, and which kernels ``mp`` leaves
    whole (the shape check of every mesh)."""
    counters, layouts, _ = counted
    mps = {lay.mp for lay in layouts}
    assert counters["per_layer"].calls <= len(mps)
    assert counters["replicated_at"].calls <= 3  # mp 2, 4 and 8
    tokens = {lay: BATCH[0] // lay.data_degree * (BATCH[1] // lay.sep) for lay in layouts}
    micro = {(lay.mp, n // (lay.num_microbatches * lay.accumulate_steps))
             for lay, n in tokens.items()}  # fmt: skip
    assert counters["efficiency"].calls <= len(micro)
    assert counters["estimate"].calls == len(layouts)


def test_no_cycle_collection_while_pricing(monkeypatch, model):
    """Python's cyclic collector is paused while the layouts are priced (its collections,
    set off by the search's allocations, scanned every live object: a quarter of the 1T
    row's planning) and left as it was after, on or off."""
    seen = []
    inner = planner.estimate

    def noting(*args, **kwargs):
        seen.append(gc.isenabled())
        return inner(*args, **kwargs)

    monkeypatch.setattr(planner, "estimate", noting)
    assert gc.isenabled()
    plan(model, BATCH, CLUSTER, patterns=match_patterns(model))
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        plan(model, BATCH, CLUSTER, patterns=match_patterns(model), force_mesh={"dp": 32})
        assert not gc.isenabled()
    finally:
        gc.enable()


#: A shape-built mixture of experts: the wide search multiplies its meshes by ``ep``.
MOE_SHAPE = ModelShape(
    arch="llama", layers=8, width=256, heads=4, kv_heads=4, ffn=0, vocab=1024, seq_len=128,
    moe=MoESpec(experts=8, top_k=2, expert_ffn=512, layers=8),
)  # fmt: skip


def test_expert_terms_once_a_model_stage_size_and_ep(monkeypatch):
    """The routed experts' terms read the model's parameters once (the experts' dtype, the
    largest block kernel's: it scanned every parameter several times a layout, 82% of
    planning Qwen3-235B-A22B on 256 GPUs) and their per-device elements once a stage size
    and ``ep``, not once a layout."""
    reads = {"size": 0}
    size = ParamInfo.size

    def counted_size(p):
        reads["size"] += 1
        return size.fget(p)

    model = abstract_model(MOE_SHAPE)
    found = match_patterns(model)
    elems = _Counter(monkeypatch, cost_moe, "_stage_experts_of")
    reductions = _Counter(monkeypatch, cost_moe, "_one_call_expert_reduction")
    checks = _Counter(monkeypatch, layout_module, "_count_ok")
    exchanges = _Counter(monkeypatch, cost_moe, "_one_exchange")
    estimates = _Counter(monkeypatch, planner, "estimate")
    monkeypatch.setattr(ParamInfo, "size", property(counted_size))
    result = plan(model, (64, 128), CLUSTER, patterns=found, wide_search=True)
    layouts = [args[2] for args in estimates.args]
    assert len(layouts) > 1000 and len({lay.ep for lay in layouts}) == 4  # ep 1, 2, 4, 8
    assert result.chosen.fits
    # the stage's blocks and ep decide the experts' elements
    stages = {(_moe_stage_blocks(lay), lay.ep) for lay in layouts}
    assert elems.calls <= len(stages) < len(layouts) / 10
    # a call's expert reduction once a mesh, ZeRO setting and stage size; a call's
    # all-to-alls once a mesh and micro-batch size
    zeros = {(tuple(lay.degrees.values()), lay.zero_stage, lay.zero_spans_data,
              _moe_stage_blocks(lay)) for lay in layouts}  # fmt: skip
    assert reductions.calls <= len(zeros) < len(layouts) / 4
    tokens = {(tuple(lay.degrees.values()), _moe_tokens_mb(lay)) for lay in layouts if lay.ep > 1}
    assert 0 < exchanges.calls <= len(tokens) < len(layouts) / 4
    # every layout, ep > 1 too, passes Layout's checks at once, not one count at a time
    # (counted: the Workload's batch and sequence, once)
    assert checks.calls == 2
    # a parameter's size is read a bounded number of times whatever the layouts' count
    assert reads["size"] <= 10 * len(found.params) < len(layouts)


def _moe_stage_blocks(lay: Layout) -> int:
    return step_shape.largest_stage_blocks(MOE_SHAPE.layers, 1, lay.pp, lay.num_virtual_stages)


def _moe_tokens_mb(lay: Layout) -> int:
    local = 64 // lay.data_degree * (MOE_SHAPE.seq_len // lay.sep)
    return local // (lay.num_microbatches * lay.accumulate_steps)

"""to_distributed runs the planner's gradient accumulation and selective recompute.

Accumulation (``Layout.accumulate_steps``): the loader yields each batch as ``k`` slices
and the strategy's gradient merge makes one update of them, so 10 Adam updates equal one
device's on the whole batches. Selective recompute (``recompute="selective"``): each
block keeps its weight-matmul outputs and recomputes the rest; values and gradients are
those of no recompute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import DistributedStrategy, fleet, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, match_patterns, plan_for
from jfleet.auto_parallel.apply.scanned_blocks import ScannedBlocks
from jfleet.auto_parallel.cost.layout import Workload
from jfleet.auto_parallel.search.layouts import enumerate_layouts
from jfleet.auto_parallel.to_distributed import to_distributed
from jfleet.mesh import context
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.testing import assert_trains_like_one_device

STEPS = 10


def llama() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2)


@pytest.mark.parametrize(
    ("mesh", "zero", "k", "optimizer"),
    [
        ({"sharding": 8}, 3, 2, "sgd"),
        ({"dp": 2, "sharding": 4}, 2, 2, "adam"),
        ({"dp": 2, "mp": 4}, None, 2, "adam"),
        ({"dp": 2, "sharding": 2, "mp": 2}, 2, 4, "adam"),
        ({"dp": 2, "pp": 2, "mp": 2}, None, 2, "adam"),
        ({"dp": 2, "sharding": 2, "mp": 2}, 2, 4, "sgd"),
        ({"dp": 2, "pp": 2, "mp": 2}, None, 2, "sgd"),
    ],
    ids=[
        "sgd-zero3-sharding8-accumulate2-merged-in-backward",
        "zero2-dp2-sharding4-accumulate2-merged-in-backward",
        "dp2-mp4-accumulate2",
        "zero2-dp2-sharding2-mp2-accumulate4",
        "dp2-pp2-mp2-accumulate2",
        "sgd-zero2-dp2-sharding2-mp2-accumulate4",
        "sgd-dp2-pp2-mp2-accumulate2",
    ],
)
def test_an_accumulating_plan_trains_like_one_device(mesh, zero, k, optimizer):
    """10 updates, each of k calls on a slice of the batch (a pipeline: each call runs
    M = 2 micro-batches), against one device on the whole batches (fp32: losses and
    parameters within 1e-5 (1 + log2 8)). Adam is almost blind to a gradient's scale; SGD
    is not, so the SGD runs tell k slices' summed gradients from their mean (issue 40)."""
    microbatches = 2 if mesh.get("pp", 1) > 1 else None
    config = ToDistributedConfig(
        force_mesh=mesh, zero_stage=zero, accumulate_steps=k, num_microbatches=microbatches,
        recompute=True if "sharding" in mesh and "mp" not in mesh else None,
    )  # fmt: skip
    tx = optax.adam(1e-2) if optimizer == "adam" else optax.sgd(0.5)
    assert_trains_like_one_device(llama, tx, lm_batches(STEPS), loss_fn=lm_loss, layout=config)
    plan = get_plan_of_last_run(config)
    assert plan.layout.accumulate_steps == k
    assert f"accumulate {k}" in plan.layout.name and f"| accumulate {k}" in str(plan)


def get_plan_of_last_run(config: ToDistributedConfig, batches=None):
    """The plan of a fresh run with ``config`` (planning is deterministic)."""
    fleet._fleet._reset()
    batches = lm_batches(1) if batches is None else batches[:1]
    model, _, _ = to_distributed(llama(), optax.adam(1e-2), batches, config=config)
    return get_plan(model)


def test_the_loader_yields_k_slices_and_the_optimizer_merges_them():
    config = ToDistributedConfig(force_mesh={"dp": 8}, accumulate_steps=2)
    batches = lm_batches(2)
    model, opt, loader = to_distributed(llama(), optax.sgd(0.1), batches, config=config)
    calls = list(loader)
    got = [np.asarray(b["tokens"]) for b in calls]
    assert len(loader) == 4 and [g.shape for g in got] == [(8, 8)] * 4
    np.testing.assert_array_equal(np.concatenate(got[:2]), batches[0]["tokens"])
    params = lambda: jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))  # noqa: E731
    before = params()
    step = make_train_step(lm_loss)
    step(model, opt, calls[0])  # one call of two: no update yet
    assert all(np.array_equal(a, b) for a, b in zip(before, params(), strict=True))
    step(model, opt, calls[1])  # the second: one update on both slices' gradients
    assert not all(np.array_equal(a, b) for a, b in zip(before, params(), strict=True))


def test_the_loader_state_names_the_slices_of_an_unfinished_batch():
    config = ToDistributedConfig(force_mesh={"dp": 8}, accumulate_steps=2)
    _, _, loader = to_distributed(llama(), optax.sgd(0.1), lm_batches(3), config=config)
    it = iter(loader)
    next(it)
    assert loader.state() == {"batches": 0, "slices": 1}
    next(it)
    assert loader.state() == {"batches": 1}
    loader.restore({"batches": 1, "slices": 1})
    rest = [np.asarray(b["tokens"]) for b in loader]
    np.testing.assert_array_equal(np.concatenate(rest), lm_batches(3)[1]["tokens"][8:].tolist()
                                  + lm_batches(3)[2]["tokens"].tolist())  # fmt: skip


def test_accumulation_is_chosen_when_nothing_fits_without_it():
    """The narrow search offers accumulation only when no layout fits the budget."""
    model = llama()
    args = dict(device_num=8, batch_size=64, seq_len=64, force_mesh={"dp": 8})
    plain = plan_for(model, **args)
    assert plain.layout.accumulate_steps == 1
    tight = plain.chosen.memory.total - plain.chosen.memory.activations // 3
    plan = plan_for(model, **args, memory_budget=tight, recompute=False)
    assert plan.layout.accumulate_steps > 1 and plan.chosen.fits
    assert plan.chosen.memory.total <= tight < plain.chosen.memory.total


def test_accumulation_errors_name_the_value_and_the_fix():
    strategy = DistributedStrategy()
    strategy.gradient_merge = True
    config = ToDistributedConfig(force_mesh={"dp": 8}, accumulate_steps=2, strategy=strategy)
    with pytest.raises(ValueError, match="accumulate_steps=2 with a strategy whose"):
        to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)
    config = ToDistributedConfig(force_mesh={"dp": 8}, accumulate_steps=3)
    with pytest.raises(ValueError, match="accumulate_steps=3 does not divide the 2 sequences"):
        to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)


def test_a_user_gradient_merge_keeps_the_search_from_accumulating():
    strategy = DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2}
    config = ToDistributedConfig(wide_search=True, strategy=strategy, memory_budget=2**40)
    model, _, loader = to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)
    assert get_plan(model).layout.accumulate_steps == 1 and len(loader) == 1


# ------------------------------------------------------------------ selective recompute
def test_selective_recompute_trains_like_one_device():
    config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4}, recompute="selective")
    assert_trains_like_one_device(
        llama, optax.adam(1e-2), lm_batches(STEPS), loss_fn=lm_loss, layout=config
    )
    plan = get_plan_of_last_run(config)
    assert plan.layout.selective_recompute and not plan.recompute
    assert "selective recompute" in str(plan)


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_selective_recompute_gives_the_values_and_gradients_of_none(scan):
    """The same blocks with and without selective recompute: loss and every gradient
    equal. What the selective program recomputes (the attention cores, nothing else) is
    counted in ``test_scanned_blocks.py::test_selective_recompute_recomputes_the_attention_
    core_and_nothing_else``."""
    batch = lm_batches(1)[0]

    def run(recompute):
        fleet._fleet._reset()
        config = ToDistributedConfig(force_mesh={"dp": 8}, recompute=recompute, scan_layers=scan)
        model, _, loader = to_distributed(llama(), optax.sgd(0.1), [batch], config=config)
        assert isinstance(model.layers, ScannedBlocks) == scan
        b = next(iter(loader))
        loss, grads = nnx.jit(nnx.value_and_grad(lm_loss))(model, b)  # eager: 3x slower
        return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))

    want_loss, want = run(False)
    got_loss, got = run("selective")
    assert got_loss == pytest.approx(want_loss, rel=1e-6)
    flat_want, flat_got = jax.tree.leaves(want), jax.tree.leaves(got)
    assert len(flat_got) == len(flat_want)
    for g, w in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_the_wide_search_offers_selective_recompute_with_and_without_a_pipeline():
    """Selective recompute is searched wide, with or without a pipeline, never with
    whole-block recompute; forced on a pipeline, under both one-chunk schedules."""
    found = match_patterns(llama())
    work = Workload(batch_size=16, seq_len=8)
    narrow, _ = enumerate_layouts(found, work, device_num=8)
    wide, _ = enumerate_layouts(found, work, device_num=8, wide=True)
    assert not any(lay.selective_recompute for lay in narrow)
    selective = [lay for lay in wide if lay.selective_recompute]
    assert selective and not any(lay.recompute for lay in selective)
    assert {lay.pp > 1 for lay in selective} == {False, True}
    forced, _ = enumerate_layouts(
        found, work, device_num=8, recompute="selective", force_mesh={"dp": 4, "pp": 2}
    )
    assert {lay.schedule for lay in forced} == {"FThenB", "1F1B"}


def test_selective_recompute_is_predicted_between_none_and_full():
    """Memory: selective below no recompute (scanned blocks, seq 256: the s x s scores
    dominate what no recompute keeps); time: none < selective < full (the attention
    core's FLOPs again, vs the whole forward)."""
    from jfleet.auto_parallel.cost.cost_model import estimate
    from jfleet.auto_parallel.cost.layout import Layout

    found = match_patterns(llama(), jnp.zeros((2, 8), jnp.int32))
    work = Workload(batch_size=16, seq_len=256)
    none, sel, full = (
        estimate(found, work, Layout(dp=8, **kw), "h100", devices_per_node=8)
        for kw in ({}, {"selective_recompute": True}, {"recompute": True})
    )
    assert none.memory.activations > sel.memory.activations
    assert none.time.compute < sel.time.compute < full.time.compute
    assert none.flops < sel.flops < full.flops


def test_the_wide_search_runs_through_to_distributed_under_a_tight_budget():
    """ToDistributedConfig(wide_search=True) on dp8 with a budget the plain dp8 step
    exceeds: the pick saves memory (accumulation, selective or full recompute) and
    trains like one device."""
    mesh, batches = {"dp": 8}, lm_batches(STEPS, seq=64)
    plain = get_plan_of_last_run(ToDistributedConfig(force_mesh=mesh), batches).chosen.memory
    budget = plain.total - plain.activations // 3
    config = ToDistributedConfig(force_mesh=mesh, wide_search=True, memory_budget=budget)
    assert_trains_like_one_device(llama, optax.adam(1e-2), batches, loss_fn=lm_loss, layout=config)
    lay = get_plan_of_last_run(config, batches).layout
    assert lay.accumulate_steps > 1 or lay.selective_recompute or lay.recompute, lay.name


def test_the_wide_search_offers_sep_with_selective_recompute_and_accumulation():
    """sep meshes are searched under sequence parallelism (where sep divides the
    sequence), wide or narrow; the wide search crosses them with accumulation."""
    plan = plan_for(
        llama(), device_num=8, batch_size=16, seq_len=64, wide_search=True,
        sequence_parallel=True,
    )  # fmt: skip
    seps = [c.layout for c in plan.candidates if c.layout.sep > 1]
    assert seps and any(lay.accumulate_steps > 1 for lay in seps)
    found = match_patterns(llama())
    odd = Workload(batch_size=16, seq_len=6, sequence_parallel=True)
    layouts, excluded = enumerate_layouts(found, odd, device_num=8, wide=True)
    assert {lay.sep for lay in layouts} == {1, 2}  # 6 tokens: sep 4 and 8 do not divide
    assert ("sep4 x mp2", "sep=4 does not divide seq_len=6") in excluded


def test_a_stored_accumulating_plan_is_reproduced():
    first = get_plan_of_last_run(ToDistributedConfig(force_mesh={"dp": 8}, accumulate_steps=2))
    fleet._fleet._reset()
    again = ToDistributedConfig(plan=first.to_json())
    model, _, loader = to_distributed(llama(), optax.sgd(0.1), lm_batches(3), config=again)
    assert get_plan(model) == first and len(loader) == 6
    fleet._fleet._reset()
    strategy = DistributedStrategy()
    strategy.gradient_merge = True
    merged = ToDistributedConfig(plan=first.to_json(), strategy=strategy)
    with pytest.raises(ValueError, match="already has gradient_merge on"):
        to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=merged)


def test_a_later_call_plans_from_the_users_strategy_not_the_earlier_plans():
    """A second ``to_distributed`` in one process (a notebook re-run) once took the first
    call's adapted strategy for the user's: after an accumulating plan, a plan without
    accumulation still merged 2 steps' gradients (and a second accumulating plan was an
    error naming a gradient merge the user never set)."""
    fleet._fleet._reset()
    mesh = {"dp": 8}
    first = ToDistributedConfig(force_mesh=mesh, accumulate_steps=2)
    to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=first)
    config = ToDistributedConfig(force_mesh=mesh)
    model, opt, loader = to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)
    assert get_plan(model).layout.accumulate_steps == 1
    assert not context.current().strategy.gradient_merge
    before = np.asarray(model.lm_head[...])
    make_train_step(lm_loss)(model, opt, next(iter(loader)))
    assert not np.allclose(np.asarray(model.lm_head[...]), before)  # updated at once
    again, _, _ = to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=first)
    assert get_plan(again).layout.accumulate_steps == 2

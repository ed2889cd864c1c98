"""Interleaved (VPP) and zero-bubble (ZB-H1) pipelines: tables, executor, PipelineLayer.

The tables are checked structurally (every op once after its inputs, bubble ticks against
the published formulas, stash bounded by the stages); the executor and the PipelineLayer
against the same computation run sequentially on one device (fp32).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfleet import fleet
from jfleet.checkpoint.layout import logical_leaves, running_values
from jfleet.parallel import pipeline_table as tables
from jfleet.parallel.pipeline_executor import table_pipeline_loss
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
from jfleet.parallel.virtual_stages import layer_order_params
from jfleet.testing import assert_trees_close
from jfleet.testing.hlo import executed_flops, summarize

from .test_pipeline_layer import ce, gpt_descs
from .test_pipeline_parallel import (
    FP32,
    as_tinygpt,
    batches,
    fp32_reference,
    pipeline_strategy,
    sgd,
)


# ------------------------------------------------------------------ tables
@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("p", [2, 4])
def test_tables_bubble_matches_the_published_formulas(p, m):
    one = tables.schedule_stats(tables.schedule_table("1F1B", p, m))
    assert one["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    for v in (2, 3):
        vpp = tables.schedule_stats(tables.schedule_table("VPP", p, m, v))
        assert vpp["bubble_fraction"] == pytest.approx((p - 1) / (v * m + p - 1))
        assert vpp["ticks"] == 3 * (v * m + p - 1)  # unit ticks: F, BI, W one each, B two
    zb = tables.schedule_stats(tables.schedule_table("ZBH1", p, m))
    assert zb["idle_per_stage"] == [p - 1] * p  # (P - 1)(T_F + T_B - T_W), unit costs
    assert 3 * zb["bubble_ticks"] <= one["bubble_ticks"]


def test_zbh1_bubble_is_a_third_of_1f1b_at_p4_m8():
    one = tables.schedule_stats(tables.schedule_table("1F1B", 4, 8))
    zb = tables.schedule_stats(tables.schedule_table("ZBH1", 4, 8))
    assert one["bubble_ticks"] == 9 and zb["bubble_ticks"] == 3
    assert zb["bubble_fraction"] < one["bubble_fraction"] / 2


@pytest.mark.parametrize(("schedule", "v"), [("1F1B", 1), ("VPP", 2), ("ZBH1", 1)])
def test_tables_run_every_op_once_after_its_inputs_with_a_stash_bounded_by_stages(schedule, v):
    stash = []
    for m in (4, 8, 32):
        table = tables.schedule_table(schedule, 4, m, v)
        tables.check_table(table)
        ops = table.op[(table.op != tables.IDLE) & (table.op != tables.BUSY)]
        assert len(ops) == (3 if schedule == "ZBH1" else 2) * 4 * v * m
        stash.append(tables.schedule_stats(table)["stash_slots"])
    assert stash[1] == stash[2]  # M = 8 and M = 32 hold as many micro-batches
    # swapping a forward and the backward that reads it must be caught
    table = tables.schedule_table(schedule, 4, 8, v)
    arrays = {name: getattr(table, name).copy() for name in ("op", "mb", "chunk")}
    t_f = int(np.argmax(arrays["op"][:, 0] == tables.F))
    t_b = int(np.argmax(np.isin(arrays["op"][:, 0], (tables.B, tables.BI))))
    for a in arrays.values():
        a[[t_f, t_b], 0] = a[[t_b, t_f], 0]
    with pytest.raises(ValueError, match="reads|ops are wrong|busy"):
        tables.check_table(dataclasses.replace(table, **arrays))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("VPP", 4, 8, 1), r"'VPP' needs num_virtual >= 2 .*got 1"),
        (("VPP", 4, 6, 2), r"multiple of num_stages \(got M=6, P=4\)"),
        (("ZBH1", 4, 8, 2), r"'ZBH1' runs one chunk per device; got num_virtual=2"),
        (("GPipe", 4, 8, 1), r"schedule='GPipe' has no table"),
        (("1F1B", 0, 8, 1), r"num_stages=0 must be an integer >= 1"),
    ],
)
def test_table_arguments_are_checked(args, message):
    with pytest.raises(ValueError, match=message):
        tables.schedule_table(*args)


# ------------------------------------------------------------------ executor
WIDTH, MB = 8, 2


def stage_fn(w, x, side, shared):
    """Two layers in a scan, as a stacked chunk runs them."""

    def layer(h, wk):
        k, b = wk
        return jnp.tanh(h @ k + b) * side[:, None] + shared, None

    return jax.lax.scan(layer, x, (w["k"], w["b"]))[0]


def head_fn(h, y, t):
    return jnp.mean((y @ h - t) ** 2)


def sequential(w, h, x, t, side, m, p, v):
    """The same model on one device: virtual stage ``c P + s`` is ``w[s, c]``."""
    ws = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1).reshape(p * v, *a.shape[2:]), w)
    split = [a.reshape(2 * m, -1, *a.shape[1:]) for a in (x, side, t)]

    def one(xm, sm, tm):
        for k in range(p * v):
            xm = stage_fn(jax.tree.map(lambda a, k=k: a[k], ws), xm, sm, 0.1)
        return head_fn(h, xm, tm)

    return jnp.mean(jax.vmap(one)(*split))


@functools.cache
def executor_case(schedule: str, v: int, m: int):
    """dp2 x pp4: compiled value-and-grad of the executor, its HLO and the reference."""
    mesh = jax.make_mesh((2, 4), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    rows = 2 * m * MB
    w = {
        "k": jax.random.normal(k[0], (4, v, 2, WIDTH, WIDTH)) * 0.5,
        "b": jax.random.normal(k[1], (4, v, 2, WIDTH)) * 0.1,
    }
    h, x = jax.random.normal(k[2], (WIDTH, WIDTH)), jax.random.normal(k[3], (rows, WIDTH))
    t, side = jnp.ones((rows, WIDTH)), jnp.linspace(0.5, 1.5, rows)

    def loss(w, h, x):
        return table_pipeline_loss(
            stage_fn, head_fn, w, h, x, t, side, jnp.float32(0.1), mesh=mesh,
            schedule=schedule, num_microbatches=m, num_virtual=v,
        )  # fmt: skip

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    compiled = step.lower(w, h, x).compile()
    want = jax.value_and_grad(sequential, argnums=(0, 1, 2))(w, h, x, t, side, m, 4, v)
    return compiled(w, h, x), want, compiled.as_text(), (loss, w, h, x)


@pytest.mark.parametrize(("schedule", "v"), [("VPP", 2), ("ZBH1", 1)])
def test_executor_equals_the_sequential_model(schedule, v):
    (loss, grads), (want_loss, want_grads), _, (f, w, h, x) = executor_case(schedule, v, 4)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    assert_trees_close(grads, want_grads, devices=4)  # 4 micro-batches summed in another order
    np.testing.assert_allclose(float(jax.jit(f)(w, h, x)), float(want_loss), rtol=1e-5)


@pytest.mark.parametrize(("schedule", "v"), [("VPP", 2), ("ZBH1", 1)])
def test_executor_collective_permutes_per_step_are_the_tables(schedule, v):
    *_, text, _ = executor_case(schedule, v, 4)
    stats = tables.schedule_stats(tables.schedule_table(schedule, 4, 4, v))
    assert summarize(text)["collective-permute"].count == stats["collective_permutes"]


@pytest.mark.parametrize(("schedule", "v"), [("VPP", 2), ("ZBH1", 1)])
def test_executed_dot_flops_are_the_schedules_ideal_with_its_recompute(schedule, v):
    *_, text, _ = executor_case(schedule, v, 4)
    table = tables.schedule_table(schedule, 4, 4, v)
    work = tables.schedule_stats(table)["work_per_stage"]
    forward = 2 * 2 * MB * WIDTH * WIDTH  # one chunk (two layers), one micro-batch: h @ k
    head = 3 * 2 * MB * WIDTH * WIDTH  # y @ h, its cotangent and weight gradient, last chunk
    for device in range(4):
        got = executed_flops(text, tables.taken_branches(table, device))
        want = work[device] * forward + (head * 4 if device == 3 else 0)
        assert got == pytest.approx(want, rel=0.05), device


# ------------------------------------------------------------------ PipelineLayer
BLOCKS = "layer:GPTBlock"


def test_virtual_stages_hold_chunks_interleaved_and_compute_the_same_model():
    plain = PipelineLayer(gpt_descs(), num_stages=2, loss_fn=ce, seed=0)
    inter = PipelineLayer(gpt_descs(), num_stages=2, loss_fn=ce, seed=0, seg_method=BLOCKS,
                          num_virtual_pipeline_stages=2)  # fmt: skip
    assert inter.get_num_virtual_stages() == 2 and plain.get_num_virtual_stages() == 1
    assert inter.segment_parts == (0, 2, 3, 4, 7)  # embed+block, block, block, block+post
    # layers 1..4 are blocks 0..3: chunk k on stage k % 2
    assert [inter.get_stage_from_index(i) for i in range(7)] == [0, 0, 1, 0, 1, 1, 1]
    # device 0 holds blocks 0 and 2, device 1 blocks 1 and 3 (stacked index (s, c))
    leaves = [jax.tree.leaves(nnx.state(model.body)) for model in (inter, plain)]
    pairs = zip(*leaves, strict=True)
    for a, b in pairs:  # plain: [2, 2, ...], device s, unit j = block 2s + j
        for (s, j), block in {(0, 0): 0, (0, 1): 2, (1, 0): 1, (1, 1): 3}.items():
            np.testing.assert_array_equal(a[s, j], b[block // 2, block % 2])
    for a, b in zip(inter.parameters(), plain.parameters(), strict=True):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    tokens = jnp.arange(12).reshape(3, 4) % 32
    assert_trees_close(inter(tokens), plain(tokens))  # the same blocks in another loop
    # the checkpoint layout: layer i <-> its stacked index, the same leaves as v = 1
    want = logical_leaves(plain, plain)
    got = logical_leaves(inter, inter)
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)
    # checkpoints move between v = 2, v = 1 and one stage (models of another seed restored)
    for stages, v, leaves in ((2, 1, got), (1, 1, got), (2, 2, want)):
        other = PipelineLayer(gpt_descs(), num_stages=stages, seed=1, seg_method=BLOCKS,
                              num_virtual_pipeline_stages=v)  # fmt: skip
        running_values(other, other, leaves)
        for x, y in zip(other.parameters(), inter.parameters(), strict=True):  # layer order
            np.testing.assert_array_equal(np.asarray(x[...]), np.asarray(y[...]))


@pytest.mark.parametrize(("schedule", "v"), [("VPP", 2), ("ZBH1", 1)])
def test_pp2_dp4_trains_like_one_device(schedule, v):
    want_losses, want_params = fp32_reference()
    strategy = pipeline_strategy({"dp_degree": 4, "pp_degree": 2}, 1, 4, schedule)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = PipelineLayer(
        gpt_descs(), loss_fn=ce, seed=0, seg_method=BLOCKS, num_virtual_pipeline_stages=v
    )
    model = fleet.distributed_model(layer)
    assert model.schedule == schedule
    opt = fleet.distributed_optimizer(sgd())
    losses = [float(model.train_batch((b["tokens"], b["labels"]), opt)) for b in batches()]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    state = nnx.state(model.module, nnx.Param)
    # back to layer order (device s, chunk c holds block 2c + s), as [1, N, ...]
    ordered = layer_order_params(nnx.to_pure_dict(state["body"]), 2, v)
    nnx.replace_by_pure_dict(
        state["body"], jax.tree.map(lambda a: a.reshape(2, 2, *a.shape[1:]), ordered)
    )
    assert_trees_close(as_tinygpt(state), want_params, **FP32, check_dtypes=False)


@pytest.mark.parametrize(
    ("schedule", "v", "acc", "message"),
    [
        ("VPP", 1, 4, r"'VPP' \(interleaved stages\) needs a PipelineLayer with "
                      r"num_virtual_pipeline_stages >= 2"),
        ("FThenB", 2, 4, r"'FThenB' runs one chunk per stage.*num_virtual_pipeline_stages=2"),
        ("ZBH1", 2, 4, r"'ZBH1' runs one chunk per stage"),
        ("VPP", 2, 3, r"accumulate_steps \(micro-batches\)=3 is not a multiple of it: use 4"),
    ],
)  # fmt: skip
def test_schedule_and_virtual_stage_combinations_are_checked(schedule, v, acc, message):
    strategy = pipeline_strategy({"dp_degree": 4, "pp_degree": 2}, 1, acc, schedule)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = PipelineLayer(
        gpt_descs(), loss_fn=ce, seed=0, seg_method=BLOCKS, num_virtual_pipeline_stages=v
    )
    with pytest.raises(ValueError, match=message):
        fleet.distributed_model(layer)


def test_virtual_stages_need_a_stacked_body():
    # 3 blocks over 2 x 2 chunks now stack unevenly (chunks of 0, 1, 2, 0 blocks, padded)
    uneven = PipelineLayer(gpt_descs(blocks=3), num_stages=2, num_virtual_pipeline_stages=2)
    assert uneven.stages is None and uneven.chunk_sizes == (0, 1, 2, 0)
    unlike = [LayerDesc(nnx.Linear, 4, 8), LayerDesc(nnx.Linear, 8, 4)] * 2  # no run to stack
    with pytest.raises(ValueError, match=r"num_virtual_pipeline_stages=2 needs a stacked body"):
        PipelineLayer(unlike, num_stages=2, num_virtual_pipeline_stages=2)
    with pytest.raises(ValueError, match=r"num_virtual_pipeline_stages=0 must be None or an int"):
        PipelineLayer(gpt_descs(), num_stages=2, num_virtual_pipeline_stages=0)

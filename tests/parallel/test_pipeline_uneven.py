"""Uneven pipeline stages: ``pp`` need not divide the blocks.

The stacked body is padded to the largest stage and the padded slots are skipped exactly
(:func:`jfleet.parallel.stack.padded_stage`). Checked: 5 blocks on pp 2 and 7 blocks on
pp 4 with interleaved (VPP) stages train like one device, through the Fleet path
(``PipelineLayer`` + ``fleet.distributed_model``) and through ``to_distributed``; padded
slots get exactly zero gradient and are not checkpointed; the planner plans 70 blocks on
pp 12 as stages of 6 and 5 and charges the 6-block stage; bad splits are clear errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, plan_for
from jfleet.auto_parallel.apply.blocks import PipelinedBlocks
from jfleet.auto_parallel.search.model_shapes import ModelShape, abstract_model
from jfleet.auto_parallel.to_distributed import to_distributed
from jfleet.checkpoint.layout import logical_leaves, running_values
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.parallel import stack
from jfleet.parallel import virtual_stages as virtual
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
from jfleet.testing import assert_trees_close, train_one_device

from .test_pipeline_parallel import pipeline_strategy

STEPS = 3


class Block(nnx.Module):
    """A residual MLP block (width 8)."""

    def __init__(self, width: int, *, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(width, width, rngs=rngs)
        self.down = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jnp.tanh(self.up(x)))


def mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out - y) ** 2)


def descs(blocks: int) -> list:
    return (
        [LayerDesc(nnx.Linear, 4, 8)]
        + [LayerDesc(Block, 8)] * blocks
        + [LayerDesc(nnx.Linear, 8, 2)]
    )


def data() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32))
        for _ in range(STEPS)
    ]


def one_device(blocks: int) -> tuple[np.ndarray, dict]:
    """The same PipelineLayer (same seed) as one stage, trained on one device."""
    model = PipelineLayer(descs(blocks), num_stages=1, loss_fn=mse, seed=0)
    losses, _ = train_one_device(model, optax.adam(1e-2), data(), lambda m, b: m.loss(*b))
    return losses, logical_leaves(model, model)


# ------------------------------------------------------------------ the Fleet path
@pytest.mark.parametrize(
    ("blocks", "hybrid", "virtual_stages", "schedule", "sizes"),
    [
        (5, {"dp_degree": 4, "pp_degree": 2}, None, "1F1B", (2, 3)),
        (7, {"dp_degree": 2, "pp_degree": 4}, 2, "VPP", (0, 1, 1, 1, 1, 1, 1, 1)),
    ],
    ids=["5_blocks_pp2", "7_blocks_pp4_vpp2"],
)
def test_uneven_pipeline_layer_trains_like_one_device(
    blocks, hybrid, virtual_stages, schedule, sizes
):
    want_losses, want_params = one_device(blocks)
    micro = 16 // hybrid["dp_degree"] // 4  # 4 micro-batches of the replica's rows
    strategy = pipeline_strategy(hybrid, micro, 4, schedule)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = PipelineLayer(
        descs(blocks),
        loss_fn=mse,
        seed=0,
        seg_method="layer:Block",
        num_virtual_pipeline_stages=virtual_stages,
    )
    # Paddle's remainder rule (the extra blocks to the last stages), one stacked body
    assert layer.stages is None and layer.chunk_sizes == sizes
    padded = virtual.slot_units(sizes, hybrid["pp_degree"]) < 0
    first = np.asarray(layer.body.up.kernel[...])[padded]
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    losses = [float(model.train_batch(batch, opt)) for batch in data()]
    # Adam on exactly zero gradients leaves the padded slots as they were
    np.testing.assert_array_equal(np.asarray(layer.body.up.kernel[...])[padded], first)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got = logical_leaves(layer, layer)  # the real blocks only, under their own names
    assert sorted(got) == sorted(want_params)
    assert_trees_close(got, want_params, rtol=1e-5, atol=1e-5)


def test_padded_slots_get_exactly_zero_gradient_and_are_not_saved():
    mesh = jax.make_mesh(
        (4, 2, 1), ("dp", "pp", "sharding"), axis_types=(jax.sharding.AxisType.Auto,) * 3
    )
    layer = PipelineLayer(descs(5), num_stages=2, loss_fn=mse, seed=0, seg_method="layer:Block")
    layer.place(mesh)
    x, y = data()[0]
    grads = nnx.jit(
        lambda m: nnx.grad(lambda q: q.pipeline_loss(x, y, mesh=mesh, num_microbatches=2))(m)
    )(layer)
    padded = virtual.slot_units(layer.chunk_sizes, 2) < 0  # stage 0's third slot
    assert padded.tolist() == [[False, False, True], [False, False, False]]
    for leaf in jax.tree.leaves(nnx.to_pure_dict(grads)["body"]):
        leaf = np.asarray(leaf)
        assert np.all(leaf[padded] == 0)
        assert np.all(np.abs(leaf[~padded]).reshape(5, -1).max(axis=1) > 0)
    saved = logical_leaves(layer, layer)
    assert len([k for k in saved if k.endswith("up.kernel")]) == 5
    before = np.asarray(layer.body.up.kernel[...])
    layer.body.up.kernel[...] = jnp.zeros_like(before)
    running_values(layer, layer, saved)  # restored into the padded stack
    np.testing.assert_array_equal(np.asarray(layer.body.up.kernel[...]), before)


# ------------------------------------------------------------------ to_distributed
@pytest.mark.parametrize(
    ("layers", "config", "stage_sizes"),
    [
        (5, dict(force_mesh={"dp": 4, "pp": 2}, schedule="1F1B"), (3, 2)),
        (
            7,
            dict(
                force_mesh={"dp": 2, "pp": 4},
                schedule="VPP",
                num_virtual_pipeline_stages=2,
                num_microbatches=4,
            ),
            (2, 2, 2, 1),
        ),
    ],
    ids=["5_blocks_pp2", "7_blocks_pp4_vpp2"],
)
def test_to_distributed_uneven_stages_train_like_one_device(layers, config, stage_sizes):
    config = ToDistributedConfig(**config)
    make = lambda: TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=layers)  # noqa: E731
    plain = make()
    # SGD with momentum, not Adam: Adam turns the rounding noise of near-zero gradient
    # entries into steps of up to its learning rate, so parameters after Adam differ by
    # ~2e-4 in a few entries whatever the layout (the attention kernel's rounding alone
    # moved 1% of entries past 1e-5); SGD keeps every entry to fp32's rule
    tx = optax.sgd(0.1, momentum=0.9)
    model, opt, loader = to_distributed(make(), tx, lm_batches(STEPS), config=config)
    plan = get_plan(model)
    assert [len(s) for s in plan.stages] == list(stage_sizes)
    assert f"stages of {','.join(map(str, stage_sizes))} blocks" in str(plan)
    assert isinstance(model.layers, PipelinedBlocks) and model.layers.stage_sizes == stage_sizes
    step = make_train_step(lm_loss)
    step_losses = [float(step(model, opt, batch)) for batch in loader]
    want_losses, want = train_one_device(plain, tx, lm_batches(STEPS), lm_loss)
    np.testing.assert_allclose(step_losses, want_losses, rtol=1e-5, atol=1e-5)
    got = logical_leaves(model, model)
    want = logical_leaves(plain, plain)
    assert sorted(got) == sorted(want)
    assert_trees_close(got, want, devices=8)


# ------------------------------------------------------------------ the planner
def test_planner_splits_70_blocks_on_pp12_and_charges_the_6_block_stage():
    def shape(layers: int) -> nnx.Module:
        return abstract_model(
            ModelShape(arch="llama", layers=layers, width=64, heads=4, kv_heads=4, ffn=128,
                       vocab=128, seq_len=16)
        )  # fmt: skip

    kw = dict(device_num=12, batch_size=12, seq_len=16, schedule="1F1B", num_microbatches=12)
    plans = {n: plan_for(shape(n), force_mesh={"pp": 12}, **kw) for n in (60, 70, 72)}
    uneven = plans[70]
    assert [len(s) for s in uneven.stages] == [6] * 10 + [5] * 2
    assert "stages of 6,6,6,6,6,6,6,6,6,6,5,5 blocks" in str(uneven)
    # charged as the 6-block stage (72 blocks, 6 a stage), more than 5-block stages
    six, five = plans[72].chosen, plans[60].chosen
    for term in ("params", "optimizer", "grads", "activations", "total"):
        got = getattr(uneven.chosen.memory, term)
        assert got == pytest.approx(getattr(six.memory, term), rel=1e-9), term
    assert uneven.chosen.memory.total > five.memory.total
    assert uneven.chosen.time.compute == pytest.approx(six.time.compute, rel=1e-9)
    assert uneven.chosen.time.compute > five.time.compute


# ------------------------------------------------------------------ errors
def test_bad_splits_are_clear_errors():
    layers = [nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(5)]
    with pytest.raises(ValueError, match=r"stage sizes \[4, 2\] sum to 6, not the 5 "):
        stack.stack_layers(layers, 2, chunk_sizes=(4, 2))
    with pytest.raises(
        ValueError, match=r"stage sizes \[5, 0\] leave pipeline stage\(s\) \[1\] with 0"
    ):
        stack.stack_layers(layers, 2, chunk_sizes=(5, 0))
    with pytest.raises(ValueError, match=r"stage sizes \[5\] must be 2 ints >= 0.*e.g. \[3, 2\]"):
        virtual.check_sizes([5], 5, 2)
    with pytest.raises(ValueError, match=r"use pp <= 5"):
        virtual.check_sizes(None, 5, 6)
    mesh = jax.make_mesh((4, 2), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match=r"stage sizes \[4, 2\] sum to 6, not the 5 Linear"):
        PipelinedBlocks(layers, mesh=mesh, num_microbatches=2, stage_sizes=[4, 2])
    # explicit seg_method boundaries (Paddle's): 3 and 2 blocks, one padded stacked body
    bounds = PipelineLayer(descs(5), num_stages=2, seg_method=[0, 4, 7], seed=0)
    assert bounds.chunk_sizes == (3, 2) and bounds.body.up.kernel.shape[:2] == (2, 3)
    with pytest.raises(ValueError, match=r"pp=8 is more than the 2 blocks.*use pp <= 2"):
        plan_for(TinyLlama(layers=2), device_num=8, batch_size=8, seq_len=8, force_mesh={"pp": 8})

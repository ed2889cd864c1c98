"""Selective recompute in pipelines (issue 37, item 3).

Each stage stashes, per micro-batch, its input and its blocks' weight-matmul outputs and
recomputes only the attention cores and elementwise work, under FThenB and 1F1B alike
(one program), and under VPP per chunk (:mod:`jfleet.parallel.pipeline_forward`). It
trains like one device, the compiled step keeps less than without recompute and more than
with full recompute, and the planner offers it with ``pp > 1`` at a memory between the two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

from jfleet import make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, match_patterns
from jfleet.auto_parallel.apply.blocks import PipelinedBlocks, pipeline_blocks
from jfleet.auto_parallel.cost.cost_model import estimate
from jfleet.auto_parallel.cost.layout import Layout, Workload
from jfleet.auto_parallel.search.layouts import enumerate_layouts
from jfleet.auto_parallel.to_distributed import to_distributed
from jfleet.mesh.topology import DP, PP
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.parallel.pipeline_forward import pipeline_forward
from jfleet.testing import assert_trains_like_one_device
from tests.auto_parallel.test_to_distributed import llama

STEPS = 3


def selective_trainer(schedule: str):
    """``to_distributed`` on dp4 x pp2 with selective recompute; checks the stand-in runs it."""

    def trainer(model, optimizer, batches, loss_fn):
        config = ToDistributedConfig(
            force_mesh={"dp": 4, "pp": 2}, schedule=schedule, recompute="selective",
            num_microbatches=2,
        )  # fmt: skip
        placed, opt, loader = to_distributed(model, optimizer, batches, config=config)
        assert placed is model and get_plan(model).layout.selective_recompute
        assert isinstance(model.layers, PipelinedBlocks) and model.layers.selective
        step = make_train_step(loss_fn)
        return [float(step(model, opt, batch)) for batch in loader]

    return trainer


def deeper() -> TinyLlama:
    """Four blocks: two chunks of one block per stage under VPP (pp 2, v 2)."""
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=4)


@pytest.mark.parametrize(
    ("schedule", "model_fn"), [("FThenB", llama), ("1F1B", llama), ("VPP", deeper)]
)
def test_selective_recompute_in_a_pipeline_trains_like_one_device(schedule, model_fn):
    """Losses and parameters after 3 Adam steps equal one device's (fp32, 4e-5). The
    four-block model (VPP) has a few entries whose gradient is near zero, where Adam's
    ``m / sqrt(v)`` turns a 1e-7 difference of the reduction order into 1.5e-4: VPP without
    selective recompute differs at the same entries by as much, so it gets 3e-4."""
    tol = 3e-4 if schedule == "VPP" else None
    assert_trains_like_one_device(
        model_fn,
        optax.adam(1e-2),
        lm_batches(STEPS),
        loss_fn=lm_loss,
        layout=selective_trainer(schedule),
        rtol=tol,
        atol=tol,
    )


def temp_mib(schedule: str, *, recompute: bool = False, selective: bool = False) -> float:
    """Compiled temp memory per device of the stand-in's gradient (dp4 x pp2, M = 4,
    micro-batches of 2 rows x 64 tokens: the attention scores outweigh the matmuls)."""
    mesh = jax.make_mesh((4, 2), (DP, PP), axis_types=(AxisType.Auto,) * 2)
    model = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=4)
    pipeline_blocks(
        model,
        "layers",
        mesh=mesh,
        num_microbatches=4,
        schedule=schedule,
        recompute=recompute,
        selective=selective,
    )
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((32, 64), jnp.int32)

    def loss(state, tokens):
        return jnp.mean(nnx.merge(graphdef, state)(tokens) ** 2)

    compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def test_the_compiled_pipeline_keeps_less_than_no_recompute_and_more_than_full():
    """FThenB without recompute stashes every matmul output, the s x s scores among them
    (4.6 MiB); selective drops the scores (3.2 MiB, the same program under 1F1B); full
    recompute stashes stage inputs only (2.1 MiB)."""
    none = temp_mib("FThenB")
    selective = temp_mib("FThenB", selective=True)
    full = temp_mib("FThenB", recompute=True)
    assert full < 0.8 * selective and selective < 0.8 * none, (full, selective, none)


def test_the_planner_offers_selective_recompute_with_a_pipeline_between_none_and_full():
    """The wide search offers it on pp meshes (under 1F1B it is FThenB's program,
    offered once); the predicted activations of dp4 x pp2 sit between FThenB
    without recompute and full recompute, and the time adds the attention cores."""
    found = match_patterns(llama())
    work = Workload(batch_size=16, seq_len=256)
    wide, _ = enumerate_layouts(found, work, device_num=8, wide=True)
    piped = [lay for lay in wide if lay.selective_recompute and lay.pp > 1]
    assert piped and {lay.schedule for lay in piped} == {"FThenB"}  # 2 blocks: no VPP
    forced, _ = enumerate_layouts(
        found, work, device_num=8, recompute="selective", force_mesh={"dp": 4, "pp": 2}
    )
    assert forced and {lay.schedule for lay in forced} == {"FThenB", "1F1B"}
    base = dict(dp=4, pp=2, schedule="FThenB", num_microbatches=2)
    none, sel, full = (
        estimate(found, work, Layout(**base, **kw), "cpu", devices_per_node=8)
        for kw in ({}, {"selective_recompute": True}, {"recompute": True})
    )
    assert full.memory.activations < sel.memory.activations < none.memory.activations
    assert none.flops < sel.flops < full.flops


def test_selective_recompute_refuses_whole_block_recompute():
    mesh = jax.make_mesh((4, 2), (DP, PP), axis_types=(AxisType.Auto,) * 2)
    w = jnp.stack([jnp.eye(3)] * 2)
    x = jnp.ones((8, 3))
    with pytest.raises(ValueError, match="selective=True, remat=True"):
        pipeline_forward(
            lambda w, x, s, c: x @ w, w, x, mesh=mesh, num_microbatches=2, remat=True,
            selective=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="selective_recompute=True with recompute=True"):
        Layout(dp=4, pp=2, schedule="FThenB", num_microbatches=2, recompute=True,
               selective_recompute=True)  # fmt: skip

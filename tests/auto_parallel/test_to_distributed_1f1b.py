"""to_distributed with the stand-in's 1F1B schedule: trains like one device, memory flat in M.

1F1B for a model whose loss stays outside the pipeline stashes each micro-batch's stage
input and recomputes the stage in its own backward loop
(:mod:`jfleet.parallel.pipeline_forward`); FThenB keeps every micro-batch's activations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel import ToDistributedConfig, get_plan
from jfleet.auto_parallel.apply.blocks import PipelinedBlocks, pipeline_blocks
from jfleet.auto_parallel.to_distributed import to_distributed
from jfleet.mesh.topology import DP, PP
from jfleet.models import lm_batches
from jfleet.models.llama import TinyLlama
from tests.auto_parallel.test_to_distributed import TOL, llama, single_device_losses, train


def test_a_forced_1f1b_plan_trains_like_one_device_with_the_rows_split_over_pp():
    config = ToDistributedConfig(force_mesh={"dp": 4, "pp": 2}, schedule="1F1B")
    model, opt, loader = to_distributed(llama(), optax.adam(1e-2), lm_batches(10), config=config)
    assert get_plan(model).schedule == "1F1B"
    assert isinstance(model.layers, PipelinedBlocks) and model.layers.schedule == "1F1B"
    # the layers after the stack see the rows split over dp x pp (the head runs on 1/8)
    hidden = jax.jit(lambda t: model.layers.run(model.embed_tokens(t)))(
        next(iter(loader))["tokens"]
    )
    assert hidden.sharding.spec == P((DP, PP))
    losses = train(model, opt, loader)
    np.testing.assert_allclose(losses, single_device_losses("llama"), rtol=0, atol=TOL)


def temp_bytes(schedule: str, microbatches: int) -> int:
    """Compiled temp memory per device of the stand-in's training gradient, dp2 x pp4,
    micro-batches of 2 rows x 16 tokens per replica."""
    mesh = jax.make_mesh((2, 4), (DP, PP), axis_types=(AxisType.Auto,) * 2)
    model = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=4)
    pipeline_blocks(model, "layers", mesh=mesh, num_microbatches=microbatches, schedule=schedule)
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((microbatches * 2 * 2, 16), jnp.int32)

    def loss(state, tokens):
        return jnp.mean(nnx.merge(graphdef, state)(tokens) ** 2)

    compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_1f1b_temp_memory_is_flat_in_the_micro_batches_where_fthenb_grows():
    fthenb = {m: temp_bytes("FThenB", m) for m in (4, 16)}
    one = {m: temp_bytes("1F1B", m) for m in (4, 16)}
    assert one[16] <= fthenb[16] / 2, (one, fthenb)
    assert one[16] - one[4] < (fthenb[16] - fthenb[4]) / 3, (one, fthenb)


def test_a_forced_vpp_plan_trains_like_one_device_and_checkpoints_as_the_plain_model():
    """VPP through to_distributed: 4 blocks over pp 2 in 2 interleaved chunks a stage
    (device 0 holds blocks 0 and 2), 10 steps equal one device's; the logical checkpoint
    view is the plain model's per-block parameters."""
    from jfleet.checkpoint import layout
    from tests.auto_parallel.test_to_distributed import adam_one_device

    def deeper():
        return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=4)

    config = ToDistributedConfig(
        force_mesh={"dp": 2, "pp": 2, "mp": 2}, schedule="VPP", num_microbatches=2
    )
    plain = deeper()
    model, opt, loader = to_distributed(deeper(), optax.adam(1e-2), lm_batches(10), config=config)
    plan = get_plan(model)
    assert plan.layout.name == "dp2 x pp2 x mp2 (VPP v=2 M=2)"
    assert plan.stages == ((0, 2), (1, 3))
    stand_in = model.layers
    assert isinstance(stand_in, PipelinedBlocks) and stand_in.num_virtual_stages == 2
    flat = layout.logical_leaves(model, model)
    for i in range(4):  # device s, unit k holds block k P + s: the plain model's order
        want = plain.layers[i].mlp.up_proj.kernel[...]
        np.testing.assert_array_equal(flat[f"layers.{i}.mlp.up_proj.kernel"], want)
    losses = train(model, opt, loader)
    want = adam_one_device(deeper(), lm_batches(10))
    np.testing.assert_allclose(losses, want, rtol=0, atol=TOL)

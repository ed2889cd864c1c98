"""A pipelined stack of blocks that return more than their activation or hold dropout
streams (:mod:`jfleet.auto_parallel.match.block_extras`), run directly through
:func:`~jfleet.auto_parallel.apply.blocks.pipeline_blocks`: the forward equals the unpipelined
one, masks included, under interleaved stages too, and the streams advance alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfleet.auto_parallel.apply.blocks import pipeline_blocks
from jfleet.auto_parallel.match.block_calls import record_block_calls
from jfleet.auto_parallel.match.block_extras import BlockOutputs
from jfleet.testing.nnx_styles import AuxLossDecoder, DropoutDecoder

AUTO = (jax.sharding.AxisType.Auto,) * 2


def counts(model: nnx.Module) -> list[int]:
    leaves = jax.tree.leaves(nnx.state(model, nnx.RngCount))
    return sorted(int(c) for a in leaves for c in np.asarray(a).reshape(-1))


def test_interleaved_stages_draw_the_unpipelined_masks_and_advance_the_streams():
    mesh = jax.make_mesh((4, 2), ("dp", "pp"), axis_types=AUTO)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 48, (8, 6)), jnp.int32)
    plain = DropoutDecoder(0.5, layers=4, rngs=nnx.Rngs(params=0, dropout=1))
    piped = DropoutDecoder(0.5, layers=4, rngs=nnx.Rngs(params=0, dropout=1))
    pipeline_blocks(
        piped, "layers", mesh=mesh, num_microbatches=2, schedule="VPP", num_virtual_stages=2
    )
    forward = nnx.jit(lambda model, tokens: model(tokens))
    for _ in range(2):  # the second call draws new masks from the advanced counts
        np.testing.assert_allclose(forward(piped, tokens), forward(plain, tokens), atol=1e-5)
    assert counts(piped) == counts(plain) == [2] * 13


def test_a_summed_auxiliary_loss_comes_back_as_the_unpipelined_sum():
    mesh = jax.make_mesh((4, 2), ("dp", "pp"), axis_types=AUTO)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 48, (8, 6)), jnp.int32)
    plain, piped = AuxLossDecoder(rngs=nnx.Rngs(0)), AuxLossDecoder(rngs=nnx.Rngs(0))
    paths = ["layers.0", "layers.1"]
    call = record_block_calls(piped, paths, lambda: piped(tokens))[0].calls[0]
    outputs = BlockOutputs(call.out_tree, call.roles, call.out_avals, 8)
    pipeline_blocks(piped, "layers", mesh=mesh, num_microbatches=2, outputs=outputs)
    (logits, aux), (want_logits, want_aux) = nnx.jit(lambda a, b: (a(tokens), b(tokens)))(
        piped, plain
    )
    np.testing.assert_allclose(logits, want_logits, atol=1e-5)
    np.testing.assert_allclose(aux, want_aux, rtol=1e-6)
    assert float(want_aux) > 0

"""Blocks that wrap their activation in what they return train like one device (issue 35).

:data:`jfleet.testing.nnx_styles.RETURN_STYLES`: ``(cache, x)`` with the cache None in
training (Flax's Gemma example, Qwen3 ports), ``(x, None)``, ``{"hidden": x, "cache":
None}`` and ``(x, aux)`` with the losses added up. At dp2 x mp4 the default pp = 1 plan
scans the blocks (the scan carries the activation, sums ``aux``, rebuilds the output
structure for the model's own loop); at dp2 x pp2 x mp2 they are pipelined. Both against
the same model trained on one device, 3 Adam steps at the fp32 rule's tolerance.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import make_train_step
from jfleet.auto_parallel import ToDistributedConfig, to_distributed
from jfleet.auto_parallel.apply.blocks import PipelinedBlocks
from jfleet.auto_parallel.apply.scanned_blocks import ScannedBlocks, scan_blocks
from jfleet.auto_parallel.match.block_calls import block_outputs
from jfleet.testing import assert_trees_close, train_one_device
from jfleet.testing.nnx_styles import RETURN_STYLES, ReturnFormDecoder
from jfleet.testing.nnx_styles.block_forms import ReturnFormBlock

STEPS = 3
MESHES = {"dp2-mp4": (("dp", 2), ("mp", 4)), "dp2-pp2-mp2": (("dp", 2), ("pp", 2), ("mp", 2))}


@functools.cache
def one_device(loss: str) -> tuple[float, ...]:
    """The one-device losses; the three forms without ``aux`` compute one function."""
    style = RETURN_STYLES["x_aux" if loss == "aux" else "cache_first"]
    losses, _ = train_one_device(
        style.build(nnx.Rngs(0)), optax.adam(1e-2), style.batches(STEPS), style.loss_fn
    )
    return tuple(float(x) for x in losses)


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", list(RETURN_STYLES))
def test_each_return_form_trains_like_one_device_scanned_and_pipelined(name, mesh):
    style = RETURN_STYLES[name]
    pipelined = "pp2" in mesh
    config = ToDistributedConfig(
        force_mesh=dict(MESHES[mesh]),
        forward=style.forward,
        num_microbatches=2 if pipelined else None,
        scan_layers=True,
    )
    model, opt, loader = to_distributed(
        style.build(nnx.Rngs(0)), optax.adam(1e-2), style.batches(STEPS), config=config
    )
    # scanned (or pipelined), not left unrolled: one stand-in where the blocks were
    assert isinstance(model.layers, PipelinedBlocks if pipelined else ScannedBlocks)
    # the stack returns the block's own output structure around the last activation
    x = jax.ShapeDtypeStruct((8, 8, 32), jnp.float32)
    out = jax.eval_shape(lambda h: next(iter(model.layers))(h), x)
    block = style.build(nnx.Rngs(0)).layers[0]
    assert jax.tree.structure(out) == jax.tree.structure(jax.eval_shape(block, x))
    step = make_train_step(style.loss_fn)
    losses = [float(step(model, opt, batch)) for batch in loader]
    reference = one_device("aux" if name == "x_aux" else "plain")
    assert reference[-1] < reference[0]  # it trains, so equality means something
    assert_trees_close(np.asarray(losses), np.asarray(reference), devices=8)


class WindowedBlock(ReturnFormBlock):
    """Reads a window setting, as Gemma's local layers do (here the window spans the
    sequence, so local and global blocks compute alike, but their definitions differ)."""

    def __call__(self, x, cache=None):
        if self.window is not None:
            x = x + 0.0 * self.window
        return super().__call__(x, cache)


def test_super_blocks_of_blocks_returning_cache_first_hand_on_the_activation():
    # Gemma 2/3 alternate local and global blocks: a scan step runs a super-block of two,
    # and its second block must get the first's activation, not its (None, x)
    model = ReturnFormDecoder("cache_first", layers=4, rngs=nnx.Rngs(0))
    for i, block in enumerate(model.layers):
        block.__class__ = WindowedBlock
        block.window = 4 if i % 2 == 0 else None  # a static setting repeating every 2
    tokens = jnp.asarray(RETURN_STYLES["cache_first"].batches(1)[0]["tokens"])
    want = model(tokens)
    paths = [f"layers.{i}" for i in range(4)]
    outputs = block_outputs(model, paths, lambda: model(tokens))
    scanned = scan_blocks(model, "layers", outputs=outputs)
    assert scanned.period == 2 and outputs.tree == jax.tree.structure((None, 0))
    assert_trees_close(model(tokens), want)

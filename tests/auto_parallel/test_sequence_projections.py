"""Sequence parallelism as Megatron runs it, inside blocks written without it.

``to_distributed(..., sequence_parallel=True)`` keeps activations split over the sequence
on ``mp`` between blocks. Inside a block the projections of public Flax NNX code
(``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``) all-gather the sequence before a
column-parallel projection and reduce-scatter after a row-parallel one
(:mod:`jfleet.auto_parallel.apply.sequence_dots`): the compiled layer loop moves
activations, never a weight (left to GSPMD it all-gathers every weight of the block, in
the forward, the recomputation and the backward), and training equals one device.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
from jfleet.auto_parallel.apply.sequence_dots import SequenceProjection
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.testing import hlo, train_one_device
from jfleet.testing.nnx_styles import STYLES

STEPS = 3
#: fp32 Adam 1e-2 over 3 steps; the reductions run in another order on 8 devices.
TOL = 1e-5


def _llama() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2)


#: (model, batches, loss, forward) by name: the reference model (``nnx.Linear``) and two
#: public styles (``nnx.LinearGeneral``; ``nnx.Einsum`` with a stacked q / k / v kernel).
SUBJECTS = {
    "llama": lambda: (_llama(), lm_batches(STEPS, batch=16, seq=16, vocab=64), lm_loss, None),
    **{
        name: lambda name=name: (
            STYLES[name].build(nnx.Rngs(0)),
            STYLES[name].batches(STEPS, batch=8, seq=16),
            STYLES[name].loss_fn,
            STYLES[name].forward,
        )
        for name in ("linear_general", "einsum_qkv")
    },
}


@functools.cache
def _one_device(name: str) -> tuple[float, ...]:
    model, batches, loss, _ = SUBJECTS[name]()
    return tuple(float(x) for x in train_one_device(model, optax.adam(1e-2), batches, loss)[0])


def _loop_gather_shapes(text: str) -> set[tuple[int, ...]]:
    """Result shapes of the all-gathers inside the compiled step's loops."""
    looped = {c.name for c in hlo.collectives(text) if c.kind == "all-gather" and c.weight > 1}
    shapes = set()
    for line in text.splitlines():
        found = re.match(r"\s*%?([\w.\-]+) = \w+\[([\d,]*)\]", line)
        if found and found.group(1) in looped and " all-gather(" in line:
            shapes.add(tuple(int(d) for d in found.group(2).split(",") if d))
    return shapes


@pytest.mark.parametrize("name", list(SUBJECTS))
def test_blocks_move_activations_not_weights_and_train_like_one_device(name):
    model, batches, loss, forward = SUBJECTS[name]()
    kernels = {
        tuple(v.shape) for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if v.ndim >= 2
    }
    config = ToDistributedConfig(
        force_mesh={"dp": 2, "mp": 4}, sequence_parallel=True, recompute=True, forward=forward
    )
    model, opt, loader = to_distributed(model, optax.adam(1e-2), batches, config=config)
    assert get_plan(model).sequence_parallel
    hooks = [
        m for _, m in nnx.iter_graph(model)
        if isinstance(getattr(m, "dot_general", None) or getattr(m, "einsum_op", None),
                      SequenceProjection)
    ]  # fmt: skip
    assert hooks, "no projection of the blocks was given Megatron's layouts"
    step = make_train_step(loss)
    batch = next(iter(loader))
    gathered = _loop_gather_shapes(step.lower(model, opt, batch).compile().as_text())
    assert gathered, "the layer loop gathers no sequence"
    weights = {s for k in kernels for s in (k, k[::-1], (1, *k))}
    assert not gathered & weights, (gathered, kernels)  # activations only: [b, s, ...]
    losses = [float(step(model, opt, b)) for b in loader]
    np.testing.assert_allclose(losses, _one_device(name), rtol=0, atol=TOL)

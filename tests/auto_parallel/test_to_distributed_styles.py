"""to_distributed on models written the way public Flax NNX code writes them.

Each style of :mod:`jfleet.testing.nnx_styles` (``nnx.MultiHeadAttention``,
``nnx.LinearGeneral``, ``nnx.Einsum`` with separate / stacked kernels, grouped-query and
multi-query attention with q/k norms, a KV-cache block, alternating sliding-window blocks,
dropout) is laid out under forced meshes: every attention and MLP weight of the blocks is
split over ``mp`` on its heads / hidden dimension (the dims the zoo states by hand), and
10 Adam steps equal one device within 1e-4 (fp32).
"""

from __future__ import annotations

import fnmatch
import functools

import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
from jfleet.testing import train_one_device
from jfleet.testing.nnx_styles import STYLES

STEPS = 10
TOL = 1e-4
PIPELINED = [name for name, style in STYLES.items() if style.pipelines]


@functools.cache
def one_device(name: str) -> tuple[float, ...]:
    style = STYLES[name]
    losses, _ = train_one_device(
        style.build(nnx.Rngs(0)), optax.adam(1e-2), style.batches(STEPS), style.loss_fn
    )
    return tuple(float(x) for x in losses)


def distributed(name: str, mesh: dict, **settings):
    style = STYLES[name]
    config = ToDistributedConfig(force_mesh=mesh, forward=style.forward, **settings)
    model, opt, loader = to_distributed(
        style.build(nnx.Rngs(0)), optax.adam(1e-2), style.batches(STEPS), config=config
    )
    step = make_train_step(style.loss_fn)
    return model, [float(step(model, opt, batch)) for batch in loader]


def expected_spec(style, path: str, mp: int) -> P:
    (pattern,) = [p for p in style.splits if fnmatch.fnmatch(path, p)]
    role = style.roles[pattern]
    if role in ("k", "v", "kv") and style.kv_replicated_at and mp >= style.kv_replicated_at:
        return P()  # kv heads mp does not divide stay whole; q and o are split
    dim = style.splits[pattern]
    return P(*("mp" if d == dim else None for d in range(len(style.shapes[pattern]))))


def block_weights(style, plan) -> list[str]:
    paths = [p.path for p in plan.params]
    found = [p for p in paths if any(fnmatch.fnmatch(p, pat) for pat in style.splits)]
    assert len(found) == len(style.splits) * style.layers, (found, style.splits)
    return found


@pytest.mark.parametrize("name", list(STYLES))
def test_every_block_weight_is_split_on_its_heads_or_hidden_dim_and_trains_like_one_device(
    name,
):
    style = STYLES[name]
    model, losses = distributed(name, {"dp": 2, "mp": 4})
    plan = get_plan(model)
    state = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for path in block_weights(style, plan):
        want = expected_spec(style, path, 4)
        assert plan.spec(path) == want, (path, plan.spec(path), want)
        key = tuple(int(k) if k.isdigit() else k for k in path.split("."))
        got = state[key].get_value().sharding.spec
        assert tuple(got) + (None,) * (len(want) - len(got)) == tuple(want) + (None,) * (
            len(got) - len(want)
        ), (path, got)
        if want == P():
            assert "does not divide" in plan._param(path).replicated_why
    np.testing.assert_allclose(losses, one_device(name), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", PIPELINED)
def test_pipelined_and_zero3_layouts_train_like_one_device(name):
    _, piped = distributed(name, {"dp": 2, "pp": 2, "mp": 2}, num_microbatches=2)
    np.testing.assert_allclose(piped, one_device(name), rtol=TOL, atol=TOL)
    model, zero3 = distributed(name, {"dp": 2, "sharding": 2, "mp": 2}, zero_stage=3)
    assert get_plan(model).zero_stage == 3
    np.testing.assert_allclose(zero3, one_device(name), rtol=TOL, atol=TOL)

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
import logging
import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import make_train_step
from jfleet.auto_parallel import ToDistributedConfig, TraceError, get_plan, to_distributed
from jfleet.checkpoint import layout
from jfleet.testing import train_one_device
from jfleet.testing.nnx_styles import STYLES

STEPS = 10
TOL = 1e-4
#: Styles that pipeline (the one-kv-head variant shares gqa_qknorm's blocks: dp2 x mp4 only).
PIPELINED = [n for n, style in STYLES.items() if style.pipelines and n != "gqa_qknorm_mqa"]


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
    # by the plain model's per-block paths, whether the blocks run scanned or unrolled
    state = layout.logical_leaves(model, model, abstract=True)
    for path in block_weights(style, plan):
        (pattern,) = [p for p in style.splits if fnmatch.fnmatch(path, p)]
        assert plan._param(path).role == style.roles[pattern], path
        want = expected_spec(style, path, 4)
        assert plan.spec(path) == want, (path, plan.spec(path), want)
        got = state[path].sharding.spec
        assert tuple(got) + (None,) * (len(want) - len(got)) == tuple(want) + (None,) * (
            len(got) - len(want)
        ), (path, got)
        if want == P():
            assert "does not divide" in plan._param(path).replicated_why
    reference = one_device(name)
    assert reference[0] > math.log(style.vocab) / 2  # an untrained model is near uniform
    assert reference[-1] < reference[0]  # and the style trains (so equality means something)
    np.testing.assert_allclose(losses, reference, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("name", PIPELINED)
def test_pipelined_and_zero3_layouts_train_like_one_device(name):
    _, piped = distributed(name, {"dp": 2, "pp": 2, "mp": 2}, num_microbatches=2)
    np.testing.assert_allclose(piped, one_device(name), rtol=TOL, atol=TOL)
    model, zero3 = distributed(name, {"dp": 2, "sharding": 2, "mp": 2}, zero_stage=3)
    assert get_plan(model).zero_stage == 3
    np.testing.assert_allclose(zero3, one_device(name), rtol=TOL, atol=TOL)


def test_the_recomputing_1f1b_stand_in_trains_public_styles_like_one_device():
    # Gemma's alternating local / global blocks: super-blocks of 2, one a stage
    model, losses = distributed(
        "gemma_alternating", {"dp": 2, "pp": 2, "mp": 2}, num_microbatches=2, schedule="1F1B"
    )
    assert get_plan(model).schedule == "1F1B"
    np.testing.assert_allclose(losses, one_device("gemma_alternating"), rtol=TOL, atol=TOL)


def test_interleaved_vpp_trains_the_flax_minigpt_style_like_one_device():
    """The Flax tutorial's MiniGPT (``nnx.MultiHeadAttention`` blocks in an ``nnx.List``)
    at 4 blocks: dp2 x pp2 x mp2 with 2 interleaved chunks a stage, 10 steps equal one
    device's."""
    from jfleet.testing.nnx_styles import MAX_SEQ, MiniGPT

    style = STYLES["mha"]

    def build(rngs):
        return MiniGPT(MAX_SEQ, style.vocab, style.width, style.heads, style.hidden, 4, rngs=rngs)

    want, _ = train_one_device(
        build(nnx.Rngs(0)), optax.adam(1e-2), style.batches(STEPS), style.loss_fn
    )
    config = ToDistributedConfig(
        force_mesh={"dp": 2, "pp": 2, "mp": 2}, schedule="VPP", num_microbatches=2
    )
    model, opt, loader = to_distributed(
        build(nnx.Rngs(0)), optax.adam(1e-2), style.batches(STEPS), config=config
    )
    assert get_plan(model).layout.name == "dp2 x pp2 x mp2 (VPP v=2 M=2)"
    step = make_train_step(style.loss_fn)
    got = [float(step(model, opt, batch)) for batch in loader]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


# ------------------------------------------------------------------ what cannot be split
def test_blocks_with_dropout_streams_are_not_excluded_from_pipelines_at_planning_time():
    """Their pipelined draws are the unpipelined ones (``PIPELINED`` trains the style so)."""
    style = STYLES["dropout"]
    model, _, _ = to_distributed(style.build(nnx.Rngs(0)), optax.adam(1e-2), style.batches(1))
    reasons = dict(get_plan(model).excluded)
    assert not any("Rng" in reason for reason in reasons.values()), reasons


def test_blocks_that_do_not_repeat_are_not_pipelined_and_the_setting_is_named():
    style = STYLES["gemma_alternating"]  # sliding windows 4, None, 4, None: period 2
    model = style.build(nnx.Rngs(0))
    model.layers[2].attn.sliding_window_size = None  # 4, None, None, None: no period
    config = ToDistributedConfig(force_mesh={"dp": 4, "pp": 2})
    with pytest.raises(ValueError, match=r"differs from block layers.0 in attribute "
                       r"'attn.sliding_window_size' \(None vs 4\)"):  # fmt: skip
        to_distributed(model, optax.adam(1e-2), style.batches(1), config=config)
    config = ToDistributedConfig(force_mesh={"dp": 2, "pp": 4})  # 2 super-blocks of 2
    with pytest.raises(ValueError, match=r"pp=4 is more than the 2 super-blocks of 2"):
        to_distributed(style.build(nnx.Rngs(0)), optax.adam(1e-2), style.batches(1), config=config)


class MysteryAttention(nnx.Module):
    """q / k / v / o around a kernel the pass cannot see through (a Pallas call, a callback):
    here a sort across heads, which mixes what a head split would keep apart."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (
            nnx.Linear(width, width, use_bias=False, rngs=rngs) for _ in range(4)
        )

    def __call__(self, x):
        b, t, w = x.shape
        q, k, v = (f(x).reshape(b, t, self.heads, -1) for f in (self.wq, self.wk, self.wv))
        mixed = jax.lax.sort(q * k + v, dimension=2)
        return self.wo(mixed.reshape(b, t, w))


class MysteryLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.blocks = nnx.List([MysteryAttention(32, 4, rngs=rngs) for _ in range(2)])
        self.norm = nnx.RMSNorm(32, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(self.norm(x))
        return self.embed.attend(x)


def test_attention_that_cannot_be_split_gets_no_mp_and_a_warning_listing_it(caplog):
    batches = STYLES["mha"].batches(1, seq=8)
    with caplog.at_level(logging.WARNING, logger="jfleet"):
        model, _, _ = to_distributed(MysteryLM(nnx.Rngs(0)), optax.adam(1e-2), batches)
    plan = get_plan(model)
    assert plan.mesh_shape["mp"] == 1
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "kept whole on every mp rank" in warned
    assert all(f"blocks.*.{n}.kernel" in warned for n in ("wq", "wk", "wv", "wo"))
    why = plan._param("blocks.0.wo.kernel").replicated_why
    assert "no column/row pair" in why
    with pytest.raises(ValueError, match=r"mp=4 would leave large decoder-block kernels whole"):
        to_distributed(
            MysteryLM(nnx.Rngs(0)),
            optax.adam(1e-2),
            batches,
            config=ToDistributedConfig(force_mesh={"dp": 2, "mp": 4}),
        )


# ------------------------------------------------------------------ how the model is called
class NeedsMask(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)

    def __call__(self, tokens, mask):
        return self.embed.attend(self.embed(tokens) * mask[..., None])


def test_a_model_whose_call_fails_or_a_hook_returning_no_arrays_is_a_clear_error():
    batches = [{"tokens": np.zeros((8, 8), np.int32), "mask": np.ones((8, 8), np.float32)}]
    with pytest.raises(TraceError, match=r"tracing NeedsMask\(inputs\) failed.*forward="):
        to_distributed(NeedsMask(nnx.Rngs(0)), optax.adam(1e-2), batches)
    config = ToDistributedConfig(forward=lambda model, batch: "logits")
    with pytest.raises(TraceError, match=r"returned 'logits', not arrays"):
        to_distributed(NeedsMask(nnx.Rngs(0)), optax.adam(1e-2), batches, config=config)
    config = ToDistributedConfig(forward=lambda model, batch: model(batch["tokens"], batch["mask"]))
    model, _, _ = to_distributed(NeedsMask(nnx.Rngs(0)), optax.adam(1e-2), batches, config=config)
    assert get_plan(model).mesh_shape["dp"] == 8
    with pytest.raises(ValueError, match=r"keys \['ids', 'y'\], none of them a known model input"):
        odd = [{"ids": np.zeros((8, 8), np.int32), "y": np.zeros((8, 8), np.int32)}]
        to_distributed(NeedsMask(nnx.Rngs(0)), optax.adam(1e-2), odd)

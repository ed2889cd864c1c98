"""The zoo of public-code NNX styles (``jfleet.testing.nnx_styles``) on one device.

Each style's hand-written Megatron table names real weights whose split dimension has the
size the role says (heads, kv heads or MLP hidden). Nothing here calls ``to_distributed``;
that each style trains on one device (and equals it under every layout) is
``test_to_distributed_styles.py``'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfleet.testing.nnx_styles import MAX_SEQ, STYLES, Style

NAMES = sorted(STYLES)
BASE_STYLES = {
    "mha",
    "linear_general",
    "einsum_gemma",
    "einsum_qkv",
    "gqa_qknorm",
    "kv_cache",
    "gemma_alternating",
    "dropout",
}
ROLES = {"q", "k", "v", "kv", "qkv", "o", "gate", "up", "gate_up", "down"}


def param_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Dotted path -> shape of every ``nnx.Param`` (works on abstract models)."""
    return {
        ".".join(map(str, path)): tuple(var.shape)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def module_at(model: nnx.Module, dotted: str):
    node = model
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def expected_size(style: Style, role: str, shape: tuple[int, ...]) -> int:
    """The size of the split dimension: heads, kv heads (times head_dim when fused) or hidden."""
    if role in {"gate", "up", "gate_up", "down"}:
        return style.hidden
    heads = style.kv_heads if role in {"k", "v", "kv"} else style.heads
    fused = len(shape) == 2  # an nnx.Linear: [width, heads * head_dim] or its transpose
    return heads * style.head_dim if fused else heads


def test_the_registry_holds_every_style_with_consistent_fields():
    assert set(STYLES) >= BASE_STYLES
    assert "gqa_qknorm_mqa" in STYLES
    for name, style in STYLES.items():
        assert style.name == name
        assert set(style.splits) == set(style.roles) == set(style.shapes)
        assert set(style.roles.values()) <= ROLES
        assert all(path.startswith(style.blocks_at + ".*.") for path in style.splits)
        assert {"q", "o"} <= set(style.roles.values()) or "qkv" in style.roles.values()
        assert "down" in style.roles.values()
        assert 64 <= style.vocab <= 128 and style.width <= 64 and style.layers <= 4
        assert style.heads % style.kv_heads == 0
        not_dividing = [mp for mp in (2, 4, 8) if style.kv_heads % mp]
        want = not_dividing[0] if style.kv_heads != style.heads else None
        assert style.kv_replicated_at == want, name
        assert style.note
    assert STYLES["gqa_qknorm"].kv_replicated_at == 4
    assert STYLES["gqa_qknorm_mqa"].kv_replicated_at == 2
    assert STYLES["dropout"].pipelines and STYLES["kv_cache"].forward is not None


def test_batches_share_one_format():
    for style in STYLES.values():
        (batch,) = style.batches(1, batch=4, seq=6, seed=3)
        assert set(batch) == {"tokens", "labels"}
        for key in ("tokens", "labels"):
            assert batch[key].shape == (4, 6) and batch[key].dtype == np.int32
            assert batch[key].min() >= 0 and batch[key].max() < style.vocab
        np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    with pytest.raises(ValueError, match="MAX_SEQ"):
        STYLES["mha"].batches(1, seq=MAX_SEQ + 1)


@pytest.mark.parametrize("name", NAMES)
def test_splits_name_real_weights_and_their_head_or_hidden_dims(name):
    style = STYLES[name]
    model = nnx.eval_shape(lambda: style.build(nnx.Rngs(0)))  # shapes only: no init
    shapes = param_shapes(model)
    assert len(module_at(model, style.blocks_at)) == style.layers
    for path, dim in style.splits.items():
        for block in range(style.layers):
            assert shapes[path.replace("*", str(block))] == style.shapes[path], path
        role, shape = style.roles[path], style.shapes[path]
        assert shape[dim] == expected_size(style, role, shape), (path, shape, dim)
    # The table is complete: every weight of block 0 that is not a bias or a norm scale.
    prefix = style.blocks_at + ".0."
    weights = {
        path.replace(prefix, style.blocks_at + ".*.", 1)
        for path, shape in shapes.items()
        if path.startswith(prefix) and len(shape) >= 2 and not path.endswith("bias")
    }
    assert weights == set(style.splits)


def test_alternating_blocks_differ_only_by_their_window():
    style = STYLES["gemma_alternating"]
    model = style.build(nnx.Rngs(0))
    layers = module_at(model, style.blocks_at)
    assert [layer.attn.sliding_window_size for layer in layers] == [4, None, 4, None]
    assert len({type(layer) for layer in layers}) == 1
    shapes = [param_shapes(layer) for layer in layers]
    assert all(s == shapes[0] for s in shapes)
    # A local block attends differently from the same block made global (seq 12 > window 4)
    # but alike over the first 4 positions; a global block is unchanged.
    x = jax.random.normal(jax.random.key(1), (2, 12, style.width))
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    mask = positions[:, :, None] >= positions[:, None, :]
    attend = nnx.jit(lambda attn: attn(x, positions, mask))
    local, global_ = attend(layers[0].attn), attend(layers[1].attn)
    layers[0].attn.sliding_window_size = layers[1].attn.sliding_window_size = None
    widened, same = attend(layers[0].attn), attend(layers[1].attn)  # graphs compiled above
    np.testing.assert_allclose(widened[:, :4], local[:, :4], atol=1e-6)
    assert not np.allclose(widened[:, 4:], local[:, 4:], atol=1e-3)
    np.testing.assert_array_equal(same, global_)


def test_kv_cache_decoding_matches_the_training_forward():
    style = STYLES["kv_cache"]
    model = style.build(nnx.Rngs(0))
    batch = style.batches(1, batch=2, seq=8)[0]
    full = nnx.jit(style.forward)(model, batch)
    tokens = jnp.asarray(batch["tokens"])

    @nnx.jit
    def decode(model, token, position, cache):
        positions = jnp.full((token.shape[0], 1), position, jnp.int32)
        return model(token, positions=positions, cache=cache)

    cache, steps = model.init_cache(2), []
    for t in range(tokens.shape[1]):
        logits, cache = decode(model, tokens[:, t : t + 1], t, cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5)


def test_dropout_style_holds_rng_streams_that_change_each_call():
    style = STYLES["dropout"]
    model = style.build(nnx.Rngs(0))
    tokens = jnp.asarray(style.batches(1)[0]["tokens"])
    forward = nnx.jit(lambda model, tokens: model(tokens))

    def counts():
        return [int(count) for count in jax.tree.leaves(nnx.state(model, nnx.RngCount))]

    before = counts()
    first, second = forward(model, tokens), forward(model, tokens)
    assert not np.allclose(first, second)
    after = counts()
    assert len(before) == 1 + 3 * style.layers  # embedding dropout, 3 per block
    assert all(a > b for a, b in zip(after, before, strict=True))

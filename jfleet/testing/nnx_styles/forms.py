"""The forms beyond the decoder LM (:mod:`.beyond_lm`) as :class:`~.registry.Style` entries.

:data:`FORMS` holds a ViT and the MNIST CNN (image batches, class labels), a T5-style
encoder-decoder, a Mixture-of-Experts decoder, the Llama reference trained through a fresh
KV cache, and decoders whose blocks return ``(cache, x)``, return ``{"hidden", "aux_loss"}``
with the losses summed over the blocks, or hold dropout streams (:mod:`.block_forms`; token
batches, next-token labels). Each entry's ``splits`` are absolute paths (``*``
for a block index) of the weights a Megatron layout splits over ``mp``.

:data:`RETURN_STYLES` holds issue 35's block output forms
(:class:`~.block_forms.ReturnFormDecoder`): ``(cache, x)`` with the cache None in training,
``(x, None)``, ``{"hidden": x, "cache": None}`` and ``(x, aux)`` with the auxiliary losses
added to the loss. The first three compute the same function from the same seed.

:data:`MOE_STYLES` holds issue 39's MoE decoders in public styles (:mod:`.moe_styles`):
Qwen3-MoE's stacked experts with a dense or a ragged dispatch, Mixtral's list of expert MLPs
and GPT-OSS's fused gate/up with attention sinks. Their ``splits`` are the Megatron cut of
each expert on its hidden dimension ``F`` (the router stays whole).

Example:
  >>> sorted(FORMS)  # doctest: +NORMALIZE_WHITESPACE
  ['aux_loss', 'cache_returning', 'cnn', 'dropout_blocks', 'encoder_decoder',
   'kv_cache_train', 'moe', 'vit']
  >>> FORMS["vit"].batches(1)[0]["images"].shape
  (8, 8, 8, 3)
  >>> sorted(RETURN_STYLES)
  ['cache_first', 'dict_cache', 'x_aux', 'x_none']
  >>> sorted(MOE_STYLES)
  ['gpt_oss', 'mixtral', 'qwen3_moe', 'qwen3_moe_ragged']
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jfleet.testing.nnx_styles.beyond_lm import (
    EncoderDecoder,
    MnistCnn,
    MoeDecoder,
    VisionTransformer,
    cache_forward,
)
from jfleet.testing.nnx_styles.block_forms import (
    AuxLossDecoder,
    CacheReturningDecoder,
    DropoutDecoder,
    ReturnFormDecoder,
)
from jfleet.testing.nnx_styles.moe_styles import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from jfleet.testing.nnx_styles.ports import LlamaCacheTransformer, ModelArgs
from jfleet.testing.nnx_styles.registry import Style, token_batches

__all__ = ["FORMS", "MOE_STYLES", "RETURN_STYLES"]


def image_batches(
    n: int, batch: int = 8, seq: int = 8, seed: int = 0, *, channels: int
) -> list[dict]:
    """``n`` batches of ``{"images": float32 [batch, seq, seq, channels], "labels": int32
    [batch]}``: the label is the brightest of 10 fixed pixel positions, so it can be learned."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        images = rng.normal(size=(batch, seq, seq, channels)).astype(np.float32)
        labels = images[:, 0, :, 0].reshape(batch, -1)[:, :10].argmax(-1).astype(np.int32)
        out.append({"images": images, "labels": labels})
    return out


def _loss(forward):
    def loss_fn(model: nnx.Module, batch: dict) -> jax.Array:
        logits = forward(model, batch).astype(jnp.float32)
        labels = jnp.asarray(batch["labels"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss_fn


def _images(model: nnx.Module, batch: dict) -> jax.Array:
    return model(jnp.asarray(batch["images"]))


def _tokens(model: nnx.Module, batch: dict) -> jax.Array:
    return model(jnp.asarray(batch["tokens"]))


def _with_aux(model: nnx.Module, batch: dict) -> tuple[jax.Array, jax.Array]:
    return model(jnp.asarray(batch["tokens"]))


def _aux_loss(model: nnx.Module, batch: dict) -> jax.Array:
    logits, aux = _with_aux(model, batch)
    labels = jnp.asarray(batch["labels"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return ce.mean() + aux


def _seq2seq(model: nnx.Module, batch: dict) -> jax.Array:
    tokens = jnp.asarray(batch["tokens"])
    return model(tokens, tokens)


def _form(name, build, batches, forward, table, sizes, blocks_at, pipelines, note) -> Style:
    rows = [line.split() for line in table.strip().splitlines() if line.strip()]
    vocab, width, heads, kv_heads, head_dim, hidden, layers = sizes
    return Style(
        name=name,
        build=build,
        batches=batches,
        loss_fn=_loss(forward),
        forward=forward,
        splits={r[0]: int(r[2]) for r in rows},
        roles={r[0]: r[1] for r in rows},
        shapes={r[0]: tuple(map(int, r[3].split("x"))) for r in rows},
        kv_replicated_at=None,
        vocab=vocab,
        width=width,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=hidden,
        layers=layers,
        blocks_at=blocks_at,
        pipelines=pipelines,
        note=note,
    )


_ATTN = "\n".join(
    f"{{p}}.{n}.kernel  {r}  {d}  32x32" for n, r, d in (("q", "q", 1), ("k", "k", 1),
                                                         ("v", "v", 1), ("o", "o", 0))
)  # fmt: skip

_BLOCK_TABLE = (
    _ATTN.format(p="layers.*")
    + """
layers.*.up.kernel    up    1  32x64
layers.*.down.kernel  down  0  64x32
"""
)

FORMS: dict[str, Style] = {
    "vit": _form(
        "vit",
        lambda rngs: VisionTransformer(rngs=rngs),
        functools.partial(image_batches, channels=3),
        _images,
        """
        blocks.*.attn.query.kernel  q     1  32x4x8
        blocks.*.attn.key.kernel    k     1  32x4x8
        blocks.*.attn.value.kernel  v     1  32x4x8
        blocks.*.attn.out.kernel    o     0  4x8x32
        blocks.*.fc1.kernel         up    1  32x64
        blocks.*.fc2.kernel         down  0  64x32
        """,
        (10, 32, 4, 4, 8, 64, 2),
        "blocks",
        True,
        "conv patches, class token; a 10-class head mp=4 leaves whole",
    ),
    "cnn": _form(
        "cnn",
        lambda rngs: MnistCnn(rngs=rngs),
        functools.partial(image_batches, channels=1),
        _images,
        """
        linear1.kernel  up    1  64x64
        linear2.kernel  down  0  64x10
        """,
        (10, 64, 0, 0, 0, 64, 0),
        "",
        False,
        "convolutions stay whole; the relu read-out is the one pair",
    ),
    "encoder_decoder": _form(
        "encoder_decoder",
        lambda rngs: EncoderDecoder(rngs=rngs),
        functools.partial(token_batches, vocab=48),
        _seq2seq,
        "\n".join(
            [
                _ATTN.format(p=f"{s}.*.{a}")
                for s, a in (
                    ("encoder", "attn"),
                    ("decoder", "self_attn"),
                    ("decoder", "cross_attn"),
                )
            ]
            + [
                f"{s}.*.mlp.wi.kernel  up  1  32x64\n{s}.*.mlp.wo.kernel  down  0  64x32"
                for s in ("encoder", "decoder")
            ]
        ),
        (48, 32, 4, 4, 8, 64, 2),
        "decoder",
        False,
        "two stacks; decoder blocks take the encoder's output (it needs a gradient: no "
        "pipeline); relative-position bias tables split by heads; one shared token table",
    ),
    "moe": _form(
        "moe",
        lambda rngs: MoeDecoder(rngs=rngs),
        functools.partial(token_batches, vocab=48),
        _tokens,
        _ATTN.format(p="layers.*.attn")
        + """
        layers.*.moe.gate_up  gate_up  2  3x32x64
        layers.*.moe.down     down     1  3x32x32
        """,
        (48, 32, 4, 4, 8, 32, 2),
        "layers",
        True,
        "experts' interleaved gate/up split on hidden; the router stays whole",
    ),
    "kv_cache_train": _form(
        "kv_cache_train",
        lambda rngs: LlamaCacheTransformer(ModelArgs(), rngs=rngs),
        functools.partial(token_batches, vocab=64),
        cache_forward,
        """
        layers.*.attention.wq.kernel  q     1  32x32
        layers.*.attention.wk.kernel  k     1  32x32
        layers.*.attention.wv.kernel  v     1  32x32
        layers.*.attention.wo.kernel  o     0  32x32
        layers.*.feed_forward.w1.kernel  gate  1  32x96
        layers.*.feed_forward.w3.kernel  up    1  32x96
        layers.*.feed_forward.w2.kernel  down  0  96x32
        """,
        (64, 32, 4, 4, 8, 96, 2),
        "layers",
        False,
        "a fresh cache each step: k / v written with a dynamic update, then read back",
    ),
    "cache_returning": _form(
        "cache_returning",
        lambda rngs: CacheReturningDecoder(rngs=rngs),
        functools.partial(token_batches, vocab=48),
        _tokens,
        _BLOCK_TABLE,
        (48, 32, 4, 4, 8, 64, 2),
        "layers",
        True,
        "blocks return (cache, x); the training forward drops the cache",
    ),
    "aux_loss": dataclasses.replace(
        _form(
            "aux_loss",
            lambda rngs: AuxLossDecoder(rngs=rngs),
            functools.partial(token_batches, vocab=48),
            _with_aux,
            _BLOCK_TABLE,
            (48, 32, 4, 4, 8, 64, 2),
            "layers",
            True,
            "blocks return {'hidden', 'aux_loss'}; the forward sums the losses over the blocks",
        ),
        loss_fn=_aux_loss,
    ),
    "dropout_blocks": _form(
        "dropout_blocks",
        lambda rngs: DropoutDecoder(0.1, rngs=rngs),
        functools.partial(token_batches, vocab=48),
        _tokens,
        _BLOCK_TABLE,
        (48, 32, 4, 4, 8, 64, 2),
        "layers",
        True,
        "nnx.Dropout(0.1) with its own stream after the embedding, the attention "
        "probabilities and each residual branch",
    ),
}
"""Issue 27's forms, by name."""


def _return_style(form: str) -> Style:
    summed = form == "x_aux"
    style = _form(
        form,
        lambda rngs: ReturnFormDecoder(form, rngs=rngs),
        functools.partial(token_batches, vocab=48),
        _with_aux if summed else _tokens,
        _BLOCK_TABLE,
        (48, 32, 4, 4, 8, 64, 2),
        "layers",
        True,
        {
            "cache_first": "blocks return (cache, x), the cache None in training",
            "x_none": "blocks return (x, None)",
            "dict_cache": "blocks return {'hidden': x, 'cache': None}",
            "x_aux": "blocks return (x, aux); the forward adds the losses up over the blocks",
        }[form],
    )
    return dataclasses.replace(style, loss_fn=_aux_loss) if summed else style


RETURN_STYLES: dict[str, Style] = {
    form: _return_style(form) for form in ("cache_first", "x_none", "dict_cache", "x_aux")
}
"""Issue 35's block output forms, by name."""


def _moe_attention(prefix: str, q: int, kv: int, width: int = 32) -> str:
    """Split-table rows of a GQA attention's ``q_proj`` .. ``o_proj`` under ``prefix``."""
    return f"""
    {prefix}.q_proj.kernel  q  1  {width}x{q}
    {prefix}.k_proj.kernel  k  1  {width}x{kv}
    {prefix}.v_proj.kernel  v  1  {width}x{kv}
    {prefix}.o_proj.kernel  o  0  {q}x{width}
    """


_QWEN3_MOE_TABLE = (
    _moe_attention("model.layers.*.self_attn", 32, 16)
    + """
    model.layers.*.mlp.gate_proj  gate  2  8x32x16
    model.layers.*.mlp.up_proj    up    2  8x32x16
    model.layers.*.mlp.down_proj  down  1  8x16x32
    """
)


def _qwen3_moe(name: str, dispatch: str, note: str) -> Style:
    style = _form(
        name,
        lambda rngs: Qwen3MoeForCausalLM(Qwen3MoeConfig(dispatch=dispatch), rngs=rngs),
        functools.partial(token_batches, vocab=64),
        _with_aux,
        _QWEN3_MOE_TABLE,
        (64, 32, 4, 2, 8, 16, 2),
        "model.layers",
        False,
        note,
    )
    return dataclasses.replace(style, loss_fn=_aux_loss, kv_replicated_at=4)


MOE_STYLES: dict[str, Style] = {
    "qwen3_moe": _qwen3_moe(
        "qwen3_moe",
        "dense",
        "stacked [E, D, F] experts, router 'gate', softmax -> top-2 renormalised, every token "
        "through every expert (zero-filled combine); one aux over every layer's router logits "
        "(blocks return them): no pipeline",
    ),
    "qwen3_moe_ragged": _qwen3_moe(
        "qwen3_moe_ragged",
        "ragged",
        "qwen3_moe with the token copies sorted by expert and jax.lax.ragged_dot",
    ),
    "mixtral": dataclasses.replace(
        _form(
            "mixtral",
            lambda rngs: MixtralForCausalLM(MixtralConfig(), rngs=rngs),
            functools.partial(token_batches, vocab=64),
            _with_aux,
            _moe_attention("model.layers.*.self_attn", 32, 16)
            + """
            model.layers.*.block_sparse_moe.experts.*.w1.kernel  gate  1  32x16
            model.layers.*.block_sparse_moe.experts.*.w3.kernel  up    1  32x16
            model.layers.*.block_sparse_moe.experts.*.w2.kernel  down  0  16x32
            """,
            (64, 32, 4, 2, 8, 16, 2),
            "model.layers",
            False,
            "nnx.List of w1/w2/w3 experts, top-2 logits -> softmax, each expert masked by "
            "jnp.where; (logits, aux): a nonlinear aux, so no pipeline",
        ),
        loss_fn=_aux_loss,
        kv_replicated_at=4,
    ),
    "gpt_oss": dataclasses.replace(
        _form(
            "gpt_oss",
            lambda rngs: GptOssForCausalLM(GptOssConfig(), rngs=rngs),
            functools.partial(token_batches, vocab=64),
            _tokens,
            _moe_attention("model.layers.*.self_attn", 32, 16)
            + """
            model.layers.*.mlp.experts.gate_up_proj  gate_up  2  8x32x32
            model.layers.*.mlp.experts.down_proj     down     1  8x16x32
            """,
            (64, 32, 4, 2, 8, 16, 2),
            "model.layers",
            False,
            "fused interleaved gate/up [E, D, 2F] with biases, clamped swiglu, top-4 logits -> "
            "softmax, experts' weights gathered per token; attention sinks; its 2 layers are "
            "one sliding / full pair, so no pipeline (stages need whole pairs)",
        ),
        kv_replicated_at=4,
    ),
}
"""Issue 39's MoE decoders in public styles, by name."""

"""Styles of Flax's own examples: the MiniGPT tutorial (``nnx.MultiHeadAttention``), MaxText /
T5X ``DenseGeneral`` layers (``nnx.LinearGeneral``), a stacked qkv einsum as tutorials write it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfleet.testing.nnx_styles._shared import MAX_SEQ, arange_positions, rope


# --- 1. mha: the Flax MiniGPT tutorial (post-norm blocks) -----------------------------
class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(vocab_size, embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(maxlen, embed_dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.token_emb(x) + self.pos_emb(jnp.arange(x.shape[1])[None, :])


class MiniGPTBlock(nnx.Module):
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs):
        self.attention = nnx.MultiHeadAttention(num_heads, embed_dim, decode=False, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(embed_dim, rngs=rngs)
        dense = functools.partial(nnx.Linear, rngs=rngs)
        self.mlp = nnx.Sequential(dense(embed_dim, ff_dim), jax.nn.gelu, dense(ff_dim, embed_dim))
        self.layer_norm2 = nnx.LayerNorm(embed_dim, rngs=rngs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(inputs[..., 0])
        out1 = self.layer_norm1(inputs + self.attention(inputs, mask=mask))
        return self.layer_norm2(out1 + self.mlp(out1))


class MiniGPT(nnx.Module):
    def __init__(self, maxlen, vocab_size, embed_dim, num_heads, ff_dim, num_blocks, *, rngs):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.List(
            MiniGPTBlock(embed_dim, num_heads, ff_dim, rngs=rngs) for _ in range(num_blocks)
        )
        self.output_layer = nnx.Linear(embed_dim, vocab_size, rngs=rngs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        x = self.embedding_layer(inputs)
        for transformer_block in self.transformer_blocks:
            x = transformer_block(x)
        return self.output_layer(x)


# --- 2. linear_general: MaxText / T5X-like DenseGeneral layers -------------------------
class DenseGeneralAttention(nnx.Module):
    def __init__(self, emb_dim: int, num_heads: int, head_dim: int, *, rngs: nnx.Rngs):
        dense = functools.partial(nnx.LinearGeneral, use_bias=False, rngs=rngs)
        self.query = dense(emb_dim, (num_heads, head_dim))
        self.key = dense(emb_dim, (num_heads, head_dim))
        self.value = dense(emb_dim, (num_heads, head_dim))
        self.out = dense((num_heads, head_dim), emb_dim, axis=(-2, -1))

    def __call__(self, inputs: jax.Array, decoder_positions: jax.Array) -> jax.Array:
        query = rope(self.query(inputs), decoder_positions)
        key = rope(self.key(inputs), decoder_positions)
        weights = jnp.einsum("...qhd,...khd->...hqk", query, key) / np.sqrt(query.shape[-1])
        causal = jnp.tril(jnp.ones((inputs.shape[-2],) * 2, bool))
        weights = jax.nn.softmax(jnp.where(causal, weights, jnp.finfo(weights.dtype).min))
        return self.out(jnp.einsum("...hqk,...khd->...qhd", weights, self.value(inputs)))


class DenseGeneralMlp(nnx.Module):
    def __init__(self, emb_dim: int, mlp_dim: int, *, rngs: nnx.Rngs):
        self.wi_0 = nnx.LinearGeneral(emb_dim, mlp_dim, use_bias=False, rngs=rngs)
        self.wi_1 = nnx.LinearGeneral(emb_dim, mlp_dim, use_bias=False, rngs=rngs)
        self.wo = nnx.LinearGeneral(mlp_dim, emb_dim, use_bias=False, rngs=rngs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        return self.wo(nnx.silu(self.wi_0(inputs)) * self.wi_1(inputs))


class DenseGeneralLayer(nnx.Module):
    def __init__(self, emb_dim, num_heads, head_dim, mlp_dim, *, rngs: nnx.Rngs):
        self.pre_self_attention_layer_norm = nnx.RMSNorm(emb_dim, rngs=rngs)
        self.self_attention = DenseGeneralAttention(emb_dim, num_heads, head_dim, rngs=rngs)
        self.post_self_attention_layer_norm = nnx.RMSNorm(emb_dim, rngs=rngs)
        self.mlp = DenseGeneralMlp(emb_dim, mlp_dim, rngs=rngs)

    def __call__(self, inputs: jax.Array, decoder_positions: jax.Array) -> jax.Array:
        lnx = self.pre_self_attention_layer_norm(inputs)
        x = inputs + self.self_attention(lnx, decoder_positions)
        return x + self.mlp(self.post_self_attention_layer_norm(x))


class DenseGeneralLM(nnx.Module):
    def __init__(self, vocab_size, emb_dim, num_heads, head_dim, mlp_dim, num_layers, *, rngs):
        self.token_embedder = nnx.Embed(vocab_size, emb_dim, rngs=rngs)
        self.layers = nnx.List(
            DenseGeneralLayer(emb_dim, num_heads, head_dim, mlp_dim, rngs=rngs)
            for _ in range(num_layers)
        )
        self.decoder_norm = nnx.RMSNorm(emb_dim, rngs=rngs)

    def __call__(self, decoder_input_tokens: jax.Array) -> jax.Array:
        positions = arange_positions(decoder_input_tokens)
        y = self.token_embedder(decoder_input_tokens)
        for layer in self.layers:
            y = layer(y, positions)
        return self.token_embedder.attend(self.decoder_norm(y))


# --- 4. einsum_qkv: a stacked qkv einsum, as tutorials write it -------------------------
class QkvEinsumBlock(nnx.Module):
    """Pre-norm; attention and MLP (``linear1``/``linear2``, hidden == width) in the block."""

    def __init__(self, features: int, num_heads: int, *, rngs: nnx.Rngs):
        n, d, h = num_heads, features, features // num_heads
        self.norm1 = nnx.LayerNorm(features, rngs=rngs)
        self.qkv_einsum = nnx.Einsum("BTD,SNDH->SBTNH", (3, n, d, h), rngs=rngs)
        self.out_einsum = nnx.Einsum("BTNH,NHD->BTD", (n, h, d), (d,), rngs=rngs)
        self.norm2 = nnx.LayerNorm(features, rngs=rngs)
        self.linear1 = nnx.Linear(features, features, rngs=rngs)
        self.linear2 = nnx.Linear(features, features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        q, k, v = self.qkv_einsum(self.norm1(x))
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.out_einsum(nnx.dot_product_attention(q, k, v, mask=mask))
        return x + self.linear2(nnx.gelu(self.linear1(self.norm2(x))))


class QkvEinsumLM(nnx.Module):
    def __init__(self, vocab: int, features: int, num_heads: int, depth: int, *, rngs):
        self.token_embedding = nnx.Embed(vocab, features, rngs=rngs)
        init = nnx.initializers.normal(stddev=0.02)
        self.pos_embedding = nnx.Param(init(rngs.params(), (1, MAX_SEQ, features)))
        self.blocks = nnx.List(QkvEinsumBlock(features, num_heads, rngs=rngs) for _ in range(depth))
        self.norm = nnx.LayerNorm(features, rngs=rngs)
        self.head = nnx.Linear(features, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.token_embedding(tokens) + self.pos_embedding[:, : tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))

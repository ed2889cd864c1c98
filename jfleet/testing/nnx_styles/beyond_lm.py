"""Models beyond the decoder LM, written as public Flax NNX code writes them (issue 27's forms).

* :class:`VisionTransformer`: a ViT as the Flax / big_vision NNX ports write it (a strided
  ``nnx.Conv`` patch embedding, a class token and learned positions as bare ``Param``\\ s,
  ``nnx.MultiHeadAttention`` encoder blocks that differ only in an unread ``layer_idx``, a
  10-class head that ``mp=4`` does not divide).
* :class:`MnistCnn`: the Flax MNIST tutorial's CNN (two convolutions, average pooling, a relu
  MLP read-out): no blocks, no attention.
* :class:`EncoderDecoder`: a T5-style encoder-decoder (one shared token table, a learned
  relative-position bias ``nnx.Embed(buckets, heads)`` added to every attention's scores,
  cross-attention in the decoder blocks, a separate LM head).
* :class:`MoeDecoder`: a Mixture-of-Experts decoder whose experts keep gate and up in one
  interleaved kernel ``[E, D, 2F]`` read as ``[..., ::2]`` / ``[..., 1::2]``, and a router.
* ``cache_forward``: Meta's Llama reference (:class:`~.ports.LlamaCacheTransformer`) trained
  with a fresh KV cache every step: k / v are written into it with a dynamic update and read
  back.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> vit = VisionTransformer(rngs=nnx.Rngs(0))
  >>> nnx.jit(lambda m, x: m(x))(vit, jnp.zeros((2, 8, 8, 3))).shape  # one program
  (2, 10)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jfleet.testing.nnx_styles._shared import arange_positions

__all__ = ["EncoderDecoder", "MnistCnn", "MoeDecoder", "VisionTransformer", "cache_forward"]


# --- a ViT --------------------------------------------------------------------------------
class ViTBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int, layer_idx: int, *, rngs: nnx.Rngs):
        self.layer_idx = layer_idx  # bookkeeping no computation reads (as many ports keep)
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, mlp_dim, rngs=rngs)
        self.fc2 = nnx.Linear(mlp_dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(nnx.gelu(self.fc1(self.norm2(x))))


class VisionTransformer(nnx.Module):
    def __init__(
        self, image: int = 8, patch: int = 4, dim: int = 32, depth: int = 2, heads: int = 4,
        mlp_dim: int = 64, num_classes: int = 10, *, rngs: nnx.Rngs,
    ):  # fmt: skip
        self.patch_embed = nnx.Conv(3, dim, (patch, patch), strides=(patch, patch), rngs=rngs)
        n = (image // patch) ** 2 + 1
        self.cls_token = nnx.Param(jnp.zeros((1, 1, dim)))
        self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, n, dim)))
        self.blocks = nnx.List([ViTBlock(dim, heads, mlp_dim, i, rngs=rngs) for i in range(depth)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, num_classes, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = self.patch_embed(images)
        x = x.reshape(x.shape[0], -1, x.shape[-1])
        cls = jnp.broadcast_to(self.cls_token[...], (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.pos_embed[...]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


# --- the MNIST tutorial CNN ---------------------------------------------------------------
class MnistCnn(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(16 * 2 * 2, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


# --- a T5-style encoder-decoder -----------------------------------------------------------
def _buckets(q_len: int, k_len: int, buckets: int, causal: bool) -> jax.Array:
    """Relative positions clipped into ``buckets`` (both directions unless causal)."""
    rel = jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None]
    if causal:
        return jnp.clip(-rel, 0, buckets - 1)
    half = buckets // 2
    return jnp.clip(rel, -half, half - 1) + half


class T5Attention(nnx.Module):
    def __init__(self, dim: int, heads: int, *, relative: bool, causal: bool, rngs: nnx.Rngs):
        self.heads, self.causal = heads, causal
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.q, self.k, self.v, self.o = (linear(dim, dim) for _ in range(4))
        self.relative_attention_bias = nnx.Embed(8, heads, rngs=rngs) if relative else None

    def __call__(self, x: jax.Array, memory: jax.Array | None = None) -> jax.Array:
        b, s, d = x.shape
        src = x if memory is None else memory
        split = lambda y: y.reshape(b, y.shape[1], self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(src)), split(self.v(src))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if self.relative_attention_bias is not None:
            bias = self.relative_attention_bias(_buckets(s, src.shape[1], 8, self.causal))
            scores = scores + bias.transpose(2, 0, 1)[None]
        if self.causal:
            scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.o(out.reshape(b, s, d))


class T5Mlp(nnx.Module):
    def __init__(self, dim: int, ff: int, *, rngs: nnx.Rngs):
        self.wi = nnx.Linear(dim, ff, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(ff, dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.wo(nnx.relu(self.wi(x)))


class T5EncoderBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, ff: int, *, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.attn = T5Attention(dim, heads, relative=True, causal=False, rngs=rngs)
        self.mlp = T5Mlp(dim, ff, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class T5DecoderBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, ff: int, *, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.norm3 = nnx.RMSNorm(dim, rngs=rngs)
        self.self_attn = T5Attention(dim, heads, relative=True, causal=True, rngs=rngs)
        self.cross_attn = T5Attention(dim, heads, relative=False, causal=False, rngs=rngs)
        self.mlp = T5Mlp(dim, ff, rngs=rngs)

    def __call__(self, x: jax.Array, memory: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.norm1(x))
        x = x + self.cross_attn(self.norm2(x), memory)
        return x + self.mlp(self.norm3(x))


class EncoderDecoder(nnx.Module):
    def __init__(
        self, vocab: int = 48, dim: int = 32, heads: int = 4, ff: int = 64, layers: int = 2,
        *, rngs: nnx.Rngs,
    ):  # fmt: skip
        self.shared = nnx.Embed(vocab, dim, rngs=rngs)
        self.encoder = nnx.List([T5EncoderBlock(dim, heads, ff, rngs=rngs) for _ in range(layers)])
        self.encoder_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.decoder = nnx.List([T5DecoderBlock(dim, heads, ff, rngs=rngs) for _ in range(layers)])
        self.decoder_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        memory = self.shared(inputs)
        for block in self.encoder:
            memory = block(memory)
        memory = self.encoder_norm(memory)
        x = self.shared(targets)
        for block in self.decoder:
            x = block(x, memory)
        return self.lm_head(self.decoder_norm(x))


# --- a Mixture-of-Experts decoder ---------------------------------------------------------
class MoeLayer(nnx.Module):
    """Experts with gate and up interleaved in one kernel, weighted by a softmax router."""

    def __init__(self, dim: int, ff: int, experts: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Linear(dim, experts, use_bias=False, rngs=rngs)
        self.gate_up = nnx.Param(init(rngs.params(), (experts, dim, 2 * ff)))
        self.down = nnx.Param(init(rngs.params(), (experts, ff, dim)))

    def __call__(self, x: jax.Array) -> jax.Array:
        weights = jax.nn.softmax(self.router(x), axis=-1)
        h = jnp.einsum("bsd,edf->bsef", x, self.gate_up[...])
        h = nnx.silu(h[..., ::2]) * h[..., 1::2]
        y = jnp.einsum("bsef,efd->bsed", h, self.down[...])
        return jnp.einsum("bsed,bse->bsd", y, weights)


class MoeBlock(nnx.Module):
    def __init__(self, dim: int, heads: int, ff: int, experts: int, *, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.attn = T5Attention(dim, heads, relative=False, causal=True, rngs=rngs)
        self.moe = MoeLayer(dim, ff, experts, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class MoeDecoder(nnx.Module):
    def __init__(
        self, vocab: int = 48, dim: int = 32, heads: int = 4, ff: int = 32, experts: int = 3,
        layers: int = 2, *, rngs: nnx.Rngs,
    ):  # fmt: skip
        self.embed_tokens = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List(
            [MoeBlock(dim, heads, ff, experts, rngs=rngs) for _ in range(layers)]
        )
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def cache_forward(model: nnx.Module, batch: dict) -> jax.Array:
    """Llama reference logits with a fresh KV cache per step (written, then read back)."""
    tokens = batch["tokens"]
    positions = arange_positions(tokens)
    logits, _ = model(tokens, positions, cache=model.init_cache(tokens.shape[0]))
    return logits

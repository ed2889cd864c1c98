"""Flax's Gemma styles: ``nnx.Einsum`` attention, bare-``Param`` MLPs, a config; Gemma 2/3's
alternating local / global blocks of one class."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jfleet.testing.nnx_styles._shared import arange_positions, rope


# --- 3. einsum_gemma: Flax's Gemma (config, embedder, attention shared with 7) -----------
@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    sliding_window_size: int | None = None  # Gemma 2/3: local attention on even layers
    final_logit_softcap: float | None = None
    use_qk_norm: bool = False  # Gemma 3


class GemmaEmbedder(nnx.Module):
    """A bare ``[vocab, width]`` table: ``encode`` scales by ``sqrt(width)``, ``decode`` ties."""

    def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=embed_dim**-0.5)
        self.input_embedding = nnx.Param(init(rngs.params(), (vocab_size, embed_dim)))

    def encode(self, x: jax.Array) -> jax.Array:
        table = self.input_embedding[...]
        return table[(x,)] * jnp.sqrt(jnp.float32(table.shape[1]))

    def decode(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x, self.input_embedding[...].T)


class GemmaAttention(nnx.Module):
    """Gemma 1/2/3 attention: q/k norms and a sliding window (static) are options."""

    def __init__(self, cfg: GemmaConfig, sliding_window_size: int | None = None, *, rngs):
        n, k, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.sliding_window_size = sliding_window_size  # None: global attention
        self.use_qk_norm = cfg.use_qk_norm
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (n, d, h), rngs=rngs)
        self.kv_einsum = nnx.Einsum("BSD,CKDH->CBSKH", (2, k, d, h), rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (n, h, d), rngs=rngs)
        if cfg.use_qk_norm:
            self._query_norm = nnx.RMSNorm(h, rngs=rngs)
            self._key_norm = nnx.RMSNorm(h, rngs=rngs)

    def __call__(self, x, segment_pos, attn_mask=None):
        query_proj = self.q_einsum(x)
        key_proj, value_proj = self.kv_einsum(x)
        if self.use_qk_norm:
            query_proj, key_proj = self._query_norm(query_proj), self._key_norm(key_proj)
        query_proj = rope(query_proj, segment_pos) * self.head_dim**-0.5
        key_proj = rope(key_proj, segment_pos)
        if attn_mask is None:
            attn_mask = segment_pos[:, :, None] >= segment_pos[:, None, :]
        if self.sliding_window_size is not None:
            distance = segment_pos[:, :, None] - segment_pos[:, None, :]
            attn_mask = attn_mask & (distance < self.sliding_window_size)
        b, t, _, h = query_proj.shape
        query_proj = query_proj.reshape(b, t, self.num_kv_heads, -1, h)  # [B, T, K, G, H]
        logits = jnp.einsum("BTKGH,BSKH->BKGTS", query_proj, key_proj)
        logits = jnp.where(attn_mask[:, None, None], logits, -2.3819763e38)
        encoded = jnp.einsum("BKGTS,BSKH->BTKGH", jax.nn.softmax(logits, axis=-1), value_proj)
        return self.attn_vec_einsum(encoded.reshape(b, t, self.num_heads, h))


class GemmaFeedForward(nnx.Module):
    """GeGLU of bare kernels ``gating_einsum: [2, features, hidden]``, ``linear``."""

    def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=features**-0.5)
        self.gating_einsum = nnx.Param(init(rngs.params(), (2, features, hidden_dim)))
        self.linear = nnx.Param(init(rngs.params(), (hidden_dim, features)))

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.einsum("...d,cdf->c...f", x, self.gating_einsum[...])
        return jnp.einsum("...f,fd->...d", jax.nn.gelu(gate) * up, self.linear[...])


class GemmaBlock(nnx.Module):
    def __init__(self, cfg: GemmaConfig, *, rngs: nnx.Rngs):
        self.pre_attention_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)
        self.attn = GemmaAttention(cfg, rngs=rngs)
        self.pre_ffw_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)
        self.mlp = GemmaFeedForward(cfg.embed_dim, cfg.hidden_dim, rngs=rngs)

    def __call__(self, x: jax.Array, segment_pos: jax.Array) -> jax.Array:
        attn_output = x + self.attn(self.pre_attention_norm(x), segment_pos)
        return attn_output + self.mlp(self.pre_ffw_norm(attn_output))


class GemmaLM(nnx.Module):
    def __init__(self, cfg: GemmaConfig, *, rngs: nnx.Rngs):
        self.embedder = GemmaEmbedder(cfg.num_embed, cfg.embed_dim, rngs=rngs)
        self.layers = nnx.List(GemmaBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers))
        self.final_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)

    def __call__(self, last_tokens: jax.Array) -> jax.Array:
        positions = arange_positions(last_tokens)
        x = self.embedder.encode(last_tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.embedder.decode(self.final_norm(x))


# --- 7. gemma_alternating: Gemma 2/3; even blocks local, odd global; nnx.data list -----
class Gemma3FeedForward(nnx.Module):
    """GeGLU of ``nnx.Einsum``; the gating kernel is transposed, ``[2, hidden, features]``."""

    def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs):
        self.gating_einsum = nnx.Einsum("BTD,CFD->CBTF", (2, hidden_dim, features), rngs=rngs)
        self.linear = nnx.Einsum("BTF,FD->BTD", (hidden_dim, features), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = self.gating_einsum(x)
        return self.linear(jax.nn.gelu(gate, approximate=True) * up)


class Gemma3Block(nnx.Module):
    def __init__(self, cfg: GemmaConfig, sliding_window_size: int | None, *, rngs: nnx.Rngs):
        norm = functools.partial(nnx.RMSNorm, cfg.embed_dim, rngs=rngs)
        self.pre_attention_norm = norm()
        self.attn = GemmaAttention(cfg, sliding_window_size, rngs=rngs)
        self.post_attention_norm = norm()
        self.pre_ffw_norm = norm()
        self.mlp = Gemma3FeedForward(cfg.embed_dim, cfg.hidden_dim, rngs=rngs)
        self.post_ffw_norm = norm()

    def __call__(self, x, segment_pos, attn_mask):
        attn_output = self.attn(self.pre_attention_norm(x), segment_pos, attn_mask)
        x = x + self.post_attention_norm(attn_output)
        return x + self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x)))


class Gemma3LM(nnx.Module):
    def __init__(self, cfg: GemmaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedder = GemmaEmbedder(cfg.num_embed, cfg.embed_dim, rngs=rngs)
        windows = [None if i % 2 else cfg.sliding_window_size for i in range(cfg.num_layers)]
        self.layers = nnx.data([Gemma3Block(cfg, w, rngs=rngs) for w in windows])
        self.final_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)

    def __call__(self, last_tokens: jax.Array) -> jax.Array:
        positions = arange_positions(last_tokens)
        attn_mask = positions[:, :, None] >= positions[:, None, :]
        x = self.embedder.encode(last_tokens)
        for layer in self.layers:
            x = layer(x, positions, attn_mask)
        logits = self.embedder.decode(self.final_norm(x))
        if (cap := self.cfg.final_logit_softcap) is not None:
            logits = jnp.tanh(logits / cap) * cap
        return logits

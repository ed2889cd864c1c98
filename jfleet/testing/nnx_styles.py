"""A zoo of tiny decoder LMs written the way public Flax NNX code writes them.

``jfleet.auto_parallel`` must find the roles of models it has never seen, not only those of
:mod:`jfleet.models`. Each style is a family of classes with the naming, block container,
call signature, config and layer types of one kind of public NNX code (imitated, nothing
copied) and a hand-written table of the dimension a Megatron layout splits in each weight.

* ``mha``: Flax's MiniGPT tutorial (``nnx.MultiHeadAttention``, ``nnx.Sequential`` MLP).
* ``linear_general``: MaxText / T5X ``DenseGeneral`` layers (``nnx.LinearGeneral``).
* ``einsum_gemma``: Flax's Gemma (``nnx.Einsum`` attention, MLP of bare ``nnx.Param``).
* ``einsum_qkv``: Gemma's multi-head path in a tutorial (stacked ``qkv_einsum``).
* ``gqa_qknorm`` / ``gqa_qknorm_mqa``: Qwen3 / Llama 3 ports (GQA, q/k norms, a config).
* ``kv_cache``: Meta's Llama reference (``wq``..``wo``, ``w1``..``w3``, a KV cache).
* ``gemma_alternating``: Gemma 2/3 (local and global blocks of one class).
* ``dropout``: nanoGPT / minGPT (``nnx.Dict`` of ``wte``/``wpe``/``h``, ``nnx.Dropout``).

Example:
  >>> sorted(STYLES)[:3]
  ['dropout', 'einsum_gemma', 'einsum_qkv']
  >>> STYLES["einsum_gemma"].splits["layers.*.attn.kv_einsum.kernel"]
  1
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = ["MAX_SEQ", "STYLES", "Style"]

MAX_SEQ = 32
"""Longest sequence the learned position tables and the KV cache hold."""


def _rope(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotary embedding of ``x: [b, s, heads, d]`` at integer ``positions: [b, s]``."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _arange_positions(tokens: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


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
        query = _rope(self.query(inputs), decoder_positions)
        key = _rope(self.key(inputs), decoder_positions)
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
        positions = _arange_positions(decoder_input_tokens)
        y = self.token_embedder(decoder_input_tokens)
        for layer in self.layers:
            y = layer(y, positions)
        return self.token_embedder.attend(self.decoder_norm(y))


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
        query_proj = _rope(query_proj, segment_pos) * self.head_dim**-0.5
        key_proj = _rope(key_proj, segment_pos)
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
        positions = _arange_positions(last_tokens)
        x = self.embedder.encode(last_tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.embedder.decode(self.final_norm(x))


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


# --- 5. gqa_qknorm: Qwen3 / Llama 3 ports ----------------------------------------------
@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int = 80
    hidden_size: int = 48
    intermediate_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6


class Qwen3Attention(nnx.Module):
    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        self.config = config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = config.head_dim
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.q_proj = linear(config.hidden_size, heads * head_dim)
        self.k_proj = linear(config.hidden_size, kv_heads * head_dim)
        self.v_proj = linear(config.hidden_size, kv_heads * head_dim)
        self.o_proj = linear(heads * head_dim, config.hidden_size)
        self.q_norm = nnx.RMSNorm(head_dim, epsilon=config.rms_norm_eps, rngs=rngs)
        self.k_norm = nnx.RMSNorm(head_dim, epsilon=config.rms_norm_eps, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        theta = self.config.rope_theta
        q = self.q_norm(self.q_proj(x).reshape(b, s, -1, self.config.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, s, -1, self.config.head_dim))
        v = self.v_proj(x).reshape(b, s, -1, self.config.head_dim)
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
        out = jax.nn.dot_product_attention(q, k, v, mask=mask)  # groups the kv heads itself
        return self.o_proj(out.reshape(b, s, -1))


class Qwen3MLP(nnx.Module):
    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.gate_proj = linear(config.hidden_size, config.intermediate_size)
        self.up_proj = linear(config.hidden_size, config.intermediate_size)
        self.down_proj = linear(config.intermediate_size, config.hidden_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        eps = config.rms_norm_eps
        self.input_layernorm = nnx.RMSNorm(config.hidden_size, epsilon=eps, rngs=rngs)
        self.self_attn = Qwen3Attention(config, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(config.hidden_size, epsilon=eps, rngs=rngs)
        self.mlp = Qwen3MLP(config, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nnx.Module):
    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs)
        self.layers = nnx.List(
            Qwen3DecoderLayer(config, rngs=rngs) for _ in range(config.num_hidden_layers)
        )
        self.norm = nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        positions = _arange_positions(input_ids)
        mask = (positions[:, :, None] >= positions[:, None, :])[:, None]  # [b, 1, s, s]
        hidden_states = self.embed_tokens(input_ids)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, positions, mask)
        return self.norm(hidden_states)


class Qwen3ForCausalLM(nnx.Module):
    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs):
        self.model = Qwen3Model(config, rngs=rngs)
        self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        return self.lm_head(self.model(input_ids))


# --- 6. kv_cache: Meta's Llama reference, with a KV cache -------------------------------
@dataclasses.dataclass(frozen=True)
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 64
    hidden_dim: int = 96
    norm_eps: float = 1e-5
    max_seq_len: int = MAX_SEQ


class LlamaCacheAttention(nnx.Module):
    """With ``cache=(keys, values)``, writes this chunk at its first position in them."""

    def __init__(self, args: ModelArgs, *, rngs: nnx.Rngs):
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads or args.n_heads
        self.head_dim = args.dim // args.n_heads
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.wq = linear(args.dim, self.n_heads * self.head_dim)
        self.wk = linear(args.dim, self.n_kv_heads * self.head_dim)
        self.wv = linear(args.dim, self.n_kv_heads * self.head_dim)
        self.wo = linear(self.n_heads * self.head_dim, args.dim)

    def __call__(self, x, positions, cache=None):
        bsz, seqlen, _ = x.shape
        xq = _rope(self.wq(x).reshape(bsz, seqlen, self.n_heads, self.head_dim), positions)
        xk = _rope(self.wk(x).reshape(bsz, seqlen, self.n_kv_heads, self.head_dim), positions)
        xv = self.wv(x).reshape(bsz, seqlen, self.n_kv_heads, self.head_dim)
        keys, values, key_positions = xk, xv, positions
        if cache is not None:
            start = (0, positions[0, 0], 0, 0)
            keys = jax.lax.dynamic_update_slice(cache[0], xk, start)
            values = jax.lax.dynamic_update_slice(cache[1], xv, start)
            key_positions = jnp.arange(keys.shape[1])[None, :]
        n_rep = self.n_heads // self.n_kv_heads
        repeated_keys = jnp.repeat(keys, n_rep, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", xq, repeated_keys) / np.sqrt(self.head_dim)
        visible = key_positions[:, None, None, :] <= positions[:, None, :, None]
        scores = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        output = jnp.einsum("bhts,bshd->bthd", scores, jnp.repeat(values, n_rep, axis=2))
        output = self.wo(output.reshape(bsz, seqlen, -1))
        return output if cache is None else (output, (keys, values))


class LlamaFeedForward(nnx.Module):
    def __init__(self, dim: int, hidden_dim: int, *, rngs: nnx.Rngs):
        self.w1 = nnx.Linear(dim, hidden_dim, use_bias=False, rngs=rngs)
        self.w2 = nnx.Linear(hidden_dim, dim, use_bias=False, rngs=rngs)
        self.w3 = nnx.Linear(dim, hidden_dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(nnx.silu(self.w1(x)) * self.w3(x))


class LlamaCacheBlock(nnx.Module):
    def __init__(self, args: ModelArgs, *, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(args.dim, epsilon=args.norm_eps, rngs=rngs)
        self.attention = LlamaCacheAttention(args, rngs=rngs)
        self.ffn_norm = nnx.RMSNorm(args.dim, epsilon=args.norm_eps, rngs=rngs)
        self.feed_forward = LlamaFeedForward(args.dim, args.hidden_dim, rngs=rngs)

    def __call__(self, x, positions, cache=None):
        """``x`` without a cache (training); ``(x, new_cache)`` with one (decoding)."""
        if cache is None:
            h = x + self.attention(self.attention_norm(x), positions)
        else:
            attn, cache = self.attention(self.attention_norm(x), positions, cache)
            h = x + attn
        out = h + self.feed_forward(self.ffn_norm(h))
        return out if cache is None else (out, cache)


class LlamaCacheTransformer(nnx.Module):
    def __init__(self, params: ModelArgs, *, rngs: nnx.Rngs):
        self.params = params
        self.tok_embeddings = nnx.Embed(params.vocab_size, params.dim, rngs=rngs)
        self.layers = nnx.List(LlamaCacheBlock(params, rngs=rngs) for _ in range(params.n_layers))
        self.norm = nnx.RMSNorm(params.dim, epsilon=params.norm_eps, rngs=rngs)
        self.output = nnx.Linear(params.dim, params.vocab_size, use_bias=False, rngs=rngs)

    def init_cache(self, batch_size: int) -> list[tuple[jax.Array, jax.Array]]:
        """An empty ``(keys, values)`` per layer."""
        attn = self.layers[0].attention
        shape = (batch_size, self.params.max_seq_len, attn.n_kv_heads, attn.head_dim)
        return [(jnp.zeros(shape), jnp.zeros(shape)) for _ in self.layers]

    def __call__(self, tokens, positions=None, cache=None):
        """Logits ``[b, s, vocab]``; with a ``cache``, ``(logits, new_cache)``."""
        if positions is None:
            positions = _arange_positions(tokens)
        h = self.tok_embeddings(tokens)
        new_cache = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                h = layer(h, positions)
            else:
                h, layer_cache = layer(h, positions, cache=cache[i])
                new_cache.append(layer_cache)
        logits = self.output(self.norm(h))
        return logits if cache is None else (logits, new_cache)


def llama_forward(model: LlamaCacheTransformer, batch: dict) -> jax.Array:
    """How a training script calls the model: explicit positions, no cache."""
    tokens = jnp.asarray(batch["tokens"])
    positions = jnp.arange(tokens.shape[1])[None, :].repeat(tokens.shape[0], axis=0)
    return model(tokens, positions=positions)


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
        positions = _arange_positions(last_tokens)
        attn_mask = positions[:, :, None] >= positions[:, None, :]
        x = self.embedder.encode(last_tokens)
        for layer in self.layers:
            x = layer(x, positions, attn_mask)
        logits = self.embedder.decode(self.final_norm(x))
        if (cap := self.cfg.final_logit_softcap) is not None:
            logits = jnp.tanh(logits / cap) * cap
        return logits


# --- 8. dropout: nanoGPT / minGPT with dropout ------------------------------------------
class CausalSelfAttention(nnx.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, *, rngs: nnx.Rngs):
        self.n_head = n_head
        self.key = nnx.Linear(n_embd, n_embd, rngs=rngs)
        self.query = nnx.Linear(n_embd, n_embd, rngs=rngs)
        self.value = nnx.Linear(n_embd, n_embd, rngs=rngs)
        self.attn_drop = nnx.Dropout(dropout, rngs=rngs)
        self.resid_drop = nnx.Dropout(dropout, rngs=rngs)
        self.proj = nnx.Linear(n_embd, n_embd, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, c = x.shape
        k, q, v = (
            y(x).reshape(b, t, self.n_head, c // self.n_head).swapaxes(1, 2)
            for y in (self.key, self.query, self.value)
        )
        att = (q @ k.swapaxes(-2, -1)) * (1.0 / np.sqrt(k.shape[-1]))
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        att = self.attn_drop(jax.nn.softmax(att, axis=-1))
        y = (att @ v).swapaxes(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nnx.Module):
    def __init__(self, n_embd: int, dropout: float, *, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(n_embd, 4 * n_embd, rngs=rngs)
        self.c_proj = nnx.Linear(4 * n_embd, n_embd, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.c_proj(nnx.gelu(self.c_fc(x))))


class Block(nnx.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, *, rngs: nnx.Rngs):
        self.ln_1 = nnx.LayerNorm(n_embd, rngs=rngs)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(n_embd, rngs=rngs)
        self.mlp = MLP(n_embd, dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nnx.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.1, *, rngs):
        self.transformer = nnx.Dict(
            wte=nnx.Embed(vocab_size, n_embd, rngs=rngs),
            wpe=nnx.Embed(block_size, n_embd, rngs=rngs),
            drop=nnx.Dropout(dropout, rngs=rngs),
            h=nnx.List(Block(n_embd, n_head, dropout, rngs=rngs) for _ in range(n_layer)),
            ln_f=nnx.LayerNorm(n_embd, rngs=rngs),
        )
        self.lm_head = nnx.Linear(n_embd, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, idx: jax.Array) -> jax.Array:
        pos = jnp.arange(idx.shape[1])
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


# --- the registry ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Style:
    """One public-code style: how to build, feed and train it, and its Megatron layout.

    ``build(rngs)`` makes the tiny fp32 model; ``batches(n, batch=8, seq=8, seed=0)`` gives
    ``n`` NumPy batches ``{"tokens": int32 [batch, seq], "labels": int32 [batch, seq]}``
    (next tokens of stride-3 sequences, so the loss can fall); ``loss_fn(model, batch)`` is
    the mean next-token cross-entropy, through ``forward(model, batch) -> logits`` where
    the style has one (``None``: the call is ``model(batch["tokens"])``).

    ``splits``: every attention and MLP weight of a block (dotted path from the root, ``*``
    for the block index) -> the dimension a Megatron layout splits: the (kv) heads or hidden
    dimension of a column weight, the one contracted with it in a row weight (``heads *
    head_dim`` in a 2-D ``nnx.Linear``). ``roles``: ``q``, ``k``, ``v``, ``kv``, ``qkv``,
    ``o``, ``gate``, ``up``, ``gate_up`` or ``down`` per path; ``shapes``: its shape.
    ``kv_replicated_at``: the smallest power-of-two mp not dividing ``kv_heads`` (``None``
    without grouped-query attention). ``pipelines``: whether the blocks (at ``blocks_at``)
    could be pipelined without changing the model code.
    """

    name: str
    build: Callable[[nnx.Rngs], nnx.Module]
    batches: Callable[..., list[dict]]
    loss_fn: Callable[[nnx.Module, dict], jax.Array]
    forward: Callable[[nnx.Module, dict], jax.Array] | None
    splits: dict[str, int]
    roles: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    kv_replicated_at: int | None
    vocab: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    layers: int
    blocks_at: str
    pipelines: bool
    note: str


def _batches(n: int, batch: int = 8, seq: int = 8, seed: int = 0, *, vocab: int) -> list[dict]:
    """``n`` batches of ``start, start + 3, start + 6, ... (mod vocab)`` from random starts."""
    if seq > MAX_SEQ:
        raise ValueError(f"seq={seq} is longer than MAX_SEQ={MAX_SEQ}.")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, vocab, size=(batch, 1))
        tokens = ((start + 3 * np.arange(seq + 1)) % vocab).astype(np.int32)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


_BUILDS = {
    "mha": lambda rngs: MiniGPT(MAX_SEQ, 96, 32, 4, 128, 2, rngs=rngs),
    "linear_general": lambda rngs: DenseGeneralLM(64, 48, 4, 12, 96, 2, rngs=rngs),
    "einsum_gemma": lambda rngs: GemmaLM(GemmaConfig(128, 32, 64, 4, 2, 8, 2), rngs=rngs),
    "einsum_qkv": lambda rngs: QkvEinsumLM(64, 64, 8, 2, rngs=rngs),
    "gqa_qknorm": lambda rngs: Qwen3ForCausalLM(Qwen3Config(), rngs=rngs),
    "gqa_qknorm_mqa": lambda rngs: Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=1), rngs=rngs),
    "kv_cache": lambda rngs: LlamaCacheTransformer(ModelArgs(), rngs=rngs),
    "gemma_alternating": lambda rngs: Gemma3LM(
        GemmaConfig(128, 32, 64, 4, 2, 16, 4, 4, 30.0, True), rngs=rngs
    ),
    "dropout": lambda rngs: GPT(64, MAX_SEQ, 2, 4, 32, 0.1, rngs=rngs),
}

_SIZE_FIELDS = "vocab width heads kv_heads head_dim hidden layers kv_replicated_at pipelines"
_SIZES = {
    "mha": (96, 32, 4, 4, 8, 128, 2, None, True),
    "linear_general": (64, 48, 4, 4, 12, 96, 2, None, True),
    "einsum_gemma": (128, 32, 4, 2, 8, 64, 2, 4, True),
    "einsum_qkv": (64, 64, 8, 8, 8, 64, 2, None, True),
    "gqa_qknorm": (80, 48, 4, 2, 8, 96, 2, 4, True),
    "gqa_qknorm_mqa": (80, 48, 4, 1, 8, 96, 2, 2, True),
    "kv_cache": (64, 32, 4, 4, 8, 96, 2, None, True),
    "gemma_alternating": (128, 32, 4, 2, 16, 64, 4, 4, True),
    "dropout": (64, 32, 4, 4, 8, 128, 2, None, False),
}

# [name] block container, then per weight of a block: path  role  split dimension  shape
_TABLES = """
[mha] transformer_blocks
attention.query.kernel        q        1  32x4x8
attention.key.kernel          k        1  32x4x8
attention.value.kernel        v        1  32x4x8
attention.out.kernel          o        0  4x8x32
mlp.layers.0.kernel           up       1  32x128
mlp.layers.2.kernel           down     0  128x32
[linear_general] layers
self_attention.query.kernel   q        1  48x4x12
self_attention.key.kernel     k        1  48x4x12
self_attention.value.kernel   v        1  48x4x12
self_attention.out.kernel     o        0  4x12x48
mlp.wi_0.kernel               gate     1  48x96
mlp.wi_1.kernel               up       1  48x96
mlp.wo.kernel                 down     0  96x48
[einsum_gemma] layers
attn.q_einsum.kernel          q        0  4x32x8
attn.kv_einsum.kernel         kv       1  2x2x32x8
attn.attn_vec_einsum.kernel   o        0  4x8x32
mlp.gating_einsum             gate_up  2  2x32x64
mlp.linear                    down     0  64x32
[einsum_qkv] blocks
qkv_einsum.kernel             qkv      1  3x8x64x8
out_einsum.kernel             o        0  8x8x64
linear1.kernel                up       1  64x64
linear2.kernel                down     0  64x64
[gqa_qknorm] model.layers
self_attn.q_proj.kernel       q        1  48x32
self_attn.k_proj.kernel       k        1  48x16
self_attn.v_proj.kernel       v        1  48x16
self_attn.o_proj.kernel       o        0  32x48
mlp.gate_proj.kernel          gate     1  48x96
mlp.up_proj.kernel            up       1  48x96
mlp.down_proj.kernel          down     0  96x48
[gqa_qknorm_mqa] model.layers
self_attn.q_proj.kernel       q        1  48x32
self_attn.k_proj.kernel       k        1  48x8
self_attn.v_proj.kernel       v        1  48x8
self_attn.o_proj.kernel       o        0  32x48
mlp.gate_proj.kernel          gate     1  48x96
mlp.up_proj.kernel            up       1  48x96
mlp.down_proj.kernel          down     0  96x48
[kv_cache] layers
attention.wq.kernel           q        1  32x32
attention.wk.kernel           k        1  32x32
attention.wv.kernel           v        1  32x32
attention.wo.kernel           o        0  32x32
feed_forward.w1.kernel        gate     1  32x96
feed_forward.w3.kernel        up       1  32x96
feed_forward.w2.kernel        down     0  96x32
[gemma_alternating] layers
attn.q_einsum.kernel          q        0  4x32x16
attn.kv_einsum.kernel         kv       1  2x2x32x16
attn.attn_vec_einsum.kernel   o        0  4x16x32
mlp.gating_einsum.kernel      gate_up  1  2x64x32
mlp.linear.kernel             down     0  64x32
[dropout] transformer.h
attn.query.kernel             q        1  32x32
attn.key.kernel               k        1  32x32
attn.value.kernel             v        1  32x32
attn.proj.kernel              o        0  32x32
mlp.c_fc.kernel               up       1  32x128
mlp.c_proj.kernel             down     0  128x32
"""

_NOTES = {
    "mha": "post-norm; biased 3-D q/k/v/o; Sequential MLP; the block makes its own mask",
    "linear_general": "3-D LinearGeneral kernels, out contracts two axes; attend-tied head",
    "einsum_gemma": "MLP weights are bare nnx.Param in jnp.einsum; bare tied embedding",
    "einsum_qkv": "hidden == width; attention and MLP weights straight in the block",
    "gqa_qknorm": "2 kv heads; heads * head_dim != width; blocks in model.layers",
    "gqa_qknorm_mqa": "gqa_qknorm with one kv head: k/v cannot split even at mp 2",
    "kv_cache": "block returns (x, cache) with a cache; training without one pipelines",
    "gemma_alternating": "graphs differ by a static window; stages need whole pairs",
    "dropout": "blocks own RNG streams advanced per call: no pipeline as-is",
}


def _style(header: str, table: str) -> Style:
    name, blocks_at = header.lstrip("[").split("] ")
    rows = [line.split() for line in table.splitlines()]
    forward = llama_forward if name == "kv_cache" else None

    def loss_fn(model: nnx.Module, batch: dict) -> jax.Array:
        logits = forward(model, batch) if forward else model(jnp.asarray(batch["tokens"]))
        logits, labels = logits.astype(jnp.float32), jnp.asarray(batch["labels"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    paths = [f"{blocks_at}.*.{row[0]}" for row in rows]
    return Style(
        name=name,
        build=_BUILDS[name],
        batches=functools.partial(_batches, vocab=_SIZES[name][0]),
        loss_fn=loss_fn,
        forward=forward,
        splits={path: int(row[2]) for path, row in zip(paths, rows, strict=True)},
        roles={path: row[1] for path, row in zip(paths, rows, strict=True)},
        shapes={p: tuple(map(int, row[3].split("x"))) for p, row in zip(paths, rows, strict=True)},
        blocks_at=blocks_at,
        note=_NOTES[name],
        **dict(zip(_SIZE_FIELDS.split(), _SIZES[name], strict=True)),
    )


STYLES: dict[str, Style] = {
    (style := _style(*section.strip().split("\n", 1))).name: style
    for section in _TABLES.split("\n[")[1:]
}
"""The zoo, by name."""

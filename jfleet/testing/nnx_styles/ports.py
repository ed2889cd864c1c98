"""Ports of reference implementations: Qwen3 / Llama 3 (GQA, q/k norms), Meta's Llama with a
KV cache, nanoGPT / minGPT with dropout."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfleet.testing.nnx_styles._shared import MAX_SEQ, arange_positions, rope


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
        q, k = rope(q, positions, theta), rope(k, positions, theta)
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
        positions = arange_positions(input_ids)
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
        xq = rope(self.wq(x).reshape(bsz, seqlen, self.n_heads, self.head_dim), positions)
        xk = rope(self.wk(x).reshape(bsz, seqlen, self.n_kv_heads, self.head_dim), positions)
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
            positions = arange_positions(tokens)
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

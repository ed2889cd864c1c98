"""A small Llama-style decoder in plain Flax NNX, with no distributed code.

The model of Paddle's ``to_distributed`` example, scaled down: a token embedding,
``layers`` decoder layers (RMSNorm -> rotary self-attention with separate q/k/v/o
projections and optional grouped-query heads -> residual; RMSNorm -> SwiGLU MLP
gate/up/down -> residual), a final RMSNorm, and a bare ``[width, vocab]`` weight
matrix as the LM head. No projection has a bias. Every layer is an ordinary
``nnx.Linear`` / ``nnx.Embed`` / ``nnx.RMSNorm``: :mod:`jfleet.auto_parallel` finds the
tensor-parallel roles from the structure.

Example:
  >>> from jfleet.models import lm_batches, lm_loss
  >>> model = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2)
  >>> model(lm_batches(1)[0]["tokens"]).shape
  (16, 8, 64)
  >>> float(lm_loss(model, lm_batches(1)[0])) > 0
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jfleet.models.attention import causal_attention


def rotary(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding of ``x: [batch, seq, heads, head_dim]`` (positions 0..seq-1).

    The two halves of the head dimension are rotated against each other (the
    ``rotate_half`` form used by Llama).
    """
    seq, dim = x.shape[1], x.shape[-1]
    half = dim // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq[None, :]
    cos = jnp.cos(angle)[None, :, None, :].astype(x.dtype)
    sin = jnp.sin(angle)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LlamaAttention(nnx.Module):
    """Causal rotary self-attention with q/k/v/o projections and ``kv_heads`` key/value heads.

    The core is :func:`~jfleet.models.attention.causal_attention`
    (``jax.nn.dot_product_attention``: cuDNN flash attention on a GPU, XLA elsewhere).
    """

    def __init__(self, width: int, heads: int, kv_heads: int, *, rngs: nnx.Rngs) -> None:
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}.")
        if heads % kv_heads:
            raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}.")
        head_dim = width // heads
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} (width // heads) must be even for rotary.")
        self.num_heads = heads
        self.num_key_value_heads = kv_heads
        self.head_dim = head_dim
        self.q_proj = nnx.Linear(width, heads * head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(width, kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(width, kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(heads * head_dim, width, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        h, kv, d = self.num_heads, self.num_key_value_heads, self.head_dim
        q = rotary(self.q_proj(x).reshape(b, s, h, d))
        k = rotary(self.k_proj(x).reshape(b, s, kv, d))
        v = self.v_proj(x).reshape(b, s, kv, d)
        # grouped-query heads are grouped inside (no repeat); flash attention on a GPU
        return self.o_proj(causal_attention(q, k, v).reshape(b, s, h * d))


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.gate_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.up_proj = nnx.Linear(width, hidden, use_bias=False, rngs=rngs)
        self.down_proj = nnx.Linear(hidden, width, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(
        self, width: int, heads: int, kv_heads: int, hidden: int, *, rngs: nnx.Rngs
    ) -> None:
        self.input_layernorm = nnx.RMSNorm(width, rngs=rngs)
        self.self_attn = LlamaAttention(width, heads, kv_heads, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(width, rngs=rngs)
        self.mlp = LlamaMLP(width, hidden, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nnx.Module):
    """Embedding, ``layers`` decoder layers, final RMSNorm, and a ``[width, vocab]`` head matrix.

    Args:
      vocab: vocabulary size.
      width: model width (hidden size).
      heads: attention (query) heads; must divide ``width``.
      kv_heads: key/value heads (grouped-query attention); must divide ``heads``.
        ``None`` means ``heads`` (multi-head attention).
      layers: decoder layers.
      hidden: SwiGLU hidden size; ``None`` means ``2 * width``.
      seed: initialisation seed.
    """

    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        heads: int = 4,
        kv_heads: int | None = None,
        layers: int = 2,
        hidden: int | None = None,
        *,
        seed: int = 0,
    ) -> None:
        rngs = nnx.Rngs(seed)
        kv_heads = heads if kv_heads is None else kv_heads
        hidden = 2 * width if hidden is None else hidden
        self.embed_tokens = nnx.Embed(vocab, width, rngs=rngs)
        self.layers = nnx.List(
            [LlamaDecoderLayer(width, heads, kv_heads, hidden, rngs=rngs) for _ in range(layers)]
        )
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        init = nnx.initializers.normal(stddev=width**-0.5)
        self.lm_head = nnx.Param(init(rngs.params(), (width, vocab), jnp.float32))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.lm_head[...]

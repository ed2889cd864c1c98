"""A small GPT-2-style decoder in plain Flax NNX, with no distributed code.

Token and learned position embeddings, ``layers`` pre-norm blocks (LayerNorm -> causal
self-attention with one fused, biased qkv projection and a biased output projection ->
residual; LayerNorm -> GELU MLP up/down with biases -> residual), a final LayerNorm, and a
head *tied* to the token embedding (``wte.attend``). Parameter names follow GPT-2
(``wte``, ``wpe``, ``h``, ``ln_1``, ``c_attn``, ``c_proj``, ``c_fc``, ``ln_f``).

The fused projection's output is laid out per head, ``[heads, 3, head_dim]`` (Megatron's
layout), so a contiguous split of its output dimension gives whole heads: the layout
:mod:`jfleet.auto_parallel` assumes for a fused qkv. (The original GPT-2 checkpoint uses
``[3, heads, head_dim]``; its columns must be permuted before tensor-parallel use.)

Example:
  >>> from jfleet.models import lm_batches, lm_loss
  >>> model = TinyGPT2(vocab=64, width=32, heads=4, layers=2)
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


class GPT2Attention(nnx.Module):
    """Causal self-attention: fused ``c_attn`` (width -> 3 width, per-head layout), ``c_proj``.

    The core is :func:`~jfleet.models.attention.causal_attention` (flash on a GPU).
    """

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs) -> None:
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}.")
        self.n_head = heads
        self.c_attn = nnx.Linear(width, 3 * width, rngs=rngs)
        self.c_proj = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, w = x.shape
        h = self.n_head
        d = w // h
        qkv = self.c_attn(x).reshape(b, s, h, 3, d)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        return self.c_proj(causal_attention(q, k, v).reshape(b, s, w))


class GPT2MLP(nnx.Module):
    """``c_proj(gelu(c_fc(x)))`` with biases."""

    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.c_fc = nnx.Linear(width, hidden, rngs=rngs)
        self.c_proj = nnx.Linear(hidden, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x)))


class GPT2Block(nnx.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, width: int, heads: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.ln_1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = GPT2Attention(width, heads, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(width, rngs=rngs)
        self.mlp = GPT2MLP(width, hidden, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT2(nnx.Module):
    """GPT-2 shape: ``wte`` + ``wpe``, ``layers`` blocks, ``ln_f``, head tied to ``wte``.

    Args:
      vocab: vocabulary size.
      width: model width.
      heads: attention heads; must divide ``width``.
      layers: blocks.
      hidden: MLP hidden size; ``None`` means ``4 * width``.
      max_len: positions the learned position embedding covers.
      seed: initialisation seed.
    """

    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        heads: int = 4,
        layers: int = 2,
        hidden: int | None = None,
        max_len: int = 64,
        *,
        seed: int = 0,
    ) -> None:
        rngs = nnx.Rngs(seed)
        hidden = 4 * width if hidden is None else hidden
        self.wte = nnx.Embed(vocab, width, rngs=rngs)
        self.wpe = nnx.Embed(max_len, width, rngs=rngs)
        self.h = nnx.List([GPT2Block(width, heads, hidden, rngs=rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        s = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(jnp.arange(s))[None]
        for block in self.h:
            x = block(x)
        return self.wte.attend(self.ln_f(x))

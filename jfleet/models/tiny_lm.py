"""A GPT-shaped toy language model without attention, and the token data the models train on.

Example:
  >>> model = TinyLM()
  >>> batch = lm_batches(1)[0]
  >>> float(lm_loss(model, batch)) > 0
  True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Block(nnx.Module):
    """LayerNorm -> Linear -> gelu -> Linear, with a residual."""

    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class TinyLM(nnx.Module):
    """Embedding, two blocks, final norm, head: a GPT-shaped model without attention."""

    def __init__(self, vocab: int = 64, width: int = 32, hidden: int = 64, *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, hidden, rngs=rngs) for _ in range(2)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy in fp32."""
    logits = model(batch["tokens"]).astype(jnp.float32)
    labels = jax.nn.one_hot(batch["labels"], logits.shape[-1])
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))


def lm_batches(n: int, batch: int = 16, seq: int = 8, vocab: int = 64, seed: int = 0) -> list:
    """``n`` random token batches as NumPy dicts."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


def stride_batches(
    n: int, batch: int = 16, seq: int = 8, vocab: int = 64, stride: int = 7, seed: int = 0
) -> list[dict]:
    """``n`` batches of sequences ``s, s+stride, s+2*stride, ... (mod vocab)`` from random ``s``.

    The next token depends on the current one only, so even the attention-free
    :class:`TinyLM` learns it and the loss really falls (unlike on :func:`lm_batches`).
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, vocab, size=(batch, 1))
        tokens = ((start + stride * np.arange(seq + 1)) % vocab).astype(np.int32)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out

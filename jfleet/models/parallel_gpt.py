"""A small GPT built either from plain Flax layers or from jfleet's tensor-parallel layers.

``TinyGPT(..., tensor_parallel=False)`` is an ordinary single-device NNX model;
``tensor_parallel=True`` builds the same model (same parameter names, shapes and, with
the same seed, the same initial values) from :mod:`jfleet.fleet.meta_parallel` layers in the
Megatron layout: q/k/v and the MLP's up projection column-parallel, the attention output
and the MLP's down projection row-parallel, the embedding and the LM head split over the
vocabulary, the loss a :class:`~jfleet.parallel.cross_entropy.ParallelCrossEntropy`.
``sequence_parallel=True`` adds Paddle's sequence parallelism: activations between the
tensor-parallel regions are split over the sequence on ``mp``.

Example:
  >>> from jfleet.models import lm_batches
  >>> model = TinyGPT()
  >>> float(gpt_loss(model, lm_batches(1)[0])) > 0
  True
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jfleet.models.attention import causal_attention
from jfleet.parallel.cross_entropy import parallel_cross_entropy
from jfleet.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from jfleet.parallel.sequence import (
    ColumnSequenceParallelLinear,
    RowSequenceParallelLinear,
    gather_from_sequence_parallel,
    mark_as_sequence_parallel_parameter,
    scatter_to_sequence_parallel,
)


def _layers(tensor_parallel: bool, sequence_parallel: bool):
    """(column, row, embed) constructors for the chosen layout."""
    if not tensor_parallel:
        if sequence_parallel:
            raise ValueError("sequence_parallel=True needs tensor_parallel=True.")
        return (
            functools.partial(nnx.Linear, use_bias=True),
            functools.partial(nnx.Linear, use_bias=True),
            nnx.Embed,
        )
    if sequence_parallel:
        return (
            functools.partial(
                ColumnSequenceParallelLinear, has_bias=True, gather_output=False, seq_axis=1
            ),
            functools.partial(
                RowSequenceParallelLinear, has_bias=True, input_is_parallel=True, seq_axis=1
            ),
            VocabParallelEmbedding,
        )
    return (
        functools.partial(ColumnParallelLinear, has_bias=True, gather_output=False),
        functools.partial(RowParallelLinear, has_bias=True, input_is_parallel=True),
        VocabParallelEmbedding,
    )


class Attention(nnx.Module):
    """Causal multi-head self-attention: a fused qkv projection and an output projection.

    The fused projection's output is laid out per head (``[heads, 3, head_dim]``, as in
    Megatron), so splitting it over ``mp`` gives each rank whole heads. The core is
    :func:`~jfleet.models.attention.causal_attention` (flash on a GPU).
    """

    def __init__(self, width: int, heads: int, *, column, row, rngs: nnx.Rngs) -> None:
        if width % heads:
            raise ValueError(f"width={width} must be a multiple of heads={heads}.")
        self.heads = heads
        self.qkv = column(width, 3 * width, rngs=rngs)
        self.o = row(width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, _, w = x.shape
        hd = w // self.heads
        qkv = self.qkv(x).reshape(b, -1, self.heads, 3, hd)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        s_full = q.shape[1]
        return self.o(causal_attention(q, k, v).reshape(b, s_full, w))


class MLP(nnx.Module):
    """up (column) -> gelu -> down (row)."""

    def __init__(self, width: int, hidden: int, *, column, row, rngs: nnx.Rngs) -> None:
        self.up = column(width, hidden, rngs=rngs)
        self.down = row(hidden, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x)))


class GPTBlock(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, width: int, heads: int, hidden: int, *, column, row, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(width, rngs=rngs)
        self.attn = Attention(width, heads, column=column, row=row, rngs=rngs)
        self.norm2 = nnx.LayerNorm(width, rngs=rngs)
        self.mlp = MLP(width, hidden, column=column, row=row, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nnx.Module):
    """Embedding, ``layers`` GPT blocks, final norm, LM head (untied)."""

    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        heads: int = 4,
        layers: int = 2,
        hidden: int | None = None,
        *,
        tensor_parallel: bool = False,
        sequence_parallel: bool = False,
        seed: int = 0,
    ) -> None:
        column, row, embed = _layers(tensor_parallel, sequence_parallel)
        rngs = nnx.Rngs(seed)
        self.tensor_parallel = tensor_parallel
        self.sequence_parallel = sequence_parallel
        self.embed = embed(vocab, width, rngs=rngs)
        self.blocks = nnx.List(
            [
                GPTBlock(width, heads, hidden or 4 * width, column=column, row=row, rngs=rngs)
                for _ in range(layers)
            ]
        )
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        if tensor_parallel:
            self.head = ColumnParallelLinear(
                width, vocab, has_bias=False, gather_output=False, rngs=rngs
            )
        else:
            self.head = nnx.Linear(width, vocab, use_bias=False, rngs=rngs)
        if sequence_parallel:
            for block in self.blocks:
                for norm in (block.norm1, block.norm2):
                    mark_as_sequence_parallel_parameter(norm.scale)
                    mark_as_sequence_parallel_parameter(norm.bias)
            mark_as_sequence_parallel_parameter(self.norm.scale)
            mark_as_sequence_parallel_parameter(self.norm.bias)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel(x, seq_axis=1)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel(x, seq_axis=1)
        return self.head(x)


def gpt_loss(model: nnx.Module, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy (the vocabulary-parallel one for a tensor-parallel model)."""
    logits = model(batch["tokens"])
    inner = getattr(model, "module", model)
    if getattr(inner, "tensor_parallel", False):
        return jnp.mean(parallel_cross_entropy(logits, batch["labels"]))
    return jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["labels"])
    )

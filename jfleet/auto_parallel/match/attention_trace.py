"""Whether the traced attention materialises its ``s x s`` scores, and a fused one's FLOPs.

The trace :func:`~jfleet.auto_parallel.match.patterns.match_patterns` reads lists every product
of two activations (:attr:`~jfleet.auto_parallel.match.patterns.DotCost.attention`): the scores
``q k^T`` and the weighted values of an attention written out (einsum, ``jnp.matmul``, or
``jax.nn.dot_product_attention``'s XLA implementation). Those programs hold the ``s x s``
scores and probabilities between the forward and the backward pass. A fused attention (a
flash kernel: ``jax.nn.dot_product_attention(implementation="cudnn")``, a Pallas kernel)
appears as one opaque call with no such product: it keeps only its output and the
row statistics, and its FLOPs do not show among the traced products, so
:func:`fused_attention_flops` counts them from the shapes (``4 s^2 q_dim`` a sequence
forward per layer, the convention of Narayanan et al., SC21).

Example:
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> scores_materialised(match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2)))
  True
"""

from __future__ import annotations

import dataclasses

from jfleet.auto_parallel.match.patterns import ModelPatterns

__all__ = ["fused_attention_flops", "scores_materialised", "without_attention_products"]


def scores_materialised(patterns: ModelPatterns) -> bool:
    """True unless the model has attention whose trace shows no product of activations.

    Without a trace (no products recorded) the scores are taken as materialised.
    """
    if not patterns.attention or not patterns.dots:
        return True
    return any(d.attention for d in patterns.dots)


def fused_attention_flops(patterns: ModelPatterns, tokens: float, seq_len: int) -> float:
    """Forward FLOPs of a fused attention the trace does not show, over all layers.

    Args:
      patterns: the matched model.
      tokens: tokens processed (per device, as the caller counts them).
      seq_len: tokens per sequence (each attends to ``seq_len`` keys).

    Returns:
      ``4 x tokens x seq_len x q_dim x layers`` when the attention is fused, else 0.
    """
    if scores_materialised(patterns):
        return 0.0
    layers = len(patterns.blocks) or 1
    return 4.0 * tokens * seq_len * patterns.dims.q_dim * layers


def without_attention_products(patterns: ModelPatterns) -> ModelPatterns:
    """``patterns`` as a fused attention would be traced: no products of two activations.

    For testing and for planning a model whose attention kernel will be swapped for a
    fused one: ``scores_materialised`` of the result is False.
    """
    return dataclasses.replace(patterns, dots=tuple(d for d in patterns.dots if not d.attention))

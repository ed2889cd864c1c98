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

The reference models call :func:`jfleet.models.attention.causal_attention`, which picks its
implementation by platform (cuDNN flash on a GPU for half inputs, XLA elsewhere). The trace
runs on the planning host, so it shows the XLA implementation's products, marked
(:attr:`~jfleet.auto_parallel.match.matched.DotCost.platform_attention`);
:func:`attention_as_run` turns them into what the planned platform runs.

Example:
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> scores_materialised(match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2)))
  True
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jfleet.auto_parallel.match.patterns import ModelPatterns

__all__ = [
    "attention_as_run",
    "fused_attention_flops",
    "scores_materialised",
    "without_attention_products",
]


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


def attention_as_run(
    patterns: ModelPatterns,
    platform: str,
    dtype: str,
    *,
    materialised: bool = False,
    max_head_dim: int = 256,
) -> tuple[ModelPatterns, str]:
    """``patterns`` as ``platform`` runs their attention, and a note saying why.

    The products traced inside :func:`jfleet.models.attention.causal_attention` are the XLA
    implementation's, because the trace runs on the planning host. Where that call picks
    cuDNN's flash attention on ``platform`` (:func:`~jfleet.models.attention.
    attention_implementation`: a GPU, ``bfloat16`` / ``float16``, a head dimension the
    kernel takes) they are dropped (no ``s x s`` scores kept; :func:`fused_attention_flops`
    counts the FLOPs). Other products, and every product on a CPU, stay as traced.

    Args:
      patterns: the matched model.
      platform: the planned devices' platform (``HardwareProfile.platform``).
      dtype: the compute dtype.
      materialised: charge the traced (materialised) scores even where the call would
        run fused (the planner's ``materialised_attention``).
      max_head_dim: the largest head dimension the platform's flash kernel takes.

    Returns:
      ``(patterns, note)``: the patterns to cost, and the decision with its reason for the
      plan's notes (``""`` when there is nothing to say: no marked attention, or a CPU,
      where the trace is what runs).

    Example:
      >>> from jfleet.auto_parallel.match.patterns import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> found = match_patterns(TinyLlama(vocab=64, width=64, heads=4, layers=2))
      >>> fused, note = attention_as_run(found, "gpu", "bfloat16")
      >>> scores_materialised(found), scores_materialised(fused), note[:16]
      (True, False, 'attention: fused')
      >>> attention_as_run(found, "cpu", "bfloat16")[0] is found
      True
    """
    # imported here: loading a saved model (checkpoint -> auto_parallel) needs no models
    from jfleet.models.attention import FLASH_DTYPES, attention_implementation

    marked = [d for d in patterns.dots if d.attention and d.platform_attention]
    if not marked or platform == "cpu":
        return patterns, ""
    head_dim = patterns.dims.head_dim
    impl = attention_implementation(platform, dtype, head_dim, max_head_dim=max_head_dim)
    where = f"{platform}, {jnp.dtype(dtype).name}, head_dim {head_dim}"
    if impl == "xla":
        return patterns, (
            f"attention: materialised ({where}): causal_attention runs XLA's "
            f"dot_product_attention here (cuDNN flash needs {' / '.join(FLASH_DTYPES)} and a "
            f"head_dim that is a multiple of 8 and at most {max_head_dim}), which keeps the "
            "s x s scores."
        )
    if materialised:
        return patterns, (
            f"attention: materialised as asked (materialised_attention=True), though "
            f"causal_attention runs cuDNN flash attention here ({where}): s x s scores charged."
        )
    fused = dataclasses.replace(
        patterns, dots=tuple(d for d in patterns.dots if not d.platform_attention)
    )
    return fused, (
        f"attention: fused ({where}): causal_attention runs cuDNN flash attention "
        "(jax.nn.dot_product_attention, implementation='cudnn'), so no s x s scores are kept "
        "and its FLOPs are 4 s^2 q_dim per layer; materialised_attention=True "
        "(--materialised-attention) charges the XLA implementation's scores."
    )

"""The reference models' attention core: ``jax.nn.dot_product_attention``, fused where it can be.

:func:`causal_attention` is the causal (and grouped-query) attention of every reference model.
It calls :func:`jax.nn.dot_product_attention` with the implementation
:func:`attention_implementation` picks for the platform the program runs on: cuDNN's flash
attention (``implementation="cudnn"``) on a GPU for half-precision inputs whose head
dimension the kernel takes, else XLA's implementation (which materialises the ``s x s``
scores; on CPU the numbers equal the hand-written ``einsum -> softmax -> einsum`` to float
rounding).

The call runs inside ``jax.named_scope(PLATFORM_ATTENTION)``: the planner
(:mod:`jfleet.auto_parallel.match.attention_trace`) traces on whatever host it runs on,
sees the XLA implementation's products under that name, and knows that on a GPU profile
the same call runs fused (no ``s x s`` scores kept).

Example:
  >>> import jax.numpy as jnp
  >>> q, kv = jnp.ones((2, 8, 4, 16)), jnp.ones((2, 8, 2, 16))
  >>> causal_attention(q, kv, kv).shape
  (2, 8, 4, 16)
  >>> [attention_implementation(p, "bfloat16", 128) for p in ("gpu", "cpu")]
  ['cudnn', 'xla']
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "FLASH_DTYPES",
    "PLATFORM_ATTENTION",
    "attention_implementation",
    "causal_attention",
    "reference_attention",
]

#: The name scope :func:`causal_attention` runs in (what the planner's trace reads).
PLATFORM_ATTENTION = "jfleet_platform_attention"
#: Input dtypes cuDNN's flash attention takes (it refuses float32).
FLASH_DTYPES = ("bfloat16", "float16")
_PLATFORMS = ("cpu", "gpu", "tpu")


def attention_implementation(
    platform: str, dtype: str | np.dtype, head_dim: int, *, max_head_dim: int = 256
) -> Literal["cudnn", "xla"]:
    """The implementation :func:`causal_attention` runs on ``platform``.

    ``"cudnn"`` (flash attention: no ``s x s`` scores kept) on a GPU for ``bfloat16`` /
    ``float16`` inputs whose head dimension is a multiple of 8 and at most
    ``max_head_dim`` (cuDNN: 128 before Hopper, 256 from Hopper on); else ``"xla"``.

    Args:
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``jax.default_backend()``; ``"cuda"``
        and ``"rocm"`` count as ``"gpu"``).
      dtype: the attention inputs' dtype.
      head_dim: per-head size.
      max_head_dim: the largest head dimension the GPU's kernel takes.

    Raises:
      ValueError: an unknown platform or a head dimension below 1.

    Example:
      >>> attention_implementation("gpu", "float32", 128)
      'xla'
    """
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if platform not in _PLATFORMS:
        raise ValueError(
            f"platform={platform!r} is not one of {_PLATFORMS}; pass jax.default_backend() "
            "or a profile's platform."
        )
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim={head_dim!r}: expected an int >= 1 (width // heads).")
    fits = head_dim % 8 == 0 and head_dim <= max_head_dim
    if platform == "gpu" and jnp.dtype(dtype).name in FLASH_DTYPES and fits:
        return "cudnn"
    return "xla"


def _max_head_dim() -> int:
    """The head dimensions this machine's GPU kernel takes (256 from Hopper on, else 128)."""
    capability = getattr(jax.devices()[0], "compute_capability", "0")
    try:
        return 256 if float(capability) >= 9.0 else 128
    except ValueError:
        return 128


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    implementation: Literal["cudnn", "xla"] | None = None,
) -> jax.Array:
    """Causal scaled dot-product attention, ``[batch, seq, heads, head_dim]`` in and out.

    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention: query head
    ``n`` reads key / value head ``n // (heads // kv_heads)``, as ``jnp.repeat`` of the
    key / value heads would). Scores are scaled by ``1 / sqrt(head_dim)`` and the softmax
    runs in float32.

    Args:
      q: queries ``[batch, seq, heads, head_dim]``.
      k: keys ``[batch, seq, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
      v: values, ``k``'s shape.
      implementation: ``"cudnn"`` or ``"xla"``; default :func:`attention_implementation`
        for ``jax.default_backend()``, the inputs' dtype and head dimension.

    Returns:
      ``[batch, seq, heads, head_dim]`` in the inputs' dtype.

    Raises:
      ValueError: inputs that are not 4-D with matching batch, sequence and head sizes,
        or an unknown ``implementation``.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((1, 4, 2, 8))
      >>> bool(jnp.allclose(causal_attention(x, x, x), x))
      True
    """
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"q {q.shape}, k {k.shape}, v {v.shape}: expected q [batch, seq, heads, head_dim] "
            "and k, v [batch, seq, kv_heads, head_dim] of one shape."
        )
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(
            f"q {q.shape} and k / v {k.shape}: batch, sequence and head_dim must match and "
            f"kv_heads={k.shape[2]} must divide heads={h}."
        )
    if implementation not in (None, "cudnn", "xla"):
        raise ValueError(f"implementation={implementation!r}: expected 'cudnn', 'xla' or None.")
    if implementation is None:
        platform = jax.default_backend()
        implementation = attention_implementation(
            platform, q.dtype, d, max_head_dim=_max_head_dim() if platform == "gpu" else 256
        )
    with jax.named_scope(PLATFORM_ATTENTION):
        return jax.nn.dot_product_attention(
            q, k.astype(q.dtype), v.astype(q.dtype), is_causal=True, implementation=implementation
        )


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The hand-written attention the reference models ran before :func:`causal_attention`:
    ``einsum`` scores (cast to float32) over repeated key / value heads, a causal mask,
    softmax, ``einsum`` with the values (for tests).

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((1, 4, 2, 8))
      >>> bool(jnp.allclose(reference_attention(x, x, x), causal_attention(x, x, x)))
      True
    """
    _, s, h, d = q.shape
    if k.shape[2] != h:
        k = jnp.repeat(k, h // k.shape[2], axis=2)
        v = jnp.repeat(v, h // v.shape[2], axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(d)
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)

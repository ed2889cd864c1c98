"""Decoder blocks that return more than their activation or hold RNG streams (issue 27's
pipeline forms), written as public Flax NNX ports write them.

* :class:`CacheReturningDecoder`: each block returns ``(cache, x)`` (its keys and values, as
  decoding ports return them) and the training forward drops the cache.
* :class:`AuxLossDecoder`: each block returns ``{"hidden": x, "aux_loss": ...}`` (a z-loss
  style penalty on its MLP activations) and the forward sums the losses over the blocks
  (``aux = aux + out["aux_loss"]``), returning ``(logits, aux)``.
* :class:`DropoutDecoder`: nanoGPT's dropout placement (after the embedding, the attention
  probabilities, and each residual branch), every ``nnx.Dropout`` holding its own stream.
* :class:`ReturnFormDecoder`: blocks whose output wraps the activation the ways public
  ports write it (issue 35, :data:`RETURN_FORMS`): Flax's Gemma example and Qwen3 ports'
  ``(cache, x)`` with the cache None in training, ``(x, None)``, ``{"hidden": x, "cache":
  None}``, and ``(x, aux)`` with the forward adding the auxiliary losses up.

All three share one attention / MLP core (``q``, ``k``, ``v``, ``o``, ``up``, ``down``,
causal attention over 4 heads of 8).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> model = AuxLossDecoder(rngs=nnx.Rngs(0))
  >>> logits, aux = model(jnp.zeros((2, 6), jnp.int32))
  >>> logits.shape, aux.shape
  ((2, 6, 48), ())
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "RETURN_FORMS",
    "AuxLossDecoder",
    "CacheReturningDecoder",
    "DropoutDecoder",
    "ReturnFormDecoder",
]


class _Core(nnx.Module):
    """Pre-norm causal attention and a relu MLP; ``drop`` (or None) after the attention
    probabilities and after each residual branch."""

    def __init__(self, dim: int, heads: int, hidden: int, rate: float | None, *, rngs: nnx.Rngs):
        self.heads = heads
        linear = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)  # noqa: E731
        self.norm1, self.norm2 = nnx.RMSNorm(dim, rngs=rngs), nnx.RMSNorm(dim, rngs=rngs)
        self.q, self.k, self.v, self.o = (linear(dim, dim) for _ in range(4))
        self.up, self.down = linear(dim, hidden), linear(hidden, dim)
        drop = (lambda: nnx.Dropout(rate, rngs=rngs)) if rate is not None else (lambda: None)
        self.attn_drop, self.resid_drop, self.mlp_drop = drop(), drop(), drop()

    def _drop(self, layer: nnx.Dropout | None, x: jax.Array) -> jax.Array:
        return x if layer is None else layer(x)

    def attend(self, x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        b, t, d = x.shape
        h = self.norm1(x)
        split = (b, t, self.heads, d // self.heads)
        q, k, v = (p(h).reshape(split) for p in (self.q, self.k, self.v))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        probs = self._drop(self.attn_drop, jax.nn.softmax(jnp.where(causal, scores, -1e9), -1))
        out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d)
        return x + self._drop(self.resid_drop, self.o(out)), (k, v)

    def mlp(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        act = nnx.relu(self.up(self.norm2(x)))
        return x + self._drop(self.mlp_drop, self.down(act)), act


class CacheBlock(_Core):
    def __call__(self, x: jax.Array) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        x, cache = self.attend(x)
        x, _ = self.mlp(x)
        return cache, x


class AuxBlock(_Core):
    def __call__(self, x: jax.Array) -> dict[str, jax.Array]:
        x, _ = self.attend(x)
        x, act = self.mlp(x)
        return {"hidden": x, "aux_loss": 1e-2 * jnp.mean(jnp.square(act))}


class DropoutBlock(_Core):
    def __call__(self, x: jax.Array) -> jax.Array:
        return self.mlp(self.attend(x)[0])[0]


class _Decoder(nnx.Module):
    def __init__(
        self, block: type, rate: float | None = None, vocab: int = 48, dim: int = 32,
        layers: int = 2, *, rngs: nnx.Rngs,
    ):  # fmt: skip
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs) if rate is not None else None
        self.layers = nnx.List([block(dim, 4, 2 * dim, rate, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)


class CacheReturningDecoder(_Decoder):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(CacheBlock, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for layer in self.layers:
            _cache, x = layer(x)  # decoding would keep the cache; training drops it
        return self.lm_head(self.norm(x))


class AuxLossDecoder(_Decoder):
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(AuxBlock, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        x, aux = self.embed(tokens), 0.0
        for layer in self.layers:
            out = layer(x)
            x = out["hidden"]
            aux = aux + out["aux_loss"]
        return self.lm_head(self.norm(x)), aux


class DropoutDecoder(_Decoder):
    """``rate=None`` builds no dropout layers at all (the same parameters when ``rngs``
    has a separate ``dropout`` stream)."""

    def __init__(self, rate: float | None = 0.1, layers: int = 2, *, rngs: nnx.Rngs):
        super().__init__(DropoutBlock, rate, layers=layers, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        x = x if self.drop is None else self.drop(x)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


RETURN_FORMS = ("cache_first", "x_none", "dict_cache", "x_aux")
"""What a :class:`ReturnFormDecoder`'s blocks return: ``(cache, x)`` with ``cache=None``,
``(x, None)``, ``{"hidden": x, "cache": None}``, ``(x, aux)``."""


class ReturnFormBlock(_Core):
    """A block returning its activation wrapped as ``form`` says (:data:`RETURN_FORMS`).

    ``cache`` is what a decoding loop would pass (the layer's cache); training passes None
    and gets None back, as Flax's Gemma example does.
    """

    def __init__(self, *args, form: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.form = form

    def __call__(self, x: jax.Array, cache: dict | None = None):
        x, (k, v) = self.attend(x)
        x, act = self.mlp(x)
        new_cache = None if cache is None else {"k": k, "v": v}
        if self.form == "cache_first":
            return new_cache, x
        if self.form == "x_none":
            return x, new_cache
        if self.form == "dict_cache":
            return {"hidden": x, "cache": new_cache}
        return x, 1e-2 * jnp.mean(jnp.square(act))


class ReturnFormDecoder(nnx.Module):
    """A decoder whose blocks return their activation wrapped as ``form`` says, its loop
    unwrapping it the way ports of that form do; with ``"x_aux"`` it returns ``(logits,
    aux)``, the auxiliary losses added up over the blocks.

    Example:
      >>> import jax.numpy as jnp
      >>> model = ReturnFormDecoder("cache_first", rngs=nnx.Rngs(0))
      >>> model.layers[0](jnp.zeros((1, 3, 32)))[0] is None
      True
      >>> model(jnp.zeros((2, 6), jnp.int32)).shape
      (2, 6, 48)
    """

    def __init__(self, form: str, vocab: int = 48, dim: int = 32, layers: int = 2, *, rngs):
        if form not in RETURN_FORMS:
            raise ValueError(f"ReturnFormDecoder(form={form!r}): use one of {RETURN_FORMS}.")
        self.form = form
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.layers = nnx.List(
            [ReturnFormBlock(dim, 4, 2 * dim, None, form=form, rngs=rngs) for _ in range(layers)]
        )
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array):
        x, aux = self.embed(tokens), 0.0
        for layer in self.layers:
            if self.form == "cache_first":
                _layer_cache, x = layer(x, None)
            elif self.form == "x_none":
                x, _ = layer(x)
            elif self.form == "dict_cache":
                x = layer(x, cache=None)["hidden"]
            else:
                x, layer_aux = layer(x)
                aux = aux + layer_aux
        logits = self.lm_head(self.norm(x))
        return (logits, aux) if self.form == "x_aux" else logits

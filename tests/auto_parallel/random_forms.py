"""Randomly composed block forms for the matcher's property test.

A :class:`Form` picks, for one tiny model, how each part is written: attention (separate,
fused contiguous, fused strided, k or v missing, none), grouped kv heads, a KV cache written
with a dynamic update or a scatter, projection biases, additive attention biases (a learned
relative-position table, ALiBi slopes, per-head sinks), the MLP (gelu, swiglu, fused gate/up
contiguous or strided, experts with a router, none), what the block returns (an array,
``(x, aux)``, ``{"hidden": x, "aux": aux}``, and with a cache that is None in training
``(cache, x)``, ``(x, cache)``, ``{"hidden": x, "cache": cache}``), the norm, the input
(token ids into an ``nnx.Embed`` or a bare table, or float features) and the head
(separate, tied, a small classifier, none). Every form is a valid model: the matcher must
return for each (roles, or a named reason), never raise.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import jax
import jax.numpy as jnp
from flax import nnx

WIDTH, HEADS, HEAD_DIM, HIDDEN, VOCAB, SEQ, EXPERTS = 16, 4, 4, 24, 40, 6, 3

CHOICES = {
    "attn": ("separate", "fused", "fused_strided", "no_k", "no_v", "none"),
    "kv_heads": (4, 2, 1),
    "cache": ("none", "update_slice", "scatter"),
    "bias": (False, True),
    "score_bias": ("none", "relative", "alibi", "sinks"),
    "mlp": ("gelu", "swiglu", "fused", "fused_strided", "experts", "none"),
    "ret": ("array", "tuple", "dict", "cache_first", "x_none", "dict_cache"),
    "norm": ("rms", "layer", "none"),
    "inputs": ("embed", "bare", "features", "embed_positions"),
    "head": ("separate", "tied", "small", "none"),
    "layers": (1, 2),
}


@dataclasses.dataclass(frozen=True)
class Form:
    """One composition (see the module docstring); fields take :data:`CHOICES`' values."""

    attn: str
    kv_heads: int
    cache: str
    bias: bool
    score_bias: str
    mlp: str
    ret: str
    norm: str
    inputs: str
    head: str
    layers: int


def random_forms(n: int, seed: int = 0) -> list[Form]:
    """``n`` forms drawn uniformly from :data:`CHOICES` (a tied head needs token ids)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        form = Form(**{k: rng.choice(v) for k, v in CHOICES.items()})
        if form.head == "tied" and form.inputs not in ("embed", "embed_positions"):
            continue
        out.append(form)
    return out


class FormAttention(nnx.Module):
    def __init__(self, f: Form, rngs: nnx.Rngs):
        self.f = f
        kv = f.kv_heads if f.attn in ("separate", "fused") else HEADS
        self.kv = kv
        lin = functools.partial(nnx.Linear, use_bias=f.bias, rngs=rngs)
        if f.attn == "fused":
            self.qkv = lin(WIDTH, (HEADS + 2 * kv) * HEAD_DIM)
        elif f.attn == "fused_strided":
            self.qkv = lin(WIDTH, 3 * HEADS * HEAD_DIM)
        else:
            self.q = lin(WIDTH, HEADS * HEAD_DIM)
            if f.attn != "no_k":
                self.k = lin(WIDTH, kv * HEAD_DIM)
            if f.attn != "no_v":
                self.v = lin(WIDTH, kv * HEAD_DIM)
        self.o = lin(HEADS * HEAD_DIM, WIDTH)
        if f.score_bias == "relative":
            self.rel = nnx.Embed(8, HEADS, rngs=rngs)
        elif f.score_bias == "sinks":
            self.sinks = nnx.Param(jnp.zeros((HEADS,)))

    def _qkv(self, x):
        b, s, _ = x.shape
        f, kv = self.f, self.kv
        if f.attn == "fused":
            h = self.qkv(x)
            q, k, v = jnp.split(h, [HEADS * HEAD_DIM, (HEADS + kv) * HEAD_DIM], axis=-1)
        elif f.attn == "fused_strided":
            h = self.qkv(x)
            q, k, v = h[..., 0::3], h[..., 1::3], h[..., 2::3]
        else:
            q = self.q(x)
            k = self.k(x) if f.attn != "no_k" else q
            v = self.v(x) if f.attn != "no_v" else x[..., : kv * HEAD_DIM]
        return (
            q.reshape(b, s, HEADS, HEAD_DIM),
            k.reshape(b, s, kv, HEAD_DIM),
            v.reshape(b, s, kv, HEAD_DIM),
        )

    def _cached(self, k):
        b, s = k.shape[:2]
        cache = jnp.zeros((b, 2 * SEQ, *k.shape[2:]), k.dtype)
        if self.f.cache == "update_slice":
            cache = jax.lax.dynamic_update_slice(cache, k, (0, 0, 0, 0))
        else:
            cache = cache.at[:, jnp.arange(s)].set(k)
        return cache[:, :s]

    def __call__(self, x):
        q, k, v = self._qkv(x)
        if self.f.cache != "none":
            k, v = self._cached(k), self._cached(v)
        rep = HEADS // self.kv
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM**0.5
        s = x.shape[1]
        dist = jnp.arange(s)[None, :] - jnp.arange(s)[:, None]
        if self.f.score_bias == "relative":
            scores = scores + self.rel(jnp.clip(dist, 0, 7)).transpose(2, 0, 1)
        elif self.f.score_bias == "alibi":
            slopes = 2.0 ** -jnp.arange(1, HEADS + 1)
            scores = scores - slopes[:, None, None] * jnp.abs(dist)
        elif self.f.score_bias == "sinks":
            scores = scores + self.sinks[...][:, None, None]
        probs = jax.nn.softmax(jnp.where(dist <= 0, scores, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(*x.shape[:2], -1)
        return self.o(out), k


class FormMlp(nnx.Module):
    def __init__(self, f: Form, rngs: nnx.Rngs):
        self.kind = f.mlp
        lin = functools.partial(nnx.Linear, use_bias=f.bias, rngs=rngs)
        if f.mlp in ("gelu", "swiglu"):
            self.up = lin(WIDTH, HIDDEN)
            if f.mlp == "swiglu":
                self.gate = lin(WIDTH, HIDDEN)
        elif f.mlp in ("fused", "fused_strided"):
            self.gate_up = lin(WIDTH, 2 * HIDDEN)
        if f.mlp == "experts":
            init = nnx.initializers.lecun_normal()
            self.router = lin(WIDTH, EXPERTS)
            self.w_in = nnx.Param(init(rngs.params(), (EXPERTS, WIDTH, HIDDEN)))
            self.w_out = nnx.Param(init(rngs.params(), (EXPERTS, HIDDEN, WIDTH)))
        elif f.mlp != "none":
            self.down = lin(HIDDEN, WIDTH)

    def __call__(self, x):
        if self.kind == "gelu":
            return self.down(nnx.gelu(self.up(x)))
        if self.kind == "swiglu":
            return self.down(nnx.silu(self.gate(x)) * self.up(x))
        if self.kind in ("fused", "fused_strided"):
            h = self.gate_up(x)
            if self.kind == "fused":
                gate, up = jnp.split(h, 2, axis=-1)
            else:
                gate, up = h[..., ::2], h[..., 1::2]
            return self.down(nnx.silu(gate) * up)
        if self.kind == "experts":
            weights = jax.nn.softmax(self.router(x), axis=-1)
            h = nnx.gelu(jnp.einsum("bsd,edf->bsef", x, self.w_in[...]))
            y = jnp.einsum("bsef,efd->bsed", h, self.w_out[...])
            return jnp.einsum("bsed,bse->bsd", y, weights)
        return jnp.zeros_like(x)


def _norm(f: Form, rngs: nnx.Rngs):
    if f.norm == "rms":
        return nnx.RMSNorm(WIDTH, rngs=rngs)
    if f.norm == "layer":
        return nnx.LayerNorm(WIDTH, rngs=rngs)
    return None


class FormBlock(nnx.Module):
    def __init__(self, f: Form, rngs: nnx.Rngs):
        self.ret = f.ret
        self.norm1, self.norm2 = _norm(f, rngs), _norm(f, rngs)
        self.attn = FormAttention(f, rngs) if f.attn != "none" else None
        self.mlp = FormMlp(f, rngs)

    def __call__(self, x):
        aux = jnp.zeros(())
        if self.attn is not None:
            h, keys = self.attn(self.norm1(x) if self.norm1 else x)
            x, aux = x + h, keys.mean()
        x = x + self.mlp(self.norm2(x) if self.norm2 else x)
        cache = None  # what a decoding loop would get back; None in training
        if self.ret == "tuple":
            return x, aux
        if self.ret == "dict":
            return {"hidden": x, "aux": aux}
        if self.ret == "cache_first":
            return cache, x
        if self.ret == "x_none":
            return x, cache
        if self.ret == "dict_cache":
            return {"hidden": x, "cache": cache}
        return x


def _activation(ret: str, out):
    """The activation in a block's output, unwrapped as the model's loop does."""
    if ret in ("tuple", "x_none"):
        return out[0]
    if ret == "cache_first":
        _layer_cache, h = out
        return h
    return out["hidden"] if ret in ("dict", "dict_cache") else out


class FormModel(nnx.Module):
    def __init__(self, f: Form, rngs: nnx.Rngs):
        self.f = f
        if f.inputs in ("embed", "embed_positions"):
            self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
            if f.inputs == "embed_positions":
                self.pos = nnx.Embed(WIDTH, WIDTH, rngs=rngs)  # max_len == width, on purpose
        elif f.inputs == "bare":
            self.table = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, WIDTH)))
        else:
            self.proj_in = nnx.Linear(5, WIDTH, rngs=rngs)
        self.blocks = nnx.List([FormBlock(f, rngs) for _ in range(f.layers)])
        self.final = _norm(f, rngs)
        if f.head == "separate":
            self.head = nnx.Linear(WIDTH, VOCAB, use_bias=False, rngs=rngs)
        elif f.head == "small":
            self.head = nnx.Linear(WIDTH, 10, rngs=rngs)

    def inputs(self, batch: int = 2) -> jax.ShapeDtypeStruct:
        """What the model is called with."""
        if self.f.inputs == "features":
            return jax.ShapeDtypeStruct((batch, SEQ, 5), jnp.float32)
        return jax.ShapeDtypeStruct((batch, SEQ), jnp.int32)

    def __call__(self, x):
        f = self.f
        if f.inputs in ("embed", "embed_positions"):
            h = self.embed(x)
            if f.inputs == "embed_positions":
                h = h + self.pos(jnp.arange(x.shape[1]))
        elif f.inputs == "bare":
            h = self.table[...][x]
        else:
            h = self.proj_in(x)
        for block in self.blocks:
            out = block(h)
            h = _activation(f.ret, out)
        h = self.final(h) if self.final is not None else h
        if f.head == "separate":
            return self.head(h)
        if f.head == "tied":
            return self.embed.attend(h)
        if f.head == "small":
            return self.head(h.mean(axis=1))
        return h

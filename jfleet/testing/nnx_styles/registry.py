"""The zoo's registry: each style's build, batches, loss and its hand-written split table."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jfleet.testing.nnx_styles._shared import MAX_SEQ
from jfleet.testing.nnx_styles.flax_tutorials import DenseGeneralLM, MiniGPT, QkvEinsumLM
from jfleet.testing.nnx_styles.gemma import Gemma3LM, GemmaConfig, GemmaLM
from jfleet.testing.nnx_styles.ports import (
    GPT,
    LlamaCacheTransformer,
    ModelArgs,
    Qwen3Config,
    Qwen3ForCausalLM,
    llama_forward,
)

__all__ = ["STYLES", "Style", "token_batches"]


@dataclasses.dataclass(frozen=True)
class Style:
    """One public-code style: how to build, feed and train it, and its Megatron layout.

    ``build(rngs)`` makes the tiny fp32 model; ``batches(n, batch=8, seq=8, seed=0)`` gives
    ``n`` NumPy batches ``{"tokens": int32 [batch, seq], "labels": int32 [batch, seq]}``
    (next tokens of stride-3 sequences, so the loss can fall); ``loss_fn(model, batch)`` is
    the mean next-token cross-entropy, through ``forward(model, batch) -> logits`` where
    the style has one (``None``: the call is ``model(batch["tokens"])``).

    ``splits``: every attention and MLP weight of a block (dotted path from the root, ``*``
    for the block index) -> the dimension a Megatron layout splits: the (kv) heads or hidden
    dimension of a column weight, the one contracted with it in a row weight (``heads *
    head_dim`` in a 2-D ``nnx.Linear``). ``roles``: ``q``, ``k``, ``v``, ``kv``, ``qkv``,
    ``o``, ``gate``, ``up``, ``gate_up`` or ``down`` per path; ``shapes``: its shape.
    ``kv_replicated_at``: the smallest power-of-two mp not dividing ``kv_heads`` (``None``
    without grouped-query attention). ``pipelines``: whether the blocks (at ``blocks_at``)
    could be pipelined without changing the model code.
    """

    name: str
    build: Callable[[nnx.Rngs], nnx.Module]
    batches: Callable[..., list[dict]]
    loss_fn: Callable[[nnx.Module, dict], jax.Array]
    forward: Callable[[nnx.Module, dict], jax.Array] | None
    splits: dict[str, int]
    roles: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    kv_replicated_at: int | None
    vocab: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    layers: int
    blocks_at: str
    pipelines: bool
    note: str


def token_batches(n: int, batch: int = 8, seq: int = 8, seed: int = 0, *, vocab: int) -> list[dict]:
    """``n`` batches of ``start, start + 3, start + 6, ... (mod vocab)`` from random starts."""
    if seq > MAX_SEQ:
        raise ValueError(f"seq={seq} is longer than MAX_SEQ={MAX_SEQ}.")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = rng.integers(0, vocab, size=(batch, 1))
        tokens = ((start + 3 * np.arange(seq + 1)) % vocab).astype(np.int32)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


_BUILDS = {
    "mha": lambda rngs: MiniGPT(MAX_SEQ, 96, 32, 4, 128, 2, rngs=rngs),
    "linear_general": lambda rngs: DenseGeneralLM(64, 48, 4, 12, 96, 2, rngs=rngs),
    "einsum_gemma": lambda rngs: GemmaLM(GemmaConfig(128, 32, 64, 4, 2, 8, 2), rngs=rngs),
    "einsum_qkv": lambda rngs: QkvEinsumLM(64, 64, 8, 2, rngs=rngs),
    "gqa_qknorm": lambda rngs: Qwen3ForCausalLM(Qwen3Config(), rngs=rngs),
    "gqa_qknorm_mqa": lambda rngs: Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=1), rngs=rngs),
    "kv_cache": lambda rngs: LlamaCacheTransformer(ModelArgs(), rngs=rngs),
    "gemma_alternating": lambda rngs: Gemma3LM(
        GemmaConfig(128, 32, 64, 4, 2, 16, 4, 4, 30.0, True), rngs=rngs
    ),
    "dropout": lambda rngs: GPT(64, MAX_SEQ, 2, 4, 32, 0.1, rngs=rngs),
}

_SIZE_FIELDS = "vocab width heads kv_heads head_dim hidden layers kv_replicated_at pipelines"
_SIZES = {
    "mha": (96, 32, 4, 4, 8, 128, 2, None, True),
    "linear_general": (64, 48, 4, 4, 12, 96, 2, None, True),
    "einsum_gemma": (128, 32, 4, 2, 8, 64, 2, 4, True),
    "einsum_qkv": (64, 64, 8, 8, 8, 64, 2, None, True),
    "gqa_qknorm": (80, 48, 4, 2, 8, 96, 2, 4, True),
    "gqa_qknorm_mqa": (80, 48, 4, 1, 8, 96, 2, 2, True),
    "kv_cache": (64, 32, 4, 4, 8, 96, 2, None, True),
    "gemma_alternating": (128, 32, 4, 2, 16, 64, 4, 4, True),
    "dropout": (64, 32, 4, 4, 8, 128, 2, None, True),
}

# [name] block container, then per weight of a block: path  role  split dimension  shape
_TABLES = """
[mha] transformer_blocks
attention.query.kernel        q        1  32x4x8
attention.key.kernel          k        1  32x4x8
attention.value.kernel        v        1  32x4x8
attention.out.kernel          o        0  4x8x32
mlp.layers.0.kernel           up       1  32x128
mlp.layers.2.kernel           down     0  128x32
[linear_general] layers
self_attention.query.kernel   q        1  48x4x12
self_attention.key.kernel     k        1  48x4x12
self_attention.value.kernel   v        1  48x4x12
self_attention.out.kernel     o        0  4x12x48
mlp.wi_0.kernel               gate     1  48x96
mlp.wi_1.kernel               up       1  48x96
mlp.wo.kernel                 down     0  96x48
[einsum_gemma] layers
attn.q_einsum.kernel          q        0  4x32x8
attn.kv_einsum.kernel         kv       1  2x2x32x8
attn.attn_vec_einsum.kernel   o        0  4x8x32
mlp.gating_einsum             gate_up  2  2x32x64
mlp.linear                    down     0  64x32
[einsum_qkv] blocks
qkv_einsum.kernel             qkv      1  3x8x64x8
out_einsum.kernel             o        0  8x8x64
linear1.kernel                up       1  64x64
linear2.kernel                down     0  64x64
[gqa_qknorm] model.layers
self_attn.q_proj.kernel       q        1  48x32
self_attn.k_proj.kernel       k        1  48x16
self_attn.v_proj.kernel       v        1  48x16
self_attn.o_proj.kernel       o        0  32x48
mlp.gate_proj.kernel          gate     1  48x96
mlp.up_proj.kernel            up       1  48x96
mlp.down_proj.kernel          down     0  96x48
[gqa_qknorm_mqa] model.layers
self_attn.q_proj.kernel       q        1  48x32
self_attn.k_proj.kernel       k        1  48x8
self_attn.v_proj.kernel       v        1  48x8
self_attn.o_proj.kernel       o        0  32x48
mlp.gate_proj.kernel          gate     1  48x96
mlp.up_proj.kernel            up       1  48x96
mlp.down_proj.kernel          down     0  96x48
[kv_cache] layers
attention.wq.kernel           q        1  32x32
attention.wk.kernel           k        1  32x32
attention.wv.kernel           v        1  32x32
attention.wo.kernel           o        0  32x32
feed_forward.w1.kernel        gate     1  32x96
feed_forward.w3.kernel        up       1  32x96
feed_forward.w2.kernel        down     0  96x32
[gemma_alternating] layers
attn.q_einsum.kernel          q        0  4x32x16
attn.kv_einsum.kernel         kv       1  2x2x32x16
attn.attn_vec_einsum.kernel   o        0  4x16x32
mlp.gating_einsum.kernel      gate_up  1  2x64x32
mlp.linear.kernel             down     0  64x32
[dropout] transformer.h
attn.query.kernel             q        1  32x32
attn.key.kernel               k        1  32x32
attn.value.kernel             v        1  32x32
attn.proj.kernel              o        0  32x32
mlp.c_fc.kernel               up       1  32x128
mlp.c_proj.kernel             down     0  128x32
"""

_NOTES = {
    "mha": "post-norm; biased 3-D q/k/v/o; Sequential MLP; the block makes its own mask",
    "linear_general": "3-D LinearGeneral kernels, out contracts two axes; attend-tied head",
    "einsum_gemma": "MLP weights are bare nnx.Param in jnp.einsum; bare tied embedding",
    "einsum_qkv": "hidden == width; attention and MLP weights straight in the block",
    "gqa_qknorm": "2 kv heads; heads * head_dim != width; blocks in model.layers",
    "gqa_qknorm_mqa": "gqa_qknorm with one kv head: k/v cannot split even at mp 2",
    "kv_cache": "block returns (x, cache) with a cache; training without one pipelines",
    "gemma_alternating": "graphs differ by a static window; stages need whole pairs",
    "dropout": "blocks own RNG streams; pipelined, they draw what the unpipelined blocks draw",
}


def _style(header: str, table: str) -> Style:
    name, blocks_at = header.lstrip("[").split("] ")
    rows = [line.split() for line in table.splitlines()]
    forward = llama_forward if name == "kv_cache" else None

    def loss_fn(model: nnx.Module, batch: dict) -> jax.Array:
        logits = forward(model, batch) if forward else model(jnp.asarray(batch["tokens"]))
        logits, labels = logits.astype(jnp.float32), jnp.asarray(batch["labels"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    paths = [f"{blocks_at}.*.{row[0]}" for row in rows]
    return Style(
        name=name,
        build=_BUILDS[name],
        batches=functools.partial(token_batches, vocab=_SIZES[name][0]),
        loss_fn=loss_fn,
        forward=forward,
        splits={path: int(row[2]) for path, row in zip(paths, rows, strict=True)},
        roles={path: row[1] for path, row in zip(paths, rows, strict=True)},
        shapes={p: tuple(map(int, row[3].split("x"))) for p, row in zip(paths, rows, strict=True)},
        blocks_at=blocks_at,
        note=_NOTES[name],
        **dict(zip(_SIZE_FIELDS.split(), _SIZES[name], strict=True)),
    )


STYLES: dict[str, Style] = {
    (style := _style(*section.strip().split("\n", 1))).name: style
    for section in _TABLES.split("\n[")[1:]
}
"""The zoo, by name."""

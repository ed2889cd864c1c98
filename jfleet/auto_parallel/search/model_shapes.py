"""Named model shapes for planning offline: layers, width, heads, MLP, vocabulary, sequence.

:data:`MODEL_SHAPES` holds published architectures by name; :func:`abstract_model` builds
one as an abstract model (``nnx.eval_shape``: shapes and dtypes, no memory) from
:mod:`jfleet.models` (``llama``: rotary attention, SwiGLU, RMSNorm, untied head; ``gpt``:
learned positions, GELU, LayerNorm, tied head), for
:func:`jfleet.auto_parallel.search.cluster_plan.plan` and its CLI.

Sources: Llama 2 (Touvron et al., 2023, Table 1 and the released configs), Llama 3
(Meta, "The Llama 3 Herd of Models", 2024, Table 3), GPT-3 (Brown et al., 2020, Table
2.1; ``gpt3-5b``: NeMo Megatron's 5B, ``conf/training/gpt3/5b.yaml`` of
NVIDIA/NeMo-Megatron-Launcher), the GPT rows of Narayanan et al., SC21, Table 1
(``megatron-*``; vocabulary 51,200, sequence 2,048), MosaicML's MPT (``mpt-*``:
``scripts/train/yamls/pretrain/mpt-*.yaml`` of mosaicml/llm-foundry; learned positions,
GELU MLP of 4 x width, LayerNorm, tied head, vocabulary 50,368, sequence 2,048; its
benchmark table's parameter counts match the ``gpt`` architecture's, biases included).

**Mixtures of experts** (``moe``, a :class:`~jfleet.auto_parallel.match.moe_spec.MoESpec`):
each MoE layer's routed experts and router are priced by the cost model from the spec
(:mod:`jfleet.auto_parallel.cost.cost_moe`); the abstract model is the rest of the decoder
(:class:`MoELlama`: attention of ``head_dim`` per head, norms, the shared experts as one
dense SwiGLU MLP of ``ffn``, none when ``ffn`` is 0), carrying the spec for the planner.
Sources (the released ``config.json`` of each, and the published totals the tests check):
``mixtral-8x7b`` (Jiang et al., "Mixtral of Experts", 2024: 47B parameters, 13B active;
``mistralai/Mixtral-8x7B-v0.1``), ``mixtral-8x22b`` (Mistral AI, 2024: 141B, 39B active;
``mistralai/Mixtral-8x22B-v0.1``), ``qwen3-30b-a3b`` and ``qwen3-235b-a22b`` (Qwen3
Technical Report, 2025, Table 2: 30.5B / 3.3B and 235B / 22B; ``Qwen/Qwen3-30B-A3B``,
``Qwen/Qwen3-235B-A22B``; 128 experts, 8 a token, no shared experts; their q / k norms,
``2 x 128`` a layer, left out).

Example:
  >>> MODEL_SHAPES["llama2-70b"].kv_heads
  8
  >>> m = abstract_model(ModelShape(arch="llama", layers=2, width=64, heads=4, kv_heads=2,
  ...                               ffn=128, vocab=256, seq_len=32))
  >>> type(m).__name__, m.lm_head.shape, len(m.layers)
  ('Llama', (64, 256), 2)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jfleet.auto_parallel.match.moe_spec import MoESpec
from jfleet.models.gpt2 import TinyGPT2
from jfleet.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    TinyLlama,
)

__all__ = ["MODEL_SHAPES", "MoELlama", "ModelShape", "abstract_model"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's shape.

    Attributes:
      arch: ``"llama"`` or ``"gpt"`` (see the module docstring).
      layers, width, heads, kv_heads, ffn, vocab: the sizes (``kv_heads == heads``
        without grouped-query attention; ``ffn`` the MLP's hidden size).
      seq_len: the training sequence length.
      head_dim: each attention head's size (0: ``width // heads``).
      moe: the routed experts (:class:`~jfleet.auto_parallel.match.moe_spec.MoESpec`), or
        None for a dense model; with experts ``ffn`` is the shared experts' hidden size
        (0: none), and ``arch`` is ``"llama"``.
    """

    arch: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    head_dim: int = 0
    moe: MoESpec | None = None

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gpt"):
            raise ValueError(f"arch={self.arch!r} must be 'llama' or 'gpt'.")
        for f in ("layers", "width", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            value = getattr(self, f)
            least = 0 if f == "ffn" and self.moe is not None else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{f}={value!r} must be an int >= {least}.")
        if self.moe is not None and (self.arch != "llama" or self.moe.every != 1):
            raise ValueError(
                f"moe={self.moe}: shape-built MoE models are llama blocks, every one a MoE "
                "layer (arch='llama', every=1)."
            )

    @property
    def params(self) -> int:
        """Parameter count (weights of the blocks, embeddings and head; norms included)."""
        h, f, q = self.width, self.ffn, self.width // self.heads * self.kv_heads
        attn = h * h * 2 + 2 * h * q
        if self.head_dim:  # q / o of heads x head_dim (Qwen3's q / k norms left out)
            attn = 2 * h * self.head_dim * (self.heads + self.kv_heads)
        mlp = (3 if self.arch == "llama" else 2) * h * f
        bias = (4 * h + 2 * q + f + h) if self.arch == "gpt" else 0
        embed = self.vocab * h * (2 if self.arch == "llama" else 1)
        pos = self.seq_len * h if self.arch == "gpt" else 0
        experts = self.moe.expert_params(h) if self.moe is not None else 0
        return self.layers * (attn + mlp + bias + 4 * h) + embed + pos + 2 * h + experts

    @property
    def active_params(self) -> int:
        """Parameters one token runs: :attr:`params` with ``k`` of each layer's routed
        experts (all of them for a dense model)."""
        if self.moe is None:
            return self.params
        h = self.width
        return self.params - self.moe.expert_params(h) + self.moe.active_expert_params(h)


def _gpt(layers: int, width: int, heads: int) -> ModelShape:
    return ModelShape(
        arch="gpt", layers=layers, width=width, heads=heads, kv_heads=heads,
        ffn=4 * width, vocab=51200, seq_len=2048,
    )  # fmt: skip


def _mpt(layers: int, width: int, heads: int) -> ModelShape:
    return dataclasses.replace(_gpt(layers, width, heads), vocab=50368)


def _llama(layers, width, heads, kv, ffn, vocab, seq) -> ModelShape:
    return ModelShape(
        arch="llama", layers=layers, width=width, heads=heads, kv_heads=kv, ffn=ffn,
        vocab=vocab, seq_len=seq,
    )  # fmt: skip


def _moe(layers, width, heads, kv, head_dim, vocab, seq, **moe) -> ModelShape:
    return ModelShape(
        arch="llama", layers=layers, width=width, heads=heads, kv_heads=kv, ffn=0,
        vocab=vocab, seq_len=seq, head_dim=head_dim, moe=MoESpec(layers=layers, **moe),
    )  # fmt: skip


#: Published shapes by name.
MODEL_SHAPES: dict[str, ModelShape] = {
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096),
    "llama3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248, 128256, 8192),
    "gpt3-175b": _gpt(96, 12288, 96),
    "gpt3-5b": _gpt(24, 4096, 32),
    "megatron-1.7b": _gpt(24, 2304, 24),
    "megatron-3.6b": _gpt(30, 3072, 32),
    "megatron-7.5b": _gpt(36, 4096, 32),
    "megatron-18.4b": _gpt(40, 6144, 48),
    "megatron-39.1b": _gpt(48, 8192, 64),
    "megatron-76.1b": _gpt(60, 10240, 80),
    "megatron-145.6b": _gpt(80, 12288, 96),
    "megatron-310.1b": _gpt(96, 16384, 128),
    "megatron-529.6b": _gpt(105, 20480, 128),
    "megatron-1008b": _gpt(128, 25600, 160),
    "mpt-1b": _mpt(24, 2048, 16),
    "mpt-3b": _mpt(32, 2560, 20),
    "mpt-7b": _mpt(32, 4096, 32),
    "mpt-13b": _mpt(40, 5120, 40),
    "mpt-30b": _mpt(48, 7168, 56),
    "mpt-70b": _mpt(80, 8192, 64),
    # mixtures of experts (see the module docstring); Mixtral's head_dim is width // heads
    "mixtral-8x7b": _moe(32, 4096, 32, 8, 0, 32000, 4096, experts=8, top_k=2,
                         expert_ffn=14336),
    "mixtral-8x22b": _moe(56, 6144, 48, 8, 0, 32768, 4096, experts=8, top_k=2,
                          expert_ffn=16384),
    "qwen3-30b-a3b": _moe(48, 2048, 32, 4, 128, 151936, 4096, experts=128, top_k=8,
                          expert_ffn=768),
    "qwen3-235b-a22b": _moe(94, 4096, 64, 4, 128, 151936, 4096, experts=128, top_k=8,
                            expert_ffn=1536),
}  # fmt: skip


class Llama(TinyLlama):
    """:class:`~jfleet.models.llama.TinyLlama`'s modules at a shape's size, named for what
    it is (a plan's ``model:`` line names the class)."""


class GPT(TinyGPT2):
    """:class:`~jfleet.models.gpt2.TinyGPT2`'s modules at a shape's size (see :class:`Llama`)."""


class _Attention(LlamaAttention):
    """:class:`~jfleet.models.llama.LlamaAttention` with heads of ``head_dim`` (Qwen3's 128
    beside a width of 2048: ``q_dim != width``; its q / k norms, ``2 head_dim`` a layer,
    are left out)."""

    def __init__(self, width, heads, kv_heads, head_dim, *, rngs) -> None:
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nnx.Linear(width, heads * head_dim, use_bias=False, rngs=rngs)
        self.k_proj = nnx.Linear(width, kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.v_proj = nnx.Linear(width, kv_heads * head_dim, use_bias=False, rngs=rngs)
        self.o_proj = nnx.Linear(heads * head_dim, width, use_bias=False, rngs=rngs)


class _RoutedExperts(nnx.Module):
    """Where the routed experts run: no parameters here (the cost model prices them from
    the spec the model carries), nothing added to the residual."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.zeros_like(x)


class _MoEBlock(LlamaDecoderLayer):
    """A pre-norm block whose MLP is the shared experts (``ffn``) or the routed ones' place."""

    def __init__(self, shape: ModelShape, *, rngs: nnx.Rngs) -> None:
        h = shape.width
        head_dim = shape.head_dim or h // shape.heads
        self.input_layernorm = nnx.RMSNorm(h, rngs=rngs)
        self.self_attn = _Attention(h, shape.heads, shape.kv_heads, head_dim, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(h, rngs=rngs)
        self.mlp = LlamaMLP(h, shape.ffn, rngs=rngs) if shape.ffn else _RoutedExperts()


class MoELlama(TinyLlama):
    """A shape's decoder without its routed experts (:class:`_MoEBlock` s, untied head),
    carrying them as :attr:`routed_experts` (a
    :class:`~jfleet.auto_parallel.match.moe_spec.MoESpec` the planner puts on the patterns).
    """

    def __init__(self, shape: ModelShape) -> None:
        rngs = nnx.Rngs(0)
        h = shape.width
        self.routed_experts = shape.moe
        self.embed_tokens = nnx.Embed(shape.vocab, h, rngs=rngs)
        self.layers = nnx.List([_MoEBlock(shape, rngs=rngs) for _ in range(shape.layers)])
        self.norm = nnx.RMSNorm(h, rngs=rngs)
        init = nnx.initializers.normal(stddev=h**-0.5)
        self.lm_head = nnx.Param(init(rngs.params(), (h, shape.vocab), jnp.float32))


def abstract_model(shape: ModelShape) -> nnx.Module:
    """The shape as an abstract ``nnx.Module`` (``nnx.eval_shape``; fp32 parameters).

    One decoder block is built abstractly and cloned ``layers`` times (the same
    parameter paths, shapes and dtypes as building them all: 0.5 s instead of half a
    minute for an 80-layer 70B model).
    """
    one = dataclasses.replace(shape, layers=1)
    model = nnx.eval_shape(lambda: _build(one))
    name = "layers" if shape.arch == "llama" else "h"
    block = getattr(model, name)[0]
    setattr(model, name, nnx.List([nnx.clone(block) for _ in range(shape.layers)]))
    return model


def _build(shape: ModelShape) -> nnx.Module:
    if shape.moe is not None or shape.head_dim:
        return MoELlama(shape)
    if shape.arch == "llama":
        return Llama(
            vocab=shape.vocab, width=shape.width, heads=shape.heads, kv_heads=shape.kv_heads,
            layers=shape.layers, hidden=shape.ffn,
        )  # fmt: skip
    return GPT(
        vocab=shape.vocab, width=shape.width, heads=shape.heads, layers=shape.layers,
        hidden=shape.ffn, max_len=shape.seq_len,
    )  # fmt: skip

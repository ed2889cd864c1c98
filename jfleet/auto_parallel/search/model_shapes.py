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

from flax import nnx

from jfleet.models.gpt2 import TinyGPT2
from jfleet.models.llama import TinyLlama

__all__ = ["MODEL_SHAPES", "ModelShape", "abstract_model"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A decoder-only transformer's shape.

    Attributes:
      arch: ``"llama"`` or ``"gpt"`` (see the module docstring).
      layers, width, heads, kv_heads, ffn, vocab: the sizes (``kv_heads == heads``
        without grouped-query attention; ``ffn`` the MLP's hidden size).
      seq_len: the training sequence length.
    """

    arch: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gpt"):
            raise ValueError(f"arch={self.arch!r} must be 'llama' or 'gpt'.")
        for f in ("layers", "width", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f}={value!r} must be an int >= 1.")

    @property
    def params(self) -> int:
        """Parameter count (weights of the blocks, embeddings and head; norms included)."""
        h, f, q = self.width, self.ffn, self.width // self.heads * self.kv_heads
        attn = h * h * 2 + 2 * h * q
        mlp = (3 if self.arch == "llama" else 2) * h * f
        bias = (4 * h + 2 * q + f + h) if self.arch == "gpt" else 0
        embed = self.vocab * h * (2 if self.arch == "llama" else 1)
        pos = self.seq_len * h if self.arch == "gpt" else 0
        return self.layers * (attn + mlp + bias + 4 * h) + embed + pos + 2 * h


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
}


class Llama(TinyLlama):
    """:class:`~jfleet.models.llama.TinyLlama`'s modules at a shape's size, named for what
    it is (a plan's ``model:`` line names the class)."""


class GPT(TinyGPT2):
    """:class:`~jfleet.models.gpt2.TinyGPT2`'s modules at a shape's size (see :class:`Llama`)."""


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
    if shape.arch == "llama":
        return Llama(
            vocab=shape.vocab, width=shape.width, heads=shape.heads, kv_heads=shape.kv_heads,
            layers=shape.layers, hidden=shape.ffn,
        )  # fmt: skip
    return GPT(
        vocab=shape.vocab, width=shape.width, heads=shape.heads, layers=shape.layers,
        hidden=shape.ffn, max_len=shape.seq_len,
    )  # fmt: skip

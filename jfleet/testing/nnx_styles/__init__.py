"""A zoo of tiny decoder LMs written the way public Flax NNX code writes them.

``jfleet.auto_parallel`` must find the roles of models it has never seen, not only those of
:mod:`jfleet.models`. Each style is a family of classes with the naming, block container,
call signature, config and layer types of one kind of public NNX code (imitated, nothing
copied) and a hand-written table of the dimension a Megatron layout splits in each weight.

* ``mha``: Flax's MiniGPT tutorial (``nnx.MultiHeadAttention``, ``nnx.Sequential`` MLP).
* ``linear_general``: MaxText / T5X ``DenseGeneral`` layers (``nnx.LinearGeneral``).
* ``einsum_gemma``: Flax's Gemma (``nnx.Einsum`` attention, MLP of bare ``nnx.Param``).
* ``einsum_qkv``: Gemma's multi-head path in a tutorial (stacked ``qkv_einsum``).
* ``gqa_qknorm`` / ``gqa_qknorm_mqa``: Qwen3 / Llama 3 ports (GQA, q/k norms, a config).
* ``kv_cache``: Meta's Llama reference (``wq``..``wo``, ``w1``..``w3``, a KV cache).
* ``gemma_alternating``: Gemma 2/3 (local and global blocks of one class).
* ``dropout``: nanoGPT / minGPT (``nnx.Dict`` of ``wte``/``wpe``/``h``, ``nnx.Dropout``).

The models live in :mod:`.flax_tutorials`, :mod:`.gemma` and :mod:`.ports`; :mod:`.registry`
holds :data:`STYLES`. Every name stays importable from ``jfleet.testing.nnx_styles``.

Example:
  >>> sorted(STYLES)[:3]
  ['dropout', 'einsum_gemma', 'einsum_qkv']
  >>> STYLES["einsum_gemma"].splits["layers.*.attn.kv_einsum.kernel"]
  1
"""

from __future__ import annotations

from jfleet.testing.nnx_styles._shared import MAX_SEQ as MAX_SEQ
from jfleet.testing.nnx_styles.flax_tutorials import (
    DenseGeneralAttention as DenseGeneralAttention,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    DenseGeneralLayer as DenseGeneralLayer,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    DenseGeneralLM as DenseGeneralLM,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    DenseGeneralMlp as DenseGeneralMlp,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    MiniGPT as MiniGPT,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    MiniGPTBlock as MiniGPTBlock,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    QkvEinsumBlock as QkvEinsumBlock,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    QkvEinsumLM as QkvEinsumLM,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    TokenAndPositionEmbedding as TokenAndPositionEmbedding,
)
from jfleet.testing.nnx_styles.gemma import (
    Gemma3Block as Gemma3Block,
)
from jfleet.testing.nnx_styles.gemma import (
    Gemma3FeedForward as Gemma3FeedForward,
)
from jfleet.testing.nnx_styles.gemma import (
    Gemma3LM as Gemma3LM,
)
from jfleet.testing.nnx_styles.gemma import (
    GemmaAttention as GemmaAttention,
)
from jfleet.testing.nnx_styles.gemma import (
    GemmaBlock as GemmaBlock,
)
from jfleet.testing.nnx_styles.gemma import (
    GemmaConfig as GemmaConfig,
)
from jfleet.testing.nnx_styles.gemma import (
    GemmaEmbedder as GemmaEmbedder,
)
from jfleet.testing.nnx_styles.gemma import (
    GemmaFeedForward as GemmaFeedForward,
)
from jfleet.testing.nnx_styles.gemma import (
    GemmaLM as GemmaLM,
)
from jfleet.testing.nnx_styles.ports import (
    GPT as GPT,
)
from jfleet.testing.nnx_styles.ports import (
    MLP as MLP,
)
from jfleet.testing.nnx_styles.ports import (
    Block as Block,
)
from jfleet.testing.nnx_styles.ports import (
    CausalSelfAttention as CausalSelfAttention,
)
from jfleet.testing.nnx_styles.ports import (
    LlamaCacheAttention as LlamaCacheAttention,
)
from jfleet.testing.nnx_styles.ports import (
    LlamaCacheBlock as LlamaCacheBlock,
)
from jfleet.testing.nnx_styles.ports import (
    LlamaCacheTransformer as LlamaCacheTransformer,
)
from jfleet.testing.nnx_styles.ports import (
    LlamaFeedForward as LlamaFeedForward,
)
from jfleet.testing.nnx_styles.ports import (
    ModelArgs as ModelArgs,
)
from jfleet.testing.nnx_styles.ports import (
    Qwen3Attention as Qwen3Attention,
)
from jfleet.testing.nnx_styles.ports import (
    Qwen3Config as Qwen3Config,
)
from jfleet.testing.nnx_styles.ports import (
    Qwen3DecoderLayer as Qwen3DecoderLayer,
)
from jfleet.testing.nnx_styles.ports import (
    Qwen3ForCausalLM as Qwen3ForCausalLM,
)
from jfleet.testing.nnx_styles.ports import (
    Qwen3MLP as Qwen3MLP,
)
from jfleet.testing.nnx_styles.ports import (
    Qwen3Model as Qwen3Model,
)
from jfleet.testing.nnx_styles.ports import (
    llama_forward as llama_forward,
)
from jfleet.testing.nnx_styles.registry import STYLES as STYLES
from jfleet.testing.nnx_styles.registry import Style as Style

__all__ = ["MAX_SEQ", "STYLES", "Style"]

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

:data:`FORMS` (:mod:`.forms`, models in :mod:`.beyond_lm` and :mod:`.block_forms`): a ViT,
the MNIST CNN, a T5-style encoder-decoder, a Mixture-of-Experts decoder, the Llama reference
trained through a KV cache, and decoders whose blocks return ``(cache, x)`` or ``{"hidden",
"aux_loss"}`` or hold dropout streams: the forms of issue 27, with image or token batches.
:data:`RETURN_STYLES`: decoders whose blocks return ``(cache, x)`` with the cache None in
training, ``(x, None)``, ``{"hidden": x, "cache": None}`` or ``(x, aux)`` (issue 35).
:data:`MOE_STYLES` (:mod:`.moe_styles`, issue 39): tiny MoE decoders (8 experts of width 16)
in the styles of public MoE code:

* ``qwen3_moe`` / ``qwen3_moe_ragged``: Qwen3-MoE ports (tunix, Hugging Face): stacked
  ``[E, D, F]`` experts, a router ``gate``, softmax then renormalised top-2; a dense dispatch
  (every token through every expert) or tokens sorted by expert into ``jax.lax.ragged_dot``.
* ``mixtral``: Mixtral (Mistral's reference, Hugging Face): an ``nnx.List`` of ``w1`` / ``w2``
  / ``w3`` experts, the top-2 logits then their softmax, each expert masked by ``jnp.where``.
* ``gpt_oss``: GPT-OSS (OpenAI's reference, Hugging Face): fused interleaved ``gate_up_proj``
  with biases, the clamped SwiGLU, top-4, attention sinks, sliding / full layers alternating.

The models live in :mod:`.flax_tutorials`, :mod:`.gemma` and :mod:`.ports`; :mod:`.registry`
holds :data:`STYLES`. Every name stays importable from ``jfleet.testing.nnx_styles``.

Example:
  >>> sorted(STYLES)[:3]
  ['dropout', 'einsum_gemma', 'einsum_qkv']
  >>> STYLES["einsum_gemma"].splits["layers.*.attn.kv_einsum.kernel"]
  1
"""

from __future__ import annotations

from jfleet.testing.nnx_styles._shared import (
    MAX_SEQ,
)
from jfleet.testing.nnx_styles.block_forms import (
    AuxLossDecoder,
    CacheReturningDecoder,
    DropoutDecoder,
    ReturnFormDecoder,
)
from jfleet.testing.nnx_styles.flax_tutorials import (
    DenseGeneralAttention,
    DenseGeneralLayer,
    DenseGeneralLM,
    DenseGeneralMlp,
    MiniGPT,
    MiniGPTBlock,
    QkvEinsumBlock,
    QkvEinsumLM,
    TokenAndPositionEmbedding,
)
from jfleet.testing.nnx_styles.forms import (
    FORMS,
    MOE_STYLES,
    RETURN_STYLES,
)
from jfleet.testing.nnx_styles.gemma import (
    Gemma3Block,
    Gemma3FeedForward,
    Gemma3LM,
    GemmaAttention,
    GemmaBlock,
    GemmaConfig,
    GemmaEmbedder,
    GemmaFeedForward,
    GemmaLM,
)
from jfleet.testing.nnx_styles.moe_styles import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from jfleet.testing.nnx_styles.ports import (
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    LlamaCacheAttention,
    LlamaCacheBlock,
    LlamaCacheTransformer,
    LlamaFeedForward,
    ModelArgs,
    Qwen3Attention,
    Qwen3Config,
    Qwen3DecoderLayer,
    Qwen3ForCausalLM,
    Qwen3MLP,
    Qwen3Model,
    llama_forward,
)
from jfleet.testing.nnx_styles.registry import (
    STYLES,
    Style,
)

__all__ = [
    "FORMS",
    "GPT",
    "MAX_SEQ",
    "MLP",
    "MOE_STYLES",
    "RETURN_STYLES",
    "STYLES",
    "AuxLossDecoder",
    "Block",
    "CacheReturningDecoder",
    "CausalSelfAttention",
    "DenseGeneralAttention",
    "DenseGeneralLM",
    "DenseGeneralLayer",
    "DenseGeneralMlp",
    "DropoutDecoder",
    "Gemma3Block",
    "Gemma3FeedForward",
    "Gemma3LM",
    "GemmaAttention",
    "GemmaBlock",
    "GemmaConfig",
    "GemmaEmbedder",
    "GemmaFeedForward",
    "GemmaLM",
    "GptOssConfig",
    "GptOssForCausalLM",
    "LlamaCacheAttention",
    "LlamaCacheBlock",
    "LlamaCacheTransformer",
    "LlamaFeedForward",
    "MiniGPT",
    "MiniGPTBlock",
    "MixtralConfig",
    "MixtralForCausalLM",
    "ModelArgs",
    "QkvEinsumBlock",
    "QkvEinsumLM",
    "Qwen3Attention",
    "Qwen3Config",
    "Qwen3DecoderLayer",
    "Qwen3ForCausalLM",
    "Qwen3MLP",
    "Qwen3Model",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "ReturnFormDecoder",
    "Style",
    "TokenAndPositionEmbedding",
    "llama_forward",
]

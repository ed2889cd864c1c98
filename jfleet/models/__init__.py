r"""Reference models for the docs, examples, notebooks, benchmarks and tests.

Reference models, built from the parallel layer (beside ``precision``, neither importing
the other); the planner's named model shapes build them abstractly.

May import: runtime, mesh, optim, parallel.

Each is a small decoder written in plain Flax NNX (no distributed code) unless its name
says otherwise; all train on the token batches of :mod:`jfleet.models.tiny_lm`.

* :mod:`~jfleet.models.tiny_lm`: ``TinyLM`` (embedding, MLP blocks, head; no attention)
  and the data (``lm_batches``, ``stride_batches``, ``lm_loss``).
* :mod:`~jfleet.models.parallel_gpt`: ``TinyGPT``, built from plain layers or from
  jfleet's tensor-parallel layers (Megatron layout, optional sequence parallel).
* :mod:`~jfleet.models.gpt2`: ``TinyGPT2``, GPT-2-style (fused qkv, tied head).
* :mod:`~jfleet.models.llama`: ``TinyLlama``, Llama-style (RMSNorm, RoPE, GQA, SwiGLU).
* :mod:`~jfleet.models.moe_lm`: ``TinyMoELM``, whose blocks are Paddle ``MoELayer``\ s
  (experts over the ``ep`` axis), and ``moe_lm_loss`` (cross-entropy plus the gates' losses).
* :mod:`~jfleet.models.attention`: the attention core they share, ``causal_attention``
  (``jax.nn.dot_product_attention``: cuDNN flash attention on a GPU, XLA elsewhere).

Example:
  >>> from jfleet.models import TinyLM, lm_batches, lm_loss
  >>> float(lm_loss(TinyLM(), lm_batches(1)[0])) > 0
  True
"""

from jfleet.models.moe_lm import TinyMoELM as TinyMoELM
from jfleet.models.moe_lm import moe_lm_loss as moe_lm_loss
from jfleet.models.tiny_lm import Block as Block
from jfleet.models.tiny_lm import TinyLM as TinyLM
from jfleet.models.tiny_lm import lm_batches as lm_batches
from jfleet.models.tiny_lm import lm_loss as lm_loss
from jfleet.models.tiny_lm import stride_batches as stride_batches

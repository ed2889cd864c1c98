"""``TinyMoELM``: a decoder whose blocks are Paddle ``MoELayer``\\ s, and its loss.

An embedding, pre-norm MoE blocks with residuals (each an
:class:`~jfleet.parallel.moe.moe_layer.MoELayer` over Paddle-style expert layers:
``htoh4``, GELU, ``h4toh``, biases on), and a head. The loss is the cross-entropy plus each
gate's auxiliary loss (Paddle's ``gate.get_loss()``), the pattern a Paddle MoE script
uses. Built on the fleet's mesh, its experts split over the expert-parallel group.

Example:
  >>> from jfleet import fleet
  >>> from jfleet.models import lm_batches
  >>> strategy = fleet.DistributedStrategy()
  >>> strategy.hybrid_configs = {"dp_degree": 2, "ep_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
  >>> from flax import nnx
  >>> model = TinyMoELM()
  >>> float(nnx.jit(moe_lm_loss)(model, lm_batches(1, batch=8)[0])) > 0
  True
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from jfleet.mesh import context
from jfleet.parallel.moe.moe_layer import MoELayer

__all__ = ["ExpertLayer", "TinyMoELM", "moe_lm_loss"]


class ExpertLayer(nnx.Module):
    """Paddle's docstring expert: ``htoh4``, GELU, ``h4toh`` (biases on)."""

    def __init__(self, d_model: int, d_hidden: int, *, rngs: nnx.Rngs) -> None:
        self.htoh4 = nnx.Linear(d_model, d_hidden, rngs=rngs)
        self.h4toh = nnx.Linear(d_hidden, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.h4toh(jax.nn.gelu(self.htoh4(x)))


class TinyMoELM(nnx.Module):
    """Embedding, ``layers`` pre-norm MoE blocks with residuals, a head.

    Args:
      vocab, width, hidden: vocabulary, token width, each expert's hidden width.
      experts: experts a layer (every rank's).
      layers: MoE blocks.
      gate: the layers' ``gate`` (default: GShard, top 2, dropless, no random routing).
      split_mp: split the tokens over ``mp`` too (the layers' ``mp_group``).
      groups: token groups a device's tokens form for the capacity rule.
      mesh: the mesh (default: the fleet's); the experts go over its ``ep`` axis.
      seed: the ``nnx.Rngs`` seed.
    """

    def __init__(
        self,
        vocab: int = 64,
        width: int = 16,
        hidden: int = 32,
        experts: int = 8,
        layers: int = 2,
        gate: dict | None = None,
        *,
        split_mp: bool = False,
        groups: int = 1,
        mesh: Mesh | None = None,
        seed: int = 0,
    ) -> None:
        rngs = nnx.Rngs(seed)
        gate = gate or {"type": "gshard", "top_k": 2, "capacity": None, "random_routing": False}
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.norms = nnx.List([nnx.RMSNorm(width, rngs=rngs) for _ in range(layers)])
        mp_group = _mp_group() if split_mp else None
        self.moes = nnx.List(
            [
                MoELayer(
                    width,
                    [ExpertLayer(width, hidden, rngs=rngs) for _ in range(experts)],
                    gate=dict(gate),
                    mp_group=mp_group,
                    groups=groups,
                    mesh=mesh,
                    rngs=rngs,
                )
                for _ in range(layers)
            ]
        )
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes, strict=True):
            x = x + moe(norm(x))
        return self.head(x)


def _mp_group() -> Any:
    """The running fleet's model-parallel group."""
    return context.require("TinyMoELM(split_mp=True)").hcg.get_model_parallel_group()


def moe_lm_loss(model: nnx.Module, batch: dict, aux_weight: float = 0.01) -> jax.Array:
    """Cross-entropy plus ``aux_weight`` times every gate's loss of this forward."""
    logits = model(batch["tokens"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
    layers = getattr(model, "module", model).moes  # fleet.distributed_model wraps the model
    losses = [m.gate.get_loss() for m in layers]
    return ce + aux_weight * sum(x for x in losses if x is not None)

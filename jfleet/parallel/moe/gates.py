"""Paddle's MoE gates: ``NaiveGate``, ``GShardGate``, ``SwitchGate``.

A gate scores each token's experts and says how :class:`~jfleet.parallel.moe.moe_layer.MoELayer`
routes them: how many experts a token takes (``top_k``), whether their weights are
renormalised, the capacity factor, and the auxiliary loss it keeps (``get_loss``).
Paddle's names and arguments (``paddle.incubate.distributed.models.moe.gate``), with
Paddle's (fastmoe's) bugs fixed, as each class says:

* the combine weights are probabilities: Paddle's ``NaiveGate`` and ``GShardGate`` return
  the raw top-k *logits* and ``MoELayer`` weights the experts' outputs by them; fastmoe,
  which Paddle adapted, takes the softmax over the top-k logits, as here;
* the capacity is GShard's: ``capacity=(1.2, 2.4)`` are factors of a token group's even
  share per expert, ``ceil(factor * T * k / E)`` slots (training, evaluation). Paddle
  gives each expert ``ceil(factor * T)`` slots for what every rank sends it, ``E / k``
  times that share (one rank never drops); fastmoe, which Paddle adapted, has since
  scaled it by ``k / E``, as here. ``capacity=None`` is dropless;
* the Switch loss is Switch's: ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of all
  tokens routed to ``e`` and ``P_e`` its mean probability over all tokens (Paddle divides
  both by the tokens kept after the capacity limit).

``NaiveGate`` keeps no loss (``get_loss()`` is None, as Paddle's); ``GShardGate``'s is
Paddle's scale, ``k`` times the Switch form (Paddle counts each of a token's k choices
against the tokens).

Example:
  >>> from flax import nnx
  >>> gate = GShardGate(8, num_expert=4, world_size=2, rngs=nnx.Rngs(0))
  >>> gate.tot_expert, gate.top_k, gate.capacity_factor(training=True)
  (8, 2, 1.2)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jfleet.parallel.moe.layer import MoEAux
from jfleet.parallel.stack import CallOutput

__all__ = ["BaseGate", "GShardGate", "GateLoss", "NaiveGate", "SwitchGate"]


class GateLoss(CallOutput):
    """A gate's auxiliary loss of its last call (state, not a parameter; in a pipelined
    body it is only seen inside the block, right after the layer's call)."""


def _positive_int(cls: str, **values: Any) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{cls}: {name}={v!r} must be a positive int.")


class BaseGate(nnx.Module):
    """What every gate holds: ``num_expert`` experts a rank, ``world_size`` ranks,
    ``tot_expert`` in all, and the loss of its last call (``set_loss`` / ``get_loss``)."""

    def __init__(self, num_expert: int, world_size: int) -> None:
        _positive_int(type(self).__name__, num_expert=num_expert, world_size=world_size)
        self.num_expert = num_expert
        self.world_size = world_size
        self.tot_expert = num_expert * world_size
        self.loss = GateLoss(jnp.zeros((), jnp.float32))
        self.has_loss = False

    def set_loss(self, loss: jax.Array) -> None:
        """Keep ``loss`` as the gate's loss (read it with :meth:`get_loss`)."""
        self.loss[...] = jnp.asarray(loss, jnp.float32)

    def get_loss(self, clear: bool = True) -> jax.Array | None:
        """The loss of the last call (None for a gate that keeps none); ``clear`` resets it
        to zero (Paddle sets it to None)."""
        if not self.has_loss:
            return None
        if self.loss.ndim:
            raise ValueError(
                f"{type(self).__name__}.get_loss(): this gate is stacked in a pipelined body "
                f"(its loss has shape {self.loss.shape}, one a layer) and keeps no loss after "
                "a step; read gate.get_loss() inside the block right after the MoE layer's "
                "call and return it with the activation (docs/moe.md, 'MoE in a pipeline')."
            )
        loss = self.loss[...]
        if clear:
            self.loss[...] = jnp.zeros((), jnp.float32)
        return loss

    def record(self, aux: MoEAux) -> None:
        """Keep this gate's loss from the layer's :class:`MoEAux` (none by default)."""

    @property
    def balance_scale(self) -> float:
        """The gate's loss as a multiple of the Switch load-balancing loss (0: none)."""
        return 0.0


class NaiveGate(BaseGate):
    """Top-k routing by a linear layer's logits; no capacity limit, no loss.

    Args:
      d_model: token width.
      num_expert: experts on each rank (``tot_expert = num_expert * world_size``).
      world_size: ranks of the expert-parallel group.
      topk: experts a token takes.
      rngs: the linear layer's ``params`` key.

    The weights of a token's experts are the softmax over its top-k logits (fastmoe's;
    Paddle uses the raw logits).

    Example:
      >>> from flax import nnx
      >>> g = NaiveGate(4, 3, rngs=nnx.Rngs(0))
      >>> g(jnp.ones((5, 4))).shape, g.get_loss()
      ((5, 3), None)
    """

    normalize = True

    def __init__(
        self,
        d_model: int,
        num_expert: int,
        world_size: int = 1,
        topk: int = 2,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(num_expert, world_size)
        _positive_int(type(self).__name__, d_model=d_model, topk=topk)
        if topk > self.tot_expert:
            raise ValueError(
                f"{type(self).__name__}: topk={topk} exceeds the {self.tot_expert} experts "
                f"(num_expert={num_expert} x world_size={world_size}); use topk <= "
                f"{self.tot_expert}."
            )
        self.gate = nnx.Linear(d_model, self.tot_expert, rngs=rngs)
        self.top_k = topk
        self.capacity: tuple[float, float] | None = None  # no limit
        self.deterministic = False

    def __call__(self, x: jax.Array) -> jax.Array:
        """Router logits ``[..., tot_expert]``."""
        return self.gate(x).astype(jnp.float32)

    def capacity_factor(self, training: bool) -> float | None:
        """The training or evaluation capacity factor (None: dropless, the naive gate's)."""
        return None if self.capacity is None else self.capacity[0 if training else 1]

    def random_draws(self, shape: tuple[int, ...]) -> jax.Array | None:
        """Uniform draws for GShard's random routing (None: every choice is routed)."""
        return None


class GShardGate(NaiveGate):
    """GShard's top-2 gate: capacity factors, random routing of second choices, and the
    load-balancing loss.

    Args:
      d_model, num_expert, world_size: as :class:`NaiveGate`.
      topk: must be 2 (as Paddle's).
      capacity: capacity factors ``(training, evaluation)`` (GShard's: ``ceil(f * T * k /
        E)`` slots an expert for ``T`` tokens of a group), or None: dropless.
      random_routing: route a token's second choice with probability ``2 * w2`` (its
        normalised weight), GShard's rule; drawn from ``rngs``' ``gate`` stream in
        training (``deterministic`` False).
      group: accepted for Paddle (the layer's ``moe_group`` decides the split).
      rngs: parameter and random-routing keys.

    The loss: ``E * sum_e c_e * m_e`` with ``c_e`` the assignments to expert ``e`` over
    the tokens (both choices) and ``m_e`` its mean probability: Paddle's value.
    """

    def __init__(
        self,
        d_model: int,
        num_expert: int,
        world_size: int = 1,
        topk: int = 2,
        capacity: tuple[float, float] | None = (1.2, 2.4),
        random_routing: bool = True,
        group: Any = None,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        if topk != 2:
            raise ValueError(f"GShardGate: topk={topk!r}; GShard's gate routes topk=2 experts.")
        super().__init__(d_model, num_expert, world_size, topk, rngs=rngs)
        self.capacity = _capacity_pair(type(self).__name__, capacity)
        self.random_routing = bool(random_routing)
        self.rngs = rngs["gate"].fork() if random_routing else nnx.data(None)
        self.has_loss = True

    def random_draws(self, shape: tuple[int, ...]) -> jax.Array | None:
        """Uniform ``[0, 1)`` draws a token, in training with random routing."""
        if not self.random_routing or self.deterministic:
            return None
        return jax.random.uniform(self.rngs(), shape, jnp.float32)

    def record(self, aux: MoEAux) -> None:
        self.set_loss(self.balance_scale * aux.load_balancing_loss)

    @property
    def balance_scale(self) -> float:
        return float(self.top_k)


class SwitchGate(NaiveGate):
    """Switch Transformer's top-1 gate: noisy logits in training, capacity factors, the
    load-balancing loss.

    Args:
      d_model, num_expert, world_size: as :class:`NaiveGate`.
      topk: must be 1 (as Paddle's).
      switch_eps: training noise, uniform in ``[-eps, eps]`` added to the logits
        (Paddle adds ``U(1 - eps, 1 + eps)``: the same softmax).
      capacity: capacity factors ``(training, evaluation)``, or None: dropless.
      group: accepted for Paddle.
      rngs: parameter and noise keys.

    The token's weight is its top-1 probability (not renormalised); the loss is Switch's,
    ``E * sum_e f_e * P_e``.
    """

    normalize = False

    def __init__(
        self,
        d_model: int,
        num_expert: int,
        world_size: int = 1,
        topk: int = 1,
        switch_eps: float = 0.1,
        capacity: tuple[float, float] | None = (1.2, 2.4),
        group: Any = None,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        if topk != 1:
            raise ValueError(f"SwitchGate: topk={topk!r}; the Switch gate routes topk=1 expert.")
        if not 0 <= switch_eps < 1:
            raise ValueError(f"SwitchGate: switch_eps={switch_eps!r} must be in [0, 1).")
        super().__init__(d_model, num_expert, world_size, topk, rngs=rngs)
        self.switch_eps = float(switch_eps)
        self.capacity = _capacity_pair(type(self).__name__, capacity)
        self.rngs = rngs["gate"].fork()
        self.has_loss = True

    def __call__(self, x: jax.Array) -> jax.Array:
        logits = super().__call__(x)
        if self.deterministic or not self.switch_eps:
            return logits
        noise = jax.random.uniform(self.rngs(), logits.shape, jnp.float32)
        return logits + (2 * noise - 1) * self.switch_eps

    def record(self, aux: MoEAux) -> None:
        self.set_loss(aux.load_balancing_loss)

    @property
    def balance_scale(self) -> float:
        return 1.0


def _capacity_pair(cls: str, capacity: Any) -> tuple[float, float] | None:
    if capacity is None:
        return None
    try:
        train, evaluate = (float(c) for c in capacity)
    except (TypeError, ValueError):
        train = evaluate = float("nan")
    if not (train > 0 and evaluate > 0):
        raise ValueError(
            f"{cls}: capacity={capacity!r} must be two positive factors (training, "
            "evaluation), e.g. (1.2, 2.4), or None for dropless."
        )
    return train, evaluate

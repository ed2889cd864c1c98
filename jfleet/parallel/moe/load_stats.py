"""The router statistics a gate's load-balancing loss is made of, carried per row so that a
pipeline can sum them over its micro-batches before it takes the loss.

The Switch / GShard loss ``E * sum_e f_e * P_e`` multiplies two batch statistics, so the
mean of each micro-batch's loss is not the whole batch's (it is gradient accumulation's
value). Its parts are sums over tokens, though: ``C_e`` (the assignments to expert ``e``,
not differentiated) and ``Pr_e`` (the router probabilities of ``e``) over ``T`` tokens give
``E * sum_e C_e * Pr_e / T**2`` (with the gate's scale folded into ``C``). A block that
carries :class:`LoadStats` with its activation, one slot per MoE layer, and a loss function
that reads :meth:`LoadStats.loss` get the whole batch's value on one device, under data
parallelism, and in ``PipelineLayer``'s ``"FThenB"`` schedule, which sums every
micro-batch's statistics before the head's loss (its backward is the exact gradient). Under
``"1F1B"`` a backward starts before the last forward, so the loss is each micro-batch's,
averaged (today's value); ``PipelineLayer`` logs a note saying so, once.

Example:
  >>> import jax.numpy as jnp
  >>> stats = LoadStats.zeros(rows=2, layers=1, experts=2)
  >>> logits = jnp.array([[[9.0, 0.0]], [[0.0, 9.0]]])  # 2 rows of 1 token, balanced
  >>> stats = stats.push(row_stats(logits, k=1, scale=1.0))
  >>> round(float(stats.loss()), 3)
  1.0
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jfleet.mesh.group_collective import manual_axes
from jfleet.mesh.topology import DATA_AXES
from jfleet.parallel.moe.routing import route_logits

__all__ = ["LoadStats", "row_stats"]


class LoadStats(NamedTuple):
    """Per row of the batch and per MoE layer, the sums a load-balancing loss is made of
    (all float32, batch first so that they ride with an activation through a pipeline).

    Attributes:
      counts: ``[rows, layers, E]`` each row's top-k assignments per expert, times the
        gate's scale over ``k`` (not differentiated).
      probs: ``[rows, layers, E]`` each row's router probabilities summed over its tokens.
      tokens: ``[rows, layers]`` each row's tokens.
      z: ``[rows, layers]`` each row's ``z_loss_coef * sum logsumexp(logits) ** 2``.
    """

    counts: jax.Array
    probs: jax.Array
    tokens: jax.Array
    z: jax.Array

    #: ``PipelineLayer`` sums the leaves of such a node over the micro-batches (FThenB)
    pooled_over_microbatches = True

    @classmethod
    def zeros(cls, rows: int, layers: int, experts: int) -> LoadStats:
        """Empty statistics for ``layers`` MoE layers of ``experts`` experts."""
        wide = jnp.zeros((rows, layers, experts), jnp.float32)
        narrow = jnp.zeros((rows, layers), jnp.float32)
        return cls(wide, wide, narrow, narrow)

    def push(self, layer: LoadStats) -> LoadStats:
        """These statistics with one layer's (``[rows, 1, ...]``, :func:`row_stats`) shifted
        in at slot 0 and the last slot dropped: identical blocks, stacked in a scan, each
        push theirs and after ``layers`` blocks every slot holds one layer's."""
        return LoadStats(
            *(
                jnp.concatenate([new, old[:, :-1]], axis=1)
                for new, old in zip(layer, self, strict=True)
            )
        )

    def loss(self) -> jax.Array:
        """The layers' load-balancing losses (and z-losses) over every row, summed over the
        layers: each gate's ``get_loss()`` on the whole batch.

        Inside a ``shard_map`` (a pipeline's head) the sums are ``psum``-ed over the manual
        data axes, so every device gets the value of all the batch's rows; slots no layer
        filled (no tokens) add zero.
        """
        axes = tuple(a for a in manual_axes() if a in DATA_AXES)
        sums = [jnp.sum(a, axis=0) for a in self]
        if axes:
            sums = jax.lax.psum(sums, axes)
        counts, probs, tokens, z = sums
        safe = jnp.where(tokens > 0, tokens, 1.0)
        experts = counts.shape[-1]
        balance = experts * jnp.sum(jax.lax.stop_gradient(counts) * probs, axis=-1) / safe**2
        return jnp.sum(jnp.where(tokens > 0, balance + z / safe, 0.0))


def row_stats(logits: jax.Array, k: int, scale: float, z_loss_coef: float = 0.0) -> LoadStats:
    """One layer's :class:`LoadStats` (``[rows, 1, ...]``) from its router logits
    ``[rows, ..., E]``: the top-k choices of :func:`~jfleet.parallel.moe.routing.route_logits`
    (before capacity drops and random routing, as
    :func:`~jfleet.parallel.moe.routing.load_balancing_loss` counts them), ``scale`` the
    gate's multiple of the Switch loss (GShard's ``k``, Switch's 1, 0 for no loss)."""
    rows, experts = logits.shape[0], logits.shape[-1]
    flat = logits.reshape(-1, experts)
    routing = route_logits(flat, k, normalize=False)
    chosen = jnp.sum(jax.nn.one_hot(routing.experts, experts, dtype=jnp.float32), axis=1)
    per_row = lambda a: a.reshape(rows, -1, *a.shape[1:]).sum(axis=1)  # noqa: E731
    tokens = jnp.full((rows,), flat.shape[0] // rows, jnp.float32)
    z = jnp.square(jax.nn.logsumexp(routing.logits, axis=-1))
    return LoadStats(
        jax.lax.stop_gradient(per_row(chosen) * (scale / k))[:, None],
        (per_row(routing.probs) * (1.0 if scale else 0.0))[:, None],
        tokens[:, None],
        (per_row(z) * z_loss_coef)[:, None],
    )

"""The experts' weights and their compute: a batched einsum or a grouped matmul.

An expert is an MLP, ``act(x @ w_in) @ w_out``, or a gated one (SwiGLU when ``act`` is
``silu``): ``(act(x @ w_gate) * (x @ w_in)) @ w_out``. The ``E`` experts' kernels are
stacked on a leading expert axis, ``[E, D, F]`` and ``[E, F, D]``, which the expert-parallel
mesh axis splits: each device holds ``E / ep`` experts.

Two ways to run a device's experts:

* :func:`experts_einsum`: on fixed buffers ``[E_local, N, D]`` (``N`` slots per expert,
  padding included), one batched einsum per kernel;
* :func:`experts_ragged_dot`: on rows ``[M, D]`` sorted by expert with ``group_sizes``
  rows per expert, ``jax.lax.ragged_dot`` per kernel (a grouped matmul; rows past
  ``sum(group_sizes)`` come out zero).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

Activation = Callable[[jax.Array], jax.Array]


class ExpertWeights(NamedTuple):
    """Stacked expert kernels.

    Attributes:
      w_in: ``[E, D, F]`` up projection.
      w_out: ``[E, F, D]`` down projection.
      w_gate: ``[E, D, F]`` gate projection of a gated MLP, or ``None``.
    """

    w_in: jax.Array
    w_out: jax.Array
    w_gate: jax.Array | None = None

    @property
    def num_experts(self) -> int:
        """``E``, the experts the kernels hold."""
        return self.w_in.shape[0]


def check_expert_weights(weights: ExpertWeights, d_model: int) -> None:
    """Raise a ``ValueError`` naming every kernel whose shape does not fit the others.

    Example:
      >>> w = ExpertWeights(jnp.zeros((4, 8, 16)), jnp.zeros((4, 16, 8)))
      >>> check_expert_weights(w, 8)
      >>> check_expert_weights(w, 6)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: expert kernels do not fit tokens of width 6: w_in (4, 8, 16) should be ...
    """
    e, f = weights.w_in.shape[0], weights.w_in.shape[-1]
    want = {"w_in": (e, d_model, f), "w_out": (e, f, d_model)}
    if weights.w_gate is not None:
        want["w_gate"] = (e, d_model, f)
    spell = {"w_in": "[E, {d}, F]", "w_out": "[E, F, {d}]", "w_gate": "[E, {d}, F]"}
    bad = [
        f"{name} {tuple(getattr(weights, name).shape)} should be {spell[name].format(d=d_model)}"
        for name, shape in want.items()
        if tuple(getattr(weights, name).shape) != shape
    ]
    if bad:
        raise ValueError(f"expert kernels do not fit tokens of width {d_model}: " + "; ".join(bad))


def experts_einsum(
    x: jax.Array, weights: ExpertWeights, activation: Activation = jax.nn.silu
) -> jax.Array:
    """Each expert's MLP on its own buffer: ``x [E, N, D] -> [E, N, D]``.

    Example:
      >>> w = ExpertWeights(jnp.ones((2, 3, 4)), jnp.ones((2, 4, 3)))
      >>> experts_einsum(jnp.ones((2, 5, 3)), w, jax.nn.relu).shape
      (2, 5, 3)
    """
    hidden = jnp.einsum("end,edf->enf", x, weights.w_in)
    if weights.w_gate is None:
        hidden = activation(hidden)
    else:
        hidden = activation(jnp.einsum("end,edf->enf", x, weights.w_gate)) * hidden
    return jnp.einsum("enf,efd->end", hidden, weights.w_out)


def experts_ragged_dot(
    rows: jax.Array,
    group_sizes: jax.Array,
    weights: ExpertWeights,
    activation: Activation = jax.nn.silu,
) -> jax.Array:
    """The experts' MLPs as grouped matmuls over ``rows [M, D]`` sorted by expert.

    Rows ``sum(group_sizes[:e])`` to ``sum(group_sizes[:e+1])`` belong to expert ``e``;
    rows past ``sum(group_sizes)`` give zeros.

    Example:
      >>> w = ExpertWeights(jnp.ones((2, 3, 4)), jnp.ones((2, 4, 3)))
      >>> y = experts_ragged_dot(jnp.ones((5, 3)), jnp.array([1, 2]), w, jax.nn.relu)
      >>> y[:, 0].tolist()
      [12.0, 12.0, 12.0, 0.0, 0.0]
    """
    sizes = group_sizes.astype(jnp.int32)
    hidden = jax.lax.ragged_dot(rows, weights.w_in, sizes)
    if weights.w_gate is None:
        hidden = activation(hidden)
    else:
        hidden = activation(jax.lax.ragged_dot(rows, weights.w_gate, sizes)) * hidden
    return jax.lax.ragged_dot(hidden, weights.w_out, sizes)

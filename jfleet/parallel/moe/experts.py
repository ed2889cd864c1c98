"""The experts' weights and their compute: a batched einsum or a grouped matmul.

An expert is an MLP, ``act(x @ w_in) @ w_out``, or a gated one (SwiGLU when ``act`` is
``silu``): ``(act(x @ w_gate) * (x @ w_in)) @ w_out``. The ``E`` experts' kernels are
stacked on a leading expert axis, ``[E, D, F]`` and ``[E, F, D]``, which the expert-parallel
mesh axis splits: each device holds ``E / ep`` experts.

Experts written as modules (Paddle's ``MoELayer`` takes a list of any expert layers)
are :class:`StackedExperts`: the modules' parameters stacked on the expert axis, run on
the fixed buffers by ``jax.vmap`` over it (:func:`experts_apply`).

Two ways to run a device's experts given as kernels:

* :func:`experts_einsum`: on fixed buffers ``[E_local, N, D]`` (``N`` slots per expert,
  padding included), one batched einsum per kernel;
* :func:`experts_ragged_dot`: on rows ``[M, D]`` sorted by expert with ``group_sizes``
  rows per expert, ``jax.lax.ragged_dot`` per kernel (a grouped matmul; rows past
  ``sum(group_sizes)`` come out zero).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

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


def check_expert_weights(weights: ExpertWeights | StackedExperts, d_model: int) -> None:
    """Raise a ``ValueError`` naming every kernel whose shape does not fit the others.

    Example:
      >>> w = ExpertWeights(jnp.zeros((4, 8, 16)), jnp.zeros((4, 16, 8)))
      >>> check_expert_weights(w, 8)
      >>> check_expert_weights(w, 6)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: expert kernels do not fit tokens of width 6: w_in (4, 8, 16) should be ...
    """
    if not isinstance(weights, ExpertWeights):
        return  # modules: their own call checks the width
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedExperts:
    """Expert modules of one definition with their parameters stacked: ``[E, ...]`` each.

    A pytree whose leaves are the stacked parameters (so ``shard_map`` splits them over
    the expert axis) and whose ``graphdef`` is static.

    Attributes:
      graphdef: the experts' shared ``nnx`` graph definition.
      params: their parameters, each with a leading expert axis.

    Example:
      >>> from flax import nnx
      >>> experts = [nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(3)]
      >>> graphdef, _ = nnx.split(experts[0])
      >>> params = jax.tree.map(lambda *a: jnp.stack(a), *[nnx.state(e) for e in experts])
      >>> stacked = StackedExperts(graphdef, params)
      >>> stacked.num_experts, experts_apply(jnp.ones((3, 2, 4)), stacked).shape
      (3, (3, 2, 4))
    """

    graphdef: Any = dataclasses.field(metadata={"static": True})
    params: Any

    @property
    def num_experts(self) -> int:
        """``E``, the experts the parameters hold."""
        return jax.tree.leaves(self.params)[0].shape[0]


Experts = ExpertWeights | StackedExperts


def experts_apply(
    x: jax.Array, weights: Experts, activation: Activation = jax.nn.silu
) -> jax.Array:
    """Each expert on its own buffer, ``x [E, N, D] -> [E, N, D]``: kernels through
    :func:`experts_einsum`, modules (:class:`StackedExperts`) by ``jax.vmap`` over the
    expert axis (``activation`` is theirs, not applied here)."""
    if isinstance(weights, ExpertWeights):
        return experts_einsum(x, weights, activation)
    return jax.vmap(lambda p, h: nnx.merge(weights.graphdef, p)(h))(weights.params, x)

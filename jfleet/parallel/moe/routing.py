"""Top-k routing, the capacity rule, and the router's auxiliary losses.

Routing is per token: softmax router probabilities over the ``E`` experts, the ``k`` most
probable experts, and their weights (the top-k probabilities, renormalised to sum to one
as Mixtral and Qwen3-MoE do, or kept as they are as GShard does).

The capacity rule (:func:`expert_capacity`) and the drop order (:func:`assign_slots`) are
GShard's and Switch's: each token group (one device's tokens) gives every expert
``capacity`` slots; the ``k * T`` (token, choice) assignments take them first choice
first, then second choice, ..., each in token order; an assignment past its expert's
capacity is dropped.

The losses are computed over the whole batch even when each device holds a slice of it:
pass the mesh axes the tokens are split over as ``axis_names`` inside ``shard_map`` and
the sums are ``psum``-ed over them, so every device returns the one-device value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

#: Slack for the float product in the capacity rule: ``1.1 * 10`` is 11.000000000000002
#: in binary floating point and must give 11 slots, not 12.
_CAPACITY_SLACK = 1e-9


class Routing(NamedTuple):
    """Where each token goes.

    Attributes:
      logits: ``[T, E]`` router logits (float32).
      probs: ``[T, E]`` softmax router probabilities.
      experts: ``[T, k]`` int32 chosen experts, most probable first (distinct per token).
      weights: ``[T, k]`` combine weights of the chosen experts.
    """

    logits: jax.Array
    probs: jax.Array
    experts: jax.Array
    weights: jax.Array


def check_routing(k: int, num_experts: int, capacity_factor: float | None) -> None:
    """Raise a ``ValueError`` for a top-k or capacity factor no router can honour.

    Example:
      >>> check_routing(2, 8, 1.25)
      >>> check_routing(9, 8, None)
      Traceback (most recent call last):
      ...
      ValueError: k=9 experts per token cannot exceed the 8 experts; use 1 <= k <= 8.
    """
    if not 1 <= k <= num_experts:
        raise ValueError(
            f"k={k} experts per token cannot exceed the {num_experts} experts; "
            f"use 1 <= k <= {num_experts}."
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(
            f"capacity_factor={capacity_factor!r} must be a positive number (1.0 gives each "
            "expert its even share of the tokens); pass capacity_factor=None for dropless."
        )


def route(x: jax.Array, router: jax.Array, k: int, *, normalize: bool = True) -> Routing:
    """Top-k routing of tokens ``x [T, D]`` by a router kernel ``router [D, E]``.

    Args:
      x: ``[T, D]`` tokens.
      router: ``[D, E]`` router kernel (no bias).
      k: experts per token.
      normalize: renormalise the ``k`` chosen probabilities to sum to one (Mixtral,
        Qwen3-MoE); ``False`` keeps the softmax probabilities (GShard, Switch).

    Returns:
      The :class:`Routing`; logits and probabilities in float32.

    Raises:
      ValueError: ``k`` is not in ``1..E``.

    Example:
      >>> x = jnp.eye(2, 4)
      >>> router = jnp.array([[4.0, 0, 0], [0, 0, 4.0], [0, 0, 0], [0, 0, 0]])
      >>> r = route(x, router, 2)
      >>> r.experts.tolist(), r.weights.sum(-1).round(6).tolist()
      ([[0, 1], [2, 0]], [1.0, 1.0])
    """
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
    return route_logits(logits, k, normalize=normalize)


def route_logits(logits: jax.Array, k: int, *, normalize: bool = True) -> Routing:
    """:func:`route` from router logits ``[T, E]`` a gate computed (a router with a bias,
    Switch's noise, a norm before it).

    Example:
      >>> r = route_logits(jnp.array([[0.0, 2.0, 1.0]]), 2, normalize=False)
      >>> r.experts.tolist(), round(float(r.weights.sum()), 4)
      ([[1, 2]], 0.91)
    """
    num_experts = logits.shape[-1]
    check_routing(k, num_experts, None)
    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top, experts = jax.lax.top_k(probs, k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return Routing(logits, probs, experts.astype(jnp.int32), top)


def expert_capacity(tokens: int, k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Slots per expert for a group of ``tokens`` tokens.

    The rule: ``min(tokens, ceil(capacity_factor * tokens * k / num_experts))``, the
    product taken in Python floats less ``1e-9`` (so ``1.1 * 10`` gives 11, not 12), and at
    least one slot. ``capacity_factor=None`` is dropless: ``tokens`` slots, the worst case
    (a token's ``k`` experts are distinct, so no expert can be chosen more than once per
    token); the ``min`` only trims slots no group could fill.

    Raises:
      ValueError: ``k`` outside ``1..num_experts`` or ``capacity_factor <= 0``.

    Example:
      >>> expert_capacity(64, 2, 8, 1.0), expert_capacity(64, 2, 8, 1.25)
      (16, 20)
      >>> expert_capacity(64, 2, 8, None), expert_capacity(10, 1, 1, 1.1)
      (64, 10)
    """
    check_routing(k, num_experts, capacity_factor)
    if capacity_factor is None:
        return tokens
    wanted = math.ceil(capacity_factor * tokens * k / num_experts - _CAPACITY_SLACK)
    return max(1, min(tokens, wanted))


class Slots(NamedTuple):
    """Each (choice, token) assignment's place in its expert's buffer.

    Assignments are ordered choice-major: index ``j * T + t`` is token ``t``'s ``j``-th
    choice.

    Attributes:
      expert: ``[k*T]`` int32 expert of each assignment.
      position: ``[k*T]`` int32 its rank among its expert's assignments (0 = first).
      kept: ``[k*T]`` bool: ``position < capacity``.
      routed: ``[E]`` int32 assignments per expert (kept or not).
    """

    expert: jax.Array
    position: jax.Array
    kept: jax.Array
    routed: jax.Array


def assign_slots(experts: jax.Array, num_experts: int, capacity: int) -> Slots:
    """Positions of the assignments in their experts' buffers, in GShard's priority.

    First choices take slots before second choices, each in token order; an assignment
    whose position reaches ``capacity`` is dropped. In the example token 0's second choice
    (expert 0) is dropped, since tokens 1 and 2 chose expert 0 first; in plain token order
    token 2's first choice would be.

    Args:
      experts: ``[T, k]`` chosen experts (:attr:`Routing.experts`).
      num_experts: ``E``.
      capacity: slots per expert (:func:`expert_capacity`).

    Example:
      >>> s = assign_slots(jnp.array([[1, 0], [0, 2], [0, 1]]), 3, 2)
      >>> s.position.tolist(), s.kept.tolist(), s.routed.tolist()
      ([0, 0, 1, 2, 0, 1], [True, True, True, False, True, True], [3, 2, 1])
    """
    flat = experts.T.reshape(-1)
    onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    return Slots(flat, position, position < capacity, jnp.sum(onehot, axis=0))


def _global_sum(x: jax.Array, axis_names: Sequence[str]) -> jax.Array:
    return jax.lax.psum(x, tuple(axis_names)) if axis_names else x


def load_balancing_loss(
    probs: jax.Array, experts: jax.Array, *, axis_names: Sequence[str] = ()
) -> jax.Array:
    """Switch / GShard load-balancing loss ``E * sum_e f_e * P_e`` over the whole batch.

    ``f_e`` is the fraction of the ``k * T`` top-k assignments that choose expert ``e``
    (before capacity drops; at ``k = 1`` Switch's fraction of tokens), ``P_e`` the mean
    router probability of ``e`` over the ``T`` tokens. Balanced routing gives 1.0. The
    gradient flows through ``P_e`` only (``f_e`` counts discrete choices).

    Args:
      probs: ``[T, E]`` router probabilities of this device's tokens.
      experts: ``[T, k]`` chosen experts.
      axis_names: inside ``shard_map``, the mesh axes the tokens are split over; the
        counts and sums are ``psum``-ed over them so the value is the whole batch's.

    Example:
      >>> probs = jnp.full((4, 2), 0.5)
      >>> float(load_balancing_loss(probs, jnp.array([[0], [1], [0], [1]])))
      1.0
    """
    num_experts = probs.shape[-1]
    tokens = _global_sum(jnp.asarray(probs.shape[0], jnp.float32), axis_names)
    counts = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=(0, 1))
    fraction = _global_sum(counts, axis_names) / (tokens * experts.shape[-1])
    mean_prob = _global_sum(jnp.sum(probs.astype(jnp.float32), axis=0), axis_names) / tokens
    return num_experts * jnp.sum(jax.lax.stop_gradient(fraction) * mean_prob)


def router_z_loss(logits: jax.Array, *, axis_names: Sequence[str] = ()) -> jax.Array:
    """Router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits) ** 2``.

    Args:
      logits: ``[T, E]`` router logits of this device's tokens.
      axis_names: inside ``shard_map``, the mesh axes the tokens are split over.

    Example:
      >>> float(router_z_loss(jnp.zeros((3, 4))))  # log(4) ** 2
      1.9218120574951172
    """
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    tokens = _global_sum(jnp.asarray(z.shape[0], jnp.float32), axis_names)
    return _global_sum(jnp.sum(z**2), axis_names) / tokens

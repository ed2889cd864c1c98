"""Moving tokens to their experts and back, inside ``shard_map`` over the expert axis.

Each device holds ``T`` tokens and ``E_local = E / ep`` experts. Routing has given every
(choice, token) assignment an expert and a slot (:func:`~jfleet.parallel.moe.routing.assign_slots`);
the exchange returns each assignment's expert output, zeros for dropped assignments.

* :func:`dense_exchange`, the CPU path (and any platform's, when asked): a fixed buffer of
  ``capacity`` slots per expert, ``[E, C, D]``, goes through one ``jax.lax.all_to_all``
  over the expert axis, the experts run on ``[E_local, ep * C, D]``, and one
  ``all_to_all`` brings the results back: two all-to-alls per layer, each moving
  ``E * C * D`` elements per device. Dropless is ``C = T`` (worst-case buffers).
* :func:`ragged_exchange`, the GPU / TPU path: the kept assignments sorted by expert go
  through ``jax.lax.ragged_all_to_all`` (only the rows that exist), the experts run as
  grouped matmuls (``jax.lax.ragged_dot``), and a second ``ragged_all_to_all`` brings them
  back; one small ``all_gather`` of the per-expert counts sets the offsets. Its receive
  buffer is sized for the worst case, ``ep * min(T * min(k, E_local), E_local * C)`` rows.
  XLA:CPU does not implement ``ragged_all_to_all`` (jax#34755), so on CPU this path is
  tested only with an emulated collective (``tests/parallel/test_moe_dispatch.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

from jfleet.parallel.moe.experts import (
    Activation,
    Experts,
    ExpertWeights,
    experts_apply,
    experts_ragged_dot,
)
from jfleet.parallel.moe.routing import Slots

Compute = Literal["einsum", "ragged_dot"]
#: The collective of the ragged path (a module attribute, so a CPU test can emulate it).
RAGGED_ALL_TO_ALL: Callable[..., jax.Array] = jax.lax.ragged_all_to_all


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _ragged_dot_on_buffers(
    h: jax.Array, valid: jax.Array, weights: ExpertWeights, activation: Activation
) -> jax.Array:
    """``experts_ragged_dot`` on fixed buffers ``[E_local, N, D]``: the filled slots of each
    expert sorted to the front, empty slots left out of the groups (they come out zero)."""
    e_local, n, d = h.shape
    expert = jnp.repeat(jnp.arange(e_local, dtype=jnp.int32), n)
    valid = valid.reshape(-1)
    perm = jnp.argsort(jnp.where(valid, expert, e_local), stable=True)
    sizes = jnp.sum(valid.reshape(e_local, n), axis=1, dtype=jnp.int32)
    out = experts_ragged_dot(h.reshape(-1, d)[perm], sizes, weights, activation)
    return jnp.zeros_like(out).at[perm].set(out).reshape(e_local, n, d)


def dense_exchange(
    x: jax.Array,
    slots: Slots,
    capacity: int,
    weights: Experts,
    *,
    axis_name: str,
    compute: Compute = "einsum",
    activation: Activation = jax.nn.silu,
) -> jax.Array:
    """Fixed-buffer dispatch, expert compute and combine; per device, inside ``shard_map``.

    Args:
      x: ``[T, D]`` this device's tokens.
      slots: the ``k * T`` assignments' experts, positions and kept flags.
      capacity: slots per expert ``C``.
      weights: this device's ``E_local`` experts (kernels, or modules:
        :class:`~jfleet.parallel.moe.experts.StackedExperts`).
      axis_name: the expert-parallel mesh axis.
      compute: ``"einsum"`` (batched over the buffers; modules run by ``vmap``) or
        ``"ragged_dot"`` (kernels only) (a grouped
        matmul over the filled slots; a flag column rides with the tokens so the
        receiver knows which slots are filled, one extra element per row).
      activation: the experts' activation.

    Returns:
      ``[k * T, D]`` each assignment's expert output (zeros where dropped).
    """
    tokens, d = x.shape
    num_experts = slots.routed.shape[0]
    ep = num_experts // weights.num_experts
    e_local = num_experts // ep
    index = jnp.where(slots.kept, slots.expert * capacity + slots.position, num_experts * capacity)
    source = x[jnp.arange(index.shape[0]) % tokens]
    if compute == "ragged_dot":
        source = jnp.concatenate([source, jnp.ones((index.shape[0], 1), x.dtype)], axis=-1)
    width = source.shape[-1]
    buffer = jnp.zeros((num_experts * capacity, width), x.dtype)
    buffer = buffer.at[index].set(source, mode="drop", unique_indices=True)
    received = jax.lax.all_to_all(
        buffer.reshape(ep, e_local, capacity, width), axis_name, 0, 0
    )  # [ep source, E_local, C, width]
    h = received.transpose(1, 0, 2, 3).reshape(e_local, ep * capacity, width)
    if compute == "ragged_dot":
        out = _ragged_dot_on_buffers(h[..., :d], h[..., d] > 0, weights, activation)
    else:
        out = experts_apply(h, weights, activation)
    back = out.reshape(e_local, ep, capacity, d).transpose(1, 0, 2, 3)
    returned = jax.lax.all_to_all(back, axis_name, 0, 0).reshape(num_experts * capacity, d)
    return returned.at[index].get(mode="fill", fill_value=0)


def _ragged_plan(counts: jax.Array, axis_name: str, ep: int) -> dict[str, jax.Array]:
    """Offsets and sizes of both ragged all-to-alls from every device's per-expert counts."""
    everyone = jax.lax.all_gather(counts, axis_name)  # [ep source, E]
    e_local = counts.shape[0] // ep
    rows = everyone.reshape(ep, ep, e_local).sum(-1)  # [source, destination]
    me = jax.lax.axis_index(axis_name)
    landing = _exclusive_cumsum(rows, axis=0)  # where a source's rows land on a destination
    leaving = _exclusive_cumsum(rows, axis=1)  # where a source's rows for a destination start
    mine = jax.lax.dynamic_slice_in_dim(everyone, me * e_local, e_local, axis=1)
    return {
        "send_sizes": rows[me],
        "input_offsets": leaving[me],
        "output_offsets": landing[me],
        "recv_sizes": rows[:, me],
        "back_input_offsets": landing[:, me],
        "back_output_offsets": leaving[:, me],
        "received": mine,  # [ep source, E_local] rows this device receives per expert
    }


def _received_experts(received: jax.Array, rows: int) -> jax.Array:
    """The local expert of each received row (``E_local`` past the last one)."""
    ep, e_local = received.shape
    bounds = jnp.cumsum(received.reshape(-1))
    segment = jnp.searchsorted(bounds, jnp.arange(rows), side="right")
    return jnp.where(segment < ep * e_local, segment % e_local, e_local).astype(jnp.int32)


def ragged_exchange(
    x: jax.Array,
    slots: Slots,
    capacity: int,
    weights: ExpertWeights,
    *,
    axis_name: str,
    k: int,
    activation: Activation = jax.nn.silu,
) -> jax.Array:
    """Ragged dispatch, grouped-matmul experts and combine; per device, inside ``shard_map``.

    Needs ``jax.lax.ragged_all_to_all`` (GPU, TPU); the arguments and result are those of
    :func:`dense_exchange`.
    """
    tokens, d = x.shape
    num_experts = slots.routed.shape[0]
    e_local = weights.w_in.shape[0]
    ep = num_experts // e_local
    assignments = slots.expert.shape[0]
    order = jnp.argsort(jnp.where(slots.kept, slots.expert, num_experts), stable=True)
    rows = x[(jnp.arange(assignments) % tokens)[order]]
    counts = jnp.sum(
        jax.nn.one_hot(slots.expert, num_experts, dtype=jnp.int32) * slots.kept[:, None], axis=0
    )
    plan = _ragged_plan(counts, axis_name, ep)
    size = ep * min(tokens * min(k, e_local), e_local * capacity)
    received = RAGGED_ALL_TO_ALL(
        rows,
        jnp.zeros((size, d), x.dtype),
        plan["input_offsets"],
        plan["send_sizes"],
        plan["output_offsets"],
        plan["recv_sizes"],
        axis_name=axis_name,
    )
    perm = jnp.argsort(_received_experts(plan["received"], size), stable=True)
    out = experts_ragged_dot(received[perm], plan["received"].sum(0), weights, activation)
    out = jnp.zeros_like(out).at[perm].set(out)
    back = RAGGED_ALL_TO_ALL(
        out,
        jnp.zeros((assignments, d), x.dtype),
        plan["back_input_offsets"],
        plan["recv_sizes"],
        plan["back_output_offsets"],
        plan["send_sizes"],
        axis_name=axis_name,
    )
    unsorted = jnp.zeros_like(back).at[order].set(back)
    return unsorted * slots.kept[:, None].astype(x.dtype)

"""An expert-parallel mixture-of-experts layer: route, dispatch, run the experts, combine.

:func:`moe` takes global arrays and runs :func:`moe_local` in ``jax.shard_map``: tokens
split over ``token_axes`` (the data axes and the expert axis), expert kernels ``[E, ...]``
split over the expert axis (``E / ep`` experts per device), the router replicated. Per
device: top-k routing, GShard's capacity rule per device's token group, two all-to-alls
(dispatch and combine) over the expert axis, and the weighted sum of each token's expert
outputs. A token whose assignments are all dropped comes out zero from the layer; the
residual around it carries it on. The auxiliary output counts the dropped assignments
and holds the whole batch's load-balancing loss and router z-loss.

Drops depend on how the batch is split: capacity is per device's token group, as in
GShard, Switch and Megatron-Core, so a one-device run of the same rule splits its batch
into the same groups. Dropless (``capacity_factor=None``) does not depend on it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.mesh import topology
from jfleet.parallel.moe import exchange
from jfleet.parallel.moe.experts import (
    Activation,
    Experts,
    ExpertWeights,
    check_expert_weights,
)
from jfleet.parallel.moe.routing import (
    assign_slots,
    check_routing,
    expert_capacity,
    load_balancing_loss,
    route,
    route_logits,
    router_z_loss,
)

#: The expert-parallel mesh axis name (the vocabulary's ``EP``).
EP_AXIS: str = topology.EP
Path = Literal["auto", "dense", "ragged"]
#: Platforms with ``jax.lax.ragged_all_to_all``.
RAGGED_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})


class MoEAux(NamedTuple):
    """What an MoE layer reports besides its output (whole-batch values on every device).

    Attributes:
      load_balancing_loss: Switch / GShard ``E * sum_e f_e * P_e`` (scalar).
      router_z_loss: mean of ``logsumexp(logits) ** 2`` (scalar).
      routed: ``[E]`` int32 top-k assignments per expert.
      dropped: ``[E]`` int32 assignments per expert dropped by the capacity rule;
        ``dropped.sum()`` is the layer's dropped count (0 when dropless).
    """

    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    routed: jax.Array
    dropped: jax.Array


def choose_path(platform: str, path: Path = "auto") -> Literal["dense", "ragged"]:
    """The exchange a platform runs: ``"ragged"`` where ``ragged_all_to_all`` exists.

    Example:
      >>> choose_path("cpu"), choose_path("gpu"), choose_path("gpu", "dense")
      ('dense', 'ragged', 'dense')
    """
    if path not in ("auto", "dense", "ragged"):
        raise ValueError(f"path={path!r} is not an exchange; use 'auto', 'dense' or 'ragged'.")
    if path != "auto":
        return path
    return "ragged" if platform in RAGGED_PLATFORMS else "dense"


def moe_local(
    x: jax.Array,
    router: jax.Array | None,
    weights: Experts,
    *,
    k: int,
    capacity_factor: float | None = None,
    normalize: bool = True,
    axis_name: str = EP_AXIS,
    token_axes: Sequence[str] | None = None,
    path: Literal["dense", "ragged"] = "dense",
    compute: exchange.Compute = "einsum",
    activation: Activation = jax.nn.silu,
    logits: jax.Array | None = None,
    second_draws: jax.Array | None = None,
    groups: int = 1,
) -> tuple[jax.Array, MoEAux]:
    """One device's MoE layer, called inside ``shard_map`` (see :func:`moe`).

    Args:
      x: ``[T, D]`` this device's tokens.
      router: ``[D, E]`` the whole router kernel, or None with ``logits``.
      weights: this device's ``E / ep`` experts (kernels or
        :class:`~jfleet.parallel.moe.experts.StackedExperts`).
      k: experts per token.
      capacity_factor: GShard's factor (``expert_capacity``), or ``None`` for dropless.
      normalize: renormalise the top-k weights to sum to one.
      axis_name: the expert-parallel mesh axis.
      token_axes: every mesh axis the tokens are split over (default ``(axis_name,)``);
        the losses and counts are summed over them.
      path: ``"dense"`` (fixed buffers, ``all_to_all``) or ``"ragged"``.
      compute: the dense path's expert compute, ``"einsum"`` or ``"ragged_dot"``.
      activation: the experts' activation.
      logits: ``[T, E]`` router logits a gate computed, in place of ``router``.
      second_draws: ``[T]`` uniform draws for GShard's random routing: a token's second
        choice is routed only where ``2 * w2 >= draw`` (``w2`` its weight); an unrouted
        choice takes no slot and gives nothing. None: every choice is routed.
      groups: token groups the device's tokens form, each with its own capacity
        (GShard's groups; default one). A one-device run with ``groups`` equal to the
        devices reproduces their drops.

    Returns:
      ``([T, D]`` outputs, :class:`MoEAux`).
    """
    token_axes = (axis_name,) if token_axes is None else tuple(token_axes)
    if logits is None:
        routing = route(x, router, k, normalize=normalize)
    else:
        routing = route_logits(logits, k, normalize=normalize)
    num_experts = routing.probs.shape[-1]
    if groups < 1 or x.shape[0] % groups or (groups > 1 and path == "ragged"):
        raise ValueError(
            f"groups={groups!r} must be a positive int dividing the {x.shape[0]} tokens "
            "(and 1 on the ragged path)."
        )
    capacity = expert_capacity(x.shape[0] // groups, k, num_experts, capacity_factor)
    keep = jnp.ones(routing.experts.shape, bool)
    if second_draws is not None and k > 1:
        keep = keep.at[:, 1].set(2 * routing.weights[:, 1] >= second_draws)
    chosen = jnp.where(keep, routing.experts, num_experts)
    one_group = functools.partial(
        _one_group,
        weights=weights,
        num_experts=num_experts,
        capacity=capacity,
        k=k,
        axis_name=axis_name,
        path=path,
        compute=compute,
        activation=activation,
    )

    if groups == 1:
        y, routed, dropped = one_group(x, chosen, keep, routing.weights)
    else:  # GShard's token groups: each its own capacity (a one-device run of ep devices)
        split = lambda a: a.reshape(groups, -1, *a.shape[1:])  # noqa: E731
        y, routed, dropped = jax.vmap(one_group)(
            split(x), split(chosen), split(keep), split(routing.weights)
        )
        y, routed, dropped = y.reshape(x.shape), routed.sum(0), dropped.sum(0)
    aux = MoEAux(
        load_balancing_loss(routing.probs, routing.experts, axis_names=token_axes),
        router_z_loss(routing.logits, axis_names=token_axes),
        jax.lax.psum(routed, token_axes),
        jax.lax.psum(dropped, token_axes),
    )
    return y.astype(x.dtype), aux


def _one_group(
    x: jax.Array,
    chosen: jax.Array,
    keep: jax.Array,
    weights_k: jax.Array,
    *,
    weights: Experts,
    num_experts: int,
    capacity: int,
    k: int,
    axis_name: str,
    path: str,
    compute: exchange.Compute,
    activation: Activation,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token group's slots, exchange and combine: (outputs, routed, dropped per expert)."""
    slots = assign_slots(chosen, num_experts, capacity)
    # an unrouted assignment (random routing) takes no slot
    slots = slots._replace(
        expert=jnp.minimum(slots.expert, num_experts - 1),
        kept=slots.kept & keep.T.reshape(-1),
    )
    if path == "ragged":
        per_assignment = exchange.ragged_exchange(
            x, slots, capacity, weights, axis_name=axis_name, k=k, activation=activation
        )
    else:
        per_assignment = exchange.dense_exchange(
            x,
            slots,
            capacity,
            weights,
            axis_name=axis_name,
            compute=compute,
            activation=activation,
        )
    combine = weights_k.T.reshape(-1, 1).astype(per_assignment.dtype)
    y = jnp.sum((per_assignment * combine).reshape(k, *x.shape), axis=0)
    return y, slots.routed, jnp.maximum(slots.routed - capacity, 0)


def _check_layout(
    mesh: Mesh,
    x: jax.Array,
    num_experts: int,
    weights: Experts,
    k: int,
    capacity_factor: float | None,
    axis_name: str,
    token_axes: tuple[str, ...],
) -> None:
    """Every ``ValueError`` :func:`moe` raises for arguments that cannot work together."""
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the mesh {tuple(mesh.axis_names)}; "
            "name the expert-parallel axis the mesh has."
        )
    unknown = [a for a in token_axes if a not in mesh.axis_names]
    if unknown or axis_name not in token_axes:
        raise ValueError(
            f"token_axes={token_axes} must be axes of the mesh {tuple(mesh.axis_names)} and "
            f"include the expert axis {axis_name!r}: tokens are split over it."
        )
    check_routing(k, num_experts, capacity_factor)
    check_expert_weights(weights, x.shape[-1])
    ep = mesh.shape[axis_name]
    if weights.num_experts != num_experts or num_experts % ep:
        raise ValueError(
            f"{weights.num_experts} expert kernels and a router over {num_experts} experts "
            f"must agree, and split evenly over {axis_name}={ep}; use a multiple of {ep} "
            "experts or another expert-parallel degree."
        )
    groups = int(np.prod([mesh.shape[a] for a in token_axes]))
    tokens = int(np.prod(x.shape[:-1]))
    if tokens % groups:
        raise ValueError(
            f"{tokens} tokens do not split over the {groups} devices of {token_axes}; "
            f"give a multiple of {groups} tokens."
        )


def _exchange_path(mesh: Mesh, weights: Experts, path: Path, compute: str | None) -> str:
    """The exchange :func:`moe` runs, or a ``ValueError`` for a combination that cannot."""
    if compute not in (None, "einsum", "ragged_dot"):
        raise ValueError(
            f"compute={compute!r} is not an expert compute; use 'einsum' or 'ragged_dot'."
        )
    modules = not isinstance(weights, ExpertWeights)
    if modules and (compute == "ragged_dot" or path == "ragged"):
        raise ValueError(
            f"experts given as modules run on fixed buffers (compute='einsum', path='dense'), "
            f"not compute={compute!r}, path={path!r}; give stacked kernels (ExpertWeights) "
            "for the grouped matmul."
        )
    platform = mesh.devices.flat[0].platform
    dense = path == "auto" and (compute == "einsum" or modules)
    chosen = choose_path(platform, "dense" if dense else path)
    if chosen == "ragged" and compute == "einsum":
        raise ValueError("compute='einsum' needs path='dense'; the ragged path runs ragged_dot.")
    return chosen


def moe(
    x: jax.Array,
    router: jax.Array | None,
    weights: Experts,
    *,
    mesh: Mesh,
    k: int,
    capacity_factor: float | None = None,
    normalize: bool = True,
    axis_name: str = EP_AXIS,
    token_axes: Sequence[str] | None = None,
    path: Path = "auto",
    compute: exchange.Compute | None = None,
    activation: Activation = jax.nn.silu,
    logits: jax.Array | None = None,
    second_draws: jax.Array | None = None,
    groups: int = 1,
) -> tuple[jax.Array, MoEAux]:
    """An expert-parallel MoE layer over global arrays: ``x [..., D] -> [..., D]``.

    Args:
      x: tokens ``[..., D]``; the flattened leading dims are split over ``token_axes``.
      router: ``[D, E]`` router kernel (replicated).
      weights: stacked expert kernels ``[E, ...]``, split over ``axis_name``.
      mesh: the mesh whose axes ``axis_name`` and ``token_axes`` name.
      k: experts per token.
      capacity_factor: per device's ``T`` tokens each expert gets
        ``min(T, ceil(capacity_factor * T * k / E))`` slots (:func:`expert_capacity`);
        ``None`` is dropless (worst-case buffers, ``T`` slots).
      normalize: renormalise the top-k weights (Mixtral, Qwen3) or not (GShard).
      axis_name: the expert-parallel mesh axis.
      token_axes: the mesh axes the tokens are split over (default: every mesh axis).
      path: ``"ragged"`` (``ragged_all_to_all``, GPU / TPU), ``"dense"`` (fixed buffers and
        ``all_to_all``, any platform) or ``"auto"``: ragged where the mesh's devices
        have it. Only the dense path runs on CPU, so only it is tested against one device
        here; the ragged path's bookkeeping is tested on CPU with an emulated collective.
      compute: the dense path's expert compute: ``"einsum"`` (default) or
        ``"ragged_dot"``; the ragged path always uses ``ragged_dot`` (so ``"einsum"``
        with ``path="auto"`` picks the dense path).
      activation: the experts' activation (gated when ``weights.w_gate`` is given;
        experts given as modules apply their own).
      logits: router logits ``[..., E]`` a gate computed (shaped like ``x`` but for the
        last dimension), in place of ``router`` (pass ``router=None``).
      second_draws: ``[...]`` uniform draws a token for GShard's random routing
        (:func:`moe_local`).
      groups: token groups a device's tokens form for the capacity rule
        (:func:`moe_local`).

    Returns:
      ``(y, aux)``: outputs shaped like ``x`` and the :class:`MoEAux`.

    Raises:
      ValueError: ``k`` not in ``1..E``, ``capacity_factor <= 0``, ``E`` not divisible by
        the expert-parallel degree, tokens not divisible by the token groups, or unknown axes.

    Example:
      >>> import numpy as np
      >>> from jax.sharding import Mesh
      >>> mesh = Mesh(np.array(jax.devices()), ("ep",))
      >>> w = ExpertWeights(jnp.ones((8, 4, 6)) * 0.1, jnp.ones((8, 6, 4)) * 0.1)
      >>> x = jnp.ones((16, 4))
      >>> layer = jax.jit(lambda x, r, w: moe(x, r, w, mesh=mesh, k=2))  # one program
      >>> y, aux = layer(x, jnp.zeros((4, 8)), w)
      >>> y.shape, int(aux.dropped.sum()), float(aux.load_balancing_loss)
      ((16, 4), 0, 1.0)
    """
    token_axes = tuple(mesh.axis_names) if token_axes is None else tuple(token_axes)
    if (router is None) == (logits is None):
        raise ValueError("pass the router kernel or the router logits (logits=...), one of them.")
    num_experts = (router if logits is None else logits).shape[-1]
    _check_layout(mesh, x, num_experts, weights, k, capacity_factor, axis_name, token_axes)
    chosen = _exchange_path(mesh, weights, path, compute)
    options = dict(
        k=k,
        capacity_factor=capacity_factor,
        normalize=normalize,
        axis_name=axis_name,
        token_axes=token_axes,
        path=chosen,
        compute=compute or "einsum",
        activation=activation,
        groups=groups,
    )
    return _sharded(mesh, x, router, weights, logits, second_draws, options)


def _sharded(
    mesh: Mesh,
    x: jax.Array,
    router: jax.Array | None,
    weights: Experts,
    logits: jax.Array | None,
    second_draws: jax.Array | None,
    options: dict,
) -> tuple[jax.Array, MoEAux]:
    """:func:`moe_local` in ``shard_map``: tokens (and logits, draws) split over the token
    axes, the experts over the expert axis, the router replicated."""
    tokens = P(options["token_axes"])
    num_experts = (router if logits is None else logits).shape[-1]
    args = [x.reshape(-1, x.shape[-1])]
    args.append(router if logits is None else logits.reshape(-1, num_experts))
    args.append(weights)
    specs = [tokens, P() if logits is None else tokens]
    specs.append(jax.tree.map(lambda _: P(options["axis_name"]), weights))
    if second_draws is not None:
        args.append(second_draws.reshape(-1))
        specs.append(tokens)

    def local(x, routed_by, weights, draws=None):
        if logits is None:
            return moe_local(x, routed_by, weights, second_draws=draws, **options)
        return moe_local(x, None, weights, logits=routed_by, second_draws=draws, **options)

    body = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(specs), out_specs=(tokens, MoEAux(P(), P(), P(), P()))
    )
    y, aux = body(*args)
    return y.reshape(x.shape), aux

"""Paddle's ``MoELayer``: a gate and a list of expert layers, the experts split over an
expert-parallel group and the tokens moved to them by all-to-all.

``paddle.incubate.distributed.models.moe.MoELayer`` (also
``jfleet.incubate.distributed.models.moe.MoELayer``) with Paddle's arguments, run by
:func:`jfleet.parallel.moe.layer.moe` in ``shard_map``. What differs from Paddle, and why:

* ``experts`` is every expert of the layer (one program runs on every device): with
  ``ep`` ranks each holds ``len(experts) / ep`` of them. A Paddle script builds each rank's
  own experts and its gate routes over ``len(experts) * world_size``; port its loop as
  ``range(num_experts * ep_degree)``.
* The experts must be alike (one class and shapes): their parameters are stacked on an
  expert axis (the block stacker, :func:`jfleet.parallel.stack.stack_layers`) split over
  the group, and run on fixed buffers by ``vmap`` (``layer.experts`` is that stacked
  module, not a list).
* ``moe_group`` is a mesh axis's group (default: the fleet's expert-parallel group,
  ``hcg.get_expert_parallel_group()``; the data-parallel group works too, as Paddle's
  examples use it). ``mp_group`` (the fleet's model-parallel group) splits the tokens over
  ``mp`` as well, as Paddle's does; None routes the tokens each ``mp`` rank holds.
* The gates' fixes (combine weights are probabilities, GShard's capacity rule, Switch's
  loss) are :mod:`jfleet.parallel.moe.gates`'. Dropped assignments are counted:
  :attr:`MoELayer.dropped` and :func:`moe_stats`.
* ``recompute_interval > 0`` recomputes the layer in the backward pass
  (``jax.checkpoint``); ``recompute_ctx`` is accepted and not needed (logged once).
* In a pipeline (blocks holding an ``MoELayer`` stacked by ``PipelineLayer``) the layer
  runs inside the stage's ``shard_map``, already manual over ``pp`` and the data axes: it
  calls :func:`~jfleet.parallel.moe.layer.moe_local` on its ``E / ep`` experts (the stage's
  expert kernels arrive split over ``ep``). Its gate loss and counts are seen only inside
  the block right after the call (a block returns the loss with its activation); the
  stacked body keeps neither (``docs/moe.md``, "MoE in a pipeline"). For the whole
  batch's load-balancing loss a block carries
  :class:`~jfleet.parallel.moe.load_stats.LoadStats` instead (``layer(x,
  load_stats=stats)``), which the FThenB schedule sums over the micro-batches.

Example:
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> strategy = fleet.DistributedStrategy()
  >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
  >>> experts = [nnx.Linear(8, 8, rngs=nnx.Rngs(i)) for i in range(4)]
  >>> layer = MoELayer(8, experts, gate={"type": "gshard", "top_k": 2}, rngs=nnx.Rngs(0))
  >>> call = nnx.jit(lambda m, x: m(x))  # one program (eagerly, each op runs on its own)
  >>> call(layer, jnp.ones((2, 4, 8))).shape, layer.gate.get_loss().shape
  ((2, 4, 8), ())
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jfleet.mesh.group_collective import manual_axes
from jfleet.mesh.layer_mesh import layer_mesh
from jfleet.mesh.topology import DATA_AXES, MP
from jfleet.parallel.moe.experts import StackedExperts
from jfleet.parallel.moe.gates import BaseGate, GShardGate, NaiveGate, SwitchGate
from jfleet.parallel.moe.layer import EP_AXIS, MoEAux, moe, moe_local
from jfleet.parallel.moe.load_stats import LoadStats, row_stats
from jfleet.parallel.stack import CallOutput, stack_layers
from jfleet.runtime.log import logger

__all__ = ["MoELayer", "MoEStat", "moe_stats"]

_GATES = {"naive": NaiveGate, "gshard": GShardGate, "switch": SwitchGate}


class MoEStat(CallOutput):
    """What an MoE layer's last call counted (state, not a parameter; not kept by a
    pipelined body, see :func:`moe_stats`)."""


class MoELayer(nnx.Module):
    """A mixture-of-experts layer with Paddle's signature.

    Args:
      d_model: token width.
      experts: every expert (alike modules mapping ``[..., d_model]`` to the same shape).
      gate: ``{"type": "gshard" | "switch" | "naive", "top_k": k}`` (default: gshard,
        top 2), with the gate's own settings beside them if wanted (``capacity``,
        ``random_routing``, ``switch_eps``: jfleet's additions), or a gate built from
        :mod:`jfleet.parallel.moe.gates`.
      moe_group: the group whose mesh axis holds the experts (default: the fleet's
        expert-parallel group).
      mp_group: the fleet's model-parallel group to split the tokens over ``mp`` too, or
        None.
      recompute_interval: > 0 recomputes the layer in the backward pass.
      recompute_ctx: accepted for Paddle (not needed).
      z_loss_coef: weight of the router z-loss added to the gate's loss (0: none).
      groups: token groups each device's tokens form for the capacity rule (GShard's
        groups): a run on one device with ``groups`` equal to the data-parallel devices of
        another run drops what that run drops.
      mesh: the mesh (default: the fleet's, as it is when the layer runs: a model
        ``to_distributed`` re-plans runs on the plan's mesh).
      rngs: the gate's parameter (and noise) keys, when ``gate`` is a dict.

    Raises:
      ValueError: no experts, unlike experts, a gate type or ``top_k`` that cannot work,
        a gate over another number of experts, a group that is not one mesh axis, or
        experts that do not split evenly over it.

    Example:
      >>> from flax import nnx
      >>> from jfleet import fleet
      >>> strategy = fleet.DistributedStrategy()
      >>> strategy.hybrid_configs = {"dp_degree": 2, "ep_degree": 4}
      >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
      >>> experts = [nnx.Linear(8, 8, rngs=nnx.Rngs(i)) for i in range(8)]
      >>> layer = MoELayer(8, experts, gate={"type": "switch"}, rngs=nnx.Rngs(0))
      >>> kernel = layer.experts.kernel  # 8 experts stacked, split over ep: 2 a device
      >>> kernel.shape, kernel.get_metadata()["out_sharding"]
      ((1, 8, 8, 8), (None, 'ep'))
    """

    def __init__(
        self,
        d_model: int,
        experts: Sequence[nnx.Module],
        gate: dict | BaseGate | None = None,
        moe_group: Any = None,
        mp_group: Any = None,
        recompute_interval: int = 0,
        recompute_ctx: Any = None,
        *,
        z_loss_coef: float = 0.0,
        groups: int = 1,
        mesh: Mesh | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        experts = list(experts)
        if not experts:
            raise ValueError("MoELayer: experts is empty; pass the layer's expert modules.")
        for name, value in (("d_model", d_model), ("groups", groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoELayer: {name}={value!r} must be a positive int.")
        if isinstance(recompute_interval, bool) or not isinstance(recompute_interval, int):
            raise ValueError(
                f"MoELayer: recompute_interval={recompute_interval!r} must be an int "
                "(0: no recompute)."
            )
        self.mesh = layer_mesh(mesh)  # the fleet's, read again at each call unless given
        self.own_mesh = mesh is not None
        self.groups = groups
        self.axis_name = _group_axis(moe_group, "moe_group", default=EP_AXIS, mesh=self.mesh)
        mp_axis = _group_axis(mp_group, "mp_group", default=MP, mesh=self.mesh)
        if mp_group is not None and mp_axis != MP:
            raise ValueError(
                f"MoELayer: mp_group={mp_group!r} is not the fleet's model-parallel group."
            )
        ep = self.mesh.shape.get(self.axis_name, 1)
        if len(experts) % ep:
            raise ValueError(
                f"MoELayer: {len(experts)} experts do not split over {self.axis_name}={ep}; "
                f"give a multiple of {ep} experts (every rank's: jfleet runs one program)."
            )
        self.d_model = d_model
        self.num_expert = len(experts)
        self.gate = _build_gate(gate, d_model, len(experts), ep, rngs)
        self.top_k = self.gate.top_k
        self.experts = _stack_experts(experts, self.axis_name, self.mesh)
        self.token_axes = tuple(a for a in (*DATA_AXES, *((MP,) if mp_group else ())))
        if self.axis_name not in self.token_axes:
            self.token_axes = (*self.token_axes, self.axis_name)
        self.recompute_interval = recompute_interval
        if recompute_ctx is not None:
            logger.info("MoELayer: recompute_ctx means nothing under SPMD and is ignored")
        self.z_loss_coef = float(z_loss_coef)
        zero = jnp.zeros((self.num_expert,), jnp.int32)
        self.dropped = MoEStat(zero)
        self.routed = MoEStat(zero)

    def __call__(
        self, inp: jax.Array, *, load_stats: LoadStats | None = None
    ) -> jax.Array | tuple[jax.Array, LoadStats]:
        """``inp [..., d_model]`` through the gate and the experts; same shape out.

        The gate's loss (:meth:`BaseGate.get_loss`) and the dropped / routed assignments
        per expert (:attr:`dropped`, :attr:`routed`) are this call's afterwards.

        With ``load_stats`` (:class:`~jfleet.parallel.moe.load_stats.LoadStats`, rows
        first like ``inp``) the call returns ``(output, load_stats)`` with this layer's
        router statistics pushed in: carried with the activation, their
        :meth:`~jfleet.parallel.moe.load_stats.LoadStats.loss` is the gate's loss over
        the whole batch, also in a pipeline (``schedule="FThenB"``).
        """
        if inp.shape[-1] != self.d_model:
            raise ValueError(
                f"MoELayer: input of shape {inp.shape} does not end in d_model={self.d_model}."
            )
        mesh = self.mesh if self.own_mesh else layer_mesh()  # to_distributed re-plans it
        training = not self.gate.deterministic
        logits = self.gate(inp)
        draws = self.gate.random_draws(inp.shape[:-1])
        graphdef, params = nnx.split(self.experts)
        params = jax.tree.map(lambda a: a.reshape(a.shape[1:]), params)  # [1, E, ...] -> [E, ...]
        run = functools.partial(
            _run,
            graphdef=graphdef,
            mesh=mesh,
            k=self.top_k,
            capacity_factor=self.gate.capacity_factor(training),
            normalize=self.gate.normalize,
            axis_name=self.axis_name,
            token_axes=self.token_axes,
            groups=self.groups,
        )
        if self.recompute_interval > 0:
            run = jax.checkpoint(run)
        y, aux = run(inp, logits, params, draws)
        self.gate.record(aux)
        if self.gate.has_loss and self.z_loss_coef:
            self.gate.set_loss(self.gate.loss[...] + self.z_loss_coef * aux.router_z_loss)
        self.dropped[...] = aux.dropped
        self.routed[...] = aux.routed
        if load_stats is None:
            return y
        z_coef = self.z_loss_coef if self.gate.has_loss else 0.0
        mine = row_stats(logits, self.top_k, self.gate.balance_scale, z_coef)
        return y, load_stats.push(mine)


def _run(
    x: jax.Array,
    logits: jax.Array,
    params: Any,
    draws: jax.Array | None,
    *,
    graphdef: Any,
    **kwargs: Any,
) -> tuple[jax.Array, MoEAux]:
    experts = StackedExperts(graphdef, params)
    if manual_axes():  # inside a shard_map (a pipeline stage): this device's experts
        return _run_local(x, logits, experts, draws, **kwargs)
    return moe(x, None, experts, logits=logits, second_draws=draws, **kwargs)


def _run_local(
    x: jax.Array,
    logits: jax.Array,
    experts: StackedExperts,
    draws: jax.Array | None,
    *,
    mesh: Mesh,
    axis_name: str,
    token_axes: tuple[str, ...],
    **kwargs: Any,
) -> tuple[jax.Array, MoEAux]:
    """:func:`~jfleet.parallel.moe.layer.moe_local` on this device's tokens and experts,
    inside a ``shard_map`` already manual over the expert axis and the token axes (a
    pipeline stage, manual over ``pp`` and the data axes ``dp``, ``sharding``, ``ep``)."""
    manual = set(manual_axes())
    context = jax.sharding.get_abstract_mesh()
    missing = [a for a in token_axes if a not in manual and context.shape.get(a, 1) > 1]
    if axis_name not in manual or missing:
        raise ValueError(
            f"MoELayer runs inside a shard_map manual over {sorted(manual)}; it splits its "
            f"experts over {axis_name!r} and its tokens over {token_axes}, which must all be "
            f"manual there ({[axis_name, *missing]} are not): run it in a pipeline stage "
            "(manual over pp and the data axes) without mp_group, or outside shard_map."
        )
    ep = context.shape[axis_name]
    local, total = experts.num_experts, logits.shape[-1]
    if local * ep != total:
        raise ValueError(
            f"MoELayer: this device holds {local} expert(s) of {total} over "
            f"{axis_name}={ep}; inside a shard_map each needs its {total // ep} (the expert "
            f"kernels passed split over {axis_name!r}, as PipelineLayer passes them)."
        )
    d = x.shape[-1]
    y, aux = moe_local(
        x.reshape(-1, d),
        None,
        experts,
        logits=logits.reshape(-1, total),
        second_draws=None if draws is None else draws.reshape(-1),
        axis_name=axis_name,
        token_axes=tuple(a for a in token_axes if a in manual),
        **kwargs,
    )
    return y.reshape(x.shape), aux


def _group_axis(group: Any, what: str, *, default: str, mesh: Mesh) -> str:
    """The one mesh axis a Paddle group spans (its other axes of size 1): a hybrid-group
    getter's group, or ``dist.new_group(ranks)``'s."""
    if group is None:
        return default
    axis = getattr(group, "axis_name", None)
    axes = (axis,) if isinstance(axis, str) else tuple(axis) if isinstance(axis, tuple) else ()
    spanned = [a for a in axes if mesh.shape.get(a, 1) > 1] or list(axes[:1])
    if len(spanned) != 1:
        raise ValueError(
            f"MoELayer: {what}={group!r} spans the mesh axes {axes}; the experts go over one "
            "axis: pass hcg.get_expert_parallel_group() (or another one-axis group) or None."
        )
    return spanned[0]


def _build_gate(
    gate: dict | BaseGate | None, d_model: int, num_experts: int, ep: int, rngs: nnx.Rngs | None
) -> BaseGate:
    """The gate a Paddle ``gate`` argument names, over ``num_experts`` experts."""
    if isinstance(gate, BaseGate):
        if getattr(gate, "tot_expert", None) != num_experts:
            raise ValueError(
                f"MoELayer: the gate routes over {gate.tot_expert} experts but there are "
                f"{num_experts}; build it with num_expert * world_size = {num_experts}."
            )
        return gate
    if gate is not None and not isinstance(gate, dict):
        raise TypeError(f"MoELayer: gate={gate!r} must be a dict (type, top_k), a gate or None.")
    config = dict(gate or {})
    kind = config.pop("type", "gshard") or "naive"
    if kind not in _GATES:
        raise ValueError(f"MoELayer: gate type {kind!r} is not one of {sorted(_GATES)}.")
    top_k = config.pop("top_k", 1 if kind == "switch" else 2)
    allowed = {"naive": set(), "gshard": {"capacity", "random_routing"}}.get(
        kind, {"capacity", "switch_eps"}
    )
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ValueError(
            f"MoELayer: gate={gate!r}: {unknown} are not settings of a {kind!r} gate; it "
            f"takes 'type', 'top_k' (Paddle's) and {sorted(allowed)}."
        )
    if rngs is None:
        raise ValueError("MoELayer: pass rngs=nnx.Rngs(...) to build the gate's parameters.")
    return _GATES[kind](d_model, num_experts // ep, ep, top_k, rngs=rngs, **config)


def _stack_experts(experts: list[nnx.Module], axis: str, mesh: Mesh) -> nnx.Module:
    """The experts' parameters stacked ``[1, E, ...]``, split over ``axis`` on the expert
    dimension (their own tensor-parallel split kept behind it)."""
    stacked = stack_layers(experts, 1, "expert")
    for _, param in nnx.iter_graph(stacked):
        if isinstance(param, nnx.Param):
            inner = tuple(param.get_metadata().get("out_sharding") or ())[2:]
            param.set_metadata(out_sharding=(None, axis, *inner), mesh=mesh)
    return stacked


def moe_stats(model: nnx.Module) -> dict[str, jax.Array]:
    """Every :class:`MoELayer`'s last call in ``model``, summed: ``dropped`` and ``routed``
    assignments, for a loss function's aux output or a log line.

    Example:
      >>> from flax import nnx
      >>> from jfleet import fleet
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> experts = [nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(2)]
      >>> layer = MoELayer(4, experts, gate={"type": "naive", "top_k": 1}, rngs=nnx.Rngs(0))
      >>> _ = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((8, 4)))  # the counts leave jit too
      >>> {k: int(v) for k, v in moe_stats(layer).items()}
      {'dropped': 0, 'routed': 8}
    """
    layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"moe_stats: {type(model).__name__} holds no MoELayer.")
    stacked = [m for m in layers if m.routed.ndim > 1]
    if stacked:
        raise ValueError(
            f"moe_stats: {type(model).__name__} holds MoELayers stacked in a pipelined body "
            f"(counts of shape {stacked[0].routed.shape}); a pipeline keeps no counts of its "
            "layers' calls. Return layer.routed / layer.dropped from the block with its "
            "activation if you need them, or count without the pipeline."
        )
    return {
        "dropped": sum(jnp.sum(m.dropped[...]) for m in layers),
        "routed": sum(jnp.sum(m.routed[...]) for m in layers),
    }

"""Mixture of experts over an expert-parallel mesh axis: routing, dispatch, experts, combine.

``routing`` is the router's math (top-k, GShard's capacity rule and drop order, the
load-balancing loss and router z-loss over the whole batch; ``load_stats`` their sums per
row, for a pipeline to add over micro-batches); ``experts`` the stacked expert
kernels and their compute (batched einsum or ``ragged_dot``); ``exchange`` moves tokens to
their experts and back inside ``shard_map`` (fixed-buffer ``all_to_all`` on every platform,
``ragged_all_to_all`` on GPU / TPU); ``layer`` is the layer: :func:`moe` over global
arrays, :func:`moe_local` inside a caller's own ``shard_map``; ``gates`` and ``moe_layer``
are Paddle's ``MoELayer`` and gates on top of it (imported by Paddle's path from
``jfleet.incubate.distributed.models.moe``).

May import: runtime, mesh, optim.
"""

from jfleet.parallel.moe.experts import (
    ExpertWeights,
    StackedExperts,
    experts_apply,
    experts_einsum,
    experts_ragged_dot,
)
from jfleet.parallel.moe.gates import BaseGate, GShardGate, NaiveGate, SwitchGate
from jfleet.parallel.moe.layer import EP_AXIS, MoEAux, choose_path, moe, moe_local
from jfleet.parallel.moe.load_stats import LoadStats, row_stats
from jfleet.parallel.moe.moe_layer import MoELayer, MoEStat, moe_stats
from jfleet.parallel.moe.routing import (
    Routing,
    Slots,
    assign_slots,
    expert_capacity,
    load_balancing_loss,
    route,
    route_logits,
    router_z_loss,
)

__all__ = [
    "EP_AXIS",
    "BaseGate",
    "ExpertWeights",
    "GShardGate",
    "LoadStats",
    "MoEAux",
    "MoELayer",
    "MoEStat",
    "NaiveGate",
    "Routing",
    "Slots",
    "StackedExperts",
    "SwitchGate",
    "assign_slots",
    "choose_path",
    "expert_capacity",
    "experts_apply",
    "experts_einsum",
    "experts_ragged_dot",
    "load_balancing_loss",
    "moe",
    "moe_local",
    "moe_stats",
    "route",
    "route_logits",
    "router_z_loss",
    "row_stats",
]

"""Paddle's ``fleet.utils.hybrid_parallel_util``: the hand-written synchronisation of
eager hybrid parallelism, and what it becomes under SPMD.

Paddle keeps one copy of each parameter per rank and keeps the copies equal by hand:
it broadcasts parameters from a source rank at start-up and all-reduces gradients after
each backward pass. In jfleet a parameter is one global ``jax.Array``: replicas cannot
diverge, and the gradient of a global loss with respect to a replicated parameter is
already the sum over the data-parallel batch split (the compiler inserts that
all-reduce, or a reduce-scatter under ZeRO). So the broadcasts and gradient reductions
here have nothing to do: each returns at once and logs, once, that it is a no-op.
:func:`unwrap_optimizer` keeps its meaning.

Example:
  >>> fused_allreduce_gradients([], None)  # nothing to do: gradients are global
"""

from __future__ import annotations

from typing import Any

from jfleet.fleet._noop import log_noop
from jfleet.mesh.hybrid_group import HybridCommunicateGroup
from jfleet.mesh.topology import Group
from jfleet.training.distributed_optimizer import DistributedOptimizer

__all__ = [
    "broadcast_dp_parameters",
    "broadcast_mp_parameters",
    "broadcast_sep_parameters",
    "broadcast_sharding_parameters",
    "fused_allreduce_gradients",
    "fused_allreduce_gradients_with_group",
    "sharding_reduce_gradients",
    "unwrap_optimizer",
]

_GRADS = (
    "the gradient of a global loss with respect to a global parameter is already reduced "
    "over every data-parallel rank by the compiled step"
)
_PARAMS = "a parameter is one global array, so its replicas are equal by construction"


def _check_hcg(hcg: Any, fn: str) -> None:
    if hcg is not None and not isinstance(hcg, HybridCommunicateGroup):
        raise TypeError(
            f"{fn}: hcg={hcg!r} ({type(hcg).__name__}) is not a HybridCommunicateGroup; pass "
            "fleet.get_hybrid_communicate_group()."
        )


def fused_allreduce_gradients(parameter_list: Any, hcg: HybridCommunicateGroup | None) -> None:
    """No-op: gradients are already summed over data parallel (logged once).

    Raises:
      TypeError: ``hcg`` is neither None nor a HybridCommunicateGroup.
    """
    _check_hcg(hcg, "fused_allreduce_gradients")
    log_noop("fused_allreduce_gradients", _GRADS)


def fused_allreduce_gradients_with_group(
    parameter_list: Any, group: Group | None, bucket_size: int = 128 * 1024 * 1024, scale=None
) -> None:
    """No-op: gradients are already summed over the group's axes (logged once).

    Raises:
      TypeError: ``group`` is neither None nor a Group.
    """
    if group is not None and not isinstance(group, Group):
        raise TypeError(
            f"fused_allreduce_gradients_with_group: group={group!r} ({type(group).__name__}) "
            "is not a Group; pass one from fleet.get_hybrid_communicate_group()."
        )
    log_noop("fused_allreduce_gradients_with_group", _GRADS)


def sharding_reduce_gradients(parameter_list: Any, hcg: HybridCommunicateGroup | None) -> None:
    """No-op: ZeRO's gradient reduce-scatter is in the compiled step (logged once)."""
    _check_hcg(hcg, "sharding_reduce_gradients")
    log_noop("sharding_reduce_gradients", _GRADS)


def _broadcast(name: str, model: Any, hcg: Any) -> None:
    _check_hcg(hcg, name)
    log_noop(name, _PARAMS)


def broadcast_dp_parameters(model: Any, hcg: HybridCommunicateGroup | None) -> None:
    """No-op: data-parallel replicas of a global parameter are one value (logged once)."""
    _broadcast("broadcast_dp_parameters", model, hcg)


def broadcast_mp_parameters(model: Any, hcg: HybridCommunicateGroup | None) -> None:
    """No-op: a parameter replicated over mp is one value (logged once)."""
    _broadcast("broadcast_mp_parameters", model, hcg)


def broadcast_sharding_parameters(model: Any, hcg: HybridCommunicateGroup | None) -> None:
    """No-op: sharding replicas of a global parameter are one value (logged once)."""
    _broadcast("broadcast_sharding_parameters", model, hcg)


def broadcast_sep_parameters(model: Any, hcg: HybridCommunicateGroup | None) -> None:
    """No-op: segment-parallel replicas of a global parameter are one value (logged once)."""
    _broadcast("broadcast_sep_parameters", model, hcg)


def unwrap_optimizer(optimizer: Any, optimizer_instances: type | tuple[type, ...] = ()) -> Any:
    """Peels wrappers of the given classes off ``optimizer`` (Paddle's rule), via ``_inner_opt``.

    While ``optimizer`` is an instance of ``optimizer_instances`` it is replaced by its
    ``_inner_opt``. jfleet's ``DistributedOptimizer`` is returned as it is: the one
    object stands for Paddle's whole stack (``HybridParallelOptimizer`` around
    ``DygraphShardingOptimizer`` ...), and ``isinstance`` against the
    :mod:`jfleet.fleet.meta_optimizers` classes answers for each layer of it.

    Raises:
      TypeError: ``optimizer_instances`` is not a class or a tuple of classes.

    Example:
      >>> import optax
      >>> tx = optax.sgd(0.1)
      >>> unwrap_optimizer(tx) is tx
      True
    """
    kinds = optimizer_instances
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not all(isinstance(k, type) for k in kinds):
        raise TypeError(
            f"unwrap_optimizer: optimizer_instances={optimizer_instances!r} must be a class or "
            "a tuple of classes, e.g. (HybridParallelOptimizer, DygraphShardingOptimizer)."
        )
    while (
        kinds
        and isinstance(optimizer, kinds)
        and not isinstance(optimizer, DistributedOptimizer)
        and getattr(optimizer, "_inner_opt", None) is not None
    ):
        optimizer = optimizer._inner_opt
    return optimizer

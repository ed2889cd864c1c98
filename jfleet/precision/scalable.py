"""What the precision tools need of an optimizer, stated as a protocol.

``GradScaler`` attaches loss scaling to an optimizer and ``amp.decorate`` adds fp32 master
weights to one. Both work on jfleet's ``DistributedOptimizer`` (``fleet.distributed_optimizer``),
which sits in the layer above (``jfleet.training``); this layer names only the methods it
calls, so it never imports that class.

Example:
  >>> import optax
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True)
  >>> isinstance(fleet.distributed_optimizer(optax.sgd(0.1)), ScalableOptimizer)
  True
  >>> isinstance(optax.sgd(0.1), ScalableOptimizer)
  False
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ScalableOptimizer(Protocol):
    """An optimizer that takes loss scaling and master weights (``DistributedOptimizer``).

    Only methods that identify the kind are listed (``init`` / ``step`` also exist, but an
    ``nnx.Optimizer`` has them as well, and ``step`` is its step-count variable).
    """

    def minimize(self, loss_fn: Callable[..., Any], model: Any, batch: Any) -> Any:
        """One step on ``batch``; returns the loss."""

    def when_bound(self, name: str, write: Callable[[Any], None]) -> None:
        """Runs ``write`` once the optimizer has state (now, if it has)."""

    def attach_loss_scaling(self, config: Mapping[str, Any]) -> None:
        """Adds dynamic loss scaling with ``config`` to the update."""

    def add_master_weights(self) -> None:
        """Keeps fp32 master weights for half-precision parameters."""

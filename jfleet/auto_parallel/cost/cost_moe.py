"""What an MoE layer's token exchange costs: the all-to-all buffers and their time.

jfleet's MoE layer (:func:`jfleet.parallel.moe.layer.moe`, Paddle's ``MoELayer``) sends each
device's tokens to their experts in a fixed buffer of ``E x C x D`` elements (``C`` slots an
expert: GShard's capacity for the device's ``T`` tokens, or ``T`` when dropless) through one
all-to-all over the expert axis, and the experts' outputs back through a second of the same
size; the backward pass runs the two again with the cotangents. Each device keeps ``1 /
ep`` of a buffer and sends the rest over the links the ``ep`` group spans
(:meth:`~jfleet.auto_parallel.cost.step_shape.StepShape.bandwidth`,
:func:`~jfleet.auto_parallel.cost.step_shape.group_bandwidth`). The ragged path (GPU, TPU)
sends only the routed rows: ``T * k`` of them when no expert overflows, the load-balanced
case; ``imbalance`` scales that for a skewed router.

Example:
  >>> moe_exchange_bytes(tokens=64, width=16, k=2, experts=8, capacity_factor=None)
  32768
  >>> moe_exchange_bytes(tokens=64, width=16, k=2, experts=8, capacity_factor=1.0)
  8192
"""

from __future__ import annotations

import dataclasses

from jfleet.auto_parallel.cost.step_shape import ring_bytes
from jfleet.parallel.moe.routing import expert_capacity

__all__ = ["MoEExchange", "moe_exchange", "moe_exchange_bytes"]


def moe_exchange_bytes(
    *,
    tokens: int,
    width: int,
    k: int,
    experts: int,
    capacity_factor: float | None,
    act_bytes: int = 4,
    groups: int = 1,
    ragged: bool = False,
    imbalance: float = 1.0,
) -> int:
    """Bytes of one all-to-all buffer of an MoE layer on one device (the dispatch; the
    combine moves as many): ``E x C x D`` elements on the fixed-buffer path, ``T x k x D``
    routed rows (times ``imbalance``) on the ragged path.

    Args:
      tokens: the device's tokens ``T`` (``groups`` groups of ``T / groups``).
      width: the token width ``D``.
      k: experts a token takes.
      experts: ``E``.
      capacity_factor: GShard's factor, or None for dropless (``C = T / groups``).
      act_bytes: bytes an element.
      groups: token groups, each with its own capacity.
      ragged: the ragged path (only routed rows move).
      imbalance: the ragged path's load-imbalance factor (1: balanced).
    """
    if ragged:
        return int(tokens * k * width * act_bytes * imbalance)
    per_group = tokens // groups
    capacity = expert_capacity(per_group, k, experts, capacity_factor)
    return groups * experts * capacity * width * act_bytes


@dataclasses.dataclass(frozen=True)
class MoEExchange:
    """An MoE layer's all-to-alls in one training step, per device.

    Attributes:
      count: all-to-alls (dispatch and combine, forward and backward: 4).
      buffer_bytes: bytes of each buffer.
      wire_bytes: bytes each device sends in all of them (``(ep - 1) / ep`` of each).
      seconds: their time at ``bandwidth`` with ``latency`` each.
    """

    count: int
    buffer_bytes: int
    wire_bytes: float
    seconds: float


def moe_exchange(
    buffer_bytes: int, ep: int, bandwidth: float, latency: float = 0.0, *, backward: bool = True
) -> MoEExchange:
    """The step's MoE all-to-alls of one layer: two forward, two more in the backward pass.

    Example:
      >>> x = moe_exchange(8192, ep=4, bandwidth=1e9)
      >>> x.count, x.wire_bytes
      (4, 24576.0)
    """
    count = 4 if backward else 2
    wire = count * ring_bytes("all-to-all", buffer_bytes, ep)
    return MoEExchange(
        count, buffer_bytes, wire, count * latency + wire / bandwidth if ep > 1 else 0.0
    )

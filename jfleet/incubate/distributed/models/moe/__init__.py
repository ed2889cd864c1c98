"""``paddle.incubate.distributed.models.moe``: ``MoELayer`` and its gates.

Paddle's import path for :class:`jfleet.parallel.moe.moe_layer.MoELayer` (what differs from
Paddle is listed there) and, in :mod:`.gate`, the gates of :mod:`jfleet.parallel.moe.gates`.

Example:
  >>> from jfleet.incubate.distributed.models.moe import MoELayer
  >>> from jfleet.incubate.distributed.models.moe.gate import GShardGate
  >>> GShardGate.__name__
  'GShardGate'
"""

from __future__ import annotations

from jfleet.incubate.distributed.models.moe import gate as gate
from jfleet.parallel.moe.moe_layer import MoELayer as MoELayer

__all__ = ["MoELayer", "gate"]

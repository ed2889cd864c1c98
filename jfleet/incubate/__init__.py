"""Paddle's ``paddle.incubate`` names that jfleet has: ``jfleet.incubate.distributed.models.moe``.

The facade layer beside ``distributed`` (Paddle keeps its MoE layer under
``paddle.incubate.distributed.models.moe``); the layer itself is
:mod:`jfleet.parallel.moe`.

May import: runtime, mesh, optim, parallel, models, precision, training, auto_parallel,
checkpoint, launch, ps, fleet.

Example:
  >>> from jfleet.incubate.distributed.models.moe import MoELayer
  >>> MoELayer.__module__
  'jfleet.parallel.moe.moe_layer'
"""

from __future__ import annotations

from jfleet.incubate import distributed as distributed

__all__ = ["distributed"]

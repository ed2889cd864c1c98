"""Paddle's ``paddle.distributed.fleet.base`` package: here only its ``topology`` module.

Example:
  >>> from jfleet.fleet.base import topology
  >>> topology.ParallelMode.TENSOR_PARALLEL.value
  1
"""

from jfleet.fleet.base import topology as topology

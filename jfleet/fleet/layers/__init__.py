"""Paddle's ``paddle.distributed.fleet.layers``: the tensor-parallel building blocks (``mpu``).

Example:
  >>> from jfleet.fleet.layers import mpu
  >>> mpu.ColumnParallelLinear.__name__
  'ColumnParallelLinear'
"""

from jfleet.fleet.layers import mpu as mpu

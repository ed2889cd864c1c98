"""Paddle's ``fleet.layers.mpu.mp_layers``: the tensor-parallel layers of :mod:`jfleet.parallel`.

Example:
  >>> from jfleet.fleet.layers.mpu.mp_layers import ColumnParallelLinear
  >>> from jfleet.fleet import meta_parallel
  >>> ColumnParallelLinear is meta_parallel.ColumnParallelLinear
  True
"""

from jfleet.parallel.cross_entropy import ParallelCrossEntropy as ParallelCrossEntropy
from jfleet.parallel.layers import ColumnParallelLinear as ColumnParallelLinear
from jfleet.parallel.layers import RowParallelLinear as RowParallelLinear
from jfleet.parallel.layers import VocabParallelEmbedding as VocabParallelEmbedding

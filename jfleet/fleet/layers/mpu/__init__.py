"""Paddle's ``fleet.layers.mpu``: tensor-parallel layers, their ops and RNG streams.

The layers are :mod:`jfleet.parallel`'s (also under ``fleet.meta_parallel``); the ops
are in :mod:`~jfleet.fleet.layers.mpu.mp_ops`.

Example:
  >>> from jfleet.fleet.layers.mpu import mp_layers, mp_ops, random
  >>> mp_layers.RowParallelLinear.__name__, mp_ops._c_identity.__name__
  ('RowParallelLinear', '_c_identity')
"""

from jfleet.fleet.layers.mpu import mp_layers as mp_layers
from jfleet.fleet.layers.mpu import mp_ops as mp_ops
from jfleet.fleet.layers.mpu import random as random
from jfleet.fleet.layers.mpu.mp_layers import ColumnParallelLinear as ColumnParallelLinear
from jfleet.fleet.layers.mpu.mp_layers import ParallelCrossEntropy as ParallelCrossEntropy
from jfleet.fleet.layers.mpu.mp_layers import RowParallelLinear as RowParallelLinear
from jfleet.fleet.layers.mpu.mp_layers import VocabParallelEmbedding as VocabParallelEmbedding
from jfleet.fleet.layers.mpu.random import RNGStatesTracker as RNGStatesTracker
from jfleet.fleet.layers.mpu.random import get_rng_state_tracker as get_rng_state_tracker
from jfleet.fleet.layers.mpu.random import (
    model_parallel_random_seed as model_parallel_random_seed,
)

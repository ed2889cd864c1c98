"""Paddle's ``fleet.layers.mpu.random``: the model-parallel RNG streams of jfleet.parallel.random.

Example:
  >>> from jfleet.fleet.layers.mpu.random import get_rng_state_tracker
  >>> type(get_rng_state_tracker()).__name__
  'RNGStatesTracker'
"""

from jfleet.parallel.random import RNGStatesTracker as RNGStatesTracker
from jfleet.parallel.random import get_rng_state_tracker as get_rng_state_tracker
from jfleet.parallel.random import model_parallel_random_seed as model_parallel_random_seed

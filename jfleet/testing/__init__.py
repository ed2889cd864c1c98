"""Tools for testing and measuring jfleet runs.

* :mod:`~jfleet.testing.hlo`: the collectives of a compiled program and their bytes, and its
  dot FLOPs with loop bodies weighted by their trip counts.
* :mod:`~jfleet.testing.nnx_styles`: tiny decoder LMs written in the styles of public Flax NNX
  code (``STYLES``), with the dimension a Megatron layout splits in each weight.
* :mod:`~jfleet.testing.reference`: the same training on one device, to compare with.
* :mod:`~jfleet.testing.strategies`: a strategy from keyword settings.
* :mod:`~jfleet.testing.trees`: tree assertions (values, dtypes, structure) on chex.

Example:
  >>> from jfleet.testing import make_strategy
  >>> make_strategy({"dp_degree": 8}).hybrid_configs["dp_degree"]
  8
"""

from jfleet.testing.reference import train_one_device as train_one_device
from jfleet.testing.strategies import make_strategy as make_strategy
from jfleet.testing.trees import assert_trees_close as assert_trees_close

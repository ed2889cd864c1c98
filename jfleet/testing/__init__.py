"""Tools for testing and measuring jfleet runs, and for testing your own parallel code.

The top layer: users' test tools; nothing in jfleet imports it.

May import: runtime, mesh, optim, parallel, models, precision, training, auto_parallel,
checkpoint, launch, ps, fleet, distributed, incubate.

* :mod:`~jfleet.testing.assertions`: trains like one device, sharded as meant, the compiled
  step's collectives and memory.
* :mod:`~jfleet.testing.devices`: emulated CPU devices set before JAX starts, and the check
  that says how to get more.
* :mod:`~jfleet.testing.hlo`: the collectives of a compiled program and their bytes, and its
  dot FLOPs with loop bodies weighted by their trip counts.
* :mod:`~jfleet.testing.nnx_styles`: tiny decoder LMs written in the styles of public Flax NNX
  code (``STYLES``), with the dimension a Megatron layout splits in each weight.
* :mod:`~jfleet.testing.processes`: child interpreters (n processes x m devices) with a
  deadline, reaped.
* :mod:`~jfleet.testing.reference`: the same training on one device, to compare with.
* :mod:`~jfleet.testing.strategies`: a strategy from keyword settings.
* :mod:`~jfleet.testing.trees`: tree assertions (values, dtypes, structure) on chex, and
  :func:`state_as_numpy` (any model's variables under per-layer paths, to compare runs).

The pytest plugin that uses them (``--jfleet-devices``, fixtures, a marker) is the
top-level module ``pytest_jfleet``, installed with jfleet.

Example:
  >>> from jfleet.testing import make_strategy
  >>> make_strategy({"dp_degree": 8}).hybrid_configs["dp_degree"]
  8
"""

from jfleet.testing.assertions import assert_collectives as assert_collectives
from jfleet.testing.assertions import assert_peak_memory_below as assert_peak_memory_below
from jfleet.testing.assertions import assert_sharded_as as assert_sharded_as
from jfleet.testing.assertions import assert_trains_like_one_device as assert_trains_like_one_device
from jfleet.testing.devices import NotEnoughDevicesError as NotEnoughDevicesError
from jfleet.testing.devices import emulate_cpu_devices as emulate_cpu_devices
from jfleet.testing.devices import require_devices as require_devices
from jfleet.testing.processes import ProcessesFailedError as ProcessesFailedError
from jfleet.testing.processes import run_processes as run_processes
from jfleet.testing.reference import train_one_device as train_one_device
from jfleet.testing.strategies import make_strategy as make_strategy
from jfleet.testing.trees import assert_trees_close as assert_trees_close
from jfleet.testing.trees import default_tolerance as default_tolerance
from jfleet.testing.trees import state_as_numpy as state_as_numpy

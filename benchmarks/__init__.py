"""Benchmarks of jfleet (run as scripts: ``python benchmarks/zero_memory.py``).

Importing the package sets up what every benchmark runs on, before JAX starts: the CPU
platform, quiet XLA logs and 8 emulated devices. A script puts the repository root on
``sys.path`` and imports ``benchmarks`` first; under a harness that already started JAX
with its own device count (the test suite), the count is left as it is.
"""

import contextlib
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax

# Raises only when backends already started with another count (a harness chose its own).
with contextlib.suppress(RuntimeError):
    jax.config.update("jax_num_cpu_devices", 8)

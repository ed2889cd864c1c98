"""Test harness: every test and doctest in this process sees 8 emulated CPU devices.

Tests that need another device count, or several processes, run their code in a
subprocess through ``tests/subprocess_util.py`` (on :mod:`jfleet.testing.processes`) with
a wall-clock timeout, so a hung collective can never hang the suite. The device count and
the fleet reset are jfleet's pytest plugin's (``pytest_jfleet``), which users get too.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile without LLVM's expensive optimisations: the same HLO (collectives, buffer
# assignment, memory analysis), about a quarter less suite time on 2 cores, where
# compiling the tiny models dominates. Children, examples and notebooks inherit it.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

from jfleet.testing.devices import emulate_cpu_devices  # noqa: E402

emulate_cpu_devices(8)

import pytest  # noqa: E402

pytest_plugins = ["pytest_jfleet"]


@pytest.fixture(autouse=True)
def _fresh_fleet(fleet_reset):
    """Each test starts with no fleet initialised and leaves none behind."""

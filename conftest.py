"""Test harness: every test and doctest in this process sees 8 emulated CPU devices.

Tests that need another device count, or several processes, run their code in a
subprocess through ``tests/subprocess_util.py`` with a wall-clock timeout, so a
hung collective can never hang the suite.
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

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_fleet():
    """Each test starts with no fleet initialised and leaves none behind."""
    from jfleet import fleet

    fleet._reset()
    yield
    fleet._reset()

"""Test harness: every test and doctest in this process sees 8 emulated CPU devices.

Tests that need another device count, or several processes, run their code in a
subprocess through ``tests/subprocess_util.py`` with a wall-clock timeout, so a
hung collective can never hang the suite.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_fleet():
    """Each test starts with no fleet initialised and leaves none behind."""
    from jfleet import fleet

    fleet._reset()
    yield
    fleet._reset()

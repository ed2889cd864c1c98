"""Test harness: every test and doctest in this process sees 8 emulated CPU devices.

Tests that need another device count, or several processes, run their code in a
subprocess through ``tests/subprocess_util.py`` (on :mod:`jfleet.testing.processes`) with
a wall-clock timeout, so a hung collective can never hang the suite. The device count and
the fleet reset are jfleet's pytest plugin's (``pytest_jfleet``), which users get too.
"""

import contextlib
import ctypes
import gc
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile without LLVM's expensive optimisations and with XLA:CPU's classic fusion emitter
# instead of its MLIR fusion emitters: the same HLO (collectives, buffer assignment, memory
# analysis within 0.1%), a third of the compile time of a tiny model's step on 2 cores,
# where compiling dominates. Children, examples and notebooks inherit it. A flag that a
# newer jaxlib no longer knows would abort XLA, so the set is probed once in a child first.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
)


def _xla_accepts(flags: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    _flags = os.environ.get("XLA_FLAGS", "")
    if _xla_accepts(" ".join((_flags, *_FAST_COMPILE))):
        _flags = " ".join((_flags, *_FAST_COMPILE))
    else:  # keep those it knows, say which it refused
        for _extra in _FAST_COMPILE:
            if _xla_accepts(f"{_flags} {_extra}"):
                _flags = f"{_flags} {_extra}"
            else:
                print(f"conftest: this jaxlib refuses XLA_FLAGS {_extra!r}; compiling without it")
    os.environ["XLA_FLAGS"] = _flags.strip()

from jfleet.testing.devices import emulate_cpu_devices  # noqa: E402

emulate_cpu_devices(8)

import jax  # noqa: E402
import pytest  # noqa: E402

pytest_plugins = ["pytest_jfleet"]


@pytest.fixture(autouse=True)
def _fresh_fleet(fleet_reset):
    """Each test starts with no fleet initialised and leaves none behind."""


#: One test per module for CI's smoke job (``pytest --smoke``): the test listed for the
#: module (the fastest of a cold smoke run), else its first; ``! path  reason`` lines name
#: modules whose every test costs too much alone (a long module fixture) to fit 3 minutes.
SMOKE_LIST = Path(__file__).resolve().parent / ".ci" / "smoke_tests.txt"


def pytest_addoption(parser):
    parser.addoption(
        "--smoke",
        action="store_true",
        help="run one test per module (.ci/smoke_tests.txt, else the module's first): "
        "CI's check of the newest dependency releases",
    )


def _smoke_list() -> tuple[dict[str, str], set[str]]:
    """``({module: listed test}, {modules left out})`` from ``.ci/smoke_tests.txt``."""
    listed, left_out = {}, set()
    for line in SMOKE_LIST.read_text().splitlines() if SMOKE_LIST.exists() else []:
        line = line.strip()
        if line.startswith("!"):
            left_out.add(line[1:].split()[0])
        elif line and not line.startswith("#"):
            listed[line.split("::", 1)[0]] = line
    return listed, left_out


def pytest_collection_modifyitems(config, items):
    if not config.getoption("smoke"):
        return
    listed, left_out = _smoke_list()
    by_module = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    chosen = [
        next((t for t in tests if t.nodeid == listed.get(module)), tests[0])
        for module, tests in by_module.items()
        if module not in left_out
    ]
    config.hook.pytest_deselected(items=[i for i in items if i not in chosen])
    items[:] = chosen


#: Resident memory past which JAX's caches are first dropped after a module, and how much
#: it may grow again after each drop before the next.
RELEASE_ABOVE_BYTES = 2 << 30
RELEASE_GROWTH_BYTES = 1 << 30
_next_release = [RELEASE_ABOVE_BYTES]


def _resident_bytes() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: never release


def _return_freed_memory() -> None:
    """Give the pages malloc keeps after a release back to the system (glibc only)."""
    # not glibc: the resident size stays high, and the growth rule still holds
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a module, what is alive is frozen; past 2 GiB, JAX's caches are dropped.

    Freezing (:func:`gc.freeze`) takes the objects alive after a module (JAX's caches of
    traced and compiled programs, imported modules) out of the collector's full passes,
    which otherwise walk them all again every few hundred thousand allocations: ``tests/
    auto_parallel`` ran in 251 and 266 s instead of 300 and 303 s, its full passes taking 17 s
    instead of 29 s, and the whole suite in 1252 s wall and 1355 CPU-seconds instead of 1495
    and 1627. Freezing after every test instead kept garbage alive too long (2.6 GB
    resident, 287 s for ``tests/auto_parallel``; with a collection before each freeze, 340 s
    instead of 288 s). Cyclic garbage frozen with the module's objects is freed at the next
    release.

    Programs rarely repeat across modules, and a run that keeps them all grows to 6 GB,
    which costs kernel and collector time (releasing after every module of ``tests/parallel``
    kept the peak at 1.3 GB instead of 3.6 GB, 6% less wall). Releasing after *every*
    module costs more than it saves over the whole run (a full collection each time, and
    170 doctest modules that recompile what they share), hence the threshold. The next
    release waits for 1 GiB of growth past what is resident after this one: malloc keeps
    freed pages, so a fixed threshold, once crossed, released after every module from there
    on (the 531 doctests, which run last, took 238 s in the suite and 51 s alone). With the
    growth rule the doctests take 21 s in the suite, and the whole suite, on a fresh clone
    with a fresh venv, 647 s wall and 699 CPU-seconds instead of 1112 and 1196 (every
    module after the first crossing had paid a release and a recompile of what it shared).
    """
    yield
    if _resident_bytes() > _next_release[0]:
        gc.unfreeze()
        jax.clear_caches()
        gc.collect()
        _return_freed_memory()
        _next_release[0] = max(RELEASE_ABOVE_BYTES, _resident_bytes() + RELEASE_GROWTH_BYTES)
    gc.freeze()

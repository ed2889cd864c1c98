"""jfleet's pytest plugin: emulated devices, a fresh fleet, meshes and multi-process runs.

Installed with jfleet (entry point ``pytest11``), it does nothing until asked: this module
imports only pytest and the standard library, and JAX is imported and configured only
when an option, a fixture or the marker below is used (disable it with ``-p no:jfleet``).

* ``--jfleet-devices N`` (or ``jfleet_devices = N`` in the ini file): N emulated CPU
  devices in the pytest process, set before JAX starts.
* ``@pytest.mark.jfleet_devices(n, timeout=600)``: the test runs with n devices: in this
  process when it has n, else alone in a child ``pytest`` with ``--jfleet-devices n``
  (killed after ``timeout`` s; its report and output come back as this test's).
* fixtures: ``fleet_reset`` (no fleet before or after the test), ``mesh_factory``
  (``mesh_factory(dp=2, mp=4)``: ``fleet.init`` with those degrees on the first devices,
  returning the mesh), ``emulated_processes`` (``emulated_processes(2, 4, fn_or_code)``:
  :func:`jfleet.testing.processes.run_processes`).

It lives outside the ``jfleet`` package because importing anything under ``jfleet`` imports
JAX, which a plugin that is loaded into every pytest run must not do.

Example (a user's test file, run as ``pytest --jfleet-devices 8``)::

    def test_mesh(mesh_factory):
        mesh = mesh_factory(dp=2, mp=4)
        assert dict(mesh.shape)["mp"] == 4
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: Set in the child that runs a marked test, so it never starts another.
CHILD_ENV = "JFLEET_PYTEST_CHILD"
#: The file the child writes its reports to.
REPORT_ENV = "JFLEET_PYTEST_REPORTS"
MARKER = "jfleet_devices"
DEFAULT_CHILD_TIMEOUT = 600.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("jfleet", "jfleet: emulated devices")
    group.addoption(
        "--jfleet-devices",
        type=int,
        default=None,
        metavar="N",
        help="emulate N CPU devices in this pytest process (set before JAX starts).",
    )
    parser.addini("jfleet_devices", "emulated CPU devices, as --jfleet-devices", default="")


def requested_devices(config: pytest.Config) -> int | None:
    """The device count asked for: the option, else the ini value, else None (off)."""
    value = config.getoption("jfleet_devices")
    if value is None:
        text = str(config.getini("jfleet_devices") or "").strip()
        if not text:
            return None
        try:
            value = int(text)
        except ValueError:
            raise pytest.UsageError(
                f"jfleet_devices = {text!r} in the ini file: expected a positive int."
            ) from None
    if value < 1:
        raise pytest.UsageError(f"--jfleet-devices {value}: expected a positive int.")
    return value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(n, timeout={DEFAULT_CHILD_TIMEOUT:g}): run the test with n emulated CPU "
        "devices (in a child pytest unless this process has n).",
    )
    n = requested_devices(config)
    if n is not None:
        from jfleet.testing.devices import emulate_cpu_devices

        emulate_cpu_devices(n)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture
def fleet_reset() -> Any:
    """No fleet initialised when the test starts, none left when it ends."""
    from jfleet import fleet

    fleet._reset()
    yield
    fleet._reset()


@pytest.fixture
def mesh_factory(fleet_reset: None) -> Callable[..., Any]:
    """``mesh_factory(dp=2, mp=4)``: ``fleet.init`` with those degrees, returning its mesh.

    Degrees not given are 1; the mesh takes the first ``product(degrees)`` devices, so
    jfleet code reading the current run (``make_train_step``, parallel layers) uses it.
    """

    def make(**degrees: int) -> Any:
        import jax

        from jfleet import fleet
        from jfleet.mesh.topology import AXIS_NAMES
        from jfleet.testing import make_strategy
        from jfleet.testing.devices import require_devices

        unknown = sorted(set(degrees) - set(AXIS_NAMES))
        if unknown:
            raise ValueError(
                f"mesh_factory({', '.join(unknown)}=...): unknown axes; use {list(AXIS_NAMES)}."
            )
        bad = {a: d for a, d in degrees.items() if not isinstance(d, int) or d < 1}
        if bad:
            raise ValueError(f"mesh_factory degrees {bad}: expected positive ints.")
        total = math.prod(degrees.values())
        shown = ", ".join(f"{a}={d}" for a, d in degrees.items())
        require_devices(total, f"mesh_factory({shown})")
        strategy = make_strategy({f"{a}_degree": d for a, d in degrees.items()})
        fleet.init(strategy=strategy, log_level="WARNING", devices=jax.devices()[:total])
        return fleet.get_hybrid_communicate_group().mesh

    return make


@pytest.fixture
def emulated_processes(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``emulated_processes(n, devices_each, fn_or_code, launcher="paddle", timeout=120)``.

    Runs the target in ``n`` processes of ``devices_each`` CPU devices with the launcher's
    variables (:func:`jfleet.testing.processes.run_processes`, same arguments); a child
    that fails or hangs fails the test with every child's output, and none is left running.
    """

    def run(n: int, devices_each: int, target: Any, **kwargs: Any) -> Any:
        from jfleet.testing.processes import run_processes

        kwargs.setdefault("cwd", str(request.config.invocation_params.dir))
        return run_processes(target, n, devices_each, **kwargs)

    return run


# ------------------------------------------------------------------ the device marker


def _marked(item: pytest.Item) -> tuple[int, float] | None:
    mark = item.get_closest_marker(MARKER)
    if mark is None:
        return None
    if len(mark.args) != 1 or isinstance(mark.args[0], bool) or not isinstance(mark.args[0], int):
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.{MARKER}{mark.args}: expected one positive int."
        )
    return mark.args[0], float(mark.kwargs.get("timeout", DEFAULT_CHILD_TIMEOUT))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    marked = _marked(item)
    if marked is None:
        return None
    n, timeout = marked
    import jax

    have = len(jax.devices())
    if have == n:
        return None  # runs here, as any test
    if os.environ.get(CHILD_ENV):
        run: Callable[[], None] = lambda: pytest.fail(  # noqa: E731
            f"the child pytest for this test has {have} devices, not {n}: is JAX started "
            "by a conftest.py before the plugin sets the count?",
            pytrace=False,
        )
    else:
        run = lambda: _run_in_child(item, n, timeout)  # noqa: E731
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for when, fn in (("setup", lambda: None), ("call", run), ("teardown", lambda: None)):
        call = pytest.CallInfo.from_call(fn, when=when, reraise=(KeyboardInterrupt,))
        report = ihook.pytest_runtest_makereport(item=item, call=call)
        ihook.pytest_runtest_logreport(report=report)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _run_in_child(item: pytest.Item, n: int, timeout: float) -> None:
    """Runs ``item`` alone in ``pytest --jfleet-devices n``; raises its outcome here."""
    from jfleet.testing.processes import run_children

    config = item.config
    target = str(item.path) + item.nodeid[len(item.nodeid.split("::")[0]) :]
    argv = ["-m", "pytest", target, "-p", __name__, "--jfleet-devices", str(n)]
    argv += ["-q", "-p", "no:cacheprovider", "--rootdir", str(config.rootpath)]
    if config.inipath is not None:
        argv += ["-c", str(config.inipath)]
    with tempfile.TemporaryDirectory(prefix="jfleet-pytest-") as tmp:
        reports = os.path.join(tmp, "reports.jsonl")
        env = {CHILD_ENV: "1", REPORT_ENV: reports}
        (child,) = run_children(
            [argv], envs=[env], timeout=timeout, cwd=config.invocation_params.dir
        )
        lines = Path(reports).read_text().splitlines() if os.path.exists(reports) else []
    outcomes = [json.loads(line) for line in lines]
    where = f"in a child pytest with {n} devices"
    output = child.report("child pytest")
    if child.killed:
        pytest.fail(f"{where}: still running after {timeout:g} s (killed)\n{output}", pytrace=False)
    failed = [r for r in outcomes if r["outcome"] == "failed"]
    if failed:
        text = "\n".join(f"[{r['when']}] {r['longrepr']}" for r in failed)
        pytest.fail(f"{where}:\n{text}", pytrace=False)
    skipped = [r for r in outcomes if r["outcome"] == "skipped"]
    if skipped:
        pytest.skip(f"{where}: {skipped[0]['longrepr']}")
    if not any(r["when"] == "call" and r["outcome"] == "passed" for r in outcomes):
        pytest.fail(
            f"{where}: the test did not run (exit code {child.returncode})\n{output}", pytrace=False
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """A test short of devices fails with the fix alone, not a traceback into jfleet."""
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if type(error).__name__ == "NotEnoughDevicesError" and report.failed:
        report.longrepr = f"{item.nodeid}: {error}"
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path or not os.environ.get(CHILD_ENV):
        return
    if report.skipped and isinstance(report.longrepr, tuple):
        text = str(report.longrepr[2])  # (file, line, reason)
    else:
        text = str(report.longrepr) if report.longrepr else ""
    if report.failed and report.capstdout:
        text += f"\n--- captured stdout\n{report.capstdout}"
    if report.failed and report.capstderr:
        text += f"\n--- captured stderr\n{report.capstderr}"
    with open(path, "a") as f:
        f.write(json.dumps({"when": report.when, "outcome": report.outcome, "longrepr": text}))
        f.write("\n")

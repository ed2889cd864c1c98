"""jfleet's pytest plugin, tested as plugins are: pytest runs on files written by a user."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import jax
import pytest

from jfleet.testing import ProcessesFailedError

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "test_my_model.py"
PLUGIN = ("-p", "pytest_jfleet", "-p", "no:cacheprovider")


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """Children (pytest subprocesses, marked tests) import jfleet and the plugin from here."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def test_the_example_passes_with_jfleet_devices_8(pytester):
    pytester.makepyfile(test_my_model=EXAMPLE.read_text())
    result = pytester.runpytest_inprocess(*PLUGIN, "--jfleet-devices", "8")
    result.assert_outcomes(passed=5)


def test_without_the_option_every_test_says_to_add_it(pytester):
    pytester.makepyfile(test_my_model=EXAMPLE.read_text())
    result = pytester.runpytest_subprocess(*PLUGIN)  # a fresh process: one CPU device
    result.assert_outcomes(failed=2, errors=3)  # errors: in the placing fixture
    # Each test's message shows in its section and (untruncated where CI is set) in the summary.
    hinted = re.findall(r"test_my_model\.py::(\w+): .*needs 8 devices, but this process has 1: "
                        r"run pytest with --jfleet-devices 8", result.stdout.str())  # fmt: skip
    assert len(set(hinted)) == 5
    assert "Traceback" not in result.stdout.str() and "devices.py" not in result.stdout.str()


def test_the_plugin_changes_nothing_unless_asked(pytester, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JAX_NUM_CPU_DEVICES", raising=False)
    pytester.makepyfile(
        """
        import os, sys

        def test_untouched(request):
            assert request.config.pluginmanager.hasplugin("pytest_jfleet")
            assert "jax" not in sys.modules and "jfleet" not in sys.modules
            assert "JAX_PLATFORMS" not in os.environ
            import jax

            assert jax.config.jax_num_cpu_devices == -1  # JAX's default
            assert len(jax.devices("cpu")) == 1
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=1)


def test_the_ini_option_sets_the_device_count_before_jax_starts(pytester, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    pytester.makeini("[pytest]\njfleet_devices = 2\n")
    pytester.makepyfile(
        """
        import os, jax

        def test_two():
            assert len(jax.devices()) == 2 and os.environ["JAX_PLATFORMS"] == "cpu"
        """
    )
    result = pytester.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=1)


def test_the_marker_runs_a_test_in_a_child_with_that_many_devices(pytester):
    pytester.makepyfile(
        f"""
        import os, jax, pytest

        @pytest.mark.jfleet_devices(2)
        def test_two_in_a_child():
            assert len(jax.devices()) == 2 and os.getpid() != {os.getpid()}

        @pytest.mark.jfleet_devices(8)
        def test_eight_here():
            assert len(jax.devices()) == 8 and os.getpid() == {os.getpid()}

        @pytest.mark.jfleet_devices(2)
        def test_failing_in_a_child():
            print("child output")
            assert len(jax.devices()) == 3, "the child saw 2"
        """
    )
    assert len(jax.devices()) == 8
    result = pytester.runpytest_inprocess(*PLUGIN)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*in a child pytest with 2 devices*", "*the child saw 2*"])
    assert "child output" in result.stdout.str()


HANG = """
import os, subprocess, sys, time

rank = os.environ["PADDLE_TRAINER_ID"]
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"rank {rank} of {os.environ['PADDLE_TRAINERS_NUM']} pid {os.getpid()} "
      f"grandchild {grandchild.pid} devices {os.environ['JAX_NUM_CPU_DEVICES']}", flush=True)
print(f"rank {rank} stderr", file=sys.stderr, flush=True)
if rank == "0":
    time.sleep(600)  # rank 0 hangs; rank 1 ends, leaving its grandchild running
"""


#: The hang test's deadline: long enough that rank 1, on a loaded machine, has started, printed
#: and ended by then (it fails when rank 1 is still running, or a rank has not printed).
HANG_TIMEOUT = 15


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting a reaper other than us counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def test_a_hung_process_is_killed_at_the_timeout_with_all_output_and_none_left(pytester):
    pytester.makepyfile(
        f"""
        def test_hangs(emulated_processes):
            emulated_processes(2, 4, {HANG!r}, timeout={HANG_TIMEOUT})
        """
    )
    start = time.monotonic()
    result = pytester.runpytest_inprocess(*PLUGIN)
    result.assert_outcomes(failed=1)
    assert time.monotonic() - start < 60
    out = result.stdout.str()
    assert f"rank(s) [0] still running after the {HANG_TIMEOUT} s timeout (all killed)" in out
    # Each rank's output shows in the failure and again in the summary where CI is set.
    ranks = set(re.findall(r"rank (\d) of 2 pid (\d+) grandchild (\d+) devices 4", out))
    assert sorted(r[0] for r in ranks) == ["0", "1"]
    assert "rank 0 stderr" in out and "rank 1 stderr" in out
    pids = [int(p) for _, child, grandchild in ranks for p in (child, grandchild)]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]


def joined_job():
    """What one process of a 2 x 4 job sees after fleet.init (run in a child)."""
    import jax

    from jfleet import fleet

    fleet.init(is_collective=True, log_level="WARNING")
    return jax.process_index(), jax.process_count(), len(jax.devices()), jax.local_device_count()


def test_a_function_runs_in_two_processes_of_four_devices(emulated_processes):
    children = emulated_processes(2, 4, joined_job, launcher="jax", timeout=120)
    assert [c.value for c in children] == [(0, 2, 8, 4), (1, 2, 8, 4)]
    with pytest.raises(ProcessesFailedError, match=r"rank\(s\) \[1\] exited non-zero"):
        emulated_processes(2, 1, "import os, sys; sys.exit(int(os.environ['PADDLE_TRAINER_ID']))")


def test_mesh_factory_and_its_device_hint(mesh_factory):
    mesh = mesh_factory(dp=2, mp=2)
    assert dict(mesh.shape) == {"dp": 2, "pp": 1, "sharding": 1, "sep": 1, "ep": 1, "mp": 2}
    assert mesh.devices.size == 4
    with pytest.raises(RuntimeError, match="mesh_factory\\(dp=16\\) needs 16 devices.*"
                       "--jfleet-devices 16"):  # fmt: skip
        mesh_factory(dp=16)
    with pytest.raises(ValueError, match=r"mesh_factory\(tp=\.\.\.\): unknown axes"):
        mesh_factory(tp=2)

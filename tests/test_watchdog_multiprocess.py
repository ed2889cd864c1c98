"""The watchdog in real 2-process jobs (2 processes x 2 CPU devices each, dp4, TinyLM).

Rank 1 injects a fault before its third step: an exception, an early normal exit, a hang in
Python, a SIGKILL (rank 0 blocked reading the loss, or waiting in Python where it can catch
:class:`jfleet.watchdog.PeerFailedError`); and one job has no fault. The six jobs (twelve
processes) run at once, from ``benchmarks/fault_bench.py`` (the table in RESULTS.md), each
killed with its process group at the deadline. Every faulty job must end within 30 s of the
fault, every process non-zero (or with the exit code the script chose after catching the
error), with a line naming rank 1 and the cause; the healthy job must exit 0, promptly.
Without the watchdog the faulty jobs hang until the deadline (measured on main: >= 81 s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fault_bench import Outcome, run, table
from jfleet.runtime.watchdog import ABORT_EXIT_CODE, EXIT_GRACE_S

STEP_TIMEOUT_S = 10
PEER_TIMEOUT_S = 5
ENV = {
    "JFLEET_HEARTBEAT_TIMEOUT": "20",
    "JFLEET_PEER_TIMEOUT": str(PEER_TIMEOUT_S),
    "JFLEET_STEP_TIMEOUT": str(STEP_TIMEOUT_S),
}
BOUND_S = 30.0


@pytest.fixture(scope="module")
def jobs() -> dict[str, Outcome]:
    return run(["none", "exception", "exit", "stuck", "kill", "kill_poll"], env=ENV, deadline=100)


def _report(o: Outcome) -> str:
    return "\n".join(
        f"--- rank {r} rc={o.codes[r]}\nstdout:\n{o.stdout[r][-2000:]}\n"
        f"stderr:\n{o.stderr[r][-3000:]}"
        for r in o.codes
    )


def _ended_in_time(o: Outcome) -> float:
    assert not o.timed_out, _report(o)
    seconds = o.fault_to_exit_s
    assert seconds is not None and 0 <= seconds < BOUND_S, (seconds, _report(o))
    return seconds


def test_no_fault_job_exits_zero_promptly(jobs):
    o = jobs["none"]
    assert not o.timed_out, _report(o)
    assert o.codes == {0: 0, 1: 0}, _report(o)
    assert all("LOSS" in o.stdout[r] and "jfleet.watchdog" not in o.stderr[r] for r in (0, 1))
    # From the end of the script to the last exit: JAX's shutdown plus at most a poll or two
    # (0.7 s on an idle machine, 5.2 s with twelve processes on 2 busy cores), never a wait
    # for a peer's timeout and then the exit grace (>= 8 s here).
    bound = PEER_TIMEOUT_S + EXIT_GRACE_S
    assert o.done_to_exit_s < bound, (o.done_to_exit_s, bound, _report(o))


def test_exception_in_rank_1_ends_the_job(jobs):
    o = jobs["exception"]
    _ended_in_time(o)
    assert o.codes == {0: ABORT_EXIT_CODE, 1: 1}, _report(o)
    cause = "rank 1 failed (ValueError: injected fault) after step 2 (between steps)"
    assert f"jfleet.watchdog: {cause}; rank 0 stops" in o.stderr[0], _report(o)
    assert f"jfleet.watchdog: {cause}; rank 1 stops" in o.stderr[1], _report(o)
    assert "Traceback" in o.stderr[1]  # the previous excepthook still ran


def test_rank_1_leaving_early_ends_the_job(jobs):
    o = jobs["exit"]
    _ended_in_time(o)
    assert o.codes == {0: ABORT_EXIT_CODE, 1: ABORT_EXIT_CODE}, _report(o)
    cause = "rank 1 exited after step 2 while rank 0 waits in step 3 (train)"
    for r in (0, 1):
        assert f"jfleet.watchdog: {cause}; rank {r} stops" in o.stderr[r], _report(o)


def test_rank_1_stuck_in_python_ends_the_job(jobs):
    o = jobs["stuck"]
    seconds = _ended_in_time(o)
    assert seconds > STEP_TIMEOUT_S - 1  # it waited for the timeout, no sooner
    assert o.codes == {0: ABORT_EXIT_CODE, 1: ABORT_EXIT_CODE}, _report(o)
    cause = "rank 1 has been between steps after step 2 (in Python: not in a jfleet step) for "
    for r in (0, 1):
        assert cause in o.stderr[r] and "while rank 0 waits in step 3 (train)" in o.stderr[r]
        assert f"rank {r} stops" in o.stderr[r], _report(o)


def test_rank_1_killed_while_rank_0_blocks_in_a_collective(jobs):
    o = jobs["kill"]
    seconds = _ended_in_time(o)
    assert seconds > PEER_TIMEOUT_S - 1
    assert o.codes == {0: ABORT_EXIT_CODE, 1: -9}, _report(o)
    line = o.cause(0)
    assert line.startswith("jfleet.watchdog: rank 1 (host "), _report(o)
    assert "stopped sending heartbeats" in line and line.endswith("; rank 0 stops"), line


def test_rank_1_killed_raises_a_catchable_error_in_rank_0(jobs):
    o = jobs["kill_poll"]
    _ended_in_time(o)
    assert o.codes == {0: 17, 1: -9}, _report(o)  # 17: the script's own choice
    assert "CAUGHT PeerFailedError: jfleet.watchdog: rank 1 (host " in o.stdout[0], _report(o)
    assert "stopped sending heartbeats" in o.stdout[0]


def test_fault_bench_renders_its_table(jobs):
    text = table(jobs)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()[2:]}
    assert "rank 1 never starts" not in rows  # not run here
    assert "| 70, 1 | " in rows["rank 1 raises ValueError"]
    assert "rank 1 failed (ValueError: injected fault)" in rows["rank 1 raises ValueError"]
    assert "(end of script → exit)" in rows["no fault (3 steps each, then exit)"]
    assert "CAUGHT PeerFailedError" in rows["rank 1 killed (SIGKILL); rank 0 waits in Python"]
    assert "rank 0 (the coordinator) raises ValueError" not in rows  # not run

"""The watchdog in one process: settings, the rules (``decide``), and the per-process parts
(progress from the engine's hooks, the exception hook, the exit path, delivering
``PeerFailedError``) against an in-memory key-value store. The real multi-process jobs are in
``tests/test_watchdog_multiprocess.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import jax.numpy as jnp
import pytest

from jfleet.runtime import consistency, watchdog
from jfleet.runtime import coordination as _coordination
from jfleet.runtime.watchdog import (
    ABORT_EXIT_CODE,
    EXIT_GRACE_S,
    STALE_S,
    PeerFailedError,
    Settings,
    Verdict,
    decide,
    phase,
    settings,
)

CONFIG = Settings(step_timeout_s=60.0, peer_timeout_s=10.0, heartbeat_timeout_s=100.0)


def rec(started, done=None, *, dispatched=None, state="run", since=0.0, kind="train", **extra):
    """A heartbeat record as a process publishes it."""
    done = started if done is None else done
    return {
        "rank": 0,
        "host": "h",
        "pid": 7,
        "seq": 1,
        "state": state,
        "started": started,
        "dispatched": started if dispatched is None else dispatched,
        "done": done,
        "kind": kind,
        "since": since,
        "error": extra.get("error"),
        "thread_error": extra.get("thread_error"),
    }


# ------------------------------------------------------------------ settings
def test_settings_read_the_environment_and_default():
    assert settings({}) == Settings(1800.0, 30.0, 100.0, True)
    got = settings(
        {
            "JFLEET_STEP_TIMEOUT": "12.5",
            "JFLEET_PEER_TIMEOUT": "3",
            "JFLEET_HEARTBEAT_TIMEOUT": "20",
            "JFLEET_WATCHDOG": "0",
        }
    )
    assert got == Settings(12.5, 3.0, 20.0, False)


def test_the_peer_timeout_stays_below_half_the_heartbeat_timeout():
    assert Settings(60, 30, 100).peer_limit_s == 30
    assert Settings(60, 30, 40).peer_limit_s == 20  # JAX aborts after 40 s: act by 20
    assert Settings(60, 30, 10).peer_limit_s == 1.5  # 7.5 s (JAX's first abort) - 5 s - 1 s
    assert Settings(60, 30, 4).peer_limit_s == 1


@pytest.mark.parametrize(
    "name, value",
    [
        ("JFLEET_STEP_TIMEOUT", "ten"),
        ("JFLEET_STEP_TIMEOUT", "0"),
        ("JFLEET_PEER_TIMEOUT", "-3"),
        ("JFLEET_PEER_TIMEOUT", "inf"),
        ("JFLEET_HEARTBEAT_TIMEOUT", "nan"),
    ],
)
def test_a_bad_timeout_is_named_with_the_fix(name, value):
    with pytest.raises(ValueError, match=rf"{name}='{value}' is not a positive number.*set it"):
        settings({name: value})


def test_a_bad_switch_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"JFLEET_WATCHDOG='yes' is neither '1' .* nor '0'"):
        settings({"JFLEET_WATCHDOG": "yes"})


# ------------------------------------------------------------------ phases
@pytest.mark.parametrize(
    "record, words",
    [
        (rec(0), "before its first step (in Python: not in a jfleet step)"),
        (rec(2), "between steps after step 2 (in Python: not in a jfleet step)"),
        (rec(3, 2, dispatched=2), "preparing step 3 (train: tracing or compiling)"),
        (rec(3, 2, kind="eval"), "in step 3 (eval)"),
        (rec(4, 2), "in step 3 (train)"),  # two dispatched, the oldest not complete
        (rec(2, state="exiting"), "exiting after step 2"),
    ],
)
def test_phase_in_words(record, words):
    assert phase(record) == words


# ------------------------------------------------------------------ the rules
def test_a_healthy_job_has_no_verdict():
    views = {0: (rec(3, 2, since=30.0), 0.5), 1: (rec(3, 2, since=30.0), 0.9)}
    assert decide(views, 2, CONFIG) is None
    everyone_done = {r: (rec(5, state="exiting", since=100.0), 1.0) for r in (0, 1)}
    assert decide(everyone_done, 2, CONFIG) is None


def test_a_failed_rank_is_named_with_its_error_and_step():
    views = {0: (rec(3, 2), 0.0), 1: (rec(3, 2, state="failed", error="ValueError: boom"), 0.0)}
    assert decide(views, 2, CONFIG) == Verdict(
        1, "failed", "rank 1 failed (ValueError: boom) during step 3 (train)"
    )


def test_a_silent_rank_is_lost_and_the_verdict_is_catchable():
    views = {0: (rec(3, 2), 0.0), 1: (rec(2, since=1.0), 10.5)}
    v = decide(views, 2, CONFIG)
    assert (v.rank, v.cause, v.catchable) == (1, "lost", True)
    assert v.message == (
        "rank 1 (host h, pid 7) stopped sending heartbeats 10 s ago (killed or frozen; "
        "JFLEET_PEER_TIMEOUT=10); its last report: between steps after step 2 "
        "(in Python: not in a jfleet step)"
    )
    assert decide({0: (rec(3, 2), 0.0), 1: (rec(2), 9.5)}, 2, CONFIG) is None
    # A rank that exited and then went quiet passed through JAX's shutdown: not lost.
    assert (
        decide({0: (rec(2, state="exiting"), 0.0), 1: (rec(2, state="exiting"), 50)}, 2, CONFIG)
        is None
    )


def test_a_rank_that_exited_before_a_step_its_peer_waits_in_is_named():
    t = EXIT_GRACE_S + 0.5
    views = {0: (rec(3, 2, since=t), 0.0), 1: (rec(2, state="exiting", since=t), 0.0)}
    v = decide(views, 2, CONFIG)
    assert v == Verdict(
        1, "exited", "rank 1 exited after step 2 while rank 0 waits in step 3 (train)"
    )
    assert not v.catchable
    # Within the grace, or with rank 0 between steps (finishing up), nothing yet.
    soon = {0: (rec(3, 2, since=1.0), 0.0), 1: (rec(2, state="exiting", since=t), 0.0)}
    assert decide(soon, 2, CONFIG) is None
    finishing = {0: (rec(2, since=t), 0.0), 1: (rec(2, state="exiting", since=t), 0.0)}
    assert decide(finishing, 2, CONFIG) is None


def test_a_laggard_is_named_once_both_waited_the_step_timeout():
    views = {0: (rec(3, 2, since=61.0), 0.0), 1: (rec(2, since=61.5), 1.0)}
    v = decide(views, 2, CONFIG)
    assert (v.rank, v.cause) == (1, "stuck")
    assert v.message == (
        "rank 1 has been between steps after step 2 (in Python: not in a jfleet step) for 62 s "
        "while rank 0 waits in step 3 (train)"
    )
    # The laggard's time before rank 0 started waiting does not count.
    assert (
        decide({0: (rec(3, 2, since=5.0), 0.0), 1: (rec(2, since=500.0), 0.0)}, 2, CONFIG) is None
    )
    # A laggard whose record is stale is left to the heartbeat rule.
    assert (
        decide({0: (rec(3, 2, since=90.0), 0), 1: (rec(2, since=90.0), STALE_S + 1)}, 2, CONFIG)
        is None
    )
    # Its dying thread is part of the story.
    noted = {0: views[0], 1: (rec(2, since=62.0, thread_error="loader: OSError: gone"), 0.0)}
    assert decide(noted, 2, CONFIG).message.endswith("(its thread died: loader: OSError: gone)")


def test_a_rank_that_never_started_its_watchdog_is_behind_everyone():
    # Not lost (it may be slow to reach fleet.init after its own jax.distributed.initialize)...
    assert decide({0: (rec(0), 0.0), 1: (None, 500.0)}, 2, CONFIG) is None
    assert decide({0: (rec(1, 0, since=10.0), 0.0), 1: (None, 500.0)}, 2, CONFIG) is None
    # ... but named once a peer has waited the step timeout for it.
    v = decide({0: (rec(1, 0, since=61.0), 0.0), 1: (None, 500.0)}, 2, CONFIG)
    assert (v.rank, v.cause) == (1, "stuck")
    assert v.message == (
        "rank 1 has not started its watchdog for 500 s (has it reached fleet.init?) while "
        "rank 0 waits in step 1 (train)"
    )


def test_a_step_that_makes_no_progress_on_any_rank_is_stuck():
    views = {0: (rec(3, 2, since=61.0), 0.0), 1: (rec(3, 2, since=61.0), 0.0)}
    v = decide(views, 2, CONFIG)
    assert (v.rank, v.cause) == (0, "stuck")
    assert v.message.startswith(
        "rank 0 has been in step 3 (train) for 61 s (JFLEET_STEP_TIMEOUT=60) and no rank is "
        "behind it"
    )
    # Tracing and compiling is not waiting, however long.
    compiling = {r: (rec(1, 0, dispatched=0, since=600.0), 0.0) for r in (0, 1)}
    assert decide(compiling, 2, CONFIG) is None


def test_a_rank_still_preparing_the_step_its_peer_waits_in_is_named():
    # Rank 1 started step 3 but never dispatched it (stuck in a trace or a check that waits).
    views = {0: (rec(3, 2, since=61.0), 0.0), 1: (rec(3, 2, dispatched=2, since=62.0), 0.0)}
    v = decide(views, 2, CONFIG)
    assert (v.rank, v.cause) == (1, "stuck")
    assert v.message == (
        "rank 1 has been preparing step 3 (train: tracing or compiling) for 62 s while rank 0 "
        "waits in step 3 (train)"
    )
    views[0] = (rec(3, 2, since=30.0), 0.0)  # rank 0 has not waited that long yet
    assert decide(views, 2, CONFIG) is None


def test_an_exception_message_becomes_one_bounded_line():
    assert (
        watchdog._one_line("A: first\n  rank 0: x\n  rank 1: y") == "A: first rank 0: x rank 1: y"
    )
    assert watchdog._one_line("x" * 500, 10) == "x" * 9 + "…"


def test_a_rank_between_steps_while_a_peer_waits_at_exit_is_a_laggard():
    views = {0: (rec(2, since=61.0), 0.0), 1: (rec(2, state="exiting", since=61.0), 0.0)}
    v = decide(views, 2, CONFIG)
    assert (v.rank, v.cause) == (0, "stuck")
    assert v.message.endswith("for 61 s while rank 1 waits at exit")


# ------------------------------------------------------------------ one process
def test_one_process_start_is_a_logged_no_op(caplog):
    assert not _coordination.available()
    with caplog.at_level(logging.DEBUG, logger="jfleet"):
        watchdog.start()
    assert watchdog._wd is None
    assert "one process (no coordination service); watchdog off" in caplog.text
    watchdog.step_started("train")
    watchdog.step_dispatched("train", jnp.zeros(()))


def test_start_checks_the_variables_even_in_one_process(monkeypatch):
    monkeypatch.setenv("JFLEET_STEP_TIMEOUT", "-1")
    with pytest.raises(ValueError, match=r"JFLEET_STEP_TIMEOUT='-1' is not a positive number"):
        watchdog.start()


def test_the_hooks_cost_well_under_a_microsecond_each_in_one_process():
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        watchdog.step_started("train")
        watchdog.step_dispatched("train", None)
    per_pair_us = (time.perf_counter() - t0) / n * 1e6
    assert per_pair_us < 5, per_pair_us


# ------------------------------------------------------------------ one process's watchdog
class _ExitedError(Exception):
    pass


@pytest.fixture
def store(monkeypatch):
    """An in-memory key-value store in place of the coordination service."""
    kv: dict = {}
    monkeypatch.setattr(_coordination, "put", lambda k, v: kv.__setitem__(k, v))
    monkeypatch.setattr(_coordination, "try_get", lambda k: kv.get(k))
    monkeypatch.setattr(
        _coordination,
        "get_dir",
        lambda p: {k[len(p) :]: v for k, v in kv.items() if k.startswith(p)},
    )

    def fake_exit(code):
        raise _ExitedError(code)

    monkeypatch.setattr(watchdog, "_exit", fake_exit)
    monkeypatch.setattr(watchdog, "_wd", None)
    return kv


def _dog(rank=0, num=2):
    return watchdog._Watchdog(rank, num, CONFIG)


def test_the_hooks_count_steps_and_their_completion(store, monkeypatch):
    wd = _dog()
    monkeypatch.setattr(watchdog, "_wd", wd)
    watchdog.step_started("train")
    assert (wd.started, wd.dispatched, wd.in_engine) == (1, 0, True)
    watchdog.step_dispatched("train", {"loss": jnp.ones(()) * 2})
    wd._poll_outputs()
    assert (wd.started, wd.dispatched, wd.done, wd.in_engine) == (1, 1, 1, False)

    class Pending:
        def is_ready(self):
            return False

    watchdog.step_started("eval")
    watchdog.step_dispatched("eval", Pending())
    wd._poll_outputs()
    assert (wd.done, phase(wd.record())) == (1, "in step 2 (eval)")
    # the consistency checks' progress rides in the heartbeat (jfleet.consistency registers it)
    assert wd.record()["batch_progress"] == consistency.batch_progress()


def test_the_multiprocess_hooks_cost_microseconds(store, monkeypatch):
    wd = _dog()
    monkeypatch.setattr(watchdog, "_wd", wd)
    n, loss = 5000, jnp.ones(())
    t0 = time.perf_counter()
    for _ in range(n):
        watchdog.step_started("train")
        watchdog.step_dispatched("train", loss)
        wd.pending.clear()
    per_pair_us = (time.perf_counter() - t0) / n * 1e6
    assert per_pair_us < 50, per_pair_us


def test_a_lost_peer_raises_at_the_next_hook(store, monkeypatch):
    wd = _dog()
    monkeypatch.setattr(watchdog, "_wd", wd)
    wd.verdict = Verdict(1, "lost", "rank 1 (host h, pid 7) stopped sending heartbeats")
    with pytest.raises(
        PeerFailedError, match=r"^jfleet.watchdog: rank 1 \(host h, pid 7\) stopped"
    ):
        watchdog.step_started("train")
    watchdog.step_started("train")  # raised once


@pytest.mark.parametrize("rank", [1, 0])
def test_a_lost_peer_is_raised_asynchronously_in_a_thread_running_python(store, rank):
    wd = _dog(rank=rank, num=3)
    store["watchdog/rank/1"] = rec(2)  # a live peer (fresh record)
    caught = []
    ready = threading.Event()

    def worker():
        try:
            ready.set()
            while True:
                time.sleep(0.01)  # a user's loop waiting in Python
        except PeerFailedError as e:
            caught.append(str(e))

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    ready.wait()
    wd.main_ident = t.ident
    lost = Verdict(2, "lost", "rank 2 stopped sending heartbeats")
    wd.on_abort(lost)
    if rank == 0:  # the service's host holds it back while a peer still runs
        wd.on_abort(lost)
        time.sleep(0.1)
        assert caught == [] and wd.hold
        store["watchdog/rank/1"] = rec(2, state="aborted")
        wd.on_abort(lost)
    t.join(timeout=10)
    assert caught == ["jfleet.watchdog: rank 2 stopped sending heartbeats"]


def test_an_uncaught_exception_publishes_the_failure_and_the_abort(store, capsys):
    wd = _dog(rank=1)
    wd.started = wd.dispatched = wd.done = 2
    try:
        raise ValueError("boom")
    except ValueError as e:
        wd.excepthook(ValueError, e, e.__traceback__)
    message = "rank 1 failed (ValueError: boom) after step 2 (between steps)"
    assert store["watchdog/abort"] == {"rank": 1, "cause": "failed", "message": message, "by": 1}
    assert store["watchdog/rank/1"]["state"] == "failed"
    assert f"jfleet.watchdog: {message}; rank 1 stops" in capsys.readouterr().err
    with pytest.raises(_ExitedError, match="1"):  # at exit: os._exit(1), past JAX's barrier
        wd.at_exit()


def test_a_normal_exit_returns_once_every_rank_is_exiting(store):
    wd = _dog(rank=1)
    store["watchdog/rank/0"] = rec(3, state="exiting")
    t0 = time.monotonic()
    wd.at_exit()  # returns: JAX's shutdown follows
    assert time.monotonic() - t0 < 0.5 and wd.stopped
    assert store["watchdog/rank/1"]["state"] == "exiting"


def test_an_exit_during_an_abort_leaves_with_the_abort_code(store, capsys):
    wd = _dog(rank=1)
    store["watchdog/rank/0"] = rec(3, 2)
    store["watchdog/abort"] = {"rank": 1, "cause": "exited", "message": "rank 1 exited", "by": 0}
    with pytest.raises(_ExitedError, match=str(ABORT_EXIT_CODE)):
        wd.at_exit()
    assert "jfleet.watchdog: rank 1 exited; rank 1 stops" in capsys.readouterr().err


def test_process_0_judges_from_the_published_records(store):
    judge, early = _dog(rank=0), _dog(rank=1)
    judge.started = judge.dispatched = 3
    judge.done = 2
    judge.t_change -= EXIT_GRACE_S + 1
    early.started = early.dispatched = early.done = 2
    early.state = "exiting"
    early.t_change -= EXIT_GRACE_S + 1
    judge.publish()
    early.publish()
    v = judge.judge()
    assert v.message == "rank 1 exited after step 2 while rank 0 waits in step 3 (train)"
    assert judge.announce(v)["message"] == v.message
    other = Verdict(0, "stuck", "later")
    assert judge.announce(other)["message"] == v.message  # the first verdict stays


def test_a_main_thread_blocked_outside_python_is_ended_before_the_grace(store, monkeypatch, capsys):
    monkeypatch.setattr(watchdog, "BLOCKED_S", 0.2)
    wd = _dog(rank=1)
    release = threading.Event()

    def blocked():  # like float(loss) on a collective whose peer died: no bytecode runs
        with contextlib.suppress(PeerFailedError):
            release.wait()

    t = threading.Thread(target=blocked, daemon=True)
    t.start()
    time.sleep(0.05)
    wd.main_ident = t.ident
    lost = Verdict(0, "lost", "rank 0 stopped sending heartbeats")
    wd.on_abort(lost)  # delivered, but it waits in C
    wd.on_abort(lost)  # too soon to tell
    time.sleep(0.3)
    with pytest.raises(_ExitedError, match=str(ABORT_EXIT_CODE)):
        wd.on_abort(lost)
    assert "jfleet.watchdog: rank 0 stopped sending heartbeats; rank 1 stops" in (
        capsys.readouterr().err
    )
    release.set()
    t.join(timeout=5)


def test_a_malformed_record_is_logged_once_and_the_thread_keeps_beating(store, caplog):
    judge = _dog(rank=0)
    store["watchdog/rank/1"] = {"seq": 1, "state": "run"}  # fields missing
    with caplog.at_level(logging.ERROR, logger="jfleet"):
        assert judge.judge_and_announce() is None
        assert judge.judge_and_announce() is None
    assert caplog.text.count("could not judge the heartbeat records") == 1


def test_an_exception_after_another_ranks_fault_reports_that_fault(store, capsys):
    wd = _dog(rank=0)
    first = {"rank": 1, "cause": "failed", "message": "rank 1 failed (ValueError: x)", "by": 1}
    store["watchdog/abort"] = first
    try:
        raise RuntimeError("a collective failed because rank 1 left")
    except RuntimeError as e:
        wd.excepthook(RuntimeError, e, e.__traceback__)
    assert store["watchdog/abort"] == first and wd.state == "run"
    with pytest.raises(_ExitedError, match=str(ABORT_EXIT_CODE)):
        wd.at_exit()
    assert "jfleet.watchdog: rank 1 failed (ValueError: x); rank 0 stops" in capsys.readouterr().err

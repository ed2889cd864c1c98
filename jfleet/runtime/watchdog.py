"""The job watchdog: every fault ends the whole multi-process job quickly, naming the rank.

With several processes (``jax.distributed``), ``start()`` runs a daemon thread in each
process that publishes a heartbeat record about once a second through the coordination
service's key-value store (:mod:`jfleet.runtime.coordination`, keys
``jfleet/runtime/watchdog/...``): rank,
host, pid, steps started and completed (the engine calls :func:`step_started` at a step's
entry and :func:`step_dispatched` with its loss; the thread learns that the step completed
from ``loss.is_ready()``), and how long it has been in that state. Process 0 (which hosts the
service) reads every record and applies the rules below; the first verdict is written as an
*abort record* that every process polls (every 0.25 s). Rules:

- **exception**: an uncaught exception in the main thread (``sys.excepthook``, chained to the
  previous hook) makes that process publish the abort ("rank 1 failed (ValueError: boom)
  during step 3 (train)") and leave with exit code 1 through ``os._exit`` at interpreter exit,
  skipping JAX's shutdown barrier (which would wait for the peers). An exception in another
  thread (``threading.excepthook``) is only recorded and shown in later messages.
- **early exit**: a process that exits normally publishes "exiting after step N" and waits at
  exit until every process is exiting (the normal end; no added delay beyond a poll) or an
  abort. If a peer waits in a step that the exited process never ran for more than
  ``EXIT_GRACE_S``, the verdict names the exited rank ("rank 1 exited after step 2 while
  rank 0 waits in step 3 (train)").
- **stuck**: a process waits in step K (dispatched, not complete) while a peer has not
  started step K, both for more than ``$JFLEET_STEP_TIMEOUT`` seconds (the laggard is named
  with its phase, e.g. "between steps after step 2 (in Python: not in a jfleet step)"); or a
  dispatched step does not complete within ``$JFLEET_STEP_TIMEOUT`` and no rank is behind.
  Tracing and compiling (between :func:`step_started` and :func:`step_dispatched`) is not
  waiting: a long compile on every rank is never a fault, but a rank still preparing a step
  that a peer waits in is named after the timeout ("rank 1 has been preparing step 3"). The
  default, 1800 s, is for slow compiles, slow steps and long work between steps (evaluation,
  checkpoints). A process between steps while a peer waits at exit for longer than the
  timeout is a laggard too, and so is one that never reported (it initialised
  ``jax.distributed`` itself and has not reached ``fleet.init``).
- **peer lost**: a published record that stops changing for ``$JFLEET_PEER_TIMEOUT`` s (default
  30; capped by :attr:`Settings.peer_limit_s` so that the survivors are done before JAX's own
  heartbeat abort) means the peer was killed or froze. This verdict is *catchable*: each
  survivor raises :class:`PeerFailedError` in its main thread (at the next :func:`step_started` /
  :func:`step_dispatched`, or asynchronously when the main thread runs Python outside the
  engine, so a ``try/finally`` can log), which then has ``ABORT_GRACE_S`` to end (process 0
  gets it last, once the others are gone, as its exit takes the service along). A main
  thread blocked in a collective cannot receive it: once it has not moved for ``BLOCKED_S``,
  the watchdog ends the process.

On every verdict each process prints one line to stderr, ``jfleet.watchdog: <verdict>; rank
R stops``, and ends with exit code ``ABORT_EXIT_CODE`` (70) via ``os._exit`` (JAX's shutdown
would hang on the missing peer); a process that caught :class:`PeerFailedError` ends with the
same code when it exits (``os._exit(code)`` chooses another). Process 0 leaves last (up to
``ABORT_GRACE_S``) so the others read the verdict before the service goes.

Variables: ``JFLEET_STEP_TIMEOUT`` (s, default 1800), ``JFLEET_PEER_TIMEOUT`` (s, default 30),
``JFLEET_HEARTBEAT_TIMEOUT`` (JAX's, s, default 100; the one ``fleet.init`` passes) and
``JFLEET_WATCHDOG`` (1, the default, or 0 to turn the watchdog off).

Not covered: a killed process 0 takes the coordination service with it, and JAX's client then
aborts every peer at once (SIGABRT, "the JAX distributed service detected fatal errors"); its
``missed_heartbeat_callback`` cannot take a Python function in jaxlib 0.10.2. Process 0 judges,
so a frozen process 0 (its heartbeat thread starved) is left to JAX's heartbeat abort. A main
thread that holds the GIL for longer than the peer timeout (one long C call) looks frozen to
the peers. In a single process every function here returns at once (:func:`start` logs that
the watchdog is off).

Example:
  >>> step_started("train"); step_dispatched("train", None)
  >>> phase({"state": "run", "started": 3, "dispatched": 3, "done": 2, "kind": "train"})
  'in step 3 (train)'
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import dataclasses
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from jfleet.runtime import coordination as _coordination
from jfleet.runtime.env import seconds
from jfleet.runtime.log import logger

STEP_TIMEOUT_ENV = "JFLEET_STEP_TIMEOUT"
PEER_TIMEOUT_ENV = "JFLEET_PEER_TIMEOUT"
HEARTBEAT_TIMEOUT_ENV = "JFLEET_HEARTBEAT_TIMEOUT"
ENABLE_ENV = "JFLEET_WATCHDOG"
DEFAULT_STEP_TIMEOUT_S = 1800.0
DEFAULT_PEER_TIMEOUT_S = 30.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 100.0  # jax.distributed's default, as role_maker passes it
EXIT_GRACE_S = 3.0
ABORT_GRACE_S = 5.0
BLOCKED_S = 1.5  # a main thread unmoved this long after the delivery is blocked outside Python
ABORT_EXIT_CODE = 70
POLL_S = 0.25
HEARTBEAT_S = 1.0
STALE_S = 3 * HEARTBEAT_S  # a record older than this is not trusted for phases
_RECORDS = "watchdog/rank/"
_ABORT = "watchdog/abort"


_FIELDS: dict[str, Any] = {}  # extra heartbeat fields: name -> zero-argument function


def publish_field(name: str, value_fn: Any) -> None:
    """Adds ``name: value_fn()`` to this process's heartbeat record (a JSON value).

    Other modules use it to tell peers their progress cheaply (:mod:`jfleet.consistency`
    publishes how far its batch checks went); peers read it with :func:`peer_record`.

    Example:
      >>> publish_field("example", lambda: 1); _ = _FIELDS.pop("example")
    """
    _FIELDS[name] = value_fn


def peer_record(rank: int) -> dict | None:
    """Process ``rank``'s last heartbeat record, or None (none yet, or one process)."""
    record = _coordination.try_get(f"{_RECORDS}{rank}")
    return record if isinstance(record, dict) else None


class PeerFailedError(RuntimeError):
    """A peer process died or stopped responding; raised in each survivor's main thread.

    Example:
      >>> issubclass(PeerFailedError, RuntimeError)  # try / finally sees it on the survivors
      True
    """


@dataclasses.dataclass(frozen=True)
class Settings:
    """The watchdog's timeouts in seconds and its switch (see the module docstring).

    Example:
      >>> Settings(step_timeout_s=60, peer_timeout_s=10, heartbeat_timeout_s=100).peer_limit_s
      10
    """

    step_timeout_s: float
    peer_timeout_s: float
    heartbeat_timeout_s: float
    enabled: bool = True

    @property
    def peer_limit_s(self) -> float:
        """The peer timeout in effect, capped so that the survivors are done before JAX's
        heartbeat abort (seen from 3/4 of the heartbeat timeout on): detection, then up to
        ``ABORT_GRACE_S`` for a caught :class:`PeerFailedError`, then a poll."""
        hb = self.heartbeat_timeout_s
        return max(1.0, min(self.peer_timeout_s, hb / 2, 0.75 * hb - ABORT_GRACE_S - 1))


def settings(env: Mapping[str, str] | None = None) -> Settings:
    """The timeouts from ``$JFLEET_STEP_TIMEOUT``, ``$JFLEET_PEER_TIMEOUT`` and
    ``$JFLEET_HEARTBEAT_TIMEOUT``, and ``$JFLEET_WATCHDOG`` (1: on, 0: off), or from ``env``.

    Raises:
      ValueError: a timeout is not a positive number, or ``$JFLEET_WATCHDOG`` is not 0 or 1.

    Example:
      >>> settings({"JFLEET_STEP_TIMEOUT": "60"}).step_timeout_s
      60.0
    """
    env = os.environ if env is None else env
    switch = env.get(ENABLE_ENV, "1")
    if switch not in ("0", "1"):
        raise ValueError(
            f"{ENABLE_ENV}={switch!r} is neither '1' (the watchdog on, the default) nor '0' "
            "(off); set one of the two."
        )
    return Settings(
        enabled=switch == "1",
        step_timeout_s=seconds(STEP_TIMEOUT_ENV, DEFAULT_STEP_TIMEOUT_S, env=env),
        peer_timeout_s=seconds(PEER_TIMEOUT_ENV, DEFAULT_PEER_TIMEOUT_S, env=env),
        heartbeat_timeout_s=seconds(HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S, env=env),
    )


def phase(record: Mapping[str, Any]) -> str:
    """What a process was doing, from its heartbeat record, in words.

    Example:
      >>> phase({"state": "run", "started": 2, "dispatched": 2, "done": 2, "kind": "train"})
      'between steps after step 2 (in Python: not in a jfleet step)'
    """
    state, started, done = record["state"], record["started"], record["done"]
    if state == "exiting":
        return f"exiting after step {done}"
    if started > record["dispatched"]:
        return f"preparing step {started} ({record['kind']}: tracing or compiling)"
    if started > done:
        return f"in step {done + 1} ({record['kind']})"
    if done == 0:
        return "before its first step (in Python: not in a jfleet step)"
    return f"between steps after step {done} (in Python: not in a jfleet step)"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Why the job stops: the rank at fault, the cause and the message every process prints."""

    rank: int
    cause: str  # "failed" | "lost" | "exited" | "stuck"
    message: str

    @property
    def catchable(self) -> bool:
        """Whether survivors raise :class:`PeerFailedError` before exiting."""
        return self.cause == "lost"


def _thread_note(rec: Mapping[str, Any]) -> str:
    return f" (its thread died: {rec['thread_error']})" if rec.get("thread_error") else ""


def decide(
    views: Mapping[int, tuple[Mapping[str, Any] | None, float]],
    num_processes: int,
    config: Settings,
) -> Verdict | None:
    """The verdict on the job from each rank's latest record and its age, or None if healthy.

    ``views[rank] = (record, age_s)``: the record last read (None if never seen) and the
    seconds since it last changed, on the caller's clock. Pure: the unit tests call it.

    Example:
      >>> rec = {"state": "run", "started": 1, "dispatched": 1, "done": 1, "kind": "train",
      ...        "since": 0.0}
      >>> decide({0: (rec, 0.0), 1: (rec, 0.5)}, 2, settings({})) is None
      True
    """
    recs = {r: v[0] for r, v in views.items() if v[0] is not None}
    age = {r: v[1] for r, v in views.items()}
    for r, rec in sorted(recs.items()):
        if rec["state"] == "failed":
            return Verdict(r, "failed", f"rank {r} failed ({rec['error']}) {_during(rec)}")
    for r, rec in sorted(recs.items()):
        if rec["state"] not in ("exiting", "aborted") and age[r] > config.peer_limit_s:
            return Verdict(
                r,
                "lost",
                f"rank {r} (host {rec['host']}, pid {rec['pid']}) stopped sending heartbeats "
                f"{age[r]:.0f} s ago (killed or frozen; {PEER_TIMEOUT_ENV}="
                f"{config.peer_limit_s:g}); its last report: {phase(rec)}",
            )
    # A rank that never reported has not started its watchdog (not reached fleet.init yet, if
    # it initialised jax.distributed itself; one that died is JAX's to report): behind all.
    missing = [r for r in range(num_processes) if r not in recs]
    elapsed = {r: rec["since"] + age[r] for r, rec in recs.items()}
    # Waiting: a dispatched step not complete. Preparing one (tracing, compiling) is not.
    waiting = sorted(
        r for r, rec in recs.items() if rec["state"] == "run" and rec["dispatched"] > rec["done"]
    )
    exited = sorted(r for r, rec in recs.items() if rec["state"] == "exiting")
    for w in waiting:
        step = recs[w]["done"] + 1
        where = f"waits in step {step} ({recs[w]['kind']})"
        for e in exited:
            if recs[e]["done"] < step and min(elapsed[w], elapsed[e]) > EXIT_GRACE_S:
                msg = f"rank {e} exited after step {recs[e]['done']} while rank {w} {where}"
                return Verdict(e, "exited", msg)
        behind = [r for r, rec in recs.items() if rec["state"] == "run" and rec["started"] < step]
        # A laggard whose record is stale is left to the heartbeat rule above.
        fresh = [r for r in behind if age[r] <= STALE_S]
        if fresh:
            lag = max(fresh, key=lambda r: (elapsed[r], -r))
            if min(elapsed[lag], elapsed[w]) > config.step_timeout_s:  # both for that long
                msg = _laggard(lag, recs[lag], elapsed[lag], f"rank {w} {where}")
                return Verdict(lag, "stuck", msg)
        for m in missing:
            if min(age.get(m, 0.0), elapsed[w]) > config.step_timeout_s:
                msg = (
                    f"rank {m} has not started its watchdog for {age.get(m, 0.0):.0f} s (has it "
                    f"reached fleet.init?) while rank {w} {where}"
                )
                return Verdict(m, "stuck", msg)
        if behind or missing:
            continue
        # A rank still preparing this step (a slow trace or compile, or a check that waits)
        # keeps the waiter waiting: named once both have been at it for the timeout.
        preparing = [
            r
            for r, rec in recs.items()
            if rec["state"] == "run"
            and rec["dispatched"] < step <= rec["started"]
            and age[r] <= STALE_S
        ]
        for p in sorted(preparing, key=lambda r: (-elapsed[r], r)):
            if min(elapsed[p], elapsed[w]) > config.step_timeout_s:
                msg = _laggard(p, recs[p], elapsed[p], f"rank {w} {where}")
                return Verdict(p, "stuck", msg)
        if elapsed[w] > config.step_timeout_s:
            return Verdict(
                w,
                "stuck",
                f"rank {w} has been {phase(recs[w])} for {elapsed[w]:.0f} s "
                f"({STEP_TIMEOUT_ENV}={config.step_timeout_s:g}) and no rank is behind it: the "
                f"step makes no progress (a hung collective?){_thread_note(recs[w])}",
            )
    for e in exited:
        for lag, rec in sorted(recs.items()):
            fresh = rec["state"] == "run" and age[lag] <= STALE_S
            if fresh and min(elapsed[lag], elapsed[e]) > config.step_timeout_s:
                return Verdict(
                    lag, "stuck", _laggard(lag, rec, elapsed[lag], f"rank {e} waits at exit")
                )
    return None


def _in_step(rec: Mapping[str, Any]) -> bool:
    return rec["started"] > rec["done"]


def _during(rec: Mapping[str, Any]) -> str:
    if _in_step(rec):
        return f"during step {rec['done'] + 1} ({rec['kind']})"
    return f"after step {rec['done']} (between steps)"


def _laggard(rank: int, rec: Mapping[str, Any], elapsed: float, waiter: str) -> str:
    return (
        f"rank {rank} has been {phase(rec)} for {elapsed:.0f} s while {waiter}{_thread_note(rec)}"
    )


class _Watchdog:
    """This process's progress, its heartbeat thread, and its exit hooks."""

    def __init__(self, rank: int, num: int, config: Settings) -> None:
        self.rank, self.num, self.config = rank, num, config
        self.started = self.dispatched = self.done = 0
        self.kind = "train"
        self.state = "run"  # run | exiting | failed | aborted
        self.error: str | None = None
        self.thread_error: str | None = None
        self.t_change = time.monotonic()
        self.pending: collections.deque = collections.deque()  # (step number, outputs)
        self.in_engine = False
        self.verdict: Verdict | None = None
        self.delivered: PeerFailedError | None = None
        self.t_abort = self.t_failed = 0.0
        self.mark: tuple | None = None
        self.judge_failed = False
        self.hold = False  # process 0 holds a catchable error back until the others are gone
        self.dying = threading.Lock()
        self.outputs_lock = threading.Lock()
        self.seq = 0
        self.stopped = False
        self.lock = threading.Lock()  # held around every key-value call
        self.seen: dict[int, tuple[Any, float]] = {}  # rank -> (seq, monotonic time seen)
        self.t_start = time.monotonic()
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.main_ident = threading.main_thread().ident

    # --- progress (main thread) ---
    def progress(self) -> None:
        self.t_change = time.monotonic()

    def record(self) -> dict:
        self.seq += 1
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "seq": self.seq,
            "state": self.state,
            "started": self.started,
            "dispatched": self.dispatched,
            "done": self.done,
            "kind": self.kind,
            "since": round(time.monotonic() - self.t_change, 3),
            "error": self.error,
            "thread_error": self.thread_error,
            **{name: fn() for name, fn in _FIELDS.items()},
        }

    # --- the thread ---
    def run(self) -> None:
        last_beat, last = 0.0, None
        while not self.stopped:
            self._poll_outputs()
            if self.state == "failed" and time.monotonic() - self.t_failed > ABORT_GRACE_S:
                _exit(1)  # the failing process did not reach its exit hook in time
            now = time.monotonic()
            with self.lock:
                if self.stopped:
                    return
                current = (self.state, self.started, self.dispatched, self.done)
                if now - last_beat >= HEARTBEAT_S or current != last:
                    try:
                        self.publish()  # at least once a second, and at each change
                    except Exception as e:  # the service is gone: process 0 died
                        unreachable = f"the coordination service (process 0) is unreachable ({e})"
                        self.die(_one_line(unreachable), "lost")
                    last_beat, last = now, current
                abort = _coordination.try_get(_ABORT)
                if abort is None and self.rank == 0:
                    abort = self.judge_and_announce()
            if abort is not None:
                self.on_abort(Verdict(abort["rank"], abort["cause"], abort["message"]))
            time.sleep(POLL_S)

    def judge_and_announce(self) -> dict | None:
        """Process 0's turn: the abort record of a new verdict, if any."""
        try:
            verdict = self.judge()
            return None if verdict is None else self.announce(verdict)
        except Exception:  # a malformed record must not kill the heartbeat thread
            if not self.judge_failed:
                logger.exception("jfleet.watchdog: could not judge the heartbeat records")
            self.judge_failed = True
            return None

    def _poll_outputs(self) -> None:
        """Counts the dispatched steps whose outputs are ready as done."""
        with self.outputs_lock:
            while self.pending:
                step, outputs = self.pending[0]
                try:
                    ready = all(x.is_ready() for x in _arrays(outputs))
                except Exception:  # deleted or not an array: count it as done
                    ready = True
                if not ready:
                    return
                self.pending.popleft()
                self.done = max(self.done, step)
                self.progress()

    def settle(self, timeout_s: float = 0.5) -> None:
        """Waits up to ``timeout_s`` for the dispatched steps to complete (exact step counts in
        the messages: a replicated loss reads on one device before all its copies are ready)."""
        deadline = time.monotonic() + timeout_s
        self._poll_outputs()
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.01)
            self._poll_outputs()

    def publish(self) -> None:
        _coordination.put(f"{_RECORDS}{self.rank}", self.record())

    def views(self) -> dict[int, tuple[dict | None, float]]:
        now = time.monotonic()
        records = {int(k): v for k, v in _coordination.get_dir(_RECORDS).items()}
        out: dict[int, tuple[dict | None, float]] = {}
        for r in range(self.num):
            rec = records.get(r)
            key = None if rec is None else rec["seq"]
            old = self.seen.get(r)
            if old is None or old[0] != key:
                self.seen[r] = (key, self.t_start if rec is None else now)
            out[r] = (rec, now - self.seen[r][1])
        return out

    def judge(self) -> Verdict | None:
        return decide(self.views(), self.num, self.config)

    def announce(self, verdict: Verdict) -> dict:
        """Writes the abort record unless one exists; returns the one in force."""
        current = _coordination.try_get(_ABORT)
        if current is not None:
            return current
        abort = {"rank": verdict.rank, "cause": verdict.cause, "message": verdict.message}
        abort["by"] = self.rank
        _coordination.put(_ABORT, abort)
        return abort

    def on_abort(self, verdict: Verdict) -> None:
        if self.verdict is None:
            self.verdict = verdict
            if verdict.catchable and self.state == "run":
                self.t_abort = time.monotonic()
                # Process 0 hosts the service: its script may end as soon as it has the error,
                # so it gets it once the others are gone (or after the grace).
                self.hold = self.rank == 0
                if not self.hold:
                    self.mark = self.main_mark()
                    self.deliver()
                return
        if self.state == "failed":
            return  # this process is the cause; it leaves through its own exit path
        if self.hold and self.state == "run":
            if self.peers_gone() or time.monotonic() - self.t_abort > ABORT_GRACE_S:
                self.hold = False
                self.t_abort, self.mark = time.monotonic(), self.main_mark()
                self.deliver()
            return
        waited = time.monotonic() - self.t_abort
        # A main thread that has not moved since the delivery is blocked outside Python (in a
        # collective, say): it will not see the exception, so it need not get the whole grace.
        blocked = self.delivered is not None and self.main_mark() == self.mark
        if not verdict.catchable or waited > ABORT_GRACE_S or (blocked and waited > BLOCKED_S):
            self.die(verdict.message, verdict.cause)

    def main_mark(self) -> tuple | None:
        """Where the main thread is in Python (changes whenever it runs bytecode)."""
        frame = sys._current_frames().get(self.main_ident)
        return None if frame is None else (id(frame), frame.f_lasti)

    def error_for(self, verdict: Verdict) -> PeerFailedError:
        return PeerFailedError(f"jfleet.watchdog: {verdict.message}")

    def deliver(self) -> None:
        """Raises PeerFailedError in the main thread unless it is inside the engine's step."""
        if self.in_engine or self.verdict is None or self.delivered is not None:
            return
        err = self.error_for(self.verdict)
        message = str(err)

        class _DeliveredError(PeerFailedError):
            def __init__(self, *args: Any) -> None:
                super().__init__(*(args or (message,)))

        _DeliveredError.__name__ = _DeliveredError.__qualname__ = "PeerFailedError"
        self.delivered = err
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(self.main_ident), ctypes.py_object(_DeliveredError)
        )

    def die(self, message: str, cause: str, code: int = ABORT_EXIT_CODE) -> None:
        """Prints the verdict line and ends the process (process 0 last)."""
        self.dying.acquire()  # one thread prints and exits; another waits here for it
        _say(f"jfleet.watchdog: {message}; rank {self.rank} stops")
        if self.state != "failed":
            self.state = "aborted"
        try:
            self.publish()
            if self.rank == 0:
                self.wait_for_peers_to_leave()
        except Exception:
            pass
        _exit(code)

    def peers_gone(self) -> bool:
        """Whether every other process has left (or failed, or gone silent)."""
        return all(
            rec is None or rec["state"] in ("aborted", "failed") or age > STALE_S
            for r, (rec, age) in self.views().items()
            if r != self.rank
        )

    def wait_for_peers_to_leave(self) -> None:
        deadline = time.monotonic() + ABORT_GRACE_S
        while time.monotonic() < deadline and not self.peers_gone():
            time.sleep(POLL_S / 2)

    # --- exit paths (main thread) ---
    def excepthook(self, exc_type, exc, tb) -> None:
        if isinstance(exc, PeerFailedError) or self.verdict is not None:
            return
        with contextlib.suppress(Exception):
            earlier = _coordination.try_get(_ABORT)
            if earlier is not None:  # a consequence of an earlier fault (not yet polled)
                self.verdict = Verdict(earlier["rank"], earlier["cause"], earlier["message"])
                return
        self.settle()
        self.error = _one_line(f"{exc_type.__name__}: {exc}")
        self.state = "failed"
        self.t_failed = time.monotonic()
        message = f"rank {self.rank} failed ({self.error}) {_during(self.record())}"
        _say(f"jfleet.watchdog: {message}; rank {self.rank} stops")
        self.verdict = Verdict(self.rank, "failed", message)
        try:
            with self.lock:
                self.publish()
                self.announce(self.verdict)
        except Exception:
            pass

    def at_exit(self) -> None:
        if self.state == "failed":
            with self.lock:
                self.stopped = True
            if self.rank == 0:
                self.wait_for_peers_to_leave()
            _exit(1)
        if self.verdict is not None:
            self.die(self.verdict.message, self.verdict.cause)
        self.settle()
        self.state = "exiting"
        self.progress()
        while True:
            self._poll_outputs()
            with self.lock:
                try:
                    self.publish()
                    abort = _coordination.try_get(_ABORT)
                    views = self.views()
                except Exception as e:
                    self.die(f"the coordination service (process 0) is unreachable ({e})", "lost")
                if abort is None and all(
                    rec is not None and rec["state"] == "exiting" for rec, _ in views.values()
                ):
                    self.stopped = True  # JAX's shutdown follows: no more key-value calls
                    return
            if abort is not None:
                self.die(abort["message"], abort["cause"])
            time.sleep(POLL_S / 2)


def _one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line (an exception's message may span several), at most ``limit`` chars."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _arrays(outputs: Any) -> list:
    import jax

    return [x for x in jax.tree.leaves(outputs) if hasattr(x, "is_ready")]


def _say(line: str) -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def _exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


_wd: _Watchdog | None = None


def start(*, heartbeat_timeout_s: float | None = None) -> None:
    """Starts watching this multi-process job (``initialize_distributed`` calls it).

    Idempotent. Without a coordination service (one process) it logs that the watchdog is
    off and returns.

    Args:
      heartbeat_timeout_s: JAX's heartbeat timeout for this job, if known; default
        ``$JFLEET_HEARTBEAT_TIMEOUT`` or 100. The peer timeout is capped below it.

    Raises:
      ValueError: a ``JFLEET_*_TIMEOUT`` variable is not a positive number, or
        ``$JFLEET_WATCHDOG`` is neither 0 nor 1.
    """
    global _wd
    config = settings()
    if heartbeat_timeout_s is not None:
        config = dataclasses.replace(config, heartbeat_timeout_s=float(heartbeat_timeout_s))
    if _wd is not None:
        return
    if not _coordination.available():
        logger.debug("jfleet.watchdog: one process (no coordination service); watchdog off.")
        return
    if not config.enabled:
        logger.info("jfleet.watchdog: off (%s=0); faults may leave the job hanging.", ENABLE_ENV)
        return
    import jax

    wd = _Watchdog(jax.process_index(), jax.process_count(), config)
    if config.peer_limit_s < config.peer_timeout_s:
        logger.warning(
            "%s=%g is too close to %s=%g; the watchdog uses %g s so that it acts "
            "before JAX's heartbeat abort.",
            PEER_TIMEOUT_ENV,
            config.peer_timeout_s,
            HEARTBEAT_TIMEOUT_ENV,
            config.heartbeat_timeout_s,
            config.peer_limit_s,
        )
    wd.publish()
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        previous_hook(exc_type, exc, tb)
        wd.excepthook(exc_type, exc, tb)

    previous_thread_hook = threading.excepthook

    def thread_hook(args):
        previous_thread_hook(args)
        name = args.thread.name if args.thread is not None else "?"
        wd.thread_error = _one_line(f"{name}: {args.exc_type.__name__}: {args.exc_value}", 200)

    sys.excepthook, threading.excepthook = excepthook, thread_hook
    atexit.register(wd.at_exit)  # after jax's clean_up, so it runs first
    threading.Thread(target=wd.run, name="jfleet-watchdog", daemon=True).start()
    _wd = wd
    logger.info(
        "jfleet.watchdog: watching %d processes (step timeout %g s, peer timeout %g s).",
        wd.num,
        config.step_timeout_s,
        config.peer_limit_s,
    )


def step_started(kind: str) -> None:
    """The engine is about to prepare and dispatch a ``kind`` ("train" / "eval") step.

    Raises:
      PeerFailedError: a peer died (the watchdog's verdict is pending in this process).
    """
    wd = _wd
    if wd is None:
        return
    if wd.verdict is not None and wd.verdict.catchable and not wd.hold and wd.delivered is None:
        wd.delivered = wd.error_for(wd.verdict)
        raise wd.delivered
    wd.started += 1
    wd.kind = kind
    wd.in_engine = True
    wd.progress()


def step_dispatched(kind: str, outputs: Any) -> None:
    """The engine dispatched a ``kind`` step whose results are ``outputs`` (arrays).

    Raises:
      PeerFailedError: a peer died (raised after the step's outputs are installed).
    """
    wd = _wd
    if wd is None:
        return
    wd.pending.append((wd.started, outputs))
    wd.dispatched = wd.started
    wd.progress()
    wd.in_engine = False
    if wd.verdict is not None and wd.verdict.catchable and not wd.hold and wd.delivered is None:
        wd.delivered = wd.error_for(wd.verdict)
        raise wd.delivered

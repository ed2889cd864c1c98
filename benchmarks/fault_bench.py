"""Faults in a 2-process job: the time from each fault to the last process's exit.

Run from the repository root (about 2 minutes on 2 cores; jobs run one after another)::

    python benchmarks/fault_bench.py             # prints the table, writes RESULTS.md
    python benchmarks/fault_bench.py --no-write --only exception,kill

Each job is 2 processes x 2 CPU devices (``fleet.init`` with dp4 through the ``PADDLE_*``
variables) training ``TinyLM(vocab=16, width=8, hidden=8)``; rank 1 injects the fault before
its third step (or at start-up). For every fault of issue 14 the table gives each process's
exit code, the time from the fault (printed by the child as ``FAULT_AT <time.time()>``, or the
launch for faults at start-up) to the last process's exit, and each process's first line
naming the cause. The watchdog's timeouts are set low through ``JFLEET_*`` variables (in the
table's header). ``tests/test_watchdog_multiprocess.py`` runs the same jobs with a deadline.

The last three faults (a rank that never starts, mismatched strategies and batch shapes) are
caught by :mod:`jfleet.consistency` and the start-up timer of :mod:`jfleet.role_maker`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_file import write_section  # noqa: E402
from tests.subprocess_util import child_env, free_port  # noqa: E402

SECTION = "fault_bench"
TIMEOUTS = {
    "JFLEET_HEARTBEAT_TIMEOUT": "20",
    "JFLEET_PEER_TIMEOUT": "5",
    "JFLEET_STEP_TIMEOUT": "8",
    "JFLEET_INIT_TIMEOUT": "10",
    "JFLEET_CONSISTENCY_TIMEOUT": "5",
}

CHILD = """
import inspect, os, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 2)
import optax
import jfleet.training.engine
from jfleet import fleet
from jfleet.runtime import watchdog
from jfleet.models import TinyLM, lm_batches, lm_loss

rank = int(os.environ["PADDLE_TRAINER_ID"])
fault = os.environ["FAULT"] if rank == int(os.environ.get("FAULT_RANK", "1")) else "none"
blocking = os.environ.get("WAIT", "block") == "block"
strategy = fleet.DistributedStrategy()
if fault == "strategies":
    strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 2}
    print("FAULT_AT", repr(time.time()), flush=True)
else:
    strategy.hybrid_configs = {"dp_degree": 4}
fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
watchdog.start()  # idempotent: fleet.init may have started it
hooks = "watchdog" not in inspect.getsource(jfleet.engine)  # the engine calls them itself
model = fleet.distributed_model(TinyLM(vocab=16, width=8, hidden=8))
opt = fleet.distributed_optimizer(optax.sgd(0.1))


def inject():
    print("FAULT_AT", repr(time.time()), flush=True)
    if fault == "exception":
        raise ValueError("injected fault")
    if fault == "exit":
        sys.exit(0)
    if fault == "stuck":
        time.sleep(1000)
    if fault == "kill":
        os.kill(os.getpid(), 9)


fleet.barrier_worker()
try:
    for step, batch in enumerate(lm_batches(int(os.environ["STEPS"]), batch=8, seq=8, vocab=16)):
        local = {k: v[rank * 4 : (rank + 1) * 4, :4] for k, v in batch.items()}
        if step == 2 and fault == "batch_shapes":
            print("FAULT_AT", repr(time.time()), flush=True)
            local = {k: v[rank * 4 : (rank + 1) * 4] for k, v in batch.items()}
        elif step == 2 and fault != "none":
            inject()
        if hooks:
            watchdog.step_started("train")
        loss = model.train_batch(local, opt, loss_fn=lm_loss)
        if hooks:
            watchdog.step_dispatched("train", loss)
        if not blocking:  # wait in Python, where a PeerFailedError can arrive
            while not loss.is_ready():
                time.sleep(0.02)
        print("LOSS", rank, step, float(loss), flush=True)
except watchdog.PeerFailedError as e:
    print("CAUGHT", type(e).__name__ + ":", e, flush=True)
    sys.stdout.flush()
    os._exit(17)
print("DONE_AT", repr(time.time()), flush=True)
"""


NOTES = """\
What sets each time (`jfleet/runtime/watchdog.py`): an exception, about one poll of the abort record
(0.25 s); an early exit, the grace a waiting peer gets (`EXIT_GRACE_S` = 3 s); a hang,
`JFLEET_STEP_TIMEOUT`; a killed peer, `JFLEET_PEER_TIMEOUT`, then 1.5 s for a main thread
blocked in a collective (which cannot receive `PeerFailedError`) or the script's own handler.
Rank 0 killed takes the coordination service along: JAX's client aborts rank 1 at once
(SIGABRT, its own message), before any Python code can run. The last three rows are
`jfleet.consistency`'s checks; their errors reach the peer through the watchdog. On main
before issue 14 the exception, early-exit, hang and strategy rows each hung for 81-233 s."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One job: what rank 1 does, which ranks start, and the extra environment."""

    title: str
    fault: str
    ranks: tuple[int, ...] = (0, 1)
    steps: int = 6
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)


SCENARIOS = {
    "none": Scenario("no fault (3 steps each, then exit)", "none", steps=3),
    "none_off": Scenario(
        "no fault, watchdog off (`JFLEET_WATCHDOG=0`)",
        "none",
        steps=3,
        env={"JFLEET_WATCHDOG": "0"},
    ),
    "exception": Scenario("rank 1 raises ValueError", "exception"),
    "exit": Scenario("rank 1 exits early (code 0)", "exit"),
    "stuck": Scenario("rank 1 stuck in Python (sleep)", "stuck"),
    "kill": Scenario("rank 1 killed (SIGKILL); rank 0 blocked in `float(loss)`", "kill"),
    "kill_poll": Scenario(
        "rank 1 killed (SIGKILL); rank 0 waits in Python", "kill", env={"WAIT": "poll"}
    ),
    "exception0": Scenario(
        "rank 0 (the coordinator) raises ValueError", "exception", env={"FAULT_RANK": "0"}
    ),
    "exit0": Scenario("rank 0 exits early (code 0)", "exit", env={"FAULT_RANK": "0"}),
    "kill0": Scenario("rank 0 (the coordinator) killed (SIGKILL)", "kill", env={"FAULT_RANK": "0"}),
    "never_starts": Scenario("rank 1 never starts", "none", ranks=(0,)),
    "strategies": Scenario("mismatched strategies (dp4 vs dp2·mp2)", "strategies"),
    "batch_shapes": Scenario("mismatched batch shapes (seq 4 vs 8)", "batch_shapes"),
}


@dataclasses.dataclass
class Outcome:
    """How a job ended: per launched rank its exit code, output and exit time."""

    name: str
    codes: dict[int, int | None]
    stdout: dict[int, str]
    stderr: dict[int, str]
    fault_at: float | None
    exit_at: dict[int, float]
    timed_out: bool

    @property
    def fault_to_exit_s(self) -> float | None:
        """Seconds from the fault to the last exit (None if a process outlived the deadline)."""
        if self.timed_out or self.fault_at is None:
            return None
        return max(self.exit_at.values()) - self.fault_at

    @property
    def done_to_exit_s(self) -> float | None:
        """Seconds from the last ``DONE_AT`` (end of the script) to the last exit."""
        done = [float(m) for out in self.stdout.values() for m in re.findall(r"DONE_AT (\S+)", out)]
        return max(self.exit_at.values()) - max(done) if done and not self.timed_out else None

    def cause(self, rank: int) -> str:
        """The line of ``rank``'s output naming the cause: the watchdog's, the caught error,
        the uncaught exception's last line, or JAX's fatal error (first found, in that order).
        """
        lines = [ln.strip() for ln in (self.stderr[rank] + "\n" + self.stdout[rank]).splitlines()]
        for pattern in (
            r"^jfleet\.watchdog: ",
            r"^CAUGHT ",
            r"^jfleet\S*: ",
            r"^[\w.]*(Error|Exception|Interrupt)\b: ",
            r"^F\d+ .*\] ",  # absl's fatal log line
        ):
            found = [ln for ln in lines if re.search(pattern, ln)]
            if found:
                return found[0] if pattern.startswith("^jfleet") else found[-1]
        return ""


def run(
    names: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    deadline: float = 90.0,
    concurrent: bool = True,
) -> dict[str, Outcome]:
    """Runs the named scenarios (all at once, or one after another) and returns how each ended.

    Every process is started in its own session; any still running at ``deadline`` seconds
    after its job's launch is killed with its process group (``timed_out``).
    """
    if not concurrent:
        out: dict[str, Outcome] = {}
        for name in names:
            out.update(run([name], env=env, deadline=deadline))
        return out
    with contextlib.ExitStack() as stack:
        jobs = {}
        for name in names:
            sc = SCENARIOS[name]
            endpoints = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
            procs, files = {}, {}
            for rank in sc.ranks:
                extra = {
                    **TIMEOUTS,
                    **(env or {}),
                    **sc.env,
                    "PADDLE_TRAINER_ID": str(rank),
                    "PADDLE_TRAINERS_NUM": "2",
                    "PADDLE_TRAINER_ENDPOINTS": endpoints,
                    "PADDLE_CURRENT_ENDPOINT": endpoints.split(",")[rank],
                    "FAULT": sc.fault,
                    "STEPS": str(sc.steps),
                }
                # Files, not pipes: nobody reads while the jobs run, and a full pipe blocks.
                files[rank] = tuple(stack.enter_context(tempfile.TemporaryFile("w+")) for _ in "oe")
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-c", CHILD],
                    env=child_env(extra),
                    cwd=ROOT,
                    stdout=files[rank][0],
                    stderr=files[rank][1],
                    text=True,
                    start_new_session=True,
                )
            jobs[name] = (time.time(), procs, files)
        try:
            exit_at, timed_out = _wait(jobs, deadline)
        finally:  # never leave a process behind, even when interrupted
            for _, procs, _ in jobs.values():
                for p in procs.values():
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                        p.wait()
        outcomes = {}
        for name, (t0, procs, files) in jobs.items():
            texts = {rank: tuple(_read(f) for f in files[rank]) for rank in procs}
            stdout = {rank: t[0] for rank, t in texts.items()}
            faults = [
                float(m) for out in stdout.values() for m in re.findall(r"FAULT_AT (\S+)", out)
            ]
            fault_at = faults[0] if faults else (t0 if SCENARIOS[name].ranks != (0, 1) else None)
            outcomes[name] = Outcome(
                name=name,
                codes={rank: p.returncode for rank, p in procs.items()},
                stdout=stdout,
                stderr={rank: t[1] for rank, t in texts.items()},
                fault_at=fault_at,
                exit_at=exit_at[name],
                timed_out=name in timed_out,
            )
        return outcomes


def _wait(jobs: dict, deadline: float) -> tuple[dict[str, dict[int, float]], set[str]]:
    """Polls until every process ended; kills the groups of those past ``deadline``."""
    exit_at: dict[str, dict[int, float]] = {name: {} for name in jobs}
    timed_out: set[str] = set()
    while True:
        running = 0
        for name, (t0, procs, _) in jobs.items():
            for rank, p in procs.items():
                if rank in exit_at[name]:
                    continue
                if p.poll() is not None:
                    exit_at[name][rank] = time.time()
                elif time.time() - t0 > deadline:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    exit_at[name][rank] = time.time()
                    timed_out.add(name)
                else:
                    running += 1
        if not running:
            break
        time.sleep(0.02)
    return exit_at, timed_out


def _read(f) -> str:
    f.seek(0)
    return f.read()


def table(outcomes: Mapping[str, Outcome]) -> str:
    """The Markdown table of the outcomes, in the scenarios' order."""
    rows = [
        "| fault | exit codes (rank 0, rank 1) | fault → last exit (s) "
        "| rank 0 says | rank 1 says |",
        "|---|---|---|---|---|",
    ]
    for name, sc in SCENARIOS.items():
        if name not in outcomes:
            continue
        o = outcomes[name]
        codes = ", ".join(str(o.codes.get(r, "not started")) for r in (0, 1))
        if o.timed_out:
            secs = "> deadline (killed)"
        elif sc.fault == "none" and sc.ranks == (0, 1):
            secs = f"{o.done_to_exit_s:.1f} (end of script → exit)"
        else:
            secs = f"{o.fault_to_exit_s:.1f}"
        says = [o.cause(r).replace("|", "\\|")[:160] if r in o.codes else "" for r in (0, 1)]
        rows.append(f"| {sc.title} | {codes} | {secs} | {says[0]} | {says[1]} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--deadline", type=float, default=90.0)
    args = parser.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else SCENARIOS) if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    outcomes = run(names, deadline=args.deadline, concurrent=False)
    settings = ", ".join(f"{k}={v}" for k, v in TIMEOUTS.items())
    body = (
        f"## Faults in a 2-process job: time to the last exit\n\n"
        f"`python benchmarks/fault_bench.py` ({datetime.date.today()}; 2 processes x 2 CPU "
        f"devices, one job at a time; {settings}; exit code 70 = ended by the watchdog, "
        f"17 = the script caught `PeerFailedError` and chose it, -9 = the injected SIGKILL)\n\n"
        + table(outcomes)
        + "\n\n"
        + NOTES
    )
    print(body)
    if not args.no_write:
        write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

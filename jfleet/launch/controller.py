"""One node's launcher: meet the other nodes, start the workers, watch them, reap them.

:func:`run` is the whole life of a launcher: it serves the rendezvous when it is node 0
(:mod:`jfleet.launch.rendezvous`), registers this node with ports it holds
(:mod:`jfleet.launch.ports`), starts ``nproc_per_node`` workers with their environment
(:mod:`jfleet.launch.env`), each in its own process group with its output in
``log_dir/workerlog.<global rank>`` (the node's local rank 0 also echoed, ``[rank N]``),
and watches them:

- every worker exits 0 -> the node reports ``done``; when all nodes are done, exit 0;
- a worker exits non-zero or is killed -> the node reports the failure (rank, exit code
  or signal, the last lines of its log) and every node reaps its workers: SIGTERM to each
  process group, SIGKILL after :data:`GRACE_S` seconds (``$JFLEET_KILL_GRACE``); then
  the job restarts (up to ``--max_restart`` times, ``JFLEET_RESTART_COUNT`` counting) or
  every launcher exits with the failure's code (128 + signal for a killed worker);
- SIGINT / SIGTERM to a launcher -> forwarded to its workers, the job reaped everywhere
  and never restarted; exit 128 + signal.

A worker that exits 0 while others still run is not a failure. On Linux each worker has
SIGTERM as its parent-death signal: a launcher killed outright (SIGKILL, out of memory) takes
its workers with it, and the other nodes, which lose its connection, stop theirs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

from jfleet.launch.args import LaunchArgs
from jfleet.launch.auth import job_token
from jfleet.launch.cluster import Scheduler
from jfleet.launch.env import endpoints, global_rank, worker_env
from jfleet.launch.ports import HeldPort, hold_free_ports
from jfleet.launch.rendezvous import Node, RendezvousClient, RendezvousServer
from jfleet.launch.schema import MAX_TEXT
from jfleet.launch.wire import HandshakeError
from jfleet.runtime.env import seconds
from jfleet.runtime.startup import DEFAULT_INIT_TIMEOUT_S, INIT_TIMEOUT_ENV
from jfleet.runtime.watchdog import ABORT_EXIT_CODE

__all__ = ["GRACE_S", "TAIL_LINES", "exit_code_of", "grace_seconds", "run"]

#: Seconds between SIGTERM and SIGKILL when reaping workers (``$JFLEET_KILL_GRACE``).
GRACE_S = 10.0
GRACE_ENV = "JFLEET_KILL_GRACE"
#: Log lines of a failed worker printed by the launchers.
TAIL_LINES = 20
PREFIX = "[jfleet.launch]"
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*")
_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}


def exit_code_of(returncode: int) -> int:
    """A worker's return code as a shell reports it: ``-N`` (killed by signal N) -> 128 + N.

    Example:
      >>> exit_code_of(3), exit_code_of(-9)
      (3, 137)
    """
    return 128 - returncode if returncode < 0 else returncode


#: Runs a worker's command with SIGTERM as its parent-death signal (Linux): a launcher
#: that dies without reaping (SIGKILL, OOM) does not leave its workers running.
_ORPHAN_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"  # PR_SET_PDEATHSIG
    "sys.exit(143) if os.getppid() != int(sys.argv[1]) else None\n"  # died before prctl
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


def _guarded(command: list[str]) -> list[str]:
    """``command`` behind :data:`_ORPHAN_GUARD` on Linux (unchanged elsewhere)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", _ORPHAN_GUARD, str(os.getpid()), *command]


def grace_seconds(environ: dict[str, str] | os._Environ) -> float:
    """Seconds from SIGTERM to SIGKILL: ``$JFLEET_KILL_GRACE``, else :data:`GRACE_S`.

    Raises:
      ValueError: the variable is not a number >= 0.

    Example:
      >>> grace_seconds({}), grace_seconds({"JFLEET_KILL_GRACE": "60"})
      (10.0, 60.0)
    """
    return seconds(GRACE_ENV, GRACE_S, env=environ, allow_zero=True)


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {exit_code_of(returncode)})"
    return f"exited with code {returncode}"


class _Log:
    """The launcher's messages: ``[jfleet.launch]`` on stderr, and a file once it is known."""

    def __init__(self, level: str) -> None:
        self.level = _LEVELS[level]
        self._file: IO[str] | None = None
        self._early: list[str] = []

    def attach(self, path: Path) -> None:
        if self._file is None:
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            for line in self._early:
                self._file.write(line + "\n")
            self._file.flush()
            self._early = []

    def __call__(self, message: str, level: str = "INFO") -> None:
        if _LEVELS[level] < self.level:
            return
        stamp = time.strftime("%H:%M:%S")
        line = f"{PREFIX} {message}"
        print(line, file=sys.stderr, flush=True)
        if self._file is not None:
            self._file.write(f"{stamp} {level} {message}\n")
            self._file.flush()
        else:
            self._early.append(f"{stamp} {level} {message}")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


#: What Gloo's connection message is made of, written by several threads at once: when
#: they interleave, the pieces after the first ``[Gloo]`` of a line end up on lines of
#: their own (a bare ``3``: "... peer ranks is : 3").
_GLOO_PIECES = re.compile(
    rb"(?:\s|\d|Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :)+"
)


class ConsoleFilter:
    r"""A worker's output lines as the console shows them: Gloo's connection chatter (kept
    in the worker's log only) is cut, also where it follows a progress bar's unfinished
    line on the same stream, and so are the pieces of interleaved Gloo messages that land
    on lines of their own; ``None`` when nothing of a line is left. One filter per stream.

    Example:
      >>> shown = ConsoleFilter()
      >>> shown(b"[Gloo] Rank 0 is connected to 1 peer ranks.\n") is None
      True
      >>> shown(b"step 0%|  | 0/2\r[Gloo] Rank 0 is connected to 1 peer ranks.\n")
      b'step 0%|  | 0/2\n'
      >>> shown(b"[Gloo] Rank 0 is connected to 3 peer ranks. Expected ... is : [Gloo] Rank 1"
      ...       b" is connected to 3 peer ranks. Expected ... is : 3\n") is None
      True
      >>> shown(b"3\n") is None  # the end of rank 0's message
      True
      >>> shown(b"3\n")  # nothing of Gloo's is open: a line of the program's own
      b'3\n'
    """

    def __init__(self) -> None:
        self._open = 0  # Gloo messages begun whose line end has not been seen

    def __call__(self, line: bytes) -> bytes | None:
        at = line.find(b"[Gloo]")
        kept = line if at < 0 else line[:at].rstrip(b" \r\t") + b"\n"
        if at >= 0 and not kept.strip():
            kept = None
        elif self._open and _GLOO_PIECES.fullmatch(kept):
            kept = None  # pieces of messages begun on earlier lines
        # each line ends one message: begun on it or open from before
        self._open = max(0, self._open + line.count(b"[Gloo]") - 1)
        return kept


def _echo(stream: IO[bytes], log: IO[bytes], prefix: bytes) -> None:
    """Copies a worker's output to its log file and, prefixed, to the console (Gloo's
    connection chatter only to the file)."""
    console = ConsoleFilter()
    for line in iter(stream.readline, b""):
        log.write(line)
        log.flush()
        shown = console(line)
        if shown is None:
            continue
        sys.stdout.buffer.write(prefix + shown)
        sys.stdout.buffer.flush()
    stream.close()


@dataclasses.dataclass
class _Worker:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    log_path: Path
    log_file: IO[bytes]
    echo: threading.Thread | None = None

    def tail(self, n: int = TAIL_LINES) -> list[str]:
        if self.echo is not None:
            self.echo.join(2)
        try:
            with open(self.log_path, "rb") as f:
                console = ConsoleFilter()
                shown = (console(line) for line in f)
                lines = deque((line for line in shown if line is not None), maxlen=n)
        except OSError:
            return []
        return [line.decode(errors="replace").rstrip("\n")[:MAX_TEXT] for line in lines]


def _first_failure(workers: list[_Worker], codes: list[int | None]) -> _Worker | None:
    """The failed worker to report: one that failed on its own before one that the
    watchdog stopped because a peer failed (exit code 70), else the lowest rank."""
    failed = [w for w, c in zip(workers, codes, strict=True) if c not in (None, 0)]
    failed.sort(key=lambda w: w.proc.returncode == ABORT_EXIT_CODE)
    return failed[0] if failed else None


def error_line(tail: list[str]) -> str | None:
    """The line of a log tail that says what went wrong: the watchdog's verdict or the
    exception's last line (None when there is neither).

    Example:
      >>> error_line(["Traceback (most recent call last):", "  x", "ValueError: bad lr"])
      'ValueError: bad lr'
    """
    for line in reversed(tail):
        text = line.strip()
        if text.startswith("jfleet.watchdog:") or _EXCEPTION.match(text):
            return text[:300]
    return None


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _reap(workers: list[_Worker], sig: int, grace_s: float) -> None:
    """``sig`` to every worker's process group, SIGKILL to what is left after ``grace_s``."""
    for w in workers:
        if w.proc.poll() is None:
            _signal_group(w.proc.pid, sig)
    deadline = time.monotonic() + grace_s
    for w in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(timeout=max(deadline - time.monotonic(), 0))
    for w in workers:  # the leader's children too, alive or not
        _signal_group(w.proc.pid, signal.SIGKILL)
    for w in workers:
        w.proc.wait()
        if w.echo is not None:
            w.echo.join(5)
        w.log_file.close()


def _route_host(master: str | None) -> str:
    """This machine's address on the route to the master (127.0.0.1 without one)."""
    if master is None:
        return "127.0.0.1"
    host, _, port = master.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class _Launcher:
    def __init__(self, args: LaunchArgs, log: _Log, environ: dict[str, str]) -> None:
        self.args = args
        self.log = log
        self.environ = environ
        self.workers: list[_Worker] = []
        self.held: list[HeldPort] = []
        self.interrupt: int | None = None
        self.node_rank: int | None = None
        self.timeout_s = float(
            seconds(INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT_S, env=environ, whole=True)
        )
        self.grace_s = grace_seconds(environ)
        self.token = job_token(environ, nnodes=args.nnodes)

    # ---------------------------------------------------------------- the job
    def _serve(self, master: str | None) -> tuple[RendezvousServer | None, str]:
        """Starts the master when this node is node 0; returns it and the address to use."""
        args = self.args
        kwargs: dict[str, Any] = {"nnodes": args.nnodes, "timeout_s": self.timeout_s}
        kwargs.update(max_restart=args.max_restart, token=self.token)
        kwargs["log"] = lambda message: self.log(message, "WARNING")
        if master is None:  # one node, nobody else: a private master on loopback
            server = RendezvousServer.bind("127.0.0.1", 0, **kwargs)
            server.start()
            return server, server.address
        host, _, port = master.rpartition(":")
        if args.rank > 0:
            return None, master
        try:
            server = RendezvousServer.bind(host, int(port), **kwargs)
        except OSError as error:
            if args.rank == 0:
                raise RuntimeError(
                    f"--rank 0 serves the rendezvous at --master {master}, but binding it "
                    f"failed ({error}); give this machine's address and a free port."
                ) from None
            self.log(
                f"--master {master} is served elsewhere ({error.strerror}); joining it", "DEBUG"
            )
            return None, master
        server.start()
        self.log(f"serving the rendezvous at {master} for {args.nnodes} node(s)")
        return server, master

    def _start_workers(self, nodes: list[Node], node_rank: int, attempt: int) -> None:
        args = self.args
        args.log_dir.mkdir(parents=True, exist_ok=True)
        self.log.attach(args.log_dir / f"{args.job_id}.launch.node{node_rank}.log")
        eps = endpoints(nodes)
        self.log(
            f"job {args.job_id!r} attempt {attempt}: node {node_rank} of {len(nodes)}, "
            f"{len(eps)} workers, coordinator {eps[0]}, endpoints {','.join(eps)}"
        )
        for h in self.held[1 if node_rank == 0 else 0 :]:
            h.release()  # only the coordinator port stays held: JAX binds it with SO_REUSEPORT
        for local in range(args.nproc_per_node):
            rank = global_rank(nodes, node_rank, local)
            env = worker_env(
                self.environ, args, nodes, node_rank=node_rank, local_rank=local, attempt=attempt
            )
            path = args.log_dir / f"workerlog.{rank}"
            log_file = open(path, "ab")  # noqa: SIM115 - closed when reaped
            if attempt:
                log_file.write(f"--- jfleet.launch: restart {attempt} ---\n".encode())
                log_file.flush()
            echo = local == 0
            proc = subprocess.Popen(
                _guarded(args.command(sys.executable)),
                env=env,
                stdout=subprocess.PIPE if echo else log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            worker = _Worker(rank, local, proc, path, log_file)
            if echo:
                worker.echo = threading.Thread(
                    target=_echo, args=(proc.stdout, log_file, f"[rank {rank}] ".encode())
                )
                worker.echo.start()
            self.workers.append(worker)
            self.log(f"started worker rank {rank} (pid {proc.pid}), log {path}", "DEBUG")

    def _failure(self, worker: _Worker, node_rank: int) -> dict[str, Any]:
        rc = worker.proc.returncode
        tail = worker.tail()
        what = f"worker rank {worker.rank} (node {node_rank}) {_describe(rc)}"
        line = error_line(tail)
        return {
            "rank": worker.rank,
            "node_rank": node_rank,
            "returncode": rc,
            "exit_code": exit_code_of(rc),
            "what": what if line is None else f"{what}: {line}",
            "log": str(worker.log_path),
            "tail": tail,
        }

    def _stop(self, sig: int = signal.SIGTERM) -> None:
        if self.workers:
            _reap(self.workers, sig, self.grace_s)
            self.workers = []
        for h in self.held:
            h.release()
        self.held = []

    def _attempt(self, client: RendezvousClient, node_rank: int | None) -> dict[str, Any]:
        """Registers, runs one attempt; returns the master's ``restart`` or ``end``."""
        args = self.args
        host = args.host or _route_host(args.master)
        self.held = hold_free_ports(args.nproc_per_node, start=args.start_port)
        client.send(
            {
                "type": "register",
                "host": host,
                "nproc": args.nproc_per_node,
                "ports": [h.port for h in self.held],
                "rank": args.rank if node_rank is None else node_rank,
            }
        )
        reported = False  # this node's outcome (failure or done) was sent
        forwarded = False  # a signal to this launcher was forwarded and reported
        started = False
        while True:
            msg = client.receive(0.1)
            if msg is not None:
                kind = msg["type"]
                if kind == "start":
                    nodes = [Node.from_json(n) for n in msg["nodes"]]
                    node_rank = msg["node_rank"]
                    self.node_rank = node_rank
                    started = True
                    self._start_workers(nodes, node_rank, msg["attempt"])
                elif kind == "stop":
                    first = msg["failure"]
                    if not reported:
                        self.log(f"stopping this node's workers: {first['what']}")
                    self._stop(self.interrupt or signal.SIGTERM)
                    client.send({"type": "stopped"})
                elif kind in ("restart", "end"):
                    self._stop()
                    return msg
                elif kind == "lost":
                    self._stop()
                    return {
                        "type": "end",
                        "code": 1,
                        "error": f"lost the rendezvous master at {args.master}: node 0's "
                        "launcher is gone; the job is over.",
                    }
            if self.interrupt is not None and not started:
                self._stop()
                name = signal.Signals(self.interrupt).name
                return {"type": "end", "code": 128 + self.interrupt, "error": f"got {name}"}
            if self.interrupt is not None and not forwarded:  # even after done: stop the job
                name = signal.Signals(self.interrupt).name
                reported = forwarded = True
                what = f"the launcher of node {node_rank} got {name}"
                self.log(f"{what}: forwarding it to the workers and stopping the job")
                self._stop(self.interrupt)
                client.send(
                    {
                        "type": "failed",
                        "failure": {
                            "what": what,
                            "exit_code": 128 + self.interrupt,
                            "interrupted": True,
                        },
                    }
                )
                continue
            if not self.workers or reported:
                continue
            codes = [w.proc.poll() for w in self.workers]
            failed = _first_failure(self.workers, codes)
            if failed is not None:
                reported = True
                failure = self._failure(failed, node_rank)
                self.log(f"{failure['what']}; stopping the job")
                client.send({"type": "failed", "failure": failure})
                self._stop()
            elif all(c == 0 for c in codes):
                reported = True
                self.log(f"all {len(codes)} workers of node {node_rank} exited 0", "DEBUG")
                client.send({"type": "done"})
                self._stop(signal.SIGKILL)  # what a worker left in its process group

    def run(self, scheduler: Scheduler | None) -> int:
        args = self.args
        master = args.master  # a scheduler's, when one gave it (jfleet.launch.resolve)
        if scheduler is not None:
            self.log(
                f"{scheduler.name}: node {scheduler.node_rank} of {args.nnodes}, "
                f"rendezvous {master or 'on this node'}"
            )
        server, address = self._serve(master)
        try:
            client = RendezvousClient.connect(
                address,
                token=self.token,
                nnodes=args.nnodes,
                timeout_s=self.timeout_s,
                stop=lambda: self.interrupt is not None,
            )
        except HandshakeError as error:
            self.log(f"error: {error}", "ERROR")
            return 1
        except InterruptedError as error:
            self.log(str(error), "ERROR")
            return 128 + (self.interrupt or signal.SIGINT)
        node_rank = None
        try:
            while True:
                verdict = self._attempt(client, node_rank)
                node_rank = self.node_rank
                if verdict["type"] == "restart":
                    self.log(
                        f"restarting the job (restart {verdict['attempt']} of "
                        f"{args.max_restart}); workers resume from their latest checkpoint "
                        "if they save one"
                    )
                    continue
                return self._finish(verdict)
        finally:
            self._stop(signal.SIGKILL)
            client.close()
            if server is not None:
                server.join(5)

    def _finish(self, end: dict[str, Any]) -> int:
        code = int(end["code"])
        if end.get("error"):
            self.log(f"error: {end['error']}", "ERROR")
        failure = end.get("failure")
        if failure:
            lines = [f"job failed: {failure['what']}"]
            if failure.get("tail"):
                lines.append(f"last {len(failure['tail'])} lines of {failure['log']}:")
                lines += [f"  | {line}" for line in failure["tail"]]
            lines.append(f"exit code {code}")
            self.log("\n".join(lines), "ERROR")
        elif code == 0:
            self.log(f"job {self.args.job_id!r} finished: every worker exited 0")
        return code


def run(
    args: LaunchArgs, scheduler: Scheduler | None = None, environ: dict[str, str] | None = None
) -> int:
    """Runs this node's part of the job; returns the launcher's exit code.

    SIGINT and SIGTERM are caught while it runs (forwarded to the workers).
    """
    log = _Log(args.log_level)
    launcher = _Launcher(args, log, dict(os.environ if environ is None else environ))

    def on_signal(signum: int, frame: Any) -> None:
        launcher.interrupt = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return launcher.run(scheduler)
    except (RuntimeError, TimeoutError, ValueError) as error:
        log(f"error: {error}", "ERROR")
        return 1
    except OSError as error:  # e.g. an unwritable --log_dir, a script that cannot start
        log(f"error: {error}; check --log_dir and the training script.", "ERROR")
        return 1
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        log.close()

"""Run Python code in fresh interpreters with a wall-clock timeout.

Used for anything that needs a device count other than the suite's 8 or more than
one process. A child that overruns is killed with its whole process group and the
test fails with the child's output.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: the repo importable, CPU only, quiet XLA."""
    env = dict(os.environ)
    for key in [k for k in env if k.startswith(("PADDLE_", "JAX_COORDINATOR", "JAX_NUM_PROC"))]:
        del env[key]
    env.pop("JAX_PROCESS_ID", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra or {})
    return env


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> subprocess.Popen:
    """Starts ``python <argv>`` in its own session (killable as a group) with :func:`child_env`.

    Output goes to pipes unless ``stdout`` / ``stderr`` (open files) are given.
    """
    return subprocess.Popen(
        [sys.executable, *argv],
        env=child_env(env),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=subprocess.PIPE if stderr is None else stderr,
        text=True,
        start_new_session=True,
    )


def run_python(
    code: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
) -> subprocess.CompletedProcess:
    """Runs ``code`` in one child interpreter; raises AssertionError on timeout."""
    return run_many([code], envs=[env or {}], timeout=timeout)[0]


def run_many(
    codes: Sequence[str],
    *,
    envs: Sequence[Mapping[str, str]],
    timeout: float = 120.0,
) -> list[subprocess.CompletedProcess]:
    """Starts one child per code at once and waits for all, killing all on timeout."""
    procs = []
    for code, env in zip(codes, envs, strict=True):
        procs.append(spawn(["-c", textwrap.dedent(code)], env=env))
    results = []
    timed_out = False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out, err = proc.communicate()
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    if timed_out:
        details = "\n".join(
            f"--- child {i} rc={r.returncode}\n"
            f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
            for i, r in enumerate(results)
        )
        raise AssertionError(f"subprocess(es) ran past the {timeout}s timeout\n{details}")
    return results


def free_port() -> int:
    """A TCP port nothing listens on now (for a coordinator address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def paddle_launch_envs(n: int, *, init_timeout: int = 60, heartbeat: int = 20) -> list[dict]:
    """The ``PADDLE_*`` variables Paddle's launcher gives each of ``n`` local processes."""
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    return [
        {
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_TRAINERS_NUM": str(n),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
            "JFLEET_INIT_TIMEOUT": str(init_timeout),
            "JFLEET_HEARTBEAT_TIMEOUT": str(heartbeat),
        }
        for rank in range(n)
    ]


@dataclasses.dataclass
class Child:
    """One child's end: exit code (None if killed at the deadline), output and when it ended."""

    returncode: int | None
    stdout: str
    stderr: str
    ended_at: float
    killed: bool

    def report(self, name: str = "child") -> str:
        return (
            f"--- {name} rc={self.returncode} killed={self.killed}\n"
            f"stdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-4000:]}"
        )


def run_concurrently(
    codes: Sequence[str],
    *,
    envs: Sequence[Mapping[str, str]],
    timeout: float = 120.0,
    poll_s: float = 0.05,
) -> list[Child]:
    """Starts one child per code at once and records when each ends (``time.time()``).

    Unlike :func:`run_many`, a child still running at ``timeout`` does not fail the call:
    its process group is killed and it comes back with ``killed=True`` (and
    ``returncode=None``) for the test to judge. Output goes through temporary files, so
    a chatty child cannot block on a full pipe.
    """
    with tempfile.TemporaryDirectory() as tmp:
        procs, files = [], []
        for i, (code, env) in enumerate(zip(codes, envs, strict=True)):
            out = open(os.path.join(tmp, f"{i}.out"), "w+")  # noqa: SIM115
            err = open(os.path.join(tmp, f"{i}.err"), "w+")  # noqa: SIM115
            files.append((out, err))
            procs.append(spawn(["-c", textwrap.dedent(code)], env=env, stdout=out, stderr=err))
        deadline = time.monotonic() + timeout
        ended: dict[int, float] = {}
        killed: set[int] = set()
        while len(ended) < len(procs):
            for i, proc in enumerate(procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = time.time()
            if time.monotonic() > deadline:
                for i, proc in enumerate(procs):
                    if i not in ended:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        ended[i], killed = time.time(), killed | {i}
                break
            time.sleep(poll_s)
        children = []
        for i, (proc, (out, err)) in enumerate(zip(procs, files, strict=True)):
            out.seek(0)
            err.seek(0)
            children.append(
                Child(
                    returncode=None if i in killed else proc.returncode,
                    stdout=out.read(),
                    stderr=err.read(),
                    ended_at=ended[i],
                    killed=i in killed,
                )
            )
            out.close()
            err.close()
        return children

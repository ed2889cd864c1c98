"""Run Python code in fresh interpreters with a wall-clock timeout.

Used for anything that needs a device count other than the suite's 8 or more than
one process. A child that overruns is killed with its whole process group and the
test fails with the child's output.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

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
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(code)],
                env=child_env(env),
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
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

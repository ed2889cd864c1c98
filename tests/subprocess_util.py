"""Child interpreters for the suite: :mod:`jfleet.testing.processes` run from the repository.

Used for anything that needs a device count other than the suite's 8 or more than one
process. A child that overruns is killed with its whole process group and the test fails
with the child's output. The children run in the repository root with it importable.
"""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jfleet.testing import processes
from jfleet.testing.processes import Child as Child
from jfleet.testing.processes import free_port as free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: the repo importable, CPU only, quiet XLA."""
    return processes.child_env(extra, pythonpath=[REPO_ROOT])


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
) -> subprocess.Popen:
    """Starts ``python <argv>`` in the repository, in its own session (killable as a group)."""
    return processes.spawn(
        argv, env=env, cwd=REPO_ROOT, pythonpath=[REPO_ROOT], stdout=stdout, stderr=stderr
    )


def run_concurrently(
    codes: Sequence[str], *, envs: Sequence[Mapping[str, str]], timeout: float = 120.0
) -> list[Child]:
    """Starts one child per code at once; a child past ``timeout`` comes back killed."""
    argvs = [["-c", textwrap.dedent(code)] for code in codes]
    return processes.run_children(
        argvs, envs=envs, timeout=timeout, cwd=REPO_ROOT, pythonpath=[REPO_ROOT]
    )


def run_many(
    codes: Sequence[str], *, envs: Sequence[Mapping[str, str]], timeout: float = 120.0
) -> list[subprocess.CompletedProcess]:
    """Starts one child per code at once and waits for all; AssertionError on timeout."""
    children = run_concurrently(codes, envs=envs, timeout=timeout)
    if any(c.killed for c in children):
        details = "\n".join(c.report(f"child {i}") for i, c in enumerate(children))
        raise AssertionError(f"subprocess(es) ran past the {timeout}s timeout\n{details}")
    return [
        subprocess.CompletedProcess(["-c", code], c.returncode, c.stdout, c.stderr)
        for code, c in zip(codes, children, strict=True)
    ]


def run_python(
    code: str, *, env: Mapping[str, str] | None = None, timeout: float = 120.0
) -> subprocess.CompletedProcess:
    """Runs ``code`` in one child interpreter; raises AssertionError on timeout."""
    return run_many([code], envs=[env or {}], timeout=timeout)[0]


def paddle_launch_envs(n: int, *, init_timeout: int = 60, heartbeat: int = 20) -> list[dict]:
    """The ``PADDLE_*`` variables Paddle's launcher gives each of ``n`` local processes."""
    return processes.launch_envs(n, init_timeout=init_timeout, heartbeat=heartbeat)

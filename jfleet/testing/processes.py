"""Child interpreters for tests: n processes x m emulated devices, a deadline, nothing left behind.

Every child starts in its own session, so it is killed with everything it started (its
process group); its output goes to temporary files (a chatty child cannot block on a full
pipe) and comes back with its exit code. :func:`run_processes` is what the pytest plugin's
``emulated_processes`` fixture runs: one function or code string in ``n`` processes of
``devices_each`` CPU devices each, with the variables Paddle's launcher (``"paddle"``) or
JAX's (``"jax"``) gives a worker, failing with every child's output when one fails or runs
past the deadline.

Example:
  >>> [c.stdout for c in run_children([["-c", "print(6 * 7)"]], envs=[{}], timeout=60)]
  ['42\\n']
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "Child",
    "ProcessesFailedError",
    "child_env",
    "free_port",
    "launch_envs",
    "run_children",
    "run_processes",
    "spawn",
]

#: Variables that describe another job's processes: a child starts without them.
_JOB_PREFIXES = ("PADDLE_", "JAX_COORDINATOR", "JAX_NUM_PROC", "JAX_PROCESS_ID")
_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")
LAUNCHERS = ("paddle", "jax")


def child_env(
    extra: Mapping[str, str] | None = None, *, pythonpath: Sequence[str | os.PathLike] = ()
) -> dict[str, str]:
    """This process's environment for a child: no job variables, CPU only, quiet XLA.

    Args:
      extra: variables set last (they win).
      pythonpath: directories put first on the child's ``PYTHONPATH``.

    Example:
      >>> env = child_env({"A": "1"}, pythonpath=["/src"])
      >>> env["JAX_PLATFORMS"], env["A"], env["PYTHONPATH"].split(os.pathsep)[0]
      ('cpu', '1', '/src')
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(_JOB_PREFIXES)}
    paths = [str(p) for p in pythonpath] + [env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra or {})
    return env


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    pythonpath: Sequence[str | os.PathLike] = (),
    stdout: Any = None,
    stderr: Any = None,
) -> subprocess.Popen:
    """Starts ``python <argv>`` in its own session (killable as a group) with :func:`child_env`.

    Output goes to pipes unless ``stdout`` / ``stderr`` (open files) are given.
    """
    return subprocess.Popen(
        [sys.executable, *argv],
        env=child_env(env, pythonpath=pythonpath),
        cwd=cwd,
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=subprocess.PIPE if stderr is None else stderr,
        text=True,
        start_new_session=True,
    )


@dataclasses.dataclass
class Child:
    """One child's end: exit code (None if killed at the deadline), output and when it ended.

    ``value`` is what the function returned, for :func:`run_processes` given a function.
    """

    returncode: int | None
    stdout: str
    stderr: str
    ended_at: float
    killed: bool
    value: Any = None

    def report(self, name: str = "child") -> str:
        """The exit code and the last 4000 characters of each stream, for a failure message."""
        return (
            f"--- {name} rc={self.returncode} killed={self.killed}\n"
            f"stdout:\n{self.stdout[-4000:]}\nstderr:\n{self.stderr[-4000:]}"
        )


class ProcessesFailedError(AssertionError):
    """A child failed or ran past the deadline; the message holds every child's output.

    Example:
      >>> issubclass(ProcessesFailedError, AssertionError)  # a failed test, with the output
      True
    """

    def __init__(self, message: str, children: Sequence[Child]) -> None:
        super().__init__(message)
        self.children = list(children)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_children(
    argvs: Sequence[Sequence[str]],
    *,
    envs: Sequence[Mapping[str, str]],
    timeout: float = 120.0,
    cwd: str | os.PathLike | None = None,
    pythonpath: Sequence[str | os.PathLike] = (),
    poll_s: float = 0.05,
) -> list[Child]:
    """Starts ``python <argv>`` for each argv at once and waits for all, at most ``timeout`` s.

    A child still running at the deadline is killed with its process group and comes back
    with ``killed=True`` (``returncode=None``) for the caller to judge; a child that ended
    has its process group killed too (whatever it left running), and every child is
    reaped. ``ended_at`` is ``time.time()`` when the child was seen to end.
    """
    with tempfile.TemporaryDirectory(prefix="jfleet-children-") as tmp:
        procs, files = [], []
        try:
            for i, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
                out = open(os.path.join(tmp, f"{i}.out"), "w+")  # noqa: SIM115
                err = open(os.path.join(tmp, f"{i}.err"), "w+")  # noqa: SIM115
                files.append((out, err))
                procs.append(
                    spawn(argv, env=env, cwd=cwd, pythonpath=pythonpath, stdout=out, stderr=err)
                )
            deadline = time.monotonic() + timeout
            ended: dict[int, float] = {}
            killed: set[int] = set()
            while len(ended) < len(procs):
                for i, proc in enumerate(procs):
                    if i not in ended and proc.poll() is not None:
                        ended[i] = time.time()
                if len(ended) < len(procs) and time.monotonic() > deadline:
                    for i, proc in enumerate(procs):
                        if i not in ended:
                            _kill_group(proc)
                            proc.wait()
                            ended[i], killed = time.time(), killed | {i}
                    break
                time.sleep(poll_s)
        finally:  # an interrupt or a failed start: nothing left running
            for proc in procs:
                _kill_group(proc)
                proc.wait()
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


def free_port() -> int:
    """A TCP port nothing listens on now (for a coordinator address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_envs(
    n: int, *, launcher: str = "paddle", init_timeout: int = 60, heartbeat: int = 20
) -> list[dict[str, str]]:
    """The variables a launcher gives each of ``n`` local processes, rank by rank.

    Args:
      n: the process count.
      launcher: ``"paddle"`` (``PADDLE_TRAINER_ID``, ``PADDLE_TRAINERS_NUM``,
        ``PADDLE_TRAINER_ENDPOINTS``, ``PADDLE_CURRENT_ENDPOINT``: Paddle's collective
        launch) or ``"jax"`` (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
        ``JAX_PROCESS_ID``); ``fleet.init`` reads either.
      init_timeout: ``JFLEET_INIT_TIMEOUT`` (s): how long start-up waits for the peers.
      heartbeat: ``JFLEET_HEARTBEAT_TIMEOUT`` (s): how soon a dead peer aborts the others.

    Raises:
      ValueError: ``launcher`` is neither.

    Example:
      >>> [e["JAX_PROCESS_ID"] for e in launch_envs(2, launcher="jax")]
      ['0', '1']
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: expected one of {LAUNCHERS}.")
    timeouts = {
        "JFLEET_INIT_TIMEOUT": str(init_timeout),
        "JFLEET_HEARTBEAT_TIMEOUT": str(heartbeat),
    }
    if launcher == "jax":
        coordinator = f"127.0.0.1:{free_port()}"
        return [
            {
                "JAX_COORDINATOR_ADDRESS": coordinator,
                "JAX_NUM_PROCESSES": str(n),
                "JAX_PROCESS_ID": str(rank),
                **timeouts,
            }
            for rank in range(n)
        ]
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(n)]
    return [
        {
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_TRAINERS_NUM": str(n),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
            **timeouts,
        }
        for rank in range(n)
    ]


_RUN_FUNCTION = """
import importlib.util, os, pickle, sys
path, name, qualname, args_file, result_file = sys.argv[1:6]
sys.path[:0] = [os.path.dirname(path), os.getcwd()]
spec = importlib.util.spec_from_file_location(name, path)
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
fn = module
for part in qualname.split("."):
    fn = getattr(fn, part)
with open(args_file, "rb") as f:
    args = pickle.load(f)
value = fn(*args)
with open(result_file, "wb") as f:
    pickle.dump(value, f)
"""


def _function_argv(fn: Callable, args_file: str, result_file: str) -> list[str]:
    """The child's argv that imports ``fn`` from its file and calls it."""
    qualname = getattr(fn, "__qualname__", "")
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        path = None
    if not path or "<" in qualname or fn.__module__ == "__main__":
        raise TypeError(
            f"{fn!r} cannot be found by a child process: give a function defined at the top "
            "level of a module file (a test module works), or a code string."
        )
    return ["-c", _RUN_FUNCTION, path, fn.__module__, qualname, args_file, result_file]


def run_processes(
    target: Callable[..., Any] | str,
    n: int,
    devices_each: int,
    *,
    launcher: str = "paddle",
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    pythonpath: Sequence[str | os.PathLike] = (),
    check: bool = True,
) -> list[Child]:
    """Runs ``target`` in ``n`` processes of ``devices_each`` emulated CPU devices at once.

    Each child gets the launcher's variables for its rank (:func:`launch_envs`),
    ``JAX_NUM_CPU_DEVICES=devices_each`` and ``JAX_PLATFORMS=cpu``: ``fleet.init()``
    in it joins the ``n * devices_each``-device job.

    Args:
      target: Python code (dedented), or a function defined at the top level of a module
        file, called as ``target(*args)`` in each child; its return value (pickled) comes
        back as ``Child.value``.
      n: processes.
      devices_each: emulated CPU devices per process.
      launcher: ``"paddle"`` or ``"jax"`` variables.
      args: the function's arguments (pickled).
      timeout: wall-clock seconds for all children together.
      env: more variables for every child.
      cwd: the children's working directory (default: this process's).
      pythonpath: directories put first on the children's ``PYTHONPATH``.
      check: raise when a child fails; False: only when one runs past the deadline.

    Returns:
      One :class:`Child` per rank.

    Raises:
      ProcessesFailedError: a child ran past ``timeout`` (every child is then killed) or,
        with ``check``, exited non-zero; the message holds every child's output.
      ValueError / TypeError: a bad count, launcher or target.

    Example:
      >>> children = run_processes("import os; print(os.environ['PADDLE_TRAINER_ID'])", 2, 1)
      >>> [c.stdout.strip() for c in children], [c.returncode for c in children]
      (['0', '1'], [0, 0])
    """
    for name, value in (("n", n), ("devices_each", devices_each)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive int.")
    envs = launch_envs(n, launcher=launcher)
    flags = _DEVICE_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    for rank_env in envs:
        rank_env.update({"JAX_NUM_CPU_DEVICES": str(devices_each), "XLA_FLAGS": flags})
        rank_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="jfleet-processes-") as tmp:
        results = [os.path.join(tmp, f"result-{rank}.pkl") for rank in range(n)]
        if isinstance(target, str):
            argvs = [["-c", textwrap.dedent(target)]] * n
        elif callable(target):
            args_file = os.path.join(tmp, "args.pkl")
            Path(args_file).write_bytes(pickle.dumps(tuple(args)))
            argvs = [_function_argv(target, args_file, r) for r in results]
        else:
            raise TypeError(f"target={target!r}: expected code (a str) or a function.")
        children = run_children(argvs, envs=envs, timeout=timeout, cwd=cwd, pythonpath=pythonpath)
        for child, result in zip(children, results, strict=True):
            if os.path.exists(result):
                child.value = pickle.loads(Path(result).read_bytes())
    late = [i for i, c in enumerate(children) if c.killed]
    failed = [i for i, c in enumerate(children) if not c.killed and c.returncode != 0]
    if late or (check and failed):
        what = (
            f"rank(s) {late} still running after the {timeout:g} s timeout (all killed)"
            if late
            else f"rank(s) {failed} exited non-zero"
        )
        details = "\n".join(c.report(f"rank {i}") for i, c in enumerate(children))
        raise ProcessesFailedError(
            f"{n} processes x {devices_each} devices ({launcher} variables): {what}\n{details}",
            children,
        )
    return children

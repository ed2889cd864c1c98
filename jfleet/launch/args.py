"""The launcher's command line: Paddle's flags, checked, as one frozen :class:`LaunchArgs`.

``python -m jfleet.launch [flags] training_script [script args]`` (or ``-m module``).
Flags are Paddle's (``python -m paddle.distributed.launch``); a flag may also come from
Paddle's environment variable (``PADDLE_NNODES``, ``PADDLE_MASTER``, ...), the flag winning.
Everything after the script (or ``-m module``) belongs to the script.

Example:
  >>> a = parse_args(["--nproc_per_node", "2", "--devices", "0,1,2,3", "train.py", "--lr", "1"])
  >>> a.nproc_per_node, a.devices, a.training_script, a.training_script_args
  (2, ('0', '1', '2', '3'), 'train.py', ('--lr', '1'))
  >>> a.devices_of(1)
  ('2', '3')
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from jfleet.launch.schema import BadMessageError, check_host

__all__ = ["LaunchArgs", "parse_args", "parse_master"]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

#: Paddle's environment variables that stand in for a flag (the flag wins).
ENV_FLAGS = {
    "PADDLE_MASTER": "master",
    "PADDLE_NNODES": "nnodes",
    "PADDLE_NPROC_PER_NODE": "nproc_per_node",
    "PADDLE_RANK": "rank",
    "PADDLE_DEVICES": "devices",
    "PADDLE_JOB_ID": "job_id",
    "PADDLE_LOG_DIR": "log_dir",
    "PADDLE_LOG_LEVEL": "log_level",
    "PADDLE_MAX_RESTART": "max_restart",
    "POD_IP": "host",
}

_NO_SERVERS = (
    "jfleet has no separate server processes (every worker holds a shard of each sparse "
    "table); start workers only and call fleet.init(is_collective=False)"
)
#: Paddle flags that have no meaning here, with what to do instead.
UNSUPPORTED = {
    "--ips": "it is the legacy multi-node flag; start one launcher per node with "
    "--nnodes N --master <ip of node 0>:<port>",
    "--servers": _NO_SERVERS,
    "--trainers": _NO_SERVERS,
    "--heter_workers": _NO_SERVERS,
    "--elastic_level": "elastic jobs are not supported; give a fixed --nnodes",
    "--elastic_timeout": "elastic jobs are not supported; give a fixed --nnodes",
    "--with_gloo": "JAX's coordination service replaces Gloo; drop the flag",
}


@dataclasses.dataclass(frozen=True)
class LaunchArgs:
    """The launcher's settings, validated.

    Attributes:
      nproc_per_node: worker processes on this node.
      nnodes: nodes (one launcher each).
      master: ``host:port`` of the rendezvous (node 0's launcher), or None.
      rank: this node's rank; -1: assigned by the master in arrival order.
      devices: device ids of this node, split evenly among its processes; None: not set.
      log_dir: where ``workerlog.N`` and the launcher's log go.
      log_level: the launcher's level, also given to the workers (``JFLEET_LOG_LEVEL``).
      job_id: the job's name, in the launcher's log name and ``PADDLE_JOB_ID``.
      start_port: first port tried for the workers' endpoints; None: any free port.
      max_restart: restarts of the whole job after a failure (0: none).
      host: the address other nodes reach this node at; None: found from the route to
        the master.
      training_script: the script to run, or None with ``module``.
      module: the module to run (``-m``), or None.
      training_script_args: the script's arguments.
    """

    nproc_per_node: int = 1
    nnodes: int = 1
    master: str | None = None
    rank: int = -1
    devices: tuple[str, ...] | None = None
    log_dir: Path = Path("log")
    log_level: str = "INFO"
    job_id: str = "default"
    start_port: int | None = None
    max_restart: int = 0
    host: str | None = None
    training_script: str | None = None
    module: str | None = None
    training_script_args: tuple[str, ...] = ()

    def devices_of(self, local_rank: int) -> tuple[str, ...] | None:
        """The device ids of the process with ``local_rank`` (None when ``--devices`` unset)."""
        if self.devices is None:
            return None
        per = len(self.devices) // self.nproc_per_node
        return self.devices[local_rank * per : (local_rank + 1) * per]

    def command(self, python: str) -> list[str]:
        """The worker's command line, run by ``python``."""
        target = ["-m", self.module] if self.module else [self.training_script or ""]
        return [python, "-u", *target, *self.training_script_args]

    def check_script(self) -> None:
        """Raises ValueError when ``training_script`` is not a file (a module is not checked)."""
        if self.training_script is not None and not Path(self.training_script).is_file():
            raise ValueError(
                f"jfleet.launch: training script {self.training_script!r} does not exist "
                f"(looked in {Path.cwd()}); give the path of a Python file, or -m module."
            )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits; we raise a clear ValueError
        raise ValueError(f"jfleet.launch: {message}; see python -m jfleet.launch --help.")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m jfleet.launch",
        description="Start a jfleet (JAX) job's worker processes, Paddle's launcher style.",
        allow_abbrev=False,
        add_help=False,
    )
    p.add_argument("--nproc_per_node", type=str, default=None)
    p.add_argument("--nnodes", type=str, default=None)
    p.add_argument("--master", type=str, default=None)
    p.add_argument("--rank", type=str, default=None)
    p.add_argument("--devices", type=str, default=None)
    p.add_argument("--gpus", type=str, default=None)
    p.add_argument("--log_dir", type=str, default=None)
    p.add_argument("--log_level", type=str, default=None)
    p.add_argument("--job_id", type=str, default=None)
    p.add_argument("--start_port", type=str, default=None)
    p.add_argument("--max_restart", type=str, default=None)
    p.add_argument("--host", type=str, default=None)
    p.add_argument("--run_mode", type=str, default=None)
    return p


USAGE = """usage: python -m jfleet.launch [flags] training_script [args] | -m module [args]

  --nproc_per_node N   worker processes on this node (default: one per --devices id, else 1)
  --nnodes N           nodes, one launcher each (default 1; elastic N:M is not supported)
  --master IP:PORT     rendezvous address: node 0's launcher serves it (needed for nnodes > 1
                       unless SLURM, Open MPI or a Kubernetes indexed job provides it)
  --rank R             this node's rank (default -1: ranks in arrival order)
  --devices IDS        device ids of this node (alias --gpus), split evenly among the processes;
                       CUDA_VISIBLE_DEVICES on GPUs, that many emulated devices on CPU
  --log_dir DIR        workerlog.N per worker, plus the launcher's log (default log)
  --log_level LEVEL    DEBUG, INFO (default), WARNING, ERROR, CRITICAL
  --job_id NAME        the job's name (default "default")
  --start_port PORT    first port tried for endpoints (default: any free port)
  --max_restart N      restarts of the whole job after a failure (default 0)
  --host IP            this node's address as other nodes reach it (default: found)
  --run_mode collective   the only mode (Paddle's default)
"""


def parse_master(text: str, *, flag: str = "--master") -> str:
    """Checks ``ip:port`` and returns it.

    Raises:
      ValueError: an ``etcd://`` or other URL, a missing or bad port.

    Example:
      >>> parse_master("10.0.0.1:6170")
      '10.0.0.1:6170'
    """
    value = text.strip()
    if "://" in value:
        raise ValueError(
            f"{flag}={text!r}: only ip:port is supported (jfleet's launchers meet on a TCP "
            "rendezvous served by node 0; etcd and other URLs are not supported); give "
            f"{flag} <ip of node 0>:<free port>."
        )
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{flag}={text!r}: expected ip:port with a port in 1..65535, e.g. {flag} 10.0.0.1:6170."
        )
    return value


def _int(flag: str, value: str, *, low: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{flag}={value!r} is not an integer; give {what}.") from None
    if n < low:
        raise ValueError(f"{flag}={value!r} must be >= {low}; give {what}.")
    return n


def _nnodes(flag: str, value: str) -> int:
    if ":" in value:
        raise ValueError(
            f"{flag}={value!r}: elastic ranges (min:max) are not supported; give a fixed "
            "node count, e.g. --nnodes 2."
        )
    return _int(flag, value, low=1, what="the number of nodes, e.g. --nnodes 2")


def _devices(flag: str, value: str) -> tuple[str, ...]:
    ids = tuple(v.strip() for v in value.split(","))
    if not ids or not all(i.isdigit() for i in ids):
        raise ValueError(
            f"{flag}={value!r}: expected comma-separated device ids, e.g. {flag} 0,1,2,3."
        )
    dup = sorted({i for i in ids if ids.count(i) > 1}, key=int)
    if dup:
        raise ValueError(f"{flag}={value!r} lists device(s) {dup} more than once; list each once.")
    return ids


def _job_id(flag: str, value: str) -> str:
    if not value or not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(
            f"{flag}={value!r}: use letters, digits, '-', '_' or '.' (it names log files)."
        )
    return value


def _host(flag: str, value: str) -> str:
    try:
        return check_host(value)
    except BadMessageError:
        raise ValueError(
            f"{flag}={value!r} is not a hostname or an IP address (one address, no port); "
            "give the address other nodes reach this node at, e.g. --host 10.0.0.2."
        ) from None


def _split_argv(argv: Sequence[str]) -> tuple[list[str], str | None, str | None, list[str]]:
    """(launcher tokens, script, module, script args): the first non-flag is the script."""
    own: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in ("-h", "--help"):
            own.append(token)
            i += 1
        elif token == "-m":
            if i + 1 >= len(argv):
                raise ValueError("jfleet.launch: -m needs a module name, e.g. -m mypkg.train.")
            return own, None, argv[i + 1], list(argv[i + 2 :])
        elif token.startswith("-"):
            own.append(token)
            if "=" not in token and i + 1 < len(argv):
                own.append(argv[i + 1])
                i += 1
            i += 1
        else:
            return own, token, None, list(argv[i + 1 :])
    return own, None, None, []


def parse_args(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> LaunchArgs:
    """Parses and checks the launcher's command line (``environ``: Paddle's variables).

    Raises:
      ValueError: an unknown, unsupported, malformed or contradictory flag, named with
        its value and the fix; or no training script.
      SystemExit: ``-h`` / ``--help`` (after printing the usage).

    Example:
      >>> parse_args(["--nnodes", "2", "--master", "10.0.0.1:6170", "t.py"], environ={}).nnodes
      2
    """
    own, script, module, script_args = _split_argv(list(argv))
    raw, names = _raw_settings(own, os.environ if environ is None else environ)
    if script is None and module is None:
        raise ValueError(
            "jfleet.launch: no training script given; usage: python -m jfleet.launch "
            "[flags] train.py [args] (or -m package.module [args])."
        )
    run_mode = raw.get("run_mode", "collective")
    if run_mode != "collective":
        raise ValueError(
            f"--run_mode={run_mode!r}: only 'collective' (SPMD) jobs exist in jfleet "
            "(parameter-server and rpc modes are not available); drop the flag."
        )
    devices, nproc = _devices_and_nproc(raw, names)
    nnodes, rank = _nodes_and_rank(raw, names)
    master = parse_master(raw["master"], flag=names["master"]) if "master" in raw else None
    level = raw.get("log_level", "INFO").upper()
    if level not in LOG_LEVELS:
        raise ValueError(
            f"{names['log_level']}={raw['log_level']!r} is not a level; use one of {LOG_LEVELS}."
        )
    start_port = None
    if "start_port" in raw:
        start_port = _int("--start_port", raw["start_port"], low=1, what="a port in 1..65535")
        if start_port > 65535:
            raise ValueError(f"--start_port={start_port} is above 65535; give a port in 1..65535.")
    max_restart = 0
    if "max_restart" in raw:
        max_restart = _int(
            names["max_restart"], raw["max_restart"], low=0, what="the restarts allowed (0: none)"
        )
    job_id = _job_id(names.get("job_id", "--job_id"), raw.get("job_id", "default"))
    host = _host(names["host"], raw["host"]) if "host" in raw else None
    return LaunchArgs(
        nproc_per_node=nproc,
        nnodes=nnodes,
        master=master,
        rank=rank,
        devices=devices,
        log_dir=Path(raw.get("log_dir", "log")),
        log_level=level,
        job_id=job_id,
        start_port=start_port,
        max_restart=max_restart,
        host=host,
        training_script=script,
        module=module,
        training_script_args=tuple(script_args),
    )


def _raw_settings(own: list[str], env: Mapping[str, str]) -> tuple[dict, dict]:
    """The launcher's own flags as strings (Paddle's variables fill the unset ones), and
    how errors name each value (``--rank`` or ``PADDLE_RANK``)."""
    if "-h" in own or "--help" in own:
        print(USAGE)
        raise SystemExit(0)
    for token in own:
        flag = token.split("=", 1)[0]
        if flag in UNSUPPORTED:
            raise ValueError(f"jfleet.launch: {flag} is not supported: {UNSUPPORTED[flag]}.")
    ns = _parser().parse_args(own)
    raw = {k: v for k, v in vars(ns).items() if v is not None}
    names = {field: f"--{field}" for field in raw}
    for var, field in ENV_FLAGS.items():
        if field not in raw and env.get(var, "").strip():
            raw[field] = env[var].strip()
            names[field] = var
    return raw, names


def _devices_and_nproc(raw: dict, names: dict) -> tuple[list[str] | None, int]:
    """``--devices`` / ``--gpus`` (one list) and the processes per node that split it."""
    devices = None
    if "devices" in raw and "gpus" in raw:
        a, b = _devices("--devices", raw["devices"]), _devices("--gpus", raw["gpus"])
        if a != b:
            raise ValueError(
                f"--devices={raw['devices']!r} and --gpus={raw['gpus']!r} disagree (--gpus is "
                "an alias of --devices); give one of them."
            )
    if "devices" in raw or "gpus" in raw:
        flag = names["devices"] if "devices" in raw else "--gpus"
        devices = _devices(flag, raw.get("devices", raw.get("gpus", "")))
    if "nproc_per_node" in raw:
        nproc = _int(
            names["nproc_per_node"], raw["nproc_per_node"], low=1, what="the processes per node"
        )
    else:
        nproc = len(devices) if devices else 1
    if devices is not None and len(devices) % nproc:
        raise ValueError(
            f"--devices={','.join(devices)!r} ({len(devices)} devices) cannot be split evenly "
            f"among --nproc_per_node={nproc} processes; give a multiple of {nproc} devices "
            "or another --nproc_per_node."
        )
    return devices, nproc


def _nodes_and_rank(raw: dict, names: dict) -> tuple[int, int]:
    """``--nnodes`` and this node's ``--rank`` (-1: assigned in arrival order), checked."""
    nnodes = _nnodes(names["nnodes"], raw["nnodes"]) if "nnodes" in raw else 1
    rank = -1
    if "rank" in raw:
        rank = _int(names["rank"], raw["rank"], low=-1, what="this node's rank, or -1")
    if rank >= nnodes:
        nodes_name = names.get("nnodes", "--nnodes")
        raise ValueError(
            f"{names['rank']}={rank} is out of range for {nodes_name}={nnodes}; node ranks are "
            f"0..{nnodes - 1} (or -1: assigned in arrival order)."
        )
    return nnodes, rank

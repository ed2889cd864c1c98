"""``python -m jfleet.launch``: Paddle's launcher for jfleet (JAX) jobs.

An operational subsystem (beside ``checkpoint`` and ``ps``, none importing another); it
imports no JAX.

May import: runtime, mesh, optim, parallel, models, precision, training, auto_parallel (it
uses runtime alone).

Starts ``--nproc_per_node`` worker processes on each of ``--nnodes`` nodes (one launcher
per node), gives each the ``PADDLE_*`` and ``JAX_*`` variables that ``fleet.init`` reads,
files each worker's output in ``--log_dir/workerlog.<rank>`` (local rank 0's also on the
console as ``[rank N] ...``), and reaps the whole job when one worker fails: every
launcher exits with the failed worker's exit code after printing its rank and the last
lines of its log. ``--max_restart N`` restarts the whole job up to N times
(``JFLEET_RESTART_COUNT`` counts); a script that resumes from
``jfleet.checkpoint.CheckpointManager``'s latest step continues where it stopped, any
other script starts again from scratch.

    python -m jfleet.launch --nproc_per_node 2 --devices 0,1,2,3 train.py --lr 0.1
    # two nodes (run on each; node 0 serves the rendezvous at --master):
    python -m jfleet.launch --nnodes 2 --master 10.0.0.1:6170 --nproc_per_node 4 train.py

Under SLURM, Open MPI or a Kubernetes indexed job (one launcher per node), ``--master``
and the node's rank come from the scheduler (:mod:`jfleet.launch.cluster`).
``docs/launch.md`` has the flags table and the details.

Example:
  >>> launch(["--nnodes", "1:2", "train.py"])  # bad flags: an error message, status 2
  2
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from jfleet.launch.args import LaunchArgs, parse_args
from jfleet.launch.auth import job_token
from jfleet.launch.cluster import Scheduler, detect
from jfleet.launch.controller import grace_seconds, run
from jfleet.runtime.env import seconds
from jfleet.runtime.startup import DEFAULT_INIT_TIMEOUT_S, INIT_TIMEOUT_ENV

__all__ = ["LaunchArgs", "launch", "main", "parse_args", "resolve"]


def resolve(args: LaunchArgs, scheduler: Scheduler | None) -> LaunchArgs:
    """``args`` completed by a scheduler's node rank, node count and master.

    Raises:
      ValueError: the flags contradict the scheduler, or several nodes and no master.

    Example:
      >>> from jfleet.launch.cluster import Scheduler
      >>> a = resolve(LaunchArgs(training_script="t.py"), Scheduler("slurm", 1, 2, "n0:6000"))
      >>> a.nnodes, a.rank, a.master
      (2, 1, 'n0:6000')
    """
    if args.master is not None or scheduler is None:
        if args.nnodes > 1 and args.master is None:
            raise ValueError(
                f"--nnodes={args.nnodes} needs --master <ip of node 0>:<port> (the same on "
                "every node), unless the launchers run under SLURM, Open MPI or a Kubernetes "
                "indexed job."
            )
        return args
    nnodes = scheduler.nnodes or args.nnodes
    if scheduler.nnodes is not None and args.nnodes not in (1, scheduler.nnodes):
        raise ValueError(
            f"--nnodes={args.nnodes} but {scheduler.name} runs {scheduler.nnodes} launchers; "
            "drop --nnodes or make it match."
        )
    if args.rank not in (-1, scheduler.node_rank):
        raise ValueError(
            f"--rank={args.rank} but {scheduler.name} makes this node {scheduler.node_rank}; "
            "drop --rank (the scheduler's rank is used)."
        )
    if not 0 <= scheduler.node_rank < nnodes:
        raise ValueError(
            f"{scheduler.name} makes this node {scheduler.node_rank} but there are {nnodes} "
            "nodes; give --nnodes (the number of pods / tasks)."
        )
    master = scheduler.master if nnodes > 1 else None
    return dataclasses.replace(args, nnodes=nnodes, rank=scheduler.node_rank, master=master)


def launch(argv: Sequence[str]) -> int:
    """Runs the launcher on ``argv`` (the command line without the program name).

    Returns:
      The exit status: 0 when every worker exited 0; the first failed worker's exit code
      (128 + N for a worker killed by signal N); 2 for bad flags or settings (a
      malformed ``JFLEET_*`` variable such as ``JFLEET_INIT_TIMEOUT=abc``, a multi-node job
      without a job token); 1 when the nodes could not meet, or the master did not prove
      the job token.
    """
    try:
        args = parse_args(argv)
        args.check_script()
        scheduler = detect() if args.master is None else None
        args = resolve(args, scheduler)
        grace_seconds(os.environ)
        seconds(INIT_TIMEOUT_ENV, DEFAULT_INIT_TIMEOUT_S, whole=True)
        job_token(os.environ, nnodes=args.nnodes)
    except ValueError as error:
        message = str(error).removeprefix("jfleet.launch: ")
        print(f"[jfleet.launch] error: {message}", file=sys.stderr, flush=True)
        return 2
    return run(args, scheduler)


def main() -> int:
    """``python -m jfleet.launch`` (reads ``sys.argv``)."""
    return launch(sys.argv[1:])

"""Where a scheduler already says who is who: SLURM, Open MPI, Kubernetes indexed jobs.

Run one launcher per node under the scheduler (``srun --ntasks-per-node=1``, ``mpirun
--map-by ppr:1:node``, an indexed Job with one pod per node) and leave out ``--master``:
:func:`detect` reads the node's rank, the node count and the rendezvous address from the
scheduler's variables. SLURM and Open MPI are read with JAX's own cluster classes
(``jax._src.clusters``: the same first host and job-derived port JAX would use); a
Kubernetes indexed job is read from ``JOB_COMPLETION_INDEX`` and the pod host names
``<job>-<index>.<service>`` of a headless service (``JFLEET_K8S_SERVICE``).

The scheduler's per-task variables that make ``jax.distributed`` configure itself
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``OMPI_MCA_orte_hnp_uri``) describe the launcher,
not its workers: :data:`SCRUBBED` lists them, and the workers do not inherit them.

Example:
  >>> detect({}) is None  # no scheduler
  True
  >>> info = detect({"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "train-1",
  ...                "JFLEET_K8S_SERVICE": "workers"})
  >>> info.name, info.node_rank, info.master
  ('kubernetes', 1, 'train-0.workers:6070')
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

__all__ = ["SCRUBBED", "Scheduler", "detect"]

#: Variables removed from the workers' environment (see the module docstring).
SCRUBBED = ("SLURM_PROCID", "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri")
#: The rendezvous port on Kubernetes (Paddle's default --start_port).
K8S_PORT = 6070


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """What a scheduler says about this node's launcher.

    Attributes:
      name: ``"slurm"``, ``"ompi"`` or ``"kubernetes"``.
      node_rank: this node's rank.
      nnodes: the node count, or None when the scheduler does not say (Kubernetes).
      master: ``host:port`` of the rendezvous (node 0).
    """

    name: str
    node_rank: int
    nnodes: int | None
    master: str


@contextmanager
def _environ(environ: Mapping[str, str]) -> Iterator[None]:
    """JAX's cluster classes read ``os.environ``: show them ``environ`` for a moment."""
    if environ is os.environ:
        yield
        return
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        raise ValueError(
            f"{name}={environ.get(name)!r}: the scheduler variable is missing or not an "
            "integer; run the launcher under the scheduler, or give --master and --rank."
        ) from None


def _slurm(environ: Mapping[str, str]) -> Scheduler | None:
    if "SLURM_JOB_ID" not in environ:
        return None
    from jax._src.clusters.slurm_cluster import SlurmCluster

    with _environ(environ):
        if not SlurmCluster.is_env_present():
            return None
        master = SlurmCluster.get_coordinator_address(None, None)
    tasks, nodes = _int(environ, "SLURM_NTASKS"), environ.get("SLURM_STEP_NUM_NODES")
    if nodes is not None and nodes.isdigit() and int(nodes) != tasks:
        raise ValueError(
            f"SLURM_NTASKS={tasks} but SLURM_STEP_NUM_NODES={nodes}: run one launcher per "
            "node (srun --ntasks-per-node=1 python -m jfleet.launch ...); it starts the "
            "node's workers itself."
        )
    return Scheduler("slurm", _int(environ, "SLURM_PROCID"), tasks, master)


def _ompi(environ: Mapping[str, str]) -> Scheduler | None:
    from_ompi = "OMPI_MCA_orte_hnp_uri" in environ
    if not from_ompi:
        return None
    from jax._src.clusters.ompi_cluster import OmpiCluster

    with _environ(environ):
        master = OmpiCluster.get_coordinator_address(None, None)
    local = environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    if local != "1":
        raise ValueError(
            f"OMPI_COMM_WORLD_LOCAL_SIZE={local}: run one launcher per node (mpirun "
            "--map-by ppr:1:node python -m jfleet.launch ...); it starts the node's workers."
        )
    return Scheduler(
        "ompi",
        _int(environ, "OMPI_COMM_WORLD_RANK"),
        _int(environ, "OMPI_COMM_WORLD_SIZE"),
        master,
    )


def _kubernetes(environ: Mapping[str, str]) -> Scheduler | None:
    if "JOB_COMPLETION_INDEX" not in environ:
        return None
    index = _int(environ, "JOB_COMPLETION_INDEX")
    host = environ.get("HOSTNAME", "")
    match = re.fullmatch(rf"(.+)-{index}", host.split(".")[0])
    if not match:
        raise ValueError(
            f"JOB_COMPLETION_INDEX={index} but HOSTNAME={host!r} is not '<job>-{index}': "
            "the pods of an indexed Job are named so; give --master <node 0>:<port> instead."
        )
    service = environ.get("JFLEET_K8S_SERVICE", "").strip()
    first = f"{match.group(1)}-0" + (f".{service}" if service else "")
    return Scheduler("kubernetes", index, None, f"{first}:{K8S_PORT}")


def detect(environ: Mapping[str, str] | None = None) -> Scheduler | None:
    """This node's rank, the node count and the master from a scheduler (None: none).

    Checked in order: SLURM, Open MPI, Kubernetes indexed job.

    Raises:
      ValueError: the scheduler runs several launchers per node, or its variables are
        malformed.
    """
    env = os.environ if environ is None else environ
    for probe in (_slurm, _ompi, _kubernetes):
        found = probe(env)
        if found is not None:
            return found
    return None

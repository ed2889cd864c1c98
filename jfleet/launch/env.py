"""The workers' environment: Paddle's and JAX's variables for each rank.

:func:`worker_env` gives one worker the variables ``jfleet.role_maker.PaddleCloudRoleMaker``
reads (and Paddle's launcher sets), JAX's equivalents with the same values, its share of
``--devices``, and ``JFLEET_RESTART_COUNT``. The JAX coordinator is the first endpoint
(rank 0's); ``PADDLE_MASTER`` names it too, because jfleet's role maker reads
``PADDLE_MASTER`` as the coordinator.

Example:
  >>> from jfleet.launch.args import LaunchArgs
  >>> from jfleet.launch.rendezvous import Node
  >>> nodes = [Node("10.0.0.1", 2, (6170, 6171)), Node("10.0.0.2", 2, (6170, 6171))]
  >>> env = worker_env({}, LaunchArgs(nproc_per_node=2, nnodes=2, devices=("0", "1")),
  ...                  nodes, node_rank=1, local_rank=1, attempt=0)
  >>> env["PADDLE_TRAINER_ID"], env["PADDLE_CURRENT_ENDPOINT"], env["JAX_COORDINATOR_ADDRESS"]
  ('3', '10.0.0.2:6171', '10.0.0.1:6170')
  >>> env["CUDA_VISIBLE_DEVICES"], env["JAX_NUM_CPU_DEVICES"]
  ('1', '1')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jfleet.launch.args import LaunchArgs
from jfleet.launch.auth import TOKEN_ENV, TOKEN_FILE_ENV
from jfleet.launch.cluster import SCRUBBED
from jfleet.launch.rendezvous import Node

__all__ = ["endpoints", "global_rank", "worker_env"]


def endpoints(nodes: Sequence[Node]) -> list[str]:
    """Every worker's ``host:port`` in global rank order (node by node)."""
    return [f"{n.host}:{p}" for n in nodes for p in n.ports]


def global_rank(nodes: Sequence[Node], node_rank: int, local_rank: int) -> int:
    """The global rank of worker ``local_rank`` of node ``node_rank``."""
    return sum(n.nproc for n in nodes[:node_rank]) + local_rank


def worker_env(
    base: Mapping[str, str],
    args: LaunchArgs,
    nodes: Sequence[Node],
    *,
    node_rank: int,
    local_rank: int,
    attempt: int,
) -> dict[str, str]:
    """The environment of worker ``local_rank`` on node ``node_rank`` (``base`` + the job).

    Args:
      base: the launcher's environment.
      args: the launcher's settings (job id, log dir, devices).
      nodes: every node in rank order, with its host, process count and ports.
      node_rank: this node's rank.
      local_rank: the worker's rank on its node.
      attempt: the job's restart count (0 on the first run).
    """
    eps = endpoints(nodes)
    rank = global_rank(nodes, node_rank, local_rank)
    coordinator = eps[0]
    hidden = (*SCRUBBED, TOKEN_ENV, TOKEN_FILE_ENV)  # the job token stays with the launchers
    env = {k: v for k, v in base.items() if k not in hidden}
    env.update(
        {
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_TRAINERS_NUM": str(len(eps)),
            "PADDLE_TRAINER_ENDPOINTS": ",".join(eps),
            "PADDLE_CURRENT_ENDPOINT": eps[rank],
            "PADDLE_MASTER": coordinator,
            "PADDLE_RANK_IN_NODE": str(local_rank),
            "PADDLE_LOCAL_RANK": str(local_rank),
            "PADDLE_LOCAL_SIZE": str(nodes[node_rank].nproc),
            "PADDLE_GLOBAL_RANK": str(rank),
            "PADDLE_GLOBAL_SIZE": str(len(eps)),
            "PADDLE_NNODES": str(len(nodes)),
            "PADDLE_NODE_RANK": str(node_rank),
            "PADDLE_JOB_ID": args.job_id,
            "PADDLE_LOG_DIR": str(args.log_dir),
            "PADDLE_TRAINING_ROLE": "TRAINER",
            "JAX_COORDINATOR_ADDRESS": coordinator,
            "JAX_NUM_PROCESSES": str(len(eps)),
            "JAX_PROCESS_ID": str(rank),
            "JFLEET_RESTART_COUNT": str(attempt),
            "PYTHONUNBUFFERED": "1",
        }
    )
    share = args.devices_of(local_rank)
    if share is not None:
        ids = ",".join(share)
        env.update(
            {
                "CUDA_VISIBLE_DEVICES": ids,
                "FLAGS_selected_gpus": ids,
                "FLAGS_selected_devices": ids,
                "JAX_NUM_CPU_DEVICES": str(len(share)),
            }
        )
    return env

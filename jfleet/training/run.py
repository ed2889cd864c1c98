"""Starting a run: the processes, the one hybrid mesh, and the run every layer reads.

``fleet.init`` (Paddle's facade) and ``to_distributed`` both start runs through
:func:`start_run`, and both wrap optimizers through
:func:`~jfleet.training.distributed_optimizer.make_distributed_optimizer`, so neither
reaches into the other.

Example:
  >>> from jfleet.runtime.role_maker import PaddleCloudRoleMaker
  >>> from jfleet.training.strategy import DistributedStrategy
  >>> strategy = DistributedStrategy()
  >>> strategy.hybrid_configs = {"dp_degree": 4, "mp_degree": 2}
  >>> run = start_run(PaddleCloudRoleMaker(is_collective=True), strategy)
  >>> dict(run.mesh.shape)
  {'dp': 4, 'pp': 1, 'sharding': 1, 'sep': 1, 'ep': 1, 'mp': 2}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jfleet.mesh import context as _context
from jfleet.mesh.hybrid_group import build_hybrid_communicate_group
from jfleet.parallel.random import apply_tensor_init_seed
from jfleet.runtime import consistency
from jfleet.runtime.log import logger
from jfleet.runtime.startup import initialize_distributed
from jfleet.training.strategy import SPMD_NOOP_SETTINGS, DistributedStrategy


def start_run(
    role_maker: Any,
    strategy: DistributedStrategy,
    devices: Sequence[jax.Device] | None = None,
) -> _context.Run:
    """Starts the processes (if several), builds the hybrid mesh and makes it the run.

    Args:
      role_maker: where the process layout comes from (a role maker).
      strategy: the strategy whose ``hybrid_configs`` shape the mesh.
      devices: the devices the mesh spans, in rank order; default every device.

    Returns:
      The new current run (:class:`jfleet.mesh.context.Run`).

    Raises:
      ValueError: ``devices`` empty or naming a device twice; degrees whose product is
        not the device count. InconsistentJobError: (several processes) the processes
        disagree on the strategy, mesh or versions.
    """
    if initialize_distributed(role_maker):
        logger.info(
            "jax.distributed initialised: process %d of %d",
            jax.process_index(),
            jax.process_count(),
        )
    hcg = build_hybrid_communicate_group(strategy.hybrid_configs, _checked_devices(devices))
    consistency.check_init(strategy, hcg.mesh)  # several processes: all must agree
    run = _context.Run(role_maker=role_maker, strategy=strategy, hcg=hcg)
    _context.set_run(run)
    apply_tensor_init_seed(strategy)
    _log_ignored_settings(strategy)
    logger.info(
        "fleet initialised: %d process(es), %d devices, mesh %s",
        role_maker.worker_num(),
        hcg.mesh.devices.size,
        dict(hcg.mesh.shape),
    )
    return run


def _checked_devices(devices: Sequence[jax.Device] | None) -> list[jax.Device] | None:
    if devices is None:
        return None
    devices = list(devices)
    if not devices or len({id(d) for d in devices}) != len(devices):
        raise ValueError(
            f"devices={devices!r} must list each device once, at least one; default: "
            "every device of the run."
        )
    return devices


def _log_ignored_settings(strategy: DistributedStrategy) -> None:
    ignored = strategy.spmd_noop_settings()
    if ignored:
        logger.info(
            "these settings mean nothing under SPMD and are ignored: %s",
            "; ".join(
                f"{name} ({SPMD_NOOP_SETTINGS.get(name, 'no effect under SPMD')})"
                for name in ignored
            ),
        )

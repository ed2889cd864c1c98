"""``fleet.init`` in a real 2-process job: 2 processes x 4 CPU devices, one 8-device mesh.

The processes are started the way Paddle's launcher starts them, through the
``PADDLE_*`` variables; each checks fleet's answers and host collectives, then runs
two data-parallel training steps on its local half of each batch. The losses must be
the same on both processes and equal those of the same training on the full batches
in this (single) process.
"""

from __future__ import annotations

import numpy as np
import optax

from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.testing import train_one_device
from tests.subprocess_util import paddle_launch_envs, run_many

STEPS = 2
BATCH = 16
LR = 0.1

CHILD = f"""
import os
import jax
jax.config.update("jax_num_cpu_devices", 4)
import optax
import jfleet
from jfleet import fleet
from jfleet.models import TinyLM, lm_batches, lm_loss

rank = int(os.environ["PADDLE_TRAINER_ID"])
endpoints = os.environ["PADDLE_TRAINER_ENDPOINTS"].split(",")
strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {{"dp_degree": 2, "mp_degree": 4}}
assert fleet.init(is_collective=True, strategy=strategy, log_level="WARNING") is fleet._fleet
assert jax.process_count() == 2 and jax.process_index() == rank

mesh = fleet.get_hybrid_communicate_group().mesh
assert mesh.devices.size == 8, mesh
assert dict(mesh.shape) == {{"dp": 2, "pp": 1, "sharding": 1, "sep": 1, "ep": 1, "mp": 4}}, mesh
assert fleet.worker_index() == fleet.rank() == rank
assert fleet.worker_num() == fleet.world_size() == 2
assert fleet.is_first_worker() is (rank == 0)
assert fleet.is_worker() and not fleet.is_server() and fleet.server_num() == 0
assert fleet.node_num() == 1 and fleet.local_rank() == rank
assert fleet.worker_endpoints() == endpoints
assert fleet.worker_endpoints(to_string=True) == ",".join(endpoints)
local_ids, world_ids = fleet.local_device_ids(), fleet.world_device_ids()
assert len(local_ids) == 4 and len(world_ids) == 8 and set(local_ids) <= set(world_ids)
assert [d.id for d in mesh.devices.flat] == world_ids

assert fleet.all_reduce(1) == 2
assert fleet.all_reduce(rank, "max") == 1 and fleet.all_reduce(rank, "min") == 0
assert fleet.all_reduce(rank, "mean") == 0.5
fleet.barrier_worker()
shard = fleet.util.get_file_shard(["a", "b", "c"])
assert shard == [["a", "b"], ["c"]][rank], shard
assert fleet.util.all_gather(rank) == [0, 1]
assert fleet.util.all_reduce(rank + 1) == 3
fleet.util.barrier()
fleet.util.print_on_rank(f"PRINTED_BY {{rank}}", 1)
print("CHECKS_OK", rank, flush=True)

model = fleet.distributed_model(TinyLM())
opt = fleet.distributed_optimizer(optax.sgd({LR}))
half = {BATCH} // 2
for step, batch in enumerate(lm_batches({STEPS}, batch={BATCH})):
    local = {{k: v[rank * half : (rank + 1) * half] for k, v in batch.items()}}
    loss = model.train_batch(local, opt, loss_fn=lm_loss)
    print("LOSS", rank, step, repr(float(loss)), flush=True)
fleet.barrier_worker()
print("CHILD_OK", rank, flush=True)
"""


def reference_losses() -> list[float]:
    """The same steps on the full batches, one process, no fleet."""
    losses, _ = train_one_device(TinyLM(), optax.sgd(LR), lm_batches(STEPS, batch=BATCH), lm_loss)
    return list(losses)


def parse_losses(stdout: str, rank: int) -> list[float]:
    losses = {}
    for line in stdout.splitlines():
        if line.startswith(f"LOSS {rank} "):
            _, _, step, value = line.split()
            losses[int(step)] = float(value)
    return [losses[s] for s in sorted(losses)]


def test_fleet_two_processes_four_devices_each():
    envs = paddle_launch_envs(2, init_timeout=60, heartbeat=20)
    results = run_many([CHILD, CHILD], envs=envs, timeout=180)
    for rank, result in enumerate(results):
        report = f"child {rank} rc={result.returncode}\n{result.stdout}\n{result.stderr[-6000:]}"
        assert f"CHECKS_OK {rank}" in result.stdout, report
        assert result.returncode == 0, report
        assert f"CHILD_OK {rank}" in result.stdout, report
    assert "PRINTED_BY 1" not in results[0].stdout
    assert "PRINTED_BY 1" in results[1].stdout

    losses = [parse_losses(r.stdout, rank) for rank, r in enumerate(results)]
    assert len(losses[0]) == STEPS, results[0].stdout
    # One global loss: bit-identical on both processes.
    assert losses[0] == losses[1]
    # And equal to the single-process loss on the full batch; the second step's loss
    # also checks that the gradient was averaged over both processes' halves.
    np.testing.assert_allclose(losses[0], reference_losses(), rtol=2e-5, atol=1e-6)

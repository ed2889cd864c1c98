"""to_distributed in a 2-process job (2 x 4 CPU devices): each process feeds its local half.

The processes start as Paddle's launcher starts them (``PADDLE_*`` variables) and call
``fleet.init()`` before any JAX computation, as a multi-process job must; then
``to_distributed`` plans dp2 x pp2 x mp2 over all 8 devices. The losses must be the same
on both processes and equal single-process training on the full batches.
"""

from __future__ import annotations

from tests.auto_parallel.test_to_distributed import single_device_losses
from tests.subprocess_util import paddle_launch_envs, run_many
from tests.test_fleet_multiprocess import parse_losses

STEPS = 3

CHILD = f"""
import os
import jax
jax.config.update("jax_num_cpu_devices", 4)
import optax
from jfleet import fleet, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama

rank = int(os.environ["PADDLE_TRAINER_ID"])
fleet.init(is_collective=True, log_level="WARNING")
model = TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2)
local = [{{k: v[rank * 8 : (rank + 1) * 8] for k, v in b.items()}} for b in lm_batches({STEPS})]
config = ToDistributedConfig(force_mesh={{"dp": 2, "pp": 2, "mp": 2}})
model, opt, loader = to_distributed(model, optax.adam(1e-2), local, config=config)
assert get_plan(model).batch_size == 16, get_plan(model).batch_size
step = make_train_step(lm_loss)
for i, batch in enumerate(loader):
    assert batch["tokens"].shape == (16, 8), batch["tokens"].shape
    print("LOSS", rank, i, repr(float(step(model, opt, batch))), flush=True)
fleet.barrier_worker()
print("CHILD_OK", rank, flush=True)
"""


def test_to_distributed_two_processes_four_devices_each():
    envs = paddle_launch_envs(2, init_timeout=60, heartbeat=20)
    results = run_many([CHILD, CHILD], envs=envs, timeout=240)
    for rank, result in enumerate(results):
        report = f"child {rank} rc={result.returncode}\n{result.stdout}\n{result.stderr[-6000:]}"
        assert result.returncode == 0 and f"CHILD_OK {rank}" in result.stdout, report
    losses = [parse_losses(r.stdout, rank) for rank, r in enumerate(results)]
    assert len(losses[0]) == STEPS and losses[0] == losses[1], losses
    expected = single_device_losses("llama", STEPS)
    assert max(abs(a - b) for a, b in zip(losses[0], expected, strict=True)) < 1e-4, (
        losses[0],
        expected,
    )

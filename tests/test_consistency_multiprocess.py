"""Cross-process consistency in real 2-process jobs (2 processes x 4 CPU devices).

One test starts four jobs at once (six processes), each under a hard deadline:

- ``checks``: both ranks call ``fleet.init`` with different strategies (dp2·mp4 vs dp4·mp2)
  and both raise ``InconsistentJobError`` naming each rank's degrees; then the same
  strategy; first batches of 4 vs 8 local rows, then of sequence 4 vs 8 (both ranks raise
  ``InconsistentBatchError`` from ``train_batch`` naming each rank's shape); then two
  steps on equal local shapes (no error; equal losses on both ranks, equal to one process
  training on the full batches).
- ``one_changes``: after a step, only rank 1's batch changes shape; rank 1 waits
  ``JFLEET_CONSISTENCY_TIMEOUT`` for rank 0's signature for that call, then names the
  mismatch from rank 0's latest signature (not a timeout) and fails. Rank 0 is then
  blocked in the step's collective: until the watchdog (issue 14) ends it, the job ends
  through JAX's heartbeat timeout, or the test's deadline kills it.
- ``never_starts`` / ``no_coordinator``: only rank 0 (resp. only rank 1) of a 2-process job
  starts; it exits with code 1 after ``JFLEET_INIT_TIMEOUT`` seconds, naming the missing
  rank and the timeout variable, before JAX's own abort.
"""

from __future__ import annotations

import re
import time

import numpy as np
import optax

from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.testing import train_one_device
from tests.subprocess_util import paddle_launch_envs, run_concurrently

INIT_TIMEOUT = 10
CONSISTENCY_TIMEOUT = 4

PRELUDE = """
import os, time
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
import optax
from jfleet import fleet
from jfleet.runtime.consistency import InconsistentBatchError, InconsistentJobError
from jfleet.models import TinyLM, lm_batches, lm_loss

rank = int(os.environ["PADDLE_TRAINER_ID"])


def strategy(dp, mp):
    s = fleet.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": dp, "mp_degree": mp}
    return s


batch = lm_batches(1, batch=8)[0]
local = {k: v[rank * 4 : (rank + 1) * 4] for k, v in batch.items()}
"""

CHECKS = (
    PRELUDE
    + """
start = time.monotonic()
try:
    fleet.init(is_collective=True, strategy=strategy(*((2, 4) if rank == 0 else (4, 2))),
               log_level="WARNING")
    print("NO_STRATEGY_ERROR", flush=True)
except InconsistentJobError as e:
    print("STRATEGY_ERROR", rank, time.monotonic() - start, repr(str(e)), flush=True)
fleet.init(is_collective=True, strategy=strategy(2, 4), log_level="WARNING")
model = fleet.distributed_model(TinyLM())
opt = fleet.distributed_optimizer(optax.sgd(0.1))
bad = {  # each rank's first batches: 4 vs 8 rows, then sequence 4 vs 8
    "rows": {k: np.concatenate([v] * (1 + rank)) for k, v in local.items()},
    "seq": {k: v[:, : 4 * (1 + rank)] for k, v in local.items()},
}
for name, b in bad.items():
    start = time.monotonic()
    try:
        model.train_batch(b, opt, loss_fn=lm_loss)
        print("NO_BATCH_ERROR", name, flush=True)
    except InconsistentBatchError as e:
        print("BATCH_ERROR", name, rank, time.monotonic() - start, repr(str(e)), flush=True)
for _ in range(2):  # equal shapes: no error, one global loss
    print("LOSS", rank, repr(float(model.train_batch(local, opt, loss_fn=lm_loss))), flush=True)
print("CHILD_OK", rank, flush=True)
"""
)

ONE_CHANGES = (
    PRELUDE
    + """
fleet.init(is_collective=True, strategy=strategy(2, 4), log_level="WARNING")
model = fleet.distributed_model(TinyLM())
opt = fleet.distributed_optimizer(optax.sgd(0.1))
float(model.train_batch(local, opt, loss_fn=lm_loss))
b = local if rank == 0 else {k: v[:2] for k, v in local.items()}
print("FAULT_AT", rank, time.time(), flush=True)
float(model.train_batch(b, opt, loss_fn=lm_loss))
print("NOT_DETECTED", rank, flush=True)
"""
)

ALONE = """
import os, time
import jax
jax.config.update("jax_num_cpu_devices", 4)
from jfleet import fleet
print("INIT_AT", time.time(), flush=True)
fleet.init(is_collective=True, log_level="WARNING")
print("CONNECTED", flush=True)
"""


def test_consistency_faults_in_two_process_jobs():
    checks_env = paddle_launch_envs(2, init_timeout=60, heartbeat=10)
    change_env = paddle_launch_envs(2, init_timeout=60, heartbeat=10)
    alone_env = paddle_launch_envs(2, init_timeout=INIT_TIMEOUT)
    orphan_env = paddle_launch_envs(2, init_timeout=INIT_TIMEOUT)
    extra = {"JFLEET_CONSISTENCY_TIMEOUT": str(CONSISTENCY_TIMEOUT), "JFLEET_SHUTDOWN_TIMEOUT": "5"}
    envs = [{**e, **extra} for e in (*checks_env, *change_env, alone_env[0], orphan_env[1])]
    started = time.time()
    children = run_concurrently(
        [CHECKS, CHECKS, ONE_CHANGES, ONE_CHANGES, ALONE, ALONE], envs=envs, timeout=100
    )
    checks, changes, (alone, orphan) = children[:2], children[2:4], children[4:]
    report = "\n".join(c.report(f"child {i}") for i, c in enumerate(children))

    # Mismatched strategies: both ranks raise at fleet.init, naming each rank's degrees,
    # within seconds (no collective is reached).
    for rank, child in enumerate(checks):
        assert child.returncode == 0 and f"CHILD_OK {rank}" in child.stdout, report
        assert "NO_STRATEGY_ERROR" not in child.stdout, report
        (message,) = [
            line for line in child.stdout.splitlines() if line.startswith("STRATEGY_ERROR")
        ]
        assert re.search(r"hybrid_configs differs: rank 0 dp2·mp4; rank 1 dp4·mp2", message), (
            message
        )
        assert "mesh shape differs" in message and "same DistributedStrategy" in message, message
        assert float(message.split()[2]) < 30, message
    # Equal shapes: one global loss, bit-identical on both ranks and equal to one process.
    losses = [
        [float(line.split()[2]) for line in c.stdout.splitlines() if line.startswith("LOSS")]
        for c in checks
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 2, report
    reference, _ = train_one_device(TinyLM(), optax.sgd(0.1), lm_batches(1, batch=8) * 2, lm_loss)
    np.testing.assert_allclose(losses[0], reference, rtol=2e-5, atol=1e-6)
    # Mismatched batches: both ranks raise, naming each rank's shape, then recover.
    expected = {
        "rows": r"\['tokens'\] differs: rank 0 int32\[4, 8\]; rank 1 int32\[8, 8\]",
        "seq": r"\['tokens'\] differs: rank 0 int32\[4, 4\]; rank 1 int32\[4, 8\]",
    }
    for child in checks:
        assert "NO_BATCH_ERROR" not in child.stdout, report
        for name, pattern in expected.items():
            (message,) = [
                line for line in child.stdout.splitlines() if line.startswith(f"BATCH_ERROR {name}")
            ]
            assert re.search(pattern, message), message
            assert "drop the last" in message, message
            assert float(message.split()[3]) < 30, message
        rows = "(processes x local rows): rank 0 2 x 4 = 8; rank 1 2 x 8 = 16"
        assert rows in child.stdout, report

    # Only rank 1's shape changes: rank 1 names rank 0's latest signature, not a timeout.
    fault = float(changes[1].stdout.split("FAULT_AT 1 ")[1].split()[0])
    assert "InconsistentBatchError" in changes[1].stderr, report
    assert re.search(
        r"\['tokens'\] differs: rank 0 int32\[4, 8\] \(its batch since shard_batch call #0; "
        # (at once when the watchdog's heartbeat carries consistency.batch_progress())
        r"it (published no new shape for call #1 within 4 s|went past call #1 without a new "
        r"shape)\); rank 1 int32\[2, 8\]",
        changes[1].stderr,
    ), report
    assert "NOT_DETECTED" not in changes[0].stdout + changes[1].stdout, report
    assert changes[1].returncode not in (0, None), report
    assert changes[1].ended_at - fault < 30, report
    # Rank 0 waits in the step's collective; it ends by the watchdog or JAX's heartbeat
    # abort (JFLEET_HEARTBEAT_TIMEOUT=10), else the deadline kills it (reported above).
    assert changes[0].returncode != 0, report

    # A rank that never starts: the other exits with code 1 naming it and the variable,
    # JFLEET_INIT_TIMEOUT seconds after its start (JAX would abort later, naming no rank).
    for child, pattern in (
        (alone, r"jfleet: rank 1 did not connect to the coordinator this process hosts"),
        (orphan, r"jfleet: rank 0 did not connect \(nothing answers at the coordinator"),
    ):
        assert child.returncode == 1, report
        assert re.search(pattern, child.stderr), report
        assert "within 10 s (JFLEET_INIT_TIMEOUT)" in child.stderr, report
        assert "Start all 2 processes" in child.stderr, report
        init_at = float(child.stdout.split("INIT_AT ")[1].split()[0])
        assert INIT_TIMEOUT <= child.ended_at - init_at < INIT_TIMEOUT + 30, report
    assert time.time() - started < 100

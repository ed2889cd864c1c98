"""Checkpoints across process counts: 2 processes save -> 1 restores, and 1 -> 2.

One Fleet ZeRO-3 ``sharding8`` TinyLM run (every parameter split over all 8 devices, so
over both processes) in three places at once: this process (8 CPU devices) and a 2-process
job (4 CPU devices each, started as Paddle's launcher starts them). Each trains 6 steps,
saving after step 3 into its own directory; each then restores the *other's* checkpoint
into a fresh model and trains the last 3 steps. Resumed losses must equal the
uninterrupted ones (within 1e-5 across process counts), and the 2-process checkpoint must
hold one shard file set per process.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

from jfleet.models import lm_batches
from jfleet.testing import make_strategy
from tests.subprocess_util import paddle_launch_envs, run_many
from tests.test_checkpoint import SAVE_AT, STEPS, fleet_losses

HYBRID, STAGE = {"sharding_degree": 8}, 3


def fingerprint(tree) -> str:
    """A digest of every leaf's bytes, shape and dtype (equal only for bit-equal trees)."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        leaf = np.asarray(leaf)
        digest.update(f"{leaf.shape}{leaf.dtype}".encode() + leaf.tobytes())
    return digest.hexdigest()


CHILD = """
import os, itertools
import jax
jax.config.update("jax_num_cpu_devices", 4)
import optax
from jfleet import fleet
from jfleet.checkpoint import CheckpointManager
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.testing import make_strategy
from flax import nnx
from jax.experimental.multihost_utils import process_allgather
from tests.test_checkpoint_multiprocess import fingerprint

def state(model, opt):  # the global arrays, gathered from both processes
    return fingerprint(process_allgather((nnx.state(model), nnx.state(opt)), tiled=True))

rank = int(os.environ["PADDLE_TRAINER_ID"])
strategy = make_strategy({hybrid}, sharding_configs={{"stage": {stage}}})
fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
assert jax.process_count() == 2
half = 8
batches = [{{k: v[rank * half : (rank + 1) * half] for k, v in b.items()}}
           for b in lm_batches({steps})]

def fresh():
    return fleet.distributed_model(TinyLM()), fleet.distributed_optimizer(optax.adam(1e-2))

model, opt = fresh()
with CheckpointManager({mine!r}) as mngr:  # async: returns while both processes write
    for i, batch in enumerate(batches):
        if i == {save_at}:
            assert mngr.save({save_at}, model, opt)
            print("SAVED", rank, state(model, opt), flush=True)
        print("LOSS", rank, repr(float(model.train_batch(batch, opt, loss_fn=lm_loss))), flush=True)
model, opt = fresh()
with CheckpointManager({theirs!r}) as mngr:
    assert mngr.restore(model=model, optimizer=opt)["step"] == {save_at}
print("RESTORED", rank, state(model, opt), flush=True)
for batch in batches[{save_at}:]:
    print("RESUMED", rank, repr(float(model.train_batch(batch, opt, loss_fn=lm_loss))), flush=True)
print("CHILD_OK", rank, flush=True)
"""


def parse(stdout: str, tag: str, rank: int, kind: type = float) -> list:
    """The values a child printed as ``<tag> <rank> <value>`` lines."""
    lines = [line.split() for line in stdout.splitlines()]
    return [kind(w[2]) for w in lines if w[:2] == [tag, str(rank)]]


def test_two_processes_save_one_restores_and_the_reverse(tmp_path):
    one, two = tmp_path / "one_process", tmp_path / "two_processes"
    strategy = make_strategy(HYBRID, sharding_configs={"stage": STAGE})
    batches = lm_batches(STEPS)
    want, saved_one, _ = fleet_losses(strategy, batches, one)  # 1 process: 6 steps, saved at 3
    code = CHILD.format(
        hybrid=HYBRID, stage=STAGE, steps=STEPS, save_at=SAVE_AT, mine=str(two), theirs=str(one)
    )
    results = run_many([code, code], envs=paddle_launch_envs(2), timeout=180)
    for rank, result in enumerate(results):
        report = f"child {rank} rc={result.returncode}\n{result.stdout}\n{result.stderr[-6000:]}"
        assert result.returncode == 0 and f"CHILD_OK {rank}" in result.stdout, report
    two_losses = parse(results[0].stdout, "LOSS", 0)
    assert two_losses == parse(results[1].stdout, "LOSS", 1) and len(two_losses) == STEPS
    np.testing.assert_allclose(two_losses, want, rtol=0, atol=1e-5)  # same run, 2 processes
    # each process wrote its own shards of the 2-process checkpoint
    state = two / str(SAVE_AT) / "state"
    for rank in range(2):  # ZeRO-3: each holds data only it had (the other's shards differ)
        assert any((state / f"ocdbt.process_{rank}" / "d").iterdir()), list(state.iterdir())
    # 1 -> 2: the 2 processes resume from the 1-process checkpoint, bit for bit
    for rank, result in enumerate(results):
        assert parse(result.stdout, "RESTORED", rank, str) == [fingerprint(saved_one)]
    resumed_two = parse(results[0].stdout, "RESUMED", 0)
    assert resumed_two == parse(results[1].stdout, "RESUMED", 1)
    np.testing.assert_allclose(resumed_two, two_losses[SAVE_AT:], rtol=0, atol=1e-5)
    # 2 -> 1: this process resumes from the 2-process checkpoint
    resumed_one, restored_one, _ = fleet_losses(strategy, batches[SAVE_AT:], two, restore=True)
    for rank, result in enumerate(results):  # bit for bit
        assert parse(result.stdout, "SAVED", rank, str) == [fingerprint(restored_one)]
    np.testing.assert_allclose(resumed_one, want[SAVE_AT:], rtol=0, atol=1e-5)

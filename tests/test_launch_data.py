"""One script, unchanged, in one process and under ``python -m jfleet.launch``: equal losses.

The script asks for 8 emulated devices for the whole job (``jfleet.emulate_devices``) and
passes ``jfleet.data.local_rows`` of each global batch to ``train_batch``; every process
reads the same global batches.
"""

from __future__ import annotations

import re
import subprocess

import numpy as np

from tests.subprocess_util import spawn

SCRIPT = """
import jfleet

jfleet.emulate_devices(8)  # the whole job's devices: 4 per process under 2 processes

import optax
from jfleet import fleet
from jfleet.training.data import local_rows
from jfleet.models import TinyLM, lm_batches, lm_loss

strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {"dp_degree": 4, "mp_degree": 2}
fleet.init(is_collective=True, strategy=strategy)  # INFO: its lines print once
model = fleet.distributed_model(TinyLM())
opt = fleet.distributed_optimizer(optax.adam(1e-2))
for batch in lm_batches(3, batch=16):
    loss = model.train_batch(local_rows(batch), opt, loss_fn=lm_loss)
    print(f"loss {float(loss):.6f}", flush=True)
"""


def console(argv: list[str], timeout: float) -> str:
    proc = spawn(argv)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{argv} ran past {timeout}s\n{out}\n{err}") from None
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{out}\n{err}"
    return out + err


def losses(text: str) -> list[float]:
    """The losses a console printed (rank 0's, under the launcher)."""
    return [float(x) for x in re.findall(r"^(?:\[rank 0\] )?(?:step .*)?loss (\S+)$", text, re.M)]


def test_a_script_with_local_rows_runs_unchanged_under_the_launcher(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    one = losses(console([str(script)], timeout=120))
    text = console(
        [
            "-m",
            "jfleet.launch",
            "--nproc_per_node",
            "2",
            "--log_dir",
            str(tmp_path / "log"),
            str(script),
        ],
        timeout=180,
    )
    two = losses(text)
    assert len(one) == 3, one
    lines = [line for line in text.splitlines() if "[Gloo]" not in line]  # the launcher's
    assert sum("fleet initialised" in line for line in lines) == 1, text  # one record, once
    assert len(lines) == len(set(lines)), f"a line printed twice:\n{text}"
    assert len(two) == 3, two
    np.testing.assert_allclose(two, one, rtol=1e-5)  # the same global batches and steps


def test_the_fleet_example_gives_one_process_losses_under_the_launcher(tmp_path):
    args = ["examples/train_fleet.py", "--steps", "3", "--log-every", "1"]
    one = losses(console(args, timeout=120))
    launch = ["-m", "jfleet.launch", "--nproc_per_node", "2", "--log_dir", str(tmp_path)]
    two = losses(console([*launch, *args], timeout=180))
    assert len(one) == 3 and len(two) == 3, (one, two)
    np.testing.assert_allclose(two, one, atol=1e-4)  # printed to 4 decimals

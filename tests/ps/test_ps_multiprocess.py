"""Parameter-server mode in a real 2-process job (1 PSERVER + 1 TRAINER, 4 CPU devices each),
started with Paddle's PS variables: both processes hold table shards and train; a table
saved from both (one part each) loads back; the values equal one process on 8 devices."""

from __future__ import annotations

import re

import numpy as np

from jfleet import fleet
from jfleet.ps import SparseTable
from tests.subprocess_util import free_port, run_many

IDS = [[1, 2, 3], [2, 5, 8], [13, 21, 34], [1, 1, 55]]
LABELS = [1.0, 0.0, 1.0, 0.0]

CHILD = f"""
import os, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
from jfleet import fleet
from jfleet.ps import SparseTable

fleet.init(is_collective=False, log_level="WARNING")
rank = jax.process_index()
assert rank == (0 if os.environ["TRAINING_ROLE"] == "PSERVER" else 1), rank
assert fleet.is_server() and fleet.is_worker() and fleet.server_num() == 2 == jax.process_count()
assert fleet.server_index() == rank and len(jax.devices()) == 8
table = SparseTable(1024, 4, table_id=0)
if fleet.is_server():
    fleet.init_server()
    fleet.run_server()
if fleet.is_worker():
    fleet.init_worker()
    b = table.prepare(np.array({IDS}), labels={LABELS})
    pulled = table.pull(table.state, b.rows)
    table.state = table.push(table.state, b.rows, np.asarray(pulled) + 1.0, b.show, b.click)
    assert fleet.save_one_table(0, sys.argv[1], 0) == int((b.rows >= 0).sum())
    fleet.stop_worker()
fresh = SparseTable(1024, 4, table_id=0, seed=9)
fleet.init_server(sys.argv[1])
vals = fresh.lookup(np.array({IDS}))
print("SUM", rank, repr(float(np.abs(vals).sum())), flush=True)
"""


def test_two_processes_share_the_tables_and_their_saves(tmp_path):
    servers = f"127.0.0.1:{free_port()}"
    base = {"PADDLE_PSERVERS_IP_PORT_LIST": servers, "PADDLE_TRAINERS_NUM": "1"}
    base.update(JFLEET_INIT_TIMEOUT="60", JFLEET_HEARTBEAT_TIMEOUT="20")
    envs = [
        {
            **base,
            "TRAINING_ROLE": "PSERVER",
            "POD_IP": "127.0.0.1",
            "PADDLE_PORT": servers.rpartition(":")[2],
        },
        {**base, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0"},
    ]
    code = CHILD.replace("sys.argv[1]", repr(str(tmp_path)))
    results = run_many([code, code], envs=envs, timeout=150)
    sums = {}
    for r in results:
        assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
        rank, value = re.search(r"^SUM (\d) (\S+)$", r.stdout, re.M).groups()
        sums[int(rank)] = float(value)
    assert sorted(p.name for p in (tmp_path / "0").iterdir()) == [
        "meta.json",
        "part-00000.npz",
        "part-00001.npz",
    ]
    # the same in this process on 8 devices
    fleet.init(is_collective=False, log_level="WARNING")
    table = SparseTable(1024, 4)
    b = table.prepare(np.array(IDS), labels=LABELS)
    pulled = table.pull(table.state, b.rows)
    table.state = table.push(table.state, b.rows, np.asarray(pulled) + 1.0, b.show, b.click)
    expected = float(np.abs(table.lookup(np.array(IDS))).sum())
    np.testing.assert_allclose([sums[0], sums[1]], [expected, expected], rtol=1e-6)

"""What the launcher reports: the first failing rank with its error line, a quiet console.

A worker stopped by the watchdog because a peer failed exits 70 (``ABORT_EXIT_CODE``); the
summary names the peer that failed first, with the line that says why, and Gloo's
connection chatter stays in the worker's log, off the console.
"""

from __future__ import annotations

import textwrap
import time
from types import SimpleNamespace

from jfleet.launch.controller import _first_failure, error_line
from jfleet.launch.rendezvous import RendezvousClient, RendezvousServer
from tests.test_launch import finish, start

TOKEN = b"test-token-0123456789"

WORKERS = """
import os, pathlib, sys, time
out, rank = pathlib.Path(sys.argv[1]), os.environ["PADDLE_TRAINER_ID"]
print("[Gloo] Rank", rank, "is connected to 1 peer ranks.", flush=True)
# two of Gloo's connecting threads at once: the end of one message lands on a line alone
gloo = "[Gloo] Rank {} is connected to 3 peer ranks. Expected number of connected peer ranks is : "
print(gloo.format(0) + gloo.format(1) + "3", "3", "the program's own line:", "3", sep="\\n")
(out / f"printed.{rank}").touch()
(out / f"pid.{rank}.tmp").write_text(str(os.getpid()))
(out / f"pid.{rank}.tmp").rename(out / f"pid.{rank}")
if rank == "1":
    # rank 0's lines are out before rank 1 fails: a loaded machine may start rank 0 late,
    # and the launcher stops rank 0 as soon as rank 1 exits
    deadline = time.monotonic() + 30
    while not (out / "printed.0").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    raise RuntimeError("rank 1 ran out of patience")
# the watchdog's abort comes after its cause has exited (not only logged its error): a
# rank 1 slow to exit on a loaded machine would make rank 0's exit 70 the first failure
while not (out / "pid.1").exists():
    time.sleep(0.01)
stat = pathlib.Path(f"/proc/{(out / 'pid.1').read_text()}/stat")
def running():
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # reaped
        return False
while running():
    time.sleep(0.01)
time.sleep(0.3)
print("jfleet.watchdog: rank 1 is lost (no heartbeat for 30 s); rank 0 stops", flush=True)
os._exit(70)
"""


def test_the_summary_names_the_first_failing_rank_and_gloo_stays_in_the_log(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(WORKERS))
    launcher = start(
        ["--nproc_per_node", "2", "--log_dir", str(tmp_path / "log"), str(script), str(tmp_path)]
    )
    ((rc, out, err),) = finish([launcher], timeout=60)
    assert rc == 1, err
    assert (
        "job failed: worker rank 1 (node 0) exited with code 1: "
        "RuntimeError: rank 1 ran out of patience" in err
    ), err
    assert "[Gloo]" not in out and "[Gloo]" not in err, out
    shown = out.splitlines()
    assert shown.count("[rank 0] 3") == 1, out  # the program's own "3"; Gloo's piece is not
    assert shown.index("[rank 0] 3") == shown.index("[rank 0] the program's own line:") + 1
    assert "[Gloo] Rank 0" in (tmp_path / "log" / "workerlog.0").read_text()


def _worker(rank: int, returncode: int | None) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, proc=SimpleNamespace(returncode=returncode))


def test_a_watchdog_abort_seen_with_its_cause_is_not_reported_first():
    workers = [_worker(0, 70), _worker(1, 1), _worker(2, None)]
    assert _first_failure(workers, [70, 1, None]).rank == 1
    assert _first_failure(workers[:1], [70]).rank == 0  # alone, it is the failure
    assert _first_failure(workers[2:], [None]) is None
    assert error_line(["x", "jfleet.watchdog: rank 3 froze; rank 0 stops", "bye"]) == (
        "jfleet.watchdog: rank 3 froze; rank 0 stops"
    )
    assert error_line(["all fine"]) is None


def test_the_master_reports_the_cause_that_arrives_just_after_its_consequence():
    server = RendezvousServer.bind(
        "127.0.0.1", 0, nnodes=2, timeout_s=5, max_restart=0, token=TOKEN
    )
    server.start()
    a, b = (
        RendezvousClient.connect(server.address, token=TOKEN, nnodes=2, timeout_s=5)
        for _ in range(2)
    )
    for c, rank, port in ((a, 0, 7000), (b, 1, 7001)):
        c.send({"type": "register", "host": "127.0.0.1", "nproc": 1, "ports": [port], "rank": rank})
    assert [a.receive(5)["type"], b.receive(5)["type"]] == ["start", "start"]
    abort = {"what": "worker rank 0 (node 0) exited with code 70", "exit_code": 70}
    cause = {"what": "worker rank 1 (node 1) exited with code 1: ValueError: x", "exit_code": 1}
    a.send({"type": "failed", "failure": abort})
    time.sleep(0.1)
    b.send({"type": "failed", "failure": cause})
    for c in (a, b):
        assert c.receive(5)["type"] == "stop"
        c.send({"type": "stopped"})
    ends = [a.receive(5), b.receive(5)]
    assert [(e["code"], e["failure"]["what"]) for e in ends] == [(1, cause["what"])] * 2
    for c in (a, b):
        c.close()
    server.join(5)

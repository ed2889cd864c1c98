"""``python -m jfleet.launch`` for real: nodes emulated by launchers on this machine.

Each test starts launchers as a user does and checks what they promise: equal losses to one
process, other ports for a concurrent job, a failure reaping every worker (and the workers'
children) on every node with the failed rank, its exit code and its log's last lines, a
restart that resumes from the latest checkpoint, a node that never shows, SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import optax

from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.testing import train_one_device
from tests.subprocess_util import REPO_ROOT, free_port, spawn

EXAMPLES = REPO_ROOT / "examples"
#: The job token every multi-node launcher of these tests shares.
TOKEN = "test-token-0123456789abcdef"


def start(args: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """One launcher (its own session), output captured; DEBUG logs the workers' pids."""
    env = {"JFLEET_JOB_TOKEN": TOKEN, **(env or {})}
    return spawn(["-m", "jfleet.launch", "--log_level", "DEBUG", *args], env=env)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of each launcher; on timeout every process is killed."""
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the launcher reaps its workers
        time.sleep(12)
        outputs = []
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            outputs.append(err)
            for pid in re.findall(r"\(pid (\d+)\)", err):
                kill_group(int(pid))
        raise AssertionError(
            f"launchers ran past {timeout}s:\n" + "\n---\n".join(outputs)
        ) from None
    return results


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def ports_of(stderr: str) -> tuple[str, list[str]]:
    """(coordinator, endpoints) the launcher reported."""
    m = re.search(r"coordinator (\S+), endpoints (\S+)", stderr)
    assert m, stderr
    return m.group(1), m.group(2).split(",")


# ------------------------------------------------------- 2 nodes x 2 processes x 2 devices

SECOND_JOB = """
import os
import jax
jax.distributed.initialize(  # JAX's variables, as the launcher set them
    num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
    process_id=int(os.environ["JAX_PROCESS_ID"]),
    initialization_timeout=60,
)
print("JOB2", jax.process_index(), jax.process_count(), jax.device_count(), flush=True)
"""


def test_two_nodes_train_llama_to_one_process_losses_and_a_concurrent_job_gets_other_ports(
    tmp_path,
):
    steps = 2
    master = f"127.0.0.1:{free_port()}"
    example = [str(EXAMPLES / "llama_to_distributed.py"), "--steps", str(steps)]
    example += ["--mesh", "dp=4,mp=2", "--devices", "8"]
    nodes = [
        start(
            ["--nnodes", "2", "--master", master, "--nproc_per_node", "2"]
            + ["--devices", "0,1,2,3", "--log_dir", str(tmp_path / f"node{i}"), "--job_id", "llama"]
            + (["--host", "127.0.0.2"] if i else [])  # node 1 "on another host"
            + example
        )
        for i in range(2)
    ]
    job2_script = tmp_path / "job2.py"
    job2_script.write_text(textwrap.dedent(SECOND_JOB))
    job2 = start(["--nproc_per_node", "2", "--log_dir", str(tmp_path / "job2"), str(job2_script)])
    results = finish([*nodes, job2], timeout=300)
    for rc, out, err in results:
        assert rc == 0, f"rc={rc}\n{out[-3000:]}\n{err[-3000:]}"

    # the example has no per-process code (global batches); the consoles are quiet
    for _, out, err in results[:2]:
        console = (out + err).splitlines()
        assert not [line for line in console if "[Gloo]" in line], console
        assert not [line for line in console if "INFO:jfleet:" in line], console
        records = [line for line in console if re.search(r"\[jfleet[ .]\w+\]", line)]
        assert len(records) == len(set(records)), f"a record printed twice: {console}"
    # every worker printed the same losses, equal to one device's
    logs = sorted((tmp_path / "node0").glob("workerlog.*")) + sorted(
        (tmp_path / "node1").glob("workerlog.*")
    )
    assert sorted(p.name for p in logs) == [f"workerlog.{r}" for r in range(4)], logs
    losses = []
    for log in logs:
        text = log.read_text()
        assert "8 cpu devices" in text and "layout: dp4 x mp2" in text, text[-3000:]
        losses.append(json.loads(re.search(r"^losses (.*)$", text, re.M).group(1)))
    assert all(row == losses[0] for row in losses), losses
    sys.path.insert(0, str(EXAMPLES))
    try:
        import llama_to_distributed as example_module
    finally:
        sys.path.remove(str(EXAMPLES))
    one = example_module.train_one_device(example_module.parse_args(["--steps", str(steps)]))
    np.testing.assert_allclose(losses[0], one, rtol=1e-5)

    # the local rank 0 of each node echoed, prefixed; ranks from arrival order, one each
    echoed = sorted(
        int(r) for _, out, _ in results[:2] for r in re.findall(r"^\[rank (\d)\]", out, re.M)
    )
    assert sorted(set(echoed)) == [0, 2], echoed
    # the concurrent job: 2 processes x 1 device, other ports than the first job's
    job2_out = results[2][1]
    assert "[rank 0] JOB2 0 2 2" in job2_out, job2_out
    assert "JOB2 1 2 2" in (tmp_path / "job2" / "workerlog.1").read_text()
    coord1, eps1 = ports_of(results[0][2])
    assert (coord1, eps1) == ports_of(results[1][2])  # one job: both nodes agree
    coord2, eps2 = ports_of(results[2][2])
    assert coord1 != coord2 and not set(eps1) & set(eps2), (eps1, eps2)
    assert [e.split(":")[0] for e in eps1] in (
        ["127.0.0.1"] * 2 + ["127.0.0.2"] * 2,
        ["127.0.0.2"] * 2 + ["127.0.0.1"] * 2,
    ), eps1
    assert len(list((tmp_path / "node0").glob("llama.launch.node*.log"))) == 1


# --------------------------------------------------------------------------- failures

WORKER = """
import os, pathlib, subprocess, sys, time
out, failing = pathlib.Path(sys.argv[1]), sys.argv[2]
rank = os.environ["PADDLE_TRAINER_ID"]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
if sys.argv[3:] == ["stubborn"]:
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
# printed before the pids file that lets the failing rank go on: the launcher stops the
# other workers as soon as it fails, and a loaded machine may start one late
print(f"rank {rank} on {os.environ['PADDLE_CURRENT_ENDPOINT']}", flush=True)
(out / f"{rank}.pids.tmp").write_text(f"{os.getpid()} {child.pid}")
(out / f"{rank}.pids.tmp").rename(out / f"{rank}.pids")
if rank == failing:
    while len(list(out.glob("*.pids"))) < int(os.environ["PADDLE_TRAINERS_NUM"]):
        time.sleep(0.05)
    (out / "fault").write_text(str(time.time()))
    if sys.argv[3:] == ["kill"]:
        os.kill(os.getpid(), 9)
    raise RuntimeError(f"boom in rank {rank}")
time.sleep(120)
"""


def pids(out: Path) -> list[int]:
    return [int(p) for f in sorted(out.glob("*.pids")) for p in f.read_text().split()]


def test_a_worker_raising_on_node_1_stops_every_worker_on_both_nodes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    master = f"127.0.0.1:{free_port()}"
    launchers = [
        start(
            [
                "--nnodes",
                "2",
                "--rank",
                str(i),
                "--master",
                master,
                "--nproc_per_node",
                "2",
                "--log_dir",
                str(tmp_path / "log"),
                str(script),
                str(tmp_path),
                "3",
            ]
        )
        for i in range(2)
    ]
    results = finish(launchers, timeout=60)
    done = time.time()
    fault = float((tmp_path / "fault").read_text())
    for rc, _, err in results:
        assert rc == 1, err  # the Python exception's exit code
        assert "job failed: worker rank 3 (node 1) exited with code 1" in err, err
        assert "RuntimeError: boom in rank 3" in err, err  # the last lines of its log
        assert "workerlog.3" in err, err
    assert "stopping this node's workers: worker rank 3 (node 1)" in results[0][2]
    assert len(pids(tmp_path)) == 8  # 4 workers and a child each
    assert not [p for p in pids(tmp_path) if alive(p)], "a process of the job survived"
    assert done - fault < 15, f"the job took {done - fault:.1f} s to stop"


def test_a_killed_worker_is_named_with_its_signal_and_the_job_stops(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    launcher = start(
        [
            *("--nproc_per_node", "2", "--log_dir", str(tmp_path / "log")),
            *(str(script), str(tmp_path), "1", "kill"),
        ]
    )
    ((rc, out, err),) = finish([launcher], timeout=60)
    assert rc == 128 + signal.SIGKILL, err
    assert "job failed: worker rank 1 (node 0) was killed by SIGKILL (exit code 137)" in err, err
    assert "[rank 0] rank 0 on 127.0.0.1:" in out, out  # local rank 0 echoed, prefixed
    assert "rank 0 on" not in err and "rank 1 on" not in out  # rank 1 only in its log
    assert "rank 1 on 127.0.0.1:" in (tmp_path / "log" / "workerlog.1").read_text()
    assert len(pids(tmp_path)) == 4
    assert not [p for p in pids(tmp_path) if alive(p)], "a process of the job survived"


def test_sigterm_to_the_launcher_reaches_the_workers_then_sigkill_after_the_grace(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    launcher = start(
        [
            "--nproc_per_node",
            "2",
            "--log_dir",
            str(tmp_path / "log"),
            str(script),
            str(tmp_path),
            "none",
            "stubborn",  # the workers ignore SIGTERM
        ],
        env={"JFLEET_KILL_GRACE": "1"},
    )
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.pids"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    launcher.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    ((rc, _, err),) = finish([launcher], timeout=30)
    assert 1 <= time.monotonic() - sent < 10, err  # SIGKILL after the 1 s grace
    assert rc == 128 + signal.SIGTERM, err
    assert "the launcher of node 0 got SIGTERM: forwarding it to the workers" in err, err
    assert len(pids(tmp_path)) == 4
    assert not [p for p in pids(tmp_path) if alive(p)], "a process of the job survived"


def test_a_launcher_killed_outright_takes_its_workers_and_the_other_node_stops(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    master = f"127.0.0.1:{free_port()}"
    launchers = [
        start(
            [
                *("--nnodes", "2", "--rank", str(i), "--master", master),
                *("--log_dir", str(tmp_path / "log"), str(script), str(tmp_path), "none"),
            ]
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pids"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    worker1, child1 = (int(p) for p in (tmp_path / "1.pids").read_text().split())
    launchers[1].kill()  # SIGKILL: no reaping by node 1's launcher
    try:
        ((rc, _, err),) = finish(launchers[:1], timeout=30)
        launchers[1].communicate()
        assert rc == 1, err
        assert "job failed: node 1's launcher disconnected" in err, err
        gone = time.monotonic() + 5
        while alive(worker1) and time.monotonic() < gone:
            time.sleep(0.05)
        assert not alive(worker1), "node 1's worker outlived its launcher"
        survivors = [p for p in pids(tmp_path) if alive(p) and p != child1]
        assert not survivors, survivors
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child1, signal.SIGKILL)  # the worker's own child is left to init: documented


def test_a_node_that_never_shows_is_named_and_the_launcher_exits(tmp_path):
    (tmp_path / "never_run.py").write_text("raise SystemExit(5)\n")
    started = time.monotonic()
    launcher = start(
        [
            "--nnodes",
            "3",
            "--rank",
            "0",
            "--master",
            f"127.0.0.1:{free_port()}",
            "--log_dir",
            str(tmp_path / "log"),
            str(tmp_path / "never_run.py"),
        ],
        env={"JFLEET_INIT_TIMEOUT": "2"},
    )
    ((rc, _, err),) = finish([launcher], timeout=60)
    assert rc == 1, err
    assert "1 of 3 nodes registered with the rendezvous within 2 s" in err, err
    assert "2 node(s) never showed" in err, err
    assert time.monotonic() - started < 20


# ---------------------------------------------------------------------------- restart

RESTARTED = """
import os, sys
import jax, optax
from flax import nnx
from jfleet.checkpoint import CheckpointManager
from jfleet.models import TinyLM, lm_batches, lm_loss

directory, steps, fail_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
attempt = os.environ["JFLEET_RESTART_COUNT"]
model = TinyLM()
opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

@nnx.jit
def train_step(model, opt, batch):
    loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
    opt.update(model, grads)
    return loss

batches = lm_batches(steps, batch=8)
with CheckpointManager(directory, async_save=False) as mngr:
    start = 0
    if mngr.latest_step() is not None:
        start = mngr.restore(model=model, optimizer=opt)["step"]
        print("RESUMED", attempt, start, flush=True)
    for i in range(start, steps):
        print("LOSS", attempt, i + 1, repr(float(train_step(model, opt, batches[i]))), flush=True)
        mngr.save(i + 1, model, opt)
        if attempt == "0" and i + 1 == fail_after:
            sys.exit(3)
"""


def test_max_restart_resumes_from_the_latest_checkpoint(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(RESTARTED))
    steps = 4
    launcher = start(
        [
            "--max_restart",
            "1",
            "--log_dir",
            str(tmp_path / "log"),
            str(script),
            str(tmp_path / "ckpt"),
            str(steps),
            "2",
        ]
    )
    ((rc, out, err),) = finish([launcher], timeout=120)
    assert rc == 0, f"{out}\n{err}"
    assert "worker rank 0 (node 0) exited with code 3" in err, err
    assert "restarting the job (restart 1 of 1)" in err, err
    log = (tmp_path / "log" / "workerlog.0").read_text()
    assert "RESUMED 1 2" in log, log
    rows = re.findall(r"^LOSS (\d) (\d) (\S+)$", log, re.M)
    assert [(a, int(s)) for a, s, _ in rows] == [("0", 1), ("0", 2), ("1", 3), ("1", 4)], log
    uninterrupted, _ = train_one_device(
        TinyLM(), optax.sgd(0.1), lm_batches(steps, batch=8), lm_loss
    )
    np.testing.assert_allclose([float(v) for _, _, v in rows], uninterrupted, rtol=1e-5)

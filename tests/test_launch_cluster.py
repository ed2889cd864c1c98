"""``jfleet.launch`` without workers: flags, scheduler variables, ports, env, rendezvous."""

from __future__ import annotations

import socket
import time

import pytest

from jfleet.launch import launch, resolve
from jfleet.launch.args import LaunchArgs, parse_args
from jfleet.launch.cluster import Scheduler, detect
from jfleet.launch.env import worker_env
from jfleet.launch.ports import hold_free_ports, is_free
from jfleet.launch.rendezvous import Node, RendezvousClient, RendezvousServer
from jfleet.runtime.role_maker import PaddleCloudRoleMaker

TOKEN = b"test-token-0123456789"

# ------------------------------------------------------------------------------ flags


def test_flags_defaults_and_script_args():
    a = parse_args(["train.py"], environ={})
    assert (a.nproc_per_node, a.nnodes, a.master, a.rank, a.devices) == (1, 1, None, -1, None)
    assert (a.job_id, a.log_level, a.max_restart, a.start_port) == ("default", "INFO", 0, None)
    assert str(a.log_dir) == "log"
    # everything after the script is the script's, flags included
    a = parse_args(["--job_id=j1", "--nnodes", "2", "--master", "h:1", "t.py", "--nnodes", "9"], {})
    assert (a.job_id, a.nnodes, a.training_script) == ("j1", 2, "t.py")
    assert a.training_script_args == ("--nnodes", "9")


def test_flags_devices_split_and_default_nproc():
    a = parse_args(["--gpus", "4,5,6,7", "t.py"], environ={})
    assert a.nproc_per_node == 4  # one process per device by default, as Paddle
    assert [a.devices_of(i) for i in range(4)] == [("4",), ("5",), ("6",), ("7",)]
    a = parse_args(["--devices", "0,1,2,3,4,5", "--nproc_per_node", "3", "t.py"], environ={})
    assert [a.devices_of(i) for i in range(3)] == [("0", "1"), ("2", "3"), ("4", "5")]


def test_flags_module_form_and_command():
    a = parse_args(["--nproc_per_node", "2", "-m", "pkg.train", "--lr", "1"], environ={})
    assert (a.module, a.training_script, a.training_script_args) == (
        "pkg.train",
        None,
        ("--lr", "1"),
    )
    assert a.command("py") == ["py", "-u", "-m", "pkg.train", "--lr", "1"]


def test_flags_from_paddle_environment_the_flag_winning():
    env = {"PADDLE_NNODES": "2", "PADDLE_MASTER": "10.0.0.1:7000", "PADDLE_JOB_ID": "envjob"}
    a = parse_args(["--job_id", "flagjob", "t.py"], environ=env)
    assert (a.nnodes, a.master, a.job_id) == (2, "10.0.0.1:7000", "flagjob")


BAD_FLAGS = [
    (["--nnodes", "2:4", "t.py"], r"--nnodes='2:4': elastic ranges \(min:max\) are not supported"),
    (["--nnodes", "0", "t.py"], r"--nnodes='0' must be >= 1"),
    (["--nnodes", "two", "t.py"], r"--nnodes='two' is not an integer"),
    (
        ["--master", "etcd://10.0.0.1:2379", "t.py"],
        r"--master='etcd://10.0.0.1:2379': only ip:port",
    ),
    (["--master", "10.0.0.1", "t.py"], r"--master='10.0.0.1': expected ip:port"),
    (["--master", "10.0.0.1:70000", "t.py"], r"port in 1\.\.65535"),
    (["--nproc_per_node", "0", "t.py"], r"--nproc_per_node='0' must be >= 1"),
    (["--devices", "0,1,2", "--nproc_per_node", "2", "t.py"], r"cannot be split evenly among"),
    (["--devices", "0,1,1", "t.py"], r"lists device\(s\) \['1'\] more than once"),
    (["--devices", "a,b", "t.py"], r"--devices='a,b': expected comma-separated device ids"),
    (["--devices", "0,1", "--gpus", "2,3", "t.py"], r"--devices='0,1' and --gpus='2,3' disagree"),
    (["--nnodes", "2", "--rank", "2", "t.py"], r"--rank=2 is out of range for --nnodes=2"),
    (["--rank", "-2", "t.py"], r"--rank='-2' must be >= -1"),
    (["--log_level", "LOUD", "t.py"], r"--log_level='LOUD' is not a level"),
    (["--start_port", "70000", "t.py"], r"--start_port=70000 is above 65535"),
    (["--max_restart", "-1", "t.py"], r"--max_restart='-1' must be >= 0"),
    (["--run_mode", "ps", "t.py"], r"--run_mode='ps': only 'collective'"),
    (["--job_id", "a/b", "t.py"], r"--job_id='a/b': use letters"),
    (["--frobnicate", "1", "t.py"], r"unrecognized arguments: --frobnicate 1"),
    (["--ips", "10.0.0.1,10.0.0.2", "t.py"], r"--ips is not supported: it is the legacy"),
    (["--nproc_per_node", "2"], r"no training script given"),
    (["-m"], r"-m needs a module name"),
]


@pytest.mark.parametrize(("argv", "match"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_are_named_with_their_value(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv, environ={})


def test_missing_script_and_bad_flags_exit_2(tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match=r"training script '.*nope.py' does not exist"):
        parse_args([str(tmp_path / "nope.py")], environ={}).check_script()
    assert launch([str(tmp_path / "nope.py")]) == 2
    script = tmp_path / "t.py"
    script.write_text("")
    assert launch(["--nnodes", "2", str(script)]) == 2  # several nodes, no master, no scheduler
    monkeypatch.setenv("JFLEET_KILL_GRACE", "soon")
    assert launch([str(script)]) == 2
    err = capsys.readouterr().err
    assert (
        "[jfleet.launch] error: JFLEET_KILL_GRACE='soon' is not a number of seconds >= 0" in err
    ), err
    assert "[jfleet.launch] error: training script" in err, err
    assert "[jfleet.launch] error: --nnodes=2 needs --master" in err, err


# -------------------------------------------------------------------------- schedulers


def test_no_scheduler():
    assert detect({"PATH": "/bin"}) is None


def test_slurm_one_launcher_per_node(monkeypatch):
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_NODELIST": "gpu[003-004],other",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
    }
    port = 1234 % 4096 + 65536 - 4096  # JAX's job-derived port in the ephemeral range
    assert detect(env) == Scheduler("slurm", 1, 2, f"gpu003:{port}")
    args = resolve(LaunchArgs(training_script="t.py", nproc_per_node=4), detect(env))
    assert (args.nnodes, args.rank, args.master) == (2, 1, f"gpu003:{port}")
    with pytest.raises(ValueError, match=r"SLURM_NTASKS=8 but SLURM_STEP_NUM_NODES=2: run one"):
        detect({**env, "SLURM_NTASKS": "8"})


def test_open_mpi(monkeypatch):
    env = {
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    }
    port = (1531576320 // 4096) % 4096 + 65536 - 4096
    assert detect(env) == Scheduler("ompi", 1, 3, f"10.96.0.1:{port}")
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_LOCAL_SIZE=2: run one launcher per"):
        detect({**env, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_kubernetes_indexed_job():
    env = {"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "llama-train-2", "JFLEET_K8S_SERVICE": "svc"}
    found = detect(env)
    assert found == Scheduler("kubernetes", 2, None, "llama-train-0.svc:6070")
    args = resolve(LaunchArgs(training_script="t.py", nnodes=4), found)
    assert (args.nnodes, args.rank, args.master) == (4, 2, "llama-train-0.svc:6070")
    with pytest.raises(ValueError, match=r"makes this node 2 but there are 1 nodes; give --nnodes"):
        resolve(LaunchArgs(training_script="t.py"), found)
    with pytest.raises(ValueError, match=r"HOSTNAME='worker' is not '<job>-2'"):
        detect({"JOB_COMPLETION_INDEX": "2", "HOSTNAME": "worker"})


def test_scheduler_contradicting_flags():
    slurm = Scheduler("slurm", 1, 2, "n0:6000")
    with pytest.raises(ValueError, match=r"--nnodes=3 but slurm runs 2 launchers"):
        resolve(LaunchArgs(training_script="t.py", nnodes=3), slurm)
    with pytest.raises(ValueError, match=r"--rank=0 but slurm makes this node 1"):
        resolve(LaunchArgs(training_script="t.py", rank=0), slurm)
    one = resolve(LaunchArgs(training_script="t.py"), Scheduler("slurm", 0, 1, "n0:6000"))
    assert (one.nnodes, one.master) == (1, None)  # one node: a private rendezvous


# ------------------------------------------------------------------------------ ports


def test_held_ports_are_not_free_to_others_but_bindable_with_reuseport():
    held = hold_free_ports(3)
    ports = [h.port for h in held]
    try:
        assert len(set(ports)) == 3
        assert not any(is_free(p) for p in ports)  # another launcher's test fails
        assert not {h.port for h in hold_free_ports(3)} & set(ports)  # (released on gc)
        # what JAX's coordination service (gRPC) does: bind with SO_REUSEPORT and listen
        with socket.socket() as grpc_like:
            grpc_like.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            grpc_like.bind(("", ports[0]))
            grpc_like.listen(1)
    finally:
        for h in held:
            h.release()
    assert all(is_free(p) for p in ports)


def test_start_port_scans_upwards_past_taken_ports():
    first = hold_free_ports(1)[0]
    try:
        got = hold_free_ports(2, start=first.port)
        assert all(h.port > first.port for h in got), (first, got)
        for h in got:
            h.release()
    finally:
        first.release()


# ------------------------------------------------------------------------ workers' env


def test_worker_env_is_what_the_role_maker_reads():
    nodes = [Node("10.0.0.1", 2, (7000, 7001)), Node("10.0.0.2", 2, (7100, 7101))]
    args = LaunchArgs(nproc_per_node=2, nnodes=2, devices=("0", "1", "2", "3"), job_id="j")
    base = {"PATH": "/bin", "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "9"}
    eps = ["10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.2:7100", "10.0.0.2:7101"]
    for node_rank, local_rank, rank in [(0, 0, 0), (0, 1, 1), (1, 0, 2), (1, 1, 3)]:
        env = worker_env(base, args, nodes, node_rank=node_rank, local_rank=local_rank, attempt=2)
        rm = PaddleCloudRoleMaker(environ=env)
        assert (rm.worker_index(), rm.worker_num(), rm.local_rank()) == (rank, 4, local_rank)
        assert (rm.node_num(), rm.worker_endpoints()) == (2, eps)
        assert rm.current_endpoint() == eps[rank]
        assert rm.coordinator_address() == "10.0.0.1:7000"
        assert env["JAX_COORDINATOR_ADDRESS"] == env["PADDLE_MASTER"] == "10.0.0.1:7000"
        assert (env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == ("4", str(rank))
        assert (env["PADDLE_NNODES"], env["PADDLE_LOCAL_RANK"]) == ("2", str(local_rank))
        assert (env["PADDLE_JOB_ID"], env["JFLEET_RESTART_COUNT"]) == ("j", "2")
        share = ["0,1", "2,3"][local_rank]
        assert (env["CUDA_VISIBLE_DEVICES"], env["JAX_NUM_CPU_DEVICES"]) == (share, "2")
        # the launcher's scheduler task variables would make JAX configure itself
        assert "SLURM_PROCID" not in env and "SLURM_LOCALID" not in env
        assert env["SLURM_JOB_ID"] == "9" and env["PATH"] == "/bin"
    env = worker_env(
        {}, LaunchArgs(), [Node("127.0.0.1", 1, (7000,))], node_rank=0, local_rank=0, attempt=0
    )
    assert "CUDA_VISIBLE_DEVICES" not in env and "JAX_NUM_CPU_DEVICES" not in env


# -------------------------------------------------------------------------- rendezvous


def _register(c: RendezvousClient, rank: int, port: int) -> None:
    c.send({"type": "register", "host": "127.0.0.1", "nproc": 1, "ports": [port], "rank": rank})


def test_rendezvous_ranks_relays_the_failure_restarts_and_ends():
    server = RendezvousServer.bind(
        "127.0.0.1", 0, token=TOKEN, nnodes=2, timeout_s=5, max_restart=1
    )
    server.start()
    ranked = RendezvousClient.connect(
        server.address, token=TOKEN, nnodes=server.nnodes, timeout_s=5
    )
    _register(ranked, 1, 7001)  # arrives first but asked for rank 1
    time.sleep(0.1)
    other = RendezvousClient.connect(server.address, token=TOKEN, nnodes=server.nnodes, timeout_s=5)
    _register(other, -1, 7000)
    starts = [ranked.receive(5), other.receive(5)]
    assert [s["node_rank"] for s in starts] == [1, 0]
    assert starts[0]["nodes"] == [
        {"host": "127.0.0.1", "nproc": 1, "ports": [7000]},
        {"host": "127.0.0.1", "nproc": 1, "ports": [7001]},
    ]
    failure = {"what": "worker rank 1 (node 1) exited with code 5", "exit_code": 5}
    ranked.send({"type": "failed", "failure": failure})
    for c in (ranked, other):
        assert c.receive(5) == {"type": "stop", "failure": failure}
        c.send({"type": "stopped"})
    for c in (ranked, other):
        assert c.receive(5) == {"type": "restart", "attempt": 1}
    _register(ranked, 1, 7003)
    _register(other, 0, 7002)
    assert [ranked.receive(5)["attempt"], other.receive(5)["attempt"]] == [1, 1]
    ranked.send({"type": "failed", "failure": failure})  # again: no restart left
    for c in (ranked, other):
        assert c.receive(5)["type"] == "stop"
        c.send({"type": "stopped"})
    ends = [ranked.receive(5), other.receive(5)]
    assert [(e["type"], e["code"], e["failure"]) for e in ends] == [("end", 5, failure)] * 2
    for c in (ranked, other):
        c.close()
    server.join(5)


def test_rendezvous_names_the_nodes_that_never_show():
    # the wait starts with the server: 3 s for this node to connect and register even on a
    # loaded machine (0.5 s was not always enough)
    server = RendezvousServer.bind(
        "127.0.0.1", 0, token=TOKEN, nnodes=3, timeout_s=3, max_restart=0
    )
    server.start()
    c = RendezvousClient.connect(server.address, token=TOKEN, nnodes=server.nnodes, timeout_s=5)
    _register(c, 0, 7000)
    end = c.receive(10)
    assert (end["type"], end["code"]) == ("end", 1)
    assert "1 of 3 nodes registered with the rendezvous within 3 s" in end["error"]
    assert "2 node(s) never showed" in end["error"]
    c.close()


def test_rendezvous_refuses_two_nodes_with_one_rank():
    server = RendezvousServer.bind(
        "127.0.0.1", 0, token=TOKEN, nnodes=2, timeout_s=5, max_restart=0
    )
    server.start()
    a, b = (
        RendezvousClient.connect(server.address, token=TOKEN, nnodes=server.nnodes, timeout_s=5)
        for _ in range(2)
    )
    _register(a, 1, 7000)
    _register(b, 1, 7001)
    assert "two launchers were given --rank 1" in a.receive(5)["error"]
    a.close()
    b.close()


def test_an_unwritable_log_dir_is_an_error_before_any_worker_starts(tmp_path, capsys):
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit('never started')\n")
    taken = tmp_path / "a_file"
    taken.write_text("")
    assert launch(["--log_dir", str(taken / "logs"), str(script)]) == 1
    err = capsys.readouterr().err
    assert f"Not a directory: '{taken / 'logs'}'; check --log_dir" in err, err


@pytest.mark.parametrize(
    ("environ", "argv", "message"),
    [
        ({"PADDLE_RANK": "x"}, [], r"PADDLE_RANK='x' is not an integer"),
        ({"PADDLE_NNODES": "2:4"}, [], r"PADDLE_NNODES='2:4': elastic ranges"),
        ({"PADDLE_RANK": "3", "PADDLE_NNODES": "2"}, [], r"PADDLE_RANK=3 is out of range for PA"),
        ({"PADDLE_MASTER": "10.0.0.1"}, [], r"PADDLE_MASTER='10.0.0.1': expected ip:port"),
        ({"PADDLE_LOG_LEVEL": "loud"}, [], r"PADDLE_LOG_LEVEL='loud' is not a level"),
        ({"POD_IP": "127.0.0.1:1,10.6.6.6"}, [], r"POD_IP='127.0.0.1:1,10.6.6.6' is not a hos"),
        ({}, ["--host", "10.0.0.1 10.0.0.2"], r"--host='10.0.0.1 10.0.0.2' is not a hostname"),
        ({"PADDLE_RANK": "x"}, ["--rank", "y"], r"--rank='y' is not an integer"),  # flag wins
    ],
)
def test_values_from_the_environment_are_named_by_their_variable(environ, argv, message):
    with pytest.raises(ValueError, match=message):
        parse_args([*argv, "t.py"], environ=environ)

"""Tests for jfleet/runtime/role_maker.py: environment parsing, layouts, validation."""

from __future__ import annotations

import time

import pytest

from jfleet.runtime.role_maker import PaddleCloudRoleMaker, Role, UserDefinedRoleMaker
from jfleet.runtime.startup import initialize_distributed, not_connected_message
from tests.fleet_setup import clear_process_env
from tests.subprocess_util import free_port

FOUR = "10.0.0.1:6170,10.0.0.1:6171,10.0.0.2:6170,10.0.0.2:6171"


@pytest.fixture
def env(monkeypatch):
    """A clean process environment; returns a setter of variables."""
    clear_process_env(monkeypatch)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


def test_role_values():
    assert [int(r) for r in Role] == [1, 2, 3, 4, 5]
    assert Role.WORKER == 1 and Role.COORDINATOR == 5


def test_no_variables_is_one_process(env, caplog):
    caplog.set_level("DEBUG", logger="jfleet")
    rm = PaddleCloudRoleMaker()
    assert (rm.worker_index(), rm.worker_num(), rm.node_num(), rm.local_rank()) == (0, 1, 1, 0)
    assert rm.is_worker() and not rm.is_server() and rm.is_first_worker()
    assert rm.server_num() == 0
    assert rm.worker_endpoints() == [] and rm.current_endpoint() == ""
    assert rm.coordinator_address() is None
    assert rm.is_collective and rm.role == Role.WORKER
    assert "one process" in caplog.text


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_four_endpoints_on_two_hosts(env, rank):
    env(PADDLE_TRAINER_ID=rank, PADDLE_TRAINER_ENDPOINTS=FOUR)
    rm = PaddleCloudRoleMaker()
    endpoints = FOUR.split(",")
    assert rm.worker_num() == 4 and rm.worker_index() == rank
    assert rm.node_num() == 2
    assert rm.local_rank() == rank % 2
    assert rm.worker_endpoints() == endpoints
    assert rm.current_endpoint() == endpoints[rank]
    assert rm.coordinator_address() == endpoints[0]
    assert rm.is_first_worker() == (rank == 0)


def test_underscore_aliases(env):
    env(
        PADDLE_TRAINER_ID=2,
        PADDLE_TRAINERS_NUM=4,
        PADDLE_TRAINER_ENDPOINTS=FOUR,
        PADDLE_CURRENT_ENDPOINT="10.0.0.2:6170",
    )
    rm = PaddleCloudRoleMaker()
    assert rm._worker_index() == 2 and rm._worker_num() == 4
    assert rm._is_worker() and not rm._is_server() and not rm._is_first_worker()
    assert rm._server_num() == 0 and rm._node_num() == 2
    assert rm._get_trainer_endpoints() == FOUR.split(",")
    assert rm._get_current_endpoint() == "10.0.0.2:6170"


def test_rank_in_node_and_master_override(env):
    env(
        PADDLE_TRAINER_ID=1,
        PADDLE_TRAINER_ENDPOINTS="127.0.0.1:7000,127.0.0.1:7001",
        PADDLE_RANK_IN_NODE=0,
        PADDLE_MASTER="127.0.0.1:9999",
    )
    rm = PaddleCloudRoleMaker()
    assert rm.local_rank() == 0
    assert rm.coordinator_address() == "127.0.0.1:9999"


def test_jax_variables_alone(env):
    env(JAX_COORDINATOR_ADDRESS="10.0.0.1:1234", JAX_NUM_PROCESSES=3, JAX_PROCESS_ID=2)
    rm = PaddleCloudRoleMaker()
    assert (rm.worker_index(), rm.worker_num()) == (2, 3)
    assert rm.coordinator_address() == "10.0.0.1:1234"
    assert rm.worker_endpoints() == [] and rm.node_num() == 3 and rm.local_rank() == 0


def test_agreeing_paddle_and_jax_variables(env):
    env(
        PADDLE_TRAINER_ID=1,
        JAX_PROCESS_ID=1,
        PADDLE_TRAINERS_NUM=2,
        JAX_NUM_PROCESSES=2,
        PADDLE_TRAINER_ENDPOINTS="h1:1,h2:2",
        PADDLE_TRAINING_ROLE="TRAINER",
    )
    rm = PaddleCloudRoleMaker()
    assert (rm.worker_index(), rm.worker_num(), rm.node_num(), rm.local_rank()) == (1, 2, 2, 0)


def test_rank_from_current_endpoint(env):
    env(PADDLE_TRAINER_ENDPOINTS=FOUR, PADDLE_CURRENT_ENDPOINT="10.0.0.2:6171")
    assert PaddleCloudRoleMaker().worker_index() == 3


def test_single_process_with_count_one(env):
    env(PADDLE_TRAINERS_NUM=1)
    rm = PaddleCloudRoleMaker()
    assert (rm.worker_index(), rm.worker_num()) == (0, 1)


def test_parameter_server_mode_builds_the_ps_role_maker(env):
    from jfleet.ps import PSRoleMaker  # issue 16; tests/ps/test_ps_fleet.py tests it

    assert isinstance(PaddleCloudRoleMaker(is_collective=False), PSRoleMaker)
    with pytest.raises(ValueError, match="needs server_endpoints"):
        UserDefinedRoleMaker(is_collective=False)


def test_user_defined_role_maker():
    rm = UserDefinedRoleMaker(current_id=3, role=Role.WORKER, worker_endpoints=FOUR.split(","))
    assert (rm.worker_index(), rm.worker_num(), rm.node_num(), rm.local_rank()) == (3, 4, 2, 1)
    assert rm.current_endpoint() == "10.0.0.2:6171"
    assert rm.coordinator_address() == "10.0.0.1:6170"
    rm = UserDefinedRoleMaker(worker_num=2, worker_endpoints="a:1,b:2", current_id=1)
    assert rm.worker_num() == 2 and rm.node_num() == 2
    rm = UserDefinedRoleMaker()
    assert (rm.worker_index(), rm.worker_num()) == (0, 1)
    rm = UserDefinedRoleMaker(current_id=1, worker_num=2, coordinator_address="10.1.1.1:80")
    assert rm.coordinator_address() == "10.1.1.1:80"
    assert "worker_num=2" in repr(rm)


BAD_ENV = [
    ({"PADDLE_TRAINER_ID": "2", "PADDLE_TRAINER_ENDPOINTS": "a:1,b:2"}, "PADDLE_TRAINER_ID=2"),
    ({"PADDLE_TRAINER_ID": "-1", "PADDLE_TRAINERS_NUM": "1"}, "PADDLE_TRAINER_ID=-1"),
    (
        {
            "PADDLE_TRAINER_ID": "0",
            "PADDLE_TRAINERS_NUM": "3",
            "PADDLE_TRAINER_ENDPOINTS": "a:1,b:2",
        },
        "PADDLE_TRAINERS_NUM=3 disagrees with the 2 endpoints",
    ),
    (
        {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "2", "JAX_NUM_PROCESSES": "4"},
        "PADDLE_TRAINERS_NUM='2' and JAX_NUM_PROCESSES='4' disagree",
    ),
    (
        {"PADDLE_TRAINER_ID": "1", "JAX_PROCESS_ID": "0", "PADDLE_TRAINERS_NUM": "2"},
        "PADDLE_TRAINER_ID='1' and JAX_PROCESS_ID='0' disagree",
    ),
    ({"PADDLE_TRAINER_ID": "1"}, "PADDLE_TRAINER_ID=1 is set but the number of processes"),
    (
        {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "2"},
        "PADDLE_TRAINERS_NUM=2 but no coordinator",
    ),
    ({"PADDLE_TRAINERS_NUM": "2", "PADDLE_MASTER": "h:1"}, "PADDLE_TRAINER_ID is not set"),
    ({"PADDLE_MASTER": "h:1"}, "PADDLE_MASTER='h:1' is set but the number of processes"),
    (
        {
            "PADDLE_TRAINER_ID": "0",
            "PADDLE_TRAINER_ENDPOINTS": "a:1,b:2",
            "PADDLE_CURRENT_ENDPOINT": "c:3",
        },
        "PADDLE_CURRENT_ENDPOINT='c:3' is not among",
    ),
    (
        {
            "PADDLE_TRAINER_ID": "0",
            "PADDLE_TRAINER_ENDPOINTS": "a:1,b:2",
            "PADDLE_CURRENT_ENDPOINT": "b:2",
        },
        "PADDLE_CURRENT_ENDPOINT='b:2' is at position 1",
    ),
    (
        {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1,127.0.0.2:6170"},
        "endpoint '127.0.0.1' has no port",
    ),
    (
        {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINER_ENDPOINTS": "a:1,b:http"},
        "endpoint 'b:http' has port 'http'",
    ),
    ({"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINER_ENDPOINTS": "a:1,a:1"}, r"\['a:1'\] more than"),
    ({"PADDLE_TRAINER_ID": "zero", "PADDLE_TRAINERS_NUM": "1"}, "PADDLE_TRAINER_ID='zero'"),
    ({"PADDLE_TRAINERS_NUM": "two"}, "PADDLE_TRAINERS_NUM='two' is not an integer"),
    ({"PADDLE_TRAINERS_NUM": "0"}, "PADDLE_TRAINERS_NUM=0"),
    ({"PADDLE_TRAINING_ROLE": "PSERVER"}, "PADDLE_TRAINING_ROLE='PSERVER'"),
    (
        {"PADDLE_MASTER": "a:1", "JAX_COORDINATOR_ADDRESS": "b:2", "PADDLE_TRAINERS_NUM": "1"},
        "PADDLE_MASTER='a:1' and JAX_COORDINATOR_ADDRESS='b:2' disagree",
    ),
    (
        {"JAX_COORDINATOR_ADDRESS": "nohost", "JAX_NUM_PROCESSES": "2"},
        "JAX_COORDINATOR_ADDRESS='nohost'",
    ),
    (
        {
            "PADDLE_TRAINER_ENDPOINTS": "a:1,b:2",
            "PADDLE_TRAINER_ID": "1",
            "PADDLE_RANK_IN_NODE": "5",
        },
        "PADDLE_RANK_IN_NODE=5",
    ),
]


@pytest.mark.parametrize(("values", "message"), BAD_ENV, ids=[m[:40] for _, m in BAD_ENV])
def test_bad_environment(env, values, message):
    env(**values)
    with pytest.raises(ValueError, match=message):
        PaddleCloudRoleMaker()


BAD_USER = [
    ({"current_id": 2, "worker_num": 2, "worker_endpoints": ["a:1", "b:2"]}, "current_id=2"),
    ({"current_id": 0, "worker_num": 3, "worker_endpoints": ["a:1", "b:2"]}, "worker_num=3"),
    ({"current_id": 1, "worker_num": 2}, "worker_num=2 but no coordinator"),
    ({"role": Role.SERVER}, "role=<Role.SERVER: 2>"),
    ({"role": 9}, "role=9 is not a Role"),
    ({"worker_num": -1}, "worker_num=-1"),
    ({"current_id": -1}, "current_id=-1"),
    ({"worker_endpoints": ["a:1", "b"]}, "endpoint 'b' has no port"),
    ({"worker_endpoints": "a:1,b:99999"}, "port 99999"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_USER, ids=[m for _, m in BAD_USER])
def test_bad_user_defined(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UserDefinedRoleMaker(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"current_id": "1"}, "current_id='1'"),
        ({"worker_num": 2.0}, "worker_num=2.0"),
        ({"worker_endpoints": ["a:1", 5]}, "endpoint 5"),
    ],
)
def test_bad_user_defined_types(kwargs, message):
    with pytest.raises(TypeError, match=message):
        UserDefinedRoleMaker(**kwargs)


def test_initialize_one_process_does_nothing(env):
    assert initialize_distributed(PaddleCloudRoleMaker()) is False


def test_initialize_after_backend_started_is_clear(env):
    # conftest already started the 8-device backend in this process.
    import jax

    jax.devices()
    rm = UserDefinedRoleMaker(current_id=0, worker_endpoints=["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(RuntimeError, match=r"call fleet\.init before any JAX computation"):
        initialize_distributed(rm, initialization_timeout=1, heartbeat_timeout_seconds=1)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"JFLEET_INIT_TIMEOUT": "soon"}, "JFLEET_INIT_TIMEOUT='soon'"),
        ({"JFLEET_HEARTBEAT_TIMEOUT": "0"}, "JFLEET_HEARTBEAT_TIMEOUT='0' is not a positive whole"),
        (
            {"JFLEET_SHUTDOWN_TIMEOUT": "1.5"},
            r"JFLEET_SHUTDOWN_TIMEOUT='1\.5' is not a positive whole",
        ),
    ],
)
def test_bad_timeouts(env, values, message):
    env(**values)
    rm = UserDefinedRoleMaker(current_id=0, worker_endpoints=["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(ValueError, match=message):
        initialize_distributed(rm)


@pytest.fixture
def fake_jax_init(env, monkeypatch):
    """jax.distributed.initialize and the watchdog replaced by recorders (no real job)."""
    import jax

    from jfleet.runtime import startup, watchdog

    calls = {"init": [], "watchdog": []}
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(startup, "_backend_started", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls["init"].append(kw))

    def start(**kwargs):
        calls["watchdog"].append(kwargs)

    monkeypatch.setattr(watchdog, "start", start)
    return calls


def test_initialize_passes_every_timeout_and_starts_the_watchdog(env, fake_jax_init):
    rm = UserDefinedRoleMaker(current_id=1, worker_endpoints=["127.0.0.1:1", "127.0.0.1:2"])
    assert initialize_distributed(rm) is True
    env(JFLEET_INIT_TIMEOUT=7, JFLEET_HEARTBEAT_TIMEOUT=8, JFLEET_SHUTDOWN_TIMEOUT=9)
    assert initialize_distributed(rm) is True
    assert initialize_distributed(rm, shutdown_timeout_seconds=3) is True
    default, from_env, given = fake_jax_init["init"]
    # JAX's own connect deadline comes 5 s after jfleet's (which names the missing ranks).
    assert (default["initialization_timeout"], default["heartbeat_timeout_seconds"]) == (305, 100)
    assert default["shutdown_timeout_seconds"] == 60
    assert default["process_id"] == 1 and default["num_processes"] == 2
    assert default["coordinator_address"] == "127.0.0.1:1"
    assert (from_env["initialization_timeout"], from_env["heartbeat_timeout_seconds"]) == (12, 8)
    assert from_env["shutdown_timeout_seconds"] == 9
    assert given["shutdown_timeout_seconds"] == 3
    # The watchdog acts before JAX's heartbeat abort: it is told the heartbeat timeout.
    assert [k["heartbeat_timeout_s"] for k in fake_jax_init["watchdog"]] == [100, 8, 8]


def test_bad_shutdown_timeout_argument(env, fake_jax_init):
    rm = UserDefinedRoleMaker(current_id=0, worker_endpoints=["127.0.0.1:1", "127.0.0.1:2"])
    with pytest.raises(ValueError, match=r"shutdown_timeout_seconds=0 must be a positive"):
        initialize_distributed(rm, shutdown_timeout_seconds=0)
    assert fake_jax_init["init"] == [] and fake_jax_init["watchdog"] == []


@pytest.mark.parametrize(
    ("rank", "num", "up", "expected"),
    [
        (0, 2, None, "rank 1 did not connect to the coordinator this process hosts at h:1"),
        (0, 4, None, "at least one of ranks 1..3 did not connect to the coordinator"),
        (1, 2, False, "rank 0 did not connect (nothing answers at the coordinator address h:1"),
        (2, 4, True, "at least one rank other than 2 did not connect to the coordinator at h:1"),
    ],
)
def test_not_connected_message(rank, num, up, expected):
    text = not_connected_message(
        rank=rank, num=num, coordinator="h:1", timeout=9, coordinator_up=up
    )
    assert expected in text
    assert "within 9 s (JFLEET_INIT_TIMEOUT)" in text and f"this is rank {rank} of {num}" in text
    assert f"Start all {num} processes (ranks 0..{num - 1})" in text


def test_connect_deadline_prints_and_exits(monkeypatch, capsys):
    """Past the timeout the process says who is missing and exits (os._exit, faked)."""
    import threading

    from jfleet.runtime import startup

    exited = threading.Event()
    codes = []

    def fake_exit(code):
        codes.append(code)
        exited.set()

    monkeypatch.setattr(startup.os, "_exit", fake_exit)
    # A rank other than 0 probes the coordinator: nothing listens on this closed port.
    startup._connect(
        lambda: exited.wait(10), rank=1, num=2, coordinator=f"127.0.0.1:{free_port()}", timeout=1
    )
    assert codes == [startup.NOT_CONNECTED_EXIT_CODE]
    assert "jfleet: rank 0 did not connect (nothing answers" in capsys.readouterr().err
    codes.clear()
    startup._connect(lambda: None, rank=0, num=2, coordinator="127.0.0.1:1", timeout=1)
    time.sleep(1.2)  # a connect that returned in time: the deadline never fires
    assert codes == []

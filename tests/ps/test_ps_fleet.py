"""fleet.init(is_collective=False): Paddle's PS role variables, the server / worker calls,
and the table methods by id; every PS name of Paddle's fleet.py exists on jfleet.fleet."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from jfleet import fleet
from jfleet.ps import PSRoleMaker, SparseTable
from jfleet.runtime.role_maker import PaddleCloudRoleMaker, Role, UserDefinedRoleMaker

SERVERS = "10.0.0.1:6000,10.0.0.2:6000"
SEED = Path("/work/shared/seeds/paddle_fleet_fleet.py.txt")
PS_NAMES = (
    "init_worker",
    "init_server",
    "run_server",
    "stop_worker",
    "save_one_table",
    "load_one_table",
    "save_cache_model",
    "save_cache_table",
    "set_date",
    "shrink",
    "save_dense_params",
    "is_server",
    "server_num",
    "server_index",
    "server_endpoints",
)


def ps_env(role: str, **extra: str) -> dict[str, str]:
    env = {"TRAINING_ROLE": role, "PADDLE_PSERVERS_IP_PORT_LIST": SERVERS}
    env["PADDLE_TRAINERS_NUM"] = "2"
    env.update(extra)
    return env


def test_paddles_ps_variables_lay_out_one_job_of_servers_then_trainers():
    env = ps_env("TRAINER", PADDLE_TRAINER_ID="1")
    trainer = PaddleCloudRoleMaker(is_collective=False, environ=env)
    assert isinstance(trainer, PSRoleMaker) and not trainer.is_collective
    assert (trainer.worker_index(), trainer.worker_num(), trainer.server_num()) == (3, 4, 4)
    assert trainer.is_server() and trainer.is_worker() and trainer.role == Role.ALL
    assert trainer.coordinator_address() == "10.0.0.1:6000"
    assert trainer.server_endpoints() == SERVERS.split(",")  # trainers' endpoints not given
    server = PSRoleMaker.from_env(ps_env("PSERVER", POD_IP="10.0.0.2", PADDLE_PORT="6000"))
    assert (server.server_index(), server.paddle_role) == (1, "PSERVER")
    full = PSRoleMaker.from_env(
        ps_env("TRAINER", PADDLE_TRAINER_ID="0", PADDLE_TRAINER_ENDPOINTS="h:1,h:2")
    )
    assert full.server_endpoints() == [*SERVERS.split(","), "h:1", "h:2"]
    user = UserDefinedRoleMaker(
        is_collective=False, current_id=0, role=Role.SERVER, worker_num=2, server_endpoints=SERVERS
    )
    assert isinstance(user, PSRoleMaker) and user.worker_index() == 0 and user.worker_num() == 4
    assert PSRoleMaker.from_env({}).worker_num() == 1  # nothing set: one process


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TRAINING_ROLE": "TRAINER"}, "Can not find PADDLE_PSERVERS_IP_PORT_LIST"),
        (ps_env("TRAINER"), "Can not find PADDLE_TRAINER_ID"),
        (ps_env("TRAINER", PADDLE_TRAINER_ID="2"), r"PADDLE_TRAINER_ID=2 must be in 0\.\.1"),
        (ps_env("PSERVER", POD_IP="10.0.0.9", PADDLE_PORT="6000"), "not in PADDLE_PSERVERS"),
        (ps_env("HETER_TRAINER"), "expected TRAINER or PSERVER"),
    ],
)
def test_a_half_set_ps_environment_is_an_error_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        PaddleCloudRoleMaker(is_collective=False, environ=env)


def test_ps_mode_runs_paddles_script_shape_and_tables_by_id(tmp_path):
    with pytest.raises(RuntimeError, match="fleet.init"):
        fleet.init_server()
    fleet.init(is_collective=False, log_level="WARNING")
    assert not fleet.fleet._is_collective
    assert (fleet.is_server(), fleet.is_worker(), fleet.server_num(), fleet.server_index()) == (
        True,
        True,
        1,
        0,
    )
    table = SparseTable(256, 4, table_id=7)
    assert fleet.run_server() is None
    fleet.init_worker()
    b = table.prepare(np.array([[1, 2], [1, 3]]), labels=[1.0, 1.0])
    table.state = table.push(table.state, b.rows, np.ones((b.rows.size, 4)), b.show, b.click)
    fleet.set_date(7, "20250105")
    assert fleet.save_one_table(7, str(tmp_path), 0) == 3
    assert fleet.save_cache_table(7, 1, 1) == 1  # row 1: 2 clicked shows, the hottest
    assert fleet.save_cache_model(str(tmp_path / "c"), table_id=7) == 1
    before = table.lookup(np.array([1, 2, 3]))
    assert fleet.shrink(threshold=10.0) == {7: 3} and table.present_rows() == 0
    fleet.init_server(str(tmp_path))  # loads every table from the directory
    np.testing.assert_array_equal(table.lookup(np.array([1, 2, 3])), before)
    assert fleet.load_one_table(7, str(tmp_path), 1) == 3
    fleet.stop_worker()
    with pytest.raises(ValueError, match="table_id=8: no sparse table"):
        fleet.save_one_table(8, str(tmp_path), 0)


def test_collective_mode_has_no_servers():
    fleet.init(is_collective=True, log_level="WARNING")
    assert not fleet.is_server() and fleet.server_num() == 0 and fleet.server_endpoints() == []
    with pytest.raises(ValueError, match="collective mode has no parameter servers"):
        fleet.server_index()


def test_every_ps_method_of_paddles_fleet_exists():
    seed = SEED.read_text() if SEED.exists() else ""
    for name in PS_NAMES:
        assert not seed or re.search(rf"def {name}\(", seed), name  # the names are Paddle's
        assert callable(getattr(fleet, name)) and name in fleet.__all__, name

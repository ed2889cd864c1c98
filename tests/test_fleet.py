"""Tests for jfleet/fleet/: ``fleet.init`` and its functions, ``fleet.util``.

Everything here runs in the suite's one process with 8 CPU devices; the 2-process job
is in ``tests/test_fleet_multiprocess.py``. Role makers of several workers are tested
here by replacing ``jax.distributed`` bring-up (``initialize_distributed``) with a
no-op: the answers come from the role maker, the mesh from the 8 local devices.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

from jfleet import fleet
from jfleet import fleet as fleet_module
from jfleet.runtime.role_maker import PaddleCloudRoleMaker, UserDefinedRoleMaker
from jfleet.testing import make_strategy
from jfleet.training import run
from jfleet.training.strategy import DistributedStrategy
from tests.fleet_setup import clear_process_env

NOOP_MESSAGE = "mean nothing under SPMD"


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    """No process variables (a one-process job) and the jfleet logger level restored."""
    clear_process_env(monkeypatch)
    jfleet_logger = logging.getLogger("jfleet")
    level = jfleet_logger.level
    yield
    jfleet_logger.setLevel(level)


def init_as_worker(monkeypatch, current_id: int, worker_num: int):
    """``fleet.init`` with a ``worker_num``-worker role maker, without jax.distributed."""
    monkeypatch.setattr(run, "initialize_distributed", lambda role_maker: False)
    endpoints = [f"127.0.0.1:{6170 + i}" for i in range(worker_num)]
    role_maker = UserDefinedRoleMaker(
        current_id=current_id, worker_num=worker_num, worker_endpoints=endpoints
    )
    return fleet.init(role_maker=role_maker, is_collective=True, log_level="WARNING")


def paddle_file_shard(files, trainer_id, trainers):
    """Paddle's ``UtilBase.get_file_shard``, transcribed."""
    remainder = len(files) % trainers
    blocksize = len(files) // trainers
    blocks = [blocksize] * trainers
    for i in range(remainder):
        blocks[i] += 1
    begin = 0
    shards = []
    for i in range(trainers):
        shards.append(files[begin : begin + blocks[i]])
        begin += blocks[i]
    return shards[trainer_id]


# ------------------------------------------------------------------------ init, one process


def test_init_returns_the_fleet_with_single_process_answers():
    out = fleet.init(role_maker=None, is_collective=True, strategy=None, log_level="INFO")
    assert out is fleet._fleet
    assert fleet.worker_index() == fleet.rank() == 0
    assert fleet.worker_num() == fleet.world_size() == 1
    assert fleet.is_first_worker() is True
    assert fleet.is_worker() is True
    assert fleet.is_server() is False
    assert fleet.server_num() == 0
    assert fleet.node_num() == 1
    assert fleet.local_rank() == 0
    assert fleet.worker_endpoints() == []
    assert fleet.worker_endpoints(to_string=True) == ""
    assert isinstance(fleet._fleet.strategy, DistributedStrategy)
    assert fleet._fleet.strategy == DistributedStrategy()


def test_default_init_arguments():
    # fleet.init() alone is collective (Paddle's default is parameter-server mode).
    assert fleet.init() is fleet._fleet
    assert fleet.worker_num() == 1


def test_device_ids_in_rank_order():
    fleet.init(is_collective=True)
    ids = [d.id for d in jax.devices()]
    assert len(ids) == 8
    assert fleet.world_device_ids() == ids
    assert fleet.local_device_ids() == [d.id for d in jax.local_devices()] == ids
    mesh_ids = [d.id for d in fleet.get_hybrid_communicate_group().mesh.devices.flat]
    assert mesh_ids == fleet.world_device_ids()


def test_worker_endpoints_from_a_user_defined_role_maker():
    role_maker = UserDefinedRoleMaker(current_id=0, worker_endpoints=["10.0.0.1:6170"])
    fleet.init(role_maker=role_maker, is_collective=True)
    assert fleet.worker_endpoints() == ["10.0.0.1:6170"]
    assert fleet.worker_endpoints(to_string=True) == "10.0.0.1:6170"
    assert fleet.worker_num() == 1 and fleet.node_num() == 1


def test_worker_endpoints_from_the_environment(monkeypatch):
    monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:6170")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    fleet.init(role_maker=PaddleCloudRoleMaker(is_collective=True))
    assert fleet.worker_endpoints() == ["127.0.0.1:6170"]
    assert fleet.worker_endpoints(to_string=True) == "127.0.0.1:6170"


def test_barrier_worker_passes():
    fleet.init(is_collective=True)
    assert fleet.barrier_worker() is None


@pytest.mark.parametrize(
    ("mode", "expected", "kind"),
    [("sum", 5, int), ("mean", 5.0, float), ("max", 5, int), ("min", 5, int)],
)
def test_all_reduce_single_process(mode, expected, kind):
    fleet.init(is_collective=True)
    out = fleet.all_reduce(5, mode)
    assert out == expected and type(out) is kind


def test_all_reduce_default_mode_and_arrays():
    fleet.init(is_collective=True)
    assert fleet.all_reduce(2.5) == 2.5
    out = fleet.all_reduce(np.array([1.0, -2.0]), mode="min")
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, [1.0, -2.0])


def test_all_reduce_bad_mode_names_it():
    fleet.init(is_collective=True)
    with pytest.raises(ValueError, match="mode='prod'"):
        fleet.all_reduce(1, mode="prod")


def test_all_reduce_bad_value_names_it():
    fleet.init(is_collective=True)
    with pytest.raises(TypeError, match="str 'one'"):
        fleet.all_reduce("one")


# ------------------------------------------------------------------------ mesh and topology


def test_default_mesh_axes_sizes_and_types():
    fleet.init(is_collective=True)
    mesh = fleet.get_hybrid_communicate_group().mesh
    assert mesh.axis_names == ("dp", "pp", "sharding", "sep", "ep", "mp")
    assert dict(mesh.shape) == {"dp": 8, "pp": 1, "sharding": 1, "sep": 1, "ep": 1, "mp": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 6


def test_hybrid_mesh_follows_the_strategy():
    strategy = make_strategy(dict(dp_degree=2, pp_degree=1, sharding_degree=2, mp_degree=2))
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    mesh = hcg.mesh
    assert mesh.axis_names == ("dp", "pp", "sharding", "sep", "ep", "mp")
    assert dict(mesh.shape) == {"dp": 2, "pp": 1, "sharding": 2, "sep": 1, "ep": 1, "mp": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert hcg.get_data_parallel_world_size() == 2
    assert hcg.get_sharding_parallel_world_size() == 2
    assert hcg.get_model_parallel_world_size() == 2
    assert hcg.get_pipe_parallel_world_size() == 1
    # Row-major: mp is innermost, so rank 0's mp group is ranks 0 and 1.
    assert hcg.get_model_parallel_group().ranks == (0, 1)


def test_hybrid_parallel_topology():
    fleet.init(
        is_collective=True, strategy=make_strategy(dict(dp_degree=2, pp_degree=2, mp_degree=2))
    )
    topo = fleet.get_hybrid_parallel_topology()
    assert topo is fleet.get_hybrid_communicate_group().topology()
    names = ["data", "pipe", "sharding", "sep", "expert", "model"]
    assert topo.get_hybrid_group_names() == names
    assert [topo.get_dim(n) for n in topo.get_hybrid_group_names()] == [2, 2, 1, 1, 1, 2]
    assert topo.world_size() == 8
    assert topo.get_rank(data=1, pipe=0, sharding=0, sep=0, expert=0, model=1) == 5
    assert topo.get_comm_list("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    ("hybrid", "dp"),
    [
        ({}, 8),
        ({"mp_degree": 2}, 4),
        ({"pp_degree": 2, "mp_degree": 2}, 2),
        # jfleet counts sharding and sep when inferring dp (Paddle does not).
        ({"sharding_degree": 2, "mp_degree": 2}, 2),
        ({"sep_degree": 2, "mp_degree": 2}, 2),
        ({"sharding_degree": 4}, 2),
        ({"sharding_degree": 2, "sep_degree": 2, "mp_degree": 2}, 1),
        ({"dp_degree": -1, "sep_degree": 8}, 1),
    ],
)
def test_dp_degree_is_inferred(hybrid, dp):
    strategy = make_strategy(hybrid)
    assert strategy.hybrid_configs["dp_degree"] == -1
    fleet.init(is_collective=True, strategy=strategy)
    shape = dict(fleet.get_hybrid_communicate_group().mesh.shape)
    assert shape["dp"] == dp
    assert np.prod(list(shape.values())) == 8
    for key, value in hybrid.items():
        if key != "dp_degree":
            assert shape[key.removesuffix("_degree")] == value


def test_non_default_order_changes_the_mesh_axis_order():
    order = ["mp", "sep", "sharding", "pp", "dp"]
    strategy = make_strategy(dict(dp_degree=2, mp_degree=4, order=order))
    fleet.init(is_collective=True, strategy=strategy)
    mesh = fleet.get_hybrid_communicate_group().mesh
    # ep, which the order leaves out, goes just outside mp
    assert mesh.axis_names == ("ep", *order)
    assert dict(mesh.shape) == {"ep": 1, "mp": 4, "sep": 1, "sharding": 1, "pp": 1, "dp": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 6
    # mp is now outermost: the devices along mp (dp=0) are every other rank.
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    assert ids[0, :, 0, 0, 0, 0].tolist() == [0, 2, 4, 6]
    assert ids[0, 0, 0, 0, 0, :].tolist() == [0, 1]
    topo = fleet.get_hybrid_parallel_topology()
    assert topo.get_hybrid_group_names() == ["expert", "model", "sep", "sharding", "pipe", "data"]


def test_order_alias_and_cp_entry():
    strategy = DistributedStrategy()
    strategy.hybrid_configs = {"mp_degree": 2, "pp_degree": 2}
    strategy.hybrid_parallel_order = ["pp", "dp", "cp", "sharding", "sep", "mp"]
    fleet.init(is_collective=True, strategy=strategy)
    mesh = fleet.get_hybrid_communicate_group().mesh
    assert mesh.axis_names == ("pp", "dp", "sharding", "sep", "ep", "mp")
    assert dict(mesh.shape) == {"pp": 2, "dp": 2, "sharding": 1, "sep": 1, "ep": 1, "mp": 2}


def test_init_again_rebuilds_the_mesh():
    fleet.init(is_collective=True, strategy=make_strategy(dict(mp_degree=2)))
    assert dict(fleet.get_hybrid_communicate_group().mesh.shape)["mp"] == 2
    fleet.init(is_collective=True, strategy=make_strategy(dict(mp_degree=4)))
    assert dict(fleet.get_hybrid_communicate_group().mesh.shape)["mp"] == 4
    assert fleet._fleet.strategy.hybrid_configs["mp_degree"] == 4


# ------------------------------------------------------------------------ degrees


def test_degrees_whose_product_is_not_the_device_count():
    strategy = make_strategy(dict(dp_degree=2, mp_degree=2))
    with pytest.raises(ValueError, match=r"dp_degree=2 x .*mp_degree=2 = 4.*8 devices") as info:
        fleet.init(is_collective=True, strategy=strategy)
    message = str(info.value)
    for name in ("dp_degree=2", "pp_degree=1", "sharding_degree=1", "sep_degree=1"):
        assert name in message
    # A failed init leaves no fleet behind.
    with pytest.raises(RuntimeError, match="fleet.init"):
        fleet.worker_num()


def test_degrees_too_large_for_the_devices():
    strategy = make_strategy(dict(dp_degree=4, pp_degree=2, mp_degree=2))
    with pytest.raises(ValueError, match=r"dp_degree=4 x pp_degree=2 .*mp_degree=2 = 16.*8 dev"):
        fleet.init(is_collective=True, strategy=strategy)


def test_inferred_dp_that_does_not_divide():
    strategy = make_strategy(dict(mp_degree=3))
    with pytest.raises(ValueError, match=r"dp_degree=-1 .*mp_degree=3 = 3 does not divide the 8"):
        fleet.init(is_collective=True, strategy=strategy)


def test_order_not_a_permutation_names_it():
    strategy = DistributedStrategy()
    with pytest.raises(ValueError, match=r"order=\['dp', 'pp', 'mp'\].*permutation"):
        strategy.hybrid_configs = {"order": ["dp", "pp", "mp"]}
    with pytest.raises(ValueError, match=r"order=\['dp', 'dp', 'pp', 'sharding', 'sep'\]"):
        strategy.hybrid_parallel_order = ["dp", "dp", "pp", "sharding", "sep"]
    with pytest.raises(ValueError, match="'tp'"):
        strategy.hybrid_configs = {"order": ["dp", "pp", "sharding", "sep", "tp"]}


def test_zero_degree_names_it():
    strategy = DistributedStrategy()
    with pytest.raises(ValueError, match="mp_degree=0"):
        strategy.hybrid_configs = {"mp_degree": 0}


# ------------------------------------------------------------------------ bad arguments


def test_parameter_server_mode_makes_every_process_a_worker_and_a_server():
    fleet.init(is_collective=False)  # issue 16: jfleet.ps; tests/ps test it
    assert fleet.is_worker() and fleet.is_server() and not fleet.fleet._is_collective


def test_is_collective_must_be_a_bool():
    with pytest.raises(TypeError, match="is_collective='yes' \\(str\\)"):
        fleet.init(is_collective="yes")


@pytest.mark.parametrize(
    ("role_maker", "named"),
    [
        ("127.0.0.1:6170", r"role_maker='127\.0\.0\.1:6170' \(str\)"),
        (PaddleCloudRoleMaker, r"\(type\) is not a role maker"),
        ({"worker_num": 1}, r"\(dict\) is not a role maker"),
    ],
)
def test_role_maker_of_the_wrong_type(role_maker, named):
    with pytest.raises(TypeError, match=named):
        fleet.init(role_maker=role_maker, is_collective=True)


@pytest.mark.parametrize(
    ("strategy", "named"),
    [
        ({"dp_degree": 8}, r"strategy=\{'dp_degree': 8\} \(dict\) is not a DistributedStrategy"),
        ("dp", r"strategy='dp' \(str\)"),
    ],
)
def test_strategy_of_the_wrong_type(strategy, named):
    with pytest.raises(TypeError, match=named):
        fleet.init(is_collective=True, strategy=strategy)


def test_several_workers_after_jax_started_is_an_error(monkeypatch):
    jax.devices()  # the backend has started in this process
    monkeypatch.setenv("JFLEET_INIT_TIMEOUT", "5")
    role_maker = UserDefinedRoleMaker(
        current_id=0, worker_num=2, worker_endpoints=["127.0.0.1:6170", "127.0.0.1:6171"]
    )
    with pytest.raises(RuntimeError, match=r"call fleet\.init before any JAX.*2-process job"):
        fleet.init(role_maker=role_maker, is_collective=True)


def test_distributed_optimizer_bad_arguments():
    fleet.init(is_collective=True)
    with pytest.raises(TypeError, match=r"optimizer='sgd' \(str\)"):
        fleet.distributed_optimizer("sgd")
    with pytest.raises(TypeError, match=r"strategy=\{'amp': True\} \(dict\)"):
        fleet.distributed_optimizer(optax.sgd(0.1), strategy={"amp": True})


def test_distributed_model_bad_arguments():
    fleet.init(is_collective=True, strategy=make_strategy(dict(pp_degree=2)))
    with pytest.raises(TypeError, match="pp_degree=2 needs the model as a PipelineLayer"):
        fleet.distributed_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_get_loss_scaling_without_fp16():
    fleet.init(is_collective=True)
    with pytest.raises(RuntimeError, match="no fp16 loss scaling"):
        fleet.get_loss_scaling()
    fleet.distributed_optimizer(optax.sgd(0.1))
    with pytest.raises(RuntimeError, match="no fp16 loss scaling"):
        fleet.get_loss_scaling()


def _linear():
    return nnx.Linear(2, 2, rngs=nnx.Rngs(0))


BEFORE_INIT = [
    ("worker_index", lambda: fleet.worker_index()),
    ("worker_index", lambda: fleet.rank()),
    ("worker_num", lambda: fleet.worker_num()),
    ("worker_num", lambda: fleet.world_size()),
    ("worker_num", lambda: fleet.nranks()),
    ("worker_num", lambda: fleet.fleet.worker_num()),
    ("is_first_worker", lambda: fleet.is_first_worker()),
    ("is_worker", lambda: fleet.is_worker()),
    ("is_server", lambda: fleet.is_server()),
    ("server_num", lambda: fleet.server_num()),
    ("node_num", lambda: fleet.node_num()),
    ("local_rank", lambda: fleet.local_rank()),
    ("local_rank", lambda: fleet.rank_in_node()),
    ("_hcg", lambda: fleet.fleet._hcg),
    ("_user_defined_strategy", lambda: fleet.fleet._user_defined_strategy),
    ("local_device_ids", lambda: fleet.local_device_ids()),
    ("world_device_ids", lambda: fleet.world_device_ids()),
    ("worker_endpoints", lambda: fleet.worker_endpoints()),
    ("barrier_worker", lambda: fleet.barrier_worker()),
    ("all_reduce", lambda: fleet.all_reduce(1)),
    ("collective_perf", lambda: fleet.collective_perf("allreduce", round=1)),
    ("get_hybrid_communicate_group", lambda: fleet.get_hybrid_communicate_group()),
    ("get_hybrid_parallel_topology", lambda: fleet.get_hybrid_parallel_topology()),
    ("distributed_model", lambda: fleet.distributed_model(_linear())),
    ("distributed_optimizer", lambda: fleet.distributed_optimizer(optax.sgd(0.1))),
    ("get_loss_scaling", lambda: fleet.get_loss_scaling()),
    ("strategy", lambda: fleet._fleet.strategy),
    ("util.all_reduce", lambda: fleet.util.all_reduce(1)),
    ("util.all_gather", lambda: fleet.util.all_gather(1)),
    ("util.barrier", lambda: fleet.util.barrier()),
    ("util.get_file_shard", lambda: fleet.util.get_file_shard(["a", "b"])),
    ("util.print_on_rank", lambda: fleet.util.print_on_rank("hello", 0)),
    # issue 16 (static-graph and federated names)
    ("amp_init", lambda: fleet.amp_init()),
    ("qat_init", lambda: fleet.qat_init()),
    ("minimize", lambda: fleet.minimize(lambda m, b: 0.0, batch=1)),
    ("is_coordinator", lambda: fleet.is_coordinator()),
    # issue 16: parameter-server names
    ("server_index", lambda: fleet.server_index()),
    ("server_endpoints", lambda: fleet.server_endpoints()),
    ("init_server", lambda: fleet.init_server()),
    ("run_server", lambda: fleet.run_server()),
    ("init_worker", lambda: fleet.init_worker()),
    ("stop_worker", lambda: fleet.stop_worker()),
    ("save_one_table", lambda: fleet.save_one_table(0, "unused", 0)),
    ("load_one_table", lambda: fleet.load_one_table(0, "unused", 0)),
    ("save_cache_table", lambda: fleet.save_cache_table(0, 0)),
    ("save_cache_model", lambda: fleet.save_cache_model("unused")),
    ("set_date", lambda: fleet.set_date(0, "20250101")),
    ("shrink", lambda: fleet.shrink()),
    ("check_save_pre_patch_done", lambda: fleet.check_save_pre_patch_done()),
]


@pytest.mark.parametrize(
    ("name", "call"), BEFORE_INIT, ids=[f"{i}-{n}" for i, (n, _) in enumerate(BEFORE_INIT)]
)
def test_functions_before_init_raise(name, call):
    pattern = rf"fleet\.{name}(\(\))? needs fleet\.init\(\)"
    with pytest.raises(RuntimeError, match=pattern) as info:
        call()
    assert "fleet.init(is_collective=True" in str(info.value)


def test_every_public_function_is_covered_before_init():
    """Each public function of the module that needs a fleet is in BEFORE_INIT."""
    # the scaler needs no fleet; the save / load names work without one given model=
    exempt = {
        "init",
        "util",
        "distributed_scaler",
        "save",
        "save_persistables",
        "save_dense_params",
        "load_model",
        "save_inference_model",
        "load_inference_model",
        # the seed's *_perf(iteration, x, group, ...) log "group invalid" for group=None
        "allreduce_perf",
        "reduce_perf",
        "broadcast_perf",
        "allgather_perf",
        "reduce_scatter_perf",
        # federated mode is refused with or without a fleet (test_fleet_static_methods.py)
        "init_coordinator",
        "make_fl_strategy",
        "get_fl_client",
    }
    names = {
        n
        for n in fleet_module.__all__
        if callable(getattr(fleet_module, n))
        and not isinstance(getattr(fleet_module, n), type)
        and n not in exempt
    }
    covered = {n for n, _ in BEFORE_INIT} | {"rank", "world_size", "nranks", "rank_in_node"}
    assert names <= covered, sorted(names - covered)


# ------------------------------------------------------------------------ fleet.util


def test_util_collectives_single_process():
    fleet.init(is_collective=True)
    assert fleet.util.all_reduce(3) == 3
    assert fleet.util.all_reduce(3, mode="max") == 3
    assert fleet.util.all_reduce(3, mode="min", comm_world="all") == 3
    assert fleet.util.all_reduce(3.0, mode="mean") == 3.0
    out = fleet.util.all_reduce(np.arange(3), "sum")
    np.testing.assert_array_equal(out, [0, 1, 2])
    assert fleet.util.all_gather(7) == [7]
    assert fleet.util.all_gather(0.5, comm_world="worker") == [0.5]
    (gathered,) = fleet.util.all_gather(np.ones((2, 2)))
    np.testing.assert_array_equal(gathered, np.ones((2, 2)))
    assert fleet.util.barrier() is None
    assert fleet.util.barrier("all") is None


@pytest.mark.parametrize("comm_world", ["server", "xpu", ""])
def test_util_bad_comm_world_names_it(comm_world):
    fleet.init(is_collective=True)
    with pytest.raises(ValueError, match=f"comm_world={comm_world!r}"):
        fleet.util.all_reduce(1, comm_world=comm_world)
    with pytest.raises(ValueError, match=f"comm_world={comm_world!r}"):
        fleet.util.all_gather(1, comm_world=comm_world)
    with pytest.raises(ValueError, match=f"comm_world={comm_world!r}"):
        fleet.util.barrier(comm_world=comm_world)


def test_util_all_reduce_bad_mode_names_it():
    fleet.init(is_collective=True)
    with pytest.raises(ValueError, match="mode='avg'"):
        fleet.util.all_reduce(1, mode="avg")


def test_get_file_shard_single_process_is_everything():
    fleet.init(is_collective=True)
    files = [f"part-{i:05d}" for i in range(5)]
    assert fleet.util.get_file_shard(files) == files
    assert fleet.util.get_file_shard([]) == []
    assert fleet.util.get_file_shard(("a", "b")) == ["a", "b"]


@pytest.mark.parametrize(
    ("current_id", "expected"), [(0, ["a", "b", "c"]), (1, ["d", "e"]), (2, ["f", "g"])]
)
def test_get_file_shard_three_workers(monkeypatch, current_id, expected):
    init_as_worker(monkeypatch, current_id, 3)
    assert fleet.worker_num() == 3 and fleet.worker_index() == current_id
    assert fleet.util.get_file_shard(list("abcdefg")) == expected


@pytest.mark.parametrize("current_id", [0, 1, 2])
def test_get_file_shard_matches_paddle(monkeypatch, current_id):
    init_as_worker(monkeypatch, current_id, 3)
    for n in range(12):
        files = [f"f{i}" for i in range(n)]
        shard = fleet.util.get_file_shard(files)
        assert shard == paddle_file_shard(files, current_id, 3), (n, current_id)
    # Fewer files than workers: the first ones get a file, the last ones none.
    assert fleet.util.get_file_shard(["x", "y"]) == [["x"], ["y"], []][current_id]


def test_get_file_shard_shards_cover_the_files_once(monkeypatch):
    files = [f"f{i}" for i in range(10)]
    shards = []
    for current_id in range(4):
        init_as_worker(monkeypatch, current_id, 4)
        shards.append(fleet.util.get_file_shard(files))
    assert [len(s) for s in shards] == [3, 3, 2, 2]
    assert [f for shard in shards for f in shard] == files


def test_several_workers_role_answers(monkeypatch):
    init_as_worker(monkeypatch, 2, 3)
    assert fleet.worker_index() == fleet.rank() == 2
    assert fleet.worker_num() == fleet.world_size() == 3
    assert fleet.is_first_worker() is False
    assert fleet.is_worker() is True and fleet.is_server() is False
    assert fleet.node_num() == 1
    assert fleet.local_rank() == 2
    assert fleet.worker_endpoints() == ["127.0.0.1:6170", "127.0.0.1:6171", "127.0.0.1:6172"]
    assert fleet.worker_endpoints(to_string=True) == (
        "127.0.0.1:6170,127.0.0.1:6171,127.0.0.1:6172"
    )


@pytest.mark.parametrize(
    ("files", "named"),
    [
        ("abc", r"files='abc' \(str\)"),
        ({"a": 1}, r"files=\{'a': 1\} \(dict\)"),
        (["a", 3], r"files=\['a', 3\]"),
        (None, r"files=None \(NoneType\)"),
    ],
)
def test_get_file_shard_not_a_list(files, named):
    fleet.init(is_collective=True)
    with pytest.raises(TypeError, match=named):
        fleet.util.get_file_shard(files)


def test_print_on_rank(capsys):
    fleet.init(is_collective=True)
    fleet.util.print_on_rank("hello from 0", 0)
    assert capsys.readouterr().out == "hello from 0\n"


def test_print_on_rank_other_worker_prints_nothing(monkeypatch, capsys):
    init_as_worker(monkeypatch, 1, 2)
    fleet.util.print_on_rank("for rank 0", 0)
    assert capsys.readouterr().out == ""
    fleet.util.print_on_rank("for rank 1", 1)
    assert capsys.readouterr().out == "for rank 1\n"


@pytest.mark.parametrize("rank_id", [1, -1, "0", True, 0.0])
def test_print_on_rank_bad_rank_names_it(rank_id):
    fleet.init(is_collective=True)
    with pytest.raises(ValueError, match=rf"rank_id={rank_id!r} must be an int in \[0, 1\)"):
        fleet.util.print_on_rank("x", rank_id)


# ------------------------------------------------------------------------ logging


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("DEBUG", logging.DEBUG),
        ("info", logging.INFO),
        ("Warning", logging.WARNING),
        ("ERROR", logging.ERROR),
        ("CRITICAL", logging.CRITICAL),
        (logging.WARNING, logging.WARNING),
        (5, 5),
    ],
)
def test_log_level_sets_the_jfleet_logger(level, expected):
    fleet.init(is_collective=True, log_level=level)
    assert logging.getLogger("jfleet").level == expected


def test_default_log_level_is_info():
    logging.getLogger("jfleet").setLevel(logging.ERROR)
    fleet.init(is_collective=True)
    assert logging.getLogger("jfleet").level == logging.INFO


@pytest.mark.parametrize(
    ("level", "error", "named"),
    [
        ("LOUD", ValueError, "log_level='LOUD'"),
        ("", ValueError, "log_level=''"),
        (1.5, TypeError, r"log_level=1\.5 \(float\)"),
        (None, TypeError, r"log_level=None \(NoneType\)"),
        (True, TypeError, r"log_level=True \(bool\)"),
    ],
)
def test_bad_log_level_names_it(level, error, named):
    with pytest.raises(error, match=named):
        fleet.init(is_collective=True, log_level=level)
    with pytest.raises(RuntimeError, match="fleet.init"):
        fleet.worker_num()


def _noop_records(caplog):
    return [r for r in caplog.records if r.name == "jfleet" and NOOP_MESSAGE in r.getMessage()]


def test_spmd_noop_settings_logged_once_at_init(caplog):
    strategy = DistributedStrategy()
    strategy.fuse_grad_size_in_MB = 64
    strategy.hybrid_configs = {"mp_configs": {"sync_grad": True}}
    assert strategy.spmd_noop_settings() == [
        "fuse_grad_size_in_MB",
        "hybrid_configs.mp_configs.sync_grad",
    ]
    with caplog.at_level(logging.INFO, logger="jfleet"):
        fleet.init(is_collective=True, strategy=strategy, log_level="INFO")
    records = _noop_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    message = records[0].getMessage()
    assert records[0].levelno == logging.INFO
    assert "fuse_grad_size_in_MB" in message
    assert "hybrid_configs.mp_configs.sync_grad" in message
    assert "XLA sizes its own all-reduce buckets" in message


def test_no_noop_message_for_a_default_strategy(caplog):
    with caplog.at_level(logging.INFO, logger="jfleet"):
        fleet.init(is_collective=True, strategy=DistributedStrategy(), log_level="INFO")
    assert _noop_records(caplog) == []
    assert any("fleet initialised" in r.getMessage() for r in caplog.records)


def test_noop_message_hidden_above_info(caplog):
    strategy = DistributedStrategy()
    strategy.nccl_comm_num = 2
    with caplog.at_level(logging.WARNING, logger="jfleet"):
        fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    assert _noop_records(caplog) == []

"""Every public method of Paddle's ``Fleet`` (the seed ``fleet.py``) exists on ``jfleet.fleet``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jfleet import fleet

#: The public methods of ``paddle.distributed.fleet.Fleet`` (paddlepaddle 3.3.1, the seed file).
SEED_METHODS = (
    "all_reduce", "allgather_perf", "allreduce_perf", "amp_init", "barrier_worker",
    "broadcast_perf", "check_save_pre_patch_done", "collective_perf", "distributed_optimizer",
    "get_fl_client", "get_hybrid_communicate_group", "get_hybrid_parallel_topology",
    "get_loss_scaling", "init", "init_coordinator", "init_server", "init_worker",
    "is_coordinator", "is_first_worker", "is_server", "is_worker", "load_inference_model",
    "load_model", "load_one_table", "local_device_ids", "local_rank", "make_fl_strategy",
    "minimize", "node_num", "qat_init", "reduce_perf", "reduce_scatter_perf", "run_server",
    "save", "save_cache_model", "save_cache_table", "save_dense_params", "save_inference_model",
    "save_one_table", "save_persistables", "server_endpoints", "server_index", "server_num",
    "set_date", "shrink", "stop_worker", "worker_endpoints", "worker_index", "worker_num",
    "world_device_ids",
)  # fmt: skip

#: Where the seed lives beside the repository (not shipped with it).
SEED = Path(__file__).resolve().parents[2] / "shared" / "seeds" / "paddle_fleet_fleet.py.txt"


@pytest.mark.parametrize("name", SEED_METHODS)
def test_every_seed_method_is_on_the_fleet_object_and_the_module(name):
    assert callable(getattr(fleet.fleet, name)), name  # the Fleet object (Paddle's fleet.fleet)
    assert callable(getattr(fleet, name)) and name in fleet.__all__, name  # the module


def test_the_list_is_the_seeds_own():
    if not SEED.exists():  # a checkout without the shared folder: the list above stands
        return
    text = SEED.read_text()
    seed = set(re.findall(r"^    def ([a-z]\w*)\(\s*self", text, re.M))
    assert seed == set(SEED_METHODS)


def test_check_save_pre_patch_done_needs_a_fleet_and_then_answers_true():
    with pytest.raises(RuntimeError, match="fleet.init"):
        fleet.check_save_pre_patch_done()
    fleet.init(is_collective=False, log_level="WARNING")
    assert fleet.check_save_pre_patch_done() is True

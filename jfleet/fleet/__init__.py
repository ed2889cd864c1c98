"""The Fleet facade: ``fleet.init`` and the module-level functions Paddle users call.

The facade layer: Paddle's ``paddle.distributed.fleet`` tree on top of the layers; its
submodules never import the package's own ``__init__``.

May import: runtime, mesh, optim, parallel, models, precision, training, auto_parallel,
checkpoint, launch, ps.

As in Paddle, ``jfleet.fleet``'s functions are bound to one process-wide
:class:`~jfleet.fleet.fleet_base.Fleet` object, so a ported script reads the same::

    from jfleet import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "pp_degree": 2, "mp_degree": 2}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    mesh = hcg.mesh  # one jax.sharding.Mesh with axes (dp, pp, sharding, sep, ep, mp)

The package mirrors Paddle's tree (``paddle.distributed.fleet`` → ``jfleet.fleet``):
``fleet.utils`` (``recompute``, ``sequence_parallel_utils``, ``hybrid_parallel_util``,
``mix_precision_utils``), ``fleet.recompute``, ``fleet.layers.mpu`` (``mp_ops``,
``mp_layers``, ``random``), ``fleet.meta_parallel``, ``fleet.meta_optimizers``,
``fleet.base.topology``, ``fleet.scaler``; ``fleet.fleet`` is the :class:`Fleet`
object itself, as in Paddle.

Rank answers are host answers: ``worker_index()`` is this process's index (what
Paddle calls the trainer id); the coordinate of a device on a mesh axis comes from
the :class:`~jfleet.mesh.hybrid_group.HybridCommunicateGroup` getters. The layers are under
``fleet.meta_parallel`` as in Paddle.

This package is the facade only: nothing else in jfleet imports it (the run it starts
is in :mod:`jfleet.mesh.context`), except ``to_distributed``, which calls ``fleet.init``.

Example:
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> fleet.get_hybrid_communicate_group().get_model_parallel_world_size()
  4
"""

from jfleet.checkpoint.inference import load_inference_model as load_inference_model
from jfleet.checkpoint.inference import save_inference_model as save_inference_model
from jfleet.fleet import base as base
from jfleet.fleet import layers as layers
from jfleet.fleet import meta_optimizers as meta_optimizers
from jfleet.fleet import meta_parallel as meta_parallel
from jfleet.fleet import recompute as recompute
from jfleet.fleet import scaler as scaler
from jfleet.fleet import utils as utils
from jfleet.fleet.fleet_base import Fleet as Fleet
from jfleet.fleet.fleet_base import fleet as _the_fleet
from jfleet.fleet.scaler import distributed_scaler as distributed_scaler
from jfleet.fleet.util_base import UtilBase as UtilBase
from jfleet.mesh.hybrid_group import HybridCommunicateGroup as HybridCommunicateGroup
from jfleet.mesh.topology import CommunicateTopology as CommunicateTopology
from jfleet.mesh.topology import ParallelMode as ParallelMode
from jfleet.runtime.role_maker import PaddleCloudRoleMaker as PaddleCloudRoleMaker
from jfleet.runtime.role_maker import Role as Role
from jfleet.runtime.role_maker import UserDefinedRoleMaker as UserDefinedRoleMaker
from jfleet.training.strategy import DistributedStrategy as DistributedStrategy

__all__ = [
    "CommunicateTopology",
    "DistributedStrategy",
    "Fleet",
    "HybridCommunicateGroup",
    "PaddleCloudRoleMaker",
    "ParallelMode",
    "Role",
    "UserDefinedRoleMaker",
    "UtilBase",
    "all_reduce",
    "allgather_perf",
    "allreduce_perf",
    "barrier_worker",
    "base",
    "broadcast_perf",
    "collective_perf",
    "distributed_model",
    "distributed_optimizer",
    "distributed_scaler",
    "fleet",
    "get_hybrid_communicate_group",
    "get_hybrid_parallel_topology",
    "get_loss_scaling",
    "init",
    "is_first_worker",
    "is_server",
    "is_worker",
    "layers",
    "load_inference_model",
    "load_model",
    "local_device_ids",
    "local_rank",
    "meta_optimizers",
    "meta_parallel",
    "node_num",
    "nranks",
    "rank",
    "rank_in_node",
    "recompute",
    "reduce_perf",
    "reduce_scatter_perf",
    "save",
    "save_dense_params",
    "save_inference_model",
    "save_persistables",
    "scaler",
    "server_num",
    "util",
    "utils",
    "worker_endpoints",
    "worker_index",
    "worker_num",
    "world_device_ids",
    "world_size",
]

_fleet = fleet = (
    _the_fleet  # Paddle's ``fleet.fleet``: the Fleet object these functions are bound to
)

init = _fleet.init
worker_index = _fleet.worker_index
rank = _fleet.rank
worker_num = _fleet.worker_num
nranks = _fleet.worker_num
world_size = _fleet.world_size
is_first_worker = _fleet.is_first_worker
is_worker = _fleet.is_worker
is_server = _fleet.is_server
server_num = _fleet.server_num
node_num = _fleet.node_num
local_rank = _fleet.local_rank
rank_in_node = _fleet.local_rank
local_device_ids = _fleet.local_device_ids
world_device_ids = _fleet.world_device_ids
worker_endpoints = _fleet.worker_endpoints
barrier_worker = _fleet.barrier_worker
all_reduce = _fleet.all_reduce
collective_perf = _fleet.collective_perf
allreduce_perf = _fleet.allreduce_perf
reduce_perf = _fleet.reduce_perf
broadcast_perf = _fleet.broadcast_perf
allgather_perf = _fleet.allgather_perf
reduce_scatter_perf = _fleet.reduce_scatter_perf
get_hybrid_communicate_group = _fleet.get_hybrid_communicate_group
get_hybrid_parallel_topology = _fleet.get_hybrid_parallel_topology
distributed_optimizer = _fleet.distributed_optimizer
distributed_model = _fleet.distributed_model
get_loss_scaling = _fleet.get_loss_scaling
save = _fleet.save
save_persistables = _fleet.save_persistables
save_dense_params = _fleet.save_dense_params
load_model = _fleet.load_model
_get_applied_meta_list = _fleet._get_applied_meta_list
util = _fleet.util
_reset = _fleet._reset

# issue 16: static-graph names and federated names
__all__ += [
    "amp_init",
    "get_fl_client",
    "init_coordinator",
    "is_coordinator",
    "make_fl_strategy",
    "minimize",
    "qat_init",
]
amp_init = _fleet.amp_init
qat_init = _fleet.qat_init
minimize = _fleet.minimize
init_coordinator = _fleet.init_coordinator
make_fl_strategy = _fleet.make_fl_strategy
get_fl_client = _fleet.get_fl_client
is_coordinator = _fleet.is_coordinator
# issue 16: parameter-server names
server_index = _fleet.server_index
server_endpoints = _fleet.server_endpoints
init_server = _fleet.init_server
run_server = _fleet.run_server
init_worker = _fleet.init_worker
stop_worker = _fleet.stop_worker
save_one_table = _fleet.save_one_table
load_one_table = _fleet.load_one_table
save_cache_table = _fleet.save_cache_table
save_cache_model = _fleet.save_cache_model
set_date = _fleet.set_date
shrink = _fleet.shrink
check_save_pre_patch_done = _fleet.check_save_pre_patch_done
__all__ += [
    "check_save_pre_patch_done",
    "init_server",
    "init_worker",
    "load_one_table",
    "run_server",
    "save_cache_model",
    "save_cache_table",
    "save_one_table",
    "server_endpoints",
    "server_index",
    "set_date",
    "shrink",
    "stop_worker",
]

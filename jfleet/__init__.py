"""jfleet: PaddlePaddle Fleet's distributed-training API as SPMD on JAX and Flax NNX.

Example:
  >>> from jfleet import fleet
  >>> strategy = fleet.DistributedStrategy()
  >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=strategy)
  >>> dict(fleet.get_hybrid_communicate_group().mesh.shape)["mp"]
  4
"""

from jfleet import auto_parallel as auto_parallel
from jfleet import fleet as fleet
from jfleet import interrupts as interrupts
from jfleet._devices import emulate_devices as emulate_devices
from jfleet._devices import emulate_from_env as _emulate_from_env
from jfleet.auto_parallel import ToDistributedConfig as ToDistributedConfig
from jfleet.auto_parallel import to_distributed as to_distributed
from jfleet.consistency import ConsistencyTimeoutError as ConsistencyTimeoutError
from jfleet.consistency import InconsistentBatchError as InconsistentBatchError
from jfleet.consistency import InconsistentJobError as InconsistentJobError
from jfleet.data import ShardedLoader as ShardedLoader
from jfleet.distributed.sharding import save_group_sharded_model as save_group_sharded_model
from jfleet.distributed_model import DistributedModel as DistributedModel
from jfleet.distributed_optimizer import DistributedOptimizer as DistributedOptimizer
from jfleet.engine import make_eval_step as make_eval_step
from jfleet.engine import make_train_step as make_train_step
from jfleet.fleet import meta_parallel as meta_parallel
from jfleet.fleet.group_sharded import group_sharded_parallel as group_sharded_parallel
from jfleet.interrupts import on_termination as on_termination
from jfleet.nonfinite import NonFiniteError as NonFiniteError
from jfleet.placement import ParallelPlan as ParallelPlan
from jfleet.placement import Placement as Placement
from jfleet.role_maker import PaddleCloudRoleMaker as PaddleCloudRoleMaker
from jfleet.role_maker import Role as Role
from jfleet.role_maker import UserDefinedRoleMaker as UserDefinedRoleMaker
from jfleet.strategy import DistributedStrategy as DistributedStrategy
from jfleet.topology import CommunicateTopology as CommunicateTopology
from jfleet.topology import HybridCommunicateGroup as HybridCommunicateGroup
from jfleet.topology import ParallelMode as ParallelMode
from jfleet.watchdog import PeerFailedError as PeerFailedError

__version__ = "0.1.0"

_emulate_from_env()  # JFLEET_CPU_DEVICES (importing jfleet starts no JAX backend)

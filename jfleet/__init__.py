"""jfleet: PaddlePaddle Fleet's distributed-training API as SPMD on JAX and Flax NNX.

The package is read from the bottom up; each folder is a layer and imports only from the
layers below it (see ``CONTRIBUTING.md``):

- ``runtime``: processes (env, logging, role makers, coordination, watchdog, consistency)
- ``mesh``: topology and axis names, the current run, placement, collectives
- ``optim``: meta-optimizers as Optax transforms and the strategy compiler
- ``parallel``: tensor / sequence-parallel layers, the block stacker, pipelines
- ``precision``: AMP, GradScaler, quantisation, batch-norm policy, the non-finite guard;
  ``models``, beside it: reference models built from the parallel layers
- ``training``: the strategy, the engine, replicas, the distributed model and optimizer
- ``auto_parallel``: ``to_distributed``: matching, the cost model, the planner
- ``checkpoint``, ``ps``, ``launch``: operational subsystems
- ``fleet``, ``distributed``, ``incubate``: Paddle's package trees (facades); ``testing``:
  users' test tools

This file imports nothing eagerly: ``import jfleet.launch`` needs no JAX. The names below
load on first use, and the module paths of earlier releases (``jfleet.amp``,
``jfleet.strategy``, ``jfleet.collective``, ...) stay importable as aliases of the
modules' homes in the layers.

Example:
  >>> from jfleet import fleet
  >>> strategy = fleet.DistributedStrategy()
  >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=strategy)
  >>> dict(fleet.get_hybrid_communicate_group().mesh.shape)["mp"]
  4
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it (loaded on first access).
_EXPORTS: dict[str, str] = {
    "ToDistributedConfig": "jfleet.auto_parallel",
    "to_distributed": "jfleet.auto_parallel",
    "save_group_sharded_model": "jfleet.distributed.sharding",
    "meta_parallel": "jfleet.fleet",
    "group_sharded_parallel": "jfleet.fleet.group_sharded",
    "LazyGuard": "jfleet.mesh.lazy",
    "ParallelPlan": "jfleet.mesh.placement",
    "Placement": "jfleet.mesh.placement",
    "CommunicateTopology": "jfleet.mesh.topology",
    "HybridCommunicateGroup": "jfleet.mesh.hybrid_group",
    "ParallelMode": "jfleet.mesh.topology",
    "NonFiniteError": "jfleet.precision.nonfinite",
    "ConsistencyTimeoutError": "jfleet.runtime.consistency",
    "InconsistentBatchError": "jfleet.runtime.consistency",
    "InconsistentJobError": "jfleet.runtime.consistency",
    "on_termination": "jfleet.runtime.interrupts",
    "PaddleCloudRoleMaker": "jfleet.runtime.role_maker",
    "Role": "jfleet.runtime.role_maker",
    "UserDefinedRoleMaker": "jfleet.runtime.role_maker",
    "PeerFailedError": "jfleet.runtime.watchdog",
    "ShardedLoader": "jfleet.training.data",
    "DistributedModel": "jfleet.training.distributed_model",
    "DistributedOptimizer": "jfleet.training.distributed_optimizer",
    "make_eval_step": "jfleet.training.engine",
    "make_train_step": "jfleet.training.engine",
    "DistributedStrategy": "jfleet.training.strategy",
    "emulate_devices": "jfleet.runtime.devices",
}

#: Stable module paths of earlier releases (named by the README, docs and Paddle ports) ->
#: the module's home. ``import jfleet.amp`` gives the very module ``jfleet.precision.amp``.
_MODULE_ALIASES: dict[str, str] = {
    "jfleet.watchdog": "jfleet.runtime.watchdog",
    "jfleet.consistency": "jfleet.runtime.consistency",
    "jfleet.interrupts": "jfleet.runtime.interrupts",
    "jfleet.role_maker": "jfleet.runtime.role_maker",
    "jfleet.topology": "jfleet.mesh.topology",
    "jfleet.placement": "jfleet.mesh.placement",
    "jfleet.collective": "jfleet.mesh.collective",
    "jfleet.group_collective": "jfleet.mesh.group_collective",
    "jfleet.collective_perf": "jfleet.mesh.collective_perf",
    "jfleet.recompute": "jfleet.parallel.recompute",
    "jfleet.amp": "jfleet.precision.amp",
    "jfleet.grad_scaler": "jfleet.precision.grad_scaler",
    "jfleet.quantization": "jfleet.precision.quantization",
    "jfleet.batch_norm": "jfleet.precision.batch_norm",
    "jfleet.nonfinite": "jfleet.precision.nonfinite",
    "jfleet.engine": "jfleet.training.engine",
    "jfleet.replicas": "jfleet.training.replicas",
    "jfleet.data": "jfleet.training.data",
    "jfleet.distributed_model": "jfleet.training.distributed_model",
    "jfleet.distributed_optimizer": "jfleet.training.distributed_optimizer",
    "jfleet.strategy": "jfleet.training.strategy",
    "jfleet.inference": "jfleet.checkpoint.inference",
    "jfleet.parallel.pipeline_parallel": "jfleet.training.pipeline_parallel",
}

#: ``jfleet.auto_parallel``'s modules by stage folder: their flat paths of earlier releases
#: (``jfleet.auto_parallel.patterns``) alias their homes (``...auto_parallel.match.patterns``).
_AUTO_PARALLEL_STAGES: dict[str, tuple[str, ...]] = {
    "match": (
        "attention_trace", "block_calls", "block_check", "block_extras", "dataflow",
        "matched", "module_parts", "pairs", "patterns", "tag_walk",
    ),
    "cost": (
        "cost_comm", "cost_memory", "cost_model", "cost_types", "memo", "profiles",
        "step_shape", "step_work",
    ),
    "search": ("cluster_plan", "layouts", "model_shapes", "plan", "planner"),
    "apply": ("apply_plan", "blocks", "scanned_blocks"),
}  # fmt: skip
_MODULE_ALIASES.update(
    {
        f"jfleet.auto_parallel.{module}": f"jfleet.auto_parallel.{stage}.{module}"
        for stage, modules in _AUTO_PARALLEL_STAGES.items()
        for module in modules
    }
)

_SUBPACKAGES = (
    "auto_parallel",
    "checkpoint",
    "distributed",
    "fleet",
    "incubate",
    "launch",
    "mesh",
    "models",
    "optim",
    "parallel",
    "precision",
    "ps",
    "runtime",
    "testing",
    "training",
)


def _alias_target(fullname: str) -> str | None:
    """The real module behind an alias path (a submodule of an aliased package too)."""
    for alias, home in _MODULE_ALIASES.items():
        if fullname == alias or fullname.startswith(alias + "."):
            return home + fullname[len(alias) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands out the already-imported real module under the alias name."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(self.target)
        self._home_spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        """Nothing to run (the real module ran when imported); its own spec is put back."""
        module.__spec__ = self._home_spec

    def get_code(self, fullname: str) -> Any:
        """For ``python -m jfleet.<alias>``: the real module's code."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)  # type: ignore[union-attr]


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``jfleet.<old path>`` to the module's home in its layer."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        home = _alias_target(fullname)
        if home is None:
            return None
        real = importlib.util.find_spec(home)
        if real is None:
            return None
        # the real file as origin: ``runpy`` sets ``sys.argv[0]`` from it (``python -m``)
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(home), origin=real.origin)
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())

# JFLEET_CPU_DEVICES, read at ``import jfleet`` (imports JAX only when it is set).
importlib.import_module("jfleet.runtime.devices").emulate_from_env()


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBPACKAGES or f"jfleet.{name}" in _MODULE_ALIASES:
        value = importlib.import_module(f"jfleet.{name}")
    else:
        raise AttributeError(f"module 'jfleet' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    aliases = [a.split(".", 1)[1] for a in _MODULE_ALIASES if a.count(".") == 1]
    return sorted({*globals(), *_EXPORTS, *_SUBPACKAGES, *aliases})


__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what static tools and IDEs see
    from jfleet import auto_parallel as auto_parallel
    from jfleet import fleet as fleet
    from jfleet.auto_parallel import ToDistributedConfig as ToDistributedConfig
    from jfleet.auto_parallel import to_distributed as to_distributed
    from jfleet.distributed.sharding import save_group_sharded_model as save_group_sharded_model
    from jfleet.fleet import meta_parallel as meta_parallel
    from jfleet.fleet.group_sharded import group_sharded_parallel as group_sharded_parallel
    from jfleet.mesh.hybrid_group import HybridCommunicateGroup as HybridCommunicateGroup
    from jfleet.mesh.placement import ParallelPlan as ParallelPlan
    from jfleet.mesh.placement import Placement as Placement
    from jfleet.mesh.topology import CommunicateTopology as CommunicateTopology
    from jfleet.mesh.topology import ParallelMode as ParallelMode
    from jfleet.precision.nonfinite import NonFiniteError as NonFiniteError
    from jfleet.runtime import interrupts as interrupts
    from jfleet.runtime.consistency import ConsistencyTimeoutError as ConsistencyTimeoutError
    from jfleet.runtime.consistency import InconsistentBatchError as InconsistentBatchError
    from jfleet.runtime.consistency import InconsistentJobError as InconsistentJobError
    from jfleet.runtime.devices import emulate_devices as emulate_devices
    from jfleet.runtime.interrupts import on_termination as on_termination
    from jfleet.runtime.role_maker import PaddleCloudRoleMaker as PaddleCloudRoleMaker
    from jfleet.runtime.role_maker import Role as Role
    from jfleet.runtime.role_maker import UserDefinedRoleMaker as UserDefinedRoleMaker
    from jfleet.runtime.watchdog import PeerFailedError as PeerFailedError
    from jfleet.training.data import ShardedLoader as ShardedLoader
    from jfleet.training.distributed_model import DistributedModel as DistributedModel
    from jfleet.training.distributed_optimizer import (
        DistributedOptimizer as DistributedOptimizer,
    )
    from jfleet.training.engine import make_eval_step as make_eval_step
    from jfleet.training.engine import make_train_step as make_train_step
    from jfleet.training.strategy import DistributedStrategy as DistributedStrategy

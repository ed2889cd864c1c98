"""The :class:`Fleet` object behind :mod:`jfleet.fleet`'s module functions.

Its state (role maker, strategy, hybrid group) lives in :mod:`jfleet.mesh.context`, where
layers, placement and the engine read it; the object adds the getters Paddle users call
and the last distributed optimizer (for ``get_loss_scaling``).

Example:
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True, log_level="WARNING")
  >>> fleet.worker_num(), fleet.get_hybrid_communicate_group().mesh.size
  (1, 8)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

import jfleet.checkpoint.state_dict as _state_dict
from jfleet.fleet.federated import FederatedMethods
from jfleet.fleet.perf import PerfMethods
from jfleet.fleet.ps_methods import PSMethods
from jfleet.fleet.static_methods import StaticMethods
from jfleet.fleet.util_base import UtilBase
from jfleet.mesh import collective
from jfleet.mesh import context as _context
from jfleet.mesh.hybrid_group import HybridCommunicateGroup
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import CommunicateTopology
from jfleet.parallel.pipeline_layer import PipelineLayer
from jfleet.parallel.random import get_rng_state_tracker, set_init_mode
from jfleet.runtime.log import logger, set_log_level
from jfleet.runtime.role_maker import (
    PaddleCloudRoleMaker,
    RoleMakerBase,
)
from jfleet.training.distributed_model import DistributedModel, prepare_model
from jfleet.training.distributed_optimizer import (
    DistributedOptimizer,
    make_distributed_optimizer,
)
from jfleet.training.pipeline_parallel import pipeline_model
from jfleet.training.run import start_run
from jfleet.training.strategy import DistributedStrategy


class Fleet(PerfMethods, StaticMethods, FederatedMethods, PSMethods):
    """Process-wide state of a jfleet run: role maker, strategy and hybrid mesh.

    Use the module-level functions of :mod:`jfleet.fleet`; they are this object's
    bound methods.

    Example:
      >>> from jfleet import fleet
      >>> _ = fleet.init(is_collective=True)
      >>> fleet.worker_num()
      1
    """

    def __init__(self) -> None:
        # Inert: the facade is built when ``jfleet.fleet`` is first imported, which may be
        # after a run started (``to_distributed`` does not import it), so it touches no run
        # state, RNG tracker or table; ``fleet.init`` and :meth:`_reset` do.
        self._model: nnx.Module | None = None
        self._ps_worker_started = False
        self.util = UtilBase(self)

    def _reset(self) -> None:
        """Forgets the run: its mesh and optimizer, the RNG tracker's states, the init mode,
        the parameter-server tables (the pytest plugin's ``fleet_reset`` calls it)."""
        get_rng_state_tracker().reset()
        set_init_mode("replicable")
        _context.clear()
        self._ps_reset()
        self._model: nnx.Module | None = None

    @property
    def _optimizer(self) -> DistributedOptimizer | None:
        """The run's distributed optimizer (``fleet.distributed_optimizer`` or
        ``to_distributed`` made it); None before one, and after a new ``fleet.init``."""
        run = _context.current()
        return None if run is None else run.optimizer

    @_optimizer.setter
    def _optimizer(self, optimizer: DistributedOptimizer | None) -> None:
        _context.replace(optimizer=optimizer)

    def _require_init(self, what: str) -> _context.Run:
        return _context.require(f"fleet.{what}()")

    # ----------------------------------------------------------------- init
    def init(
        self,
        role_maker: RoleMakerBase | None = None,
        is_collective: bool = True,
        strategy: DistributedStrategy | None = None,
        log_level: str | int = "INFO",
        *,
        devices: Sequence[jax.Device] | None = None,
    ) -> Fleet:
        """Starts the processes (if several), and builds the one hybrid-parallel mesh.

        Call it once at the top of a script, before any JAX computation when the run
        has several processes (``jax.distributed.initialize`` must come first).
        Calling it again in the same process (a notebook) rebuilds the mesh from
        the new strategy; the process group stays as it was.

        Args:
          role_maker: where the process layout comes from; default
            ``PaddleCloudRoleMaker(is_collective=is_collective)``, which reads Paddle's
            ``PADDLE_*`` and JAX's ``JAX_*`` variables (none set: one process).
          is_collective: False starts parameter-server mode (:mod:`jfleet.ps.role_maker`:
            Paddle's PS variables; every process holds table shards and trains).
          strategy: a :class:`DistributedStrategy`; default ``DistributedStrategy()``
            (pure data parallel over every device).
          log_level: level of the ``jfleet`` logger.
          devices: the devices the mesh spans, in rank order (a jfleet addition; default
            every device of the run). ``to_distributed(device_num=...)`` uses it.

        Returns:
          The fleet object (the module functions act on it too).

        Raises:
          TypeError: a role maker or strategy of the wrong type.
          ValueError: degrees whose product is not the device count, and the role
            makers' errors for contradictory process settings.
          jfleet.consistency.InconsistentJobError: (several processes) the processes'
            strategies, meshes, process counts or package versions differ; raised on
            every process, naming each one's value.

        Example:
          >>> from jfleet import fleet
          >>> strategy = fleet.DistributedStrategy()
          >>> strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
          >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
          >>> dict(fleet.get_hybrid_communicate_group().mesh.shape)["mp"]
          4
        """
        if not isinstance(is_collective, bool):
            raise TypeError(
                f"is_collective={is_collective!r} ({type(is_collective).__name__}) must be a bool."
            )
        if role_maker is None:
            role_maker = PaddleCloudRoleMaker(is_collective=is_collective)
        elif not isinstance(role_maker, RoleMakerBase):
            raise TypeError(
                f"role_maker={role_maker!r} ({type(role_maker).__name__}) is not a role maker; "
                "pass PaddleCloudRoleMaker(...) or UserDefinedRoleMaker(...)."
            )
        if role_maker.is_collective != is_collective:
            logger.info("fleet.init: the role maker's mode wins over is_collective (as Paddle)")
        if strategy is None:
            strategy = DistributedStrategy()
        elif not isinstance(strategy, DistributedStrategy):
            raise TypeError(
                f"strategy={strategy!r} ({type(strategy).__name__}) is not a "
                "DistributedStrategy; build one with fleet.DistributedStrategy()."
            )
        set_log_level(log_level)
        start_run(role_maker, strategy, devices)
        if not role_maker.is_collective:
            self._ps_started(strategy)
        return self

    # ------------------------------------------------------------ processes
    def worker_index(self) -> int:
        """This process's index among the workers (Paddle's trainer id).

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.worker_index(), fleet.rank()
          (0, 0)
        """
        return self._require_init("worker_index").role_maker.worker_index()

    rank = worker_index

    def worker_num(self) -> int:
        """The number of worker processes.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.worker_num(), fleet.world_size(), fleet.nranks()
          (1, 1, 1)
        """
        return self._require_init("worker_num").role_maker.worker_num()

    world_size = worker_num

    def is_first_worker(self) -> bool:
        """Whether this process is worker 0.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.is_first_worker()
          True
        """
        return self._require_init("is_first_worker").role_maker.is_first_worker()

    def is_worker(self) -> bool:
        """Always True in collective mode.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.is_worker()
          True
        """
        return self._require_init("is_worker").role_maker.is_worker()

    def is_server(self) -> bool:
        """Always False in collective mode (no parameter servers).

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.is_server()
          False
        """
        return self._require_init("is_server").role_maker.is_server()

    def server_num(self) -> int:
        """0 in collective mode.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.server_num()
          0
        """
        return self._require_init("server_num").role_maker.server_num()

    def node_num(self) -> int:
        """The number of distinct hosts among the worker endpoints.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.node_num()
          1
        """
        return self._require_init("node_num").role_maker.node_num()

    def local_rank(self) -> int:
        """This process's index among the processes on its host.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.local_rank(), fleet.rank_in_node()
          (0, 0)
        """
        return self._require_init("local_rank").role_maker.local_rank()

    rank_in_node = local_rank
    nranks = worker_num

    def local_device_ids(self) -> list[int]:
        """Ids of the devices this process drives.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> len(fleet.local_device_ids())
          8
        """
        self._require_init("local_device_ids")
        return [d.id for d in jax.local_devices()]

    def world_device_ids(self) -> list[int]:
        """Ids of every device of the run, in Paddle rank order.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> len(fleet.world_device_ids())
          8
        """
        self._require_init("world_device_ids")
        return [d.id for d in jax.devices()]

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        """The workers' ``host:port`` endpoints (a comma-joined string if ``to_string``).

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.worker_endpoints()  # one process, not launched: no endpoints
          []
        """
        endpoints = list(self._require_init("worker_endpoints").role_maker.worker_endpoints())
        return ",".join(endpoints) if to_string else endpoints

    def barrier_worker(self) -> None:
        """Blocks until every worker process reaches this call.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.barrier_worker()
        """
        self._require_init("barrier_worker")
        collective.barrier()

    def all_reduce(self, value: Any, mode: str = "sum") -> Any:
        """Reduces a host value across worker processes (``sum|mean|max|min``).

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> int(fleet.all_reduce(3))
          3
        """
        self._require_init("all_reduce")
        return collective.all_reduce(value, mode)

    # ------------------------------------------------------------- topology
    def get_hybrid_communicate_group(self) -> HybridCommunicateGroup:
        """The hybrid group: the mesh and Paddle's group and rank getters.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.get_hybrid_communicate_group().get_data_parallel_world_size()
          8
        """
        return self._require_init("get_hybrid_communicate_group").hcg

    def get_hybrid_parallel_topology(self) -> CommunicateTopology:
        """The :class:`CommunicateTopology` behind the hybrid group.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> fleet.get_hybrid_parallel_topology().world_size()
          8
        """
        return self._require_init("get_hybrid_parallel_topology").hcg.topology()

    # ------------------------------------------------------------- training
    def distributed_optimizer(
        self, optimizer: Any, strategy: DistributedStrategy | None = None
    ) -> DistributedOptimizer:
        """Wraps an optimizer in the meta-optimizers the strategy asks for.

        Args:
          optimizer: an ``optax.GradientTransformation`` or an ``nnx.Optimizer``
            (its transform and ``wrt`` are taken; its state is made anew).
          strategy: overrides the strategy given to :meth:`init` for the
            optimizer (logged, as in Paddle); its hybrid degrees cannot change the
            mesh built at ``init``.

        Returns:
          A :class:`~jfleet.distributed_optimizer.DistributedOptimizer`, bound to
          a model on first use. ``applied_meta_list`` says what was applied.

        Raises:
          TypeError: not an optimizer. ValueError / NotImplementedError: see
          :func:`jfleet.optim.compiler.compile_strategy`.

        Example:
          >>> import optax
          >>> from jfleet import fleet
          >>> strategy = fleet.DistributedStrategy()
          >>> strategy.gradient_merge = True
          >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
          >>> fleet.distributed_optimizer(optax.sgd(0.1)).applied_meta_list
          ('GradientMergeOptimizer',)
        """
        self._require_init("distributed_optimizer")
        if strategy is not None:
            if not isinstance(strategy, DistributedStrategy):
                raise TypeError(
                    f"strategy={strategy!r} ({type(strategy).__name__}) is not a "
                    "DistributedStrategy."
                )
            logger.info(
                "fleet.distributed_optimizer got a strategy: it replaces the one given to "
                "fleet.init (prefer passing it to fleet.init)"
            )
            if strategy.hybrid_configs != self.strategy.hybrid_configs:
                logger.warning(
                    "the hybrid_configs of the strategy given to distributed_optimizer differ "
                    "from fleet.init's; the mesh stays as fleet.init built it"
                )
            _context.replace(strategy=strategy)
        self._optimizer = make_distributed_optimizer(optimizer, self.strategy)
        return self._optimizer

    def distributed_model(self, model: nnx.Module) -> DistributedModel:
        """Places an NNX model for the strategy and wraps it for ``train_batch``.

        Applies AMP (O1 compute dtypes / O2 half parameters) and recompute from
        the strategy, then places parameters: replicated for data parallel,
        ZeRO-3 sharded over the ``sharding`` axis, tensor-parallel layouts from
        the parameters' ``out_sharding`` metadata, pipeline stages over ``pp``.

        A :class:`~jfleet.parallel.pipeline_layer.PipelineLayer` (required when
        ``pp_degree > 1``) becomes a
        :class:`~jfleet.parallel.pipeline_parallel.PipelineParallel`, whose
        ``train_batch(data, optimizer)`` runs the ``pipeline_configs`` schedule.

        A model built inside :class:`jfleet.LazyGuard` (Paddle's ``paddle.LazyGuard``), or a
        function that builds one, is created directly in this layout, so no device or host
        holds a parameter the layout splits whole (:func:`jfleet.mesh.create.create_placed`).

        Raises:
          TypeError: not an ``nnx.Module``, or not a ``PipelineLayer`` with
            pp_degree > 1. ValueError: a ``PipelineLayer`` whose ``num_stages`` is
            not the pp degree. NotImplementedError: a Paddle schedule jfleet lacks.

        Example:
          >>> import optax
          >>> from jfleet import fleet
          >>> from jfleet.models import TinyLM, lm_batches, lm_loss
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> model = fleet.distributed_model(TinyLM())
          >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
          >>> loss = model.train_batch(lm_batches(1)[0], opt, loss_fn=lm_loss)
          >>> loss.shape
          ()
        """
        run = self._require_init("distributed_model")
        placement = Placement.from_fleet()
        if run.hcg.get_pipe_parallel_world_size() > 1 or isinstance(model, PipelineLayer):
            self._model = pipeline_model(model, run.strategy, placement)
        else:
            self._model = prepare_model(model, run.strategy, placement)
        return self._model

    # ---------------------------------------------------------- checkpoints
    def _objects(self, what: str, model: Any, optimizer: Any) -> tuple[nnx.Module, Any]:
        """``model`` / ``optimizer``, or the last distributed ones when ``model`` is None."""
        if model is not None:
            return model, optimizer
        if self._model is None:
            raise ValueError(
                f"fleet.{what}: model=None and no model was wrapped by fleet.distributed_model; "
                "pass model= (and optimizer=)."
            )
        return self._model, self._optimizer if optimizer is None else optimizer

    def save(
        self,
        dirname: str,
        feed: Sequence[Any] | None = None,
        fetch: Any = None,
        *,
        model: nnx.Module | None = None,
        optimizer: Any = None,
        **configs: Any,
    ) -> None:
        """Paddle's ``fleet.save``: the persistables, or an inference model with ``feed``.

        Without ``feed`` / ``fetch``: :meth:`save_persistables` (``configs["mode"]``, 0).
        With ``feed`` (example inputs: arrays) and optionally ``fetch`` (a
        ``forward(model, *inputs)`` callable; Paddle's output variables):
        :func:`jfleet.inference.save_inference_model`. ``model`` / ``optimizer`` default to
        the last ``fleet.distributed_model`` / ``fleet.distributed_optimizer`` (Paddle uses
        its programs).

        Raises:
          ValueError: ``fetch`` without ``feed``; a ``configs`` key other than ``mode``.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> model, path = nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tempfile.mkdtemp()
          >>> fleet.save(path, model=model)
          >>> fresh = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
          >>> fleet.load_model(path, model=fresh)
          >>> bool((fresh.kernel[...] == model.kernel[...]).all())
          True
        """
        unknown = sorted(set(configs) - {"mode"})
        if unknown:
            raise ValueError(
                f"fleet.save: configs {unknown} are not understood; expected only mode= "
                "(0: save everything)."
            )
        model, optimizer = self._objects("save", model, optimizer)
        if feed is None and fetch is None:
            self.save_persistables(
                None, dirname, mode=configs.get("mode", 0), model=model, optimizer=optimizer
            )
            return
        if feed is None:
            raise ValueError(
                f"fleet.save: fetch={fetch!r} without feed; pass feed= (example inputs) to save "
                "an inference model, or neither to save the persistables."
            )
        from jfleet.checkpoint.inference import save_inference_model

        save_inference_model(dirname, model, list(feed), forward=fetch)

    def save_persistables(
        self,
        executor: Any,
        dirname: str,
        main_program: Any = None,
        mode: int = 0,
        *,
        model: nnx.Module | None = None,
        optimizer: Any = None,
    ) -> None:
        """Saves the model's variables and the optimizer's state into directory ``dirname``.

        A state dict of :func:`jfleet.checkpoint.state_dict.save_model` (Orbax; every
        process writes its shards; the logical per-layer layout, so :meth:`load_model`
        restores onto any mesh). ``executor`` / ``main_program`` mean nothing without static
        programs and are ignored (logged). ``model`` / ``optimizer``: see :meth:`save`.

        Raises:
          ValueError: ``mode`` is not 0 (Paddle's 1 / 2 save parameter-server tables).

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.models import TinyLM
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> model = fleet.distributed_model(TinyLM())
          >>> path = tempfile.mkdtemp()
          >>> fleet.save_persistables(None, path)  # the model (and optimizer) of this run
          >>> fleet.load_model(path)
        """
        _check_mode("save_persistables", mode)
        _ignore_static("save_persistables", executor=executor, main_program=main_program)
        model, optimizer = self._objects("save_persistables", model, optimizer)
        _state_dict.save_model(dirname, model, optimizer)

    def save_dense_params(
        self,
        executor: Any,
        dirname: str,
        scope: Any = None,
        program: Any = None,
        var_names: Sequence[str] | None = None,
        *,
        model: nnx.Module | None = None,
    ) -> None:
        """Saves the model's parameters (``nnx.Param`` s) only into directory ``dirname``.

        ``executor`` / ``scope`` / ``program`` / ``var_names`` are ignored (logged): every
        parameter is saved. :meth:`load_model` reads it (other variables keep their values).

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.models import TinyLM
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> model = fleet.distributed_model(TinyLM())
          >>> path = tempfile.mkdtemp()
          >>> fleet.save_dense_params(None, path)  # parameters only
          >>> fleet.load_model(path)
        """
        _ignore_static(
            "save_dense_params",
            executor=executor,
            scope=scope,
            program=program,
            var_names=var_names,
        )
        model, _ = self._objects("save_dense_params", model, None)
        _state_dict.save_model(dirname, model, params_only=True)

    def load_model(
        self,
        path: str,
        mode: int = 0,
        *,
        model: nnx.Module | None = None,
        optimizer: Any = None,
    ) -> None:
        """Loads :meth:`save` / :meth:`save_persistables` / :meth:`save_dense_params` output.

        Into ``model`` / ``optimizer`` in place (default: the last distributed ones; the
        optimizer's state is read when the directory holds it), each array read into the
        running sharding whatever mesh saved it.

        Raises:
          ValueError: ``mode`` is not 0; a parameter is missing from ``path``.
          FileNotFoundError: nothing saved at ``path``.

        Example:
          >>> import tempfile
          >>> from jfleet import fleet
          >>> from jfleet.models import TinyLM
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> model = fleet.distributed_model(TinyLM())
          >>> path = tempfile.mkdtemp()
          >>> fleet.save_persistables(None, path)
          >>> fleet.load_model(path)  # read into the running shardings
        """
        _check_mode("load_model", mode)
        defaulted = model is None and optimizer is None
        model, optimizer = self._objects("load_model", model, optimizer)
        names = _state_dict.saved_names(path) if defaulted and optimizer is not None else []
        if names and not any(n.startswith("optimizer.") for n in names):
            optimizer = None  # saved without one: the model alone
        _state_dict.load_model(path, model, optimizer)

    def get_loss_scaling(self) -> float:
        """The current fp16 loss scale of the last distributed optimizer.

        Example:
          >>> import optax
          >>> from jfleet import fleet
          >>> strategy = fleet.DistributedStrategy()
          >>> strategy.amp = True
          >>> strategy.amp_configs = {"dtype": "float16", "init_loss_scaling": 1024.0}
          >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
          >>> from flax import nnx
          >>> model = fleet.distributed_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
          >>> _ = fleet.distributed_optimizer(optax.sgd(0.1)).init(model)
          >>> fleet.get_loss_scaling()
          1024.0
        """
        self._require_init("get_loss_scaling")
        if self._optimizer is None or not self._optimizer.has_loss_scaling:
            raise RuntimeError(
                "no fp16 loss scaling is active: set strategy.amp=True with float16 "
                "(amp_configs dtype 'float16' or use_pure_fp16) and build the optimizer with "
                "fleet.distributed_optimizer."
            )
        return float(self._optimizer.loss_scale)

    def _get_applied_meta_list(self) -> list[str]:
        """Names of the meta-optimizers applied to the last distributed optimizer."""
        if self._optimizer is None:
            return []
        return list(self._optimizer.applied_meta_list)

    @property
    def strategy(self) -> DistributedStrategy:
        """The strategy given to :meth:`init` (a default one if none was)."""
        return _context.require("fleet.strategy").strategy

    # Paddle code reads these private attributes of its Fleet object (``fleet.fleet``).
    @property
    def _hcg(self) -> HybridCommunicateGroup:
        """Paddle's ``fleet.fleet._hcg``: the hybrid group (``get_hybrid_communicate_group``)."""
        return self._require_init("_hcg").hcg

    @property
    def _user_defined_strategy(self) -> DistributedStrategy:
        """Paddle's ``fleet.fleet._user_defined_strategy``: the strategy in force."""
        return self._require_init("_user_defined_strategy").strategy

    @property
    def _is_collective(self) -> bool:
        """False in parameter-server mode (``fleet.init(is_collective=False)``)."""
        run = _context.current()
        return run is None or run.role_maker.is_collective


def _check_mode(what: str, mode: Any) -> None:
    if mode != 0:
        raise ValueError(
            f"fleet.{what}(mode={mode!r}): only mode=0 (everything) exists here; Paddle's "
            "other modes are parameter-server table increments."
        )


def _ignore_static(what: str, **given: Any) -> None:
    for name, value in given.items():
        if value is not None:
            logger.info("fleet.%s: %s is ignored (no static programs under JAX)", what, name)


#: The process's one Fleet object (Paddle's ``fleet.fleet``); ``jfleet.fleet``'s module
#: functions are its bound methods.
fleet = Fleet()

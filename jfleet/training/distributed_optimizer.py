"""``fleet.distributed_optimizer``: an ``nnx.Optimizer`` whose chain a strategy compiled.

The optimizer is created before the model is known (as in Paddle), so its state is
made when it first meets a model: in ``DistributedModel.train_batch``, in a step
from :func:`jfleet.make_train_step`, or explicitly with :meth:`DistributedOptimizer.init`.
From then on it is an ordinary ``nnx.Optimizer``: ``opt.update(model, grads)`` works
inside a user's own ``@nnx.jit`` step, with these limits — the user's step does not
scale the loss for fp16 (use the engine, or multiply the loss by ``opt.loss_scale``
yourself) and does not constrain gradients to the ZeRO-2 layout (the update is
still correct; only the gradient all-reduce is not turned into a reduce-scatter), nor
run the replicas' gradient communication (``fp16_allreduce``: gradients are reduced in
fp32 by GSPMD there); under LocalSGD ``opt.update`` is refused (the replicas' own
parameters live in the optimizer and only the engine steps them).

Paddle's optimizer object (``HybridParallelOptimizer``), the functional way:

==================================  ===================================================
Paddle                              jfleet
==================================  ===================================================
``opt.get_lr()``                    ``opt.get_lr()``: the lr the next update applies
``opt.set_lr(v)``                   ``opt.set_lr(v)``: written into the state, no recompile
``loss.backward(); opt.step()``     ``opt.step(model, grads)`` (grads are values in JAX)
``opt.clear_grad()``                a logged no-op: there are no stored gradients
``opt.minimize(loss)``              ``opt.minimize(loss_fn, model, batch)``: one engine step
``opt._inner_opt``                  the user's optax optimizer
``opt.state_dict()``                ``opt.state_dict()`` / ``opt.set_state_dict(d)``
==================================  ===================================================

``opt.step`` is also ``nnx.Optimizer``'s update counter: a :class:`StepCounter`
variable (``int(opt.step[...])`` reads it) that is callable as Paddle's ``step``.

The learning rate must be readable for ``get_lr`` / ``set_lr`` / an ``lr_scheduler``:
build the optimizer with ``optax.inject_hyperparams(optax.adam)(learning_rate=...)``
or :mod:`jfleet.optim.hyperparams` (``hyperparams.adam(1e-3)``); the learning rate then
lives in the optimizer state, so changing it never recompiles the step.

Example:
  >>> import optax
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> from jfleet.optim import hyperparams
  >>> _ = fleet.init(is_collective=True)
  >>> model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> opt = fleet.distributed_optimizer(hyperparams.adam(1e-3)).init(model)
  >>> int(opt.step[...]), round(opt.get_lr(), 6)
  (0, 0.001)
  >>> opt.set_lr(5e-4)
  >>> round(opt.get_lr(), 6)
  0.0005
"""

from __future__ import annotations

import contextlib
import numbers
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx.training.optimizer import OptState, to_opt_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh import context as _context
from jfleet.mesh.placement import Placement, put, resolve_placement, write_variable
from jfleet.optim import hyperparams
from jfleet.optim.communication import GradientCommunication
from jfleet.optim.compiler import compile_strategy
from jfleet.optim.localsgd import LocalSGDConfig
from jfleet.optim.loss_scale import loss_scale_of, scaling_state_of
from jfleet.runtime.log import logger
from jfleet.training.replicas import check_localsgd, init_replica_state, stack_localsgd_state

# What waits for an optimizer's state (set before it is bound): kept off the module so
# the optimizer's graph definition (the compiled step's key) never changes for it.
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The scheduler of each optimizer's set_lr_scheduler, kept off the module for the same reason.
_SCHEDULERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_scheduler(scheduler: Any, where: str) -> None:
    """Raises unless ``scheduler`` is a Paddle-style scheduler or an optax schedule."""
    if not callable(scheduler) and not callable(getattr(scheduler, "step", None)):
        raise TypeError(
            f"{where}: expected a Paddle-style scheduler with step() "
            "(jfleet.optim.lr.StepDecay(...)) or an optax schedule (a callable of the step "
            f"count); {type(scheduler).__name__} is neither."
        )


def scheduler_lr(scheduler: Any, optimizer: DistributedOptimizer | None) -> float:
    """The rate a scheduler gives now: Paddle's ``last_lr`` (else ``scheduler()``, else
    ``get_lr()``) for a Paddle-style scheduler, an optax schedule at the update count.

    Example:
      >>> from jfleet.optim.lr import StepDecay
      >>> scheduler_lr(StepDecay(0.1, step_size=2), None)
      0.1
    """
    if callable(getattr(scheduler, "step", None)):
        value = getattr(scheduler, "last_lr", None)
        if value is None:
            value = scheduler() if callable(scheduler) else scheduler.get_lr()
        return float(value)
    bound = optimizer is not None and optimizer.is_bound
    return float(scheduler(int(optimizer.step[...]) if bound else 0))


class StepCounter(OptState):
    """``nnx.Optimizer``'s update counter that is also Paddle's ``opt.step(...)``.

    ``opt.step[...]`` is the number of updates so far (as for any ``nnx.Optimizer``);
    ``opt.step(model, grads)`` applies ``grads`` (one jitted ``opt.update``), Paddle's
    ``loss.backward(); opt.step()`` with the gradients as values. Inside your own
    ``@nnx.jit`` step call ``opt.update(model, grads)`` instead.
    """

    __slots__ = ("_owner",)

    def __call__(self, model: nnx.Module | None = None, grads: Any = None) -> None:
        owner = getattr(self, "_owner", None)
        opt = owner() if owner is not None else None
        if opt is None or opt.step is not self:
            raise TypeError(
                "opt.step(model, grads) runs on the host, on the optimizer that "
                "fleet.distributed_optimizer returned; inside a jitted function (or on a copy "
                "of the optimizer) call opt.update(model, grads) instead."
            )
        if model is None or grads is None:
            raise TypeError(
                f"opt.step(model={type(model).__name__}, grads={type(grads).__name__}): JAX "
                "gradients are values, so pass them: grads = nnx.grad(loss_fn)(model); "
                "opt.step(model, grads). Or run a whole step with opt.minimize(loss_fn, "
                "model, batch)."
            )
        if not opt.is_bound:
            opt.init(model)
        opt.apply_lr_scheduler()
        _apply_update(opt, model, grads)


@nnx.jit
def _apply_update(opt: nnx.Optimizer, model: nnx.Module, grads: Any) -> None:
    opt.update(model, grads)


class DistributedOptimizer(nnx.Optimizer):
    """An ``nnx.Optimizer`` over a strategy-compiled Optax chain, bound on first use.

    Attributes:
      tx: the compiled chain (outermost meta-optimizer first).
      applied_meta_list: names of the meta-optimizers the strategy applied, in
        Paddle's naming (``["AMPOptimizer", "GradientMergeOptimizer", ...]``).
      inner_tx: the optimizer the user gave (also ``_inner_opt``, Paddle's name).
      step: the update counter, callable as Paddle's ``step`` (:class:`StepCounter`).
      communication: how the replicas combine their gradients (``fp16_allreduce``,
        DGC: :mod:`jfleet.optim.communication`), or None (GSPMD's fp32 reduction). Its
        per-replica state is ``comm_state`` once bound: each leaf with a leading replica
        dimension sharded over the data axes. Only the engine's steps apply it; a
        user's own ``opt.update`` gets gradients GSPMD already reduced.
      localsgd: LocalSGD's settings (:mod:`jfleet.optim.localsgd`), or None. Once bound,
        ``local_state`` holds the replicas' own parameters and the schedule's counters,
        and the leaves of ``opt_state`` that differ between replicas (``replica_leaves``
        marks them: moments, accumulators) have a leading replica dimension; the model
        holds the parameters of the last average. Only the engine's steps train it.

    Example:
      >>> import optax
      >>> from jfleet import fleet
      >>> from jfleet.models import TinyLM, lm_batches, lm_loss
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
      >>> isinstance(opt, DistributedOptimizer), opt.applied_meta_list
      (True, ())
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        *,
        inner_tx: optax.GradientTransformation,
        applied_meta_list: tuple[str, ...] = (),
        has_loss_scaling: bool = False,
        wrt: Any = nnx.Param,
        communication: GradientCommunication | None = None,
        localsgd: LocalSGDConfig | None = None,
    ) -> None:
        self.tx = tx
        self.communication = communication
        self.localsgd = localsgd
        self.replica_leaves: tuple[bool, ...] = ()
        self.inner_tx = inner_tx
        self.wrt = wrt
        self.graph = None
        self.applied_meta_list = tuple(applied_meta_list)
        self.has_loss_scaling = has_loss_scaling
        self.loss_scaling_config: tuple | None = None  # from a GradScaler, as sorted items
        self.master_weights_added = False  # by jfleet.amp.decorate(level="O2")
        self.step = nnx.data(None)
        self.opt_state = nnx.data(None)
        self._param_paths: tuple[str, ...] | None = None
        self._model: Callable[[], Any] = lambda: None

    @property
    def is_bound(self) -> bool:
        """Whether the state has been made for a model."""
        return self._param_paths is not None

    @property
    def _inner_opt(self) -> optax.GradientTransformation:
        """Paddle's name for the wrapped optimizer: the user's optax transformation."""
        return self.inner_tx

    def init(self, model: nnx.Module, placement: Placement | None = None) -> DistributedOptimizer:
        """Makes the optimizer state for ``model`` (once), placed for ``placement``.

        ``placement`` defaults to the model's (a ``DistributedModel``), else the run's.

        ZeRO stage >= 1 shards every parameter-shaped state leaf (moments,
        accumulated gradients, master weights) over the ZeRO axis; scalars are
        replicated over the mesh. A learning rate set with :meth:`set_lr` (or loss
        scaling counters loaded by a ``GradScaler``) before this call are written in.

        Raises:
          ValueError: already bound to a model with other parameters.
        """
        if self.is_bound and self._model() is model:
            return self  # the common case, every step: nothing to look at
        paths = _param_paths(nnx.state(model, self.wrt))
        if self.is_bound:
            if paths != self._param_paths:
                raise ValueError(
                    "this distributed optimizer was initialised for a model with parameters "
                    f"{_short(self._param_paths)}, but is now used with one with parameters "
                    f"{_short(paths)}; make one distributed optimizer per model."
                )
            return self
        plan = resolve_placement(placement, model)
        params = nnx.state(model, self.wrt)
        if plan.zero_stage >= 1:
            params = put(params, plan.param_shardings(params, zero=True))
        raw = self.tx.init(params)
        if self.localsgd is not None:
            check_localsgd(plan, self.localsgd.switch)
            raw, local, self.replica_leaves = stack_localsgd_state(
                self.tx, params, raw, self.localsgd, plan
            )
            self.local_state = nnx.data(to_opt_state(local))
        state = to_opt_state(raw)
        replicated = plan.named(P())

        def on_mesh(x: Any) -> Any:
            sharding = x.sharding if isinstance(x, jax.Array) else None
            if isinstance(sharding, NamedSharding) and sharding.mesh == plan.mesh:
                return x
            return put(x, replicated)

        # The step donates model and optimizer buffers, so no buffer may appear twice
        # (optax and inject_hyperparams can hand out one constant for several leaves).
        taken = {_buffer(x) for x in jax.tree.leaves(nnx.state(model))}
        state = jax.tree.map(lambda x: _own_buffer(on_mesh(x), taken), state)
        counter = StepCounter(jax.device_put(jnp.array(0, dtype=jnp.uint32), replicated))
        object.__setattr__(counter, "_owner", weakref.ref(self))
        self.step = counter
        self.opt_state = nnx.data(state)
        if self.communication is not None:
            zeros = jax.tree.map(jnp.zeros_like, nnx.as_pure(params))
            comm_state = init_replica_state(self.communication.init, zeros, plan)
            self.comm_state = nnx.data(to_opt_state(comm_state))
        self._param_paths = paths
        self._model = weakref.ref(model)
        for pending in _PENDING.pop(self, {}).values():
            pending.write(self)
        return self

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> optax.Updates:
        """Applies gradients (see ``nnx.Optimizer.update``); needs :meth:`init` first."""
        if not self.is_bound:
            raise RuntimeError(
                "the distributed optimizer has no state yet; call opt.init(model) first "
                "(train_batch and make_train_step steps do it for you)."
            )
        if self.localsgd is not None:
            raise RuntimeError(
                f"{self.localsgd.switch}: the replicas step on their own parameters, which "
                "only the engine's step runs; train with model.train_batch(...) or "
                "jfleet.make_train_step(loss_fn), not opt.update / opt.step."
            )
        return super().update(model, grads, **kwargs)

    @property
    def loss_scale(self) -> jax.Array:
        """The current fp16 loss scale (1.0 when the strategy has no loss scaling)."""
        if not self.has_loss_scaling or not self.is_bound:
            return jnp.asarray(1.0, jnp.float32)
        return loss_scale_of(nnx.as_pure(self.opt_state))

    # ------------------------------------------------------------ Paddle's optimizer API
    def get_lr(self) -> float:
        """The learning rate the next update applies (Paddle's ``get_lr``).

        With a scheduler set by :meth:`set_lr_scheduler`, the scheduler's current rate. A
        scheduled learning rate (an optax schedule inside the optimizer) is evaluated at
        the next update's step count.

        Raises:
          ValueError: the learning rate is not readable (see the module docstring).
        """
        scheduler = _SCHEDULERS.get(self)
        if scheduler is not None:
            return scheduler_lr(scheduler, self)
        if not self.is_bound:
            pending = _PENDING.get(self, {}).get("lr")
            if pending is not None:
                return pending.value
            node = self._lr_node(self.tx.init(hyperparams.probe_params(self.tx)))
        else:
            node = self._lr_node(self.opt_state)
        if hyperparams.is_scheduled(node):
            return hyperparams.scheduled_learning_rate(self.inner_tx, node)
        return float(hyperparams.variable_values(node.hyperparams["learning_rate"]))

    def set_lr(self, value: float) -> None:
        """Sets the learning rate of the next updates, without recompiling the step.

        Before the optimizer is bound to a model the value is kept and written in by
        :meth:`init`.

        Raises:
          TypeError / ValueError: ``value`` is not a finite number >= 0.
          ValueError: the learning rate is not readable, is an optax schedule (which
            would overwrite it), or comes from :meth:`set_lr_scheduler` (Paddle raises
            for a scheduler too).
        """
        if isinstance(value, bool) or not isinstance(value, numbers.Real | np.ndarray | jax.Array):
            raise TypeError(
                f"set_lr(value={value!r}): the learning rate must be a number; pass a float "
                "such as opt.set_lr(1e-3)."
            )
        value = float(value)
        if not np.isfinite(value) or value < 0:
            raise ValueError(
                f"set_lr(value={value!r}): the learning rate must be finite and >= 0; pass "
                "e.g. opt.set_lr(1e-3)."
            )
        if _SCHEDULERS.get(self) is not None:
            raise ValueError(
                f"set_lr(value={value}): the learning rate comes from the scheduler given to "
                "set_lr_scheduler (Paddle raises here too); step the scheduler instead, or "
                "call opt.set_lr_scheduler(None) first."
            )
        self._write_lr(value)

    def set_lr_scheduler(self, scheduler: Any) -> None:
        """Paddle's ``set_lr_scheduler``: every update applies ``scheduler``'s current rate.

        As ``paddle.optimizer.Adam(learning_rate=scheduler)``: before each update
        (``train_batch``, :meth:`minimize`, ``opt.step(model, grads)``) the optimizer
        writes the scheduler's rate into its state (no recompile); you keep calling
        ``scheduler.step()``. ``scheduler`` is a Paddle-style scheduler
        (:mod:`jfleet.optim.lr`), an optax schedule (evaluated at the update count), or
        ``None`` to go back to :meth:`set_lr`.

        Raises:
          TypeError: ``scheduler`` is neither kind.
          ValueError: the learning rate is not readable, or is an optax schedule inside
            the optimizer already.
        """
        if scheduler is None:
            _SCHEDULERS.pop(self, None)
            return
        check_scheduler(scheduler, f"set_lr_scheduler(scheduler={scheduler!r})")
        state = self.opt_state if self.is_bound else self.tx.init(hyperparams.probe_params(self.tx))
        self._check_not_scheduled(self._lr_node(state))
        _SCHEDULERS[self] = scheduler

    def apply_lr_scheduler(self, scheduler: Any = None) -> None:
        """Writes the rate of ``scheduler`` (default: the one of :meth:`set_lr_scheduler`)
        into the state, when it differs; what every update path calls first."""
        scheduler = scheduler if scheduler is not None else _SCHEDULERS.get(self)
        if scheduler is None:
            return
        value = scheduler_lr(scheduler, self)
        if _SCHEDULERS.get(self) is scheduler or self.get_lr() != value:
            self._write_lr(value)

    def _write_lr(self, value: float) -> None:
        if not self.is_bound:
            node = self._lr_node(self.tx.init(hyperparams.probe_params(self.tx)))
            self._check_not_scheduled(node)
            _PENDING.setdefault(self, {})["lr"] = _Pending(value, lambda opt: opt._write_lr(value))
            return
        node = self._lr_node(self.opt_state)
        self._check_not_scheduled(node)
        write_variable(node.hyperparams["learning_rate"], value)

    def clear_grad(self, set_to_zero: bool = True) -> None:
        """Paddle's ``clear_grad``: a no-op (logged), JAX gradients are values, not stored."""
        del set_to_zero
        logger.debug("opt.clear_grad(): no-op, JAX gradients are values and are not stored")

    def minimize(self, loss_fn: Callable[[nnx.Module, Any], Any], model: nnx.Module, batch: Any):
        """One training step through the engine (Paddle's ``minimize``); returns the loss.

        The functional twin of ``opt.minimize(loss)``: the loss is a function
        ``loss_fn(model, batch)`` and the step differentiates it; the model is the one
        ``fleet.distributed_model`` returned (its ``train_batch`` runs the step).

        Raises:
          TypeError: ``model`` has no ``train_batch(batch, optimizer, loss_fn=...)``.
        """
        train_batch = getattr(model, "train_batch", None)
        if train_batch is None or not hasattr(model, "placement"):
            raise TypeError(
                f"opt.minimize(loss_fn, model={type(model).__name__}, batch): the model must "
                "come from fleet.distributed_model(...); for a plain NNX model use "
                "jfleet.make_train_step(loss_fn)(model, opt, batch)."
            )
        return train_batch(batch, self, loss_fn=loss_fn)

    def state_dict(self) -> dict[str, Any]:
        """The state as numpy arrays keyed by path (``"opt_state/0/mu/kernel"``, ``"step"``),
        plus ``"learning_rate"`` (a float) when it is readable. Round-trips through
        :meth:`set_state_dict` exactly.

        Raises:
          RuntimeError: the optimizer has no state yet (no step and no :meth:`init`).
        """
        self._require_bound("state_dict")
        out = {key: np.asarray(var.get_value()) for key, var in self._flat_state().items()}
        with contextlib.suppress(ValueError):  # not readable: nothing more to save
            out["learning_rate"] = self.get_lr()
        return out

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned (same keys, same shapes).

        Each array keeps the dtype and the sharding of the state it replaces.

        Raises:
          RuntimeError: the optimizer has no state yet: call ``opt.init(model)`` first.
          KeyError: keys missing or unexpected (they are listed).
          ValueError: an array of another shape.
        """
        self._require_bound("set_state_dict")
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"set_state_dict(state_dict={type(state_dict).__name__}): expected the dict "
                "that opt.state_dict() returned."
            )
        flat = self._flat_state()
        given = set(state_dict) - {"learning_rate"}
        missing, unexpected = sorted(set(flat) - given), sorted(given - set(flat))
        if missing or unexpected:
            raise KeyError(
                f"set_state_dict: the state dict does not match this optimizer: missing keys "
                f"{missing[:4]}, unexpected keys {unexpected[:4]}; pass a dict from "
                "state_dict() of an optimizer built the same way for the same model."
            )
        for key, var in flat.items():
            old = np.shape(var.get_value())
            if np.shape(state_dict[key]) != old:
                raise ValueError(
                    f"set_state_dict: {key!r} has shape {np.shape(state_dict[key])}, this "
                    f"optimizer's has shape {old}; load a state dict saved for the same model."
                )
        for key, var in flat.items():
            write_variable(var, state_dict[key])
        if "learning_rate" in state_dict:
            node = self._lr_node(self.opt_state)
            if not hyperparams.is_scheduled(node):
                self.set_lr(state_dict["learning_rate"])

    # ------------------------------------------------------------------ helpers
    def _lr_node(self, state: Any) -> Any:
        return hyperparams.learning_rate_state(state, self.inner_tx)

    @staticmethod
    def _check_not_scheduled(node: Any) -> None:
        if hyperparams.is_scheduled(node):
            raise ValueError(
                "set_lr: the optimizer's learning rate is an optax schedule, which sets it "
                "at every update (Paddle raises for an LRScheduler too). Build the optimizer "
                "with a number, e.g. hyperparams.adam(1e-3), and pass the schedule to "
                "train_batch(lr_scheduler=...)."
            )

    def _require_bound(self, what: str) -> None:
        if not self.is_bound:
            raise RuntimeError(
                f"opt.{what}(): the optimizer has no state yet; call opt.init(model) first "
                "(the first train_batch does it too)."
            )

    def _flat_state(self) -> dict[str, nnx.Variable]:
        return {
            "/".join(str(k) for k in path): var for path, var in nnx.to_flat_state(nnx.state(self))
        }

    def when_bound(self, name: str, write: Callable[[DistributedOptimizer], None]) -> None:
        """Runs ``write(self)`` now if the state exists, else when :meth:`init` makes it."""
        if self.is_bound:
            write(self)
        else:
            _PENDING.setdefault(self, {})[name] = _Pending(None, write)

    def attach_loss_scaling(self, config: Mapping[str, Any]) -> None:
        """Adds fp16 dynamic loss scaling (a ``GradScaler``'s ``config``) to the chain.

        The chain is compiled anew from the user's optimizer and the run's strategy, so
        the scaling sits where ``strategy.amp`` puts it. Attaching the same config again
        is a no-op.

        Raises:
          ValueError: the optimizer already scales the loss another way, or is bound to a
            model already (its state was made without the scaling).
        """
        items = tuple(sorted(config.items()))
        if self.loss_scaling_config == items:
            return
        if self.has_loss_scaling:
            theirs = "strategy.amp" if self.loss_scaling_config is None else "another GradScaler"
            raise ValueError(
                f"this optimizer already has fp16 loss scaling from {theirs}; a GradScaler "
                f"with {dict(items)} cannot be added too. Use one: pass scaler=None, or build "
                "the optimizer without it."
            )
        if self.is_bound:
            raise ValueError(
                "a GradScaler cannot be attached to an optimizer whose state was already made "
                "without loss scaling; pass the scaler from the first step on (train_batch("
                "..., scaler=scaler) or fleet.distributed_scaler before training)."
            )
        self.loss_scaling_config = items
        self._recompile()

    def add_master_weights(self) -> None:
        """Adds fp32 master weights (AMP O2, ``amp.decorate``); before the state is made."""
        if self.master_weights_added:
            return
        if self.is_bound:
            raise ValueError(
                "amp.decorate(level='O2') cannot add master weights to an optimizer whose "
                "state was already made; decorate before the first step."
            )
        self.master_weights_added = True
        self._recompile()

    def _recompile(self) -> None:
        from jfleet.optim.compiler import META_ORDER, compile_strategy
        from jfleet.training.strategy import DistributedStrategy

        run = _context.current()
        strategy = run.strategy if run is not None else DistributedStrategy()
        scaling = dict(self.loss_scaling_config) if self.loss_scaling_config else None
        compiled = compile_strategy(
            self.inner_tx,
            strategy,
            loss_scaling=scaling,
            master_weights=self.master_weights_added,
        )
        self.tx = compiled.tx
        self.communication = compiled.communication
        self.localsgd = compiled.localsgd
        applied = {*self.applied_meta_list, *compiled.applied_meta_list}
        self.applied_meta_list = tuple(sorted(applied, key=META_ORDER.index))
        self.has_loss_scaling = self.has_loss_scaling or scaling is not None

    @property
    def loss_scaling_state(self) -> Any:
        """The live ``DynamicLossScalingState`` (fields are writable variables)."""
        self._require_bound("loss_scaling_state")
        return scaling_state_of(self.opt_state)


def make_distributed_optimizer(optimizer: Any, strategy: Any) -> DistributedOptimizer:
    """Wraps ``optimizer`` in the meta-optimizers ``strategy`` asks for.

    The work of ``fleet.distributed_optimizer`` (which also records the result as the
    run's optimizer) and of ``to_distributed``.

    Args:
      optimizer: an ``optax.GradientTransformation`` or an ``nnx.Optimizer`` (its
        transform and ``wrt`` are taken; its state is made anew).
      strategy: the :class:`~jfleet.strategy.DistributedStrategy` in force.

    Raises:
      TypeError: not an optimizer. ValueError / NotImplementedError: see
        :func:`jfleet.optim.compiler.compile_strategy`.

    Example:
      >>> import optax
      >>> from jfleet.training.strategy import DistributedStrategy
      >>> s = DistributedStrategy()
      >>> s.gradient_merge = True
      >>> make_distributed_optimizer(optax.sgd(0.1), s).applied_meta_list
      ('GradientMergeOptimizer',)
    """
    wrt = nnx.Param
    if isinstance(optimizer, nnx.Optimizer):
        wrt = optimizer.wrt
        optimizer = optimizer.tx
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"optimizer={optimizer!r} ({type(optimizer).__name__}) is neither an optax "
            "GradientTransformation nor an nnx.Optimizer; pass e.g. optax.adam(1e-3)."
        )
    compiled = compile_strategy(optimizer, strategy)
    dist = DistributedOptimizer(
        compiled.tx,
        inner_tx=optimizer,
        applied_meta_list=compiled.applied_meta_list,
        has_loss_scaling=bool(compiled.amp and compiled.amp.loss_scaling),
        wrt=wrt,
        communication=compiled.communication,
        localsgd=compiled.localsgd,
    )
    logger.info("meta-optimizers applied: %s", list(compiled.applied_meta_list) or "none")
    return dist


class _Pending:
    """A value waiting for the optimizer's state, and how to write it there."""

    def __init__(self, value: Any, write: Callable[[DistributedOptimizer], None]) -> None:
        self.value = value
        self.write = write


def _buffer(x: Any) -> int | None:
    if not isinstance(x, jax.Array) or not x.addressable_shards:
        return None
    return x.addressable_shards[0].data.unsafe_buffer_pointer()


def _own_buffer(x: Any, taken: set) -> Any:
    """``x``, or a copy of it when its buffer is already in ``taken``; records the buffer."""
    key = _buffer(x)
    if key is None:
        return x
    if key in taken:
        x = jnp.copy(x)
        key = _buffer(x)
    taken.add(key)
    return x


def _param_paths(params: nnx.State) -> tuple[str, ...]:
    return tuple(
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)
    )


def _short(paths: tuple[str, ...] | None) -> str:
    paths = paths or ()
    return ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4 else "")

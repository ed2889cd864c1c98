"""The one training-step engine.

Every way of training in jfleet — ``DistributedModel.train_batch``,
:func:`make_train_step`, the objects ``to_distributed`` returns — runs the step built
here: one ``jax.jit`` over the model's and the optimizer's state with explicit in
and out shardings and donated buffers, so parameters and optimizer state are
updated in place on every device.

What the engine adds over a hand-written ``nnx.jit`` step:
  * the batch is split over the data axes (``dp`` x ``sharding``);
  * fp16 loss scaling: the loss is multiplied by the optimizer's current scale
    before differentiation (the scale lives in the optimizer state, see
    :mod:`jfleet.optim.loss_scale`);
  * ZeRO-3: parameters, stored sharded, are gathered to their tensor-parallel layout
    for the step;
  * ZeRO-2/3: gradients are constrained to the ZeRO layout, so each device keeps
    only its shard (GPU/TPU compilers emit a reduce-scatter; XLA's CPU compiler an
    all-reduce followed by a slice — ``benchmarks/RESULTS.md``);
  * the loss is computed and returned in fp32;
  * meta-optimizers that act between data-parallel replicas (``fp16_allreduce``'s
    gradient communication, LocalSGD) run each replica's part in ``shard_map`` over the
    data axes (:mod:`jfleet.replicas`);
  * the non-finite guard: an inf / nan loss or gradient is warned about, skipped or
    raised on (``nonfinite``, :mod:`jfleet.nonfinite`);
  * no lost state: dispatching the step and installing its outputs is an
    :class:`jfleet.interrupts.atomic` section, so a SIGINT / SIGTERM arriving meanwhile
    is delivered once the new state is installed; an error after the inputs were
    donated says that the state was lost (:class:`StepStateLostError`). With
    ``jax_debug_nans`` or ``jax_debug_infs`` on, nothing is donated (JAX re-runs a
    failing step op by op on its inputs, which donation would have deleted);
  * the watchdog's hooks (:mod:`jfleet.watchdog`) at every step's start and dispatch;
  * no host overhead beyond that: a call with the model and optimizer of the last call
    reuses its binding (program, variables, shardings) while the graph is unchanged
    (:class:`TrainStep`); ``benchmarks/host_overhead.py`` measures it against a
    hand-written ``jax.jit`` step.

Example:
  >>> import jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> from jfleet import fleet, make_train_step
  >>> _ = fleet.init(is_collective=True)
  >>> model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
  >>> step = make_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
  >>> loss = step(model, opt, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jfleet.mesh import context as _context
from jfleet.mesh.placement import Placement, resolve_placement
from jfleet.optim.gradient_merge import GradientMergeState
from jfleet.optim.loss_scale import finite_flags, floating_leaves
from jfleet.parallel import layer_gather, merged_backward
from jfleet.parallel.loss import scalar_loss
from jfleet.precision.nonfinite import Guard, check_mode, leaf_names
from jfleet.runtime import interrupts, watchdog
from jfleet.training.distributed_optimizer import DistributedOptimizer
from jfleet.training.graph_watch import same, watch_graph
from jfleet.training.replicas import check_supported, localsgd_step, replica_gradients

LossFn = Callable[[nnx.Module, Any], Any]


def _split_loss(out: Any) -> tuple[jax.Array, Any]:
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError(
                f"loss_fn returned a tuple of {len(out)} items; return a scalar loss or "
                "(loss, aux)."
            )
        loss, aux = out
    else:
        loss, aux = out, None
    return scalar_loss(loss, "loss_fn"), aux


_SWITCHES = {
    "FP16AllReduceOptimizer": "fp16_allreduce",
    "DGCMomentumOptimizer": "dgc",
    "LocalSGDOptimizer": "localsgd",
    "AdaptiveLocalSGDOptimizer": "adaptive_localsgd",
}


def _switches(optimizer: DistributedOptimizer) -> str:
    """The strategy switch(es) behind the optimizer's per-replica step, for error messages."""
    names = [_SWITCHES[m] for m in optimizer.applied_meta_list if m in _SWITCHES]
    return " and ".join(f"strategy.{n}=True" for n in names) or "the gradient communication"


class StepStateLostError(RuntimeError):
    """A train step failed after its inputs were donated: the model / optimizer state is gone."""


def _raise_if_lost(state: Any, err: BaseException) -> None:
    """Raises :class:`StepStateLostError` from ``err`` if an array of ``state`` is deleted."""
    deleted = [x for x in jax.tree.leaves(state) if isinstance(x, jax.Array) and x.is_deleted()]
    if deleted:
        raise StepStateLostError(
            f"the train step failed ({type(err).__name__}: {err}) after donating the model's "
            f"and the optimizer's buffers to it: {len(deleted)} of their arrays are deleted "
            "and the step produced no new state, so the model and optimizer can no longer "
            "be used. Restore them from a checkpoint (jfleet.checkpoint) and resume."
        ) from err


def _debugging_floats() -> tuple[bool, bool]:
    return bool(jax.config.jax_debug_nans), bool(jax.config.jax_debug_infs)


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


def _leaf_specs(tree: Any) -> tuple:
    """What of a tree's arrays a compiled step is specialised to: shape, dtype, sharding."""
    return tuple(
        (x.shape, x.dtype, x.sharding)
        if isinstance(x, jax.Array)
        else (getattr(x, "shape", None), getattr(x, "dtype", None), None)
        for x in jax.tree.leaves(tree)
    )


class _CompileCache:
    """Compiled steps by key, where a key need not be hashable.

    A key holds the model's (and optimizer's) graph definition, and a graph
    definition carries every static attribute of the model: a config attribute
    holding a list or a non-frozen dataclass makes it unhashable, although it still
    compares with ``==`` and a plain ``nnx.jit`` step trains the model. So a hashable
    key is looked up in a dict and an unhashable one is searched by ``==`` in a list:
    either way an equal key finds its step (one compile per distinct key), and a
    different graph definition (another structure or another static value) misses
    and compiles anew. The search is linear, over the few unhashable keys one step
    sees.

    An unhashable key is stored as a deep copy (the graph definition's static values
    are the model's own objects, so a list edited in place would otherwise edit the
    stored key too and match a program traced with the old value); the step is built
    from that copy. Keys that cannot be copied are stored as they are.
    """

    def __init__(self) -> None:
        self._hashed: dict[Any, Callable] = {}
        self._unhashable: list[tuple[Any, Callable]] = []

    def __len__(self) -> int:
        return len(self._hashed) + len(self._unhashable)

    def get_or_build(self, key: Any, build: Callable[[Any], Callable]) -> Callable:
        """The step for ``key``; ``build(key)`` makes it on a miss (and gets the stored key)."""
        try:
            fn = self._hashed.get(key)
        except TypeError:  # unhashable: a list, dict or plain dataclass in the config
            pass
        else:
            if fn is None:
                fn = self._hashed[key] = build(key)
            return fn
        for stored, fn in self._unhashable:
            if same(stored, key):
                return fn
        try:
            stored = copy.deepcopy(key)
        except Exception:
            stored = key
        fn = build(stored)
        self._unhashable.append((stored, fn))
        return fn


class _Bound:
    """The last step's binding: its program, variables and what they were built for.

    While :meth:`valid` holds (same model and optimizer objects, same mode, placement
    and debug flags, and the graph unchanged: :class:`GraphWatch`) the engine
    reuses it: no optimizer ``init``, no ``nnx.split``, no cache key. The state travels
    as one flat list of arrays: each variable's value is read on the call (so values the
    user wrote between steps, ``nnx.update`` or ``opt.set_lr``, are used) and the step's
    outputs are written back into the same variables. A value the step did not install
    itself is checked against the shape, dtype and sharding the program was built for;
    another one sends the call down the full path (a compile-cache lookup).
    """

    def __init__(self, fn, placement, model, optimizer, states, mode) -> None:
        self.fn = fn
        self.placement = placement
        self.mode = mode
        self.debug = _debugging_floats()
        self.model = weakref.ref(model)
        self.optimizer = weakref.ref(optimizer)
        self.states = states  # kept only where the variables do not map 1:1 to leaves
        self.batch_def: Any = None
        self.batch_specs: tuple = ()
        is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
        variables = jax.tree.leaves(states, is_leaf=is_var)
        leaves = jax.tree.leaves(states)
        flat = len(variables) == len(leaves) and all(
            is_var(v) and v.get_raw_value() is x and isinstance(x, jax.Array)
            for v, x in zip(variables, leaves, strict=True)
        )
        self.variables = variables if flat else None
        self.watch = watch_graph(model, optimizer) if flat else None
        if self.variables is not None:
            self.states = None  # the variables hold the values; keep no second reference
            self.specs = [(x.shape, x.dtype, x.sharding) for x in leaves]
            self._installed = [weakref.ref(x) for x in leaves]
        # Hold the variables no longer than the model lives.
        self._finalizer = weakref.finalize(model, self.release)

    def valid(self, model: Any, optimizer: Any, mode: str, placement: Placement | None) -> bool:
        """Whether the next call may reuse this binding (see the class docstring);
        ``placement`` is the step's own (``None``: the model's, else the run's)."""
        if self.watch is None or self.model() is not model or self.optimizer() is not optimizer:
            return False
        if mode != self.mode or _debugging_floats() != self.debug:
            return False
        current = resolve_placement(placement, model)
        if current is not self.placement and current != self.placement:
            return False
        return self.watch.unchanged()

    def release(self) -> None:
        """Drops the references to the variables (the model died, or another binding won)."""
        self._finalizer.detach()
        self.variables = self.watch = self.states = None

    def values(self) -> list:
        """The state's arrays, in the program's order."""
        if self.variables is None:
            return jax.tree.leaves(self.states)
        return list(map(nnx.Variable.get_raw_value, self.variables))

    def arguments(self, batch: Any) -> tuple[list, Any] | None:
        """The program's arguments, or ``None`` when a value or the batch does not fit it."""
        values = self.values()
        if self.variables is not None:
            for i, (ref, x) in enumerate(zip(self._installed, values, strict=True)):
                if ref() is not x and _spec(x) != self.specs[i]:
                    return None
        leaves, treedef = jax.tree.flatten(batch)
        if treedef != self.batch_def or _leaf_specs(leaves) != self.batch_specs:
            return None
        return values, batch

    def install(self, leaves: list) -> None:
        """Writes the step's outputs into the model's and the optimizer's variables."""
        if self.variables is None:
            model_state, opt_state = jax.tree.unflatten(jax.tree.structure(self.states), leaves)
            nnx.update(self.model(), model_state)
            nnx.update(self.optimizer(), opt_state)
            return
        # What set_raw_value(x, _unsafe_bypass_check=True) does, without its checks.
        list(map(_set_raw_value, self.variables, leaves))
        self._installed = list(map(weakref.ref, leaves))


def _set_raw_value(var: nnx.Variable, value: Any) -> None:
    object.__setattr__(var, "_raw_value", value)


def _spec(x: Any) -> tuple | None:
    """Shape, dtype and sharding of an array; ``None`` for anything else (the full path)."""
    return (x.shape, x.dtype, x.sharding) if isinstance(x, jax.Array) else None


class _Step:
    """What the train and eval steps share: the loss function, the placement, the compile cache."""

    def __init__(
        self, loss_fn: LossFn, placement: Placement | None = None, nonfinite: str | None = None
    ) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn={loss_fn!r} is not callable; pass loss_fn(model, batch).")
        if nonfinite is not None:
            check_mode(nonfinite, "nonfinite")
        self.loss_fn = loss_fn
        self._placement = placement
        self._nonfinite = nonfinite
        self._cache = _CompileCache()
        self._guard = Guard()
        self._leaf_names: dict[int, list[str]] = {}  # id(compiled step) -> guarded leaves
        self._bound: _Bound | None = None  # the train step's fast path (see _Bound)
        self.last_aux: Any = None


class TrainStep(_Step):
    """One jitted train step ``step(model, optimizer, batch) -> loss``.

    Built by :func:`make_train_step`. The first call for a model/optimizer/batch
    structure compiles; later calls reuse the executable. A structure is the model's
    and the optimizer's graph definitions (static attributes included, hashable or
    not: a config holding a list is fine), the placement, and the shapes, dtypes and
    shardings of the state and batch arrays. The aux value of a ``(loss, aux)`` loss
    function of the last call is in ``last_aux``.

    ``nonfinite`` (``"warn"``, ``"skip"``, ``"raise"``; default: the strategy's, else
    ``"warn"``) is the non-finite guard (:mod:`jfleet.nonfinite`); ``nonfinite_steps``
    counts the non-finite steps seen. Dispatch and install are atomic
    (:class:`jfleet.interrupts.atomic`): an interrupt leaves the old or the new state.

    Host work per call: after a call for a model and optimizer, the next call with the
    same two objects skips the optimizer's ``init``, ``nnx.split`` and the cache key when
    nothing the program depends on changed (checked by identity against a snapshot of
    the graph, :class:`GraphWatch`); it reads each variable's value, so values
    written between calls (``nnx.update``, a checkpoint restore, ``opt.set_lr``) are
    used, and writes the outputs back into the same variables. Any other change (a
    submodule swapped, a static attribute set, a value of another shape, dtype or
    sharding, another model) takes the full path (split, key, compile-cache lookup).
    """

    @property
    def nonfinite(self) -> str:
        """The guard's mode for the next call: the one given, else the strategy's, else warn."""
        if self._nonfinite is not None:
            return self._nonfinite
        run = _context.current()
        return run.strategy.nonfinite if run is not None else "warn"

    @property
    def nonfinite_steps(self) -> int:
        """How many steps had a non-finite loss or gradient (waits for the pending steps)."""
        return self._guard.count

    def lower(self, model: nnx.Module, optimizer: DistributedOptimizer, batch: Any):
        """The lowered step for these arguments (for HLO and memory inspection)."""
        bound, batch = self._bind(model, optimizer, batch, self.nonfinite)
        return bound.fn.lower(bound.values(), batch)

    def __call__(self, model: nnx.Module, optimizer: DistributedOptimizer, batch: Any) -> jax.Array:
        watchdog.step_started("train")
        mode = self.nonfinite
        bound = self._bound
        args = None
        if bound is not None and bound.valid(model, optimizer, mode, self._placement):
            args = bound.arguments(bound.placement.shard_batch(batch))
        if args is None:  # the full path: something the program depends on changed
            bound, batch = self._bind(model, optimizer, batch, mode)
            args = bound.arguments(batch)
        fn = bound.fn
        with interrupts.atomic():  # old state or new state, never donated buffers
            try:
                state, loss, aux, flags = fn(*args)
            except Exception as err:
                _raise_if_lost(args[0], err)
                raise
            bound.install(state)
            self.last_aux = aux
        watchdog.step_dispatched("train", loss)
        self._guard.record(mode, flags, self._leaf_names[id(fn)])
        return loss

    def _bind(self, model, optimizer, batch, mode) -> tuple[_Bound, Any]:
        """The full path: binds the optimizer, splits both objects, looks the step up."""
        if not isinstance(optimizer, DistributedOptimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is not a DistributedOptimizer; wrap it "
                "with fleet.distributed_optimizer(...)."
            )
        placement = resolve_placement(self._placement, model)
        optimizer.init(model, placement)
        batch = placement.shard_batch(batch)
        model_def, model_state = nnx.split(model)
        opt_def, opt_state = nnx.split(optimizer)
        # What the program is specialised to: the placement (ZeRO stage and mesh), both
        # graph definitions (structure and static attributes), the batch's structure,
        # and the shape, dtype and sharding of every state and batch array (the jit's in
        # and out shardings are fixed when it is built), the non-finite mode and JAX's
        # debug_nans / debug_infs flags (no donation under them). See _CompileCache for
        # keys that are not hashable.
        batch_def = jax.tree.structure(batch)
        batch_specs = _leaf_specs(batch)
        key = (
            placement,
            model_def,
            opt_def,
            batch_def,
            _leaf_specs(model_state),
            _leaf_specs(opt_state),
            batch_specs,
            mode,
            _debugging_floats(),
        )

        def build(key):
            _, model_def, opt_def, *_ = key
            return self._build(
                placement, model_def, model_state, opt_def, opt_state, batch, optimizer, mode
            )

        fn = self._cache.get_or_build(key, build)
        bound = _Bound(fn, placement, model, optimizer, (model_state, opt_state), mode)
        bound.batch_def, bound.batch_specs = batch_def, batch_specs
        if self._bound is not None:
            self._bound.release()
        self._bound = bound
        return bound, batch

    def _build(self, placement, model_def, model_state, opt_def, opt_state, batch, optimizer, mode):
        loss_fn = self.loss_fn
        names: list[str] = []
        wrt = optimizer.wrt
        scaled = optimizer.has_loss_scaling
        comm, local = optimizer.communication, optimizer.localsgd
        # ZeRO-2 / 3 stacks gather per layer in the step's one program (not under the
        # replicas' shard_map of a communication hook or LocalSGD)
        per_layer = placement if comm is None and local is None else None
        grad_shardings, gathered, outside, regathers = _zero_layouts(
            placement, nnx.merge(model_def, model_state), wrt, per_layer
        )
        # The step takes and returns the state as one flat list of arrays (the model's,
        # then the optimizer's), so a call flattens no State and installs by position.
        model_tree = jax.tree.structure(model_state)
        opt_tree = jax.tree.structure(opt_state)
        n_model = model_tree.num_leaves
        state_sh = jax.tree.leaves(_shardings((model_state, opt_state)))
        batch_sh = _shardings(batch)
        replicated = placement.named(jax.sharding.PartitionSpec())

        if comm is not None or local is not None:
            check_supported(placement, _switches(optimizer))
        merge_in_backward = _merges_in_backward(per_layer, scaled)

        def objective(model, batch, scale):
            accumulators = merged_backward.current()
            if accumulators is not None:  # the stacks find their accumulators by array
                accumulators.bind(nnx.state(model, wrt))
            if gathered is not None:
                params = nnx.state(model, wrt)
                nnx.update(model, jax.lax.with_sharding_constraint(params, gathered))
            if outside is not None:
                nnx.update(model, layer_gather.gather_tree(nnx.state(model, wrt), outside))
            with layer_gather.per_layer(per_layer):  # ZeRO-2 / 3: stacks gather per layer
                loss, aux = _split_loss(loss_fn(model, batch))
            return loss * scale, (loss, aux)

        def step(leaves, batch):
            model_state = jax.tree.unflatten(model_tree, leaves[:n_model])
            opt_state = jax.tree.unflatten(opt_tree, leaves[n_model:])
            model = nnx.merge(model_def, model_state)
            opt = nnx.merge(opt_def, opt_state)
            scale = opt.loss_scale if scaled else jnp.float32(1.0)
            old = jax.tree.leaves((model_state, opt_state))
            before = jax.tree.leaves(nnx.state(model, wrt))  # the update changes model_state
            if local is not None:  # LocalSGD: replicas step on their own parameters
                loss, aux, flags = localsgd_step(model, opt, objective, batch, scale, placement)
                checked = (loss, nnx.state(model, wrt))  # what the flags are about, for names
            else:
                if comm is not None:  # each replica's gradient, combined by the hook
                    grads, loss, aux, comm_state = replica_gradients(
                        model, wrt, objective, batch, scale, placement, comm,
                        nnx.as_pure(opt.comm_state),
                    )  # fmt: skip
                    nnx.update(opt.comm_state, nnx.state(comm_state))
                    accumulators = None
                else:
                    grads, loss, aux, accumulators = _gradients(
                        objective, model, opt, wrt, batch, scale, merge_in_backward
                    )
                if grad_shardings is not None:
                    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
                # The guard: with loss scaling the scaler skips overflowing steps itself (and
                # lowers the scale), so only the loss is checked; else the loss and gradients.
                checked = (loss,) if scaled else (loss, grads)
                flags = finite_flags(checked)
                _update(opt, model, grads, accumulators)
            if regathers is not None:  # the guard below selects on the shards
                nnx.update(model, layer_gather.split_tree(nnx.state(model, wrt), regathers))
            names[:] = leaf_names([path for path, _ in floating_leaves(checked)])
            new_state = (nnx.state(model), nnx.state(opt))
            if mode != "warn" and not scaled:  # drop the update: old state, bit for bit
                finite = jnp.all(flags)
                leaves, treedef = jax.tree.flatten(new_state)
                kept = [jnp.where(finite, n, o) for n, o in zip(leaves, old, strict=True)]
                new_state = jax.tree.unflatten(treedef, kept)
            if regathers is not None:
                new_state = _regathered(new_state, before, model_def, wrt, regathers)
            new_leaves = jax.tree.leaves(new_state)
            if jax.tree.structure(new_state) != jax.tree.structure((model_state, opt_state)):
                raise ValueError(
                    "the train step changed the structure of the model's or the optimizer's "
                    "state (a variable added, removed or given other metadata inside "
                    "loss_fn); make such changes outside the step, between calls."
                )
            return new_leaves, loss, aux, flags

        donate = () if any(_debugging_floats()) else (0,)
        fn = jax.jit(
            step,
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, replicated, None, replicated),
            donate_argnums=donate,
        )
        self._leaf_names[id(fn)] = names  # filled when the step is traced
        return fn


def _merges_in_backward(per_layer: Placement | None, scaled: bool) -> bool:
    """Whether ZeRO-2 / 3 stacks add their gradients into gradient merge's accumulator in
    the backward pass (one gradient-sized buffer, not two): not under loss scaling, whose
    accumulator holds unscaled sums of differently scaled steps."""
    return per_layer is not None and per_layer.zero_stage >= 2 and not scaled


def _gradients(
    objective: Callable, model: nnx.Module, opt: nnx.Optimizer, wrt: Any, batch: Any,
    scale: jax.Array, merge_in_backward: bool,
) -> tuple:  # fmt: skip
    """``(grads, loss, aux, accumulators)``: ``objective``'s gradients with respect to the
    ``wrt`` parameters, the stacks merging theirs into gradient merge's accumulators where
    ``merge_in_backward`` (:mod:`jfleet.parallel.merged_backward`; None: nothing merged)."""
    accumulators = _accumulators(opt, model, wrt) if merge_in_backward else None
    with merged_backward.accumulating(accumulators):
        grads, (loss, aux) = nnx.grad(objective, argnums=nnx.DiffState(0, wrt), has_aux=True)(
            model, batch, scale
        )
    return grads, loss, aux, accumulators


def _update(opt: nnx.Optimizer, model: nnx.Module, grads: Any, accumulators: Any) -> None:
    """``opt.update(model, grads)``, or :func:`_update_merged` where stacks merged their
    gradients into ``accumulators`` already."""
    if accumulators is None or not accumulators.taken:
        opt.update(model, grads)
    else:  # those gradients hold their merge, in the accumulators' buffers
        _update_merged(opt, model, grads, accumulators.taken)


def _accumulators(
    opt: nnx.Optimizer, model: nnx.Module, wrt: Any
) -> merged_backward.Accumulators | None:
    """The gradient-merge accumulators of ``model``'s parameters in ``opt``, where its
    optimizer is a :func:`jfleet.optim.gradient_merge` (outermost, so it gets the raw
    gradients) that keeps them in its parameters' dtypes; else None."""
    state = opt.opt_state
    if not isinstance(state, GradientMergeState) or isinstance(state.acc_grads, tuple):
        return None
    params = dict(nnx.to_flat_state(nnx.state(model, wrt)))
    by_path = {}
    for path, var in nnx.to_flat_state(state.acc_grads):
        param = params.get(path)
        if param is not None and var.get_value().dtype == param.get_value().dtype:
            by_path[path] = var.get_value()
    if not by_path:
        return None
    return merged_backward.Accumulators(by_path, fresh=state.mini_step.get_value() == 0)


def _update_merged(opt: nnx.Optimizer, model: nnx.Module, grads: Any, paths: set) -> None:
    """``opt.update(model, grads)`` where the gradients at ``paths`` are merged already
    (:mod:`jfleet.parallel.merged_backward`): the gradient merge gets zeros for their
    accumulators (the compiler drops its ``0 + g``), and keeps the merged gradients as
    their accumulators (it reads them as zero at its next mini-step 0), so the backward
    loop's buffer is the accumulator's, with no copy."""
    accs = {path: var for path, var in nnx.to_flat_state(opt.opt_state.acc_grads) if path in paths}
    for var in accs.values():
        var.set_value(jnp.zeros_like(var.get_value()))
    opt.update(model, grads)
    merged = dict(nnx.to_flat_state(grads))
    for path, var in accs.items():
        grad = merged[path]
        var.set_value(grad.get_value() if isinstance(grad, nnx.Variable) else grad)


def _zero_layouts(placement: Any, model: Any, wrt: Any, per_layer: Any) -> tuple:
    """What a ZeRO stage constrains in the step: ``(gradient shardings, gathered
    parameter shardings, the gathers outside per-layer stacks, the updated stacks'
    per-layer regathers)``, each ``None`` where the stage has none."""
    grad_shardings = gathered = outside = regathers = None
    if placement.zero_stage == 0:
        return grad_shardings, gathered, outside, regathers
    params = nnx.state(model, wrt)
    if placement.zero_stage >= 2:
        grad_shardings = placement.param_shardings(params, zero=True)
    if placement.zero_stage in (1, 2) and per_layer is not None:
        # the updated stacks return whole one layer at a time (layer_gather.regather)
        regathers = layer_gather.update_gathers(placement, model, params)
    if placement.zero_stage >= 3:
        # ZeRO-3 keeps parameters sharded between steps and gathers them (to their
        # tensor-parallel layout) for the step; left to itself GSPMD may keep them
        # sharded and all-reduce activations instead, which costs far more. Stacked
        # blocks that gather per layer (FSDP, layer_gather) are left split: only the
        # parameters outside them are gathered here.
        if per_layer is not None:
            outside = layer_gather.outside_gathers(placement, model, params)
        if outside is None:
            gathered = placement.param_shardings(params, zero=False)
    return grad_shardings, gathered, outside, regathers


def _regathered(state: tuple, before: list, model_def: Any, wrt: Any, pairs: list) -> tuple:
    """``(model state, optimizer state)`` with the model's stacked ZeRO-1 / 2 parameters
    gathered back whole one layer at a time into their buffers before the update,
    ``before`` (:func:`layer_gather.regather_tree`)."""
    model_state, opt_state = state
    model = nnx.merge(model_def, model_state)
    nnx.update(model, layer_gather.regather_tree(nnx.state(model, wrt), before, pairs))
    return nnx.state(model), opt_state


class EvalStep(_Step):
    """One jitted evaluation step ``step(model, batch) -> loss`` (no update)."""

    def __call__(self, model: nnx.Module, batch: Any) -> jax.Array:
        watchdog.step_started("eval")
        batch = resolve_placement(self._placement, model).shard_batch(batch)
        model_def, model_state = nnx.split(model)
        key = (model_def, jax.tree.structure(batch))
        loss_fn = self.loss_fn

        def build(key):
            model_def = key[0]

            def step(model_state, batch):
                return _split_loss(loss_fn(nnx.merge(model_def, model_state), batch))

            return jax.jit(step)  # specialises to shapes and shardings itself

        fn = self._cache.get_or_build(key, build)
        loss, aux = fn(model_state, batch)
        self.last_aux = aux
        watchdog.step_dispatched("eval", loss)
        return loss


_STEPS: dict[type, weakref.WeakKeyDictionary] = {}


def cached_step(cls: type[_Step], loss_fn: LossFn, placement: Placement | None) -> Any:
    """The one step cache: the ``cls`` step (train or eval) for ``loss_fn`` and ``placement``.

    ``train_batch`` and ``eval_batch`` of every wrapped model ask here, so a loss function
    compiles once per placement and model structure however often it is passed in. Equal
    loss-function objects share a step.

    Example:
      >>> loss_fn = lambda m, b: 0.0
      >>> cached_step(TrainStep, loss_fn, None) is cached_step(TrainStep, loss_fn, None)
      True
    """
    per_fn = _STEPS.setdefault(cls, weakref.WeakKeyDictionary()).setdefault(loss_fn, {})
    if placement not in per_fn:
        per_fn[placement] = cls(loss_fn, placement)
    return per_fn[placement]


def make_train_step(
    loss_fn: LossFn, *, placement: Placement | None = None, nonfinite: str | None = None
) -> TrainStep:
    """The engine's train step as a function ``step(model, optimizer, batch) -> loss``.

    Args:
      loss_fn: ``loss_fn(model, batch)`` returning a scalar loss or ``(loss, aux)``.
      placement: where the arrays live; default: the model's (a ``DistributedModel``),
        else the one ``fleet.init`` set up.
      nonfinite: what a step with an inf / nan loss or gradient does: ``"warn"``,
        ``"skip"`` or ``"raise"`` (:mod:`jfleet.nonfinite`); default: the strategy's
        ``nonfinite`` (``"warn"`` without ``fleet.init``).

    Returns:
      A :class:`TrainStep`. ``optimizer`` must come from
      ``fleet.distributed_optimizer``; it is bound to ``model`` on the first call.

    Raises:
      ValueError: ``nonfinite`` is not one of the three modes.

    Example:
      >>> import optax
      >>> from jfleet import fleet
      >>> from jfleet.models import TinyLM, lm_batches, lm_loss
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> from jfleet import make_train_step
      >>> model = fleet.distributed_model(TinyLM())
      >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
      >>> step = make_train_step(lm_loss)
      >>> float(step(model, opt, lm_batches(1)[0])) > 0
      True
    """
    return TrainStep(loss_fn, placement, nonfinite)


def make_eval_step(loss_fn: LossFn, *, placement: Placement | None = None) -> EvalStep:
    """The engine's evaluation step ``step(model, batch) -> loss``.

    Example:
      >>> import optax
      >>> from jfleet import fleet
      >>> from jfleet.models import TinyLM, lm_batches, lm_loss
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> from jfleet import make_eval_step
      >>> evaluate = make_eval_step(lm_loss)
      >>> float(evaluate(fleet.distributed_model(TinyLM()), lm_batches(1)[0])) > 0
      True
    """
    return EvalStep(loss_fn, placement)

"""``to_distributed``: one call turns a plain NNX model, optimizer and loader into a parallel run.

The call matches the model's parts, lets the cost model choose the layout
(:func:`~jfleet.auto_parallel.search.planner.plan_for`), builds the fleet mesh for it
(``fleet.init`` with the plan's degrees), and applies it: parameters placed by the plan's
``PartitionSpec``\\ s (ZeRO-sharded as its stage says), the decoder blocks replaced by a
pipelined stack when ``pp > 1`` (:mod:`jfleet.auto_parallel.apply.blocks`) and by one scan
otherwise (:mod:`jfleet.auto_parallel.apply.scanned_blocks`; ``scan_layers=False`` keeps them
unrolled), the optimizer's state
made and placed for the plan, and the loader wrapped to yield global sharded arrays. Train
the returned objects with :func:`jfleet.make_train_step` (any plan) or with your own
``nnx.jit`` step (plans without loss scaling). A model too big for one device is passed as
the function that builds it: it is planned from its shapes and created in its layout.

Example:
  >>> import optax
  >>> from jfleet import make_train_step
  >>> from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
  >>> from jfleet.models import lm_batches, lm_loss
  >>> from jfleet.models.llama import TinyLlama
  >>> config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4})
  >>> model, opt, loader = to_distributed(TinyLlama(), optax.adam(1e-2), lm_batches(2),
  ...                                     config=config)
  >>> get_plan(model).mesh_shape["mp"]
  4
  >>> step = make_train_step(lm_loss)
  >>> losses = [float(step(model, opt, batch)) for batch in loader]
  >>> losses[1] < losses[0]
  True
"""

from __future__ import annotations

import copy
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from jfleet.auto_parallel.apply.apply_plan import apply_plan, shape_for_plan
from jfleet.auto_parallel.apply.blocks import (
    PipelinedBlocks,
    container_of,
)
from jfleet.auto_parallel.apply.scanned_blocks import ScannedBlocks
from jfleet.auto_parallel.config import ToDistributedConfig, check_config
from jfleet.auto_parallel.cost.layout import OPTIMIZER_MOMENTS
from jfleet.auto_parallel.match.block_calls import ARRAY, TREE, block_outputs, record_block_calls
from jfleet.auto_parallel.match.block_check import block_problems, pipeline_problem, state_problem
from jfleet.auto_parallel.match.block_extras import BlockOutputs
from jfleet.auto_parallel.match.patterns import ModelPatterns, match_patterns
from jfleet.auto_parallel.search.layouts import stacks_reason
from jfleet.auto_parallel.search.plan import Plan
from jfleet.auto_parallel.search.planner import plan_for
from jfleet.mesh import context as _context
from jfleet.mesh.create import create_placed
from jfleet.mesh.lazy import unbuilt
from jfleet.mesh.placement import Placement, check_divides
from jfleet.mesh.topology import AXIS_NAMES, DP, PP, SHARDING
from jfleet.optim.compiler import amp_settings
from jfleet.runtime.devices import fix_hint
from jfleet.runtime.log import logger
from jfleet.runtime.role_maker import PaddleCloudRoleMaker
from jfleet.training.data import ShardedLoader, batch_shape, peek
from jfleet.training.distributed_model import apply_distributed_settings, apply_strategy_amp
from jfleet.training.distributed_optimizer import (
    DistributedOptimizer,
    make_distributed_optimizer,
)
from jfleet.training.run import start_run
from jfleet.training.strategy import DistributedStrategy

__all__ = ["ToDistributedConfig", "get_plan", "to_distributed"]

_PLANS: weakref.WeakKeyDictionary[nnx.Module, Plan] = weakref.WeakKeyDictionary()
#: Why the blocks cannot run as one stack (True: they can), from the planning trace.
_BLOCK_PROBLEMS: weakref.WeakKeyDictionary[nnx.Module, str | bool] = weakref.WeakKeyDictionary()


#: The dict keys read as the model's input when neither ``forward`` nor ``loss_fn`` is given.
_INPUT_KEYS = ("input_ids", "tokens", "inputs", "input", "x", "image", "images", "pixel_values")


def _model_call(batch: Any, forward: Callable | None) -> tuple[Any, Callable | None]:
    """``(inputs, forward)`` for tracing the model on ``batch`` (see ``config.forward``).

    Raises:
      ValueError: a dict batch with none of the known input keys and no ``forward``.

    Example:
      >>> _model_call({"tokens": 1, "labels": 2}, None)
      (1, None)
    """
    if forward is not None:
        if not callable(forward):
            raise TypeError(
                f"config.forward={forward!r} is not callable; pass a function "
                "forward(model, batch) that calls the model as your training step does."
            )
        return batch, forward
    if isinstance(batch, Mapping):
        for key in _INPUT_KEYS:
            if key in batch:
                return batch[key], None
        raise ValueError(
            f"the loader's batches are dicts with keys {sorted(batch)}, none of them a known "
            f"model input {_INPUT_KEYS}; pass your training loss as "
            "ToDistributedConfig(loss_fn=loss_fn), or ToDistributedConfig(forward=lambda "
            "model, batch: model(batch[...])) calling the model as your training step does."
        )
    if isinstance(batch, tuple | list):
        return batch[0], None
    return batch, None


def get_plan(model: nnx.Module) -> Plan:
    """The :class:`Plan` :func:`to_distributed` applied to ``model``.

    The plan names parameters by their paths in the model as it was given
    (``layers.0.self_attn.q_proj.kernel``); with a pipeline the returned model holds the
    blocks stacked instead (``layers.body.self_attn.q_proj.kernel``, ``[pp, L/pp, ...]``;
    scanned blocks: ``[1, L, ...]``),
    so ``plan.validate`` and ``plan.spec`` apply to a fresh model, as for
    ``ToDistributedConfig(plan=...)``.

    Raises:
      ValueError: ``model`` was not returned by ``to_distributed``.

    Example:
      >>> import optax
      >>> from jfleet.models import TinyLM, lm_batches
      >>> config = ToDistributedConfig(force_mesh={"dp": 8})
      >>> model, _, _ = to_distributed(TinyLM(), optax.sgd(0.1), lm_batches(1), config=config)
      >>> get_plan(model).layout.name
      'dp8'
    """
    plan = _PLANS.get(model) if isinstance(model, nnx.Module) else None
    if plan is None:
        raise ValueError(
            f"{type(model).__name__} object was not returned by to_distributed; pass the model "
            "to_distributed returned (or plan one with jfleet.auto_parallel.plan_for)."
        )
    return plan


def to_distributed(
    model: nnx.Module | Callable[[], nnx.Module],
    optimizer: nnx.Optimizer | optax.GradientTransformation,
    dataloader: Iterable[Any],
    device_num: int | None = None,
    node_num: int = 1,
    config: ToDistributedConfig | None = None,
) -> tuple[nnx.Module, DistributedOptimizer, ShardedLoader]:
    """Plans and applies a hybrid-parallel layout for a model with no distributed code.

    Args:
      model: an ``nnx.Module``; changed in place (parameters placed; with a pipeline its
        list of decoder blocks becomes a
        :class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks`, without one a
        :class:`~jfleet.auto_parallel.apply.scanned_blocks.ScannedBlocks`) and returned.
        Its class and call signature stay. Or a function that builds the model
        (``lambda: Model(rngs=nnx.Rngs(0))``, Paddle's ``LazyGuard`` use): the plan is made
        from its abstract shapes (``nnx.eval_shape``) and the model is created directly in
        the planned layout (:func:`~jfleet.mesh.create.create_placed`), so
        no device or host ever holds a parameter the plan splits whole; the values equal
        the same function compiled on one device bitwise (eager construction may round
        variance-scaled initialisers 1 ulp apart).
      optimizer: an ``optax.GradientTransformation`` or an ``nnx.Optimizer`` (its
        transform and ``wrt`` are used; its state is made anew for the placed model).
      dataloader: an iterable of batches (numpy or jax arrays, or dicts / tuples of them).
      device_num: devices per node to use (default: all devices / ``node_num``).
      node_num: nodes; tensor parallelism stays inside one.
      config: a :class:`ToDistributedConfig`.

    Returns:
      ``(model, optimizer, loader)``: the placed model, a
      :class:`~jfleet.distributed_optimizer.DistributedOptimizer` with its state placed,
      and a :class:`~jfleet.data.ShardedLoader`.

    Raises:
      TypeError: neither an ``nnx.Module`` nor a function returning one, an abstract
        module (pass its factory), an optimizer of another kind, a config of
        another type, a loader that is not iterable.
      ValueError: ``device_num x node_num`` above the devices present, a model without parameters,
        a forced mesh that does not multiply out or does not suit the shapes, a batch the data-
        parallel size does not divide, an ``input_spec`` batch other than the loader's, a schedule
        other than FThenB / 1F1B, a plan made for another model or given with planning settings, a
        strategy asking for recompute, a model already returned; a model whose traced call fails
        (``TraceError``: the message names the model and suggests ``config.forward``), a ``forward``
        returning no arrays.

    Example:
      >>> import optax
      >>> from jfleet.models import TinyLM, lm_batches
      >>> model, opt, loader = to_distributed(TinyLM(), optax.sgd(0.1), lm_batches(1))
      >>> get_plan(model).layout.size  # every device of this process
      8
      >>> model, opt, loader = to_distributed(lambda: TinyLM(), optax.sgd(0.1), lm_batches(1))
      >>> get_plan(model).layout.size  # created in its layout, never whole
      8
    """
    config = _checked_config(config, model)
    model, factory = _planned_model(model)  # a factory: planned on its abstract model
    tx, wrt = _transform(optimizer)
    device_num, node_num = _device_counts(device_num, node_num)
    first = peek(dataloader)
    batch_size, seq_len = _batch_dims(first, config)
    plan = _given_plan(config, model, device_num * node_num)
    if plan is None:
        inputs, forward = _model_call(first, config.forward)
        stored = _as_amp_stores(model, config.strategy)  # O2: half-precision parameters
        patterns = match_patterns(stored, inputs, forward=forward)  # 1. match the model
        plan = plan_for(  # 2, 3. cost every layout its shapes allow, keep the best
            stored, patterns=patterns, device_num=device_num, node_num=node_num,
            batch_size=batch_size, seq_len=seq_len,
            **_search_settings(stored, patterns, inputs, forward, tx, wrt, config),
        )  # fmt: skip
    _check_batch(plan, batch_size)  # a given plan may be for another batch
    model, dist, placement = _apply(  # 4. apply the plan (create the model in it)
        model, factory, plan, tx, wrt, first, config, device_num * node_num
    )
    return model, dist, _loader(dataloader, placement, first, config, _PLANS[model])


# ------------------------------------------------------------------ steps
def _loader(
    dataloader: Iterable[Any],
    placement: Placement,
    first: Any,
    config: ToDistributedConfig,
    plan: Plan,
) -> ShardedLoader:
    """The loader, sharded for the plan; each batch in ``accumulate_steps`` calls."""
    return ShardedLoader(
        dataloader,
        placement,
        first,
        global_batches=config.global_batches,
        accumulate_steps=plan.layout.accumulate_steps,
    )


def _transform(optimizer: Any) -> tuple[optax.GradientTransformation, Any]:
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.inner_tx, optimizer.wrt
    if isinstance(optimizer, nnx.Optimizer):
        return optimizer.tx, optimizer.wrt
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer, nnx.Param
    raise TypeError(
        f"optimizer={optimizer!r} ({type(optimizer).__name__}) is neither an optax "
        "GradientTransformation nor an nnx.Optimizer; pass e.g. optax.adam(1e-3)."
    )


def _device_counts(device_num: int | None, node_num: int) -> tuple[int, int]:
    present = jax.device_count()
    if isinstance(node_num, bool) or not isinstance(node_num, int) or node_num < 1:
        raise ValueError(f"node_num={node_num!r} must be an int >= 1.")
    if device_num is None:
        if present % node_num:
            raise ValueError(
                f"node_num={node_num} does not divide the {present} devices present; pass "
                "device_num (devices per node) explicitly."
            )
        return present // node_num, node_num
    if isinstance(device_num, bool) or not isinstance(device_num, int) or device_num < 1:
        raise ValueError(f"device_num={device_num!r} must be an int >= 1 (devices per node).")
    if device_num * node_num > present:
        raise ValueError(
            f"device_num={device_num} x node_num={node_num} = {device_num * node_num} devices "
            f"asked for, but only {present} are present; use device_num <= "
            f"{present // node_num}. " + fix_hint(device_num * node_num)
        )
    return device_num, node_num


def _optimizer_kind(tx: optax.GradientTransformation, model: nnx.Module, wrt: Any) -> str:
    """The cost model's optimizer name with as many parameter-sized moments as ``tx`` keeps."""
    params = nnx.state(model, wrt)
    state = jax.eval_shape(tx.init, params)
    size = sum(math.prod(np.shape(x)) for x in jax.tree.leaves(params))
    kept = sum(math.prod(x.shape) for x in jax.tree.leaves(state) if hasattr(x, "shape"))
    moments = round(kept / size) if size else 0
    by_count = {n: name for name, n in reversed(OPTIMIZER_MOMENTS.items())}
    return by_count[min(moments, max(by_count))]


def _checked_config(config: ToDistributedConfig | None, model: Any) -> ToDistributedConfig:
    """The config to use (default, or with ``loss_fn`` as the traced forward); a model that
    is no ``nnx.Module``, or one ``to_distributed`` already returned, is an error."""
    config = ToDistributedConfig() if config is None else config
    if not isinstance(config, ToDistributedConfig):
        raise TypeError(
            f"config={config!r} ({type(config).__name__}) is not a ToDistributedConfig."
        )
    if not isinstance(model, nnx.Module) and not callable(model):
        raise TypeError(
            f"model is a {type(model).__name__}, neither an nnx.Module nor a function that "
            "builds one; pass a Flax NNX module, or lambda: Model(rngs=nnx.Rngs(0)) to create "
            "it directly in its planned layout."
        )
    if not isinstance(model, nnx.Module):  # a factory: nothing built yet
        check_config(config)
        return _traced_loss(config)
    stand_ins = (PipelinedBlocks, ScannedBlocks)
    if model in _PLANS or any(isinstance(m, stand_ins) for _, m in nnx.iter_modules(model)):
        raise ValueError(
            f"this {type(model).__name__} was already returned by to_distributed (plan "
            f"{_PLANS[model].layout.name if model in _PLANS else 'with a pipeline'}); pass a "
            "freshly built model to plan again, or keep training the one you have."
        )
    check_config(config)
    return _traced_loss(config)


def _traced_loss(config: ToDistributedConfig) -> ToDistributedConfig:
    """``config`` with its ``loss_fn`` as the traced forward when no forward is given."""
    if config.forward is None and config.loss_fn is not None:
        config = dataclasses.replace(config, forward=config.loss_fn)  # trace the loss
    return config


def _batch_dims(first: Any, config: ToDistributedConfig) -> tuple[int, int]:
    """The global batch size and sequence length: the first batch's, what ``input_spec``
    states winning over it (a batch it states must agree)."""
    batch_size, seq_len = batch_shape(first, local=not config.global_batches)
    if config.input_spec is not None:  # what it states wins; what it leaves open (-1) not
        spec_batch, spec_seq = batch_shape(config.input_spec, local=False)
        if spec_batch is not None and batch_size is not None and spec_batch != batch_size:
            raise ValueError(
                f"config.input_spec states a global batch of {spec_batch}, but the loader's "
                f"first batch has {batch_size}; make them agree (or leave the batch "
                "dimension of input_spec open with -1)."
            )
        seq_len = spec_seq or seq_len
    if batch_size is None or seq_len is None:
        raise ValueError(
            f"the loader's first batch has no known batch size / sequence length "
            f"({batch_size}, {seq_len}); yield arrays with concrete shapes."
        )
    return batch_size, seq_len


def _given_plan(config: ToDistributedConfig, model: nnx.Module, devices: int) -> Plan | None:
    """``config.plan`` checked against the model and the device count (None: none given)."""
    if config.plan is None:
        return None
    plan = Plan.from_json(config.plan) if isinstance(config.plan, str) else config.plan
    if not isinstance(plan, Plan):
        raise TypeError(f"config.plan={plan!r} is neither a Plan nor its JSON.")
    plan.validate(model)
    if math.prod(plan.axis_sizes) != devices:
        raise ValueError(
            f"config.plan is for {math.prod(plan.axis_sizes)} devices "
            f"({plan.layout.mesh_name}) but device_num x node_num = {devices}."
        )
    return plan


def _search_settings(
    model: nnx.Module,
    patterns: ModelPatterns,
    inputs: Any,
    forward: Callable | None,
    tx: optax.GradientTransformation,
    wrt: Any,
    config: ToDistributedConfig,
) -> dict[str, Any]:
    """:func:`plan_for`'s settings beside the model and the batch: the config's, the
    optimizer's moments, the AMP dtype, and whether the blocks can be pipelined."""
    return dict(
        profile=config.profile if config.profile is not None else _default_profile(),
        memory_budget=config.memory_budget,
        force_mesh=config.force_mesh,
        schedule=config.schedule,
        num_microbatches=config.num_microbatches,
        num_virtual_stages=config.num_virtual_pipeline_stages,
        zero_stage=config.zero_stage,
        sequence_parallel=config.sequence_parallel,
        optimizer=_optimizer_kind(tx, model, wrt),
        recompute=config.recompute,
        pipeline=_pipeline_problem(model, patterns, inputs, forward),
        # blocks that cannot be stacked (RNG streams, ...; found by the trace above) run
        # unrolled, and are planned so
        scan_layers=config.scan_layers and _BLOCK_PROBLEMS.get(model, True) is True,
        dtype=_amp_dtype(config.strategy),
        amp_level=_amp_level(config.strategy),
        distributed_optimizer=config.distributed_optimizer,
        wide_search=config.wide_search,
        accumulate_steps=_search_accumulation(config),
    )


def _apply(
    model: nnx.Module,
    factory: Callable[[], nnx.Module] | None,
    plan: Plan,
    tx: optax.GradientTransformation,
    wrt: Any,
    first: Any,
    config: ToDistributedConfig,
    devices: int,
) -> tuple[nnx.Module, DistributedOptimizer, Placement]:
    """Stage 4: start the run on the plan's mesh, restructure and place the model (or, from
    a ``factory``, create it in place), make the optimizer's state; the plan as placed is
    kept for :func:`get_plan`."""
    base = _users_strategy(config.strategy)
    strategy = _with_accumulation(base, plan)
    placement = _init_fleet(plan, strategy, devices)
    _context.replace(planned_from=base)  # what a later call plans from, not ``strategy``
    apply_distributed_settings(model, strategy, placement)
    unscanned = _scan_problem(model, plan, first, config.forward) if config.scan_layers else None
    scan = config.scan_layers and unscanned is None
    per_sample, outputs = _stacked_blocks(model, plan, first, config, scan)
    shaping = dict(per_sample=per_sample, scan=scan, outputs=outputs)
    if factory is None:
        apply_plan(model, plan, placement, **shaping)
    else:

        def build() -> nnx.Module:
            made = _built(factory)
            apply_distributed_settings(made, strategy, placement)
            shape_for_plan(made, plan, placement, **shaping)
            return made

        model = create_placed(build, placement)
    dist = make_distributed_optimizer(tx, strategy)
    _context.replace(optimizer=dist)  # what fleet's optimizer getters read
    dist.wrt = wrt
    dist.init(model, placement)
    _PLANS[model] = plan = _noted(plan.as_placed(model), unscanned, outputs)  # as placed
    logger.info("to_distributed: %s", plan.layout.name)
    return model, dist, placement


def _built(factory: Callable[[], nnx.Module]) -> nnx.Module:
    """``factory()``, checked to be a fresh ``nnx.Module``."""
    model = factory()
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"the model factory {factory!r} returned a {type(model).__name__}, not an "
            "nnx.Module; pass a function that builds the model, e.g. "
            "lambda: Model(rngs=nnx.Rngs(0))."
        )
    return model


def _planned_model(model: Any) -> tuple[nnx.Module, Callable[[], nnx.Module] | None]:
    """The model to plan on, and the factory to create it from (None: ``model`` is built).

    A factory (any callable that is not an ``nnx.Module``) is planned on its abstract model
    (``nnx.eval_shape``: shapes only, nothing allocated), a :class:`~jfleet.mesh.lazy.LazyGuard`
    model is that abstract model already; an abstract model without its factory cannot be
    created, which is an error naming the fix.
    """
    factory = unbuilt(model, "to_distributed")
    if factory is None:
        return model, None
    abstract = model if isinstance(model, nnx.Module) else nnx.eval_shape(lambda: _built(factory))
    return abstract, factory


def _stacks_problem(model: nnx.Module, patterns: ModelPatterns, call: Callable) -> str:
    """Why a model with several block stacks gets no pipeline: one pipeline runs one stack,
    and each stack's own reason where it has one (decoder blocks handed the encoder's
    output, which a pipeline's block arguments would give no gradient)."""
    own = []
    for paths, cls in patterns.stacks:
        why = pipeline_problem(model, list(paths), call)
        if why:
            own.append(f"{paths[0].rsplit('.', 1)[0]} ({len(paths)} x {cls}): {why}")
    return stacks_reason(patterns) + ("; besides, " + "; ".join(own) if own else "")


def _user_strategy(user: DistributedStrategy | None) -> DistributedStrategy | None:
    """The strategy given, else an earlier ``fleet.init``'s, else the one an earlier
    ``to_distributed`` planned from (None: none of them)."""
    run = _context.current()
    if user is not None or run is None:
        return user
    return run.strategy if run.planned_from is None else run.planned_from


def _search_accumulation(config: ToDistributedConfig) -> int | None:
    """The accumulation the search may use: the config's; 1 when the user's strategy
    merges gradients itself (its merge already spans whole loader batches)."""
    strategy = _user_strategy(config.strategy)
    if strategy is None or not strategy.gradient_merge:
        return config.accumulate_steps
    if config.accumulate_steps not in (None, 1):
        raise ValueError(
            f"config.accumulate_steps={config.accumulate_steps} while the strategy given to "
            "fleet.init has gradient_merge on; drop one of the two."
        )
    return 1


def _set_accumulation(strategy: DistributedStrategy, plan: Plan) -> None:
    """Turns the strategy's gradient merge on for a plan that accumulates ``k`` calls."""
    k = plan.layout.accumulate_steps
    if k == 1:
        return
    if strategy.gradient_merge:
        raise ValueError(
            f"plan {plan.layout.name} accumulates {k} calls through gradient merge, but the "
            "strategy already has gradient_merge on; pass a strategy without it (the plan "
            "sets k_steps) or a plan without accumulation."
        )
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": k, "avg": True}


def _amp_level(user: DistributedStrategy | None) -> str | None:
    """The strategy's AMP level (``"O1"`` / ``"O2"``; None without AMP)."""
    strategy = _user_strategy(user)
    settings = amp_settings(strategy) if strategy is not None else None
    return settings.level if settings is not None else None


def _as_amp_stores(model: nnx.Module, user: DistributedStrategy | None) -> nnx.Module:
    """The model as the run will store its parameters: under the strategy's AMP O2 an
    abstract copy with its half-precision parameters (``model`` untouched), to plan on."""
    if _amp_level(user) != "O2":
        return model
    strategy = _user_strategy(user)
    return nnx.eval_shape(lambda m: apply_strategy_amp(m, strategy), model)


def _amp_dtype(user: DistributedStrategy | None) -> str | None:
    """The strategy's AMP compute dtype, planned at its rates (None: the model's dtype)."""
    strategy = _user_strategy(user)
    settings = amp_settings(strategy) if strategy is not None else None
    return settings.dtype if settings is not None else None


def _pipeline_problem(
    model: nnx.Module, patterns: ModelPatterns, inputs: Any, forward: Callable | None
) -> str | bool:
    """True when the decoder blocks can run as a pipelined stack, else the reason why not.

    Checked at planning time on the traced forward
    (:func:`~jfleet.auto_parallel.match.block_check.block_problems`): parameters and RNG streams
    only (no caches), alike or repeating blocks, each called once in order with the same
    further arguments (arrays, not cache objects), returning the activation (and parts
    summed over the blocks or unused). What keeps the blocks from a scan is kept for
    :func:`_scan_problem`.
    """
    if not patterns.blocks:
        return True

    def call() -> Any:
        return forward(model, inputs) if forward is not None else model(inputs)

    if len(patterns.stacks) > 1:  # an encoder-decoder: each stack's own reason, if any
        problem = scan = _stacks_problem(model, patterns, call)
    else:
        problem, scan = block_problems(model, list(patterns.blocks), call)
    if problem:
        logger.info("to_distributed: no pipeline: %s", problem)
    _BLOCK_PROBLEMS[model] = scan or True
    return problem or True


def _noted(plan: Plan, unscanned: str | None, outputs: BlockOutputs | None = None) -> Plan:
    """``plan`` with why its blocks run unrolled among its notes (``unscanned``, if any)
    and, where the layout splits the batch into parts, what that does to the blocks'
    auxiliary outputs (:func:`aux_note`)."""
    notes = [f"decoder blocks kept unrolled (not scanned): {unscanned}"] if unscanned else []
    aux = aux_note(plan, outputs)
    if aux:
        logger.warning("to_distributed: %s", aux)
        notes.append(aux)
    return dataclasses.replace(plan, notes=(*plan.notes, *notes)) if notes else plan


def aux_note(plan: Plan, outputs: BlockOutputs | None) -> str | None:
    """What a layout that splits each batch (pipeline micro-batches, gradient accumulation)
    does to the blocks' auxiliary outputs (an MoE load-balancing loss), or None.

    Each part's forward computes its own value and the step averages them: the whole
    batch's value for a loss linear in the batch (a mean of per-token terms), not for one
    that multiplies batch statistics, such as the Switch / GShard load-balancing loss
    ``E * sum_e f_e * P_e``. A block's scalar output is all the trace has (its router
    statistics are gone), so the note names the paths that have the whole batch's value.
    """
    if outputs is None or not outputs.sums:
        return None
    parts = []
    if plan.mesh_shape[PP] > 1 and plan.num_microbatches > 1:
        parts.append(f"{plan.num_microbatches} pipeline micro-batches")
    if plan.layout.accumulate_steps > 1:
        parts.append(f"{plan.layout.accumulate_steps} accumulation steps")
    if not parts:
        return None
    return (
        f"the blocks' auxiliary output is the mean over {' x '.join(parts)} of each part's "
        "value: the whole batch's for a loss linear in the batch, not for one that "
        "multiplies batch statistics (the Switch / GShard load-balancing loss), and a "
        "scalar cannot be un-averaged; for that plan with num_microbatches=1 and no "
        "accumulation, or build the blocks on jfleet's MoELayer carrying LoadStats in a "
        "PipelineLayer with schedule_mode='FThenB', which sums the router statistics over "
        "the micro-batches (docs/moe.md, 'MoE in a pipeline')"
    )


def _scan_problem(
    model: nnx.Module, plan: Plan, first: Any, forward: Callable | None
) -> str | None:
    """Why the plan's blocks do not run as one scan ("" when there is nothing to scan: no
    blocks, or a pipeline), or None when they do.

    The checks are the pipeline's (:func:`_pipeline_problem`, from the planning trace, or
    traced now for a given plan); a reason not to scan is logged, and ``to_distributed``
    adds it to the plan's notes.
    """
    if not plan.blocks or plan.mesh_shape[PP] > 1:
        return ""
    problem = _BLOCK_PROBLEMS.pop(model, None)
    if problem is None:  # a given plan: the forward was not traced
        inputs, fwd = _model_call(first, forward)
        call = (lambda: fwd(model, inputs)) if fwd is not None else (lambda: model(inputs))
        problem = block_problems(model, list(plan.blocks), call)[1] or True
    if problem is True:  # the strategy's settings (QAT's scales) may have added state since
        problem = state_problem(model, list(plan.blocks)) or True
    if problem is True:
        try:
            container_of(model, plan.blocks)
        except ValueError as err:
            problem = str(err)
    if problem is True:
        return None
    logger.info("to_distributed: decoder blocks kept unrolled (not scanned): %s", problem)
    return problem


def _leading(text: str) -> int | None:
    """The leading dimension of an array described as ``int32[8,16]`` (None: a scalar)."""
    inside = text.partition("[")[2].partition("]")[0]
    head = inside.split(",")[0]
    return int(head) if head.strip().isdigit() else None


def _stacked_blocks(
    model: nnx.Module, plan: Plan, first: Any, config: ToDistributedConfig, scan: bool
) -> tuple[tuple[int | str, ...] | None, BlockOutputs | None]:
    """A pipelined stack's per-sample block arguments, and what the blocks of a pipelined
    or scanned (``scan``) stack return besides the activation (None: no stack, or the
    activation alone)."""
    per_sample = config.per_sample_args
    pipelined = bool(plan.blocks) and plan.mesh_shape[PP] > 1
    if not pipelined and not scan:
        return per_sample, None
    if pipelined and per_sample is None:
        per_sample = _per_sample_args(model, plan.blocks, first, config.forward)
    return per_sample, _block_outputs(model, plan.blocks, first, config.forward)


def _block_outputs(
    model: nnx.Module, blocks: tuple[str, ...], batch: Any, forward: Callable | None
) -> BlockOutputs | None:
    """How the forward run on ``batch`` uses a block's output beyond the activation it
    hands on (:func:`~jfleet.auto_parallel.match.block_calls.block_outputs`)."""
    inputs, fwd = _model_call(batch, forward)

    def call() -> Any:
        return fwd(model, inputs) if fwd is not None else model(inputs)

    return block_outputs(model, blocks, call)


def _per_sample_args(
    model: nnx.Module, blocks: tuple[str, ...], batch: Any, forward: Callable | None
) -> tuple[int | str, ...] | None:
    """The decoder blocks' extra arguments that hold one row per sample.

    The forward is traced abstractly on the batch and on the batch repeated twice: an
    array argument whose leading dimension doubles with the batch is per-sample (split
    into micro-batches), the others are shared. None (decide by shape) when an argument
    is a pytree or the traces disagree.
    """
    size = batch_shape(batch, local=False)[0]

    def twice(x: Any) -> Any:
        if hasattr(x, "shape") and np.ndim(x) >= 1 and np.shape(x)[0] == size:
            return np.concatenate([np.asarray(x)] * 2)
        return x

    records = []
    try:
        for b in (batch, jax.tree.map(twice, batch)):
            inputs, fwd = _model_call(b, forward)

            def call(inputs: Any = inputs, fwd: Callable | None = fwd) -> Any:
                return fwd(model, inputs) if fwd is not None else model(inputs)

            calls = record_block_calls(model, list(blocks), call)[0].calls
            if not calls:
                return None
            records.append(calls[0].arguments)
    except Exception as err:  # e.g. a batch of global arrays: leave it to the shapes
        logger.debug("per-sample block arguments not traced: %s", err)
        return None
    out: list[int | str] = []
    for a, b in zip(*records, strict=True):
        if a.kind == TREE or a.name != b.name:
            return None
        if a.kind == ARRAY and _leading(a.text) != _leading(b.text):
            out.append(int(a.name) if a.name.isdigit() else a.name)
    return tuple(out)


def _check_batch(plan: Plan, batch_size: int) -> None:
    degrees = plan.mesh_shape
    parts = [(DP, degrees[DP]), (SHARDING, degrees[SHARDING])]
    label = "data-parallel size"
    if degrees[PP] > 1 and plan.num_microbatches > 1:
        parts.append(("pipeline micro-batches", plan.num_microbatches))
        label += " x pipeline micro-batches"
    if plan.layout.accumulate_steps > 1:
        parts.append(("gradient-accumulation steps", plan.layout.accumulate_steps))
        label += " x gradient-accumulation steps"
    check_divides(
        f"the loader's batch size is {batch_size}",
        batch_size,
        parts,
        f"plan {plan.layout.name} needs a batch size that is a multiple of "
        f"{math.prod(n for _, n in parts)}",
        label=label,
    )


def _with_accumulation(base: DistributedStrategy, plan: Plan) -> DistributedStrategy:
    """A copy of ``base`` with gradient merge on for a plan that accumulates."""
    strategy = copy.deepcopy(base)
    _set_accumulation(strategy, plan)
    return strategy


def _users_strategy(user: DistributedStrategy | None) -> DistributedStrategy:
    """The user's strategy, copied: the one given, else ``fleet.init``'s, else the one an
    earlier ``to_distributed`` call planned from (not the one it adapted to its plan: its
    degrees and gradient merge were that plan's), else the defaults."""
    run = _context.current()
    if user is None and run is not None and run.planned_from is not None:
        user = run.planned_from
    elif user is None and run is not None:
        user = run.strategy
        if user.recompute:
            raise ValueError(
                "the strategy given to fleet.init has recompute=True: to_distributed "
                "recomputes whole decoder blocks; set ToDistributedConfig(recompute=True) and "
                "pass a strategy without recompute."
            )
        logger.info("to_distributed: using the strategy given to fleet.init")
    return copy.deepcopy(user) if user is not None else DistributedStrategy()


def _mesh_devices(n: int) -> list[jax.Device]:
    """``n`` devices for the mesh: all of them, or an equal share of every process's."""
    devices = jax.devices()
    if n == len(devices) or jax.process_count() == 1:
        return devices[:n]
    per, rest = divmod(n, jax.process_count())
    if rest:
        raise ValueError(
            f"{n} devices cannot be split evenly over {jax.process_count()} processes; use a "
            f"device count that is a multiple of {jax.process_count()}."
        )
    return [
        d
        for p in range(jax.process_count())
        for d in [x for x in devices if x.process_index == p][:per]
    ]


def _default_profile() -> str:
    kind = jax.devices()[0].device_kind.lower()
    if jax.devices()[0].platform == "cpu":
        return "cpu"
    for name in ("h200", "h100", "a100"):
        if name in kind:
            return name
    return "h100"


def _init_fleet(plan: Plan, strategy: DistributedStrategy, n: int) -> Placement:
    """Starts the run (``fleet.init``'s work) with the plan's degrees and the user's
    meta-optimizer settings."""
    degrees = {**dict.fromkeys(AXIS_NAMES, 1), **plan.mesh_shape}  # every axis: a user's
    # ep_degree must not outlive a plan without ep
    strategy.hybrid_configs = {f"{a}_degree": n for a, n in degrees.items()}
    strategy.sharding = plan.zero_stage > 0
    spans = plan.layout.zero_spans_data
    if plan.zero_stage:
        strategy.sharding_configs = {"stage": plan.zero_stage, "_dp_as_optimizer_sharding": spans}
    run = start_run(PaddleCloudRoleMaker(is_collective=True), strategy, _mesh_devices(n))
    return Placement(mesh=run.mesh, zero_stage=plan.zero_stage, zero_axis=plan.layout.zero_axes)

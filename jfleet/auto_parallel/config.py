"""``ToDistributedConfig``: what a ``to_distributed`` call may be told, checked.

Example:
  >>> config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4}, zero_stage=1)
  >>> check_config(config)
  >>> config.force_mesh
  {'dp': 2, 'mp': 4}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from jfleet.auto_parallel.cost.layout import SCHEDULES
from jfleet.auto_parallel.cost.profiles import HardwareProfile
from jfleet.auto_parallel.search.plan import Plan
from jfleet.parallel.virtual_stages import check_chunks_agree
from jfleet.training.strategy import DistributedStrategy


@dataclasses.dataclass(frozen=True)
class ToDistributedConfig:
    """What steers :func:`to_distributed` (every field optional).

    Frozen: ``to_distributed`` only reads it, so one config can steer several calls; make a
    changed copy with ``dataclasses.replace(config, zero_stage=1)``.

    Attributes:
      input_spec: one global batch's shapes: arrays or anything with ``.shape`` and
        ``.dtype`` (``jax.ShapeDtypeStruct``, Paddle's ``InputSpec``), e.g.
        ``[jax.ShapeDtypeStruct((64, 512), jnp.int32)]``; ``None`` / ``-1`` dimensions are
        read from the loader's first batch (the default for everything). Gives the cost
        model its batch size and sequence length.
      sequence_parallel: split activations' sequence dimension over ``mp`` between the
        blocks (Megatron sequence parallelism) and consider ``sep`` layouts. Inside the
        blocks the ``nnx.Linear`` / ``nnx.LinearGeneral`` / ``nnx.Einsum`` projections the
        plan splits gather the sequence before a column projection and reduce-scatter
        after a row one, as Megatron does
        (:mod:`~jfleet.auto_parallel.apply.sequence_dots`); a bare ``x @ w`` is left to
        the compiler, which may gather its weight instead.
      profile: hardware profile name (``cpu``, ``a100``, ``h100``, ``h200``) or a
        :class:`~jfleet.auto_parallel.cost.profiles.HardwareProfile`; default: ``cpu`` on CPU
        devices, else the profile named like the device kind, else ``h100``.
      memory_budget: bytes per device the plan must fit (default: the profile's memory).
      force_mesh: degrees to use, e.g. ``{"dp": 2, "pp": 2, "mp": 2}`` (missing axes 1).
      schedule: pipeline schedule of the stand-in for the blocks, ``"FThenB"`` (GPipe),
        ``"1F1B"`` (the loss stays in the model, so every forward precedes every backward;
        1F1B stashes only each micro-batch's stage input and recomputes the stage in its
        own backward loop: activation memory flat in the micro-batches) or ``"VPP"``
        (1F1B's program over interleaved stages: each device holds ``v`` chunks of blocks,
        the bubble shrinks to ``(P - 1) / (v M + P - 1)`` for ``v`` times the
        point-to-point transfers and stashed chunk inputs;
        :mod:`jfleet.parallel.pipeline_forward`); default: compared by the cost model.
      num_microbatches: pipeline micro-batches (default: compared by the cost model).
      num_virtual_pipeline_stages: chunks per stage for ``"VPP"`` (Paddle's
        ``PipelineLayer`` argument; 2 or more selects VPP, 1 rules it out); default: the
        cost model compares 2 with the one-chunk schedules.
      zero_stage: ZeRO stage 0-3 (default: compared).
      recompute: recompute block activations in the backward pass: True (or ``"full"``)
        whole blocks, ``"selective"`` (or Paddle's ``"core_attn"``) only each block's
        attention core and elementwise work, keeping its weight-matmul outputs
        (``jax.checkpoint`` with ``dots_with_no_batch_dims_saveable``; in a pipeline each
        stage stashes them per micro-batch, every schedule),
        False none (default: compared; selective under ``wide_search``).
      accumulate_steps: run each loader batch as this many calls of the training step with
        one optimizer update (gradient accumulation: the loader yields the batch in that
        many equal slices and the optimizer merges their gradients through the strategy's
        gradient merge, ``jfleet.optim.gradient_merge``). Default: 1, or compared by the
        cost model where no layout fits without it or under ``wide_search``.
      wide_search: the planner's wide search (``plan_for(wide_search=True)``): every
        pipeline micro-batch count and virtual-stage count, gradient accumulation and
        selective recompute, dominated layouts pruned (default False: the narrow search).
      plan: a :class:`Plan` (or its JSON) to apply instead of planning: reproduces a run.
      strategy: a :class:`~jfleet.strategy.DistributedStrategy` whose AMP (model dtypes
        and loss scaling), gradient merge, LAMB and LARS settings apply on top; its hybrid
        and sharding settings are replaced by the plan's (use ``recompute`` above, not the
        strategy's). Default: the strategy of an earlier ``fleet.init``, if any.
      per_sample_args: which extra arguments of the decoder blocks hold one row per sample
        (positions after the activation, or keyword names), for the pipelined stand-in to
        split them into micro-batches; default: decided by shape
        (:class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks`).
      forward: how the model is called on a batch, ``forward(model, batch) -> arrays``, for
        the trace the plan is read from (which projections pair up, the FLOPs) and for the
        pipeline checks. A loss function ``(model, batch) -> loss`` works too. Default:
        ``loss_fn`` when given, else ``model(x)`` with ``x`` the batch itself (an array),
        its first entry (a tuple or list) or its ``input_ids`` / ``tokens`` / ``inputs`` /
        ``input`` / ``x`` / ``image`` / ``images`` / ``pixel_values`` entry (a dict).
        Give it when the model needs more (positions, a mask, a cache)::

          ToDistributedConfig(
              forward=lambda model, batch: model(batch["tokens"], batch["positions"]))

      loss_fn: the training loss ``loss_fn(model, batch) -> scalar``, traced in place of
        ``forward`` when that is not given: whatever the loss feeds the model (a dict
        batch's ``image`` / ``label``, positions, a mask) the trace sees, e.g.
        ``ToDistributedConfig(loss_fn=my_loss)``.
      scan_layers: without a pipeline, run alike decoder blocks (or blocks repeating with
        a period) as one ``lax.scan``
        (:class:`~jfleet.auto_parallel.apply.scanned_blocks.ScannedBlocks`), so the compiled
        step stays the same size whatever the depth; False keeps them unrolled, one by one
        (``model.layers[3]`` reachable). Blocks that cannot be stacked (dropout RNG
        streams, batch statistics, blocks that differ) stay unrolled either way, and are
        planned unrolled.
      distributed_optimizer: ZeRO over every rank holding the same parameters,
        ``dp x sharding x sep`` (Megatron's distributed optimizer; with the strategy's
        AMP O2, ``amp_configs={"use_pure_bf16": True}``, half-precision parameters and
        fp32 master weights and moments split over all of them): True keeps to it, False
        to ZeRO over ``sharding`` alone; default: the cost model compares both
        (:attr:`~jfleet.auto_parallel.cost.layout.Layout.zero_spans_data`).
      global_batches: every process's loader yields the whole global batch and each
        process keeps its own rows (:func:`jfleet.data.local_rows`), so one script runs
        unchanged in one process and under ``python -m jfleet.launch``; default False:
        each process's loader yields its own rows (its share of every batch).

    Example:
      >>> import dataclasses
      >>> config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4})
      >>> dataclasses.replace(config, zero_stage=1).force_mesh
      {'dp': 2, 'mp': 4}
    """

    input_spec: Any = None
    sequence_parallel: bool = False
    profile: str | HardwareProfile | None = None
    memory_budget: float | None = None
    force_mesh: Mapping[str, int] | None = None
    schedule: str | None = None
    num_microbatches: int | None = None
    num_virtual_pipeline_stages: int | None = None
    zero_stage: int | None = None
    recompute: bool | str | None = None
    accumulate_steps: int | None = None
    wide_search: bool = False
    plan: Plan | str | None = None
    strategy: DistributedStrategy | None = None
    per_sample_args: tuple[int | str, ...] | None = None
    forward: Callable[[nnx.Module, Any], Any] | None = None
    scan_layers: bool = True
    loss_fn: Callable[[nnx.Module, Any], Any] | None = None
    global_batches: bool = False
    distributed_optimizer: bool | None = None


_PLANNING_FIELDS = (
    "input_spec",
    "sequence_parallel",
    "profile",
    "memory_budget",
    "force_mesh",
    "schedule",
    "num_microbatches",
    "num_virtual_pipeline_stages",
    "zero_stage",
    "recompute",
    "accumulate_steps",
    "wide_search",
    "distributed_optimizer",
)


def _check_pipeline_settings(config: ToDistributedConfig) -> None:
    """A schedule the cost model does not know, or a virtual stage count that is no count
    or disagrees with the schedule, is an error."""
    if config.schedule not in (None, *SCHEDULES):
        raise ValueError(
            f"config.schedule={config.schedule!r} is not a pipeline schedule; use one of "
            f"{list(SCHEDULES)} (or None to let the cost model compare them)."
        )
    v = config.num_virtual_pipeline_stages
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(
            f"config.num_virtual_pipeline_stages={v!r} must be an int >= 1 (chunks per pipeline "
            "stage; 2 or more interleave them under schedule 'VPP') or None."
        )
    if v is not None:
        names = ("config.schedule", "config.num_virtual_pipeline_stages")
        check_chunks_agree(config.schedule, v, names=names)


def check_config(config: ToDistributedConfig) -> None:
    """A given plan with settings that would steer a new one, or a strategy that
    recomputes, is an error naming the settings."""
    if not isinstance(config.global_batches, bool):
        raise TypeError(f"config.global_batches={config.global_batches!r} must be a bool.")
    if not isinstance(config.wide_search, bool):
        raise TypeError(f"config.wide_search={config.wide_search!r} must be a bool.")
    if not (config.distributed_optimizer is None or isinstance(config.distributed_optimizer, bool)):
        raise TypeError(
            f"config.distributed_optimizer={config.distributed_optimizer!r} must be True, "
            "False or None (compared by the cost model)."
        )
    _check_pipeline_settings(config)
    if config.plan is not None:
        defaults = ToDistributedConfig()
        steering = [f for f in _PLANNING_FIELDS if getattr(config, f) != getattr(defaults, f)]
        if steering:
            raise ValueError(
                f"config.plan is given together with {steering}: a given plan is applied as "
                "it is; drop those settings, or drop plan to plan anew with them."
            )
    if config.strategy is not None:
        if not isinstance(config.strategy, DistributedStrategy):
            raise TypeError(f"config.strategy={config.strategy!r} is not a DistributedStrategy.")
        if config.strategy.recompute:
            raise ValueError(
                "config.strategy.recompute=True: to_distributed recomputes whole decoder "
                "blocks; set ToDistributedConfig(recompute=True) instead."
            )
        merge = config.strategy.gradient_merge
        if merge and config.accumulate_steps not in (None, 1):
            raise ValueError(
                f"config.accumulate_steps={config.accumulate_steps} with a strategy whose "
                "gradient_merge is on: to_distributed runs accumulation through the "
                "strategy's gradient merge itself; drop one of the two (gradient_merge_configs"
                f"['k_steps'] = {config.strategy.gradient_merge_configs['k_steps']} merges "
                "whole loader batches)."
            )

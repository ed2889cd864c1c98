"""Planning: :func:`plan_for` matches a model, predicts every layout, and keeps the best.

It matches the model's parts (:mod:`jfleet.auto_parallel.match.patterns`), lists and predicts
every layout the shapes allow (:mod:`jfleet.auto_parallel.cost.cost_model`), drops what does not
fit the memory budget and returns the fastest as a :class:`~jfleet.auto_parallel.search.plan.Plan`.

Example:
  >>> from jfleet.models.llama import TinyLlama
  >>> plan = plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8)
  >>> plan.mesh_shape
  {'dp': 8, 'pp': 1, 'sharding': 1, 'sep': 1, 'mp': 1}
  >>> forced = plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8,
  ...                   force_mesh={"dp": 2, "mp": 4})
  >>> forced.spec("layers.0.self_attn.o_proj.kernel")
  P('mp', None)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.cost.cost_model import Candidate, estimate, rank
from jfleet.auto_parallel.cost.layout import (
    OPTIMIZER_MOMENTS,
    SCHEDULES,
    SELECTIVE,
    Layout,
    Workload,
)
from jfleet.auto_parallel.cost.profiles import HardwareProfile, get_profile
from jfleet.auto_parallel.match.attention_trace import attention_as_run
from jfleet.auto_parallel.match.experts import moe_layer_paths
from jfleet.auto_parallel.match.moe_spec import MoESpec
from jfleet.auto_parallel.match.patterns import ModelPatterns, match_patterns, path_str
from jfleet.auto_parallel.search.layouts import enumerate_layouts, shape_problem
from jfleet.auto_parallel.search.plan import ParamPlan, Plan, _mib, _secs
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import AXIS_NAMES, EP, MP, PP, SEP
from jfleet.parallel.virtual_stages import check_chunks_agree, even_sizes, slot_units
from jfleet.precision.amp import apply_amp
from jfleet.runtime.log import logger

__all__ = ["expert_choice", "plan_for", "recompute_setting"]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1.")
    return value


def _check_force_mesh(force_mesh: Mapping[str, int], device_num: int, node_num: int) -> dict:
    if not isinstance(force_mesh, Mapping):
        raise TypeError(
            f"force_mesh={force_mesh!r} must be a dict of degrees, e.g. {{'dp': 2, 'mp': 4}}."
        )
    unknown = sorted(set(force_mesh) - set(AXIS_NAMES))
    if unknown:
        raise ValueError(
            f"force_mesh={dict(force_mesh)} names unknown axes {unknown}; axes are {AXIS_NAMES}."
        )
    for a, n in force_mesh.items():
        _positive_int(f"force_mesh[{a!r}]", n)
    product = math.prod(force_mesh.values())
    total = device_num * node_num
    if product != total:
        shown = " x ".join(f"{a}{n}" for a, n in force_mesh.items()) or "{}"
        raise ValueError(
            f"force_mesh={dict(force_mesh)} multiplies out to {shown} = {product}, but "
            f"device_num x node_num = {device_num} x {node_num} = {total}; give degrees "
            f"whose product is {total}."
        )
    return {a: int(force_mesh.get(a, 1)) for a in AXIS_NAMES}


def _check_forced_ep(forced: dict | None, force_mesh: Any, patterns: ModelPatterns) -> None:
    """Refuses a forced ``ep`` > 1 for a model without routed experts (``patterns.moe``)."""
    if forced is None or forced[EP] == 1 or patterns.moe is not None:
        return
    raise ValueError(
        f"force_mesh={dict(force_mesh)} asks for {EP}={forced[EP]}, but the model has no "
        "routed experts the planner knows of (to_distributed does not plan expert parallelism "
        f"yet for experts in traced code); leave '{EP}' out (or 1), or train the "
        "expert-parallel layout with fleet (hybrid_configs ep_degree)."
    )


def _matched(
    model: nnx.Module, patterns: Any, forced: dict | None, force_mesh: Any
) -> ModelPatterns:
    """``match_patterns(model)`` (or the given ``patterns``, checked), with the routed
    experts the model carries (``model.routed_experts``, a
    :class:`~jfleet.auto_parallel.match.moe_spec.MoESpec`: a shape-built
    :class:`~jfleet.auto_parallel.search.model_shapes.MoELlama`) where they have none; a
    forced ``ep`` > 1 without experts refused."""
    patterns = match_patterns(model) if patterns is None else _check_patterns(patterns, model)
    spec = getattr(model, "routed_experts", None)
    if patterns.moe is None and isinstance(spec, MoESpec):
        patterns = dataclasses.replace(patterns, moe=spec)
    _check_forced_ep(forced, force_mesh, patterns)
    return patterns


def _ep_text(c: Candidate, device_num: int) -> str:
    """Where a candidate's ``ep`` group runs and what its all-to-alls cost."""
    lay = c.layout
    where = "within a node" if lay.ep * lay.mp <= device_num else "across nodes"
    if c.collectives.all_to_all == 0:  # a traced dispatch: tokens gathered over ep
        return f"tokens gathered over ep{lay.ep} {where} ({_secs(c.time.expert_parallel)})"
    moved = c.collectives.all_to_all * (lay.ep - 1) / lay.ep
    return (
        f"all-to-alls over ep{lay.ep} {where}, {_mib(moved)} a device a step sent "
        f"({_secs(c.time.expert_parallel)})"
    )


def expert_choice(ranked: list[Candidate], patterns: ModelPatterns, device_num: int) -> str:
    """Why the plan's ``ep`` was chosen, from the ranked candidates ('' without experts):
    what the chosen degree holds and moves, and the best layout of the other kind (``ep =
    1`` against ``ep > 1``) with why it lost."""
    moe = patterns.moe
    if moe is None or not ranked:
        return ""
    best = ranked[0]
    lay = best.layout
    ep = lay.ep
    count = _parameter_count(moe.expert_params(patterns.dims.width))
    split = (
        f"ZeRO-3 splits each 1/{lay.zero_degree} over the ZeRO axis (gathered a layer at a time)"
        if lay.zero_stage >= 3 and lay.zero_degree > 1
        else ""
    )
    if ep > 1:
        what = (
            f"1/{ep} of the hidden dimension of each of the {moe.experts} experts"
            if moe.dispatch == "list"
            else f"{moe.experts // ep} of the {moe.experts} experts"
        )
        held = (
            f"ep{ep} chosen: each device holds {what} "
            f"of each MoE layer (1/{ep} of their {count} parameters"
            + (f"; {split}" if split else "")
            + "); "
            + _ep_text(best, device_num)
        )
    else:
        held = (
            f"ep1 chosen: no all-to-all; the {moe.experts} experts of each MoE layer ({count} "
            "parameters over the model) are laid out like the other weights: "
            + (split or "whole on every device")
        )
    other = next((c for c in ranked if (c.layout.ep > 1) != (ep > 1)), None)
    if other is None:
        kind = "ep1" if ep > 1 else "ep > 1"
        return f"{held}; no {kind} layout is left to compare (none allowed, or all dominated)."
    lost = other.reason if other.fits else f"does not fit ({_mib(other.memory.total)})"
    extra = f"; {_ep_text(other, device_num)}" if other.layout.ep > 1 else ""
    return f"{held}; the best {other.layout.name}: {lost}{extra}."


def _parameter_count(n: float) -> str:
    """``n`` parameters, readably: ``'227.1B'``, ``'48.0M'``, ``'12.3K'``."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _own_dispatch(patterns: ModelPatterns, lay: Any) -> str:
    """The note of a traced model's routed experts: how its own dispatch code runs over
    ``ep`` (tokens gathered a MoE layer at a time), or why ``ep`` was not searched for a
    dispatch of routed rows ('' without traced experts)."""
    if not patterns.routed:
        return ""
    moe = patterns.moe
    if moe.dispatch == "ragged" and lay.ep == 1 and lay.pp == 1 and lay.sep == 1:
        return (
            "the model's own dispatch runs ragged_dots over its token copies sorted by "
            "expert, so each MoE layer runs in a shard_map over the data axes: each device "
            "routes and computes its own tokens (left to GSPMD, the sort would gather the "
            "whole batch's token copies onto every device)"
        )
    if moe.dispatch in ("einsum", "ragged", "gather", "list"):
        if lay.ep == 1:
            return ""
        local = moe.experts // lay.ep
        experts = f"{local} expert{'s' if local > 1 else ''}"
        if moe.dispatch == "list":
            return (
                f"the model's own dispatch applies each of its listed expert modules to "
                f"every token, so over ep{lay.ep} each MoE layer runs in a shard_map: its "
                "tokens all-gathered over the ep group, routed by the model's code, each "
                f"device computing 1/{lay.ep} of every expert's hidden dimension (its "
                "columns of the up projections, its rows of the down one: Megatron's split, "
                "over ep) and the output reduce-scattered back (their cotangents the "
                "reverse: MaxText's ring of experts); the experts never move"
            )
        if moe.dispatch == "gather":
            return (
                f"the model's own dispatch gathers each token's experts' weights, so over "
                f"ep{lay.ep} each MoE layer runs in a shard_map: its tokens all-gathered over "
                "the ep group, routed by the model's code, each product with gathered "
                "weights computed as a ragged_dot of the token copies sorted by expert, "
                f"restricted to the rows of the device's {experts}, and the output "
                "reduce-scattered back (their cotangents the reverse: MaxText's ring of "
                "experts); the experts never move"
            )
        if moe.dispatch == "ragged":
            return (
                f"the model's own dispatch runs ragged_dots over its token copies sorted by "
                f"expert, so over ep{lay.ep} each MoE layer runs in a shard_map: its tokens "
                "all-gathered over the ep group, routed by the model's code, each device's "
                f"ragged_dots restricted to the rows of its {experts}, and the output "
                "reduce-scattered back (their cotangents the reverse: MaxText's ring of "
                "experts); the experts never move"
            )
        return (
            f"the model's own dispatch applies whole expert stacks in einsums, so over "
            f"ep{lay.ep} each MoE layer's tokens are all-gathered over the ep group at its "
            "input and its output all-reduced there (their cotangents the reverse: MaxText's "
            f"ring of experts); each device runs its {experts} "
            "on the group's tokens and the experts never move"
        )
    if lay.ep == 1:
        return (
            "ep not searched: the model's own dispatch of routed rows (none that each device "
            "can run its experts' share of: see the matcher's note) would run over ep as "
            "GSPMD partitions "
            "it, which gathers expert stacks or all-reduces per-row intermediates over the ep "
            "group (measured), where the "
            "cost model prices jfleet's all-to-alls (jfleet.parallel.moe.moe); "
            "force_mesh={..., 'ep': n} places the experts over ep anyway (it trains like one "
            "device), or route through jfleet's MoELayer, or apply the expert stacks in "
            "einsums (every expert on every token, or a one-hot capacity dispatch), "
            "ragged_dots over token copies sorted by expert, per-token gathers of their "
            "weights or a list of expert modules: then ep is searched"
        )
    return (
        f"the experts are split over ep{lay.ep} on their leading dimension, and the model's "
        "own dispatch of routed rows runs as GSPMD "
        "partitions it (it may gather expert stacks or all-reduce per-row intermediates "
        "over the ep group), while the cost model prices jfleet's dispatch "
        "(jfleet.parallel.moe.moe: two all-to-alls a MoE layer forward, two backward), so "
        "the step time and the collective bytes above are a prediction for that dispatch, "
        "not this one"
    )


def _check_patterns(patterns: Any, model: nnx.Module) -> ModelPatterns:
    """``patterns`` when they are ``model``'s (the same parameter paths and shapes)."""
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model is a {type(model).__name__}, not an nnx.Module; pass a Flax NNX module."
        )
    if not isinstance(patterns, ModelPatterns):
        raise TypeError(
            f"patterns={patterns!r} ({type(patterns).__name__}) is not a ModelPatterns; pass "
            "match_patterns(model)'s result, or leave patterns out."
        )
    found = {p.path: tuple(p.shape) for p in (*patterns.params, *patterns.routed)}
    have = {
        path_str(path): tuple(var.shape)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    if found != have:
        differ = sorted(set(found.items()) ^ set(have.items()))[:4]
        raise ValueError(
            f"patterns were found in another model than this {type(model).__name__}: "
            f"parameters differ at {differ}; pass match_patterns(model) for this model, or "
            "leave patterns out."
        )
    return patterns


_UNIT_WORDS = {
    "k": "kv heads", "v": "kv heads", "kv": "kv heads", "o": "heads", "q": "heads",
    "head": "outputs", "embedding": "vocabulary rows", "attention_bias": "heads",
}  # fmt: skip


def _replicated_summary(patterns: ModelPatterns) -> list[str]:
    """``path (block 0's; * for every block): reason``, grouped by reason."""
    by_reason: dict[str, list[str]] = collections.defaultdict(list)
    blocks = patterns.blocks
    for path, reason in patterns.replicated_in_blocks:
        shown = path
        for b in blocks:
            if path.startswith(b + "."):
                parent = b.rsplit(".", 1)[0] if "." in b else ""
                shown = f"{parent}.*{path[len(b) :]}" if parent else f"*{path[len(b) :]}"
                break
        if shown not in by_reason[reason]:
            by_reason[reason].append(shown)
    return [f"{', '.join(paths)} ({reason})" for reason, paths in by_reason.items()]


#: AMP levels ``plan_for`` plans (Paddle's; O0 is fp32 training: no AMP).
AMP_LEVELS = ("O1", "O2")


def _as_amp_stores(
    model: nnx.Module, amp_level: str | None, dtype: str | None, *, given: bool
) -> tuple[nnx.Module, str | None]:
    """The model to plan on and the compute dtype under ``amp_level``: at O2 an abstract
    copy with AMP's half-precision parameters (unless ``given`` patterns were matched on
    one already)."""
    if amp_level is None or amp_level == "O1":
        return model, dtype
    if amp_level != "O2":
        raise ValueError(
            f"amp_level={amp_level!r} is not an AMP level; use one of {AMP_LEVELS} (or None "
            "to plan the parameters in the dtype the model holds them)."
        )
    dtype = dtype or "bfloat16"
    if jnp.dtype(dtype).itemsize >= 4:
        raise ValueError(
            f"amp_level='O2' with dtype={dtype!r}: O2 stores the parameters in a half "
            "precision; use dtype 'bfloat16' or 'float16'."
        )
    if given:
        return model, dtype
    return nnx.eval_shape(lambda m: apply_amp(m, dtype=dtype, level="O2"), model), dtype


def _optional_bool(name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: expected True, False or None (compared).")
    return value


def _model_dtype(patterns: ModelPatterns) -> str:
    counts = collections.Counter()
    for p in patterns.params:
        counts[p.dtype] += p.size
    return counts.most_common(1)[0][0]


def prune_dominated(candidates: list[Candidate]) -> list[Candidate]:
    """``candidates`` without those another one beats on both time and memory.

    A candidate is dropped when one at least as fast (within ``1e-9``: equal programs
    tie) needs no more memory and is strictly better in one of the two.

    >>> from jfleet.auto_parallel.cost.cost_model import Collectives, Memory, StepTime
    >>> from jfleet.auto_parallel.cost.layout import Layout
    >>> def cand(dp, seconds, nbytes):
    ...     mem = Memory(params=nbytes, optimizer=0, inputs=0, grads=0, gathered=0,
    ...                  activations=0)
    ...     return Candidate(layout=Layout(dp=dp), memory=mem,
    ...                      time=StepTime(compute=seconds), collectives=Collectives())
    >>> [c.layout.dp for c in prune_dominated([cand(1, 1.0, 9), cand(2, 2.0, 9),
    ...                                         cand(4, 3.0, 1)])]
    [1, 4]
    """
    # each total summed once (a wide search prunes hundreds of thousands); the index keeps
    # equal times and memories in their given order, as a stable sort on the two does
    by_time = sorted((c.time.total, c.memory.total, i) for i, c in enumerate(candidates))
    kept: list[int] = []
    least = math.inf  # least memory among the faster ones kept
    last_t = last_m = math.inf  # the last kept one's time and memory
    for t, m, i in by_time:
        if m >= least and kept and t > last_t * (1 + 1e-9):
            continue
        if m >= least and kept and t == last_t and m > last_m:
            continue
        kept.append(i)
        least, last_t, last_m = min(least, m), t, m
    return [candidates[i] for i in kept]


def _workload(
    patterns: ModelPatterns,
    batch_size: int,
    seq_len: int,
    dtype: str | None,
    optimizer: str,
    sequence_parallel: bool,
) -> Workload:
    return Workload(
        batch_size=_positive_int("batch_size", batch_size),
        seq_len=_positive_int("seq_len", seq_len),
        dtype=dtype or _model_dtype(patterns),
        optimizer=optimizer,
        sequence_parallel=sequence_parallel,
    )


def _check_search(
    schedule: str | None,
    num_microbatches: int | None,
    num_virtual_stages: int | None,
    zero_stage: int | None,
    optimizer: str,
) -> str | None:
    """Checks the search's restrictions; returns the schedule (``"VPP"`` for v > 1)."""
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}.")
    if num_microbatches is not None:
        _positive_int("num_microbatches", num_microbatches)
    if num_virtual_stages is not None:
        interleaved = _positive_int("num_virtual_stages", num_virtual_stages) > 1
        check_chunks_agree(schedule, num_virtual_stages, names=("schedule", "num_virtual_stages"))
        if interleaved:
            schedule = "VPP"
    if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r} must be 0, 1, 2 or 3 (or None).")
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(
            f"optimizer={optimizer!r} is not known to the cost model; use one of "
            f"{sorted(OPTIMIZER_MOMENTS)}."
        )
    return schedule


def _stages(patterns: ModelPatterns, lay: Any) -> tuple[tuple[tuple[int, ...], ...], dict]:
    """Each pipeline stage's blocks, and each block's stage: chunk ``i`` of the ``pp x v``
    holds ``even_sizes`` units (super-blocks of the block period), device ``s`` chunks ``s,
    s + pp, ...`` (uneven stages: the larger first, as the applied stack)."""
    if not patterns.blocks:
        return (), {}
    period = patterns.block_period or 1
    units = len(patterns.blocks) // period
    if lay.pp <= 1 or units < lay.pp:
        every = tuple(range(len(patterns.blocks)))
        return (every,), dict.fromkeys(every, 0)
    sizes = even_sizes(units, lay.pp * lay.num_virtual_stages)
    table = slot_units(sizes, lay.pp)
    stages = tuple(
        tuple(int(u) * period + j for u in row if u >= 0 for j in range(period)) for row in table
    )
    return stages, {b: s for s, blocks in enumerate(stages) for b in blocks}


def _checked_force(
    force_mesh: Mapping[str, int] | None, device_num: int, node_num: int, sequence_parallel: bool
) -> dict | None:
    """The forced degrees of every axis, or None."""
    if force_mesh is None:
        return None
    forced = _check_force_mesh(force_mesh, device_num, node_num)
    if forced[SEP] > 1 and not sequence_parallel:
        raise ValueError(
            f"force_mesh={dict(force_mesh)} has sep={forced[SEP]} but "
            "sequence_parallel=False; pass sequence_parallel=True."
        )
    return forced


#: Names of the recompute settings (Megatron's ``recompute_granularity`` and Paddle's).
_RECOMPUTE_NAMES = {"full": True, SELECTIVE: SELECTIVE, "core_attn": SELECTIVE}


def recompute_setting(value: Any) -> bool | str | None:
    """``recompute`` as the search takes it: None, True (whole blocks), False, or
    ``"selective"`` (also Paddle's ``"core_attn"``); ``"full"`` is True.

    >>> recompute_setting("core_attn"), recompute_setting("full"), recompute_setting(None)
    ('selective', True, None)
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in _RECOMPUTE_NAMES:
        return _RECOMPUTE_NAMES[value]
    raise ValueError(
        f"recompute={value!r} is not a recompute setting; use True / 'full' (whole blocks), "
        f"'selective' / 'core_attn' (the attention core and elementwise work), False, or None "
        "(compared by the cost model)."
    )


def _accumulate_steps(value: Any) -> int | None:
    """A forced gradient-accumulation count, checked (None: compared)."""
    return None if value is None else _positive_int("accumulate_steps", value)


def _profile_budget(
    profile: str | HardwareProfile | None, memory_budget: float | None
) -> tuple[HardwareProfile, float]:
    prof = get_profile(profile)
    budget = prof.usable_memory if memory_budget is None else memory_budget
    if not budget > 0:
        raise ValueError(f"memory_budget={memory_budget!r} must be a positive number of bytes.")
    return prof, budget


def _report_patterns(
    patterns: ModelPatterns, name: str, forced: dict | None, force_mesh: Any
) -> None:
    """Logs what was not recognised; refuses a forced mp / pp without recognised parts."""
    if not patterns.recognised:
        logger.warning(
            "%s: no transformer parts recognised (%s); planning data parallel only. "
            "Unmatched parameters (kept replicated): %s%s",
            name,
            patterns.summary(),
            ", ".join(patterns.unmatched) or "none",
            "".join(f"; {n}" for n in patterns.notes),
        )
        if forced is not None and (forced[MP] > 1 or forced[PP] > 1):
            raise ValueError(
                f"force_mesh={dict(force_mesh)} asks for tensor or pipeline parallelism, but "
                f"no transformer parts of {name} were recognised; use dp / sharding only."
            )
    elif patterns.replicated_in_blocks:
        logger.warning(
            "%s: decoder-block parameters kept whole on every mp rank: %s",
            name,
            "; ".join(_replicated_summary(patterns)),
        )
    if patterns.recognised and patterns.unmatched:
        logger.info("unmatched parameters, kept replicated: %s", ", ".join(patterns.unmatched))


def _attention_as_run(
    patterns: ModelPatterns, prof: HardwareProfile, workload: Workload, materialised: Any
) -> ModelPatterns:
    """The patterns as the profile's platform runs their attention, the reason noted."""
    if not isinstance(materialised, bool):
        raise TypeError(
            f"materialised_attention={materialised!r}: expected True (charge the s x s "
            "scores) or False (charge the attention as the profile's platform runs it)."
        )
    patterns, note = attention_as_run(
        patterns,
        prof.platform,
        workload.dtype,
        materialised=materialised,
        max_head_dim=prof.flash_max_head_dim,
    )
    return dataclasses.replace(patterns, notes=(*patterns.notes, note)) if note else patterns


def _why_not_piped(pipeline: bool | str, forced: dict | None, force_mesh: Any) -> str | None:
    """Why ``pp > 1`` may not be chosen (None when it may)."""
    if pipeline is True:
        return None
    why = pipeline if isinstance(pipeline, str) and pipeline else "the blocks cannot be pipelined"
    if forced is not None and forced[PP] > 1:
        raise ValueError(
            f"force_mesh={dict(force_mesh)} asks for pp={forced[PP]}, but this model's "
            f"blocks cannot be pipelined: {why} Use pp 1."
        )
    return why


def _candidate_layouts(
    patterns: ModelPatterns,
    workload: Workload,
    *,
    device_num: int,
    node_num: int,
    forced: dict | None,
    force_mesh: Any,
    why_not_piped: str | None,
    name: str,
    search: dict[str, Any],
) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Enumerates the layouts the shapes allow, filtered by what the model can run."""
    if forced is not None:
        problem = shape_problem(patterns, workload, forced, device_num)
        if problem is not None:
            raise ValueError(f"force_mesh={dict(force_mesh)} cannot be used: {problem}.")
    layouts, excluded = enumerate_layouts(
        patterns,
        workload,
        device_num=device_num,
        node_num=node_num,
        force_mesh=forced,
        **search,
    )
    if not patterns.recognised:
        layouts = [lay for lay in layouts if lay.pp == 1 and lay.mp == 1]
    if why_not_piped is not None:
        piped = dict.fromkeys(lay.mesh_name for lay in layouts if lay.pp > 1)
        excluded = [*excluded, *((m, why_not_piped) for m in piped)]
        layouts = [lay for lay in layouts if lay.pp == 1]
    if not layouts:
        raise ValueError(
            f"no layout of {device_num * node_num} devices suits {name} with "
            f"batch_size={workload.batch_size}, seq_len={workload.seq_len}: "
            + "; ".join(f"{m}: {r}" for m, r in excluded)
        )
    return layouts, excluded


def _choose(
    ranked: list[Candidate], budget: float, forced: dict | None, force_mesh: Any
) -> list[Candidate]:
    """The ranked candidates, the chosen first; a forced mesh over budget is kept, warned."""
    best = ranked[0]
    if best.fits:
        return ranked
    message = (
        f"no layout fits the memory budget of {_mib(budget)} per device; the smallest, "
        f"{best.layout.name}, needs {_mib(best.memory.total)}. Raise memory_budget, "
        "use a profile with more memory, or lower batch_size / seq_len."
    )
    if forced is None:
        raise ValueError(message)
    logger.warning("force_mesh=%s: %s Using it anyway.", dict(force_mesh), message)
    best = min(ranked, key=lambda c: c.time.total)
    return [dataclasses.replace(best, reason="best (forced, over budget)")] + [
        c for c in ranked if c is not best
    ]


@contextlib.contextmanager
def _cycles_uncollected() -> Iterator[None]:
    """Python's cyclic garbage collector paused (left as it was after): a wide search
    allocates millions of small objects (a layout, its step shape and its predictions, each
    freed by its reference count: they hold no cycles), whose allocations set off
    collections that scan every object the process holds; they were a quarter of planning
    the 1T model on 3072 GPUs, more with earlier plans alive."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _ranked_search(
    patterns: ModelPatterns,
    workload: Workload,
    prof: HardwareProfile,
    budget: float,
    scan: bool,
    where: dict[str, Any],
    search: dict[str, Any],
) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The candidates of ``search`` predicted and ranked (dominated ones pruned in the wide
    search), and the meshes excluded. When none fits a narrow search that was not told an
    accumulation count, the search is run again with gradient accumulation offered (the
    local batch in smaller calls)."""

    def ranked_in(search: dict[str, Any]) -> tuple[list[Candidate], list]:
        with _cycles_uncollected():
            layouts, excluded = _candidate_layouts(patterns, workload, **where, search=search)
            candidates = [
                estimate(
                    patterns,
                    workload,
                    lay,
                    prof,
                    devices_per_node=where["device_num"],
                    scan_layers=scan,
                )
                for lay in layouts
            ]
            candidates = prune_dominated(candidates) if search["wide"] else candidates
            return rank(candidates, budget), excluded

    ranked, excluded = ranked_in(search)
    if not ranked[0].fits and not search["wide"] and search["accumulate_steps"] is None:
        ranked, excluded = ranked_in({**search, "accumulation": True})
    return ranked, excluded


def plan_for(
    model: nnx.Module,
    *,
    device_num: int,
    node_num: int = 1,
    batch_size: int,
    seq_len: int,
    profile: str | HardwareProfile | None = None,
    memory_budget: float | None = None,
    force_mesh: Mapping[str, int] | None = None,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    zero_stage: int | None = None,
    sequence_parallel: bool = False,
    optimizer: str = "adam",
    recompute: bool | str | None = None,
    dtype: str | None = None,
    pipeline: bool | str = True,
    patterns: ModelPatterns | None = None,
    scan_layers: bool = True,
    num_virtual_stages: int | None = None,
    wide_search: bool = False,
    accumulate_steps: int | None = None,
    materialised_attention: bool = False,
    amp_level: str | None = None,
    distributed_optimizer: bool | None = None,
) -> Plan:
    """Chooses the fastest layout of ``model`` that fits, by the cost model.

    Args:
      model: an unannotated ``nnx.Module``.
      device_num: devices per node.
      node_num: nodes (tensor parallelism stays inside one).
      batch_size: global batch (sequences per step).
      seq_len: tokens per sequence.
      profile: a name or profile :func:`~jfleet.auto_parallel.cost.profiles.get_profile` takes.
      memory_budget: bytes per device; default the profile's memory.
      force_mesh: degrees that must be used (missing axes 1), e.g. ``{"dp": 2, "mp": 4}``.
      schedule: ``"FThenB"``, ``"1F1B"`` or ``"VPP"`` (interleaved); default: compared.
      num_microbatches: pipeline micro-batches; default: compared.
      zero_stage: ZeRO stage (0 forbids a sharding axis); default: compared.
      sequence_parallel: Megatron sequence parallelism over ``mp``, and ``sep`` candidates.
      optimizer: the state's kind (``adam``, ``momentum``, ``sgd``, ...).
      recompute: True (whole blocks), False, or ``"selective"`` (the attention core and
        elementwise work, pipelined too); default: compared (wide search: selective).
      dtype: compute dtype; default the model's parameter dtype.
      pipeline: whether ``pp > 1`` may be chosen: True, or False / the reason it may not.
      scan_layers: alike blocks run as one ``lax.scan`` when not pipelined (predicted so).
      patterns: ``match_patterns(model)``, when the caller has it; default: matched here.
      num_virtual_stages: chunks per stage of ``"VPP"`` layouts (2 or more); default 2.
      wide_search: every ``M``, ``v``, accumulation and selective recompute, dominated
        layouts pruned (``enumerate_layouts``'s ``wide``).
      accumulate_steps: gradient-accumulation calls per step; default: 1 in the narrow
        search unless nothing fits without (then compared), compared in the wide one.
      materialised_attention: charge the ``s x s`` scores the trace shows even where
        :func:`jfleet.models.attention.causal_attention` runs fused on the profile's
        platform; default False: as that platform runs it (the plan's notes say which).
      amp_level: ``"O2"`` plans the parameters as AMP O2 stores them, in ``dtype``
        (default ``"bfloat16"``; norms fp32) with fp32 masters beside the moments, on an
        abstract copy (:func:`jfleet.amp.apply_amp`); ``"O1"``/None: as ``model`` holds
        them. With ``patterns`` given, match them on the cast model yourself.
      distributed_optimizer: ZeRO over every data rank, ``dp x sharding x sep``
        (:attr:`~jfleet.auto_parallel.cost.layout.Layout.zero_spans_data`, Megatron's
        distributed optimizer); True: only that, False: never; default: both compared.

    Returns: The :class:`Plan`.

    Raises:
      TypeError: a non-module model, a non-dict ``force_mesh``, non-``ModelPatterns``.
      ValueError: a bad count, schedule, ZeRO stage or forced mesh; another model's
        ``patterns``; nothing fits.

    Example:
      >>> from jfleet.models.llama import TinyLlama
      >>> plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8).layout.name
      'dp8'
    """
    device_num = _positive_int("device_num", device_num)
    node_num = _positive_int("node_num", node_num)
    schedule = _check_search(schedule, num_microbatches, num_virtual_stages, zero_stage, optimizer)
    forced = _checked_force(force_mesh, device_num, node_num, sequence_parallel)
    prof, budget = _profile_budget(profile, memory_budget)
    model, dtype = _as_amp_stores(model, amp_level, dtype, given=patterns is not None)
    patterns = _matched(model, patterns, forced, force_mesh)
    workload = _workload(patterns, batch_size, seq_len, dtype, optimizer, sequence_parallel)
    _report_patterns(patterns, name := type(model).__name__, forced, force_mesh)
    patterns = _attention_as_run(patterns, prof, workload, materialised_attention)
    why_not_piped = _why_not_piped(pipeline, forced, force_mesh)
    search = _search_options(
        schedule, num_microbatches, zero_stage, recompute, num_virtual_stages, wide_search,
        accumulate_steps, distributed_optimizer,
    )  # fmt: skip
    where = dict(device_num=device_num, node_num=node_num, forced=forced, force_mesh=force_mesh)
    where.update(why_not_piped=why_not_piped, name=name)
    scan = scan_layers and why_not_piped is None  # a stack that cannot pipeline is not scanned
    ranked, excluded = _ranked_search(patterns, workload, prof, budget, scan, where, search)
    ranked = _choose(ranked, budget, forced, force_mesh)
    return _build_plan(
        patterns, workload, ranked, excluded, prof, budget, device_num, node_num, name
    )


def _search_options(
    schedule: str | None,
    num_microbatches: int | None,
    zero_stage: int | None,
    recompute: bool | str | None,
    num_virtual_stages: int | None,
    wide: bool,
    accumulate_steps: int | None,
    distributed_optimizer: bool | None,
) -> dict:
    """``enumerate_layouts``'s search settings from ``plan_for``'s checked arguments."""
    return dict(
        schedule=schedule,
        num_microbatches=num_microbatches,
        zero_stage=zero_stage,
        recompute=recompute_setting(recompute),
        num_virtual_stages=num_virtual_stages,
        wide=wide,
        accumulate_steps=_accumulate_steps(accumulate_steps),
        zero_spans_data=_optional_bool("distributed_optimizer", distributed_optimizer),
    )


def _build_plan(
    patterns: ModelPatterns,
    workload: Workload,
    ranked: list[Candidate],
    excluded: list[tuple[str, str]],
    profile: HardwareProfile,
    budget: float,
    device_num: int,
    node_num: int,
    model_name: str,
) -> Plan:
    """The plan of the chosen (first) candidate: each parameter's specs, the stages."""
    best = ranked[0]
    lay = best.layout
    abstract = AbstractMesh(tuple(lay.degrees.values()), AXIS_NAMES)
    zero = Placement(mesh=abstract, zero_stage=lay.zero_stage, zero_axis=lay.zero_axes)
    stages, stage_of = _stages(patterns, lay)
    moe_layers = _gathered_moe_layers(patterns, lay)
    params = []
    why = dict(patterns.replicated_in_blocks)
    routed = {p.path for p in patterns.routed}
    for p in (*patterns.params, *patterns.routed):
        spec = p.spec_for(lay.mp)
        if p.path in routed and p.role != "router" and lay.ep > 1:
            spec = _over_ep(spec, p, patterns.moe.dispatch, patterns.dims.width)
        reason = why.get(p.path, "")
        if lay.mp > 1 and p.split_dim is not None and spec == P():
            reason = f"mp={lay.mp} does not divide its {p.units} {_UNIT_WORDS.get(p.role, 'units')}"
        zspec = zero.zero_spec(spec, p.shape) if lay.zero_stage else spec
        stage = stage_of.get(p.block) if p.block is not None else None
        params.append(
            ParamPlan(
                path=p.path,
                shape=p.shape,
                dtype=p.dtype,
                role=p.role,
                spec=spec,
                zero_spec=zspec,
                stage=stage,
                replicated_why=reason,
            )
        )
    logger.info(
        "plan: %s (predicted %s per device, %s per step)",
        lay.name,
        _mib(best.memory.total),
        _secs(best.time.total),
    )
    return Plan(
        # a plan leaves ep's degree 1 out, as plans before the axis did
        mesh=tuple((a, n) for a, n in lay.degrees.items() if a != EP or n > 1),
        zero_stage=lay.zero_stage,
        schedule=lay.schedule,
        num_microbatches=lay.num_microbatches,
        recompute=lay.recompute,
        sequence_parallel=workload.sequence_parallel,
        params=tuple(params),
        blocks=patterns.blocks,
        stages=stages,
        chosen=best,
        candidates=tuple(ranked),
        excluded=tuple(excluded),
        architecture=f"{model_name}: {patterns.summary()}",
        unmatched=patterns.unmatched,
        notes=(
            *patterns.notes,
            *filter(
                None, [expert_choice(ranked, patterns, device_num), _own_dispatch(patterns, lay)]
            ),
        ),
        batch_size=workload.batch_size,
        seq_len=workload.seq_len,
        dtype=workload.dtype,
        optimizer=workload.optimizer,
        device_num=device_num,
        node_num=node_num,
        profile=profile,
        memory_budget=int(budget),
        workload=""
        if patterns.input_kind == "tokens"
        else patterns.workload(workload.batch_size, workload.seq_len),
        moe_layers=moe_layers,
        moe_dispatch=patterns.moe.dispatch if moe_layers else "",
    )


def _over_ep(spec: P, p: Any, dispatch: str, width: int) -> P:
    """An expert parameter's spec with ``ep``: a stack's expert dimension (its first), or a
    listed expert's hidden dimension (its mp split dimension, or the side of a ``[D, F]`` /
    ``[F, D]`` kernel that is not the width; ``ep`` outside ``mp`` there)."""
    entries = list((tuple(spec) + (None,) * len(p.shape))[: len(p.shape)])
    if dispatch != "list":
        entries[0] = EP
        return P(*entries)
    dim = p.split_dim if p.split_dim is not None else int(p.shape[0] == width)
    there = entries[dim]
    entries[dim] = EP if there is None else (EP, *_axes(there))
    return P(*entries)


def _axes(entry: Any) -> tuple:
    return entry if isinstance(entry, tuple) else (entry,)


def _gathered_moe_layers(patterns: ModelPatterns, lay: Any) -> tuple[str, ...]:
    """The traced MoE layers whose tokens the plan gathers over ``ep``: an einsum or a
    per-token gather dispatch over ``ep`` > 1, a ``ragged_dot`` one at any ``ep`` without
    pipelines or a sequence
    split (at ``ep = 1`` each device then routes its own tokens: left to GSPMD, the sort of
    the token copies gathers the batch's onto every device; measured). Any other dispatch
    of routed rows is left to GSPMD (gathering its tokens all-reduces its per-row
    intermediates, more than it saves; measured)."""
    if not patterns.routed:
        return ()
    dispatch = patterns.moe.dispatch
    ring = dispatch in ("einsum", "gather", "list") and lay.ep > 1
    ring |= dispatch == "ragged" and lay.pp == 1 and lay.sep == 1
    if not ring:
        return ()
    return tuple(moe_layer_paths(p.path for p in patterns.routed if p.role == "router"))

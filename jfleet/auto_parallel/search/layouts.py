"""The layouts to compare: every way to lay a model out on the devices, and why not others.

:func:`enumerate_layouts` lists every factorisation of ``device_num x node_num`` into the
mesh degrees ``dp x pp x sharding x sep x mp`` (``sep > 1`` only under sequence
parallelism) that the model's shapes allow, each as the :class:`Layout` s worth comparing
(ZeRO stage, pipeline schedule, micro-batch count, accumulation, recompute), and gives the
reason for each mesh it leaves out (:func:`shape_problem`). A layout and a workload are
the cost model's inputs (:mod:`jfleet.auto_parallel.cost.layout`, their home; this module
re-exports them under the module path of earlier releases); what each layout costs is
:mod:`jfleet.auto_parallel.cost.cost_model`'s business.

**Shape rules.** ``mp`` divides every unit count a tensor-parallel split must not cut
(query heads, MLP hidden, vocabulary) and is at most the devices of one node (tensor
parallelism stays on the fast links; the mesh order ``dp, pp, sharding, sep, mp`` puts
``mp`` neighbours next to each other). Grouped-query attention whose kv heads ``mp`` does
not divide keeps k and v whole on every ``mp`` rank (each rank then holds every kv head
its q heads need) and splits q and o. ``mp > 1`` is excluded when it would leave most of
the decoder blocks' kernel elements whole (attention or MLP that could not be paired).
``pp`` is at most the decoder blocks (super-blocks when they repeat with a period): when it
does not divide them the stages hold ``ceil`` or ``floor`` of ``L / pp`` each, the larger
first (the cost model charges the largest stage). ``dp x sharding x ep`` divides the batch
(``ep`` > 1 only for a model with routed experts, ``patterns.moe``, and dividing its experts);
``sep`` divides the sequence. A model with no recognised parts gets ``mp = pp = 1``; one
with no repeated blocks gets ``pp = 1``.

Example:
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))
  >>> layouts, excluded = enumerate_layouts(found, Workload(batch_size=8, seq_len=8),
  ...                                       device_num=4)
  >>> sorted({lay.mesh_name for lay in layouts if lay.pp == 1 and lay.sharding == 1})
  ['dp2 x mp2', 'dp4', 'mp4']
  >>> excluded
  [('pp4', 'pp=4 is more than the 2 blocks (every pipeline stage needs one); use pp <= 2')]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping

from jfleet.auto_parallel.cost.layout import (
    OPTIMIZER_MOMENTS,
    SCHEDULES,
    SELECTIVE,
    Layout,
    Workload,
    mesh_name,
)
from jfleet.auto_parallel.cost.memo import cached
from jfleet.auto_parallel.match.patterns import ModelPatterns
from jfleet.mesh.topology import AXIS_NAMES, DP, EP, MP, PP, SEP, SHARDING

__all__ = [
    "OPTIMIZER_MOMENTS",
    "SCHEDULES",
    "SELECTIVE",
    "Layout",
    "Workload",
    "enumerate_layouts",
    "mesh_name",
    "shape_problem",
    "stacks_reason",
]

#: Chunks per stage the planner tries for VPP when not told.
VIRTUAL_OPTIONS = (2,)

#: The most gradient-accumulation steps a wide search tries with a pipeline (its
#: micro-batch count M already sets the micro-batch size; accumulation only shrinks the
#: stand-in's stash of M stage inputs).
PIPELINE_ACCUMULATIONS = 4


# ------------------------------------------------------------------ shape rules
def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _factorisations(n: int, k: int) -> Iterable[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for d in _divisors(n):
        for rest in _factorisations(n // d, k - 1):
            yield (d, *rest)


def shape_problem(
    patterns: ModelPatterns, workload: Workload, degrees: Mapping[str, int], devices_per_node: int
) -> str | None:
    """Why ``degrees`` cannot run this model and workload, or None when they can.

    Args:
      patterns: what :func:`~jfleet.auto_parallel.match.patterns.match_patterns` found.
      workload: batch, sequence and sequence parallelism.
      degrees: ``{axis: degree}`` (missing axes are 1).
      devices_per_node: devices of one node (the most ``mp`` may span).

    Returns:
      The reason, worded for a report (``"mp=8 does not divide the 4 heads of
      layers.0.self_attn.q_proj.kernel [32x32] ..."``: each parameter ``mp`` would cut, its
      shape and split dimension, and the degrees that fit), or None.

    Example:
      >>> from jfleet.auto_parallel.match.patterns import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))
      >>> why = shape_problem(found, Workload(batch_size=8, seq_len=8), {"mp": 8}, 8)
      >>> for part in why.split("; "): print(part)
      mp=8 does not divide the 4 heads of layers.0.self_attn.q_proj.kernel [32x32] (role q, ...
      use mp in (1, 2, 4), or sizes that 8 divides
    """
    mp, pp, sep = degrees.get(MP, 1), degrees.get(PP, 1), degrees.get(SEP, 1)
    ep = degrees.get(EP, 1)
    data = degrees.get(DP, 1) * degrees.get(SHARDING, 1) * ep
    if ep > 1:
        problem = _expert_problem(patterns, ep, pp, sep)
        if problem is not None:
            return problem
    if mp > 1:
        # the same few mp degrees recur in every mesh: each one's answer once a model
        problem = cached(
            patterns,
            ("mp_problem", mp, devices_per_node),
            lambda: _mp_problem(patterns, mp, devices_per_node),
        )
        if problem is not None:
            return problem
    if pp > 1:
        blocks, period = len(patterns.blocks), patterns.block_period
        if blocks < 2:
            return "no run of >= 2 identical blocks to pipeline"
        if len(patterns.stacks) > 1:
            return stacks_reason(patterns)
        if period is None:
            return (
                "the blocks are not alike (static settings included) and do not repeat, so "
                "no one definition can run them stacked"
            )
        if blocks // period < pp:
            units = blocks // period
            if period == 1:
                return (
                    f"pp={pp} is more than the {blocks} blocks (every pipeline stage needs "
                    f"one); use pp <= {blocks}"
                )
            return (
                f"pp={pp} is more than the {units} super-blocks of {period} (the blocks "
                f"repeat every {period}; every pipeline stage needs one); use pp <= {units}"
            )
    if sep > 1:
        if not workload.sequence_parallel:
            return "sep > 1 needs sequence_parallel=True"
        if workload.seq_len % sep:
            return f"sep={sep} does not divide seq_len={workload.seq_len}"
    if workload.batch_size % data:
        over = "dp x sharding x ep" if ep > 1 else "dp x sharding"
        return f"{over} = {data} does not divide batch_size={workload.batch_size}"
    return None


def _expert_problem(patterns: ModelPatterns, ep: int, pp: int = 1, sep: int = 1) -> str | None:
    """Why ``ep`` cannot split this model's routed experts, or None."""
    if patterns.moe is None:
        return f"ep={ep} needs routed experts; the model has none the planner knows of"
    if patterns.moe.experts % ep:
        return f"ep={ep} does not divide the {patterns.moe.experts} experts of a MoE layer"
    if patterns.routed and (pp > 1 or sep > 1):
        # the tokens are gathered over ep at each MoE layer's boundary (apply/expert_tokens),
        # a constraint over the data axes a pipeline stage holds manual, and the sequence
        # dimension it leaves whole
        return (
            f"ep={ep} with {'pp' if pp > 1 else 'sep'} > 1: a traced model's own expert "
            "dispatch runs over ep with each MoE layer's tokens gathered over the ep group, "
            "which jfleet does inside neither a pipeline stage nor a sequence split; use "
            "jfleet's MoELayer (it pipelines over ep) or ep with dp / sharding / mp only"
        )
    return None


def _mp_problem(patterns: ModelPatterns, mp: int, devices_per_node: int) -> str | None:
    """Why ``mp > 1`` cannot split this model (:func:`shape_problem`'s ``mp`` part), or None."""
    if not patterns.recognised:
        return "no tensor-parallel parts were recognised"
    if mp > devices_per_node:
        return f"mp={mp} exceeds the {devices_per_node} devices of a node"
    bad = patterns.indivisible(mp)
    if bad:
        return _indivisible_reason(patterns, bad, mp, devices_per_node)
    kernels = [p for p in patterns.params if p.block is not None and len(p.shape) >= 2]
    largest = max((p.size for p in kernels), default=0)
    # k / v whole where mp cuts their kv heads is the grouped-query layout; any other
    # large block kernel left whole would be computed on every mp rank
    whole = [
        p
        for p in patterns.replicated_at(mp)
        if p.role not in ("k", "v", "kv") and 8 * p.size >= largest
    ]
    if whole:
        why = dict(patterns.replicated_in_blocks)
        shown = "; ".join(
            f"{p.path} [{'x'.join(map(str, p.shape))}]"
            + (f": {why[p.path]}" if p.path in why else "")
            for p in whole
            if p.block == 0
        )
        return (
            f"mp={mp} would leave large decoder-block kernels whole on every mp rank "
            f"({shown}; ... in every block)"
        )
    return None


_UNIT_WORDS = {
    "q": "heads", "qk": "heads", "qkv": "heads", "o": "heads",
    "gate": "hidden features", "up": "hidden features", "gate_up": "hidden features",
    "down": "hidden features",
}  # fmt: skip


def _indivisible_reason(patterns: ModelPatterns, bad: tuple, mp: int, devices_per_node: int) -> str:
    """``mp`` cuts a unit of these parameters: name each unit count's first parameter (path,
    shape, split dimension) and the ``mp`` degrees that would divide them all."""
    shown, seen = [], set()
    for p in sorted(bad, key=lambda p: p.role in ("o", "down")):  # columns first: q, up
        count = p.units or p.shape[p.split_dim]
        if count not in seen:
            seen.add(count)
            words = _UNIT_WORDS.get(p.role or "", "units")
            shown.append(
                f"the {count} {words} of {p.path} [{'x'.join(map(str, p.shape))}] "
                f"(role {p.role}, split on dim {p.split_dim})"
            )
    more = len(bad) - len(shown)
    common = math.gcd(*patterns.split_dims())
    fits = [d for d in _divisors(common) if d <= devices_per_node]
    return (
        f"mp={mp} does not divide "
        + "; ".join(shown)
        + (f" (and {more} more parameter(s) alike)" if more else "")
        + f"; use mp in {tuple(fits)}, or sizes that {mp} divides"
    )


def stacks_reason(patterns: ModelPatterns) -> str:
    """Why ``pp > 1`` cannot run a model with several block stacks (an encoder-decoder).

    Example:
      >>> from jfleet.auto_parallel.match.matched import ModelDims
      >>> two = ((("enc.0", "enc.1"), "EncBlock"), (("dec.0", "dec.1"), "DecBlock"))
      >>> why = stacks_reason(ModelPatterns(params=(), dims=ModelDims(), stacks=two))
      >>> for part in why.split("; "): print(part)
      the model has 2 block stacks (enc: 2 x EncBlock, dec: 2 x DecBlock)
      a pipeline runs one stack of alike blocks, so a model with several runs with pp=1
    """
    shown = ", ".join(
        f"{paths[0].rsplit('.', 1)[0]}: {len(paths)} x {cls}" for paths, cls in patterns.stacks
    )
    return (
        f"the model has {len(patterns.stacks)} block stacks ({shown}); a pipeline runs one "
        "stack of alike blocks, so a model with several runs with pp=1"
    )


def _zero_problem(zero_stage: int | None, sharding: int) -> str | None:
    """Why a forced ZeRO stage cannot go with this sharding degree, or None."""
    if zero_stage == 0 and sharding > 1:
        return f"zero_stage=0 but sharding={sharding}"
    if zero_stage and sharding == 1:
        return f"zero_stage={zero_stage} needs sharding > 1"
    return None


def _microbatch_options(local: int, pp: int, forced: int | None, wide: bool) -> list[int]:
    if forced is not None:
        return [forced] if local % forced == 0 else []
    divisors = _divisors(local)
    if wide:  # every micro-batch size: M from pp up to the local batch
        return [m for m in divisors if m >= pp] or [divisors[-1]]
    out = []
    for target in (pp, 2 * pp, 4 * pp):
        fit = [m for m in divisors if m >= target]
        if fit:
            out.append(fit[0])
    if not out:
        out.append(divisors[-1])
    return sorted(set(out))


def _accumulations(
    rows: int, *, piped: bool, wide: bool, forced: int | None = None, offered: bool = False
) -> list[int]:
    """Gradient-accumulation steps to try over ``rows`` local sequences (per call of a
    pipeline: per micro-batch): ``forced`` alone where it divides them; none unless
    ``wide`` or ``offered``; every divisor without a pipeline; with one (whose
    micro-batches already bound the working set) those up to
    :data:`PIPELINE_ACCUMULATIONS`.

    >>> _accumulations(8, piped=False, wide=False), _accumulations(8, piped=False, wide=True)
    ([1], [1, 2, 4, 8])
    >>> _accumulations(8, piped=True, wide=False, forced=4), _accumulations(6, piped=False,
    ...                                                                     wide=False, forced=4)
    ([4], [])
    """
    if forced is not None:
        return [forced] if rows % forced == 0 else []
    if not (wide or offered):
        return [1]
    divisors = _divisors(rows)
    return [a for a in divisors if a <= PIPELINE_ACCUMULATIONS] if piped else divisors


def _virtual_options(
    patterns: ModelPatterns,
    schedule: str | None,
    pp: int,
    m: int,
    forced: int | None,
    wide: bool = False,
) -> list[int]:
    """Chunks per stage to try: 1 for one-chunk schedules; for VPP those of
    :data:`VIRTUAL_OPTIONS` (or ``forced``) that interleave this pipeline: ``M`` a multiple
    of ``pp``, every chunk holding a block (super-block; uneven chunks are padded to the
    largest); a ``forced`` ``v`` needs only a block per stage."""
    if schedule != "VPP":
        return [1]
    units = len(patterns.blocks) // (patterns.block_period or 1)
    options = [forced] if forced else list(VIRTUAL_OPTIONS)
    if wide and not forced:
        options = list(range(2, max(units // pp, 1) + 1))
    least = pp if forced else None
    return [v for v in options if v > 1 and m % pp == 0 and units >= (least or pp * v)]


def _no_interleaving(patterns: ModelPatterns, pp: int, ms: list[int], v: int | None) -> str:
    units = len(patterns.blocks) // (patterns.block_period or 1)
    chunks = v or VIRTUAL_OPTIONS[0]
    return (
        f"VPP needs num_microbatches a multiple of pp={pp} (options {ms}) and a block in "
        f"each of the pp x {chunks} virtual stages ({units} blocks)"
    )


def _meshes(
    total: int,
    sequence_parallel: bool,
    force_mesh: Mapping[str, int] | None,
    experts: int = 0,
) -> list[tuple[int, ...]]:
    """Every mesh to consider, as degree tuples in mesh order (``ep`` only with
    ``experts``: among the divisors of the experts a MoE layer holds)."""
    if force_mesh is not None:
        return [tuple(force_mesh.get(a, 1) for a in AXIS_NAMES)]
    axes = (DP, PP, SHARDING, SEP, MP) if sequence_parallel else (DP, PP, SHARDING, MP)
    if experts:
        axes = (*axes[:-1], EP, MP)
    meshes = []
    for combo in _factorisations(total, len(axes)):
        deg = dict(zip(axes, combo, strict=True))
        if experts and experts % deg[EP]:
            continue
        meshes.append(tuple(deg.get(a, 1) for a in AXIS_NAMES))
    return meshes


def enumerate_layouts(
    patterns: ModelPatterns,
    workload: Workload,
    *,
    device_num: int,
    node_num: int = 1,
    force_mesh: Mapping[str, int] | None = None,
    schedule: str | None = None,
    num_microbatches: int | None = None,
    zero_stage: int | None = None,
    recompute: bool | str | None = None,
    num_virtual_stages: int | None = None,
    wide: bool = False,
    accumulate_steps: int | None = None,
    accumulation: bool = False,
    zero_spans_data: bool | None = None,
) -> tuple[list[Layout], list[tuple[str, str]]]:
    """Every layout worth predicting, and the meshes excluded (with the reason).

    Args:
      patterns: what :func:`~jfleet.auto_parallel.match.patterns.match_patterns` found.
      workload: batch, sequence, dtype, optimizer.
      device_num: devices per node.
      node_num: nodes.
      force_mesh: only this mesh (degrees; missing axes are 1).
      schedule: only this pipeline schedule.
      num_microbatches: only this micro-batch count (pipelined layouts).
      zero_stage: only this ZeRO stage (0: no sharding axis).
      recompute: only with (True) or without (False) recompute of whole blocks, or only
        ``"selective"`` recompute (:attr:`Layout.selective_recompute`, with or without a
        pipeline). Default: without and with; the wide search adds selective recompute.
      num_virtual_stages: chunks per stage for ``"VPP"`` (default: :data:`VIRTUAL_OPTIONS`);
        VPP layouts are offered where ``M`` is a multiple of ``pp`` and every chunk holds
        a block (super-block).
      wide: the search practitioners use: every micro-batch count ``M`` from ``pp`` up to
        the local batch, every ``v`` up to a stage's blocks, and gradient accumulation
        over every divisor of the local batch / ``M`` (else ``M`` near ``pp``, ``2 pp``,
        ``4 pp``, ``v`` of :data:`VIRTUAL_OPTIONS`, no accumulation, no selective
        recompute).
      accumulate_steps: only this gradient-accumulation count (a mesh whose local batch
        / ``M`` it does not divide is excluded); accumulation: offer accumulation as the
        wide search does in an otherwise narrow search (the planner's retry: none fits).
      zero_spans_data: ZeRO only over every data rank (True: Megatron's distributed
        optimizer, :attr:`Layout.zero_spans_data`; meshes without a sharding axis are then
        excluded; kept to wherever ``dp`` or ``sep`` is beside a sharding axis) or only
        over ``sharding`` (False); default: both where ``sep`` is beside a sharding axis
        (over ``dp`` alone it equals the mesh whose sharding axis is ``dp x sharding``,
        enumerated as such).

    Returns:
      ``(layouts, excluded)``; ``excluded`` holds ``(mesh name, reason)`` pairs.

    Example:
      >>> from jfleet.auto_parallel.match.patterns import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
      >>> layouts, excluded = enumerate_layouts(found, Workload(batch_size=4, seq_len=8),
      ...                                       device_num=8, force_mesh={"dp": 8})
      >>> layouts, excluded
      ([], [('dp8', 'dp x sharding = 8 does not divide batch_size=4')])
    """
    only = _Only(
        schedule=schedule, num_microbatches=num_microbatches, zero_stage=zero_stage,
        recompute=recompute, num_virtual_stages=num_virtual_stages, wide=wide,
        accumulate_steps=accumulate_steps, accumulation=accumulation,
        zero_spans_data=zero_spans_data,
    )  # fmt: skip
    layouts: list[Layout] = []
    excluded: list[tuple[str, str]] = []
    # ep is searched for experts whose dispatch the cost model prices: jfleet's (shape-built
    # plans), a traced einsum, ragged_dot or per-token gather dispatch (run with each
    # layer's tokens gathered over ep); any other traced dispatch of routed rows runs as
    # GSPMD partitions it, all-reducing its per-row intermediates (issue 39), so ep is only
    # forced there
    moe = patterns.moe
    searched = moe is not None and (
        not patterns.routed or moe.dispatch in ("einsum", "list", "ragged", "gather")
    )
    experts = moe.experts if searched else 0
    for sizes in _meshes(device_num * node_num, workload.sequence_parallel, force_mesh, experts):
        deg = dict(zip(AXIS_NAMES, sizes, strict=True))
        found, problem = _mesh_layouts(patterns, workload, deg, device_num, only)
        layouts.extend(found)
        if problem is not None:
            excluded.append((mesh_name(deg), problem))
    return layouts, excluded


@dataclasses.dataclass(frozen=True)
class _Only:
    """What :func:`enumerate_layouts` is told to keep to (None: every option it tries)."""

    schedule: str | None
    num_microbatches: int | None
    zero_stage: int | None
    recompute: bool | str | None
    num_virtual_stages: int | None
    wide: bool
    accumulate_steps: int | None
    accumulation: bool
    zero_spans_data: bool | None = None


def _mesh_layouts(
    patterns: ModelPatterns,
    workload: Workload,
    deg: dict[str, int],
    devices_per_node: int,
    only: _Only,
) -> tuple[list[Layout], str | None]:
    """One mesh's layouts: each ZeRO stage, schedule, micro-batch count, recompute,
    virtual-stage and accumulation count worth comparing; or, with none, why."""
    problem = shape_problem(patterns, workload, deg, devices_per_node)
    if problem is None and only.zero_stage is not None:
        problem = _zero_problem(only.zero_stage, deg[SHARDING])
    if problem is None and only.zero_spans_data and deg[SHARDING] == 1:
        problem = "the distributed optimizer (ZeRO over every data rank) needs sharding > 1"
    if problem is not None:
        return [], problem
    local = workload.batch_size // (deg[DP] * deg[SHARDING] * deg[EP])
    piped = deg[PP] > 1
    ms = _microbatch_options(local, deg[PP], only.num_microbatches, only.wide) if piped else [1]
    if not ms:
        return [], (
            f"num_microbatches={only.num_microbatches} does not divide the {local} sequences "
            "per data-parallel replica"
        )
    zero = [only.zero_stage] if only.zero_stage else [1, 2, 3]
    stages = zero if deg[SHARDING] > 1 else [0]
    scheds = ([only.schedule] if only.schedule else list(SCHEDULES)) if piped else [None]
    accumulate = dict(forced=only.accumulate_steps, offered=only.accumulation, wide=only.wide)
    recomputes = _recompute_options(patterns, only.recompute, only.wide)
    options = itertools.product(stages, scheds, ms, recomputes)
    found = [
        lay
        for stage, sched, m, rc in options
        # 1F1B recomputes (VPP too); 1F1B with selective recompute is FThenB's program, and
        # VPP's keeps every micro-batch's matmul outputs as FThenB's does: searched under
        # FThenB alone (with VPP it doubled the wide search: 49k more layouts at 64
        # devices), VPP's when asked for
        if not (rc and only.recompute is None and sched in ("1F1B", "VPP"))
        for lay in _variants(patterns, deg, stage, sched, m, rc, local, accumulate,
                             only.num_virtual_stages)
    ]  # fmt: skip
    # over dp alone it is a sharding axis of dp x sharding, a mesh of its own: offered
    # where sep ranks are beside it, whose copies of the state it splits too; asked for,
    # wherever dp or sep ranks are beside a sharding axis
    beside = deg[DP] * deg[SEP] if only.zero_spans_data else deg[SEP]
    if deg[SHARDING] > 1 and beside > 1 and only.zero_spans_data is not False:
        spread = [dataclasses.replace(lay, zero_spans_data=True) for lay in found]
        found = spread if only.zero_spans_data else found + spread
    if not found:
        return [], _nothing_left(
            patterns, deg, local, ms, only.recompute, only.accumulate_steps,
            only.num_virtual_stages,
        )  # fmt: skip
    return found, None


def _recompute_options(
    patterns: ModelPatterns, recompute: bool | str | None, wide: bool
) -> list[bool | str]:
    """The recompute settings to try: the one forced, else off and whole blocks, and
    selective in the wide search (for a model with blocks)."""
    if recompute is not None:
        return [SELECTIVE if recompute == SELECTIVE else bool(recompute)]
    return [False, True, SELECTIVE] if wide and patterns.blocks else [False, True]


def _variants(
    patterns: ModelPatterns,
    deg: Mapping[str, int],
    stage: int,
    sched: str | None,
    m: int,
    rc: bool | str,
    local: int,
    accumulate: dict,
    forced_v: int | None,
) -> list[Layout]:
    """The layouts of one mesh, ZeRO stage, schedule, ``M`` and recompute setting: every
    virtual-stage and accumulation count to try."""
    wide = accumulate["wide"]
    return [
        Layout(
            **deg,
            zero_stage=stage,
            schedule=sched,
            num_microbatches=m,
            recompute=rc is True,
            selective_recompute=rc == SELECTIVE,
            num_virtual_stages=v,
            accumulate_steps=a,
        )
        for v in _virtual_options(patterns, sched, deg[PP], m, forced_v, wide)
        for a in _accumulations(local // m, piped=deg[PP] > 1, **accumulate)
    ]


def _nothing_left(
    patterns: ModelPatterns,
    deg: Mapping[str, int],
    local: int,
    ms: list[int],
    recompute: bool | str | None,
    accumulate_steps: int | None,
    num_virtual_stages: int | None,
) -> str:
    """Why a mesh the shapes allow got no layout: the forced settings it cannot take."""
    if accumulate_steps is not None and all(local // m % accumulate_steps for m in ms):
        per = " per pipeline micro-batch" if deg[PP] > 1 else ""
        return (
            f"accumulate_steps={accumulate_steps} does not divide the {local // ms[0]} "
            f"sequences per data-parallel replica{per}"
        )
    return _no_interleaving(patterns, deg[PP], ms, num_virtual_stages)

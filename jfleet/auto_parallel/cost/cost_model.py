"""The cost model: per-device memory, collective bytes and step time of a layout.

:func:`estimate` predicts one :class:`~jfleet.auto_parallel.search.layouts.Layout`'s per-device
memory, collective bytes and step time for a :class:`~jfleet.auto_parallel.search.layouts.Workload`;
:func:`rank` drops what does not fit the memory budget, sorts the rest by time and says
why each one lost. Which layouts exist at all (the shape rules, and why a mesh is
excluded) is :mod:`jfleet.auto_parallel.search.layouts`.

**Memory per device** (bytes; ``Phi_tp`` is a parameter's elements after the ``mp`` split,
``Phi_z`` after the ZeRO split too, only the blocks of one pipeline stage counted; the
embedding and head run outside the pipeline and are held by every stage, on ``1 / P`` of
the local rows when the batch splits over the data axes x ``pp``):

* resident (the step's arguments): parameters ``Phi_tp`` (``Phi_z`` at ZeRO-3), optimizer
  state ``k x Phi_tp`` (``k x Phi_z`` at ZeRO >= 1; Adam k = 2 moments, momentum 1, SGD 0;
  as in Rajbhandari et al., ZeRO, SC20, for fp32 training without a master copy), and the
  batch;
* temporary (the compiled step's ``temp``): ``max(activations + gathered, 2 x grads)``,
  the larger of two peaks. Between the forward and the backward pass every activation
  is live (and, at ZeRO-3, the parameters gathered in the forward pass, which stay live
  into the backward: ``gathered = Phi_tp``; with recompute one block is re-gathered at
  a time). At the end of the backward pass the whole local gradient (``Phi_tp``) is
  live with the reduction's output buffer: XLA materialises each device's local
  gradient before reducing it, even at ZeRO-2 (which therefore compiles to the same
  step as ZeRO-1, see ``benchmarks/RESULTS.md``). Scanned blocks at ZeRO-2 / 3 run
  per layer instead (FSDP, :mod:`jfleet.parallel.layer_gather`): one block gathered at a
  time (``gathered = max(Phi_outside, one block)``: the embedding and head are gathered
  where they run, outside the loop) and each block's gradient reduce-scattered in the
  loop (``grads = Phi_tp / N +`` one block, one copy), under every profile.

**Activations** follow Korthikanti et al., *Reducing Activation Recomputation in Large
Transformer Models* (2022): per layer and token ``34 h + 5 a s`` bytes in fp16 with
dropout. Counted instead from what JAX's autodiff saves (``print_saved_residuals``) and
XLA keeps for a pre-norm block in the compute dtype without dropout, in elements per
token per layer: ``4 h`` per norm (input, centred input, normalised, scaled) — not
split by ``mp`` unless under sequence parallelism — plus, split by ``mp``: attention
``4 q_dim + 2 a s`` (q, k, v after the grouped-query repeat, the attention output; the
masked scores and the probabilities), SwiGLU ``5 F`` (gate, up, silu's two parts, the
product), GELU ``3 F``. Outside the blocks: ``h`` (embedding output), ``4 h`` (final
norm) and ``4 V / mp`` (logits, log-softmax, softmax, one-hot labels). Measured on
XLA:CPU with 8 devices these match the compiled temp's slope per token and layer to
within 2% for :class:`~jfleet.models.llama.TinyLlama` and
:class:`~jfleet.models.gpt2.TinyGPT2` at width 128 (16% over at width 256).
Schedules (``to_distributed``'s, :mod:`jfleet.parallel.pipeline_forward`; bubble ticks
skipped): no pipeline keeps every layer's activations (alike blocks run as one ``lax.scan``,
:mod:`jfleet.auto_parallel.apply.scanned_blocks`, which adds half a block's backward working set
and the stacked gradient accumulator); FThenB keeps its ``M`` micro-batches' residuals (x
1.25: what XLA keeps beside the saved matmul outputs), one micro-batch's backward working
set (``blocks + 1`` blocks' activations in a loop over the stage's blocks, 1.3 with one
block a stage) and the stage's gradient accumulators; 1F1B (and FThenB with recompute, the
same program) keeps ``M`` stage inputs, the same working set and accumulators; VPP keeps
``v M`` chunk inputs and one chunk's working set; the stage inputs are stashed split over
``mp`` (``1 / mp`` of each per device,
:attr:`~jfleet.auto_parallel.cost.step_shape.StepShape.wire_split`); every pipeline adds the
stack's boundary buffers, two of the local batch's ``b s h`` (its input and outputs in the
forward loop, the cotangents in the backward), split over ``mp`` alike. Recompute keeps each
layer's input and one layer's working set where the recomputation waits for the backward
pass: inside a loop (scanned or pipelined blocks), or on a compiler that keeps
``jax.checkpoint``'s barriers until it schedules (``HardwareProfile.remat_barriers_kept``);
XLA:CPU removes them earlier and runs an unrolled recomputation with the forward pass, so
there it keeps every activation (:mod:`jfleet.recompute`). Selective recompute
(``jax.checkpoint`` with ``dots_with_no_batch_dims_saveable``) keeps per layer and token the
block's input and its weight-matmul outputs — ``h`` + ``(q_dim + 2 kv_dim) / mp + h`` (q, k,
v; o before its all-reduce) + ``2 F / mp + h`` (SwiGLU gate, up; down; GELU ``F``) — and one
block's working set (0.5 of its activations in a scan, as without recompute; 1.3 unrolled),
where its recomputation waits (scanned or pipelined blocks, or barriers kept; a pipeline's
stage stashes them for each of its micro-batches, under FThenB and 1F1B alike, measured
0.88-1.02 of the compiled memory at dp4 x pp2 and dp2 x pp2 x mp2); the ``s x s`` scores,
norms and activations are recomputed (measured on XLA:CPU, TinyLlama width 128, sequence 64
and 256, dp8 and dp2 x mp4: 0.99-1.13 of the compiled memory). The constants (1.25, 1.3,
0.5) are fitted to compiled temp memory of TinyLlama (width 128, 2-4 layers) on XLA:CPU.

**Step time** (seconds; no overlap of communication with compute, so an upper bound):

* compute: every product of the traced forward pass
  (:attr:`~jfleet.auto_parallel.match.patterns.ModelPatterns.dots`: projections of any kernel
  rank, attention scores and values, the head), scaled from the traced batch to the
  workload's (attention products with the square of the sequence), plus one backward
  product per operand that needs a gradient, per device: divided by the data axes
  (``dp x sharding x sep``) and by ``mp`` only when a parameter split over ``mp`` at this
  degree splits the product (a product of a kernel left whole runs on every ``mp`` rank);
  the largest stage's share of the blocks (``1 / pp`` when ``pp`` divides them; uneven
  stages run the padded stack, the largest stage's size, everywhere); recompute (and 1F1B)
  adds one forward of the blocks, selective recompute one forward of their attention cores
  (the products of two activations: scores and values, or a fused attention's); embedding
  and head run on every stage, on ``1 / P`` of the rows when the rows split over pp.
  :attr:`Candidate.flops` is that count as executed (bubble ticks skip their work), what
  :func:`jfleet.testing.hlo.executed_flops` counts for the slowest stage of the compiled
  step. Without a trace, ``6 x`` the kernels' elements per token;
* tensor parallel: per block and micro-batch (a pipeline: per tick of ``M + P - 1``,
  as the compiled loop holds them) one forward (twice with recompute)
  all-reduce per row projection split over ``mp`` (after o and down), and in the
  backward one per split column projection reading the block's input (XLA reduces q, k
  and v's input gradients separately: 3 for separate q/k/v, 1 for a fused qkv; 2 for
  SwiGLU gate/up, 1 for GELU or a stacked gate/up), each of ``b s h`` elements, plus the
  vocabulary-parallel embedding (forward) and head (backward) and two softmax
  statistics; ring all-reduce ``2(n-1)/n B`` at the bandwidth of the links the ``mp``
  group spans;
* gradient reduction over ``dp x sharding x sep``: ring all-reduce ``2(n-1)/n G``; with
  ZeRO a reduce-scatter over ``sharding`` (on XLA:CPU an all-reduce plus a slice), an
  all-reduce of the shard over ``dp x sep``, and an all-gather of the parameters
  (``(n-1)/n P``): once per step at every stage (XLA gathers a ZeRO-3 parameter once and
  reuses it in the backward; with recompute it gathers again; scanned blocks gather each
  block in the forward loop and again in the backward's, recomputed or not: ``2 x`` the
  blocks' bytes, one all-gather per block parameter per iteration); the pipelined blocks
  leave their ``shard_map`` with gradients already summed over ``dp x sharding`` (one
  all-reduce);
* pipeline: bubble ``(P-1)/(vM+P-1)`` of the blocks' compute (``v`` chunks per stage, 1 but
  for VPP; none where the devices share the host's cores, ``HardwareProfile.shared_cores``:
  an idle stage's core runs the others' work), and ``2(vM+P-1)`` (every schedule: a forward
  and a backward loop) point-to-point transfers of ``b s h`` on the critical path, each
  ``1 / mp`` of it with tensor parallel inside the stages and followed by an all-gather of
  ``b s h`` over ``mp`` (Megatron-LM's scatter / gather; 1F1B's backward all-gathers its
  stashed input too, so 3 all-gathers a tick, 2 for FThenB without recompute; the stack's
  gather / scatter over ``pp`` below moves ``1 / mp`` too, and its output and input
  cotangent are all-gathered over ``mp`` after it); with the
  rows split over ``pp`` the stack all-gathers its input and reduce-scatters its output over
  ``pp`` (and the reverse for the cotangents), else the embedding and head run on every
  stage and the stack's output and its input's cotangent are all-reduced over ``pp``;
* loop memory traffic (pipelines): each stashed residual written and read once, the
  stage's weights read from their stack 2-3 times per micro-batch and the stacked
  gradients read and written, at ``HardwareProfile.memory_bandwidth`` (on XLA:CPU
  pipelined steps are bound by this dynamic-slice / update / copy traffic); 1F1B's
  recompute reuses one micro-batch's buffer and stashes only the stage inputs;
* sequence parallel (``sep``): an all-gather of k and v per block forward and a
  reduce-scatter of their gradients backward.

**Routed experts** (a model whose patterns carry a
:class:`~jfleet.auto_parallel.match.moe_spec.MoESpec`; every term 0 without one, so a dense
model's prediction is unchanged; formulas in :mod:`jfleet.auto_parallel.cost.cost_moe`):
``ep`` is a data axis (the batch splits over ``dp x sharding x ep``; the non-expert
gradients are reduced over it too). Each MoE layer's ``E`` experts are split over ``ep``
(``[E, ...]`` kernels placed ``P('ep')``, whole over ``mp``), the router replicated:
memory ``E / ep x`` an expert's weights a layer, split further by ZeRO as the rest (one
layer's experts gathered at a time at ZeRO-3). The layer routes a device's ``T`` tokens a
call split over ``mp`` too (its default token axes are every mesh axis). Compute: on the
ragged path (GPU, TPU) ``2 x rows x`` an expert's weights forward with ``rows = T k x``
:data:`~jfleet.auto_parallel.cost.cost_moe.LOAD_IMBALANCE` where ``ep > 1`` (the busiest
rank; capped by the capacity factor), on the fixed-buffer path ``rows = E x C`` (padding
included; ``C = T`` dropless), plus the router's ``2 T h E``; three passes a step, four
with recompute. The all-to-alls (:func:`~jfleet.auto_parallel.cost.cost_moe.moe_exchange`):
dispatch and combine, forward and backward (6 with recompute) per MoE layer and call, each
sending ``(ep - 1) / ep`` of its buffer at the bandwidth of the links the ``ep`` group
spans (``StepTime.expert_parallel``). The expert gradients are all-reduced over the ranks
holding the same experts, ``dp x sharding x sep x mp`` (with ZeRO: reduce-scatter, the
rest all-reduced, the shard all-gathered; ZeRO-3 gathers each MoE layer's experts forward
and backward).

Every collective also pays the profile's latency; ZeRO's all-gathers are one per parameter
array (XLA does not combine them as it does all-reduces). A group's bandwidth is intra-node
when its devices lie within one node (row-major mesh order), else inter-node.

**Collective bytes** are counted as :mod:`jfleet.testing.hlo` counts them (the buffer of an
all-reduce, the input of a reduce-scatter, the output of an all-gather), so a
prediction compares directly with a compiled step (``benchmarks/cost_model_check.py``).

Example:
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
  >>> work = Workload(batch_size=16, seq_len=8)
  >>> c = estimate(found, work, Layout(dp=2, mp=4), get_profile("cpu"), devices_per_node=8)
  >>> c.layout.name, c.memory.optimizer == 2 * c.memory.params + 4
  ('dp2 x mp4', True)
  >>> c.collectives.all_reduce > 0, c.time.tensor_parallel > 0
  (True, True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jfleet.auto_parallel.cost.cost_comm import (
    data_parallel_time,
    exposed,
    new_counts,
    pipeline_time,
    sequence_time,
    tensor_parallel_time,
)
from jfleet.auto_parallel.cost.cost_memory import loop_traffic_time, memory
from jfleet.auto_parallel.cost.cost_moe import (
    expert_reduction_time,
    moe_exchange_time,
    moe_flops,
)
from jfleet.auto_parallel.cost.cost_types import (
    TIME_WORDS,
    Candidate,
    Collectives,
    Memory,
    StepTime,
    assembled,
    gib_text,
)
from jfleet.auto_parallel.cost.layout import Layout, Workload
from jfleet.auto_parallel.cost.memo import cached, cached_for
from jfleet.auto_parallel.cost.profiles import HardwareProfile, get_profile
from jfleet.auto_parallel.cost.step_shape import StepShape, step_shape
from jfleet.auto_parallel.cost.step_work import attention_core_flops, step_flops
from jfleet.auto_parallel.match.patterns import ModelPatterns

__all__ = [
    "Candidate",
    "Collectives",
    "Memory",
    "StepTime",
    "compute_time",
    "estimate",
    "matmul_efficiency",
    "rank",
]

_SAME = 1e-9  # relative time difference treated as a tie (equal programs)


# ------------------------------------------------------------------ estimation
def matmul_efficiency(s: StepShape) -> float:
    """The fraction of peak the step's matmuls reach: the profile's efficiency, and on a
    profile with a roofline the memory bound of a micro-batch's widest projection.

    A weight of ``k x n`` (``k`` the width, ``n`` the MLP's hidden or the query width over
    ``mp``) applied to the micro-batch's ``m`` tokens does ``2 mkn`` flops and moves
    ``(mk + kn + mn)`` elements; below ``peak / memory_bandwidth`` flops a byte it runs at
    the memory's rate.
    """
    profile = s.profile
    if not profile.roofline:
        return profile.matmul_efficiency
    d = s.dims
    m, k = max(s.tokens_mb, 1), max(d.width, 1)
    n = max(d.hidden, d.q_dim, d.width, 1) / s.layout.mp
    intensity = 2 * m * k * n / (s.act_bytes * (m * k + k * n + m * n))
    peak = profile.flops(s.workload.dtype) * profile.matmul_efficiency
    return profile.matmul_efficiency * min(1.0, intensity * profile.memory_bandwidth / peak)


def compute_time(s: StepShape) -> tuple[float, float, float]:
    """(compute seconds, bubble seconds, executed FLOPs) per device of one step."""
    lay, profile = s.layout, s.profile
    pp = lay.pp
    work = s.workload
    key = ("flops", lay.mp, lay.data_degree * lay.sep, work.tokens, work.seq_len)
    fwd_blocks, step_blocks, step_outside = cached(
        s.patterns, key, lambda: step_flops(s.patterns, work, lay, s.specs)
    )
    # the largest stage's share (uneven stages: the padded stack runs its size everywhere)
    layers = len(s.patterns.blocks)
    share = 1 / pp if s.even_stages or not layers else s.stage_blocks / layers
    block_flops = (step_blocks + (fwd_blocks if s.recompute else 0.0)) * share
    if s.selective:  # the attention cores run again in the backward pass (the stage's)
        block_flops += share * cached(
            s.patterns, ("core", *key), lambda: attention_core_flops(s.patterns, work, lay, s.specs)
        )
    block_flops += moe_flops(s)  # the stage's routed experts and routers (0 without)
    outside_flops = step_outside / pp if s.rows_over_pp else step_outside
    # (the same for every layout of a micro-batch size and mp)
    at = ("peak", s.workload.dtype, s.act_bytes, s.tokens_mb, lay.mp)
    peak = cached_for(
        s.patterns, profile, at, lambda: profile.flops(s.workload.dtype) * matmul_efficiency(s)
    )
    t_blocks = block_flops / peak
    t_head = outside_flops / peak
    bubble = 0.0
    if pp > 1 and not profile.shared_cores:
        bubble = t_blocks * (pp - 1) / (s.v * lay.num_microbatches)
    return t_blocks + t_head, bubble, block_flops + outside_flops


def estimate(
    patterns: ModelPatterns,
    workload: Workload,
    layout: Layout,
    profile: HardwareProfile | str | None = None,
    *,
    devices_per_node: int,
    scan_layers: bool = True,
) -> Candidate:
    """Predicts one layout's memory, collective bytes and step time.

    Args:
      patterns: the matched model.
      workload: the step's batch and dtype.
      layout: the layout to predict.
      profile: the hardware (default ``cpu``).
      devices_per_node: devices per node (decides intra- vs inter-node links).
      scan_layers: whether alike blocks run as one ``lax.scan`` when not pipelined (as
        ``to_distributed`` runs them when they can be stacked; at ZeRO-3 as FSDP).

    Returns:
      An unranked :class:`Candidate`.

    Example:
      >>> from jfleet.auto_parallel.match.patterns import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
      >>> work = Workload(batch_size=16, seq_len=8)
      >>> dp = estimate(found, work, Layout(dp=8), devices_per_node=8)
      >>> z3 = estimate(found, work, Layout(sharding=8, zero_stage=3), devices_per_node=8)
      >>> z3.memory.params * 8 == dp.memory.params
      True
    """
    s = step_shape(
        patterns,
        workload,
        layout,
        get_profile(profile),
        devices_per_node=devices_per_node,
        scan_layers=scan_layers,
    )
    compute, bubble, executed = compute_time(s)
    coll = new_counts()
    # every field of the four given, in order (the terms add to coll in this order)
    time = assembled(
        StepTime,
        {
            "compute": compute,
            "bubble": bubble,
            "tensor_parallel": tensor_parallel_time(s, coll),
            "data_parallel": exposed(
                data_parallel_time(s, coll) + expert_reduction_time(s, coll), s, compute
            ),
            "pipeline": pipeline_time(s, coll),
            "sequence": sequence_time(s, coll),
            "memory_traffic": loop_traffic_time(s),
            "expert_parallel": moe_exchange_time(s, coll),
        },
    )
    return assembled(
        Candidate,
        {
            "layout": layout,
            "memory": memory(s),
            "time": time,
            "collectives": assembled(Collectives, {k: round(v) for k, v in coll.items()}),
            "flops": executed,
            "fits": True,
            "reason": "",
        },
    )


# ------------------------------------------------------------------ ranking
def _why_slower(c: Candidate, best: Candidate) -> str:
    pct = 100 * (c.time.total / best.time.total - 1) if best.time.total else 0.0
    parts = {k: getattr(c.time, k) - getattr(best.time, k) for k in TIME_WORDS}
    worst = max(parts, key=lambda k: parts[k])
    shown = f"{pct:.0f}%" if pct >= 10 else f"{pct:.2g}%" if pct >= 0.01 else "<0.01%"
    return f"{shown} slower than the best: more {TIME_WORDS[worst]} time"


def _simpler_first_among_ties(by_time: list[Candidate]) -> list[Candidate]:
    """``by_time`` with each run of equal times (within ``_SAME``) sorted simplest first."""
    ordered: list[Candidate] = []
    i = 0
    while i < len(by_time):
        limit = by_time[i].time.total * (1 + _SAME)
        j = i
        while j < len(by_time) and by_time[j].time.total <= limit:
            j += 1
        tie = sorted(
            by_time[i:j], key=lambda c: (c.layout.complexity(), c.memory.total, c.time.total)
        )
        ordered.extend(tie)
        i = j
    return ordered


def rank(candidates: Sequence[Candidate], memory_budget: float) -> list[Candidate]:
    """Sorts candidates (fitting ones by time) and fills ``fits`` and ``reason``.

    The fastest fitting candidate is first, with reason ``"best"``. Equal times (e.g.
    ZeRO-1 and ZeRO-2, which compile to the same step) go to the simpler layout (fewer
    parallel kinds, lower ZeRO stage, no recompute), then to less memory. Candidates
    over the budget follow, by memory.

    Args:
      candidates: from :func:`estimate`.
      memory_budget: bytes per device.

    Returns:
      The ranked candidates (new objects).

    Example:
      >>> from jfleet.auto_parallel.match.patterns import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
      >>> work = Workload(batch_size=16, seq_len=8)
      >>> cands = [estimate(found, work, lay, devices_per_node=8)
      ...          for lay in (Layout(dp=8), Layout(dp=2, mp=4))]
      >>> [(c.layout.name, c.reason) for c in rank(cands, memory_budget=2**30)][0]
      ('dp8', 'best')
    """

    def key(c: Candidate) -> tuple:
        return (c.time.total, c.memory.total, c.layout.complexity())

    fitting = _simpler_first_among_ties(
        sorted((c for c in candidates if c.memory.total <= memory_budget), key=key)
    )
    over = sorted(
        (c for c in candidates if c.memory.total > memory_budget),
        key=lambda c: (c.memory.total, c.time.total),
    )
    out = []
    best = fitting[0] if fitting else None
    for i, c in enumerate(fitting):
        if i == 0:
            reason = "best"
        elif c.time.total > best.time.total * (1 + _SAME):
            reason = _why_slower(c, best)
        elif c.memory.total > best.memory.total:
            reason = (
                f"as fast as the best but needs more memory ({gib_text(c.memory.total)} vs "
                f"{gib_text(best.memory.total)})"
            )
        else:
            reason = "as fast as the best; the simpler layout is preferred"
        out.append(dataclasses.replace(c, fits=True, reason=reason))
    for c in over:
        reason = f"does not fit: {gib_text(c.memory.total)} > {gib_text(memory_budget)} budget"
        out.append(dataclasses.replace(c, fits=False, reason=reason))
    return out

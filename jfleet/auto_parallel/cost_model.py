"""The cost model: per-device memory, collective bytes and step time of a layout.

:func:`estimate` predicts one :class:`~jfleet.auto_parallel.layouts.Layout`'s per-device
memory, collective bytes and step time for a :class:`~jfleet.auto_parallel.layouts.Workload`;
:func:`rank` drops what does not fit the memory budget, sorts the rest by time and says
why each one lost. Which layouts exist at all (the shape rules, and why a mesh is
excluded) is :mod:`jfleet.auto_parallel.layouts`.

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
  step as ZeRO-1, see ``benchmarks/RESULTS.md``).

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
:mod:`jfleet.auto_parallel.scanned_blocks`, which adds half a block's backward working set
and the stacked gradient accumulator); FThenB keeps its ``M`` micro-batches' residuals (x
1.25: what XLA keeps beside the saved matmul outputs), one micro-batch's backward working
set (``blocks + 1`` blocks' activations in a loop over the stage's blocks, 1.3 with one
block a stage) and the stage's gradient accumulators; 1F1B (and FThenB with recompute, the
same program) keeps ``M`` stage inputs, the same working set and accumulators; VPP keeps
``v M`` chunk inputs and one chunk's working set. Recompute keeps each layer's input and one
layer's working set where the recomputation waits for the backward pass: inside a loop
(scanned or pipelined blocks), or on a compiler that keeps ``jax.checkpoint``'s barriers
until it schedules (``HardwareProfile.remat_barriers_kept``); XLA:CPU removes them earlier
and runs an unrolled recomputation with the forward pass, so there it keeps every activation
(:mod:`jfleet.recompute`). The constants (1.25, 1.3, 0.5) are fitted to compiled temp memory
of TinyLlama (width 128, 2-4 layers) on XLA:CPU.

**Step time** (seconds; no overlap of communication with compute, so an upper bound):

* compute: every product of the traced forward pass
  (:attr:`~jfleet.auto_parallel.patterns.ModelPatterns.dots`: projections of any kernel
  rank, attention scores and values, the head), scaled from the traced batch to the
  workload's (attention products with the square of the sequence), plus one backward
  product per operand that needs a gradient, per device: divided by the data axes
  (``dp x sharding x sep``) and by ``mp`` only when a parameter split over ``mp`` at this
  degree splits the product (a product of a kernel left whole runs on every ``mp`` rank);
  the blocks' share divided by ``pp``; recompute (and 1F1B) adds one forward of the
  blocks; embedding and head run on every stage, on ``1 / P`` of the rows when the rows
  split over pp. :attr:`Candidate.flops` is that count as executed (bubble ticks skip
  their work), what :func:`jfleet.testing.hlo.executed_flops` counts for the slowest
  stage of the compiled step. Without a trace, ``6 x`` the kernels' elements per token;
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
  reuses it in the backward; with recompute it gathers again); the pipelined blocks
  leave their ``shard_map`` with gradients already summed over ``dp x sharding`` (one
  all-reduce);
* pipeline: bubble ``(P-1)/(vM+P-1)`` of the blocks' compute (``v`` chunks per stage, 1 but
  for VPP; none where the devices share the host's cores, ``HardwareProfile.shared_cores``:
  an idle stage's core runs the others' work), and ``2(vM+P-1)`` (every schedule: a forward
  and a backward loop) point-to-point transfers of ``b s h`` on the critical path; with the
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

Every collective also pays the profile's latency; ZeRO's all-gathers are one per parameter
array (XLA does not combine them as it does all-reduces). A group's bandwidth is intra-node
when its devices lie within one node (row-major mesh order), else inter-node.

**Collective bytes** are counted as :mod:`jfleet.testing.hlo` counts them (the buffer of an
all-reduce, the input of a reduce-scatter, the output of an all-gather), so a
prediction compares directly with a compiled step (``benchmarks/cost_model_check.py``).

Example:
  >>> from jfleet.auto_parallel.patterns import match_patterns
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
import math
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.layouts import OPTIMIZER_MOMENTS, Layout, Workload
from jfleet.auto_parallel.patterns import ModelPatterns, ParamInfo
from jfleet.auto_parallel.profiles import HardwareProfile, get_profile
from jfleet.auto_parallel.step_work import (
    ATTN_Q_ELEMS,
    ATTN_SCORE_ELEMS,
    LOGIT_ELEMS,
    MLP_ELEMS,
    NORM_ELEMS,
    OUTSIDE_H_ELEMS,
    layers_and_norms,
    split_degrees,
    step_flops,
    tp_reductions,
)
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import AXIS_NAMES, DP, MP, PP, SEP, SHARDING

__all__ = [
    "Candidate",
    "Collectives",
    "Memory",
    "StepTime",
    "estimate",
    "rank",
]

_SAME = 1e-9  # relative time difference treated as a tie (equal programs)
#: One block's backward working set on one micro-batch, x its activations, when no loop
#: over the stage's blocks adds a residual stack (measured on XLA:CPU, TinyLlama width 128).
_ONE_BLOCK_WORK = 1.3
#: A scan over layers without recompute: its backward's working set beside the stacked
#: residuals, x one block's activations (XLA:CPU, TinyLlama width 128 at dp8 and dp2 x mp4).
_SCAN_WORK = 0.5
#: FThenB's stand-in keeps its M micro-batches' residuals: the matmul outputs
#: (``pipeline_parts.SavedStage``), x the activations. Fitted on XLA:CPU (TinyLlama,
#: 2-4 blocks, dp2 x pp2 x mp2 M=2 and dp2 x pp4 M=4): 0.16-0.85 keeps all within 25%.
_FTHENB_KEPT = 0.5
#: A scan over layers without recompute keeps each block's matmul outputs only
#: (``jax.checkpoint(policy=dots_saveable)`` of the scanned step), x the activations.
#: Fitted on XLA:CPU (TinyLlama, 2-4 blocks, dp8, dp2 x mp4, ZeRO-2 dp2 x sharding4):
#: 0.12-0.53 keeps all within 25%.
_SCANNED_KEPT = 0.4
GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / GiB:.3g} GiB" if n >= 2**27 else f"{n / 2**20:.3g} MiB"


# ------------------------------------------------------------------ outputs
@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
    """Predicted bytes per device (see the module docstring for the formulas).

    Attributes:
      params: resident parameters (ZeRO-3: the shard).
      optimizer: optimizer state.
      inputs: the batch.
      grads: the local gradient the step materialises (before reduction).
      gathered: ZeRO-3 parameters gathered for the step (0 otherwise).
      activations: activations live between the forward and the backward pass.
    """

    params: int
    optimizer: int
    inputs: int
    grads: int
    gathered: int
    activations: int

    @property
    def resident(self) -> int:
        """Bytes kept between steps (the step's arguments)."""
        return self.params + self.optimizer + self.inputs

    @property
    def temp(self) -> int:
        """Bytes of the step's temporaries at its peak."""
        return max(self.activations + self.gathered, 2 * self.grads)

    @property
    def total(self) -> int:
        """Peak bytes per device: resident + temp."""
        return self.resident + self.temp


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTime:
    """Predicted seconds per step, by cause.

    Attributes:
      compute: matmul time at peak (recompute included), without the bubble.
      bubble: pipeline bubble (idle stage time).
      tensor_parallel: ``mp`` all-reduces of activations.
      data_parallel: gradient reduction and ZeRO all-gathers.
      pipeline: point-to-point transfers between stages.
      sequence: ``sep`` all-gathers / reduce-scatters of k and v.
      memory_traffic: the residuals the step's loops (pipeline ticks, a scan over
        layers) stash and fetch, at the profile's memory bandwidth.
    """

    compute: float
    bubble: float = 0.0
    tensor_parallel: float = 0.0
    data_parallel: float = 0.0
    pipeline: float = 0.0
    sequence: float = 0.0
    memory_traffic: float = 0.0

    @property
    def total(self) -> float:
        """Sum of the parts (no overlap)."""
        return (
            self.compute
            + self.bubble
            + self.tensor_parallel
            + self.data_parallel
            + self.pipeline
            + self.sequence
            + self.memory_traffic
        )

    @property
    def communication(self) -> float:
        """All communication time."""
        return self.tensor_parallel + self.data_parallel + self.pipeline + self.sequence


_TIME_WORDS = {
    "compute": "compute",
    "bubble": "pipeline bubble",
    "tensor_parallel": "tensor-parallel all-reduce",
    "data_parallel": "gradient reduction / ZeRO gather",
    "pipeline": "pipeline transfer",
    "sequence": "sequence-parallel gather",
    "memory_traffic": "loop memory traffic",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collectives:
    """Predicted collective bytes per device per step.

    Counted as :func:`jfleet.testing.hlo.summarize` counts a compiled step's.
    """

    all_reduce: int = 0
    reduce_scatter: int = 0
    all_gather: int = 0
    collective_permute: int = 0
    all_to_all: int = 0

    @property
    def total(self) -> int:
        """All kinds together."""
        return (
            self.all_reduce
            + self.reduce_scatter
            + self.all_gather
            + self.collective_permute
            + self.all_to_all
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout with its predictions; after :func:`rank`, whether it fits and why it lost.

    Attributes:
      layout: the layout.
      flops: predicted dot FLOPs per device per step, as executed (bubble ticks skipped):
        what ``jfleet.testing.hlo.executed_flops`` counts for the compiled step's slowest
        stage (``dot_flops`` without a pipeline).
      memory: predicted bytes per device.
      time: predicted seconds per step.
      collectives: predicted collective bytes per device per step.
      fits: predicted total <= the memory budget.
      reason: ``"best"`` for the winner, else why it lost.
    """

    layout: Layout
    memory: Memory
    time: StepTime
    collectives: Collectives
    flops: float = 0.0
    fits: bool = True
    reason: str = ""


# ------------------------------------------------------------------ estimation
def _local_elems(spec: P, shape: Sequence[int], sizes: Mapping[str, int]) -> int:
    n = 1
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for dim, entry in zip(shape, entries, strict=True):
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        n *= dim // math.prod(sizes[a] for a in axes)
    return n


def _group_bandwidth(
    group: Sequence[str], degrees: Mapping[str, int], profile: HardwareProfile, per_node: int
) -> float:
    """Intra-node bandwidth when the group's devices lie within one node, else inter-node."""
    span = 1
    for i, axis in enumerate(AXIS_NAMES):
        if axis in group and degrees[axis] > 1:
            stride = math.prod(degrees[a] for a in AXIS_NAMES[i + 1 :])
            span = max(span, stride * degrees[axis])
    return profile.intra_node_bandwidth if span <= per_node else profile.inter_node_bandwidth


def _stored_leaves(params: Sequence[ParamInfo], blocks: int, *, stacked: bool) -> int:
    """How many arrays hold ``params``: one per parameter, or one per block parameter
    kind when the blocks are stacked (a scan over layers, a pipeline stage)."""
    in_blocks = sum(p.block is not None for p in params)
    outside = len(params) - in_blocks
    return outside + (in_blocks // max(blocks, 1) if stacked and blocks else in_blocks)


def _ring(kind: str, nbytes: float, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "collective-permute":
        return nbytes
    return (n - 1) / n * nbytes


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
        ``to_distributed`` runs them when they can be stacked; not at ZeRO-3).

    Returns:
      An unranked :class:`Candidate`.

    Example:
      >>> from jfleet.auto_parallel.patterns import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
      >>> work = Workload(batch_size=16, seq_len=8)
      >>> dp = estimate(found, work, Layout(dp=8), devices_per_node=8)
      >>> z3 = estimate(found, work, Layout(sharding=8, zero_stage=3), devices_per_node=8)
      >>> z3.memory.params * 8 == dp.memory.params
      True
    """
    profile = get_profile(profile)
    d = patterns.dims
    deg = layout.degrees
    mp, pp, sep, shard = layout.mp, layout.pp, layout.sep, layout.sharding
    stage = layout.zero_stage
    m = layout.num_microbatches
    abstract = AbstractMesh(tuple(deg.values()), AXIS_NAMES)
    zero = Placement(mesh=abstract, zero_stage=stage) if stage else None
    layers, norms = layers_and_norms(patterns)
    stage_blocks = layers // pp

    def in_stage(p: ParamInfo) -> bool:
        return p.block is None or p.block < stage_blocks

    def tp(p: ParamInfo) -> int:
        return _local_elems(p.spec_for(mp), p.shape, deg) * jnp.dtype(p.dtype).itemsize

    def zp(p: ParamInfo) -> int:
        if zero is None:
            return tp(p)
        spec = zero.zero_spec(p.spec_for(mp), p.shape)
        return _local_elems(spec, p.shape, deg) * jnp.dtype(p.dtype).itemsize

    mine = [p for p in patterns.params if in_stage(p)]
    tp_bytes = sum(tp(p) for p in mine)
    z_bytes = sum(zp(p) for p in mine)
    block_tp = sum(tp(p) for p in mine if p.block is not None)
    outside_tp = tp_bytes - block_tp
    one_block_tp = block_tp // stage_blocks if stage_blocks else 0
    params_mem = z_bytes if stage >= 3 else tp_bytes
    moments = OPTIMIZER_MOMENTS[workload.optimizer]
    opt_mem = moments * (z_bytes if stage >= 1 else tp_bytes)
    if moments:
        opt_mem += 4  # the step count
    data = layout.data_degree
    local_seqs = workload.batch_size // data
    local_seq = workload.seq_len // sep
    inputs = 2 * local_seqs * local_seq * 4  # token ids and labels, int32

    # activations (elements per token)
    h, s = d.width, workload.seq_len
    sp = mp if workload.sequence_parallel else 1
    per_layer_rep = NORM_ELEMS * norms * h / sp
    attn_mp, mlp_mp = split_degrees(patterns, mp)
    per_layer = per_layer_rep
    if patterns.attention:
        per_layer += (ATTN_Q_ELEMS * d.q_dim + ATTN_SCORE_ELEMS * d.heads * s) / attn_mp
    if patterns.mlp:
        per_layer += MLP_ELEMS[patterns.mlp] * d.hidden / mlp_mp
    vocab = d.vocab if patterns.tied_head is not None else 0
    outside = OUTSIDE_H_ELEMS * h + LOGIT_ELEMS * vocab / mp
    ab = workload.act_bytes
    tokens_local = local_seqs * local_seq  # per device, whole step
    tokens_mb = tokens_local // m
    # The pipelines are to_distributed's stand-in (blocks.PipelinedBlocks ->
    # pipeline_forward): bubble ticks skip their work (lax.cond), so a stage runs M
    # micro-batches. FThenB differentiates its forward loop, each stage's matmul outputs
    # saved; 1F1B (and FThenB with recompute, the same program) stashes each
    # micro-batch's stage input and recomputes the stage in its own backward loop. When
    # the batch rows split over the data axes x pp, the embedding, head and loss run on
    # 1 / P of the local rows. Without a pipeline, alike blocks run as one lax.scan
    # (scanned_blocks.ScannedBlocks; not at ZeRO-3, not when they cannot be stacked).
    piped = pp > 1
    # 1F1B's program (VPP: the same over v interleaved chunks of stage_blocks / v blocks,
    # v M + P - 1 ticks a loop, v chunk inputs stashed per micro-batch)
    staged = piped and (layout.schedule in ("1F1B", "VPP") or layout.recompute)
    v = layout.num_virtual_stages
    chunk_blocks = stage_blocks / v
    rows_over_pp = piped and workload.batch_size % (data * pp) == 0
    head_tokens = tokens_local // pp if rows_over_pp else tokens_local
    scanned = not piped and scan_layers and bool(patterns.blocks) and stage < 3
    # One block's backward working set on one micro-batch. In a loop over more than one
    # block the residual stack of the blocks and the slice the backward reads add one
    # more (measured on XLA:CPU: (blocks + 1) x per_layer; one block a stage, 1.3 x).
    # recompute that waits for the backward pass: inside a loop, or where the compiler
    # keeps jax.checkpoint's barriers until it schedules (not XLA:CPU: jfleet.recompute);
    # else the recomputation runs with the forward pass and saves no memory (nor, at
    # ZeRO-3, the second gather of the parameters)
    remat_waits = layout.recompute and (piped or scanned or profile.remat_barriers_kept)
    looped = chunk_blocks > 1
    work_set = tokens_mb * per_layer * ((chunk_blocks + 1) if looped else _ONE_BLOCK_WORK)
    if staged:
        layer_acts = v * tokens_local * h + work_set  # v M chunk inputs + one unit's
    elif piped:
        layer_acts = _FTHENB_KEPT * tokens_local * per_layer * stage_blocks + work_set
    elif remat_waits:
        layer_acts = tokens_local * h * stage_blocks + tokens_mb * per_layer * _ONE_BLOCK_WORK
    else:
        # no recompute, or recompute XLA:CPU schedules with the forward pass (outside a
        # loop it removes jax.checkpoint's barriers before scheduling; jfleet.recompute)
        layer_acts = tokens_local * per_layer * stage_blocks
        if scanned:  # matmul outputs kept, and the backward's working set beside them
            layer_acts = _SCANNED_KEPT * layer_acts + tokens_mb * per_layer * _SCAN_WORK
    activations = int((layer_acts + head_tokens * outside) * ab)
    if piped or scanned:
        # the backward loop carries the stacked blocks' gradients, accumulated over its
        # iterations, while the residuals are live
        activations += block_tp
    # memory traffic of the pipeline's loops (measured on XLA:CPU to bound pipelined
    # steps, issue 15; a scan over layers writes its residuals in place): each residual
    # a stage stashes for the backward loop is written (dynamic-update-slice) and read
    # (dynamic-slice) once per step; every tick reads the stage's weights out of their
    # stack in the forward pass, again in the backward (and the recompute), and reads and
    # writes the stacked gradients it adds into. 1F1B's recompute keeps one micro-batch's
    # residuals in a buffer each backward tick reuses, not a stash of all M.
    stashed = 0.0
    if staged:
        stashed = v * tokens_local * h
    elif piped:
        stashed = _FTHENB_KEPT * tokens_local * per_layer * stage_blocks
    weight_passes = 4 + int(layout.recompute or staged) if piped else 0
    loop_bytes = 2 * stashed * ab + weight_passes * m * block_tp
    t_mem = loop_bytes / profile.memory_bandwidth
    gathered = 0
    if stage >= 3:
        gathered = outside_tp + (one_block_tp if remat_waits else block_tp)
    memory = Memory(
        params=params_mem,
        optimizer=opt_mem,
        inputs=inputs,
        grads=tp_bytes,
        gathered=gathered,
        activations=activations,
    )

    # compute: every product of the traced forward, with its backward
    fwd_blocks, step_blocks, step_outside = step_flops(patterns, workload, layout)
    recompute = layout.recompute or staged
    block_flops = (step_blocks + (fwd_blocks if recompute else 0.0)) / pp
    outside_flops = step_outside / pp if rows_over_pp else step_outside
    peak = profile.flops(workload.dtype)
    t_blocks = block_flops / peak
    t_head = outside_flops / peak
    bubble = t_blocks * (pp - 1) / (v * m) if pp > 1 and not profile.shared_cores else 0.0
    compute = t_blocks + t_head
    executed = block_flops + outside_flops

    lat = profile.collective_latency

    def bw(*group: str) -> float:
        return _group_bandwidth(group, deg, profile, devices_per_node)

    bw_mp, bw_data, bw_shard = bw(MP), bw(DP, SHARDING, SEP), bw(SHARDING)
    bw_dpsep, bw_pp, bw_sep = bw(DP, SEP), bw(PP), bw(SEP)
    coll = dict.fromkeys(
        ("all_reduce", "reduce_scatter", "all_gather", "collective_permute", "all_to_all"), 0.0
    )
    t_tp = t_dp = t_pp = t_sep = 0.0

    # tensor parallel
    if mp > 1:
        act = tokens_mb * h * ab
        fwd, bwd = tp_reductions(patterns, mp)
        # recompute runs the forward's all-reduces again in the backward pass. A pipeline
        # counts them on each of its M + P - 1 ticks: the compiled loop holds them at
        # every tick (jfleet.testing.hlo weights them by the trip count), bubble or not.
        per_mb = chunk_blocks * (fwd * (2 if recompute else 1) + bwd)  # a chunk per tick
        n_mb = per_mb * (v * m + pp - 1 if piped else m)
        roles = {p.role for p in patterns.params}
        n_out = int("embedding" in roles) + int("head" in roles or bool(patterns.tied_head))
        out_bytes = n_out * head_tokens * h * ab
        stats = 2 * head_tokens * 4 if vocab else 0
        if workload.sequence_parallel:
            # each all-reduce becomes a reduce-scatter + an all-gather: the same wire bytes;
            # hlo counts the reduce-scatter's input and the all-gather's output
            coll["reduce_scatter"] += n_mb * act
            coll["all_gather"] += n_mb * act
        else:
            coll["all_reduce"] += n_mb * act
        coll["all_reduce"] += out_bytes + stats
        count = n_mb + n_out + (2 if stats else 0)
        t_tp = count * lat + (_ring("all-reduce", n_mb * act + out_bytes + stats, mp)) / bw_mp

    # gradient reduction over the data axes (and sep)
    red = data * sep
    grads = tp_bytes
    if red > 1:
        if stage == 0:
            coll["all_reduce"] += grads
            t_dp += lat + _ring("all-reduce", grads, red) / bw_data
        else:
            zeroed = grads
            if piped:
                # the pipelined blocks' weights enter the pipeline's shard_map (manual over
                # dp and sharding) replicated over the data axes, so their gradients leave
                # it summed over dp x sharding: one all-reduce, not ZeRO's reduce-scatter;
                # only the embedding's and the head's are reduced in the ZeRO layout
                zeroed = outside_tp
                coll["all_reduce"] += block_tp
                t_dp += lat + _ring("all-reduce", block_tp, red) / bw_data
            if profile.reduce_scatter_native:
                coll["reduce_scatter"] += zeroed
                t_dp += lat + _ring("reduce-scatter", zeroed, shard) / bw_shard
            else:
                coll["all_reduce"] += zeroed
                t_dp += lat + _ring("all-reduce", zeroed, shard) / bw_shard
            if layout.dp * sep > 1:
                coll["all_reduce"] += zeroed / shard
                t_dp += lat + _ring("all-reduce", zeroed / shard, layout.dp * sep) / bw_dpsep
            # ZeRO's all-gathers (of the updated shards; at stage 3 of the parameters
            # before use) are one per parameter leaf, as the step holds them (stacked
            # when the blocks are scanned or pipelined): XLA combines all-reduces, not
            # these (measured: 13 all-gathers scanned, 39 unrolled, TinyLlama 4 blocks)
            gathers = 2 if (stage >= 3 and remat_waits) else 1
            coll["all_gather"] += gathers * tp_bytes
            leaves = _stored_leaves(mine, stage_blocks, stacked=piped or scanned)
            t_dp += gathers * (leaves * lat + _ring("all-gather", tp_bytes, shard) / bw_shard)
    if pp > 1:
        # every schedule: one forward loop and one backward loop of v M + P - 1 ticks, one
        # collective-permute of a micro-batch's b s h per tick and direction
        ticks = v * m + pp - 1
        act = tokens_mb * h * ab
        coll["collective_permute"] += 2 * ticks * act
        t_pp = 2 * ticks * (lat + act / bw_pp)
        # to_distributed's stand-in runs only the blocks pipelined. With the rows split
        # over pp it gathers its input over pp and reduce-scatters its output (and the
        # reverse for the cotangents): 2 all-gathers + 2 reduce-scatters of the local
        # batch's b s h. Otherwise the embedding and head run on every stage on the same
        # values, and the output and the input's cotangent are all-reduced over pp.
        out = tokens_local * h * ab
        if rows_over_pp:
            coll["all_gather"] += 2 * out
            coll["reduce_scatter"] += 2 * out
            t_pp += 4 * (lat + _ring("all-gather", out, pp) / bw_pp)
        else:
            coll["all_reduce"] += 2 * out
            t_pp += 2 * (lat + _ring("all-reduce", out, pp) / bw_pp)
    if sep > 1 and patterns.attention:
        kv = tokens_mb * sep * 2 * d.kv_dim / mp * ab
        n = stage_blocks * m
        coll["all_gather"] += n * kv
        coll["reduce_scatter"] += n * kv
        t_sep = 2 * n * (lat + _ring("all-gather", kv, sep) / bw_sep)

    return Candidate(
        layout=layout,
        flops=executed,
        memory=memory,
        time=StepTime(
            compute=compute,
            bubble=bubble,
            tensor_parallel=t_tp,
            data_parallel=t_dp,
            pipeline=t_pp,
            sequence=t_sep,
            memory_traffic=t_mem,
        ),
        collectives=Collectives(**{k: round(v) for k, v in coll.items()}),
    )


# ------------------------------------------------------------------ ranking
def _why_slower(c: Candidate, best: Candidate) -> str:
    pct = 100 * (c.time.total / best.time.total - 1) if best.time.total else 0.0
    parts = {k: getattr(c.time, k) - getattr(best.time, k) for k in _TIME_WORDS}
    worst = max(parts, key=lambda k: parts[k])
    shown = f"{pct:.0f}%" if pct >= 10 else f"{pct:.2g}%" if pct >= 0.01 else "<0.01%"
    return f"{shown} slower than the best: more {_TIME_WORDS[worst]} time"


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
      >>> from jfleet.auto_parallel.patterns import match_patterns
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

    fitting = sorted((c for c in candidates if c.memory.total <= memory_budget), key=key)
    if fitting:
        ordered: list[Candidate] = []
        rest = list(fitting)
        while rest:
            head = rest[0]
            tie = [c for c in rest if c.time.total <= head.time.total * (1 + _SAME)]
            tie.sort(key=lambda c: (c.layout.complexity(), c.memory.total, c.time.total))
            ordered.extend(tie)
            rest = [c for c in rest if c not in tie]
        fitting = ordered
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
                f"as fast as the best but needs more memory ({_gib(c.memory.total)} vs "
                f"{_gib(best.memory.total)})"
            )
        else:
            reason = "as fast as the best; the simpler layout is preferred"
        out.append(dataclasses.replace(c, fits=True, reason=reason))
    for c in over:
        reason = f"does not fit: {_gib(c.memory.total)} > {_gib(memory_budget)} budget"
        out.append(dataclasses.replace(c, fits=False, reason=reason))
    return out

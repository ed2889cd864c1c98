"""The cost model's memory terms: resident state, activations, and the loops' memory traffic.

Each function reads one :class:`~jfleet.auto_parallel.cost.step_shape.StepShape`; the formulas
and where their constants come from are in :mod:`jfleet.auto_parallel.cost.cost_model`'s
docstring. :func:`memory` assembles the :class:`~jfleet.auto_parallel.cost.cost_types.Memory`;
:func:`loop_traffic_time` is the pipelines' stash / weight-stack traffic.

Example:
  >>> from jfleet.auto_parallel.cost.layout import Layout, Workload
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.auto_parallel.cost.step_shape import step_shape
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
  >>> s = step_shape(found, Workload(batch_size=16, seq_len=8), Layout(dp=8),
  ...                "cpu", devices_per_node=8)
  >>> memory(s).grads == s.tp_bytes, loop_traffic_time(s)
  (True, 0.0)
"""

from __future__ import annotations

from jfleet.auto_parallel.cost.cost_moe import expert_memory, moe_elems
from jfleet.auto_parallel.cost.cost_types import Memory, assembled
from jfleet.auto_parallel.cost.layout import OPTIMIZER_MOMENTS
from jfleet.auto_parallel.cost.memo import cached
from jfleet.auto_parallel.cost.step_shape import StepShape
from jfleet.auto_parallel.cost.step_work import (
    ATTN_Q_ELEMS,
    ATTN_SCORE_ELEMS,
    LOGIT_ELEMS,
    MLP_ELEMS,
    NORM_ELEMS,
    OUTSIDE_H_ELEMS,
    split_degrees,
)

__all__ = [
    "activation_bytes",
    "gradient_bytes",
    "loop_traffic_time",
    "memory",
    "optimizer_bytes",
    "per_layer_elems",
    "selective_kept_elems",
]

#: One block's backward working set on one micro-batch, x its activations, when no loop
#: over the stage's blocks adds a residual stack (measured on XLA:CPU, TinyLlama width 128).
_ONE_BLOCK_WORK = 1.3
#: A scan over layers without recompute: its backward's working set beside the stacked
#: residuals, x one block's activations (XLA:CPU, TinyLlama width 128 at dp8 and dp2 x mp4).
_SCAN_WORK = 0.5
#: FThenB's stand-in keeps its M micro-batches' residuals: the matmul outputs
#: (``pipeline_schedule.SavedStage``), x the activations. Fitted on XLA:CPU (TinyLlama,
#: 2-4 blocks, dp2 x pp2 x mp2 M=2 and dp2 x pp4 M=4): 0.16-0.85 keeps all within 25%.
_FTHENB_KEPT = 0.5
#: A scan over layers without recompute keeps each block's matmul outputs only
#: (``jax.checkpoint(policy=dots_saveable)`` of the scanned step), x the activations.
#: Fitted on XLA:CPU (TinyLlama, 2-4 blocks, dp8, dp2 x mp4, ZeRO-2 dp2 x sharding4):
#: 0.12-0.53 keeps all within 25%.
_SCANNED_KEPT = 0.4
#: ZeRO-3 on scanned blocks: blocks' gathered weights live at once. Each loop body
#: gathers one block's (the backward's once, for its recompute and its matmuls), and the
#: parameters outside the blocks are gathered where they are used (the embedding before
#: the loop, the head after it), so the peak holds the larger of one block and the rest:
#: TinyLlama (widths 128 / 256, 4 / 16 blocks, sharding8 and sharding4 x mp2, recompute on
#: and off) 0.88-1.16 of the compiled step on XLA:CPU; counting both, or two blocks, gave
#: up to 1.37. A GPU scheduler that prefetches the next block's gather holds one more.
_PER_LAYER_GATHERED = 1


def per_layer_elems(s: StepShape) -> float:
    """Activation elements per token one decoder layer keeps (split by ``mp`` as it splits):
    its dense part once a model, ``mp`` and sequence, the routed experts' (which also vary
    with ``ep``, the micro-batch's tokens and the data ranks) once a layout's MoE key."""
    key = ("per_layer_elems", s.layout.mp, s.workload.sequence_parallel, s.workload.seq_len)
    dense = cached(s.patterns, key, lambda: _per_layer_elems(s))  # the same for every M, v, ...
    return dense + _moe_elems(s, kept=False)


def _moe_elems(s: StepShape, *, kept: bool) -> float:
    if s.patterns.moe is None:
        return 0.0
    lay = s.layout
    key = ("moe_elems", kept, lay.mp, lay.ep, lay.dp * lay.sharding, s.tokens_mb)
    key += (s.profile.platform,)
    return cached(s.patterns, key, lambda: moe_elems(s, kept=kept))


def _per_layer_elems(s: StepShape) -> float:
    d, mp = s.dims, s.layout.mp
    sp = mp if s.workload.sequence_parallel else 1
    per_layer = NORM_ELEMS * s.norms * d.width / sp
    attn_mp, mlp_mp = cached(
        s.patterns, ("split_degrees", mp), lambda: split_degrees(s.patterns, mp, s.specs)
    )
    if s.patterns.attention:
        # the masked scores and probabilities only where the trace materialises them
        scores = ATTN_SCORE_ELEMS * d.heads * s.workload.seq_len if s.scores_materialised else 0
        per_layer += (ATTN_Q_ELEMS * d.q_dim + scores) / attn_mp
    if s.patterns.mlp:
        per_layer += MLP_ELEMS[s.patterns.mlp] * d.hidden / mlp_mp
    return per_layer  # the routed experts' rows are per_layer_elems's (cost_moe)


#: Elements per token of the MLP's up projections (gate and up for SwiGLU), x hidden.
_MLP_UP = {"swiglu": 2, "gelu": 1}


def selective_kept_elems(s: StepShape) -> float:
    """Elements per token one layer keeps under selective recompute: its input and its
    weight-matmul outputs (split by ``mp`` as they split; a row projection's output is
    whole before its all-reduce)."""
    d, mp = s.dims, s.layout.mp
    sp = mp if s.workload.sequence_parallel else 1
    attn_mp, mlp_mp = cached(
        s.patterns, ("split_degrees", mp), lambda: split_degrees(s.patterns, mp, s.specs)
    )
    kept = d.width / sp
    if s.patterns.attention:
        kept += (d.q_dim + 2 * d.kv_dim) / attn_mp + d.width
    if s.patterns.mlp:
        kept += _MLP_UP[s.patterns.mlp] * d.hidden / mlp_mp + d.width
    return kept + _moe_elems(s, kept=True)  # the routed experts' exchanged rows (cost_moe)


def _layer_acts(s: StepShape, per_layer: float) -> float:
    """Elements the stage's layers keep at the step's peak, by program."""
    # The pipelines are to_distributed's stand-in (blocks.PipelinedBlocks ->
    # pipeline_forward): bubble ticks skip their work (lax.cond), so a stage runs M
    # micro-batches. FThenB differentiates its forward loop, each stage's matmul outputs
    # saved; 1F1B (and FThenB with recompute, the same program) stashes each
    # micro-batch's stage input and recomputes the stage in its own backward loop.
    # Without a pipeline, alike blocks run as one lax.scan (scanned_blocks.ScannedBlocks;
    # not when they cannot be stacked; at ZeRO-3 each block gathers its own weights).
    # One block's backward working set on one micro-batch: in a loop over more than one
    # block the residual stack of the blocks and the slice the backward reads add one more
    # (measured on XLA:CPU: (blocks + 1) x per_layer; one block a stage, 1.3 x).
    # A loop runs stacked units of ``period`` blocks (Gemma's local / global pairs:
    # super-blocks of 2), each unit unrolled inside; the residual stack is the chunk's
    # blocks and the slice the backward reads one unit.
    h = s.dims.width
    unit = s.patterns.block_period or 1
    looped = s.chunk_blocks > unit
    one_unit = _ONE_BLOCK_WORK * unit
    work_set = s.tokens_mb * per_layer * ((s.chunk_blocks + unit) if looped else one_unit)
    if s.staged:  # v M chunk inputs (split over mp) + one unit's
        return s.v * s.tokens_live * h / s.wire_split + work_set
    if s.piped and s.selective:  # each micro-batch's kept matmul outputs, stashed
        return s.tokens_live * selective_kept_elems(s) * s.stage_blocks + work_set
    if s.piped:
        return _FTHENB_KEPT * s.tokens_live * per_layer * s.stage_blocks + work_set
    # one accumulation step's activations are live (tokens_live: all of them when A = 1)
    if s.remat_waits:  # each block's input, split over mp between blocks under SP
        # (measured, TinyLlama width 256 dp2 x mp4, 4 -> 12 scanned blocks: 131,072 B a
        # block with SP = b s h / 4, 524,288 B without, beside the gradients' stack)
        sp = s.layout.mp if s.workload.sequence_parallel else 1
        kept = s.tokens_live * h / sp * s.stage_blocks
        return kept + s.tokens_mb * per_layer * _ONE_BLOCK_WORK
    if s.selective_waits:  # the kept matmul outputs, one block's recomputation beside them
        kept = s.tokens_live * selective_kept_elems(s) * s.stage_blocks
        return kept + s.tokens_mb * per_layer * (_SCAN_WORK if s.scanned else _ONE_BLOCK_WORK)
    # no recompute, or recompute XLA:CPU schedules with the forward pass (outside a loop
    # it removes jax.checkpoint's barriers before scheduling; jfleet.recompute)
    layer_acts = s.tokens_live * per_layer * s.stage_blocks
    if s.scanned:  # matmul outputs kept, and the backward's working set beside them
        layer_acts = _SCANNED_KEPT * layer_acts + s.tokens_mb * per_layer * _SCAN_WORK
    return layer_acts


def activation_bytes(s: StepShape) -> int:
    """Bytes of activations (and loop-carried gradients) live between forward and backward."""
    h = s.dims.width
    outside = OUTSIDE_H_ELEMS * h + LOGIT_ELEMS * s.vocab / s.layout.mp
    activations = int((_layer_acts(s, per_layer_elems(s)) + s.head_tokens * outside) * s.act_bytes)
    if (s.piped or s.scanned) and not s.merges_in_backward:
        # the backward loop carries the stacked blocks' gradients, accumulated over its
        # iterations, while the residuals are live (split over the ZeRO axis when each
        # block reduce-scatters its own; merged into gradient accumulation's accumulator,
        # optimizer state, when the loop adds them there)
        activations += s.block_tp // s.layout.zero_degree if s.per_layer else s.block_tp
    if s.piped:
        # the stack holds its replica's whole input and outputs (forward), its output's
        # cotangents and its input's (backward), split over mp
        activations += int(2 * s.tokens_live * h / s.wire_split * s.act_bytes)
    return activations


def memory(s: StepShape) -> Memory:
    """Predicted bytes per device: resident state, gradients, gathered weights, activations."""
    stage = s.layout.zero_stage
    gathered = 0
    if stage >= 3 and s.per_layer:  # the blocks gathered one at a time in their loop
        # (in the dtype each layer computes in: StepShape.gather_wire)
        gathered = max(s.outside_tp, int(_PER_LAYER_GATHERED * s.one_block_tp * s.gather_wire))
    elif stage >= 3:
        gathered = s.outside_tp + (s.one_block_tp if s.remat_waits else s.block_tp)
    # the routed experts' share (0 without experts): split over ep (cost_moe)
    moments = OPTIMIZER_MOMENTS[s.workload.optimizer]
    e_params, e_optimizer, e_grads, e_gathered = expert_memory(s, moments)
    # Memory(...)'s every field, in order, set at once (cost_types.assembled)
    return assembled(
        Memory,
        {
            "params": (s.z_bytes if stage >= 3 else s.tp_bytes) + e_params,
            "optimizer": optimizer_bytes(s) + e_optimizer,
            "inputs": 2 * s.tokens_live * 4,  # one call's token ids and labels, int32
            "grads": gradient_bytes(s) + e_grads,
            "gathered": gathered + e_gathered,
            "activations": activation_bytes(s),
            # the whole local gradient beside the reduction's output (at fp32 where the
            # compiler reduces half-precision gradients in fp32)
            "grad_copies": 1 + s.param_wire if s.profile.whole_grad_temp and not s.per_layer else 1,
        },
    )


def optimizer_bytes(s: StepShape) -> int:
    """Optimizer state: the moments over the ZeRO shard (stage >= 1), the step count, for
    half-precision parameters fp32 moments and fp32 master copies (AMP O2,
    ``jfleet.amp.decorate``: the optimizer updates the masters), and under gradient
    accumulation the merged gradient (``jfleet.optim.gradient_merge``: an optax
    transformation, its accumulator is optimizer state)."""
    moments = OPTIMIZER_MOMENTS[s.workload.optimizer]
    if s.z_master:
        opt_mem = moments * s.z_fp32 + s.z_master
    else:  # fp32 parameters: the moments in their dtype
        opt_mem = moments * (s.z_bytes if s.layout.zero_stage >= 1 else s.tp_bytes)
    if moments:
        opt_mem += 4  # the step count
    if s.accumulate > 1:  # gradient merge's accumulator, placed as the optimizer state
        opt_mem += s.z_bytes if s.layout.zero_stage >= 1 else s.tp_bytes
    return opt_mem


def gradient_bytes(s: StepShape) -> int:
    """The local gradient the step holds at its end (see ``HardwareProfile.whole_grad_temp``).

    Where the compiler materialises it whole (XLA:CPU) it is every local gradient, twice
    with the reduction's output (``Memory.grad_copies``). Else it is reduce-scattered as
    it is produced: at ZeRO-2 / 3 the shard stays, with one block's gradient in flight.
    """
    if s.per_layer:  # the program reduce-scatters each block's gradient in its loop
        outside = s.outside_tp // s.layout.zero_degree if s.layout.zero_stage >= 3 else s.outside_tp
        if s.merges_in_backward:  # the blocks' shards go into the accumulator (optimizer)
            return outside + s.one_block_tp
        return outside + s.block_tp // s.layout.zero_degree + s.one_block_tp
    if s.profile.whole_grad_temp or s.layout.zero_stage < 2:
        return s.tp_bytes
    return s.tp_bytes // s.layout.zero_degree + s.one_block_tp


def loop_traffic_time(s: StepShape) -> float:
    """Seconds of the pipeline loops' memory traffic at the profile's memory bandwidth."""
    # measured on XLA:CPU to bound pipelined steps (issue 15; a scan over layers writes its
    # residuals in place): each residual a stage stashes for the backward loop is written
    # (dynamic-update-slice) and read (dynamic-slice) once per step; every tick reads the
    # stage's weights out of their stack in the forward pass, again in the backward (and
    # the recompute), and reads and writes the stacked gradients it adds into. 1F1B's
    # recompute keeps one micro-batch's residuals in a buffer each backward tick reuses,
    # not a stash of all M.
    stashed = 0.0
    if s.staged:
        stashed = s.v * s.tokens_live * s.dims.width / s.wire_split
    elif s.piped:
        kept = selective_kept_elems(s) if s.selective else _FTHENB_KEPT * per_layer_elems(s)
        stashed = s.tokens_live * kept * s.stage_blocks
    if not s.profile.loop_traffic:
        return 0.0
    weight_passes = 4 + int(s.layout.recompute or s.staged) if s.piped else 0
    loop_bytes = 2 * stashed * s.act_bytes + weight_passes * s.layout.num_microbatches * s.block_tp
    return loop_bytes / s.profile.memory_bandwidth

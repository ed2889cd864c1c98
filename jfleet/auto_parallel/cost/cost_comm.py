"""The cost model's communication terms: tensor parallel, gradient reduction, pipeline, sep.

Each function reads one :class:`~jfleet.auto_parallel.cost.step_shape.StepShape`, adds the
collective bytes it issues to ``coll`` (counted as :mod:`jfleet.testing.hlo` counts a
compiled step's) and returns its seconds; the formulas are in
:mod:`jfleet.auto_parallel.cost.cost_model`'s docstring. Every collective also pays the
profile's latency.

Example:
  >>> from jfleet.auto_parallel.cost.layout import Layout, Workload
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.auto_parallel.cost.step_shape import step_shape
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
  >>> s = step_shape(found, Workload(batch_size=16, seq_len=8), Layout(dp=8),
  ...                "cpu", devices_per_node=8)
  >>> coll = new_counts()
  >>> data_parallel_time(s, coll) > 0, coll["all_reduce"] == s.tp_bytes
  (True, True)
"""

from __future__ import annotations

from jfleet.auto_parallel.cost.memo import cached, cached_for
from jfleet.auto_parallel.cost.step_shape import StepShape, ring_bytes, stored_leaves
from jfleet.auto_parallel.cost.step_work import tp_reductions
from jfleet.mesh.topology import DP, EP, MP, PP, SEP, SHARDING

__all__ = [
    "COLLECTIVE_KINDS",
    "data_parallel_time",
    "exposed",
    "new_counts",
    "pipeline_time",
    "sequence_time",
    "tensor_parallel_time",
]

COLLECTIVE_KINDS = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "collective_permute",
    "all_to_all",
)


def new_counts() -> dict[str, float]:
    """Zero bytes of every collective kind."""
    return dict.fromkeys(COLLECTIVE_KINDS, 0.0)


def tensor_parallel_time(s: StepShape, coll: dict[str, float]) -> float:
    """``mp`` all-reduces of activations per block and micro-batch, and the embedding's / head's."""
    mp = s.layout.mp
    if mp <= 1:
        return 0.0
    ab, h, pp, m = s.act_bytes, s.dims.width, s.layout.pp, s.layout.num_microbatches
    act = s.tokens_mb * h * ab
    fwd, bwd = cached(
        s.patterns, ("tp_reductions", mp), lambda: tp_reductions(s.patterns, mp, s.specs)
    )
    # recompute runs the forward's all-reduces again in the backward pass. A pipeline
    # counts them on each of its M + P - 1 ticks: the compiled loop holds them at
    # every tick (jfleet.testing.hlo weights them by the trip count), bubble or not.
    passes = 2 if s.recompute else 1
    per_mb = s.chunk_blocks * (fwd * passes + bwd)  # a chunk per tick
    calls = (s.v * m + pp - 1 if s.piped else m) * s.accumulate
    n_mb = per_mb * calls
    roles = cached(s.patterns, ("roles",), lambda: {p.role for p in s.patterns.params})
    n_out = int("embedding" in roles) + int("head" in roles or bool(s.patterns.tied_head))
    out_bytes = n_out * s.head_tokens * h * ab
    stats = 2 * s.head_tokens * 4 if s.vocab else 0
    if s.workload.sequence_parallel:
        # Megatron's program (apply.sequence_dots): a reduce-scatter after each row
        # projection and for each column projection's input cotangent (where the
        # all-reduces were), an all-gather before each column projection's input (one per
        # row projection: the attention's and the MLP's) in every forward pass and of each
        # row output's cotangent; hlo counts the reduce-scatter's input and the
        # all-gather's output
        n_gather = s.chunk_blocks * fwd * (passes + 1) * calls
        coll["reduce_scatter"] += n_mb * act
        coll["all_gather"] += n_gather * act
        count = n_mb + n_gather
        wire = ring_bytes("reduce-scatter", n_mb * act, mp)
        wire += ring_bytes("all-gather", n_gather * act, mp)
    else:
        coll["all_reduce"] += n_mb * act
        count, wire = n_mb, ring_bytes("all-reduce", n_mb * act, mp)
    coll["all_reduce"] += out_bytes + stats
    count += n_out + (2 if stats else 0)
    wire += ring_bytes("all-reduce", out_bytes + stats, mp)
    return count * s.profile.collective_latency + wire / s.bandwidth(MP)


def data_parallel_time(s: StepShape, coll: dict[str, float]) -> float:
    """Gradient reduction over ``dp x sharding x sep`` and ZeRO's all-gathers, once a call.

    Under gradient accumulation every call reduces its gradients and runs the gathers
    (the engine's gradient merge is an optax transformation after the reduction, its
    update applied on the last call), so the step pays them ``accumulate`` times.
    """
    seconds, adds, once = _call_reduction(s)
    if s.accumulate == 1:
        for kind, nbytes in adds:  # as _one_call_reduction adds them, in order
            coll[kind] += nbytes
        return seconds
    for kind, nbytes in once.items():
        coll[kind] += s.accumulate * nbytes
    return s.accumulate * seconds


def _call_reduction(s: StepShape) -> tuple[float, tuple[tuple[str, float], ...], dict]:
    """(:func:`_one_call_reduction`'s seconds, the bytes it adds to the counts, in order,
    and their sums from zero), once a mesh, ZeRO setting, stage and program: the layouts of
    a mesh that differ in micro-batches, ``v`` or accumulation alone reduce alike."""
    lay = s.layout
    # (the mesh, ZeRO setting and stage size decide the stage's bytes and leaves,
    # step_shape._param_bytes; the profile and the compute dtype their wire bytes)
    key = ("call_reduction", s.sizes, s.devices_per_node, lay.zero_stage, lay.zero_spans_data)
    key += (s.stage_blocks, s.scanned, s.remat_waits, s.workload.act_bytes)

    def reduce() -> tuple[float, tuple[tuple[str, float], ...], dict]:
        adds: list[tuple[str, float]] = []
        seconds = _one_call_reduction(s, adds)
        once = new_counts()
        for kind, nbytes in adds:
            once[kind] += nbytes
        return seconds, tuple(adds), once

    return cached_for(s.patterns, s.profile, key, reduce)


def _one_call_reduction(s: StepShape, adds: list[tuple[str, float]]) -> float:
    """One call's gradient reduction and ZeRO gathers: its seconds; the collective bytes
    it moves appended to ``adds`` as (kind, bytes), in order."""
    lay = s.layout
    red = lay.data_degree * lay.sep
    # the parameters' bytes as their collectives move them (fp32 where the compiler runs
    # half-precision collectives in fp32)
    wire = s.param_wire
    grads, block_tp, outside_tp = s.tp_bytes * wire, s.block_tp * wire, s.outside_tp * wire
    lat = s.profile.collective_latency
    t_dp = 0.0
    if red <= 1:
        return t_dp
    data = (DP, SHARDING, SEP, EP)  # ep is a data axis (degree 1 without routed experts)
    if lay.zero_stage == 0:
        adds.append(("all_reduce", grads))
        return t_dp + lat + ring_bytes("all-reduce", grads, red) / s.bandwidth(*data)
    zeroed = grads
    if s.piped:
        # the pipelined blocks' weights enter the pipeline's shard_map (manual over dp and
        # sharding) replicated over the data axes, so their gradients leave it summed over
        # dp x sharding: one all-reduce, not ZeRO's reduce-scatter; only the embedding's
        # and the head's are reduced in the ZeRO layout
        zeroed = outside_tp
        adds.append(("all_reduce", block_tp))
        t_dp += lat + ring_bytes("all-reduce", block_tp, red) / s.bandwidth(*data)
    # ZeRO over sharding: reduce-scatter there, all-reduce the shards over dp x sep; over
    # every data rank (the distributed optimizer): one reduce-scatter over all of them
    zero_over = (DP, SHARDING, SEP) if lay.zero_spans_data else (SHARDING,)
    shard, bw_shard = lay.zero_degree, s.bandwidth(*zero_over)
    if s.profile.reduce_scatter_native:
        adds.append(("reduce_scatter", zeroed))
        t_dp += lat + ring_bytes("reduce-scatter", zeroed, shard) / bw_shard
    else:
        adds.append(("all_reduce", zeroed))
        t_dp += lat + ring_bytes("all-reduce", zeroed, shard) / bw_shard
    # the shards' all-reduce over the data ranks ZeRO leaves out (ep's too)
    rest = lay.ep if lay.zero_spans_data else lay.dp * lay.sep * lay.ep
    if rest > 1:
        adds.append(("all_reduce", zeroed / shard))
        rest_axes = (EP,) if lay.zero_spans_data else (DP, SEP, EP)
        t_dp += lat + ring_bytes("all-reduce", zeroed / shard, rest) / s.bandwidth(*rest_axes)
    # ZeRO's all-gathers (of the updated shards; at stage 3 of the parameters before use)
    # are one per parameter leaf, as the step holds them (stacked when the blocks are
    # scanned or pipelined): XLA combines all-reduces, not these (measured: 13
    # all-gathers scanned, 39 unrolled, TinyLlama 4 blocks)
    if lay.zero_stage >= 3 and s.per_layer:
        # each block gathers its weights in the forward loop and again in the backward's
        # (recomputed or not: the loop body saves matmul outputs, not gathered weights),
        # one all-gather per block parameter per iteration; the rest once
        outside_leaves, block_leaves = s.leaf_counts
        # (in the dtype each layer computes in: gather_wire)
        gathered = s.block_tp * s.gather_wire
        adds.append(("all_gather", outside_tp + 2 * gathered))
        t_dp += outside_leaves * lat + ring_bytes("all-gather", outside_tp, shard) / bw_shard
        t_dp += 2 * (block_leaves * lat + ring_bytes("all-gather", gathered, shard) / bw_shard)
        return t_dp
    gathers = 2 if (lay.zero_stage >= 3 and s.remat_waits) else 1
    adds.append(("all_gather", gathers * grads))
    leaves = stored_leaves(s.leaf_counts, s.stage_blocks, stacked=s.piped or s.scanned)
    t_dp += gathers * (leaves * lat + ring_bytes("all-gather", grads, shard) / bw_shard)
    return t_dp


def exposed(t_dp: float, s: StepShape, compute: float) -> float:
    """The part of the gradient reduction / ZeRO gathers not hidden under compute.

    ``HardwareProfile.comm_overlap`` of it runs under the compute the schedule leaves
    beside it: the backward pass (2/3 of the compute; the forward too for ZeRO-3's
    gathers), of the last micro-batch only in a pipeline (the reduction waits for the
    last gradients); under gradient accumulation each call's reduction overlaps its own
    backward.
    """
    overlap = s.profile.comm_overlap
    if not overlap or not t_dp:
        return t_dp
    share = 1.0 if s.layout.zero_stage >= 3 else 2 / 3
    window = compute * share / (s.v * s.layout.num_microbatches)
    return max(t_dp - overlap * window, t_dp * (1 - overlap))


def pipeline_time(s: StepShape, coll: dict[str, float]) -> float:
    """Point-to-point transfers between stages, and the stack's input / output over ``pp``."""
    pp = s.layout.pp
    if pp <= 1:
        return 0.0
    lat, bw_pp, ab, h = s.profile.collective_latency, s.bandwidth(PP), s.act_bytes, s.dims.width
    # every schedule: one forward loop and one backward loop of v M + P - 1 ticks, one
    # collective-permute of a micro-batch's b s h per tick and direction, split over mp
    # (Megatron's scatter / gather): 1 / mp of it crosses to the next stage, all-gathered
    # over mp where it is used; 1F1B's backward all-gathers its stashed input too (inside
    # the tick's cond: the compiled loop holds it on every tick, as jfleet.testing.hlo
    # counts it)
    ticks = (s.v * s.layout.num_microbatches + pp - 1) * s.accumulate  # over A calls
    act = s.tokens_mb * h * ab
    split = s.wire_split
    coll["collective_permute"] += 2 * ticks * act / split
    t_pp = 2 * ticks * (lat + act / split / bw_pp)
    if split > 1:
        gathers = ticks * (3 if s.staged else 2)
        coll["all_gather"] += gathers * act
        t_pp += gathers * (lat + ring_bytes("all-gather", act, split) / s.bandwidth(MP))
    # to_distributed's stand-in runs only the blocks pipelined. With the rows split over
    # pp it gathers its input over pp and reduce-scatters its output (and the reverse for
    # the cotangents): 2 all-gathers + 2 reduce-scatters of the local batch's b s h.
    # Otherwise the embedding and head run on every stage on the same values, and the
    # output and the input's cotangent are all-reduced over pp.
    # With mp each device gathers / sums its 1 / mp share over pp, and the stack's output
    # and its input's cotangent are all-gathered over mp after it (the code around the
    # stack runs whole).
    out = s.tokens_live * h * ab * s.accumulate  # A calls of tokens_live each
    if s.rows_over_pp:
        coll["all_gather"] += 2 * out / split
        coll["reduce_scatter"] += 2 * out / split
        t_pp += 4 * (lat + ring_bytes("all-gather", out / split, pp) / bw_pp)
    else:
        coll["all_reduce"] += 2 * out / split
        t_pp += 2 * (lat + ring_bytes("all-reduce", out / split, pp) / bw_pp)
    if split > 1:
        whole = out / pp if s.rows_over_pp else out
        coll["all_gather"] += 2 * whole
        t_pp += 2 * (lat + ring_bytes("all-gather", whole, split) / s.bandwidth(MP))
    return t_pp


def sequence_time(s: StepShape, coll: dict[str, float]) -> float:
    """``sep``: an all-gather of k and v per block forward, a reduce-scatter backward."""
    sep = s.layout.sep
    if sep <= 1 or not s.patterns.attention:
        return 0.0
    kv = s.tokens_mb * sep * 2 * s.dims.kv_dim / s.layout.mp * s.act_bytes
    n = s.stage_blocks * s.layout.num_microbatches * s.accumulate
    coll["all_gather"] += n * kv
    coll["reduce_scatter"] += n * kv
    lat = s.profile.collective_latency
    return 2 * n * (lat + ring_bytes("all-gather", kv, sep) / s.bandwidth(SEP))

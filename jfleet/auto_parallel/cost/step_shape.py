"""One layout's step, measured once: the quantities every cost term reads.

:func:`step_shape` computes, for one :class:`~jfleet.auto_parallel.search.layouts.Layout` of a
matched model, each parameter's ``mp`` spec and local bytes (once per candidate, with and
without the ZeRO split), the blocks one pipeline stage holds, the local tokens per step
and per micro-batch, and which program the step runs (pipelined, staged, scanned,
recompute waiting for the backward). The cost terms (:mod:`jfleet.auto_parallel.cost.cost_memory`,
:mod:`jfleet.auto_parallel.cost.cost_comm`, :func:`jfleet.auto_parallel.cost.cost_model.estimate`)
read only this.

Example:
  >>> from jfleet.auto_parallel.cost.layout import Layout, Workload
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
  >>> s = step_shape(found, Workload(batch_size=16, seq_len=8), Layout(dp=2, mp=4),
  ...                get_profile("cpu"), devices_per_node=8)
  >>> s.tokens_local, s.stage_blocks, s.piped
  (64, 2, False)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.cost.layout import Layout, Workload
from jfleet.auto_parallel.cost.memo import block_groups, cached, cached_for
from jfleet.auto_parallel.cost.profiles import HardwareProfile, get_profile
from jfleet.auto_parallel.cost.step_work import layers_and_norms
from jfleet.auto_parallel.match.attention_trace import scores_materialised
from jfleet.auto_parallel.match.patterns import ModelDims, ModelPatterns, ParamInfo
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import AXIS_NAMES

__all__ = ["StepShape", "group_bandwidth", "largest_stage_blocks", "ring_bytes", "step_shape"]
__all__ += ["stored_leaves"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShape:
    """What one layout's step holds and processes per device (see :func:`step_shape`).

    Attributes:
      patterns, workload, layout, profile: the inputs.
      devices_per_node: devices per node (intra- vs inter-node links).
      sizes: the layout's degrees in mesh order (``AXIS_NAMES``'; :meth:`bandwidth` reads them).
      links: :meth:`bandwidth`'s answers by group, shared by the layouts of one mesh, node
        size and profile (it is asked a few times a layout, of a few groups a mesh).
      specs: each parameter's ``mp`` spec at this layout, by path.
      leaf_counts: how many parameters one device's stage holds (blocks of stage 0
        first): (outside the blocks, in them).
      stage_blocks: decoder blocks per pipeline stage; norms: norms per layer.
      tp_bytes: local parameter bytes after the ``mp`` split; z_bytes: after ZeRO's too;
        tp_fp32: ``tp_bytes``' elements at 4 bytes.
      z_fp32: ``z_bytes``' elements at 4 bytes (fp32 optimizer state); z_master: those
        of half-precision parameters (their fp32 master copies under AMP).
      block_tp, outside_tp, one_block_tp: ``tp_bytes`` of the stage's blocks, of the
        rest, of one block.
      local_seqs, local_seq: sequences and tokens per sequence per device.
      tokens_local, tokens_mb, head_tokens: tokens per device per step, per
        micro-batch (pipeline or gradient accumulation), and those the embedding / head
        run on at once.
      tokens_live: tokens one call of the step processes (all of them, or one
        accumulation step's).
      accumulate: gradient-accumulation micro-batches (``Layout.accumulate_steps``).
      scores_materialised: whether the traced attention materialises its ``s x s``
        scores (:func:`~jfleet.auto_parallel.match.attention_trace.scores_materialised`).
      piped, staged, scanned, rows_over_pp, remat_waits, recompute: the program run
        (see the cost model's docstring); :attr:`per_layer` follows from them.
      selective: selective recompute (:attr:`~jfleet.auto_parallel.search.layouts.Layout.
        selective_recompute`); selective_waits: its recomputation waits for the backward
        pass (scanned or pipelined blocks, or a compiler that keeps ``jax.checkpoint``'s
        barriers).
      v: chunks per stage; chunk_blocks: blocks per chunk (the largest chunk's when the
        stages are uneven); even_stages: every stage holds as many blocks.
      vocab: the vocabulary the head's logits span (0 without a head).
    """

    patterns: ModelPatterns
    workload: Workload
    layout: Layout
    profile: HardwareProfile
    devices_per_node: int
    sizes: tuple[int, ...]
    links: dict[tuple[str, ...], float]
    specs: Mapping[str, P]
    leaf_counts: tuple[int, int]
    stage_blocks: int
    norms: int
    tp_bytes: int
    tp_fp32: int
    z_bytes: int
    z_fp32: int
    z_master: int
    block_tp: int
    outside_tp: int
    one_block_tp: int
    local_seqs: int
    local_seq: int
    tokens_local: int
    tokens_mb: int
    head_tokens: int
    tokens_live: int
    accumulate: int
    scores_materialised: bool
    piped: bool
    staged: bool
    scanned: bool
    rows_over_pp: bool
    remat_waits: bool
    recompute: bool
    selective: bool
    selective_waits: bool
    v: int
    chunk_blocks: float
    even_stages: bool = True
    vocab: int

    @classmethod
    def _assembled(cls, shared: Mapping[str, Any], **own: Any) -> StepShape:
        """``StepShape(**shared, **own)``, its fields set at once: the dataclass's frozen
        ``__init__`` sets each of them through ``object.__setattr__``, over half of
        :func:`step_shape`'s time, which planning runs once a layout (148,417 times for
        the 1T model on 3072 GPUs). Every field is given (tests check it)."""
        shape = object.__new__(cls)
        fields = shape.__dict__
        fields.update(shared)
        fields.update(own)
        return shape

    @property
    def per_layer(self) -> bool:
        """ZeRO-2 / 3 on scanned blocks: each block gathers its weights inside the loop
        (ZeRO-3) and reduce-scatters its gradient there (:mod:`jfleet.parallel.
        layer_gather`), so no whole gathered stack or whole-size gradient exists."""
        return self.scanned and self.layout.zero_stage >= 2

    @property
    def merges_in_backward(self) -> bool:
        """Gradient accumulation's merge inside the scanned blocks' backward loop
        (:mod:`jfleet.parallel.merged_backward`): per-layer ZeRO with full recompute, fp32
        parameters and no fp16 loss scaling; the blocks' gradient shards are added into the
        accumulator (optimizer state) as the loop makes them, so the step keeps no stacked
        gradient of its own."""
        return (
            self.per_layer
            and self.accumulate > 1
            and self.recompute
            and not self.selective
            and self.z_master == 0
            and self.workload.dtype != "float16"
        )

    @property
    def dims(self) -> ModelDims:
        """The model's sizes."""
        return self.patterns.dims

    @property
    def wire_split(self) -> int:
        """How many ways a pipeline stage's stashed input and its sends are split: ``mp``
        when it divides the stage input's sequence or width (the stand-in stashes each
        micro-batch's input and sends the activation split over ``mp``, all-gathered
        inside the node, :class:`~jfleet.parallel.pipeline_parts.TensorSplit`; not beside
        ``sep``, which splits the sequence already), else 1."""
        mp = self.layout.mp
        if not self.piped or mp <= 1 or self.layout.sep > 1:
            return 1
        return mp if self.workload.seq_len % mp == 0 or self.dims.width % mp == 0 else 1

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element (fp32 where the compiler computes half precision in
        fp32: ``HardwareProfile.half_precision_fp32``)."""
        if self.profile.half_precision_fp32:
            return max(self.workload.act_bytes, 4)
        return self.workload.act_bytes

    @property
    def gather_wire(self) -> float:
        """Bytes a per-layer (FSDP) gather of a block's parameters moves per byte of them:
        each is gathered in the dtype its layer computes in
        (:func:`jfleet.parallel.layer_gather.compute_dtypes`; AMP O1 halves fp32
        parameters' gathers), at fp32 where the compiler runs half-precision collectives
        in fp32 (``HardwareProfile.half_precision_fp32``)."""
        if not self.tp_bytes:
            return 1.0
        itemsize = 4 if self.profile.half_precision_fp32 else min(self.workload.act_bytes, 4)
        return self.tp_fp32 / self.tp_bytes * itemsize / 4

    @property
    def param_wire(self) -> float:
        """Bytes a parameter's collective moves per byte of the parameter: 1, or for
        half-precision parameters 2 where the compiler runs their collectives in fp32
        (``HardwareProfile.half_precision_fp32``)."""
        if self.profile.half_precision_fp32 and self.tp_bytes:
            return self.tp_fp32 / self.tp_bytes
        return 1.0

    def bandwidth(self, *group: str) -> float:
        """Bytes/s of the links a group of mesh axes spans (:func:`group_bandwidth`)."""
        try:
            return self.links[group]
        except KeyError:
            bw = self.links[group] = _links(
                self.profile, _span(group, self.sizes), self.devices_per_node
            )
            return bw


def _local_elems(spec: P, shape: Sequence[int], sizes: Mapping[str, int]) -> int:
    n = 1
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for dim, entry in zip(shape, entries, strict=True):
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        n *= dim // math.prod(sizes[a] for a in axes)
    return n


def group_bandwidth(
    group: Sequence[str], degrees: Mapping[str, int], profile: HardwareProfile, per_node: int
) -> float:
    """Bytes/s per device of a ring collective over a group of mesh axes.

    Inside one node: the intra-node links. A group that spans nodes runs its ring's
    node-crossing hops on the network, one NIC a device (rail-optimised nodes, as DGX
    and HGX clusters are built): NCCL gives each of the group's ``m`` devices in a node a
    ring channel of its own, each carrying ``1/m`` of the bytes through its own NIC, so
    the ring moves ``m`` times one device's inter-node bandwidth, up to the intra-node
    links' (NCCL's measured multi-node bus bandwidth on 8-GPU nodes is the node's NIC
    total, not one NIC's). A data-parallel group beside ``mp8`` in each node has ``m = 1``;
    FSDP over whole nodes has ``m = 8``.

    Example:
      >>> h100 = get_profile("h100")
      >>> group_bandwidth(("sharding",), {**dict.fromkeys(AXIS_NAMES, 1), "sharding": 64},
      ...                 h100, 8) / h100.inter_node_bandwidth
      8.0
      >>> group_bandwidth(("dp",), {**dict.fromkeys(AXIS_NAMES, 1), "dp": 8, "mp": 8},
      ...                 h100, 8) / h100.inter_node_bandwidth
      1.0
    """
    span = _span(tuple(group), tuple(degrees[a] for a in AXIS_NAMES))
    return _links(profile, span, per_node)


def _links(profile: HardwareProfile, span: tuple[int, int], per_node: int) -> float:
    """:func:`group_bandwidth` of a group spanning ``span = (devices, members)``."""
    devices, members = span
    if devices <= per_node:
        return profile.intra_node_bandwidth
    per_node_members = max(1, members * per_node // devices)
    return min(profile.intra_node_bandwidth, per_node_members * profile.inter_node_bandwidth)


@functools.lru_cache(maxsize=4096)
def _span(group: tuple[str, ...], sizes: tuple[int, ...]) -> tuple[int, int]:
    """How many consecutive devices (row-major mesh order) a group of axes spans, and
    how many of them are the group's members."""
    span = members = 1
    for i, axis in enumerate(AXIS_NAMES):
        if axis in group and sizes[i] > 1:
            span = max(span, math.prod(sizes[i + 1 :]) * sizes[i])
            members *= sizes[i]
    return span, members


def stored_leaves(counts: tuple[int, int], blocks: int, *, stacked: bool) -> int:
    """How many arrays hold a stage's parameters (``counts``: outside and in its blocks):
    one per parameter, or one per block parameter kind when the blocks are stacked (a
    scan over layers, a pipeline stage)."""
    outside, in_blocks = counts
    return outside + (in_blocks // max(blocks, 1) if stacked and blocks else in_blocks)


def ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends in a ring ``kind`` collective of ``nbytes`` over ``n``."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * nbytes
    if kind == "collective-permute":
        return nbytes
    return (n - 1) / n * nbytes


def _stage_bytes(
    params: tuple[ParamInfo, ...], specs: Mapping[str, P], layout: Layout
) -> tuple[int, ...]:
    """Local bytes of ``params`` after ``mp``, after ZeRO too, of those in blocks; and after
    ZeRO at 4 bytes an element (fp32 optimizer state), of the fp32 masters of half ones."""
    deg = layout.degrees
    zero = None
    if layout.zero_stage:
        abstract = AbstractMesh(tuple(deg.values()), AXIS_NAMES)
        zero = Placement(mesh=abstract, zero_stage=layout.zero_stage, zero_axis=layout.zero_axes)
    tp_bytes = z_bytes = block_tp = z_fp32 = z_master = tp_fp32 = 0
    for p in params:
        itemsize = jnp.dtype(p.dtype).itemsize
        spec = specs[p.path]
        tp_elems = _local_elems(spec, p.shape, deg)
        zspec = zero.zero_spec(spec, p.shape) if zero is not None else spec
        z_elems = tp_elems if zero is None else _local_elems(zspec, p.shape, deg)
        tp_bytes += tp_elems * itemsize
        tp_fp32 += 4 * tp_elems
        z_bytes += z_elems * itemsize
        block_tp += tp_elems * itemsize if p.block is not None else 0
        z_fp32 += 4 * z_elems
        z_master += 4 * z_elems if itemsize < 4 else 0  # fp32 masters of half params
    return tp_bytes, z_bytes, block_tp, z_fp32, z_master, tp_fp32


def param_specs(patterns: ModelPatterns, mp: int) -> Mapping[str, P]:
    """Each parameter's spec at ``mp``, by path (computed once per model and degree)."""
    return cached(
        patterns, ("specs", mp), lambda: {p.path: p.spec_for(mp) for p in patterns.params}
    )


def _param_bytes(
    patterns: ModelPatterns, layout: Layout, sizes: tuple[int, ...], stage_blocks: int
) -> dict:
    """The stage's parameters, their specs and their local bytes with and without ZeRO
    (once a mesh, ZeRO setting and stage size; ``sizes``: the layout's degrees in mesh order).
    """
    key = ("bytes", layout.zero_stage, layout.zero_spans_data, sizes, stage_blocks)
    return cached(patterns, key, lambda: _stage_params(patterns, layout, sizes, stage_blocks))


def _stage_params(
    patterns: ModelPatterns, layout: Layout, sizes: tuple[int, ...], stage_blocks: int
) -> dict:
    """:func:`_param_bytes` computed. Identical blocks
    (:func:`~jfleet.auto_parallel.cost.memo.block_groups`) are summed over block 0 and
    multiplied by the stage's blocks; those sums are kept once a mesh and ZeRO setting,
    whatever the stage size (uneven pipeline splits give a mesh many)."""
    specs = param_specs(patterns, layout.mp)
    outside, first, uniform = block_groups(patterns)
    if uniform:
        # (ZeRO's split is the same at every stage: the stage only picks what it splits)
        out_b, one_b = cached(
            patterns,
            ("block_bytes", layout.zero_stage > 0, layout.zero_spans_data, sizes),
            lambda: (_stage_bytes(outside, specs, layout), _stage_bytes(first, specs, layout)),
        )
        totals = tuple(o + stage_blocks * b for o, b in zip(out_b, one_b, strict=True))
        counts = (len(outside), len(first) * stage_blocks)
    else:
        mine = tuple(p for p in patterns.params if p.block is None or p.block < stage_blocks)
        totals = _stage_bytes(mine, specs, layout)
        in_blocks = sum(p.block is not None for p in mine)
        counts = (len(mine) - in_blocks, in_blocks)
    tp_bytes, z_bytes, block_tp, z_fp32, z_master, tp_fp32 = totals
    return {
        "specs": specs,
        "tp_fp32": tp_fp32,
        "z_fp32": z_fp32,
        "z_master": z_master,
        "tp_bytes": tp_bytes,
        "z_bytes": z_bytes,
        "block_tp": block_tp,
        "outside_tp": tp_bytes - block_tp,
        "one_block_tp": block_tp // stage_blocks if stage_blocks else 0,
        "leaf_counts": counts,
    }


def largest_stage_blocks(blocks: int, period: int, pp: int, v: int = 1) -> int:
    """Blocks one pipeline stage holds, the largest stage's when ``pp x v`` does not divide
    the blocks: its ``v`` chunks of ``ceil(units / (pp v))`` units of ``period`` blocks (the
    stack is padded to it, and its padded slots compute and are discarded).

    Example:
      >>> largest_stage_blocks(70, 1, 12), largest_stage_blocks(7, 1, 4, 2)
      (6, 2)
    """
    if pp <= 1 or not blocks:
        return blocks
    units = blocks // period
    return v * -(-units // (pp * v)) * period


#: A layout's degrees in mesh order.
_DEGREES = operator.attrgetter(*AXIS_NAMES)


def _model_facts(patterns: ModelPatterns) -> tuple[int, int, int, bool, int, bool]:
    """What every layout's step reads of the model: its layers and norms per layer, the
    block period, whether its attention materialises the scores, the head's vocabulary
    (0 without a tied head) and whether its blocks can run as one scan (one stack)."""
    layers, norms = layers_and_norms(patterns)
    return (
        layers,
        norms,
        patterns.block_period or 1,
        scores_materialised(patterns),
        patterns.dims.vocab if patterns.tied_head is not None else 0,
        bool(patterns.blocks) and len(patterns.stacks) <= 1,  # several stacks run unrolled
    )


def step_shape(
    patterns: ModelPatterns,
    workload: Workload,
    layout: Layout,
    profile: HardwareProfile | str | None = None,
    *,
    devices_per_node: int,
    scan_layers: bool = True,
) -> StepShape:
    """Measures one layout's step once for every cost term (arguments as ``estimate``'s)."""
    profile = get_profile(profile)
    pp, m = layout.pp, layout.num_microbatches
    layers, norms, period, scores, vocab, one_stack = cached(
        patterns, ("step_shape_model",), lambda: _model_facts(patterns)
    )
    sizes = _DEGREES(layout)
    stage_blocks = largest_stage_blocks(layers, period, pp, layout.num_virtual_stages)
    data = layout.data_degree
    local_seqs = workload.batch_size // data
    local_seq = workload.seq_len // layout.sep
    tokens_local = local_seqs * local_seq
    accumulate = layout.accumulate_steps
    piped = pp > 1
    # 1F1B's program (VPP: the same over v interleaved chunks); FThenB with recompute too;
    # selective recompute runs FThenB's stashing program under either schedule
    selective = layout.selective_recompute
    staged = piped and not selective and (layout.schedule in ("1F1B", "VPP") or layout.recompute)
    rows_over_pp = piped and (workload.batch_size // accumulate) % (data * pp) == 0
    scanned = not piped and scan_layers and one_stack
    return StepShape._assembled(
        _param_bytes(patterns, layout, sizes, stage_blocks),
        patterns=patterns,
        workload=workload,
        layout=layout,
        profile=profile,
        devices_per_node=devices_per_node,
        sizes=sizes,
        links=cached_for(patterns, profile, ("links", sizes, devices_per_node), dict),
        stage_blocks=stage_blocks,
        norms=norms,
        local_seqs=local_seqs,
        local_seq=local_seq,
        tokens_local=tokens_local,
        tokens_mb=tokens_local // (m * accumulate),
        head_tokens=(tokens_local // pp if rows_over_pp else tokens_local) // accumulate,
        tokens_live=tokens_local // accumulate,
        accumulate=accumulate,
        scores_materialised=scores,
        piped=piped,
        staged=staged,
        scanned=scanned,
        rows_over_pp=rows_over_pp,
        remat_waits=layout.recompute and (piped or scanned or profile.remat_barriers_kept),
        recompute=layout.recompute or staged,
        selective=selective,
        selective_waits=selective and (scanned or piped or profile.remat_barriers_kept),
        v=layout.num_virtual_stages,
        chunk_blocks=stage_blocks / layout.num_virtual_stages,
        even_stages=layers % (period * pp * layout.num_virtual_stages) == 0,
        vocab=vocab,
    )

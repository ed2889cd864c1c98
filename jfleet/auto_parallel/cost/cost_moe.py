"""What an MoE layer's token exchange costs: the all-to-all buffers and their time.

jfleet's MoE layer (:func:`jfleet.parallel.moe.layer.moe`, Paddle's ``MoELayer``) sends each
device's tokens to their experts in a fixed buffer of ``E x C x D`` elements (``C`` slots an
expert: GShard's capacity for the device's ``T`` tokens, or ``T`` when dropless) through one
all-to-all over the expert axis, and the experts' outputs back through a second of the same
size; the backward pass runs the two again with the cotangents. Each device keeps ``1 /
ep`` of a buffer and sends the rest over the links the ``ep`` group spans
(:meth:`~jfleet.auto_parallel.cost.step_shape.StepShape.bandwidth`,
:func:`~jfleet.auto_parallel.cost.step_shape.group_bandwidth`). The ragged path (GPU, TPU)
sends only the routed rows: ``T * k`` of them when no expert overflows, the load-balanced
case; ``imbalance`` scales that for a skewed router.

A traced model's own einsum dispatch (:attr:`MoESpec.dispatch
<jfleet.auto_parallel.match.moe_spec.MoESpec>` ``"einsum"``: every expert on every token,
or a one-hot capacity dispatch) keeps its code. ``to_distributed`` runs it over ``ep`` with
each MoE layer's tokens gathered over the ``ep`` group
(:mod:`jfleet.auto_parallel.apply.expert_tokens`). That costs an all-gather of the group's
tokens and an all-reduce of the layer's output, and the same two again in the backward pass
(:func:`ring_exchange_time`). Each device computes its ``E / ep`` experts on ``ep`` times
its tokens: the traced rows a token (``rows_per_token``) times its own tokens, as at
``ep = 1``. A traced ``ragged_dot`` dispatch (``"ragged"``) runs the same ring in a
``shard_map`` (:mod:`jfleet.auto_parallel.apply.expert_rows`), its output reduce-scattered
rather than all-reduced, each device computing its experts' rows of the group's token
copies.

Example:
  >>> moe_exchange_bytes(tokens=64, width=16, k=2, experts=8, capacity_factor=None)
  32768
  >>> moe_exchange_bytes(tokens=64, width=16, k=2, experts=8, capacity_factor=1.0)
  8192
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.cost.memo import cached, cached_for
from jfleet.auto_parallel.cost.step_shape import StepShape, ring_bytes
from jfleet.auto_parallel.match.patterns import ModelPatterns
from jfleet.mesh.topology import DP, EP, MP, SEP, SHARDING
from jfleet.parallel.moe.layer import choose_path
from jfleet.parallel.moe.routing import expert_capacity

__all__ = [
    "CPU_RAGGED_PRODUCTS",
    "LOAD_IMBALANCE",
    "RING_ROW_BUFFERS",
    "SLOT_OVER_EP",
    "SLOT_TENSORS",
    "MoEExchange",
    "moe_exchange",
    "moe_exchange_bytes",
]
__all__ += ["expert_memory", "expert_reduction_time", "moe_elems", "moe_exchange_time"]
__all__ += ["moe_flops", "moe_rows", "moe_stage_layers", "ring_exchange_time"]


def moe_exchange_bytes(
    *,
    tokens: int,
    width: int,
    k: int,
    experts: int,
    capacity_factor: float | None,
    act_bytes: int = 4,
    groups: int = 1,
    ragged: bool = False,
    imbalance: float = 1.0,
) -> int:
    """Bytes of one all-to-all buffer of an MoE layer on one device (the dispatch; the
    combine moves as many): ``E x C x D`` elements on the fixed-buffer path, ``T x k x D``
    routed rows (times ``imbalance``) on the ragged path.

    Args:
      tokens: the device's tokens ``T`` (``groups`` groups of ``T / groups``).
      width: the token width ``D``.
      k: experts a token takes.
      experts: ``E``.
      capacity_factor: GShard's factor, or None for dropless (``C = T / groups``).
      act_bytes: bytes an element.
      groups: token groups, each with its own capacity.
      ragged: the ragged path (only routed rows move).
      imbalance: the ragged path's load-imbalance factor (1: balanced).
    """
    if ragged:
        return int(tokens * k * width * act_bytes * imbalance)
    per_group = tokens // groups
    capacity = expert_capacity(per_group, k, experts, capacity_factor)
    return groups * experts * capacity * width * act_bytes


@dataclasses.dataclass(frozen=True)
class MoEExchange:
    """An MoE layer's all-to-alls in one training step, per device.

    Attributes:
      count: all-to-alls (dispatch and combine, forward and backward: 4).
      buffer_bytes: bytes of each buffer.
      wire_bytes: bytes each device sends in all of them (``(ep - 1) / ep`` of each).
      seconds: their time at ``bandwidth`` with ``latency`` each.
    """

    count: int
    buffer_bytes: int
    wire_bytes: float
    seconds: float


def moe_exchange(
    buffer_bytes: int, ep: int, bandwidth: float, latency: float = 0.0, *, backward: bool = True
) -> MoEExchange:
    """The step's MoE all-to-alls of one layer: two forward, two more in the backward pass.

    Example:
      >>> x = moe_exchange(8192, ep=4, bandwidth=1e9)
      >>> x.count, x.wire_bytes
      (4, 24576.0)
    """
    count = 4 if backward else 2
    wire = count * ring_bytes("all-to-all", buffer_bytes, ep)
    return MoEExchange(
        count, buffer_bytes, wire, count * latency + wire / bandwidth if ep > 1 else 0.0
    )


# ------------------------------------------------------------------ a layout's MoE terms
#: The busiest ``ep`` rank's routed rows over the mean, where experts are split over ``ep``
#: (ragged path: it computes and receives that many; with ``ep = 1`` every device holds
#: every expert and computes its own ``T k`` rows, balanced or not). A stated assumption,
#: not a fit: routers trained with GShard's / Switch's load-balancing loss (coefficient
#: 1e-2, Mixtral's and Megatron-Core's default) or DeepSeek-V3's bias balancing keep the
#: per-expert load near the mean; Switch Transformer (Fedus et al., JMLR 2022, Sec. 2.2)
#: sizes its default capacity 1.25 x the mean to absorb the imbalance, so 1.1 is taken
#: for a group of experts (an ``ep`` rank holds ``E / ep`` of them, whose loads average).
#: The capacity factor caps it where one is set.
LOAD_IMBALANCE = 1.1
#: Elements per routed row the expert MLP keeps for the backward pass, x its hidden
#: (gated: gate, up, silu's two parts, the product; as a dense MLP's ``MLP_ELEMS``).
_EXPERT_ELEMS = {True: 5, False: 3}


def moe_stage_layers(s: StepShape) -> float:
    """MoE layers on the largest pipeline stage (its blocks' share of the MoE layers)."""
    return _stage_experts(s)[0]


def _stage_experts(s: StepShape) -> tuple[float, float, float]:
    """(:func:`moe_stage_layers`, the routed experts' elements on one device, the
    routers'), once a model, stage size and ``ep``: every MoE term of a layout reads them,
    and the layouts of a stage size and ``ep`` (every ``M``, ``v``, accumulation, ZeRO
    stage and recompute of their meshes) share them."""
    key = ("moe_stage", s.stage_blocks, s.layout.ep, _expert_mp(s))
    return cached(s.patterns, key, lambda: _stage_experts_of(s))


def _stage_experts_of(s: StepShape) -> tuple[float, float, float]:
    moe, h = s.patterns.moe, s.dims.width
    blocks = len(s.patterns.blocks) or s.dims.layers or 1
    layers = moe.layers * s.stage_blocks / blocks
    experts = layers * moe.experts // s.layout.ep * moe.one_expert(h) / _expert_mp(s)
    return layers, experts, layers * h * moe.experts


def _einsum(s: StepShape) -> bool:
    """A traced model's own dispatch applying whole experts in its products: an einsum one
    (whole expert stacks), or a list of expert modules (each on every token)."""
    return s.patterns.moe.dispatch in ("einsum", "list")


def _shard_mapped(s: StepShape) -> bool:
    """A traced dispatch run in :mod:`jfleet.auto_parallel.apply.expert_rows`'s
    ``shard_map``: its output reduce-scattered over ``ep``, its experts' gradients
    all-reduced over the data axes."""
    return _own_ragged(s) or (s.patterns.moe.dispatch == "list" and s.layout.ep > 1)


def _ring(s: StepShape) -> bool:
    """A traced model's own dispatch run with each MoE layer's tokens gathered over ``ep``
    (an einsum or a ``ragged_dot`` dispatch, a per-token gather over ``ep`` > 1: MaxText's
    ring of experts)."""
    return s.patterns.moe.dispatch in ("einsum", "list", "ragged") or _own_ragged(s)


def _own_ragged(s: StepShape) -> bool:
    """A traced dispatch run as ``ragged_dot`` products of each rank's experts' rows: a
    ``ragged_dot`` one, and a per-token gather over ``ep`` > 1
    (:mod:`jfleet.auto_parallel.apply.expert_rows`)."""
    dispatch = s.patterns.moe.dispatch
    return dispatch == "ragged" or (dispatch == "gather" and s.layout.ep > 1)


def _expert_mp(s: StepShape) -> int:
    """What ``mp`` divides each expert by: a traced einsum dispatch's experts are read as
    projection pairs and split on their hidden dimension like a dense MLP; jfleet's
    experts stay whole over ``mp`` (its layer splits the tokens instead)."""
    mp = s.layout.mp
    if mp == 1 or not _einsum(s):
        return 1
    return cached(s.patterns, ("expert_mp", mp), lambda: _experts_split_at(s.patterns, mp))


def _experts_split_at(patterns: ModelPatterns, mp: int) -> int:
    experts = [p for p in patterns.routed if p.role != "router"]
    return mp if experts and all(p.spec_for(mp) != P() for p in experts) else 1


def _call_tokens(s: StepShape) -> int:
    """Tokens one device's MoE layer routes per call (micro-batch): jfleet's layer splits
    its tokens over every mesh axis (:func:`jfleet.parallel.moe.layer.moe`'s default token
    axes), ``mp`` included; a traced dispatch keeps the device's tokens."""
    if _ring(s):
        return max(s.tokens_mb, 1)
    return max(s.tokens_mb // s.layout.mp, 1)


def _ragged(s: StepShape) -> bool:
    return choose_path(s.profile.platform) == "ragged"


def _imbalance(s: StepShape) -> float:
    """The busiest rank's rows over the mean: :data:`LOAD_IMBALANCE` with ``ep`` > 1,
    capped by the capacity factor."""
    cap = s.patterns.moe.capacity_factor
    imb = LOAD_IMBALANCE if s.layout.ep > 1 and not _einsum(s) else 1.0
    return min(imb, cap) if cap is not None else imb


def moe_rows(s: StepShape) -> float:
    """Rows one device's experts compute per MoE layer and call.

    The fixed-buffer (dense) path, :func:`jfleet.parallel.moe.exchange.dense_exchange`,
    runs the expert matmuls over every slot of the ``E x C`` buffers it receives, padding
    included (``C`` = GShard's capacity of the ``T`` tokens, ``T`` when dropless: ``E / k``
    times the routed rows). The ragged path (GPU, TPU) runs ``ragged_dot`` over the routed
    rows only: ``T k`` times the busiest rank's imbalance. A traced einsum dispatch runs
    its traced rows a token times ``T`` (its ``E / ep`` experts on the ``ep`` group's
    tokens), over ``mp`` where its experts are split there. A traced ``ragged_dot`` dispatch
    computes the routed rows of its ``E / ep`` experts among the ``ep`` group's on GPU and
    TPU, as the ragged path; XLA:CPU computes a ``ragged_dot`` as one product per group
    over every row (measured: 9.0 x the routed rows' FLOPs at 8 groups), so there each
    rank's ``E / ep`` groups over the ``ep x T x k`` rows: ``T k E``.
    """
    moe, t = s.patterns.moe, _call_tokens(s)
    if _einsum(s):
        return moe.rows_per_token * t / _expert_mp(s)
    if _own_ragged(s) and not _ragged(s):
        return t * moe.top_k * moe.experts
    if _ragged(s):
        return t * moe.top_k * _imbalance(s)
    return moe.experts * expert_capacity(t, moe.top_k, moe.experts, moe.capacity_factor)


def _rerun(s: StepShape) -> bool:
    """Whether the experts' forward (and exchange) runs again in the backward pass: under
    recompute, and under selective recompute too (``dots_with_no_batch_dims_saveable``
    saves no expert product: a batched einsum or a ``ragged_dot``)."""
    return s.recompute or s.selective


def moe_flops(s: StepShape) -> float:
    """Dot FLOPs of the stage's routed experts and routers per device per step (forward,
    two backward products each; recompute, selective too, runs the forward again): 0
    without experts."""
    if s.patterns.moe is None:
        return 0.0
    calls = s.layout.num_microbatches * s.accumulate
    # one call's forward, once a micro-batch size, mp, ep and platform
    key = ("moe_fwd", s.tokens_mb, s.layout.mp, s.layout.ep, s.profile.platform)
    fwd = cached(s.patterns, key, lambda: _call_flops(s))
    passes = 3 + (1 if _rerun(s) else 0)
    return passes * fwd * calls * moe_stage_layers(s)


def _call_flops(s: StepShape) -> float:
    """One MoE layer's forward dot FLOPs per device and call: its experts' and router's (a
    traced dispatch's router runs on the tokens gathered over ``ep``)."""
    moe, h = s.patterns.moe, s.dims.width
    routed = _call_tokens(s) * (s.layout.ep if _ring(s) else 1)
    return 2 * moe_rows(s) * moe.one_expert(h) + 2 * routed * h * moe.experts


#: ``[T, E, C]`` tensors a traced one-hot capacity dispatch keeps a MoE layer (its dispatch
#: and combine tensors and what their products keep). Read off the compiled step of the
#: ``qwen3_moe`` style with ``dispatch="capacity"`` at ep8 with 2048 tokens
#: (``benchmarks/moe_exchange.py``, ``capacity_memory``: 3.0).
SLOT_TENSORS = 3
#: Of those, the share GSPMD splits over ``ep`` alone, not over the ranks that split the
#: capacity rule's tokens (``dp``, ``sharding``): the running position of each token in
#: its expert's slots is a cumulative sum over every token. Read off the dp8 row (0.72);
#: the table's other ``dp`` rows are held out.
SLOT_OVER_EP = 0.75


#: ``[M, F]`` buffers (``M`` the ``ep`` group's token copies) a traced ``ragged_dot``
#: dispatch over ``ep`` > 1 keeps a MoE layer beyond the expert MLP's own: the rows moved
#: to the front of each restricted product and back
#: (:mod:`jfleet.auto_parallel.apply.expert_rows`). Read off the ``qwen3_moe`` style's
#: ragged dispatch at ep8 with 1024 tokens (``benchmarks/moe_exchange.py``,
#: ``ragged_memory``: 2.1, :data:`CPU_RAGGED_PRODUCTS` read first); the other rows are held
#: out.
RING_ROW_BUFFERS = 2
#: ``[E / ep, M, F]`` products XLA:CPU keeps a MoE layer for a traced ``ragged_dot``
#: dispatch: it computes a ``ragged_dot`` as one product per group over every row (GPU and
#: TPU run grouped products over the routed rows: none). Read off the dp8 row at 1024
#: tokens (3.3).
CPU_RAGGED_PRODUCTS = 3


def _ragged_extra(s: StepShape) -> float:
    """Elements per row of the ``ep`` group's token copies beyond the expert MLP's that a
    traced ``ragged_dot`` dispatch keeps: :data:`RING_ROW_BUFFERS` ``[M, F]`` buffers with
    ``ep`` > 1, and on XLA:CPU :data:`CPU_RAGGED_PRODUCTS` ``[E / ep, M, F]`` products
    (``E / ep`` elements a row of each)."""
    moe, ep = s.patterns.moe, s.layout.ep
    extra = RING_ROW_BUFFERS if ep > 1 else 0
    if not _ragged(s):
        extra += CPU_RAGGED_PRODUCTS * moe.experts / ep
    return extra * moe.expert_ffn


def _slot_elems(s: StepShape) -> float:
    """Elements per device token of a traced capacity dispatch's ``[T, E, C]`` one-hot
    tensors (0 for any other dispatch): ``T`` the layer's tokens over every data rank, as
    the code's capacity rule sees them, so ``T x E x C = rows_per_token x T^2``; split over
    the data ranks but :data:`SLOT_OVER_EP` of a tensor split over ``ep`` alone. Quadratic
    in the tokens, as GShard's dispatch without groups is."""
    moe = s.patterns.moe
    if not _einsum(s) or moe.rows_per_token >= moe.experts:  # every expert: no slots
        return 0.0
    lay = s.layout
    data = lay.dp * lay.sharding * lay.ep
    tokens = s.tokens_mb * data  # per device token: T x E x C / data / (T / data)
    split = (SLOT_TENSORS - SLOT_OVER_EP) + SLOT_OVER_EP * data / lay.ep
    return split * moe.rows_per_token * tokens


def moe_elems(s: StepShape, *, kept: bool = False) -> float:
    """Activation elements per device token and decoder layer the routed experts keep
    (their MLP's per routed row, the dispatched and combined rows, the router's logits
    and probabilities), averaged over the layers: 0 without experts. ``kept``: what
    selective recompute keeps of them (the dispatched and combined rows and the router's;
    the experts run again). A traced ``ragged_dot`` dispatch over ``ep`` holds every row of
    the ``ep`` group's token copies (``ep x k`` a token), the other ranks' rows as zeros."""
    moe = s.patterns.moe
    if moe is None:
        return 0.0
    per_row = (0 if kept else _EXPERT_ELEMS[moe.gated] * moe.expert_ffn) + 2 * s.dims.width
    if _own_ragged(s):
        rows_per_token = float(moe.top_k * s.layout.ep)
        per_row += 0 if kept else _ragged_extra(s)
    else:
        rows_per_token = moe_rows(s) / max(s.tokens_mb, 1)
    router = 2 * moe.experts / s.layout.mp
    share = moe.layers / (len(s.patterns.blocks) or s.dims.layers or 1)
    slots = 0.0 if kept else _slot_elems(s)
    return (rows_per_token * per_row + router + slots) * share


def _expert_elems(s: StepShape) -> tuple[float, float]:
    """(routed experts' elements on one device, routers'), of the stage's MoE layers."""
    _, experts, routers = _stage_experts(s)
    return experts, routers


def _itemsize(s: StepShape) -> int:
    """Bytes an element of the experts: the dtype of the model's largest block kernel (found
    once a model: a scan of every parameter, asked several times a layout)."""
    return cached(s.patterns, ("expert_itemsize",), lambda: _largest_itemsize(s.patterns))


def _largest_itemsize(patterns: ModelPatterns) -> int:
    kernels = [p for p in patterns.params if p.block is not None] or list(patterns.params)
    largest = max(kernels, key=lambda p: p.size, default=None)
    return jnp.dtype(largest.dtype).itemsize if largest is not None else 4


def _gathered_bytes(s: StepShape) -> float:
    """Bytes of the stage's local experts as ZeRO-3 gathers them: in the compute dtype
    (fp32 where the compiler runs half-precision collectives in fp32)."""
    size = _itemsize(s)
    wire = 4 if s.profile.half_precision_fp32 else min(s.workload.act_bytes, size)
    return _expert_elems(s)[0] * wire


def expert_memory(s: StepShape, moments: int) -> tuple[int, int, int, int]:
    """(parameters, optimizer state, gradient, gathered) bytes of the routed experts and
    routers on one device: each MoE layer's experts split over ``ep`` (``[E, ...]``
    kernels placed ``P('ep')``, whole over ``mp``), the routers replicated; ZeRO splits
    them over its axes as it does the rest (state at stage >= 1, parameters at 3, the
    gradient at 2 / 3 where gradients are reduce-scattered as produced); half-precision
    experts keep fp32 moments and masters. At ZeRO-3 one MoE layer's experts are gathered
    at a time. ``(0, 0, 0, 0)`` without experts."""
    if s.patterns.moe is None:
        return 0, 0, 0, 0
    lay, profile = s.layout, s.profile
    key = ("moe_memory", s.stage_blocks, lay.ep, _expert_mp(s), lay.zero_stage, lay.zero_degree)
    key += (moments,)
    key += (profile.whole_grad_temp, profile.half_precision_fp32, s.workload.act_bytes)
    return cached(s.patterns, key, lambda: _expert_memory(s, moments))


def _expert_memory(s: StepShape, moments: int) -> tuple[int, int, int, int]:
    """:func:`expert_memory`'s bytes (what its key holds decides them)."""
    experts, routers = _expert_elems(s)
    elems = experts + routers
    size, stage, zero = _itemsize(s), s.layout.zero_stage, s.layout.zero_degree
    params = elems * size / (zero if stage >= 3 else 1)
    state_elems = elems / (zero if stage >= 1 else 1)
    half = size < 4
    optimizer = moments * state_elems * (4 if half else size) + (4 * state_elems if half else 0)
    whole = s.profile.whole_grad_temp or stage < 2 or _shard_mapped(s)  # summed whole
    grads = elems * size / (1 if whole else zero)
    layers = max(moe_stage_layers(s), 1)
    gathered = _gathered_bytes(s) / layers if stage >= 3 else 0
    return int(params), int(optimizer), int(grads), int(gathered)


def expert_reduction_time(s: StepShape, coll: dict[str, float]) -> float:
    """The routed experts' gradient reduction: each expert shard is held by every rank of
    ``dp x sharding x sep x mp`` (the layer splits its tokens over ``mp`` too), so its
    gradient is all-reduced there (with ZeRO: reduce-scattered over the ZeRO axis,
    all-reduced over the rest, the updated shard all-gathered; at ZeRO-3 each MoE layer's
    experts gathered in the forward and again in the backward pass, one all-gather a
    layer); once a call, as the rest. The routers' (``h x E`` a layer) are left out. 0
    without experts. A traced dispatch keeps each device's tokens whole over ``mp``: no sum
    over ``mp``; a ``ragged_dot`` / gather one (its ``shard_map``) all-reduces the gradient
    over the data axes at every ZeRO stage (measured at sharding8, ZeRO-2 and 3: no
    reduce-scatter), whole on each device."""
    if s.patterns.moe is None:
        return 0.0
    lay, profile = s.layout, s.profile
    # one call's reduction, once a mesh, ZeRO setting, stage size and wire (the layouts of
    # a mesh differ in micro-batches, v, accumulation and recompute, which it ignores)
    key = ("moe_reduction", s.sizes, s.devices_per_node, lay.zero_stage, lay.zero_spans_data)
    key += (s.stage_blocks, s.param_wire, s.workload.act_bytes)
    t, grads, gathered, shard, rest = cached_for(
        s.patterns, profile, key, lambda: _one_call_expert_reduction(s)
    )
    if t is None:  # no group to reduce over
        return 0.0
    if not lay.zero_stage:
        coll["all_reduce"] += s.accumulate * grads
        return s.accumulate * t
    coll["all_reduce" if _shard_mapped(s) else "reduce_scatter"] += s.accumulate * grads
    coll["all_gather"] += s.accumulate * grads
    if lay.zero_stage >= 3:  # each MoE layer's experts gathered forward and backward
        coll["all_gather"] += s.accumulate * 2 * gathered
    if rest > 1 and not _shard_mapped(s):
        coll["all_reduce"] += s.accumulate * grads / shard
    return s.accumulate * t


def _one_call_expert_reduction(s: StepShape) -> tuple[float | None, float, float, int, int]:
    """(seconds of one call's expert-gradient reduction, or None without a group; the
    gradient's bytes, one MoE layer's gathered bytes, the ZeRO degree, the ranks beside it)."""
    lay, lat = s.layout, s.profile.collective_latency
    grads = _expert_elems(s)[0] * _itemsize(s) * s.param_wire
    # a traced dispatch keeps each device's tokens whole over mp (it computes its experts,
    # or their mp split, for all of them): no sum over mp
    axes = (DP, SHARDING, SEP) if _ring(s) else (DP, SHARDING, SEP, MP)
    group = lay.dp * lay.sharding * lay.sep * (1 if _ring(s) else lay.mp)
    if group <= 1:
        return None, grads, 0.0, 1, 1
    if not lay.zero_stage:
        bw = s.bandwidth(*axes)
        return lat + ring_bytes("all-reduce", grads, group) / bw, grads, 0.0, 1, 1
    shard = lay.zero_degree
    zero_bw = s.bandwidth(*((DP, SHARDING, SEP) if lay.zero_spans_data else (SHARDING,)))
    if _shard_mapped(s):  # the shard_map sums the gradient over its data axes: an all-reduce
        t = 2 * lat + ring_bytes("all-reduce", grads, group) / s.bandwidth(*axes)
        t += ring_bytes("all-gather", grads, shard) / zero_bw
    else:
        t = 2 * lat + (ring_bytes("reduce-scatter", grads, shard) * 2) / zero_bw
    gathered = 0.0
    if lay.zero_stage >= 3:
        gathered, layers = _gathered_bytes(s), moe_stage_layers(s)
        t += 2 * (layers * lat + ring_bytes("all-gather", gathered, shard) / zero_bw)
    rest = group // shard
    if rest > 1 and not _shard_mapped(s):
        rest_axes = (MP,) if lay.zero_spans_data else (DP, SEP, MP)
        t += lat + ring_bytes("all-reduce", grads / shard, rest) / s.bandwidth(*rest_axes)
    return t, grads, gathered, shard, rest


def moe_exchange_time(s: StepShape, coll: dict[str, float]) -> float:
    """The stage's MoE all-to-alls per device per step: dispatch and combine forward and
    backward (:func:`moe_exchange`; again forward where the experts are recomputed) per MoE
    layer and call, of :func:`moe_exchange_bytes` buffers (ragged on GPU / TPU, with the
    busiest rank's imbalance), at the bandwidth of the links the ``ep`` group spans
    (:func:`~jfleet.auto_parallel.cost.step_shape.group_bandwidth`). 0 without experts or
    with ``ep = 1``."""
    if s.patterns.moe is None or s.layout.ep <= 1:
        return 0.0
    if _ring(s):
        return ring_exchange_time(s, coll)
    # one layer's all-to-alls of a call, once a mesh and micro-batch size
    key = ("moe_a2a", s.sizes, s.devices_per_node, s.tokens_mb, s.act_bytes)
    buffer, one = cached_for(s.patterns, s.profile, key, lambda: _one_exchange(s))
    passes = (one.count + (2 if _rerun(s) else 0)) / one.count
    times = moe_stage_layers(s) * s.layout.num_microbatches * s.accumulate * passes
    coll["all_to_all"] += times * one.count * buffer
    return times * one.seconds


def _one_exchange(s: StepShape) -> tuple[int, MoEExchange]:
    """(the buffer's bytes, :func:`moe_exchange` of it) of one MoE layer and call."""
    moe, ep = s.patterns.moe, s.layout.ep
    buffer = moe_exchange_bytes(
        tokens=_call_tokens(s), width=s.dims.width, k=moe.top_k, experts=moe.experts,
        capacity_factor=moe.capacity_factor, act_bytes=s.act_bytes, ragged=_ragged(s),
        imbalance=_imbalance(s),
    )  # fmt: skip
    return buffer, moe_exchange(buffer, ep, s.bandwidth(EP), s.profile.collective_latency)


def ring_exchange_time(s: StepShape, coll: dict[str, float]) -> float:
    """A traced dispatch's token exchange over ``ep`` per device per step: per MoE layer
    and call, the layer's input all-gathered over the ``ep`` group and its output summed
    there (``ep x T x D`` elements each), and in the backward pass the output's cotangent
    all-gathered and the input's summed (again forward where the experts are recomputed);
    at the bandwidth the ``ep`` group spans. 0 with ``ep = 1``.

    The sums of an einsum dispatch (sharding constraints, GSPMD's choice) are all-reduces on
    XLA:CPU (measured); a ``ragged_dot`` dispatch (:mod:`jfleet.auto_parallel.apply.
    expert_rows`, a ``shard_map``) reduce-scatters them: half the bytes on the wire.
    """
    ep = s.layout.ep
    if ep <= 1:
        return 0.0
    gathered = ep * _call_tokens(s) * s.dims.width * s.act_bytes
    calls = moe_stage_layers(s) * s.layout.num_microbatches * s.accumulate
    sums = 2 + (1 if _rerun(s) else 0)  # a layer and call: forward, backward, recompute
    # a scanned block keeps its products alone (jax.checkpoint, dots_saveable): the
    # backward pass gathers the tokens again (measured: 3 all-gathers a layer, 2 sums)
    gathers = sums + (1 if s.scanned and not _rerun(s) else 0)
    summed = "reduce-scatter" if _shard_mapped(s) else "all-reduce"
    coll["all_gather"] += calls * gathers * gathered
    coll[summed.replace("-", "_")] += calls * sums * gathered
    bw, lat = s.bandwidth(EP), s.profile.collective_latency
    gather = lat + ring_bytes("all-gather", gathered, ep) / bw
    return calls * (gathers * gather + sums * (lat + ring_bytes(summed, gathered, ep) / bw))

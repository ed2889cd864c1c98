"""What one training step of a layout computes per device: products, activations, reductions.

The cost model (:mod:`jfleet.auto_parallel.cost.cost_model`) turns these counts into memory,
collective bytes and time. Here: the dot FLOPs of the traced products under a layout
(:func:`step_flops`), which parameters ``mp`` splits (:func:`split_set`,
:func:`split_degrees`, :func:`kv_groups`), the tensor-parallel all-reduces a block issues
(:func:`tp_reductions`), the decoder layers and their norms (:func:`layers_and_norms`),
and the activation elements autodiff keeps per token (the ``*_ELEMS`` constants, see the
cost model's docstring for where they come from).

Example:
  >>> from jfleet.auto_parallel.cost.layout import Layout, Workload
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
  >>> layers_and_norms(found)
  (2, 2)
  >>> fwd, step, outside = step_flops(found, Workload(batch_size=8, seq_len=8), Layout(dp=8))
  >>> step == 3 * fwd
  True
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.cost.layout import Layout, Workload
from jfleet.auto_parallel.match.attention_trace import fused_attention_flops
from jfleet.auto_parallel.match.patterns import COLUMN_ROLES, ROW_ROLES, ModelPatterns

__all__ = [
    "ATTN_Q_ELEMS",
    "ATTN_SCORE_ELEMS",
    "LOGIT_ELEMS",
    "MLP_ELEMS",
    "NORM_ELEMS",
    "OUTSIDE_H_ELEMS",
    "attention_core_flops",
    "kv_groups",
    "layers_and_norms",
    "split_degrees",
    "split_set",
    "step_flops",
    "tp_reductions",
]

NORM_ELEMS = 4  # per norm, x h
ATTN_Q_ELEMS = 4  # x q_dim
ATTN_SCORE_ELEMS = 2  # x heads x seq
MLP_ELEMS = {"swiglu": 5, "gelu": 3}  # x hidden
OUTSIDE_H_ELEMS = 5  # embedding output + final norm, x h
LOGIT_ELEMS = 4  # x vocab / mp


def layers_and_norms(patterns: ModelPatterns) -> tuple[int, int]:
    """(layers, norms per layer): the repeated blocks, or one layer of whatever matched."""
    # norms of the model width (q / k norms over head_dim are part of the attention's)
    width = (patterns.dims.width,)
    norms = {
        p.path.rsplit(".", 1)[0]
        for p in patterns.params
        if p.role == "norm" and tuple(p.shape) == width
    }
    if patterns.blocks:
        layers = len(patterns.blocks)
        if len(patterns.stacks) > 1:  # stacks differ: the norms of all blocks, per block
            held = {p.path.rsplit(".", 1)[0] for p in patterns.params if p.block is not None}
            return layers, round(len(held & norms) / layers)
        first = {p.path.rsplit(".", 1)[0] for p in patterns.params if p.block == 0}
        return layers, len(first & norms)
    if patterns.attention or patterns.mlp:
        return 1, max(len(norms) - 1, 0)
    return 0, 0


def _specs(patterns: ModelPatterns, mp: int, specs: Mapping[str, P] | None) -> Mapping[str, P]:
    """Each parameter's spec at ``mp``: ``specs`` when the caller computed them already."""
    return specs if specs is not None else {p.path: p.spec_for(mp) for p in patterns.params}


def split_set(
    patterns: ModelPatterns, mp: int, specs: Mapping[str, P] | None = None
) -> frozenset[tuple[str, int]]:
    """``(path, dim)`` of every parameter split over ``mp`` at this degree.

    ``specs`` (here and below): each parameter's ``spec_for(mp)`` by path, when the
    caller has them (the cost model computes them once per layout).
    """
    if mp <= 1:
        return frozenset()
    specs = _specs(patterns, mp, specs)
    return frozenset(
        (p.path, p.split_dim)
        for p in patterns.params
        if p.split_dim is not None and specs[p.path] != P()
    )


def kv_groups(
    patterns: ModelPatterns, mp: int, specs: Mapping[str, P] | None = None
) -> dict[str, int]:
    """``{path: gcd(kv heads, mp)}`` for k / v kernels kept whole at ``mp`` (> 1 groups)."""
    specs = _specs(patterns, mp, specs)
    out = {}
    for p in patterns.params:
        if p.role in ("k", "v", "kv") and p.kind == "kernel" and p.split_dim is not None:
            g = math.gcd(p.units, mp)
            if specs[p.path] == P() and g > 1:
                out[p.path] = g
    return out


def split_degrees(
    patterns: ModelPatterns, mp: int, specs: Mapping[str, P] | None = None
) -> tuple[int, int]:
    """How many ways ``mp`` splits the attention's and the MLP's activations (1 or ``mp``)."""
    specs = _specs(patterns, mp, specs)
    attn = mlp = 1
    for p in patterns.params:
        if p.kind == "kernel" and specs[p.path] != P():
            if p.role in ("q", "qk", "qkv"):
                attn = mp
            elif p.role in ("up", "gate_up", "gate"):
                mlp = mp
    return attn, mlp


def tp_reductions(
    patterns: ModelPatterns, mp: int, specs: Mapping[str, P] | None = None
) -> tuple[float, float]:
    """All-reduces per block: forward (one per split row), backward (one per split column);
    with several stacks (an encoder-decoder) the mean over every block of every stack."""
    specs = _specs(patterns, mp, specs)
    first = 0 if patterns.blocks else None
    several = len(patterns.stacks) > 1  # stacks differ: every block's, per block
    kernels = [
        p
        for p in patterns.params
        if p.kind == "kernel"
        and (p.block is not None if several else p.block == first)
        and specs[p.path] != P()
    ]
    rows = sum(p.role in ROW_ROLES for p in kernels)
    columns = sum(p.role in COLUMN_ROLES for p in kernels)
    if several:
        return rows / len(patterns.blocks), columns / len(patterns.blocks)
    return rows, columns


def step_flops(
    patterns: ModelPatterns,
    workload: Workload,
    layout: Layout,
    specs: Mapping[str, P] | None = None,
) -> tuple[float, ...]:
    """Per-device dot FLOPs of one step: (blocks' forward, blocks' step, outside's step).

    Each traced product is scaled from the traced batch to the workload's (attention
    products with the square of the sequence), counted forward plus one backward product
    per operand needing a gradient, and divided by the data axes and by ``mp`` only when a
    parameter split over ``mp`` splits it. The blocks' numbers are for all blocks (the
    caller divides by ``pp``); without a trace, ``6 x`` the kernels' elements per token.
    """
    data = layout.data_degree * layout.sep
    if not patterns.dots:
        kernels = sum(p.size for p in patterns.params if p.kind != "table" and len(p.shape) >= 2)
        inside = sum(p.size for p in patterns.params if p.block is not None and len(p.shape) >= 2)
        per = 2 * workload.tokens / data
        return per * inside, 3 * per * inside, 3 * per * (kernels - inside)
    split = split_set(patterns, layout.mp, specs)
    grouped = kv_groups(patterns, layout.mp, specs)
    batch, seq = patterns.traced_tokens or (1, 1)
    scale = workload.tokens / (batch * seq)
    fwd_blocks = step_blocks = step_outside = 0.0
    for d in patterns.dots:
        f = d.flops * scale * (workload.seq_len / seq if d.attention else 1.0) / data
        if d.param in grouped:
            # k / v kept whole where mp cuts their kv heads: XLA computes on each rank the
            # kv heads its q heads need (gcd(kv heads, mp) groups) forward and for the
            # input's gradient, the weight's whole gradient on every rank
            g = grouped[d.param]
            fwd_blocks += f / g if d.block is not None else 0.0
            step = f / g + f + f / g * (d.grads - 1)
            if d.block is None:
                step_outside += step
            else:
                step_blocks += step
            continue
        if d.splits & split:
            f /= layout.mp
        step = f * (1 + d.grads)
        if d.block is None:
            step_outside += step
        else:
            fwd_blocks += f
            step_blocks += step
    fused = fused_attention_flops(patterns, workload.tokens / data, workload.seq_len)
    if fused:  # a fused attention's products, split over mp with the heads
        fused /= split_degrees(patterns, layout.mp, specs)[0]
        fwd_blocks += fused
        step_blocks += 3 * fused
    return fwd_blocks, step_blocks, step_outside


def attention_core_flops(
    patterns: ModelPatterns,
    workload: Workload,
    layout: Layout,
    specs: Mapping[str, P] | None = None,
) -> float:
    """Per-device forward FLOPs of the blocks' attention cores (scores and values, no
    weights): what selective recompute runs again in the backward pass (all blocks; the
    caller divides by ``pp``).

    >>> import numpy as np
    >>> from jfleet.auto_parallel.match.patterns import match_patterns
    >>> from jfleet.models.llama import TinyLlama
    >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2),
    ...                        np.zeros((2, 8), np.int32))
    >>> attention_core_flops(found, Workload(batch_size=8, seq_len=8), Layout(dp=8))
    16384.0
    """
    data = layout.data_degree * layout.sep
    split = split_set(patterns, layout.mp, specs)
    batch, seq = patterns.traced_tokens or (1, 1)
    scale = workload.tokens / (batch * seq) * workload.seq_len / seq / data
    out = sum(
        d.flops * scale / (layout.mp if d.splits & split else 1)
        for d in patterns.dots
        if d.attention and d.block is not None
    )
    fused = fused_attention_flops(patterns, workload.tokens / data, workload.seq_len)
    return out + fused / split_degrees(patterns, layout.mp, specs)[0]

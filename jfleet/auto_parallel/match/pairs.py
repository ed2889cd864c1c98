"""Column / row pairs and their role names, read from a traced model.

:func:`pairs` groups the edges of a :class:`~jfleet.auto_parallel.match.dataflow.Trace` into
Megatron pairs: a row (a projection whose contracted input dimension is reached by other
projections' outputs) with the column projections feeding it, the dimension each is split on
and the units a split must not cut. :func:`attention_roles` and :func:`mlp_roles` name them
(q / k / v / qk / kv / qkv / o; gate / up / gate_up / down), :func:`bias_splits` says how the
biases added to their outputs are split.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jfleet.auto_parallel.match.dataflow import trace_model
  >>> mlp = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.gelu,
  ...                      nnx.Linear(16, 8, rngs=nnx.Rngs(1)))
  >>> trace = trace_model(mlp, jnp.zeros((2, 4, 8)))
  >>> (pair,) = pairs(trace, set())
  >>> trace.path(pair.row), pair.row_dim, {trace.path(p): d for p, d in pair.producers.items()}
  ('layers.2.kernel', 0, {'layers.0.kernel': (1, 16)})
  >>> sorted(mlp_roles(trace, pair).values())
  ['down', 'up']
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable

from jfleet.auto_parallel.match.dataflow import Trace

__all__ = [
    "Pair",
    "attention_roles",
    "bias_splits",
    "contracted_size",
    "mlp_roles",
    "name_hint",
    "pairs",
]

_Q_HINTS = ("q", "query", "wq", "q_proj", "q_einsum", "to_q", "q_lin")
_K_HINTS = ("k", "key", "wk", "k_proj", "to_k", "k_lin")


def name_hint(name: str, hints: Iterable[str]) -> bool:
    """Whether ``name`` is, starts with or ends in ``_`` + one of ``hints`` (case-insensitive).

    >>> name_hint("q_proj", ("q",)), name_hint("wq", ("q",))
    (True, False)
    """
    name = name.lower()
    return any(name == h or name.endswith("_" + h) or name.startswith(h) for h in hints)


@dataclasses.dataclass
class Pair:
    """A row projection with the columns feeding it (parameter indices of the trace).

    Attributes:
      row: the consumer; split on ``row_dim`` (its contracted input dimension).
      row_dim: that dimension.
      units: the units reaching it (heads, hidden features).
      producers: ``{column: (dim, units)}``: each producer's split output dimension.
      attention: the producers meet in attention scores or values.
    """

    row: int
    row_dim: int
    units: int
    producers: dict[int, tuple[int, int]]  # producer -> (dim, units)
    attention: bool


def pairs(trace: Trace, exclude: set[int]) -> list[Pair]:
    """Column / row pairs: each row (a consumer of tagged dims) with the producers feeding it.

    ``exclude``: parameters that are no pair's member (embedding tables, the LM head).
    """
    edges_in = [e for e in trace.edges if e.producer not in exclude and e.consumer not in exclude]
    consumers = {e.consumer for e in edges_in}
    by_row: dict[int, list] = collections.defaultdict(list)
    for e in edges_in:
        if e.producer not in consumers:
            by_row[e.consumer].append(e)
    in_attention = set()
    for lhs, rhs in trace.score_sides:
        in_attention |= lhs | rhs
    for side in trace.value_sides:
        in_attention |= side
    taken: set[int] = set()
    groups = []
    for row in sorted(by_row, key=lambda i: trace.paths[i]):
        edges = by_row[row]
        fed: dict[int, set[int]] = collections.defaultdict(set)
        for e in edges:
            if e.producer not in taken:
                fed[e.consumer_dim].add(e.producer)
        if not fed:
            continue
        dim = max(sorted(fed), key=lambda d: len(fed[d]))
        producers: dict[int, tuple[int, int]] = {}
        for e in edges:
            if e.consumer_dim != dim or e.producer in taken:
                continue
            prev = producers.get(e.producer)
            if prev is None:
                producers[e.producer] = (e.producer_dim, e.units)
            elif prev[0] == e.producer_dim:
                producers[e.producer] = (prev[0], min(prev[1], e.units))
        taken |= set(producers)
        units = max(u for _, u in producers.values())
        groups.append(Pair(row, dim, units, producers, bool(set(producers) & in_attention)))
    return groups


def free_size(trace: Trace, i: int) -> int:
    """Elements of parameter ``i``'s output per position: the product of its free dims."""
    return math.prod(trace.shapes[i][d] for d in trace.free.get(i, ()))


def contracted_size(trace: Trace, i: int) -> int:
    return math.prod(trace.shapes[i][d] for d in trace.contracted.get(i, ()))


def attention_roles(trace: Trace, group: Pair) -> dict[int, str]:
    """q / k / v / qk / kv / qkv for the producers, o for the row.

    A producer feeding both the scores and the values is ``kv`` (``qkv`` when it is on
    both sides of the scores); one feeding only the values is ``v``; of those feeding only
    the scores, q and k are told apart by name (``q_proj``, ``query``, ``wq``, ...), then by
    units (k has the fewer under grouped-query attention), then by side (q on the left).
    """
    lhs = set().union(*(a for a, _ in trace.score_sides)) if trace.score_sides else set()
    rhs = set().union(*(b for _, b in trace.score_sides)) if trace.score_sides else set()
    val = set().union(*trace.value_sides) if trace.value_sides else set()
    score_only = [
        u for p, (_, u) in group.producers.items() if (p in lhs or p in rhs) and p not in val
    ]
    most = max(score_only, default=0)
    roles: dict[int, str] = {group.row: "o"}
    for p, (_, units) in group.producers.items():
        both = p in lhs and p in rhs
        if (p in lhs or p in rhs) and p in val:
            roles[p] = "qkv" if both else "kv"
        elif both:
            roles[p] = "qk"
        elif p in val:
            roles[p] = "v"
        elif p in lhs or p in rhs:
            name = str(trace.paths[p][-2]) if len(trace.paths[p]) > 1 else ""
            if name_hint(name, _K_HINTS) and not name_hint(name, ("kv",)):
                roles[p] = "k"
            elif name_hint(name, _Q_HINTS) and not name_hint(name, ("qkv",)):
                roles[p] = "q"
            elif units < most:
                roles[p] = "k"
            else:
                roles[p] = "q" if p in lhs else "k"
        else:
            roles[p] = "gate"
    return roles


def mlp_roles(trace: Trace, group: Pair) -> dict[int, str]:
    producers = sorted(group.producers, key=lambda i: trace.paths[i])
    roles: dict[int, str] = {group.row: "down"}
    if len(producers) == 1:
        (p,) = producers
        # twice the row's hidden features (per expert, for kernels matched batch-wise)
        experts = max(1, trace.batched.get(group.row, 1))
        gated = free_size(trace, p) > contracted_size(trace, group.row) * experts
        roles[p] = "gate_up" if gated else "up"
        return roles
    gates = [
        p
        for p in producers
        if any((p in a and na) or (p in b and nb) for a, na, b, nb in trace.gates)
    ]
    gate = gates[0] if len(gates) == 1 else producers[0]
    for p in producers:
        roles[p] = "gate" if (p == gate and len(producers) == 2) else "up"
    return roles


def bias_splits(trace: Trace, split: dict[int, tuple[int, int]]) -> dict[int, tuple]:
    """``{bias: (owner, dim or None, units)}`` for biases added to a projection's output."""
    out: dict[int, tuple] = {}
    for b, entries in trace.biases.items():
        # a bias on attention scores meets q's and k's tags: split it like the most units (q)
        owned = [
            (-split[tag.param][1], bdim, tag)
            for bdim, tag in sorted(entries)
            if tag.param in split and split[tag.param][0] == tag.dim
        ]
        if owned:
            units, bdim, tag = min(owned)
            out[b] = (tag.param, bdim, -units)
        else:
            owners = sorted({tag.param for _, tag in entries})
            if len(owners) == 1:
                out[b] = (owners[0], None, 0)
    return out

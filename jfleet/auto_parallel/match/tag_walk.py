"""How a projection's output dimensions travel through a traced program: the walk's rules.

A projection (a ``dot_general`` with a parameter on one side) tags the dimensions of its output
that come from the kernel's free dimensions (:class:`Tag`). :class:`Walk` runs a jaxpr's
equations and moves the tags through each primitive: reshapes split and merge them
(:func:`reshape_groups`), transposes and broadcasts move them, elementwise work keeps them, a
residual sum or a slice ends them, and a projection contracting a tagged dimension records an
:class:`Edge`. Every product is recorded as a :class:`Dot`. The entry point that traces a model
and runs the walk is :func:`jfleet.auto_parallel.match.dataflow.trace_model`.

Example:
  >>> reshape_groups((2, 8, 32), (2, 8, 4, 8))
  [([0], [0]), ([1], [1]), ([2], [2, 3])]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["EMPTY", "Dot", "Edge", "Tag", "Val", "Walk", "const_val", "reshape_groups"]


@dataclasses.dataclass(frozen=True, order=True)
class Tag:
    """A dimension carrying projection ``param``'s output dimension ``dim``, in ``units``
    contiguous units (heads, hidden features) that a split must not cut.

    ``inner``: the dimension is the inner part of a split of that output dimension
    (``[heads] -> [kv_heads, group]``: the group part), which a contiguous split of the
    projection's dimension does not split on its own; merged back under its outer part
    (``[kv_heads, group] -> [heads]``) the units multiply again. ``raw``: a 2-D kernel's
    output dimension not yet reshaped (``heads * head_dim`` flattened): its first split is
    into units and their insides (``[heads, head_dim]``), so it leaves no inner part.
    """

    param: int
    dim: int
    units: int
    inner: bool = False
    raw: bool = False


@dataclasses.dataclass(frozen=True)
class Edge:
    """Projection ``producer``'s output dim reaches ``consumer``'s contracted input dim."""

    producer: int
    producer_dim: int
    consumer: int
    consumer_dim: int
    units: int


@dataclasses.dataclass(frozen=True)
class Dot:
    """One product of the forward pass.

    Attributes:
      flops: forward FLOPs (2 x output elements x contracted size), loop trips included.
      param: the parameter on one side (a projection), or None (two activations).
      splits: ``(param, dim)`` pairs: when that parameter is split over ``mp`` on that
        dimension, this product is split too.
      grads: operands that need a gradient (the backward pass computes one product each).
      last: the projections the operands came from most recently (for block attribution).
      scoped: traced inside the walk's marked name scope (:class:`Walk`'s ``scope``: the
        reference models' platform-chosen attention, fused on a GPU).
    """

    flops: int
    param: int | None
    splits: frozenset[tuple[int, int]]
    grads: int
    last: frozenset[int]
    scoped: bool = False


@dataclasses.dataclass(frozen=True)
class Val:
    tags: tuple[frozenset, ...]
    bcast: tuple[bool, ...]
    view: tuple[Tag | None, ...] | None = None  # a view of one parameter, dim by dim
    act: bool = False  # depends on the model's inputs
    grad: bool = False  # depends on a parameter
    last: frozenset = frozenset()
    score: bool = False  # an attention score / probability
    nonlin: str = ""  # the first nonlinearity since the last projection ("": none)


EMPTY: frozenset = frozenset()
_NONLINEAR = frozenset(
    {"exp", "exp2", "tanh", "logistic", "erf", "erfc", "max", "log", "log1p", "sin", "cos"}
)
_REDUCTIONS = frozenset(
    {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_and"}
)
_CUMULATIVE = frozenset({"cumsum", "cummax", "cummin", "cumprod", "cumlogsumexp"})
_ADDS = frozenset({"add", "sub", "add_any"})


def const_val(ndim: int) -> Val:
    return Val(tags=(EMPTY,) * ndim, bcast=(True,) * ndim)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()) or ())


def reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pairs of dimension groups of two shapes of one array whose sizes multiply equally.

    >>> reshape_groups((2, 8, 32), (2, 8, 4, 8))
    [([0], [0]), ([1], [1]), ([2], [2, 3])]
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            groups.append(([i], [j] if j < len(b) and b[j] == 1 else []))
            j += 1 if j < len(b) and b[j] == 1 else 0
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            break
        ii, jj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ii.append(i)
                pa *= a[i]
                i += 1
            elif j < len(b):
                jj.append(j)
                pb *= b[j]
                j += 1
            else:
                break
        groups.append((ii, jj))
    return groups


def _retag(tags: frozenset, size: int, inner: bool | None = None) -> frozenset:
    return frozenset(
        Tag(t.param, t.dim, math.gcd(t.units, size), t.inner if inner is None else inner, t.raw)
        for t in tags
    )


def _split_tags(tags: frozenset, outer: int, inner: int) -> tuple[frozenset, frozenset]:
    """Tags of a dimension split into ``[outer, inner]``: the outer part keeps them (units
    as many as fit), the inner part carries the rest of their units, marked inner."""
    out, rest = set(), set()
    for t in tags:
        u = math.gcd(t.units, outer)
        out.add(Tag(t.param, t.dim, u, t.inner))
        if not t.inner and not t.raw and t.units // u > 1:
            rest.add(Tag(t.param, t.dim, math.gcd(t.units // u, inner), True))
    return frozenset(out), frozenset(rest)


def _merge_tags(outer: frozenset, inner: frozenset) -> frozenset:
    """Tags of ``[outer, inner]`` merged into one dimension: the outer part's, with the
    units of the same projection's inner part multiplied back in."""
    out = set()
    for t in outer:
        extra = [i.units for i in inner if i.inner and (i.param, i.dim) == (t.param, t.dim)]
        out.add(Tag(t.param, t.dim, t.units * (extra[0] if extra else 1), t.inner, t.raw))
    return frozenset(out)


def _cut_words(eqn: Any, src: Sequence[int]) -> str:
    """How a resizing primitive cut a dimension, for the replicated reason: a contiguous
    ``slice`` names its range (``slice [0:48] of 96``), anything else its primitive."""
    if eqn.primitive.name != "slice" or any(k > 1 for k in eqn.params.get("strides") or ()):
        return eqn.primitive.name
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    ranges = [f"[{b}:{e}] of {n}" for b, e, n in zip(start, limit, src, strict=True) if e - b != n]
    return "contiguous slice " + ", ".join(ranges) if ranges else "slice"


def takes_first_dim(eqn: Any) -> bool:
    """A ``gather`` of whole slices along its operand's first dimension (``w[indices]``,
    ``jnp.take(w, indices, axis=0)``)."""
    dims = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    return (
        tuple(dims.collapsed_slice_dims) == (0,)
        and tuple(dims.start_index_map) == (0,)
        and not dims.operand_batching_dims
        and tuple(eqn.params["slice_sizes"]) == (1, *shape[1:])
    )


class Walk:
    """Runs a jaxpr over :class:`Val` values, recording edges, products and roles' evidence.

    ``scope``: a ``jax.named_scope`` name; products traced inside it (at any depth of
    nested calls) are recorded with ``Dot.scoped`` set. Empty: none are.
    """

    def __init__(self, scope: str = "") -> None:
        self.scope = scope
        self._in_scope = False
        self.edges: list[Edge] = []
        self.dots: list[Dot] = []
        self.biases: dict[int, set[tuple[int, Tag]]] = {}
        self.contracted: dict[int, set[int]] = {}
        self.free: dict[int, set[int]] = {}
        self.score_sides: list[tuple[frozenset, frozenset]] = []
        self.value_sides: list[frozenset] = []
        self.gates: list[tuple[frozenset, bool, frozenset, bool]] = []
        self.heads: list[int] = []
        self.lookups: set[int] = set()
        self.reads_inputs: set[int] = set()  # projections of the inputs themselves
        self.activations: dict[int, str] = {}  # the nonlinearity each projection's input took
        self.cut: dict[int, str] = {}
        self.batched: dict[int, int] = {}  # projections with a batch dim (experts): its size
        self.fed_by: dict[int, set[int]] = {}  # the projections each projection's input came from
        self.top_k: dict[int, tuple[int, int]] = {}  # projection -> (k, choices) a top_k read
        self.grouped: set[int] = set()  # parameters a ragged_dot reads as its groups
        self.taken: set[int] = set()  # parameters gathered whole along their first dim
        self.read_otherwise: set[int] = set()  # ... and anything else reads too

    # ------------------------------------------------------------ helpers
    def _generic(self, args: list[Val], outs: Sequence[Any]) -> list[Val]:
        act = any(a.act for a in args)
        grad = any(a.grad for a in args)
        last = frozenset().union(*(a.last for a in args)) if args else EMPTY
        score = any(a.score for a in args)
        res = []
        for o in outs:
            n = len(_shape(o))
            res.append(
                Val(
                    tags=(EMPTY,) * n,
                    bcast=(False,) * n if act or grad else (True,) * n,
                    act=act,
                    grad=grad,
                    last=last,
                    score=score,
                )
            )
        return res

    def _like(self, args: list[Val], tags, bcast, view=None, **kw) -> Val:
        base = {
            "act": any(a.act for a in args),
            "grad": any(a.grad for a in args),
            "last": frozenset().union(*(a.last for a in args)) if args else EMPTY,
            "score": any(a.score for a in args),
            "nonlin": next((a.nonlin for a in args if a.nonlin), ""),
        }
        base.update(kw)
        return Val(tags=tuple(tags), bcast=tuple(bcast), view=view, **base)

    # ------------------------------------------------------------ structural ops
    def _elementwise(self, name: str, eqn: Any, args: list[Val]) -> Val:
        out_shape = _shape(eqn.outvars[0])
        n = len(out_shape)
        shapes = [_shape(v) for v in eqn.invars]
        arrays = [(a, s) for a, s in zip(args, shapes, strict=True) if len(s) == n]
        tags, bcast = [], []
        views = [a for a, _ in arrays if a.view is not None]
        acts = [(a, s) for a, s in arrays if a.view is None and (a.act or a.grad)]
        for d in range(n):
            full = [(a, s) for a, s in arrays if s[d] == out_shape[d] and not a.bcast[d]]
            bcast.append(not full)
            sets = [a.tags[d] for a, _ in full if a.view is None]
            # a residual sum of two activations ends tags; a bias made of parameters does not
            inputs = [(a, s) for a, s in acts if a.act]
            if name in _ADDS and len([a for a, _ in inputs if not a.bcast[d]]) > 1:
                distinct = {a.tags[d] for a, s in inputs if s[d] == out_shape[d] and not a.bcast[d]}
                tags.append(next(iter(distinct)) if len(distinct) == 1 else EMPTY)
            else:
                tags.append(frozenset().union(*sets) if sets else EMPTY)
            if name in _ADDS and tags[d]:
                for v in views:
                    t = v.view[d] if d < len(v.view) else None
                    if t is not None:
                        for tag in tags[d]:
                            self.biases.setdefault(t.param, set()).add((t.dim, tag))
        if name == "mul" and len(acts) == 2:
            (a, _), (b, _) = acts
            shared = [
                d for d in range(n) if a.tags[d] and b.tags[d] and not (a.bcast[d] or b.bcast[d])
            ]
            if shared and not (a.score or b.score):
                self.gates.append((a.last, bool(a.nonlin), b.last, bool(b.nonlin)))
        view = None
        if name in ("convert_element_type", "copy", "copy_p", "reduce_precision"):
            view = args[0].view
        nonlin = next((a.nonlin for a in args if a.nonlin), "")
        nonlin = nonlin or (name if name in _NONLINEAR else "")
        return self._like(args, tags, bcast, view, nonlin=nonlin)

    def _reshape(self, eqn: Any, a: Val) -> Val:
        src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
        tags: list = [EMPTY] * len(dst)
        view: list | None = [None] * len(dst) if a.view is not None else None
        groups = reshape_groups(src, dst)
        new_ones = {jj[0] for ii, jj in groups if not ii and jj}
        pending: frozenset = EMPTY  # tags of a size-1 dim merged into the next one
        for ii, jj in groups:
            big_in = [i for i in ii if src[i] > 1]
            big_out = [j for j in jj if dst[j] > 1]
            if ii and not jj and src[ii[0]] == 1:
                pending = pending | a.tags[ii[0]]
                continue
            if not big_in or not big_out:
                continue
            outer_in, outer_out = big_in[0], big_out[0]
            if view is not None and a.view[outer_in] is not None:
                t = a.view[outer_in]
                view[outer_out] = Tag(t.param, t.dim, math.gcd(t.units, dst[outer_out]))
            if outer_out - 1 in new_ones and len(jj) == 1 and outer_in == len(src) - 1:
                # [.., n] -> [.., 1, n]: an activation's features as one head of n
                # (multi-query k / v): the head dim carries them, one unit
                outer_out -= 1
            if pending:  # [.., 1, g] -> [.., g]: one kv head shared by g q heads
                tags[outer_out] = tags[outer_out] | _retag(pending, 1)
                pending = EMPTY
            incoming = a.tags[outer_in]
            if len(big_in) > 1:  # a merge: inner parts multiply their units back in
                incoming = _merge_tags(incoming, a.tags[big_in[1]])
            if len(big_out) > 1 and outer_out == big_out[0]:  # a split: [outer, inner]
                kept, rest = _split_tags(incoming, dst[outer_out], dst[big_out[1]])
                tags[outer_out] = tags[outer_out] | kept
                tags[big_out[1]] = tags[big_out[1]] | rest
            else:
                tags[outer_out] = tags[outer_out] | _retag(incoming, dst[outer_out])
        bcast = [False] * len(dst)
        for ii, jj in reshape_groups(src, dst):
            for j in jj:
                bcast[j] = (all(a.bcast[i] for i in ii) if ii else True) and not tags[j]
        return self._like([a], tags, bcast, None if view is None else tuple(view))

    def _permute(self, a: Val, order: Sequence[int]) -> Val:
        view = None if a.view is None else tuple(a.view[i] for i in order)
        return self._like(
            [a], [a.tags[i] for i in order], [a.bcast[i] for i in order], view, nonlin=a.nonlin
        )

    def _broadcast(self, eqn: Any, a: Val) -> Val:
        src, dst = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
        dims = eqn.params["broadcast_dimensions"]
        tags: list = [EMPTY] * len(dst)
        bcast = [True] * len(dst)
        view: list | None = [None] * len(dst) if a.view is not None else None
        for i, d in enumerate(dims):
            if src[i] == dst[d]:
                tags[d] = a.tags[i]
                bcast[d] = a.bcast[i]
                if view is not None:
                    view[d] = a.view[i]
            elif src[i] == 1 and a.tags[i]:  # one head repeated for every q head
                tags[d] = a.tags[i]
        return self._like([a], tags, bcast, None if view is None else tuple(view))

    def _drop(self, a: Val, keep: Sequence[int], changed: frozenset = EMPTY, why: str = "") -> Val:
        for i in changed:
            for t in a.tags[i]:
                self.cut.setdefault(t.param, why)
        tags = [EMPTY if i in changed else a.tags[i] for i in keep]
        bcast = [a.bcast[i] for i in keep]
        view = None
        if a.view is not None:
            view = tuple(None if i in changed else a.view[i] for i in keep)
        return self._like([a], tags, bcast, view)

    def _written(self, eqn: Any, args: list[Val]) -> Val:
        """dynamic_update_slice / scatter: an update written into an operand (a KV cache).

        The result keeps the operand's tags, and the update's on every dimension it spans
        whole (the heads of keys written at a sequence position), so projections written
        into a cache and read back keep their pairs.
        """
        name = eqn.primitive.name
        operand, update = args[0], args[2 if name.startswith("scatter") else 1]
        dst = _shape(eqn.outvars[0])
        usrc = _shape(eqn.invars[2 if name.startswith("scatter") else 1])
        if len(usrc) != len(dst):
            return self._generic(args, eqn.outvars)[0]
        tags = [
            operand.tags[d] | (update.tags[d] if usrc[d] == dst[d] else EMPTY)
            for d in range(len(dst))
        ]
        bcast = [operand.bcast[d] and update.bcast[d] for d in range(len(dst))]
        return self._like([operand, update], tags, bcast)

    def _table_rows(self, eqn: Any, table: Val) -> Val:
        """Rows of a 2-D table picked by indices made inside the model (relative-position
        buckets, ``arange`` positions): a view of the table's columns, so a bias built from
        it (``[buckets, heads]`` added to attention scores) is split with the heads."""
        out = _shape(eqn.outvars[0])
        n = len(out)
        whole = bool(out) and out[-1] == _shape(eqn.invars[0])[1]
        view = (None,) * (n - 1) + (table.view[1],) if whole else None
        return Val(tags=(EMPTY,) * n, bcast=(False,) * n, view=view, grad=True)

    @staticmethod
    def _strided(eqn: Any, src: Sequence[int], dst: Sequence[int]) -> frozenset:
        """Dims a ``slice`` reads every ``k``-th element of, from one of the first ``k``
        (``h[..., ::2]``, ``h[..., 1::2]``: interleaved gate / up, strided q / k / v). A
        contiguous split of such a dim into units of ``k`` keeps every slice whole on one
        rank, so its tags carry on, ``dst`` units."""
        if eqn.primitive.name != "slice" or not eqn.params.get("strides"):
            return frozenset()
        start, strides = eqn.params["start_indices"], eqn.params["strides"]
        return frozenset(
            d
            for d, k in enumerate(strides)
            if k > 1 and start[d] < k and src[d] % k == 0 and dst[d] == src[d] // k
        )

    def _resized(self, eqn: Any, args: list[Val]) -> list[Val]:
        """slice, pad, concatenate, dynamic_slice, ...: dims whose size changes lose tags."""
        if eqn.primitive.name == "dynamic_update_slice":
            return [self._written(eqn, args)]
        out = []
        a = args[0]
        src = _shape(eqn.invars[0])
        for o in eqn.outvars:
            dst = _shape(o)
            if len(dst) != len(src):
                out.extend(self._generic(args, [o]))
                continue
            changed = frozenset(i for i in range(len(src)) if src[i] != dst[i])
            if eqn.primitive.name == "concatenate":
                changed = changed | {eqn.params["dimension"]}
                sets = [
                    [b.tags[d] for b, v in zip(args, eqn.invars, strict=True) if len(_shape(v))]
                    for d in range(len(dst))
                ]
                tags = [
                    EMPTY if d in changed else frozenset().union(*sets[d]) for d in range(len(dst))
                ]
                bcast = [all(b.bcast[d] for b in args) for d in range(len(dst))]
                out.append(self._like(args, tags, bcast))
                continue
            strided = self._strided(eqn, src, dst) & changed
            val = self._drop(a, range(len(src)), changed - strided, _cut_words(eqn, src))
            tags = [
                _retag(a.tags[d], dst[d]) if d in strided else val.tags[d] for d in range(len(dst))
            ]
            out.append(self._like(args, tags, val.bcast, val.view if not strided else None))
        return out

    # ------------------------------------------------------------ products
    def _dot(self, eqn: Any, lhs: Val, rhs: Val, mult: int) -> Val:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        ls, rs = _shape(eqn.invars[0]), _shape(eqn.invars[1])
        out_shape = _shape(eqn.outvars[0])
        contracted = math.prod(ls[i] for i in lc)
        flops = 2 * math.prod(out_shape) * contracted * mult
        lfree = [i for i in range(len(ls)) if i not in lc and i not in lb]
        rfree = [i for i in range(len(rs)) if i not in rc and i not in rb]
        grads = int(lhs.grad) + int(rhs.grad)
        splits: set[tuple[int, int]] = set()
        for side in (lhs, rhs):
            for ts in side.tags:
                splits.update((t.param, t.dim) for t in ts)
            if side.view is not None:
                splits.update((t.param, t.dim) for t in side.view if t is not None)
        pside = None
        sides = {
            "l": (lhs, rhs, lc, rc, rb, lfree, rfree),
            "r": (rhs, lhs, rc, lc, lb, rfree, lfree),
        }
        if (lhs.view is None) != (rhs.view is None):
            pside = "l" if lhs.view is not None else "r"
            wv, av, wc, ac, ab, wfree, afree = sides[pside]
        if pside is not None:
            params = {t.param for t in wv.view if t is not None}
            param = params.pop() if len(params) == 1 else None
            wb, wshape = (lb, ls) if pside == "l" else (rb, rs)
            if param is not None and wb:  # one kernel per expert, matched batch-wise
                self.batched.setdefault(param, math.prod(wshape[i] for i in wb))
            for wd, ad in zip(wc, ac, strict=True):
                w = wv.view[wd]
                if w is None:
                    continue
                self.contracted.setdefault(w.param, set()).add(w.dim)
                for t in av.tags[ad]:
                    if t.param != w.param and not t.inner:
                        self.edges.append(Edge(t.param, t.dim, w.param, w.dim, t.units))
            for i in wfree:
                if wv.view[i] is not None:
                    self.free.setdefault(wv.view[i].param, set()).add(wv.view[i].dim)
            batch_tags = [av.tags[ad] for ad in ab]
            a_tags = [av.tags[i] for i in afree]
            w_tags = [frozenset({wv.view[i]}) if wv.view[i] is not None else EMPTY for i in wfree]
            tags = batch_tags + (w_tags + a_tags if pside == "l" else a_tags + w_tags)
            last = frozenset({param}) if param is not None else av.last
            if param is not None and av.act and not av.grad:
                self.reads_inputs.add(param)
            if param is not None and av.nonlin:
                self.activations.setdefault(param, av.nonlin)
            if param is not None:
                self.fed_by.setdefault(param, set()).update(av.last - {param})
            self.dots.append(Dot(flops, param, frozenset(splits), grads, last, self._in_scope))
            n = len(out_shape)
            return Val(
                tags=tuple(tags),
                bcast=(False,) * n,
                act=av.act,
                grad=True,
                last=last,
            )
        # two activations (attention scores / values), or two parameters
        last = lhs.last | rhs.last
        self.dots.append(Dot(flops, None, frozenset(splits), grads, last, self._in_scope))
        if lhs.view is None and rhs.view is None and lhs.act and rhs.act:
            if lhs.score != rhs.score:
                self.value_sides.append(rhs.last if lhs.score else lhs.last)
            elif not lhs.score:
                self.score_sides.append((lhs.last, rhs.last))
                tagged = [i for i in lb if lhs.tags[i]]
                if tagged:
                    self.heads.append(_shape(eqn.invars[0])[tagged[0]])
        tags = [lhs.tags[i] | rhs.tags[j] for i, j in zip(lb, rb, strict=True)]
        tags += [lhs.tags[i] for i in lfree] + [rhs.tags[i] for i in rfree]
        score = lhs.score == rhs.score and not lhs.score and lhs.act and rhs.act
        n = len(out_shape)
        return Val(
            tags=tuple(tags),
            bcast=(False,) * n,
            act=lhs.act or rhs.act,
            grad=lhs.grad or rhs.grad,
            last=last,
            score=score,
        )

    # ------------------------------------------------------------ the walk
    def run(self, jaxpr: Any, args: list[Val], consts: Sequence[Val] = (), mult: int = 1):
        from jax.extend.core import Literal

        env: dict[Any, Val] = {}
        for var, val in zip(jaxpr.constvars, consts, strict=False):
            env[var] = val
        for var, val in zip(jaxpr.invars, args, strict=True):
            env[var] = val

        def read(x: Any) -> Val:
            if isinstance(x, Literal):
                return const_val(len(_shape(x)))
            return env.get(x) or const_val(len(_shape(x)))

        for eqn in jaxpr.eqns:
            ins = [read(x) for x in eqn.invars]
            outer = self._in_scope
            if self.scope and not outer:
                self._in_scope = self.scope in str(eqn.source_info.name_stack).split("/")
            try:
                outs = self._eqn(eqn, ins, mult)
            finally:
                self._in_scope = outer
            self._note_reads(eqn, ins, outs)
            for var, val in zip(eqn.outvars, outs, strict=False):
                env[var] = val
        return [read(v) for v in jaxpr.outvars]

    def _note_reads(self, eqn: Any, ins: list[Val], outs: list[Val]) -> None:
        """Parameters an equation reads (not passes on as a view: a cast, a reshape): as a
        ``ragged_dot``'s groups (:attr:`grouped`), gathered whole along their first
        dimension (:attr:`taken`: ``w[indices]``), or otherwise."""
        if any(getattr(o, "view", None) is not None for o in outs):
            return
        for i, val in enumerate(ins):
            owners = {t.param for t in val.view or () if t is not None}
            if len(owners) == 1:
                name = eqn.primitive.name
                grouped = name == "ragged_dot_general" and i == 1
                taken = name == "gather" and i == 0 and takes_first_dim(eqn)
                read = self.grouped if grouped else self.taken if taken else self.read_otherwise
                read.add(owners.pop())

    def _sub(self, closed: Any, args: list[Val], mult: int) -> list[Val]:
        inner = getattr(closed, "jaxpr", closed)
        consts = [const_val(len(np.shape(c))) for c in getattr(closed, "consts", ())]
        return self.run(inner, args, consts, mult)

    def _eqn(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        name = eqn.primitive.name
        p = eqn.params
        if name == "dot_general" and len(ins) == 2:
            return [self._dot(eqn, ins[0], ins[1], mult)]
        if name == "reshape":
            return [self._reshape(eqn, ins[0])]
        if name == "transpose":
            return [self._permute(ins[0], p["permutation"])]
        if name == "broadcast_in_dim":
            return [self._broadcast(eqn, ins[0])]
        if name == "squeeze":
            gone = {d % len(ins[0].tags) for d in p["dimensions"]}
            return [self._drop(ins[0], [i for i in range(len(ins[0].tags)) if i not in gone])]
        if name == "top_k":  # a router: the projections its scores came from, k of how many
            for param in ins[0].last:
                self.top_k.setdefault(param, (int(p["k"]), int(_shape(eqn.invars[0])[-1])))
        if name == "gather":
            for a in ins[:1]:
                for ts in a.tags:
                    for t in ts:
                        self.cut.setdefault(t.param, "gather")
            table, indices = ins[0], ins[1]
            if table.view is not None and indices.act and len(table.view) == 2:
                owners = {t.param for t in table.view if t is not None}
                if len(owners) == 1:
                    self.lookups.add(owners.pop())
            elif table.view is not None and not indices.act and len(table.view) == 2:
                return [self._table_rows(eqn, table)]
        if name in _REDUCTIONS:
            axes = set(p["axes"])
            keep = [i for i in range(len(ins[0].tags)) if i not in axes]
            val = self._drop(ins[0], keep)
            return [dataclasses.replace(val, view=None)]
        if name in _CUMULATIVE:
            axis = p["axis"]
            return [self._drop(ins[0], range(len(ins[0].tags)), frozenset({axis}))]
        if name in ("scatter", "scatter-add", "scatter_add") and len(ins) >= 3:
            return [self._written(eqn, ins)]
        if name in ("slice", "pad", "dynamic_slice", "dynamic_update_slice", "concatenate"):
            return self._resized(eqn, ins)
        if name == "split":
            a, axis = ins[0], p["axis"]
            cut = frozenset({axis})
            why = f"split into {len(eqn.outvars)} contiguous parts"
            return [self._drop(a, range(len(a.tags)), cut, why) for _ in eqn.outvars]
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):  # jit, custom_jvp/vjp, remat, ...
            sub = p.get(key)
            inner = getattr(sub, "jaxpr", sub)
            if (
                name != "scan"
                and hasattr(inner, "eqns")
                and len(inner.invars) == len(ins)
                and len(inner.outvars) == len(eqn.outvars)
            ):
                return self._sub(sub, ins, mult)
        if name == "scan":
            return self._scan(eqn, ins, mult)
        if name == "cond":
            outs = None
            for branch in p["branches"]:
                res = self._sub(branch, ins[1:], mult)
                outs = (
                    res
                    if outs is None
                    else [self._merge(a, b) for a, b in zip(outs, res, strict=True)]
                )
            return outs or self._generic(ins, eqn.outvars)
        if name == "while":
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            body_args = ins[nc : nc + nb] + ins[nc + nb :]
            self._sub(p["body_jaxpr"], body_args, mult)
            return self._generic(ins, eqn.outvars)
        outs = eqn.outvars
        shapes = [_shape(v) for v in eqn.invars]
        if len(outs) == 1 and not any(k in p for k in ("axes", "dimension", "dimensions", "axis")):
            n = len(_shape(outs[0]))
            if all(len(s) in (0, n) for s in shapes) and any(len(s) == n for s in shapes):
                return [self._elementwise(name, eqn, ins)]
        return self._generic(ins, outs)

    def _merge(self, a: Val, b: Val) -> Val:
        n = min(len(a.tags), len(b.tags))
        return self._like(
            [a, b],
            [a.tags[i] | b.tags[i] for i in range(n)],
            [a.bcast[i] and b.bcast[i] for i in range(n)],
        )

    def _scan(self, eqn: Any, ins: list[Val], mult: int) -> list[Val]:
        p = eqn.params
        nc, ncarry, length = p["num_consts"], p["num_carry"], int(p["length"])
        # each step sees one slice of xs; a stacked parameter's slice keeps its dims' tags
        xs = [self._drop(x, range(1, len(x.tags))) for x in ins[nc + ncarry :]]
        outs = self._sub(p["jaxpr"], ins[: nc + ncarry] + xs, mult * length)
        carry, ys = outs[:ncarry], outs[ncarry:]
        ys = [self._like([y], (EMPTY, *y.tags), (False, *y.bcast)) for y in ys]
        return carry + ys

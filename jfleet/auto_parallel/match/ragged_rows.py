"""Which rows of a traced ``ragged_dot`` dispatch an ``ep`` rank computes, and whether the
rows it skips can reach the layer's output.

:mod:`jfleet.auto_parallel.apply.expert_rows` runs a model's own MoE layer (token copies
sorted by expert, ``jax.lax.ragged_dot`` over the groups) on each ``ep`` rank with the
``ep`` group's tokens, restricting every ``ragged_dot`` over an expert stack to the rank's
``E / ep`` experts. :class:`ExpertRows` evaluates the layer's jaxpr so, equation by
equation, and classifies every value:

* **replicated**: the same on every rank (the gathered tokens, the routing, the router);
* **stack**: the rank's experts of a stacked expert parameter (a cast of it too);
* **clean**: sorted rows, the rank's experts' exact, every other row zero (a restricted
  ``ragged_dot``'s output; a product with it, ``x * 0``);
* **dirty**: sorted rows, the rank's experts' exact, the others anything finite (row-wise
  code on clean rows: a restricted ``ragged_dot`` ignores the others);
* **partial**: the rank's share of a sum over the ``ep`` ranks (linear code on clean rows:
  unsorting, the router's weights, reshapes, sums); a replicated term added to it (a
  shared expert's output) is added on rank 0 only.

A per-token gather of a stack (``w[expert_indices]``, gpt-oss's) is held back (**taken**)
until its product with each token's vector, which runs as a restricted ``ragged_dot`` of
the token copies sorted by expert (clean); a listed expert's kernels (Mixtral's ``nnx.List``)
are split on their hidden dimension (**in**: ``[D, F]`` columns, **out**: ``[F, D]`` rows),
``x @ w_in`` giving the rank's **columns** and ``h @ w_out`` a partial sum.

The layer runs so exactly when each output is partial (reduce-scattered) or replicated
(the rank's tokens sliced); anything else raises a ``ValueError`` naming the equation.
:func:`ragged_rows_problem` runs the classification alone on a model's MoE layers, so the
matcher prices ``ep`` only for layers that can run so.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def layer(x, w, sizes):  # rows through one expert product, then a row-wise tanh
  ...     return jnp.tanh(jax.lax.ragged_dot(x, w, sizes))
  >>> jaxpr = jax.make_jaxpr(layer)(jnp.ones((8, 4)), jnp.ones((4, 4, 4)), jnp.ones(4, int))
  >>> ExpertRows(4, 2).run(jaxpr.jaxpr, [], None, ["replicated", "stack", "replicated"])[1]
  ['dirty']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jcore

from jfleet.auto_parallel.match.matched import module_at
from jfleet.auto_parallel.match.tag_walk import takes_first_dim
from jfleet.mesh.topology import EP

__all__ = ["SUMMED", "ExpertRows", "LayerParts", "layer_parts"]
__all__ += ["extra_inputs_problem", "output_problem", "ragged_rows_problem"]

# What a value is on one rank of the ep group, as the layer is evaluated.
_REP = "replicated"  # the same on every rank: the gathered tokens, routing, the router
_STACK = "stack"  # this rank's E / ep experts of a stacked expert parameter
_CLEAN = "clean"  # sorted rows: this rank's experts' rows exact, every other row zero
_DIRTY = "dirty"  # sorted rows: this rank's experts' rows exact, the others anything finite
_PARTIAL = "partial"  # this rank's share: the sum over the ep ranks is the value
_ONCE = "once"  # a partial value plus a replicated one (a shared expert): rank 0 adds it
_TAKEN = "taken"  # each slot's expert slice of a stack (``w[indices]``), not yet gathered
_IN = "in"  # a listed expert's [D, F] kernel: this rank's columns
_OUT = "out"  # a listed expert's [F, D] kernel: this rank's rows
_COLS = "columns"  # a listed expert's hidden activations: this rank's columns, exact

#: Element-wise primitives (every operand of the output's shape).
# fmt: off
_ELEMENTWISE = frozenset({
    "abs", "add", "atan2", "cos", "cosh", "div", "erf", "erf_inv", "exp", "exp2", "expm1",
    "integer_pow", "logistic", "log", "log1p", "max", "min", "mul", "neg", "pow", "rsqrt",
    "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh", "clamp",
    "convert_element_type", "copy", "copy_p", "stop_gradient", "reduce_precision",
})
# fmt: on
#: Element-wise and linear: a row that is zero stays zero, a sum over ranks passes through.
_ZERO_KEEPING = frozenset(["neg", "convert_element_type", "copy", "copy_p", "reduce_precision"])
#: Linear in their first operand, moving or summing its elements; any other operand is a
#: position or a size (replicated).
# fmt: off
_MOVING = frozenset({
    "reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "gather", "slice",
    "dynamic_slice", "reduce_sum", "rev", "cumsum",
})
# fmt: on
#: Calls whose body is evaluated here (a ragged_dot may be inside).
_CALLS = frozenset(["jit", "pjit", "closed_call", "core_call"])
#: Calls bound whole (their own derivative rules), classified by their body.
_CUSTOM = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr"}


def _broadcasts(small: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A scalar, or an operand of the output's rank whose other dimensions are 1."""
    return not small or (
        len(small) == len(shape) and all(a in (1, b) for a, b in zip(small, shape, strict=True))
    )


def _cumulative(jaxpr: Any) -> Any:
    """Every running count (``cumsum`` ...) in ``jaxpr`` and the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("cum"):
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _cumulative(inner)


def _body(params: dict, key: str) -> tuple[Any, list]:
    sub = params[key]
    return (sub.jaxpr, list(sub.consts)) if hasattr(sub, "consts") else (sub, [])


@dataclasses.dataclass(frozen=True)
class _Taken:
    """``stack[indices]`` not gathered yet: ``stack`` this rank's experts."""

    eqn: Any
    stack: Any
    indices: Any


class ExpertRows:
    """Evaluates one MoE layer's jaxpr on one ep rank, each ``ragged_dot`` over an expert
    stack restricted to the rank's experts, and classifies every value (``_REP`` ...
    ``_PARTIAL``) to check that the rows it skips cannot reach the output."""

    def __init__(self, experts: int, ep: int, tokens: int = 0):
        self.experts, self.local = experts, experts // ep
        self.tokens = tokens  # the layer's tokens: a running count over as many couples them
        self.groups: Any = None  # the group sizes every product shares
        self.slots: tuple[int, ...] | None = None  # the leading dims rows / slots span

    def layer(self, jaxpr: Any, consts: list, args: list | None, kinds: list[str]) -> tuple:
        """:meth:`run` of a whole MoE layer, after :meth:`check_tokens`."""
        self.check_tokens(jaxpr)
        return self.run(jaxpr, consts, args, kinds)

    def run(self, jaxpr: Any, consts: list, args: list, kinds: list[str]) -> tuple[list, list]:
        """``(outputs, their kinds)``; ``args`` None: classify only."""
        env: dict = {}
        kind: dict = {}
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v], kind[v] = c, _REP
        for v, a, k in zip(jaxpr.invars, args or [None] * len(kinds), kinds, strict=True):
            env[v], kind[v] = a, k

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        def kind_of(v):
            return _REP if isinstance(v, jcore.Literal) else kind[v]

        for eqn in jaxpr.eqns:
            values = [read(v) for v in eqn.invars] if args is not None else None
            outs, k = self.eqn(eqn, values, [kind_of(v) for v in eqn.invars])
            for i, v in enumerate(eqn.outvars):
                env[v], kind[v] = (outs[i] if outs is not None else None), k
        outs = [read(v) for v in jaxpr.outvars] if args is not None else None
        return outs, [kind_of(v) for v in jaxpr.outvars]

    def check_tokens(self, jaxpr: Any) -> None:
        """Refuses a running count over as many rows as the layer's tokens (a capacity
        rule couples the tokens: over the ep group's it would not drop the batch's)."""
        for eqn in _cumulative(jaxpr):
            size = eqn.invars[0].aval.shape[eqn.params["axis"]]
            if self.tokens and size >= self.tokens:
                self.refuse(
                    eqn,
                    f"a running {eqn.primitive.name} over {size} token rows couples the "
                    "tokens (a capacity rule): over the ep group's tokens it would not drop "
                    "the batch's",
                )

    def eqn(self, eqn: Any, values: list | None, kinds: list[str]) -> tuple[list | None, str]:
        name = eqn.primitive.name
        if set(kinds) == {_REP} or not kinds:
            return self.bind(eqn, values), _REP
        if name == "ragged_dot_general" and kinds[1] == _STACK:
            self.check_ragged(eqn, kinds)
            self.check_slots(eqn, eqn.invars[0].aval.shape[:1])
            return (None if values is None else [self.ragged(eqn, *values)]), _CLEAN
        if name == "gather" and kinds[0] == _STACK:
            self.check_taken(eqn, kinds)
            return (None if values is None else [_Taken(eqn, *values)]), _TAKEN
        if _TAKEN in kinds:
            if name == "dot_general" and kinds[1] == _TAKEN and self.taken_dot_ok(eqn, kinds):
                return (None if values is None else [self.taken_dot(eqn, *values)]), _CLEAN
            # any other use: this rank's experts' slices gathered, every other slot zero
            if values is not None:
                values = [
                    self.gathered(v) if k == _TAKEN else v
                    for v, k in zip(values, kinds, strict=True)
                ]
            kinds = [_CLEAN if k == _TAKEN else k for k in kinds]
        if name in _CALLS:
            outs, out_kinds = self.run(*_body(eqn.params, "jaxpr"), values, kinds)
            return outs, self.join(eqn, out_kinds)
        if name in _CUSTOM:
            _, out_kinds = self.run(*_body(eqn.params, _CUSTOM[name]), None, kinds)
            return self.bind(eqn, values), self.join(eqn, out_kinds)
        kind = self.kind(eqn, name, kinds)
        if kind == _ONCE:  # partial + replicated: the replicated term counted on one rank
            if values is not None:
                first = jax.lax.axis_index(EP) == 0
                chosen = name == "select_n"  # its predicate stays
                values = [
                    jnp.where(first, v, jnp.zeros_like(v)) if k == _REP and (i or not chosen) else v
                    for i, (v, k) in enumerate(zip(values, kinds, strict=True))
                ]
            return self.bind(eqn, values), _PARTIAL
        return self.bind(eqn, values), kind

    @staticmethod
    def bind(eqn: Any, values: list | None) -> list | None:
        if values is None:
            return None
        outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
        return list(outs) if eqn.primitive.multiple_results else [outs]

    def join(self, eqn: Any, kinds: list[str]) -> str:
        if len(set(kinds)) > 1:
            self.refuse(eqn, f"its outputs mix {sorted(set(kinds))} values")
        return kinds[0] if kinds else _REP

    def kind(self, eqn: Any, name: str, kinds: list[str]) -> str:
        """The kind of a primitive's outputs (not all operands replicated)."""
        present = set(kinds)
        held = present & {_STACK, _IN, _OUT}
        if held and name in _ZERO_KEEPING and len(kinds) == 1:
            return kinds[0]  # a cast of the experts (mixed precision)
        if held - {_STACK} or _COLS in present:
            return self.listed(eqn, name, kinds)
        if _STACK in present:
            self.refuse(eqn, "it reads an expert stack other than as a ragged_dot's groups")
        shape = eqn.outvars[0].aval.shape
        if name in _ELEMENTWISE and all(
            v.aval.shape == shape or (k == _REP and _broadcasts(v.aval.shape, shape))
            for v, k in zip(eqn.invars, kinds, strict=True)
        ):
            return self.elementwise(eqn, name, kinds, present)
        moved, rest = kinds[0], set(kinds[1:])
        if name == "slice" and moved in (_CLEAN, _DIRTY) and self.keeps_slots(eqn):
            return moved  # a slice of each row / slot (gpt-oss's interleaved gate and up)
        if name == "dot_general" and sorted(kinds) in ([_CLEAN, _REP], [_PARTIAL, _REP]):
            return _PARTIAL
        if name in _MOVING and moved in (_CLEAN, _PARTIAL) and rest <= {_REP}:
            return _PARTIAL
        if name == "concatenate" and present <= {_CLEAN, _PARTIAL}:
            return _PARTIAL
        self.refuse(eqn, f"it is not linear in the experts' rows it reads ({sorted(present)})")
        raise AssertionError  # refuse raises

    def listed(self, eqn: Any, name: str, kinds: list[str]) -> str:
        """A listed expert's products and the row-wise code between them: ``x @ w_in``
        gives this rank's columns of the hidden activations, ``h @ w_out`` its share of
        the output (Megatron's column and row split, over ``ep``)."""
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs_last = len(eqn.invars[0].aval.shape) - 1
            plain = not lb and not rb and tuple(rc) == (0,) and tuple(lc) == (lhs_last,)
            if plain and tuple(kinds) == (_REP, _IN):
                return _COLS
            if plain and tuple(kinds) == (_COLS, _OUT):
                return _PARTIAL
        shape = eqn.outvars[0].aval.shape
        rowwise = name in _ELEMENTWISE and all(
            (k == _COLS and v.aval.shape == shape)
            or (k == _REP and _broadcasts(v.aval.shape, shape) and v.aval.shape[-1:] in ((), (1,)))
            for v, k in zip(eqn.invars, kinds, strict=True)
        )
        if rowwise:
            return _COLS
        self.refuse(eqn, "it reads a listed expert's weights other than in its own products")
        raise AssertionError  # refuse raises

    def elementwise(self, eqn: Any, name: str, kinds: list[str], present: set) -> str:
        if name == "select_n":  # a replicated choice between values of one kind
            cases = set(kinds[1:])
            if kinds[0] == _REP and len(cases) == 1 and cases <= {_CLEAN, _PARTIAL}:
                return cases.pop()
            if kinds[0] == _REP and cases == {_PARTIAL, _REP}:
                return _ONCE  # where(p, partial, r): r taken on rank 0 only
        if _PARTIAL in present:  # sums pass through a sum, scaling and a cast only
            if name in _ZERO_KEEPING or (name in ("add", "sub") and present <= {_PARTIAL, _CLEAN}):
                return _PARTIAL
            if name in ("add", "sub") and set(kinds) == {_PARTIAL, _REP}:
                return _ONCE  # the replicated term is added on rank 0 only
            if name == "mul" and sorted(kinds) == [_PARTIAL, _REP]:
                return _PARTIAL
            self.refuse(eqn, "it is not linear in the experts' summed rows")
        if name == "mul" and _CLEAN in present:
            return _CLEAN  # a skipped row is zero times something finite
        if name == "div" and kinds[0] == _CLEAN and kinds[1] == _REP:
            return _CLEAN
        if name in _ZERO_KEEPING or (name in ("add", "sub") and present == {_CLEAN}):
            return present.pop() if len(present) == 1 else _DIRTY
        return _DIRTY  # row-wise: this rank's rows still exact

    def refuse(self, eqn: Any, why: str) -> None:
        text = " ".join(str(eqn).split())
        text = text if len(text) <= 200 else text[:200] + " ..."
        raise ValueError(f"at `{text}`, {why}")

    def check_ragged(self, eqn: Any, kinds: list[str]) -> None:
        if kinds[0] == _PARTIAL or kinds[2] != _REP:
            self.refuse(eqn, "its rows or group sizes were moved after an expert product")
        if eqn.params["group_offset"] is not None:
            self.refuse(eqn, "it has a group_offset")
        dims = eqn.params["ragged_dot_dimension_numbers"]
        if tuple(dims.lhs_ragged_dimensions) != (0,) or tuple(dims.rhs_group_dimensions) != (0,):
            self.refuse(eqn, "its rows are not lhs's first dimension, its groups not rhs's")
        sizes = eqn.invars[2]
        if self.groups is None:
            self.groups = sizes
        elif sizes is not self.groups:
            self.refuse(eqn, "two products read different group sizes")

    def ragged(self, eqn: Any, lhs: Any, rhs: Any, sizes: Any) -> Any:
        """A ``ragged_dot`` over this rank's experts' rows."""
        return self.restricted(lhs, rhs, sizes, lambda *a: eqn.primitive.bind(*a, **eqn.params))

    def restricted(self, lhs: Any, rhs: Any, sizes: Any, dot: Callable[..., Any]) -> Any:
        """The rank's experts' rows of ``lhs`` (sorted by expert, ``sizes`` a group) moved
        to the front, multiplied by ``dot(rows, rhs, local sizes)``, moved back; every other
        row zero."""
        first = jax.lax.axis_index(EP) * self.local
        local = jax.lax.dynamic_slice_in_dim(sizes, first, self.local)
        start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))
        rows = lhs.shape[0]
        front = jax.lax.dynamic_slice_in_dim(
            jnp.concatenate([lhs, jnp.zeros_like(lhs)]), start, rows
        )
        mine = jnp.arange(rows) < jnp.sum(local)  # the other rows may hold anything: zeros
        front = jnp.where(mine.reshape(-1, *([1] * (front.ndim - 1))), front, 0)
        out = dot(front, rhs, local)
        return jax.lax.dynamic_slice_in_dim(
            jnp.concatenate([jnp.zeros_like(out), out]), rows - start, rows
        )

    # ------------------------------------------------ a gather of each slot's experts
    def check_slots(self, eqn: Any, slots: tuple[int, ...]) -> None:
        if self.slots is None:
            self.slots = tuple(slots)
        elif self.slots != tuple(slots):
            self.refuse(eqn, f"its rows {slots} are not the other products' {self.slots}")

    def keeps_slots(self, eqn: Any) -> bool:
        """A slice that leaves every row / slot whole in the leading dimensions."""
        n, shape = len(self.slots or ()), eqn.invars[0].aval.shape
        strides = eqn.params["strides"] or (1,) * len(shape)
        return bool(n) and all(
            eqn.params["start_indices"][d] == 0
            and eqn.params["limit_indices"][d] == shape[d]
            and strides[d] == 1
            for d in range(n)
        )

    def check_taken(self, eqn: Any, kinds: list[str]) -> None:
        out, slots = eqn.outvars[0].aval.shape, eqn.invars[1].aval.shape[:-1]
        offsets = eqn.params["dimension_numbers"].offset_dims
        whole = takes_first_dim(eqn) and tuple(offsets) == tuple(range(len(slots), len(out)))
        if kinds[1] != _REP or not whole or eqn.invars[1].aval.shape[-1] != 1:
            self.refuse(eqn, "it gathers an expert stack other than each slot's whole expert")
        self.check_slots(eqn, slots)

    def taken_dot_ok(self, eqn: Any, kinds: list[str]) -> bool:
        """A product of each slot's vector (replicated, or one a slot) with its expert's
        matrix: ``td,tkdf->tkf`` or ``tkf,tkfd->tkd``."""
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        n = len(self.slots)
        lhs = eqn.invars[0].aval.shape
        ok = (
            kinds[0] in (_REP, _CLEAN, _DIRTY)
            and len(rc) == 1
            and rc[0] in (n, n + 1)
            and tuple(rb) == tuple(range(len(rb)))
            and len(lc) == 1
            and len(lhs) == len(lb) + 1
            and eqn.outvars[0].aval.shape[:n] == self.slots
        )
        if not ok:
            self.refuse(eqn, "it multiplies gathered experts other than slot by slot")
        return True

    def taken_dot(self, eqn: Any, lhs: Any, taken: _Taken) -> Any:
        """``lhs`` slot by slot times each slot's expert, over this rank's experts: the
        slots sorted by expert and multiplied by a restricted ``ragged_dot``."""
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        n, slots = len(self.slots), self.slots
        rows = jnp.transpose(lhs, (*lb, lc[0]))  # the slots it has, then its vector
        rows = jax.lax.broadcast_in_dim(rows, (*slots, lhs.shape[lc[0]]), (*rb, n))
        rows = rows.reshape(-1, rows.shape[-1])
        stack = taken.stack if rc[0] == n else jnp.swapaxes(taken.stack, 1, 2)
        experts = taken.indices.reshape(-1)
        order = jnp.argsort(experts)
        sizes = jnp.bincount(experts, length=self.experts).astype(jnp.int32)
        kind = eqn.params.get("preferred_element_type")

        def dot(a, b, g):
            return jax.lax.ragged_dot(a, b, g, preferred_element_type=kind)

        out = self.restricted(rows[order], stack, sizes, dot)[jnp.argsort(order)]
        return out.reshape(*slots, -1)

    def gathered(self, taken: _Taken) -> Any:
        """``stack[indices]`` of this rank's experts, every other slot zero."""
        first = jax.lax.axis_index(EP) * self.local
        at = taken.indices - first
        mine = (at >= 0) & (at < self.local)
        out = self.bind(taken.eqn, [taken.stack, jnp.clip(at, 0, self.local - 1)])[0]
        mask = mine.reshape(*mine.shape[:-1], *([1] * (out.ndim - mine.ndim + 1)))
        return jnp.where(mask, out, jnp.zeros_like(out))


#: The kinds of output summed over the ranks (reduce-scattered).
SUMMED = frozenset({_CLEAN, _PARTIAL})


@dataclasses.dataclass(frozen=True)
class LayerParts:
    """One MoE layer's call as a pure function of its state's leaves (for a jaxpr).

    Attributes:
      values: the layer's state leaves.
      ep_dims: per leaf, the dimension ``ep`` splits of an expert parameter (a stack's
        first, a listed expert's hidden one), or None.
      call: ``call(values, x, args, kwargs)``: the layer's own ``__call__`` (of ``base``).
      listed: a list of expert modules (each kernel split on its hidden dimension), not
        stacks ``[E, ...]``.
    """

    values: list
    ep_dims: list[int | None]
    call: Callable[..., Any]
    listed: bool = False

    @property
    def experts(self) -> int:
        """``E`` of the stacked experts (0 for a list of expert modules)."""
        stacked = [
            v.shape[0] for v, k in zip(self.values, self._kinds(), strict=True) if k == _STACK
        ]
        return stacked[0] if stacked else 0

    def _kinds(self) -> list[str]:
        return [_param_kind(d, self.listed) for d in self.ep_dims]

    def kinds(self, n_inputs: int) -> list[str]:
        """The kinds of ``(values, x, args, kwargs)``'s leaves: the experts', then replicated."""
        return self._kinds() + [_REP] * n_inputs


def _param_kind(ep_dim: int | None, listed: bool) -> str:
    """A stack ``[E, ...]``, a listed expert's ``[D, F]`` kernel (its columns over ``ep``)
    or ``[F, D]`` one (its rows), or replicated."""
    if ep_dim is None:
        return _REP
    if listed:
        return _IN if ep_dim == 1 else _OUT
    return _STACK


def layer_parts(
    module: nnx.Module, base: type, stacks: Mapping[str, int], listed: bool = False
) -> LayerParts:
    """:class:`LayerParts` of ``module`` (called as ``base``), ``stacks`` its expert
    parameters' paths relative to it and the dimension ``ep`` splits in each.

    Raises:
      ValueError: none of ``stacks`` is a parameter of the layer.
    """
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [
        ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path if not _attr(k))
        for path, _ in leaves
    ]
    ep_dims = [stacks.get(n) for n in names]
    if all(d is None for d in ep_dims):
        raise ValueError(
            f"none of {sorted(stacks)} is a parameter of {base.__name__} (its parameters: {names})."
        )

    def call(values: list, x: Any, args: tuple, kwargs: dict) -> Any:
        layer = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))
        return base.__call__(layer, x, *args, **kwargs)

    return LayerParts([leaf for _, leaf in leaves], ep_dims, call, listed)


def _attr(key: Any) -> bool:
    return isinstance(key, jax.tree_util.GetAttrKey)


def extra_inputs_problem(args: tuple, kwargs: dict) -> str | None:
    """Why a layer called with ``args`` / ``kwargs`` besides its tokens cannot run over
    ``ep``, or None: arrays there would not be split with the tokens."""
    arrays = [a for a in jax.tree_util.tree_leaves((args, kwargs)) if hasattr(a, "shape")]
    if arrays:
        return (
            f"it takes {len(arrays)} array argument(s) besides its tokens (shapes "
            f"{[tuple(a.shape) for a in arrays]}), which would not be split with them"
        )
    return None


def output_problem(kinds: list[str]) -> str | None:
    """Why a layer whose outputs are of ``kinds`` cannot run over ``ep``, or None."""
    bad = [k for k in kinds if k not in SUMMED | {_REP}]
    if bad:
        return (
            f"an output has {bad[0]} rows (neither the experts' rows summed nor the same on "
            "every rank)"
        )
    return None


def ragged_rows_problem(
    model: nnx.Module,
    layers: Sequence[str],
    stacks: Mapping[str, int],
    trace: Callable[[nnx.Module], Any],
    listed: bool = False,
) -> str | None:
    """Why the MoE layers at ``layers`` cannot run each ``ep`` rank's ragged_dot rows, or
    None: ``trace(model)`` traces the model abstractly (the layers' classes swapped for the
    call, restored after) and each layer's computation is classified as it is called.

    Example:
      >>> from flax import nnx
      >>> from jfleet.auto_parallel.match.dataflow import trace_forward
      >>> from jfleet.testing.nnx_styles import MOE_STYLES
      >>> style = MOE_STYLES["qwen3_moe_ragged"]
      >>> model = style.build(nnx.Rngs(0))
      >>> trace = lambda m: trace_forward(m, style.batches(1)[0], style.forward)
      >>> ragged_rows_problem(model, ["model.layers.0.mlp"], {"gate_proj": 0, "up_proj": 0,
      ...     "down_proj": 0}, trace) is None
      True
    """
    found: list[str] = []
    swapped = []

    def checking(base: type) -> type:
        def __call__(self, x, *args, **kwargs):  # noqa: N807
            if not found and (problem := extra_inputs_problem(args, kwargs)):
                found.append(problem)
            if not found:
                parts = layer_parts(self, base, stacks, listed)
                inputs = (parts.values, x, args, kwargs)
                n_in = len(jax.tree_util.tree_leaves(inputs)) - len(parts.values)
                jaxpr = jax.make_jaxpr(parts.call)(*inputs)
                try:
                    tokens = math.prod(x.shape[:-1])
                    _, kinds = ExpertRows(parts.experts, 1, tokens).layer(
                        jaxpr.jaxpr, list(jaxpr.consts), None, parts.kinds(n_in)
                    )
                    problem = output_problem(kinds)
                except ValueError as err:
                    problem = str(err)
                if problem:
                    found.append(problem)
            return base.__call__(self, x, *args, **kwargs)

        return type(base.__name__, (base,), {"__call__": __call__})

    try:
        for path in layers:
            layer = module_at(model, path)
            swapped.append((layer, type(layer)))
            layer.__class__ = checking(type(layer))
        trace(model)
    finally:
        for layer, base in swapped:
            layer.__class__ = base
    return found[0] if found else None

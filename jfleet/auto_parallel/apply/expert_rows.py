"""A traced ``ragged_dot`` dispatch over ``ep``: each rank runs its own experts' rows.

A model that sorts its token copies by expert and runs ``jax.lax.ragged_dot`` over the
groups (tunix's Megablox path, MaxText's ``sparse_matmul``, the ``qwen3_moe_ragged`` style)
cannot be split over ``ep`` by sharding constraints: GSPMD does not partition a
``ragged_dot`` over its groups. :func:`ring_ragged_experts` runs each such MoE layer in a
``shard_map`` over ``ep`` the way MaxText's "ring of experts" does:

1. the layer's tokens are all-gathered over ``ep``, so every rank of the group routes the
   same tokens (the model's own routing code, run as written);
2. every ``ragged_dot`` whose groups are an expert stack ``[E, ...]`` (held ``E / ep`` a
   rank) runs on this rank's experts only: the sorted rows of its groups are moved to the
   front (a dynamic slice by the row count of the experts before them), multiplied by the
   local stack with the local group sizes, and moved back; every other row comes out zero;
3. the code between and after the products runs as written; the output, a sum of rows
   that each rank computed for its own experts, is reduce-scattered over ``ep`` back to
   each rank's tokens. Outputs that do not depend on the experts (the router's logits)
   are the rank's own slice of the gathered tokens.

This is exact when the rows a rank did not compute cannot reach the output. The layer's
computation is checked while it is traced, equation by equation: between products only
row-wise (elementwise) code; a non-expert row is zero after each product and a product
(``x * 0``) keeps it zero; after the last product only linear code (gathers, reshapes,
sums, products with routing weights). A layer that does anything else raises a
``ValueError`` naming the equation, and the planner prices no such layer over ``ep``
(:mod:`jfleet.auto_parallel.match.experts` marks only a dispatch read by ``ragged_dot``
alone). Values and gradients equal one device's (tested at dp2 x ep4 and ep8).

Example:
  >>> import jax
  >>> from flax import nnx
  >>> from jfleet.testing.nnx_styles import MOE_STYLES
  >>> model = MOE_STYLES["qwen3_moe_ragged"].build(nnx.Rngs(0))
  >>> mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> layers = ["model.layers.0.mlp", "model.layers.1.mlp"]
  >>> ring_ragged_experts(model, layers, mesh, ["gate_proj", "up_proj", "down_proj"])
  >>> type(model.model.layers[0].mlp).__qualname__
  'Qwen3MoeSparseMoeBlock[ep rows]'
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jcore
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.match.matched import module_at
from jfleet.mesh.topology import DATA_AXES, EP

__all__ = ["ring_ragged_experts"]

# What a value is on one rank of the ep group, as the layer is evaluated.
_REP = "replicated"  # the same on every rank: the gathered tokens, routing, the router
_STACK = "stack"  # this rank's E / ep experts of a stacked expert parameter
_CLEAN = "clean"  # sorted rows: this rank's experts' rows exact, every other row zero
_DIRTY = "dirty"  # sorted rows: this rank's experts' rows exact, the others anything finite
_PARTIAL = "partial"  # this rank's share: the sum over the ep ranks is the value

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


def _body(params: dict, key: str) -> tuple[Any, list]:
    sub = params[key]
    return (sub.jaxpr, list(sub.consts)) if hasattr(sub, "consts") else (sub, [])


class _Rows:
    """Evaluates one MoE layer's jaxpr on one ep rank, each ``ragged_dot`` over an expert
    stack restricted to the rank's experts, and classifies every value (``_REP`` ...
    ``_PARTIAL``) to check that the rows it skips cannot reach the output."""

    def __init__(self, experts: int, ep: int):
        self.local = experts // ep
        self.groups: Any = None  # the group sizes every product shares

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

    def eqn(self, eqn: Any, values: list | None, kinds: list[str]) -> tuple[list | None, str]:
        name = eqn.primitive.name
        if set(kinds) == {_REP} or not kinds:
            return self.bind(eqn, values), _REP
        if name == "ragged_dot_general" and kinds[1] == _STACK:
            self.check_ragged(eqn, values, kinds)
            return (None if values is None else [self.ragged(eqn, *values)]), _CLEAN
        if name in _CALLS:
            outs, out_kinds = self.run(*_body(eqn.params, "jaxpr"), values, kinds)
            return outs, self.join(eqn, out_kinds)
        if name in _CUSTOM:
            _, out_kinds = self.run(*_body(eqn.params, _CUSTOM[name]), None, kinds)
            return self.bind(eqn, values), self.join(eqn, out_kinds)
        return self.bind(eqn, values), self.kind(eqn, name, kinds)

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
        if _STACK in present:
            if name in _ZERO_KEEPING and len(kinds) == 1:
                return _STACK  # a cast of the experts (mixed precision)
            self.refuse(eqn, "it reads an expert stack other than as a ragged_dot's groups")
        shape = eqn.outvars[0].aval.shape
        if name in _ELEMENTWISE and all(v.aval.shape == shape for v in eqn.invars[-1:]):
            return self.elementwise(eqn, name, kinds, present)
        moved, rest = kinds[0], set(kinds[1:])
        if name == "dot_general" and sorted(kinds) in ([_CLEAN, _REP], [_PARTIAL, _REP]):
            return _PARTIAL
        if name in _MOVING and moved in (_CLEAN, _PARTIAL) and rest <= {_REP}:
            return _PARTIAL
        if name == "concatenate" and present <= {_CLEAN, _PARTIAL}:
            return _PARTIAL
        self.refuse(eqn, f"it is not linear in the experts' rows it reads ({sorted(present)})")
        raise AssertionError  # refuse raises

    def elementwise(self, eqn: Any, name: str, kinds: list[str], present: set) -> str:
        if name == "select_n":  # a replicated choice between values of one kind
            cases = set(kinds[1:])
            if kinds[0] == _REP and len(cases) == 1 and cases <= {_CLEAN, _PARTIAL}:
                return cases.pop()
        if _PARTIAL in present:  # sums pass through a sum, scaling and a cast only
            if name in _ZERO_KEEPING or (name in ("add", "sub") and _REP not in present):
                return _PARTIAL
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
        raise ValueError(
            f"cannot run this MoE layer's ragged_dot dispatch over ep: at `{eqn}`, {why}. "
            "Run it with ep_degree=1 (let to_distributed choose), or route with "
            "jfleet.parallel.moe.MoELayer."
        )

    def check_ragged(self, eqn: Any, values: list | None, kinds: list[str]) -> None:
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
        """The rank's experts' rows moved to the front, multiplied, moved back."""
        first = jax.lax.axis_index(EP) * self.local
        local = jax.lax.dynamic_slice_in_dim(sizes, first, self.local)
        start = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < first, sizes, 0))
        rows = lhs.shape[0]
        front = jax.lax.dynamic_slice_in_dim(
            jnp.concatenate([lhs, jnp.zeros_like(lhs)]), start, rows
        )
        out = eqn.primitive.bind(front, rhs, local, **eqn.params)
        return jax.lax.dynamic_slice_in_dim(
            jnp.concatenate([jnp.zeros_like(out), out]), rows - start, rows
        )


def _attr(key: Any) -> bool:
    return isinstance(key, jax.tree_util.GetAttrKey)


def _split_tokens(a: Any, outer: int, ep: int) -> Any:
    """``[b, ...]`` -> ``[outer, ep, b / (outer ep), ...]``: the batch's layout over the data
    axes before ``ep``, ``ep``, and those after it, as three dimensions (free: no data moves)."""
    return a.reshape(outer, ep, a.shape[0] // (outer * ep), *a.shape[1:])


def _merge_tokens(a: Any) -> Any:
    return a.reshape(-1, *a.shape[3:])


def _layer_call(
    self: nnx.Module, base: type, mesh: Mesh, stacks: frozenset, x: Any, *args: Any, **kwargs: Any
) -> Any:
    ep = mesh.shape[EP]
    data = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    before, after = data[: data.index(EP)], data[data.index(EP) + 1 :]
    outer = math.prod(mesh.shape[a] for a in before)
    ranks = outer * ep * math.prod(mesh.shape[a] for a in after)
    graphdef, state = nnx.split(self)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [
        ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path if not _attr(k))
        for path, _ in leaves
    ]
    is_stack = [n in stacks for n in names]
    values = [leaf for _, leaf in leaves]
    if not any(is_stack):
        raise ValueError(
            f"ring_ragged_experts: none of {sorted(stacks)} is a parameter of "
            f"{base.__name__} (its parameters: {names})."
        )
    experts = next(v.shape[0] for v, s in zip(values, is_stack, strict=True) if s)

    def original(values, x, args, kwargs):
        module = nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, values))
        return base.__call__(module, x, *args, **kwargs)

    out_shape = jax.eval_shape(original, values, x, args, kwargs)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    for o in [x, *out_leaves]:
        if not o.shape or o.shape[0] % ranks:
            raise ValueError(
                f"ring_ragged_experts: {base.__name__} takes or returns a {o.shape} value; "
                f"its input and every output must be per token (a leading dimension divisible "
                f"by the {ranks} data ranks), as its tokens are gathered over ep."
            )
    n_in = len(jax.tree_util.tree_leaves((values, x, args, kwargs)))
    in_kinds = [_STACK if s else _REP for s in is_stack] + [_REP] * (n_in - len(values))

    def body(values, x, args, kwargs):
        gathered = _merge_tokens(jax.lax.all_gather(x, EP, axis=1, tiled=True))
        whole = [  # the layer as written sees every expert: traced with the whole stacks
            jax.ShapeDtypeStruct((experts, *v.shape[1:]), v.dtype) if s else v
            for v, s in zip(values, is_stack, strict=True)
        ]
        closed = jax.make_jaxpr(original)(whole, gathered, args, kwargs)
        flat = jax.tree_util.tree_leaves((values, gathered, args, kwargs))
        outs, kinds = _Rows(experts, ep).run(closed.jaxpr, list(closed.consts), flat, in_kinds)
        done = []
        for o, k in zip(outs, kinds, strict=True):
            o = _split_tokens(o, 1, ep)
            if k in (_CLEAN, _PARTIAL):  # each rank's experts' rows: summed, scattered back
                done.append(jax.lax.psum_scatter(o, EP, scatter_dimension=1, tiled=True))
            elif k == _REP:  # the same on every rank: this rank's tokens
                done.append(jax.lax.dynamic_slice_in_dim(o, jax.lax.axis_index(EP), 1, axis=1))
            else:
                raise ValueError(
                    f"cannot run {base.__name__}'s ragged_dot dispatch over ep: an output "
                    f"{o.shape} has {k} rows (neither the experts' rows summed nor the same "
                    "on every rank)."
                )
        return done

    split = P(before or None, EP, after or None)
    outs = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([P(EP) if s else P() for s in is_stack], split, P(), P()),
        out_specs=[split] * len(out_leaves),
        axis_names=frozenset(data),
        check_vma=False,
    )(values, _split_tokens(x, outer, ep), args, kwargs)
    return jax.tree_util.tree_unflatten(out_tree, [_merge_tokens(o) for o in outs])


@functools.cache
def _ring_class(base: type, mesh: Mesh, stacks: frozenset) -> type:
    def __call__(self, x, *args, **kwargs):  # noqa: N807
        return _layer_call(self, base, mesh, stacks, x, *args, **kwargs)

    name = f"{base.__name__}[ep rows]"
    return type(base.__name__, (base,), {"__call__": __call__, "__qualname__": name})


def ring_ragged_experts(
    model: nnx.Module, layers: Iterable[str], mesh: Mesh, stacks: Iterable[str]
) -> None:
    """Runs each MoE layer at ``layers`` (dotted paths) with its ``ragged_dot`` experts
    over ``mesh``'s ``ep`` axis (see the module's docstring), in place. ``stacks``: the
    layer-relative paths of its stacked expert parameters ``[E, ...]`` (placed ``P('ep')``).

    Raises:
      ValueError: the mesh has no ``ep`` axis above 1, or no stacks are named. A layer
        whose computation cannot run so raises a ``ValueError`` naming the equation when it
        is first called.
    """
    if mesh.shape.get(EP, 1) <= 1:
        raise ValueError(f"ring_ragged_experts needs an ep axis above 1; mesh has {mesh.shape}.")
    stacks = frozenset(stacks)
    if not stacks:
        raise ValueError("ring_ragged_experts needs the layers' stacked expert parameters.")
    for path in layers:
        layer = module_at(model, path)
        base = type(layer)
        if "[ep rows]" not in base.__qualname__:
            layer.__class__ = _ring_class(base, mesh, stacks)

"""A traced ``ragged_dot`` (or per-token gather) dispatch over ``ep``: each rank runs its own
experts' rows.

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
   A per-token gather of the experts' weights (``w[expert_indices]``, gpt-oss's
   reference) and its products with each token's vector run the same way: the token
   copies sorted by expert, a restricted ``ragged_dot``, unsorted (the gathered
   ``[T, k, D, F]`` weights are never built); a gathered bias is the rank's experts'
   entries, zero elsewhere. A list of expert modules (Mixtral's) has each expert's hidden
   dimension split over ``ep`` instead: ``x @ w_in`` gives the rank's columns, ``h @
   w_out`` its share of the output (Megatron's column and row split, over ``ep``);
3. the code between and after the products runs as written; the output, a sum of rows
   that each rank computed for its own experts, is reduce-scattered over ``ep`` back to
   each rank's tokens. Outputs that do not depend on the experts (the router's logits)
   are the rank's own slice of the gathered tokens.

This is exact when the rows a rank did not compute cannot reach the output, and the layer
is token-wise (no running count over the tokens: a capacity rule would drop the ep group's
tokens, not the batch's). :mod:`jfleet.auto_parallel.match.ragged_rows` evaluates the
layer's jaxpr equation by equation to check it (row-wise code between the products, linear
code after the last one; a shared expert's output, the same on every rank, is added on rank
0 only); the matcher runs that check before it prices ``ep`` for a layer, and a layer that
fails here raises a ``ValueError`` naming the equation. With ``ep = 1`` each device routes
and computes its own tokens (left to GSPMD, the layer's sort of its token copies would
gather the whole batch's onto every device). Values and gradients equal one device's
(tests/auto_parallel/test_expert_rows.py, test_moe_match.py).

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
from collections.abc import Iterable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.match.matched import module_at
from jfleet.auto_parallel.match.ragged_rows import (
    SUMMED,
    ExpertRows,
    extra_inputs_problem,
    layer_parts,
    output_problem,
)
from jfleet.mesh.topology import DATA_AXES, EP

__all__ = ["ring_ragged_experts"]


def _split_tokens(a: Any, outer: int, ep: int) -> Any:
    """``[b, ...]`` -> ``[outer, ep, b / (outer ep), ...]``: the batch's layout over the data
    axes before ``ep``, ``ep``, and those after it, as three dimensions (free: no data moves)."""
    return a.reshape(outer, ep, a.shape[0] // (outer * ep), *a.shape[1:])


def _merge_tokens(a: Any) -> Any:
    return a.reshape(-1, *a.shape[3:])


def _times(shape: tuple[int, ...], dim: int, n: int) -> tuple[int, ...]:
    return tuple(s * n if d == dim else s for d, s in enumerate(shape))


def _spec(ndim: int, ep_dim: int | None) -> P:
    return P() if ep_dim is None else P(*(EP if d == ep_dim else None for d in range(ndim)))


def _refused(base: type, why: str) -> ValueError:
    return ValueError(
        f"cannot run {base.__name__}'s expert dispatch over ep: {why}. Plan with "
        "ep_degree=1 (to_distributed's search does, for a layer it cannot run so), or route "
        "with jfleet.parallel.moe.MoELayer."
    )


def _layer_call(
    self: nnx.Module,
    base: type,
    mesh: Mesh,
    stacks: tuple,
    listed: bool,
    x: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    ep = mesh.shape.get(EP, 1)
    data = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    if EP not in data:
        raise ValueError(f"ring_ragged_experts needs a mesh with an ep axis; got {mesh.shape}.")
    before, after = data[: data.index(EP)], data[data.index(EP) + 1 :]
    outer = math.prod(mesh.shape[a] for a in before)
    ranks = outer * ep * math.prod(mesh.shape[a] for a in after)
    parts = layer_parts(self, base, dict(stacks), listed)
    out_shape = jax.eval_shape(parts.call, parts.values, x, args, kwargs)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    for o in [x, *out_leaves]:
        if not o.shape or o.shape[0] % ranks:
            raise _refused(
                base,
                f"it takes or returns a {o.shape} value, where its input and every output "
                f"must be per token (a leading dimension divisible by the {ranks} data ranks)",
            )
    problem = extra_inputs_problem(args, kwargs)
    if problem:
        raise _refused(base, problem)
    n_in = len(jax.tree_util.tree_leaves((x, args, kwargs)))
    experts = parts.experts

    def body(values, x, args, kwargs):
        if ep == 1:  # each device routes and computes its own tokens
            x = _merge_tokens(x)
            try:  # token-wise: no capacity rule over the tokens
                closed = jax.make_jaxpr(parts.call)(values, x, args, kwargs)
                ExpertRows(experts, 1, math.prod(x.shape[:-1])).check_tokens(closed.jaxpr)
            except ValueError as err:
                raise _refused(base, str(err)) from None
            outs = jax.tree_util.tree_leaves(parts.call(values, x, args, kwargs))
            return [_split_tokens(o, 1, 1) for o in outs]
        gathered = _merge_tokens(jax.lax.all_gather(x, EP, axis=1, tiled=True))
        whole = [  # the layer as written sees every expert: traced with them whole
            v if d is None else jax.ShapeDtypeStruct(_times(v.shape, d, ep), v.dtype)
            for v, d in zip(values, parts.ep_dims, strict=True)
        ]
        closed = jax.make_jaxpr(parts.call)(whole, gathered, args, kwargs)
        flat = jax.tree_util.tree_leaves((values, gathered, args, kwargs))
        try:
            outs, kinds = ExpertRows(experts, ep, math.prod(gathered.shape[:-1])).layer(
                closed.jaxpr, list(closed.consts), flat, parts.kinds(n_in)
            )
            problem = output_problem(kinds)
        except ValueError as err:
            problem = str(err)
        if problem:
            raise _refused(base, problem)
        done = []
        for o, k in zip(outs, kinds, strict=True):
            o = _split_tokens(o, 1, ep)
            if k in SUMMED:  # each rank's experts' rows: summed, scattered back
                done.append(jax.lax.psum_scatter(o, EP, scatter_dimension=1, tiled=True))
            else:  # the same on every rank: this rank's tokens
                done.append(jax.lax.dynamic_slice_in_dim(o, jax.lax.axis_index(EP), 1, axis=1))
        return done

    split = P(before or None, EP, after or None)
    held = [_spec(v.ndim, d) for v, d in zip(parts.values, parts.ep_dims, strict=True)]
    outs = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(held, split, P(), P()),
        out_specs=[split] * len(out_leaves),
        axis_names=frozenset(data),
        check_vma=False,
    )(parts.values, _split_tokens(x, outer, ep), args, kwargs)
    return jax.tree_util.tree_unflatten(out_tree, [_merge_tokens(o) for o in outs])


@functools.cache
def _ring_class(base: type, mesh: Mesh, stacks: tuple, listed: bool) -> type:
    def __call__(self, x, *args, **kwargs):  # noqa: N807
        return _layer_call(self, base, mesh, stacks, listed, x, *args, **kwargs)

    name = f"{base.__name__}[ep rows]"
    return type(base.__name__, (base,), {"__call__": __call__, "__qualname__": name})


def ring_ragged_experts(
    model: nnx.Module,
    layers: Iterable[str],
    mesh: Mesh,
    stacks: Mapping[str, int] | Iterable[str],
    listed: bool = False,
) -> None:
    """Runs each MoE layer at ``layers`` (dotted paths) with its ``ragged_dot`` experts
    over ``mesh``'s ``ep`` axis (see the module's docstring), in place. ``stacks``: the
    layer-relative paths of its expert parameters and the dimension ``ep`` splits in each
    (a name alone: a stack ``[E, ...]`` placed ``P('ep')``). ``listed``: the layer holds a
    list of expert modules, each kernel split on its hidden dimension (a ``[D, F]`` one:
    1, an ``[F, D]`` one: 0), run as Megatron's column and row split over ``ep``.

    With ``ep = 1`` each device runs the layer on its own tokens (the data axes manual: left
    to GSPMD, the layer's sort of its token copies would gather the whole batch's onto
    every device).

    Raises:
      ValueError: no stacks are named. A layer
        whose computation cannot run so raises a ``ValueError`` naming the equation when it
        is first called.
    """
    stacks = tuple(
        sorted(stacks.items() if isinstance(stacks, Mapping) else {n: 0 for n in stacks}.items())
    )
    if not stacks:
        raise ValueError("ring_ragged_experts needs the layers' stacked expert parameters.")
    for path in layers:
        layer = module_at(model, path)
        base = type(layer)
        if "[ep rows]" not in base.__qualname__:
            layer.__class__ = _ring_class(base, mesh, stacks, listed)

"""Which projection feeds which, along which dimension: a walk over a model's traced program.

:func:`trace_model` traces one forward call of a whole model abstractly (``jax.make_jaxpr``:
no FLOPs spent) and follows every parameter through the program. Each projection — a
``dot_general`` with a parameter on one side, whatever the kernel's rank or einsum
equation — tags the dimensions of its output that come from the kernel's free dimensions
(``Tag(param, dim, units)``). Tags travel through the work a Megatron layout keeps local:
reshapes (a dimension split into ``[heads, head_dim]`` keeps its tag on the outer part,
``units`` becoming the number of heads), transposes, broadcasts, elementwise work (rotary,
gating, softmax), reductions over other dimensions, and products of two activations that
keep the dimension as a batch dimension (attention scores and values over heads). A
residual sum (two different activations added) and slicing or contracting a dimension end
its tags. When a projection contracts a tagged dimension, the walk records an
:class:`Edge`: the producer's output dimension reaches the consumer's input dimension, so
the pair can be split there (column then row parallel).

The walk also records every product (:class:`Dot`: its FLOPs, the projections whose split
would split it, whether its operands need gradients) for the cost model, the biases added
to tagged outputs, and which projections meet in attention scores, in attention values
and in gating products, so roles can be named.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx

from jfleet.auto_parallel.match.tag_walk import EMPTY, Dot, Edge, Tag, Val, Walk, const_val
  >>> mlp = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.gelu,
  ...                      nnx.Linear(16, 8, rngs=nnx.Rngs(1)))
  >>> trace = trace_model(mlp, jnp.zeros((2, 4, 8)))
  >>> [(trace.path(e.producer), e.producer_dim, trace.path(e.consumer), e.consumer_dim)
  ...  for e in trace.edges]
  [('layers.0.kernel', 1, 'layers.2.kernel', 0)]
  >>> sum(d.flops for d in trace.dots)
  4096
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from jfleet.auto_parallel.match.tag_walk import EMPTY, Dot, Edge, Tag, Val, Walk, const_val

__all__ = ["Dot", "Edge", "Tag", "Trace", "TraceError", "trace_forward", "trace_model"]


class TraceError(ValueError):
    """The model could not be traced with the given input (the message says how to fix it).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> try:
      ...     trace_model(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), jnp.ones((2, 5)))
      ... except TraceError as err:
      ...     print(str(err)[:29])
      tracing Linear(inputs) failed
    """


class _NotArraysError(Exception):
    def __init__(self, value: Any) -> None:
        super().__init__("not arrays")
        self.value = value


@dataclasses.dataclass(frozen=True)
class Trace:
    """What :func:`trace_model` found.

    Attributes:
      paths: each parameter's path (``("layers", 0, "attn", "q", "kernel")``); parameters
        are referred to by index into it.
      shapes: each parameter's shape.
      edges: projection pairs (:class:`Edge`).
      dots: every product of the forward pass (:class:`Dot`).
      biases: ``{bias: {(bias dim, Tag)}}``: parameters added to tagged outputs.
      contracted: ``{param: dims}``: the dims of each projection contracted with activations.
      free: ``{param: dims}``: the dims of each projection left free (its outputs); a stacked
        parameter's layer dim (sliced by a scan) is in neither.
      score_sides: per attention-score product, the projections on its two sides.
      value_sides: per attention-value product, the projections on the values' side.
      gates: per gating product, ``(projections, nonlinear, projections, nonlinear)``.
      heads: per attention-score product, the size of its first tagged batch dimension.
      cut: ``{projection: primitive}``: where a tagged output dimension was sliced.
      lookups: 2-D parameters gathered from with indices computed from the inputs
        (embedding tables, ``nnx.Embed`` or a bare ``Param``).
      input_shapes: the traced inputs' shapes.
      reads_inputs: projections contracted with the model's inputs themselves (float
        features, not yet through any parameter): input projections, no pair's members.
      activations: ``{projection: primitive}``: the first nonlinearity (``erf``,
        ``logistic``, ``max``, ...) its input went through since the previous projection.
      input_dtypes: the traced inputs' dtypes.
      fed_by: ``{projection: projections}``: the projections its input came from most
        recently (through any work).
      batched: ``{projection: size}``: projections whose kernel has a batch dimension in
        its product (one kernel per expert), and that dimension's size.
      top_k: ``{projection: (k, choices)}``: projections whose output a ``top_k`` read
        most recently (routers: ``k`` of ``choices`` experts).
      grouped: parameters read only as the groups of a ``jax.lax.ragged_dot`` (stacked
        expert kernels ``[E, ...]`` applied to rows sorted by expert), whole.
      taken: parameters read only by gathers of whole slices along their first dimension
        (``w[expert_indices]``: each token's experts' weights).
    """

    paths: tuple[tuple, ...]
    shapes: tuple[tuple[int, ...], ...]
    edges: tuple[Edge, ...]
    dots: tuple[Dot, ...]
    biases: dict[int, frozenset]
    contracted: dict[int, frozenset]
    free: dict[int, frozenset]
    score_sides: tuple[tuple[frozenset, frozenset], ...]
    value_sides: tuple[frozenset, ...]
    gates: tuple[tuple[frozenset, bool, frozenset, bool], ...]
    heads: tuple[int, ...]
    cut: dict[int, str]
    lookups: frozenset[int]
    input_shapes: tuple[tuple[int, ...], ...]
    reads_inputs: frozenset[int] = frozenset()
    activations: dict[int, str] = dataclasses.field(default_factory=dict)
    input_dtypes: tuple[str, ...] = ()
    fed_by: dict[int, frozenset] = dataclasses.field(default_factory=dict)
    batched: dict[int, int] = dataclasses.field(default_factory=dict)
    top_k: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    grouped: frozenset[int] = frozenset()
    taken: frozenset[int] = frozenset()

    def path(self, i: int) -> str:
        """Parameter ``i``'s dotted path."""
        return ".".join(str(k) for k in self.paths[i])


def _key(k: Any) -> Any:
    return getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))


def trace_forward(
    model: nnx.Module, inputs: Any, forward: Callable[[nnx.Module, Any], Any] | None = None
) -> tuple[Any, list, Any, list]:
    """``model(inputs)`` (or ``forward(model, inputs)``) traced abstractly: ``(the closed
    jaxpr over (parameters, the other state, the inputs' arrays), the parameters' leaves
    with their paths, the other state, the inputs' arrays as ShapeDtypeStructs)``.

    Raises:
      TraceError: as :func:`trace_model`.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    pleaves, ptree = jax.tree_util.tree_flatten_with_path(params)
    pvals = [jax.ShapeDtypeStruct(np.shape(v), v.dtype) for _, v in pleaves]
    ileaves, itree = jax.tree_util.tree_flatten(inputs)
    arrays = [i for i, x in enumerate(ileaves) if hasattr(x, "shape") and hasattr(x, "dtype")]
    ivals = [jax.ShapeDtypeStruct(np.shape(ileaves[i]), ileaves[i].dtype) for i in arrays]

    def run(pv: list, rest: Any, iv: list) -> Any:
        m = nnx.merge(graphdef, jax.tree_util.tree_unflatten(ptree, pv), rest)
        leaves = list(ileaves)
        for i, v in zip(arrays, iv, strict=True):
            leaves[i] = v
        x = jax.tree_util.tree_unflatten(itree, leaves)
        out = forward(m, x) if forward is not None else m(x)
        leaves_out = jax.tree_util.tree_leaves(out)
        if not leaves_out or not all(isinstance(o, jax.Array) for o in leaves_out):
            raise _NotArraysError(out)
        return out

    how = "forward(model, batch)" if forward is not None else f"{type(model).__name__}(inputs)"
    try:
        closed = jax.make_jaxpr(run)(pvals, rest, ivals)
    except _NotArraysError as err:
        raise TraceError(
            f"{how} returned {err.value!r}, not arrays; the forward hook must return the "
            "model's output (logits) or a loss."
        ) from None
    except Exception as err:  # the user's call failed: say where, and how to call it
        raise TraceError(
            f"tracing {how} failed for the auto-parallel plan: {type(err).__name__}: {err}. "
            "If the model is not called as model(inputs) — it needs positions, a mask or a "
            "cache, or the batch's input is not its first entry — pass "
            "ToDistributedConfig(forward=lambda model, batch: ...) calling it as your "
            "training step does."
        ) from err
    return closed, pleaves, rest, ivals


def trace_model(
    model: nnx.Module, inputs: Any, forward: Callable[[nnx.Module, Any], Any] | None = None
) -> Trace:
    """Traces ``model(inputs)`` (or ``forward(model, inputs)``) abstractly and walks it.

    Args:
      model: an ``nnx.Module``.
      inputs: what the model is called with: arrays or ``jax.ShapeDtypeStruct`` leaves
        (numpy arrays are read for their shapes only).
      forward: ``forward(model, inputs)`` when calling ``model(inputs)`` is not how the
        model runs (positions, masks, caches, a loss): anything returning arrays.

    Raises:
      TraceError: the call fails (the message names the model and suggests ``forward``),
        or returns no arrays.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> trace = trace_model(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), jnp.ones((2, 4)))
      >>> trace.input_shapes
      ((2, 4),)
    """
    closed, pleaves, rest, ivals = trace_forward(model, inputs, forward)
    paths = tuple(tuple(_key(k) for k in path[:-1]) for path, _ in pleaves)
    shapes = tuple(tuple(int(s) for s in np.shape(v)) for _, v in pleaves)
    # the reference models' attention (imported here: loading a saved model needs no models)
    from jfleet.models.attention import PLATFORM_ATTENTION

    walk = Walk(scope=PLATFORM_ATTENTION)  # products of causal_attention: Dot.scoped
    n_rest = len(jax.tree_util.tree_leaves(rest))
    args: list[Val] = []
    for i, shape in enumerate(shapes):
        n = len(shape)
        view = tuple(Tag(i, d, shape[d], raw=n == 2) for d in range(n))
        args.append(Val(tags=(EMPTY,) * n, bcast=(False,) * n, view=view, grad=True))
    args += [const_val(len(np.shape(x))) for x in jax.tree_util.tree_leaves(rest)][:n_rest]
    for v in ivals:
        n = len(v.shape)
        args.append(Val(tags=(EMPTY,) * n, bcast=(False,) * n, act=True))
    consts = [const_val(len(np.shape(c))) for c in closed.consts]
    walk.run(closed.jaxpr, args, consts)
    return Trace(
        paths=paths,
        shapes=shapes,
        edges=tuple(walk.edges),
        dots=tuple(walk.dots),
        biases={k: frozenset(v) for k, v in walk.biases.items()},
        contracted={k: frozenset(v) for k, v in walk.contracted.items()},
        free={k: frozenset(v) for k, v in walk.free.items()},
        score_sides=tuple(walk.score_sides),
        value_sides=tuple(walk.value_sides),
        gates=tuple(walk.gates),
        heads=tuple(walk.heads),
        cut=dict(walk.cut),
        lookups=frozenset(walk.lookups),
        input_shapes=tuple(tuple(v.shape) for v in ivals),
        reads_inputs=frozenset(walk.reads_inputs),
        activations=dict(walk.activations),
        input_dtypes=tuple(str(v.dtype) for v in ivals),
        fed_by={k: frozenset(v) for k, v in walk.fed_by.items()},
        batched=dict(walk.batched),
        top_k=dict(walk.top_k),
        grouped=frozenset(walk.grouped - walk.read_otherwise - walk.taken),
        taken=frozenset(walk.taken - walk.read_otherwise - walk.grouped),
    )

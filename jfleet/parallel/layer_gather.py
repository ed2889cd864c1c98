"""ZeRO-3 as FSDP: a stacked layer's weights are gathered where the layer runs, and its
gradient is reduce-scattered there.

Under ZeRO-3 the training step used to gather every parameter (to its tensor-parallel
layout) at its start, so a scanned stack of ``L`` layers was live whole through the
step and its gradient was whole-size until the final reduction: temp memory measured 3x
the whole model's parameters at 4 and at 16 layers (issue 37). Here each layer of a
stack gathers its own slice inside the loop body instead:

* forward: the ``[...]`` slice of one layer is constrained to its tensor-parallel layout
  (an all-gather over the ZeRO axis), used, and dropped; a weight whose layer computes in
  a narrower dtype (AMP O1: fp32 parameters, bf16 matmuls) is cast first, so it is
  gathered in the compute dtype, as FSDP does, and its gradient reduced in fp32;
* backward: the layer's gradient is constrained to its ZeRO layout (a reduce-scatter;
  all-reduce + slice on XLA:CPU) before it leaves the loop body, so the stacked gradient
  the backward loop writes is already split;
* the backward needs the gathered weights again: under recompute they are re-gathered by
  construction; without it the loop body saves its matmul outputs
  (``dots_saveable``), not the gathered weights, so they are re-gathered too.

ZeRO-2 uses the same rule with an identity forward (the parameters are not split): only
the gradient is reduce-scattered per layer, so no whole-size gradient of the stack exists.
ZeRO-1 / 2 update each rank's shard of the parameters and return them whole; left to
itself XLA gathers a stacked parameter whole along a non-major dimension into temp and
transposes it, several at once (ZeRO-2, 16 layers: 7 MiB of temp). The engine instead
splits the updated stacks (:func:`split_tree`) and gathers them back one layer at a time
into the parameters' old buffers (:func:`regather_tree`, pairs from
:func:`update_gathers`), so the update's temp is one layer.

The engine (:mod:`jfleet.training.engine`) turns this on while it traces a ZeRO-2 / 3
step (:func:`per_layer`); a module that runs stacked layers and gathers them
(:class:`GathersLayers`, e.g. ``to_distributed``'s scanned blocks) reads the placement
with :func:`current` and the pairs of layouts with :func:`unit_shardings`, and passes
them to :func:`jfleet.parallel.stack.run_layers`. Parameters outside such modules (the
embedding, the head) are gathered by the engine at the step's start as before, through
:func:`gather` so their gradients are split the same way.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((8,), ("sharding",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("sharding")))
  >>> full, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("sharding"))
  >>> g = jax.jit(jax.grad(lambda w: gather(w, full, shard).sum()))(w)
  >>> g.sharding.spec
  P('sharding',)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh.placement import Placement

__all__ = [
    "GathersLayers",
    "compute_dtypes",
    "current",
    "gather",
    "gather_tree",
    "outside_gathers",
    "per_layer",
    "regather",
    "regather_tree",
    "split_tree",
    "unit_shardings",
    "update_gathers",
]

#: (full, shard): a layer's tensor-parallel layout and its ZeRO layout, per leaf (the
#: per-layer gathers add the compute dtype and whether the leaf arrives split).
Pair = tuple[NamedSharding, NamedSharding]

_PLACEMENT: contextvars.ContextVar[Placement | None] = contextvars.ContextVar(
    "jfleet_layer_gather", default=None
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def gather(
    x: jax.Array, full: NamedSharding, shard: NamedSharding, dtype: Any = None, split: bool = True
) -> jax.Array:
    """``x`` laid out as ``full`` (an all-gather over the ZeRO axis); its cotangent laid
    out as ``shard`` (a reduce-scatter) in the backward pass.

    ``dtype``: the dtype the layer computes in, where narrower than ``x``'s (AMP O1: fp32
    parameters, bf16 compute): ``x`` is cast before the all-gather, as FSDP gathers in the
    compute dtype, and its cotangent cast back before the reduce-scatter (the gradient is
    reduced in ``x``'s dtype). The layer's own cast is then a no-op: the same values.

    ``split``: whether ``x`` arrives split as ``shard`` (ZeRO-3). ZeRO-2's parameters
    arrive whole (``full`` is their own layout): the forward is the identity, only the
    cotangent is reduce-scattered.
    """
    x = x if dtype is None else x.astype(dtype)
    flat = _flat_pair(full, shard, x.ndim) if split else None
    if flat is None:
        return lax.with_sharding_constraint(x, full)
    dim, flat_full, flat_shard = flat
    moved = jnp.moveaxis(x, dim, 0)
    pieces = lax.with_sharding_constraint(moved.reshape(-1), flat_shard)
    whole = lax.with_sharding_constraint(pieces, flat_full).reshape(moved.shape)
    return lax.with_sharding_constraint(jnp.moveaxis(whole, 0, dim), full)


def _flat_pair(full: NamedSharding, shard: NamedSharding, ndim: int) -> tuple | None:
    """For a layer split by ZeRO along one dimension and by nothing else: that dimension
    and the 1-D layouts of the layer flattened with it first.

    A layer sliced from a stack is gathered as one flat vector: XLA places an all-gather's
    gathered dimension outermost in memory, and gathering the ``[1, ...]`` slice of the
    stack along a later dimension made XLA lay out (copy) the whole stacked parameter that
    way before the layer loop, one more stack-sized buffer per parameter (issue 37).
    """
    mesh = full.mesh
    whole, split = (_live(_padded(s.spec, ndim), mesh.shape) for s in (full, shard))
    differ = [d for d in range(ndim) if whole[d] != split[d]]
    if len(differ) != 1 or any(e is not None for e in whole):
        return None
    if any(e is not None for d, e in enumerate(split) if d != differ[0]):
        return None
    return differ[0], NamedSharding(mesh, P()), NamedSharding(mesh, P(split[differ[0]]))


def _live(entries: tuple, sizes: Any) -> tuple:
    """Spec entries without the mesh axes of size 1 (None where none is left)."""
    out = []
    for e in entries:
        axes = tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if sizes[a] > 1)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def _gather_fwd(
    x: jax.Array, full: NamedSharding, shard: NamedSharding, dtype: Any, split: bool
) -> tuple:
    return gather(x, full, shard, dtype, split), jnp.zeros((), x.dtype)


def _gather_bwd(
    full: NamedSharding,
    shard: NamedSharding,
    dtype: Any,
    split: bool,
    like: jax.Array,
    ct: jax.Array,
) -> tuple:
    ct = ct.astype(like.dtype)
    flat = _flat_pair(full, shard, ct.ndim)
    if flat is None:
        return (lax.with_sharding_constraint(ct, shard),)
    dim, _, flat_shard = flat
    moved = jnp.moveaxis(ct, dim, 0)
    pieces = lax.with_sharding_constraint(moved.reshape(-1), flat_shard).reshape(moved.shape)
    return (lax.with_sharding_constraint(jnp.moveaxis(pieces, 0, dim), shard),)


gather.defvjp(_gather_fwd, _gather_bwd)


class GathersLayers:
    """Marks a module whose stacked layers gather their own weights under ZeRO-2 / 3 (the
    engine leaves its parameters split; the module calls :func:`unit_shardings`)."""


@contextlib.contextmanager
def per_layer(placement: Placement | None) -> Iterator[None]:
    """While tracing a step: stacked layers gather per layer under ``placement``'s ZeRO
    (nothing for None or ZeRO stage < 2)."""
    if placement is not None and placement.zero_stage < 2:
        placement = None
    token = _PLACEMENT.set(placement)
    try:
        yield
    finally:
        _PLACEMENT.reset(token)


def current() -> Placement | None:
    """The placement stacked layers gather under now (None: outside a ZeRO-2 / 3 step)."""
    return _PLACEMENT.get()


def unit_shardings(
    placement: Placement, state: nnx.State, lead: int, body: nnx.Module | None = None
) -> list[tuple | None]:
    """Per leaf of ``state`` (stacked parameters, ``lead`` leading stack dimensions), in
    ``jax.tree.leaves`` order: the layouts one layer's slice is gathered to and its
    gradient scattered to, and with ``body`` (the stacked module ``state`` is of) the dtype
    its owner computes in where narrower than the leaf (:func:`compute_dtypes`; gathered
    in it). None where ZeRO does not split the leaf, or splits it along a stack dimension
    (no per-layer gather is possible; the leaf runs as laid out).

    Each entry is ``(full, shard, dtype, split)``, :func:`gather`'s arguments; ``split``
    is False under ZeRO-2, which gathers nothing: its ``full`` is the parameter's own
    layout, and only the gradient is reduce-scattered.
    """
    tp = jax.tree.leaves(placement.param_shardings(state, zero=False))
    zero = jax.tree.leaves(placement.param_shardings(state, zero=True))
    casts = compute_dtypes(body, state) if body is not None else [None] * len(tp)
    pairs: list[tuple | None] = []
    for whole, split, cast in zip(tp, zero, casts, strict=True):
        full, shard = _inner(whole.spec, lead), _inner(split.spec, lead)
        if full is None or shard is None or full == shard:
            pairs.append(None)
            continue
        split = placement.zero_stage >= 3
        pairs.append((placement.named(full), placement.named(shard), cast, split))
    return pairs


def compute_dtypes(body: nnx.Module, state: nnx.State) -> list[Any]:
    """Per leaf of ``state`` (``body``'s), in ``jax.tree.leaves`` order: the floating dtype
    the module owning it computes in (its ``dtype`` attribute) where narrower than the
    leaf, else None. AMP O1 gives the white list's modules a bf16 / fp16 ``dtype`` over
    fp32 parameters (:mod:`jfleet.precision.amp`); its black list's keep fp32.

    Example:
      >>> from flax import nnx
      >>> import jax.numpy as jnp
      >>> layer = nnx.Linear(2, 2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
      >>> compute_dtypes(layer, nnx.state(layer))
      [dtype(bfloat16), dtype(bfloat16)]
    """
    owners = {tuple(path): node for path, node in nnx.iter_graph(body)}
    out = []
    for path, leaf in zip(
        (p for p, _ in nnx.to_flat_state(state)), jax.tree.leaves(state), strict=True
    ):
        want = getattr(owners.get(tuple(path[:-1])), "dtype", None)
        have = getattr(leaf, "dtype", None)
        narrower = (
            want is not None
            and have is not None
            and jnp.issubdtype(want, jnp.floating)
            and jnp.issubdtype(have, jnp.floating)
            and jnp.dtype(want).itemsize < jnp.dtype(have).itemsize
        )
        out.append(jnp.dtype(want) if narrower else None)
    return out


def outside_gathers(
    placement: Placement, model: nnx.Module, params: nnx.State
) -> list[Pair | None] | None:
    """What the engine gathers at a ZeRO-3 step's start when ``model`` holds stacks that
    gather per layer (:class:`GathersLayers`): per leaf of ``params`` (``nnx.state(model,
    wrt)``, in ``jax.tree.leaves`` order), the (tensor-parallel, ZeRO) layouts of a
    parameter outside those stacks (the embedding, the head; None where ZeRO leaves it
    whole), None for one inside. None when ``model`` holds no such stack (the engine then
    gathers every parameter at the start, as before).
    """
    return _split_leaves(placement, model, params, inside=False)


def update_gathers(
    placement: Placement, model: nnx.Module, params: nnx.State
) -> list[Pair | None] | None:
    """What a ZeRO-1 / 2 step gathers one layer at a time at its end: per leaf of
    ``params``, the (tensor-parallel, ZeRO) layouts of a stacked parameter inside a
    :class:`GathersLayers` stack that ZeRO splits, None for the others. None when
    ``model`` holds no such stack.

    The optimizer updates each parameter on its ZeRO shard; the step returns it whole.
    Left to the step's output layout, XLA all-gathers every stacked parameter whole into a
    temporary buffer (gathering a dimension that is not the outermost, then transposing
    it into place), several at once: at 16 scanned blocks that was all of ZeRO-2's temp
    growth with depth (issue 37). :func:`regather` gathers one layer of the stack at a
    time into the output instead.
    """
    return _split_leaves(placement, model, params, inside=True)


def _split_leaves(
    placement: Placement, model: nnx.Module, params: nnx.State, *, inside: bool
) -> list[Pair | None] | None:
    """(tensor-parallel, ZeRO) layouts of the leaves of ``params`` that ZeRO splits and
    that lie inside (``inside``) or outside the model's :class:`GathersLayers` stacks."""
    stacks = [path for path, node in nnx.iter_graph(model) if isinstance(node, GathersLayers)]
    if not stacks:
        return None
    tp = jax.tree.leaves(placement.param_shardings(params, zero=False))
    zero = jax.tree.leaves(placement.param_shardings(params, zero=True))
    pairs: list[Pair | None] = []
    for (path, _), full, shard in zip(nnx.to_flat_state(params), tp, zero, strict=True):
        within = any(path[: len(s)] == s for s in stacks)
        pairs.append((full, shard) if within == inside and full != shard else None)
    return pairs


def regather(x: jax.Array, old: jax.Array, full: NamedSharding, shard: NamedSharding) -> jax.Array:
    """``x``, a stacked parameter updated on its ZeRO shard ``shard``, laid out as ``full``
    one layer at a time: a loop over the stack dimensions that neither layout splits
    writes each layer's all-gather into ``old`` (the parameter before the update, laid out
    as ``full``; the step donates it, so the loop writes in place).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> mesh = jax.make_mesh((8,), ("sharding",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> full, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "sharding"))
      >>> w = jax.device_put(jnp.ones((4, 8, 2)), full)
      >>> new = jax.jit(lambda w: regather(2 * w, w, full, shard))(w)
      >>> float(new.sum()), new.sharding.is_fully_replicated
      (128.0, True)
    """
    x = lax.with_sharding_constraint(x, shard)
    lead = _stack_dims(full.spec, shard.spec, x.ndim)
    if lead == 0 or x.shape[:lead] == (1,) * lead:
        return lax.with_sharding_constraint(x, full)
    one = NamedSharding(full.mesh, P(*_padded(full.spec, x.ndim)[lead:]))
    layers = x.reshape((-1, *x.shape[lead:]))

    def put_layer(i: jax.Array, out: jax.Array) -> jax.Array:
        layer = lax.with_sharding_constraint(lax.dynamic_index_in_dim(layers, i, 0, False), one)
        return lax.dynamic_update_index_in_dim(out, layer, i, 0)

    out = lax.with_sharding_constraint(old, full).reshape(layers.shape)
    out = lax.fori_loop(0, layers.shape[0], put_layer, out)
    return lax.with_sharding_constraint(out.reshape(x.shape), full)


def split_tree(tree: Any, pairs: list[Pair | None]) -> Any:
    """``tree``'s leaves laid out as their ZeRO shard where ``pairs`` gives layouts (the
    update is computed there, before :func:`regather_tree`)."""
    leaves, treedef = jax.tree.flatten(tree)
    out = [
        x if p is None else lax.with_sharding_constraint(x, p[1])
        for x, p in zip(leaves, pairs, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def regather_tree(tree: Any, old: Any, pairs: list[Pair | None]) -> Any:
    """``tree``'s leaves through :func:`regather` (into ``old``'s) where ``pairs`` (one per
    leaf) gives layouts."""
    leaves, treedef = jax.tree.flatten(tree)
    olds = jax.tree.leaves(old)
    out = [
        x if p is None else regather(x, o, *p) for x, o, p in zip(leaves, olds, pairs, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def _padded(spec: P, ndim: int) -> tuple:
    """``spec``'s entries, one per dimension (missing trailing ones None)."""
    entries = tuple(spec)
    return entries + (None,) * (ndim - len(entries))


def _stack_dims(full: P, shard: P, ndim: int) -> int:
    """How many leading dimensions neither layout splits (the stack's, or fewer), keeping
    the first dimension either splits."""
    for lead, (a, b) in enumerate(zip(_padded(full, ndim), _padded(shard, ndim), strict=True)):
        if a is not None or b is not None:
            return lead
    return 0  # nothing split: no per-layer gather


def gather_tree(tree: Any, pairs: list[Pair | None]) -> Any:
    """``tree``'s leaves through :func:`gather` where ``pairs`` (one per leaf) gives layouts."""
    leaves, treedef = jax.tree.flatten(tree)
    out = [x if p is None else gather(x, *p) for x, p in zip(leaves, pairs, strict=True)]
    return jax.tree.unflatten(treedef, out)


def _inner(spec: P, lead: int) -> P | None:
    """``spec`` without its ``lead`` stack entries; None if one of those is split."""
    entries = tuple(spec)
    if any(e is not None for e in entries[:lead]):
        return None
    return P(*entries[lead:])

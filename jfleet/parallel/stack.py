"""Stacked layers: the one code that turns identical layers into pipeline stages and runs them.

:class:`~jfleet.parallel.pipeline_layer.PipelineLayer` (Paddle's pipelined body) and
``to_distributed``'s :class:`~jfleet.auto_parallel.blocks.PipelinedBlocks` (a stand-in for
a model's list of decoder blocks) both run through this module:

* :func:`stack_layers` stacks ``N`` alike layers into one module of their class whose
  parameters are ``[P, N/P, ...]`` (stage ``s`` owns row ``s``); :func:`annotate_stack`
  lays the stacked parameters out as ``(pp, None, *inner)`` on a mesh. Layers are alike
  when their definitions are equal, static settings included (:func:`first_difference`);
  layers that repeat with a period ``p`` (local / global attention alternating) stack as
  ``N/p`` super-blocks of ``p`` layers each (:class:`SuperBlock`, :func:`block_period`).
* :func:`run_layers` runs a stack of layers with one ``lax.scan`` (optionally recomputing
  groups of layers, optionally constraining each output); :func:`run_stack` runs all
  stages of a stacked module in order (the single-device model).
* :func:`stage_inputs` splits what a stage gets into the schedules' three kinds: the
  **carried** activation (the floating leaves of the value passed from layer to layer;
  sent to the next stage, differentiated), per-sample **side** inputs (split into
  micro-batches with the activation, never differentiated: the non-floating leaves of the
  activation, such as integer position ids or a boolean attention mask, and the per-sample
  extra block arguments) and **shared** inputs (whole arrays every micro-batch gets: a
  rotary table). :func:`stage_function` builds the schedules' stage function
  ``stage_fn(params, carried, side, shared) -> carried`` from them.
* :func:`widened_stage`: XLA:CPU aborts compiling a 16-bit all-reduce inside a partly manual
  ``shard_map`` (the schedules' gradient sums), so on CPU half-precision arrays cross the
  pipeline in float32 and are cast back inside the stage: the same values.

Non-floating leaves of the activation do not cross stages: every stage receives the
values that entered the stack (as side inputs), so the layers must return them unchanged,
as Paddle's pipelined layers pass ``(hidden, mask, position_ids)`` along.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> layers = [nnx.Linear(3, 3, rngs=nnx.Rngs(i)) for i in range(4)]
  >>> body = stack_layers(layers, 2)
  >>> body.kernel.shape
  (2, 2, 3, 3)
  >>> x = jnp.ones((5, 3))
  >>> want = layers[3](layers[2](layers[1](layers[0](x))))
  >>> bool(jnp.allclose(run_stack(body, x), want, atol=1e-6))
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jfleet.mesh.topology import PP
from jfleet.parallel.alike import block_period, first_difference, first_mismatch

__all__ = [
    "CARRIED",
    "SHARED",
    "SIDE",
    "STATIC",
    "StageFn",
    "StageInputs",
    "SuperBlock",
    "annotate_stack",
    "batch_first_leaves",
    "block_period",
    "first_difference",
    "first_mismatch",
    "narrow",
    "run_layers",
    "run_stack",
    "stack_layers",
    "stage_function",
    "stage_inputs",
    "widen",
    "widened",
    "widened_stage",
    "widens_on",
]

CARRIED = "carried"
"""Kind of an activation leaf passed from stage to stage and differentiated."""
SIDE = "side"
"""Kind of a per-sample stage input: split into micro-batches with the activation."""
SHARED = "shared"
"""Kind of a whole-array stage input: every micro-batch gets all of it."""
STATIC = "static"
"""Kind of a block argument that is not an array: passed to every layer as it is."""

#: The schedules' stage function: ``stage_fn(params_of_one_stage, x, side, shared) -> y``.
StageFn = Callable[[Any, Any, Any, Any], Any]


class SuperBlock(nnx.Module):
    """``p`` consecutive layers run in order: the unit stacked when layers repeat every ``p``.

    ``__call__(x, *args, **kwargs)`` runs ``x = layer(x, *args, **kwargs)`` for each layer,
    every layer getting the same further arguments and passing the activation (an array or
    a tuple such as ``(hidden, mask, positions)``) to the next.

    Attributes:
      layers: the layers, in order (an ``nnx.List``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> pair = SuperBlock([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(2)])
      >>> x = jnp.ones((1, 2))
      >>> bool(jnp.allclose(pair(x), pair.layers[1](pair.layers[0](x))))
      True
    """

    def __init__(self, layers: Sequence[nnx.Module]) -> None:
        self.layers = nnx.List(list(layers))

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        for layer in self.layers:
            x = layer(x, *args, **kwargs)
        return x


def _steps(module: nnx.Module) -> Iterator[nnx.Module]:
    """The layers one scan step of a stack runs: a super-block's, or the module itself."""
    return iter(module.layers) if isinstance(module, SuperBlock) else iter((module,))


# ------------------------------------------------------------------ stacking


def check_params_only(module: Any, what: str, fix: str = "") -> None:
    """Raises when ``module`` holds state other than ``nnx.Param`` (pipelined layers may not).

    Raises:
      ValueError: naming ``what``, the state kinds found and the fix.

    Example:
      >>> check_params_only(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "a stage")
    """
    other = nnx.state(module, nnx.Not(nnx.Param))
    if jax.tree.leaves(other):
        kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(other)})
        raise ValueError(
            f"{what} hold state other than nnx.Param ({kinds}); pipelined layers may only "
            "hold parameters (no batch statistics, caches or RNG streams: build dropout "
            f"without rngs{', ' + fix if fix else ''})."
        )


def stack_layers(
    layers: Sequence[nnx.Module],
    num_stages: int,
    name: str | None = None,
    *,
    period: int = 1,
) -> Any:
    """One module whose parameters are the layers' stacked to ``[P, N/P, ...]``.

    With ``period=1`` the layers must be alike (:func:`first_difference`: the same
    definition, static settings such as a sliding window included), and the result is a
    module of their class built from layer 0's definition. With ``period=p`` layer ``i``
    must be alike to layer ``i % p``: each ``p`` consecutive layers become a
    :class:`SuperBlock` and the ``N/p`` super-blocks are stacked to ``[P, N/(pP), ...]``
    (:func:`block_period` finds ``p``). Each layer's own (tensor-parallel)
    ``out_sharding`` metadata, and its ZeRO ``optimizer_sharding`` if set, is kept
    behind the two stacked axes, ``(None, None, *inner)``; :func:`annotate_stack` fills
    in the stage axis of ``out_sharding``.

    Args:
      layers: ``N`` modules holding only ``nnx.Param``\\ s.
      num_stages: ``P``; it must divide ``N / period``.
      name: what the layers are called in error messages (default: their class name).
      period: ``p``, the number of consecutive layers stacked as one unit; it must
        divide ``N``.

    Returns:
      A module of the layers' class (``period=1``) or a :class:`SuperBlock` (its
      ``__call__`` is one unit's; run the stack with :func:`run_layers` / :func:`run_stack`).

    Raises:
      TypeError: an entry that is not an ``nnx.Module``.
      ValueError: no layers; ``period`` not dividing their number; ``num_stages`` not
        dividing the number of units; layers holding state other than ``nnx.Param``
        (batch statistics, caches, RNG streams); or layers that are not alike (layer
        ``i`` unlike layer ``i % period``; the message names the first differing
        attribute with both values and the period they repeat with, if any).

    Example:
      >>> from flax import nnx
      >>> body = stack_layers([nnx.Linear(2, 3, rngs=nnx.Rngs(i)) for i in range(6)], 3)
      >>> body.kernel.shape, body.bias.shape
      ((3, 2, 2, 3), (3, 2, 3))
      >>> def linear(i):  # every other layer computes at the highest matmul precision
      ...     return nnx.Linear(2, 2, precision="highest" if i % 2 else None, rngs=nnx.Rngs(i))
      >>> stack_layers([linear(i) for i in range(4)], 2)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: the pipelined body's Linear layers are not alike: layer 1 differs from ...
      >>> pairs = stack_layers([linear(i) for i in range(4)], 2, period=2)
      >>> type(pairs).__name__, pairs.layers[1].kernel.shape, pairs.layers[1].precision
      ('SuperBlock', (2, 1, 2, 2), 'highest')
    """
    layers = list(layers)
    if not layers:
        raise ValueError("stack_layers(layers=[]): pass the (alike) layers to stack.")
    bad = [
        f"{i}: {type(a).__name__}" for i, a in enumerate(layers) if not isinstance(a, nnx.Module)
    ]
    name = name or type(layers[0]).__name__
    if bad:
        raise TypeError(
            f"the pipelined body's {name} builds {'; '.join(bad)}, not an nnx.Module; "
            "pipelined layers must be nnx.Module instances."
        )
    count = len(layers)
    if not isinstance(period, int) or period < 1 or count % period:
        raise ValueError(
            f"period={period!r} does not divide the {count} {name} layers; use a period "
            f"(layers per super-block) dividing {count}."
        )
    units = count // period
    if not isinstance(num_stages, int) or num_stages < 1 or units % num_stages:
        grouped = f" in {units} super-blocks of {period}" if period > 1 else ""
        raise ValueError(
            f"num_stages={num_stages!r} does not split the {count} {name} layers{grouped} "
            f"evenly; use a stage count dividing {units}."
        )
    for layer in layers[:period]:
        check_params_only(
            layer,
            f"the pipelined body's {name} layers",
            "or keep such layers in the pre / post part",
        )
    mismatch = first_mismatch(layers, period)
    if mismatch:
        raise ValueError(_unlike_message(layers, mismatch, period, name))
    if period > 1:
        layers = [SuperBlock(layers[k : k + period]) for k in range(0, count, period)]
    graphdef, template = nnx.split(layers[0])
    per_stage = units // num_stages
    leaves = [jax.tree.leaves(nnx.state(layer)) for layer in layers]
    stacked = jax.tree.unflatten(
        jax.tree.structure(template),
        [
            jnp.stack(xs).reshape(num_stages, per_stage, *xs[0].shape)
            for xs in zip(*leaves, strict=True)
        ],
    )
    for _, var in nnx.to_flat_state(stacked):
        for key in ("out_sharding", "optimizer_sharding"):  # layouts, now behind the stack
            inner = var.get_metadata(key, None)
            if inner:
                inner = tuple(inner) + (None,) * (var.ndim - 2 - len(inner))
                var.set_metadata(**{key: (None, None, *inner)})
    return nnx.merge(graphdef, stacked)


def _unlike_message(
    layers: Sequence[nnx.Module], mismatch: tuple[int, int, str], period: int, name: str
) -> str:
    i, j, difference = mismatch
    found = block_period(layers)
    said = f"layer {i} differs from layer {j} in {difference}"
    if period == 1:
        head = f"the pipelined body's {name} layers are not alike: {said}"
    else:
        head = f"the pipelined body's {name} layers do not repeat every {period}: {said}"
    if found is not None and found != period:
        fix = (
            f"they repeat every {found} layers: stack them with period={found} (super-blocks "
            f"of {found} consecutive layers), or run them without a pipeline."
        )
    else:
        fix = (
            f"they do not repeat with any period shorter than all {len(layers)}, so one "
            "definition cannot run them all: run them without a pipeline, or give them the "
            "same settings."
        )
    return f"{head}. Stacked layers all run one definition (static settings included); {fix}"


def annotate_stack(body: nnx.Module, mesh: jax.sharding.Mesh, num_stages: int) -> None:
    """Sets a stacked module's ``out_sharding`` to ``(PP, None, *inner)`` and its ``mesh``.

    ``inner`` is each layer's own (tensor-parallel) layout, read from the metadata
    :func:`stack_layers` left behind the two stacked axes. The stage axis is sharded on
    the pipeline axis only when the mesh's pipeline size is ``num_stages`` (else None).

    Example:
      >>> import jax
      >>> from flax import nnx
      >>> mesh = jax.make_mesh((2,), ("pp",), devices=jax.devices()[:2])
      >>> body = stack_layers([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(4)], 2)
      >>> annotate_stack(body, mesh, 2)
      >>> body.kernel.get_metadata("out_sharding")
      ('pp', None, None, None)
    """
    stage_axis = PP if mesh.shape.get(PP, 1) == num_stages else None
    for _, var in nnx.to_flat_state(nnx.state(body)):
        current = var.get_metadata("out_sharding", None)
        inner = tuple(current)[2:] if current else ()
        inner = inner + (None,) * (var.ndim - 2 - len(inner))
        var.set_metadata(out_sharding=(stage_axis, None, *inner), mesh=mesh)


# ------------------------------------------------------------------ running
def run_layers(
    graphdef: Any,
    params: Any,
    x: Any,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    remat_interval: int = 0,
    after: Callable[[Any], Any] | None = None,
    remat_policy: Callable[..., bool] | None = None,
) -> Any:
    """``x`` through the layers whose parameters are ``params`` (leaves ``[n, ...]``).

    Each scan step is one stacked unit, ``nnx.merge(graphdef, params_of_unit)``: a layer,
    or the ``p`` layers of a :class:`SuperBlock` in order. Each layer is called as
    ``layer(x, *args, **kwargs)``, with ``after`` (a sharding constraint, say) applied to
    its output. The activation (an array or a pytree such as ``(hidden, mask,
    position_ids)``) is a ``lax.scan`` carry: it keeps the structure and dtypes it enters
    with (cast back after each unit).

    Args:
      graphdef: the graph definition of one unit (``nnx.split(stacked)[0]``).
      params: the units' parameters, leaves ``[n, ...]`` (one stage's, or all).
      x: the activation entering the first layer.
      args: further positional arguments of every layer.
      kwargs: keyword arguments of every layer.
      remat_interval: ``k > 0`` runs each group of ``k`` units (layers, or super-blocks)
        under ``jax.checkpoint`` (the last group may be shorter); 0 keeps every activation.
      after: applied to each layer's output.
      remat_policy: the ``jax.checkpoint`` saving policy of the recomputed groups (None:
        save nothing, recompute all; ``jax.checkpoint_policies.dots_saveable``: keep the
        matmul outputs, recompute only the cheap elementwise work).

    Returns:
      The last layer's output.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> body = stack_layers([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(3)], 1)
      >>> graphdef, state = nnx.split(body)
      >>> params = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(state))  # stage 0
      >>> run_layers(graphdef, params, jnp.ones((4, 2)), remat_interval=2).shape
      (4, 2)
    """
    kwargs = kwargs or {}

    def one(h: Any, w: Any) -> tuple[Any, None]:
        y = h
        for layer in _steps(nnx.merge(graphdef, w)):
            y = layer(y, *args, **kwargs)
            y = y if after is None else after(y)
        return jax.tree.map(lambda a, b: a.astype(b.dtype), y, h), None

    def scan(h: Any, w: Any) -> Any:
        return lax.scan(one, h, w)[0]

    if remat_interval <= 0:
        return scan(x, params)
    if remat_interval == 1:  # one loop whose step is recomputed (no nested scan of 1)
        return lax.scan(jax.checkpoint(one, policy=remat_policy), x, params)[0]
    n = jax.tree.leaves(params)[0].shape[0]
    groups, rest = divmod(n, remat_interval)
    group = jax.checkpoint(scan, policy=remat_policy)
    if groups:
        full = jax.tree.map(
            lambda a: a[: groups * remat_interval].reshape(groups, remat_interval, *a.shape[1:]),
            params,
        )
        x = lax.scan(lambda h, w: (group(h, w), None), x, full)[0]
    if rest:
        x = group(x, jax.tree.map(lambda a: a[groups * remat_interval :], params))
    return x


def run_stack(body: nnx.Module, x: Any, *args: Any, remat_interval: int = 0, **kwargs: Any) -> Any:
    """All ``N`` layers of a stacked module in order, on one program (the sequential model).

    ``remat_interval`` counts stacked units (super-blocks when the stack has a period).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> body = stack_layers([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(4)], 2)
      >>> run_stack(body, jnp.ones((3, 2))).shape
      (3, 2)
    """
    graphdef, state = nnx.split(body)
    params = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), nnx.to_pure_dict(state))
    return run_layers(graphdef, params, x, args, kwargs, remat_interval=remat_interval)


# ------------------------------------------------------------------ stage inputs
def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray)


def _floating(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class StageInputs:
    """How :func:`stage_inputs` split a stack's inputs into carried, side and shared parts.

    Attributes:
      activation: the treedef of the activation passed from layer to layer.
      act_kinds: per activation leaf, :data:`CARRIED` (floating, batch first), :data:`SIDE`
        (batch first, not floating) or :data:`SHARED` (not batch first: an ``[L, L]`` mask).
      arguments: the treedef of ``(args, kwargs)``, the layers' further arguments.
      leaves: the argument leaves; the arrays among them are replaced by None (their
        values come back as side / shared inputs).
      kinds: per argument leaf, :data:`SIDE`, :data:`SHARED` or :data:`STATIC`.
    """

    activation: Any
    act_kinds: tuple[str, ...]
    arguments: Any
    leaves: tuple
    kinds: tuple[str, ...]

    @property
    def floating(self) -> tuple[bool, ...]:
        """Per activation leaf, whether it is carried from stage to stage."""
        return tuple(k == CARRIED for k in self.act_kinds)

    @property
    def num_side(self) -> int:
        """How many side inputs come from the activation (they come first)."""
        return self.act_kinds.count(SIDE)

    @property
    def num_shared(self) -> int:
        """How many shared inputs come from the activation (they come first)."""
        return self.act_kinds.count(SHARED)

    def activation_of(
        self, carried: Sequence[Any], side: Sequence[Any], shared: Sequence[Any] = ()
    ) -> Any:
        """The activation rebuilt from its carried leaves and the first side / shared inputs.

        Raises:
          ValueError: the activation has shared leaves and ``shared`` lacks them.
        """
        if len(shared) < self.num_shared:
            raise ValueError(
                f"the activation has {self.num_shared} leaves that are not batch first (whole "
                f"arrays every micro-batch gets); activation_of got {len(shared)} shared inputs."
            )
        parts = {CARRIED: iter(carried), SIDE: iter(side), SHARED: iter(shared)}
        leaves = [next(parts[k]) for k in self.act_kinds]
        return jax.tree.unflatten(self.activation, leaves)

    def carried_of(self, y: Any) -> list:
        """The carried (floating) leaves of a layer's output.

        Raises:
          ValueError: ``y`` does not have the activation's structure.
        """
        leaves, treedef = jax.tree.flatten(y)
        if treedef != self.activation:
            raise ValueError(
                "the pipelined layers must return an activation of the structure they take "
                f"(it is passed to the next layer); they take {self.activation} and return "
                f"{treedef}."
            )
        return [leaf for leaf, k in zip(leaves, self.act_kinds, strict=True) if k == CARRIED]

    def arguments_of(self, side: Sequence[Any], shared: Sequence[Any]) -> tuple[tuple, dict]:
        """The layers' ``(args, kwargs)`` from the side and shared inputs (after the
        activation's own)."""
        side = iter(list(side)[self.num_side :])
        shared = iter(list(shared)[self.num_shared :])
        merged = [
            next(side) if k == SIDE else next(shared) if k == SHARED else leaf
            for leaf, k in zip(self.leaves, self.kinds, strict=True)
        ]
        return jax.tree.unflatten(self.arguments, merged)


def stage_inputs(
    x: Any,
    args: tuple = (),
    kwargs: dict | None = None,
    per_sample: Sequence[int | str] | None = None,
    *,
    batch: int | None = None,
    batch_first: Sequence[bool] | None = None,
) -> tuple[StageInputs, list, list, list]:
    """Splits a stack's inputs into the carried activation, side and shared inputs.

    The activation ``x`` (an array or a pytree such as ``(hidden, mask, position_ids)``):
    its batch-first floating leaves are **carried** (passed between stages, differentiated),
    its other batch-first leaves (integer ids, boolean masks) are **side** inputs (split
    into micro-batches), and its leaves that are not batch first (an ``[L, L]`` mask, a
    small table) are **shared** (whole with every micro-batch); neither kind gets a
    gradient. The layers' further arguments ``args`` / ``kwargs``: with ``per_sample``
    (argument positions after the activation, or keyword names) the arrays of those
    arguments are side inputs and every other array is **shared**; without it an array
    whose leading dimension is the batch size is a side input. Leaves that are not arrays
    (``deterministic=True``) are static.

    Args:
      x: the activation entering the stack.
      args: further positional arguments of every layer.
      kwargs: keyword arguments of every layer.
      per_sample: which arguments hold one row per sample, or None (decided by shape).
      batch: the batch size (default: the leading dimension of ``x``'s first floating leaf).
      batch_first: per leaf of ``x``, whether it holds one row per sample (when known, e.g.
        by tracing with another batch size: an ``[L, L]`` mask with ``L`` the batch size);
        default: a leaf whose leading dimension is ``batch``.

    Returns:
      ``(inputs, carried, side, shared)``: the split (for :func:`stage_function` and to
      rebuild the output), the carried leaves, the side arrays and the shared arrays (the
      activation's first in both).

    Raises:
      ValueError: ``x`` has a leaf that is not an array or no batch-first floating leaf;
        or, without ``per_sample``, an argument whose leading dimension is the batch size
        and also another dimension of the activation (it could be a per-sample array or a
        sequence-indexed table).

    Example:
      >>> import jax.numpy as jnp
      >>> hidden, ids, causal = jnp.ones((4, 3, 2)), jnp.zeros((4, 3), int), jnp.ones((3, 3))
      >>> table = jnp.ones((3, 2))
      >>> inputs, carried, side, shared = stage_inputs(
      ...     (hidden, ids, causal), (table,), {"flag": True})
      >>> inputs.act_kinds, len(carried), len(side), len(shared), inputs.kinds
      (('carried', 'side', 'shared'), 1, 1, 2, ('shared', 'static'))
    """
    kwargs = kwargs or {}
    x_leaves, activation = jax.tree.flatten(x)
    bad = [f"{type(a).__name__}" for a in x_leaves if not _is_array(a)]
    floats = [a for a in x_leaves if _is_array(a) and _floating(a) and a.ndim]
    if batch is None and floats:
        batch = floats[0].shape[0]
    if batch_first is None:
        batch_first = [_is_array(a) and a.ndim > 0 and a.shape[0] == batch for a in x_leaves]
    act_kinds = tuple(
        SHARED if not (_is_array(a) and first) else CARRIED if _floating(a) else SIDE
        for a, first in zip(x_leaves, batch_first, strict=True)
    )
    if bad or CARRIED not in act_kinds:
        got = jax.tree.map(lambda a: f"{getattr(a, 'dtype', type(a).__name__)}", x)
        shapes = jax.tree.map(lambda a: tuple(getattr(a, "shape", ())), x)
        raise ValueError(
            f"the activation entering the pipelined layers is {got} of shapes {shapes} (batch "
            f"{batch}); it must be an array or a pytree of arrays with at least one floating "
            "array whose leading dimension is the batch (the hidden state) passed from layer "
            "to layer; integer ids, masks and tables may travel with it."
        )
    first = next(a for a, k in zip(x_leaves, act_kinds, strict=True) if k == CARRIED)
    pick = {kind: [a for a, k in zip(x_leaves, act_kinds, strict=True) if k == kind]
            for kind in (CARRIED, SIDE, SHARED)}  # fmt: skip
    carried, side, shared = pick[CARRIED], pick[SIDE], pick[SHARED]
    per_sample = None if per_sample is None else tuple(per_sample)
    leaves, kinds = [], []
    named = [*enumerate(args), *sorted(kwargs.items())]  # jax.tree.flatten's order
    for key, value in named:
        for path, leaf in jax.tree_util.tree_leaves_with_path(value):
            kind = _kind(key, path, leaf, first, per_sample)
            kinds.append(kind)
            leaves.append(leaf if kind == STATIC else None)
            if kind == SIDE:
                side.append(leaf)
            elif kind == SHARED:
                shared.append(leaf)
    arguments = jax.tree.structure((tuple(args), kwargs))
    inputs = StageInputs(activation, act_kinds, arguments, tuple(leaves), tuple(kinds))
    return inputs, carried, side, shared


def _kind(key: Any, path: Any, leaf: Any, x: jax.Array, per_sample: tuple | None) -> str:
    if not _is_array(leaf):
        return STATIC
    if per_sample is not None:
        return SIDE if key in per_sample else SHARED
    batch = x.shape[0]
    if leaf.ndim < 1 or leaf.shape[0] != batch:
        return SHARED
    if batch in x.shape[1:]:
        where = f"argument {key!r}{jax.tree_util.keystr(path)}"
        raise ValueError(
            f"{where} of the pipelined blocks has shape {leaf.shape}, and its leading "
            f"{batch} is both the batch size and another dimension of the activation "
            f"{x.shape}: it is unclear whether it holds one row per sample. Say which "
            "block arguments are per-sample: ToDistributedConfig(per_sample_args=(0, "
            "'mask', ...)) (positions after the activation, or keyword names)."
        )
    return SIDE


def batch_first_leaves(fn: Callable[[Any], Any], inputs: Any) -> list[bool] | None:
    """Per leaf of ``fn(inputs)``, whether it holds one row per sample: its leading dimension
    follows the batch when ``fn`` is traced with twice the batch (an ``[L, L]`` mask does
    not, even when ``L`` is the batch size). None when ``fn`` cannot be traced so.

    Example:
      >>> import jax.numpy as jnp
      >>> batch_first_leaves(lambda x: (x * 2, jnp.ones((4, 4))), jnp.ones((4, 3)))
      [True, False]
    """
    batch = jax.tree.leaves(inputs)[0].shape[0]
    twice = jax.tree.map(lambda a: jax.ShapeDtypeStruct((2 * batch, *a.shape[1:]), a.dtype), inputs)
    try:
        at_one, at_two = jax.eval_shape(fn, inputs), jax.eval_shape(fn, twice)
    except Exception:  # a function tied to the batch size: decided by shape instead
        return None
    pairs = zip(jax.tree.leaves(at_one), jax.tree.leaves(at_two), strict=True)
    return [bool(a.shape) and (a.shape[0], b.shape[0]) == (batch, 2 * batch) for a, b in pairs]


def stage_function(
    graphdef: Any,
    inputs: StageInputs,
    *,
    remat_interval: int = 0,
    after: Callable[[Any], Any] | None = None,
) -> StageFn:
    """The schedules' ``stage_fn(params, carried, side, shared) -> carried`` for a stack.

    It rebuilds the activation and the layers' arguments from the carried, side and
    shared inputs (as :func:`stage_inputs` split them), runs the stage's layers with
    :func:`run_layers` and returns the carried leaves of the output.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> body = stack_layers([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(2)], 1)
      >>> graphdef, state = nnx.split(body)
      >>> params = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(state))
      >>> inputs, carried, side, shared = stage_inputs(jnp.ones((3, 2)))
      >>> stage_fn = stage_function(graphdef, inputs)
      >>> [a.shape for a in stage_fn(params, carried, side, shared)]
      [(3, 2)]
    """

    def stage_fn(params: Any, carried: Any, side: Any, shared: Any) -> list:
        x = inputs.activation_of(carried, side, shared)
        args, kwargs = inputs.arguments_of(side, shared)
        y = run_layers(
            graphdef, params, x, args, kwargs, remat_interval=remat_interval, after=after
        )
        return inputs.carried_of(y)

    return stage_fn


# ------------------------------------------------------------------ CPU widening
def widens_on(mesh: jax.sharding.Mesh) -> bool:
    """Whether half-precision arrays must cross a pipeline on ``mesh`` in float32 (CPU).

    Example:
      >>> import jax
      >>> widens_on(jax.make_mesh((1,), ("pp",), devices=jax.devices()[:1]))
      True
    """
    return mesh.devices.flat[0].platform == "cpu"


def widen(tree: Any, wide: bool = True) -> Any:
    """``tree`` with its half-precision floating leaves cast to float32 when ``wide``.

    Example:
      >>> import jax.numpy as jnp
      >>> [a.dtype for a in widen([jnp.ones(2, jnp.bfloat16), jnp.ones(2, int)])]
      [dtype('float32'), dtype('int32')]
    """

    def one(a: Any) -> Any:
        if wide and jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize < 4:
            return a.astype(jnp.float32)
        return a

    return jax.tree.map(one, tree)


def narrow(tree: Any, like: Any) -> Any:
    """``tree`` cast back to the dtypes of ``like`` (arrays or dtypes): undoes :func:`widen`.

    Example:
      >>> import jax.numpy as jnp
      >>> narrow(jnp.ones(2), jnp.ones(2, jnp.bfloat16)).dtype
      dtype(bfloat16)
    """
    dtypes = jax.tree.map(lambda a: getattr(a, "dtype", a), like)
    return jax.tree.map(lambda a, d: a if a.dtype == d else a.astype(d), tree, dtypes)


def widened(fn: Callable[..., Any], like: tuple, *, wide: bool) -> Callable[..., Any]:
    """``fn`` taking its first ``len(like)`` arguments widened and returning its output widened.

    Inside, those arguments are cast back to the dtypes of ``like`` (a tuple of pytrees of
    arrays or dtypes) before ``fn`` runs; further arguments pass unchanged. With ``wide``
    False, ``fn`` itself.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones(2, jnp.bfloat16)
      >>> f = widened(lambda a, b: a * b, (x,), wide=True)
      >>> f(widen(x), 2.0).dtype
      dtype('float32')
    """
    if not wide:
        return fn
    dtypes = jax.tree.map(lambda a: getattr(a, "dtype", a), like)

    def wide_fn(*args: Any) -> Any:
        head = narrow(args[: len(dtypes)], dtypes)
        return widen(fn(*head, *args[len(dtypes) :]))

    return wide_fn


def widened_stage(
    stage_fn: StageFn, params: Any, x: Any, *, mesh: jax.sharding.Mesh
) -> tuple[StageFn, Any, Any]:
    """A stage function, its parameters and activation as they cross a pipeline on ``mesh``.

    On CPU meshes (:func:`widens_on`) the parameters and activation are widened to float32
    and the returned stage function casts them back before ``stage_fn`` and widens its
    output; elsewhere everything is returned as given. Cast the pipeline's output back
    with ``narrow(y, x)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((1,), ("pp",), devices=jax.devices()[:1])
      >>> w, x = jnp.ones((2, 2), jnp.bfloat16), jnp.ones((3, 2), jnp.bfloat16)
      >>> fn, w32, x32 = widened_stage(lambda w, x, s, c: x @ w, w, x, mesh=mesh)
      >>> w32.dtype, fn(w32, x32, (), ()).dtype
      (dtype('float32'), dtype('float32'))
    """
    wide = widens_on(mesh)
    return widened(stage_fn, (params, x), wide=wide), widen(params, wide), widen(x, wide)

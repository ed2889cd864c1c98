"""Stacked layers: the one code that turns identical layers into pipeline stages and runs them.

:class:`~jfleet.parallel.pipeline_layer.PipelineLayer` (Paddle's pipelined body) and
``to_distributed``'s :class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks` (a stand-in for
a model's list of decoder blocks) both run through this module:

* :func:`stack_layers` stacks ``N`` alike layers into one module of their class whose
  parameters are ``[P, N/P, ...]`` (stage ``s`` owns row ``s``); with ``chunk_sizes``
  the stages may hold different numbers of layers (``P`` need not divide ``N``): rows are
  padded to the largest stage, and :func:`padded_stage` makes the stage function skip the
  padded slots exactly (an identity step; their gradients are exactly zero);
  :func:`annotate_stack`
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

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jfleet.mesh.topology import PP
from jfleet.parallel import virtual_stages as virtual
from jfleet.parallel.alike import block_period, first_difference, first_mismatch
from jfleet.parallel.layer_gather import Pair, gather_tree
from jfleet.parallel.merged_backward import Accumulate, run_merged
from jfleet.parallel.stage_io import (
    CARRIED,
    SHARED,
    SIDE,
    STATIC,
    StageFn,
    StageInputs,
    batch_first_leaves,
    narrow,
    stage_inputs,
    widen,
    widened,
    widened_stage,
    widens_on,
)

__all__ = [
    "CARRIED",
    "SHARED",
    "SIDE",
    "STATIC",
    "CallOutput",
    "PaddedSlot",
    "StageFn",
    "StageInputs",
    "SuperBlock",
    "annotate_stack",
    "batch_first_leaves",
    "block_period",
    "first_difference",
    "first_mismatch",
    "layer_order",
    "narrow",
    "padded_stage",
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


class CallOutput(nnx.Variable):
    """State a layer overwrites on every call before reading it: what its last call
    reported (an MoE gate's auxiliary loss, its routing counts), not an input of the next.

    A stack built with ``outputs=True`` (:func:`stack_layers`) holds such variables stacked
    like the parameters; a pipeline runs each layer on scratch copies of them, so their
    values are only seen inside the block that calls the layer (which may return them
    with its activation), never kept in the stacked module.

    Example:
      >>> class Probe(nnx.Module):  # reports the mean of its last input
      ...     def __init__(self):
      ...         self.mean = CallOutput(jnp.zeros(()))
      ...     def __call__(self, x):
      ...         self.mean[...] = x.mean()
      ...         return x
      >>> stack_layers([Probe(), Probe()], 2, outputs=True).mean.shape
      (2, 1)
    """


def check_params_only(
    module: Any, what: str, fix: str = "", *, streams: bool = False, outputs: bool = False
) -> None:
    """Raises when ``module`` holds state other than ``nnx.Param`` (pipelined layers may not;
    with ``streams``, RNG streams are allowed too; with ``outputs``, :class:`CallOutput`\\ s).

    Raises:
      ValueError: naming ``what``, the state kinds found and the fix.

    Example:
      >>> check_params_only(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "a stage")
    """
    kept = (nnx.Param, *((nnx.RngState,) if streams else ()), *((CallOutput,) if outputs else ()))
    kept = nnx.Any(*kept) if len(kept) > 1 else nnx.Param
    other = nnx.state(module, nnx.Not(kept))
    if jax.tree.leaves(other):
        kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(other)})
        raise ValueError(
            f"{what} hold state other than nnx.Param ({kinds}); pipelined layers may only "
            "hold parameters (no batch statistics, caches or RNG streams: build dropout "
            "without rngs, an MoE gate without random draws (GShard's random_routing=False, "
            f"no Switch gate){', ' + fix if fix else ''})."
        )


def stack_layers(
    layers: Sequence[nnx.Module],
    num_stages: int,
    name: str | None = None,
    *,
    period: int = 1,
    streams: bool = False,
    chunk_sizes: Sequence[int] | None = None,
    outputs: bool = False,
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
      streams: allow RNG streams (``nnx.RngState``: their keys and counts are stacked like
        the parameters); the caller draws from them as it documents.
      chunk_sizes: units (layers, or super-blocks) per chunk, ``P v`` of them (``v``
        virtual stages per device; see :mod:`~jfleet.parallel.virtual_stages`), the
        layers given in their own order: the stack is ``[P, v K, ...]`` with ``K =
        max(chunk_sizes)``, chunk ``c P + s`` in slots ``c K ..`` of row ``s``; a padded
        slot holds a copy of a real unit of its row and is skipped by
        :func:`padded_stage`. ``P`` need not divide the units then. None: ``P`` equal
        stages of the layers as given (already in stacked order).
      outputs: allow :class:`CallOutput` state (stacked like the parameters).

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
      >>> uneven = stack_layers([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(5)], 2,
      ...                       chunk_sizes=(3, 2))  # row 1's third slot is padding
      >>> uneven.kernel.shape
      (2, 3, 2, 2)
    """
    layers = list(layers)
    name = _check_stackable(
        layers, num_stages, period, name, streams, chunk_sizes is None, outputs=outputs
    )
    count, units = len(layers), len(layers) // period
    if period > 1:
        layers = [SuperBlock(layers[k : k + period]) for k in range(0, count, period)]
    graphdef, template = nnx.split(layers[0])
    if chunk_sizes is None:
        per_stage = units // num_stages
        table = np.arange(units).reshape(num_stages, per_stage)
    else:
        table = _slot_table(chunk_sizes, units, num_stages, name)
    leaves = [jax.tree.leaves(nnx.state(layer)) for layer in layers]
    # a stack of stages' stacks: a slice of one stage's row is one concatenated operand, so
    # a program computing one stage's row (sharded creation) computes no other stage's
    stacked = jax.tree.unflatten(
        jax.tree.structure(template),
        [
            jnp.stack([jnp.stack([xs[u] for u in row]) for row in table])
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


def _slot_table(chunk_sizes: Sequence[int], units: int, num_stages: int, name: str) -> Any:
    """Per row and slot, the unit stacked there: a padded slot takes its row's nearest
    real unit (finite values whose forward the stage computes and discards)."""
    if not isinstance(num_stages, int) or num_stages < 1 or len(chunk_sizes) % num_stages:
        raise ValueError(
            f"chunk_sizes={list(chunk_sizes)!r} must hold num_stages={num_stages!r} x virtual "
            "stages counts (one per chunk); pass one count per chunk."
        )
    v = len(chunk_sizes) // num_stages
    sizes = virtual.check_sizes(list(chunk_sizes), units, num_stages, v, name=f"{name} units")
    table = virtual.slot_units(sizes, num_stages)
    for row in table:
        real = [u for u in row if u >= 0]
        last = real[0]
        for k, u in enumerate(row):
            last = u if u >= 0 else last
            row[k] = last
    return table


def _check_stackable(
    layers: list,
    num_stages: int,
    period: int,
    name: str | None,
    streams: bool = False,
    even: bool = True,
    *,
    outputs: bool = False,
) -> str:
    """Raises when ``layers`` cannot be stacked; returns what they are called."""
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
    bad_stages = not isinstance(num_stages, int) or num_stages < 1
    if bad_stages or (even and units % num_stages):
        grouped = f" in {units} super-blocks of {period}" if period > 1 else ""
        raise ValueError(
            f"num_stages={num_stages!r} does not split the {count} {name} layers{grouped} "
            f"evenly; use a stage count dividing {units}, or chunk_sizes (uneven stages)."
        )
    for layer in layers[:period]:
        check_params_only(
            layer,
            f"the pipelined body's {name} layers",
            "or keep such layers in the pre / post part",
            streams=streams,
            outputs=outputs,
        )
    mismatch = first_mismatch(layers, period)
    if mismatch:
        raise ValueError(_unlike_message(layers, mismatch, period, name))
    return name


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
    gathers: list[Pair | None] | None = None,
    accumulate: Accumulate | None = None,
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
      gathers: ZeRO's per-layer gather (FSDP): per leaf of one unit's parameters (in
        ``jax.tree.leaves`` order), None or the (tensor-parallel, ZeRO) layouts of
        :func:`jfleet.parallel.layer_gather.unit_shardings`: the unit's slice is gathered
        inside the loop body and its gradient reduce-scattered there.
      accumulate: gradient merge in the backward pass: the accumulators of ``params``'
        gradients (a tree like ``params``, same dtypes); the gradient of ``params`` is then
        the accumulators plus this call's, added one layer at a time into their buffers
        (:func:`jfleet.parallel.merged_backward.run_merged`). Only with ``remat_interval=1``
        and ``remat_policy=None`` (full recompute: the forward keeps each layer's input).

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

    def unit(h: Any, w: Any, args: tuple, kwargs: dict) -> Any:
        y = h
        if gathers is not None:
            w = gather_tree(w, gathers)
        for layer in _steps(nnx.merge(graphdef, w)):
            y = layer(y, *args, **kwargs)
            y = y if after is None else after(y)
        _check_carried(y, h, layer)
        return jax.tree.map(lambda a, b: a.astype(b.dtype), y, h)

    def one(h: Any, w: Any) -> tuple[Any, None]:
        return unit(h, w, args, kwargs), None

    if accumulate is not None:
        if remat_interval != 1 or remat_policy is not None:
            raise ValueError(
                f"run_layers(accumulate=...) with remat_interval={remat_interval} and "
                f"remat_policy={remat_policy!r}: merging gradients in the backward pass "
                "recomputes each layer from its input; use remat_interval=1 and "
                "remat_policy=None (full recompute), or accumulate after the step."
            )
        return run_merged(unit, params, accumulate, x, args, kwargs)

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


def _check_carried(y: Any, h: Any, layer: nnx.Module) -> None:
    """Raises unless a stacked layer returned the structure of the activation it took."""
    got, want = jax.tree.structure(y), jax.tree.structure(h)
    if got != want:
        raise ValueError(
            f"a stacked {type(layer).__name__} layer returned {got} where it took {want}: "
            "the layers of a scanned or pipelined stack hand their output on as the next "
            "layer's activation, so each must return what it takes. Blocks that return more "
            "(a cache, an auxiliary loss) run through to_distributed, whose traced forward "
            "carries the activation and sums or drops the rest; or keep them unrolled."
        )


def run_stack(
    body: nnx.Module,
    x: Any,
    *args: Any,
    remat_interval: int = 0,
    chunk_sizes: Sequence[int] | None = None,
    **kwargs: Any,
) -> Any:
    """All ``N`` layers of a stacked module in order, on one program (the sequential model).

    ``remat_interval`` counts stacked units (super-blocks when the stack has a period).
    ``chunk_sizes``: the stack's units per chunk as :func:`stack_layers` took them (its
    padded slots are left out, its chunks run in layer order); None: rows in order.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> body = stack_layers([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(4)], 2)
      >>> run_stack(body, jnp.ones((3, 2))).shape
      (3, 2)
    """
    graphdef, state = nnx.split(body)
    params = nnx.to_pure_dict(state)
    if chunk_sizes is None:
        params = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), params)
    else:
        params = layer_order(params, chunk_sizes)
    return run_layers(graphdef, params, x, args, kwargs, remat_interval=remat_interval)


def layer_order(params: Any, chunk_sizes: Sequence[int]) -> Any:
    """Stacked leaves ``[P, v K, ...]`` as ``[N, ...]``: the real units in layer order
    (a static gather; padded slots left out, their gradients zero).

    Example:
      >>> import numpy as np
      >>> layer_order(np.array([[0, 1, 2], [3, 4, 4]]), (3, 2)).tolist()
      [0, 1, 2, 3, 4]
    """
    num_stages = jax.tree.leaves(params)[0].shape[0]
    table = virtual.slot_units(chunk_sizes, num_stages)
    rows, slots = np.nonzero(table >= 0)
    order = np.argsort(table[rows, slots])
    rows, slots = rows[order], slots[order]
    return jax.tree.map(lambda a: a[rows, slots], params)


class PaddedSlot(nnx.Module):
    """One slot of an unevenly stacked stage: its unit's output where ``real`` is nonzero,
    else the activation unchanged (an exact identity step, whose parameters get exactly
    zero gradient: ``jnp.where`` sends the padded branch a zero cotangent).

    Attributes:
      unit: the stacked unit (a layer or a :class:`SuperBlock`).
      real: an ``nnx.Variable`` scalar, 1.0 at a real slot and 0.0 at padding.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> x = jnp.ones((1, 2))
      >>> bool((PaddedSlot(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), 0.0)(x) == x).all())
      True
    """

    def __init__(self, unit: nnx.Module, real: Any = 1.0) -> None:
        self.unit = unit
        self.real = nnx.Variable(jnp.asarray(real, jnp.float32))

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        y = self.unit(x, *args, **kwargs)
        if jax.tree.structure(y) != jax.tree.structure(x):
            return y  # run_layers names the mismatch
        keep = self.real[...] > 0
        return jax.tree.map(lambda a, b: jnp.where(keep, a, b.astype(a.dtype)), y, x)


def padded_stage(
    body: nnx.Module,
    params: Any,
    chunk_sizes: Sequence[int],
    num_stages: int,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Any, Any]:
    """``(graphdef, params)`` of an unevenly stacked body for :func:`stage_function`: each
    scan step is a :class:`PaddedSlot` whose ``real`` flag comes with the parameters
    (``[P, v K]``, sharded and chunked like them; on ``mesh``, split over ``pp`` as the
    stacked parameters are), so any schedule skips the padded slots.

    The flags are constants of the step (not model parameters): the model's own
    gradients are those of ``params``, exactly zero at the padded slots.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> body = stack_layers([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(3)], 2,
      ...                     chunk_sizes=(2, 1))
      >>> graphdef, params = padded_stage(body, nnx.to_pure_dict(nnx.state(body)), (2, 1), 2)
      >>> params["real"].tolist()
      [[1.0, 1.0], [1.0, 0.0]]
    """
    mask = jnp.asarray(virtual.slot_mask(chunk_sizes, num_stages))
    if mesh is not None:
        stage_axis = PP if mesh.shape.get(PP, 1) == num_stages else None
        mask = jax.device_put(
            mask, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(stage_axis))
        )
    return nnx.graphdef(PaddedSlot(body)), {"unit": params, "real": mask}


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

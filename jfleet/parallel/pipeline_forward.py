"""A pipelined stack of stages with the loss outside it: the stand-in for a list of blocks.

:func:`pipeline_forward` runs ``P`` stages over ``M`` micro-batches inside one
``jax.shard_map`` (manual over ``pp`` and the data axes) and returns the last stage's
output, so a pipelined stack can replace a model's decoder blocks while the head and the
loss stay the model's own code (:class:`jfleet.auto_parallel.apply.blocks.PipelinedBlocks`).
With the loss outside the pipeline every forward precedes every backward; the schedules
differ in what a stage keeps between them. Both are a ``jax.custom_vjp`` whose forward runs
the GPipe forward loop (``M + P - 1`` ticks, bubble ticks skipped by ``lax.cond``) and whose
backward runs its own loop of ``M + P - 1`` ticks (bubbles skipped): stage ``s`` pulls the
cotangent of micro-batch ``t - (P - 1 - s)`` back, accumulates the parameter gradients and
sends the input cotangent to the previous stage by ``lax.ppermute``. No loop is
differentiated by JAX, so no per-tick residual (a ``cond`` would hand out the stage's
weights per tick) is stacked.

  * ``"FThenB"`` (GPipe): the forward stashes, per micro-batch, the stage's matmul (and
    convolution) outputs and the other residuals of its ``jax.vjp`` except the weights
    (:class:`~jfleet.parallel.pipeline_parts.SavedStage`: the stage runs under
    ``jax.checkpoint`` saving only matmul outputs); the backward pulls back from them,
    recomputing only elementwise work. Executed work per stage: ``M`` forwards and ``M``
    backwards; activation memory: every micro-batch's matmul outputs.
  * ``"1F1B"`` (and ``"FThenB"`` with ``remat=True``, the same program): the forward
    stashes only each micro-batch's stage input; the backward recomputes the stage from it
    (``jax.vjp``). Executed work per stage: ``M`` forwards, ``M`` recomputed forwards
    (XLA drops recomputed work whose result only the forward needed, such as the stage's
    last projection) and ``M`` backwards; activation memory: ``M`` stage inputs plus one
    micro-batch's internals (the name follows Paddle's ``schedule_mode``: with the loss
    outside, the bound on memory comes from the recompute, not from interleaving).
  * ``"VPP"`` (``num_virtual = v >= 2``): 1F1B's program over interleaved stages. Device
    ``s`` holds chunks ``s, s + P, ...`` of the stack; both loops run ``v M + P - 1`` ticks
    of one chunk each, the last stage's output (and stage 0's cotangent) going round the
    ring to the next chunk, so the bubble is ``(P - 1) / (v M + P - 1)``. It stashes
    ``v M`` chunk inputs and keeps one chunk's internals; ``M`` a multiple of ``P``.
  * ``selective=True`` (selective recompute, every schedule): ``"FThenB"`` and ``"1F1B"``
    both run FThenB's stashing program with the stage under selective recompute's policy
    (:func:`~jfleet.parallel.recompute.selective_policy`): the forward stashes, per
    micro-batch in flight, the stage input and its blocks' weight-matmul outputs; the
    backward recomputes only the attention cores (the matmuls with batch dimensions) and
    the elementwise work. Against FThenB it drops the ``s x s`` attention scores and
    probabilities from the stash; against 1F1B it trades the recomputed forward of the
    whole stage (its weight matmuls) for the kept matmul outputs of every micro-batch.
    ``"VPP"`` runs it over its interleaved chunks: each chunk's kept outputs are stashed
    per micro-batch (``v M`` stashes of a chunk's blocks, a stage's blocks in all).

The schedules run ``2(v M + P - 1)`` collective-permutes per training step (one per tick and
direction; ``v = 1`` but for VPP), plus one all-reduce of the output over ``pp``
(``rows_over_pp=False``) or one reduce-scatter (``rows_over_pp=True``), and the same again
for the input cotangent.

Tensor parallel inside the stages (an automatic ``mp`` axis, no ``sep``): what crosses
between stages and what the stack buffers is split over ``mp``
(:class:`~jfleet.parallel.pipeline_parts.TensorSplit`, each leaf on its first non-batch
dimension ``mp`` divides), as Megatron-LM's scatter / gather: each collective-permute
carries ``1 / mp`` of the activation and the receiver all-gathers it over ``mp`` inside the
node; the stashed stage inputs, the stack's gathered input, its outputs and cotangents cost
``1 / mp`` per device, and its gather / scatter over ``pp`` moves ``1 / mp``; the stage
runs on the whole activation (its output pinned whole, so the split does not spread into
it), the recomputing backward all-gathers one stashed input per tick, and the code before
and after the stack sees whole activations. Measured on 8 emulated devices (pp2 x mp4, a
two-matmul stage, M = 8 and 16): the collective-permute operand is a quarter of the
activation and the compiled temp grows by 1.75 stage inputs per micro-batch (the loss's
whole input among them; 3 with every buffer whole).

Batch layout: by default the batch is split over the data axes and every stage gets the
output for its replica's whole batch (a ``psum`` over ``pp``), so the code after the stack
runs on every stage. With ``rows_over_pp=True`` the rows are split over the data axes *and*
``pp`` (``P((*data_axes, pp))``): the stack gathers its input over ``pp`` and
reduce-scatters its output, so the embedding before it and the head and loss after it run
on ``1 / P`` of the rows per device. Row order is the unsplit batch's.

Example:
  >>> import jax, jax.numpy as jnp
  >>> mesh = jax.make_mesh((2, 4), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> w = jnp.stack([jnp.eye(3) * 2.0] * 4)  # 4 stages, each doubles x
  >>> f = lambda w, x: pipeline_forward(lambda w, x, s, c: x @ w, w, x, mesh=mesh,
  ...                                   num_microbatches=2, schedule="1F1B")
  >>> f(w, jnp.ones((8, 3)))[0]
  Array([16., 16., 16.], dtype=float32)
  >>> jax.grad(lambda w: f(w, jnp.ones((8, 3))).sum())(w).shape
  (4, 3, 3)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.mesh.placement import check_divides
from jfleet.mesh.topology import DATA_AXES, MP, PP
from jfleet.parallel import virtual_stages as virtual
from jfleet.parallel.pipeline_parts import (
    PipelineSpec,
    SavedStage,
    StageFn,
    TensorSplit,
    backward_ticks,
    check_stage,
    forward_ticks,
    from_microbatches,
    saves_matmuls,
    stage_call,
    stage_vjp,
    take,
    to_microbatches,
    validate,
    vary,
)
from jfleet.parallel.recompute import selective_policy


def pipeline_forward(
    stage_fn: StageFn,
    stage_params: Any,
    inputs: Any,
    side: Any = (),
    shared: Any = (),
    *,
    mesh: Mesh,
    num_microbatches: int,
    pp_axis: str = PP,
    data_axes: tuple[str, ...] = DATA_AXES,
    remat: bool = False,
    schedule: str = "FThenB",
    rows_over_pp: bool = False,
    num_virtual: int = 1,
    selective: bool = False,
) -> Any:
    """The output of a pipelined stack of stages, differentiable (see the module docstring).

    Args:
      stage_fn: ``stage_fn(params_of_one_stage, x, side, shared) -> y``, ``y`` of ``x``'s
        shapes and dtypes.
      stage_params: a pytree whose leaves have a leading axis of size ``P`` (the ``pp``
        degree), sharded on ``pp``.
      inputs: the activation ``[B, ...]`` entering stage 0 (a pytree of arrays allowed).
      side: per-sample arrays ``[B, ...]`` every stage needs with its micro-batch (an
        attention mask, positions); split into micro-batches like ``inputs``; no
        gradient flows into them (``lax.stop_gradient``).
      shared: arrays every stage gets whole (a rotary table); no gradient either.
      mesh: the mesh; must have ``pp_axis``.
      num_microbatches: ``M``; each data-parallel replica's rows split into ``M``
        consecutive micro-batches.
      pp_axis: the pipeline mesh axis.
      data_axes: mesh axes the batch is split over (those the mesh lacks are ignored).
      remat: recompute each stage in the backward pass (FThenB; 1F1B always does).
      schedule: ``"FThenB"``, ``"1F1B"`` or ``"VPP"`` (``"1F1B"`` with ``num_virtual > 1``
        runs ``"VPP"``).
      rows_over_pp: the batch's rows split over the data axes and ``pp``: the output too,
        so the code after the stack runs on ``1 / P`` of the rows per device.
      num_virtual: ``v``, chunks per stage (interleaved stages, ``"VPP"``): the stage
        leaves are ``[P, v K, ...]``, row ``s`` holding chunks ``s, s + P, ..., s + (v - 1)
        P`` of ``K`` units each in order (:func:`~jfleet.parallel.virtual_stages.
        interleaved_order`), and ``stage_fn`` runs one chunk's ``[K, ...]``.
      selective: selective recompute (any schedule, not with ``remat``):
        stash each micro-batch's weight-matmul outputs, recompute the attention cores and
        elementwise work (see the module docstring).

    Returns:
      The last stage's output for the whole batch, ``[B, ...]``: on every stage, or split
      over the data axes and ``pp`` with ``rows_over_pp``.

    Raises:
      ValueError: as :func:`~jfleet.parallel.pipeline_schedule.pipeline_loss` (unknown
        schedule, mesh without ``pp_axis``, stage leaves without the stage axis, a batch
        that does not split into the micro-batches), ``rows_over_pp`` with a batch that
        does not split over the data axes x ``pp``; ``"VPP"`` with ``num_virtual < 2``, a
        single stage, ``M`` not a multiple of ``P``, or stage leaves whose second axis
        ``num_virtual`` does not divide; ``selective`` with ``remat``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((2, 4), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> w = jnp.stack([jnp.eye(3) * 2.0] * 4)  # 4 stages, each doubles x
      >>> y = pipeline_forward(lambda w, x, s, c: x @ w, w, jnp.ones((8, 3)),
      ...                      mesh=mesh, num_microbatches=2, rows_over_pp=True)
      >>> y[0], y.sharding.spec
      (Array([16., 16., 16.], dtype=float32), P(('dp', 'pp'),))
    """
    v = virtual.check_virtual(num_virtual)
    virtual.check_chunks_agree(schedule, v, one_f_one_b_interleaves=True)
    schedule = "VPP" if v > 1 else schedule
    _check_selective(selective, remat)
    spec = validate(
        stage_fn,
        _no_head,
        stage_params,
        {"inputs": inputs, "side": side},
        mesh=mesh,
        schedule="1F1B" if schedule == "VPP" else schedule,
        num_microbatches=num_microbatches,
        pp_axis=pp_axis,
        data_axes=data_axes,
        remat=remat,
    )
    rows = bool(rows_over_pp)
    if rows:
        batch = jax.tree.leaves(inputs)[0].shape[0]
        check_divides(
            f"the batch of {batch} rows",
            batch,
            [*((a, mesh.shape[a]) for a in spec.data_axes), (pp_axis, spec.num_stages)],
            "rows_over_pp splits the rows over the data axes and the pipeline stages; "
            "use rows_over_pp=False for this batch",
            label="data-parallel size x pipeline stages",
        )
    if v > 1:
        _check_chunks(spec, stage_params, v)
    side, shared = lax.stop_gradient((side, shared))
    saving = _saving_policy(schedule, spec.remat, selective)
    return _pipelined(spec, rows, saving, v)(stage_params, inputs, side, shared)


def _check_selective(selective: bool, remat: bool) -> None:
    """Selective recompute runs without whole-stage remat."""
    if selective and remat:
        raise ValueError(
            "pipeline_forward(selective=True, remat=True): selective recompute keeps the "
            "stage's weight-matmul outputs, remat keeps none of them; pass one of the two."
        )


def _saving_policy(schedule: str, remat: bool, selective: bool) -> Callable[..., bool] | None:
    """What each stage stashes per micro-batch: the outputs a ``jax.checkpoint`` policy
    keeps (:class:`~jfleet.parallel.pipeline_parts.SavedStage`), or None: its input only
    (the backward recomputes the stage)."""
    if selective:
        return selective_policy()
    return saves_matmuls if schedule == "FThenB" and not remat else None


def _check_chunks(spec: PipelineSpec, stage_params: Any, v: int) -> None:
    """Interleaved stages: 2+ stages, micro-batches in groups of ``P``, ``v`` chunks a row."""
    p = spec.num_stages
    if p < 2:
        raise ValueError(
            f"num_virtual={v} interleaves chunks over the pipeline stages, but the mesh's "
            f"{spec.pp_axis!r} size is {p}; use num_virtual=1 or a pipeline of 2+ stages."
        )
    virtual.check_microbatches("VPP", p, spec.num_microbatches)
    bad = [
        f"{jax.tree_util.keystr(path) or '<root>'}: {leaf.shape}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params)
        if len(leaf.shape) < 2 or leaf.shape[1] % v
    ]
    if bad:
        raise ValueError(
            f"num_virtual={v} needs stage leaves [P, v K, ...] (v chunks of K units per "
            f"stage); these do not split into {v} chunks: {'; '.join(bad)}."
        )


def _no_head(*_: Any) -> jax.Array:
    return jnp.zeros((), jnp.float32)


def _batch_spec(spec: PipelineSpec, rows: bool) -> P:
    axes = (*spec.data_axes, spec.pp_axis) if rows else spec.data_axes
    return P(axes) if axes else P()


def _stash_spec(spec: PipelineSpec) -> P:
    """What a device stashed, as one block per device of a leading axis."""
    return P((spec.pp_axis, *spec.data_axes))


def _gather(tree: Any, spec: PipelineSpec, rows: bool, wire: Any = None) -> Any:
    """This replica's whole batch from its stages' shares (``rows_over_pp``), as
    micro-batches ``[M, b, ...]``; with ``wire`` split over ``mp`` (each device gathers its
    ``1 / mp`` share over ``pp``)."""
    if wire is None:
        if rows:
            tree = jax.tree.map(lambda a: lax.all_gather(a, spec.pp_axis, axis=0, tiled=True), tree)
        return to_microbatches(tree, spec)
    tree = wire.whole(tree)  # the code before the stack runs whole (see _scatter)
    if rows:
        tree = wire.send(tree, lambda a: lax.all_gather(a, spec.pp_axis, axis=0, tiled=True))
    return wire.split(to_microbatches(wire.split(tree), spec), lead=1)


def _scatter(tree: Any, spec: PipelineSpec, rows: bool, wire: Any = None) -> Any:
    """The sum over stages of micro-batches ``[M, b, ...]``: whole on every stage, or each
    stage's rows (``rows_over_pp``); with ``wire`` summed on each device's ``mp`` share,
    then all-gathered over ``mp``: the code after the stack runs whole (a split left to the
    compiler's sharding propagation spreads into it: measured, TinyLlama pp2 x mp2, it
    all-gathered the embedding table and the head's weight, and inside the stages their
    weights)."""
    tree = from_microbatches(tree)
    if rows:
        fn = lambda a: lax.psum_scatter(a, spec.pp_axis, scatter_dimension=0, tiled=True)  # noqa: E731
    else:
        fn = lambda a: lax.psum(a, spec.pp_axis)  # noqa: E731
    if wire is None:
        return jax.tree.map(fn, tree)
    return wire.whole(wire.send(wire.split(tree), fn))


def _mapped(
    spec: PipelineSpec, rows: bool, mode: str, saving: Callable[..., bool] | None = None, v: int = 1
) -> Callable[..., Any]:
    """The jitted ``shard_map`` of one pass: ``"forward"``, ``"stash"`` (forward + what
    the backward needs: the stage inputs, or with ``saving``, a ``jax.checkpoint`` policy,
    the outputs it keeps) or ``"backward"`` (the backward loop); ``v`` chunks per stage."""
    pp, batch = spec.pp_axis, _batch_spec(spec, rows)
    if mode == "backward":
        in_specs = (P(pp), _stash_spec(spec), batch, P(), batch)
        out_specs: Any = (P(pp), batch)
        body: Callable[..., Any] = lambda *a: _local_backward(spec, rows, saving, v, *a)  # noqa: E731
    else:
        in_specs = (P(pp), batch, batch, P())
        out_specs = (batch, _stash_spec(spec)) if mode == "stash" else batch
        body = lambda *a: _local_forward(spec, rows, mode, saving, v, *a)  # noqa: E731
    mapped = jax.shard_map(
        body,
        mesh=spec.mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(spec.manual_axes),
        check_vma=True,
    )
    return jax.jit(mapped)


def _pipelined(
    spec: PipelineSpec, rows: bool, saving: Callable[..., bool] | None, v: int
) -> Callable[..., Any]:
    """``f(stage_params, inputs, side, shared) -> y`` whose VJP is the backward loop: it
    recomputes each stage from its stashed input, or (``saving``) pulls back from the
    stashed matmul outputs."""

    @jax.custom_vjp
    def run(stage_params, inputs, side, shared):
        return _mapped(spec, rows, "forward", v=v)(stage_params, inputs, side, shared)

    def fwd(stage_params, inputs, side, shared):
        y, ins = _mapped(spec, rows, "stash", saving, v)(stage_params, inputs, side, shared)
        return y, (stage_params, ins, side, shared, inputs)

    def bwd(res, g):
        stage_params, ins, side, shared, inputs = res
        backward = _mapped(spec, rows, "backward", saving, v)
        d_params, d_inputs = backward(stage_params, ins, side, shared, g)
        return d_params, jax.tree.map(_cotangent, d_inputs, inputs), None, None

    run.defvjp(fwd, bwd)
    return run


def _cotangent(d: jax.Array, x: jax.Array) -> Any:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return d.astype(x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


def _prepare(spec, rows, v, stage_params, side, shared):
    """This device's stage parameters (``[v, K, ...]`` chunks when ``v > 1``), its stage
    call and index."""
    axes = spec.manual_axes
    params = vary(jax.tree.map(lambda a: a[0], stage_params), axes)
    if v > 1:
        params = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), params)
    side_mb = vary(_gather(side, spec, rows), axes)
    return params, stage_call(spec, side_mb, vary(shared, axes)), lax.axis_index(spec.pp_axis)


def _wire(spec: PipelineSpec) -> TensorSplit | None:
    """The tensor-parallel split of what stages stash and send (``mp``, an automatic axis
    inside the pipeline's ``shard_map``), or None without one."""
    mesh = spec.mesh
    if MP not in mesh.axis_names or MP in spec.manual_axes or mesh.shape[MP] == 1:
        return None
    if mesh.axis_types[mesh.axis_names.index(MP)] != jax.sharding.AxisType.Auto:
        return None
    others = set(mesh.axis_names) - {MP, *spec.manual_axes}
    if any(mesh.shape[a] > 1 for a in others):  # sep splits the sequence already
        return None
    return TensorSplit(MP, mesh.shape[MP])


def _local_forward(spec, rows, mode, saving, v, stage_params, inputs, side, shared):
    """One device's forward: the GPipe loop, the last stage's output (and the stash)."""
    axes = spec.manual_axes
    params, call, stage = _prepare(spec, rows, v, stage_params, side, shared)
    wire = _wire(spec)
    x_mb = vary(_gather(inputs, spec, rows, wire), axes)
    check_stage(call, take(params, 0) if v > 1 else params, take(x_mb, 0))

    def run(x, i, c=None):
        return vary(call(params if c is None else take(params, c), x, i), axes)

    stash: Any = mode == "stash"
    if stash and saving:
        saved = SavedStage(call, params, take(x_mb, 0), saving, chunked=v > 1)
        run, stash = saved.forward, saved.shapes
    got = forward_ticks(spec, run, x_mb, stage, stash=stash, virtual=v, wire=wire)
    stash = stash is not False
    outs = got[0] if stash else got
    last = stage == spec.num_stages - 1
    outs = jax.tree.map(lambda a: jnp.where(last, a, jnp.zeros_like(a)), outs)
    y = _scatter(outs, spec, rows, wire)
    return (y, jax.tree.map(lambda a: a[None], got[1])) if stash else y


def _local_backward(spec, rows, saving, v, stage_params, ins, side, shared, g):
    """One device's backward loop: parameter gradients (summed over the data axes) and
    the input cotangent (stage 0's, summed or scattered over ``pp``)."""
    axes = spec.manual_axes
    params, call, stage = _prepare(spec, rows, v, stage_params, side, shared)
    ins = vary(jax.tree.map(lambda a: a[0], ins), axes)
    wire = _wire(spec)
    g_mb = vary(_gather(g, spec, rows, wire), axes)
    if saving:
        vjp = SavedStage(call, params, take(g_mb, 0), saving, chunked=v > 1).backward
    elif v > 1:

        def vjp(x, g, i, c):  # recompute chunk c, pull back through it
            return stage_vjp(call, take(params, c))(x, g, i)

    else:
        vjp = stage_vjp(call, params)
    if wire is not None and not saving:  # the stage input was stashed split over mp
        pull = vjp
        vjp = lambda x, *a: pull(wire.whole(x), *a)  # noqa: E731
    d_params, d_x = backward_ticks(spec, vjp, params, ins, g_mb, stage, virtual=v, wire=wire)
    if spec.data_axes:
        d_params = lax.psum(d_params, spec.data_axes)
    d_params = jax.tree.map(
        lambda d, p: d.astype(p.dtype).reshape(p.shape[1:])[None], d_params, stage_params
    )
    return d_params, _scatter(d_x, spec, rows, wire)


def rows_fit(batch: int, mesh: Mesh, num_microbatches: int, data_axes: tuple = DATA_AXES) -> bool:
    """Whether ``batch`` rows split over the data axes x ``pp`` (``rows_over_pp``) and
    each replica's rows into ``num_microbatches`` micro-batches.

    Example:
      >>> import jax
      >>> mesh = jax.make_mesh((2, 4), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> rows_fit(16, mesh, 2), rows_fit(12, mesh, 2)
      (True, False)
    """
    data = math.prod(mesh.shape[a] for a in data_axes if a in mesh.axis_names)
    pp = mesh.shape[PP] if PP in mesh.axis_names else 1
    return batch % (data * pp) == 0 and batch % (data * num_microbatches) == 0

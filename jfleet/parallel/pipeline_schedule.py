"""SPMD pipeline schedules (FThenB / GPipe and 1F1B) as one differentiable loss function.

:func:`pipeline_loss` runs a stack of ``P`` pipeline stages over ``M`` micro-batches on a
mesh with a ``pp`` axis of size ``P`` and returns the mean loss; ``jax.grad`` /
``nnx.grad`` of it give the gradients of the stage parameters, the head parameters and
the inputs (so an embedding run before the pipeline gets its gradient too).

How it runs:
  * one ``jax.shard_map`` that is manual over ``pp`` and the data axes (``dp``,
    ``sharding``) and automatic over the others (``mp``, ``sep``), so tensor-parallel
    layers inside a stage keep working and the data-parallel gradient reduction happens
    once, after the loop;
  * stage ``s`` owns ``tree.map(lambda x: x[s], stage_params)`` (leading axis sharded on
    ``pp``); activations go to the next stage and cotangents to the previous one by
    ``lax.ppermute`` once per tick of a ``lax.scan``; ``lax.cond`` on per-device validity
    skips the bubble's work;
  * a ``jax.custom_vjp``: its forward runs the whole training schedule (the forward and
    backward passes of every micro-batch, as 1F1B interleaves them) and keeps the
    gradients as residuals; its backward multiplies them by the incoming cotangent (a loss
    scale, say). Without differentiation (``jax.jit(loss)``) a forward-only GPipe loop runs.

Schedules (:mod:`jfleet.parallel.schedule_ticks` counts their ticks, work and collectives):
  * ``"FThenB"`` (GPipe): the forward of every micro-batch (``M + P - 1`` ticks), stashing
    per micro-batch what its backward needs, then the backward loop (``M + P - 1`` ticks,
    :func:`backward_ticks`: ``jax.vjp`` + ``ppermute`` to the previous stage, shared with
    the ``to_distributed`` stand-in). Without remat the stash is the stage's matmul outputs
    (:class:`SavedStage`; elementwise work is recomputed); with ``remat=True`` only each
    micro-batch's stage input, and the backward recomputes the stage. Both skip their
    ``2(P - 1)`` bubble ticks.
  * ``"1F1B"``: one scan of ``T = M + 2(P - 1)`` ticks; at tick ``t`` stage ``s`` runs the
    forward of micro-batch ``t - s``, stashing only the stage input in a ring of
    ``2(P - 1)`` slots, and the backward of micro-batch ``t - 2(P - 1) + s``, recomputing
    the stage from its stashed input with ``jax.vjp``. The last stage computes the head's
    loss and cotangent of the micro-batch it just finished and runs its backward in the
    same tick. Activation memory is bounded by the number of stages, not micro-batches.

The loss is the mean over micro-batches of ``head_fn``'s loss, and over the data-parallel
replicas: with a ``head_fn`` that averages over its micro-batch's samples it equals the
single-device mean over the global batch, whatever the data-parallel degree. A loss that is
not linear in the batch (an MoE load-balancing loss) gets the whole batch's value under
FThenB from statistics the activation carries (``pooled`` leaves, summed over the
micro-batches before the head, which has every micro-batch's output before any backward).

One stage function serves both entry points: ``stage_fn(params_of_one_stage, x, side,
shared) -> y``. ``x`` is the activation passed from stage to stage (differentiated);
``side`` holds per-sample arrays split into micro-batches with the inputs (an attention
mask, position ids) and ``shared`` whole arrays every micro-batch gets (a rotary table).
Neither is differentiated (their cotangents are zero) nor passed between stages: every
stage reads the side rows of the micro-batch it runs (1F1B's backward re-reads them by
micro-batch index, so its stash ring holds only the activation).

Example:
  >>> import jax, jax.numpy as jnp
  >>> mesh = jax.make_mesh((2, 4), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> stage_fn = lambda w, x, mask, scale: jnp.tanh(x @ w) * mask[:, None] * scale
  >>> head_fn = lambda h, y, t: jnp.mean((y @ h - t) ** 2)
  >>> w = jnp.stack([jnp.eye(4)] * 4)  # 4 stages
  >>> x, t, mask = jnp.ones((16, 4)), jnp.zeros((16, 1)), jnp.ones(16)
  >>> loss = lambda w: pipeline_loss(stage_fn, head_fn, w, jnp.ones((4, 1)), x, t,
  ...                                side=mask, shared=jnp.float32(1.0),
  ...                                mesh=mesh, schedule="1F1B", num_microbatches=4)
  >>> value, grad = jax.jit(jax.value_and_grad(loss))(w)
  >>> grad.shape, bool(value > 0)
  ((4, 4, 4), True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.mesh.topology import DATA_AXES, PP
from jfleet.parallel.pipeline_parts import (
    HeadFn,
    PipelineSpec,
    SavedStage,
    StageFn,
    acc_dtype,
    backward_ticks,
    check_head,
    check_stage,
    forward_ticks,
    from_microbatches,
    pooled_outputs,
    put,
    reduced_loss,
    select,
    shift,
    stage_call,
    stage_grad_sum,
    stage_vjp,
    take,
    to_microbatches,
    validate,
    vary,
    zeros_like_tree,
)
from jfleet.parallel.schedule_ticks import (  # noqa: F401  (re-exported)
    SCHEDULES,
    TICK_KINDS,
    _check_schedule,
    schedule_stats,
    stage_ticks,
    taken_branches,
)


def pipeline_loss(
    stage_fn: StageFn,
    head_fn: HeadFn,
    stage_params: Any,
    head_params: Any,
    inputs: Any,
    targets: Any,
    side: Any = (),
    shared: Any = (),
    *,
    mesh: Mesh,
    schedule: str = "1F1B",
    num_microbatches: int,
    pp_axis: str = PP,
    data_axes: tuple[str, ...] = DATA_AXES,
    remat: bool = False,
    micro_losses: bool = False,
    stage_specs: Any = None,
    pooled: tuple[bool, ...] | None = None,
) -> Any:
    """The mean loss of a pipelined stack of stages, differentiable in all its arrays.

    Args:
      stage_fn: ``stage_fn(params_of_one_stage, x, side, shared) -> y``, ``y`` of ``x``'s
        structure, shapes and dtypes (the activation passed between stages); ``side`` and
        ``shared`` are this micro-batch's rows of ``side`` and all of ``shared``. A stage
        may hold several layers (leaves ``[P, L/P, ...]`` run by a ``lax.scan`` inside
        ``stage_fn``).
      head_fn: ``head_fn(head_params, y, target) -> scalar``: the loss of one micro-batch
        from the last stage's output (final norm, LM head, loss). Make it a mean over the
        micro-batch's samples for the result to be the global-batch mean.
      stage_params: a pytree whose leaves have a leading axis of size ``P`` (the ``pp``
        degree); stage ``s`` owns ``tree.map(lambda a: a[s], stage_params)``. The axis is
        sharded on ``pp``; other dimensions may be sharded on the automatic axes (``mp``).
      head_params: a pytree, replicated over ``pp`` (may be sharded on ``mp``).
      inputs: array (or pytree of arrays) ``[B, ...]`` entering stage 0 (the embedding's
        output); ``B = num_microbatches x micro-batch size x data-parallel size``.
      targets: array (or pytree) ``[B, ...]`` given to ``head_fn``; never differentiated.
      side: per-sample arrays (a pytree) ``[B, ...]`` every stage needs with its
        micro-batch (an attention mask, position ids); split into micro-batches like
        ``inputs``; never differentiated.
      shared: arrays (a pytree) every stage gets whole with every micro-batch; never
        differentiated.
      mesh: the mesh; must have ``pp_axis``.
      schedule: ``"1F1B"`` or ``"FThenB"``.
      num_microbatches: ``M``, micro-batches per step.
      pp_axis: the pipeline mesh axis.
      data_axes: mesh axes the batch is split over (those the mesh lacks are ignored).
        Each replica splits its rows into ``M`` consecutive micro-batches.
      remat: FThenB only: keep only each stage's input per micro-batch and recompute the
        stage in its own backward loop (bubble ticks skipped). 1F1B always recomputes
        each stage from its stashed input, so the flag changes nothing there.
      micro_losses: also return each micro-batch's loss (mean over replicas; no gradient).
      stage_specs: one ``PartitionSpec`` per ``stage_params`` leaf, ``P(pp_axis, ...)``
        naming the data axes the leaf stays split over inside the stage (an MoE layer's
        expert kernels over ``ep``: each device gets its ``E / ep`` experts and their
        gradients are summed over the other data axes only); None: every leaf ``P(pp)``,
        whole on each device of its stage.
      pooled: one bool per ``inputs`` leaf: ``"FThenB"`` sums those leaves of the last
        stage's output over the micro-batches and gives every ``head_fn`` call the sum (MoE
        router statistics: the whole batch's load-balancing loss, value and gradient).
        ``"1F1B"`` ignores it (a backward starts before the last forward).

    Returns:
      The fp32 mean of ``head_fn`` over micro-batches and data-parallel replicas; with
      ``micro_losses``, ``(mean, losses[M])``.

    Raises:
      ValueError: an unknown schedule, ``num_microbatches < 1``, a mesh without
        ``pp_axis``, stage leaves whose leading axis is not the ``pp`` degree, or a batch
        that does not split into the micro-batches.
      TypeError: ``stage_fn`` / ``head_fn`` not callable, ``mesh`` not a ``Mesh``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((8,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> w = jnp.zeros((8, 3, 3))
      >>> x, t = jnp.ones((4, 3)), jnp.zeros((4, 3))
      >>> pipeline_loss(lambda w, x, side, shared: x + x @ w,
      ...               lambda h, y, t: jnp.mean((y - t) ** 2),
      ...               w, (), x, t, mesh=mesh, schedule="FThenB", num_microbatches=2)
      Array(1., dtype=float32)
    """
    spec = validate(
        stage_fn,
        head_fn,
        stage_params,
        {"inputs": inputs, "targets": targets, "side": side},
        mesh=mesh,
        schedule=schedule,
        num_microbatches=num_microbatches,
        pp_axis=pp_axis,
        data_axes=data_axes,
        remat=remat,
        stage_specs=stage_specs,
        pooled=pooled if schedule == "FThenB" else None,
    )
    out = _differentiable(spec)(stage_params, head_params, inputs, targets, side, shared)
    return out if micro_losses else out[0]


#: ``local(forward_only, with_dx, stage_params, head_params, inputs, targets, side, shared)``:
#: one device's share of a pipelined loss inside the ``shard_map`` (this module's
#: :func:`_local_step`, or the table executor's).
Local = Callable[..., Any]


def _differentiable(spec: PipelineSpec, local: Local | None = None) -> Callable[..., jax.Array]:
    """``f(stage_params, head_params, inputs, targets, side, shared) -> (loss, losses)`` with
    the schedule's VJP: the forward runs the whole training schedule (``local``) and keeps
    the gradients; the backward scales them by the loss's cotangent (targets, side and
    shared get zero cotangents)."""
    local = local or functools.partial(_local_step, spec)

    @jax.custom_vjp
    def run(stage_params, head_params, inputs, targets, side, shared):
        return _sharded(spec, local, forward_only=True, with_dx=False)(
            stage_params, head_params, inputs, targets, side, shared
        )

    def fwd(stage_params, head_params, inputs, targets, side, shared):
        with_dx = any(leaf.perturbed for leaf in jax.tree.leaves(inputs, is_leaf=_is_primal))
        values = [
            jax.tree.map(lambda leaf: leaf.value, tree, is_leaf=_is_primal)
            for tree in (stage_params, head_params, inputs, targets, side, shared)
        ]
        return _sharded(spec, local, forward_only=False, with_dx=with_dx)(*values)

    def bwd(grads, g):
        g = g[0]  # the micro-batch losses are reported, not differentiated
        if isinstance(g, SymbolicZero):
            return (None,) * 6

        def scale(tree):
            return None if tree is None else jax.tree.map(lambda d: (d * g).astype(d.dtype), tree)

        d_stage, d_head, d_inputs = grads
        return scale(d_stage), scale(d_head), scale(d_inputs), None, None, None

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run


def _is_primal(x: Any) -> bool:
    return hasattr(x, "perturbed") and hasattr(x, "value")


def _sharded(spec: PipelineSpec, local: Local, *, forward_only: bool, with_dx: bool) -> Callable:
    """The jitted ``shard_map`` computing the loss (and, unless forward_only, the grads)."""
    pp, data = spec.pp_axis, spec.data_axes
    batch_spec = P(data) if data else P()
    stage_spec = P(pp) if spec.stage_specs is None else spec.stage_specs
    loss_out = (P(), P())
    if forward_only:
        out_specs: Any = loss_out
    else:
        out_specs = (loss_out, (stage_spec, P(), batch_spec if with_dx else None))

    def body(stage_params, head_params, inputs, targets, side, shared):
        return local(
            forward_only, with_dx, stage_params, head_params, inputs, targets, side, shared
        )

    mapped = jax.shard_map(
        body,
        mesh=spec.mesh,
        in_specs=(stage_spec, P(), batch_spec, batch_spec, batch_spec, P()),
        out_specs=out_specs,
        axis_names=frozenset(spec.manual_axes),
        check_vma=True,
    )
    return jax.jit(mapped)


def _local_step(
    spec, forward_only, with_dx, stage_params, head_params, inputs, targets, side, shared
):
    """One device's share: split micro-batches, run the schedule, reduce once after it."""
    m, axes = spec.num_microbatches, spec.manual_axes
    scale = 1.0 / (m * spec.data_size)
    # Vary everything over every manual axis first: a vjp with respect to a value that is
    # invariant over an axis would return a cotangent already summed over that axis.
    params = vary(jax.tree.map(lambda a: a[0], stage_params), axes)
    head = vary(head_params, axes)
    x_mb = vary(to_microbatches(inputs, spec), axes)
    t_mb = to_microbatches(targets, spec)
    call = stage_call(spec, vary(to_microbatches(side, spec), axes), vary(shared, axes))
    stage = lax.axis_index(spec.pp_axis)
    check_stage(call, params, take(x_mb, 0))
    check_head(spec, head, take(x_mb, 0), take(t_mb, 0))

    if forward_only:
        losses = _gpipe_forward(spec, call, params, head, x_mb, t_mb, stage)
        return reduced_loss(spec, losses, scale)
    run = _fthenb if spec.schedule == "FThenB" else _one_f_one_b
    losses, (d_stage, d_head, d_x) = run(spec, call, params, head, x_mb, t_mb, stage, with_dx)

    def finish(tree, over, like):
        tree = lax.psum(tree, over) if over else tree
        return jax.tree.map(lambda d, p: (d * scale).astype(p.dtype), tree, like)

    d_stage = jax.tree.map(lambda d: d[None], finish(stage_grad_sum(spec, d_stage), (), params))
    d_head = finish(d_head, axes, head_params)
    if with_dx:
        d_x = from_microbatches(finish(d_x, (spec.pp_axis,), x_mb))
    return reduced_loss(spec, losses, scale), (d_stage, d_head, d_x if with_dx else None)


def _gpipe_forward(spec, call, params, head, x_mb, t_mb, stage):
    """The forward GPipe loop, then the head on the last stage.

    ``call(params, x, i)`` runs this device's stage on micro-batch ``i``. Returns this
    device's head loss per micro-batch ``[M]`` (zeros off the last stage).
    """
    p, axes = spec.num_stages, spec.manual_axes
    outs = forward_ticks(spec, lambda x, i: vary(call(params, x, i), axes), x_mb, stage)

    def heads():
        def one(yt):
            return jnp.asarray(spec.head_fn(head, *yt), jnp.float32)

        # vmap, not lax.map: a loss that opens its own shard_map over mp (ParallelCrossEntropy)
        # does not lower inside a differentiated scan here
        return vary(jax.vmap(one)((pooled_outputs(spec, outs), t_mb)), axes)

    zeros = jnp.zeros((spec.num_microbatches,), jnp.float32)
    return lax.cond(stage == p - 1, heads, lambda: vary(zeros, axes))


def _fthenb(spec, call, params, head, x_mb, t_mb, stage, with_dx):
    """GPipe: a forward loop stashing per micro-batch what the backward needs (the stage
    input with ``remat``, else the stage's saved matmul outputs, :class:`SavedStage`), the
    head's value and gradient on the last stage, then :func:`backward_ticks`; every
    bubble tick skipped."""
    p, axes = spec.num_stages, spec.manual_axes
    if spec.remat:
        run, stash, vjp = lambda x, i: vary(call(params, x, i), axes), True, None
    else:
        saved = SavedStage(call, params, take(x_mb, 0))
        run, stash, vjp = saved.forward, saved.shapes, saved.backward
    outs, ins = forward_ticks(spec, run, x_mb, stage, stash=stash)

    def heads(head, outs):
        def one(head, y, t):
            return jnp.asarray(spec.head_fn(head, y, t), jnp.float32)

        def total(head, outs):
            losses = jax.vmap(one, (None, 0, 0))(head, pooled_outputs(spec, outs), t_mb)
            return jnp.sum(losses), losses

        (_, losses), grads = jax.value_and_grad(total, (0, 1), has_aux=True)(head, outs)
        return vary((losses, *grads), axes)

    no_loss = jnp.zeros((spec.num_microbatches,), jnp.float32)
    zeros = vary((no_loss, zeros_like_tree(head), zeros_like_tree(outs)), axes)
    losses, d_head, g_last = lax.cond(stage == p - 1, heads, lambda *_: zeros, head, outs)
    vjp = vjp or stage_vjp(call, params)
    d_stage, d_x = backward_ticks(spec, vjp, params, ins, g_last, stage)
    return losses, (d_stage, d_head, d_x if with_dx else None)


def _one_f_one_b(spec, call, params, head, x_mb, t_mb, stage, with_dx):
    """1F1B: one scan of ``M + 2(P - 1)`` ticks, each one forward and one backward.

    A micro-batch's side inputs are read by its index (``call(params, x, i)``), in the
    forward and again in the recomputing backward: only the activation is stashed.
    """
    m, p, axes = spec.num_microbatches, spec.num_stages, spec.manual_axes
    head_fn = spec.head_fn
    slots = max(2 * (p - 1), 1)
    act = take(x_mb, 0)
    last = stage == p - 1
    zero_loss = vary(jnp.zeros((), jnp.float32), axes)

    def forward(x, i):
        return vary(call(params, x, i), axes)

    vjp = stage_vjp(call, params)

    def backward(x, g, i):
        d_params, d_x = vjp(x, g, i)
        return vary((zero_loss, d_params, zeros_like_tree(head), d_x), axes)

    def last_stage(x, target, i):
        def full(params, head, x):
            return jnp.asarray(head_fn(head, call(params, x, i), target), jnp.float32)

        loss, grads = jax.value_and_grad(full, argnums=(0, 1, 2))(params, head, x)
        return vary((loss, *grads), axes)

    def skip(*_):
        return (zero_loss, zeros_like_tree(params), zeros_like_tree(head), zeros_like_tree(act))

    def tick(carry, t):
        received_x, received_g, stash, d_stage, d_head, d_x_all, losses = carry
        f, b = t - stage, t - 2 * (p - 1) + stage
        f_valid, b_valid = (f >= 0) & (f < m), (b >= 0) & (b < m)
        fi, bi = jnp.clip(f, 0, m - 1), jnp.clip(b, 0, m - 1)
        x = select(stage == 0, take(x_mb, fi), received_x)
        x_back = take(stash, bi % slots)  # read before this tick's write to the ring
        y = lax.cond(f_valid & ~last, lambda x: forward(x, fi), lambda _: zeros_like_tree(act), x)
        branch = jnp.where(last, jnp.where(f_valid, 2, 0), jnp.where(b_valid, 1, 0))
        loss, dp, dh, dx = lax.switch(
            branch,
            (skip, lambda x, g, t: backward(x, g, bi), lambda x, g, t: last_stage(x, t, fi)),
            select(last, x, x_back),
            received_g,
            take(t_mb, fi),
        )
        slot = f % slots  # f, not the clipped fi: a bubble tick must not hit a live slot
        stash = put(stash, select(f_valid, x, take(stash, slot)), slot)
        d_stage = jax.tree.map(lambda a, d: a + d.astype(a.dtype), d_stage, dp)
        d_head = jax.tree.map(lambda a, d: a + d.astype(a.dtype), d_head, dh)
        if with_dx:
            keep = b_valid & (stage == 0)
            d_x_all = put(d_x_all, select(keep, dx, take(d_x_all, bi)), bi)
        carry = (
            shift(y, spec, 1),
            shift(dx, spec, -1),
            stash,
            d_stage,
            d_head,
            d_x_all,
            losses.at[fi].add(loss),  # the loss is zero but on the last stage
        )
        return carry, None

    init = (
        zeros_like_tree(act),
        zeros_like_tree(act),
        jax.tree.map(lambda a: jnp.zeros((slots, *a.shape), a.dtype), act),
        jax.tree.map(lambda a: jnp.zeros_like(a, dtype=acc_dtype(a)), params),
        jax.tree.map(lambda a: jnp.zeros_like(a, dtype=acc_dtype(a)), head),
        zeros_like_tree(x_mb) if with_dx else None,
        jnp.zeros((m,), jnp.float32),
    )
    init = vary(init, axes)
    carry, _ = lax.scan(tick, init, jnp.arange(m + 2 * (p - 1)))
    _, _, _, d_stage, d_head, d_x_all, losses = carry
    return losses, (d_stage, d_head, d_x_all)

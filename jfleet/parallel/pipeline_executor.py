"""Run any static schedule table (1F1B, interleaved VPP, ZB-H1) as one differentiable loss.

:func:`table_pipeline_loss` is :func:`jfleet.parallel.pipeline_schedule.pipeline_loss` for
the schedules of :mod:`jfleet.parallel.pipeline_table`: the same ``stage_fn`` / ``head_fn``,
side and shared inputs, micro-batch split, data-parallel reduction once after the loop
and ``jax.custom_vjp`` (its forward runs the whole training schedule and keeps the
gradients; its backward scales them by the incoming cotangent). The stage parameters
have two leading axes, ``[P, v, ...]``: device ``s`` holds chunks ``s, s + P, ...,
s + (v - 1) P`` of the model's ``P v`` virtual stages.

How it runs: one ``jax.shard_map`` manual over ``pp`` and the data axes, and in it one
``lax.scan`` over the table's ticks. At each tick a device reads its row of the table
(:func:`~jfleet.parallel.pipeline_table.slot_plan`), stores what arrived from its
neighbours in its stashes (slots assigned in Python, so memory is bounded by the
table's ``stash_slots``, not by ``M``), and runs its op under ``lax.switch`` (idle slots
run nothing): ``F`` a chunk forward (on the last chunk also the head's loss and the
cotangent of the chunk's output), ``B`` the chunk's backward recomputing its forward
from the stashed input (``jax.vjp`` with respect to weights and input), ``BI`` / ``W``
the same with respect to the input only / the weights only. Then one ring ``ppermute``
forward (activations; the last device's output wraps to device 0's next chunk) and one
backward (cotangents).

Work per chunk and micro-batch, in forwards of the chunk (the schedule's ideal,
``schedule_stats``' ``work_per_stage``): ``F`` 1 (+ the head on the last chunk), ``B`` 3
(recompute 1 + backward 2), ``BI`` 2 (recompute + input cotangents) and ``W`` 3 (recompute,
the cotangent chain through the chunk's layers, weight gradients; 2 for a chunk of one
layer): 1F1B / VPP 4, ZB-H1 6. Nothing is kept from ``BI`` for ``W`` but the chunk's input
and output cotangent, so the stash stays two activations per pending micro-batch.

Example:
  >>> import jax, jax.numpy as jnp
  >>> mesh = jax.make_mesh((2, 4), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> stage_fn = lambda w, x, side, shared: jnp.tanh(x @ w)
  >>> head_fn = lambda h, y, t: jnp.mean((y @ h - t) ** 2)
  >>> w = jnp.stack([jnp.stack([jnp.eye(4)] * 2)] * 4)  # [P=4, v=2, 4, 4]
  >>> x, t = jnp.ones((16, 4)), jnp.zeros((16, 1))
  >>> loss = lambda w: table_pipeline_loss(stage_fn, head_fn, w, jnp.ones((4, 1)), x, t,
  ...                                      mesh=mesh, schedule="VPP", num_microbatches=4,
  ...                                      num_virtual=2)
  >>> value, grad = jax.jit(jax.value_and_grad(loss))(w)
  >>> grad.shape, bool(value > 0)
  ((4, 2, 4, 4), True)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jfleet.mesh.topology import DATA_AXES, PP
from jfleet.parallel import pipeline_table as tables
from jfleet.parallel.pipeline_parts import (
    HeadFn,
    StageFn,
    acc_dtype,
    check_head,
    check_stage,
    from_microbatches,
    reduced_loss,
    select,
    stage_call,
    take,
    to_microbatches,
    validate,
    vary,
    zeros_like_tree,
)
from jfleet.parallel.pipeline_schedule import _differentiable

__all__ = ["table_pipeline_loss"]


def table_pipeline_loss(
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
    schedule: str,
    num_microbatches: int,
    num_virtual: int = 1,
    pp_axis: str = PP,
    data_axes: tuple[str, ...] = DATA_AXES,
    micro_losses: bool = False,
) -> Any:
    """The mean loss of a pipelined stack run by a schedule table; differentiable.

    Args:
      stage_fn: ``stage_fn(params_of_one_chunk, x, side, shared) -> y`` (as
        :func:`~jfleet.parallel.pipeline_schedule.pipeline_loss`).
      head_fn: ``head_fn(head_params, y, target) -> scalar``, one micro-batch's loss.
      stage_params: leaves ``[P, v, ...]``: chunk ``c`` of device ``s`` is virtual stage
        ``c P + s``; the leading axis is sharded on ``pp``.
      head_params, inputs, targets, side, shared: as ``pipeline_loss``.
      mesh: the mesh; must have ``pp_axis``.
      schedule: ``"1F1B"``, ``"VPP"`` or ``"ZBH1"`` (:func:`~jfleet.parallel.pipeline_table.
        schedule_table`).
      num_microbatches: ``M``.
      num_virtual: ``v``, chunks per device (``VPP``: at least 2).
      pp_axis, data_axes: the pipeline and batch mesh axes.
      micro_losses: also return the ``[M]`` micro-batch losses.

    Returns:
      The float32 mean loss over micro-batches and replicas (with ``micro_losses``,
      ``(mean, losses)``).

    Raises:
      ValueError: a schedule without a table, bad counts (see ``schedule_table``), stage
        leaves without the ``[P, v]`` axes, and ``pipeline_loss``'s input errors.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((8,), ("pp",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> w = jnp.zeros((8, 1, 3, 3))
      >>> x, t = jnp.ones((4, 3)), jnp.zeros((4, 3))
      >>> table_pipeline_loss(lambda w, x, side, shared: x + x @ w,
      ...                     lambda h, y, t: jnp.mean((y - t) ** 2),
      ...                     w, (), x, t, mesh=mesh, schedule="ZBH1", num_microbatches=2)
      Array(1., dtype=float32)
    """
    spec = validate(
        stage_fn,
        head_fn,
        stage_params,
        {"inputs": inputs, "targets": targets, "side": side},
        mesh=mesh,
        schedule="1F1B",
        num_microbatches=num_microbatches,
        pp_axis=pp_axis,
        data_axes=data_axes,
        remat=False,
    )
    table = tables.schedule_table(schedule, spec.num_stages, num_microbatches, num_virtual)
    bad = [
        f"{jax.tree_util.keystr(path) or '<root>'}: {leaf.shape}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params)
        if len(leaf.shape) < 2 or leaf.shape[1] != num_virtual
    ]
    if bad:
        raise ValueError(
            f"stage_params leaves need the axes [P, v] = [{spec.num_stages}, {num_virtual}] "
            f"(stages, chunks per stage) first; these do not: {'; '.join(bad)}."
        )
    run = _Run(dataclasses.replace(spec, schedule=schedule), table)
    local = functools.partial(_local, run)
    out = _differentiable(run.spec, local)(stage_params, head_params, inputs, targets, side, shared)
    return out if micro_losses else out[0]


@dataclasses.dataclass(frozen=True, eq=False)
class _Run:
    spec: Any  # pipeline_parts.PipelineSpec
    table: tables.ScheduleTable

    def plan(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The table's ``[T, P]`` rows (the scan's inputs) and the whole slot plan."""
        plan = tables.slot_plan(self.table)
        return {k: v for k, v in plan.items() if isinstance(v, np.ndarray)}, plan


# ------------------------------------------------------------------ per-device code
def _ring(tree: Any, spec: Any, direction: int) -> Any:
    """Sends to the next device (1) or the previous one (-1), the ends wrapping around
    (one device: to itself, its next chunk)."""
    p = spec.num_stages
    if p == 1:
        return tree
    perm = [(i, (i + direction) % p) for i in range(p)]
    return jax.tree.map(lambda a: lax.ppermute(a, spec.pp_axis, perm), tree)


def _local(run, forward_only, with_dx, stage_params, head_params, inputs, targets, side, shared):
    """One device's share: split micro-batches, run the table, reduce once after it."""
    spec = run.spec
    m, axes = spec.num_microbatches, spec.manual_axes
    scale = 1.0 / (m * spec.data_size)
    params = vary(jax.tree.map(lambda a: a[0], stage_params), axes)  # [v, ...]
    head = vary(head_params, axes)
    x_mb = vary(to_microbatches(inputs, spec), axes)
    t_mb = to_microbatches(targets, spec)
    call = stage_call(spec, vary(to_microbatches(side, spec), axes), vary(shared, axes))
    stage = lax.axis_index(spec.pp_axis)
    act = take(x_mb, 0)
    check_stage(call, take(params, 0), act)
    check_head(spec, head, act, take(t_mb, 0))
    rows, plan = run.plan()
    branches = _branches(spec, call, head, act, params, forward_only)

    def tick(carry, row):
        recv_x, recv_g, xs, gs, d_params, d_head, d_x_all, losses = carry
        r = {k: lax.dynamic_index_in_dim(a, stage, 0, keepdims=False) for k, a in row.items()}
        xs = put(xs, recv_x, r["recv_x"])  # what arrived, before this tick's op reads it
        gs = put(gs, recv_g, r["recv_g"])
        i, c = r["mb"], r["chunk"]
        x = select(r["first"] == 1, take(x_mb, i), take(xs, r["x_slot"]))
        g = take(gs, r["g_slot"])
        y, dx, dw, dh, loss, g = lax.switch(
            r["branch"], branches, take(params, c), x, g, i, take(t_mb, i)
        )
        gs = put(gs, g, r["g_slot"])  # the head's cotangent (the others write back g)
        d_params = put(d_params, jax.tree.map(jnp.add, take(d_params, c), dw), c)
        d_head = jax.tree.map(jnp.add, d_head, dh)
        if with_dx:
            first = (r["first"] == 1) & (
                (r["branch"] == tables.RUN_B) | (r["branch"] == tables.RUN_BI)
            )
            d_x_all = put(d_x_all, select(first, dx, take(d_x_all, i)), i)
        losses = losses.at[i].add(loss)  # zero but on the last chunk's F
        return (
            _ring(y, spec, 1),
            _ring(dx, spec, -1),
            xs,
            gs,
            d_params,
            d_head,
            d_x_all,
            losses,
        ), None

    def acc(tree):
        return jax.tree.map(lambda a: jnp.zeros_like(a, dtype=acc_dtype(a)), tree)

    init = (
        zeros_like_tree(act),
        zeros_like_tree(act),
        jax.tree.map(lambda a: jnp.zeros((plan["x_slots"], *a.shape), a.dtype), act),
        jax.tree.map(lambda a: jnp.zeros((plan["g_slots"], *a.shape), a.dtype), act),
        acc(params),
        acc(head),
        zeros_like_tree(x_mb) if with_dx else None,
        jnp.zeros((m,), jnp.float32),
    )
    carry, _ = lax.scan(tick, vary(init, axes), {k: jnp.asarray(v) for k, v in rows.items()})
    *_, d_params, d_head, d_x_all, losses = carry
    reduced = reduced_loss(spec, losses, scale)
    if forward_only:
        return reduced

    def finish(tree, over, like):
        tree = lax.psum(tree, over) if over else tree
        return jax.tree.map(lambda d, p: (d * scale).astype(p.dtype), tree, like)

    d_stage = jax.tree.map(lambda d: d[None], finish(d_params, spec.data_axes, params))
    d_head = finish(d_head, axes, head_params)
    d_x = from_microbatches(finish(d_x_all, (spec.pp_axis,), x_mb)) if with_dx else None
    return reduced, (d_stage, d_head, d_x)


def put(tree: Any, value: Any, i: jax.Array) -> Any:
    return jax.tree.map(
        lambda a, v: lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), i, 0), tree, value
    )


def _branches(spec, call, head, act, params, forward_only) -> list[Callable[..., Any]]:
    """The ops' bodies, ``(w, x, g, i, target) -> (y, dx, dw, d_head, loss, g)``, in the
    order of ``pipeline_table.RUN_*``."""
    axes = spec.manual_axes
    zero_loss = vary(jnp.zeros((), jnp.float32), axes)
    w0 = jax.tree.map(lambda a: a[0], params)

    def out(y=None, dx=None, dw=None, dh=None, loss=None, g=None):
        return vary(
            (
                zeros_like_tree(act) if y is None else y,
                zeros_like_tree(act) if dx is None else dx,
                zeros_like_tree(w0) if dw is None else dw,
                zeros_like_tree(head) if dh is None else dh,
                zero_loss if loss is None else loss,
                g,
            ),
            axes,
        )

    def idle(w, x, g, i, t):
        return out(g=g)

    def forward(w, x, g, i, t):
        return out(y=call(w, x, i), g=g)

    def forward_last(w, x, g, i, t):
        def head_loss(y, h):
            return jnp.asarray(spec.head_fn(h, y, t), jnp.float32)

        y = call(w, x, i)
        if forward_only:
            return out(loss=head_loss(y, head), g=g)
        loss, (dy, dh) = jax.value_and_grad(head_loss, argnums=(0, 1))(y, head)
        return out(dh=dh, loss=loss, g=dy)

    def backward(w, x, g, i, t):
        _, vjp = jax.vjp(lambda w, x: call(w, x, i), w, x)
        dw, dx = vjp(g)
        return out(dx=dx, dw=dw, g=g)

    def input_grad(w, x, g, i, t):
        _, vjp = jax.vjp(lambda x: call(w, x, i), x)
        return out(dx=vjp(g)[0], g=g)

    def weight_grad(w, x, g, i, t):
        _, vjp = jax.vjp(lambda w: call(w, x, i), w)
        return out(dw=vjp(g)[0], g=g)

    if forward_only:
        return [idle, forward, forward_last, idle, idle, idle]
    return [idle, forward, forward_last, backward, input_grad, weight_grad]

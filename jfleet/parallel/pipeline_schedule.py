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
    :func:`_backward_ticks`: ``jax.vjp`` + ``ppermute`` to the previous stage, shared with
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
single-device mean over the global batch, whatever the data-parallel degree.

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

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.mesh.placement import check_divides
from jfleet.mesh.topology import DATA_AXES, PP
from jfleet.parallel.schedule_ticks import (  # noqa: F401  (re-exported)
    SCHEDULES,
    TICK_KINDS,
    _check_schedule,
    schedule_stats,
    stage_ticks,
    taken_branches,
)

#: ``stage_fn(params_of_one_stage, x, side, shared) -> y``, for both entry points.
StageFn = Callable[[Any, Any, Any, Any], Any]
HeadFn = Callable[[Any, Any, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class _Pipeline:
    """The static description of one pipelined loss (validated by :func:`pipeline_loss`)."""

    stage_fn: StageFn
    head_fn: HeadFn
    mesh: Mesh
    schedule: str
    num_microbatches: int
    pp_axis: str
    data_axes: tuple[str, ...]
    remat: bool

    @property
    def num_stages(self) -> int:
        return self.mesh.shape[self.pp_axis]

    @property
    def manual_axes(self) -> tuple[str, ...]:
        return (self.pp_axis, *self.data_axes)

    @property
    def data_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)


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
    spec = _validate(
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
    )
    out = _differentiable(spec)(stage_params, head_params, inputs, targets, side, shared)
    return out if micro_losses else out[0]


def _validate(
    stage_fn, head_fn, stage_params, batched, *, mesh, schedule, num_microbatches, pp_axis,
    data_axes, remat,
) -> _Pipeline:  # fmt: skip
    """Checks the arguments; ``batched`` maps names to the pytrees split into micro-batches."""
    _check_schedule(schedule)
    m = num_microbatches
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"num_microbatches={m!r} must be an integer >= 1.")
    for name, fn in (("stage_fn", stage_fn), ("head_fn", head_fn)):
        if not callable(fn):
            raise TypeError(f"{name}={fn!r} is not callable.")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r} is not a jax.sharding.Mesh.")
    if pp_axis not in mesh.axis_names:
        raise ValueError(
            f"the mesh has axes {mesh.axis_names} and no pipeline axis pp_axis={pp_axis!r}; "
            "build it with one (fleet.init with hybrid_configs={'pp_degree': N})."
        )
    if isinstance(data_axes, str):
        data_axes = (data_axes,)
    if pp_axis in data_axes:
        raise ValueError(f"pp_axis={pp_axis!r} cannot also be a data axis (data_axes={data_axes}).")
    data_axes = tuple(a for a in data_axes if a in mesh.axis_names)
    stages = mesh.shape[pp_axis]

    bad = [
        f"{jax.tree_util.keystr(path) or '<root>'}: {getattr(leaf, 'shape', ())}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(stage_params)
        if not getattr(leaf, "shape", ()) or leaf.shape[0] != stages
    ]
    if bad:
        raise ValueError(
            f"stage_params leaves need a leading stage axis of size {stages} (the mesh's "
            f"{pp_axis!r} size); these do not: {'; '.join(bad)}."
        )

    rows = set()
    for name, tree in batched.items():
        rows |= _batch_rows(tree, name, optional=name == "side")
    if len(rows) != 1:
        raise ValueError(
            f"{', '.join(batched)} must share one batch size on their leading axis; got "
            f"{sorted(rows)}."
        )
    (batch,) = rows
    dp = math.prod(mesh.shape[a] for a in data_axes)
    local = batch // dp if batch % dp == 0 else None
    fits = [k for k in range(1, local + 1) if local % k == 0] if local else []
    check_divides(
        f"the batch of {batch} rows",
        batch,
        [("num_microbatches", m), *((a, mesh.shape[a]) for a in data_axes)],
        f"the batch must be num_microbatches x micro-batch size x the data-parallel size {dp}"
        + (f"; num_microbatches dividing {local}: {fits}" if fits else ""),
        label="micro-batch count x data-parallel size",
    )
    return _Pipeline(stage_fn, head_fn, mesh, schedule, m, pp_axis, data_axes, bool(remat))


def _batch_rows(tree: Any, name: str, optional: bool = False) -> set[int]:
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves and not optional:
        raise ValueError(f"{name} has no arrays; pass a [B, ...] array.")
    rows = set()
    for path, leaf in leaves:
        shape = getattr(leaf, "shape", ())
        if not shape:
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} is a scalar; it needs a leading batch axis."
            )
        rows.add(shape[0])
    return rows


#: ``local(forward_only, with_dx, stage_params, head_params, inputs, targets, side, shared)``:
#: one device's share of a pipelined loss inside the ``shard_map`` (this module's
#: :func:`_local_step`, or the table executor's).
Local = Callable[..., Any]


def _differentiable(spec: _Pipeline, local: Local | None = None) -> Callable[..., jax.Array]:
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


def _sharded(spec: _Pipeline, local: Local, *, forward_only: bool, with_dx: bool) -> Callable:
    """The jitted ``shard_map`` computing the loss (and, unless forward_only, the grads)."""
    pp, data = spec.pp_axis, spec.data_axes
    batch_spec = P(data) if data else P()
    loss_out = (P(), P())
    if forward_only:
        out_specs: Any = loss_out
    else:
        out_specs = (loss_out, (P(pp), P(), batch_spec if with_dx else None))

    def body(stage_params, head_params, inputs, targets, side, shared):
        return local(
            forward_only, with_dx, stage_params, head_params, inputs, targets, side, shared
        )

    mapped = jax.shard_map(
        body,
        mesh=spec.mesh,
        in_specs=(P(pp), P(), batch_spec, batch_spec, batch_spec, P()),
        out_specs=out_specs,
        axis_names=frozenset(spec.manual_axes),
        check_vma=True,
    )
    return jax.jit(mapped)


def _varying(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = aval.manual_axis_type.varying
    return frozenset(vma)


def _vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """Casts every leaf to varying over ``axes`` (those it already varies over are kept)."""

    def one(x):
        missing = tuple(a for a in axes if a not in _varying(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def _zeros(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def _shapes(tree: Any) -> Any:
    return jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree)


def _split(tree: Any, spec: _Pipeline) -> Any:
    """``[B, ...]`` leaves as ``[M, B / M, ...]``: the micro-batches, consecutive rows."""
    m = spec.num_microbatches
    return jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), tree)


def _unsplit(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


def _stage_call(spec: _Pipeline, side_mb: Any, shared: Any) -> Callable[..., Any]:
    """``call(params, x, i)``: ``stage_fn`` on micro-batch ``i``'s activation ``x``.

    The side and shared inputs are closed over, so no gradient reaches them.
    """

    def call(params: Any, x: Any, i: jax.Array) -> Any:
        return spec.stage_fn(params, x, _take(side_mb, i), shared)

    return call


def _check_stage(call: Callable[..., Any], params: Any, x: Any) -> None:
    """Traces ``stage_fn`` on one micro-batch: a clear error for a bad return."""
    y = jax.eval_shape(call, params, x, jnp.zeros((), jnp.int32))
    if jax.tree.structure(y) != jax.tree.structure(x) or _shapes(y) != _shapes(x):
        raise ValueError(
            "stage_fn must return an activation of its input's structure, shapes and dtypes "
            f"(it is passed to the next stage); for x = {_shapes(x)} it returned {_shapes(y)}."
        )


def _check_head(spec: _Pipeline, head: Any, x: Any, target: Any) -> None:
    loss = jax.eval_shape(spec.head_fn, head, x, target)
    if getattr(loss, "shape", None) != ():
        raise ValueError(
            "head_fn must return a scalar loss for one micro-batch; it returned "
            f"{jax.tree.map(lambda a: a.shape, loss)}."
        )


def _acc_dtype(x: jax.Array) -> Any:
    return jnp.promote_types(x.dtype, jnp.float32)


def _local_step(
    spec, forward_only, with_dx, stage_params, head_params, inputs, targets, side, shared
):
    """One device's share: split micro-batches, run the schedule, reduce once after it."""
    m, axes = spec.num_microbatches, spec.manual_axes
    scale = 1.0 / (m * spec.data_size)
    # Vary everything over every manual axis first: a vjp with respect to a value that is
    # invariant over an axis would return a cotangent already summed over that axis.
    params = _vary(jax.tree.map(lambda a: a[0], stage_params), axes)
    head = _vary(head_params, axes)
    x_mb = _vary(_split(inputs, spec), axes)
    t_mb = _split(targets, spec)
    call = _stage_call(spec, _vary(_split(side, spec), axes), _vary(shared, axes))
    stage = lax.axis_index(spec.pp_axis)
    _check_stage(call, params, _take(x_mb, 0))
    _check_head(spec, head, _take(x_mb, 0), _take(t_mb, 0))

    if forward_only:
        losses = _gpipe_forward(spec, call, params, head, x_mb, t_mb, stage)
        return _reduced(spec, losses, scale)
    run = _fthenb if spec.schedule == "FThenB" else _one_f_one_b
    losses, (d_stage, d_head, d_x) = run(spec, call, params, head, x_mb, t_mb, stage, with_dx)

    def finish(tree, over, like):
        tree = lax.psum(tree, over) if over else tree
        return jax.tree.map(lambda d, p: (d * scale).astype(p.dtype), tree, like)

    d_stage = jax.tree.map(lambda d: d[None], finish(d_stage, spec.data_axes, params))
    d_head = finish(d_head, axes, head_params)
    if with_dx:
        d_x = _unsplit(finish(d_x, (spec.pp_axis,), x_mb))
    return _reduced(spec, losses, scale), (d_stage, d_head, d_x if with_dx else None)


def _reduced(spec: _Pipeline, losses: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """The mean loss and the per-micro-batch losses (mean over replicas) from this device's."""
    axes = spec.manual_axes
    return lax.psum(jnp.sum(losses), axes) * scale, lax.psum(losses, axes) / spec.data_size


def _shift(tree: Any, spec: _Pipeline, direction: int, circular: bool = False) -> Any:
    """Sends to the next stage (direction 1) or the previous one (-1); edges get zeros
    (or, ``circular``, the other end's)."""
    p = spec.num_stages
    if p == 1:
        return _zeros(tree)
    if circular:
        perm = [(i, (i + direction) % p) for i in range(p)]
    else:
        perm = [(i, i + direction) for i in range(p) if 0 <= i + direction < p]
    return jax.tree.map(lambda a: lax.ppermute(a, spec.pp_axis, perm), tree)


def _take(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _put(tree: Any, value: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _unit(u: jax.Array, m: int, p: int, v: int) -> tuple[jax.Array, jax.Array]:
    """``(micro-batch, chunk)`` of a stage's ``u``-th forward unit: groups of ``P``
    micro-batches through chunk 0, then chunk 1, ... (Megatron's interleaved order)."""
    if v == 1:
        return u, jnp.zeros_like(u)
    group, within = u // (v * p), u % (v * p)
    return group * p + within % p, within // p


def _forward_ticks(spec, run, x_mb, stage, *, stash=False, virtual=1):
    """The forward GPipe loop (``v M + P - 1`` ticks): every micro-batch through every stage.

    ``run(x, i)`` runs this device's stage on activation ``x`` of micro-batch ``i``; a
    ``lax.cond`` skips its bubble ticks. Returns the stage's outputs ``[M, ...]`` (the last
    stage's are the stack's), and with ``stash=True`` also its inputs ``[M, ...]`` (what a
    recomputing backward loop needs); with ``stash`` a pytree of shapes, ``run`` returns
    ``(y, saved)`` and ``saved`` is stashed per micro-batch instead (:class:`SavedStage`).

    ``virtual = v > 1`` (``M`` a multiple of ``P``): ``run(x, i, c)`` runs chunk ``c``;
    stage ``s`` runs :func:`_unit` ``t - s``; the last stage's chunk-``c`` output goes
    round to stage 0 (circular ``ppermute``) just in time for chunk ``c + 1``. Bubble
    ``(P - 1) / (v M + P - 1)``; the stash is ``[v M, ...]`` (``c M + i``).

    No caller differentiates this loop: under autodiff a ``cond`` returns its residuals as
    outputs that vary per tick, the stage's weights among them (needed for the input's
    cotangent), so the scan would stack a copy of the weights per tick (measured, pp4 x
    dp2: f32[19,4,256,256] at M=16 for a 4-layer 256-wide stage, temp 9.5 -> 25.3 MiB,
    with or without ``jax.checkpoint`` around the branch). The backward is
    :func:`_backward_ticks`, inside a ``jax.custom_vjp``.
    """
    m, p, axes, v = spec.num_microbatches, spec.num_stages, spec.manual_axes, virtual
    act = _take(x_mb, 0)
    saving = stash not in (False, True)  # run returns (y, saved); saved is stashed
    if saving and v > 1:
        raise NotImplementedError("interleaved stages stash chunk inputs (recompute) only")

    def tick(carry, t):
        received, outs, ins = carry
        u = t - stage
        valid = (u >= 0) & (u < v * m)
        fi, c = _unit(jnp.clip(u, 0, v * m - 1), m, p, v)
        x = _select((stage == 0) & (c == 0), _take(x_mb, fi), received)

        def work(x):
            return run(x, fi, c) if v > 1 else run(x, fi)

        if saving:
            none = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stash)
            idle = _vary((_zeros(act), none), axes)
            y, kept = lax.cond(valid, lambda x: _vary(work(x), axes), lambda _: idle, x)
        else:
            y, kept = lax.cond(valid, work, lambda _: _zeros(act), x), x
        done = valid & (c == v - 1)
        outs = _put(outs, _select(done, y, _take(outs, fi)), fi)
        if stash is not False:
            k = c * m + fi
            ins = _put(ins, _select(valid, kept, _take(ins, k)), k)
        return (_shift(y, spec, 1, circular=v > 1), outs, ins), None

    if saving:
        kept0 = jax.tree.map(lambda a: jnp.zeros((m, *a.shape), a.dtype), stash)
    elif stash:
        kept0 = jax.tree.map(lambda a: jnp.zeros((v * m, *a.shape[1:]), a.dtype), x_mb)
    else:
        kept0 = None
    init = _vary((_zeros(act), _zeros(x_mb), kept0), axes)
    (_, outs, ins), _ = lax.scan(tick, init, jnp.arange(v * m + p - 1))
    return (outs, ins) if stash is not False else outs


def _saves_matmuls(prim: Any, *_: Any, **__: Any) -> bool:
    return prim.name in ("dot_general", "conv_general_dilated")


class SavedStage:
    """A stage whose backward pulls back from saved matmul outputs, not the weights.

    ``forward(x, i) -> (y, saved)`` runs ``call(params, x, i)`` under ``jax.checkpoint``
    saving only matmul (and convolution) outputs and returns the residuals of its
    ``jax.vjp`` without the parameters; ``backward(saved, g, i) -> (d_params, d_x)`` puts
    the parameters back and pulls ``g`` back (elementwise work recomputed, no matmul).
    Stashing ``saved`` per micro-batch outside any differentiated loop keeps one copy of
    the weights: a ``lax.cond`` differentiated inside the loop would stack them per tick.

    Attributes:
      shapes: the saved residuals of one micro-batch (``jax.ShapeDtypeStruct``s).
    """

    def __init__(self, call: Callable[..., Any], params: Any, x: Any) -> None:
        self.call, self.params = call, params
        where: list[int | None] = []

        def probe(params: Any, x: Any) -> list:
            leaves = jax.tree.leaves(self._linear(params, x, jnp.zeros((), jnp.int32))[1])
            flat = jax.tree.leaves(params)
            where[:] = [next((k for k, q in enumerate(flat) if q is a), None) for a in leaves]
            return [a for a, w in zip(leaves, where, strict=True) if w is None]

        self.shapes = jax.eval_shape(probe, params, x)
        self.where = tuple(where)

    def _linear(self, params: Any, x: Any, i: jax.Array) -> Any:
        fn = jax.checkpoint(lambda p, x: self.call(p, x, i), policy=_saves_matmuls)
        return jax.vjp(fn, params, x)

    def forward(self, x: Any, i: jax.Array) -> tuple[Any, list]:
        y, pull = self._linear(self.params, x, i)
        leaves = jax.tree.leaves(pull)
        return y, [a for a, w in zip(leaves, self.where, strict=True) if w is None]

    def backward(self, saved: list, g: Any, i: jax.Array) -> Any:
        tree = jax.tree.structure(jax.eval_shape(lambda x: self._linear(self.params, x, i)[1], g))
        kept, flat = iter(saved), jax.tree.leaves(self.params)
        leaves = [next(kept) if w is None else flat[w] for w in self.where]
        return jax.tree.unflatten(tree, leaves)(g)


def _backward_ticks(spec, vjp, params, ins, g_last, stage, *, virtual=1):
    """The backward loop of a recomputing GPipe (``v M + P - 1`` ticks), bubbles skipped.

    At tick ``t`` stage ``s`` runs the backward of micro-batch ``t - (P - 1 - s)``:
    ``vjp(x, g, i) -> (d_params, d_x)`` pulls ``g`` back from what the forward stashed for
    micro-batch ``i``, ``ins[i]`` (its stage input, recomputing the stage, or the stage's
    saved matmul outputs), ``g`` being the last stage's ``g_last[i]`` or the cotangent the
    next stage sent the tick before (``lax.ppermute`` to the previous stage). A
    ``lax.cond`` skips the ``P - 1`` bubble ticks. Returns the parameter gradients summed
    over micro-batches (fp32 or wider) and the input cotangents ``[M, ...]`` (stage 0's;
    zeros elsewhere).

    ``virtual = v > 1``: the forward's units in reverse, ``vjp(x, g, i, c)`` through chunk
    ``c`` of ``params`` ``[v, ...]``; stage 0's cotangent goes round to the last stage.
    """
    m, p, axes, v = spec.num_microbatches, spec.num_stages, spec.manual_axes, virtual
    act = _take(g_last, 0)
    chunk = _take(params, 0) if v > 1 else params
    zero = _vary((_zeros(chunk), _zeros(act)), axes)

    def tick(carry, t):
        received, d_params, d_x = carry
        u = t - (p - 1 - stage)
        valid = (u >= 0) & (u < v * m)
        bi, c = _unit(v * m - 1 - jnp.clip(u, 0, v * m - 1), m, p, v)
        g = _select((stage == p - 1) & (c == v - 1), _take(g_last, bi), received)

        def work(x, g):
            return _vary(vjp(x, g, bi, c) if v > 1 else vjp(x, g, bi), axes)

        dp, dx = lax.cond(valid, work, lambda x, g: zero, _take(ins, c * m + bi), g)
        if v > 1:
            summed = jax.tree.map(lambda a, d: a + d.astype(a.dtype), _take(d_params, c), dp)
            d_params = _put(d_params, summed, c)
        else:
            d_params = jax.tree.map(lambda a, d: a + d.astype(a.dtype), d_params, dp)
        d_x = _put(d_x, _select(valid & (stage == 0) & (c == 0), dx, _take(d_x, bi)), bi)
        return (_shift(dx, spec, -1, circular=v > 1), d_params, d_x), None

    acc = jax.tree.map(lambda a: jnp.zeros_like(a, dtype=_acc_dtype(a)), params)
    init = _vary((_zeros(act), acc, _zeros(g_last)), axes)
    (_, d_params, d_x), _ = lax.scan(tick, init, jnp.arange(v * m + p - 1))
    return d_params, d_x


def stage_vjp(call: Callable[..., Any], params: Any) -> Callable[..., Any]:
    """``vjp(x, g, i) -> (d_params, d_x)``: recompute ``call(params, x, i)`` and pull ``g`` back.

    The backward tick of both recomputing loops (1F1B's and the recomputing GPipe's).
    """

    def vjp(x: Any, g: Any, i: jax.Array) -> Any:
        _, pull = jax.vjp(lambda params, x: call(params, x, i), params, x)
        return pull(g)

    return vjp


def _gpipe_forward(spec, call, params, head, x_mb, t_mb, stage):
    """The forward GPipe loop, then the head on the last stage.

    ``call(params, x, i)`` runs this device's stage on micro-batch ``i``. Returns this
    device's head loss per micro-batch ``[M]`` (zeros off the last stage).
    """
    p, axes = spec.num_stages, spec.manual_axes
    outs = _forward_ticks(spec, lambda x, i: _vary(call(params, x, i), axes), x_mb, stage)

    def heads():
        def one(yt):
            return jnp.asarray(spec.head_fn(head, *yt), jnp.float32)

        # vmap, not lax.map: a loss that opens its own shard_map over mp (ParallelCrossEntropy)
        # does not lower inside a differentiated scan here
        return _vary(jax.vmap(one)((outs, t_mb)), axes)

    zeros = jnp.zeros((spec.num_microbatches,), jnp.float32)
    return lax.cond(stage == p - 1, heads, lambda: _vary(zeros, axes))


def _fthenb(spec, call, params, head, x_mb, t_mb, stage, with_dx):
    """GPipe: a forward loop stashing per micro-batch what the backward needs (the stage
    input with ``remat``, else the stage's saved matmul outputs, :class:`SavedStage`), the
    head's value and gradient on the last stage, then :func:`_backward_ticks`; every
    bubble tick skipped."""
    p, axes = spec.num_stages, spec.manual_axes
    if spec.remat:
        run, stash, vjp = lambda x, i: _vary(call(params, x, i), axes), True, None
    else:
        saved = SavedStage(call, params, _take(x_mb, 0))
        run, stash, vjp = saved.forward, saved.shapes, saved.backward
    outs, ins = _forward_ticks(spec, run, x_mb, stage, stash=stash)

    def heads(head, outs):
        def one(head, y, t):
            return jnp.asarray(spec.head_fn(head, y, t), jnp.float32)

        def total(head, outs):
            losses = jax.vmap(one, (None, 0, 0))(head, outs, t_mb)
            return jnp.sum(losses), losses

        (_, losses), grads = jax.value_and_grad(total, (0, 1), has_aux=True)(head, outs)
        return _vary((losses, *grads), axes)

    no_loss = jnp.zeros((spec.num_microbatches,), jnp.float32)
    zeros = _vary((no_loss, _zeros(head), _zeros(outs)), axes)
    losses, d_head, g_last = lax.cond(stage == p - 1, heads, lambda *_: zeros, head, outs)
    vjp = vjp or stage_vjp(call, params)
    d_stage, d_x = _backward_ticks(spec, vjp, params, ins, g_last, stage)
    return losses, (d_stage, d_head, d_x if with_dx else None)


def _one_f_one_b(spec, call, params, head, x_mb, t_mb, stage, with_dx):
    """1F1B: one scan of ``M + 2(P - 1)`` ticks, each one forward and one backward.

    A micro-batch's side inputs are read by its index (``call(params, x, i)``), in the
    forward and again in the recomputing backward: only the activation is stashed.
    """
    m, p, axes = spec.num_microbatches, spec.num_stages, spec.manual_axes
    head_fn = spec.head_fn
    slots = max(2 * (p - 1), 1)
    act = _take(x_mb, 0)
    last = stage == p - 1
    zero_loss = _vary(jnp.zeros((), jnp.float32), axes)

    def forward(x, i):
        return _vary(call(params, x, i), axes)

    vjp = stage_vjp(call, params)

    def backward(x, g, i):
        d_params, d_x = vjp(x, g, i)
        return _vary((zero_loss, d_params, _zeros(head), d_x), axes)

    def last_stage(x, target, i):
        def full(params, head, x):
            return jnp.asarray(head_fn(head, call(params, x, i), target), jnp.float32)

        loss, grads = jax.value_and_grad(full, argnums=(0, 1, 2))(params, head, x)
        return _vary((loss, *grads), axes)

    def skip(*_):
        return (zero_loss, _zeros(params), _zeros(head), _zeros(act))

    def tick(carry, t):
        received_x, received_g, stash, d_stage, d_head, d_x_all, losses = carry
        f, b = t - stage, t - 2 * (p - 1) + stage
        f_valid, b_valid = (f >= 0) & (f < m), (b >= 0) & (b < m)
        fi, bi = jnp.clip(f, 0, m - 1), jnp.clip(b, 0, m - 1)
        x = _select(stage == 0, _take(x_mb, fi), received_x)
        x_back = _take(stash, bi % slots)  # read before this tick's write to the ring
        y = lax.cond(f_valid & ~last, lambda x: forward(x, fi), lambda _: _zeros(act), x)
        branch = jnp.where(last, jnp.where(f_valid, 2, 0), jnp.where(b_valid, 1, 0))
        loss, dp, dh, dx = lax.switch(
            branch,
            (skip, lambda x, g, t: backward(x, g, bi), lambda x, g, t: last_stage(x, t, fi)),
            _select(last, x, x_back),
            received_g,
            _take(t_mb, fi),
        )
        slot = f % slots  # f, not the clipped fi: a bubble tick must not hit a live slot
        stash = _put(stash, _select(f_valid, x, _take(stash, slot)), slot)
        d_stage = jax.tree.map(lambda a, d: a + d.astype(a.dtype), d_stage, dp)
        d_head = jax.tree.map(lambda a, d: a + d.astype(a.dtype), d_head, dh)
        if with_dx:
            keep = b_valid & (stage == 0)
            d_x_all = _put(d_x_all, _select(keep, dx, _take(d_x_all, bi)), bi)
        carry = (
            _shift(y, spec, 1),
            _shift(dx, spec, -1),
            stash,
            d_stage,
            d_head,
            d_x_all,
            losses.at[fi].add(loss),  # the loss is zero but on the last stage
        )
        return carry, None

    init = (
        _zeros(act),
        _zeros(act),
        jax.tree.map(lambda a: jnp.zeros((slots, *a.shape), a.dtype), act),
        jax.tree.map(lambda a: jnp.zeros_like(a, dtype=_acc_dtype(a)), params),
        jax.tree.map(lambda a: jnp.zeros_like(a, dtype=_acc_dtype(a)), head),
        _zeros(x_mb) if with_dx else None,
        jnp.zeros((m,), jnp.float32),
    )
    init = _vary(init, axes)
    carry, _ = lax.scan(tick, init, jnp.arange(m + 2 * (p - 1)))
    _, _, _, d_stage, d_head, d_x_all, losses = carry
    return losses, (d_stage, d_head, d_x_all)

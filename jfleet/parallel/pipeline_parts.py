"""The parts every lockstep pipeline executor is built from.

:func:`~jfleet.parallel.pipeline_schedule.pipeline_loss` (FThenB, 1F1B),
:func:`~jfleet.parallel.pipeline_executor.table_pipeline_loss` (schedule tables: VPP, ZBH1)
and :func:`~jfleet.parallel.pipeline_forward.pipeline_forward` (``to_distributed``'s stand-in)
share: the validated description of one pipeline (:class:`PipelineSpec`), micro-batch
splitting, the per-device stage call, the tick loops that run a schedule's forward and
backward passes with ``ppermute`` between stages (:func:`forward_ticks`,
:func:`backward_ticks`), a stage's saved residuals (:class:`SavedStage`) and its VJP.

Example:
  >>> import jax.numpy as jnp
  >>> x = {"a": jnp.arange(8.0).reshape(8, 1)}
  >>> take(x, jnp.int32(3))["a"].tolist()
  [3.0]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.mesh.placement import check_divides
from jfleet.parallel.schedule_ticks import (
    _check_schedule,
)

#: ``stage_fn(params_of_one_stage, x, side, shared) -> y``, for both entry points.
StageFn = Callable[[Any, Any, Any, Any], Any]


HeadFn = Callable[[Any, Any, Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
    """The static description of one pipelined loss (validated by :func:`pipeline_loss`)."""

    stage_fn: StageFn
    head_fn: HeadFn
    mesh: Mesh
    schedule: str
    num_microbatches: int
    pp_axis: str
    data_axes: tuple[str, ...]
    remat: bool
    #: per stage leaf, its ``PartitionSpec`` (``pp`` first, then the manual data axes it
    #: is split over, e.g. experts over ``ep``), or None: every leaf ``P(pp)``
    stage_specs: Any = dataclasses.field(default=None, compare=False)
    #: per leaf of the activation, whether FThenB sums it over the micro-batches before the
    #: head (router statistics, :class:`~jfleet.parallel.moe.load_stats.LoadStats`), or None
    pooled: tuple[bool, ...] | None = None

    @property
    def num_stages(self) -> int:
        return self.mesh.shape[self.pp_axis]

    @property
    def manual_axes(self) -> tuple[str, ...]:
        return (self.pp_axis, *self.data_axes)

    @property
    def data_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.data_axes)


def validate(
    stage_fn, head_fn, stage_params, batched, *, mesh, schedule, num_microbatches, pp_axis,
    data_axes, remat, stage_specs=None, pooled=None,
) -> PipelineSpec:  # fmt: skip
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
        rows |= batch_rows(tree, name, optional=name == "side")
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
    specs = _check_stage_specs(stage_specs, stage_params, pp_axis, data_axes)
    if pooled is not None:
        pooled = tuple(bool(p) for p in pooled)
        n = len(jax.tree.leaves(batched["inputs"]))
        if len(pooled) != n:
            raise ValueError(
                f"pooled has {len(pooled)} entries; give one bool per leaf of inputs ({n})."
            )
    return PipelineSpec(
        stage_fn, head_fn, mesh, schedule, m, pp_axis, data_axes, bool(remat), specs, pooled
    )


def pooled_outputs(spec: PipelineSpec, outs: Any) -> Any:
    """The last stage's outputs ``[M, ...]`` with the :attr:`PipelineSpec.pooled` leaves
    summed over the micro-batches, each micro-batch given the sum (differentiable: the
    head's cotangent reaches every micro-batch's statistics).

    Example:
      >>> import jax.numpy as jnp
      >>> spec = PipelineSpec(None, None, None, "FThenB", 2, "pp", (), False, None, (False, True))
      >>> [a.tolist() for a in pooled_outputs(spec, [jnp.array([1.0, 2.0]), jnp.array([1.0, 2.0])])]
      [[1.0, 2.0], [3.0, 3.0]]
    """
    if not spec.pooled or not any(spec.pooled):
        return outs
    leaves, tree = jax.tree.flatten(outs)
    leaves = [
        jnp.broadcast_to(jnp.sum(a, axis=0, keepdims=True), a.shape) if p else a
        for a, p in zip(leaves, spec.pooled, strict=True)
    ]
    return jax.tree.unflatten(tree, leaves)


def _check_stage_specs(specs: Any, stage_params: Any, pp_axis: str, data_axes: tuple) -> Any:
    """``specs`` (one ``PartitionSpec`` a stage leaf) if each starts with ``pp_axis`` and
    names only data axes after it; None stays None."""
    if specs is None:
        return None
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    flat, tree = jax.tree.flatten(specs, is_leaf=is_spec)
    if tree != jax.tree.structure(stage_params) or not all(map(is_spec, flat)):
        raise ValueError(
            f"stage_specs has structure {tree}; give one PartitionSpec per stage_params leaf "
            f"({jax.tree.structure(stage_params)})."
        )
    for s in flat:
        named = {a for e in tuple(s)[1:] for a in (e if isinstance(e, tuple) else (e,)) if a}
        if not s or s[0] != pp_axis or not named <= set(data_axes):
            raise ValueError(
                f"stage_specs entry {s} must be P({pp_axis!r}, ...) naming only the data axes "
                f"{data_axes} after the stage axis (those the leaf arrives split over)."
            )
    return specs


def spec_axes(spec: P) -> frozenset:
    """The mesh axes a ``PartitionSpec`` names.

    Example:
      >>> sorted(spec_axes(P("pp", None, ("ep", "mp"))))
      ['ep', 'mp', 'pp']
    """
    return frozenset(a for e in spec for a in (e if isinstance(e, tuple) else (e,)) if a)


def stage_grad_sum(spec: PipelineSpec, grads: Any) -> Any:
    """Stage gradients summed over the data axes, each leaf over those it is not split
    over (:attr:`PipelineSpec.stage_specs`: an expert kernel split over ``ep`` sums over
    ``dp`` and ``sharding`` only)."""
    if spec.stage_specs is None:
        return lax.psum(grads, spec.data_axes) if spec.data_axes else grads

    def one(g: jax.Array, s: P) -> jax.Array:
        over = tuple(a for a in spec.data_axes if a not in spec_axes(s))
        return lax.psum(g, over) if over else g

    leaves, tree = jax.tree.flatten(grads)
    specs = jax.tree.leaves(spec.stage_specs, is_leaf=lambda s: isinstance(s, P))
    return jax.tree.unflatten(tree, [one(g, s) for g, s in zip(leaves, specs, strict=True)])


def batch_rows(tree: Any, name: str, optional: bool = False) -> set[int]:
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


def varying_axes(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = aval.manual_axis_type.varying
    return frozenset(vma)


def vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """Casts every leaf to varying over ``axes`` (those it already varies over are kept)."""

    def one(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def zeros_like_tree(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def shapes_of(tree: Any) -> Any:
    return jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree)


def to_microbatches(tree: Any, spec: PipelineSpec) -> Any:
    """``[B, ...]`` leaves as ``[M, B / M, ...]``: the micro-batches, consecutive rows."""
    m = spec.num_microbatches
    return jax.tree.map(lambda a: a.reshape(m, a.shape[0] // m, *a.shape[1:]), tree)


def from_microbatches(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


def stage_call(spec: PipelineSpec, side_mb: Any, shared: Any) -> Callable[..., Any]:
    """``call(params, x, i)``: ``stage_fn`` on micro-batch ``i``'s activation ``x``.

    The side and shared inputs are closed over, so no gradient reaches them.
    """

    def call(params: Any, x: Any, i: jax.Array) -> Any:
        return spec.stage_fn(params, x, take(side_mb, i), shared)

    return call


def check_stage(call: Callable[..., Any], params: Any, x: Any) -> None:
    """Traces ``stage_fn`` on one micro-batch: a clear error for a bad return."""
    y = jax.eval_shape(call, params, x, jnp.zeros((), jnp.int32))
    if jax.tree.structure(y) != jax.tree.structure(x) or shapes_of(y) != shapes_of(x):
        raise ValueError(
            "stage_fn must return an activation of its input's structure, shapes and dtypes "
            f"(it is passed to the next stage); for x = {shapes_of(x)} it returned {shapes_of(y)}."
        )


def check_head(spec: PipelineSpec, head: Any, x: Any, target: Any) -> None:
    loss = jax.eval_shape(spec.head_fn, head, x, target)
    if getattr(loss, "shape", None) != ():
        raise ValueError(
            "head_fn must return a scalar loss for one micro-batch; it returned "
            f"{jax.tree.map(lambda a: a.shape, loss)}."
        )


def acc_dtype(x: jax.Array) -> Any:
    return jnp.promote_types(x.dtype, jnp.float32)


def reduced_loss(
    spec: PipelineSpec, losses: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array]:
    """The mean loss and the per-micro-batch losses (mean over replicas) from this device's."""
    axes = spec.manual_axes
    return lax.psum(jnp.sum(losses), axes) * scale, lax.psum(losses, axes) / spec.data_size


def shift(
    tree: Any, spec: PipelineSpec, direction: int, circular: bool = False, wire: Any = None
) -> Any:
    """Sends to the next stage (direction 1) or the previous one (-1); edges get zeros
    (or, ``circular``, the other end's). With a :class:`TensorSplit` ``wire`` each device
    sends its ``1 / mp`` share and receives one: the caller all-gathers it over ``mp``
    where it uses it (Megatron's scatter / gather: the slow link carries ``1 / mp``)."""
    p = spec.num_stages
    if p == 1:
        return zeros_like_tree(tree)
    if circular:
        perm = [(i, (i + direction) % p) for i in range(p)]
    else:
        perm = [(i, i + direction) for i in range(p) if 0 <= i + direction < p]
    if wire is None:
        return jax.tree.map(lambda a: lax.ppermute(a, spec.pp_axis, perm), tree)
    return wire.send(tree, lambda a: lax.ppermute(a, spec.pp_axis, perm))


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """An activation split over the tensor-parallel axis, an automatic axis inside the
    pipeline's ``shard_map``: each leaf on its first non-batch dimension that ``size``
    divides (a leaf with none stays whole). What a stage stashes and sends costs ``1 / size``
    per device; :meth:`whole` all-gathers it back inside the node.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> TensorSplit("mp", 4).dims({"x": jnp.zeros((2, 6, 8)), "n": jnp.zeros(2)})
      {'n': None, 'x': 2}
    """

    axis: str
    size: int

    def dims(self, tree: Any, lead: int = 0) -> Any:
        """Per leaf, the dimension split (after ``lead`` stacked axes and the batch), or None."""

        def dim(a: Any) -> int | None:
            shape = a.shape[lead + 1 :]
            return next((lead + 1 + k for k, n in enumerate(shape) if n % self.size == 0), None)

        return jax.tree.map(dim, tree)

    def split(self, tree: Any, lead: int = 0) -> Any:
        """``tree`` constrained to its split (``lead`` stacked axes before the batch's)."""

        def one(a: jax.Array, d: int | None) -> jax.Array:
            return a if d is None else lax.with_sharding_constraint(a, self._spec(a, d))

        return jax.tree.map(one, tree, self.dims(tree, lead))

    def _spec(self, a: jax.Array, d: int) -> jax.sharding.PartitionSpec:
        return jax.sharding.PartitionSpec(*(self.axis if k == d else None for k in range(a.ndim)))

    def send(self, tree: Any, fn: Callable[[jax.Array], jax.Array]) -> Any:
        """``fn`` (a collective over a manual axis) on each device's share of every leaf.

        The share is taken by a ``shard_map`` manual over the axis (inside the pipeline's):
        the SPMD partitioner gathers a collective-permute's operand split over an automatic
        axis, so the split has to be manual to stay on the wire.
        """

        def one(a: jax.Array, d: int | None) -> jax.Array:
            if d is None:
                return fn(a)
            part = self._spec(a, d)
            mapped = jax.shard_map(
                fn, in_specs=part, out_specs=part, axis_names={self.axis}, check_vma=False
            )
            return mapped(a)

        return jax.tree.map(one, tree, self.dims(tree))

    def whole(self, tree: Any) -> Any:
        """``tree`` replicated over the axis again (an all-gather of what was split)."""
        spec = jax.sharding.PartitionSpec()
        return jax.tree.map(lambda a: lax.with_sharding_constraint(a, spec), tree)


def take(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def put(tree: Any, value: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, i, 0), tree, value)


def select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def unit_of_tick(u: jax.Array, m: int, p: int, v: int) -> tuple[jax.Array, jax.Array]:
    """``(micro-batch, chunk)`` of a stage's ``u``-th forward unit: groups of ``P``
    micro-batches through chunk 0, then chunk 1, ... (Megatron's interleaved order)."""
    if v == 1:
        return u, jnp.zeros_like(u)
    group, within = u // (v * p), u % (v * p)
    return group * p + within % p, within // p


def forward_ticks(spec, run, x_mb, stage, *, stash=False, virtual=1, wire=None):
    """The forward GPipe loop (``v M + P - 1`` ticks): every micro-batch through every stage.

    ``run(x, i)`` runs this device's stage on activation ``x`` of micro-batch ``i``; a
    ``lax.cond`` skips its bubble ticks. Returns the stage's outputs ``[M, ...]`` (the last
    stage's are the stack's), and with ``stash=True`` also its inputs ``[M, ...]`` (what a
    recomputing backward loop needs); with ``stash`` a pytree of shapes, ``run`` returns
    ``(y, saved)`` and ``saved`` is stashed per micro-batch instead (:class:`SavedStage`).

    ``virtual = v > 1`` (``M`` a multiple of ``P``): ``run(x, i, c)`` runs chunk ``c``;
    stage ``s`` runs :func:`unit_of_tick` ``t - s``; the last stage's chunk-``c`` output goes
    round to stage 0 (circular ``ppermute``) just in time for chunk ``c + 1``. Bubble
    ``(P - 1) / (v M + P - 1)``; the stash is ``[v M, ...]`` (``c M + i``).

    No caller differentiates this loop: under autodiff a ``cond`` returns its residuals as
    outputs that vary per tick, the stage's weights among them (needed for the input's
    cotangent), so the scan would stack a copy of the weights per tick (measured, pp4 x
    dp2: f32[19,4,256,256] at M=16 for a 4-layer 256-wide stage, temp 9.5 -> 25.3 MiB,
    with or without ``jax.checkpoint`` around the branch). The backward is
    :func:`backward_ticks`, inside a ``jax.custom_vjp``.
    """
    m, p, axes, v = spec.num_microbatches, spec.num_stages, spec.manual_axes, virtual
    act = take(x_mb, 0)
    saving = stash not in (False, True)  # run returns (y, saved); saved is stashed

    def tick(carry, t):
        received, outs, ins = carry
        u = t - stage
        valid = (u >= 0) & (u < v * m)
        fi, c = unit_of_tick(jnp.clip(u, 0, v * m - 1), m, p, v)
        x = select((stage == 0) & (c == 0), take(x_mb, fi), received)
        x = x if wire is None else wire.whole(x)  # stashed split, run whole

        def work(x):
            return run(x, fi, c) if v > 1 else run(x, fi)

        if saving:
            none = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), stash)
            idle = vary((zeros_like_tree(act), none), axes)
            y, kept = lax.cond(valid, lambda x: vary(work(x), axes), lambda _: idle, x)
        else:
            y, kept = lax.cond(valid, work, lambda _: zeros_like_tree(act), x), x
            kept = kept if wire is None else wire.split(kept)
        if wire is not None:  # run whole: a split send must not propagate into the stage
            y = wire.whole(y)
        done = valid & (c == v - 1)
        out = y if wire is None else wire.split(y)
        outs = put(outs, select(done, out, take(outs, fi)), fi)
        if stash is not False:
            k = c * m + fi
            ins = put(ins, select(valid, kept, take(ins, k)), k)
        return (shift(y, spec, 1, circular=v > 1, wire=wire), outs, ins), None

    if saving:
        kept0 = jax.tree.map(lambda a: jnp.zeros((v * m, *a.shape), a.dtype), stash)
    elif stash:
        kept0 = jax.tree.map(lambda a: jnp.zeros((v * m, *a.shape[1:]), a.dtype), x_mb)
        kept0 = kept0 if wire is None else wire.split(kept0, lead=1)
    else:
        kept0 = None
    outs0 = zeros_like_tree(x_mb) if wire is None else wire.split(zeros_like_tree(x_mb), lead=1)
    init = vary((zeros_like_tree(act), outs0, kept0), axes)
    (_, outs, ins), _ = lax.scan(tick, init, jnp.arange(v * m + p - 1))
    return (outs, ins) if stash is not False else outs


def saves_matmuls(prim: Any, *_: Any, **__: Any) -> bool:
    return prim.name in ("dot_general", "conv_general_dilated")


class SavedStage:
    """A stage whose backward pulls back from saved matmul outputs, not the weights.

    ``forward(x, i) -> (y, saved)`` runs ``call(params, x, i)`` under ``jax.checkpoint``
    saving what ``policy`` keeps (default: every matmul and convolution output; selective
    recompute: :func:`~jfleet.parallel.recompute.selective_policy`, the weight-matmul
    outputs only) and returns the residuals of its ``jax.vjp`` without the parameters;
    ``backward(saved, g, i) -> (d_params, d_x)`` puts the parameters back and pulls ``g``
    back (elementwise work recomputed, and what the policy did not keep: under selective
    recompute the attention cores).
    Stashing ``saved`` per micro-batch outside any differentiated loop keeps one copy of
    the weights: a ``lax.cond`` differentiated inside the loop would stack them per tick.
    ``chunked`` (interleaved stages): ``params`` are ``[v, ...]`` chunks and
    ``forward(x, i, c)`` / ``backward(saved, g, i, c)`` run chunk ``c``.

    Attributes:
      shapes: the saved residuals of one micro-batch (``jax.ShapeDtypeStruct``s).
    """

    def __init__(
        self,
        call: Callable[..., Any],
        params: Any,
        x: Any,
        policy: Callable[..., bool] | None = None,
        *,
        chunked: bool = False,
    ) -> None:
        self.call, self.params, self.chunked = call, params, chunked
        self.policy = saves_matmuls if policy is None else policy
        where: list[int | None] = []

        def probe(params: Any, x: Any) -> list:
            leaves = jax.tree.leaves(self._linear(params, x, jnp.zeros((), jnp.int32))[1])
            flat = jax.tree.leaves(params)
            where[:] = [next((k for k, q in enumerate(flat) if q is a), None) for a in leaves]
            return [a for a, w in zip(leaves, where, strict=True) if w is None]

        self.shapes = jax.eval_shape(probe, self._chunk(0), x)
        self.where = tuple(where)

    def _linear(self, params: Any, x: Any, i: jax.Array) -> Any:
        fn = jax.checkpoint(lambda p, x: self.call(p, x, i), policy=self.policy)
        return jax.vjp(fn, params, x)

    def _chunk(self, c: Any) -> Any:
        return take(self.params, c) if self.chunked else self.params

    def forward(self, x: Any, i: jax.Array, c: Any = None) -> tuple[Any, list]:
        y, pull = self._linear(self._chunk(c), x, i)
        leaves = jax.tree.leaves(pull)
        return y, [a for a, w in zip(leaves, self.where, strict=True) if w is None]

    def backward(self, saved: list, g: Any, i: jax.Array, c: Any = None) -> Any:
        params = self._chunk(c)
        tree = jax.tree.structure(jax.eval_shape(lambda x: self._linear(params, x, i)[1], g))
        kept, flat = iter(saved), jax.tree.leaves(params)
        leaves = [next(kept) if w is None else flat[w] for w in self.where]
        return jax.tree.unflatten(tree, leaves)(g)


def backward_ticks(spec, vjp, params, ins, g_last, stage, *, virtual=1, wire=None):
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

    ``wire`` (a :class:`TensorSplit`): each send carries ``1 / mp`` of the cotangent
    (a stash split by :func:`forward_ticks` is gathered by ``vjp``).
    """
    m, p, axes, v = spec.num_microbatches, spec.num_stages, spec.manual_axes, virtual
    act = take(g_last, 0)
    chunk = take(params, 0) if v > 1 else params
    zero = vary((zeros_like_tree(chunk), zeros_like_tree(act)), axes)

    def tick(carry, t):
        received, d_params, d_x = carry
        u = t - (p - 1 - stage)
        valid = (u >= 0) & (u < v * m)
        bi, c = unit_of_tick(v * m - 1 - jnp.clip(u, 0, v * m - 1), m, p, v)
        g = select((stage == p - 1) & (c == v - 1), take(g_last, bi), received)
        g = g if wire is None else wire.whole(g)

        def work(x, g):
            return vary(vjp(x, g, bi, c) if v > 1 else vjp(x, g, bi), axes)

        dp, dx = lax.cond(valid, work, lambda x, g: zero, take(ins, c * m + bi), g)
        dx = dx if wire is None else wire.whole(dx)
        if v > 1:
            summed = jax.tree.map(lambda a, d: a + d.astype(a.dtype), take(d_params, c), dp)
            d_params = put(d_params, summed, c)
        else:
            d_params = jax.tree.map(lambda a, d: a + d.astype(a.dtype), d_params, dp)
        out = dx if wire is None else wire.split(dx)
        d_x = put(d_x, select(valid & (stage == 0) & (c == 0), out, take(d_x, bi)), bi)
        return (shift(dx, spec, -1, circular=v > 1, wire=wire), d_params, d_x), None

    acc = jax.tree.map(lambda a: jnp.zeros_like(a, dtype=acc_dtype(a)), params)
    d_x0 = zeros_like_tree(g_last) if wire is None else wire.split(zeros_like_tree(g_last), lead=1)
    init = vary((zeros_like_tree(act), acc, d_x0), axes)
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

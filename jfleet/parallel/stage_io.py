"""What crosses a pipeline stage: the activation carried, the side and shared inputs, and
the float32 widening of half-precision arrays on CPU.

:func:`stage_inputs` splits what a stage gets into the schedules' three kinds: the
**carried** activation (the floating leaves of the value passed from layer to layer; sent to
the next stage, differentiated), per-sample **side** inputs (split into micro-batches with
the activation, never differentiated: the non-floating leaves of the activation, such as
integer position ids or a boolean attention mask, and the per-sample extra block arguments)
and **shared** inputs (whole arrays every micro-batch gets: a rotary table).
:func:`widened_stage`: XLA:CPU aborts compiling a 16-bit all-reduce inside a partly manual
``shard_map`` (the schedules' gradient sums), so on CPU half-precision arrays cross the
pipeline in float32 and are cast back inside the stage: the same values.
:mod:`jfleet.parallel.stack` builds the stage function from these
(:func:`jfleet.parallel.stack.stage_function`) and re-exports every name here.

Example:
  >>> import jax.numpy as jnp
  >>> inputs, carried, side, shared = stage_inputs(jnp.ones((3, 2)))
  >>> [a.shape for a in carried], side, shared
  ([(3, 2)], [], [])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CARRIED",
    "SHARED",
    "SIDE",
    "STATIC",
    "StageFn",
    "StageInputs",
    "batch_first_leaves",
    "narrow",
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

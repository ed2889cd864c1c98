"""Dynamic loss scaling (Paddle's AMP ``GradScaler`` / ``update_loss_scaling``) as Optax.

The training-step engine multiplies the loss by the current scale before taking
gradients, reading the scale from the optimizer state with :func:`loss_scale_of`::

    tx = dynamic_loss_scaling(optax.adam(1e-3))
    opt_state = tx.init(params)
    scale = loss_scale_of(opt_state)
    grads = jax.grad(lambda p: loss_fn(p) * scale)(params)  # scaled gradients
    updates, opt_state = tx.update(grads, opt_state, params)  # unscaled inside
    params = optax.apply_updates(params, updates)

:func:`dynamic_loss_scaling` unscales the gradients, skips the whole step when any
gradient element is ``inf`` or ``nan`` (zero updates, inner state untouched) and updates
the scale by Paddle's rule. It must see the raw scaled gradients, so put it outside
clipping and every other gradient transform, and inside ``optax.MultiSteps`` (Paddle's
GradientMerge wraps AMP): the scale then stays fixed while micro-batches accumulate.

Where Paddle's code paths differ, this module follows the ``update_loss_scaling`` op that
the Fleet AMP meta-optimizer runs (``paddle/phi/kernels/impl/amp_kernel_impl.h``):

- a decrease never takes the scale below ``1.0`` (the op's floor; Paddle's eager
  ``GradScaler._update`` has none). A scale that already starts below ``1.0`` (only
  possible through ``init_loss_scaling < 1``) is kept on a decrease instead of being
  raised to ``1.0`` as the op would;
- an increase whose result is not finite keeps the previous scale.

With ``use_dynamic_loss_scaling=False`` the scale stays at ``init_loss_scaling`` and the
counters stay at zero, but non-finite steps are still skipped, as Paddle's
``GradScaler.minimize`` and static AMP decorator do. (Paddle's static decorator drops
the finiteness check only when the fixed scale is exactly ``1.0``; here the check always
runs.) Paddle disables dynamic scaling for bfloat16 by default; choosing that is the
strategy compiler's job, not this transform's.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jfleet.mesh.layer_mesh import named

__all__ = [
    "DynamicLossScalingState",
    "all_finite",
    "dynamic_loss_scaling",
    "finite_flags",
    "floating_leaves",
    "loss_scale_of",
    "scaling_state_of",
]


class DynamicLossScalingState(NamedTuple):
    """State of :func:`dynamic_loss_scaling`.

    Attributes:
        loss_scale: current scale, float32 scalar; the engine multiplies the loss by it.
        good_steps: consecutive finite steps since the last scale change (int32 scalar).
        bad_steps: non-finite steps since the last decrease or finite step (int32 scalar).
        inner_state: state of the wrapped transformation.
    """

    loss_scale: jax.Array
    good_steps: jax.Array
    bad_steps: jax.Array
    inner_state: Any


def _is_floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def floating_leaves(tree: Any) -> list[tuple[Any, Any]]:
    """The ``(key path, leaf)`` pairs of ``tree``'s floating arrays, in ``jax.tree.leaves`` order.

    Example:
        >>> import jax.numpy as jnp
        >>> [str(p[0]) for p, _ in floating_leaves({"w": jnp.ones(2), "n": jnp.int32(3)})]
        ["['w']"]
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(path, x) for path, x in flat if _is_floating(x)]


def finite_flags(tree: Any) -> jax.Array:
    """One boolean per floating leaf of ``tree`` (:func:`floating_leaves` order): all finite?

    The found-inf reduction of loss scaling and of the engine's non-finite guard; on
    global (SPMD) arrays each flag already covers every device.

    Example:
        >>> import jax.numpy as jnp
        >>> finite_flags({"a": jnp.ones(2), "b": jnp.array([jnp.nan])}).tolist()
        [True, False]
    """
    flags = [jnp.all(jnp.isfinite(x)) for _, x in floating_leaves(tree)]
    return jnp.stack(flags) if flags else jnp.ones((0,), jnp.bool_)


def all_finite(tree: Any) -> jax.Array:
    """Returns one boolean scalar: whether every element of every array in ``tree`` is finite.

    Non-floating leaves count as finite. On global (SPMD) arrays the reduction already
    covers every device, which is Paddle's ``found_inf`` all-reduce (MAX) for free.

    Args:
        tree: a pytree of arrays.

    Returns:
        A ``bool`` scalar array; ``True`` for a tree without floating leaves.

    Example:
        >>> import jax.numpy as jnp
        >>> bool(all_finite({"w": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
        False
    """
    return jnp.all(finite_flags(tree))


def _check_real(
    name: str, value: Any, *, expected: str, ok: Callable[[float], bool], fix: str
) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a real number {expected}; {fix}.")
    if not ok(float(value)):
        raise ValueError(f"{name}={value!r} must be {expected}; {fix}.")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name}={value!r} must be an int >= 1 (a number of steps); pass e.g. {name}=1000."
        )
    if value < 1:
        raise ValueError(
            f"{name}={value!r} must be >= 1 (a number of steps); with {value} the counter "
            f"never reaches it and the scale never changes. Pass a positive count, or "
            "use_dynamic_loss_scaling=False for a fixed scale."
        )


def _replicated_sharding(params: Any) -> NamedSharding | None:
    """The fully replicated sharding on the mesh of the first concrete mesh-sharded leaf."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            sharding = leaf.sharding
            if isinstance(sharding, NamedSharding):
                return named(sharding.mesh)
    return None


def dynamic_loss_scaling(
    inner: optax.GradientTransformation,
    *,
    init_loss_scaling: float = 32768.0,
    incr_every_n_steps: int = 1000,
    decr_every_n_nan_or_inf: int = 2,
    incr_ratio: float = 2.0,
    decr_ratio: float = 0.8,
    use_dynamic_loss_scaling: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with Paddle's dynamic loss scaling (``strategy.amp_configs``).

    ``update`` receives gradients of ``loss * loss_scale`` and

    1. unscales them: ``g / loss_scale`` computed in float32, cast back to ``g.dtype``;
    2. checks that every element of every gradient is finite (one global boolean);
    3. finite: returns the inner update; non-finite: returns zero updates and keeps the
       inner state bit-identical (selected with ``jnp.where``, so it traces and jits);
    4. updates the scale by Paddle's rule. Non-finite: ``good_steps = 0``,
       ``bad_steps += 1`` and when ``bad_steps == decr_every_n_nan_or_inf`` the scale is
       multiplied by ``decr_ratio`` (never below 1.0) and ``bad_steps = 0``. Finite:
       ``bad_steps = 0``, ``good_steps += 1`` and when ``good_steps ==
       incr_every_n_steps`` the scale is multiplied by ``incr_ratio`` (kept if that
       overflows) and ``good_steps = 0``.

    Defaults are Paddle's ``DistributedStrategy.amp_configs`` defaults (not those of
    ``paddle.amp.GradScaler``, which are 2**16, 0.5, 2000 and 1).

    Args:
        inner: the transformation that receives the unscaled gradients.
        init_loss_scaling: initial scale, > 0.
        incr_every_n_steps: consecutive finite steps before the scale grows, >= 1.
        decr_every_n_nan_or_inf: non-finite steps before the scale shrinks, >= 1.
        incr_ratio: growth factor, > 1.
        decr_ratio: shrink factor, in (0, 1).
        use_dynamic_loss_scaling: ``False`` keeps the scale fixed at
            ``init_loss_scaling``; non-finite steps are still skipped.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` with state
        :class:`DynamicLossScalingState`; extra keyword arguments reach ``inner``.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> tx = dynamic_loss_scaling(optax.sgd(0.1), init_loss_scaling=1024.0)
        >>> params = {"w": jnp.ones(2)}
        >>> state = tx.init(params)
        >>> grads = {"w": jnp.array([1024.0, jnp.inf])}  # overflowed step
        >>> updates, state = tx.update(grads, state, params)
        >>> updates["w"].tolist(), int(state.bad_steps)
        ([0.0, 0.0], 1)
    """
    _check_scaling_args(
        inner,
        init_loss_scaling,
        incr_every_n_steps,
        decr_every_n_nan_or_inf,
        incr_ratio,
        decr_ratio,
        use_dynamic_loss_scaling,
    )
    inner = optax.with_extra_args_support(inner)
    init_scale = float(init_loss_scaling)
    rule = _ScaleRule(
        incr_n=int(incr_every_n_steps),
        decr_n=int(decr_every_n_nan_or_inf),
        incr_ratio=float(incr_ratio),
        decr_ratio=float(decr_ratio),
        dynamic=bool(use_dynamic_loss_scaling),
    )

    def init_fn(params: optax.Params) -> DynamicLossScalingState:
        return _initial_state(params, init_scale, inner)

    def update_fn(
        updates: optax.Updates,
        state: DynamicLossScalingState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, DynamicLossScalingState]:
        grads = _unscaled(updates, state.loss_scale)
        finite = all_finite(grads)
        new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        zeros = jax.tree.map(jnp.zeros_like, new_updates)
        new_updates = _where_finite(finite, new_updates, zeros)
        new_inner = _where_finite(finite, new_inner, state.inner_state)
        scale, good, bad = _next_scale(state, finite, rule)
        return new_updates, DynamicLossScalingState(scale, good, bad, new_inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class _ScaleRule(NamedTuple):
    """Paddle's scale rule, checked: grow by ``incr_ratio`` after ``incr_n`` finite steps,
    shrink by ``decr_ratio`` after ``decr_n`` non-finite ones (``dynamic=False``: fixed)."""

    incr_n: int
    decr_n: int
    incr_ratio: float
    decr_ratio: float
    dynamic: bool


def _where_finite(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where the step's gradients were all finite, else ``old`` (traced: a skipped
    step keeps the inner state bit-identical)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def _check_scaling_args(
    inner: Any,
    init_loss_scaling: Any,
    incr_every_n_steps: Any,
    decr_every_n_nan_or_inf: Any,
    incr_ratio: Any,
    decr_ratio: Any,
    use_dynamic_loss_scaling: Any,
) -> None:
    """``dynamic_loss_scaling``'s static arguments, checked (Paddle's ranges)."""
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"inner={inner!r} must be an optax.GradientTransformation (with init and "
            "update); pass e.g. optax.adam(1e-3)."
        )
    _check_real(
        "init_loss_scaling",
        init_loss_scaling,
        expected="> 0 and finite",
        ok=lambda v: 0 < v < float("inf"),
        fix="Paddle's default is 32768.0",
    )
    _check_count("incr_every_n_steps", incr_every_n_steps)
    _check_count("decr_every_n_nan_or_inf", decr_every_n_nan_or_inf)
    _check_real(
        "incr_ratio",
        incr_ratio,
        expected="> 1 and finite (the scale must grow)",
        ok=lambda v: 1 < v < float("inf"),
        fix="Paddle's default is 2.0",
    )
    _check_real(
        "decr_ratio",
        decr_ratio,
        expected="in the open interval (0, 1) (the scale must shrink)",
        ok=lambda v: 0 < v < 1,
        fix="Paddle's default is 0.8",
    )
    if not isinstance(use_dynamic_loss_scaling, bool):
        raise TypeError(
            f"use_dynamic_loss_scaling={use_dynamic_loss_scaling!r} must be a bool; pass "
            "True (Paddle's default) or False for a fixed scale."
        )


def _initial_state(
    params: optax.Params, init_scale: float, inner: optax.GradientTransformation
) -> DynamicLossScalingState:
    """The scale and counters, placed as a jitted update over ``params`` returns them."""
    loss_scale = jnp.asarray(init_scale, jnp.float32)
    good = jnp.zeros([], jnp.int32)
    bad = jnp.zeros([], jnp.int32)
    sharding = _replicated_sharding(params)
    if sharding is not None:
        loss_scale, good, bad = jax.device_put((loss_scale, good, bad), sharding)
    return DynamicLossScalingState(loss_scale, good, bad, inner.init(params))


def _unscaled(updates: optax.Updates, scale: jax.Array) -> optax.Updates:
    """Gradients of ``loss * scale`` divided by ``scale`` in float32, in their dtypes."""

    def unscale(g):
        if not _is_floating(g):
            return g
        return (g.astype(jnp.float32) / scale).astype(g.dtype)

    return jax.tree.map(unscale, updates)


def _next_scale(
    state: DynamicLossScalingState, finite: jax.Array, rule: _ScaleRule
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The next (scale, good_steps, bad_steps) by Paddle's rule (traced: ``jnp.where``)."""
    scale = state.loss_scale
    if not rule.dynamic:
        return scale, state.good_steps, state.bad_steps
    good = jnp.where(finite, state.good_steps + 1, 0).astype(jnp.int32)
    bad = jnp.where(finite, 0, state.bad_steps + 1).astype(jnp.int32)
    decrease = jnp.logical_and(jnp.logical_not(finite), bad == rule.decr_n)
    increase = jnp.logical_and(finite, good == rule.incr_n)
    floor = jnp.minimum(scale, jnp.float32(1.0))
    decreased = jnp.maximum(scale * jnp.float32(rule.decr_ratio), floor)
    grown = scale * jnp.float32(rule.incr_ratio)
    increased = jnp.where(jnp.isfinite(grown), grown, scale)
    scale = jnp.where(decrease, decreased, jnp.where(increase, increased, scale))
    good = jnp.where(increase, 0, good).astype(jnp.int32)
    bad = jnp.where(decrease, 0, bad).astype(jnp.int32)
    return scale, good, bad


def _unwrap(x: Any) -> Any:
    if isinstance(x, nnx.Variable):
        return x.get_value()
    return x


def scaling_state_of(opt_state: Any) -> DynamicLossScalingState:
    """The one :class:`DynamicLossScalingState` in an optimizer state tree.

    Searches any nesting (``optax.chain``, ``optax.MultiSteps``, masked or injected
    states, the state of an ``nnx.Optimizer``, whose fields are then ``nnx`` variables
    that can be written in place).

    Raises:
        ValueError: the tree holds no :class:`DynamicLossScalingState`, or several.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> state = dynamic_loss_scaling(optax.sgd(0.1)).init({"w": jnp.ones(2)})
        >>> int(scaling_state_of(state).good_steps)
        0
    """
    if isinstance(opt_state, nnx.Optimizer):
        opt_state = opt_state.opt_state
    found = [
        node
        for node in jax.tree.leaves(
            opt_state, is_leaf=lambda x: isinstance(x, DynamicLossScalingState)
        )
        if isinstance(node, DynamicLossScalingState)
    ]
    if not found:
        raise ValueError(
            f"no DynamicLossScalingState in the optimizer state (a {type(opt_state).__name__}); "
            "loss scaling needs the optimizer wrapped by "
            "jfleet.optim.loss_scale.dynamic_loss_scaling(...), e.g. "
            "dynamic_loss_scaling(optax.adam(1e-3)), or enable strategy.amp."
        )
    if len(found) > 1:
        raise ValueError(
            f"{len(found)} DynamicLossScalingState found in the optimizer state; expected "
            "exactly one. Wrap the optimizer with dynamic_loss_scaling once, outermost "
            "(inside optax.MultiSteps)."
        )
    return found[0]


def loss_scale_of(opt_state: Any) -> jax.Array:
    """Finds the current loss scale in an optimizer state tree.

    Searches any nesting (``optax.chain``, ``optax.MultiSteps``, masked or injected
    states, the state of an ``nnx.Optimizer``) for exactly one
    :class:`DynamicLossScalingState` (see :func:`scaling_state_of`).

    Args:
        opt_state: an optax state tree, or an ``nnx.Optimizer`` (its ``opt_state`` is
            searched).

    Returns:
        The float32 scalar ``loss_scale``.

    Raises:
        ValueError: the tree holds no :class:`DynamicLossScalingState`, or several.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> tx = optax.MultiSteps(dynamic_loss_scaling(optax.adam(1e-3)), 4)
        >>> float(loss_scale_of(tx.init({"w": jnp.ones(2)})))
        32768.0
    """
    return jnp.asarray(_unwrap(scaling_state_of(opt_state).loss_scale))

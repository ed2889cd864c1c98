"""Gradient merge: Paddle's strategy.gradient_merge as an Optax transformation.

Paddle's ``gradient_merge_configs = {"k_steps": k, "avg": avg}`` accumulates the
gradients of ``k`` consecutive steps and runs the optimizer once on their sum (divided by
``k`` when ``avg``). jfleet follows ``optax.MultiSteps``'s contract: the parameters move
on every k-th call only; the other calls return zero updates and leave the inner
optimizer's state untouched.

Differences from ``optax.MultiSteps``, on purpose:

- the state is :class:`GradientMergeState` with the wrapped state in ``inner_state`` (the
  jfleet convention), not ``MultiStepsState.inner_opt_state``;
- like Paddle, the merged gradient is the plain sum, divided by ``k`` once at the k-th
  step when ``avg`` (MultiSteps keeps a running mean);
- the inner optimizer runs only on the k-th call (``lax.cond``); MultiSteps runs it on
  every call and discards the result;
- ``k_steps`` is a fixed ``int`` (Paddle's), not a schedule; ``k_steps=1`` passes the
  gradients straight through and keeps no accumulator.

At mini-step 0 the accumulator is read as zeros, whatever it holds: it is reset after
each inner step, except where the engine merged a scanned stack's gradients into it in
the backward pass (:mod:`jfleet.parallel.merged_backward`), which leaves the last merged
sum there (so the backward loop's buffer is the accumulator's, with no copy).

The accumulator is float32 at least (bfloat16 gradients are summed in float32, as
Paddle's fp32 merge buffers do) and the merged gradient is cast back to the gradients'
dtype before the inner optimizer sees it. It is shaped and sharded like the gradients.

Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> tx = gradient_merge(optax.sgd(1.0), k_steps=2)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> u1, state = tx.update({"w": jnp.ones(2)}, state, params)
    >>> u2, state = tx.update({"w": 3 * jnp.ones(2)}, state, params)
    >>> u1["w"].tolist(), u2["w"].tolist()
    ([0.0, 0.0], [-2.0, -2.0])
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

__all__ = ["GradientMergeState", "gradient_merge", "has_updated"]


class GradientMergeState(NamedTuple):
    """State of :func:`gradient_merge`.

    Attributes:
        mini_step: calls since the last inner step, in ``[0, k_steps)`` (int32).
        gradient_step: inner steps taken so far (int32).
        acc_grads: running sum of the gradients since the last inner step (at least
            float32); ``()`` when ``k_steps == 1``.
        inner_state: the wrapped optimizer's state.
    """

    mini_step: jax.Array
    gradient_step: jax.Array
    acc_grads: Any
    inner_state: Any


def _check_k_steps(k_steps: Any) -> int:
    if isinstance(k_steps, bool) or not isinstance(k_steps, int):
        raise ValueError(
            f"k_steps={k_steps!r} must be an int >= 1 (the number of steps whose gradients "
            "are merged), e.g. k_steps=4."
        )
    if k_steps < 1:
        raise ValueError(
            f"k_steps={k_steps!r} must be >= 1; use k_steps=1 to update on every step."
        )
    return k_steps


def _acc_dtype(x: jax.Array) -> jnp.dtype:
    return jnp.promote_types(x.dtype, jnp.float32)


def gradient_merge(
    inner: optax.GradientTransformation,
    *,
    k_steps: int = 1,
    avg: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Merges the gradients of ``k_steps`` calls into one step of ``inner``.

    Args:
        inner: the optimizer to run on the merged gradients.
        k_steps: how many calls are merged (Paddle's ``k_steps``), an int >= 1.
        avg: divide the merged sum by ``k_steps`` (Paddle's ``avg``, the default) or
            use the sum.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` with :class:`GradientMergeState`.
        On the k-th call it returns ``inner``'s updates for the merged gradient; on the
        others, zeros (of the dtypes ``inner`` would return).

    Raises:
        ValueError: ``k_steps`` is not an int >= 1 (bools are refused).
        TypeError: ``avg`` is not a bool.

    Example:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> tx = gradient_merge(optax.sgd(1.0), k_steps=2, avg=False)
        >>> state = tx.init(jnp.zeros(1))
        >>> _, state = tx.update(jnp.ones(1), state)
        >>> u, state = tx.update(jnp.ones(1), state)
        >>> u.tolist(), int(state.gradient_step)
        ([-2.0], 1)
    """
    k = _check_k_steps(k_steps)
    if not isinstance(avg, bool):
        raise TypeError(f"avg={avg!r} must be a bool.")
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> GradientMergeState:
        acc = () if k == 1 else jax.tree.map(lambda p: jnp.zeros_like(p, _acc_dtype(p)), params)
        return GradientMergeState(
            mini_step=jnp.zeros((), jnp.int32),
            gradient_step=jnp.zeros((), jnp.int32),
            acc_grads=acc,
            inner_state=inner.init(params),
        )

    def update_fn(
        updates: optax.Updates,
        state: GradientMergeState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, GradientMergeState]:
        if k == 1:
            new_updates, inner_state = inner.update(
                updates, state.inner_state, params, **extra_args
            )
            return new_updates, state._replace(
                gradient_step=optax.safe_increment(state.gradient_step),
                inner_state=inner_state,
            )

        # at mini-step 0 the accumulator is read as zeros: it holds the last merged sum
        # where the engine merged a stack's gradients in its backward pass (and zeros else)
        fresh = state.mini_step == 0
        acc = jax.tree.map(
            lambda a, g: jnp.where(fresh, jnp.zeros_like(a), a) + g.astype(a.dtype),
            state.acc_grads,
            updates,
        )
        emit = state.mini_step == k - 1

        def step(acc: Any, inner_state: Any) -> tuple[Any, Any]:
            merged = jax.tree.map(lambda a, g: (a / k if avg else a).astype(g.dtype), acc, updates)
            new_updates, new_inner = inner.update(merged, inner_state, params, **extra_args)
            # Both branches of lax.cond must agree on types, weak types included.
            new_inner = jax.tree.map(lambda n, o: jnp.asarray(n, o.dtype), new_inner, inner_state)
            return new_updates, new_inner

        def wait(acc: Any, inner_state: Any) -> tuple[Any, Any]:
            shapes, _ = jax.eval_shape(step, acc, inner_state)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, inner_state

        new_updates, inner_state = lax.cond(emit, step, wait, acc, state.inner_state)
        new_state = GradientMergeState(
            mini_step=jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
            gradient_step=jnp.where(
                emit, optax.safe_increment(state.gradient_step), state.gradient_step
            ),
            acc_grads=jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc),
            inner_state=inner_state,
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def has_updated(state: GradientMergeState) -> jax.Array:
    """Whether the last :func:`gradient_merge` call moved the parameters.

    Args:
        state: the state returned by that call.

    Returns:
        A boolean scalar: the mini-step counter wrapped to 0 and at least one inner step
        has been taken.

    Example:
        >>> import jax.numpy as jnp
        >>> import optax
        >>> tx = gradient_merge(optax.sgd(1.0), k_steps=2)
        >>> _, s = tx.update(jnp.ones(1), tx.init(jnp.zeros(1)))
        >>> bool(has_updated(s))
        False
    """
    return jnp.logical_and(state.mini_step == 0, state.gradient_step > 0)

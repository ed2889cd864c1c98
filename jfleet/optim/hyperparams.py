"""Optimizers whose hyperparameters jfleet can read, and the reader.

Paddle's LAMB and LARS meta-optimizers *replace* the user's optimizer: strategy.lamb
turns an ``Adam`` into ``Lamb`` with the same learning rate and betas, strategy.lars
turns a ``Momentum`` into ``LarsMomentum`` with the same learning rate and momentum.
To do the same with Optax, jfleet must read those numbers from the user's
``optax.GradientTransformation``. A plain ``optax.adam(1e-3)`` keeps them in closures,
out of reach; the supported, documented way to make them readable is
``optax.inject_hyperparams``, whose state carries a ``hyperparams`` dict (learning-rate
schedules included).

This module offers Paddle-named factories that are exactly such wrapped optimizers
(:func:`adam`, :func:`adamw`, :func:`momentum`, :func:`sgd`, with Paddle's default
values), and :func:`inner_hyperparams`, which tells the optimizer family and its
hyperparameters.

Example:
    >>> import optax
    >>> from jfleet.optim import hyperparams
    >>> family, hp = hyperparams.inner_hyperparams(hyperparams.adam(1e-3))
    >>> family, sorted(hp)
    ('adam', ['b1', 'b2', 'eps', 'eps_root', 'learning_rate'])
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "adam",
    "adamw",
    "inner_hyperparams",
    "momentum",
    "sgd",
]

ScalarOrSchedule = float | jax.Array | Callable[[jax.Array], jax.Array]

# How to rebuild each family with readable hyperparameters (shown in error messages).
_FIXES = {
    "adam": "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3) "
    "or jfleet.optim.hyperparams.adam(1e-3)",
    "adamw": "optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3) "
    "or jfleet.optim.hyperparams.adamw(1e-3)",
    "momentum": "optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9) "
    "or jfleet.optim.hyperparams.momentum(0.1)",
    "sgd": "optax.inject_hyperparams(optax.sgd)(learning_rate=0.1) "
    "or jfleet.optim.hyperparams.sgd(0.1)",
}

# State types that carry no family information.
_NEUTRAL_STATES = (
    optax.EmptyState,
    optax.InjectHyperparamsState,
    optax.InjectStatefulHyperparamsState,
    optax.ScaleByScheduleState,
    optax.MaskedState,
)


# --------------------------------------------------------------------------- factories


class ProbeError(ValueError):
    """The inner optimizer cannot be initialised on a scalar stand-in parameter."""


def _check_schedule_or_number(name: str, value: Any, *, low: float, high: float | None) -> None:
    """Validates a number in [low, high) (or a schedule, which is left alone)."""
    if callable(value) and not isinstance(value, jax.Array):
        return
    if isinstance(value, bool) or not isinstance(value, (int, float, jax.Array)):
        raise TypeError(f"{name}={value!r} must be a number or a schedule (a callable).")
    if isinstance(value, jax.Array):
        return  # traced or array values are the caller's business
    ok = math.isfinite(value) and value >= low and (high is None or value < high)
    if not ok:
        where = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value!r} must be finite and {where}.")


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformationExtraArgs:
    """Adam with readable hyperparameters (Paddle's ``paddle.optimizer.Adam``).

    Exactly ``optax.inject_hyperparams(optax.adam)(...)``. The defaults are Paddle's
    (beta1 0.9, beta2 0.999, epsilon 1e-8; Optax's are the same). Paddle's update
    ``m_hat / (sqrt(v_hat) + eps)`` is Optax's.

    Args:
        learning_rate: a number or an Optax schedule (``step -> lr``).
        b1: Paddle's ``beta1``.
        b2: Paddle's ``beta2``.
        eps: Paddle's ``epsilon``.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state holds ``hyperparams``.

    Raises:
        TypeError, ValueError: a hyperparameter of the wrong type or out of range.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = adam(1e-3)
        >>> round(float(tx.init(jnp.zeros(2)).hyperparams["b2"]), 6)
        0.999
    """
    _check_schedule_or_number("learning_rate", learning_rate, low=0.0, high=None)
    _check_schedule_or_number("b1", b1, low=0.0, high=1.0)
    _check_schedule_or_number("b2", b2, low=0.0, high=1.0)
    _check_schedule_or_number("eps", eps, low=0.0, high=None)
    return optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps)


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """AdamW with readable hyperparameters (Paddle's ``paddle.optimizer.AdamW``).

    Exactly ``optax.inject_hyperparams(optax.adamw, static_args="mask")(...)``.
    ``weight_decay`` defaults to Paddle's 0.01 (Optax's default is 1e-4); Paddle's
    decoupled decay ``p -= lr * wd * p`` is Optax's. ``mask`` plays the role of Paddle's
    ``apply_decay_param_fun``: a pytree of bools, or a callable ``params -> bools``.

    Args:
        learning_rate: a number or an Optax schedule.
        b1: Paddle's ``beta1``.
        b2: Paddle's ``beta2``.
        eps: Paddle's ``epsilon``.
        weight_decay: decoupled weight-decay rate.
        mask: which parameters decay (``None``: all).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state holds ``hyperparams``.

    Raises:
        TypeError, ValueError: a hyperparameter of the wrong type or out of range.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(adamw(1e-3).init(jnp.zeros(2)).hyperparams["weight_decay"]), 6)
        0.01
    """
    _check_schedule_or_number("learning_rate", learning_rate, low=0.0, high=None)
    _check_schedule_or_number("b1", b1, low=0.0, high=1.0)
    _check_schedule_or_number("b2", b2, low=0.0, high=1.0)
    _check_schedule_or_number("eps", eps, low=0.0, high=None)
    _check_schedule_or_number("weight_decay", weight_decay, low=0.0, high=None)
    return optax.inject_hyperparams(optax.adamw, static_args="mask")(
        learning_rate=learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        mask=mask,
    )


def momentum(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.9,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Momentum SGD with readable hyperparameters (Paddle's ``paddle.optimizer.Momentum``).

    Exactly ``optax.inject_hyperparams(optax.sgd)(learning_rate, momentum=..., ...)``.
    Paddle's rule ``v = mu * v + g; p -= lr * v`` (Nesterov: ``p -= lr * (g + mu * v)``)
    is Optax's ``trace``. ``momentum`` defaults to Paddle's 0.9.

    Args:
        learning_rate: a number or an Optax schedule.
        momentum: the momentum factor ``mu``, in [0, 1).
        nesterov: Nesterov momentum.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state holds ``hyperparams``.

    Raises:
        TypeError, ValueError: a hyperparameter of the wrong type or out of range.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(momentum(0.1).init(jnp.zeros(2)).hyperparams["momentum"]), 6)
        0.9
    """
    _check_schedule_or_number("learning_rate", learning_rate, low=0.0, high=None)
    _check_schedule_or_number("momentum", momentum, low=0.0, high=1.0)
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov={nesterov!r} must be a bool.")
    return optax.inject_hyperparams(optax.sgd)(
        learning_rate=learning_rate, momentum=momentum, nesterov=nesterov
    )


def sgd(learning_rate: ScalarOrSchedule) -> optax.GradientTransformationExtraArgs:
    """Plain SGD with a readable learning rate (Paddle's ``paddle.optimizer.SGD``).

    Exactly ``optax.inject_hyperparams(optax.sgd)(learning_rate=...)``.

    Args:
        learning_rate: a number or an Optax schedule.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state holds ``hyperparams``.

    Raises:
        TypeError, ValueError: a learning rate of the wrong type or negative.

    Example:
        >>> import jax.numpy as jnp
        >>> round(float(sgd(0.1).init(jnp.zeros(2)).hyperparams["learning_rate"]), 6)
        0.1
    """
    _check_schedule_or_number("learning_rate", learning_rate, low=0.0, high=None)
    return optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate)


# ------------------------------------------------------------------------------ reader


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _state_nodes(state: Any) -> list[Any]:
    """Every NamedTuple optimizer state in ``state``, outermost first."""
    found = []
    for node in jax.tree.leaves(state, is_leaf=_is_namedtuple):
        if _is_namedtuple(node):
            found.append(node)
            # Schedule states inside an inject_hyperparams state say nothing of the family.
            fields = (node.inner_state,) if _has_hyperparams(node) else tuple(node)
            for field in fields:
                found.extend(_state_nodes(field))
    return found


def _has_hyperparams(state: Any) -> bool:
    return isinstance(state, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState))


def probe_params(tx: optax.GradientTransformation, params: Any = None) -> Any:
    """A tiny stand-in for ``params`` on which ``tx`` can be initialised.

    A float32 scalar when ``tx`` accepts one (almost every optimizer); otherwise (for
    example an optimizer with a weight-decay mask shaped like the real parameters)
    ``params`` with every leaf replaced by a float32 scalar, so the tree structure is
    kept. Used to read hyperparameters and to run an inner optimizer as a cheap
    hyperparameter clock.

    Args:
        tx: the optimizer.
        params: the real parameters, if known.

    Returns:
        A pytree of scalar arrays.

    Raises:
        ProbeError: ``params`` is None and ``tx`` cannot be initialised on a scalar.
        ValueError: ``tx`` cannot be initialised on either stand-in.
    """
    scalar = jnp.zeros((), jnp.float32)
    try:
        jax.eval_shape(tx.init, scalar)
        return scalar
    except Exception as scalar_error:
        if params is None:
            raise ProbeError(
                "could not initialise the inner optimizer on a scalar probe parameter "
                f"({type(scalar_error).__name__}: {scalar_error}); jfleet will retry with the "
                "real parameters' structure at init"
            ) from scalar_error
    mirror = jax.tree.map(lambda p: jnp.zeros((), jnp.float32), params)
    try:
        jax.eval_shape(tx.init, mirror)
    except Exception as error:
        raise ValueError(
            "could not initialise the inner optimizer on a stand-in of the parameters "
            f"({type(error).__name__}: {error})."
        ) from error
    return mirror


def optimizer_family(tx: optax.GradientTransformation, params: Any = None) -> str:
    """The optimizer family of ``tx``, told from the state types it creates.

    Args:
        tx: the optimizer.
        params: the real parameters, when a scalar probe is not enough (see
            :func:`probe_params`).

    Returns:
        ``"adam"`` (``ScaleByAdamState``), ``"adamw"`` (Adam state plus a readable
        ``weight_decay``), ``"momentum"`` (``TraceState``), ``"lars"`` (momentum plus a
        readable ``trust_coefficient``), ``"sgd"`` (no per-parameter state) or
        ``"other (<state type names>)"``.

    Example:
        >>> import optax
        >>> optimizer_family(optax.sgd(0.1, momentum=0.9))
        'momentum'
    """
    state = jax.eval_shape(tx.init, probe_params(tx, params))
    nodes = _state_nodes(state)
    hp = next((n.hyperparams for n in nodes if _has_hyperparams(n)), {})
    types = {type(n) for n in nodes}
    if optax.ScaleByAdamState in types:
        return "adamw" if "weight_decay" in hp else "adam"
    if optax.TraceState in types:
        return "lars" if "trust_coefficient" in hp else "momentum"
    if all(issubclass(t, _NEUTRAL_STATES) for t in types):
        return "sgd"
    names = sorted(t.__name__ for t in types if not issubclass(t, _NEUTRAL_STATES))
    return f"other ({', '.join(names)})"


def readable_fix(family: str) -> str:
    """How to rebuild an optimizer of ``family`` with readable hyperparameters."""
    return _FIXES.get(family, "optax.inject_hyperparams(<optax factory>)(learning_rate=...)")


def _hyperparams_or_raise(
    tx: optax.GradientTransformation, family: str, who: str, params: Any = None
) -> dict[str, jax.Array]:
    state = tx.init(probe_params(tx, params))
    if _has_hyperparams(state):
        return dict(state.hyperparams)
    nested = any(_has_hyperparams(n) for n in _state_nodes(state)[1:])
    if nested:
        raise ValueError(
            f"{who} needs the inject_hyperparams-wrapped optimizer itself, but got a "
            f"{type(state).__name__} that contains one (for example an optax.chain). Pass the "
            f"wrapped optimizer alone, e.g. {readable_fix(family)}, and chain other "
            "transformations (clipping, ...) around the result."
        )
    raise ValueError(
        f"{who} needs readable hyperparameters, but the inner {family} optimizer keeps them "
        f"in closures (its state, a {type(state).__name__}, has no 'hyperparams'); this is "
        f"what a plain optax.{'sgd' if family in ('momentum', 'sgd') else family}(...) "
        f"looks like. Build it as {readable_fix(family)}."
    )


def inner_hyperparams(
    tx: optax.GradientTransformation, params: Any = None
) -> tuple[str, dict[str, jax.Array]]:
    """The family and the hyperparameters of an ``inject_hyperparams`` optimizer.

    Args:
        tx: an optimizer built with ``optax.inject_hyperparams`` (or one of this module's
            factories).
        params: the real parameters, when a scalar probe is not enough.

    Returns:
        ``(family, hyperparams)``: the family as :func:`optimizer_family` names it, and the
        hyperparameter values at step 0 (for a schedule, its first value), by Optax name
        (``learning_rate``, ``b1``, ``b2``, ``eps``, ``momentum``, ``weight_decay``...).

    Raises:
        ValueError: ``tx`` hides its hyperparameters (e.g. a plain ``optax.adam(1e-3)``);
            the message shows the fix.

    Example:
        >>> import optax
        >>> tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
        >>> family, hp = inner_hyperparams(tx)
        >>> family, round(float(hp["momentum"]), 6)
        ('momentum', 0.9)
    """
    family = optimizer_family(tx, params)
    return family, _hyperparams_or_raise(tx, family, "jfleet", params)


# ---------------------------------------------------------------------- learning rate


def variable_values(tree: Any) -> Any:
    """``tree`` with ``nnx`` variables replaced by their values (an optimizer's live state).

    Example:
        >>> from flax import nnx
        >>> variable_values({"lr": nnx.Variable(0.5)})
        {'lr': 0.5}
    """
    from flax import nnx

    return jax.tree.map(
        lambda x: x.get_value() if isinstance(x, nnx.Variable) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def learning_rate_state(state: Any, tx: optax.GradientTransformation | None = None) -> Any:
    """The one ``inject_hyperparams`` state in ``state`` that holds a ``learning_rate``.

    Works on a plain optax state and on an ``nnx.Optimizer``'s live state (whose fields
    are variables that can be written in place).

    Args:
        state: an optimizer state tree.
        tx: the user's optimizer, named in the error's fix.

    Raises:
        ValueError: no readable learning rate (the fix: ``inject_hyperparams``), or
            several (e.g. ``optax.multi_transform`` over two injected optimizers).

    Example:
        >>> import jax.numpy as jnp
        >>> node = learning_rate_state(sgd(0.1).init(jnp.zeros(2)))
        >>> round(float(node.hyperparams["learning_rate"]), 6)
        0.1
    """
    found = [
        n
        for n in jax.tree.leaves(state, is_leaf=_has_hyperparams)
        if _has_hyperparams(n) and "learning_rate" in n.hyperparams
    ]
    if len(found) == 1:
        return found[0]
    if not found:
        family = optimizer_family(tx) if tx is not None else "other"
        raise ValueError(
            "the optimizer's learning rate is not readable: a plain optax optimizer keeps it "
            "in a closure, so get_lr / set_lr / an lr_scheduler cannot reach it. Build the "
            f"optimizer with an injected learning rate, e.g. {readable_fix(family)}."
        )
    raise ValueError(
        f"the optimizer state holds {len(found)} injected learning rates; get_lr / set_lr "
        "need exactly one. Inject the learning rate into one optimizer only (or call "
        "set_lr on each optimizer of an optax.multi_transform yourself)."
    )


def is_scheduled(node: Any) -> bool:
    """Whether the learning rate of an :func:`learning_rate_state` node is a schedule."""
    return "learning_rate" in node.hyperparams_states


def scheduled_learning_rate(tx: optax.GradientTransformation, node: Any) -> float:
    """The learning rate that the next update of ``tx`` applies, for a scheduled ``node``.

    Runs ``tx`` once on a scalar stand-in parameter whose schedule state is ``node``'s,
    so the schedule is evaluated by optax itself at the real step count.

    Example:
        >>> import jax.numpy as jnp
        >>> tx = sgd(optax.linear_schedule(1.0, 0.0, 10))
        >>> state = tx.init(jnp.zeros(2))
        >>> _, state = tx.update(jnp.ones(2), state)
        >>> round(scheduled_learning_rate(tx, learning_rate_state(state)), 6)
        0.9
    """
    probe = probe_params(tx)
    real = variable_values(node.hyperparams_states)

    def swap(n: Any) -> Any:
        if _has_hyperparams(n) and "learning_rate" in n.hyperparams:
            return n._replace(hyperparams_states=real)
        return n

    state = jax.tree.map(swap, tx.init(probe), is_leaf=_has_hyperparams)
    _, new = tx.update(jax.tree.map(jnp.zeros_like, probe), state, probe)
    return float(learning_rate_state(new).hyperparams["learning_rate"])

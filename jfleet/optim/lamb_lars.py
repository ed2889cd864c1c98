"""LAMB and LARS: Paddle's strategy.lamb / strategy.lars as Optax transformations.

Paddle's meta-optimizers *replace* the user's optimizer. ``strategy.lamb`` turns an
``Adam`` into ``paddle.optimizer.Lamb`` with the same learning rate, betas and epsilon;
``strategy.lars`` turns a ``Momentum`` into ``LarsMomentumOptimizer`` with the same
learning rate and momentum. :func:`lamb_from` and :func:`lars_from` do the same to an
Optax optimizer whose hyperparameters are readable (built with
``optax.inject_hyperparams``, or :mod:`jfleet.optim.hyperparams`'s factories).

Learning-rate schedules are kept exactly: the inner optimizer runs as a *hyperparameter
clock* on a scalar stand-in parameter (a few bytes of state), so at every step the
learning rate (and betas, momentum) are the values the inner optimizer itself would have
used, including manual overrides of ``state.inner_state.hyperparams[...]``.

Formulas (Paddle's kernels, ``phi/kernels/funcs/lamb_functors.h`` and
``phi/kernels/cpu/lars_momentum_kernel.cc``), per parameter tensor ``p`` with gradient
``g`` and weight decay ``wd`` (0 for excluded parameters):

LAMB::

    m = b1 * m + (1 - b1) * g            v = b2 * v + (1 - b2) * g**2
    r = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps) + wd * p
    trust = ||p|| / ||r||   if wd > 0 (or always_adapt) and both norms > 0,   else 1
    p <- p - lr * trust * r

LARS::

    local_lr = lr * lars_coeff * ||p|| / (||g|| + wd * ||p|| + epsilon)
               if wd > 0 and ||p|| > 0 and ||g|| > 0,   else lr
    v = momentum * v + local_lr * (g + wd * p)
    p <- p - v

Where Optax differs: ``optax.lamb`` applies the trust ratio to *every* parameter (Paddle,
with ``always_adapt=False``, gives a parameter whose decay is 0, e.g. an excluded bias, a
plain Adam step), and its default ``eps`` is 1e-6 (Paddle's LAMB meta-optimizer takes
Adam's, 1e-8 by default). ``optax.lars`` scales by ``trust_coefficient * ||p|| /
(||g + wd * p|| + eps)`` (Paddle: ``||g|| + wd * ||p|| + epsilon``) and keeps the ratio
for parameters whose decay is masked off (Paddle: a plain momentum step). Paddle's CUDA
LARS kernel skips the zero-norm guard (a zero-initialised, non-excluded parameter never
moves); jfleet follows the CPU kernel, which falls back to ``lr``.

Exclusions follow Paddle's meta-optimizers: LAMB excludes a parameter whose name *ends
with* a pattern (``param.name.endswith(name)``), LARS one whose name *contains* a
pattern (``name in param_name``). Names are the parameters' pytree paths joined with
``"."`` (``"layers.0.linear.bias"``; nnx's trailing ``.value`` dropped), see
:func:`parameter_names`.

Example:
    >>> import jax.numpy as jnp
    >>> from jfleet.optim import hyperparams, lamb_lars
    >>> tx = lamb_lars.lamb_from(hyperparams.adam(1e-3), exclude_from_weight_decay=["bias"])
    >>> params = {"w": jnp.ones((2, 2)), "bias": jnp.zeros(2)}
    >>> updates, state = tx.update(params, tx.init(params), params)
    >>> updates["w"].shape
    (2, 2)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jfleet.optim.hyperparams import (
    ProbeError,
    _hyperparams_or_raise,
    optimizer_family,
    probe_params,
    readable_fix,
)

__all__ = [
    "LambState",
    "LarsState",
    "lamb_from",
    "lars_from",
    "parameter_names",
]


class LambState(NamedTuple):
    """State of :func:`lamb_from`.

    Attributes:
        mu: first moments, shaped and sharded like the parameters (at least float32).
        nu: second moments, likewise.
        beta1_pow: product of ``b1`` over the steps taken (Paddle's ``Beta1Pow``).
        beta2_pow: product of ``b2`` over the steps taken.
        inner_state: the inner optimizer's state on a scalar stand-in parameter; its
            ``hyperparams`` are the values used by the last step.
    """

    mu: optax.Updates
    nu: optax.Updates
    beta1_pow: jax.Array
    beta2_pow: jax.Array
    inner_state: Any


class LarsState(NamedTuple):
    """State of :func:`lars_from`.

    Attributes:
        velocity: Paddle's velocity (learning rate included), shaped and sharded like the
            parameters (at least float32).
        inner_state: the inner optimizer's state on a scalar stand-in parameter; its
            ``hyperparams`` are the values used by the last step.
    """

    velocity: optax.Updates
    inner_state: Any


# ------------------------------------------------------------------------------ names


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def parameter_names(params: Any) -> list[str]:
    """The name of every parameter leaf, in ``jax.tree.leaves`` order.

    A name is the leaf's pytree path joined with ``"."``; the ``.value`` that Flax NNX
    variables add at the end of every path is dropped, so an ``nnx.State`` and the plain
    dict of the same model give the same names.

    Args:
        params: a pytree of arrays (a dict, an ``nnx.State``, ...).

    Returns:
        One name per leaf.

    Example:
        >>> import jax.numpy as jnp
        >>> parameter_names({"layers": [{"kernel": jnp.ones(2), "bias": jnp.ones(2)}]})
        ['layers.0.bias', 'layers.0.kernel']
    """
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
            path = path[:-1]
        names.append(".".join(_key_name(k) for k in path))
    return names


def _names_for(params: Any, param_names: Any) -> list[str]:
    if param_names is None:
        return parameter_names(params)
    names = jax.tree.leaves(param_names)
    n_params = len(jax.tree.leaves(params))
    bad = [n for n in names if not isinstance(n, str)]
    if bad or len(names) != n_params:
        raise ValueError(
            f"param_names must hold one str per parameter leaf ({n_params} leaves), got "
            f"{len(names)} leaves" + (f" including non-strings {bad[:3]!r}" if bad else "") + "."
        )
    return names


def _check_patterns(patterns: Any) -> tuple[str, ...]:
    if isinstance(patterns, str):
        raise TypeError(
            f"exclude_from_weight_decay={patterns!r} must be a list of name patterns, not a "
            f"single string; use [{patterns!r}]."
        )
    if not isinstance(patterns, Sequence):
        raise TypeError(
            f"exclude_from_weight_decay={patterns!r} must be a list of name patterns, e.g. "
            "['bias', 'norm.scale']."
        )
    bad = [p for p in patterns if not isinstance(p, str) or not p]
    if bad:
        raise TypeError(
            f"exclude_from_weight_decay entries must be non-empty strings, got {bad!r} in "
            f"{list(patterns)!r}."
        )
    return tuple(patterns)


def _check_rate(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}={value!r} must be a non-negative float.")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} must be finite and >= 0.")
    return float(value)


def _decay_rates(
    params: Any,
    param_names: Any,
    patterns: tuple[str, ...],
    rate: float,
    excluded: Callable[[str, str], bool],
    warn: bool,
) -> list[float]:
    names = _names_for(params, param_names)
    for pattern in patterns if warn else ():
        if not any(excluded(name, pattern) for name in names):
            warnings.warn(
                f"exclude_from_weight_decay pattern {pattern!r} matches no parameter "
                f"(names look like {names[:4]!r}).",
                stacklevel=4,
            )
    return [0.0 if any(excluded(n, pat) for pat in patterns) else rate for n in names]


# ----------------------------------------------------------------------- inner optimizer


class _Inner:
    """The inner optimizer: family check, then a hyperparameter clock on a stand-in."""

    def __init__(
        self,
        tx: optax.GradientTransformation,
        who: str,
        families: tuple[str, ...],
        wanted: str,
    ):
        self.tx = optax.with_extra_args_support(tx)
        self.who = who
        self.families = families
        self.wanted = wanted
        try:
            self.check(None)
            self.checked = True
        except ProbeError:
            self.checked = False  # e.g. a mask shaped like the params: check at init

    def check(self, params: Any) -> None:
        family = optimizer_family(self.tx, params)
        if family not in self.families:
            raise ValueError(
                f"{self.who} needs {self.wanted} inner optimizer (as Paddle's "
                f"strategy.{self.who.lower()} does), got {family!r}. Build it as "
                f"{readable_fix(self.families[0])}."
            )
        _hyperparams_or_raise(self.tx, family, self.who, params)

    def init(self, params: Any) -> Any:
        if not self.checked:
            self.check(params)
        return self.tx.init(probe_params(self.tx, params))

    def tick(self, state: Any, params: Any, **extra_args: Any) -> tuple[dict[str, Any], Any]:
        probe = jax.tree.map(jnp.zeros_like, probe_params(self.tx, params))
        _, new_state = self.tx.update(probe, state, probe, **extra_args)
        return new_state.hyperparams, new_state


def _compute_dtype(x: jax.Array) -> jnp.dtype:
    return jnp.promote_types(x.dtype, jnp.float32)


def _norm(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x)))


# ----------------------------------------------------------------------------------- LAMB


def lamb_from(
    inner: optax.GradientTransformation,
    *,
    lamb_weight_decay: float = 0.01,
    exclude_from_weight_decay: Sequence[str] = (),
    param_names: Any = None,
    always_adapt: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Paddle's strategy.lamb: LAMB with the learning rate, betas and eps of an Adam.

    Args:
        inner: an Adam-family optimizer with readable hyperparameters, e.g.
            ``jfleet.optim.hyperparams.adam(1e-3)`` or
            ``optax.inject_hyperparams(optax.adam)(learning_rate=schedule)``. An AdamW's
            own ``weight_decay`` is not used (Paddle's Lamb ignores it too).
        lamb_weight_decay: LAMB's decay rate ``wd`` (``lamb_configs``), >= 0.
        exclude_from_weight_decay: name patterns; a parameter whose name ends with one
            gets ``wd = 0`` (and so, as in Paddle, no trust ratio unless ``always_adapt``).
            ``"bias"`` matches ``"layers.0.linear.bias"``; ``"norm"`` does not match
            ``"layers.0.norm.scale"`` (write ``"norm.scale"``). A pattern that matches no
            parameter draws a warning at ``init``.
        param_names: optional pytree of ``str`` with one name per parameter leaf (same
            leaf order as the parameters), replacing :func:`parameter_names`.
        always_adapt: apply the trust ratio also where ``wd == 0`` (Paddle's
            ``always_adapt`` attribute of the lamb op; off in Paddle's meta-optimizer).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` with :class:`LambState`; ``update``
        needs ``params``.

    Raises:
        ValueError: the inner optimizer is not Adam-family, hides its hyperparameters
            (the message shows the fix), or a rate is out of range.
        TypeError: an argument of the wrong type.

    Example:
        >>> import jax.numpy as jnp
        >>> from jfleet.optim import hyperparams
        >>> tx = lamb_from(hyperparams.adam(1e-2), lamb_weight_decay=0.0)
        >>> p = {"w": jnp.ones(3)}
        >>> u, _ = tx.update({"w": jnp.ones(3)}, tx.init(p), p)
        >>> [round(float(x), 4) for x in u["w"]]
        [-0.01, -0.01, -0.01]
    """
    wd = _check_rate("lamb_weight_decay", lamb_weight_decay)
    patterns = _check_patterns(exclude_from_weight_decay)
    if not isinstance(always_adapt, bool):
        raise TypeError(f"always_adapt={always_adapt!r} must be a bool.")
    clock = _Inner(inner, "LAMB", ("adam", "adamw"), "an Adam-family (adam, adamw)")

    def rates(params: Any, warn: bool = False) -> list[float]:
        return _decay_rates(params, param_names, patterns, wd, lambda n, pat: n.endswith(pat), warn)

    def init_fn(params: optax.Params) -> LambState:
        rates(params, warn=True)  # validates names, warns about patterns matching nothing
        return _lamb_init(params, clock.init(params))

    def update_fn(
        updates: optax.Updates,
        state: LambState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LambState]:
        if params is None:
            raise ValueError("LAMB needs params: call update(grads, state, params).")
        hp, inner_state = clock.tick(state.inner_state, params, **extra_args)
        lr, b1, b2, eps = (hp[k] for k in ("learning_rate", "b1", "b2", "eps"))
        beta1_pow = state.beta1_pow * b1.astype(jnp.float32)
        beta2_pow = state.beta2_pow * b2.astype(jnp.float32)

        treedef = jax.tree.structure(updates)
        leaves = zip(
            jax.tree.leaves(updates),
            treedef.flatten_up_to(params),
            treedef.flatten_up_to(state.mu),
            treedef.flatten_up_to(state.nu),
            rates(params),
            strict=True,
        )
        out, mus, nus = [], [], []
        for g, p, m, v, rate in leaves:
            update, m, v = _lamb_leaf(
                g, p, m, v, rate, (lr, b1, b2, eps), (beta1_pow, beta2_pow), always_adapt
            )
            out.append(update)
            mus.append(m)
            nus.append(v)
        new_state = LambState(
            mu=treedef.unflatten(mus),
            nu=treedef.unflatten(nus),
            beta1_pow=beta1_pow,
            beta2_pow=beta2_pow,
            inner_state=inner_state,
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _lamb_init(params: optax.Params, inner_state: Any) -> LambState:
    """Zero moments (in each parameter's compute dtype) and unit beta powers."""
    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=_compute_dtype(p)), params)
    one = jnp.ones((), jnp.float32)
    return LambState(
        mu=zeros,
        nu=jax.tree.map(jnp.copy, zeros),
        beta1_pow=one,
        beta2_pow=one,
        inner_state=inner_state,
    )


def _lamb_leaf(
    g: jax.Array,
    p: jax.Array,
    m: jax.Array,
    v: jax.Array,
    rate: float,
    hyper: tuple[jax.Array, ...],
    pows: tuple[jax.Array, jax.Array],
    always_adapt: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One parameter's LAMB step: (update, new first moment, new second moment)."""
    lr, b1, b2, eps = hyper
    cd = m.dtype
    g32, p32 = g.astype(cd), p.astype(cd)
    b1c, b2c, epsc = b1.astype(cd), b2.astype(cd), eps.astype(cd)
    m = b1c * m + (1 - b1c) * g32
    v = b2c * v + (1 - b2c) * g32 * g32
    m_hat = m / (1 - pows[0].astype(cd))
    v_hat = v / (1 - pows[1].astype(cd))
    r = m_hat / (jnp.sqrt(v_hat) + epsc) + rate * p32
    if rate > 0 or always_adapt:
        p_norm, r_norm = _norm(p32), _norm(r)
        trust = jnp.where((p_norm > 0) & (r_norm > 0), p_norm / r_norm, 1.0)
    else:
        trust = 1.0
    return (-(lr.astype(cd) * trust) * r).astype(p.dtype), m, v


# ----------------------------------------------------------------------------------- LARS


def lars_from(
    inner: optax.GradientTransformation,
    *,
    lars_coeff: float = 0.001,
    lars_weight_decay: float = 0.0005,
    epsilon: float = 0.0,
    exclude_from_weight_decay: Sequence[str] = (),
    param_names: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Paddle's strategy.lars: LARS momentum with the learning rate and momentum of a Momentum.

    Args:
        inner: a momentum optimizer with readable hyperparameters, e.g.
            ``jfleet.optim.hyperparams.momentum(0.1)`` or
            ``optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)``.
            Its ``nesterov`` flag is not used (Paddle's LARS has none).
        lars_coeff: trust coefficient (``lars_configs``), >= 0.
        lars_weight_decay: LARS decay rate ``wd``, >= 0.
        epsilon: added to the local learning rate's denominator, >= 0.
        exclude_from_weight_decay: name patterns; a parameter whose name contains one
            gets ``wd = 0``, which (as in Paddle) also turns off the LARS scaling: it takes
            a plain momentum step. A pattern that matches no parameter draws a warning at
            ``init``.
        param_names: optional pytree of ``str`` with one name per parameter leaf,
            replacing :func:`parameter_names`.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` with :class:`LarsState`; ``update``
        needs ``params``.

    Raises:
        ValueError: the inner optimizer is not a momentum optimizer, hides its
            hyperparameters (the message shows the fix), or a value is out of range.
        TypeError: an argument of the wrong type.

    Example:
        >>> import jax.numpy as jnp
        >>> from jfleet.optim import hyperparams
        >>> tx = lars_from(hyperparams.momentum(0.1), exclude_from_weight_decay=["b"])
        >>> p = {"b": jnp.ones(2)}
        >>> u, _ = tx.update({"b": jnp.ones(2)}, tx.init(p), p)
        >>> [round(float(x), 4) for x in u["b"]]
        [-0.1, -0.1]
    """
    coeff = _check_rate("lars_coeff", lars_coeff)
    wd = _check_rate("lars_weight_decay", lars_weight_decay)
    eps = _check_rate("epsilon", epsilon)
    patterns = _check_patterns(exclude_from_weight_decay)
    clock = _Inner(inner, "LARS", ("momentum",), "a momentum (optax.sgd with momentum)")

    def rates(params: Any, warn: bool = False) -> list[float]:
        return _decay_rates(params, param_names, patterns, wd, lambda n, pat: pat in n, warn)

    def init_fn(params: optax.Params) -> LarsState:
        rates(params, warn=True)
        velocity = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=_compute_dtype(p)), params)
        return LarsState(velocity=velocity, inner_state=clock.init(params))

    def update_fn(
        updates: optax.Updates,
        state: LarsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LarsState]:
        if params is None:
            raise ValueError("LARS needs params: call update(grads, state, params).")
        hp, inner_state = clock.tick(state.inner_state, params, **extra_args)
        lr, mu = hp["learning_rate"], hp["momentum"]

        treedef = jax.tree.structure(updates)
        leaves = zip(
            jax.tree.leaves(updates),
            treedef.flatten_up_to(params),
            treedef.flatten_up_to(state.velocity),
            rates(params),
            strict=True,
        )
        out, velocities = [], []
        for g, p, v, rate in leaves:
            cd = v.dtype
            g32, p32 = g.astype(cd), p.astype(cd)
            lr_c = lr.astype(cd)
            if rate > 0:
                p_norm, g_norm = _norm(p32), _norm(g32)
                scaled = lr_c * coeff * p_norm / (g_norm + rate * p_norm + eps)
                local_lr = jnp.where((p_norm > 0) & (g_norm > 0), scaled, lr_c)
            else:
                local_lr = lr_c
            v = mu.astype(cd) * v + local_lr * (g32 + rate * p32)
            out.append((-v).astype(p.dtype))
            velocities.append(v)
        new_state = LarsState(velocity=treedef.unflatten(velocities), inner_state=inner_state)
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

"""fp32 master weights for half-precision parameters (Paddle AMP O2, ``multi_precision``).

In Paddle's pure fp16/bf16 training (O2) the model holds half-precision parameters while
the optimizer keeps an fp32 "master" copy, updates that copy in fp32 and writes the
rounded result back. :func:`master_weights` does the same as an Optax transform::

    tx = master_weights(optax.adam(1e-3))     # params are bfloat16 / float16
    state = tx.init(params)                   # fp32 copy, inner state built on it
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)   # == new master, rounded to half

Only low-precision floating leaves (float16, bfloat16, narrower floats) get a master
copy; float32 leaves and non-floating leaves pass straight through to ``inner``.
Wrapped by :func:`~jfleet.optim.loss_scale.dynamic_loss_scaling`, a skipped step keeps
the master copy unchanged along with the rest of the inner state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["MasterWeightsState", "master_weights"]


class MasterWeightsState(NamedTuple):
    """State of :func:`master_weights`.

    Attributes:
        master_params: same tree as the params; a float32 copy (same sharding) where the
            param is low-precision floating, ``optax.MaskedNode()`` elsewhere.
        inner_state: state of the wrapped transformation, initialised on the fp32 view
            of the params (masters where they exist, the params themselves elsewhere).
    """

    master_params: Any
    inner_state: Any


def _is_low_precision(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _full_view(master: Any, params: Any) -> Any:
    """The fp32 view the inner optimizer sees: masters where present, params elsewhere."""
    return jax.tree.map(lambda m, p: p if _is_masked(m) else m, master, params, is_leaf=_is_masked)


def master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` on an fp32 master copy of the low-precision params.

    ``update(grads, state, params)`` casts low-precision grads to float32, runs ``inner``
    on the master copy, sets ``new_master = master + inner_updates`` (float32) and returns
    float32 updates ``u = new_master.astype(p.dtype).astype(f32) - p.astype(f32)`` for
    those leaves, so that ``optax.apply_updates(params, updates)``, which computes
    ``(p + u).astype(p.dtype)``, lands exactly on ``new_master.astype(p.dtype)``: ``u``
    is a difference of two half-precision values, exact in float32 unless their
    magnitudes differ by more than 2**13 (float16) / 2**16 (bfloat16). Other leaves get
    ``inner``'s updates unchanged. Params are required.

    Args:
        inner: the transformation to run in float32.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` with state :class:`MasterWeightsState`.

    Raises:
        TypeError: ``inner`` is not a gradient transformation.
        ValueError: ``update`` is called without ``params``.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
        >>> tx = master_weights(optax.sgd(1e-3))
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
        >>> state.master_params["w"].dtype, optax.apply_updates(params, updates)["w"].dtype
        (dtype('float32'), dtype(bfloat16))
    """
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            f"inner={inner!r} must be an optax.GradientTransformation (with init and "
            "update); pass e.g. optax.adam(1e-3)."
        )
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> MasterWeightsState:
        # astype keeps each leaf's sharding, so masters are laid out like the params.
        master = jax.tree.map(
            lambda p: p.astype(jnp.float32) if _is_low_precision(p) else optax.MaskedNode(),
            params,
        )
        return MasterWeightsState(master, inner.init(_full_view(master, params)))

    def update_fn(
        updates: optax.Updates,
        state: MasterWeightsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, MasterWeightsState]:
        if params is None:
            raise ValueError(
                "master_weights needs params in update(grads, state, params); got "
                "params=None. Pass the current (half-precision) params."
            )
        grads = jax.tree.map(
            lambda g: g.astype(jnp.float32) if _is_low_precision(g) else g, updates
        )
        view = _full_view(state.master_params, params)
        inner_updates, inner_state = inner.update(grads, state.inner_state, view, **extra_args)

        def new_master(m, u):
            return m if _is_masked(m) else m + u.astype(jnp.float32)

        master = jax.tree.map(new_master, state.master_params, inner_updates, is_leaf=_is_masked)

        def param_update(m, p, u):
            if _is_masked(m):
                return u
            target = m.astype(p.dtype).astype(jnp.float32)
            return target - p.astype(jnp.float32)

        out = jax.tree.map(param_update, master, params, inner_updates, is_leaf=_is_masked)
        return out, MasterWeightsState(master, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

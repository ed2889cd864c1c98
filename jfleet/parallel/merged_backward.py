"""Gradient merge inside the backward pass: a layer loop adds each layer's gradient into
the gradient-merge accumulator as it makes it.

Under gradient accumulation (:func:`jfleet.optim.gradient_merge`) a step used to hold two
gradient-sized buffers of a scanned stack: the stacked gradient the backward loop writes
(one row per layer), and the accumulator it is then added into (optimizer state). FSDP
keeps one: each layer's reduce-scattered gradient is added into ``.grad`` when it is made.
At MPT-30B on 8 GPUs (fp32 shards of 15 GB each) that second buffer was the difference
between fitting 80 GB and not (issue 37).

:func:`run_merged` runs the layer loop with a hand-written backward pass: a reverse
``lax.scan`` that carries the accumulator and adds layer ``l``'s gradient into its row
``l`` in place (``acc[l] += g_l``), recomputing each layer's forward from its saved input
(full recompute: what the forward keeps is each layer's input, nothing else). The
gradient it returns for the stack's parameters is therefore the merged one,
``accumulator + this call's gradient``, in the accumulator's buffer.

The engine (:mod:`jfleet.training.engine`) turns it on while it traces a ZeRO-2 / 3 step
whose optimizer is a gradient merge over parameters of the accumulator's dtype
(:func:`accumulating`, with :class:`Accumulators` from the optimizer state); a stacked
module (``to_distributed``'s scanned blocks) asks :func:`current` for its parameters'
accumulators (:meth:`Accumulators.take`) and passes them to
:func:`jfleet.parallel.stack.run_layers`. The engine then gives the optimizer zeros for
those accumulators (the compiler drops the ``0 + g``), so each gradient is added once.

Example:
  >>> import jax, jax.numpy as jnp
  >>> def unit(h, w, args, kwargs):  # one layer: h @ w
  ...     return jnp.tanh(h @ w)
  >>> w = jnp.stack([jnp.eye(2) * (i + 1) for i in range(3)])
  >>> acc = jnp.ones_like(w)
  >>> merge = Accumulate(acc, fresh=False)
  >>> g = jax.grad(lambda w: run_merged(unit, w, merge, jnp.ones((1, 2)), (), {}).sum())(w)
  >>> plain = jax.grad(lambda w: jax.lax.scan(
  ...     lambda h, wi: (unit(h, wi, (), {}), None), jnp.ones((1, 2)), w)[0].sum())(w)
  >>> bool(jnp.allclose(g, acc + plain))
  True
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

__all__ = ["Accumulate", "Accumulators", "accumulating", "current", "run_merged"]

#: One layer of the loop: ``unit(h, w, args, kwargs) -> h``.
Unit = Callable[[Any, Any, tuple, dict], Any]


class Accumulate(NamedTuple):
    """What a layer loop merges its gradients into.

    Attributes:
      acc: the accumulators, a tree like the loop's parameters (same shapes and dtypes).
      fresh: a boolean scalar: ``acc`` holds a sum already applied (gradient merge's
        mini-step 0) and is read as zeros.
    """

    acc: Any
    fresh: Any = False


_ACCUMULATORS: contextvars.ContextVar[Accumulators | None] = contextvars.ContextVar(
    "jfleet_merged_backward", default=None
)


class Accumulators:
    """The gradient-merge accumulators of a step's parameters, by parameter path, and the
    stacks that took theirs.

    Args:
      by_path: per parameter path (as :func:`flax.nnx.to_flat_state` gives it), the
        accumulator of that parameter's gradient (same shape and dtype).
      fresh: a boolean scalar: the accumulators hold a sum already applied (gradient
        merge's mini-step 0) and are read as zeros.

    :meth:`bind` ties the paths to the parameter arrays a traced step sees;
    :meth:`take` hands a stack the accumulators of its parameters, once: a stack run twice
    in one step (shared weights) merges on its first run only, and its second run's
    gradient adds to that as usual.
    """

    def __init__(self, by_path: dict[tuple, jax.Array], fresh: Any = False) -> None:
        self.by_path = dict(by_path)
        self.fresh = fresh
        self.taken: set[tuple] = set()
        self._paths: dict[int, tuple] = {}
        self._bound: list[Any] = []  # keeps the bound arrays alive, so their ids stay theirs

    def bind(self, params: nnx.State) -> None:
        """Ties each accumulator to the array its parameter holds in ``params`` (the
        model's parameters as the traced step sees them)."""
        self._paths.clear()
        self._bound = []
        for path, var in nnx.to_flat_state(params):
            if path in self.by_path:
                value = var.get_value() if isinstance(var, nnx.Variable) else var
                self._paths[id(value)] = path
                self._bound.append(value)

    def take(self, leaves: list[Any]) -> list[jax.Array] | None:
        """The accumulators of ``leaves`` (parameter arrays as bound), marked taken; None
        unless every leaf has one not yet taken (the stack then runs as usual)."""
        paths = [self._paths.get(id(leaf)) for leaf in leaves]
        if not paths or any(p is None or p in self.taken for p in paths):
            return None
        self.taken.update(paths)
        return [self.by_path[p] for p in paths]


@contextlib.contextmanager
def accumulating(accumulators: Accumulators | None) -> Iterator[None]:
    """While tracing a step: stacks merge their gradients into ``accumulators`` (nothing
    for None)."""
    token = _ACCUMULATORS.set(accumulators)
    try:
        yield
    finally:
        _ACCUMULATORS.reset(token)


def current() -> Accumulators | None:
    """The accumulators stacks merge into now (None: outside such a step)."""
    return _ACCUMULATORS.get()


def _floating(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.inexact)


def _arrays(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.core.Tracer)


class _Parts:
    """A pytree's leaves split into the floating arrays (differentiated), the other arrays
    (passed along) and the rest (static), and put back together."""

    def __init__(self, tree: Any) -> None:
        leaves, self.treedef = jax.tree.flatten(tree)
        self.static = [None if _arrays(x) else x for x in leaves]
        self.kinds = [2 if _floating(x) else 1 if _arrays(x) else 0 for x in leaves]

    def split(self, tree: Any) -> tuple[list, list]:
        leaves = jax.tree.leaves(tree)
        return (
            [x for x, k in zip(leaves, self.kinds, strict=True) if k == 2],
            [x for x, k in zip(leaves, self.kinds, strict=True) if k == 1],
        )

    def join(self, floats: list, others: list) -> Any:
        floats, others = iter(floats), iter(others)
        leaves = [
            next(floats) if k == 2 else next(others) if k == 1 else s
            for s, k in zip(self.static, self.kinds, strict=True)
        ]
        return jax.tree.unflatten(self.treedef, leaves)

    def cotangent(self, floats: list) -> Any:
        """A cotangent of the tree: ``floats`` for its floating arrays, None (zero) for
        the rest."""
        floats = iter(floats)
        leaves = [next(floats) if k == 2 else None for k in self.kinds]
        return jax.tree.unflatten(self.treedef, leaves)


def run_merged(
    unit: Unit, params: Any, merge: Accumulate, x: Any, args: tuple, kwargs: dict
) -> Any:
    """``x`` through the layers whose parameters are ``params`` (leaves ``[n, ...]``), as
    ``lax.scan``; differentiated, the gradient of ``params`` is ``merge.acc`` (zeros when
    ``merge.fresh``) plus this call's gradient, added in the backward loop one layer at a
    time into the accumulators' buffers.

    Args:
      unit: one layer, ``unit(h, w, args, kwargs) -> h`` (returns what it takes).
      params: the layers' parameters, leaves ``[n, ...]``.
      merge: the gradient-merge accumulators, a tree like ``params`` of the same dtypes,
        and whether they are read as zeros.
      x: the activation entering the first layer (an array or a pytree).
      args, kwargs: further arguments of every layer; their floating arrays are
        differentiated (their gradients summed over the layers).

    Returns:
      The last layer's output. Each layer's forward is recomputed once in the backward
      pass, from its input (the only thing the forward keeps per layer).
    """
    acc, fresh = merge
    h_parts, extra = _Parts(x), _Parts((args, kwargs))
    extra_floats, extra_others = extra.split((args, kwargs))

    def call(h: Any, w: Any, floats: list) -> Any:
        a, k = extra.join(floats, extra_others)
        return unit(h, w, a, k)

    @jax.custom_vjp
    def loop(params: Any, acc: Any, fresh: Any, x: Any, floats: list) -> Any:
        del acc, fresh
        return lax.scan(lambda h, w: (call(h, w, floats), None), x, params)[0]

    def loop_fwd(params: Any, acc: Any, fresh: Any, x: Any, floats: list) -> tuple:
        y, inputs = lax.scan(lambda h, w: (call(h, w, floats), h), x, params)
        return y, (params, acc, fresh, inputs, floats)

    def loop_bwd(res: tuple, dy: Any) -> tuple:
        params, acc, fresh, inputs, floats = res

        def back(carry: tuple, xs: tuple) -> tuple:
            dh, acc, dfloats = carry
            w, h, i = xs
            _, others = h_parts.split(h)

            def layer(h_floats: list, w: Any, floats: list) -> list:
                return h_parts.split(call(h_parts.join(h_floats, others), w, floats))[0]

            _, pullback = jax.vjp(layer, h_parts.split(h)[0], w, floats)
            dh, dw, df = pullback(dh)
            acc = jax.tree.map(lambda a, g: _add_row(a, g, i, fresh), acc, dw)
            dfloats = [a + b.astype(a.dtype) for a, b in zip(dfloats, df, strict=True)]
            return (dh, acc, dfloats), None

        n = jax.tree.leaves(params)[0].shape[0]
        start = (h_parts.split(dy)[0], acc, [jnp.zeros_like(f) for f in floats])
        (dx, acc, dfloats), _ = lax.scan(back, start, (params, inputs, jnp.arange(n)), reverse=True)
        return acc, None, None, h_parts.cotangent(dx), dfloats

    loop.defvjp(loop_fwd, loop_bwd)
    return loop(params, acc, jnp.asarray(fresh), x, extra_floats)


def _add_row(acc: jax.Array, grad: jax.Array, i: jax.Array, fresh: jax.Array) -> jax.Array:
    """``acc`` with ``grad`` added into its row ``i`` (read as zeros when ``fresh``), in
    place."""
    row = lax.dynamic_index_in_dim(acc, i, 0, keepdims=False)
    row = jnp.where(fresh, jnp.zeros_like(row), row) + grad.astype(acc.dtype)
    return lax.dynamic_update_index_in_dim(acc, row, i, 0)

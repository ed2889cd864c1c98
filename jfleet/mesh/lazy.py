"""Paddle's ``LazyGuard``: modules built inside it are abstract, created later in their layout.

A model bigger than one device cannot be built whole. Inside ``with LazyGuard():`` the
outermost ``nnx.Module`` constructed is not built: the call returns its abstract model
(``nnx.eval_shape``: the structure, shapes, dtypes and sharding metadata; no arrays) and
remembers how to build it. ``fleet.distributed_model``, ``group_sharded_parallel`` and
``to_distributed`` then create it directly in its layout
(:func:`~jfleet.mesh.create.create_placed`), so no device and no host ever holds a
parameter the layout splits whole. Paddle initialises each parameter's local shard when
``param.initialize()`` is called; here one compiled program makes them all.

The constructor's arguments are captured when the call is made (their NNX state, by
``nnx.split``), and each build merges fresh copies of them: the same ``nnx.Rngs(0)`` gives
the same values however often the model is built, and the caller's ``Rngs`` does not
advance (it would, built eagerly). Other arguments are shared, not copied. A mesh set
around the construction (``with jax.set_mesh(mesh):``, as Flax's sharding guide builds
models) is set around every build (as its abstract mesh: builds run traced).

Example:
  >>> from flax import nnx
  >>> with LazyGuard():
  ...     model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
  >>> type(model.kernel.get_value()).__name__  # shapes only: nothing was allocated
  'ShapeDtypeStruct'
  >>> built = factory_of(model)()
  >>> bool((built.kernel[...] == nnx.Linear(4, 8, rngs=nnx.Rngs(0)).kernel[...]).all())
  True
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from flax.nnx.module import ModuleMeta

__all__ = ["LazyGuard", "factory_of", "is_abstract", "unbuilt"]

#: abstract model -> the function that builds it (kept while the abstract model lives)
_FACTORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: inside a construction the guard deferred: inner modules are built as usual
_BUILDING: contextvars.ContextVar[bool] = contextvars.ContextVar("jfleet_lazy", default=False)
_LOCK = threading.Lock()
_ACTIVE: list[LazyGuard] = []  # guards entered (patched while non-empty)
_EAGER_CALL = ModuleMeta.__call__


class LazyGuard:
    """Inside it, constructing an ``nnx.Module`` returns its abstract model (Paddle's
    ``paddle.LazyGuard``); :func:`factory_of` gives the function that builds it.

    Only the outermost construction is deferred (its submodules are part of it). Guards
    nest; the patch of ``ModuleMeta.__call__`` is undone when the last one exits.

    Example:
      >>> from jfleet import LazyGuard, fleet
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> with LazyGuard():
      ...     model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
      >>> model = fleet.distributed_model(model)  # created in place, never whole
      >>> model.module.kernel.shape
      (4, 8)
    """

    def __enter__(self) -> LazyGuard:
        with _LOCK:
            if not _ACTIVE:
                ModuleMeta.__call__ = _lazy_call  # type: ignore[method-assign]
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                ModuleMeta.__call__ = _EAGER_CALL  # type: ignore[method-assign]


def _lazy_call(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)`` deferred: its abstract model, with its factory recorded."""
    if _BUILDING.get():
        return _EAGER_CALL(cls, *args, **kwargs)
    # the arguments as NNX graph and state: each build merges fresh objects (an Rngs
    # starts from its count at this call), inside a trace or not
    graphdef, state = nnx.split((args, kwargs))
    mesh = jax.sharding.get_mesh()  # the mesh context it was built under (Flax's guide)

    def factory() -> nnx.Module:
        a, kw = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        token = _BUILDING.set(True)
        try:
            with _under(mesh):
                return _EAGER_CALL(cls, *a, **kw)
        finally:
            _BUILDING.reset(token)

    abstract = nnx.eval_shape(factory)
    _FACTORIES[abstract] = factory
    return abstract


def _under(mesh: jax.sharding.Mesh) -> contextlib.AbstractContextManager:
    """``mesh`` as the context Flax reads variables' layouts from (its abstract mesh: a
    build runs inside ``jax.jit`` / ``eval_shape``, where ``jax.set_mesh`` is refused)."""
    if mesh.empty:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def factory_of(model: nnx.Module) -> Callable[[], nnx.Module] | None:
    """The function that builds ``model`` if :class:`LazyGuard` deferred it, else None."""
    try:
        return _FACTORIES.get(model)
    except TypeError:  # not weak-referenceable: not one of ours
        return None


def is_abstract(model: nnx.Module) -> bool:
    """Whether ``model``'s variables are shapes without values (``nnx.eval_shape``)."""
    leaves = jax.tree.leaves(nnx.state(model))
    return bool(leaves) and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)


def unbuilt(model: Any, where: str) -> Callable[[], nnx.Module] | None:
    """How to build ``model`` if it is not built yet, for ``where`` (the caller's name).

    Returns:
      ``model`` itself when it is a function (not an ``nnx.Module``), the recorded factory of
      a :class:`LazyGuard` model, None for a built module (or anything else: the caller
      checks its type).

    Raises:
      TypeError: an abstract module (``nnx.eval_shape``) whose factory is unknown.
    """
    if not isinstance(model, nnx.Module):
        return model if callable(model) else None
    factory = factory_of(model)
    if factory is None and is_abstract(model):
        raise TypeError(
            f"{where}: model is an abstract {type(model).__name__} (shapes, no values) whose "
            "construction is unknown, so it cannot be created; build it inside "
            "`with jfleet.LazyGuard():`, or pass the function that builds it, e.g. "
            "lambda: Model(rngs=nnx.Rngs(0))."
        )
    return factory

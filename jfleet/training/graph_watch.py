"""Has a model's graph changed since a step was built for it? Answered without re-splitting.

The engine's fast path (:mod:`jfleet.training.engine`) reuses the compiled step, the list of
``Variable`` objects and their tree structure from the last step while nothing the
program was specialised to has changed. What can change between steps, and how each
is seen here:

* an attribute of any graph node set, added or deleted (a submodule swapped, a static
  attribute assigned, a ``Variable`` replaced, ``nnx.update`` adding a key): every
  node's ``__dict__`` is compared by identity with a snapshot taken when the step was
  built;
* a mutable container inside the graph edited in place (a list in a config, a dict of
  hyperparameters): its items are compared by identity too;
* an unhashable static value edited in place (a non-frozen dataclass config): compared
  with ``==`` against a deep copy, as the compile cache compares graph definitions;
* a ``Variable``'s metadata changed (``set_metadata``): compared with ``==``.

What is deliberately not looked at: the variables' values. They are read on every
step (``nnx.update`` or ``opt.set_lr`` write new values into the same variables);
the engine checks the shape, dtype and sharding of each value it did not install
itself.

A graph that cannot be watched this way (a graph node without ``__dict__``, an array
stored outside a ``Variable``) gives ``None`` from :func:`watch_graph`: such a model always
takes the engine's full path.

Example:
  >>> from flax import nnx
  >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> watch = watch_graph(model)
  >>> watch.unchanged()
  True
  >>> model.extra = nnx.Param(np.zeros(1))
  >>> watch.unchanged()
  False
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graphlib


def same(a: Any, b: Any) -> bool:
    """``a == b`` as a plain bool; False when the comparison fails or is not a bool."""
    try:
        return bool(a == b)
    except Exception:
        return False


class _UnwatchableError(Exception):
    pass


class GraphWatch:
    """A snapshot of a graph's structure; :meth:`unchanged` compares the graph with it."""

    def __init__(self) -> None:
        self._dicts: list[tuple[dict, tuple, tuple]] = []  # node __dict__, keys, values
        self._lists: list[tuple[list, tuple]] = []
        self._metas: list[tuple[nnx.Variable, dict, dict]] = []
        self._statics: list[tuple[Any, Any]] = []  # unhashable value, a deep copy of it

    def unchanged(self) -> bool:
        """Whether no node, container, unhashable static value or metadata changed."""
        is_ = operator.is_
        for d, keys, values in self._dicts:
            if len(d) != len(keys) or not all(map(is_, d.values(), values)) or tuple(d) != keys:
                return False
        for lst, values in self._lists:
            if len(lst) != len(values) or not all(map(is_, lst, values)):
                return False
        for var, meta, want in self._metas:
            if var._var_metadata is not meta or not same(meta, want):
                return False
        return all(same(value, stored) for value, stored in self._statics)

    def _add(self, x: Any, seen: set[int]) -> None:
        if id(x) in seen:
            return
        if isinstance(x, nnx.Variable):
            seen.add(id(x))
            meta = x._var_metadata
            if meta.get("ref") or meta.get("hijax"):
                raise _UnwatchableError
            self._metas.append((x, meta, dict(meta)))
            return
        if isinstance(x, jax.Array | np.ndarray):
            raise _UnwatchableError  # data outside a Variable: the engine's full path reads it
        if graphlib.is_graph_node(x) or isinstance(x, nnx.State):  # a State: its _mapping
            seen.add(id(x))
            d = getattr(x, "__dict__", None)
            if not isinstance(d, dict):
                raise _UnwatchableError
            self._dicts.append((d, tuple(d), tuple(d.values())))
            for value in d.values():
                self._add(value, seen)
            return
        if type(x) is list or type(x) is dict:
            seen.add(id(x))
            if type(x) is dict:
                self._dicts.append((x, tuple(x), tuple(x.values())))
                items = x.values()
            else:
                self._lists.append((x, tuple(x)))
                items = x
            for value in items:
                self._add(value, seen)
            return
        if isinstance(x, tuple):
            for value in x:
                self._add(value, seen)
            return
        try:
            hash(x)
        except TypeError:
            seen.add(id(x))
            if any(isinstance(leaf, jax.Array | np.ndarray) for leaf in jax.tree.leaves(x)):
                raise _UnwatchableError from None  # data in a container this cannot see into
            try:
                stored = copy.deepcopy(x)
            except Exception:
                raise _UnwatchableError from None
            self._statics.append((x, stored))


def watch_graph(*roots: Any) -> GraphWatch | None:
    """A :class:`GraphWatch` over ``roots`` (models, optimizers), or ``None`` if one
    holds something this snapshot cannot see change (see the comment above GraphWatch).

    Example:
      >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> w = watch_graph(model)
      >>> w.unchanged()
      True
      >>> model.use_bias = False
      >>> w.unchanged()
      False
    """
    w = GraphWatch()
    seen: set[int] = set()
    try:
        for root in roots:
            w._add(root, seen)
    except _UnwatchableError:
        return None
    return w

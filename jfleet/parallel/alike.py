"""Whether layers are alike: the one test a stack of layers must pass.

Stacked layers all run one definition (layer 0's), so they must be alike: the same class,
the same static settings (ints, strings, tuples, None, functions compared by code), the
same parameter shapes and dtypes and the same sharing of sub-modules. Variable metadata is
not compared (the stack sets its own). :func:`first_difference` says where two layers
differ; :func:`block_period` finds the period of layers that repeat (alternating local /
global attention: 2), :func:`first_mismatch` the first pair that breaks one.

Example:
  >>> from flax import nnx
  >>> drop = lambda r: nnx.Dropout(r, deterministic=True)
  >>> first_difference(drop(0.1), drop(0.2))
  "attribute 'rate' (0.1 vs 0.2)"
  >>> block_period([drop(0.1), drop(0.2)] * 2), block_period([drop(0.1)] * 3)
  (2, 1)
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph

__all__ = ["block_period", "first_difference", "first_mismatch"]


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray)


_ABSENT = object()


def first_difference(a: nnx.Module, b: nnx.Module) -> str | None:
    """What first tells ``a``'s definition from ``b``'s, or None when they are alike.

    Two layers are alike when one graph definition runs both: the same classes, the same
    attributes with equal static values (``window=4``, ``None``, strings, tuples, dtypes;
    functions made from the same code with alike defaults and closures), the same
    sub-module sharing, and variables of the same kind, shape and dtype. Parameter values
    and variable metadata (layouts) may differ. Attributes are compared in sorted order, so
    the difference named is the first by path.

    Args:
      a: a layer.
      b: another layer.

    Returns:
      None, or a phrase naming the attribute path and both values, ``a``'s first:
      ``"attribute 'attn.window' (None vs 4)"``, ``"parameter 'mlp.kernel' (shape (16, 32)
      vs (16, 64))"``, ``"its class (LocalBlock vs GlobalBlock)"``.

    Example:
      >>> from flax import nnx
      >>> first_difference(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(2, 3, rngs=nnx.Rngs(1)))
      >>> first_difference(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.Linear(2, 4, rngs=nnx.Rngs(0)))
      "parameter 'bias' (shape (3,) vs (4,))"
      >>> drop = lambda r: nnx.Dropout(r, deterministic=True)
      >>> first_difference(drop(0.1), drop(0.2))
      "attribute 'rate' (0.1 vs 0.2)"
    """
    return _difference(a, b, (), {}, {})


def _difference(a: Any, b: Any, path: tuple, seen_a: dict, seen_b: dict) -> str | None:
    if type(a) is not type(b):
        return _differs(path, a, b)
    node = isinstance(a, nnx.Variable) or nnx_graph.is_graph_node(a)
    if node:  # the same sharing of sub-modules and variables
        first_a, first_b = seen_a.get(id(a)), seen_b.get(id(b))
        if first_a != first_b:
            shown = [
                f"the same object as {_dotted(p)!r}" if p is not None else "a separate object"
                for p in (first_a, first_b)
            ]
            return f"{_where(path)} ({shown[0]} vs {shown[1]})"
        if first_a is not None:
            return None
        seen_a[id(a)], seen_b[id(b)] = path, path
    if isinstance(a, nnx.Variable):
        return _array_difference(path, a.get_value(), b.get_value(), a)
    if node:
        dict_a, dict_b = _attributes(a), _attributes(b)
        for key in sorted(set(dict_a) | set(dict_b), key=_key_order):
            value_a, value_b = dict_a.get(key, _ABSENT), dict_b.get(key, _ABSENT)
            if value_a is _ABSENT or value_b is _ABSENT:
                return _differs((*path, key), value_a, value_b)
            if _static(value_a) and _static(value_b) and never_read(type(a), str(key)):
                continue  # ``self.layer_idx = i`` that no method reads: no computation differs
            found = _difference(value_a, value_b, (*path, key), seen_a, seen_b)
            if found:
                return found
        return None
    if _is_array(a):
        return _array_difference(path, a, b, None)
    leaves_a, tree_a = jax.tree_util.tree_flatten_with_path(a, is_leaf=_is_graph_leaf)
    leaves_b, tree_b = jax.tree_util.tree_flatten_with_path(b, is_leaf=_is_graph_leaf)
    if tree_a == tree_b and not jax.tree_util.treedef_is_leaf(tree_a):  # a container
        for (keys, value_a), (_, value_b) in zip(leaves_a, leaves_b, strict=True):
            found = _difference(value_a, value_b, (*path, *map(_key, keys)), seen_a, seen_b)
            if found:
                return found
        return None
    return None if _same_static(a, b) else _differs(path, a, b)


def _static(value: Any) -> bool:
    """A plain Python value: no module, variable or array anywhere inside."""
    found = lambda x: _is_graph_leaf(x) or _is_array(x)  # noqa: E731
    return not any(found(x) for x in jax.tree_util.tree_leaves(value, is_leaf=found))


GENERATED = "__jfleet_generated__"
"""Class attribute marking a subclass jfleet makes of a layer class (a pipelined block's
handing class): its code reads no attribute of the layer, so :func:`never_read` looks
through it to the layer's own classes."""


@functools.cache
def never_read(cls: type, name: str) -> bool:
    """Whether no method of ``cls`` (its own code and its bases' outside Flax) but
    ``__init__`` reads attribute ``name`` (``self.name`` or ``getattr(self, "name")``): an
    attribute such as ``self.layer_idx = i`` kept for bookkeeping, which no computation of
    the layer can depend on. False when a class's source cannot be read.

    Flax's own layers read their settings: for them it is always False.

    Example:
      >>> from jfleet.testing.nnx_styles.beyond_lm import ViTBlock  # sets self.layer_idx
      >>> never_read(ViTBlock, "layer_idx"), never_read(ViTBlock, "attn")
      (True, False)
      >>> never_read(nnx.Dropout, "rate")
      False
    """
    if cls.__module__.split(".")[0] == "flax":
        return False
    for klass in cls.__mro__:
        if klass is object or klass.__module__.split(".")[0] in ("flax", "builtins"):
            continue
        if klass.__dict__.get(GENERATED):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            return False
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                continue
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                for inner in ast.walk(node):
                    if (
                        isinstance(inner, ast.Attribute)
                        and inner.attr == name
                        and isinstance(inner.ctx, ast.Load)
                    ):
                        return False
                    if isinstance(inner, ast.Constant) and inner.value == name:
                        return False
    return True


def _attributes(node: Any) -> dict:
    items = nnx_graph.get_node_impl(node).node_dict(node)
    return {k: v for k, v in items.items() if not str(k).startswith("_pytree__")}


def _is_graph_leaf(x: Any) -> bool:
    return isinstance(x, nnx.Variable) or nnx_graph.is_graph_node(x)


def _key(key: Any) -> Any:
    for name in ("name", "key", "idx"):
        if hasattr(key, name):
            return getattr(key, name)
    return str(key)


def _key_order(key: Any) -> tuple:
    return (0, key, "") if isinstance(key, int) else (1, 0, str(key))


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def _where(path: tuple) -> str:
    return f"attribute {_dotted(path)!r}" if path else "its class"


def _differs(path: tuple, a: Any, b: Any) -> str:
    return f"{_where(path)} ({_show(a)} vs {_show(b)})"


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    if isinstance(value, nnx.Variable) or nnx_graph.is_graph_node(value) or isinstance(value, type):
        return type(value).__name__ if not isinstance(value, type) else value.__name__
    if _is_array(value):
        return f"{value.dtype}{list(value.shape)}"
    if isinstance(value, types.FunctionType):
        return f"function {value.__qualname__}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _array_difference(path: tuple, a: Any, b: Any, variable: Any) -> str | None:
    what = (
        "parameter"
        if isinstance(variable, nnx.Param)
        else "variable"
        if variable is not None
        else "array"
    )
    shape_a, shape_b = _shape(a), _shape(b)
    if shape_a != shape_b:
        return f"{what} {_dotted(path)!r} (shape {shape_a} vs {shape_b})"
    dtype_a, dtype_b = getattr(a, "dtype", type(a)), getattr(b, "dtype", type(b))
    if dtype_a != dtype_b:
        return f"{what} {_dotted(path)!r} (dtype {dtype_a} vs {dtype_b})"
    return None


def _shape(value: Any) -> tuple:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(np.shape(value))


def _same_static(a: Any, b: Any) -> bool:
    """Whether two static values steer a layer alike (functions: by code and closure)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, types.FunctionType):
        cells = [[_cell(c) for c in f.__closure__ or ()] for f in (a, b)]
        return (
            a.__code__ is b.__code__
            and _same_static(a.__defaults__, b.__defaults__)
            and _same_static(a.__kwdefaults__, b.__kwdefaults__)
            and _same_static(cells[0], cells[1])
        )
    if isinstance(a, functools.partial):
        return (
            _same_static(a.func, b.func)
            and _same_static(a.args, b.args)
            and _same_static(a.keywords, b.keywords)
        )
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_static(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_static(a[k], b[k]) for k in a)
    if isinstance(a, float) and a != a and b != b:  # two NaNs
        return True
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value
        return False


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return _ABSENT


def _labels(layers: Sequence[nnx.Module]) -> list[int]:
    """Per layer, the index of the first layer alike to it."""
    labels: list[int] = []
    for i, layer in enumerate(layers):
        same = (j for j in sorted(set(labels)) if first_difference(layer, layers[j]) is None)
        labels.append(next(same, i))
    return labels


def block_period(layers: Sequence[nnx.Module]) -> int | None:
    """The smallest period ``p`` with which the layers repeat, or None.

    ``p`` divides ``N = len(layers)`` and layer ``i`` is alike (:func:`first_difference`)
    to layer ``i + p`` for every ``i``: 1 when all layers are alike (a single layer
    included), 2 for local / global attention alternating. A period of ``N`` itself
    (``N > 1``) would leave nothing to stack, so there is no period then: None.

    Raises:
      ValueError: no layers.

    Example:
      >>> from flax import nnx
      >>> drop = lambda r: nnx.Dropout(r, deterministic=True)
      >>> block_period([drop(0.1), drop(0.2)] * 3), block_period([drop(0.1)] * 4)
      (2, 1)
      >>> block_period([drop(0.1), drop(0.2), drop(0.2), drop(0.2)]) is None
      True
    """
    layers = list(layers)
    if not layers:
        raise ValueError("block_period(layers=[]): pass the layers whose period to find.")
    labels = _labels(layers)
    n = len(labels)
    for p in range(1, n if n > 1 else 2):
        if n % p == 0 and all(labels[i] == labels[i + p] for i in range(n - p)):
            return p
    return None


def first_mismatch(layers: Sequence[nnx.Module], period: int = 1) -> tuple[int, int, str] | None:
    """The first layer ``i`` unlike layer ``i % period``: ``(i, i % period, difference)``.

    None when the layers repeat with ``period`` (every layer is alike to the layer at its
    place in the first period); the difference is :func:`first_difference`'s phrase.

    Example:
      >>> from flax import nnx
      >>> drop = lambda r: nnx.Dropout(r, deterministic=True)
      >>> first_mismatch([drop(0.1), drop(0.2)] * 2)
      (1, 0, "attribute 'rate' (0.2 vs 0.1)")
      >>> first_mismatch([drop(0.1), drop(0.2)] * 2, period=2) is None
      True
    """
    layers = list(layers)
    for i in range(period, len(layers)):
        found = first_difference(layers[i], layers[i % period])
        if found:
            return i, i % period, found
    return None

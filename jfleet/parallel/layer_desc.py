"""What a :class:`~jfleet.parallel.pipeline_layer.PipelineLayer` is built from.

Paddle's layer descriptions: :class:`LayerDesc` (a layer class and its arguments, built
when the pipeline is; ``rngs=`` is passed when the class takes it) and
:class:`SharedLayerDesc` (a layer tied across stages by a key, e.g. the embedding and the
LM head), and how each entry of ``PipelineLayer(layers=[...])`` is built.

Example:
  >>> from flax import nnx
  >>> desc = LayerDesc(nnx.Linear, 4, 4)
  >>> layer = desc.build_layer(nnx.Rngs(0))
  >>> type(layer).__name__, layer.kernel.shape
  ('Linear', (4, 4))
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

__all__ = ["LayerDesc", "SharedLayerDesc"]


class LayerDesc:
    """A layer described now and built later: ``layer_func(*inputs, **kwargs, rngs=rngs)``.

    Do not pass ``rngs``: the :class:`~jfleet.parallel.pipeline_layer.PipelineLayer`
    builds every layer from one ``nnx.Rngs`` (its ``seed`` or ``rngs`` argument) and adds
    ``rngs=`` to each layer whose ``layer_func`` takes it (a parameter named ``rngs`` or
    ``**kwargs``), so the same seed gives the same parameters whatever ``num_stages``.
    An ``rngs=`` given here is used as it is, drawing that layer's parameters from its
    own stream.

    Args:
      layer_func: the layer class (an ``nnx.Module`` subclass) or a factory returning one.
      *inputs: positional arguments for it.
      **kwargs: keyword arguments for it (``rngs`` is added when it accepts one and is
        not given).

    Raises:
      TypeError: ``layer_func`` is not callable.

    Example:
      >>> from flax import nnx
      >>> desc = LayerDesc(nnx.Linear, 2, 3)
      >>> desc.build_layer(nnx.Rngs(0)).kernel.shape
      (2, 3)
      >>> desc.same_as(LayerDesc(nnx.Linear, 2, 3)), desc.same_as(LayerDesc(nnx.Linear, 3, 2))
      (True, False)
    """

    def __init__(self, layer_func: Callable[..., Any], *inputs: Any, **kwargs: Any) -> None:
        if not callable(layer_func):
            raise TypeError(
                f"LayerDesc(layer_func={layer_func!r}): layer_func must be a layer class or a "
                "function building one."
            )
        self.layer_func = layer_func
        self.inputs = inputs
        self.kwargs = kwargs

    @property
    def name(self) -> str:
        """The class (or factory) name, what ``seg_method='layer:...'`` matches."""
        return _callable_name(self.layer_func)

    def build_layer(self, rngs: nnx.Rngs | None = None) -> Any:
        """Builds the layer, drawing its parameters from ``rngs`` (default ``nnx.Rngs(0)``)."""
        kwargs = dict(self.kwargs)
        if "rngs" not in kwargs and takes_rngs(self.layer_func):
            kwargs["rngs"] = rngs if rngs is not None else nnx.Rngs(0)
        return self.layer_func(*self.inputs, **kwargs)

    build = build_layer

    def same_as(self, other: Any) -> bool:
        """Whether ``other`` describes the same layer (type, class, arguments all equal)."""
        return (
            type(other) is type(self)
            and other.layer_func is self.layer_func
            and _equal(other.inputs, self.inputs)
            and _equal(other.kwargs, self.kwargs)
        )

    def __repr__(self) -> str:
        args = [repr(a) for a in self.inputs] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{type(self).__name__}({', '.join([self.name, *args])})"


class SharedLayerDesc(LayerDesc):
    """A layer shared by every description with the same ``key`` (a tied weight).

    The first description with a key builds the layer; later ones reuse that very
    module, so the tied parameter is one ``nnx.Param`` and its gradient sums all uses.
    ``forward_func(layer, x)`` says how an occurrence uses the layer (default
    ``layer(x)``): the LM head of a tied embedding is ``lambda emb, x: emb.attend(x)``.

    Args:
      key: the sharing key.
      layer_func: the layer class or factory (as :class:`LayerDesc`).
      forward_func: ``forward_func(layer, x)`` for this occurrence, or None.
      shared_weight_attr: the tied parameter's attribute name on the layer (Paddle's
        argument; checked to exist). ``"weight"`` for jfleet's and Paddle's embeddings,
        ``"embedding"`` for ``nnx.Embed``.
      *inputs: positional arguments for ``layer_func``.
      **kwargs: keyword arguments for ``layer_func``.

    Raises:
      TypeError: ``layer_func`` or ``forward_func`` not callable.

    Example:
      >>> from flax import nnx
      >>> from jfleet.parallel.pipeline_layer import PipelineLayer
      >>> embed = SharedLayerDesc("emb", nnx.Embed, None, "embedding", 16, 4)
      >>> head = SharedLayerDesc("emb", nnx.Embed, lambda e, x: e.attend(x), "embedding", 16, 4)
      >>> model = PipelineLayer([embed, LayerDesc(nnx.Linear, 4, 4), head], num_stages=1)
      >>> model.pre[0].layer is model.post[0].layer
      True
    """

    def __init__(
        self,
        key: Any,
        layer_func: Callable[..., Any],
        forward_func: Callable[[Any, Any], Any] | None = None,
        shared_weight_attr: str = "weight",
        *inputs: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(layer_func, *inputs, **kwargs)
        if forward_func is not None and not callable(forward_func):
            raise TypeError(
                f"SharedLayerDesc(key={key!r}): forward_func={forward_func!r} must be callable "
                "as forward_func(layer, x), or None."
            )
        self.layer_name = key
        self.forward_func = forward_func
        self.shared_weight_attr = shared_weight_attr

    @property
    def key(self) -> Any:
        """The sharing key (Paddle calls it ``layer_name``)."""
        return self.layer_name

    def __repr__(self) -> str:
        return f"SharedLayerDesc(key={self.layer_name!r}, {super().__repr__()})"


def _callable_name(fn: Any) -> str:
    if isinstance(fn, functools.partial):
        return _callable_name(fn.func)
    return getattr(fn, "__name__", type(fn).__name__)


def entry_name(entry: Any) -> str:
    """The name a ``layers=`` entry is logged and checked under."""
    if isinstance(entry, LayerDesc):
        return entry.name
    if isinstance(entry, nnx.Module):
        return type(entry).__name__
    return _callable_name(entry)


def takes_rngs(fn: Any) -> bool:
    """Whether ``fn`` (a layer class or factory) takes ``rngs=`` (or ``**kwargs``)."""
    if isinstance(fn, type) and fn.__init__ is object.__init__:  # a layer without __init__
        return False
    # an nnx.Module class's own signature is its metaclass's (*args, **kwargs): read __init__
    target = fn.__init__ if isinstance(fn, type) else fn
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return True
    return "rngs" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def build_entry(entry: Any, rngs: nnx.Rngs, shared: dict) -> tuple[Any, Any, str | None]:
    """``(layer, func, key)``: the built layer (or None), its function and its tied-layer key.

    The first :class:`SharedLayerDesc` of a key builds the layer; later ones of the same
    class reuse it; one of another class (Paddle's LM head next to the embedding) builds its
    own layer whose ``shared_weight_attr`` is the first one's parameter (one shape).
    """
    if isinstance(entry, SharedLayerDesc):
        entries = shared.setdefault(entry.key, [])
        same = [e for e in entries if e[0].layer_func is entry.layer_func]
        if same:
            _, name, layer = same[0]
            return layer, entry.forward_func, name
        layer = entry.build_layer(rngs)
        _check_shared_attr(entry, layer)
        name = str(entry.key) if not entries else f"{entry.key}:{entry.name}"
        if entries:
            first, _, first_layer = entries[0]
            tied = getattr(first_layer, first.shared_weight_attr)
            own, want = getattr(layer, entry.shared_weight_attr)[...], tied[...]
            if own.shape != want.shape or own.dtype != want.dtype:
                raise ValueError(
                    f"SharedLayerDesc key {entry.key!r}: {entry.name}.{entry.shared_weight_attr} "
                    f"is {own.dtype}{list(own.shape)} but {first.name}."
                    f"{first.shared_weight_attr} is {want.dtype}{list(want.shape)}; a "
                    "tied weight has one shape: build both layers with the same sizes (the LM "
                    "head's weight as the embedding's [vocab, hidden])."
                )
            setattr(layer, entry.shared_weight_attr, tied)
        entries.append((entry, name, layer))
        return layer, entry.forward_func, name
    if isinstance(entry, LayerDesc):
        return entry.build_layer(rngs), None, None
    if isinstance(entry, nnx.Module):
        return entry, None, None
    return None, entry, None


def _check_shared_attr(entry: SharedLayerDesc, layer: Any) -> None:
    if not hasattr(layer, entry.shared_weight_attr):
        params = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(layer))]
        raise ValueError(
            f"SharedLayerDesc key {entry.key!r}: {entry.name} has no attribute "
            f"shared_weight_attr={entry.shared_weight_attr!r}; its parameters: {params}."
        )


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        same = a == b
    except Exception:  # arrays and other objects without a plain ==
        return False
    return same if isinstance(same, bool | np.bool_) else False

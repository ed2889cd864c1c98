"""Recompute (activation checkpointing) of named sub-modules with ``nnx.remat``.

Paddle's ``recompute_configs['checkpoints']`` names the layers whose activations
are recomputed in the backward pass instead of kept. jfleet takes module paths
(``"blocks.0"``, ``"blocks.*.mlp"``, shell-style wildcards) or class names
(``"DecoderBlock"``) and runs each matching module's ``__call__`` under
``jax.checkpoint``.

Example:
  >>> from flax import nnx
  >>> class Net(nnx.Module):
  ...     def __init__(self):
  ...         self.hidden = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
  ...     def __call__(self, x):
  ...         return self.hidden(x)
  >>> net = apply_recompute(Net(), ["hidden"])
  >>> type(net.hidden).__name__
  'Linear'
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dot_with_no_batch_dims": None,  # built on demand (needs memory kinds)
}
_REMAT_CLASSES: dict[tuple, type] = {}  # one subclass per (class, setting)


def module_paths(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """Every sub-module with its dotted path (``""`` for the model itself)."""
    out = []
    for path, module in nnx.iter_modules(model):
        out.append((".".join(str(p) for p in path), module))
    return out


def apply_recompute(
    model: nnx.Module,
    checkpoints: Sequence[str],
    *,
    enable_offload: bool = False,
) -> nnx.Module:
    """Runs the named sub-modules under ``jax.checkpoint``; returns ``model`` (changed in place).

    Args:
      model: the NNX model.
      checkpoints: module paths (wildcards allowed) or class names.
      enable_offload: save the matmul results to host memory instead of
        recomputing them (``jax.checkpoint`` offload policy; needs a platform
        with pinned host memory — GPU or TPU).

    Raises:
      ValueError: a name that matches no sub-module (the message lists the paths
        and classes that exist), no names, or offload on a platform without
        host memory kinds.
    """
    if isinstance(checkpoints, str) or not all(isinstance(c, str) for c in checkpoints):
        raise TypeError(
            f"recompute checkpoints={checkpoints!r} must be a list of module paths or class "
            "names (str)."
        )
    if not checkpoints:
        raise ValueError(
            "strategy.recompute=True needs recompute_configs={'checkpoints': [...]} naming the "
            "sub-modules to recompute (paths such as 'blocks.0' or class names)."
        )
    policy = "offload_dot_with_no_batch_dims" if enable_offload else None
    if enable_offload:
        _offload_policy()  # refuse before changing any module
    modules = [(p, m) for p, m in module_paths(model) if p]
    chosen: dict[int, nnx.Module] = {}
    for name in checkpoints:
        hits = [m for p, m in modules if fnmatch.fnmatchcase(p, name) or _class_name(m) == name]
        if not hits:
            classes = sorted({_class_name(m) for _, m in modules})
            raise ValueError(
                f"recompute checkpoint {name!r} matches no sub-module. Paths: "
                f"{[p for p, _ in modules][:20]}; classes: {classes}."
            )
        for m in hits:
            chosen[id(m)] = m
    for m in chosen.values():
        _remat_module(m, policy)
    return model


def _class_name(module: nnx.Module) -> str:
    return getattr(type(module), "_jfleet_original", type(module)).__name__


def _remat_module(module: nnx.Module, policy: str | None) -> None:
    if is_recomputed(module):
        return  # recomputing twice would only cost time
    module.__class__ = remat_class(type(module), policy=policy)


def remat_class(
    cls: type,
    *,
    policy: str | None = None,
    after: Callable[[Any], Any] | None = None,
    recompute: bool = True,
    tag: str | None = None,
) -> type:
    """The subclass of ``cls`` whose ``__call__`` runs the original under ``nnx.remat``.

    The one class swap behind :func:`apply_recompute` and ``to_distributed``'s block
    wrapping: assign it to a module's ``__class__`` and the module keeps its parameters,
    paths and ``__init__``. Only arrays (and NNX modules / variables) of the call's
    arguments cross the remat boundary; everything else (``deterministic=True``, a
    string) stays a Python value, so flags keep steering control flow. One subclass is
    made per setting and cached.

    Args:
      cls: the module class.
      policy: the name of a ``jax.checkpoint`` saving policy (``"dots_saveable"``,
        ``"nothing_saveable"``, ``"dots_with_no_batch_dims_saveable"``,
        ``"offload_dot_with_no_batch_dims"``), or None to recompute everything.
      after: applied to the call's output (a sharding constraint, say); a hashable
        callable, as it is part of the cache key.
      recompute: False gives a subclass that only applies ``after``.
      tag: the subclass's ``__qualname__`` becomes ``f"{cls.__qualname__}[{tag}]"``
        (default: ``cls.__qualname__``); its ``__name__`` is always ``cls.__name__``.

    Returns:
      The cached subclass; :func:`is_recomputed` is True for its instances when
      ``recompute``.

    Raises:
      ValueError: an unknown policy name, or the offload policy on a platform without
        pinned host memory.
      TypeError: ``cls`` is not an ``nnx.Module`` subclass.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> layer.__class__ = remat_class(nnx.Linear)
      >>> is_recomputed(layer), type(layer).__name__, remat_class(nnx.Linear) is type(layer)
      (True, 'Linear', True)
      >>> graphdef, state = nnx.split(layer)
      >>> run = lambda state, x: nnx.merge(graphdef, state)(x)
      >>> "remat" in str(jax.make_jaxpr(run)(state, jnp.ones((1, 2))))
      True
    """
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise TypeError(f"remat_class(cls={cls!r}): cls must be an nnx.Module subclass.")
    if policy is not None and policy not in _POLICIES:
        raise ValueError(
            f"policy={policy!r} is not a checkpoint policy; use None or one of {list(_POLICIES)}."
        )
    key = (cls, policy, after, bool(recompute), tag)
    sub = _REMAT_CLASSES.get(key)
    if sub is None:
        sub = _make_remat_class(cls, _policy(policy), after, bool(recompute), tag)
        _REMAT_CLASSES[key] = sub
    return sub


def _is_dynamic(leaf: Any) -> bool:
    """Whether an argument leaf crosses the remat boundary (arrays and NNX graph nodes)."""
    return isinstance(leaf, jax.Array | np.ndarray | nnx.Module | nnx.Variable)


def _make_remat_class(
    cls: type, policy: Any, after: Callable[[Any], Any] | None, recompute: bool, tag: str | None
) -> type:
    original = cls.__call__

    def remat_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_dynamic)
        dynamic = [leaf for leaf in leaves if _is_dynamic(leaf)]

        def inner(module: Any, dynamic: list) -> Any:
            it = iter(dynamic)
            merged = [next(it) if _is_dynamic(leaf) else leaf for leaf in leaves]
            a, kw = jax.tree.unflatten(treedef, merged)
            return original(module, *a, **kw)

        return nnx.remat(inner, policy=policy)(self, dynamic)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        y = remat_call(self, *args, **kwargs) if recompute else original(self, *args, **kwargs)
        return y if after is None else after(y)

    sub = type(
        cls.__name__,
        (cls,),
        {"__call__": __call__, "_jfleet_original": cls, "_jfleet_recompute": recompute},
    )
    sub.__qualname__ = f"{cls.__qualname__}[{tag}]" if tag else cls.__qualname__
    sub.__module__ = cls.__module__
    return sub


def is_recomputed(module: nnx.Module) -> bool:
    """Whether the module runs under ``jax.checkpoint`` (:func:`apply_recompute`, a remat class)."""
    return bool(getattr(type(module), "_jfleet_recompute", False))


def _policy(name: str | None) -> Any:
    if name == "offload_dot_with_no_batch_dims":
        return _offload_policy()
    return None if name is None else _POLICIES[name]


def _offload_policy():
    kinds = {
        kind
        for device in jax.local_devices()
        for kind in getattr(device, "addressable_memories", lambda: [])()
        for kind in [getattr(kind, "kind", None)]
    }
    if "pinned_host" not in kinds:
        raise ValueError(
            "recompute_configs['enable_offload']=True needs pinned host memory, which the "
            f"{jax.default_backend()} backend does not offer; set enable_offload=False."
        )
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")

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
from collections.abc import Sequence

import jax
from flax import nnx

_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dot_with_no_batch_dims": None,  # built on demand (needs memory kinds)
}
_REMAT_CLASSES: dict[tuple[type, str | None], type] = {}


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
    policy = _offload_policy() if enable_offload else None
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
        _remat_module(m, policy, "offload" if enable_offload else None)
    return model


def _class_name(module: nnx.Module) -> str:
    return getattr(type(module), "_jfleet_original", type(module)).__name__


def _remat_module(module: nnx.Module, policy, policy_name: str | None) -> None:
    cls = type(module)
    if getattr(cls, "_jfleet_original", None) is not None:
        return
    key = (cls, policy_name)
    remat_cls = _REMAT_CLASSES.get(key)
    if remat_cls is None:
        original_call = cls.__call__

        def __call__(self, *args, **kwargs):  # noqa: N807
            return nnx.remat(lambda m, *a, **k: original_call(m, *a, **k), policy=policy)(
                self, *args, **kwargs
            )

        remat_cls = type(cls.__name__, (cls,), {"__call__": __call__, "_jfleet_original": cls})
        remat_cls.__qualname__ = cls.__qualname__
        remat_cls.__module__ = cls.__module__
        _REMAT_CLASSES[key] = remat_cls
    module.__class__ = remat_cls


def is_recomputed(module: nnx.Module) -> bool:
    """Whether :func:`apply_recompute` put this module under ``jax.checkpoint``."""
    return getattr(type(module), "_jfleet_original", None) is not None


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

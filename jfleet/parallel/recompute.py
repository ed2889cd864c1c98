"""Recompute (activation checkpointing) of named sub-modules with ``nnx.remat``.

Paddle's ``recompute_configs['checkpoints']`` names the layers whose activations
are recomputed in the backward pass instead of kept. jfleet takes module paths
(``"blocks.0"``, ``"blocks.*.mlp"``, shell-style wildcards) or class names
(``"DecoderBlock"``) and runs each matching module's ``__call__`` under
``jax.checkpoint``.

Where recompute saves memory: ``jax.checkpoint`` marks the recomputation with
``optimization_barrier``s. XLA:GPU keeps them until it has scheduled the program
(``OptimizationBarrierExpander`` runs after scheduling), so each block is recomputed when
the backward pass reaches it. XLA:CPU removes them before layout assignment and
scheduling (after CSE, so the recomputation is not merged back), and its scheduler then
runs every block's recomputation next to the forward pass: the step computes the extra
forward and keeps as much as without recompute (TinyLlama width 128, batch 32 x 128, dp8:
temp 43.4 -> 41.4 MiB for +25% matmul FLOPs). Inside a loop the recomputation cannot move
out of the iteration that needs it, so recompute of blocks run by ``lax.scan``
(``to_distributed``'s scanned and pipelined blocks) saves on CPU too.

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

Paddle's functional forms run one call under ``nnx.remat`` instead:
:func:`recompute` (``fleet.utils.recompute``), :func:`recompute_sequential` and
:func:`recompute_hybrid`.
"""

from __future__ import annotations

import contextvars
import fnmatch
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jfleet.runtime.log import logger

_POLICIES = {
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dot_with_no_batch_dims": None,  # built on demand (needs memory kinds)
}
#: The saving policy of selective recompute (Megatron's ``selective``, Paddle's
#: ``core_attn``): a block keeps its weight-matmul outputs and recomputes its attention core
#: (the matmuls with batch dimensions) and its elementwise work. Scanned, wrapped and
#: pipelined blocks all run it (:func:`selective_policy`).
SELECTIVE_POLICY = "dots_with_no_batch_dims_saveable"
_REMAT_CLASSES: dict[tuple, type] = {}  # one subclass per (class, setting)
_IN_RECOMPUTE = contextvars.ContextVar("jfleet_in_recompute", default=False)
_LOGGED: set[str] = set()


def module_paths(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    """Every sub-module with each dotted path it is reachable under (``""``: the model).

    A module held under two attributes (an alias, a tied layer) is listed once per
    path, so a checkpoint name matches either.

    Example:
      >>> from flax import nnx
      >>> class Tied(nnx.Module):
      ...     def __init__(self):
      ...         self.embed = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      ...         self.head = self.embed
      >>> [p for p, _ in module_paths(Tied())]
      ['', 'embed', 'head']
    """
    return [(".".join(str(p) for p in path), m) for path, m in _walk(model, (), ())]


def _walk(node: Any, path: tuple, stack: tuple) -> Iterator[tuple[tuple, nnx.Module]]:
    if isinstance(node, nnx.Module):
        yield path, node
    stack = (*stack, id(node))
    for key, child in nnx.iter_children(node):
        if isinstance(child, nnx.Variable) or not nnx.graph.is_graph_node(child):
            continue
        if id(child) not in stack:  # a reference back up the tree is not a new path
            yield from _walk(child, (*path, key), stack)


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


def _remat_run(fn: Callable[..., Any], module: Any, args: tuple, kwargs: dict, policy: Any) -> Any:
    """``fn(module, *args, **kwargs)`` (``fn(*args, **kwargs)`` if ``module`` is None) under
    ``nnx.remat``: the one remat call behind the class swap and :func:`recompute`."""
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=_is_dynamic)
    dynamic = [leaf for leaf in leaves if _is_dynamic(leaf)]

    def inner(module: Any, dynamic: list) -> Any:
        it = iter(dynamic)
        merged = [next(it) if _is_dynamic(leaf) else leaf for leaf in leaves]
        a, kw = jax.tree.unflatten(treedef, merged)
        token = _IN_RECOMPUTE.set(True)
        try:
            return fn(*a, **kw) if module is None else fn(module, *a, **kw)
        finally:
            _IN_RECOMPUTE.reset(token)

    return nnx.remat(inner, policy=policy)(module, dynamic)


def _make_remat_class(
    cls: type, policy: Any, after: Callable[[Any], Any] | None, recompute: bool, tag: str | None
) -> type:
    original = cls.__call__

    def remat_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _remat_run(original, self, args, kwargs, policy)

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


def selective_policy() -> Callable[..., bool]:
    """The ``jax.checkpoint`` policy of selective recompute (:data:`SELECTIVE_POLICY`).

    Example:
      >>> selective_policy() is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
      True
    """
    return _POLICIES[SELECTIVE_POLICY]


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


# ----------------------------------------------------------- Paddle's functional forms
_PADDLE_NOOPS = {
    "preserve_rng_state": "JAX recomputes from the same explicit keys (nnx.Rngs counters are "
    "inputs of the checkpointed call), so the forward randomness is always replayed",
    "use_reentrant": "it picks one of Paddle's two autograd implementations; jax.checkpoint "
    "has one",
    "offload_indices": "inputs are not offloaded one by one; use recompute_configs="
    "{'enable_offload': True} (a jax.checkpoint offload policy)",
}


def _log_ignored(name: str, value: Any) -> None:
    if name not in _LOGGED:
        _LOGGED.add(name)
        why = _PADDLE_NOOPS[name]
        logger.info("recompute(%s=%r) has no effect under JAX: %s", name, value, why)


def _check_bool(what: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what}={value!r} ({type(value).__name__}) must be True or False.")
    return value


def recompute(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Paddle's ``fleet.utils.recompute``: ``function(*args, **kwargs)`` under ``nnx.remat``.

    The activations inside ``function`` are not kept for the backward pass; they are
    recomputed from its inputs (``jax.checkpoint``). ``function`` is an ``nnx.Module``
    (its parameters and RNG streams cross the boundary as module state, so dropout
    masks are replayed exactly) or any callable. A closure may read modules it captures;
    a module whose state changes during the call (dropout RNG counters, batch
    statistics) must be ``function`` itself or an argument, as NNX state may only
    change in the transform that owns it. Array and NNX arguments are traced; other
    arguments (flags, strings) stay Python values.

    Paddle's own keywords are taken out of ``kwargs`` and accepted:
    ``preserve_rng_state`` (JAX always replays the same keys, so True is what happens
    anyway), ``use_reentrant`` (Paddle's choice of autograd mechanism) and
    ``offload_indices`` (use ``recompute_configs['enable_offload']``) have no effect
    under JAX; the first non-default use of each is logged once at INFO. All other
    keyword arguments go to ``function``.

    Args:
      function: the module or callable to run.
      *args: its positional arguments.
      **kwargs: its keyword arguments, plus Paddle's keywords above.

    Returns:
      ``function(*args, **kwargs)``.

    Raises:
      TypeError: ``function`` is not callable; ``preserve_rng_state`` or
        ``use_reentrant`` is not a bool; ``offload_indices`` is not a list of ints.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> graphdef, state = nnx.split(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
      >>> loss = lambda state, x: jnp.sum(recompute(nnx.merge(graphdef, state), x))
      >>> "remat" in str(jax.make_jaxpr(jax.grad(loss))(state, jnp.ones((1, 2))))
      True
    """
    if not callable(function):
        raise TypeError(
            f"recompute(function={function!r}): {type(function).__name__} is not callable; "
            "pass a module (e.g. a decoder layer) or a function."
        )
    preserve = _check_bool("preserve_rng_state", kwargs.pop("preserve_rng_state", True))
    reentrant = _check_bool("use_reentrant", kwargs.pop("use_reentrant", True))
    offload = kwargs.pop("offload_indices", None)
    if offload is not None and (
        not isinstance(offload, list | tuple)
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in offload)
    ):
        raise TypeError(
            f"offload_indices={offload!r} must be a list of argument indices (int), or None."
        )
    if not preserve:
        _log_ignored("preserve_rng_state", preserve)
    if not reentrant:
        _log_ignored("use_reentrant", reentrant)
    if offload:
        _log_ignored("offload_indices", offload)
    if isinstance(function, nnx.Module):
        call = getattr(type(function), "_jfleet_original", type(function)).__call__
        return _remat_run(call, function, args, kwargs, None)
    return _remat_run(function, None, args, kwargs, None)


def is_in_recompute() -> bool:
    """Whether the caller is being traced inside :func:`recompute` (or a remat class call).

    Example:
      >>> is_in_recompute()
      False
    """
    return _IN_RECOMPUTE.get()


_SEQUENTIAL_KEYS = ("segments", "preserve_rng_state")
_HYBRID_KEYS = ("mp_group", "offload", "partition")


def _check_ctx(what: str, ctx: Any, keys: tuple[str, ...]) -> dict:
    if not isinstance(ctx, dict):
        raise TypeError(
            f"{what}(ctx={ctx!r}): ctx must be a dict with keys from {list(keys)}, "
            f"e.g. {{'{keys[0]}': ...}}."
        )
    unknown = sorted(set(ctx) - set(keys))
    if unknown:
        raise ValueError(f"{what}: ctx keys {unknown} are unknown; valid keys: {list(keys)}.")
    return ctx


def recompute_sequential(
    ctx: dict[str, Any], functions: Sequence[Callable[..., Any]] | nnx.Module, *args: Any, **kwargs
) -> Any:
    """Paddle's ``recompute_sequential``: a chain of layers in segments, each recomputed.

    ``functions`` (a list of callables, an ``nnx.Sequential`` or an ``nnx.List``) is cut
    into ``ctx['segments']`` segments of ``len // segments`` layers; every segment but
    the last runs under :func:`recompute`, the last one (with the remainder) runs
    normally, as in Paddle (so ``segments=1`` recomputes nothing). The first layer takes
    ``*args`` / ``**kwargs``, each later one the previous output.

    Args:
      ctx: ``{'segments': int >= 1 (default 1), 'preserve_rng_state': bool}``.
      functions: the layers, in order.

    Raises:
      TypeError: ``ctx`` not a dict, ``functions`` not a sequence of callables.
      ValueError: an unknown ``ctx`` key, or ``segments`` not an int in
        ``[1, len(functions)]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layers = [nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(4)]
      >>> recompute_sequential({"segments": 2}, layers, jnp.ones((1, 2))).shape
      (1, 2)
    """
    ctx = _check_ctx("recompute_sequential", ctx, _SEQUENTIAL_KEYS)
    if isinstance(functions, nnx.Sequential):
        functions = list(functions.layers)
    if (
        isinstance(functions, str)
        or not isinstance(functions, Sequence | nnx.List)
        or not all(callable(f) for f in functions)
    ):
        raise TypeError(
            f"recompute_sequential(functions={functions!r}): expected a list of layers "
            "(callables), an nnx.Sequential or an nnx.List."
        )
    functions = list(functions)
    segments = ctx.get("segments", 1)
    if (
        isinstance(segments, bool)
        or not isinstance(segments, int)
        or not (1 <= segments <= max(len(functions), 1))
    ):
        raise ValueError(
            f"recompute_sequential: ctx['segments']={segments!r} must be an int in "
            f"[1, {len(functions)}] (the number of layers)."
        )
    preserve = ctx.get("preserve_rng_state", True)
    size = len(functions) // segments

    def run(chunk: list, *a: Any, **kw: Any) -> Any:
        out = chunk[0](*a, **kw)
        for f in chunk[1:]:
            out = f(out)
        return out

    for start in range(0, size * (segments - 1), size):
        out = recompute(
            run, functions[start : start + size], *args, preserve_rng_state=preserve, **kwargs
        )
        args, kwargs = (out,), {}
    rest = functions[size * (segments - 1) :]
    return run(rest, *args, **kwargs) if rest else args[0]


def recompute_hybrid(ctx: dict[str, Any], function: Callable[..., Any], *args: Any, **kwargs):
    """Paddle's ``recompute_hybrid`` (recompute under tensor parallelism): :func:`recompute`.

    ``ctx`` takes Paddle's keys: ``mp_group`` (the compiler knows every array's layout,
    so no group is needed), ``offload`` and ``partition`` (Paddle splits the kept inputs
    over mp ranks; an SPMD input keeps the layout it has) are accepted without effect.

    Raises:
      TypeError / ValueError: ``ctx`` not a dict, or an unknown key.

    Example:
      >>> import jax.numpy as jnp
      >>> recompute_hybrid({"partition": False}, jnp.tanh, jnp.zeros(2)).tolist()
      [0.0, 0.0]
    """
    _check_ctx("recompute_hybrid", ctx, _HYBRID_KEYS)
    return recompute(function, *args, **kwargs)

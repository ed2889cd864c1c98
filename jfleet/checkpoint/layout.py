"""The one logical layout on disk: every leaf under the model's own per-layer path.

A running model may hold its layers stacked for a pipeline (``to_distributed``'s
:class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks`: ``layers.body.mlp.up_proj.kernel``
of shape ``[pp, L/pp, ...]``; :class:`~jfleet.parallel.pipeline_layer.PipelineLayer`'s
``body`` with its ``pre`` / ``post`` layers) or be wrapped in a
:class:`~jfleet.distributed_model.DistributedModel` (``module.`` prefix). On disk each leaf
is stored under the path of the plain model, one leaf per layer
(``layers.3.mlp.up_proj.kernel``), whatever the mesh, ZeRO stage or pipeline (the padded
slots of uneven stages are not saved, and are refilled on restore): a
``PipelineLayer``'s layers are ``layers.<i>`` in its layer list. Optimizer state mirrors
the parameters (``opt_state.0.mu.<param path>``) and is mapped the same way.

:func:`logical_leaves` maps a running object's state to ``{logical path: leaf}`` (arrays
on save, ``jax.ShapeDtypeStruct`` targets with their shardings on restore);
:func:`running_values` assembles restored logical arrays back into the running layout
(stacking per-layer arrays device-side into the running sharding).

Example:
  >>> from flax import nnx
  >>> from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
  >>> model = PipelineLayer([LayerDesc(nnx.Linear, 2, 2)] * 4, num_stages=2)
  >>> sorted(logical_leaves(model, model))[:2]
  ['layers.0.bias', 'layers.0.kernel']
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.apply.blocks import PipelinedBlocks
from jfleet.auto_parallel.apply.scanned_blocks import ScannedBlocks
from jfleet.mesh.create import stage_sharding
from jfleet.mesh.topology import PP
from jfleet.parallel.pipeline_layer import PipelineLayer
from jfleet.parallel.virtual_stages import layer_of, slot_units
from jfleet.training.distributed_model import DistributedModel

__all__ = ["logical_leaves", "logical_params", "running_values", "state_leaves"]

Path = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Stack:
    """A stacked body at ``at`` whose unit ``(s, k)`` holds layers ``first + u*p + i``, ``u``
    the unit's layer (``s*K + k``; interleaved over ``virtual`` chunks per stage:
    :func:`~jfleet.parallel.virtual_stages.layer_of`)."""

    at: Path
    to: Path
    first: int
    period: int
    virtual: int = 1
    sizes: tuple[int, ...] | None = None  # units per chunk (uneven stages: padded slots)


@dataclasses.dataclass(frozen=True)
class _Rename:
    """Leaves under ``at`` live under ``to`` on disk."""

    at: Path
    to: Path


def _rules(model: nnx.Module) -> list[_Stack | _Rename]:
    """How the model's running paths map to logical ones (paths relative to the model)."""
    rules: list[_Stack | _Rename] = []
    for path, node in nnx.iter_graph(model):
        path = tuple(path)
        if isinstance(node, PipelinedBlocks | ScannedBlocks):
            virtual = getattr(node, "num_virtual_stages", 1)  # ScannedBlocks: 1
            sizes = getattr(node, "chunk_sizes", None)
            rules.append(_Stack((*path, "body"), path, 0, node.period, virtual, sizes))
        elif isinstance(node, PipelineLayer):
            if node.body is None:
                raise NotImplementedError(
                    f"{'.'.join(map(str, path)) or 'the model'} is a PipelineLayer with stages "
                    "of different layers (flat per-stage buffers): checkpoints cannot map "
                    "those to per-layer leaves yet; build it with identical body layers "
                    "(a stacked body) to checkpoint it."
                )
            start, end = node.body_range
            rules.append(
                _Stack((*path, "body"), (*path, "layers"), start, 1, node.v, node.chunk_sizes)
            )
            for i in range(len(node.pre)):
                rules.append(_Rename((*path, "pre", i, "layer"), (*path, "layers", i)))
            for j in range(len(node.post)):
                rules.append(_Rename((*path, "post", j, "layer"), (*path, "layers", end + j)))
    return rules


def _rule_for(rules: list, path: Path) -> tuple[Any, Path] | None:
    for rule in rules:
        if path[: len(rule.at)] == rule.at:
            return rule, path[len(rule.at) :]
    return None


def state_leaves(obj: nnx.Module) -> dict[Path, nnx.Variable]:
    """The checkpointed variables of ``obj`` by path: every array variable but RNG state.

    Placeholders without data (optax's ``MaskedNode`` of parameters a transform skips)
    are left out.
    """
    state = nnx.state(obj, nnx.Not(nnx.RngState))
    return {
        tuple(p): v
        for p, v in nnx.to_flat_state(state)
        if hasattr(v.get_value(), "shape") and hasattr(v.get_value(), "dtype")
    }


def _inner(model: nnx.Module) -> tuple[nnx.Module, Path]:
    if isinstance(model, DistributedModel):
        return model.module, ("module",)
    return model, ()


def _split(path: Path, model_paths: set[Path], wrapper: Path) -> tuple[Path, Path]:
    """``(prefix, model path)``: the longest suffix of ``path`` that is a model path."""
    for n in range(len(path), 0, -1):
        if path[-n:] in model_paths:
            prefix = path[:-n]
            if wrapper and prefix[-len(wrapper) :] == wrapper:
                prefix = prefix[: -len(wrapper)]
            return prefix, path[-n:]
    return path, ()


def _key(path: Path) -> str:
    return ".".join(str(k) for k in path)


def _per_layer_sharding(sharding: Any, ndim: int, stage: int | None = None) -> Any:
    """One layer's sharding in a ``[P, K, ...]`` stack's; with ``stage``, when ``pp`` splits
    the stack, on that pipeline stage's devices only (the layer lives there alone)."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        if stage is not None and spec[0] == PP:
            sharding = stage_sharding(NamedSharding(sharding.mesh, P(*spec)), 0, stage)
            return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[2:]))
        return NamedSharding(sharding.mesh, P(*spec[2:]))
    return sharding


def _expand(
    rules: list, prefix: Path, mpath: Path, leaf: Any, abstract: bool
) -> list[tuple[str, Any, bool]]:
    """``[(logical key, leaf, padded)]`` of one running leaf; a padded slot of an uneven
    stack (not saved) names the real unit whose value fills it on restore."""
    found = _rule_for(rules, mpath)
    if found is None:
        return [(_key(prefix + mpath), leaf, False)]
    rule, rest = found
    if isinstance(rule, _Rename):
        return [(_key(prefix + rule.to + rest), leaf, False)]
    period, inner = rule.period, rest
    subs = [None]
    if period > 1:  # a SuperBlock: body.layers.<i>.<rest>
        subs, inner = [rest[1]], rest[2:]
    stages, per_stage = leaf.shape[0], leaf.shape[1]
    sharding = _per_layer_sharding(leaf.sharding, leaf.ndim)
    units = [(s, k) for s in range(stages) for k in range(per_stage)]
    if abstract:  # a pipeline stage's layers are read onto that stage's devices only
        parts = [
            jax.ShapeDtypeStruct(
                leaf.shape[2:],
                leaf.dtype,
                sharding=_per_layer_sharding(leaf.sharding, leaf.ndim, s),
            )
            for s, _ in units
        ]
    else:
        parts = _settled(_unstack(len(units), sharding)(_settled(leaf)))
    table = _filled_table(rule.sizes, stages) if rule.sizes else None
    out = []
    for (s, k), part in zip(units, parts, strict=True):
        for i in subs:
            if table is None:
                unit, padded = layer_of(s, k, stages, rule.virtual, per_stage), False
            else:
                unit, padded = table[s][k]
            index = rule.first + unit * period + (i or 0)
            out.append((_key(prefix + rule.to + (index,) + inner), part, padded))
    return out


@functools.lru_cache(maxsize=64)
def _filled_table(sizes: tuple[int, ...], stages: int) -> tuple:
    """Per slot of an uneven stack, ``(unit, padded)``: a padded slot names its row's
    nearest real unit (what :func:`~jfleet.parallel.stack.stack_layers` copied there)."""
    rows = []
    for row in slot_units(sizes, stages).tolist():
        real = [u for u in row if u >= 0]
        last, out = real[0], []
        for u in row:
            last = u if u >= 0 else last
            out.append((last, u < 0))
        rows.append(tuple(out))
    return tuple(rows)


def logical_leaves(model: nnx.Module, obj: nnx.Module, *, abstract: bool = False) -> dict:
    """``{logical path: leaf}`` of ``obj`` (the model itself or its optimizer).

    With ``abstract`` the leaves are ``jax.ShapeDtypeStruct`` s carrying the sharding each
    logical leaf gets on the running mesh (what Orbax restores into).
    """
    return {k: v for k, v, _ in _entries(model, obj, abstract)}


def logical_params(model: nnx.Module) -> dict[str, jax.ShapeDtypeStruct]:
    """``{logical path: shape}`` of ``model``'s ``nnx.Param`` s, each in the sharding it gets
    on the running mesh (what a checkpoint is read into)."""
    params = {p for p, v in state_leaves(model).items() if isinstance(v, nnx.Param)}
    return {k: leaf for k, leaf, p in _entries(model, model, True) if p in params}


def _entries(
    model: nnx.Module, obj: nnx.Module, abstract: bool, padding: bool = False
) -> list[tuple[str, Any, Path]]:
    inner, wrapper = _inner(model)
    rules = _rules(inner)
    shapes = {p: v.get_value().shape for p, v in state_leaves(inner).items()}
    out = []
    for path, var in state_leaves(obj).items():
        value = var.get_value()
        if abstract:
            value = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)
        prefix, mpath = _split(path, set(shapes), wrapper)
        if mpath and shapes[mpath] != value.shape:  # not parameter-shaped: no per-layer split
            prefix, mpath = path, ()
        for key, leaf, padded in _expand(rules, prefix, mpath, value, abstract):
            if padding or not padded:  # padded slots are not saved, only refilled
                out.append((key, leaf, path))
    return out


def running_values(model: nnx.Module, obj: nnx.Module, restored: dict) -> None:
    """Writes restored logical arrays into ``obj``'s variables in place (stacking as needed);
    a variable whose logical arrays ``restored`` lacks keeps its value."""
    groups: dict[Path, list[str]] = {}
    for key, _, path in _entries(model, obj, abstract=True, padding=True):
        groups.setdefault(path, []).append(key)
    for path, var in state_leaves(obj).items():
        keys = groups[path]
        if any(k not in restored for k in keys):
            continue  # not read (not in the checkpoint): the running value stays
        old = var.get_value()
        if len(keys) == 1 and restored[keys[0]].shape == old.shape:
            var.set_value(restored[keys[0]])
            continue
        parts = _settled([restored[k] for k in keys])
        if _split_by_stage(old.sharding):
            var.set_value(_stacked_by_device(old.shape, old.sharding, parts))
        else:
            var.set_value(_settled(_stack(old.shape, old.sharding)(*parts)))


def _split_by_stage(sharding: Any) -> bool:
    return isinstance(sharding, NamedSharding) and len(sharding.spec) > 0 and sharding.spec[0] == PP


def _stacked_by_device(shape: tuple, sharding: NamedSharding, parts: list) -> jax.Array:
    """The ``[P, K, ...]`` stack of ``parts`` (P x K layers, each on its stage's devices):
    each device stacks its own shards of its stage's K layers; nothing moves between devices
    and no device holds another stage's layers."""
    per_stage = shape[1]
    local = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        stage = index[0].start or 0
        mine = [
            {s.device: s.data for s in part.addressable_shards}[device]
            for part in parts[stage * per_stage : (stage + 1) * per_stage]
        ]
        local.append(jnp.stack(mine)[None])
    return jax.make_array_from_single_device_arrays(shape, sharding, local)


def _settled(x: Any) -> Any:
    """``x`` once computed. The (un)stacking programs move data between devices with
    collectives; on XLA:CPU's emulated devices two such programs in flight at once (the
    training step still running, or the previous leaf's) can starve the shared thread pool
    and deadlock in a rendezvous, so each runs alone. Checkpointing is off the hot path."""
    return jax.block_until_ready(x)


@functools.lru_cache(maxsize=256)
def _unstack(count: int, sharding: Any) -> Any:
    """A jitted splitter of a ``[P, K, ...]`` array into its ``P*K`` units, each in ``sharding``."""

    def unstack(x: jax.Array) -> list[jax.Array]:
        flat = x.reshape((count, *x.shape[2:]))
        return [flat[u] for u in range(count)]

    return jax.jit(unstack, out_shardings=[sharding] * count)


@functools.lru_cache(maxsize=256)
def _stack(shape: tuple, sharding: Any) -> Any:
    """A jitted stacker of per-layer arrays into ``shape`` with the running ``sharding``."""

    def stack(*parts: jax.Array) -> jax.Array:
        return jnp.stack(parts).reshape(shape)

    return jax.jit(stack, out_shardings=sharding)


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}``: the nested tree Orbax stores (keys stay strings).

    Example:
      >>> nest({"a.b": 1, "a.c": 2})
      {'a': {'b': 1, 'c': 2}}
    """
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *heads, last = key.split(".")
        node = tree
        for head in heads:
            node = node.setdefault(head, {})
        node[last] = value
    return tree


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """The inverse of :func:`nest`: ``{"a": {"b": x}}`` -> ``{"a.b": x}``.

    Example:
      >>> flatten({"a": {"b": 1, "c": 2}})
      {'a.b': 1, 'a.c': 2}
    """
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}

"""Paddle's sharded state-dict API on Orbax: ``save_state_dict`` / ``load_state_dict``.

A state dict is ``{name: array}``: ``jax.Array`` s (sharded over any mesh, across
processes too), NumPy arrays, or ``nnx.Variable`` s (their values). Every process writes
the shards it holds (Orbax); one directory holds one state dict. Loading reads each array
straight into the sharding of the array already in the dict, so a dict whose arrays live
on another mesh or ``PartitionSpec`` than the saver's is resharded on read.

Paddle's ``model.state_dict()`` here: ``nnx.state(model)`` flattened
(``{".".join(map(str, path)): variable for path, variable in nnx.to_flat_state(...)}``,
whose ``nnx.Variable`` values :func:`load_state_dict` sets in place, so the model is
updated), or :func:`jfleet.checkpoint.layout.logical_leaves` for the one per-layer layout
of pipelines and wrapped models (what :func:`save_model` writes).

Example:
  >>> import tempfile, jax.numpy as jnp
  >>> path = tempfile.mkdtemp() + "/ckpt"
  >>> save_state_dict({"w": jnp.arange(4.0)}, path)
  >>> target = {"w": jnp.zeros(4)}
  >>> load_state_dict(target, path)
  >>> target["w"].tolist()
  [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jfleet.checkpoint import layout
from jfleet.runtime.log import logger

__all__ = ["load_model", "load_state_dict", "save_model", "save_state_dict", "saved_names"]


def _ignored(what: str, value: Any, why: str) -> None:
    logger.info("%s=%r is ignored: %s", what, value, why)


def _extras(process_group: Any, coordinator_rank: int, unique_id: Any) -> None:
    if process_group is not None:
        _ignored("process_group", process_group, "every process takes part (Orbax coordinates)")
    if coordinator_rank != 0:
        _ignored("coordinator_rank", coordinator_rank, "process 0 writes the metadata (Orbax)")
    if unique_id is not None:
        _ignored("unique_id", unique_id, "one directory holds one state dict (overwritten)")


def _value(key: str, value: Any, fn: str) -> Any:
    if isinstance(value, nnx.Variable):
        value = value.get_value()
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(
            f"{fn}: state_dict[{key!r}] is a {type(value).__name__}; expected a jax.Array, a "
            "NumPy array or an nnx.Variable holding one (drop other entries from the dict)."
        )
    return value


def _checked(state_dict: Any, fn: str) -> dict[str, Any]:
    if not isinstance(state_dict, dict):
        raise TypeError(
            f"{fn}(state_dict={type(state_dict).__name__}): expected a dict of name -> array "
            "(e.g. {'.'.join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))})."
        )
    names = set(state_dict)
    for key in state_dict:
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(
                f"{fn}: state_dict key {key!r} is not a usable name; expected a non-empty str "
                "without '/' (parts separated by '.')."
            )
        parts = key.split(".")
        for n in range(1, len(parts)):
            if ".".join(parts[:n]) in names:
                raise ValueError(
                    f"{fn}: state_dict keys {'.'.join(parts[:n])!r} and {key!r} clash (one is "
                    "a prefix of the other on disk); rename one."
                )
    return {key: _value(key, value, fn) for key, value in state_dict.items()}


def save_state_dict(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    process_group: Any = None,
    coordinator_rank: int = 0,
    unique_id: Any = None,
    async_save: bool = False,
) -> None:
    """Saves ``{name: array}`` into directory ``path`` (replaced if it exists), every shard once.

    Unlike Paddle: ``process_group`` / ``coordinator_rank`` / ``unique_id`` are ignored
    (logged; every process takes part, process 0 writes the metadata, ``path`` holds one
    state dict); ``async_save=True`` is written before returning (logged).

    Raises:
      TypeError: ``state_dict`` is not a dict, or a value is not an array.
      ValueError: a bad key, or ``path`` is an existing file.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> path = tempfile.mkdtemp() + "/sd"
      >>> save_state_dict({"w": jnp.arange(4.0)}, path)
      >>> target = {"w": jnp.zeros(4)}
      >>> load_state_dict(target, path)
      >>> target["w"].tolist()
      [0.0, 1.0, 2.0, 3.0]
    """
    arrays = _checked(state_dict, "save_state_dict")
    _extras(process_group, coordinator_rank, unique_id)
    if async_save:
        _ignored("async_save", async_save, "the state dict is written before returning")
    where = Path(path).absolute()
    if where.is_file():
        raise ValueError(f"save_state_dict(path={str(path)!r}) is a file; give a directory.")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(where, layout.nest(arrays), force=True)
        checkpointer.wait_until_finished()


def _stored(where: Path, fn: str) -> dict[str, Any]:
    if not where.is_dir():
        raise FileNotFoundError(
            f"{fn}: no state dict at {str(where)!r}; pass the directory save_state_dict, "
            "fleet.save or save_group_sharded_model wrote."
        )
    try:
        meta = ocp.StandardCheckpointer().metadata(where).item_metadata.tree
    except Exception as error:  # Orbax / tensorstore errors on damaged or foreign files
        raise ValueError(
            f"{fn}: {str(where)!r} could not be read as a state dict ({type(error).__name__}: "
            f"{error}); pass a directory save_state_dict wrote."
        ) from error
    return layout.flatten(dict(meta))


def saved_names(path: str | os.PathLike) -> list[str]:
    """The names in the state dict at ``path``, sorted.

    Raises:
      FileNotFoundError: no directory at ``path``. ValueError: not a state dict.
    """
    return sorted(_stored(Path(path).absolute(), "saved_names"))


def _read(where: Path, targets: dict[str, Any], fn: str) -> dict[str, Any]:
    """Reads ``targets``' keys from ``where`` into the targets' shapes, dtypes and shardings."""
    stored = _stored(where, fn)
    for key, want in targets.items():
        if key not in stored:
            raise ValueError(
                f"{fn}: {key!r} is not in the state dict at {str(where)!r} (it holds e.g. "
                f"{sorted(stored)[:4]}); load into a dict with the saved names."
            )
        if tuple(stored[key].shape) != tuple(want.shape):
            raise ValueError(
                f"{fn}: {key!r} has shape {tuple(stored[key].shape)} in {str(where)!r} but "
                f"{tuple(want.shape)} in the dict given; load into arrays shaped as saved."
            )
    abstract = {
        k: v
        if isinstance(v, np.ndarray)
        else jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
        for k, v in targets.items()
    }
    item = layout.nest(abstract)
    args = ocp.args.PyTreeRestore(
        item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
    )
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        return layout.flatten(checkpointer.restore(where, args=args))


def load_state_dict(
    state_dict: dict[str, Any],
    path: str | os.PathLike,
    process_group: Any = None,
    coordinator_rank: int = 0,
    unique_id: Any = None,
    offload: bool = False,
) -> None:
    """Loads the saved arrays named by ``state_dict``'s keys into it, in place.

    Each array is read in the shape, dtype and sharding of the one in the dict (resharded
    from the saver's mesh); the dict's entries are replaced (JAX arrays are immutable) and
    ``nnx.Variable`` values are set, so a model whose variables are in the dict is updated.
    Saved names the dict lacks are not read. ``process_group`` / ``coordinator_rank`` /
    ``unique_id`` / ``offload`` are ignored (logged).

    Raises:
      FileNotFoundError: no directory at ``path``.
      TypeError / ValueError: a bad ``state_dict``; a name not saved, or saved with another
        shape.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> path = tempfile.mkdtemp() + "/sd"
      >>> save_state_dict({"b": jnp.ones(2)}, path)
      >>> target = {"b": jnp.zeros(2)}
      >>> load_state_dict(target, path)
      >>> target["b"].tolist()
      [1.0, 1.0]
    """
    targets = _checked(state_dict, "load_state_dict")
    _extras(process_group, coordinator_rank, unique_id)
    if offload:
        _ignored("offload", offload, "arrays are read straight into their shardings")
    got = _read(Path(path).absolute(), targets, "load_state_dict")
    for key, value in got.items():
        if isinstance(state_dict[key], nnx.Variable):
            state_dict[key].set_value(value)
        else:
            state_dict[key] = value


def _param_keys(model: nnx.Module) -> set[str]:
    """The logical keys of ``model``'s ``nnx.Param`` s."""
    return set(layout.logical_params(model))


def _objects(
    model: nnx.Module, optimizer: Any, params_only: bool = False, *, abstract: bool = False
) -> dict[str, Any]:
    """``{"model.<logical path>": leaf}`` (and ``optimizer.``): arrays, or with ``abstract``
    shapes in their running layouts (:func:`~jfleet.checkpoint.layout.logical_leaves`)."""
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model={type(model).__name__}: expected the nnx.Module (or DistributedModel) to "
            "save or load; pass model=."
        )
    leaves = layout.logical_leaves(model, model, abstract=abstract)
    if params_only:
        keep = _param_keys(model)
        leaves = {k: v for k, v in leaves.items() if k in keep}
    out = {f"model.{k}": v for k, v in leaves.items()}
    if optimizer is not None:
        if getattr(optimizer, "is_bound", True) is False:  # a DistributedOptimizer before use
            optimizer.init(model)
        out.update(
            {
                f"optimizer.{k}": v
                for k, v in layout.logical_leaves(model, optimizer, abstract=abstract).items()
            }
        )
    return out


def save_model(
    path: str | os.PathLike,
    model: nnx.Module,
    optimizer: Any = None,
    *,
    params_only: bool = False,
    optimizer_path: str | os.PathLike | None = None,
) -> None:
    """Saves ``model`` (and ``optimizer``'s state) in the logical layout as a state dict.

    Keys are ``model.<logical path>`` (:mod:`jfleet.checkpoint.layout`: per layer, whatever
    the mesh, ZeRO stage or pipeline) and ``optimizer.<logical path>``; ``params_only``
    keeps the ``nnx.Param`` s alone (Paddle's dense parameters); ``optimizer_path`` puts
    the optimizer's keys in a directory of their own. RNG state is not saved.

    Example:
      >>> import tempfile
      >>> path = tempfile.mkdtemp() + "/m"
      >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
      >>> save_model(path, model)
      >>> fresh = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
      >>> load_model(path, fresh)
      >>> bool((fresh.kernel[...] == model.kernel[...]).all())
      True
    """
    arrays = _objects(model, optimizer, params_only)
    if optimizer_path is None or optimizer is None:
        save_state_dict(arrays, path)
        return
    save_state_dict({k: v for k, v in arrays.items() if k.startswith("model.")}, path)
    save_state_dict({k: v for k, v in arrays.items() if k.startswith("optimizer.")}, optimizer_path)


def load_model(
    path: str | os.PathLike,
    model: nnx.Module,
    optimizer: Any = None,
    *,
    optimizer_path: str | os.PathLike | None = None,
) -> None:
    """Loads what :func:`save_model` wrote into ``model`` (and ``optimizer``) in place.

    Arrays are read into the running objects' shardings (any mesh, ZeRO stage or pipeline
    layout). Model variables the directory lacks are kept when they are not ``nnx.Param``
    (a ``params_only`` save; logged).

    Raises:
      ValueError: a parameter (or, with ``optimizer``, its state) is not in the directory.
    """
    where = Path(path).absolute()
    opt_where = where if optimizer_path is None else Path(optimizer_path).absolute()
    stored = _stored(where, "load_model")
    # the targets: shapes and running layouts only (a pipeline's layer on its stage's devices)
    current = _objects(model, optimizer, abstract=True)
    loaded: dict[str, Any] = {}
    if optimizer is not None:
        opt_stored = stored if opt_where == where else _stored(opt_where, "load_model")
        if not any(k.startswith("optimizer.") for k in opt_stored):
            raise ValueError(
                f"load_model: {str(opt_where)!r} holds no optimizer state (saved without one, "
                "or with save_dense_params); load without optimizer=."
            )
        opt = {k: v for k, v in current.items() if k.startswith("optimizer.")}
        loaded.update(_read(opt_where, opt, "load_model"))
    params = {f"model.{k}" for k in _param_keys(model)}
    targets = {}
    for key, value in current.items():
        if not key.startswith("model."):
            continue
        if key in stored or key in params:
            targets[key] = value  # a missing parameter is named by _read
        else:
            logger.info("load_model: %s is not in %s; its running value is kept", key, where)
    loaded.update(_read(where, targets, "load_model"))
    for prefix, obj in (("model.", model), ("optimizer.", optimizer)):
        if obj is not None:
            part = {k[len(prefix) :]: v for k, v in loaded.items() if k.startswith(prefix)}
            layout.running_values(model, obj, part)

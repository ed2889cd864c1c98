"""``CheckpointManager``: save and resume a run (model, optimizer, data position) on Orbax.

Each step's checkpoint is an ``orbax.checkpoint`` composite of three items: ``state`` (the
model's and the optimizer's arrays in the one logical layout of
:mod:`jfleet.checkpoint.layout`), ``loader`` (the data position, JSON) and ``meta`` (what
produced it: mesh shape, fleet strategy, ``to_distributed`` plan, ``extra``; JSON). Orbax
writes atomically (a temporary directory renamed when complete) and asynchronously;
restore reads every array straight into its sharding on the running mesh, then stacks
per-layer arrays into a pipeline's running layout. Nothing is pickled. Random-number
state (``nnx.RngState``) is not saved. Steps only increase: saving a step that exists
(or is being saved) or one before the latest is an error, as is a directory named like
a step that is not a checkpoint; :meth:`~CheckpointManager.restore` first waits for the
manager's own saves in flight. In a multi-process run every process writes its shards
(``ocdbt.process_<i>``) and any process count restores them.

Trust (:mod:`jfleet.checkpoint.integrity`): every array leaf's checksum and a digest of the
JSON items are saved with the step and checked at restore, before anything is written
into the model (a mismatch names the step and the leaf); a manager takes the directory's
writer lock at its first save (a second writer is refused) and releases it on
:meth:`~CheckpointManager.close`; a background save that failed (a full disk) is reported
once, by the next call, and its step may then be saved again; a save left unfinished by a
killed process is reported once when a manager opens the directory, and its leftovers are
replaced when that step is saved again.

Example:
  >>> import tempfile, optax
  >>> from flax import nnx
  >>> model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
  >>> opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  >>> with CheckpointManager(tempfile.mkdtemp(), async_save=False) as mngr:
  ...     mngr.save(3, model, opt, extra={"note": "hi"})
  ...     fresh = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
  ...     meta = mngr.restore(model=fresh, optimizer=nnx.Optimizer(fresh, optax.adam(1e-2),
  ...                                                              wrt=nnx.Param))
  True
  >>> meta["step"], meta["extra"], bool((fresh.kernel[...] == model.kernel[...]).all())
  (3, {'note': 'hi'}, True)
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding

from jfleet.checkpoint import layout
from jfleet.checkpoint.integrity import WriterLock, fingerprints, json_digest, verify
from jfleet.mesh import context as _context
from jfleet.runtime.log import logger

__all__ = ["CheckpointManager"]

_FINISHED = "_CHECKPOINT_METADATA"  # Orbax writes it into a step's directory on commit
_SUMS = "checksums"  # the meta item's record of the arrays' and JSON items' checksums
_TMP = re.compile(r"(\d+)\.orbax-checkpoint-tmp")


def _prefixed(flat: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{part}/{k}": v for part, leaves in flat.items() for k, v in leaves.items()}


def _verified(got: Any, restored: dict[str, dict], step: int, where: Path) -> dict[str, Any]:
    """The checkpoint's description once its arrays and JSON items match their checksums."""
    meta = dict(got.meta)
    sums = meta.pop(_SUMS, None)
    if sums is None:
        logger.warning(
            "checkpoint: %s has no checksums (saved by an older jfleet): not verified", where
        )
        return meta
    if not isinstance(sums, dict) or json_digest(got.loader, meta) != sums.get("json"):
        raise ValueError(
            f"checkpoint {where} (step {step}) is damaged: its description or data position "
            f"(files under {where}/meta, {where}/loader) does not match its checksum; "
            "restore another step (all_steps())."
        )
    verify(sums.get("arrays", {}), fingerprints(_prefixed(restored)), step=step, where=where)
    return meta


def _unfinished(directory: Path) -> dict[int, list[Path]]:
    """``{step: [its temporary directories]}`` of saves not finished."""
    names = os.listdir(directory) if directory.is_dir() else []
    found: dict[int, list[Path]] = {}
    for name in names:
        if m := _TMP.match(name):
            found.setdefault(int(m.group(1)), []).append(directory / name)
    return found


def _report_unfinished(directory: Path) -> None:
    """Says once which saves were left unfinished (killed midway); Orbax ignores them."""
    for step in sorted(_unfinished(directory)):
        logger.warning(
            "checkpoint: an unfinished save of step %d in %s was ignored (the process saving "
            "it stopped midway); the complete steps are intact",
            step,
            directory,
        )


def _description(model: nnx.Module, step: int, extra: Any) -> dict[str, Any]:
    mesh = _context.current_mesh()
    if mesh is None:
        leaves = [v.get_value() for v in layout.state_leaves(model).values()]
        meshes = [getattr(x.sharding, "mesh", None) for x in leaves if isinstance(x, jax.Array)]
        mesh = next((m for m in meshes if m is not None), None)
    run = _context.current()
    plan = None
    try:
        from jfleet.auto_parallel import get_plan

        plan = get_plan(model).to_dict()
    except ValueError:
        pass
    return {
        "step": step,
        "mesh_shape": None if mesh is None else {str(k): int(v) for k, v in mesh.shape.items()},
        "strategy": None if run is None else run.strategy.to_dict(),
        "plan": plan,
        "extra": extra,
    }


def _misfit(shape: tuple, sharding: Any) -> tuple[int, str, int] | None:
    """``(dim, axes, size)`` of the first dimension of ``shape`` that ``sharding``'s mesh axes
    do not divide, or None (also for shardings without named axes)."""
    if not isinstance(sharding, NamedSharding):
        return None
    mesh_shape = dict(sharding.mesh.shape)
    for dim, axes in enumerate(tuple(sharding.spec)[: len(shape)]):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        size = math.prod(mesh_shape[a] for a in axes)
        if shape[dim] % size:
            return dim, "x".join(axes), size
    return None


def _bind(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Makes a ``DistributedOptimizer``'s state if no step has made it yet."""
    if getattr(optimizer, "is_bound", True) is False:
        optimizer.init(model)


class CheckpointManager:
    """Saves and restores training state in a directory of step checkpoints (Orbax).

    Args:
      directory: where the checkpoints live (created if missing).
      max_to_keep: keep only the newest ``n`` checkpoints (None: keep all).
      save_interval_steps: :meth:`save` writes only on steps that are multiples of it
        (step 0 included; others return False).
      async_save: write in the background (:meth:`save` returns while files are written;
        :meth:`wait_until_finished` waits).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ) -> None:
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(
                f"save_interval_steps={save_interval_steps!r}: expected an int >= 1 "
                "(1: save every step passed to save)."
            )
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(
                f"max_to_keep={max_to_keep!r}: expected None (keep all) or an int >= 1."
            )
        self.save_interval_steps = save_interval_steps
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise NotADirectoryError(
                f"checkpoint directory {self.directory} is a file: expected a directory (or a "
                "path that does not exist yet); pass another path."
            )
        self._started: set[int] = set()  # steps this manager saved (some maybe in flight)
        self._lock = WriterLock(self.directory)
        self._options = {"max_to_keep": max_to_keep, "enable_async_checkpointing": async_save}
        _report_unfinished(self.directory)
        self._mngr = self._orbax()

    def _orbax(self) -> ocp.CheckpointManager:
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "loader": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
        }
        options = ocp.CheckpointManagerOptions(**self._options)
        return ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def _settle(self) -> None:
        """Waits for the saves in flight; a failed one is reported once, then forgotten.

        Raises:
          RuntimeError: a background save failed (its step has no checkpoint and may be
            saved again).
        """
        try:
            self._mngr.wait_until_finished()
        except Exception as error:
            done = set(self._finished_steps())
            failed = sorted(self._started - done)
            self._started &= done
            with contextlib.suppress(Exception):
                self._mngr.close()
            self._mngr = self._orbax()  # Orbax would raise the same error at every call
            raise RuntimeError(
                f"the background save of step(s) {failed} to {self.directory} failed "
                f"({type(error).__name__}: {error}); no checkpoint was written for them (the "
                "earlier ones are intact): fix the cause (e.g. free disk space) and save "
                "again; the same step may be saved again."
            ) from error

    def save(
        self,
        step: int,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        *,
        loader: Any = None,
        extra: Any = None,
    ) -> bool:
        """Saves model, optimizer, ``loader``'s position and ``extra`` (JSON) at ``step``.

        Returns:
          Whether a checkpoint was started (False off the save interval).

        Raises:
          ValueError: ``step`` already has a checkpoint (saved or being saved), is not after
            the latest one, or its directory is taken by something that is not a checkpoint.
        """
        if step % self.save_interval_steps:
            return False
        if jax.process_index() == 0:
            self._lock.acquire()
        self._settle()
        self._check_new(int(step))
        if self._lock.held:  # the only writer: a temporary directory of the step is a dead save's
            for leftover in _unfinished(self.directory).get(int(step), []):
                shutil.rmtree(leftover, ignore_errors=True)
        _bind(model, optimizer)
        if jax.tree.leaves(nnx.state(model, nnx.RngState)):
            logger.info(
                "checkpoint: the model's random-number state (nnx.RngState) is not saved; "
                "a resumed run draws dropout masks from its own fresh RNG state"
            )
        flat = {
            "model": layout.logical_leaves(model, model),
            "optimizer": layout.logical_leaves(model, optimizer),
        }
        position = None if loader is None else loader.state()
        meta = _description(model, int(step), extra)
        meta[_SUMS] = {
            "arrays": fingerprints(_prefixed(flat)),
            "json": json_digest(position, meta),
        }
        args = ocp.args.Composite(
            state=ocp.args.StandardSave({k: layout.nest(v) for k, v in flat.items()}),
            loader=ocp.args.JsonSave(position),
            meta=ocp.args.JsonSave(meta),
        )
        try:
            saved = self._mngr.save(int(step), args=args)
        except Exception:
            self._mngr = self._orbax()  # a failed synchronous save: the step may be retried
            raise
        self._started.add(int(step))
        if saved:
            logger.info("checkpoint: saving step %d to %s", step, self.directory)
        return saved

    def restore(
        self,
        step: int | None = None,
        *,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        loader: Any = None,
    ) -> dict[str, Any]:
        """Restores ``step`` (default: the latest) into ``model`` / ``optimizer`` in place.

        The objects may live on another mesh, ZeRO stage or pipeline layout than the
        saver's: each array is read into the sharding the running objects give it.

        Returns:
          The checkpoint's description: ``step``, ``mesh_shape``, ``strategy``, ``plan``,
          ``extra``.

        Raises:
          FileNotFoundError: no checkpoint (at ``step``) in the directory.
          ValueError: the checkpoint was written by another model (the first differing leaf
            is named), the running mesh does not divide a stored leaf's shape (the leaf and
            the axis are named) or a file is damaged.
        """
        self._settle()  # this manager's own save of the step may be in flight
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"no checkpoint in {self.directory}: save one first, or pass the "
                    "directory the run saved to."
                )
            step = steps[-1]
        elif step not in steps:
            partial = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
            detail = (
                f" ({partial[0].name} is a save of it not finished: being written by another "
                "process, or killed midway; wait for the saver's wait_until_finished())"
                if partial
                else ""
            )
            raise FileNotFoundError(
                f"no checkpoint at step {step} in {self.directory}{detail}; its steps are {steps}."
            )
        where = self.directory / str(step)
        _bind(model, optimizer)
        target = {
            "model": layout.logical_leaves(model, model, abstract=True),
            "optimizer": layout.logical_leaves(model, optimizer, abstract=True),
        }
        self._check(where, step, target)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore({k: layout.nest(v) for k, v in target.items()}),
            loader=ocp.args.JsonRestore(),
            meta=ocp.args.JsonRestore(),
        )
        try:
            got = self._mngr.restore(step, args=args)
        except Exception as error:  # Orbax / tensorstore errors on damaged files
            raise ValueError(
                f"checkpoint {where} could not be read ({type(error).__name__}: {error}); a "
                "file is damaged or truncated: restore another step (all_steps())."
            ) from error
        restored = {part: layout.flatten(got.state[part]) for part in ("model", "optimizer")}
        meta = _verified(got, restored, step, where)
        layout.running_values(model, model, restored["model"])
        layout.running_values(model, optimizer, restored["optimizer"])
        if loader is not None:
            if got.loader is None:
                raise ValueError(
                    f"checkpoint {where} holds no data position: it was saved without "
                    "loader=; restore without loader= (the loader starts from its first batch)."
                )
            loader.restore(got.loader)
        return meta

    def _check(self, where: Path, step: int, target: dict[str, dict]) -> None:
        """Refuses a checkpoint whose leaves differ from the running objects' (first named)."""
        try:
            meta = self._mngr.item_metadata(step)["state"]
        except Exception as error:
            raise ValueError(
                f"checkpoint {where} could not be read ({type(error).__name__}: {error}); a "
                "file is damaged or truncated, or it is not a jfleet checkpoint: restore "
                "another step (all_steps())."
            ) from error
        for part, want in target.items():
            stored = layout.flatten(dict(meta.get(part, {}) if hasattr(meta, "get") else {}))
            for key in sorted(want):
                if key not in stored:
                    raise ValueError(
                        f"checkpoint {where} was written by another model: {part} leaf {key!r} "
                        f"of the running {part} is not in it (it has e.g. "
                        f"{sorted(set(stored) - set(want))[:3]}); restore into the model that "
                        "saved it."
                    )
                have, need = tuple(stored[key].shape), tuple(want[key].shape)
                misfit = _misfit(have, getattr(want[key], "sharding", None))
                if have != need and misfit is not None:
                    dim, axes, size = misfit
                    raise ValueError(
                        f"checkpoint {where}: {part} leaf {key!r} has logical shape {have} "
                        f"(the running {part}'s: {need}), whose dimension {dim} ({have[dim]}) "
                        f"the running mesh axis {axes!r} (size {size}) does not divide; "
                        f"restore on a mesh whose {axes!r} degree divides {have[dim]}, into "
                        "the model built for that mesh."
                    )
                if have != need:
                    raise ValueError(
                        f"checkpoint {where} was written by another model: {part} leaf {key!r} "
                        f"has shape {have} there but {need} in the running {part}; restore "
                        "into the model that saved it."
                    )
            for key in sorted(set(stored) - set(want)):
                raise ValueError(
                    f"checkpoint {where} was written by another model: its {part} leaf "
                    f"{key!r} is not in the running {part}; restore into the model that "
                    "saved it."
                )

    def _check_new(self, step: int) -> None:
        """Refuses a save Orbax would skip silently or fail on midway."""
        # a listing of the directory: reloading Orbax's manager here would lose its
        # bookkeeping of in-flight saves (max_to_keep would keep one too many)
        names = os.listdir(self.directory) if self.directory.is_dir() else []
        steps = self._finished_steps()
        if step in steps or step in self._started:
            raise ValueError(
                f"step {step} already has a checkpoint in {self.directory} (saved or being "
                f"saved; steps {steps}): save under a new step, or delete "
                f"{self.directory / str(step)} first."
            )
        if steps and step < steps[-1]:
            raise ValueError(
                f"step {step} is before the latest checkpoint's step {steps[-1]} in "
                f"{self.directory}: steps must increase; save into another directory, or "
                "delete the later steps first."
            )
        foreign = sorted(
            int(n)
            for n in names
            if n.isdigit()
            and int(n) not in steps
            and int(n) not in self._started  # ours: being committed or deleted
        )
        if foreign:
            raise ValueError(
                f"{self.directory / str(foreign[0])} is named like a step but is not a "
                f"checkpoint (no {_FINISHED} in it; Orbax would skip saves up to its step, "
                "or delete it under max_to_keep): move it away, or save into another "
                "directory."
            )

    def _finished_steps(self) -> list[int]:
        names = os.listdir(self.directory) if self.directory.is_dir() else []
        return sorted(
            int(n) for n in names if n.isdigit() and (self.directory / n / _FINISHED).is_file()
        )

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first.

        Partial writes and directories named like a step that are not checkpoints (no
        ``_CHECKPOINT_METADATA``) are ignored.
        """
        self._mngr.reload()
        steps = sorted(self._mngr.all_steps())
        done = [s for s in steps if (self.directory / str(s) / _FINISHED).is_file()]
        if len(done) < len(steps):
            logger.warning(
                "checkpoint: ignoring %s in %s: named like steps but not checkpoints (no %s)",
                sorted(set(steps) - set(done)),
                self.directory,
                _FINISHED,
            )
        return done

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def wait_until_finished(self) -> None:
        """Blocks until background saves are written.

        Raises:
          RuntimeError: a background save failed (reported once; see :meth:`save`).
        """
        self._settle()

    def close(self) -> None:
        """Waits for background saves, releases the manager and the directory's lock."""
        try:
            self._settle()
        finally:
            self._mngr.close()
            self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

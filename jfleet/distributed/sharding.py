"""Paddle's ``paddle.distributed.sharding``: ``group_sharded_parallel`` and its saver.

Example:
  >>> from jfleet.distributed.sharding import group_sharded_parallel
  >>> group_sharded_parallel.__name__
  'group_sharded_parallel'
"""

from __future__ import annotations

import os
from typing import Any

from flax import nnx

from jfleet.checkpoint.state_dict import load_model, save_model
from jfleet.fleet.group_sharded import group_sharded_parallel as group_sharded_parallel

__all__ = ["group_sharded_parallel", "load_group_sharded_model", "save_group_sharded_model"]

MODEL, OPT = "model.pdmodel", "model.pdopt"


def _paths(fn: str, model: Any, output: str | os.PathLike) -> tuple[str, str]:
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"{fn}(model={type(model).__name__}): expected the nnx.Module that "
            "group_sharded_parallel returned."
        )
    if os.path.isfile(output):
        raise ValueError(f"{fn}(output={str(output)!r}) is a file; give a directory.")
    return os.path.join(output, MODEL), os.path.join(output, OPT)


def save_group_sharded_model(model: nnx.Module, output: str, optimizer: Any = None) -> None:
    """Saves a group-sharded model (and its optimizer's state) into directory ``output``.

    As Paddle, writes ``output/model.pdmodel`` and, with an optimizer, ``output/model.pdopt``;
    here each is a directory of :func:`jfleet.checkpoint.state_dict.save_model` (Orbax: every
    process writes its own shards; keys in the logical per-layer layout, the wrapped model's
    own paths, as Paddle saves its inner layer). Read back with
    :func:`load_group_sharded_model` onto any mesh or ZeRO level (Paddle: ``paddle.load``).

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``.
      ValueError: ``output`` is an existing file.

    Example:
      >>> import tempfile
      >>> out = tempfile.mkdtemp()
      >>> save_group_sharded_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), out)
      >>> sorted(os.listdir(out))
      ['model.pdmodel']
    """
    model_path, opt_path = _paths("save_group_sharded_model", model, output)
    save_model(model_path, model, optimizer, optimizer_path=opt_path)


def load_group_sharded_model(model: nnx.Module, output: str, optimizer: Any = None) -> None:
    """Loads :func:`save_group_sharded_model`'s ``output`` into ``model`` (and ``optimizer``).

    Not in Paddle (which reads the files with ``paddle.load`` and ``set_state_dict``): the
    arrays are read in place into the running objects' shardings, whatever mesh or ZeRO
    level saved them.

    Raises:
      TypeError / ValueError: as :func:`save_group_sharded_model`; a parameter (or the
        optimizer's state) missing from ``output``. FileNotFoundError: nothing saved there.
    """
    model_path, opt_path = _paths("load_group_sharded_model", model, output)
    load_model(model_path, model, optimizer, optimizer_path=opt_path)

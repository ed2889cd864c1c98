"""Paddle's ``paddle.distributed.sharding``: ``group_sharded_parallel`` and its saver.

Example:
  >>> from jfleet.distributed.sharding import group_sharded_parallel
  >>> group_sharded_parallel.__name__
  'group_sharded_parallel'
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jfleet.distributed_model import DistributedModel
from jfleet.fleet.group_sharded import group_sharded_parallel as group_sharded_parallel

__all__ = ["group_sharded_parallel", "save_group_sharded_model"]


def _whole(x: Any) -> np.ndarray:
    """The full value of a (possibly multi-process) array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save_group_sharded_model(model: nnx.Module, output: str, optimizer: Any = None) -> None:
    """Saves the whole parameters (and optimizer state) of a group-sharded model.

    As Paddle, writes ``output/model.pdmodel`` and, with an optimizer,
    ``output/model.pdopt``; here each is a NumPy ``.npz`` archive keyed by path
    (``"layers/0/kernel"``: the wrapped model's own paths, as Paddle saves its inner
    layer; the optimizer's keys are its ``state_dict()``'s). Arrays are gathered whole;
    process 0 writes.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``.
      ValueError: ``output`` is an existing file.

    Example:
      >>> import tempfile
      >>> out = tempfile.mkdtemp()
      >>> save_group_sharded_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), out)
      >>> sorted(np.load(os.path.join(out, "model.pdmodel")).files)
      ['bias', 'kernel']
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"save_group_sharded_model(model={type(model).__name__}): expected the "
            "nnx.Module that group_sharded_parallel returned."
        )
    if os.path.isfile(output):
        raise ValueError(
            f"save_group_sharded_model(output={output!r}) is a file; give a directory."
        )
    inner = model.module if isinstance(model, DistributedModel) else model  # Paddle: _layer
    params = {
        "/".join(str(k) for k in path): _whole(var.get_value())
        for path, var in nnx.to_flat_state(nnx.state(inner, nnx.Param))
    }
    opt = None if optimizer is None else {k: _whole(v) for k, v in optimizer.state_dict().items()}
    if jax.process_index() != 0:
        return
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "model.pdmodel"), "wb") as f:
        np.savez(f, **params)
    if opt is not None:
        with open(os.path.join(output, "model.pdopt"), "wb") as f:
            np.savez(f, **opt)

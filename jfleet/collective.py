"""Host-level collectives across processes: ``all_reduce``, ``all_gather``, ``barrier``.

These are Paddle's ``fleet.util`` collectives: they run on the host, between
*processes*, on small host-local values (a loss for logging, a count of samples, a
flag). They are not for model tensors; inside a jitted step XLA inserts the device
collectives, and inside ``shard_map`` use ``jax.lax.psum`` with a mesh axis name.

Values travel as raw bytes, so float64 and int64 survive exactly whatever
``jax_enable_x64`` says. With one process every function works and returns at once.

Example:
  >>> from jfleet.collective import all_gather, all_reduce
  >>> all_reduce(3), all_reduce(2.0, "mean"), all_gather(7)  # one process
  (3, 2.0, [7])
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["all_gather", "all_reduce", "barrier", "broadcast_one_to_all"]

_MODES = ("sum", "mean", "max", "min")
_HEADER_BYTES = 512

Value = int | float | complex | np.ndarray | np.generic | jax.Array


def _to_numpy(value: Any, fn: str) -> np.ndarray:
    """A host-local numpy copy of ``value``; rejects what cannot be one."""
    if isinstance(value, jax.Array):
        if not value.is_fully_addressable:
            raise ValueError(
                f"{fn}: got a global jax.Array of shape {value.shape} sharded over several "
                "processes; pass a host-local value (e.g. np.asarray(x.addressable_data(0)) "
                "or a Python number). A global array is already one value for all processes."
            )
        return np.asarray(value)
    if isinstance(value, (bool, int, float, complex, np.ndarray, np.generic)):
        array = np.asarray(value)
        if array.dtype == object:
            raise TypeError(f"{fn}: cannot send an object array; got {value!r}.")
        return array
    raise TypeError(
        f"{fn}: expected a Python number, a numpy array or a jax.Array; got "
        f"{type(value).__name__} {value!r}."
    )


def _gather_arrays(array: np.ndarray) -> list[np.ndarray]:
    """Every process's array, in process order; shapes and dtypes may differ."""
    if jax.process_count() == 1:
        return [array]
    array = np.ascontiguousarray(array)
    meta = json.dumps({"shape": list(array.shape), "dtype": array.dtype.str}).encode()
    if len(meta) > _HEADER_BYTES - 8:
        raise ValueError(f"array of shape {array.shape} has too many dimensions to send.")
    header = np.zeros(_HEADER_BYTES, np.uint8)
    header[:8] = np.frombuffer(np.int64(array.nbytes).tobytes(), np.uint8)
    header[8 : 8 + len(meta)] = np.frombuffer(meta, np.uint8)
    headers = np.asarray(multihost_utils.process_allgather(header))
    sizes = [int(np.frombuffer(h[:8].tobytes(), np.int64)[0]) for h in headers]
    metas = [json.loads(h[8:].tobytes().rstrip(b"\0")) for h in headers]
    payload = np.zeros(max(max(sizes), 1), np.uint8)
    payload[: array.nbytes] = np.frombuffer(array.tobytes(), np.uint8)
    payloads = np.asarray(multihost_utils.process_allgather(payload))
    return [
        np.frombuffer(p[:size].tobytes(), np.dtype(m["dtype"])).reshape(m["shape"])
        for p, size, m in zip(payloads, sizes, metas, strict=True)
    ]


def _like_input(value: Any, result: np.ndarray) -> Any:
    """Python numbers come back as Python numbers, numpy scalars as numpy scalars."""
    if isinstance(value, (bool, int, float, complex)):
        return result.item()
    if isinstance(value, np.generic):
        return result[()]
    return np.asarray(result)


def all_reduce(value: Value, mode: str = "sum") -> Any:
    """Reduces a host-local value over all processes.

    Args:
      value: this process's value: a Python number, a numpy array or a fully
        addressable ``jax.Array``; same shape on every process.
      mode: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.

    Returns:
      The reduction, on every process. A Python number in gives a Python number out
      (an int stays an int except for ``"mean"``); an array gives a numpy array.

    Raises:
      ValueError: an unknown ``mode``, a global (multi-process) array, or shapes that
        differ between processes (raised on every process).
      TypeError: a value that is not a number or an array.

    Example:
      >>> from jfleet.collective import all_reduce
      >>> all_reduce(5, "max")  # one process
      5
    """
    if mode not in _MODES:
        raise ValueError(f"all_reduce mode={mode!r} is not supported; use one of {_MODES}.")
    array = _to_numpy(value, "all_reduce")
    gathered = _gather_arrays(array)
    shapes = {(g.shape, g.dtype.str) for g in gathered}
    if len(shapes) > 1:
        described = ", ".join(f"process {i}: {g.shape} {g.dtype}" for i, g in enumerate(gathered))
        raise ValueError(
            f"all_reduce needs the same shape and dtype on every process; got {described}."
        )
    stacked = np.stack(gathered)
    if mode == "sum":
        dtype = None if stacked.dtype == np.bool_ else stacked.dtype
        result = stacked.sum(axis=0, dtype=dtype)
    elif mode == "mean":
        result = stacked.mean(axis=0)
    elif mode == "max":
        result = stacked.max(axis=0)
    else:
        result = stacked.min(axis=0)
    return _like_input(value, np.asarray(result))


def all_gather(value: Value) -> list[Any]:
    """Every process's value, in process order.

    Args:
      value: this process's value: a Python number, a numpy array or a fully
        addressable ``jax.Array``. Shapes and dtypes may differ between processes.

    Returns:
      A list of ``jax.process_count()`` values; each converted back like the input
      (Python number -> Python number, array -> numpy array).

    Raises:
      ValueError: a global (multi-process) array.
      TypeError: a value that is not a number or an array.

    Example:
      >>> from jfleet.collective import all_gather
      >>> all_gather(1.5)  # one process
      [1.5]
    """
    gathered = _gather_arrays(_to_numpy(value, "all_gather"))
    return [_like_input(value, g) for g in gathered]


def broadcast_one_to_all(value: Value, src: int = 0) -> Any:
    """Process ``src``'s value, on every process.

    Args:
      value: this process's value (only ``src``'s is used; the others may be
        placeholders of any shape).
      src: the process whose value is sent.

    Returns:
      ``src``'s value, converted like the input.

    Raises:
      ValueError: ``src`` is not a process index.

    Example:
      >>> from jfleet.collective import broadcast_one_to_all
      >>> broadcast_one_to_all(42)
      42
    """
    count = jax.process_count()
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < count:
        raise ValueError(f"src={src!r} must be a process index in 0..{count - 1}.")
    return all_gather(value)[src]


def barrier(name: str = "jfleet_barrier") -> None:
    """Blocks until every process reaches a barrier of the same name.

    Args:
      name: the barrier's name; every process must use the same one.

    Raises:
      RuntimeError: processes reached barriers of different names.

    Example:
      >>> from jfleet.collective import barrier
      >>> barrier()  # one process: returns at once
    """
    if jax.process_count() == 1:
        return
    try:
        multihost_utils.sync_global_devices(name)
    except AssertionError as e:
        raise RuntimeError(
            f"barrier({name!r}): processes reached barriers with different names; "
            "call barrier with the same name on every process."
        ) from e

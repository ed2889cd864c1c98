"""What makes a checkpoint trustworthy: per-leaf checksums and one writer per directory.

**Checksums.** Orbax's arrays are stored by TensorStore without a checksum on their data
(zarr3 only checksums the shard index), so a flipped bit restores silently. At save,
:func:`fingerprints` computes for every leaf a 64-bit checksum of its *logical* value: two
sums over the elements' bits (as 32-bit words) modulo 2**32, one weighting each word by an
odd function of its global index, the other summing the squared words. Sums over
disjoint blocks add up, so each process sums the blocks it holds (each block once, however
many devices replicate it) on the host and the processes add their shares; any single
flipped bit changes the first sum (the weight is odd), and the
layout on disk or on the mesh does not matter (another mesh gives the same checksum). The
checksums are stored in the step's ``meta`` item (written atomically with the arrays) and,
with :func:`json_digest`, a SHA-256 of the JSON items; :func:`verify` compares them with
the restored values before anything is written into the model.

**One writer.** :class:`WriterLock` holds an exclusive ``flock`` on
``<directory>/.jfleet-writer.lock`` from a manager's first save until it closes: a second
manager (this process or another) saving into the directory is refused with a clear
error instead of interleaving its steps with the first one's. In a multi-process job only
process 0 takes it.

Example:
  >>> import jax.numpy as jnp
  >>> a = {"w": jnp.arange(6.0).reshape(2, 3)}
  >>> sums = fingerprints(a)
  >>> verify(sums, fingerprints({"w": a["w"].at[1, 2].set(5.0000005)}), step=1, where="ckpt")
  Traceback (most recent call last):
  ...
  ValueError: checkpoint ckpt (step 1) is damaged: leaf 'w' restored with checksum ...
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

__all__ = ["WriterLock", "fingerprints", "json_digest", "verify"]

LOCK_NAME = ".jfleet-writer.lock"
_WRAP = 1 << 32


def _words(block: np.ndarray) -> np.ndarray:
    """``block``'s bits as uint32 words (a last axis of 2 for 64-bit types)."""
    block = np.ascontiguousarray(block)
    size = block.dtype.itemsize
    if size == 8:
        return block.view(np.uint32).reshape(*block.shape, 2)
    kind = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    return block.view(kind).astype(np.uint32, copy=False)


def _block_sums(block: np.ndarray, offsets: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """The two sums (uint32) of one block of an array of ``shape``, at ``offsets``.

    The first, sum of ``word * (2 * global index + 1)``, is computed from the block's
    marginal sums (the index is linear in the coordinates): one pass per dimension, no
    index array. The second is the sum of the squared words.
    """
    words = _words(block if block.ndim else block.reshape(1))
    shape = (*(shape or (1,)), *words.shape[len(shape or (1,)) :])
    offsets = (*offsets, *(0 for _ in range(len(shape) - len(offsets))))
    first = int(np.sum(words, dtype=np.uint32))
    stride = 1
    for dim in reversed(range(words.ndim)):
        others = tuple(a for a in range(words.ndim) if a != dim)
        marginal = np.sum(words, axis=others, dtype=np.uint32) if others else words
        along = (np.arange(words.shape[dim], dtype=np.uint64) + offsets[dim]) * (2 * stride)
        first += int(np.sum(marginal * (along % _WRAP).astype(np.uint32), dtype=np.uint32))
        stride = (stride * shape[dim]) % _WRAP
    second = int(np.sum(words * words, dtype=np.uint32))
    return np.array([first % _WRAP, second], np.uint32)


def _partial(x: Any) -> np.ndarray:
    """This process's share of ``x``'s sums: each distinct block once (its replica 0)."""
    if not isinstance(x, jax.Array):
        return _block_sums(np.asarray(x), (), np.shape(x))
    total = np.zeros(2, np.uint64)
    for shard in x.addressable_shards:
        if shard.replica_id == 0:
            offsets = tuple(sl.start or 0 for sl in shard.index)
            total += _block_sums(np.asarray(shard.data), offsets, x.shape)
    return (total % _WRAP).astype(np.uint32)


def fingerprints(flat: dict[str, Any]) -> dict[str, str]:
    """``{leaf: checksum}`` of a flat dict of arrays (hex strings; see the module docstring).

    Every process must call it (a multi-process job adds up the processes' shares).

    Example:
      >>> import jax.numpy as jnp
      >>> fingerprints({"b": jnp.zeros(3)}) == fingerprints({"b": np.zeros(3, np.float32)})
      True
    """
    keys = sorted(k for k, v in flat.items() if isinstance(v, (jax.Array, np.ndarray)))
    sums = np.stack([_partial(flat[k]) for k in keys]) if keys else np.zeros((0, 2), np.uint32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        shares = multihost_utils.process_allgather(sums).astype(np.uint64)
        sums = (np.sum(shares, axis=0) % _WRAP).astype(np.uint32)
    return {k: f"{int(s[0]):08x}{int(s[1]):08x}" for k, s in zip(keys, sums, strict=True)}


def json_digest(*items: Any) -> str:
    """SHA-256 (hex) of JSON values, independent of key order and whitespace.

    Example:
      >>> json_digest({"a": 1, "b": 2}) == json_digest({"b": 2, "a": 1})
      True
    """
    text = json.dumps(items, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def verify(saved: dict[str, str], restored: dict[str, str], *, step: int, where: Any) -> None:
    """Raises when a restored leaf's checksum is not the one recorded at save.

    Raises:
      ValueError: naming the step, the first leaf that differs and the checkpoint's files.
    """
    for key in sorted(set(saved) | set(restored)):
        if saved.get(key) != restored.get(key):
            raise ValueError(
                f"checkpoint {where} (step {step}) is damaged: leaf {key!r} restored with "
                f"checksum {restored.get(key)} but was saved with {saved.get(key)} (its data "
                f"lives in {where}/state); the files changed after the save (disk or copy "
                "error): restore another step (all_steps()), or copy the checkpoint again."
            )


class WriterLock:
    """An exclusive, non-blocking ``flock`` on a directory's lock file (see the module doc).

    Example:
      >>> import tempfile
      >>> d = tempfile.mkdtemp()
      >>> first = WriterLock(d); first.acquire()
      >>> WriterLock(d).acquire()
      Traceback (most recent call last):
      ...
      RuntimeError: another CheckpointManager is saving into ...
      >>> first.release()
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock (a no-op when held).

        Raises:
          RuntimeError: another manager holds it; names its process when known.
        """
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(
                f"another CheckpointManager is saving into {self.path.parent} ({holder}); two "
                "writers would replace each other's steps: give this run its own directory, "
                "or close the other manager first."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drops the lock (a no-op when not held)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

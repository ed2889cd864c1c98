"""Feature ids to table rows: hashing, and the unique rows of a batch (on the host, NumPy).

Feature ids are 64-bit integers (``int64`` or ``uint64``; a negative ``int64`` is read as its
two's-complement ``uint64``). Row = ``splitmix64(id) mod num_rows``: a fixed, seedless mix, so
every process and every run maps an id to the same row.

Collisions are not resolved: ids that land on one row share its embedding, optimizer slots
and show / click statistics (the hashing trick). With ``n`` distinct ids in ``R`` rows, a
given id shares its row with some other id with probability ``1 - (1 - 1/R) ** (n - 1)``,
about ``n / R`` when ``n << R`` (1M ids in 2**24 rows: 6%; in 2**20 rows: 61%). Size the
table several times the live feature count, and let ``shrink`` keep it lean.

JAX without ``jax_enable_x64`` has no 64-bit integers, so hashing is done here on the
host, before the step; the step receives 32-bit row numbers.

Example:
  >>> import numpy as np
  >>> b = prepare(np.array([[7, 9], [7, 7]], np.int64), num_rows=1 << 20)
  >>> int((b.rows >= 0).sum()), b.show[b.inverse[0]].tolist()
  (2, [3.0, 1.0])
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["SparseBatch", "hash_ids", "prepare"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _as_uint64(ids: Any) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"feature ids of dtype {arr.dtype} are not integers; pass int64 or uint64 ids "
            "(hash strings to integers first)."
        )
    if arr.dtype.kind == "i":
        return arr.astype(np.int64).view(np.uint64)
    return arr.astype(np.uint64)


def hash_ids(ids: Any, num_rows: int) -> np.ndarray:
    """Each id's row in a table of ``num_rows`` rows (``int32``, same shape as ``ids``).

    Example:
      >>> hash_ids([1, 2, 1], 1000).tolist() == hash_ids([1, 2, 1], 1000).tolist()
      True
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or not 0 < num_rows < 2**31:
        raise ValueError(f"num_rows={num_rows!r}: expected an int in 1..2**31-1.")
    z = _as_uint64(ids)
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(num_rows)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SparseBatch:
    """A batch's feature ids as unique table rows.

    Attributes:
      rows: ``[size]`` int32: the unique rows the batch touches, then ``-1`` padding (a
        padded row reads zeros and is never updated).
      inverse: int32, the shape of the ids: each id's position in ``rows``
        (``pulled[inverse]`` is the batch's embeddings).
      show: ``[size]`` float32: how many of the batch's ids fell on each row.
      click: ``[size]`` float32: of those, how many belong to clicked instances (0 without
        labels).
    """

    rows: np.ndarray
    inverse: np.ndarray
    show: np.ndarray
    click: np.ndarray


def prepare(ids: Any, num_rows: int, labels: Any = None, size: int | None = None) -> SparseBatch:
    """Hashes ``ids`` (``[batch, ...]``) and groups them by row.

    Args:
      ids: int64 / uint64 feature ids, first axis the instances.
      num_rows: the table's row count.
      labels: optional ``[batch]`` 0/1 clicks: each row's ``click`` counts its ids in
        clicked instances.
      size: length of ``rows`` (default ``ids.size``, a fixed shape for a fixed batch shape,
        so a jitted step compiles once).

    Raises:
      ValueError: ``size`` smaller than the batch's distinct rows; ``labels`` not one per
        instance.
    """
    rows = hash_ids(ids, num_rows)
    unique, inverse, counts = np.unique(rows.ravel(), return_inverse=True, return_counts=True)
    size = rows.size if size is None else size
    if unique.size > size:
        raise ValueError(
            f"size={size} but the batch touches {unique.size} distinct rows; pass size >= "
            f"{unique.size} (default: the number of ids)."
        )
    out_rows = np.full(size, -1, np.int32)
    out_rows[: unique.size] = unique
    show = np.zeros(size, np.float32)
    show[: unique.size] = counts
    click = np.zeros(size, np.float32)
    if labels is not None:
        labels = np.asarray(labels, np.float32)
        if labels.shape != rows.shape[:1]:
            raise ValueError(
                f"labels of shape {labels.shape}: expected one per instance, {rows.shape[:1]}."
            )
        per_id = np.broadcast_to(labels.reshape((-1,) + (1,) * (rows.ndim - 1)), rows.shape)
        click[: unique.size] = np.bincount(inverse, weights=per_id.ravel(), minlength=unique.size)
    return SparseBatch(out_rows, inverse.reshape(rows.shape).astype(np.int32), show, click)

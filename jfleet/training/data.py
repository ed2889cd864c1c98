"""The sharded loader: a user's batches as global arrays split over the data axes.

:class:`ShardedLoader` wraps any iterable of batches (a list, a generator, a ``torch`` or
``grain`` loader) and places each one with :meth:`jfleet.placement.Placement.shard_batch`:
the batch dimension split over ``dp x sharding x ep``, the rest replicated. ``to_distributed``
returns one; a Fleet script wraps its own loader in one for the run's placement
(``Placement.from_fleet()``). :func:`peek` and :func:`batch_shape` read a loader's first
batch for planning.

With several processes each passes its own rows. :func:`local_rows` cuts them from a
global batch (in one process it returns the batch as it is), so one script runs unchanged
in one process and under ``python -m jfleet.launch --nproc_per_node 2``::

    for batch in batches:                     # every process reads the same global batch
        loss = model.train_batch(local_rows(batch), opt, loss_fn=loss_fn)

Example:
  >>> import jax, numpy as np
  >>> from jfleet.mesh.placement import Placement
  >>> mesh = jax.make_mesh((4, 2), ("dp", "sharding"))
  >>> loader = ShardedLoader([{"x": np.ones((16, 4))}] * 3, Placement(mesh))
  >>> batch = next(iter(loader))
  >>> batch["x"].sharding.spec, len(loader)
  (P(('dp', 'sharding'),), 3)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jfleet.mesh.placement import Placement

__all__ = ["ShardedLoader", "batch_shape", "local_rows", "peek"]


class ShardedLoader:
    """Iterates the wrapped loader and places each batch split over the data axes.

    A batch is an array, or a dict / tuple / list of arrays (any pytree of them); the
    leading dimension of each is the batch. In one process the loader yields the global
    batch; with several processes each yields its local part, or, with
    ``global_batches=True``, every process yields the whole global batch and keeps its own
    rows (:func:`local_rows`), so one script runs unchanged in one process and under the
    launcher. A re-iterable loader (a
    list, a ``torch`` or ``grain`` loader) is re-iterated on every ``iter``; a one-shot
    iterator (a generator) is consumed once.

    Args:
      loader: an iterable of batches.
      placement: the :class:`~jfleet.placement.Placement` whose data axes split each batch.
      first: the batch :func:`peek` already took from a one-shot ``loader``; it is
        yielded first, so no batch is lost.
      global_batches: the loader yields global batches in every process (each process
        keeps its rows); default False: each process's loader yields its own part.
      accumulate_steps: yield each batch as this many consecutive equal slices of its rows
        (of the global batch with ``global_batches``), one call of a training step whose
        optimizer merges that many calls' gradients (gradient accumulation,
        ``jfleet.optim.gradient_merge``); default 1: the batch whole.

    Attributes:
      loader: the wrapped loader.
      placement: the :class:`~jfleet.placement.Placement` whose data axes split the batch.
      global_batches: whether every process's loader yields the global batch.
      accumulate_steps: slices each batch is yielded as.

    Raises:
      TypeError: ``placement`` is not a ``Placement``.
      ValueError: ``accumulate_steps`` not an int >= 1; (while iterating) a batch whose
        size the data-parallel size (x ``accumulate_steps``) does not divide.

    Example:
      >>> import numpy as np
      >>> from jfleet import fleet
      >>> from jfleet.mesh.placement import Placement
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> loader = ShardedLoader([{"x": np.ones((16, 4))}] * 2, Placement.from_fleet())
      >>> [batch["x"].shape for batch in loader]
      [(16, 4), (16, 4)]
      >>> halves = ShardedLoader([{"x": np.ones((16, 4))}], Placement.from_fleet(),
      ...                        accumulate_steps=2)
      >>> [batch["x"].shape for batch in halves], len(halves)
      ([(8, 4), (8, 4)], 2)
    """

    def __init__(
        self,
        loader: Iterable[Any],
        placement: Placement,
        first: Any = None,
        *,
        global_batches: bool = False,
        accumulate_steps: int = 1,
    ) -> None:
        if not isinstance(placement, Placement):
            raise TypeError(
                f"placement={placement!r} ({type(placement).__name__}) is not a "
                "jfleet.placement.Placement; pass Placement.from_fleet() (after fleet.init) "
                "or Placement(mesh)."
            )
        if not isinstance(global_batches, bool):
            raise TypeError(f"global_batches={global_batches!r} must be a bool.")
        k = accumulate_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(
                f"accumulate_steps={k!r} must be an int >= 1 (calls each batch is split into)."
            )
        self.loader = loader
        self.placement = placement
        self.global_batches = global_batches
        self.accumulate_steps = k
        self._first = first
        self._position = 0
        self._skip = 0
        self._slice = 0  # slices of the current batch yielded (accumulation)
        self._skip_slices = 0

    def __iter__(self) -> Iterator[Any]:
        source = iter(self.loader)
        if source is self.loader:  # a one-shot iterator: keep the peeked batch
            first, self._first = self._first, None
            source = source if first is None else itertools.chain([first], source)
        skip, self._skip = self._skip, 0
        skip_slices, self._skip_slices = self._skip_slices, 0
        self._position = skip
        source = itertools.islice(source, skip, None)  # resuming: the batches already seen
        for batch in source:
            parts = _slices(batch, self.accumulate_steps)
            for j in range(skip_slices, len(parts)):
                self._slice = (j + 1) % len(parts)
                self._position += self._slice == 0  # the batch's last slice: it is done
                part = parts[j]
                if self.global_batches:
                    part = local_rows(part, self.placement)
                yield self.placement.shard_batch(part)
            skip_slices = 0

    def state(self) -> dict[str, int]:
        """The data position: ``{"batches": n}``, the batches of this pass already yielded.

        Example:
          >>> import jax, numpy as np
          >>> from jfleet.mesh.placement import Placement
          >>> mesh = jax.make_mesh((4, 2), ("dp", "sharding"))
          >>> loader = ShardedLoader([np.full((8, 1), i) for i in range(3)], Placement(mesh))
          >>> _ = next(iter(loader)); loader.state()
          {'batches': 1}
          >>> loader.restore({"batches": 2}); int(np.asarray(next(iter(loader)))[0, 0])
          2
        """
        if self._slice:  # inside an accumulation: the slices of this batch already yielded
            return {"batches": self._position, "slices": self._slice}
        return {"batches": self._position}

    def restore(self, state: dict[str, int]) -> None:
        """Resumes at ``state`` (from :meth:`state`): the next pass skips the batches seen."""
        batches = state.get("batches") if isinstance(state, dict) else None
        if not isinstance(batches, int) or batches < 0:
            raise ValueError(
                f"ShardedLoader.restore(state={state!r}): expected {{'batches': n}} with an "
                "int n >= 0, as ShardedLoader.state() returns."
            )
        slices = state.get("slices", 0)
        if not isinstance(slices, int) or not 0 <= slices < self.accumulate_steps:
            raise ValueError(
                f"ShardedLoader.restore(state={state!r}): 'slices' must be an int in [0, "
                f"{self.accumulate_steps}) for accumulate_steps={self.accumulate_steps}."
            )
        self._skip = self._position = batches
        self._skip_slices = self._slice = slices

    def __len__(self) -> int:
        # TypeError for loaders without a length, as for the original
        return len(self.loader) * self.accumulate_steps


def _slices(batch: Any, k: int) -> list[Any]:
    """``batch`` as ``k`` consecutive equal slices of its rows (0-d leaves in each whole).

    >>> [s["x"].tolist() for s in _slices({"x": np.arange(4)}, 2)]
    [[0, 1], [2, 3]]
    """
    if k == 1:
        return [batch]
    sizes = {np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)}
    if len(sizes) != 1 or next(iter(sizes)) % k:
        raise ValueError(
            f"a batch with leading dimensions {sorted(sizes)} cannot be split into "
            f"accumulate_steps={k} equal slices; yield batches whose rows are a multiple of {k}."
        )
    rows = next(iter(sizes)) // k
    return [
        jax.tree.map(lambda x, j=j: x[j * rows : (j + 1) * rows] if np.ndim(x) else x, batch)
        for j in range(k)
    ]


def peek(loader: Iterable[Any]) -> Any:
    """The loader's first batch (kept for iteration when the loader is a one-shot iterator).

    Pass it as :class:`ShardedLoader`'s ``first``: a generator cannot give it twice.

    Raises:
      TypeError: ``loader`` is not iterable.
      ValueError: it yields nothing.

    Example:
      >>> peek(iter([1, 2, 3])), peek([4, 5])
      (1, 4)
    """
    try:
        it = iter(loader)
    except TypeError:
        raise TypeError(
            f"dataloader={type(loader).__name__} is not iterable; pass an iterable of batches "
            "(a list, a generator, a DataLoader)."
        ) from None
    try:
        return next(it)
    except StopIteration:
        raise ValueError("the dataloader yielded no batch; it must yield at least one.") from None


def batch_shape(batch: Any, *, local: bool = True) -> tuple[int | None, int | None]:
    """``(batch_size, seq_len)`` of a batch (or an ``input_spec``) for the cost model.

    The batch size is the leading dimension the leaves share, times the process count
    when ``local`` (each process's part of a batch; never for global arrays);
    scalar leaves are left out. The sequence length is the second dimension of the first
    integer leaf with two or more dimensions (token ids), else of the first leaf with two
    or more, else 1. Leaves may be arrays or anything with ``.shape`` and ``.dtype``
    (``jax.ShapeDtypeStruct``, a Paddle ``InputSpec``); a dimension given as ``None`` or
    ``-1`` is unknown and comes back as None.

    Raises:
      ValueError: no arrays, a scalar leaf, or leaves disagreeing on the batch size.

    Example:
      >>> import jax, numpy as np
      >>> batch_shape({"tokens": np.zeros((16, 8), np.int32), "w": np.ones((16,))})
      (16, 8)
      >>> batch_shape(jax.ShapeDtypeStruct((4, 32), np.int32))
      (4, 32)
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch, is_leaf=_has_shape)
    leaves = [(p, x) for p, x in leaves if _shape(x)]  # scalars are placed replicated
    shapes = [(jax.tree_util.keystr(p) or "batch", _shape(x)) for p, x in leaves]
    if not shapes:
        raise ValueError(f"a batch of {batch!r} has no arrays; yield arrays with a batch axis.")
    sizes = {s[0] for _, s in shapes} - {None}
    if len(sizes) > 1:
        raise ValueError(
            "the batch's entries disagree on the batch size (leading dimension): "
            + ", ".join(f"{name} {s}" for name, s in shapes)
        )
    dtypes = [np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype) for _, x in leaves]
    wide = [(s, d) for (_, s), d in zip(shapes, dtypes, strict=True) if len(s) >= 2]
    tokens = [s for s, d in wide if np.issubdtype(d, np.integer)]
    seq = tokens[0][1] if tokens else (wide[0][0][1] if wide else 1)
    is_global = any(isinstance(x, jax.Array) and not x.is_fully_addressable for _, x in leaves)
    scale = jax.process_count() if local and not is_global else 1
    return (sizes.pop() * scale if sizes else None), seq


def _has_shape(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _shape(x: Any) -> tuple[int | None, ...]:
    shape = x.shape if _has_shape(x) else np.shape(x)
    return tuple(None if d is None or int(d) < 0 else int(d) for d in shape)


def local_rows(batch: Any, placement: Placement | None = None) -> Any:
    """This process's rows of a global batch: what it passes to ``train_batch`` or a loader.

    In one process the batch comes back as it is. With several processes each keeps the
    rows its devices hold on the data axes (``dp x sharding x ep``), in order, so every process
    can read the same global batch and the job trains on exactly that batch.

    Args:
      batch: a pytree of arrays (NumPy, JAX on the host), each with the global batch as its
        leading dimension; 0-d leaves are kept whole.
      placement: whose data axes split the batch (default: the run's,
        ``Placement.from_fleet()``).

    Returns:
      The same structure with this process's rows of each leaf.

    Example:
      >>> import numpy as np
      >>> local_rows({"x": np.arange(8)})["x"].shape  # one process: the whole batch
      (8,)
    """
    if jax.process_count() == 1:
        return batch
    placement = Placement.from_fleet() if placement is None else placement

    def one(x: Any) -> Any:
        x = np.asarray(x)
        if x.ndim == 0:
            return x
        held = placement.batch_sharding(x.ndim).addressable_devices_indices_map(x.shape)
        spans = sorted({index[0].indices(x.shape[0])[:2] for index in held.values()})
        return np.concatenate([x[start:stop] for start, stop in spans])

    return jax.tree.map(one, batch)

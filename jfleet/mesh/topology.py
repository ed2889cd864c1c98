"""The axis vocabulary and Paddle's hybrid-parallel rank arithmetic.

The one place the mesh axis names are spelled (``DP``, ``PP``, ``SHARDING``, ``SEP``,
``EP``, ``MP``). ``CommunicateTopology`` reproduces Paddle's row-major rank arithmetic (rank ``r``
has the coordinate ``np.unravel_index(r, dims)``, the last axis fastest);
:class:`~jfleet.mesh.hybrid_group.HybridCommunicateGroup` turns it into one ``Mesh`` whose
axes are the topology's axes in the same order, so that ``mesh.devices.flat[r]`` is Paddle
rank ``r``; every Paddle "group" becomes a ``Group`` naming a mesh axis (or a tuple of
axes) that ``lax.psum`` accepts inside ``shard_map``.

Rank questions have two answers in SPMD, and each getter says which one it gives:

- host view: the coordinate of this process's first device in the mesh (its first local
  device that is in the device list; a single process is rank 0 on every axis);
- per-device view: inside ``shard_map``, :func:`axis_index` / ``get_axis_rank``, i.e. the
  traced ``lax.axis_index``.

Example:
  >>> topo = CommunicateTopology(("data", "pipe", "model"), (2, 2, 2))
  >>> topo.get_comm_list("model")
  [[0, 1], [2, 3], [4, 5], [6, 7]]
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import keyword
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = [
    "AXIS_NAMES",
    "DATA_AXES",
    "DEFAULT_ORDER",
    "DP",
    "EP",
    "MP",
    "PP",
    "SEP",
    "SHARDING",
    "CommunicateTopology",
    "Group",
    "ParallelMode",
    "ProcessGroup",
    "axis_index",
]

# The axis vocabulary: the one place the mesh axis names are spelled. Every other module
# names an axis through these constants.
DP = "dp"
"""The data-parallel axis (Paddle's ``data`` / ``dp_degree``)."""
PP = "pp"
"""The pipeline axis (Paddle's ``pipe`` / ``pp_degree``): one pipeline stage per index."""
SHARDING = "sharding"
"""The ZeRO axis (Paddle's ``sharding`` / ``sharding_degree``); batches split on it too."""
SEP = "sep"
"""The sequence (segment) parallel axis (Paddle's ``sep`` / ``sep_degree``)."""
EP = "ep"
"""The expert-parallel axis (Paddle's ``expert`` / ``ep_degree``): an MoE layer's experts
``[E, ...]`` are split over it. It reuses data ranks (as Megatron-Core's and MaxText's
expert axes do): everything that is not an expert sees it as data, so a batch is split
over it and dense gradients are reduced over it."""
MP = "mp"
"""The tensor-parallel axis (Paddle's ``model`` / ``mp_degree``)."""

DEFAULT_ORDER = (DP, PP, SHARDING, SEP, EP, MP)
"""jfleet's default ``hybrid_configs["order"]``, outermost axis first: Paddle's
``["dp", "pp", "sharding", "sep", "mp"]`` with ``ep`` innermost among the data axes, next
to ``mp``, so that an expert all-to-all stays within a node."""
AXIS_NAMES = DEFAULT_ORDER
"""Every axis of a jfleet mesh (each mesh has all six, degree-1 axes kept)."""
DATA_AXES = (DP, SHARDING, EP)
"""The axes a batch is split over, outermost first (use as one ``PartitionSpec`` entry)."""

#: Paddle's topology axis names -> the mesh's, and back.
TOPO_TO_MESH = {"data": DP, "pipe": PP, "sharding": SHARDING, "sep": SEP, "expert": EP, "model": MP}
MESH_TO_TOPO = {v: k for k, v in TOPO_TO_MESH.items()}


class ParallelMode(enum.IntEnum):
    """Paddle's parallel modes, with Paddle's integer values.

    Example:
      >>> ParallelMode.TENSOR_PARALLEL.name
      'TENSOR_PARALLEL'
    """

    DATA_PARALLEL = 0
    TENSOR_PARALLEL = 1
    PIPELINE_PARALLEL = 2
    SHARDING_PARALLEL = 3
    SEGMENT_PARALLEL = 4


def is_int(x: Any) -> bool:
    """An int (NumPy's too), not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


class CommunicateTopology:
    """Named axes of a device grid, with Paddle's row-major rank order.

    Args:
      hybrid_group_names: axis names, outermost first; Python identifiers, unique.
      dims: the degree of each axis, positive ints.

    Raises:
      ValueError: names and dims differ in length, a name is repeated or not an
        identifier, or a dim is not a positive int.

    Example:
      >>> topo = CommunicateTopology(("data", "pipe", "model"), (2, 2, 2))
      >>> topo.get_rank(data=1, pipe=0, model=1), topo.get_coord(5).model
      (5, 1)
    """

    def __init__(
        self,
        hybrid_group_names: Sequence[str] = ("data", "pipe", "sharding", "sep", "model"),
        dims: Sequence[int] = (1, 1, 1, 1, 1),
    ) -> None:
        names, dims = list(hybrid_group_names), list(dims)
        if len(names) != len(dims):
            raise ValueError(
                f"hybrid_group_names={names} has {len(names)} names but dims={dims} has "
                f"{len(dims)} entries; give one dim per name."
            )
        for n in names:
            if (
                not isinstance(n, str)
                or not n.isidentifier()
                or keyword.iskeyword(n)
                or n[0] == "_"
            ):
                raise ValueError(
                    f"axis name {n!r} in hybrid_group_names={names} is not a valid name; use "
                    "Python identifiers that do not start with '_', e.g. 'data' or 'model'."
                )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"hybrid_group_names={names} repeats {dup}; each axis name once.")
        for n, d in zip(names, dims, strict=True):
            if not is_int(d) or d < 1:
                raise ValueError(f"dims={dims} gives {n}={d!r}; every dim must be an int >= 1.")
        self._parallel_names = names
        self._dims = [int(d) for d in dims]
        self.coordinate = collections.namedtuple("Coordinate", names)
        self._world_size = math.prod(self._dims)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={d}" for n, d in zip(self._parallel_names, self._dims, strict=True))
        return f"CommunicateTopology({inner})"

    def _axis(self, axis_name: str) -> int:
        if axis_name not in self._parallel_names:
            raise ValueError(
                f"axis_name={axis_name!r} is not an axis of this topology; "
                f"valid names: {self._parallel_names}."
            )
        return self._parallel_names.index(axis_name)

    def _rank_of(self, coord: Sequence[int]) -> int:
        return int(np.ravel_multi_index(tuple(coord), self._dims))

    def get_hybrid_group_names(self) -> list[str]:
        """The axis names, outermost first."""
        return list(self._parallel_names)

    def get_dim(self, axis_name: str) -> int:
        """The degree of ``axis_name``; ValueError if it is not an axis."""
        return self._dims[self._axis(axis_name)]

    def get_dim_size(self, axis_name: str) -> int:
        """Same as :meth:`get_dim`."""
        return self.get_dim(axis_name)

    def world_size(self) -> int:
        """The product of all dims."""
        return self._world_size

    def get_rank(self, **coord: int) -> int:
        """The rank at a full coordinate given by axis name, e.g. ``get_rank(data=0, ...)``."""
        unknown = sorted(set(coord) - set(self._parallel_names))
        missing = [n for n in self._parallel_names if n not in coord]
        if unknown or missing:
            raise ValueError(
                f"get_rank({coord}) needs exactly one index per axis; unknown {unknown}, "
                f"missing {missing}; valid names: {self._parallel_names}."
            )
        idx = []
        for n, d in zip(self._parallel_names, self._dims, strict=True):
            i = coord[n]
            if not is_int(i) or not 0 <= i < d:
                raise ValueError(f"get_rank: {n}={i!r} is out of range; expected 0 <= {n} < {d}.")
            idx.append(int(i))
        return self._rank_of(idx)

    def get_coord(self, rank: int) -> Any:
        """The coordinate of ``rank``: a namedtuple with one field per axis name."""
        if not is_int(rank) or not 0 <= rank < self._world_size:
            raise ValueError(
                f"rank={rank!r} is out of range; expected 0 <= rank < {self._world_size}."
            )
        return self.coordinate(*(int(i) for i in np.unravel_index(int(rank), self._dims)))

    def get_axis_list(self, axis_name: str, index: int) -> list[int]:
        """All ranks whose ``axis_name`` coordinate is ``index``, ascending."""
        axis = self._axis(axis_name)
        if not is_int(index) or not 0 <= index < self._dims[axis]:
            raise ValueError(
                f"index={index!r} is out of range for axis {axis_name!r}; "
                f"expected 0 <= index < {self._dims[axis]}."
            )
        ranks = np.arange(self._world_size).reshape(self._dims)
        return sorted(int(r) for r in np.take(ranks, index, axis=axis).ravel())

    def get_comm_list(self, axis_name: str) -> list[list[int]]:
        """One rank list per group along ``axis_name``, in Paddle's order.

        Groups are ordered row-major over the other axes; each lists the ranks along
        ``axis_name`` in increasing coordinate.
        """
        return self.get_fused_ranks([axis_name])

    def get_fused_ranks(self, fused_axis: Sequence[str]) -> list[list[int]]:
        """One rank list per group spanning the axes ``fused_axis`` together.

        Within a group the ranks run row-major over ``fused_axis`` in the order given
        (as in Paddle). Groups are ordered row-major over the remaining axes in topology
        order, i.e. sorted by first rank (Paddle iterates a ``set`` there, so its order
        is arbitrary; ``create_fuse_group`` sorts).
        """
        fused = list(fused_axis)
        axes = [self._axis(n) for n in fused]
        if len(set(axes)) != len(axes):
            raise ValueError(f"fused_axis={fused} repeats an axis; name each axis once.")
        rest = [i for i in range(len(self._dims)) if i not in axes]
        ranks = np.arange(self._world_size).reshape(self._dims).transpose(rest + axes)
        group_size = math.prod(self._dims[i] for i in axes)
        return ranks.reshape(-1, group_size).tolist()

    def get_rank_from_stage(self, global_rank: int, **kwargs: int) -> int:
        """The rank whose coordinate is ``global_rank``'s with the given axes replaced."""
        coord = self.get_coord(global_rank)._asdict()
        for n in kwargs:
            self._axis(n)
        coord.update(kwargs)
        return self.get_rank(**coord)


@dataclasses.dataclass(frozen=True)
class Group:
    """A communication group, host view: the mesh axes it spans and its global ranks.

    Inside ``shard_map`` over the hybrid mesh, ``lax.psum(x, group.axis_name)`` reduces
    over this group (on every device, each over its own group); ``ranks`` / ``rank``
    describe the group that holds this process's first mesh device.

    Attributes:
      axis_name: a mesh axis name (``"mp"``) or a tuple of names for a fused group.
      ranks: global ranks of the group, in the order ``lax.axis_index(axis_name)`` counts.
      rank: this process's index in ``ranks``, or -1 if it is not a member.
      id: which group of its kind this is (its index in the topology's group list).
      name: a label, e.g. ``"mp"`` or ``"check"``.
      mesh: the mesh the group lives on (set by ``HybridCommunicateGroup``), where
        :mod:`jfleet.collective` runs on global arrays.
      nranks: ``len(ranks)``.

    Example:
      >>> g = Group("mp", (0, 1), rank=0)
      >>> g.nranks, g.get_group_rank(1)
      (2, 1)
    """

    axis_name: str | tuple[str, ...]
    ranks: tuple[int, ...]
    rank: int = -1
    id: int = 0
    name: str | None = None
    mesh: Mesh | None = dataclasses.field(default=None, compare=False, repr=False)
    nranks: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "nranks", len(self.ranks))

    @property
    def world_size(self) -> int:
        """Same as ``nranks`` (Paddle's alias)."""
        return self.nranks

    @property
    def backend(self) -> str:
        """``"XLA"``: XLA runs every collective (Paddle names its process group's backend,
        e.g. ``"NCCL"``)."""
        return "XLA"

    @property
    def process_group(self) -> ProcessGroup:
        """A :class:`ProcessGroup` over this group (Paddle's backend process group).

        It answers ``rank()``, ``size()`` and ``name()``; collectives go through
        :mod:`jfleet.collective` with ``group=``, there being no communicator object.
        """
        return ProcessGroup(self)

    def is_member(self) -> bool:
        """Whether this process belongs to the group (Paddle also says False for a
        one-rank group; jfleet says True when the process is in it)."""
        return self.rank >= 0

    def get_group_rank(self, rank: int) -> int:
        """The index of global ``rank`` in the group, or -1."""
        return self.ranks.index(rank) if rank in self.ranks else -1

    def get_global_rank(self, group_rank: int) -> int:
        """The global rank at index ``group_rank`` of the group (inverse of
        :meth:`get_group_rank`).

        Raises:
          ValueError: ``group_rank`` is not in ``0..nranks-1``.
        """
        if not is_int(group_rank) or not 0 <= group_rank < self.nranks:
            raise ValueError(
                f"group_rank={group_rank!r} is not a rank of group {self.name!r} with "
                f"{self.nranks} ranks; expected 0 <= group_rank < {self.nranks}."
            )
        return self.ranks[int(group_rank)]


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """What ``Group.process_group`` returns: Paddle's process-group queries over a ``Group``.

    Example:
      >>> pg = Group("mp", (4, 5), rank=1, name="mp").process_group
      >>> pg.rank(), pg.size(), pg.name()
      (1, 2, 'XLA')
    """

    group: Group

    def rank(self) -> int:
        """This process's index in the group (-1 if it is not a member)."""
        return self.group.rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return self.group.nranks

    def name(self) -> str:
        """The backend's name, ``"XLA"``."""
        return self.group.backend


def axis_index(axis_name: str | tuple[str, ...]) -> jax.Array:
    """Per-device rank along mesh axes, for code inside ``shard_map``: ``lax.axis_index``.

    Example:
      >>> # inside jax.shard_map(f, mesh=hcg.mesh, ...): mp_rank = axis_index("mp")
    """
    return jax.lax.axis_index(axis_name)

"""Paddle's hybrid-parallel topology as one ``jax.sharding.Mesh``.

``CommunicateTopology`` reproduces Paddle's row-major rank arithmetic (rank ``r`` has the
coordinate ``np.unravel_index(r, dims)``, the last axis fastest). ``HybridCommunicateGroup``
turns it into one ``Mesh`` whose axes are the topology's axes in the same order, so that
``mesh.devices.flat[r]`` is Paddle rank ``r``; every Paddle "group" becomes a ``Group``
naming a mesh axis (or a tuple of axes) that ``lax.psum`` accepts inside ``shard_map``.

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
import itertools
import keyword
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

__all__ = [
    "AXIS_NAMES",
    "DATA_AXES",
    "DEFAULT_ORDER",
    "DP",
    "MP",
    "PP",
    "SEP",
    "SHARDING",
    "CommunicateTopology",
    "Group",
    "HybridCommunicateGroup",
    "ParallelMode",
    "ProcessGroup",
    "axis_index",
    "build_hybrid_communicate_group",
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
MP = "mp"
"""The tensor-parallel axis (Paddle's ``model`` / ``mp_degree``)."""

DEFAULT_ORDER = (DP, PP, SHARDING, SEP, MP)
"""Paddle's default ``hybrid_configs["order"]``, outermost axis first."""
AXIS_NAMES = DEFAULT_ORDER
"""Every axis of a jfleet mesh (each mesh has all five, degree-1 axes kept)."""
DATA_AXES = (DP, SHARDING)
"""The axes a batch is split over, outermost first (use as one ``PartitionSpec`` entry)."""

_TOPO_TO_MESH = {"data": DP, "pipe": PP, "sharding": SHARDING, "sep": SEP, "model": MP}
_MESH_TO_TOPO = {v: k for k, v in _TOPO_TO_MESH.items()}


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


def _is_int(x: Any) -> bool:
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
            if not _is_int(d) or d < 1:
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
            if not _is_int(i) or not 0 <= i < d:
                raise ValueError(f"get_rank: {n}={i!r} is out of range; expected 0 <= {n} < {d}.")
            idx.append(int(i))
        return self._rank_of(idx)

    def get_coord(self, rank: int) -> Any:
        """The coordinate of ``rank``: a namedtuple with one field per axis name."""
        if not _is_int(rank) or not 0 <= rank < self._world_size:
            raise ValueError(
                f"rank={rank!r} is out of range; expected 0 <= rank < {self._world_size}."
            )
        return self.coordinate(*(int(i) for i in np.unravel_index(int(rank), self._dims)))

    def get_axis_list(self, axis_name: str, index: int) -> list[int]:
        """All ranks whose ``axis_name`` coordinate is ``index``, ascending."""
        axis = self._axis(axis_name)
        if not _is_int(index) or not 0 <= index < self._dims[axis]:
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
        if not _is_int(group_rank) or not 0 <= group_rank < self.nranks:
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


class HybridCommunicateGroup:
    """Paddle's ``HybridCommunicateGroup`` over one ``jax.sharding.Mesh``.

    Topology names map to mesh axis names ``data->dp, pipe->pp, sharding, sep, model->mp``
    (short names are accepted as they are; other names are used verbatim). The mesh has
    the topology's axes in its order, each ``AxisType.Auto``, degree-1 axes kept; any of
    ``dp, pp, sharding, sep, mp`` the topology lacks is appended as a degree-1 axis so the
    mesh always has all five. Devices are laid out row-major, so ``mesh.devices.flat[r]``
    is ``devices[r]`` and its mesh coordinate is ``topology.get_coord(r)``.

    Rank getters answer for the host process (see the module docstring); for per-device
    code inside ``shard_map`` use :meth:`get_axis_rank` / :func:`axis_index`.

    Args:
      topology: the ``CommunicateTopology``.
      devices: the devices, Paddle rank order; default ``jax.devices()``.

    Raises:
      ValueError: the device count differs from the topology's world size, a device is
        repeated, two names map to one mesh axis, or no device of this process is given.

    Example:
      >>> topo = CommunicateTopology(("data", "pipe", "model"), (2, 2, 2))
      >>> hcg = HybridCommunicateGroup(topo)  # with 8 devices
      >>> hcg.mesh.axis_names, hcg.get_model_parallel_group().ranks
      (('dp', 'pp', 'mp', 'sharding', 'sep'), (0, 1))
    """

    def __init__(
        self, topology: CommunicateTopology, devices: Sequence[jax.Device] | None = None
    ) -> None:
        devices = list(jax.devices() if devices is None else devices)
        topo_names = topology.get_hybrid_group_names()
        dims = [topology.get_dim(n) for n in topo_names]
        if len(devices) != topology.world_size():
            product = " x ".join(f"{n}={d}" for n, d in zip(topo_names, dims, strict=True))
            raise ValueError(
                f"{product} = {topology.world_size()}, but there are {len(devices)} devices; "
                "make the product equal the device count."
            )
        if len(set(devices)) != len(devices):
            raise ValueError(
                f"devices {[d.id for d in devices]} repeat a device; give each device once."
            )
        mesh_names = [_TOPO_TO_MESH.get(n, n) for n in topo_names]
        if len(set(mesh_names)) != len(mesh_names):
            raise ValueError(
                f"topology names {topo_names} map to mesh axes {mesh_names}, which repeat; "
                f"use each of {list(_TOPO_TO_MESH)} (or {list(DEFAULT_ORDER)}) once."
            )
        self._topo = topology
        extra = [a for a in DEFAULT_ORDER if a not in mesh_names]
        self._axes = tuple(mesh_names + extra)
        self._dims = dict(zip(self._axes, dims + [1] * len(extra), strict=True))
        shape = tuple(self._dims[a] for a in self._axes)
        self._mesh = Mesh(
            np.array(devices, dtype=object).reshape(shape),
            self._axes,
            axis_types=(AxisType.Auto,) * len(self._axes),
        )
        index = {d: i for i, d in enumerate(devices)}
        mine = [index[d] for d in jax.local_devices() if d in index]
        if not mine:
            raise ValueError(
                f"none of this process's devices {[d.id for d in jax.local_devices()]} is "
                f"among the mesh devices {[d.id for d in devices]}; include one of them."
            )
        self.global_rank = mine[0]
        self.nranks = len(devices)
        self._coord = dict(
            zip(
                self._axes, (int(i) for i in np.unravel_index(self.global_rank, shape)), strict=True
            )
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{a}={self._dims[a]}" for a in self._axes)
        return f"HybridCommunicateGroup({inner}, global_rank={self.global_rank})"

    # ----- mesh and naming -------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The one hybrid ``Mesh`` (axes in topology order, then any appended degree-1)."""
        return self._mesh

    def topology(self) -> CommunicateTopology:
        """The ``CommunicateTopology`` this was built from."""
        return self._topo

    def _mesh_axis(self, name: str) -> str:
        axis = _TOPO_TO_MESH.get(name, name) if name not in self._dims else name
        if axis not in self._dims:
            raise ValueError(
                f"axis {name!r} is not in this hybrid group; valid mesh axes: "
                f"{list(self._axes)}, topology names: {self._topo.get_hybrid_group_names()}."
            )
        return axis

    def _ravel(self, coord: Mapping[str, int]) -> int:
        return int(
            np.ravel_multi_index(
                tuple(coord[a] for a in self._axes), tuple(self._dims[a] for a in self._axes)
            )
        )

    def _group(self, axes: Sequence[str], name: str) -> Group:
        axes = tuple(self._mesh_axis(a) for a in axes)
        if len(set(axes)) != len(axes):
            raise ValueError(f"axes {list(axes)} repeat an axis; name each axis once.")
        ranks = []
        for idx in itertools.product(*(range(self._dims[a]) for a in axes)):
            ranks.append(self._ravel({**self._coord, **dict(zip(axes, idx, strict=True))}))
        rest = [a for a in self._axes if a not in axes]
        gid = int(
            np.ravel_multi_index(
                tuple(self._coord[a] for a in rest), tuple(self._dims[a] for a in rest)
            )
        )
        return Group(
            axes[0] if len(axes) == 1 else axes,
            tuple(ranks),
            rank=ranks.index(self.global_rank),
            id=gid,
            name=name,
            mesh=self._mesh,
        )

    def get_axis_rank(self, axis: str | Sequence[str]) -> jax.Array:
        """Per-device rank along ``axis`` (mesh or topology names), inside ``shard_map``."""
        if isinstance(axis, str):
            return axis_index(self._mesh_axis(axis))
        return axis_index(tuple(self._mesh_axis(a) for a in axis))

    def get_global_rank(self) -> int:
        """Host view: the Paddle rank of this process's first mesh device."""
        return self.global_rank

    def get_world_size(self) -> int:
        """The number of devices in the mesh (Paddle's ``nranks``)."""
        return self.nranks

    # ----- data parallel ---------------------------------------------------------------

    def get_data_parallel_rank(self) -> int:
        """Host view: this process's ``dp`` coordinate (traced: ``get_axis_rank("dp")``)."""
        return self._coord[DP]

    def get_data_parallel_world_size(self) -> int:
        """The ``dp`` degree."""
        return self._dims[DP]

    def get_data_parallel_group(self) -> Group:
        """The ``dp`` group (``axis_name="dp"``) of this process."""
        return self._group([DP], DP)

    def get_data_parallel_group_src_rank(self) -> int:
        """Host view: the global rank of the first member of this process's ``dp`` group."""
        return self.get_data_parallel_group().ranks[0]

    # ----- tensor (model) parallel -----------------------------------------------------

    def get_model_parallel_rank(self) -> int:
        """Host view: this process's ``mp`` coordinate (traced: ``get_axis_rank("mp")``)."""
        return self._coord[MP]

    def get_model_parallel_world_size(self) -> int:
        """The ``mp`` degree."""
        return self._dims[MP]

    def get_model_parallel_group(self) -> Group:
        """The ``mp`` group (``axis_name="mp"``) of this process."""
        return self._group([MP], MP)

    def get_model_parallel_group_src_rank(self) -> int:
        """Host view: the global rank of the first member of this process's ``mp`` group."""
        return self.get_model_parallel_group().ranks[0]

    # ----- sharding parallel -----------------------------------------------------------

    def get_sharding_parallel_rank(self) -> int:
        """Host view: this process's ``sharding`` coordinate (traced: ``get_axis_rank``)."""
        return self._coord[SHARDING]

    def get_sharding_parallel_world_size(self) -> int:
        """The ``sharding`` degree."""
        return self._dims[SHARDING]

    def get_sharding_parallel_group(self) -> Group:
        """The ``sharding`` group (``axis_name="sharding"``) of this process."""
        return self._group([SHARDING], SHARDING)

    def get_sharding_parallel_group_src_rank(self) -> int:
        """Host view: the first global rank of this process's ``sharding`` group."""
        return self.get_sharding_parallel_group().ranks[0]

    # ----- segment (sep) parallel ------------------------------------------------------

    def get_sep_parallel_rank(self) -> int:
        """Host view: this process's ``sep`` coordinate (traced: ``get_axis_rank("sep")``)."""
        return self._coord[SEP]

    def get_sep_parallel_world_size(self) -> int:
        """The ``sep`` degree."""
        return self._dims[SEP]

    def get_sep_parallel_group(self) -> Group:
        """The ``sep`` group of this process (a one-rank group when ``sep`` is 1, where
        Paddle raises "sep not exist")."""
        return self._group([SEP], SEP)

    def get_sep_parallel_group_src_rank(self) -> int:
        """Host view: the first global rank of this process's ``sep`` group."""
        return self.get_sep_parallel_group().ranks[0]

    # ----- pipeline parallel -----------------------------------------------------------

    @property
    def stage_id(self) -> int:
        """Host view: this process's ``pp`` coordinate."""
        return self._coord[PP]

    @property
    def is_first_stage(self) -> bool:
        """Host view: whether this process holds pipeline stage 0 (an attribute, as in Paddle)."""
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        """Host view: whether this process holds the last pipeline stage (an attribute)."""
        return self.stage_id == self._dims[PP] - 1

    def get_stage_id(self) -> int:
        """Host view: this process's pipeline stage (traced: ``get_axis_rank("pp")``)."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """The ``pp`` degree."""
        return self._dims[PP]

    def get_pipe_parallel_group(self) -> Group:
        """The ``pp`` group (``axis_name="pp"``) of this process."""
        return self._group([PP], PP)

    def get_p2p_next_rank(self) -> int:
        """Host view: the global rank of the next stage in this process's pipeline ring.

        The ring wraps (last -> first), as Paddle's; with ``pp`` 1 it is this rank
        (Paddle leaves it unset there).
        """
        ranks = self.get_pipe_parallel_group().ranks
        return ranks[(self.stage_id + 1) % len(ranks)]

    def get_p2p_prev_rank(self) -> int:
        """Host view: the global rank of the previous stage (wrapping), see next rank."""
        ranks = self.get_pipe_parallel_group().ranks
        return ranks[(self.stage_id - 1) % len(ranks)]

    _get_p2p_next_rank = get_p2p_next_rank
    _get_p2p_prev_rank = get_p2p_prev_rank

    def get_p2p_permutation(self, direction: str = "next") -> list[tuple[int, int]]:
        """The ``lax.ppermute(x, "pp", perm)`` permutation that sends to the next/prev stage.

        This is the per-device form of Paddle's p2p send/recv: stage ``i`` sends to
        ``(i + 1) % pp`` (``"next"``) or ``(i - 1) % pp`` (``"prev"``).
        """
        if direction not in ("next", "prev"):
            raise ValueError(f"direction={direction!r}; expected 'next' or 'prev'.")
        step = 1 if direction == "next" else -1
        pp = self._dims[PP]
        return [(i, (i + step) % pp) for i in range(pp)]

    def get_p2p_groups(self) -> tuple[Group, Group, Group, Group]:
        """Paddle's four p2p pairs: ``(send_next, send_prev, recv_next, recv_prev)``.

        Host view only: each ``Group`` has ``axis_name="pp"`` and the two global ranks of
        the pair (send_next/recv_next: this rank and the next; send_prev/recv_prev: the
        previous and this rank). A pair is not a mesh axis, so do not ``psum`` over it;
        move data with ``lax.ppermute`` and :meth:`get_p2p_permutation`. Unlike Paddle,
        no ``PADDLE_USE_FOUR_DIRECTIONS_P2P`` setting is needed.
        """
        me, nxt, prv = self.global_rank, self.get_p2p_next_rank(), self.get_p2p_prev_rank()
        fwd = Group(PP, (me, nxt), rank=0, name="p2p_next", mesh=self._mesh)
        bwd = Group(PP, (prv, me), rank=(prv, me).index(me), name="p2p_prev", mesh=self._mesh)
        return fwd, bwd, fwd, bwd

    def get_rank_from_stage(self, stage_id: int, **kwargs: int) -> int:
        """The global rank at ``stage_id`` with this process's other coordinates.

        ``kwargs`` replace further coordinates, keyed by topology or mesh axis names.
        """
        coord = dict(self._coord)
        coord[PP] = stage_id
        for name, value in kwargs.items():
            coord[self._mesh_axis(name)] = value
        for a, v in coord.items():
            if not _is_int(v) or not 0 <= v < self._dims[a]:
                raise ValueError(f"{a}={v!r} is out of range; expected 0 <= {a} < {self._dims[a]}.")
        return self._ravel(coord)

    # ----- fused groups ----------------------------------------------------------------

    def get_check_parallel_group(self, sharding: bool = False) -> Group:
        """The group for global checks (inf/nan, global-norm clipping).

        As in Paddle: every rank with this process's ``dp`` coordinate, i.e. all non-``dp``
        axes fused (``axis_name`` = those axes in mesh order). With ``sharding=True``:
        every rank with this process's ``sharding`` coordinate (all non-``sharding`` axes).
        """
        skip = SHARDING if sharding else DP
        axes = [a for a in self._axes if a != skip]
        return self._group(axes, "sharding_check" if sharding else "check")

    def create_fuse_group(self, fused_strategy_list: Sequence[str]) -> Group:
        """This process's group spanning several axes (topology or mesh names), in order."""
        names = list(fused_strategy_list)
        if not names:
            raise ValueError("fused_strategy_list=[] is empty; name at least one axis.")
        return self._group(names, "_".join(self._mesh_axis(n) for n in names))

    def get_dp_sep_parallel_group(self) -> Group:
        """The fused ``(dp, sep)`` group (Paddle requires ``sep`` > 1; jfleet does not)."""
        return self.create_fuse_group([DP, SEP])

    def get_pp_mp_parallel_group(self) -> Group:
        """The fused ``(pp, mp)`` group (Paddle requires ``sep`` > 1; jfleet does not)."""
        return self.create_fuse_group([PP, MP])

    # ----- MoE sharding (no such axis) -------------------------------------------------

    def get_moe_sharding_parallel_world_size(self) -> int:
        """0: no MoE-sharding group, as Paddle's hybrid group without expert parallelism
        says (its code tests ``> 0``); ``moe_sharding_degree`` other than 1 is refused."""
        return 0

    def get_moe_sharding_parallel_rank(self) -> int:
        """0: this process's index in its one-rank MoE-sharding group."""
        return 0

    def get_moe_sharding_parallel_group(self) -> Group:
        """This process alone (``axis_name=()``: a collective over it returns its input)."""
        me = self.global_rank
        return Group((), (me,), rank=0, id=me, name="moe_sharding", mesh=self._mesh)

    def get_moe_sharding_parallel_group_src_rank(self) -> int:
        """Host view: this process's global rank (its MoE-sharding group has one rank)."""
        return self.global_rank

    def get_parallel_mode(self) -> ParallelMode:
        """The mode ``distributed_model`` dispatches on, with Paddle's priority.

        ``pp`` > 1: PIPELINE; else ``mp`` > 1: TENSOR; else ``sep`` > 1: SEGMENT; else
        ``sharding`` > 1: SHARDING (even with ``dp`` > 1); else DATA. When every degree is 1
        Paddle returns ``None``; jfleet returns DATA_PARALLEL.
        """
        d = self._dims
        if d[PP] > 1:
            return ParallelMode.PIPELINE_PARALLEL
        if d[MP] > 1:
            return ParallelMode.TENSOR_PARALLEL
        if d[SEP] > 1:
            return ParallelMode.SEGMENT_PARALLEL
        if d[SHARDING] > 1:
            return ParallelMode.SHARDING_PARALLEL
        return ParallelMode.DATA_PARALLEL


def build_hybrid_communicate_group(
    hybrid_configs: Mapping[str, Any], devices: Sequence[jax.Device] | None = None
) -> HybridCommunicateGroup:
    """Builds the topology and mesh from a strategy's ``hybrid_configs`` (``fleet.init``).

    Reads ``dp_degree`` (-1: infer), ``mp_degree``, ``pp_degree``, ``sharding_degree``,
    ``sep_degree`` (default 1 each, dp -1) and ``order`` (default ``DEFAULT_ORDER``; a
    ``"cp"`` entry is dropped); other keys are ignored. ``dp_degree=-1`` becomes
    ``devices // (mp * pp * sharding * sep)``; Paddle leaves sharding and sep out of that
    division, jfleet does not, so the product always equals the device count. Paddle
    clamps degrees of 0 to 1; jfleet rejects them.

    Args:
      hybrid_configs: the ``DistributedStrategy.hybrid_configs`` dict.
      devices: the devices in rank order; default ``jax.devices()``.

    Returns:
      The ``HybridCommunicateGroup``; its topology uses Paddle's names
      (``data, pipe, sharding, sep, model``) in ``order``.

    Raises:
      ValueError: a degree is not an int >= 1 (dp may be -1), ``order`` is not a
        permutation of ``DEFAULT_ORDER``, or the degrees do not multiply to the device count.

    Example:
      >>> hcg = build_hybrid_communicate_group({"dp_degree": -1, "mp_degree": 2})
      >>> hcg.get_data_parallel_world_size()  # with 8 devices
      4
    """
    devices = list(jax.devices() if devices is None else devices)
    order = hybrid_configs.get("order", DEFAULT_ORDER)
    if isinstance(order, str) or not isinstance(order, Sequence):
        raise ValueError(f"order={order!r} must be a list, a permutation of {list(DEFAULT_ORDER)}.")
    given = list(order)
    order = [a for a in given if a != "cp"]
    if not all(isinstance(a, str) for a in order) or sorted(order) != sorted(DEFAULT_ORDER):
        raise ValueError(
            f"order={given} is not a permutation of "
            f"{list(DEFAULT_ORDER)} (a 'cp' entry is allowed and dropped); list each once."
        )
    degrees = {}
    for a in DEFAULT_ORDER:
        key = f"{a}_degree"
        value = hybrid_configs.get(key, -1 if a == DP else 1)
        if not _is_int(value) or (value < 1 and not (a == DP and value == -1)):
            allowed = "an int >= 1 or -1 (infer)" if a == DP else "an int >= 1"
            raise ValueError(f"{key}={value!r} is not valid; expected {allowed}.")
        degrees[a] = int(value)
    n = len(devices)
    if degrees[DP] == -1:
        others = [a for a in order if a != DP]
        rest = math.prod(degrees[a] for a in others)
        if n % rest:
            product = " x ".join(f"{a}_degree={degrees[a]}" for a in others)
            raise ValueError(
                f"dp_degree=-1 cannot be inferred: {product} = {rest} does not divide the "
                f"{n} devices; choose degrees whose product divides {n}."
            )
        degrees[DP] = n // rest
    total = math.prod(degrees.values())
    if total != n:
        product = " x ".join(f"{a}_degree={degrees[a]}" for a in order)
        raise ValueError(
            f"{product} = {total}, but there are {n} devices; make the product equal the "
            "device count or set dp_degree=-1."
        )
    topology = CommunicateTopology([_MESH_TO_TOPO[a] for a in order], [degrees[a] for a in order])
    return HybridCommunicateGroup(topology, devices)

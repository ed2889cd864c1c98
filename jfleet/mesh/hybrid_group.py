"""Paddle's ``HybridCommunicateGroup``: the one hybrid mesh and the group getters.

:func:`build_hybrid_communicate_group` turns ``hybrid_configs`` into a
:class:`~jfleet.mesh.topology.CommunicateTopology` and one ``jax.sharding.Mesh`` whose axes
are the topology's axes in the same order (``mesh.devices.flat[r]`` is Paddle rank ``r``);
:class:`HybridCommunicateGroup` answers Paddle's questions about it (degrees, ranks, groups
as mesh axes). The axis vocabulary and the rank arithmetic are :mod:`jfleet.mesh.topology`'s.

Example:
  >>> hcg = build_hybrid_communicate_group({"dp_degree": 2, "mp_degree": 4})
  >>> hcg.get_model_parallel_world_size(), dict(hcg.mesh.shape)["dp"]
  (4, 2)
  >>> hcg = build_hybrid_communicate_group({"dp_degree": 2, "ep_degree": 4})
  >>> hcg.mesh.axis_names, hcg.get_expert_parallel_group().ranks
  (('dp', 'pp', 'sharding', 'sep', 'ep', 'mp'), (0, 1, 2, 3))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jfleet.mesh.topology import (
    DEFAULT_ORDER,
    DP,
    EP,
    MESH_TO_TOPO,
    MP,
    PP,
    SEP,
    SHARDING,
    TOPO_TO_MESH,
    CommunicateTopology,
    Group,
    ParallelMode,
    axis_index,
    is_int,
)

__all__ = ["HybridCommunicateGroup", "build_hybrid_communicate_group", "moe_sharding_problem"]

#: Paddle's ``order`` entries that are not jfleet mesh axes, dropped from an order (their
#: degrees must be 1): context parallelism and MoE sharding.
ORDER_DROPPED = ("cp", "moe_sharding")


def moe_sharding_problem(value: Any) -> str | None:
    """Why ``hybrid_configs["moe_sharding_degree"]=value`` cannot run, or None (it is 1).

    Paddle's ``moe_sharding`` is a ZeRO group for the expert weights alone, beside ``ep``.
    In jfleet expert weights are split over ``ep`` and replicated over the other data
    axes; sharding them further is not built, so the degree must be 1.

    Example:
      >>> moe_sharding_problem(1) is None, "moe_sharding_degree=2" in moe_sharding_problem(2)
      (True, True)
    """
    if is_int(value) and value == 1:
        return None
    return (
        f"moe_sharding_degree={value!r} is not supported; expected 1. jfleet splits expert "
        f"weights over the '{EP}' axis (ep_degree) and keeps each expert shard replicated "
        f"over the other data axes ('{DP}', '{SHARDING}'); ZeRO over the expert weights "
        "alone (Paddle's moe_sharding group) is not built. Set moe_sharding_degree=1 and "
        "give its ranks to dp_degree (or to sharding_degree, which shards the dense "
        "parameters)."
    )


class HybridCommunicateGroup:
    """Paddle's ``HybridCommunicateGroup`` over one ``jax.sharding.Mesh``.

    Topology names map to mesh axis names
    ``data->dp, pipe->pp, sharding, sep, expert->ep, model->mp`` (short names are accepted
    as they are; other names are used verbatim). The mesh has the topology's axes in its
    order, each ``AxisType.Auto``, degree-1 axes kept; any of
    ``dp, pp, sharding, sep, ep, mp`` the topology lacks is appended as a degree-1 axis so
    the mesh always has all six. Devices are laid out row-major, so ``mesh.devices.flat[r]``
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
      (('dp', 'pp', 'mp', 'sharding', 'sep', 'ep'), (0, 1))
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
        mesh_names = [TOPO_TO_MESH.get(n, n) for n in topo_names]
        if len(set(mesh_names)) != len(mesh_names):
            raise ValueError(
                f"topology names {topo_names} map to mesh axes {mesh_names}, which repeat; "
                f"use each of {list(TOPO_TO_MESH)} (or {list(DEFAULT_ORDER)}) once."
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
        axis = TOPO_TO_MESH.get(name, name) if name not in self._dims else name
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

    # ----- expert parallel -------------------------------------------------------------

    def get_expert_parallel_rank(self) -> int:
        """Host view: this process's ``ep`` coordinate (traced: ``get_axis_rank("ep")``)."""
        return self._coord[EP]

    def get_expert_parallel_world_size(self) -> int:
        """The ``ep`` degree (``hybrid_configs["ep_degree"]``; 1 without experts split)."""
        return self._dims[EP]

    def get_expert_parallel_group(self) -> Group:
        """The ``ep`` group (``axis_name="ep"``) of this process: the ranks an MoE layer's
        experts are split over, which its all-to-alls run in (a one-rank group at ``ep``
        1, where Paddle's hybrid group has no such getter).

        Example:
          >>> hcg = build_hybrid_communicate_group({"dp_degree": 2, "ep_degree": 4})
          >>> g = hcg.get_expert_parallel_group()
          >>> g.axis_name, g.ranks, hcg.get_expert_parallel_world_size()
          ('ep', (0, 1, 2, 3), 4)
        """
        return self._group([EP], EP)

    def get_expert_parallel_group_src_rank(self) -> int:
        """Host view: the first global rank of this process's ``ep`` group."""
        return self.get_expert_parallel_group().ranks[0]

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
            if not is_int(v) or not 0 <= v < self._dims[a]:
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
        """0 without expert parallelism (``ep`` 1), as Paddle's hybrid group says (its code
        tests ``> 0``); 1 with ``ep`` > 1, as Paddle's expert-parallel group says for
        ``moe_sharding_degree`` 1. A ``moe_sharding_degree`` other than 1 is refused
        (:func:`moe_sharding_problem`)."""
        return 0 if self._dims[EP] == 1 else 1

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
        ``sharding`` > 1: SHARDING (even with ``dp`` > 1); else DATA (``ep``, data to the
        dense parameters, changes no mode). When every degree is 1 Paddle returns ``None``;
        jfleet returns DATA_PARALLEL.
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
    ``sep_degree``, ``ep_degree`` (default 1 each, dp -1), ``moe_sharding_degree`` (must
    be 1) and ``order`` (default ``DEFAULT_ORDER``; ``"cp"`` and ``"moe_sharding"``
    entries are dropped, and an order without ``"ep"`` gets it just outside ``"mp"``);
    other keys are ignored. ``dp_degree=-1`` becomes
    ``devices // (pp * sharding * sep * ep * mp)``; Paddle leaves sharding and sep out of
    that division, jfleet does not, so the product always equals the device count.

    ``ep`` is a mesh axis of its own that takes its ranks from the data ranks (as in
    Megatron-Core and MaxText): ``{"dp_degree": 2, "ep_degree": 4}`` on 8 devices is a
    ``dp2 x ep4`` mesh whose batch is split 8 ways. Paddle's expert-parallel group instead
    overlaps the other axes (its ``ep_degree`` is not in the device product): Paddle's
    ``{"sharding_degree": 8, "ep_degree": 8}`` is ``{"sharding_degree": 1,
    "ep_degree": 8}`` here. Paddle clamps degrees of 0 to 1; jfleet rejects them.

    Args:
      hybrid_configs: the ``DistributedStrategy.hybrid_configs`` dict.
      devices: the devices in rank order; default ``jax.devices()``.

    Returns:
      The ``HybridCommunicateGroup``; its topology uses Paddle's names
      (``data, pipe, sharding, sep, expert, model``) in ``order``.

    Raises:
      ValueError: a degree is not an int >= 1 (dp may be -1), ``moe_sharding_degree`` is
        not 1, ``order`` is not a permutation of ``DEFAULT_ORDER`` (``"ep"`` may be left
        out), or the degrees do not multiply to the device count.

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
    order = [a for a in given if a not in ORDER_DROPPED]
    if EP not in order and MP in order:
        order.insert(order.index(MP), EP)
    if not all(isinstance(a, str) for a in order) or sorted(order) != sorted(DEFAULT_ORDER):
        raise ValueError(
            f"order={given} is not a permutation of {list(DEFAULT_ORDER)} ('ep' may be left "
            f"out: it goes just outside 'mp'; 'cp' and 'moe_sharding' entries are allowed and "
            "dropped); list each once."
        )
    problem = moe_sharding_problem(hybrid_configs.get("moe_sharding_degree", 1))
    if problem is not None:
        raise ValueError(problem)
    degrees = {}
    for a in DEFAULT_ORDER:
        key = f"{a}_degree"
        value = hybrid_configs.get(key, -1 if a == DP else 1)
        if not is_int(value) or (value < 1 and not (a == DP and value == -1)):
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
        hint = ""
        if degrees[EP] > 1:
            hint = (
                f" ep_degree counts in the product: jfleet's '{EP}' axis takes its ranks from "
                "the data ranks (Paddle's expert group overlaps the other axes), so divide "
                "dp_degree or sharding_degree by ep_degree."
            )
        raise ValueError(
            f"{product} = {total}, but there are {n} devices; make the product equal the "
            f"device count or set dp_degree=-1.{hint}"
        )
    topology = CommunicateTopology([MESH_TO_TOPO[a] for a in order], [degrees[a] for a in order])
    return HybridCommunicateGroup(topology, devices)

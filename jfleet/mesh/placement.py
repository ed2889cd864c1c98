"""Where a run's arrays live: parameter specs, ZeRO specs, optimizer state, batches.

A :class:`Placement` is the engine's view of a strategy: the mesh, the axes a batch is
split over, and which ZeRO stage shards what over which axis. Everything that places
an array (``distributed_model``, the engine, ``group_sharded_parallel``,
``to_distributed``, the sharded loader) asks this module, so there is one rule for each
placement. (Not to be confused with :class:`jfleet.auto_parallel.Plan`, the planner's
choice of a layout, which ``to_distributed`` turns into a :class:`Placement`.)

Example:
  >>> import jax
  >>> from jfleet import fleet
  >>> from jfleet.mesh.placement import Placement
  >>> _ = fleet.init(is_collective=True)
  >>> placement = Placement.from_fleet()
  >>> placement.data_parallel_size == jax.device_count()
  True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh import context as _context
from jfleet.mesh.layer_mesh import named
from jfleet.mesh.topology import DATA_AXES, DP, EP, SEP, SHARDING
from jfleet.runtime import consistency
from jfleet.runtime.log import logger

__all__ = [
    "ParallelPlan",
    "Placement",
    "check_divides",
    "put",
    "resolve_placement",
    "zero_axes",
]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's arrays live: the layout the engine compiles a step for.

    Attributes:
      mesh: the one hybrid mesh (``fleet.get_hybrid_communicate_group().mesh``).
      zero_stage: 0 (none), 1 (optimizer state sharded), 2 (also gradients) or 3
        (also parameters).
      zero_axis: the mesh axis ZeRO shards over: ``"sharding"`` (Paddle's
        sharding group) or ``"dp"`` (``group_sharded_parallel`` without a sharding
        axis); or a tuple of axes, e.g. ``("dp", "sharding", "sep")``: ZeRO over every
        rank that holds the same parameters (Megatron's distributed optimizer,
        ``sharding_configs["_dp_as_optimizer_sharding"]``, :func:`zero_axes`).

    Example:
      >>> from jfleet import fleet
      >>> strategy = fleet.DistributedStrategy()
      >>> strategy.hybrid_configs = {"dp_degree": 2, "sharding_degree": 4}
      >>> _ = fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
      >>> Placement.from_fleet().data_parallel_size
      8
    """

    mesh: Mesh
    zero_stage: int = 0
    zero_axis: str | tuple[str, ...] = SHARDING

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage!r} must be 0, 1, 2 or 3.")
        axes = _axes(self.zero_axis)
        if not axes or any(a not in self.mesh.axis_names for a in axes):
            raise ValueError(
                f"zero_axis={self.zero_axis!r} is not a mesh axis (or a tuple of them); axes: "
                f"{self.mesh.axis_names}."
            )
        if isinstance(self.zero_axis, list):  # a hashable, spec-ready entry
            object.__setattr__(self, "zero_axis", tuple(self.zero_axis))

    @classmethod
    def from_fleet(cls) -> Placement:
        """The placement for the strategy given to ``fleet.init`` (the current run).

        Raises:
          RuntimeError: ``fleet.init`` not called. ValueError: ``strategy.sharding``
            without a sharding axis.
        """
        run = _context.require("the placement of the run's arrays")
        hcg, strategy = run.hcg, run.strategy
        spans = bool(strategy.sharding_configs["_dp_as_optimizer_sharding"])
        axis = zero_axes(hcg.mesh, spans)
        degree = math.prod(hcg.mesh.shape[a] for a in _axes(axis))
        if strategy.sharding and degree == 1:
            raise ValueError(
                "strategy.sharding=True but hybrid_configs['sharding_degree']=1: there is no "
                "sharding axis to shard over; set hybrid_configs={'sharding_degree': N}"
                + (
                    "."
                    if spans
                    else " (or sharding_configs['_dp_as_optimizer_sharding'] "
                    "= True with dp_degree or sep_degree > 1)."
                )
            )
        opted_in = hcg.get_sharding_parallel_world_size() > 1 or strategy.sharding
        stage = int(strategy.sharding_configs["stage"]) if degree > 1 and opted_in else 0
        return cls(mesh=hcg.mesh, zero_stage=stage, zero_axis=axis)

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch dimension is split over."""
        return tuple(a for a in DATA_AXES if a in self.mesh.axis_names)

    @property
    def data_parallel_size(self) -> int:
        """How many ways a batch is split (dp x sharding x ep)."""
        return math.prod(self.mesh.shape[a] for a in self.data_axes)

    @property
    def process_data_slices(self) -> int:
        """How many of the batch's data-parallel slices this process's devices hold.

        A process passes that many slices' rows as its local batch; the global batch has
        ``local rows x data_parallel_size / process_data_slices`` rows. Processes that
        split ``mp`` or ``pp`` between them share slices (each passes the same rows), so
        the factor is not the process count then.

        Example:
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> Placement(fleet.get_hybrid_communicate_group().mesh).process_data_slices
          8
        """
        names = self.mesh.axis_names
        here = jax.process_index()
        slices = set()
        for index, device in np.ndenumerate(self.mesh.devices):
            if device.process_index == here:
                slices.add(tuple(index[names.index(a)] for a in self.data_axes))
        return max(len(slices), 1)

    @property
    def zero_degree(self) -> int:
        """The size of the ZeRO axis (of its axes together; 1 when ZeRO is off)."""
        if not self.zero_stage:
            return 1
        return math.prod(self.mesh.shape[a] for a in _axes(self.zero_axis))

    def named(self, spec: P) -> NamedSharding:
        """A ``NamedSharding`` on this placement's mesh (the one builder, see ``mesh_context``)."""
        return named(self.mesh, *spec)

    # -------------------------------------------------------------- params
    def param_specs(self, params: nnx.State) -> Any:
        """Each parameter's layout before ZeRO: its ``out_sharding`` metadata, else replicated."""
        return nnx.get_partition_spec(params)

    def zero_spec(self, spec: P, shape: tuple[int, ...]) -> P:
        """``spec`` with the ZeRO axis added on one dimension, where one divides.

        Picks the largest dimension not yet sharded whose size the ZeRO degree
        divides; failing that, the largest sharded one whose size the product
        divides (``('sharding', 'mp')``). A parameter with no such dimension stays
        as it is (logged at DEBUG).
        """
        zaxes = _axes(self.zero_axis)
        degree = math.prod(self.mesh.shape[a] for a in zaxes)
        if degree == 1 or not shape:
            return spec
        entries = list(spec) + [None] * (len(shape) - len(spec))
        if any(set(zaxes) & set(_axes(e)) for e in entries):
            return spec
        free = [d for d, e in enumerate(entries) if e is None and shape[d] % degree == 0]
        if free:
            d = max(free, key=lambda i: (shape[i], -i))
            entries[d] = self.zero_axis
            return P(*entries)
        taken = [
            d
            for d, e in enumerate(entries)
            if e is not None
            and shape[d] % (degree * math.prod(self.mesh.shape[a] for a in _axes(e))) == 0
        ]
        if taken:
            d = max(taken, key=lambda i: (shape[i], -i))
            entries[d] = (*zaxes, *_axes(entries[d]))
            return P(*entries)
        logger.debug("ZeRO: shape %s has no dimension divisible by %d; replicated", shape, degree)
        return spec

    def param_shardings(self, params: nnx.State, *, zero: bool | None = None) -> Any:
        """``NamedSharding`` per parameter; ZeRO-sharded when ``zero`` (default: stage 3).

        A parameter's ZeRO layout is its ``optimizer_sharding`` metadata where that is set
        and fits this mesh (``to_distributed`` sets it from its plan, :meth:`place_params`
        from :meth:`zero_spec`), else :meth:`zero_spec` of its layout: one rule, so the
        optimizer state, the ZeRO-2 gradients and the ZeRO-3 parameters agree.
        """
        if zero is None:
            zero = self.zero_stage >= 3
        specs = self.param_specs(params)
        own = iter(
            var.get_metadata("optimizer_sharding", None) if isinstance(var, nnx.Variable) else None
            for var in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        )

        def one(spec: P, x: Any) -> NamedSharding:
            given, shape = next(own), np.shape(x)
            if not zero:
                return self.named(spec)
            if given is not None and self._fits(P(*given), shape):
                return self.named(P(*given))
            return self.named(self.zero_spec(spec, shape))

        return jax.tree.map(one, specs, params, is_leaf=lambda s: isinstance(s, P))

    def place_params(self, model: nnx.Module) -> nnx.Module:
        """Moves the model's parameters (and other variables) onto the mesh for this placement.

        With ZeRO, annotated parameters also get ``optimizer_sharding`` metadata where they
        have none that fits (a plan may have set it): Flax builds an annotated parameter's
        optimizer state from its metadata and would otherwise re-lay the state out
        unsharded (``out_sharding``).
        """
        shardings = self.state_shardings(model)
        params, rest = nnx.state(model, nnx.Param, ...)
        nnx.update(model, *put((params, rest), shardings))
        return model

    def state_shardings(self, model: nnx.Module) -> tuple[Any, Any]:
        """Where :meth:`place_params` puts ``model``'s state: ``NamedSharding`` trees of its
        parameters and of its other variables, as ``nnx.state(model, nnx.Param, ...)``.

        Reads shapes and metadata only (``model`` may be abstract, or traced); with ZeRO it
        sets the ``optimizer_sharding`` metadata :meth:`place_params` describes.
        """
        if self.zero_stage >= 1:
            for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
                spec = var.get_metadata("out_sharding", None)
                given = var.get_metadata("optimizer_sharding", None)
                if spec and not (given is not None and self._fits(P(*given), var.shape)):
                    zero = self.zero_spec(P(*spec), tuple(var.shape))
                    var.set_metadata(optimizer_sharding=tuple(zero))
        params, rest = nnx.state(model, nnx.Param, ...)
        rest_specs = nnx.get_partition_spec(rest)
        rest_shardings = jax.tree.map(self.named, rest_specs, is_leaf=lambda s: isinstance(s, P))
        return self.param_shardings(params), rest_shardings

    def _fits(self, spec: P, shape: tuple[int, ...]) -> bool:
        """Whether ``spec`` names this mesh's axes and splits ``shape`` evenly."""
        if len(spec) > len(shape):
            return False
        for entry, size in zip(spec, shape, strict=False):
            axes = _axes(entry)
            if any(a not in self.mesh.axis_names for a in axes):
                return False
            if size % math.prod(self.mesh.shape[a] for a in axes):
                return False
        return True

    # -------------------------------------------------------------- batches
    def batch_sharding(self, ndim: int) -> NamedSharding:
        """Split the leading (batch) dimension over the data axes, the rest replicated."""
        if ndim == 0:
            return self.named(P())
        return self.named(P(self.data_axes))

    def shard_batch(self, batch: Any) -> Any:
        """Places a batch (a pytree of arrays) split over the data axes.

        In a single process the arrays are the global batch; with several processes
        each process passes its local part (``jax.make_array_from_process_local_data``),
        and every process must pass the same structure, shapes and dtypes: on the first
        batch of each new signature the processes compare theirs
        (:func:`jfleet.consistency.check_batch`; already global arrays are not compared).

        Raises:
          ValueError: a leading dimension the data-parallel size does not divide.
          jfleet.consistency.InconsistentBatchError: processes passing local batches of
            different structure, shape or dtype (a ``ValueError`` too).
        """
        size = self.data_parallel_size
        multi = jax.process_count() > 1
        if multi:
            consistency.check_batch(batch)
        # a degree-1 ep (every run without experts split) is left out of the message
        parts = [
            (a, self.mesh.shape[a]) for a in self.data_axes if a != EP or self.mesh.shape[a] > 1
        ]
        rows_factor = size // self.process_data_slices if multi else 1

        def _check_rows(path: Any, global_n: int | None) -> None:
            if global_n is not None:
                name = jax.tree_util.keystr(path) or "batch"
                check_divides(
                    f"{name} has batch size {global_n}",
                    global_n,
                    parts,
                    f"use a batch size that is a multiple of {size}",
                )

        def one(path: Any, x: Any) -> jax.Array:
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                # Already a global array (to_distributed's loader yields them): re-lay it
                # out if needed; its shape is the global one.
                _check_rows(path, x.shape[0] if x.ndim else None)
                return jax.device_put(x, self.batch_sharding(x.ndim))
            if isinstance(x, jax.Array) and not multi:
                shape = x.shape
            else:
                x = np.asarray(x)
                shape = x.shape
            sharding = self.batch_sharding(len(shape))
            if shape:
                _check_rows(path, shape[0] * (rows_factor if multi else 1))
            if multi:
                return jax.make_array_from_process_local_data(sharding, x)
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x  # placed already (what device_put would return)
            return put(x, sharding)

        return jax.tree_util.tree_map_with_path(one, batch)


def zero_axes(mesh: Mesh | Any, spans_data: bool) -> str | tuple[str, ...]:
    """The axis (or axes) ZeRO shards over on ``mesh``: ``"sharding"``; with
    ``spans_data``, every axis of degree > 1 whose ranks hold the same parameters
    (``dp``, ``sharding``, ``sep``, in mesh order): Megatron's distributed optimizer, as
    Paddle's ``sharding_configs["_dp_as_optimizer_sharding"]`` asks. ``ep`` is left out:
    its ranks hold different experts (dense parameters stay ZeRO-sharded over the others).

    Example:
      >>> from jax.sharding import AbstractMesh
      >>> mesh = AbstractMesh((2, 1, 2, 2, 1), ("dp", "pp", "sharding", "sep", "mp"))
      >>> zero_axes(mesh, False), zero_axes(mesh, True)
      ('sharding', ('dp', 'sharding', 'sep'))
    """
    if not spans_data:
        return SHARDING
    shape = dict(mesh.shape)
    axes = tuple(a for a in (DP, SHARDING, SEP) if shape.get(a, 1) > 1)
    if len(axes) <= 1:
        return axes[0] if axes else SHARDING
    return axes


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


ParallelPlan = Placement
"""The former name of :class:`Placement` (kept for one release)."""


def resolve_placement(placement: Placement | None, model: Any) -> Placement:
    """The placement a step runs under: the one given, else the model's, else the run's.

    Example:
      >>> from flax import nnx
      >>> from jfleet import fleet
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> resolve_placement(None, nnx.Linear(2, 2, rngs=nnx.Rngs(0))).zero_stage
      0
    """
    if placement is not None:
        return placement
    own = getattr(model, "placement", None)
    return own if isinstance(own, Placement) else Placement.from_fleet()


def check_divides(
    what: str, size: int, parts: Any, fix: str, label: str = "data-parallel size"
) -> None:
    """The one batch-divisibility check: ``size`` must split into ``parts``.

    Args:
      what: the start of the message, naming the value (``"batch has batch size 6"``).
      size: the number to split.
      parts: ``(name, count)`` pairs whose product must divide ``size``.
      fix: how to fix it, the message's end.
      label: what the product is.

    Raises:
      ValueError: the product does not divide ``size``.

    Example:
      >>> check_divides("6 rows", 6, [("dp", 2), ("sharding", 2)], "use 8")
      Traceback (most recent call last):
      ...
      ValueError: 6 rows, which the data-parallel size 4 (dp 2 x sharding 2) does not divide; use 8.
    """
    parts = list(parts)
    total = math.prod(n for _, n in parts)
    if size % total:
        product = " x ".join(f"{name} {n}" for name, n in parts)
        raise ValueError(f"{what}, which the {label} {total} ({product}) does not divide; {fix}.")


def put(tree: Any, shardings: Any) -> Any:
    """``jax.device_put(tree, shardings)``, without a compile per shape on CPU.

    Splitting an array that lives on one device over a mesh makes ``jax.device_put``
    compile a slicing program for each shape and layout (0.1-0.5 s each on CPU, tens per
    model). An array on one CPU device is host memory already, so it goes through NumPy
    instead, which compiles nothing; everything else (accelerator arrays, arrays already
    on several devices, weakly typed scalars, PRNG key arrays, tracers) goes to
    ``jax.device_put`` as is.
    The result is the same: same values, dtypes and shardings.

    Example:
      >>> import jax.numpy as jnp
      >>> mesh = jax.make_mesh((8,), ("dp",))
      >>> x = put(jnp.arange(8.0), NamedSharding(mesh, P("dp")))
      >>> len(x.addressable_shards), x.sharding.spec == P("dp")
      (8, True)
    """
    return jax.device_put(jax.tree.map(_as_host_if_free, tree), shardings)


def _as_host_if_free(x: Any) -> Any:
    """``x`` as a NumPy array where that is free (one CPU device, strongly typed)."""
    if (
        not isinstance(x, jax.Array)
        or isinstance(x, jax.core.Tracer)
        or jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # no NumPy form
        or x.weak_type
        or not x.is_fully_addressable
        or len(x.sharding.device_set) != 1
        or next(iter(x.sharding.device_set)).platform != "cpu"
    ):
        return x
    return np.asarray(x)


def write_variable(var: nnx.Variable, value: Any) -> None:
    """Writes ``value`` into a state variable in place, keeping its dtype and sharding.

    The compiled step is specialised to both, so writing this way never recompiles it.

    Example:
      >>> var = nnx.Variable(np.zeros(2, np.float32))
      >>> write_variable(var, [1, 2])
      >>> var.get_value().tolist()
      [1.0, 2.0]
    """
    old = var.get_value()
    new = np.asarray(value, dtype=old.dtype)
    var.set_value(jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else new)

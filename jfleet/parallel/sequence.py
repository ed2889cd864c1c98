"""Sequence parallelism (Megatron-SP, Paddle's ``sequence_parallel_utils``) on the ``mp`` axis.

Between the tensor-parallel regions of a transformer block (norms, dropout, residual
adds) activations are split over the sequence on ``mp`` instead of replicated, so each
mp rank holds ``1/mp`` of them. A :class:`ColumnSequenceParallelLinear` all-gathers the
sequence before its column-split matmul; a :class:`RowSequenceParallelLinear`
reduce-scatters its partial sums back to sequence-split. The two all-reduces of a
tensor-parallel block become all-gathers and reduce-scatters of the same total bytes.

Paddle's activations are ``[s, b, h]`` and its ops split dim 0; jfleet's default is
the same (``seq_axis=0``), and ``seq_axis=1`` serves ``[b, s, h]`` models.

In SPMD every array is global, so the four Paddle ops are layout changes of one value:
``ScatterOp`` / ``ReduceScatterOp`` split the sequence over ``mp``, ``GatherOp`` /
``AllGatherOp`` replicate it; which collective runs (and in the backward pass its
transpose) is the compiler's. For the same reason gradients of parameters used on
sequence-split activations (norm scales and biases) are summed over ``mp`` without
hooks: :func:`mark_as_sequence_parallel_parameter` records the mark for Paddle
compatibility and changes nothing else.

Example:
  >>> import jax.numpy as jnp
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> x = scatter_to_sequence_parallel(jnp.ones((8, 2, 4)))  # [s, b, h]
  >>> x.sharding.spec
  P('mp', ('dp', 'sharding', 'ep'), None)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.mesh.group_collective import manual_axes
from jfleet.mesh.layer_mesh import constrain, layer_mesh, mp_degree
from jfleet.mesh.topology import DATA_AXES, MP
from jfleet.parallel.layers import ColumnParallelLinear, RowParallelLinear
from jfleet.runtime.log import logger


def _seq_entries(x: jax.Array, seq_axis: int, seq: Any, mesh: Mesh) -> tuple[Any, ...]:
    """``seq`` on the sequence dim, the data axes on the batch dim (the other of dims 0, 1)."""
    if not -x.ndim <= seq_axis < x.ndim:
        raise ValueError(f"seq_axis={seq_axis} is out of range for an input of shape {x.shape}.")
    seq_axis %= x.ndim
    entries: list[Any] = [None] * x.ndim
    entries[seq_axis] = seq
    batch_axis = 1 if seq_axis == 0 else 0
    if x.ndim >= 2 and batch_axis != seq_axis:
        data = math.prod(mesh.shape.get(a, 1) for a in DATA_AXES)
        entries[batch_axis] = DATA_AXES if x.shape[batch_axis] % data == 0 else P.UNCONSTRAINED
    return tuple(entries)


def _check_seq(x: jax.Array, seq_axis: int, mesh: Mesh, what: str) -> None:
    n = mp_degree(mesh)
    length = x.shape[seq_axis]
    if length % n:
        raise ValueError(
            f"{what}: sequence length {length} (dim {seq_axis} of shape {x.shape}) is not "
            f"divisible by the mp degree {n}; sequence parallel splits the sequence over mp, "
            f"so pad it to a multiple of {n}."
        )


def scatter_to_sequence_parallel(
    x: jax.Array, *, seq_axis: int = 0, mesh: Mesh | None = None
) -> jax.Array:
    """Paddle's ``ScatterOp``: a replicated activation becomes split over the sequence on mp."""
    mesh = layer_mesh(mesh)
    _check_seq(x, seq_axis, mesh, "scatter_to_sequence_parallel")
    return constrain(x, mesh, *_seq_entries(x, seq_axis, MP, mesh))


def gather_from_sequence_parallel(
    x: jax.Array, *, seq_axis: int = 0, mesh: Mesh | None = None
) -> jax.Array:
    """Paddle's ``GatherOp``: a sequence-split activation becomes replicated over mp."""
    mesh = layer_mesh(mesh)
    return constrain(x, mesh, *_seq_entries(x, seq_axis, None, mesh))


all_gather_sequence = gather_from_sequence_parallel
reduce_scatter_sequence = scatter_to_sequence_parallel


# ----- per-device forms: inside a shard_map that is manual over the axis ------------------
Axis = str | tuple[str, ...]


def is_manual(axis: Axis) -> bool:
    """Whether the caller runs inside a ``shard_map`` that is manual over ``axis``.

    There values are per device and an op over ``axis`` is a collective; elsewhere
    arrays are global and the same op is a layout change.

    Example:
      >>> is_manual("mp")
      False
    """
    manual = manual_axes()
    return all(a in manual for a in (axis if isinstance(axis, tuple) else (axis,)))


def _axis_size(axis: Axis) -> int:
    return lax.psum(1, axis)


def _own_piece(x: jax.Array, axis: Axis, dim: int) -> jax.Array:
    n = _axis_size(axis)
    if x.shape[dim] % n:
        raise ValueError(
            f"split over {axis!r}: dim {dim} of shape {x.shape} is {x.shape[dim]}, not "
            f"divisible by the group size {n}; pad it to a multiple of {n}."
        )
    size = x.shape[dim] // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * size, size, axis=dim)


def _axes(axis: Axis) -> tuple[str, ...]:
    return axis if isinstance(axis, tuple) else (axis,)


def _vma(x: Any) -> tuple[str, ...]:
    """The manual axes ``x`` varies over (empty when the ``shard_map`` does not track them)."""
    return tuple(sorted(jax.typeof(x).manual_axis_type.varying))


def _typed(axis: Axis) -> bool:
    """Whether the ``shard_map`` tracks which values vary over ``axis`` (``check_vma``)."""
    return set(_axes(axis)) <= set(_vma(lax.axis_index(axis)))


def _varies(x: jax.Array, axis: Axis) -> bool:
    return set(_axes(axis)) <= set(_vma(x))


def _like(r: jax.Array, vma: tuple[str, ...]) -> jax.Array:
    """``r`` typed as varying over the axes ``vma`` names (a gradient matches its input)."""
    missing = tuple(a for a in vma if a not in _vma(r))
    return lax.pcast(r, missing, to="varying") if missing else r


def split_over(x: jax.Array, axis: Axis, dim: int) -> jax.Array:
    """Per device: this rank's piece of ``x`` on ``dim``; backward all-gathers the gradient.

    Paddle's ``_c_split`` / ``ScatterOp``: ``x`` is the same on every rank of the group,
    so the gradient of the whole is the concatenation of the pieces' gradients. (With
    ``check_vma`` an invariant ``x`` is cast to varying, whose transpose sums the
    zero-padded pieces: the same concatenation.)
    """
    dim %= x.ndim
    if _typed(axis) and not _varies(x, axis):
        return _own_piece(lax.pcast(x, _axes(axis), to="varying"), axis, dim)
    return _split(x, axis, dim, _vma(x))


def concat_over(x: jax.Array, axis: Axis, dim: int) -> jax.Array:
    """Per device: the group's pieces concatenated on ``dim``; backward keeps this rank's piece.

    Paddle's ``_c_concat`` / ``GatherOp``: the output is the same on every rank, so each
    rank's gradient is its own slice of the output gradient.
    """
    dim %= x.ndim
    if _typed(axis):
        # the sum of zero-padded pieces: the same on every rank (typed invariant), and its
        # transpose is this rank's slice; one all-reduce in place of an all-gather
        n = _axis_size(axis)
        shape = (*x.shape[:dim], x.shape[dim] * n, *x.shape[dim + 1 :])
        start = lax.axis_index(axis) * x.shape[dim]
        padded = lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x, start, dim)
        return lax.psum(padded, axis)
    return _concat(x, axis, dim, _vma(x))


def sum_grad_over(x: jax.Array, axis: Axis) -> jax.Array:
    """Per device: identity forward, gradient summed over ``axis`` (Paddle's ``_c_identity``).

    With ``check_vma`` an invariant ``x`` is cast to varying (its transpose is that sum).
    """
    if _typed(axis) and not _varies(x, axis):
        return lax.pcast(x, _axes(axis), to="varying")
    return _identity(x, axis, _vma(x))


def sum_over(x: jax.Array, axis: Axis) -> jax.Array:
    """Per device: sum over ``axis`` forward, gradient passed as is (``_mp_allreduce``)."""
    if _typed(axis):
        return lax.psum(x, axis)  # typed: its transpose passes the gradient as is
    return _allreduce(x, axis, _vma(x))


def _custom(fwd: Any, bwd: Any) -> Any:
    """A ``custom_vjp`` op ``f(x, axis, *static, vma)`` whose backward is ``bwd(g, axis,
    *static)``, its result typed like the input (varying over the axes ``vma`` names)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
    def op(x, axis, static, vma):
        return fwd(x, axis, *static)

    op.defvjp(
        lambda x, axis, static, vma: (fwd(x, axis, *static), None),
        lambda axis, static, vma, _, g: (_like(bwd(g, axis, *static), vma),),
    )
    return lambda x, axis, *rest: op(x, axis, rest[:-1], rest[-1])


_split = _custom(_own_piece, lambda g, axis, dim: lax.all_gather(g, axis, axis=dim, tiled=True))
_concat = _custom(lambda x, axis, dim: lax.all_gather(x, axis, axis=dim, tiled=True), _own_piece)
_identity = _custom(lambda x, axis: x, lambda g, axis: lax.psum(g, axis))
_allreduce = _custom(lambda x, axis: lax.psum(x, axis), lambda g, axis: g)


def _local_all_gather(x: jax.Array, axis: Axis, dim: int) -> jax.Array:
    return lax.all_gather(x, axis, axis=dim % x.ndim, tiled=True)


def _local_reduce_scatter(x: jax.Array, axis: Axis, dim: int) -> jax.Array:
    dim %= x.ndim
    n = _axis_size(axis)
    if x.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter over {axis!r}: dim {dim} of shape {x.shape} is not divisible by "
            f"the group size {n}; pad it to a multiple of {n}."
        )
    return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


class _Op:
    """Paddle's ``XOp.apply(x)``: a layout change on global arrays, a collective per device.

    Inside a ``shard_map`` manual over ``mp`` the op is Paddle's: ``x`` is this rank's
    ``[s/n, b, h]`` (or ``[s, b, h]``) piece and the forward / backward collectives are
    those of the class docstring.
    """

    fn: Any = None
    local: Any = None

    @classmethod
    def apply(cls, x: jax.Array, *, seq_axis: int = 0, mesh: Mesh | None = None) -> jax.Array:
        if is_manual(MP):
            return cls.local(x, MP, seq_axis)
        return cls.fn(x, seq_axis=seq_axis, mesh=mesh)


class ScatterOp(_Op):
    """Split the sequence over mp (backward: gather)."""

    fn = staticmethod(scatter_to_sequence_parallel)
    local = staticmethod(split_over)


class GatherOp(_Op):
    """Replicate a sequence-split activation (backward: split)."""

    fn = staticmethod(gather_from_sequence_parallel)
    local = staticmethod(concat_over)


class AllGatherOp(_Op):
    """All-gather the sequence (backward: reduce-scatter)."""

    fn = staticmethod(all_gather_sequence)
    local = staticmethod(_local_all_gather)


class ReduceScatterOp(_Op):
    """Reduce-scatter to sequence-split (backward: all-gather)."""

    fn = staticmethod(reduce_scatter_sequence)
    local = staticmethod(_local_reduce_scatter)


def mark_as_sequence_parallel_parameter(parameter: nnx.Variable) -> nnx.Variable:
    """Marks a parameter used on sequence-split activations (Paddle's API).

    Paddle all-reduces such parameters' gradients over mp with hooks; in SPMD the
    compiler already sums them, so the mark is only recorded
    (:func:`is_sequence_parallel_parameter`).
    """
    if not isinstance(parameter, nnx.Variable):
        raise TypeError(
            f"parameter={type(parameter).__name__} is not an nnx.Variable; pass e.g. "
            "layer_norm.scale."
        )
    parameter.set_metadata(sequence_parallel=True)
    return parameter


def is_sequence_parallel_parameter(parameter: nnx.Variable) -> bool:
    """Whether :func:`mark_as_sequence_parallel_parameter` marked this parameter."""
    return bool(parameter.get_metadata().get("sequence_parallel", False))


def register_sequence_parallel_allreduce_hooks(model: nnx.Module, *args: Any, **kwargs: Any):
    """Paddle's hook registration: nothing to register under SPMD (logged once)."""
    logger.info(
        "register_sequence_parallel_allreduce_hooks: SPMD sums sequence-parallel gradients "
        "over mp already; nothing to register"
    )
    return model


def _wide(mesh: Mesh, dtype: Any) -> bool:
    # XLA:CPU aborts compiling 16-bit reductions inside a partial-manual shard_map
    # (see layers.masked_vocab_lookup); reduce in float32 there.
    return mesh.devices.flat[0].platform == "cpu" and jnp.dtype(dtype).itemsize < 4


class ColumnSequenceParallelLinear(ColumnParallelLinear):
    """Column-parallel linear whose input is split over the sequence on mp.

    The input ``[..., s, ..., in]`` (sequence on ``seq_axis``, split over mp) is
    all-gathered over the sequence, multiplied by the column-split kernel; the output
    is split over mp on its last dim (``gather_output`` must be False, as in Paddle).
    Same parameters and initialisation as :class:`ColumnParallelLinear`.
    """

    def __init__(self, in_features: int, out_features: int, *, seq_axis: int = 0, **kwargs):
        if kwargs.get("gather_output", False):
            raise ValueError(
                "ColumnSequenceParallelLinear(gather_output=True): the output of a sequence-"
                "parallel column layer stays split over mp; use gather_output=False."
            )
        kwargs["gather_output"] = False
        super().__init__(in_features, out_features, **kwargs)
        self.seq_axis = seq_axis

    def __call__(self, x: jax.Array) -> jax.Array:
        if mp_degree(self.mesh) == 1:
            return super().__call__(_check_width(self, x, ""))
        x, kernel, bias, seq_axis = _operands(self, x, "")
        mesh = self.mesh
        x = constrain(x, mesh, *_seq_entries(x, seq_axis, MP, mesh))
        batch, manual = _manual_batch(x, seq_axis, mesh)
        x_spec = P(*_dims(x.ndim, {seq_axis: MP, **batch}))
        y_spec = P(*_dims(x.ndim, {x.ndim - 1: MP, **batch}))

        def body(x, kernel, *bias):
            full = lax.all_gather(x, MP, axis=seq_axis, tiled=True)
            y = lax.dot_general(full, kernel, (((x.ndim - 1,), (0,)), ((), ())))
            return y + bias[0] if bias else y

        args = (x, kernel) + ((bias,) if bias is not None else ())
        specs = (x_spec, P(None, MP)) + ((P(MP),) if bias is not None else ())
        y = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=y_spec, axis_names=manual)(
            *args
        )
        return constrain(y, mesh, *_data_first(y, seq_axis, mesh), MP)


class RowSequenceParallelLinear(RowParallelLinear):
    """Row-parallel linear whose output is reduce-scattered over the sequence on mp.

    The input is split over mp on its last dim (``input_is_parallel`` must be True,
    as in Paddle); each rank multiplies its slice and the partial sums are
    reduce-scattered, leaving the output split over the sequence on ``seq_axis``. The
    replicated bias is added after the reduction.
    """

    def __init__(self, in_features: int, out_features: int, *, seq_axis: int = 0, **kwargs):
        if not kwargs.get("input_is_parallel", True):
            raise ValueError(
                "RowSequenceParallelLinear(input_is_parallel=False): its input is the split "
                "output of a column layer; use input_is_parallel=True."
            )
        kwargs["input_is_parallel"] = True
        super().__init__(in_features, out_features, **kwargs)
        self.seq_axis = seq_axis

    def __call__(self, x: jax.Array) -> jax.Array:
        extra = " (the global width, split over mp)"
        if mp_degree(self.mesh) == 1:
            return super().__call__(_check_width(self, x, extra))
        x, kernel, bias, seq_axis = _operands(self, x, extra)
        mesh = self.mesh
        out_dtype = x.dtype
        wide = _wide(mesh, out_dtype)
        batch, manual = _manual_batch(x, seq_axis, mesh)
        x_spec = P(*_dims(x.ndim, {x.ndim - 1: MP, **batch}))
        y_spec = P(*_dims(x.ndim, {seq_axis: MP, **batch}))

        def body(x, kernel):
            y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
            if wide:
                y = y.astype(jnp.float32)
            y = lax.psum_scatter(y, MP, scatter_dimension=seq_axis, tiled=True)
            return y.astype(out_dtype)

        y = jax.shard_map(
            body, mesh=mesh, in_specs=(x_spec, P(MP, None)), out_specs=y_spec, axis_names=manual
        )(x, kernel)
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return constrain(y, mesh, *_seq_entries(y, seq_axis, MP, mesh))


def _check_width(layer: Any, x: jax.Array, extra: str) -> jax.Array:
    if x.shape[-1] != layer.in_features:
        raise ValueError(
            f"{type(layer).__name__}: the input's last dim is {x.shape[-1]}, expected "
            f"in_features={layer.in_features}{extra}."
        )
    return x


def _operands(layer: Any, x: jax.Array, extra: str):
    """The checked input, kernel and bias in the compute dtype, and the sequence axis."""
    _check_width(layer, x, extra)
    seq_axis = layer.seq_axis % x.ndim
    _check_seq(x, seq_axis, layer.mesh, type(layer).__name__)
    kernel = layer.kernel[...]
    bias = layer.bias[...] if layer.bias is not None else None
    x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=layer.dtype)
    return x, kernel, bias, seq_axis


def _dims(ndim: int, entries: dict[int, Any]) -> tuple[Any, ...]:
    return tuple(entries.get(d) for d in range(ndim))


def _manual_batch(x: jax.Array, seq_axis: int, mesh: Mesh) -> tuple[dict[int, Any], set[str]]:
    """The batch dim's spec entry and the manual axes of the layer's ``shard_map``.

    The data axes are made manual too when they divide the batch, so the batch stays
    split inside the layer (left automatic, the compiler gathers it).
    """
    data = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    batch_axis = 1 if seq_axis == 0 else 0
    size = math.prod(mesh.shape[a] for a in data)
    if x.ndim >= 2 and data and x.shape[batch_axis] % size == 0:
        return {batch_axis: data}, {MP, *data}
    return {}, {MP}


def _data_first(y: jax.Array, seq_axis: int, mesh: Mesh) -> tuple[Any, ...]:
    """Entries for all but the last dim: the batch dim on the data axes when they divide it."""
    return _seq_entries(y, seq_axis, None, mesh)[:-1]

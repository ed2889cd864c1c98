"""Megatron tensor-parallel layers: Paddle's ``fleet.meta_parallel`` layers as Flax NNX modules.

Each layer keeps its *global* parameter (``[in, out]`` kernel, ``[vocab, hidden]``
table) as one ``jax.Array`` split over the mesh's ``mp`` axis, with the split in the
Param's ``out_sharding`` metadata, so the engine and ZeRO place it from there. The
forward pass only pins activations (:func:`~jfleet.mesh.layer_mesh.constrain`)
and XLA inserts Megatron's collectives:

* :class:`ColumnParallelLinear` — kernel ``(None, "mp")``, bias ``("mp",)``; the
  output is split over ``mp`` on its last dim, or replicated (all-gathered) when
  ``gather_output``.
* :class:`RowParallelLinear` — kernel ``("mp", None)``, bias replicated and added once
  after the reduction; the input is split over ``mp`` on its last dim (a replicated
  input is sliced locally), the output replicated: one all-reduce over ``mp``.
* :class:`VocabParallelEmbedding` — table ``("mp", None)``; Paddle's masked lookup in
  a ``shard_map`` over ``mp``: each shard looks up the ids in its vocabulary range,
  zeros elsewhere, and a ``psum`` over ``mp`` adds them (the table is never
  gathered).

Column (``gather_output=False``) -> elementwise -> Row (``input_is_parallel=True``)
costs one all-reduce over ``mp`` forward, as in Megatron. Activations keep their
leading (batch) dimension split over the data axes (``dp`` x ``sharding``) when it
divides; middle dimensions are replicated.

**Initialisation contract** (see :mod:`jfleet.parallel.random`): by default
(``init_mode="replicable"``) a layer draws its full parameters with the same keys, in
the same order, as the Flax layer it replaces, then places them split. So
``ColumnParallelLinear(i, o, has_bias=True, rngs=nnx.Rngs(s))`` and
``RowParallelLinear(i, o, rngs=nnx.Rngs(s))`` equal ``nnx.Linear(i, o,
rngs=nnx.Rngs(s))``, ``VocabParallelEmbedding(v, h, rngs=nnx.Rngs(s))`` equals
``nnx.Embed(v, h, rngs=nnx.Rngs(s))``, and a model built from these layers is the
same at every mp degree. ``init_mode="paddle"`` draws each mp shard of the kernel from
its rank's local seed, as Paddle does.

Paddle's arguments that mean nothing under SPMD are accepted and ignored:
``fuse_matmul_bias`` (XLA fuses the bias add), ``name`` (op naming). ``weight_attr``
is not accepted: pass ``kernel_init`` / ``bias_init`` / ``embedding_init``. ``mp_group``
may only be the fleet's ``mp`` group; pass ``mesh=`` for another mesh.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> up = ColumnParallelLinear(8, 16, gather_output=False, rngs=nnx.Rngs(0))
  >>> down = RowParallelLinear(16, 8, input_is_parallel=True, rngs=nnx.Rngs(1))
  >>> y = down(nnx.gelu(up(jnp.ones((4, 8)))))
  >>> up.kernel.sharding.spec, down.kernel.sharding.spec, y.shape
  (P(None, 'mp'), P('mp', None), (4, 8))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh.layer_mesh import (
    constrain,
    layer_mesh,
    mp_degree,
    named,
    shard_map_mesh,
)
from jfleet.mesh.topology import DATA_AXES, MP
from jfleet.parallel import random as tp_random

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "activation_entries",
    "draw_param",
    "init_sharded",
    "masked_vocab_lookup",
]

Initializer = Any  # (key, shape, dtype) -> jax.Array, as flax's initializers

#: nnx.Linear's default kernel initialiser.
default_kernel_init = nnx.initializers.lecun_normal()
#: nnx.Linear's default bias initialiser.
default_bias_init = nnx.initializers.zeros_init()
#: nnx.Embed's default table initialiser.
default_embed_init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


# ------------------------------------------------------------------ shared pieces
@functools.partial(jax.jit, static_argnames=("init_fn", "shape", "dtype", "target", "axis"))
def _draw(keys, *, init_fn, shape, dtype, target, axis):
    if axis is None:
        value = init_fn(keys[0], shape, dtype)
    else:
        part = list(shape)
        part[axis] //= len(keys)
        value = jnp.concatenate([init_fn(k, tuple(part), dtype) for k in keys], axis=axis)
    return value if target is None else lax.with_sharding_constraint(value, target)


def init_sharded(
    init_fn: Initializer,
    key: jax.Array | Sequence[jax.Array],
    shape: Sequence[int],
    dtype: Any,
    sharding: NamedSharding,
    *,
    axis: int | None = None,
) -> jax.Array:
    """Draws a parameter straight into ``sharding``.

    With Flax's eager sharding off (``nnx.use_eager_sharding(False)``) the draw is left
    unplaced, as Flax leaves its own variables. With one key, ``init_fn(key, shape,
    dtype)``: the values are those of the
    unsharded draw (``jax_threefry_partitionable``), but no device holds the whole
    array. With a sequence of ``n`` keys and ``axis``, the concatenation along
    ``axis`` of ``n`` draws of the shard shape, key ``r`` for shard ``r`` (Paddle's
    per-rank draw).

    Example:
      >>> import jax
      >>> from jfleet import fleet
      >>> from jfleet.mesh.layer_mesh import layer_mesh, named
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> x = init_sharded(default_kernel_init, jax.random.key(0), (4, 8), jnp.float32,
      ...                  named(layer_mesh(), None, "dp"))
      >>> x.sharding.spec
      P(None, 'dp')
    """
    keys = tuple(key) if axis is not None else (key,)
    # Flax's eager sharding off (nnx.use_eager_sharding(False)): the draw is not laid out,
    # as Flax then lays out no variable (a program that places what it makes, e.g. a
    # pipeline stage's creation in jfleet.mesh.create)
    target = sharding if nnx.using_eager_sharding() else None
    return _draw(keys, init_fn=init_fn, shape=tuple(shape), dtype=dtype, target=target, axis=axis)


def draw_param(
    init_fn: Initializer,
    key: jax.Array,
    shape: Sequence[int],
    dtype: Any,
    mesh: Mesh,
    *entries: Any,
    split_axis: int | None = None,
    init_mode: str | None = None,
) -> nnx.Param:
    """A ``Param`` of ``shape`` placed as ``P(*entries)`` on ``mesh``, with that metadata.

    The tensor-parallel layers' one way to create parameters. ``split_axis`` names
    the dimension split over ``mp``: in ``"paddle"`` init mode with an mp degree
    above 1 that dimension's shards come from the tracker's ``"model_parallel_rng"``
    per-rank keys (``key`` is then unused); otherwise the full array is drawn with
    ``key``.

    Raises:
      RuntimeError: ``"paddle"`` mode without ``model_parallel_random_seed``.
    """
    sharding = named(mesh, *entries)
    mode = tp_random.resolve_init_mode(init_mode)
    n = mp_degree(mesh)
    if mode == "paddle" and split_axis is not None and n > 1:
        tracker = tp_random.get_rng_state_tracker()
        if tp_random.MODEL_PARALLEL_RNG not in tracker.states_:
            raise RuntimeError(
                "init_mode='paddle' draws each mp shard from the tracker's "
                f"'{tp_random.MODEL_PARALLEL_RNG}' stream, which is not seeded; call "
                "jfleet.parallel.random.model_parallel_random_seed(seed) after fleet.init "
                "(or set strategy.tensor_parallel_configs['tensor_init_seed'])."
            )
        keys = tracker.shard_keys(tp_random.MODEL_PARALLEL_RNG, n)
        value = init_sharded(init_fn, keys, shape, dtype, sharding, axis=split_axis)
    else:
        value = init_sharded(init_fn, key, shape, dtype, sharding)
    return nnx.Param(value, out_sharding=tuple(sharding.spec), mesh=mesh)


def activation_entries(mesh: Mesh, shape: Sequence[int], last: Any) -> tuple[Any, ...]:
    """Spec entries for an activation: batch over the data axes, ``last`` on the last dim.

    The leading dimension (for rank >= 2) is split over ``dp x sharding x ep`` when
    they divide it and left to the compiler otherwise; middle dimensions are
    replicated, so every layer's output layout is fixed.

    Example:
      >>> from jfleet import fleet
      >>> from jfleet.mesh.layer_mesh import layer_mesh
      >>> _ = fleet.init(is_collective=True, log_level="WARNING")
      >>> activation_entries(layer_mesh(), (8, 3, 4), "mp")[0]
      ('dp', 'sharding', 'ep')
    """
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (last,)
    data = math.prod(mesh.shape.get(a, 1) for a in DATA_AXES)
    batch = DATA_AXES if shape[0] % data == 0 else P.UNCONSTRAINED
    return (batch,) + (None,) * (len(shape) - 2) + (last,)


def _mp_group_ok(mp_group: Any, cls: str) -> None:
    if mp_group is None:
        return
    if getattr(mp_group, "axis_name", None) != MP:
        raise ValueError(
            f"{cls}: mp_group={mp_group!r} is not the fleet's model-parallel group; jfleet "
            "layers split over the mesh's 'mp' axis. Leave mp_group=None (or pass mesh=...)."
        )


def _positive(cls: str, **sizes: Any) -> None:
    for name, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{cls}: {name}={v!r} must be a positive int.")


def _divisible(cls: str, what: str, size: int, mesh: Mesh, hint: str) -> None:
    n = mp_degree(mesh)
    if size % n:
        raise ValueError(
            f"{cls}: {what}={size} is not divisible by the mp degree {n}; each of the {n} mp "
            f"ranks must hold an equal slice. {hint}"
        )


def _check_width(cls: str, x: jax.Array, in_features: int, extra: str = "") -> None:
    if x.ndim == 0 or x.shape[-1] != in_features:
        last = x.shape[-1] if x.ndim else "none (a scalar)"
        raise ValueError(
            f"{cls}: input of shape {tuple(x.shape)} has last dim {last}, but in_features="
            f"{in_features}.{extra}"
        )


def _bias_flag(has_bias: bool | None, use_bias: bool | None, default: bool) -> bool:
    if has_bias is not None and use_bias is not None and bool(has_bias) != bool(use_bias):
        raise ValueError(
            f"has_bias={has_bias!r} (Paddle's name) and use_bias={use_bias!r} (Flax's name) "
            "disagree; pass one of them."
        )
    if use_bias is not None:
        return bool(use_bias)
    if has_bias is not None:
        return bool(has_bias)
    return default


class _ParallelLinear(nnx.Module):
    """What Column and Row share: the dense product and the Paddle attribute aliases."""

    def _init_linear(
        self, in_features, out_features, *, split_axis, kernel_init, bias_init, bias_entries,
        param_dtype, dtype, precision, fuse_matmul_bias, init_mode, mesh, rngs,
    ) -> None:  # fmt: skip
        """Draws the kernel (split on ``split_axis`` over mp) then the bias, Flax's key order."""
        kernel_entries = (None, MP) if split_axis == 1 else (MP, None)
        self.kernel = draw_param(
            kernel_init, rngs.params(), (in_features, out_features), param_dtype, mesh,
            *kernel_entries, split_axis=split_axis, init_mode=init_mode,
        )  # fmt: skip
        self.bias: nnx.Param | None
        if self.use_bias:
            self.bias = draw_param(
                bias_init, rngs.params(), (out_features,), param_dtype, mesh, *bias_entries
            )
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_matmul_bias = bool(fuse_matmul_bias)
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.mesh = mesh

    def _matmul(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        x, kernel, bias = dtypes.promote_dtype((x, kernel, bias), dtype=self.dtype)
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision)
        return y, bias

    @property
    def weight(self) -> nnx.Param:
        """Paddle's name for :attr:`kernel` (read-only alias)."""
        return self.kernel

    @property
    def has_bias(self) -> bool:
        """Paddle's name for ``use_bias``."""
        return self.use_bias

    @property
    def world_size(self) -> int:
        """The mp degree (Paddle's attribute)."""
        return mp_degree(self.mesh)

    @property
    def is_mp(self) -> bool:
        """Whether the layer is split (mp degree above 1)."""
        return self.world_size > 1


# ------------------------------------------------------------------ Column
class ColumnParallelLinear(_ParallelLinear):
    """A linear layer whose kernel ``[in, out]`` is split over ``mp`` on the output dim.

    Paddle's ``fleet.meta_parallel.ColumnParallelLinear`` with Flax's signature.
    The kernel is ``P(None, "mp")``, the bias ``P("mp")``. The input is used as it
    comes (replicated over ``mp`` in a Megatron block); the output is split over
    ``mp`` on its last dim, or replicated there when ``gather_output`` (XLA
    all-gathers).

    Args:
      in_features: input width.
      out_features: output width (global); the mp degree must divide it.
      has_bias: Paddle's flag; None (Paddle's default) means no bias.
      gather_output: return the full output on every mp rank (True) or leave it
        split over ``mp`` for a following :class:`RowParallelLinear` (False).
      fuse_matmul_bias: accepted for Paddle; XLA fuses the bias add anyway.
      use_bias: Flax's name for ``has_bias`` (give one).
      dtype: computation dtype (default: inferred from input and params).
      param_dtype: parameter storage dtype.
      precision: ``lax.dot_general`` precision.
      kernel_init: kernel initialiser (``nnx.Linear``'s default).
      bias_init: bias initialiser (zeros).
      init_mode: ``"replicable"`` or ``"paddle"``; default the one set with
        :func:`jfleet.parallel.random.set_init_mode`.
      mesh: the mesh (default: the fleet's hybrid mesh).
      mp_group: accepted for Paddle; must be the fleet's mp group or None.
      name: accepted for Paddle; no effect.
      rngs: ``params`` keys: the kernel's, then the bias's (as ``nnx.Linear``).

    Raises:
      ValueError: sizes that are not positive ints, ``out_features`` not divisible
        by the mp degree, ``has_bias`` and ``use_bias`` disagreeing, a foreign
        ``mp_group``; on call, an input whose last dim is not ``in_features``.
      RuntimeError: no mesh (``fleet.init`` not called).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jfleet import fleet
      >>> s = fleet.DistributedStrategy()
      >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
      >>> layer = ColumnParallelLinear(4, 8, has_bias=True, gather_output=False,
      ...                              rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 4))).sharding.spec
      P(('dp', 'sharding', 'ep'), 'mp')
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        has_bias: bool | None = None,
        gather_output: bool = True,
        fuse_matmul_bias: bool = False,
        use_bias: bool | None = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        init_mode: str | None = None,
        mesh: Mesh | None = None,
        mp_group: Any = None,
        name: str | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        cls = type(self).__name__
        _positive(cls, in_features=in_features, out_features=out_features)
        _mp_group_ok(mp_group, cls)
        mesh = layer_mesh(mesh)
        _divisible(
            cls, "out_features", out_features, mesh, "Use an out_features that is a multiple of it."
        )
        self.use_bias = _bias_flag(has_bias, use_bias, default=False)
        self._init_linear(
            in_features, out_features, split_axis=1, kernel_init=kernel_init,
            bias_init=bias_init, bias_entries=(MP,), param_dtype=param_dtype, dtype=dtype,
            precision=precision, fuse_matmul_bias=fuse_matmul_bias, init_mode=init_mode,
            mesh=mesh, rngs=rngs,
        )  # fmt: skip
        self.output_size_per_partition = out_features // mp_degree(mesh)
        self.gather_output = bool(gather_output)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x @ kernel + bias`` over the last dim; split over ``mp`` unless ``gather_output``.

        Raises:
          ValueError: the input's last dim is not ``in_features``.
        """
        _check_width(type(self).__name__, x, self.in_features)
        y, bias = self._matmul(x)
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        last = None if self.gather_output else MP
        return constrain(y, self.mesh, *activation_entries(self.mesh, y.shape, last))


# ------------------------------------------------------------------ Row
class RowParallelLinear(_ParallelLinear):
    """A linear layer whose kernel ``[in, out]`` is split over ``mp`` on the input dim.

    Paddle's ``fleet.meta_parallel.RowParallelLinear`` with Flax's signature. The
    kernel is ``P("mp", None)``; the input is split over ``mp`` on its last dim, each
    rank multiplies its slice, the partial sums are all-reduced over ``mp`` (XLA
    inserts it for the replicated output), then the replicated bias is added once.

    Args:
      in_features: input width (global); the mp degree must divide it.
      out_features: output width.
      has_bias: whether to add a bias (default, None: True, as in Paddle).
      input_is_parallel: the input is already split over ``mp`` on its last dim (the
        output of ``ColumnParallelLinear(gather_output=False)``). Either way the
        input is the global array of full width ``in_features``; when False a
        replicated input is sliced locally, which costs no communication.
      fuse_matmul_bias: accepted for Paddle; XLA fuses the bias add anyway.
      use_bias: Flax's name for ``has_bias`` (give one).
      dtype: computation dtype (default: inferred from input and params).
      param_dtype: parameter storage dtype.
      precision: ``lax.dot_general`` precision.
      kernel_init: kernel initialiser (``nnx.Linear``'s default).
      bias_init: bias initialiser (zeros).
      init_mode: ``"replicable"`` or ``"paddle"`` (see :mod:`jfleet.parallel.random`).
      mesh: the mesh (default: the fleet's hybrid mesh).
      mp_group: accepted for Paddle; must be the fleet's mp group or None.
      name: accepted for Paddle; no effect.
      rngs: ``params`` keys: the kernel's, then the bias's (as ``nnx.Linear``).

    Raises:
      ValueError: sizes that are not positive ints, ``in_features`` not divisible by
        the mp degree, ``has_bias`` and ``use_bias`` disagreeing, a foreign
        ``mp_group``; on call, an input whose last dim is not ``in_features``.
      RuntimeError: no mesh (``fleet.init`` not called).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jfleet import fleet
      >>> s = fleet.DistributedStrategy()
      >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
      >>> layer = RowParallelLinear(8, 4, rngs=nnx.Rngs(0))
      >>> layer.kernel.sharding.spec, layer(jnp.ones((2, 8))).sharding.spec
      (P('mp', None), P(('dp', 'sharding', 'ep'), None))
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        has_bias: bool | None = None,
        input_is_parallel: bool = False,
        fuse_matmul_bias: bool = False,
        use_bias: bool | None = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = default_kernel_init,
        bias_init: Initializer = default_bias_init,
        init_mode: str | None = None,
        mesh: Mesh | None = None,
        mp_group: Any = None,
        name: str | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        cls = type(self).__name__
        _positive(cls, in_features=in_features, out_features=out_features)
        _mp_group_ok(mp_group, cls)
        mesh = layer_mesh(mesh)
        _divisible(
            cls, "in_features", in_features, mesh, "Use an in_features that is a multiple of it."
        )
        self.use_bias = _bias_flag(has_bias, use_bias, default=True)
        self._init_linear(
            in_features, out_features, split_axis=0, kernel_init=kernel_init,
            bias_init=bias_init, bias_entries=(), param_dtype=param_dtype, dtype=dtype,
            precision=precision, fuse_matmul_bias=fuse_matmul_bias, init_mode=init_mode,
            mesh=mesh, rngs=rngs,
        )  # fmt: skip
        self.input_size_per_partition = in_features // mp_degree(mesh)
        self.input_is_parallel = bool(input_is_parallel)

    def __call__(self, x: jax.Array) -> jax.Array:
        """The input split over ``mp`` on its last dim, times the kernel, all-reduced, + bias.

        Raises:
          ValueError: the input's last dim is not ``in_features`` (with
            ``input_is_parallel`` too: the input is the global array, full width).
        """
        cls = type(self).__name__
        extra = ""
        if self.input_is_parallel:
            extra = (
                f" With input_is_parallel=True the input is still the global array of full "
                f"width in_features={self.in_features}, split over mp on its last dim (each "
                f"of the {self.world_size} mp ranks holds {self.input_size_per_partition}); "
                "pass the output of ColumnParallelLinear(..., gather_output=False) as it is, "
                "not a per-rank slice."
            )
        _check_width(cls, x, self.in_features, extra)
        x = constrain(x, self.mesh, *activation_entries(self.mesh, x.shape, MP))
        y, bias = self._matmul(x)
        y = constrain(y, self.mesh, *activation_entries(self.mesh, y.shape, None))
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


# ------------------------------------------------------------------ Embedding
def masked_vocab_lookup(table: jax.Array, ids: jax.Array, mesh: Mesh) -> jax.Array:
    """Rows ``ids`` of a table split over ``mp`` on dim 0, without gathering the table.

    Paddle's ``c_lookup_table`` + all-reduce: in a ``shard_map`` over ``mp`` (other
    axes left to the compiler) each shard looks up the ids in its vocabulary range,
    writes zeros for the others, and a ``psum`` over ``mp`` adds the shards. Negative
    ids count from the end (as ``jnp.take``); ids outside ``[-vocab, vocab)`` give
    zero rows (Paddle's behaviour).

    Args:
      table: ``[vocab, hidden]``, the global table.
      ids: integer array of any shape.
      mesh: the mesh whose ``mp`` axis splits the table.

    Returns:
      ``ids.shape + (hidden,)``, replicated over ``mp``.
    """
    vocab = table.shape[0]
    ids = jnp.where(ids < 0, ids + vocab, ids)

    def local(t: jax.Array, i: jax.Array, start: jax.Array | int) -> jax.Array:
        rows = t.shape[0]
        pos = i - start
        hit = (pos >= 0) & (pos < rows)
        out = jnp.take(t, jnp.where(hit, pos, 0), axis=0, mode="clip")
        return jnp.where(hit[..., None], out, jnp.zeros((), out.dtype))

    if mp_degree(mesh) == 1:  # a size-1 manual axis makes XLA reject the psum
        return local(table, ids, 0)

    # XLA:CPU aborts compiling a 16-bit psum inside a partial-manual shard_map (its
    # all-reduce promotion cannot clone the reducer Shardy emits). Each output element
    # is one row plus zeros, so summing in float32 and casting back is exact.
    wide = mesh.devices.flat[0].platform == "cpu" and jnp.dtype(table.dtype).itemsize < 4

    def body(t: jax.Array, i: jax.Array) -> jax.Array:
        start = lax.axis_index(MP) * t.shape[0]
        part = local(t, i, start)
        if wide:
            return lax.psum(part.astype(jnp.float32), MP).astype(part.dtype)
        return lax.psum(part, MP)

    return jax.shard_map(
        body,
        mesh=shard_map_mesh(mesh),
        in_specs=(P(MP, None), P()),
        out_specs=P(),
        axis_names={MP},
    )(table, ids)


class VocabParallelEmbedding(nnx.Module):
    """An embedding table ``[vocab, hidden]`` split over ``mp`` on the vocabulary dim.

    Paddle's ``fleet.meta_parallel.VocabParallelEmbedding`` with ``nnx.Embed``'s
    signature. The lookup is Paddle's masked lookup (:func:`masked_vocab_lookup`):
    one all-reduce over ``mp`` of the ``ids.shape + (hidden,)`` output, no all-gather
    of the table. :meth:`attend` gives logits split over the vocabulary for a tied
    head (feed them to ``ParallelCrossEntropy``).

    Args:
      num_embeddings: vocabulary size; the mp degree must divide it.
      embedding_dim: hidden size.
      dtype: computation dtype (default: the table's).
      param_dtype: table storage dtype.
      embedding_init: table initialiser (``nnx.Embed``'s default).
      init_mode: ``"replicable"`` or ``"paddle"`` (see :mod:`jfleet.parallel.random`).
      mesh: the mesh (default: the fleet's hybrid mesh).
      mp_group: accepted for Paddle; must be the fleet's mp group or None.
      name: accepted for Paddle; no effect.
      rngs: one ``params`` key for the table (as ``nnx.Embed``).

    Raises:
      ValueError: sizes that are not positive ints, ``num_embeddings`` not divisible
        by the mp degree, a foreign ``mp_group``; on call, non-integer ids; in
        :meth:`attend`, a query whose last dim is not ``embedding_dim``.
      RuntimeError: no mesh (``fleet.init`` not called).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from jfleet import fleet
      >>> s = fleet.DistributedStrategy()
      >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
      >>> emb = VocabParallelEmbedding(16, 4, rngs=nnx.Rngs(0))
      >>> h = emb(jnp.array([[1, 15], [0, 7]]))
      >>> h.shape, emb.attend(h).sharding.spec
      ((2, 2, 4), P(('dp', 'sharding', 'ep'), None, 'mp'))
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Initializer = default_embed_init,
        init_mode: str | None = None,
        mesh: Mesh | None = None,
        mp_group: Any = None,
        name: str | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        cls = type(self).__name__
        _positive(cls, num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        _mp_group_ok(mp_group, cls)
        mesh = layer_mesh(mesh)
        _divisible(
            cls,
            "num_embeddings",
            num_embeddings,
            mesh,
            "Pad the vocabulary to a multiple of it (extra rows are never looked up).",
        )
        self.embedding = draw_param(
            embedding_init,
            rngs.params(),
            (num_embeddings, embedding_dim),
            param_dtype,
            mesh,
            MP,
            None,
            split_axis=0,
            init_mode=init_mode,
        )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.features = embedding_dim
        self.per_part_size = num_embeddings // mp_degree(mesh)
        self.dtype = dtype or self.embedding.dtype
        self.param_dtype = param_dtype
        self.mesh = mesh

    @property
    def weight(self) -> nnx.Param:
        """Paddle's name for :attr:`embedding` (read-only alias)."""
        return self.embedding

    @property
    def world_size(self) -> int:
        """The mp degree (Paddle's attribute)."""
        return mp_degree(self.mesh)

    @property
    def is_mp(self) -> bool:
        """Whether the table is split (mp degree above 1)."""
        return self.world_size > 1

    def __call__(self, ids: jax.Array) -> jax.Array:
        """The rows of ``ids`` (any shape), ``ids.shape + (embedding_dim,)``, replicated on mp.

        Raises:
          ValueError: ids that are not integers.
        """
        ids = jnp.asarray(ids)
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"{type(self).__name__}: ids have dtype {ids.dtype}; pass integer token ids."
            )
        (table,) = dtypes.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        ids = constrain(ids, self.mesh, *activation_entries(self.mesh, (*ids.shape, 1), None)[:-1])
        out = masked_vocab_lookup(table, ids, self.mesh)
        return constrain(out, self.mesh, *activation_entries(self.mesh, out.shape, None))

    def attend(self, query: jax.Array) -> jax.Array:
        """Logits ``query @ table.T``, split over ``mp`` on the vocabulary (last) dim.

        Raises:
          ValueError: the query's last dim is not ``embedding_dim``.
        """
        if query.ndim == 0 or query.shape[-1] != self.embedding_dim:
            raise ValueError(
                f"{type(self).__name__}.attend: query of shape {tuple(query.shape)} must have "
                f"last dim embedding_dim={self.embedding_dim}."
            )
        query, table = dtypes.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        logits = jnp.dot(query, table.T)
        return constrain(logits, self.mesh, *activation_entries(self.mesh, logits.shape, MP))

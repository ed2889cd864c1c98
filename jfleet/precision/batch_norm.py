"""Batch-norm statistics across data-parallel replicas: Paddle's ``sync_batch_norm``.

Under SPMD one ``nnx.BatchNorm`` call sees the whole global batch, wherever its rows live,
so by itself it computes global statistics. Paddle's data parallel runs one copy of the
model per replica instead: each normalises with the statistics of its own rows unless
``strategy.sync_batch_norm`` (or ``paddle.nn.SyncBatchNorm``) reduces them over the
replicas. jfleet gives both meanings to the user's own ``nnx.BatchNorm`` modules
(:func:`apply_batch_norm`, called where ``fleet.distributed_model`` prepares a model):

* ``sync_batch_norm=True``: statistics over the whole (data-sharded) batch, equal to one
  device on the global batch; XLA all-reduces the per-device sums.
* ``sync_batch_norm=False`` (Paddle's default) with R = dp x sharding x ep > 1: the batch's
  leading dimension is cut into R contiguous parts, the rows each data-parallel replica
  holds, and each part is normalised with its own mean and variance, as R separate copies
  of the module would (no collective in the forward pass). The leading dimension of a
  batch-norm input must then be the batch and divisible by R.
* Running averages: a global array holds one value for all replicas, so they follow the
  replica mean of the statistics (the mean of the per-replica means and of the per-replica
  biased variances). Paddle keeps one set per replica and saves rank 0's.

The same holds inside the engine's per-replica step (``shard_map`` over the data axes, for
``fp16_allreduce`` and DGC), where a module sees one replica's rows: its own statistics,
or (sync) the replicas' all-reduced ones. Evaluation (``use_running_average=True``,
``model.eval()``) uses the running averages in both modes. A module with its own
``axis_name`` (synchronised by the user inside ``shard_map``) is left as it is.

Example:
  >>> from flax import nnx
  >>> model = SyncBatchNorm.convert_sync_batchnorm(nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
  >>> is_sync(model), isinstance(model, nnx.BatchNorm)
  (True, True)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import normalization as _flax_norm
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.optim.communication import data_axes as manual_axes
from jfleet.parallel.recompute import module_paths

__all__ = ["SyncBatchNorm", "apply_batch_norm", "is_sync", "replicas_of"]

_CLASSES: dict[tuple, type] = {}  # one subclass per (class, kind, mesh, axes, sync)


class SyncBatchNorm(nnx.BatchNorm):
    """An ``nnx.BatchNorm`` whose statistics are always over the whole global batch.

    Paddle's ``paddle.nn.SyncBatchNorm``: the same arguments as ``nnx.BatchNorm``;
    ``fleet.distributed_model`` never gives it per-replica statistics, whatever
    ``strategy.sync_batch_norm`` says.

    Example:
      >>> from flax import nnx
      >>> bn = SyncBatchNorm(3, rngs=nnx.Rngs(0))
      >>> is_sync(bn)
      True
    """

    _jfleet_sync_bn = True

    @classmethod
    def convert_sync_batchnorm(cls, layer: nnx.Module) -> nnx.Module:
        """Makes every ``nnx.BatchNorm`` in ``layer`` synchronised; returns ``layer`` (in place).

        Each module keeps its class (a subclass is swapped in), parameters and running
        averages; a model prepared before this call is converted too.

        Raises:
          TypeError: ``layer`` is not an ``nnx.Module``.
        """
        if not isinstance(layer, nnx.Module):
            raise TypeError(
                f"convert_sync_batchnorm(layer={type(layer).__name__}): expected a flax.nnx "
                "Module holding nnx.BatchNorm layers."
            )
        for module in _batch_norms(layer):
            cls = type(module)
            if hasattr(cls, "_jfleet_bn_replicas"):  # prepared already: keep the mesh
                mesh, axes = cls._jfleet_bn_replicas
                marked = _subclass(_original(cls), "sync", None, ())
                module.__class__ = _subclass(marked, "replicas", mesh, axes, True)
            else:
                module.__class__ = _subclass(cls, "sync", None, ())
        return layer


def is_sync(module: nnx.Module) -> bool:
    """Whether a batch-norm module always uses global statistics (``SyncBatchNorm``)."""
    return bool(getattr(type(module), "_jfleet_sync_bn", False))


def replicas_of(module: nnx.Module) -> int:
    """How many replicas' statistics a batch-norm module keeps apart (1: global statistics)."""
    mesh, axes = getattr(type(module), "_jfleet_bn_replicas", (None, ()))
    if mesh is None or getattr(type(module), "_jfleet_bn_sync", False):
        return 1
    return math.prod(mesh.shape[a] for a in axes)


def apply_batch_norm(
    model: nnx.Module, *, sync: bool, mesh: Mesh, data_axes: tuple[str, ...]
) -> nnx.Module:
    """Gives the model's ``nnx.BatchNorm`` modules the strategy's statistics; in place.

    Args:
      model: the user's NNX model.
      sync: ``strategy.sync_batch_norm``: True for statistics over the global batch,
        False for per-replica statistics (``SyncBatchNorm`` modules are always global).
      mesh: the run's mesh.
      data_axes: the mesh axes the batch is split over (``Placement.data_axes``).

    Returns:
      ``model``. With more than one data-parallel replica each batch-norm module (other
      than ones with an ``axis_name``) gets a subclass of its class that keeps these
      statistics both on the global batch (GSPMD) and inside the engine's per-replica
      step (``shard_map`` over the data axes: fp16_allreduce, DGC), where the replica's
      statistics are all-reduced over the data axes for global ones.

    Example:
      >>> from flax import nnx
      >>> from jax.sharding import AxisType
      >>> from jfleet.mesh.topology import DP
      >>> mesh = jax.make_mesh((8,), (DP,), axis_types=(AxisType.Auto,))
      >>> bn = apply_batch_norm(nnx.BatchNorm(4, rngs=nnx.Rngs(0)), sync=False, mesh=mesh,
      ...                       data_axes=(DP,))
      >>> replicas_of(bn), type(bn).__name__
      (8, 'BatchNorm')
    """
    axes = tuple(data_axes)
    replicas = math.prod(mesh.shape[a] for a in axes)
    for module in _batch_norms(model):
        if module.axis_name is not None:
            continue
        cls = _original(type(module))
        if replicas > 1:
            cls = _subclass(cls, "replicas", mesh, axes, sync or is_sync(module))
        module.__class__ = cls
    return model


def _batch_norms(model: nnx.Module) -> list[nnx.BatchNorm]:
    seen: dict[int, nnx.BatchNorm] = {}
    for _, module in module_paths(model):
        if isinstance(module, nnx.BatchNorm):
            seen.setdefault(id(module), module)
    return list(seen.values())


def _original(cls: type) -> type:
    """The class before :func:`apply_batch_norm` (a ``SyncBatchNorm`` marking stays)."""
    return getattr(cls, "_jfleet_bn_original", cls)


def _subclass(
    cls: type, kind: str, mesh: Mesh | None, axes: tuple[str, ...], sync: bool = True
) -> type:
    """The cached subclass of ``cls``: ``"sync"`` (marked global) or ``"replicas"``."""
    if kind == "sync" and _is_sync_class(cls):
        return cls
    key = (cls, kind, mesh, axes, sync)
    sub = _CLASSES.get(key)
    if sub is None:
        attrs: dict[str, Any] = {}
        if kind == "sync":
            attrs["_jfleet_sync_bn"] = True
        else:
            attrs.update(
                _jfleet_bn_original=cls,
                _jfleet_bn_replicas=(mesh, axes),
                _jfleet_bn_sync=sync,
                __call__=_replica_call,
            )
        sub = type(cls.__name__, (cls,), attrs)
        sub.__qualname__ = cls.__qualname__
        sub.__module__ = cls.__module__
        _CLASSES[key] = sub
    return sub


def _is_sync_class(cls: type) -> bool:
    """Whether a batch-norm class is marked for global statistics."""
    return bool(getattr(cls, "_jfleet_sync_bn", False))


def _replica_call(
    self: Any, x: jax.Array, use_running_average: bool | None = None, *, mask: Any = None
) -> jax.Array:
    """``nnx.BatchNorm.__call__`` with per-replica or global statistics, on the global batch
    (GSPMD) or on one replica's rows (inside the engine's per-replica ``shard_map``)."""
    original = _original(type(self)).__call__
    running = self.use_running_average if use_running_average is None else use_running_average
    feature_axes = _flax_norm._canonicalize_axes(x.ndim, self.axis)
    if running is None or running or x.ndim == 0 or 0 in feature_axes:
        return original(self, x, use_running_average, mask=mask)  # flax's errors and eval
    mesh, axes = type(self)._jfleet_bn_replicas
    sync = type(self)._jfleet_bn_sync
    manual = manual_axes(axes)
    if not manual and sync:
        return original(self, x, use_running_average, mask=mask)  # GSPMD: already global
    r = 1 if manual else replicas_of(self)
    if x.shape[0] % r:
        raise ValueError(
            f"{type(self).__name__} got an input of shape {x.shape}, but per-replica "
            f"statistics (strategy.sync_batch_norm=False over {r} data-parallel replicas) "
            f"split its leading (batch) dimension into {r} parts; pass a batch divisible by "
            f"{r}, or set strategy.sync_batch_norm=True for statistics over the whole batch."
        )
    shape = (r, x.shape[0] // r, *x.shape[1:])
    scale = self.scale[...] if self.scale is not None else None
    bias = self.bias[...] if self.bias is not None else None
    x, _, _, scale, bias = self.promote_dtype(
        (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
    )
    xr = x.reshape(shape) if manual else _on_replicas(x.reshape(shape), mesh, axes)
    if mask is not None:
        mask = jnp.broadcast_to(mask, x.shape).reshape(shape)
    reduce_axes = tuple(i + 1 for i in range(x.ndim) if i not in feature_axes)
    mu, sigma2 = _flax_norm._compute_stats(
        xr,
        reduce_axes,
        dtype=self.dtype,
        axis_name=manual if sync else None,  # one replica's rows: all-reduce for global
        use_fast_variance=self.use_fast_variance,
        mask=mask,
    )  # (replicas, *features)
    stop = jax.lax.stop_gradient if self.mean._can_update or self.var._can_update else _same
    self.mean[...] = stop(self.momentum * self.mean[...] + (1 - self.momentum) * mu.mean(0))
    self.var[...] = stop(self.momentum * self.var[...] + (1 - self.momentum) * sigma2.mean(0))
    y = _flax_norm._normalize(
        xr,
        mu,
        sigma2,
        scale,
        bias,
        reduce_axes,
        tuple(a + 1 for a in feature_axes),
        self.dtype,
        self.epsilon,
    )
    return y.reshape(x.shape)


def _same(x: Any) -> Any:
    return x


def _on_replicas(x: jax.Array, mesh: Mesh, axes: tuple[str, ...]) -> jax.Array:
    """``x`` (replicas first) laid out one replica's rows per data-parallel slice."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(axes)))

"""Softmax cross entropy over logits split on the vocabulary: Paddle's ``ParallelCrossEntropy``.

The logits of a vocabulary-parallel head (``ColumnParallelLinear(gather_output=False)``,
``VocabParallelEmbedding.attend``) arrive split over ``mp`` on their last dimension. The
loss never puts a token's full-vocabulary logits on one device: inside one
``jax.shard_map`` over ``mp`` (the other mesh axes left to the compiler) each shard takes
its local maximum, all-reduces it (max), sums ``exp(logit - max)`` locally and
all-reduces the sum, and the shard that owns a token's label contributes the target logit
to a third all-reduce (sum). The three all-reduces carry one number per token. The
backward pass, ``(softmax - onehot) * dloss`` on each shard, needs no collective at all:
it recomputes the local softmax from the logits and the per-token log-sum-exp saved by
the forward pass (a ``jax.custom_vjp``, so reverse mode only: ``jax.grad`` works,
``jax.jvp`` does not). All arithmetic is float32 whatever the logits dtype; the gradient
comes back in the logits dtype. With ``mp`` 1 (or a mesh without ``mp``) the same
arithmetic runs without ``shard_map``.

Semantics (Paddle's ``c_softmax_with_cross_entropy``; two deliberate differences):

- ``labels`` has the shape ``logits.shape[:-1]`` or ``logits.shape[:-1] + (1,)``; the loss
  has shape ``logits.shape[:-1] + (1,)`` either way, as in Paddle. Mind broadcasting when
  weighting it with a ``[...]``-shaped mask: use ``loss[..., 0]`` or ``mask[..., None]``.
- Tokens whose label equals ``ignore_index`` get loss 0 and gradient 0.
- Difference: the loss is float32 (Paddle returns the logits dtype; a half-precision per-token loss
  loses precision before the mean).
- A label outside ``[0, V)`` that is not ``ignore_index`` makes that token's loss and
  its row of the gradient NaN (difference: Paddle's kernel aborts on it; a traced program cannot
  raise, so jfleet follows JAX's out-of-bounds "fill" convention, which is also what the
  dense ``optax.softmax_cross_entropy_with_integer_labels`` gives for a label ``>= V``;
  it poisons the step loudly instead of training on a wrong target).

Example:
  >>> import jax.numpy as jnp
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> _ = fleet.init(is_collective=True, strategy=s)
  >>> ce = ParallelCrossEntropy()
  >>> logits = jnp.zeros((2, 3, 8))  # vocabulary 8, two entries per mp shard
  >>> loss = ce(logits, jnp.array([[0, 5, -100], [7, 1, 2]]))
  >>> loss.shape, loss.dtype
  ((2, 3, 1), dtype('float32'))
  >>> [round(float(v), 4) for v in loss[0, :, 0]]  # log(8) twice, ignored token 0
  [2.0794, 2.0794, 0.0]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.mesh.layer_mesh import layer_mesh, mp_degree, shard_map_mesh
from jfleet.mesh.topology import MP

__all__ = ["ParallelCrossEntropy", "parallel_cross_entropy"]


class ParallelCrossEntropy(nnx.Module):
    """Per-token softmax cross entropy of vocabulary-parallel logits (Paddle's layer).

    Holds no parameters. Built after ``fleet.init`` (it takes the fleet's mesh when
    constructed, as Paddle's layer takes the model-parallel group), or with ``mesh=``.

    Args:
      ignore_index: label value whose tokens contribute loss 0 and gradient 0.
      mesh: the mesh whose ``mp`` axis splits the vocabulary; default the fleet's mesh.
      name: an optional name, kept for Paddle compatibility.

    Raises:
      TypeError: ``ignore_index`` is not an int.
      RuntimeError: no ``mesh`` and ``fleet.init`` not called.

    Example:
      >>> import jax.numpy as jnp
      >>> from jfleet import fleet
      >>> s = fleet.DistributedStrategy()
      >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> _ = fleet.init(is_collective=True, strategy=s)
      >>> ce = ParallelCrossEntropy(ignore_index=0)
      >>> loss = ce(jnp.zeros((4, 16)), jnp.array([0, 1, 2, 3]))
      >>> loss[:, 0].tolist() == [0.0] + [float(jnp.log(16.0))] * 3
      True
    """

    def __init__(
        self, ignore_index: int = -100, *, mesh: Mesh | None = None, name: str | None = None
    ) -> None:
        self.ignore_index = _check_ignore_index(ignore_index)
        self.mesh = layer_mesh(mesh)
        self.name = name

    def __call__(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        """The per-token loss, shape ``logits.shape[:-1] + (1,)``, float32.

        Args:
          logits: ``[..., V]`` floating logits, normally split over ``mp`` on ``V``.
          labels: ``[...]`` or ``[..., 1]`` integer class ids.

        Raises:
          TypeError: non-floating logits or non-integer labels.
          ValueError: scalar logits, labels of the wrong shape, or ``V`` not divisible by
            the ``mp`` degree.
        """
        return parallel_cross_entropy(
            logits, labels, ignore_index=self.ignore_index, mesh=self.mesh
        )


def parallel_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    ignore_index: int = -100,
    mesh: Mesh | None = None,
) -> jax.Array:
    """Functional form of :class:`ParallelCrossEntropy`.

    Args:
      logits: ``[..., V]`` floating logits, normally split over ``mp`` on ``V`` (any other
        layout is resharded to that on entry).
      labels: ``[...]`` or ``[..., 1]`` integer class ids in ``[0, V)`` or ``ignore_index``.
      ignore_index: label value whose tokens contribute loss 0 and gradient 0.
      mesh: the mesh whose ``mp`` axis splits the vocabulary; default the fleet's mesh.

    Returns:
      float32 per-token loss of shape ``logits.shape[:-1] + (1,)`` (Paddle's shape): 0 for
      ignored tokens, NaN for labels out of range.

    Raises:
      TypeError: non-floating logits, non-integer labels, or a non-int ``ignore_index``.
      ValueError: scalar logits, labels of the wrong shape, or ``V`` not divisible by the
        ``mp`` degree.
      RuntimeError: no ``mesh`` and ``fleet.init`` not called.

    Example:
      >>> import jax.numpy as jnp
      >>> from jfleet import fleet
      >>> s = fleet.DistributedStrategy()
      >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> _ = fleet.init(is_collective=True, strategy=s)
      >>> logits = jnp.array([[0.0, 0.0, 0.0, 9.0]])
      >>> loss = parallel_cross_entropy(logits, jnp.array([3]))
      >>> round(float(loss[0, 0]), 4)
      0.0004
    """
    ignore_index = _check_ignore_index(ignore_index)
    mesh = layer_mesh(mesh)
    shape = tuple(np.shape(logits))
    if len(shape) < 1:
        raise ValueError(
            f"logits have shape {shape} (rank 0); they need a last vocabulary dimension, "
            "shape [..., V]."
        )
    logits = jnp.asarray(logits)
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise TypeError(
            f"logits have dtype {logits.dtype}; cross entropy needs floating logits "
            "(float32, bfloat16, float16)."
        )
    labels = jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(
            f"labels have dtype {labels.dtype}; they must be integer class ids "
            "(cast them with labels.astype(jnp.int32))."
        )
    tokens, vocab = shape[:-1], shape[-1]
    if labels.shape not in (tokens, (*tokens, 1)):
        raise ValueError(
            f"labels have shape {labels.shape} but logits have shape {shape}; labels must "
            f"have shape {tokens} (logits.shape[:-1]) or {(*tokens, 1)}."
        )
    degree = mp_degree(mesh)
    if vocab % degree:
        raise ValueError(
            f"the vocabulary size {vocab} (logits.shape[-1]) is not divisible by the mp "
            f"degree {degree}; pad the vocabulary to a multiple of {degree}."
        )
    # mp 1 (or no mp axis): no shard_map; a partially manual shard_map over a size-1 axis
    # trips XLA's SPMD partitioner ("Cross-partition allreduce must be in (partial) manual
    # partitioning mode") under jit, and there is nothing to reduce anyway.
    axis = MP if degree > 1 else None
    return _loss(logits, labels.reshape(tokens), mesh=mesh, axis=axis, ignore_index=ignore_index)


def _check_ignore_index(ignore_index: int) -> int:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int | np.integer):
        raise TypeError(
            f"ignore_index={ignore_index!r} ({type(ignore_index).__name__}) must be an int "
            "(Paddle's default is -100)."
        )
    return int(ignore_index)


def _encode_labels(labels: jax.Array, vocab: int, ignore_index: int) -> tuple[jax.Array, jax.Array]:
    """``target`` (int32, -1 where there is none) and ``weight`` (1 / 0 ignored / NaN bad)."""
    info = jnp.iinfo(labels.dtype)
    if info.min <= ignore_index <= info.max:
        ignored = labels == ignore_index
    else:  # no label of this dtype can equal it
        ignored = jnp.zeros(labels.shape, bool)
    in_range = (labels >= 0) & (labels < vocab) if vocab <= info.max else labels >= 0
    target = jnp.where(in_range & ~ignored, labels, -1).astype(jnp.int32)
    weight = jnp.where(ignored, 0.0, jnp.where(in_range, 1.0, jnp.nan)).astype(jnp.float32)
    return target, weight


# ------------------------------------------------------------------ the sharded kernel
@functools.partial(jax.jit, static_argnames=("mesh", "axis", "ignore_index"))
def _loss(logits, labels, *, mesh: Mesh, axis: str | None, ignore_index: int) -> jax.Array:
    """Jitted so an eager call compiles once per shape (inlined under an outer jit)."""
    target, weight = _encode_labels(labels, logits.shape[-1], ignore_index)
    return _cross_entropy(mesh, axis, logits, target, weight)[..., None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _cross_entropy(mesh: Mesh, axis: str | None, logits, target, weight):
    return _cross_entropy_fwd(mesh, axis, logits, target, weight)[0]


def _cross_entropy_fwd(mesh, axis, logits, target, weight):
    body = functools.partial(_forward_shard, axis=axis)
    if axis is not None:
        body = jax.shard_map(
            body,
            mesh=shard_map_mesh(mesh),
            in_specs=(_vocab_spec(logits.ndim), P(), P()),
            out_specs=(P(), P()),
            axis_names={axis},
        )
    loss, lse = body(logits, target, weight)
    return loss, (logits, target, weight, lse)


def _cross_entropy_bwd(mesh, axis, residuals, dloss):
    logits, target, weight, lse = residuals
    body = functools.partial(_backward_shard, axis=axis)
    if axis is not None:
        spec = _vocab_spec(logits.ndim)
        body = jax.shard_map(
            body,
            mesh=shard_map_mesh(mesh),
            in_specs=(spec, P(), P(), P(), P()),
            out_specs=spec,
            axis_names={axis},
        )
    dlogits = body(logits, target, weight, lse, dloss)
    return dlogits, None, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def _vocab_spec(ndim: int) -> P:
    return P(*([None] * (ndim - 1)), MP)


def _local_target(target: jax.Array, local_vocab: int, axis: str | None):
    """This shard's column of each token's target, and whether the shard owns it."""
    start = 0 if axis is None else jax.lax.axis_index(axis) * local_vocab
    local = target - start
    owned = (target >= 0) & (local >= 0) & (local < local_vocab)
    return jnp.where(owned, local, 0), owned


def _forward_shard(logits, target, weight, *, axis):
    """Per-token loss and log-sum-exp from this shard's ``[..., V/mp]`` logits."""
    x = logits.astype(jnp.float32)
    local_vocab = x.shape[-1]

    def reduce(v, op):
        return v if axis is None else op(v, axis)

    row_max = reduce(jnp.max(x, axis=-1), jax.lax.pmax)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # all -inf rows stay finite
    shifted = x - row_max[..., None]
    sum_exp = reduce(jnp.sum(jnp.exp(shifted), axis=-1), jax.lax.psum)
    local, owned = _local_target(target, local_vocab, axis)
    picked = jnp.take_along_axis(shifted, local[..., None], axis=-1)[..., 0]
    picked = reduce(jnp.where(owned, picked, 0.0), jax.lax.psum)
    log_sum = jnp.log(sum_exp)
    loss = jnp.where(weight == 0, 0.0, (log_sum - picked) * weight)
    return loss, log_sum + row_max


def _backward_shard(logits, target, weight, lse, dloss, *, axis):
    """``(softmax - onehot) * dloss`` on this shard's columns; no collective."""
    x = logits.astype(jnp.float32)
    local, owned = _local_target(target, x.shape[-1], axis)
    columns = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    onehot = (owned[..., None] & (columns == local[..., None])).astype(jnp.float32)
    scale = jnp.where(weight == 0, 0.0, dloss.astype(jnp.float32) * weight)
    dlogits = (jnp.exp(x - lse[..., None]) - onehot) * scale[..., None]
    return dlogits.astype(logits.dtype)

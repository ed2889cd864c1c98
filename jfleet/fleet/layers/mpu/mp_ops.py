"""Paddle's ``fleet.layers.mpu.mp_ops``: the tensor-parallel communication ops.

Each op works in the two settings of :mod:`jfleet.collective`:

- **Inside** ``jax.shard_map`` manual over the group's axis (default ``mp``) the value is
  this rank's and the op is Paddle's, forward and backward:

  ========================  ===========================  ============================
  op                        forward                      backward
  ========================  ===========================  ============================
  ``_c_identity``           identity                     all-reduce (sum)
  ``_mp_allreduce``         all-reduce (sum)             identity
  ``_c_split``              this rank's piece, last dim  all-gather, last dim
  ``_c_concat``             all-gather, last dim         this rank's piece
  ========================  ===========================  ============================

  With ``check_vma`` (the default) the same results come from JAX's typed collectives;
  without it, from custom gradients. Either way a gradient taken per device (Paddle's
  picture: each rank differentiates its own program) is Paddle's.

- **On global arrays** (anywhere else, ``jax.jit`` included) there are no per-rank
  partial values: an array is one value, laid out over the devices. Each op then leaves
  the value unchanged and pins the layout it implies: ``_c_split`` splits the last dim
  over the group's axis, ``_c_concat`` and ``_mp_allreduce`` make it whole (replicated
  over the axis: the sum that Paddle's all-reduce forms is what a global matmul over a
  split dim already is), ``_c_identity`` is the identity. The compiler inserts the
  collectives, and their transposes in the backward pass.

``_c_lookup_table``, ``_c_softmax_with_cross_entropy`` and ``_linear`` are here too.

Example (mp4 x dp2: a Megatron MLP per device equals the one-device MLP):
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy()
  >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
  >>> hcg = fleet.init(is_collective=True, strategy=s).get_hybrid_communicate_group()
  >>> x, w1, w2 = jnp.ones((2, 4)), jnp.ones((4, 8)), jnp.ones((8, 4))
  >>> def mlp(x, w1, w2):  # w1 split by column, w2 by row
  ...     return _mp_allreduce(jnp.tanh(_c_identity(x) @ w1) @ w2)
  >>> f = jax.shard_map(mlp, mesh=hcg.mesh, in_specs=(P(), P(None, "mp"), P("mp")),
  ...                   out_specs=P())
  >>> bool(jnp.allclose(f(x, w1, w2), jnp.tanh(x @ w1) @ w2))
  True
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jfleet.mesh.collective import ReduceOp
from jfleet.mesh.layer_mesh import constrain, layer_mesh
from jfleet.mesh.topology import MP, Group
from jfleet.parallel.cross_entropy import parallel_cross_entropy
from jfleet.parallel.sequence import (
    Axis,
    concat_over,
    is_manual,
    split_over,
    sum_grad_over,
    sum_over,
)

__all__ = [
    "_c_concat",
    "_c_identity",
    "_c_lookup_table",
    "_c_softmax_with_cross_entropy",
    "_c_split",
    "_linear",
    "_mp_allreduce",
]


def _axis(group: Any, fn: str) -> Axis:
    if group is None:
        return MP
    if isinstance(group, Group):
        return group.axis_name
    raise TypeError(
        f"{fn}: group={group!r} ({type(group).__name__}) is not a Group; pass "
        "hcg.get_model_parallel_group() (or another Group of the hybrid group), or None "
        "for the model-parallel group."
    )


def _pin_last(x: jax.Array, axis: Axis | None) -> jax.Array:
    """``x`` with its last dim split over ``axis`` (None: whole), other dims as they are."""
    return constrain(x, layer_mesh(), *([P.UNCONSTRAINED] * (x.ndim - 1)), axis)


def _c_identity(
    tensor: jax.Array, group: Group | None = None, skip_c_identity_dynamic: bool = False
) -> jax.Array:
    """Identity forward, gradient all-reduced over the group (per device); global: identity.

    ``skip_c_identity_dynamic`` (Paddle's switch for its dynamic-graph kernel) has no
    effect.
    """
    axis = _axis(group, "_c_identity")
    return sum_grad_over(tensor, axis) if is_manual(axis) else tensor


def _mp_allreduce(
    tensor: jax.Array,
    op: ReduceOp = ReduceOp.SUM,
    group: Group | None = None,
    use_calc_stream: bool = True,
    use_model_parallel: bool = True,
    skip_c_identity_dynamic: bool = False,
) -> jax.Array:
    """Sum over the group forward, gradient as is (per device); global: whole over the axis.

    ``use_calc_stream`` / ``use_model_parallel`` / ``skip_c_identity_dynamic`` choose
    Paddle kernels and streams; they have no effect.

    Raises:
      ValueError: ``op`` other than ``ReduceOp.SUM`` (Paddle's op sums only).
    """
    if op != ReduceOp.SUM:
        raise ValueError(
            f"_mp_allreduce: op={op!r}; the model-parallel all-reduce sums partial results, "
            "pass op=ReduceOp.SUM (for other reductions use jfleet.collective.all_reduce)."
        )
    axis = _axis(group, "_mp_allreduce")
    return sum_over(tensor, axis) if is_manual(axis) else _pin_last(tensor, None)


def _c_split(tensor: jax.Array, group: Group | None = None) -> jax.Array:
    """This rank's piece of the last dim (backward: all-gather); global: split over the axis.

    Raises:
      ValueError: the last dim is not divisible by the group's size.
    """
    axis = _axis(group, "_c_split")
    if is_manual(axis):
        return split_over(tensor, axis, -1)
    mesh = layer_mesh()
    n = math.prod(mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))
    if tensor.shape[-1] % n:
        raise ValueError(
            f"_c_split: the last dim of shape {tensor.shape} is {tensor.shape[-1]}, not "
            f"divisible by the {n} ranks of the group; pad it to a multiple of {n}."
        )
    return _pin_last(tensor, axis)


def _c_concat(tensor: jax.Array, group: Group | None = None) -> jax.Array:
    """The group's pieces joined on the last dim (backward: own piece); global: whole."""
    axis = _axis(group, "_c_concat")
    return concat_over(tensor, axis, -1) if is_manual(axis) else _pin_last(tensor, None)


def _c_lookup_table(
    table: jax.Array,
    index: jax.Array,
    start_index: int = 0,
    vocab_size: int = -1,
    name: str | None = None,
) -> jax.Array:
    """Rows ``index - start_index`` of ``table``; ids outside it give zero rows.

    Per device, ``table`` is this rank's ``[V / n, H]`` slice starting at global row
    ``start_index`` (sum the results over the group: :func:`_mp_allreduce`). On global
    arrays pass the whole table and ``start_index=0``. ``vocab_size`` is accepted as in
    Paddle and not needed.

    Example:
      >>> table = jnp.arange(6.0).reshape(3, 2)
      >>> _c_lookup_table(table, jnp.array([3, 4, 1]), start_index=3).tolist()
      [[0.0, 1.0], [2.0, 3.0], [0.0, 0.0]]
    """
    local = index - start_index
    inside = (local >= 0) & (local < table.shape[0])
    rows = jnp.take(table, jnp.clip(local, 0, table.shape[0] - 1), axis=0)
    return jnp.where(inside[..., None], rows, jnp.zeros((), table.dtype))


def _c_softmax_with_cross_entropy(
    logits: jax.Array,
    label: jax.Array,
    group: Group | None = None,
    return_softmax: bool = False,
    ignore_index: int = -100,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Cross entropy of vocabulary-split logits: loss ``[..., 1]`` (and the softmax).

    Per device ``logits`` is this rank's ``[..., V / n]`` slice of the vocabulary and the
    max, the normaliser and the target logit are reduced over the group; the gradient
    is Paddle's ``softmax - one_hot`` on this rank's slice (the softmax output carries
    no gradient). On global arrays it is
    :func:`jfleet.parallel.cross_entropy.parallel_cross_entropy`. Tokens labelled
    ``ignore_index`` give loss 0.
    """
    axis = _axis(group, "_c_softmax_with_cross_entropy")
    if label.ndim == logits.ndim:
        label = label[..., 0]
    if not is_manual(axis):
        loss = parallel_cross_entropy(logits, label, ignore_index=ignore_index)
        if return_softmax:
            return loss, jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        return loss
    loss, softmax = _local_ce(logits, label, axis, ignore_index)
    return (loss, softmax) if return_softmax else loss


def _ce_parts(logits, label, axis, ignore_index):
    x = logits.astype(jnp.float32)
    n_local = x.shape[-1]
    start = lax.axis_index(axis) * n_local
    top = lax.pmax(lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)), axis)
    e = jnp.exp(x - top)
    total = lax.psum(jnp.sum(e, axis=-1, keepdims=True), axis)
    local = label - start
    inside = (local >= 0) & (local < n_local)
    picked = jnp.take_along_axis(x, jnp.clip(local, 0, n_local - 1)[..., None], axis=-1)
    target = lax.psum(jnp.where(inside[..., None], picked, 0.0), axis)
    keep = (label != ignore_index)[..., None]
    loss = jnp.where(keep, jnp.log(total) + top - target, 0.0)
    one_hot = jax.nn.one_hot(jnp.where(inside, local, -1), n_local, dtype=jnp.float32)
    return loss, e / total, one_hot, keep


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _local_ce(logits, label, axis, ignore_index):
    loss, softmax, _, _ = _ce_parts(logits, label, axis, ignore_index)
    return loss, softmax


def _local_ce_fwd(logits, label, axis, ignore_index):
    loss, softmax, one_hot, keep = _ce_parts(logits, label, axis, ignore_index)
    dtype = jnp.zeros((0,), logits.dtype)  # carries the logits' dtype
    return (loss, softmax), (softmax, one_hot, keep, dtype, label)


def _local_ce_bwd(axis, ignore_index, res, cts):
    softmax, one_hot, keep, dtype, label = res
    grad = (softmax - one_hot) * jnp.where(keep, cts[0], 0.0)
    return grad.astype(dtype.dtype), np.zeros(label.shape, jax.dtypes.float0)


_local_ce.defvjp(_local_ce_fwd, _local_ce_bwd)


def _linear(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, name: str | None = None
) -> jax.Array:
    """``x @ weight + bias`` (Paddle's weight layout ``[in, out]``).

    Example:
      >>> _linear(jnp.ones((1, 2)), jnp.ones((2, 3)), jnp.ones(3)).tolist()
      [[3.0, 3.0, 3.0]]
    """
    y = jnp.matmul(x, weight)
    return y if bias is None else y + bias

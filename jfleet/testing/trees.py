"""Comparing a parallel run with its single-device reference: trees on chex, models as NumPy.

* :func:`assert_trees_close`: two pytrees (or ``nnx.State`` s) with one structure, dtypes
  and values within tolerance: given, or fp32's rule for the reduction orders the
  comparison allows (:func:`default_tolerance`, scaled by each leaf's magnitude).
* :func:`state_as_numpy`: any model's variables as ``{per-layer path: np.ndarray}``, the
  same keys whether the model is plain, wrapped by ``fleet.distributed_model``, or returned
  by ``to_distributed`` with pipelined or scanned blocks, so any two runs compare.

Example:
  >>> import jax.numpy as jnp
  >>> assert_trees_close({"w": jnp.ones(2)}, {"w": jnp.ones(2) + 1e-7}, rtol=1e-5, atol=1e-6)
"""

from __future__ import annotations

import math
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfleet.checkpoint.layout import logical_leaves

__all__ = ["BASE_TOLERANCE", "assert_trees_close", "default_tolerance", "state_as_numpy"]

#: fp32 tolerance of one device against itself in another reduction order (1 + log2 d).
BASE_TOLERANCE = 1e-5


def default_tolerance(devices: int) -> float:
    """The default ``rtol`` / ``atol`` of a run on ``devices`` devices: ``1e-5 (1 + log2 d)``.

    A sum split over ``d`` devices adds about ``log2 d`` roundings to each reduction, so the
    fp32 bound grows with the depth of the reduction tree, not with the device count. One
    device against itself in another reduction order (a pipeline executor against the
    sequential model, a fused against an unfused sum) is ``d = 1``.

    Example:
      >>> default_tolerance(1), default_tolerance(8)
      (1e-05, 4e-05)
    """
    return BASE_TOLERANCE * (1 + math.log2(max(devices, 1)))


def leaf_scale(want: np.ndarray) -> float:
    """What the rule's absolute tolerance is multiplied by: ``max(1, max |finite want|)``."""
    return max(1.0, float(np.max(np.abs(want), initial=0.0, where=np.isfinite(want))))


def _plain(tree: Any) -> Any:
    """An ``nnx.State`` as its pure dict (a State and a dict of the same arrays compare)."""
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def assert_trees_close(
    got: Any,
    want: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    devices: int = 1,
    check_dtypes: bool = True,
) -> None:
    """``got`` and ``want`` have one structure, the same dtypes and values within tolerance.

    Without ``rtol`` / ``atol`` the fp32 rule applies: ``t = default_tolerance(devices)``,
    each value within ``t |want| + t max(1, max |leaf|)``. The absolute part scales with the
    leaf's largest value, since a reordered sum's rounding is relative to the terms it adds,
    not to its (possibly near-zero) result. Pass ``rtol=0, atol=0`` only where the two
    programs must be the same program; a reordering is never bitwise.

    Half-precision leaves are compared in float32. Every failing path is named.

    Args:
      got: the parallel run's tree (arrays may be sharded on any mesh).
      want: the reference tree.
      rtol: relative tolerance (default: the rule above).
      atol: absolute tolerance, not scaled (default: the rule above).
      devices: the depth of the reduction reorderings the comparison allows, as a device
        count (``8`` for a run split over 8 devices against one; ``1`` for one reordering).
      check_dtypes: also require equal dtypes leaf by leaf.

    Raises:
      AssertionError: structures, dtypes or values differ.

    Example:
      >>> import jax.numpy as jnp
      >>> assert_trees_close({"b": jnp.zeros(2)}, {"b": jnp.full(2, 1e-7)}, rtol=0, atol=1e-6)
    """
    got, want = _plain(got), _plain(want)
    chex.assert_trees_all_equal_structs(got, want)
    if check_dtypes:
        chex.assert_trees_all_equal_dtypes(got, want)
    wide = lambda t: jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.float32)), t)  # noqa: E731
    if rtol is not None and atol is not None:
        chex.assert_trees_all_close(wide(got), wide(want), rtol=rtol, atol=atol)
        return
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices={devices!r}: expected a positive int (the reduction depth).")
    t = default_tolerance(devices)
    rtol = t if rtol is None else rtol
    pairs = zip(
        jax.tree_util.tree_flatten_with_path(wide(got))[0], jax.tree.leaves(wide(want)), strict=True
    )
    for (path, a), b in pairs:
        np.testing.assert_allclose(
            a,
            b,
            rtol=rtol,
            atol=t * leaf_scale(b) if atol is None else atol,
            err_msg=f"at {jax.tree_util.keystr(path) or 'the root'} (devices={devices})",
        )


def state_as_numpy(model: nnx.Module) -> dict[str, np.ndarray]:
    """The model's variables as host NumPy arrays under the plain model's per-layer paths.

    Sharded arrays are gathered; a ``fleet.distributed_model`` wrapper adds no prefix;
    pipelined ``[pp, L/pp, ...]`` and scanned ``[1, L, ...]`` block stacks are split back
    into ``layers.0...``, ``layers.1...`` (as checkpoints store them). Two runs of one model
    on any meshes give the same keys and shapes. Every array must be addressable by this
    process (one process, or replicated).

    Args:
      model: a plain NNX model, a ``DistributedModel``, or a model ``to_distributed``
        returned.

    Returns:
      ``{dotted path: np.ndarray}`` in the model's order.

    Example:
      >>> from jfleet.models import TinyLM
      >>> a, b = state_as_numpy(TinyLM()), state_as_numpy(TinyLM())
      >>> sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
      True
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model={type(model).__name__}: expected an nnx.Module (a plain model, a "
            "DistributedModel or one to_distributed returned)."
        )
    return {k: np.asarray(v) for k, v in logical_leaves(model, model).items()}

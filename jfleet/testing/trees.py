"""Comparing a parallel run with its single-device reference: trees on chex, models as NumPy.

* :func:`assert_trees_close`: two pytrees (or ``nnx.State`` s) with one structure, dtypes
  and values within tolerance.
* :func:`state_as_numpy`: any model's variables as ``{per-layer path: np.ndarray}``, the
  same keys whether the model is plain, wrapped by ``fleet.distributed_model``, or returned
  by ``to_distributed`` with pipelined or scanned blocks, so any two runs compare.

Example:
  >>> import jax.numpy as jnp
  >>> assert_trees_close({"w": jnp.ones(2)}, {"w": jnp.ones(2) + 1e-7}, rtol=1e-5, atol=1e-6)
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfleet.checkpoint.layout import logical_leaves

__all__ = ["assert_trees_close", "state_as_numpy"]


def _plain(tree: Any) -> Any:
    """An ``nnx.State`` as its pure dict (a State and a dict of the same arrays compare)."""
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def assert_trees_close(
    got: Any, want: Any, *, rtol: float, atol: float, check_dtypes: bool = True
) -> None:
    """``got`` and ``want`` have one structure, the same dtypes and values within tolerance.

    Half-precision leaves are compared in float32. Every failing path is named (chex).

    Args:
      got: the parallel run's tree (arrays may be sharded on any mesh).
      want: the reference tree.
      rtol: relative tolerance.
      atol: absolute tolerance.
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
    wide = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)  # noqa: E731
    chex.assert_trees_all_close(wide(got), wide(want), rtol=rtol, atol=atol)


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

"""Tree assertions for comparing a parallel run with its single-device reference (on chex).

Example:
  >>> import jax.numpy as jnp
  >>> assert_trees_close({"w": jnp.ones(2)}, {"w": jnp.ones(2) + 1e-7}, rtol=1e-5, atol=1e-6)
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["assert_trees_close"]


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
    """
    got, want = _plain(got), _plain(want)
    chex.assert_trees_all_equal_structs(got, want)
    if check_dtypes:
        chex.assert_trees_all_equal_dtypes(got, want)
    wide = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)  # noqa: E731
    chex.assert_trees_all_close(wide(got), wide(want), rtol=rtol, atol=atol)

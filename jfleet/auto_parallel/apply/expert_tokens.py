"""A traced model's MoE layers over ``ep``: each layer's tokens gathered over the ``ep`` group.

``to_distributed`` splits a traced model's stacked experts ``[E, ...]`` over ``ep`` and
leaves the model's own dispatch code in place. Left to GSPMD, a one-hot dispatch (every
expert on every token, combined by the router's weights) runs as its propagation picks:
at ep8 with the Qwen3-MoE style's 8 experts of width 16, the backward pass gathered every
expert stack whole (measured). :func:`gather_expert_tokens` instead pins each MoE layer's
boundary, as MaxText's "ring of experts" does: its input is all-gathered over ``ep``
and its output summed back to the ``ep`` ranks' tokens. Each rank then runs its ``E / ep``
experts on the ``ep`` group's tokens, and the experts never move. The backward pass does
the reverse: the output's cotangent is all-gathered and the input's summed.

The boundary is two sharding constraints on each side, so their transposes pin the
cotangents too:

* input: ``tokens split over every data axis`` then ``... but ep``;
* output: ``... but ep`` then ``every data axis``.

The layer is the module holding a router (the router module's parent: Qwen3-MoE's and
gpt-oss's ``mlp``). Its class becomes a subclass of the same name whose ``__call__``
wraps the original; one subclass per class, so alike blocks stay alike for a scan. The
first positional argument and the output (or a tuple output's first item) are pinned;
values are unchanged.

Example:
  >>> import jax
  >>> from flax import nnx
  >>> from jfleet.testing.nnx_styles import MOE_STYLES
  >>> model = MOE_STYLES["qwen3_moe"].build(nnx.Rngs(0))
  >>> mesh = jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  >>> gather_expert_tokens(model, ["model.layers.0.mlp", "model.layers.1.mlp"], mesh)
  >>> type(model.model.layers[0].mlp).__qualname__
  'Qwen3MoeSparseMoeBlock[ep tokens]'
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jfleet.auto_parallel.match.matched import module_at
from jfleet.mesh.layer_mesh import constrain
from jfleet.mesh.topology import DATA_AXES, EP

__all__ = ["gather_expert_tokens"]


def _pins(mesh: Mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    data = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    return data, tuple(a for a in data if a != EP)


def _pin(x: Any, mesh: Mesh, first: tuple[str, ...], then: tuple[str, ...]) -> Any:
    if not isinstance(x, jax.Array) or x.ndim < 2:
        return x
    rest = (None,) * (x.ndim - 1)
    return constrain(constrain(x, mesh, first, *rest), mesh, then, *rest)


@functools.cache
def _gathering_class(base: type, mesh: Mesh) -> type:
    data, without_ep = _pins(mesh)

    def __call__(self, x, *args, **kwargs):  # noqa: N807
        out = base.__call__(self, _pin(x, mesh, data, without_ep), *args, **kwargs)
        if isinstance(out, tuple) and out:
            return (_pin(out[0], mesh, without_ep, data), *out[1:])
        return _pin(out, mesh, without_ep, data)

    name = f"{base.__name__}[ep tokens]"
    return type(base.__name__, (base,), {"__call__": __call__, "__qualname__": name})


def gather_expert_tokens(model: nnx.Module, layers: Iterable[str], mesh: Mesh) -> None:
    """Pins the boundary of each MoE layer at ``layers`` (dotted paths) so its tokens are
    gathered over ``mesh``'s ``ep`` axis (see the module's docstring), in place.

    Raises:
      ValueError: the mesh has no ``ep`` axis above 1.
    """
    if mesh.shape.get(EP, 1) <= 1:
        raise ValueError(f"gather_expert_tokens needs an ep axis above 1; mesh has {mesh.shape}.")
    for path in layers:
        layer = module_at(model, path)
        base = type(layer)
        if "[ep tokens]" not in base.__qualname__:
            layer.__class__ = _gathering_class(base, mesh)

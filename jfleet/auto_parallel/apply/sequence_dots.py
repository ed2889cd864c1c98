"""Megatron's sequence parallelism inside the blocks of a model written without it.

Between blocks ``to_distributed``'s sequence parallel keeps activations split over the
sequence on ``mp`` (:class:`~jfleet.auto_parallel.apply.blocks.SequenceConstraint`). Left
to itself, GSPMD carries that split into the block: it runs the projections on sequence
shards and all-gathers their column- and row-split weights in every layer's forward,
recomputation and backward (measured on TinyLlama, width 256, dp2 x mp4: each block's
weights gathered three times a step). Megatron instead all-gathers the sequence before
each column-parallel projection and reduce-scatters after each row-parallel one (and the
reverse for their cotangents), so the weights stay split and only activations move.

:func:`pin_sequence_projections` gives the model's own projections that program through
the hooks Flax exposes for it: the ``dot_general`` of an ``nnx.Linear`` /
``nnx.LinearGeneral`` and the ``einsum_op`` of an ``nnx.Einsum`` become a
:class:`SequenceProjection`, which wraps the op it replaces. Only projections the plan
splits over ``mp`` in a column or row role (q, k, v, gate, up; o, down) inside the decoder
blocks change; a projection written as a bare ``x @ w`` keeps GSPMD's choice.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> auto = (jax.sharding.AxisType.Auto,) * 2
  >>> mesh = jax.make_mesh((2, 4), ("dp", "mp"), axis_types=auto, devices=jax.devices()[:8])
  >>> layer = nnx.Linear(8, 16, rngs=nnx.Rngs(0))
  >>> layer.dot_general = SequenceProjection(jax.lax.dot_general, mesh, "column", ())
  >>> layer(jnp.ones((2, 4, 8))).shape
  (2, 4, 16)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.match.matched import COLUMN_ROLES, ROW_ROLES
from jfleet.mesh.layer_mesh import constrain
from jfleet.mesh.topology import DATA_AXES, MP

__all__ = ["SequenceProjection", "pin_sequence_projections"]


@dataclasses.dataclass(frozen=True)
class SequenceProjection:
    """A projection's op (``dot_general`` or ``einsum_op``) with Megatron's
    sequence-parallel layouts around it.

    ``role="column"``: the input's sequence (dim 1 of ``[batch, seq, ...]``) is gathered
    over ``mp`` first, kept split over ``seq_axes`` (``sep``), and its cotangent is
    reduce-scattered back; ``"row"``: the output's sequence is split over ``seq_axes`` and
    ``mp`` (its partial sums reduce-scattered), its cotangent all-gathered. Hashable: it is
    a static attribute of the layer.
    """

    inner: Callable[..., jax.Array]
    mesh: Mesh
    role: str
    seq_axes: tuple[str, ...]

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        whole = functools.partial(_pin, self.mesh, self.seq_axes or None)
        split = functools.partial(_pin, self.mesh, (*self.seq_axes, MP))
        args = list(args)
        at = 1 if isinstance(args[0], str) else 0  # einsum_op(spec, lhs, rhs) / (lhs, rhs)
        if self.role == "column" and args[at].ndim >= 3:
            args[at] = _relayout(args[at], whole, split)
        out = self.inner(*args, **kwargs)
        if self.role == "row" and out.ndim >= 3:
            out = _relayout(out, split, whole)
        return out


def _pin(mesh: Mesh, seq: Any, x: jax.Array) -> jax.Array:
    """``x`` (``[batch, seq, ...]``) with its sequence over ``seq``, its batch over the
    data axes."""
    return constrain(x, mesh, DATA_AXES, seq)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _relayout(x: jax.Array, forward: Any, backward: Any) -> jax.Array:
    """``forward(x)``, whose cotangent ``backward`` lays out (Megatron's paired all-gather
    and reduce-scatter; a sharding constraint alone transposes to itself)."""
    return forward(x)


def _relayout_fwd(x: jax.Array, forward: Any, backward: Any) -> tuple[jax.Array, None]:
    return forward(x), None


def _relayout_bwd(forward: Any, backward: Any, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (backward(ct),)


_relayout.defvjp(_relayout_fwd, _relayout_bwd)


def _split_over_mp(spec: P) -> bool:
    return any(MP in (e if isinstance(e, tuple) else (e,)) for e in spec if e)


def _hook(module: nnx.Module) -> str | None:
    """The attribute holding ``module``'s projection op, or None."""
    if isinstance(module, nnx.Einsum):
        return "einsum_op"
    if isinstance(module, nnx.LinearGeneral) and getattr(module, "dot_general_cls", None) is None:
        return "dot_general"  # None: jax.lax.dot_general
    if isinstance(module, nnx.Linear):
        return "dot_general"
    return None


def pin_sequence_projections(
    model: nnx.Module,
    params: Mapping[str, tuple[str | None, P]],
    blocks: Iterable[str],
    mesh: Mesh,
    seq_axes: tuple[str, ...] = (),
) -> int:
    """Gives each column- or row-parallel projection inside ``blocks`` (module paths) a
    :class:`SequenceProjection`; returns how many changed.

    ``params``: ``{kernel path: (role, spec)}`` from the plan; a projection changes when its
    kernel's role is a column or row role and its spec splits over ``mp``. ``seq_axes``:
    the sequence's axes other than ``mp`` (``sep``).
    """
    prefixes = tuple(f"{b}." for b in blocks)
    changed = 0
    for path, module in nnx.iter_graph(model):
        name = ".".join(str(p) for p in path)
        hook = _hook(module) if isinstance(module, nnx.Module) else None
        if hook is None or not f"{name}.".startswith(prefixes):
            continue
        role, spec = params.get(f"{name}.kernel", (None, P()))
        if role not in COLUMN_ROLES | ROW_ROLES or not _split_over_mp(spec):
            continue
        kind = "column" if role in COLUMN_ROLES else "row"
        inner = getattr(module, hook) or jax.lax.dot_general
        if isinstance(inner, SequenceProjection):  # applied before (a plan re-applied)
            inner = inner.inner
        setattr(module, hook, SequenceProjection(inner, mesh, kind, tuple(seq_axes)))
        changed += 1
    return changed

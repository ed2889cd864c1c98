"""Which projection feeds which: a dataflow walk over a traced module (for pattern matching).

:func:`probe` traces ``module(x)`` with ``jax.make_jaxpr`` and follows every value back
to the projection kernels whose matmul outputs it depends on. For each projection it
records which sibling projections feed its input (an attention's output projection is
fed by q, k and v; an MLP's down projection by gate and up), and the first reshape of its
output (q's ``[..., heads, head_dim]`` split gives the number of heads; a fused qkv's
gives its layout). Shape-only operations pass a kernel through; calls (``pjit``,
``custom_jvp_call``, ...) are walked inside.

Example:
  >>> from flax import nnx
  >>> from jfleet.models.llama import LlamaAttention
  >>> attn = nnx.eval_shape(lambda: LlamaAttention(32, 4, 2, rngs=nnx.Rngs(0)))
  >>> names = ["k_proj", "o_proj", "q_proj", "v_proj"]
  >>> flow = probe(attn, [(n, "kernel") for n in names], 32, "float32")
  >>> sorted(names[i] for i in flow.feeds[1])  # what feeds o_proj
  ['k_proj', 'q_proj', 'v_proj']
  >>> flow.reshapes[2]  # q_proj's output split into 4 heads of 8
  ((2, 4, 32), (2, 4, 4, 8))
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jfleet._logging import logger

__all__ = ["Flow", "probe", "propagate"]


class Flow:
    """Which sibling projections feed each projection, and how their outputs are reshaped."""

    def __init__(self) -> None:
        self.feeds: dict[int, set[int]] = collections.defaultdict(set)
        self.reshapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}


_SHAPE_OPS = frozenset(
    {"convert_element_type", "reshape", "transpose", "copy", "squeeze", "expand_dims"}
)


def _sub_jaxpr(eqn: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is None:
            continue
        inner = getattr(sub, "jaxpr", sub)
        if (
            hasattr(inner, "eqns")
            and len(inner.invars) == len(eqn.invars)
            and len(inner.outvars) == len(eqn.outvars)
        ):
            return inner
    return None


def propagate(jaxpr: Any, ins: list, flow: Flow) -> list:
    from jax.extend.core import Literal

    env: dict[Any, tuple] = {}
    empty: tuple = (None, frozenset())
    for var, info in zip(jaxpr.invars, ins, strict=True):
        env[var] = info

    def read(a: Any) -> tuple:
        return empty if isinstance(a, Literal) else env.get(a, empty)

    for eqn in jaxpr.eqns:
        args = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        sub = _sub_jaxpr(eqn)
        if name == "dot_general" and len(args) == 2:
            (ka, sa), (kb, sb) = args
            if kb is not None and ka is None:
                flow.feeds[kb] |= sa
                outs = [(None, sa | {kb})]
            elif ka is not None and kb is None:
                flow.feeds[ka] |= sb
                outs = [(None, sb | {ka})]
            else:
                outs = [(None, sa | sb)]
        elif sub is not None:
            outs = propagate(sub, args, flow)
        elif name in _SHAPE_OPS and len(args) == 1:
            outs = [args[0]]
            kern, src = args[0]
            if name == "reshape" and kern is None and len(src) == 1:
                (only,) = src
                shape_in = tuple(eqn.invars[0].aval.shape)
                shape_out = tuple(eqn.outvars[0].aval.shape)
                flow.reshapes.setdefault(only, (shape_in, shape_out))
        else:
            src = frozenset().union(*(s for _, s in args)) if args else frozenset()
            outs = [(None, src)] * len(eqn.outvars)
        for var, info in zip(eqn.outvars, outs, strict=False):
            env[var] = info
    return [read(v) for v in jaxpr.outvars]


def probe(container: Any, kernels: Sequence[tuple], width: int, dtype: Any) -> Flow | None:
    """Traces ``container(x)`` for ``x: [2, 4, width]``; None when that call fails.

    Args:
      container: the module holding the projections.
      kernels: each projection's kernel path relative to ``container``
        (``("q_proj", "kernel")``); the flow's indices refer to this order.
      width: the model width (the input's last dimension).
      dtype: the input's dtype.
    """
    try:
        graphdef, state = nnx.split(container)
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        index = {}
        for i, (kpath, _) in enumerate(leaves):
            keys = tuple(
                getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in kpath
            )
            index[keys] = i
        ids = {}
        for j, rel in enumerate(kernels):
            hits = [i for keys, i in index.items() if keys[: len(rel)] == rel]
            if len(hits) != 1:
                return None
            ids[hits[0]] = j
        x = jax.ShapeDtypeStruct((2, 4, width), dtype)
        closed = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    except Exception as err:  # any failure: no trace, names decide
        logger.debug("pattern probe of %s failed: %s", type(container).__name__, err)
        return None
    jaxpr = closed.jaxpr
    ins = [(ids.get(i), frozenset()) for i in range(len(jaxpr.invars) - 1)]
    ins.append((None, frozenset()))
    flow = Flow()
    try:
        propagate(jaxpr, ins, flow)
    except Exception as err:  # a primitive the walk does not know: no trace
        logger.debug("pattern probe propagation failed: %s", err)
        return None
    return flow

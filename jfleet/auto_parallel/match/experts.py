"""Routed experts in a traced model: the routers, the stacked expert weights, their spec.

A **router** is a ``[D, E]`` kernel inside a decoder block whose scores a ``jax.lax.top_k``
reads (through a softmax or not: :attr:`~jfleet.auto_parallel.match.dataflow.Trace.top_k`),
``k`` of ``E``. Its **experts** are the parameters beside it — under the module holding the
router's module (the MoE block: Qwen3-MoE's ``mlp``, gpt-oss's ``mlp``) — whose leading
dimension is ``E``: stacked ``[E, D, F]`` / ``[E, F, D]`` kernels and their ``[E, F]`` /
``[E, D]`` biases, however the code dispatches to them (a one-hot combine over every
expert, a gather of each token's experts, ``jax.lax.ragged_dot`` over sorted tokens). The
router's own bias goes with it. The spec's ``dispatch`` says how the code reaches them:
each whole stack in products that keep the expert dimension (every expert on every token,
or the slots of a one-hot capacity dispatch: ``"einsum"``, with the rows a token costs
from the products' FLOPs over the router's tokens), as the groups of ``ragged_dot``
products over token copies sorted by expert (``"ragged"``), by a per-token gather of the
experts' weights (``"gather"``), or otherwise (``"own"``). Experts kept as a list of alike
modules beside the router (Mixtral's ``nnx.List``) are taken as ``"list"``: their kernels
(each expert's hidden dimension the one ``ep`` splits), the rows a token from the products'
FLOPs.

:func:`find_experts` returns the :class:`~jfleet.auto_parallel.match.moe_spec.MoESpec`
and the routed parameters' paths; :func:`split_routed` takes them and the products that
read them out of the patterns' ``params`` and ``dots`` (the spec prices them instead).

Example:
  >>> from flax import nnx
  >>> from jfleet.auto_parallel import match_patterns
  >>> from jfleet.testing.nnx_styles import MOE_STYLES
  >>> style = MOE_STYLES["qwen3_moe"]
  >>> found = match_patterns(style.build(nnx.Rngs(0)), style.batches(1)[0],
  ...                        forward=style.forward)
  >>> found.moe.experts, found.moe.top_k, found.moe.expert_ffn, found.moe.dispatch
  (8, 2, 16, 'einsum')
  >>> found.moe.rows_per_token  # every expert on every token
  8.0
  >>> sorted(p.path for p in found.routed if p.block == 0)[:2]
  ['model.layers.0.mlp.down_proj', 'model.layers.0.mlp.gate.kernel']
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flax import nnx

from jfleet.auto_parallel.match.dataflow import Trace
from jfleet.auto_parallel.match.matched import ParamInfo
from jfleet.auto_parallel.match.module_parts import Blocks
from jfleet.auto_parallel.match.moe_spec import MoESpec
from jfleet.auto_parallel.match.ragged_rows import ragged_rows_problem
from jfleet.auto_parallel.match.tag_walk import Dot

__all__ = ["Routed", "find_experts", "moe_layer_paths", "ragged_rows_checked", "split_routed"]


@dataclasses.dataclass(frozen=True)
class Routed:
    """What :func:`find_experts` found.

    Attributes:
      spec: the experts as the cost model prices them, or None.
      experts: trace indices of the stacked expert weights (leading dim ``E``).
      routers: trace indices of the routers' parameters (kernel and bias).
      notes: why routers were found but no spec made.
    """

    spec: MoESpec | None = None
    experts: frozenset[int] = frozenset()
    routers: frozenset[int] = frozenset()
    notes: tuple[str, ...] = ()

    @property
    def indices(self) -> frozenset[int]:
        """Every routed parameter (experts and routers)."""
        return self.experts | self.routers


def _under(path: tuple, prefix: tuple) -> bool:
    return path[: len(prefix)] == prefix


def _ffn(kernels: Sequence[tuple[int, ...]], width: int) -> tuple[int, int] | None:
    """``(F, matrices)`` of one expert from its ``[E, a, b]`` kernels: ``F`` the smallest
    side that is not the width (a fused ``gate_up [E, D, 2F]`` counts as two matrices)."""
    sides = [b if a == width else a for _, a, b in kernels if width in (a, b)]
    if len(sides) != len(kernels) or not sides:
        return None
    ffn = min(sides)
    elems = sum(a * b for _, a, b in kernels)
    matrices, rest = divmod(elems, width * ffn)
    return (ffn, matrices) if not rest and matrices in (2, 3) else None


@dataclasses.dataclass(frozen=True)
class _Layer:
    block: int
    k: int
    experts: int
    ffn: tuple[int, int]
    routers: frozenset[int]
    stacked: frozenset[int]
    dispatch: tuple[str, float | None]


def _router_tokens(trace: Trace, router: int) -> float:
    """The tokens a router's products read (its FLOPs over ``2 x D x E``)."""
    width, experts = trace.shapes[router]
    return sum(d.flops for d in trace.dots if d.param == router) / (2 * width * experts)


def _dispatch(
    trace: Trace, router: int, kernels: set[int], stacked: frozenset[int]
) -> tuple[str, float | None]:
    """``("einsum", rows a token)`` when every stacked kernel is read by products that keep
    its expert dimension (free or batched); ``("ragged", None)`` when every stacked
    parameter is read only as the groups of a ``ragged_dot``; ``("gather", None)`` when
    only each token's experts' slices are gathered (``w[expert_indices]``); else ``("own",
    None)``."""
    if stacked <= trace.grouped:
        return "ragged", None
    if stacked <= trace.taken:
        return "gather", None
    experts = trace.shapes[router][1]
    tokens = _router_tokens(trace, router)
    rows = []
    for i in kernels:
        keeps = 0 in trace.free.get(i, ()) or trace.batched.get(i) == experts
        flops = sum(d.flops for d in trace.dots if d.param == i)
        if not (keeps and flops and tokens):
            return "own", None
        rows.append(flops * experts / (2 * math.prod(trace.shapes[i]) * tokens))
    return "einsum", max(rows)


def _listed(
    trace: Trace, router: int, owner: tuple, beside: list[int], experts: int
) -> tuple[tuple[int, int], frozenset[int], tuple[str, float]] | None:
    """``((F, matrices), the experts' kernels, ("list", rows a token))`` of a list of
    ``experts`` alike expert modules beside the router (Mixtral's ``nnx.List`` of
    ``w1`` / ``w2`` / ``w3``): each ``E``-th of the parameters under one attribute, the same
    bias-free ``[D, F]`` / ``[F, D]`` kernels, all read by products; else None."""
    width = trace.shapes[router][0]
    by_attr: dict = {}
    for i in beside:
        rest = trace.paths[i][len(owner) :]
        if len(rest) >= 3 and isinstance(rest[1], int):
            by_attr.setdefault(rest[0], {}).setdefault(rest[1], {})[rest[2:]] = i
    for members in by_attr.values():
        if sorted(members) != list(range(experts)):
            continue
        names = {tuple(sorted(m)) for m in members.values()}
        shapes = {tuple(trace.shapes[m[n]] for n in sorted(m)) for m in members.values()}
        if len(names) != 1 or len(shapes) != 1:
            continue
        (one,) = shapes
        ffn = _ffn([(1, *s) for s in one], width) if all(len(s) == 2 for s in one) else None
        kernels = frozenset(i for m in members.values() for i in m.values())
        flops = sum(d.flops for d in trace.dots if d.param in kernels)
        tokens = _router_tokens(trace, router)
        if ffn is None or not flops or not tokens:
            continue
        rows = flops / (2 * sum(math.prod(s) for s in one) * tokens)  # expert rows a token
        return ffn, kernels, ("list", rows)
    return None


def _layer(trace: Trace, blocks: Blocks, router: int, k: int, experts: int) -> _Layer | str | None:
    """One MoE layer around ``router`` (None: not a router in a block; a str: why no spec)."""
    path, shape = trace.paths[router], trace.shapes[router]
    block = blocks.of(path)
    if block is None or len(shape) != 2 or shape[-1] != experts or len(path) < 3:
        return None
    module, owner = path[:-1], path[:-2]
    routers = frozenset(i for i, p in enumerate(trace.paths) if p[:-1] == module)
    beside = [i for i, p in enumerate(trace.paths) if _under(p, owner) and i not in routers]
    kernels = {i for i in beside if len(trace.shapes[i]) == 3 and trace.shapes[i][0] == experts}
    outputs = {trace.shapes[i][-1] for i in kernels}
    biases = {i for i in beside if trace.shapes[i] in {(experts, n) for n in outputs}}
    stacked = frozenset(kernels | biases)  # [E, a, b] kernels and their [E, b] biases
    ffn = _ffn([trace.shapes[i] for i in kernels], shape[0])
    if ffn is None:
        listed = _listed(trace, router, owner, beside, experts)
        if listed is not None:
            return _Layer(block, k, experts, listed[0], routers, listed[1], listed[2])
        return (
            f"{'.'.join(map(str, module))} routes to the top {k} of {experts} experts, but no "
            f"stacked [{experts}, ...] expert kernels of width {shape[0]} lie beside it, nor "
            f"a list of {experts} alike expert modules of bias-free [{shape[0]}, F] / "
            f"[F, {shape[0]}] kernels; its experts are priced as dense layers and ep stays 1"
        )
    dispatch = _dispatch(trace, router, kernels, stacked)
    return _Layer(block, k, experts, ffn, routers, stacked, dispatch)


def find_experts(trace: Trace | None, blocks: Blocks) -> Routed:
    """The routed experts of a traced model (see the module's docstring); an empty
    :class:`Routed` for a dense model."""
    if trace is None:
        return Routed()
    found = [_layer(trace, blocks, r, k, e) for r, (k, e) in sorted(trace.top_k.items())]
    notes = tuple(f for f in found if isinstance(f, str))
    if len(notes) > 1:
        notes = (f"{notes[0]} (and alike in {len(notes) - 1} more blocks)",)
    layers = sorted((f for f in found if isinstance(f, _Layer)), key=lambda f: f.block)
    if not layers or notes:
        return Routed(notes=notes)
    at = [f.block for f in layers]
    every = at[1] - at[0] if len(at) > 1 else len(blocks.paths)
    regular = at == list(range(at[0], len(blocks.paths), every)) and at[0] < every
    kinds = {(f.k, f.experts, f.ffn, f.dispatch) for f in layers}
    if len(kinds) != 1 or not regular:
        why = "layers of different experts" if len(kinds) != 1 else f"at blocks {at}"
        return Routed(
            notes=(
                f"routed experts found ({why}) are not one repeating MoE layer; they are "
                "priced as dense layers and ep stays 1",
            )
        )
    ((k, experts, (ffn, matrices), (dispatch, rows)),) = kinds
    spec = MoESpec(
        experts=experts,
        top_k=k,
        expert_ffn=ffn,
        layers=len(layers),
        every=every if len(layers) > 1 else 1,
        gated=matrices == 3,
        dispatch=dispatch,
        rows_per_token=rows,
    )
    return Routed(
        spec=spec,
        experts=frozenset().union(*(f.stacked for f in layers)),
        routers=frozenset().union(*(f.routers for f in layers)),
    )


def split_routed(
    infos: Sequence[ParamInfo], dots: Sequence[Dot], routed: Routed, trace: Trace
) -> tuple[tuple[ParamInfo, ...], tuple[ParamInfo, ...], tuple[Dot, ...]]:
    """``(params, routed params, dots)``: the routed parameters taken out of ``infos``, and
    the products reading them (an expert's or the router's product, the combine of the
    experts' outputs by the router's weights, a gathered expert's product) out of ``dots``."""
    if routed.spec is None:
        return tuple(infos), (), tuple(dots)
    names = {".".join(map(str, trace.paths[i])) for i in routed.indices}
    routers = {".".join(map(str, trace.paths[i])) for i in routed.routers}
    kept = tuple(p for p in infos if p.path not in names)
    taken = tuple(
        dataclasses.replace(p, role="router", split_dim=None, units=0)
        if p.path in routers
        else dataclasses.replace(p, role=p.role or "expert")
        for p in infos
        if p.path in names
    )
    reads = routed.indices
    left = tuple(
        d for d in dots if d.param not in reads and not (d.param is None and d.last & reads)
    )
    return kept, taken, left


def ragged_rows_checked(
    routed: Routed, trace: Trace, model: nnx.Module, call: Callable[[nnx.Module], Any]
) -> Routed:
    """``routed``, its ``"ragged"`` dispatch kept only where every MoE layer can run each
    ``ep`` rank's rows (:func:`~jfleet.auto_parallel.match.ragged_rows.ragged_rows_problem`,
    ``call(model)`` tracing the model abstractly); else ``"own"``, with a note saying why."""
    spec = routed.spec
    if spec is None or spec.dispatch not in ("ragged", "gather", "list"):
        return routed
    layers = moe_layer_paths(trace.path(i) for i in routed.routers)
    first = layers[0] + "."
    width = next(trace.shapes[i][0] for i in routed.routers if len(trace.shapes[i]) == 2)
    stacks = {  # a listed expert's [D, F] kernel splits its columns over ep, [F, D] its rows
        trace.path(i)[len(first) :]: int(spec.dispatch == "list" and trace.shapes[i][0] == width)
        for i in routed.experts
        if trace.path(i).startswith(first)
    }
    problem = ragged_rows_problem(model, layers, stacks, call, spec.dispatch == "list")
    if problem is None:
        return routed
    how = {
        "ragged": "ragged_dots over token copies sorted by expert",
        "gather": "products with each token's gathered expert weights",
        "list": "a list of expert modules",
    }[spec.dispatch]
    note = (
        f"{layers[0]} applies its experts by {how}, but an ep rank cannot compute its "
        f"experts' rows alone: {problem}; its dispatch is priced as routed rows and ep is "
        "not searched"
    )
    return dataclasses.replace(
        routed, spec=dataclasses.replace(spec, dispatch="own"), notes=(*routed.notes, note)
    )


def moe_layer_paths(router_params: Iterable[str]) -> list[str]:
    """The MoE layers' paths from their routers' parameter paths (the router module's
    parent), in order.

    Example:
      >>> moe_layer_paths(["m.layers.0.mlp.gate.kernel", "m.layers.0.mlp.gate.bias"])
      ['m.layers.0.mlp']
    """
    return sorted({p.rsplit(".", 2)[0] for p in router_params})

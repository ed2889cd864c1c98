"""The parts of a model its module tree shows: parameters, dense layers, embeddings, norms,
the head and the repeated blocks.

:func:`read_parts` reads an ``nnx.Module`` without tracing it; the matcher's steps
(:mod:`jfleet.auto_parallel.match.patterns`) add what the trace shows. :class:`Parts` carries the
roles found so far (``{path: (role, kind, split_dim, units)}``) and the notes.

Example:
  >>> from jfleet.models.llama import TinyLlama
  >>> parts = read_parts(TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))
  >>> find_embeddings(parts); find_norms(parts)
  >>> parts.width, parts.vocab, parts.norm, parts.roles[("embed_tokens", "embedding")]
  (32, 64, 'rmsnorm', ('embedding', 'table', 0, 64))
  >>> blocks = find_blocks(parts)
  >>> [path_str(p) for p in blocks.paths], blocks.cls, blocks.of(("layers", 1, "mlp"))
  (['layers.0', 'layers.1'], 'LlamaDecoderLayer', 1)
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

from flax import nnx

from jfleet.auto_parallel.match.matched import path_str
from jfleet.auto_parallel.match.pairs import name_hint
from jfleet.parallel.alike import block_period

__all__ = [
    "Blocks",
    "Dense",
    "Parts",
    "find_blocks",
    "find_embeddings",
    "find_head",
    "find_norms",
    "read_parts",
]

_TOKEN_HINTS = ("tok", "wte", "word", "embed_tokens")

#: ``(role, kind, split_dim, units)`` of one parameter.
Role = tuple[str, str, int | None, int]


@dataclasses.dataclass
class Dense:
    """A module holding one 2-D kernel (and at most a matching bias): a dense layer."""

    path: tuple
    name: str
    module: Any
    kernel: tuple
    bias: tuple | None
    n_in: int
    n_out: int


@dataclasses.dataclass
class Parts:
    """What the module tree shows, and the roles found so far.

    Attributes:
      plist: ``(path, value)`` of every ``nnx.Param`` in ``nnx.state`` order.
      params: the same as a dict.
      modules: ``(path, module)`` of every module.
      dense: the dense layers (:class:`Dense`).
      roles: ``{param path: (role, kind, split_dim, units)}`` found so far.
      notes: why parts were left unmatched.
      width: the model width, once known.
      vocab: the token vocabulary (0: none found).
      token: ``(module path, module)`` of the token embedding (module None for a bare table).
      norm: the first norm's kind (``rmsnorm``, ``layernorm``, ``other``).
    """

    plist: list[tuple[tuple, Any]]
    params: dict[tuple, Any]
    modules: list[tuple[tuple, Any]]
    dense: list[Dense]
    roles: dict[tuple, Role] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    width: int | None = None
    vocab: int = 0
    token: tuple | None = None
    norm: str | None = None


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The block stacks: the longest run of >= 2 sibling modules alike in parameters, and
    any further list of such blocks beside it (an encoder-decoder's two stacks).

    ``paths`` holds every stack's blocks, stack by stack in the model's order; ``stacks``
    each stack's paths and class. ``period`` is None with more than one stack (one
    definition cannot run them all).
    """

    paths: tuple[tuple, ...]
    cls: str | None
    period: int | None
    stacks: tuple[tuple[tuple[tuple, ...], str], ...] = ()

    def of(self, path: tuple) -> int | None:
        """The index of the block holding ``path``, or None outside the blocks."""
        for i, b in enumerate(self.paths):
            if path[: len(b)] == b:
                return i
        return None


def read_parts(model: nnx.Module) -> Parts:
    """The parameters, modules and dense layers of ``model``.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``.
      ValueError: it has no ``nnx.Param``.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model is a {type(model).__name__}, not an nnx.Module; pass a Flax NNX module."
        )
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    plist = [(tuple(path), var.get_value()) for path, var in flat]
    if not plist:
        raise ValueError(
            f"{type(model).__name__} has no nnx.Param: there is nothing to distribute; "
            "build the model's layers (with their parameters) before planning."
        )
    params = dict(plist)
    modules = list(nnx.iter_modules(model))
    dense = [d for p, m in modules if (d := _dense_of(p, m, params)) is not None]
    return Parts(plist=plist, params=params, modules=modules, dense=dense)


def direct_params(prefix: tuple, params: dict[tuple, Any]) -> dict[str, Any]:
    """The parameters held by the module at ``prefix`` itself, by name."""
    n = len(prefix)
    return {p[n]: v for p, v in params.items() if len(p) == n + 1 and p[:n] == prefix}


def _dense_of(path: tuple, module: Any, params: dict[tuple, Any]) -> Dense | None:
    if isinstance(module, nnx.Embed | nnx.Conv | nnx.ConvTranspose):
        return None
    own = direct_params(path, params)
    mats = [(k, v) for k, v in own.items() if len(v.shape) == 2]
    vecs = [(k, v) for k, v in own.items() if len(v.shape) == 1]
    if len(mats) != 1 or len(own) != len(mats) + len(vecs) or len(vecs) > 1:
        return None
    (kname, kernel) = mats[0]
    n_in, n_out = kernel.shape
    bias = None
    if vecs:
        if vecs[0][1].shape != (n_out,):
            return None
        bias = (*path, vecs[0][0])
    name = str(path[-1]) if path else ""
    return Dense(path, name, module, (*path, kname), bias, n_in, n_out)


def _is_norm(path: tuple, module: Any, params: dict) -> bool:
    if isinstance(module, nnx.RMSNorm | nnx.LayerNorm):
        return True
    own = direct_params(path, params)
    return (
        "norm" in type(module).__name__.lower()
        and bool(own)
        and all(len(v.shape) == 1 for v in own.values())
    )


# ------------------------------------------------------------------ embeddings, norms
def find_embeddings(parts: Parts, fed: frozenset = frozenset()) -> None:
    """The ``nnx.Embed`` tables: the token embedding (vocabulary parallel) and the others of
    its width (position / type embeddings, replicated); sets the width and vocab.

    ``fed``: module paths of the tables the trace gathers from with indices computed from
    the model's inputs (:attr:`~jfleet.auto_parallel.match.dataflow.Trace.lookups`). The token
    embedding is one of them when there are any: a table indexed by positions made inside
    the model (``arange``) or by relative-position buckets never is, whatever its shape.
    Without a trace, or when several are fed, the tables' shapes and names decide.
    """
    embeds = [(p, m) for p, m in parts.modules if isinstance(m, nnx.Embed)]
    if not embeds:
        return
    by_inputs = [(p, m) for p, m in embeds if p in fed]
    if len(by_inputs) == 1:
        token = by_inputs[0]
        width = token[1].features
        same = [(p, m) for p, m in embeds if m.features == width]
    else:
        candidates = by_inputs or embeds
        feats = collections.Counter(m.features for _, m in candidates)
        width = feats.most_common(1)[0][0]
        same = [(p, m) for p, m in candidates if m.features == width]
        token = _token_by_shape(parts, same, width)
    parts.width, parts.token, parts.vocab = width, token, token[1].num_embeddings
    for p, _ in same:
        if p == token[0]:
            parts.roles[(*p, "embedding")] = ("embedding", "table", 0, parts.vocab)
        else:
            parts.roles[(*p, "embedding")] = ("position_embedding", "table", None, 0)


def _token_by_shape(parts: Parts, same: list, width: int) -> tuple:
    """Among tables of the model width: the one whose vocabulary a dense layer produces,
    else the one named like a token table, else the largest."""
    heads_out = {d.n_out for d in parts.dense if d.n_in == width}
    token = next(((p, m) for p, m in same if m.num_embeddings in heads_out and len(same) > 1), None)
    if token is None:
        named = [(p, m) for p, m in same if name_hint(str(p[-1]), _TOKEN_HINTS)]
        token = named[0] if len(named) == 1 else max(same, key=lambda pm: pm[1].num_embeddings)
    return token


def find_norms(parts: Parts) -> None:
    """Norm parameters (replicated), the norm kind, and the width when no embedding set it."""
    norm_mods = [(p, m) for p, m in parts.modules if _is_norm(p, m, parts.params)]
    if parts.width is None:
        sizes = collections.Counter(
            v.shape[0] for p, m in norm_mods for v in direct_params(p, parts.params).values()
        )
        if sizes:
            parts.width = sizes.most_common(1)[0][0]
        elif parts.dense:
            parts.width = collections.Counter(d.n_in for d in parts.dense).most_common(1)[0][0]
    for p, m in norm_mods:
        for name, v in direct_params(p, parts.params).items():
            if len(v.shape) == 1:
                kind = "scale" if name in ("scale", "weight") else "bias"
                parts.roles[(*p, name)] = ("norm", kind, None, 0)
        kind = (
            "rmsnorm"
            if isinstance(m, nnx.RMSNorm)
            else "layernorm"
            if isinstance(m, nnx.LayerNorm)
            else "other"
        )
        parts.norm = parts.norm or kind


# ------------------------------------------------------------------ blocks
def _signature(prefix: tuple, params: dict[tuple, Any]) -> tuple:
    n = len(prefix)
    return tuple(
        sorted(
            (path_str(p[n:]), tuple(v.shape), str(v.dtype))
            for p, v in params.items()
            if p[:n] == prefix
        )
    )


def _key_order(k: Any) -> tuple:
    return (0, k, "") if isinstance(k, int) else (1, 0, str(k))


#: A further stack beside the largest is a list (integer keys) of at least this share of
#: its parameters: an encoder beside a decoder, not a list of small heads.
_STACK_SHARE = 4


def _runs(parts: Parts) -> list[tuple[int, list[tuple], str]]:
    """``(size, members, class)`` of every run of >= 2 sibling modules of one class with the
    same parameter paths, shapes and dtypes."""
    children: dict[tuple, list[tuple]] = collections.defaultdict(list)
    for path, _ in parts.modules:
        if path:
            children[path[:-1]].append(path)
    by_path = dict(parts.modules)
    runs = []
    for kids in children.values():
        groups: dict[tuple, list[tuple]] = collections.defaultdict(list)
        for kid in kids:
            sig = _signature(kid, parts.params)
            if sig:
                groups[(type(by_path[kid]).__name__, sig)].append(kid)
        for (cls, sig), members in groups.items():
            if len(members) >= 2:
                size = len(members) * sum(math.prod(s) for _, s, _ in sig)
                runs.append((size, sorted(members, key=lambda p: _key_order(p[-1])), cls))
    return runs


def _nested(a: tuple, b: tuple) -> bool:
    return a[: len(b)] == b or b[: len(a)] == a


def find_blocks(parts: Parts, used: tuple[tuple, ...] = ()) -> Blocks:
    """The longest run (by parameters) of >= 2 sibling modules of one class with the same
    parameter paths, shapes and dtypes, and the period they repeat with; with it, any other
    list of such blocks outside it of at least a quarter of its size (an encoder-decoder's
    other stack), in the order the forward runs them (``used``: parameter paths in the order
    the trace first uses them; else the module tree's order)."""
    runs = _runs(parts)
    if not runs:
        return Blocks(paths=(), cls=None, period=1)
    best = max(runs, key=lambda r: r[0])  # the first of the largest, as the tree lists them
    stacks = [best]
    for run in runs:
        size, members, _ = run
        if (
            run is not best
            and _STACK_SHARE * size >= best[0]
            and all(isinstance(m[-1], int) for m in members)
            and not any(_nested(m, o) for m in members for _, om, _ in stacks for o in om)
        ):
            stacks.append(run)
    order = {path: i for i, (path, _) in enumerate(parts.modules)}

    def first_use(run: tuple) -> tuple[int, int]:
        block = run[1][0]
        ranks = [i for i, p in enumerate(used) if p[: len(block)] == block]
        return (min(ranks) if ranks else len(used), order[block])

    stacks.sort(key=first_use)
    by_path = dict(parts.modules)
    paths = tuple(p for _, members, _ in stacks for p in members)
    period = block_period([by_path[b] for b in paths]) if len(stacks) == 1 else None
    return Blocks(
        paths=paths,
        cls=best[2],
        period=period,
        stacks=tuple((tuple(members), cls) for _, members, cls in stacks),
    )


# ------------------------------------------------------------------ head
def find_head(parts: Parts, blocks: Blocks, found_pairs: bool) -> bool | None:
    """The LM head: a dense ``width -> vocab`` or a bare ``[width, vocab]`` Param outside the
    blocks (column parallel over the vocabulary). Returns ``tied_head``: True when there is
    a token embedding and no separate head, False for a separate head, None without one."""
    width, vocab = parts.width, parts.vocab
    if not width or not (parts.token is not None or found_pairs):
        return None
    heads_found = [
        d
        for d in parts.dense
        if d.n_in == width
        and (d.n_out == vocab if vocab else d.n_out != width)
        and d.kernel not in parts.roles
        and blocks.of(d.path) is None
    ]
    kernels = {d.kernel for d in parts.dense}
    bare = [
        p
        for p, v in parts.params.items()
        if p not in parts.roles
        and len(v.shape) == 2
        and v.shape[0] == width
        and (v.shape[1] == vocab if vocab else False)
        and blocks.of(p) is None
        and p not in kernels
    ]
    if len(heads_found) + len(bare) == 1:
        if heads_found:
            d = heads_found[0]
            parts.vocab = vocab = vocab or d.n_out
            parts.roles[d.kernel] = ("head", "kernel", 1, vocab)
            if d.bias is not None:
                parts.roles[d.bias] = ("head", "bias", 0, vocab)
        else:
            parts.roles[bare[0]] = ("head", "kernel", 1, vocab)
        return False if parts.token is not None else None
    if len(heads_found) + len(bare) > 1:
        parts.notes.append(
            "several width -> vocab projections outside the blocks: "
            + ", ".join(path_str(d.kernel) for d in heads_found)
            + ", ".join(path_str(p) for p in bare)
            + "; none taken as the head"
        )
        return False if parts.token is not None else None
    return True if parts.token is not None else None

"""Find the transformer parts of an unannotated Flax NNX model, and their tensor-parallel roles.

:func:`match_patterns` traces one forward call of the model abstractly
(:func:`~jfleet.auto_parallel.dataflow.trace_model`: ``jax.make_jaxpr``, no FLOPs spent) and
reads the roles from the computation, not from names or kernel ranks:

* **projection pairs** (Megatron column then row): a projection — any ``dot_general`` with a
  parameter on one side: ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, a bare
  ``Param`` used with ``@`` or ``jnp.einsum`` — whose output dimension reaches another
  projection's contracted dimension through per-head or elementwise work only (reshapes,
  rotary, q/k norms, softmax, attention scores and values, gating). The consumer is split
  on that input dimension (row parallel), every producer on the output dimension feeding it
  (column parallel): the heads dimension for attention, hidden for MLPs, whatever the
  kernel's rank or einsum equation. A bias added to a column's output is split with it.
* **role names**, for reports: producers meeting in attention scores are ``q`` (left side)
  and ``k`` (right side), those feeding the values ``v`` (one producer in several places:
  ``qkv``, ``kv``); the consumer is ``o``. Without attention: ``gate`` (the producer passed
  through a nonlinearity before a product), ``up``, ``gate_up`` (one stacked producer), and
  ``down``.
* the **token embedding** (an ``nnx.Embed``; more than one ``Embed`` of the model width:
  the one whose vocabulary the head produces, else one named like ``wte`` /
  ``embed_tokens`` / ``tok``, else the largest), and **position / type embeddings** (the
  other ``Embed`` tables of the model width), vocabulary parallel / replicated;
* **norms**: the parameters of ``nnx.RMSNorm`` / ``nnx.LayerNorm`` modules (q/k norms of
  ``head_dim`` included), or of a module named ``*norm*`` holding only vectors: replicated;
* the **LM head**: a dense ``width -> vocab`` or a bare ``[width, vocab]`` Param outside the
  decoder blocks (column parallel over the vocabulary); with none, the head is taken to be
  tied to the token embedding (``embed.attend``);
* the **decoder blocks**: the longest run (by parameters) of >= 2 sibling modules of one
  class with the same parameter paths, shapes and dtypes: the pipeline candidate.

**Units.** Each split dimension carries the number of whole units a split must not cut
(heads, key/value heads, hidden features), read from the reshapes in the trace: a split
over ``mp`` is used only where ``mp`` divides them. Under grouped-query attention whose key /
value heads ``mp`` does not divide, k and v stay replicated and q / o are split
(:meth:`ParamInfo.spec_for`), which the plan notes.

**How the model is called.** ``inputs`` (the loader's first batch's input) and, for models
whose call needs more than ``model(inputs)``, ``forward(model, batch)``. Without inputs, a
model with a token embedding is traced on token ids ``[2, 8]``; other models are left
unmatched (data parallel).

Everything left replicated inside the decoder blocks that is not a norm or a row's bias is
listed with the reason (:attr:`ModelPatterns.replicated_in_blocks`).

Example:
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))
  >>> found.attention, found.mlp, found.dims.heads, found.dims.kv_heads, len(found.blocks)
  ('separate', 'swiglu', 4, 2, 2)
  >>> found.role("layers.0.self_attn.o_proj.kernel"), found.spec("embed_tokens.embedding")
  ('o', P('mp', None))
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.dataflow import Trace, TraceError, trace_model
from jfleet.auto_parallel.pairs import (
    attention_roles,
    bias_splits,
    contracted_size,
    mlp_roles,
    name_hint,
    pairs,
)
from jfleet.mesh.topology import MP
from jfleet.parallel.alike import block_period
from jfleet.runtime.log import logger

__all__ = [
    "COLUMN_ROLES",
    "ROW_ROLES",
    "DotCost",
    "ModelDims",
    "ModelPatterns",
    "ParamInfo",
    "match_patterns",
    "path_str",
]

#: Roles split on an output dimension over ``mp``.
COLUMN_ROLES = frozenset({"q", "k", "v", "qk", "kv", "qkv", "gate", "up", "gate_up"})
#: Roles split on an input (contracted) dimension over ``mp``.
ROW_ROLES = frozenset({"o", "down"})
_TOKEN_HINTS = ("tok", "wte", "word", "embed_tokens")
#: Token ids a model with an embedding is traced on when no input is given.
_DEFAULT_TOKENS = (2, 8)


def path_str(path: Sequence[Any]) -> str:
    """A parameter or module path as one dotted string (``('layers', 0)`` -> ``layers.0``).

    >>> path_str(("layers", 0, "self_attn", "q_proj", "kernel"))
    'layers.0.self_attn.q_proj.kernel'
    """
    return ".".join(str(getattr(k, "key", k)) for k in path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """One parameter: where it is, its shape and dtype, and what it was matched as.

    Attributes:
      path: dotted path (``layers.0.mlp.up_proj.kernel``).
      shape: the global shape.
      dtype: dtype name (``float32``).
      role: ``q``, ``k``, ``v``, ``qk``, ``kv``, ``qkv``, ``o``, ``gate``, ``up``,
        ``gate_up``, ``down``, ``embedding``, ``position_embedding``, ``head``, ``norm``;
        None when unmatched.
      kind: ``kernel``, ``bias``, ``table`` (embeddings), ``scale`` (norms) or ``other``.
      block: index of the decoder block holding it, or None outside the blocks.
      split_dim: the dimension split over ``mp`` (None: replicated).
      units: the whole units along ``split_dim`` (heads, hidden features, vocabulary rows)
        that a split must not cut: ``mp`` must divide it.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str | None = None
    kind: str = "other"
    block: int | None = None
    split_dim: int | None = None
    units: int = 0

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole (unsharded) parameter."""
        return self.size * jnp.dtype(self.dtype).itemsize

    @property
    def spec(self) -> P:
        """The tensor-parallel layout when ``mp`` divides :attr:`units` (else see spec_for)."""
        if self.split_dim is None:
            return P()
        return P(*(MP if d == self.split_dim else None for d in range(len(self.shape))))

    def spec_for(self, mp: int) -> P:
        """The layout at ``mp``: :attr:`spec`, or replicated when ``mp`` would cut a unit.

        >>> k = ParamInfo(path="k", shape=(32, 16), dtype="float32", role="k", kind="kernel",
        ...               split_dim=1, units=2)
        >>> k.spec_for(2), k.spec_for(4)
        (P(None, 'mp'), P())
        """
        if self.split_dim is None or (self.units and self.units % mp):
            return P()
        return self.spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The sizes a plan depends on (0 where the model has no such part).

    Attributes:
      vocab: vocabulary (token embedding rows, or the head's output).
      width: model width (hidden size).
      heads: query heads.
      kv_heads: key/value heads (== heads without grouped-query attention).
      head_dim: per-head size.
      hidden: MLP hidden size.
      layers: decoder blocks.
    """

    vocab: int = 0
    width: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    hidden: int = 0
    layers: int = 0

    @property
    def q_dim(self) -> int:
        """heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """kv_heads x head_dim."""
        return self.kv_heads * self.head_dim


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotCost:
    """One product of the traced forward pass, for the cost model.

    Attributes:
      flops: forward FLOPs at the traced shape (:attr:`ModelPatterns.traced_tokens`).
      param: the path of the parameter on one side (a projection), or None.
      block: the decoder block it runs in (None: outside the blocks).
      splits: ``(path, dim)``: a split of that parameter on that dim splits this product.
      grads: operands needing a gradient (the backward pass runs one product per operand).
      attention: a product of two activations (attention scores or values), whose FLOPs
        grow with the square of the sequence length.
    """

    flops: int
    param: str | None
    block: int | None
    splits: frozenset[tuple[str, int]]
    grads: int
    attention: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelPatterns:
    """What :func:`match_patterns` found.

    Attributes:
      params: every ``nnx.Param``, in ``nnx.state`` order, with its role.
      dims: the model's sizes.
      blocks: module paths of the decoder blocks, in order (the pipeline candidate;
        empty when there is no run of >= 2 identical blocks).
      block_class: the blocks' class name.
      attention: ``"separate"`` (q, k, v apart), ``"fused"`` (one qkv producer) or None.
      mlp: ``"swiglu"`` (gated), ``"gelu"`` (one up projection) or None.
      norm: ``"rmsnorm"``, ``"layernorm"``, ``"other"`` or None.
      tied_head: True when the head is the token embedding (no separate head found),
        False for a separate head, None without a token embedding.
      has_attention_bias: whether the attention projections carry biases.
      notes: why parts were left unmatched, for the warning and the plan.
      dots: the traced products (empty when the model was not traced).
      traced_tokens: ``(batch, seq)`` of the traced input (``dots``' FLOPs are for it).
      replicated_in_blocks: ``(path, reason)`` of every decoder-block parameter left
        replicated that is not a norm or a row's bias.
      block_period: the blocks repeat every this many (1: all alike, static settings
        included; 2: alternating local / global attention, ...); None when they do not
        repeat (:func:`jfleet.parallel.stack.block_period`). A pipeline stacks super-blocks
        of one period.
    """

    params: tuple[ParamInfo, ...]
    dims: ModelDims
    blocks: tuple[str, ...] = ()
    block_class: str | None = None
    attention: str | None = None
    mlp: str | None = None
    norm: str | None = None
    tied_head: bool | None = None
    has_attention_bias: bool = False
    notes: tuple[str, ...] = ()
    dots: tuple[DotCost, ...] = ()
    traced_tokens: tuple[int, int] | None = None
    replicated_in_blocks: tuple[tuple[str, str], ...] = ()
    block_period: int | None = 1

    @property
    def unmatched(self) -> tuple[str, ...]:
        """Paths of the parameters with no role (kept replicated)."""
        return tuple(p.path for p in self.params if p.role is None)

    @property
    def recognised(self) -> bool:
        """Whether any tensor-parallel role (attention, MLP, embedding, head) was found."""
        return any(p.role not in (None, "norm", "position_embedding") for p in self.params)

    @property
    def specs(self) -> dict[str, P]:
        """``{path: PartitionSpec}`` over ``mp`` for every parameter."""
        return {p.path: p.spec for p in self.params}

    @property
    def param_count(self) -> int:
        """Total number of parameter elements."""
        return sum(p.size for p in self.params)

    def role(self, path: str) -> str | None:
        """The role of the parameter at ``path`` (KeyError when there is none)."""
        return self._by_path()[path].role

    def spec(self, path: str) -> P:
        """The ``mp`` layout of the parameter at ``path`` (KeyError when there is none)."""
        return self._by_path()[path].spec

    def _by_path(self) -> dict[str, ParamInfo]:
        return {p.path: p for p in self.params}

    def replicated_at(self, mp: int) -> tuple[ParamInfo, ...]:
        """Decoder-block kernels (rank >= 2) that stay whole on every ``mp`` rank at ``mp``."""
        return tuple(
            p
            for p in self.params
            if p.block is not None and len(p.shape) >= 2 and p.spec_for(mp) == P()
        )

    def split_dims(self) -> tuple[int, ...]:
        """Every unit count a split needs ``mp`` to divide, outside the optional k / v splits."""
        out = set()
        for p in self.params:
            if p.split_dim is not None and p.role not in ("k", "v", "kv"):
                out.add(p.units or p.shape[p.split_dim])
        return tuple(sorted(out))

    def summary(self) -> str:
        """One line: the architecture found."""
        d = self.dims
        parts = [
            f"width {d.width}",
            f"vocab {d.vocab}" if d.vocab else "no vocabulary",
            f"attention {self.attention} ({d.heads} heads, {d.kv_heads} kv heads)"
            if self.attention
            else "no attention",
            f"mlp {self.mlp} (hidden {d.hidden})" if self.mlp else "no mlp",
            f"{len(self.blocks)} x {self.block_class}" if self.blocks else "no repeated blocks",
            {True: "tied head", False: "separate head", None: "no head"}[self.tied_head],
        ]
        return ", ".join(parts)


# ------------------------------------------------------------------ helpers
@dataclasses.dataclass
class _Dense:
    path: tuple
    name: str
    module: Any
    kernel: tuple
    bias: tuple | None
    n_in: int
    n_out: int


def _params_of(model: nnx.Module) -> list[tuple[tuple, jax.Array]]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return [(tuple(path), var.get_value()) for path, var in flat]


def _direct_params(prefix: tuple, params: dict[tuple, Any]) -> dict[str, Any]:
    n = len(prefix)
    return {p[n]: v for p, v in params.items() if len(p) == n + 1 and p[:n] == prefix}


def _dense_of(path: tuple, module: Any, params: dict[tuple, Any]) -> _Dense | None:
    if isinstance(module, nnx.Embed | nnx.Conv | nnx.ConvTranspose):
        return None
    own = _direct_params(path, params)
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
    return _Dense(path, name, module, (*path, kname), bias, n_in, n_out)


def _is_norm(path: tuple, module: Any, params: dict) -> bool:
    if isinstance(module, nnx.RMSNorm | nnx.LayerNorm):
        return True
    own = _direct_params(path, params)
    return (
        "norm" in type(module).__name__.lower()
        and bool(own)
        and all(len(v.shape) == 1 for v in own.values())
    )


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


def _find_blocks(modules, params) -> tuple[list[tuple], str | None]:
    children: dict[tuple, list[tuple]] = collections.defaultdict(list)
    for path, _ in modules:
        if path:
            children[path[:-1]].append(path)
    by_path = dict(modules)
    best: tuple[int, list[tuple], str | None] = (0, [], None)
    for kids in children.values():
        groups: dict[tuple, list[tuple]] = collections.defaultdict(list)
        for kid in kids:
            sig = _signature(kid, params)
            if not sig:
                continue
            groups[(type(by_path[kid]).__name__, sig)].append(kid)
        for (cls, sig), members in groups.items():
            if len(members) < 2:
                continue
            size = len(members) * sum(math.prod(s) for _, s, _ in sig)
            if size > best[0]:
                members = sorted(members, key=lambda p: _key_order(p[-1]))
                best = (size, members, cls)
    return best[1], best[2]


# ------------------------------------------------------------------ entry point
def _trace(model, inputs, forward, token, notes) -> tuple[Trace | None, tuple | None]:
    from jfleet.training.data import batch_shape

    if inputs is not None:
        trace = trace_model(model, inputs, forward)
        batch, seq = batch_shape(inputs, local=False)
        return trace, (batch or 1, seq or 1)
    if forward is not None:
        raise ValueError(
            "match_patterns got forward= but no inputs; pass the batch forward is called with."
        )
    if token is None:
        notes.append(
            "the model was not traced (no input given and no token embedding to make one); "
            "pass the first batch (to_distributed does) to find its projections"
        )
        return None, None
    tokens = jax.ShapeDtypeStruct(_DEFAULT_TOKENS, jnp.int32)
    try:
        return trace_model(model, tokens), _DEFAULT_TOKENS
    except TraceError as err:
        notes.append(f"the model was not traced on token ids {list(_DEFAULT_TOKENS)}: {err}")
        return None, None


def _reason(i: int, trace: Trace | None, projections: set[int]) -> str:
    if trace is None:
        return "not traced"
    if i not in projections:
        return "not used as a projection (a dot_general / einsum operand) in the traced forward"
    if i in trace.cut:
        return (
            f"its output dimension is cut ({trace.cut[i]}) before it reaches another "
            "projection, so a contiguous split would not give whole heads (e.g. a fused qkv "
            "laid out [3, heads, head_dim]: lay it out per head, [heads, 3, head_dim], to "
            "split it)"
        )
    return (
        "its output reaches no other projection through per-head or elementwise work, so "
        "there is no column/row pair to split it in"
    )


def match_patterns(
    model: nnx.Module,
    inputs: Any = None,
    *,
    forward: Callable[[nnx.Module, Any], Any] | None = None,
) -> ModelPatterns:
    """Matches embeddings, projection pairs, norms, the head and the decoder blocks of ``model``.

    Args:
      model: an ``nnx.Module`` with ordinary (unannotated) parameters (abstract ones from
        ``nnx.eval_shape`` too).
      inputs: what the model is called with for the trace (arrays or
        ``jax.ShapeDtypeStruct``\\ s; only shapes are read): the loader's first batch's
        input, or the whole batch when ``forward`` is given. Default: token ids ``[2, 8]``
        when the model has a token embedding, else no trace.
      forward: ``forward(model, inputs)`` when the model is not called as
        ``model(inputs)`` (it needs positions, a mask, a cache; a loss function works too).

    Returns:
      A :class:`ModelPatterns` with every parameter's role (None when unmatched).

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``.
      ValueError: the model has no ``nnx.Param``; ``forward`` without ``inputs``.
      TraceError: tracing the given ``inputs`` failed (the message suggests ``forward``).

    Example:
      >>> from jfleet.models.gpt2 import TinyGPT2
      >>> found = match_patterns(TinyGPT2(vocab=64, width=32, heads=4, layers=2))
      >>> found.attention, found.mlp, found.tied_head, found.spec("h.0.attn.c_attn.bias")
      ('fused', 'gelu', True, P('mp',))
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model is a {type(model).__name__}, not an nnx.Module; pass a Flax NNX module."
        )
    plist = _params_of(model)
    if not plist:
        raise ValueError(
            f"{type(model).__name__} has no nnx.Param: there is nothing to distribute; "
            "build the model's layers (with their parameters) before planning."
        )
    params = dict(plist)
    modules = list(nnx.iter_modules(model))
    # path -> (role, kind, split_dim, units)
    roles: dict[tuple, tuple[str, str, int | None, int]] = {}
    notes: list[str] = []

    # embeddings
    embeds = [(p, m) for p, m in modules if isinstance(m, nnx.Embed)]
    dense_list = [d for p, m in modules if (d := _dense_of(p, m, params)) is not None]
    width = None
    vocab = 0
    token = None
    if embeds:
        feats = collections.Counter(m.features for _, m in embeds)
        width = feats.most_common(1)[0][0]
        same = [(p, m) for p, m in embeds if m.features == width]
        heads_out = {d.n_out for d in dense_list if d.n_in == width}
        token = next(
            ((p, m) for p, m in same if m.num_embeddings in heads_out and len(same) > 1), None
        )
        if token is None:
            named = [(p, m) for p, m in same if name_hint(str(p[-1]), _TOKEN_HINTS)]
            token = named[0] if len(named) == 1 else max(same, key=lambda pm: pm[1].num_embeddings)
        vocab = token[1].num_embeddings
        for p, _ in same:
            if p == token[0]:
                roles[(*p, "embedding")] = ("embedding", "table", 0, vocab)
            else:
                roles[(*p, "embedding")] = ("position_embedding", "table", None, 0)
    norm_mods = [(p, m) for p, m in modules if _is_norm(p, m, params)]
    if width is None:
        sizes = collections.Counter(
            v.shape[0] for p, m in norm_mods for v in _direct_params(p, params).values()
        )
        if sizes:
            width = sizes.most_common(1)[0][0]
        elif dense_list:
            width = collections.Counter(d.n_in for d in dense_list).most_common(1)[0][0]
    norm_kind = None
    for p, m in norm_mods:
        for name, v in _direct_params(p, params).items():
            if len(v.shape) == 1:
                kind = "scale" if name in ("scale", "weight") else "bias"
                roles[(*p, name)] = ("norm", kind, None, 0)
        kind = (
            "rmsnorm"
            if isinstance(m, nnx.RMSNorm)
            else "layernorm"
            if isinstance(m, nnx.LayerNorm)
            else "other"
        )
        norm_kind = norm_kind or kind

    # blocks
    block_paths, block_class = _find_blocks(modules, params)
    by_path = dict(modules)
    period = block_period([by_path[b] for b in block_paths]) if block_paths else 1

    def block_of(path: tuple) -> int | None:
        for i, b in enumerate(block_paths):
            if path[: len(b)] == b:
                return i
        return None

    # projection pairs, from the traced computation
    trace, traced_tokens = _trace(model, inputs, forward, token, notes)
    dims = {"heads": 0, "kv_heads": 0, "head_dim": 0, "hidden": 0}
    attention = mlp = None
    attn_bias = False
    projections: set[int] = set()
    index: dict[tuple, int] = {}
    dots: list[DotCost] = []
    if trace is not None:
        index = {path: i for i, path in enumerate(trace.paths)}
        projections = {d.param for d in trace.dots if d.param is not None}
        tables = [trace.paths[i] for i in sorted(trace.lookups) if block_of(trace.paths[i]) is None]
        if token is None and tables:  # a bare Param table gathered with the token ids
            path = max(tables, key=lambda t: params[t].shape[0])
            token = (path[:-1], None)
            vocab, table_width = (int(n) for n in params[path].shape)
            width = width or table_width
            roles[path] = ("embedding", "table", 0, vocab)
        split: dict[int, tuple[int, int]] = {}
        named: dict[int, str] = {}
        exclude = {
            i
            for i, path in enumerate(trace.paths)
            if roles.get(path, ("",))[0] in ("embedding", "position_embedding")
            or (
                vocab
                and block_of(path) is None
                and len(trace.shapes[i]) == 2
                and trace.shapes[i] == (width, vocab)
            )
        }
        for group in pairs(trace, exclude):
            found = (attention_roles if group.attention else mlp_roles)(trace, group)
            named.update(found)
            units = {p: u for p, (_, u) in group.producers.items()}
            query = [u for p, u in units.items() if found[p] in ("q", "qk", "qkv")]
            # the row is split like the queries (heads); under grouped-query attention k and
            # v may have fewer units (kv heads), and then stay whole where mp cuts them
            row_units = min(query) if query else min(units.values())
            split[group.row] = (group.row_dim, row_units)
            for p, (dim, u) in group.producers.items():
                split[p] = (dim, math.gcd(u, row_units))
            if group.attention and attention is None:
                attention = "fused" if "qkv" in found.values() else "separate"
                q_dim = contracted_size(trace, group.row)
                heads = max([row_units, *(h for h in trace.heads if q_dim % h == 0)])
                kv = min(split[p][1] for p in units if found[p] in ("k", "v", "kv", "qkv"))
                dims.update(
                    heads=heads,
                    kv_heads=kv if heads % kv == 0 else heads,
                    head_dim=q_dim // heads,
                )
            elif not group.attention and mlp is None:
                mlp = "swiglu" if {"gate", "gate_up"} & set(found.values()) else "gelu"
                dims["hidden"] = contracted_size(trace, group.row)
        for i, role in named.items():
            dim, units = split[i]
            roles[trace.paths[i]] = (role, "kernel", dim, units)
        for b, (owner, dim, units) in bias_splits(trace, split).items():
            if owner in named and trace.paths[b] not in roles:
                roles[trace.paths[b]] = (named[owner], "bias", dim, units)
                attn_bias = attn_bias or named[owner] in {"q", "k", "v", "qk", "kv", "qkv", "o"}
        blocks_of = {i: block_of(path) for i, path in enumerate(trace.paths)}
        for d in trace.dots:
            if d.param is not None:
                block = blocks_of[d.param]
            else:
                inside = [blocks_of[i] for i in d.last if blocks_of[i] is not None]
                block = max(inside) if inside else None
            dots.append(
                DotCost(
                    flops=d.flops,
                    param=None if d.param is None else path_str(trace.paths[d.param]),
                    block=block,
                    splits=frozenset((path_str(trace.paths[p]), dim) for p, dim in d.splits),
                    grads=d.grads,
                    attention=d.param is None,
                )
            )

    # head: a dense width -> vocab, or a bare [width, vocab] Param, outside the blocks
    tied = None
    if width and (token is not None or attention or mlp):
        heads_found = [
            d
            for d in dense_list
            if d.n_in == width
            and (d.n_out == vocab if vocab else d.n_out != width)
            and d.kernel not in roles
            and block_of(d.path) is None
        ]
        bare = [
            p
            for p, v in params.items()
            if p not in roles
            and len(v.shape) == 2
            and v.shape[0] == width
            and (v.shape[1] == vocab if vocab else False)
            and block_of(p) is None
            and not any(p == d.kernel for d in dense_list)
        ]
        if len(heads_found) + len(bare) == 1:
            if heads_found:
                d = heads_found[0]
                vocab = vocab or d.n_out
                roles[d.kernel] = ("head", "kernel", 1, vocab)
                if d.bias is not None:
                    roles[d.bias] = ("head", "bias", 0, vocab)
            else:
                roles[bare[0]] = ("head", "kernel", 1, vocab)
            tied = False if token is not None else None
        elif len(heads_found) + len(bare) > 1:
            notes.append(
                "several width -> vocab projections outside the blocks: "
                + ", ".join(path_str(d.kernel) for d in heads_found)
                + ", ".join(path_str(p) for p in bare)
                + "; none taken as the head"
            )
            tied = False if token is not None else None
        elif token is not None:
            tied = True

    infos = []
    replicated = []
    for path, value in plist:
        role, kind, split_dim, units = roles.get(path, (None, "other", None, 0))
        block = block_of(path)
        infos.append(
            ParamInfo(
                path=path_str(path),
                shape=tuple(int(s) for s in value.shape),
                dtype=str(value.dtype),
                role=role,
                kind=kind,
                block=block,
                split_dim=split_dim,
                units=units,
            )
        )
        i = index.get(path, -1)
        if role is None and (block is not None or i in projections):
            reason = _reason(i, trace, projections)
            if block is not None:
                replicated.append((path_str(path), reason))
            else:
                notes.append(f"{path_str(path)}: {reason}")
    found = ModelPatterns(
        params=tuple(infos),
        dims=ModelDims(vocab=vocab, width=width or 0, layers=len(block_paths), **dims),
        blocks=tuple(path_str(b) for b in block_paths),
        block_class=block_class,
        attention=attention,
        mlp=mlp,
        norm=norm_kind,
        tied_head=tied,
        has_attention_bias=attn_bias,
        notes=tuple(notes),
        dots=tuple(dots),
        traced_tokens=traced_tokens,
        replicated_in_blocks=tuple(replicated),
        block_period=period,
    )
    logger.debug("patterns: %s; unmatched %s", found.summary(), list(found.unmatched))
    return found

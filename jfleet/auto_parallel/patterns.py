"""Find the transformer parts of an unannotated Flax NNX model, and their tensor-parallel roles.

:func:`match_patterns` walks the module graph (``nnx.iter_modules``) and recognises, by
module type, structure and parameter shapes — with attribute names only as hints:

* the **token embedding** (an ``nnx.Embed``; more than one ``Embed`` of the model width:
  the one whose vocabulary the head produces, else one named like ``wte`` /
  ``embed_tokens`` / ``tok``, else the largest), and **position / type embeddings** (the
  other ``Embed`` tables of the model width);
* **attention**: a module whose dense children (``nnx.Linear`` or any module holding one
  2-D weight and an optional 1-D bias) are either q, k, v (``width -> q_dim``,
  ``width -> kv_dim``, ``width -> kv_dim``) and o (``q_dim -> width``), or a fused qkv
  (``width -> q_dim + 2 kv_dim``) and o; with or without biases; ``kv_dim < q_dim`` is
  grouped-query attention;
* the **MLP**: gate and up (``width -> hidden``, twice: SwiGLU) or up alone (GELU), and
  down (``hidden -> width``);
* **norms**: ``nnx.RMSNorm``, ``nnx.LayerNorm``, or a module named ``*norm*`` holding only
  vectors of the model width;
* the **LM head**: a dense ``width -> vocab`` or a bare ``[width, vocab]`` Param outside
  the decoder blocks; with none, the head is taken to be tied to the token embedding
  (``embed.attend``);
* the **decoder blocks**: the longest run (by parameters) of >= 2 sibling modules of one
  class with the same parameter paths, shapes and dtypes: the pipeline candidate.

Where shapes alone are ambiguous (q and o are both ``width x width`` in multi-head
attention; gate/up and down when ``hidden == width``), the module is traced once with
``jax.make_jaxpr`` on an input ``[2, 4, width]``: the projection whose input is computed
from its siblings' outputs is o (or down). A module whose ``__call__`` needs more than
that input falls back to name hints (``o_proj``, ``out``, ``c_proj``, ``down``, ``w2``,
...). The number of heads comes from an attribute (``num_heads``, ``n_head``,
``heads``, ...; kv: ``num_key_value_heads``, ``kv_heads``, ...) or from the same trace
(the reshape that splits q's output into ``[heads, head_dim]``).

**Roles and layouts (Megatron).** q, k, v, fused qkv, gate, up: column parallel, kernel
``P(None, 'mp')``, bias ``P('mp')``. o, down: row parallel, kernel ``P('mp', None)``,
bias replicated. Token embedding: vocabulary parallel, ``P('mp', None)``; head kernel
``P(None, 'mp')`` (bias ``P('mp')``). Norms, position embeddings and everything not
matched: replicated (unmatched parameters are listed by path).

**Fused-qkv layout assumption.** A contiguous split of a fused projection's output must
give each rank whole heads, so its output is assumed laid out per head:
``[heads, 3, head_dim]`` for multi-head attention (Megatron's layout, used by
:class:`jfleet.models.parallel_gpt.TinyGPT` and :class:`jfleet.models.gpt2.TinyGPT2`), and
``[kv_heads, group + 2, head_dim]`` (a group's q heads, then its k and v) under
grouped-query attention. When the trace shows the output reshaped as
``[3, heads, head_dim]`` (Hugging Face GPT-2's layout) the attention is left replicated
and listed as unmatched, with the reason.

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
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet._logging import logger
from jfleet.auto_parallel._dataflow import Flow, probe
from jfleet.topology import MP

__all__ = [
    "COLUMN_ROLES",
    "ROW_ROLES",
    "ModelDims",
    "ModelPatterns",
    "ParamInfo",
    "match_patterns",
    "path_str",
    "role_spec",
]

#: Roles split on their output (last) dimension over ``mp``.
COLUMN_ROLES = frozenset({"q", "k", "v", "qkv", "gate", "up"})
#: Roles split on their input (first) dimension over ``mp``.
ROW_ROLES = frozenset({"o", "down"})
_REPLICATED_ROLES = frozenset({"norm", "position_embedding"})

_HEAD_HINTS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "heads", "nhead")
_KV_HINTS = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "kv_heads",
    "num_query_groups",
    "num_groups",
)
_O_HINTS = ("o_proj", "out_proj", "o", "wo", "out", "c_proj", "proj", "dense", "output")
_DOWN_HINTS = ("down_proj", "down", "w2", "fc2", "c_proj", "proj", "wo", "out", "dense_4h_to_h")
_GATE_HINTS = ("gate", "w1", "wi_0")
_TOKEN_HINTS = ("tok", "wte", "word", "embed_tokens")
_POSITION_HINTS = ("pos", "wpe", "type", "segment")


def path_str(path: Sequence[Any]) -> str:
    """A parameter or module path as one dotted string (``('layers', 0)`` -> ``layers.0``).

    >>> path_str(("layers", 0, "self_attn", "q_proj", "kernel"))
    'layers.0.self_attn.q_proj.kernel'
    """
    return ".".join(str(getattr(k, "key", k)) for k in path)


def role_spec(role: str | None, kind: str, ndim: int) -> P:
    """The Megatron ``PartitionSpec`` of a parameter over ``mp``, before ZeRO and pipelining.

    Args:
      role: the parameter's role (see the module docstring), or None (unmatched).
      kind: ``"kernel"``, ``"bias"``, ``"table"`` or ``"scale"``.
      ndim: the parameter's rank.

    >>> role_spec("q", "kernel", 2), role_spec("o", "bias", 1), role_spec("norm", "scale", 1)
    (P(None, 'mp'), P(), P())
    """
    if role in COLUMN_ROLES or role == "head":
        if kind == "kernel" and ndim == 2:
            return P(None, MP)
        if kind == "bias" and ndim == 1:
            return P(MP)
    if ((role in ROW_ROLES and kind == "kernel") or role == "embedding") and ndim == 2:
        return P(MP, None)
    return P()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """One parameter: where it is, its shape and dtype, and what it was matched as.

    Attributes:
      path: dotted path (``layers.0.mlp.up_proj.kernel``).
      shape: the global shape.
      dtype: dtype name (``float32``).
      role: ``q``, ``k``, ``v``, ``qkv``, ``o``, ``gate``, ``up``, ``down``,
        ``embedding``, ``position_embedding``, ``head``, ``norm``; None when unmatched.
      kind: ``kernel``, ``bias``, ``table`` (embeddings), ``scale`` (norms) or ``other``.
      block: index of the decoder block holding it, or None outside the blocks.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str | None = None
    kind: str = "other"
    block: int | None = None

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
        """The tensor-parallel layout (:func:`role_spec`)."""
        return role_spec(self.role, self.kind, len(self.shape))


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
class ModelPatterns:
    """What :func:`match_patterns` found.

    Attributes:
      params: every ``nnx.Param``, in ``nnx.state`` order, with its role.
      dims: the model's sizes.
      blocks: module paths of the decoder blocks, in order (the pipeline candidate;
        empty when there is no run of >= 2 identical blocks).
      block_class: the blocks' class name.
      attention: ``"separate"`` (q/k/v/o), ``"fused"`` (qkv/o) or None.
      mlp: ``"swiglu"`` (gate/up/down), ``"gelu"`` (up/down) or None.
      norm: ``"rmsnorm"``, ``"layernorm"``, ``"other"`` or None.
      tied_head: True when the head is the token embedding (no separate head found),
        False for a separate head, None without a token embedding.
      has_attention_bias: whether the attention projections carry biases.
      notes: why parts were left unmatched, for the warning and the plan.
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

    def split_dims(self) -> tuple[int, ...]:
        """Every dimension size the tensor-parallel roles split: mp must divide each."""
        out = set()
        for p in self.params:
            for size, entry in zip(p.shape, p.spec, strict=False):
                if entry is not None:
                    out.add(size)
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


# ------------------------------------------------------------------ matching
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


def _hint(name: str, hints: Iterable[str]) -> bool:
    name = name.lower()
    return any(name == h or name.endswith("_" + h) or name.startswith(h) for h in hints)


def _int_attr(module: Any, names: Iterable[str]) -> int | None:
    for n in names:
        v = getattr(module, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _is_norm(path: tuple, module: Any, params: dict, width: int | None) -> bool:
    if isinstance(module, nnx.RMSNorm | nnx.LayerNorm):
        return True
    own = _direct_params(path, params)
    return (
        "norm" in type(module).__name__.lower()
        and bool(own)
        and all(len(v.shape) == 1 and (width is None or v.shape[0] == width) for v in own.values())
    )


# ------------------------------------------------------------------ containers
@dataclasses.dataclass
class _Match:
    kind: str  # "attention" | "mlp"
    style: str  # separate | fused | swiglu | gelu
    roles: dict[int, str]  # dense index -> role
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    hidden: int = 0
    note: str | None = None


def _pick_fed(denses, candidates, flow, hints) -> int | None:
    """Among ``candidates``, the one whose input depends on its siblings (else by name)."""
    if flow is not None:
        fed = [i for i in candidates if flow.feeds.get(i)]
        if len(fed) == 1:
            return fed[0]
    named = [i for i in candidates if _hint(denses[i].name, hints)]
    if len(named) == 1:
        return named[0]
    return None


def _heads_from(flow: Flow | None, q_index: int, q_dim: int) -> int | None:
    if flow is None or q_index not in flow.reshapes:
        return None
    shape_in, shape_out = flow.reshapes[q_index]
    lead = len(shape_in) - 1
    if shape_out[:lead] != shape_in[:lead] or len(shape_out) != lead + 2:
        return None
    heads, hd = shape_out[lead:]
    return heads if heads * hd == q_dim else None


def _match_attention(container, denses, width, flow_fn) -> _Match | None:
    n = len(denses)
    if n == 2:
        for qkv_i, o_i in ((0, 1), (1, 0)):
            qkv, o = denses[qkv_i], denses[o_i]
            if qkv.n_in != width or o.n_out != width:
                continue
            q_dim = o.n_in
            rest = qkv.n_out - q_dim
            if rest <= 0 or rest % 2 or q_dim % (rest // 2):
                continue
            kv_dim = rest // 2
            heads = _int_attr(container, _HEAD_HINTS)
            kv_heads = _int_attr(container, _KV_HINTS)
            flow = flow_fn()
            note = None
            if flow is not None and qkv_i in flow.reshapes:
                shape_in, shape_out = flow.reshapes[qkv_i]
                lead = len(shape_in) - 1
                split = shape_out[lead:]
                hf_layout = (
                    kv_dim == q_dim
                    and len(split) == 3
                    and split[0] == 3
                    and split[1] != 3
                    and split[1] * split[2] == q_dim
                )
                if hf_layout:
                    return _Match(
                        "attention",
                        "fused",
                        {},
                        note=(
                            f"{path_str(qkv.path)}: the fused qkv output is reshaped to "
                            f"{list(split)} ([3, heads, head_dim]), so a contiguous mp split "
                            "would not give whole heads; lay it out per head "
                            "([heads, 3, head_dim]) to tensor-parallelise it"
                        ),
                    )
                if (
                    heads is None
                    and len(split) == 3
                    and split[0] * split[1] * split[2] == (qkv.n_out)
                ):
                    kv_heads_found = split[0]
                    group = split[1] - 2
                    if group >= 1:
                        heads, kv_heads = kv_heads_found * group, kv_heads_found
            if heads is None:
                return _Match(
                    "attention",
                    "fused",
                    {},
                    note=f"{path_str(qkv.path[:-1])}: the number of heads was not found "
                    "(no num_heads / n_head attribute and no traceable reshape)",
                )
            kv_heads = kv_heads or kv_dim * heads // q_dim
            if q_dim % heads or kv_dim * heads != kv_heads * q_dim:
                return None
            roles = {qkv_i: "qkv", o_i: "o"}
            return _Match("attention", "fused", roles, heads, kv_heads, q_dim // heads, note=note)
        return None
    if n != 4:
        return None
    outs_w = [i for i, d in enumerate(denses) if d.n_out == width]
    ins_w = [i for i, d in enumerate(denses) if d.n_in == width]
    if not outs_w or len(ins_w) < 3:
        return None
    flow_cache: list = []

    def flow() -> Flow | None:
        if not flow_cache:
            flow_cache.append(flow_fn())
        return flow_cache[0]

    candidates = [i for i in outs_w if sum(1 for j in ins_w if j != i) == 3]
    if len(candidates) > 1:
        pick = _pick_fed(denses, candidates, flow(), _O_HINTS)
        candidates = [pick] if pick is not None else []
    if len(candidates) != 1:
        return _Match(
            "attention",
            "separate",
            {},
            note=f"{path_str(denses[0].path[:-1])}: four width-sized projections, but which one "
            "is the output projection could not be told (no trace, no o_proj-like name)",
        )
    o_i = candidates[0]
    o = denses[o_i]
    qkv = [i for i in range(4) if i != o_i]
    if any(denses[i].n_in != width for i in qkv):
        return None
    q_dim = o.n_in
    outs = sorted(denses[i].n_out for i in qkv)
    if outs[2] != q_dim or outs[0] != outs[1] or q_dim % outs[0]:
        return None
    kv_dim = outs[0]
    if kv_dim == q_dim:
        named = [i for i in qkv if _hint(denses[i].name, ("q", "q_proj", "query", "wq"))]
        q_i = named[0] if len(named) == 1 else qkv[0]
    else:
        q_i = next(i for i in qkv if denses[i].n_out == q_dim)
    kv = [i for i in qkv if i != q_i]
    k_i, v_i = kv
    named_v = [i for i in kv if _hint(denses[i].name, ("v", "v_proj", "value", "wv"))]
    if named_v and named_v[0] == k_i:
        k_i, v_i = v_i, k_i
    heads = _int_attr(container, _HEAD_HINTS) or _heads_from(flow(), q_i, q_dim)
    if heads is None:
        return _Match(
            "attention",
            "separate",
            {},
            note=f"{path_str(o.path[:-1])}: the number of heads was not found (no num_heads / "
            "n_head attribute and no traceable reshape of q)",
        )
    if q_dim % heads:
        return None
    head_dim = q_dim // heads
    kv_heads = _int_attr(container, _KV_HINTS) or kv_dim // head_dim
    if kv_heads * head_dim != kv_dim:
        return None
    roles = {q_i: "q", k_i: "k", v_i: "v", o_i: "o"}
    return _Match("attention", "separate", roles, heads, kv_heads, head_dim)


def _match_mlp(denses, width, flow_fn) -> _Match | None:
    n = len(denses)
    if n not in (2, 3):
        return None
    downs = [i for i, d in enumerate(denses) if d.n_out == width]
    ups_of = {
        i: [j for j, u in enumerate(denses) if j != i and u.n_in == width and u.n_out == d.n_in]
        for i, d in enumerate(denses)
        if i in downs
    }
    candidates = [i for i in downs if len(ups_of[i]) == n - 1]
    if len(candidates) > 1:
        pick = _pick_fed(denses, candidates, flow_fn(), _DOWN_HINTS)
        candidates = [pick] if pick is not None else []
    if len(candidates) != 1:
        return None
    down = candidates[0]
    ups = ups_of[down]
    hidden = denses[down].n_in
    if n == 2:
        return _Match("mlp", "gelu", {ups[0]: "up", down: "down"}, hidden=hidden)
    if denses[ups[0]].n_out != denses[ups[1]].n_out:
        return None
    gate = ups[0]
    named = [i for i in ups if _hint(denses[i].name, _GATE_HINTS)]
    if len(named) == 1:
        gate = named[0]
    up = ups[1] if gate == ups[0] else ups[0]
    return _Match("mlp", "swiglu", {gate: "gate", up: "up", down: "down"}, hidden=hidden)


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
def match_patterns(model: nnx.Module) -> ModelPatterns:
    """Matches embeddings, attention, MLPs, norms, the head and the decoder blocks of ``model``.

    Args:
      model: an ``nnx.Module`` with ordinary (unannotated) parameters.

    Returns:
      A :class:`ModelPatterns` with every parameter's role (None when unmatched).

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``.
      ValueError: the model has no ``nnx.Param``.

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
    roles: dict[tuple, tuple[str, str]] = {}  # param path -> (role, kind)
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
            named = [(p, m) for p, m in same if _hint(str(p[-1]), _TOKEN_HINTS)]
            token = named[0] if len(named) == 1 else max(same, key=lambda pm: pm[1].num_embeddings)
        vocab = token[1].num_embeddings
        for p, _ in same:
            role = "embedding" if p == token[0] else "position_embedding"
            roles[(*p, "embedding")] = (role, "table")
    norm_mods = [(p, m) for p, m in modules if _is_norm(p, m, params, width)]
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
            if width is not None and v.shape == (width,):
                roles[(*p, name)] = ("norm", "scale" if name in ("scale", "weight") else "bias")
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

    def block_of(path: tuple) -> int | None:
        for i, b in enumerate(block_paths):
            if path[: len(b)] == b:
                return i
        return None

    # attention and MLP containers
    by_parent: dict[tuple, list[_Dense]] = collections.defaultdict(list)
    for d in dense_list:
        by_parent[d.path[:-1]].append(d)
    by_path = dict(modules)
    dtype = next(iter(params.values())).dtype
    dims = {"heads": 0, "kv_heads": 0, "head_dim": 0, "hidden": 0}
    attention = mlp = None
    attn_bias = False
    signature_cache: dict[tuple, _Match | None] = {}
    if width:
        for parent, denses in sorted(by_parent.items(), key=lambda kv: path_str(kv[0])):
            container = by_path.get(parent)
            if container is None or len(denses) < 2:
                continue
            denses = sorted(denses, key=lambda d: str(d.name))
            key = (type(container).__name__, _signature(parent, params))

            def flow_fn(container=container, denses=denses, parent=parent) -> Flow | None:
                rel = [d.kernel[len(parent) :] for d in denses]
                return probe(container, rel, width, dtype)

            if key in signature_cache:
                found = signature_cache[key]
            else:
                found = _match_attention(container, denses, width, flow_fn)
                if found is None:
                    found = _match_mlp(denses, width, flow_fn)
                signature_cache[key] = found
            if found is None:
                continue
            if found.note:
                if found.note not in notes:
                    notes.append(found.note)
                if not found.roles:
                    continue
            for i, role in found.roles.items():
                d = denses[i]
                roles[d.kernel] = (role, "kernel")
                if d.bias is not None:
                    roles[d.bias] = (role, "bias")
                    if found.kind == "attention":
                        attn_bias = True
            if found.kind == "attention" and attention is None:
                attention = found.style
                dims.update(heads=found.heads, kv_heads=found.kv_heads, head_dim=found.head_dim)
            elif found.kind == "mlp" and mlp is None:
                mlp = found.style
                dims["hidden"] = found.hidden

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
            and not any(p in (d.kernel,) for d in dense_list)
        ]
        if len(heads_found) + len(bare) == 1:
            if heads_found:
                d = heads_found[0]
                roles[d.kernel] = ("head", "kernel")
                if d.bias is not None:
                    roles[d.bias] = ("head", "bias")
                vocab = vocab or d.n_out
            else:
                roles[bare[0]] = ("head", "kernel")
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
    for path, value in plist:
        role, kind = roles.get(path, (None, "other"))
        infos.append(
            ParamInfo(
                path=path_str(path),
                shape=tuple(int(s) for s in value.shape),
                dtype=str(value.dtype),
                role=role,
                kind=kind,
                block=block_of(path),
            )
        )
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
    )
    logger.debug("patterns: %s; unmatched %s", found.summary(), list(found.unmatched))
    return found

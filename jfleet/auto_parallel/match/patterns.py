"""Find the transformer parts of an unannotated Flax NNX model, and their tensor-parallel roles.

:func:`match_patterns` traces one forward call of the model abstractly
(:func:`~jfleet.auto_parallel.match.dataflow.trace_model`: ``jax.make_jaxpr``, no FLOPs spent) and
reads the roles from the computation, not from names or kernel ranks:

* **projection pairs** (Megatron column then row): a projection — any ``dot_general`` with a
  parameter on one side: ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, a bare
  ``Param`` used with ``@`` or ``jnp.einsum`` — whose output dimension reaches another
  projection's contracted dimension through per-head or elementwise work only (reshapes,
  rotary, q/k norms, softmax, attention scores and values, gating). The consumer is split
  on that input dimension (row parallel), every producer on the output dimension feeding it
  (column parallel): the heads dimension for attention, hidden for MLPs, whatever the
  kernel's rank or einsum equation. A bias added to a column's output is split with it,
  and so is one added to attention scores (a relative-position table, per-head sinks: by
  the query heads). Projections written into a KV cache (a dynamic update or a scatter)
  and read back keep their pair; a fused kernel read by strided slices (``h[..., ::2]``,
  ``h[..., 1::2]``) is split contiguously, each rank keeping whole (gate, up) pairs; a
  projection of the raw inputs (float features) is no pair's member.
* **role names**, for reports: producers meeting in attention scores are ``q`` (left side)
  and ``k`` (right side), those feeding the values ``v`` (one producer in several places:
  ``qkv``, ``kv``); the consumer is ``o``. Without attention: ``gate`` (the producer passed
  through a nonlinearity before a product), ``up``, ``gate_up`` (one stacked producer), and
  ``down``.
* the **token embedding**, chosen by dataflow: the ``nnx.Embed`` (or bare ``Param`` table)
  gathered from with indices computed from the model's inputs, never by shape (a learned
  position table as wide as it is long, indexed by ``arange`` positions, is not it; nor is
  a relative-position bias table). When several tables are fed by the inputs, or the model
  is not traced: the one whose vocabulary the head produces, else one named like ``wte`` /
  ``embed_tokens`` / ``tok``, else the largest. The other tables of its width are
  **position / type embeddings** (replicated);
* **norms**: the parameters of ``nnx.RMSNorm`` / ``nnx.LayerNorm`` modules (q/k norms of
  ``head_dim`` included), or of a module named ``*norm*`` holding only vectors: replicated;
* the **LM head**: a dense ``width -> vocab`` or a bare ``[width, vocab]`` Param outside the
  decoder blocks (column parallel over the vocabulary); with none, the head is taken to be
  tied to the token embedding (``embed.attend``);
* the **decoder blocks**: the longest run (by parameters) of >= 2 sibling modules of one
  class with the same parameter paths, shapes and dtypes: the pipeline candidate; beside
  it, any other list of such blocks (an encoder-decoder's encoder and decoder): every stack's
  blocks are the model's blocks (the cost model counts them all), and a model with several
  stacks runs without a pipeline, the plan naming them.

**Steps.** :func:`match_patterns` chains named steps, each testable on its own: the module
tree (:func:`~jfleet.auto_parallel.match.module_parts.read_parts`, embeddings, norms) ->
:func:`trace_step` -> :func:`find_projections` -> :func:`find_pairs` -> blocks
(:func:`~jfleet.auto_parallel.match.module_parts.find_blocks`) -> :func:`name_roles` -> the head
(:func:`~jfleet.auto_parallel.match.module_parts.find_head`) -> :func:`param_infos`.

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

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jfleet.auto_parallel.match.dataflow import Trace, TraceError, trace_forward, trace_model
from jfleet.auto_parallel.match.experts import find_experts, ragged_rows_checked, split_routed
from jfleet.auto_parallel.match.matched import (
    COLUMN_ROLES,
    ROW_ROLES,
    DotCost,
    ModelDims,
    ModelPatterns,
    ParamInfo,
    path_str,
)
from jfleet.auto_parallel.match.module_parts import (
    Blocks,
    Parts,
    find_blocks,
    find_embeddings,
    find_head,
    find_norms,
    read_parts,
)
from jfleet.auto_parallel.match.pairs import (
    Pair,
    attention_roles,
    bias_splits,
    contracted_size,
    mlp_roles,
    pairs,
)
from jfleet.runtime.log import logger

__all__ = [
    "COLUMN_ROLES",
    "ROW_ROLES",
    "DotCost",
    "ModelDims",
    "ModelPatterns",
    "PairRoles",
    "ParamInfo",
    "dot_costs",
    "find_pairs",
    "find_projections",
    "match_patterns",
    "name_roles",
    "param_infos",
    "path_str",
    "trace_step",
]

#: Token ids a model with an embedding is traced on when no input is given.
_DEFAULT_TOKENS = (2, 8)
_ATTENTION_ROLES = frozenset({"q", "k", "v", "qk", "kv", "qkv", "o"})
#: The MLP activation named by the first nonlinear primitive its hidden features took.
_ACTIVATIONS = {"erf": "gelu", "erfc": "gelu", "tanh": "gelu", "logistic": "silu", "max": "relu"}


# ------------------------------------------------------------------ step 1: trace
def trace_step(
    model: nnx.Module, inputs: Any, forward: Callable | None, parts: Parts
) -> tuple[Trace | None, tuple[int, int] | None]:
    """The model's traced forward call and the ``(batch, seq)`` it was traced at.

    Without ``inputs`` a model with a token embedding is traced on token ids ``[2, 8]``;
    any other model is left untraced (a note says why).
    """
    from jfleet.training.data import batch_shape

    if inputs is not None:
        trace = trace_model(model, inputs, forward)
        batch, seq = batch_shape(inputs, local=False)
        return trace, (batch or 1, seq or 1)
    if forward is not None:
        raise ValueError(
            "match_patterns got forward= but no inputs; pass the batch forward is called with."
        )
    if not any(isinstance(m, nnx.Embed) for _, m in parts.modules):
        parts.notes.append(
            "the model was not traced (no input given and no token embedding to make one); "
            "pass the first batch (to_distributed does) to find its projections"
        )
        return None, None
    tokens = jax.ShapeDtypeStruct(_DEFAULT_TOKENS, jnp.int32)
    try:
        return trace_model(model, tokens), _DEFAULT_TOKENS
    except TraceError as err:
        parts.notes.append(f"the model was not traced on token ids {list(_DEFAULT_TOKENS)}: {err}")
        return None, None


def _inputs_of(trace: Trace | None) -> tuple[tuple[tuple[int, ...], str], ...]:
    if trace is None:
        return ()
    return tuple(zip(trace.input_shapes, trace.input_dtypes, strict=True))


def _first_used(trace: Trace | None) -> tuple[tuple, ...]:
    """Parameter paths in the order the traced forward first multiplies them."""
    if trace is None:
        return ()
    seen = dict.fromkeys(trace.paths[d.param] for d in trace.dots if d.param is not None)
    return tuple(seen)


def _fed_tables(trace: Trace | None) -> frozenset:
    """Module paths of the tables gathered from with indices computed from the inputs."""
    if trace is None:
        return frozenset()
    return frozenset(trace.paths[i][:-1] for i in trace.lookups)


# ------------------------------------------------------------------ step 2: projections
def find_projections(trace: Trace | None, parts: Parts, blocks: Blocks) -> set[int]:
    """The parameters used as a projection (one side of a product) in the trace.

    A bare ``Param`` table gathered with the token ids outside the blocks, in a model with
    no ``nnx.Embed``, becomes the token embedding here.
    """
    if trace is None:
        return set()
    tables = [trace.paths[i] for i in sorted(trace.lookups) if blocks.of(trace.paths[i]) is None]
    if parts.token is None and tables:
        path = max(tables, key=lambda t: parts.params[t].shape[0])
        parts.token = (path[:-1], None)
        parts.vocab, table_width = (int(n) for n in parts.params[path].shape)
        parts.width = parts.width or table_width
        parts.roles[path] = ("embedding", "table", 0, parts.vocab)
    return {d.param for d in trace.dots if d.param is not None}


# ------------------------------------------------------------------ step 3: pairs
def find_pairs(trace: Trace | None, parts: Parts, blocks: Blocks) -> list[Pair]:
    """The column / row pairs of the trace, embeddings and the head excluded."""
    if trace is None:
        return []
    width, vocab = parts.width, parts.vocab
    exclude = {
        i
        for i, path in enumerate(trace.paths)
        if parts.roles.get(path, ("",))[0] in ("embedding", "position_embedding")
        or i in trace.reads_inputs
        or (
            vocab
            and blocks.of(path) is None
            and len(trace.shapes[i]) == 2
            and trace.shapes[i] == (width, vocab)
        )
    }
    return pairs(trace, exclude)


# ------------------------------------------------------------------ step 5: roles
@dataclasses.dataclass
class PairRoles:
    """What the pairs' roles say about the model: its attention and MLP kinds and sizes."""

    attention: str | None = None
    mlp: str | None = None
    attention_bias: bool = False
    activation: str | None = None
    dims: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"heads": 0, "kv_heads": 0, "head_dim": 0, "hidden": 0}
    )


def _attention_dims(trace: Trace, group: Pair, found: dict, split: dict, row_units: int):
    q_dim = contracted_size(trace, group.row)
    heads = max([row_units, *(h for h in trace.heads if q_dim % h == 0)])
    kv_units = [split[p][1] for p in group.producers if found[p] in ("k", "v", "kv", "qkv")]
    kv = min(kv_units) if kv_units else heads  # k / v not found: count no grouping
    return {
        "heads": heads,
        "kv_heads": kv if heads % kv == 0 else heads,
        "head_dim": q_dim // heads,
    }


def name_roles(trace: Trace | None, groups: list[Pair], parts: Parts) -> PairRoles:
    """Names each pair's projections (q / k / v / o, gate / up / down) and records their
    splits and units, and their biases', in ``parts.roles``."""
    out = PairRoles()
    if trace is None:
        return out
    split: dict[int, tuple[int, int]] = {}
    named: dict[int, str] = {}
    for group in groups:
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
        if group.attention and out.attention is None:
            out.attention = "fused" if "qkv" in found.values() else "separate"
            out.dims.update(_attention_dims(trace, group, found, split, row_units))
        elif not group.attention and out.mlp is None:
            out.mlp = "swiglu" if {"gate", "gate_up"} & set(found.values()) else "gelu"
            out.activation = _ACTIVATIONS.get(trace.activations.get(group.row, ""))
            out.dims["hidden"] = contracted_size(trace, group.row)
            if group.row in trace.batched:  # one kernel per expert
                out.dims["experts"] = trace.batched[group.row]
    for i, role in named.items():
        dim, units = split[i]
        parts.roles[trace.paths[i]] = (role, "kernel", dim, units)
    for b, (owner, dim, units) in bias_splits(trace, split).items():
        if owner in named and trace.paths[b] not in parts.roles:
            met = {named.get(tag.param) for _, tag in trace.biases[b]}
            # added to q . k scores (a relative-position table, ALiBi, sinks): its own role
            scores = bool(met & {"q", "qk", "qkv"}) and bool(met & {"k", "kv", "qk", "qkv"})
            role = "attention_bias" if scores and len(met) > 1 else named[owner]
            parts.roles[trace.paths[b]] = (role, "bias", dim, units)
            out.attention_bias = out.attention_bias or named[owner] in _ATTENTION_ROLES
    return out


def dot_costs(
    trace: Trace | None, blocks: Blocks, dots: tuple | None = None
) -> tuple[DotCost, ...]:
    """The traced products (``dots``: these of them) for the cost model, each placed in
    its block."""
    if trace is None:
        return ()
    blocks_of = {i: blocks.of(path) for i, path in enumerate(trace.paths)}
    out = []
    for d in trace.dots if dots is None else dots:
        if d.param is not None:
            block = blocks_of[d.param]
        else:
            inside = [blocks_of[i] for i in d.last if blocks_of[i] is not None]
            block = max(inside) if inside else None
        out.append(
            DotCost(
                flops=d.flops,
                param=None if d.param is None else path_str(trace.paths[d.param]),
                block=block,
                splits=frozenset((path_str(trace.paths[p]), dim) for p, dim in d.splits),
                grads=d.grads,
                attention=d.param is None,
                platform_attention=d.param is None and d.scoped,
            )
        )
    return tuple(out)


def _reason(i: int, trace: Trace | None, projections: set[int]) -> str:
    if trace is None:
        return "not traced"
    if i not in projections:
        return "not used as a projection (a dot_general / einsum operand) in the traced forward"
    if i in trace.reads_inputs:
        return (
            "it projects the model's inputs themselves (an input projection): no pair is "
            "split through it"
        )
    if i in trace.cut:
        return (
            f"its output dimension is read in parts ({trace.cut[i]}) before it reaches another "
            "projection: a fused kernel whose parts lie side by side (gate | up read by "
            "jnp.split or h[..., :F] / h[..., F:], q | k | v, or [3, heads, head_dim]). Each "
            "mp rank would need columns of every part, which no PartitionSpec of this kernel "
            "places, so it stays whole with its pair; to split it, lay the parts out per unit: "
            "interleaved (h[..., ::2] / h[..., 1::2]), [heads, 3, head_dim], or separate kernels"
        )
    fed_by = sorted(j for j in trace.fed_by.get(i, ()) if j in trace.cut)
    if fed_by:
        return (
            f"its input comes from {path_str(trace.paths[fed_by[0]])}, whose output is read in "
            f"parts ({trace.cut[fed_by[0]]}) and so stays whole: there is no column to pair it "
            "with (see that kernel's reason)"
        )
    return (
        "its output reaches no other projection through per-head or elementwise work, so "
        "there is no column/row pair to split it in"
    )


def param_infos(
    parts: Parts, blocks: Blocks, trace: Trace | None, projections: set[int]
) -> tuple[tuple[ParamInfo, ...], tuple[tuple[str, str], ...]]:
    """Every parameter's :class:`ParamInfo`, and ``(path, reason)`` of the block parameters
    left replicated (unmatched parameters outside the blocks get a note instead)."""
    index = {path: i for i, path in enumerate(trace.paths)} if trace is not None else {}
    infos, replicated = [], []
    for path, value in parts.plist:
        role, kind, split_dim, units = parts.roles.get(path, (None, "other", None, 0))
        block = blocks.of(path)
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
                parts.notes.append(f"{path_str(path)}: {reason}")
    return tuple(infos), tuple(replicated)


# ------------------------------------------------------------------ entry point
def _read_trace(
    trace: Trace | None, parts: Parts, blocks: Blocks
) -> tuple[Trace | None, set[int], PairRoles]:
    """projections -> pairs -> roles. A traced form these steps cannot read leaves the model
    as the module tree showed it (its projections replicated) with a note naming the error,
    never an exception out of the matcher."""
    before = (dict(parts.roles), parts.token, parts.vocab, parts.width)
    try:
        projections = find_projections(trace, parts, blocks)
        return trace, projections, name_roles(trace, find_pairs(trace, parts, blocks), parts)
    except Exception as err:  # any internal failure becomes a named reason
        parts.roles, parts.token, parts.vocab, parts.width = before
        parts.notes.append(
            f"the traced computation could not be read ({type(err).__name__}: {err}); its "
            "projections stay replicated (data parallel). Please report the model's form."
        )
        logger.warning("match_patterns: %s", parts.notes[-1])
        return None, set(), PairRoles()


def match_patterns(
    model: nnx.Module,
    inputs: Any = None,
    *,
    forward: Callable[[nnx.Module, Any], Any] | None = None,
) -> ModelPatterns:
    """Matches embeddings, projection pairs, norms, the head and the decoder blocks of ``model``.

    Args:
      model: an ``nnx.Module`` with unannotated parameters (``nnx.eval_shape``'s too).
      inputs: what the model is called with (only shapes are read): the loader's first
        batch's input, or the whole batch with ``forward``. Default: token ids ``[2, 8]``
        when the model has a token embedding, else no trace.
      forward: ``forward(model, inputs)`` when the model is not called as ``model(inputs)``
        (positions, a mask, a cache; a loss function works too).

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
    parts = read_parts(model)
    trace, traced_tokens = trace_step(model, inputs, forward, parts)
    find_embeddings(parts, _fed_tables(trace))
    find_norms(parts)
    blocks = find_blocks(parts, _first_used(trace))
    read, projections, found_roles = _read_trace(trace, parts, blocks)
    tied = find_head(parts, blocks, bool(found_roles.attention or found_roles.mlp))
    routed = find_experts(read, blocks)
    if routed.spec is not None:
        called = inputs if inputs is not None else jax.ShapeDtypeStruct(_DEFAULT_TOKENS, jnp.int32)
        routed = ragged_rows_checked(
            routed, read, model, lambda m: trace_forward(m, called, forward)
        )
    infos, replicated = param_infos(parts, blocks, read, projections)
    infos, routed_infos, dots = split_routed(infos, read.dots if read else (), routed, read)
    taken = {p.path for p in routed_infos}
    replicated = tuple((path, why) for path, why in replicated if path not in taken)
    found = ModelPatterns(
        params=infos,
        dims=ModelDims(
            vocab=parts.vocab, width=parts.width or 0, layers=len(blocks.paths), **found_roles.dims
        ),
        blocks=tuple(path_str(b) for b in blocks.paths),
        block_class=blocks.cls,
        attention=found_roles.attention,
        mlp=found_roles.mlp,
        norm=parts.norm,
        tied_head=tied,
        has_attention_bias=found_roles.attention_bias,
        activation=found_roles.activation,
        inputs=_inputs_of(trace),
        notes=(*parts.notes, *routed.notes),
        dots=dot_costs(read, blocks, dots) if read is not None else dot_costs(trace, blocks),
        traced_tokens=traced_tokens,
        replicated_in_blocks=replicated,
        block_period=blocks.period,
        stacks=tuple((tuple(path_str(b) for b in paths), cls) for paths, cls in blocks.stacks),
        moe=routed.spec,
        routed=routed_infos,
    )
    logger.debug("patterns: %s; unmatched %s", found.summary(), list(found.unmatched))
    return found

"""What the matcher found: each parameter's role and split, the model's sizes, its products.

:func:`~jfleet.auto_parallel.match.patterns.match_patterns` returns a :class:`ModelPatterns`;
the cost model, the planner and the plan read it. Nothing here traces or matches.

Example:
  >>> k = ParamInfo(path="layers.0.k.kernel", shape=(32, 16), dtype="float32", role="k",
  ...               kind="kernel", block=0, split_dim=1, units=2)
  >>> k.spec, k.spec_for(4), k.nbytes
  (P(None, 'mp'), P(), 2048)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.match.moe_spec import MoESpec
from jfleet.mesh.topology import MP

__all__ = [
    "COLUMN_ROLES",
    "OPTIONAL_SPLIT_ROLES",
    "ROW_ROLES",
    "DotCost",
    "ModelDims",
    "ModelPatterns",
    "ParamInfo",
    "module_at",
    "path_str",
]

#: Roles split on an output dimension over ``mp``.
COLUMN_ROLES = frozenset({"q", "k", "v", "qk", "kv", "qkv", "gate", "up", "gate_up"})
#: Roles split on an input (contracted) dimension over ``mp``.
ROW_ROLES = frozenset({"o", "down"})
#: Roles kept whole where ``mp`` does not divide their units, rather than ruling the mesh out:
#: grouped k / v heads, a small head (a 10-class classifier), an odd vocabulary.
OPTIONAL_SPLIT_ROLES = frozenset({"k", "v", "kv", "head", "embedding", "attention_bias"})


def path_str(path: Sequence[Any]) -> str:
    """A parameter or module path as one dotted string (``('layers', 0)`` -> ``layers.0``).

    >>> path_str(("layers", 0, "self_attn", "q_proj", "kernel"))
    'layers.0.self_attn.q_proj.kernel'
    """
    return ".".join(str(getattr(k, "key", k)) for k in path)


def module_at(root: Any, path: str) -> Any:
    """The node at dotted ``path`` (``layers.0``) under ``root`` (an ``nnx.Module``).

    >>> class Net:
    ...     layers = ["first", "second"]
    >>> module_at(Net(), "layers.1")
    'second'
    """
    node = root
    for part in path.split(".") if path else ():
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """One parameter: where it is, its shape and dtype, and what it was matched as.

    Attributes:
      path: dotted path (``layers.0.mlp.up_proj.kernel``).
      shape: the global shape.
      dtype: dtype name (``float32``).
      role: ``q``, ``k``, ``v``, ``qk``, ``kv``, ``qkv``, ``o``, ``gate``, ``up``,
        ``gate_up``, ``down``, ``embedding``, ``position_embedding``, ``head``, ``norm``,
        ``attention_bias`` (a table added to the attention scores: relative positions,
        ALiBi slopes, sinks; split by the query heads); None when unmatched.
      kind: ``kernel``, ``bias``, ``table`` (embeddings), ``scale`` (norms) or ``other``.
      block: index of the decoder block holding it, or None outside the blocks.
      split_dim: the dimension split over ``mp`` (None: replicated).
      units: the whole units along ``split_dim`` (heads, hidden features, vocabulary rows)
        that a split must not cut: ``mp`` must divide it.

    Example:
      >>> import numpy as np
      >>> from jfleet.auto_parallel import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> model = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2)
      >>> found = match_patterns(model, np.zeros((2, 8), np.int32))
      >>> found.params[0].path, found.params[0].role, found.params[0].split_dim
      ('embed_tokens.embedding', 'embedding', 0)
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
      experts: MLP experts (kernels matched batch-wise, one per expert; 0: a plain MLP).

    Example:
      >>> import numpy as np
      >>> from jfleet.auto_parallel import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> model = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2)
      >>> found = match_patterns(model, np.zeros((2, 8), np.int32))
      >>> found.dims.heads, found.dims.kv_heads, found.dims.layers
      (4, 2, 2)
    """

    vocab: int = 0
    width: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    hidden: int = 0
    layers: int = 0
    experts: int = 0

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
      platform_attention: traced inside :func:`jfleet.models.attention.causal_attention`
        (its XLA implementation, here): on a platform with a flash kernel the same call
        runs fused (:func:`~jfleet.auto_parallel.match.attention_trace.attention_as_run`).
    """

    flops: int
    param: str | None
    block: int | None
    splits: frozenset[tuple[str, int]]
    grads: int
    attention: bool
    platform_attention: bool = False


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
      activation: the MLP's activation as traced (``gelu``, ``silu``, ``relu``), or None.
      inputs: ``(shape, dtype)`` of each traced input array.
      block_period: the blocks repeat every this many (1: all alike, static settings
        included; 2: alternating local / global attention, ...); None when they do not
        repeat (:func:`jfleet.parallel.stack.block_period`). A pipeline stacks super-blocks
        of one period.
      stacks: ``(block paths, class)`` of each stack of blocks, in the model's order (an
        encoder-decoder has two; ``blocks`` holds them all, stack by stack).
      moe: the routed experts (:class:`~jfleet.auto_parallel.match.moe_spec.MoESpec`;
        ``params`` and ``dots`` then leave them and their routers out), or None.
      routed: the parameters ``params`` leaves out for ``moe`` (found in a traced model:
        the stacked ``[E, ...]`` expert weights, split over ``ep`` on their leading
        dimension, and the routers, replicated; :mod:`~jfleet.auto_parallel.match.experts`).

    Example:
      >>> import numpy as np
      >>> from jfleet.auto_parallel import match_patterns
      >>> from jfleet.models.llama import TinyLlama
      >>> model = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2)
      >>> found = match_patterns(model, np.zeros((2, 8), np.int32))
      >>> found.dims.width, len(found.blocks)
      (32, 2)
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
    activation: str | None = None
    inputs: tuple[tuple[tuple[int, ...], str], ...] = ()
    stacks: tuple[tuple[tuple[str, ...], str], ...] = ()
    moe: MoESpec | None = None
    routed: tuple[ParamInfo, ...] = ()

    @property
    def input_kind(self) -> str:
        """What the model reads, from its traced inputs: ``tokens`` (integer ids),
        ``images`` (a float ``[batch, height, width, channels]``) or ``features``."""
        arrays = [(shape, dtype) for shape, dtype in self.inputs if shape]
        if not arrays or "int" in arrays[0][1]:
            return "tokens"
        return "images" if len(arrays[0][0]) == 4 else "features"

    def workload(self, batch_size: int, seq_len: int) -> str:
        """The workload in the words of :attr:`input_kind`: ``batch 16 x seq 8`` for tokens,
        ``images 32 x 28x28x1``, ``features 8 x 6x5``.

        >>> ModelPatterns(params=(), dims=ModelDims(), inputs=(((2, 28, 28, 1), "float32"),)
        ...               ).workload(32, 28)
        'images 32 x 28x28x1'
        """
        if self.input_kind == "tokens":
            return f"batch {batch_size} x seq {seq_len}"
        shape = next(shape for shape, _ in self.inputs if shape)
        return f"{self.input_kind} {batch_size} x " + "x".join(str(n) for n in shape[1:])

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
        """Every unit count a split needs ``mp`` to divide, outside the optional splits
        (:data:`OPTIONAL_SPLIT_ROLES`: k / v, the head, the token embedding, which stay whole
        where ``mp`` cuts their units, the plan saying why)."""
        out = set()
        for p in self.params:
            if p.split_dim is not None and p.role not in OPTIONAL_SPLIT_ROLES:
                out.add(p.units or p.shape[p.split_dim])
        return tuple(sorted(out))

    def indivisible(self, mp: int) -> tuple[ParamInfo, ...]:
        """The parameters whose split :attr:`ParamInfo.units` ``mp`` does not divide, outside
        the optional splits (:meth:`split_dims`' counterpart, for naming them in an error).

        >>> q = ParamInfo(path="q", shape=(32, 12), dtype="float32", role="q", kind="kernel",
        ...               split_dim=1, units=6)
        >>> [p.path for p in ModelPatterns(params=(q,), dims=ModelDims()).indivisible(4)]
        ['q']
        """
        return tuple(
            p
            for p in self.params
            if p.split_dim is not None
            and p.role not in OPTIONAL_SPLIT_ROLES
            and (p.units or p.shape[p.split_dim]) % mp
        )

    def summary(self) -> str:
        """One line: the architecture found."""
        d = self.dims
        parts = [
            f"width {d.width}",
            f"vocab {d.vocab}" if d.vocab else "no vocabulary",
            f"attention {self.attention} ({d.heads} heads, {d.kv_heads} kv heads)"
            if self.attention
            else "no attention",
            f"mlp {self._mlp_kind} (hidden {d.hidden}"
            + (f", {d.experts} experts)" if d.experts else ")")
            if self.mlp
            else "no mlp",
            self._blocks_text(),
            self._head_text(),
        ]
        if self.input_kind != "tokens":
            parts[1] = f"reads {self.input_kind}"
        return ", ".join(parts)

    def _blocks_text(self) -> str:
        if len(self.stacks) > 1:
            return " + ".join(
                f"{len(paths)} x {cls} ({paths[0].rsplit('.', 1)[0]})" for paths, cls in self.stacks
            )
        return f"{len(self.blocks)} x {self.block_class}" if self.blocks else "no repeated blocks"

    @property
    def _mlp_kind(self) -> str | None:
        if self.mlp == "gelu" and self.activation:
            return self.activation  # one up projection: named by its traced activation
        if self.mlp == "swiglu" and self.activation in ("gelu", "relu"):
            return {"gelu": "geglu", "relu": "reglu"}[self.activation]  # the gate's, as traced
        return self.mlp

    def _head_text(self) -> str:
        if self.tied_head is not None:
            return "tied head" if self.tied_head else "separate head"
        head = [p for p in self.params if p.role == "head" and p.kind == "kernel"]
        if head:
            return f"head of {head[0].shape[-1]} outputs"
        # the last projection outside the blocks makes the output (a pair's row, say)
        last = [d.param for d in self.dots if d.param is not None and d.block is None]
        info = self._by_path().get(last[-1]) if last else None
        if info is not None and info.role is not None and len(info.shape) == 2:
            return f"no separate head ({info.path} gives the {info.shape[-1]} outputs)"
        return "no head"

"""The forward's block calls, recorded: what each block takes and what becomes of its outputs.

:func:`record_block_calls` traces a model's forward abstractly (``jax.eval_shape``: no
FLOPs) on a copy of its state, with each block's class swapped for a recording subclass,
and returns every call in order: its activation, its further arguments by kind
(:data:`ARRAY`, :data:`TREE`, :data:`SCALAR`, :data:`STATIC`, :data:`OBJECT`, ...), its
outputs and, from the traced dataflow, the role of each output (the next block's
activation, summed over the blocks, used otherwise or dropped;
:mod:`~jfleet.auto_parallel.match.block_extras`). The pipeline checks in
:mod:`~jfleet.auto_parallel.match.block_check` read these records.

Example:
  >>> import jax.numpy as jnp
  >>> from jfleet.models.llama import TinyLlama
  >>> model = TinyLlama(layers=2)
  >>> call = lambda: model(jnp.zeros((2, 8), int))
  >>> [b.path for b in record_block_calls(model, ["layers.0", "layers.1"], call)]
  ['layers.0', 'layers.1']
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import graph as nnx_graph

from jfleet.auto_parallel.match.block_extras import ACTIVATION, DROPPED, SUM, USED, BlockOutputs
from jfleet.auto_parallel.match.matched import module_at

__all__ = [
    "ACTIVATION",
    "ARRAY",
    "DROPPED",
    "NONE",
    "OBJECT",
    "SCALAR",
    "STATIC",
    "SUM",
    "TREE",
    "USED",
    "Argument",
    "BlockCall",
    "BlockCalls",
    "Leaf",
    "block_outputs",
    "check_paths",
    "record_block_calls",
]

ARRAY = "array"
"""Kind of a block argument that is an array."""
NONE = "none"
"""Kind of a block argument that is None."""
SCALAR = "scalar"
"""Kind of a block argument that is a Python bool / int / float / str or an enum member."""
TREE = "tree"
"""Kind of a block argument that is a pytree (tuple, list, dict) of arrays and scalars."""
STATIC = "static"
"""Kind of a block argument that is another object holding no arrays (a function, a
frozen config): passed to every block as it is."""
OBJECT = "object"
"""Kind of a block argument a pipeline cannot pass: an NNX module or variable, or a
container or object holding them or arrays outside a pytree (a KV cache)."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array (or other leaf) of a block's activation or output.

    Attributes:
      kind: ``"float"``, ``"int"``, ``"bool"`` (arrays) or ``"other"``.
      text: a description, ``"float32[2,8,16]"`` or a type name.
      passed_back: (outputs only) the very array of the activation at the same place,
        returned unchanged.
    """

    kind: str
    text: str
    passed_back: bool = False


@dataclasses.dataclass(frozen=True)
class Argument:
    """One argument of a block call after the activation.

    Attributes:
      name: its position after the activation (``"0"``, ``"1"``, ...) or its keyword.
      kind: :data:`ARRAY`, :data:`NONE`, :data:`SCALAR`, :data:`TREE`, :data:`STATIC` or
        :data:`OBJECT`.
      text: a description: ``"int32[2,8]"``, ``"True"``, ``"KVCache (an NNX object)"``.
    """

    name: str
    kind: str
    text: str

    @property
    def where(self) -> str:
        """``"argument 0 after the activation"`` or ``"keyword argument 'mask'"``."""
        if self.name.isdigit():
            return f"argument {self.name} after the activation"
        return f"keyword argument {self.name!r}"


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """What one call of a block took and returned.

    Attributes:
      activation: the leaves of its first argument (the activation).
      arguments: its further positional arguments, then its keyword arguments.
      returns: ``"array"``, ``"tuple"``, or the type name of what it returned.
      outputs: the leaves of what it returned.
      same_structure: the output has the activation's pytree structure.
      chained: its activation is, leaf by leaf, the output of the block call just before
        it (True for the first call of the forward).
      differs: how its further arguments differ from the first block call's (a phrase),
        or None when they are the same (the same arrays, equal Python values).
      learned: the further arguments computed from the model's parameters (an encoder's
        output handed to decoder blocks): they need a gradient.
      taken_from: per leaf of its activation, the position among the previous block call's
        output leaves it is (None for the first call; -1 for a leaf that is none of them).
      roles: per output leaf, from the traced forward's dataflow: :data:`ACTIVATION` (the
        next block's activation, or every leaf when the output has the activation's
        structure), :data:`SUM` (summed over the blocks into what the forward returns: an
        auxiliary loss), :data:`DROPPED` (reaches nothing the forward returns: a cache or
        state unused in training) or :data:`USED` (reaches the forward's output otherwise).
      out_tree: the output's pytree structure.
      out_avals: per output leaf, its shape and dtype (``jax.ShapeDtypeStruct``; None for a
        leaf that is not an array).
    """

    activation: tuple[Leaf, ...]
    arguments: tuple[Argument, ...]
    returns: str
    outputs: tuple[Leaf, ...]
    same_structure: bool
    chained: bool = True
    differs: str | None = None
    learned: tuple[str, ...] = ()
    taken_from: tuple[int, ...] | None = None
    roles: tuple[str, ...] = ()
    out_tree: Any = None
    out_avals: tuple = ()


@dataclasses.dataclass(frozen=True)
class BlockCalls:
    """The calls of one block during one forward.

    Attributes:
      path: the block's dotted path (``"layers.0"``).
      calls: its calls, in order (empty when the forward never ran it).
    """

    path: str
    calls: tuple[BlockCall, ...]


# ------------------------------------------------------------------ recording
def record_block_calls(
    model: nnx.Module, block_paths: Sequence[str], call: Callable[[], Any]
) -> list[BlockCalls]:
    """How each block at ``block_paths`` is called when ``call()`` runs the model's forward.

    ``call`` is evaluated abstractly (``jax.eval_shape``: shapes only, no FLOPs) on a copy
    of the model: for the duration, the model's attributes are those of a copy merged from
    its state inside the trace, so a forward that updates state (dropout RNG counts,
    batch statistics) can run, and the copy's blocks are instances of a recording
    subclass of their class. The model itself is left exactly as it was (its attributes,
    sub-modules, classes and state). ``call`` must reach the blocks through ``model``
    (``lambda: model(tokens)``); blocks reached through a reference taken before (a list
    of the blocks captured in a closure) are not seen.

    Args:
      model: the NNX model.
      block_paths: dotted paths of the blocks (``["layers.0", "layers.1"]``).
      call: a function of no arguments running the model's forward.

    Returns:
      One :class:`BlockCalls` per path, in the order given.

    Raises:
      TypeError: ``block_paths`` is a string, or a path that is not an ``nnx.Module``.
      ValueError: a path that does not resolve under ``model``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jfleet.models.llama import TinyLlama
      >>> model = TinyLlama(layers=2)
      >>> tokens = jnp.zeros((2, 8), int)
      >>> calls = record_block_calls(model, ["layers.0", "layers.1"], lambda: model(tokens))
      >>> [len(c.calls) for c in calls], calls[1].calls[0].chained
      ([1, 1], True)
      >>> calls[0].calls[0].returns, calls[0].calls[0].outputs[0].text
      ('array', 'float32[2,8,32]')
    """
    paths = check_paths(model, block_paths)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    seen: dict[str, list[BlockCall]] = {p: [] for p in paths}
    chain = _Chain()
    saved = dict(vars(model))

    def traced(params: Any, rest: Any) -> tuple[list, list, list, list]:
        fresh = nnx.merge(graphdef, params, rest)
        for path in paths:
            block = module_at(fresh, path)
            block.__class__ = _recording_class(type(block), path, seen[path], chain)
        attributes = vars(model)
        attributes.clear()
        attributes.update(vars(fresh))
        try:
            result = call()
        finally:
            attributes.clear()
            attributes.update(saved)
        outputs = [a for _, leaves in chain.outputs for a in leaves if a is not None]
        entries = [a for leaves in chain.entries.values() for a in leaves]
        returned = [a for a in jax.tree.leaves(result) if isinstance(a, jax.Array)]
        return [leaf for _, leaf in chain.arguments], outputs, entries, returned

    closed = jax.make_jaxpr(traced)(params, rest)
    learned = collections.defaultdict(set)
    depends = _depends_on_inputs(closed.jaxpr, len(jax.tree.leaves(params)))
    for (key, _), dep in zip(chain.arguments, depends[: len(chain.arguments)], strict=True):
        if dep:
            learned[key[:2]].add(key[2])
    roles = _output_roles(closed.jaxpr, chain, seen, len(chain.arguments))
    return [
        BlockCalls(
            p,
            tuple(
                dataclasses.replace(
                    c, learned=tuple(sorted(learned[(p, i)])), roles=roles.get((p, i), ())
                )
                for i, c in enumerate(seen[p])
            ),
        )
        for p in paths
    ]


def block_outputs(
    model: nnx.Module, block_paths: Sequence[str], call: Callable[[], Any]
) -> BlockOutputs | None:
    """What the first block returns and the role the traced forward gives each part
    (:class:`~jfleet.auto_parallel.match.block_extras.BlockOutputs`: the activation a stack hands
    on, parts summed over the blocks, parts dropped), or None when a block returns its
    activation alone (the same structure as it takes).

    Raises:
      ValueError: no part of the output (or more than one) is the next block's activation.

    Example:
      >>> import jax.numpy as jnp
      >>> from jfleet.testing.nnx_styles import ReturnFormDecoder
      >>> model = ReturnFormDecoder("cache_first", rngs=nnx.Rngs(0))
      >>> call = lambda: model(jnp.zeros((2, 6), jnp.int32))
      >>> outputs = block_outputs(model, ["layers.0", "layers.1"], call)
      >>> outputs.tree, outputs.roles
      (PyTreeDef((None, *)), ('activation',))
    """
    paths = list(block_paths)
    first = record_block_calls(model, paths, call)[0].calls[0]
    if first.same_structure:
        return None
    if first.roles.count(ACTIVATION) != 1:
        raise ValueError(
            f"block {paths[0]} returns a {first.returns} none (or more than one) of whose "
            "parts is the next block's activation, so a pipelined or scanned stack cannot "
            "hand one on; keep the blocks unrolled (plan without a pipeline, "
            "ToDistributedConfig(scan_layers=False))."
        )
    rows = first.out_avals[first.roles.index(ACTIVATION)].shape[0]
    return BlockOutputs(first.out_tree, first.roles, first.out_avals, rows)


def _output_roles(jaxpr: Any, chain: _Chain, seen: dict, skip: int) -> dict:
    """Per block call ``(path, index)``, the role of each output leaf (see :class:`BlockCall`)
    from the dataflow of the traced forward ``jaxpr``: its outputs are the ``skip`` argument
    leaves, every block call's output array leaves, the floating activation leaves each
    call received, then the forward's own arrays."""
    from jax.extend.core import Literal

    n_out = sum(a is not None for _, leaves in chain.outputs for a in leaves)
    variables = iter(jaxpr.outvars[skip:])
    out_vars = {
        key: [None if a is None else _variable(next(variables)) for a in leaves]
        for key, leaves in chain.outputs
    }
    entry_vars = {key: [next(variables) for _ in leaves] for key, leaves in chain.entries.items()}
    n_in = sum(len(v) for v in entry_vars.values())
    live = {v for v in jaxpr.outvars[skip + n_out + n_in :] if not isinstance(v, Literal)}
    for eqn in reversed(jaxpr.eqns):  # what the forward's output depends on
        if any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if not isinstance(v, Literal))
    users = collections.defaultdict(list)
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, Literal):
                users[v].append(eqn)
    after_blocks = {v for vs in out_vars.values() for v in vs}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in after_blocks for v in eqn.invars):
            after_blocks.update(eqn.outvars)
    producer = {id(v): eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    order = [key for key, _ in chain.outputs]
    roles: dict = {}
    flow = (out_vars, entry_vars, users, producer, order, live)
    for key in order:
        path, index = key
        record = seen[path][index]
        following = _next_call(chain, key, seen)
        if record.same_structure:
            found = [ACTIVATION] * len(record.outputs)
            roles[key] = _handed_on(key, record, following, tuple(found), *flow)
            continue
        activation = set(following.taken_from or ()) if following is not None else set()
        if following is None:  # the last block: the place the other blocks hand on
            later = [seen[p][i] for p, i in order[1:]]
            activation = {t for c in later for t in (c.taken_from or ()) if t >= 0}
        found = []
        for j, var in enumerate(out_vars[key]):
            if j in activation:
                found.append(ACTIVATION)
            elif var is None or var not in live:
                found.append(DROPPED)
            else:
                summed = _summed(j, order, out_vars, users, after_blocks, seen)
                found.append(SUM if summed else USED)
        roles[key] = _handed_on(key, record, following, tuple(found), *flow)
    return roles


def _handed_on(
    key: tuple,
    record: BlockCall,
    following: BlockCall | None,
    roles: tuple,
    out_vars: dict,
    entry_vars: dict,
    users: dict,
    producer: dict,
    order: list,
    live: set,
) -> tuple:
    """``roles`` with the floating activation parts that also reach the forward's output
    (``live``) other than through the next block (a sum of every block's hidden states)
    made :data:`USED`: a pipeline returns only the last block's."""
    at = order.index(key)
    if following is None or not following.chained or order[at + 1] not in entry_vars:
        return roles
    into_next = {id(producer.get(id(v))) for v in entry_vars[order[at + 1]]}
    found = list(roles)
    for j, role in enumerate(roles):
        var, leaf = out_vars[key][j], record.outputs[j]
        if role != ACTIVATION or var is None or leaf.kind != "float" or leaf.passed_back:
            continue
        elsewhere = [eqn for eqn in users.get(var, []) if id(eqn) not in into_next]
        if any(v in live for eqn in elsewhere for v in eqn.outvars):
            found[j] = USED
    return tuple(found)


def _variable(v: Any) -> Any:
    from jax.extend.core import Literal

    return None if isinstance(v, Literal) else v


def _next_call(chain: _Chain, key: tuple, seen: dict) -> BlockCall | None:
    order = [k for k, _ in chain.outputs]
    at = order.index(key)
    if at + 1 >= len(order):
        return None
    path, index = order[at + 1]
    return seen[path][index]


def _summed(j: int, order: list, out_vars: dict, users: dict, after: set, seen: dict) -> bool:
    """Whether output leaf ``j`` of every block call is added, in order, into one running
    sum (``total = total + aux`` after each block) whose start is no block's output."""
    from jax.extend.core import Literal

    total = None
    for key in order:
        if len(out_vars[key]) <= j or seen[key[0]][key[1]].same_structure:
            return False
        var = out_vars[key][j]
        adds = users.get(var, []) if var is not None else []
        if len(adds) != 1 or adds[0].primitive.name not in ("add", "add_any"):
            return False
        (eqn,) = adds
        others = [v for v in eqn.invars if v is not var]
        if len(others) != 1:
            return False
        (other,) = others
        if total is None:
            if not isinstance(other, Literal) and other in after:
                return False
        elif other is not total or len(users.get(total, [])) != 1:
            return False
        total = eqn.outvars[0]
    return total is not None


def _depends_on_inputs(jaxpr: Any, n: int) -> list[bool]:
    """Per output of ``jaxpr``, whether it is computed from one of its first ``n`` inputs
    (through a nested call, any input counts for every output: conservative)."""
    from jax.extend.core import Literal

    found = set(jaxpr.invars[:n])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in found for v in eqn.invars):
            found.update(eqn.outvars)
    return [not isinstance(v, Literal) and v in found for v in jaxpr.outvars]


def check_paths(model: nnx.Module, block_paths: Sequence[str]) -> list[str]:
    if isinstance(block_paths, str):
        raise TypeError(
            f"block_paths={block_paths!r} is one string; pass a list of dotted paths, "
            "such as ['layers.0', 'layers.1']."
        )
    paths = list(block_paths)
    for path in paths:
        try:
            block = module_at(model, path)
        except (AttributeError, IndexError, KeyError, TypeError) as err:
            raise ValueError(
                f"block path {path!r} does not resolve under the {type(model).__name__} "
                f"({type(err).__name__}: {err}); give dotted paths such as 'layers.0'."
            ) from err
        if not isinstance(block, nnx.Module):
            raise TypeError(
                f"block path {path!r} is a {type(block).__name__}, not an nnx.Module; give "
                "the paths of the model's blocks."
            )
    return paths


class _Chain:
    """The last block output and the first block call's arguments, across blocks."""

    def __init__(self) -> None:
        self.last: list | None = None
        self.first: tuple | None = None
        # ((path, call index), array leaves of the output (None: not an array)), in call order
        self.outputs: list[tuple[tuple[str, int], list]] = []
        # (path, call index) -> the activation's floating leaves as the block received them
        self.entries: dict[tuple[str, int], list] = {}
        # ((path, call index, argument name), floating leaf) of every block call's arguments
        self.arguments: list[tuple[tuple[str, int, str], Any]] = []


def _recording_class(cls: type, path: str, calls: list, chain: _Chain) -> type:
    original = cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807
        x = args[0] if args else None
        rest = (args[1:], kwargs)
        x_leaves, x_tree = jax.tree.flatten(x)
        arguments = tuple(_argument(str(i), v) for i, v in enumerate(args[1:])) + tuple(
            _argument(k, v) for k, v in kwargs.items()
        )
        taken = None
        if chain.last is not None:
            taken = tuple(
                next((j for j, b in enumerate(chain.last) if b is a), -1) for a in x_leaves
            )
        chained = chain.last is None or (
            len(chain.last) == len(x_leaves)
            and all(a is b for a, b in zip(chain.last, x_leaves, strict=True))
        )
        chained = chained or (len(x_leaves) == 1 and taken is not None and taken[0] >= 0)
        if args:  # the block's own uses of its activation, told apart from the forward's
            entered, _ = _fresh(x_leaves, x_tree, [], floating=True)
            chain.entries[(path, len(calls))] = [
                e for e, a in zip(entered, x_leaves, strict=True) if e is not a
            ]
            x_leaves = entered
            args = (jax.tree.unflatten(x_tree, entered), *args[1:])
        y = original(self, *args, **kwargs)
        y_leaves, y_tree = jax.tree.flatten(y)
        same = x_tree == y_tree and bool(args)
        y_leaves, y = _fresh(y_leaves, y_tree, x_leaves)
        outputs = tuple(
            _leaf(a, passed_back=same and a is x_leaves[i]) for i, a in enumerate(y_leaves)
        )
        for name, value in [(str(i), v) for i, v in enumerate(args[1:])] + list(kwargs.items()):
            for leaf in jax.tree.leaves(value, is_leaf=_is_graph_leaf):
                if _is_array(leaf) and jnp.issubdtype(leaf.dtype, jnp.inexact):
                    chain.arguments.append(((path, len(calls), name), leaf))
        if chain.first is None:
            chain.first = rest
        differs = _arguments_differ(chain.first, rest)
        chain.last = list(y_leaves)
        chain.outputs.append(((path, len(calls)), [a if _is_array(a) else None for a in y_leaves]))
        calls.append(
            BlockCall(
                activation=tuple(_leaf(a) for a in x_leaves) if args else (),
                arguments=arguments,
                returns=_returns(y),
                outputs=outputs,
                same_structure=same,
                chained=chained,
                differs=differs,
                taken_from=taken,
                out_tree=y_tree,
                out_avals=tuple(
                    jax.ShapeDtypeStruct(np.shape(a), a.dtype) if _is_array(a) else None
                    for a in y_leaves
                ),
            )
        )
        return y

    sub = type(cls.__name__, (cls,), {"__call__": __call__})
    sub.__qualname__ = f"{cls.__qualname__}[recording]"
    sub.__module__ = cls.__module__
    return sub


def _fresh(leaves: list, tree: Any, taken: list, floating: bool = False) -> tuple[list, Any]:
    """The leaves as new traced values (an identity ``optimization_barrier``), so the
    forward's uses of a block's output are told apart from the block's own uses of the same
    values; leaves in ``taken`` (passed back from the activation) stay as they are, and with
    ``floating`` so do the leaves that are not floating."""
    at = [
        i
        for i, a in enumerate(leaves)
        if isinstance(a, jax.core.Tracer)
        and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
        and (not floating or jnp.issubdtype(a.dtype, jnp.inexact))
        and not any(a is b for b in taken)
    ]
    if not at:
        return leaves, jax.tree.unflatten(tree, leaves)
    fresh = jax.lax.optimization_barrier([leaves[i] for i in at])
    leaves = list(leaves)
    for i, a in zip(at, fresh, strict=True):
        leaves[i] = a
    return leaves, jax.tree.unflatten(tree, leaves)


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_graph_leaf(x: Any) -> bool:
    return isinstance(x, nnx.Variable) or nnx_graph.is_graph_node(x)


def _array_text(a: Any) -> str:
    return f"{jnp.dtype(a.dtype).name}[{','.join(str(d) for d in np.shape(a))}]"


def _leaf(a: Any, passed_back: bool = False) -> Leaf:
    if not _is_array(a):
        return Leaf("other", type(a).__name__, passed_back)
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):  # a PRNG key
        return Leaf("other", str(a.dtype), passed_back)
    dtype = jnp.dtype(a.dtype)
    kind = (
        "float"
        if jnp.issubdtype(dtype, jnp.inexact)
        else "bool"
        if dtype == jnp.bool_
        else "int"
        if jnp.issubdtype(dtype, jnp.integer)
        else "other"
    )
    return Leaf(kind, _array_text(a), passed_back)


def _returns(y: Any) -> str:
    return "array" if _is_array(y) else "tuple" if isinstance(y, tuple) else type(y).__name__


def _argument(name: str, value: Any) -> Argument:
    if value is None:
        return Argument(name, NONE, "None")
    if _is_array(value):
        return Argument(name, ARRAY, _array_text(value))
    if isinstance(value, bool | int | float | complex | str | bytes | enum.Enum):
        text = repr(value)
        return Argument(name, SCALAR, text if len(text) <= 40 else text[:37] + "...")
    if _is_graph_leaf(value):
        return Argument(name, OBJECT, f"{type(value).__name__} (an NNX object)")
    leaves, tree = jax.tree.flatten(value, is_leaf=_is_graph_leaf)
    if not jax.tree_util.treedef_is_leaf(tree):  # a pytree: judge its leaves
        for leaf in leaves:
            inner = _argument(name, leaf)
            if inner.kind == OBJECT:
                return Argument(name, OBJECT, f"{type(value).__name__} holding {inner.text}")
        return Argument(name, TREE, f"{type(value).__name__} of {len(leaves)} leaves")
    held = [
        v
        for v in jax.tree.leaves(getattr(value, "__dict__", {}), is_leaf=_is_graph_leaf)
        if _is_array(v) or _is_graph_leaf(v)
    ]
    if held:
        what = _argument(name, held[0]).text
        return Argument(name, OBJECT, f"{type(value).__name__} (an object holding {what})")
    return Argument(name, STATIC, type(value).__name__)


def _arguments_differ(first: tuple, rest: tuple) -> str | None:
    (args0, kwargs0), (args1, kwargs1) = first, rest
    if len(args0) != len(args1) or sorted(kwargs0) != sorted(kwargs1):
        return (
            f"{len(args1)} further positional arguments and keywords {sorted(kwargs1)} "
            f"(the first block: {len(args0)} and {sorted(kwargs0)})"
        )
    pairs = [(str(i), a, b) for i, (a, b) in enumerate(zip(args0, args1, strict=True))]
    pairs += [(k, kwargs0[k], kwargs1[k]) for k in sorted(kwargs0)]
    for name, a, b in pairs:
        where = Argument(name, "", "").where
        leaves_a, tree_a = jax.tree.flatten(a, is_leaf=_is_graph_leaf)
        leaves_b, tree_b = jax.tree.flatten(b, is_leaf=_is_graph_leaf)
        if tree_a != tree_b:
            return (
                f"{where}: {_argument(name, b).text} (the first block: {_argument(name, a).text})"
            )
        for x, y in zip(leaves_a, leaves_b, strict=True):
            if x is y:
                continue
            if _is_array(x) or _is_array(y) or _is_graph_leaf(x) or _is_graph_leaf(y):
                return f"{where}: another array ({_argument(name, y).text})"
            if not _equal(x, y):
                return f"{where}: {y!r} (the first block: {x!r})"
    return None


def _equal(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == is not a truth value
        return False


# ------------------------------------------------------------------ problems

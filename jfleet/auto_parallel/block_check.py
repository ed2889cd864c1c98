"""Planning-time checks: can a model's decoder blocks run as a pipelined stack?

``to_distributed`` replaces a model's list of blocks by a
:class:`~jfleet.auto_parallel.blocks.PipelinedBlocks` only when that runs the same
computation. :func:`pipeline_problem` says why it would not, before the first step, in
words for the user (or None):

* the blocks hold state other than ``nnx.Param`` and RNG streams (batch statistics,
  caches; dropout streams are drawn as the unpipelined blocks draw them,
  :mod:`~jfleet.auto_parallel.block_extras`);
* the blocks are not alike and do not repeat with a period
  (:func:`~jfleet.parallel.stack.block_period`), or ``num_stages`` does not divide the
  number of stacked units;
* the forward does not run each block exactly once, in order, each taking the previous
  block's output and the same further arguments;
* a block takes an object argument (a KV-cache module, a list of variables), or returns
  more than its activation and the forward keeps a part of each block's output apart (a
  list of per-block caches). Other outputs are fine when the traced dataflow shows them
  summed over the blocks (``total = total + aux``) or unused (a cache training drops):
  :attr:`BlockCall.roles`.

The calls are seen by :func:`record_block_calls`, which traces the forward abstractly
(``jax.eval_shape``: no FLOPs) on a copy of the model's state and leaves the model as it
was.

Example:
  >>> import jax.numpy as jnp
  >>> from jfleet.models.llama import TinyLlama
  >>> model = TinyLlama(layers=2)
  >>> tokens = jnp.zeros((2, 8), int)
  >>> paths = ["layers.0", "layers.1"]
  >>> print(pipeline_problem(model, paths, lambda: model(tokens), num_stages=2))
  None
  >>> print(pipeline_problem(model, paths, lambda: model(tokens), num_stages=4))
  the 2 blocks do not split evenly into 4 pipeline stages; use a pp degree dividing 2.
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

from jfleet.auto_parallel.block_extras import ACTIVATION, DROPPED, SUM, USED
from jfleet.auto_parallel.blocks import module_at
from jfleet.parallel.alike import block_period, first_mismatch

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
    "block_period",
    "block_problems",
    "period_problem",
    "pipeline_problem",
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

_PIPELINE_ARGS = (
    "after the activation, pipelined blocks take only arrays, pytrees of arrays and plain "
    "Python values: an NNX object or a cache cannot be split into micro-batches and handed "
    "to every pipeline stage"
)
_CROSS = (
    "only the activation (and integer/bool side inputs passed back unchanged) can cross "
    "pipeline stages, with other outputs that are floating arrays summed over the blocks or "
    "unused"
)


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
    paths = _check_paths(model, block_paths)
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


def _check_paths(model: nnx.Module, block_paths: Sequence[str]) -> list[str]:
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
def period_problem(
    blocks: Sequence[nnx.Module],
    *,
    num_stages: int | None = None,
    names: Sequence[str] | None = None,
) -> tuple[int | None, str | None]:
    """The blocks' period and, if they cannot be stacked over ``num_stages``, why not.

    Args:
      blocks: the blocks, in order.
      num_stages: the pipeline stages, or None (not checked).
      names: what to call the blocks in the reason (their paths); default ``block i``.

    Returns:
      ``(period, reason)``: the :func:`~jfleet.parallel.stack.block_period` (None when
      the blocks do not repeat), and None or the reason: no period (naming the first
      differing attribute), or ``num_stages`` not dividing the number of stacked units.

    Raises:
      ValueError: no blocks, ``names`` of another length, or ``num_stages`` below 1.

    Example:
      >>> from flax import nnx
      >>> drop = lambda r: nnx.Dropout(r, deterministic=True)
      >>> period_problem([drop(0.1), drop(0.2)] * 2, num_stages=2)
      (2, None)
      >>> print(period_problem([drop(0.1), drop(0.2), drop(0.2)])[1])  # doctest: +ELLIPSIS
      block 1 differs from block 0 in attribute 'rate' (0.2 vs 0.1), and the 3 blocks do...
    """
    blocks = list(blocks)
    if not blocks:
        raise ValueError("period_problem(blocks=[]): pass the model's blocks.")
    names = [f"block {i}" for i in range(len(blocks))] if names is None else list(names)
    if len(names) != len(blocks):
        raise ValueError(
            f"names has {len(names)} entries for {len(blocks)} blocks; give one per block."
        )
    if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
        raise ValueError(f"num_stages={num_stages!r}: give a pipeline stage count >= 1.")
    count = len(blocks)
    period = block_period(blocks)
    if period is None:
        i, j, difference = first_mismatch(blocks) or (0, 0, "?")
        return None, (
            f"{names[i]} differs from {names[j]} in {difference}, and the {count} blocks do "
            f"not repeat with any period shorter than {count}: a pipeline runs all stacked "
            "blocks with one definition (static settings included); give the blocks settings "
            "that repeat, or plan without a pipeline."
        )
    if num_stages is None or (count // period) % num_stages == 0:
        return period, None
    units = count // period
    if period == 1:
        return period, (
            f"the {count} blocks do not split evenly into {num_stages} pipeline stages; use a "
            f"pp degree dividing {count}."
        )
    i, j, difference = first_mismatch(blocks) or (0, 0, "?")
    return period, (
        f"the {count} blocks repeat every {period} ({names[i]} differs from {names[j]} in "
        f"{difference}), so they pipeline as {units} super-blocks of {period}, which "
        f"{num_stages} pipeline stages do not split evenly; use a pp degree dividing {units}."
    )


def pipeline_problem(
    model: nnx.Module,
    block_paths: Sequence[str],
    call: Callable[[], Any],
    *,
    num_stages: int | None = None,
) -> str | None:
    """Why the blocks at ``block_paths`` cannot run as a pipelined stack, or None.

    The checks, in order (the first failing one is the reason):

    1. the blocks hold only ``nnx.Param``\\ s and RNG streams (no batch statistics or
       caches);
    2. they are alike or repeat with a period, and ``num_stages`` (if given) divides the
       number of stacked units (:func:`period_problem`);
    3. ``call()`` (the forward, traced abstractly by :func:`record_block_calls`) runs
       every block exactly once;
    4. in order, each block taking the previous block's output as its activation;
    5. with the same further arguments as the first block (the same arrays, equal Python
       values): a pipeline hands every block the first block's arguments;
    6. those arguments are arrays, pytrees of arrays or Python values, not NNX objects or
       caches;
    7. each block takes a floating array (or a tuple of arrays with a floating one) and
       returns an activation of the same structure whose integer / boolean parts are the
       ones it took, unchanged; or takes one floating array and returns it among other
       floating arrays the forward sums over the blocks or does not use (``(cache, x)``,
       ``{"hidden": x, "aux": loss}``).

    Args:
      model: the NNX model; left exactly as it was.
      block_paths: dotted paths of the blocks, in order (``["layers.0", ...]``).
      call: a function of no arguments running the model's forward
        (``lambda: model(tokens)``).
      num_stages: the pipeline stages, or None (not checked).

    Returns:
      None, or the reason in a sentence for the user.

    Raises:
      TypeError / ValueError: ``block_paths`` that do not name modules of ``model``, or
        ``num_stages`` below 1.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self):
      ...         self.blocks = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(2)])
      ...     def __call__(self, x):
      ...         aux = 0.0
      ...         for block in self.blocks:
      ...             x = block(x)
      ...             aux = aux + jnp.mean(x**2)  # every block's output, not only the last's
      ...         return x, aux
      >>> net = Net()
      >>> paths = ["blocks.0", "blocks.1"]
      >>> print(pipeline_problem(net, paths, lambda: net(jnp.ones((2, 4)))))  # doctest: +ELLIPSIS
      block blocks.0 returns float32[2,4], and its output part 0 (float32[2,4]) reaches the ...
      >>> print(pipeline_problem(net, paths, lambda: net(jnp.ones((2, 4)))[0]))
      None
    """
    return block_problems(model, block_paths, call, num_stages=num_stages)[0]


def block_problems(
    model: nnx.Module,
    block_paths: Sequence[str],
    call: Callable[[], Any],
    *,
    num_stages: int | None = None,
) -> tuple[str | None, str | None]:
    """Why the blocks cannot be pipelined, and why they cannot be scanned (or None each).

    The pipeline's reason is :func:`pipeline_problem`'s. A scanned stack
    (:mod:`~jfleet.auto_parallel.scanned_blocks`) further needs blocks holding only
    parameters (no RNG streams) that return their activation alone.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> class Net(nnx.Module):
      ...     def __init__(self):
      ...         self.blocks = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(2)])
      ...     def __call__(self, x):
      ...         for block in self.blocks:
      ...             x = block(x)
      ...         return x
      >>> net = Net()
      >>> block_problems(net, ["blocks.0", "blocks.1"], lambda: net(jnp.ones((2, 4))))
      (None, None)
    """
    paths = _check_paths(model, block_paths)
    blocks = [module_at(model, p) for p in paths]
    state = _state_problem(blocks, paths, streams=True)
    if state:
        return state, state
    names = [f"block {p}" for p in paths]
    _, reason = period_problem(blocks, num_stages=num_stages, names=names)
    if reason:
        return reason, reason
    records = record_block_calls(model, paths, call)
    for record in records:
        if len(record.calls) != 1:
            return (_count_problem(record),) * 2
    trees = {str(r.calls[0].out_tree) for r in records}
    for index, record in enumerate(records):
        problem = _call_problem(record.path, record.calls[0], paths[0] if index else None)
        if not problem and len(trees) > 1:
            problem = (
                f"block {record.path} returns a {record.calls[0].returns} of another structure "
                f"than block {paths[0]}'s; pipelined blocks run one definition: return the "
                "same structure from every block, or plan without a pipeline."
            )
        if problem:
            return problem, problem
    scan = _state_problem(blocks, paths)
    if not scan and any(set(r.calls[0].roles) - {ACTIVATION} for r in records):
        scan = (
            f"block {paths[0]} returns {_described(records[0].calls[0].outputs)}, more than "
            "its activation: a scanned stack hands on the activation alone"
        )
    return None, scan


def state_problem(model: nnx.Module, block_paths: Sequence[str]) -> str | None:
    """Why the blocks cannot be stacked for the state they hold now (anything but
    ``nnx.Param``), or None: the first check of :func:`pipeline_problem`, without a trace.

    Example:
      >>> from flax import nnx
      >>> net = nnx.Module()
      >>> net.blocks = nnx.List([nnx.BatchNorm(4, rngs=nnx.Rngs(0)) for _ in range(2)])
      >>> state_problem(net, ["blocks.0", "blocks.1"]).split(":")[0]
      'the blocks hold state other than nnx.Param'
    """
    paths = _check_paths(model, block_paths)
    return _state_problem([module_at(model, p) for p in paths], paths)


def _state_problem(
    blocks: Sequence[nnx.Module], paths: Sequence[str], streams: bool = False
) -> str | None:
    """The state other than ``nnx.Param`` the blocks hold (RNG streams allowed when
    ``streams``: a pipeline draws their keys as the unpipelined blocks would)."""
    found = []
    kept = nnx.Any(nnx.Param, nnx.RngState) if streams else nnx.Param
    for path, block in zip(paths, blocks, strict=True):
        other = nnx.state(block, nnx.Not(kept))
        for where, value in nnx.to_flat_state(other):
            dotted = ".".join(str(p) for p in (path, *where))
            found.append(f"{dotted} ({type(value).__name__})")
    if not found:
        return None
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return (
        f"the blocks hold state other than nnx.Param: {shown}. A pipelined or scanned "
        "stack holds only parameters: build dropout without rngs (pass rngs when calling "
        "it), keep batch statistics and caches out of the blocks, or plan without a pipeline."
    )


def _count_problem(record: BlockCalls) -> str:
    if not record.calls:
        return (
            f"block {record.path} is never called by the forward, so replacing the blocks by "
            "a pipeline would not run what the forward runs; plan without a pipeline (or "
            "give the blocks the forward actually runs)."
        )
    return (
        f"block {record.path} is called {len(record.calls)} times per forward (a shared block "
        "or a loop over it); a pipeline runs each block once per forward, so plan without a "
        "pipeline."
    )


def _call_problem(path: str, call: BlockCall, first: str | None) -> str | None:
    if not call.chained:
        return (
            f"block {path} does not take the previous block's output as its activation (the "
            "forward changes the activation between blocks or runs them out of order); a "
            "pipeline runs the blocks back to back, so plan without a pipeline."
        )
    if call.differs and first is not None:
        return (
            f"block {path} is called with arguments other than block {first}'s ("
            f"{call.differs}); a pipeline hands every block the first block's arguments: "
            "compute such arguments once before the loop and let each block pick its "
            "behaviour from its own settings, or plan without a pipeline."
        )
    if call.learned:
        where = ", ".join(Argument(n, "", "").where for n in call.learned)
        return (
            f"block {path} takes {where} computed from the model's parameters (an encoder's "
            "output, say); a pipeline hands block arguments to every stage without a "
            "gradient, so the layers computing it would train wrong: plan without a pipeline, "
            "or pipeline a stack whose further arguments are inputs (masks, positions)."
        )
    for argument in call.arguments:
        if argument.kind == OBJECT:
            return f"block {path} takes {argument.where} = {argument.text}; {_PIPELINE_ARGS}."
    kinds = [leaf.kind for leaf in call.activation]
    if not kinds or "other" in kinds or "float" not in kinds:
        taken = _described(call.activation) if call.activation else "no positional activation"
        return (
            f"block {path} takes {taken} as its activation; a pipelined block takes a "
            "floating array, or a tuple of arrays with a floating one (the hidden state) and "
            "integer / boolean ones passed along."
        )
    used = [j for j, r in enumerate(call.roles) if r == USED]
    if used:
        return (
            f"block {path} returns {_described(call.outputs)}, and its output part "
            f"{used[0]} ({call.outputs[used[0]].text}) reaches the forward's output other "
            "than through the next block or a running sum over the blocks (total = total + "
            "part after each block); a pipeline runs all blocks as one call, so it hands on "
            "the activation, sums such parts over the blocks or drops parts unused in "
            "training, but cannot return each block's own: sum them, drop them, or plan "
            "without a pipeline."
        )
    fine = (
        call.same_structure
        and len(call.outputs) == len(call.activation)
        and all(
            o.kind == "float" if a.kind == "float" else o.kind == a.kind
            for a, o in zip(call.activation, call.outputs, strict=True)
        )
    )
    if fine:
        for i, (a, o) in enumerate(zip(call.activation, call.outputs, strict=True)):
            if a.kind != "float" and not o.passed_back:
                return (
                    f"block {path} returns the {a.text} part {i} of its activation changed; "
                    "integer and boolean parts must come back as taken, since every pipeline "
                    "stage gets the values that entered the stack: return them unchanged, or "
                    "plan without a pipeline."
                )
    elif _outputs_fine(call):
        return None
    else:
        if call.returns == "array":
            returned = f"an array {call.outputs[0].text}"
        elif not call.outputs:
            returned = "None" if call.returns == "NoneType" else f"an empty {call.returns}"
        else:
            returned = f"a {call.returns} {_described(call.outputs)}"
        return (
            f"block {path} returns {returned} where it takes {_described(call.activation)} "
            f"— {_CROSS}; return the activation with such outputs only, or plan without a "
            "pipeline."
        )
    return None


def _outputs_fine(call: BlockCall) -> bool:
    """A block taking one floating array and returning it among other arrays that are
    summed over the blocks or unused (the roles the traced forward gave them)."""
    if len(call.activation) != 1 or call.activation[0].kind != "float":
        return False
    if not call.roles or call.roles.count(ACTIVATION) != 1 or USED in call.roles:
        return False
    j = call.roles.index(ACTIVATION)
    if call.outputs[j].text != call.activation[0].text:
        return False
    pairs = list(zip(call.outputs, call.roles, strict=True))
    return all(o.kind == "float" for o, r in pairs if r == SUM) and all(
        o.kind != "other" for o in call.outputs
    )


def _described(leaves: Sequence[Leaf]) -> str:
    if len(leaves) == 1:
        return leaves[0].text
    return "(" + ", ".join(leaf.text for leaf in leaves) + ")"

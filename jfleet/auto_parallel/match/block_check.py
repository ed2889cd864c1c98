"""Planning-time checks: can a model's decoder blocks run as a pipelined stack?

``to_distributed`` replaces a model's list of blocks by a
:class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks` only when that runs the same
computation. :func:`pipeline_problem` says why it would not, before the first step, in
words for the user (or None):

* the blocks hold state other than ``nnx.Param`` and RNG streams (batch statistics,
  caches; dropout streams are drawn as the unpipelined blocks draw them,
  :mod:`~jfleet.auto_parallel.match.block_extras`);
* the blocks are not alike and do not repeat with a period
  (:func:`~jfleet.parallel.stack.block_period`), or ``num_stages`` is more than the
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
  the 2 blocks are fewer than the 4 pipeline stages (every stage needs one); use pp <= 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flax import nnx

from jfleet.auto_parallel.match.block_calls import (
    OBJECT,
    Argument,
    BlockCall,
    BlockCalls,
    Leaf,
    check_paths,
    record_block_calls,
)
from jfleet.auto_parallel.match.block_extras import ACTIVATION, SUM, USED
from jfleet.auto_parallel.match.matched import module_at
from jfleet.parallel.alike import block_period, first_mismatch

__all__ = [
    "block_period",
    "block_problems",
    "period_problem",
    "pipeline_problem",
    "state_problem",
]

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
      differing attribute), or ``num_stages`` more than the stacked units.

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
    # uneven stages are fine (the stack is padded to the largest); each needs a unit
    if num_stages is None or count // period >= num_stages:
        return period, None
    units = count // period
    if period == 1:
        return period, (
            f"the {count} blocks are fewer than the {num_stages} pipeline stages (every stage "
            f"needs one); use pp <= {count}."
        )
    i, j, difference = first_mismatch(blocks) or (0, 0, "?")
    return period, (
        f"the {count} blocks repeat every {period} ({names[i]} differs from {names[j]} in "
        f"{difference}), so they pipeline as {units} super-blocks of {period}, fewer than the "
        f"{num_stages} pipeline stages (every stage needs one); use pp <= {units}."
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
    (:mod:`~jfleet.auto_parallel.apply.scanned_blocks`) further needs blocks holding only
    parameters (no RNG streams); outputs besides the activation it carries, sums or drops
    by their roles, as the pipeline does.

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
    paths = check_paths(model, block_paths)
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
    return None, _state_problem(blocks, paths)


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
    paths = check_paths(model, block_paths)
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

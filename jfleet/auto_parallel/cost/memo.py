"""Per-model memo of what the cost model derives from a model's parameters.

Planning predicts thousands of layouts of one matched model; most share their ``mp``
degree or their whole mesh and differ only in micro-batches, schedule or recompute.
:func:`cached` keeps what a key determines (each parameter's spec at an ``mp``, the stage's
local bytes at a mesh, the traced products' FLOPs) with the
:class:`~jfleet.auto_parallel.match.patterns.ModelPatterns` object, dropped when that object is
collected, so the cost of a candidate does not grow with the number of parameter arrays.
:func:`block_groups` says whether the decoder blocks hold the same parameter shapes, so a
stage's sums can be taken over one block and multiplied.

Example:
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
  >>> cached(found, ("answer",), lambda: 42), cached(found, ("answer",), lambda: 0)
  (42, 42)
  >>> outside, first, uniform = block_groups(found)
  >>> uniform, len(first) * 2 + len(outside) == len(found.params)
  (True, True)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from jfleet.auto_parallel.match.patterns import ModelPatterns, ParamInfo

__all__ = ["block_groups", "cached", "cached_for"]

T = TypeVar("T")
_STORE: dict[int, dict[Hashable, Any]] = {}


def cached(patterns: ModelPatterns, key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()`` the first time ``key`` is asked of ``patterns``, the kept value after."""
    try:  # the kept value: planning asks several a layout, hundreds of thousands a plan
        return _STORE[id(patterns)][key]
    except KeyError:
        pass
    ident = id(patterns)
    store = _STORE.get(ident)
    if store is None:
        store = _STORE[ident] = {}
        weakref.finalize(patterns, _STORE.pop, ident, None)
    if key not in store:
        store[key] = compute()
    return store[key]


def cached_for(patterns: ModelPatterns, owner: object, key: tuple, compute: Callable[[], T]) -> T:
    """:func:`cached` for what ``owner`` (a hardware profile) decides too, told apart by
    identity: the entry holds ``owner``, so its ``id`` stays its own while the entry lives.

    >>> from jfleet.auto_parallel.match.patterns import match_patterns
    >>> from jfleet.models.llama import TinyLlama
    >>> found, a, b = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2)), [], []
    >>> cached_for(found, a, ("n",), lambda: 1), cached_for(found, b, ("n",), lambda: 2)
    (1, 2)
    """
    return cached(patterns, (id(owner), *key), lambda: (owner, compute()))[1]


def _relative(p: ParamInfo, prefix: str) -> tuple:
    return (p.path[len(prefix) :], tuple(p.shape), p.dtype)


def _groups(patterns: ModelPatterns) -> tuple[tuple, tuple, bool]:
    outside = tuple(p for p in patterns.params if p.block is None)
    if not patterns.blocks:
        return outside, (), False
    by_block: dict[int, list] = {}
    for p in patterns.params:
        if p.block is not None:
            by_block.setdefault(p.block, []).append(p)
    first = tuple(by_block.get(0, ()))
    shape0 = sorted(_relative(p, patterns.blocks[0]) for p in first)
    uniform = len(by_block) == len(patterns.blocks) and all(
        sorted(_relative(p, patterns.blocks[b]) for p in ps) == shape0 for b, ps in by_block.items()
    )
    return outside, first, uniform


def block_groups(patterns: ModelPatterns) -> tuple[tuple, tuple, bool]:
    """(parameters outside the blocks, block 0's, whether every block holds the same shapes)."""
    return cached(patterns, ("block_groups",), lambda: _groups(patterns))

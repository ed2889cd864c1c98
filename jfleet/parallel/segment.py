"""Paddle's ``SegmentLayers``: which layers of a ``PipelineLayer`` each pipeline stage holds.

:func:`segment_layers` returns the stage boundaries ``[0, b1, ..., n]`` over a list of
``n`` layers (stage ``s`` holds ``layers[parts[s]:parts[s + 1]]``), as Paddle computes them:

* ``"uniform"``: ``n // P`` layers per stage, the ``n % P`` extra layers one each to the
  last stages (Paddle's remainder rule);
* ``"layer:<Regex>"``: balanced by the layers whose class name matches the regular
  expression (case-insensitive): each stage gets the same number of them, a stage ending
  right after its last one (the last stage takes the rest); when the stages do not divide
  their number, as evenly as they go, the extra ones to the last stages (Paddle's
  remainder rule; Paddle itself refuses this split);
* a list of ``P + 1`` non-decreasing indices from 0 to ``n``: the boundaries themselves.

Example:
  >>> segment_layers(["Embed"] + ["Block"] * 4 + ["Norm", "Head"], 2)
  [0, 3, 7]
  >>> segment_layers(["Embed"] + ["Block"] * 4 + ["Norm", "Head"], 4, "layer:block")
  [0, 2, 3, 4, 7]
  >>> segment_layers(["Embed"] + ["Block"] * 5 + ["Head"], 2, "layer:block")  # 2 + 3
  [0, 3, 7]
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["segment_layers", "uniform"]


def uniform(num_items: int, num_parts: int) -> list[int]:
    """Paddle's uniform boundaries: ``n // P`` items per part, the remainder to the last parts.

    Example:
      >>> uniform(7, 2), uniform(7, 4), uniform(8, 3)
      ([0, 3, 7], [0, 1, 3, 5, 7], [0, 2, 5, 8])
    """
    result = [0] * (num_parts + 1)
    size, extra = divmod(num_items, num_parts)
    for i in range(1, num_parts):
        offset = 1 if i > num_parts - extra else 0
        result[i] = min(result[i - 1] + size + offset, num_items)
    result[num_parts] = num_items
    return result


def segment_layers(names: Sequence[str], num_parts: int, method: Any = "uniform") -> list[int]:
    """The stage boundaries ``[0, b1, ..., len(names)]`` for layers called ``names``.

    Args:
      names: each layer's class (or function) name, in order.
      num_parts: the number of stages ``P``.
      method: ``"uniform"``, ``"layer:<Regex>"`` or explicit boundaries (see the module).

    Raises:
      ValueError: fewer layers than stages; an unknown method; a regular expression that
        is malformed or matches nothing;
        boundaries that are not ``P + 1`` non-decreasing indices from 0 to ``n``.
      TypeError: ``method`` neither a string nor a list of ints.

    Example:
      >>> segment_layers(["A", "B", "C"], 2, [0, 1, 3])
      [0, 1, 3]
    """
    n = len(names)
    if isinstance(method, str):
        if n < num_parts:
            raise ValueError(
                f"num_stages={num_parts} is more than the {n} layers; use num_stages "
                f"(pp_degree) <= {n}, or more layers."
            )
        if method == "uniform":
            return uniform(n, num_parts)
        if method.startswith("layer:"):
            return _by_layer(names, num_parts, method)
        raise ValueError(
            f"seg_method={method!r} is not a segmentation method; use 'uniform', "
            "'layer:ClassNameRegex' or a list of stage boundaries [0, ..., len(layers)]."
        )
    ok = isinstance(method, Sequence) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in method
    )
    if not ok:
        raise TypeError(
            f"seg_method={method!r} must be 'uniform', 'layer:ClassNameRegex' or a list of ints."
        )
    bounds = list(method)
    if (
        len(bounds) != num_parts + 1
        or bounds[0] != 0
        or bounds[-1] != n
        or any(b > c for b, c in itertools.pairwise(bounds))
    ):
        raise ValueError(
            f"seg_method={bounds} must be {num_parts + 1} non-decreasing stage boundaries from "
            f"0 to {n} (num_stages={num_parts}, {n} layers)."
        )
    return bounds


def _by_layer(names: Sequence[str], num_parts: int, method: str) -> list[int]:
    pattern = method[len("layer:") :]
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as err:
        raise ValueError(f"seg_method={method!r}: bad regular expression ({err}).") from err
    hits = [i for i, name in enumerate(names) if regex.search(name)]
    if not hits:
        raise ValueError(
            f"seg_method={method!r} matches no layer; the layers' class names are "
            f"{sorted(set(names))}."
        )
    counts = list(
        itertools.accumulate(b - a for a, b in itertools.pairwise(uniform(len(hits), num_parts)))
    )
    inner = [hits[c - 1] + 1 if c else hits[0] for c in counts[:-1]]
    return [0, *inner, len(names)]

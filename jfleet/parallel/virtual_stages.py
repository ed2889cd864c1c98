"""Interleaved (virtual) pipeline stages: where each layer lives and which schedule runs.

With ``v`` virtual stages per device a stacked body of ``N`` layers is cut into ``P v``
chunks of ``L = N / (P v)`` layers; device ``s`` holds chunks ``s, s + P, ..., s + (v - 1)
P`` (Megatron's and Paddle's order), stacked as one ``[P, v L, ...]`` array whose row ``s``
is its chunks in order. Unit ``(s, k)`` of that array, ``k = c L + j``, is layer
``(c P + s) L + j`` of the body; with ``v = 1`` it is layer ``s L + j`` as before.

**Uneven stages.** When ``P v`` does not divide ``N`` (or the caller says how many units
each chunk holds), chunk ``i`` holds ``sizes[i]`` consecutive units (:func:`even_sizes`:
``ceil(N / (P v))`` or ``floor``, the larger first; :func:`check_sizes` validates a given
list). The stack is then ``[P, v K, ...]`` with ``K = max(sizes)``: chunk ``c`` of device
``s`` is slots ``c K .. c K + K - 1`` of row ``s``, its first ``sizes[c P + s]`` slots
real and the rest padding that the stage function skips exactly (:func:`slot_units`,
:func:`slot_mask`).

Example:
  >>> interleaved_order(8, 2, 2)  # the body's layers as stacked: device 0, then device 1
  [0, 1, 4, 5, 2, 3, 6, 7]
  >>> layer_of(1, 2, 2, 2, 4)  # device 1's unit 2 (chunk 1, first layer)
  6
  >>> pipeline_schedule_for("1F1B", 2), pipeline_schedule_for("ZBH1", 1)
  ('VPP', 'ZBH1')
  >>> even_sizes(5, 2), slot_units((3, 2), 2).tolist()  # 5 blocks on 2 stages
  ((3, 2), [[0, 1, 2], [3, 4, -1]])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["TABLE_RUN", "chunked", "interleaved_order", "layer_of", "layer_order_params"]
__all__ += ["check_chunks_agree", "check_microbatches", "check_virtual", "pipeline_schedule_for"]
__all__ += ["check_sizes", "even_sizes", "is_even", "sizes_text", "slot_mask", "slot_units"]

#: The schedules run by :mod:`jfleet.parallel.pipeline_executor` (the others by
#: :mod:`jfleet.parallel.pipeline_schedule`).
TABLE_RUN = ("VPP", "ZBH1")


def check_virtual(v: Any) -> int:
    """``num_virtual_pipeline_stages`` as an int >= 1 (None: 1).

    Raises:
      ValueError: anything else.
    """
    if v is None:
        return 1
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(
            f"num_virtual_pipeline_stages={v!r} must be None or an int >= 1 (chunks per "
            "pipeline stage; 2 or more interleaves them)."
        )
    return v


def layer_of(stage: int, unit: int, num_stages: int, v: int, per_stage: int) -> int:
    """The body layer at unit ``unit`` of device ``stage``'s row (``per_stage = v L``)."""
    per_chunk = per_stage // v
    chunk, j = divmod(unit, per_chunk)
    return (chunk * num_stages + stage) * per_chunk + j


def interleaved_order(num_layers: int, num_stages: int, v: int) -> list[int]:
    """The body's layer indices in stacked order (device by device, its chunks in order)."""
    per_stage = num_layers // num_stages
    return [
        layer_of(s, k, num_stages, v, per_stage)
        for s in range(num_stages)
        for k in range(per_stage)
    ]


def layer_order_params(params: Any, num_stages: int, v: int) -> Any:
    """Stacked leaves ``[P, v L, ...]`` as ``[N, ...]`` in layer order (the sequential model)."""

    def one(a: jax.Array) -> jax.Array:
        per_chunk = a.shape[1] // v
        a = a.reshape(num_stages, v, per_chunk, *a.shape[2:]).swapaxes(0, 1)
        return a.reshape(num_stages * v * per_chunk, *a.shape[3:])

    return jax.tree.map(one, params)


def chunked(params: Any, v: int) -> Any:
    """Stage leaves ``[P, v L, ...]`` (or flat ``[P, n]``, ``v = 1``) as ``[P, v, L, ...]``."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0], v, a.shape[1] // v, *a.shape[2:]), params)


def pipeline_schedule_for(schedule: str, v: int) -> str:
    """The schedule that runs ``schedule`` with ``v`` virtual stages per device.

    Paddle interleaves whenever a ``PipelineLayer`` has virtual stages: ``"1F1B"`` (its
    default) or ``"VPP"`` with ``v > 1`` run ``"VPP"``; ``"VPP"`` needs ``v > 1``; FThenB and
    ZB-H1 run one chunk per device.

    Raises:
      ValueError: ``"VPP"`` with ``v == 1``; ``"FThenB"`` or ``"ZBH1"`` with ``v > 1``.
    """
    if v > 1:
        if schedule in ("1F1B", "VPP"):
            return "VPP"
        raise ValueError(
            f"schedule_mode {schedule!r} runs one chunk per stage, but the PipelineLayer has "
            f"num_virtual_pipeline_stages={v}; use schedule_mode 'VPP' (or '1F1B'), or build "
            "it with num_virtual_pipeline_stages=1."
        )
    if schedule == "VPP":
        raise ValueError(
            "schedule_mode 'VPP' (interleaved stages) needs a PipelineLayer with "
            "num_virtual_pipeline_stages >= 2; build it with num_virtual_pipeline_stages=2, or "
            "use schedule_mode '1F1B'."
        )
    return schedule


def check_chunks_agree(
    schedule: str | None,
    v: int,
    *,
    names: tuple[str, str] = ("schedule", "num_virtual"),
    one_f_one_b_interleaves: bool = False,
) -> None:
    """``schedule`` and ``v`` chunks per stage agree: ``"VPP"`` interleaves 2 or more, the
    other schedules run one (with ``one_f_one_b_interleaves``, Paddle's rule, ``"1F1B"`` may
    have more: it then runs ``"VPP"``). ``None`` (a schedule still to choose) agrees with any
    ``v``. ``names`` are the caller's names for the two settings, for the message.

    Raises:
      ValueError: they disagree.

    Example:
      >>> check_chunks_agree("VPP", 2)
      >>> check_chunks_agree("1F1B", 2, one_f_one_b_interleaves=True)  # runs VPP
      >>> check_chunks_agree(None, 4)  # a schedule still to choose
    """
    if schedule is None or (schedule == "1F1B" and one_f_one_b_interleaves):
        return
    if (schedule == "VPP") != (v > 1):
        s_name, v_name = names
        raise ValueError(
            f"{s_name}={schedule!r} with {v_name}={v}: 'VPP' (interleaved stages) needs "
            f"{v_name} >= 2 and the other schedules run one chunk per stage ({v_name}=1)."
        )


def check_microbatches(schedule: str, num_stages: int, num_microbatches: int) -> None:
    """VPP runs micro-batches in groups of ``P``: ``M`` must be a multiple of ``P``.

    Raises:
      ValueError: ``"VPP"`` with ``M % P != 0``.
    """
    if schedule == "VPP" and num_microbatches % num_stages:
        raise ValueError(
            f"interleaved stages (VPP) run micro-batches in groups of the pipeline degree "
            f"{num_stages}; accumulate_steps (micro-batches)={num_microbatches} is not a "
            "multiple of it: use "
            f"{num_stages * max(1, -(-num_microbatches // num_stages))}."
        )


# ------------------------------------------------------------------ uneven stages
def even_sizes(num_units: int, num_parts: int) -> tuple[int, ...]:
    """Units per part as even as they go: ``ceil(N / P)`` for the first ``N % P`` parts,
    ``floor(N / P)`` for the rest (the slowest stages first, as Megatron's uneven split).

    Example:
      >>> even_sizes(70, 12)
      (6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5)
      >>> even_sizes(7, 8)  # 7 blocks on pp4 x 2 virtual stages: the last chunk is empty
      (1, 1, 1, 1, 1, 1, 1, 0)
    """
    size, extra = divmod(num_units, num_parts)
    return tuple(size + (1 if i < extra else 0) for i in range(num_parts))


def is_even(sizes: Sequence[int]) -> bool:
    """Whether every chunk holds the same number of units (no padding).

    Example:
      >>> is_even((2, 2)), is_even((3, 2))
      (True, False)
    """
    return len(set(sizes)) <= 1


def sizes_text(sizes: Sequence[int], num_stages: int) -> str:
    """``"stages of 3,2 blocks"`` (per device; with virtual stages, the chunks too).

    Example:
      >>> sizes_text((3, 2), 2)
      'stages of 3,2 blocks'
    """
    per_stage = [sum(sizes[s::num_stages]) for s in range(num_stages)]
    text = f"stages of {','.join(map(str, per_stage))} blocks"
    if len(sizes) > num_stages:
        text += f" (chunks of {','.join(map(str, sizes))})"
    return text


def check_sizes(
    sizes: Any, num_units: int, num_stages: int, v: int = 1, *, name: str = "blocks"
) -> tuple[int, ...]:
    """``sizes`` (units per chunk, ``P v`` of them; None: :func:`even_sizes`) validated.

    Raises:
      ValueError: not ``P v`` ints >= 0, a sum other than ``num_units``, or a stage
        (device) left without a unit; the message names the list given, what was
        expected and a list that would do.

    Example:
      >>> check_sizes(None, 5, 2), check_sizes([2, 3], 5, 2)
      ((3, 2), (2, 3))
      >>> check_sizes([4, 2], 5, 2)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ValueError: stage sizes [4, 2] sum to 6, not the 5 blocks; ...
    """
    parts = num_stages * v
    if sizes is None:
        sizes = even_sizes(num_units, parts)
    else:
        ok = isinstance(sizes, Sequence) and not isinstance(sizes, str)
        ok = ok and all(isinstance(n, int) and not isinstance(n, bool) for n in sizes)
        ok = ok and len(sizes) == parts and all(n >= 0 for n in sizes)
        what = f"{num_stages} stages x {v} virtual stages" if v > 1 else f"{num_stages} stages"
        if not ok:
            raise ValueError(
                f"stage sizes {sizes!r} must be {parts} ints >= 0, the {name} of each of the "
                f"{what} in order; e.g. {list(even_sizes(num_units, parts))}."
            )
        if sum(sizes) != num_units:
            raise ValueError(
                f"stage sizes {list(sizes)} sum to {sum(sizes)}, not the {num_units} {name}; "
                f"give {parts} counts summing to {num_units}, e.g. "
                f"{list(even_sizes(num_units, parts))}."
            )
    sizes = tuple(int(n) for n in sizes)
    empty = [s for s in range(num_stages) if not sum(sizes[s::num_stages])]
    if empty:
        raise ValueError(
            f"stage sizes {list(sizes)} leave pipeline stage(s) {empty} with 0 {name}; every "
            f"stage needs at least one: use pp <= {num_units}"
            + (f" / {v} virtual stages" if v > 1 else "")
            + " or give each stage a block."
        )
    return sizes


def slot_units(sizes: Sequence[int], num_stages: int) -> np.ndarray:
    """``[P, v K]``: the unit at each slot of the stacked rows, ``-1`` for padding.

    Chunk ``i = c P + s`` (device ``s``'s ``c``-th) holds units ``sum(sizes[:i]) ..`` in
    slots ``c K ..`` of row ``s``. With equal sizes this is :func:`interleaved_order`.

    Example:
      >>> slot_units((1, 1, 1, 0), 2).tolist()  # 3 units on 2 devices x 2 chunks
      [[0, 2], [1, -1]]
    """
    parts = len(sizes)
    v, width = parts // num_stages, max(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    out = np.full((num_stages, v * width), -1, np.int64)
    for i, n in enumerate(sizes):
        c, s = divmod(i, num_stages)
        out[s, c * width : c * width + n] = np.arange(starts[i], starts[i] + n)
    return out


def slot_mask(sizes: Sequence[int], num_stages: int) -> np.ndarray:
    """``[P, v K]`` float32: 1 at a real slot, 0 at padding (:func:`slot_units`).

    Example:
      >>> slot_mask((3, 2), 2).tolist()
      [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    """
    return (slot_units(sizes, num_stages) >= 0).astype(np.float32)

"""Interleaved (virtual) pipeline stages: where each layer lives and which schedule runs.

With ``v`` virtual stages per device a stacked body of ``N`` layers is cut into ``P v``
chunks of ``L = N / (P v)`` layers; device ``s`` holds chunks ``s, s + P, ..., s + (v - 1)
P`` (Megatron's and Paddle's order), stacked as one ``[P, v L, ...]`` array whose row ``s``
is its chunks in order. Unit ``(s, k)`` of that array, ``k = c L + j``, is layer
``(c P + s) L + j`` of the body; with ``v = 1`` it is layer ``s L + j`` as before.

Example:
  >>> interleaved_order(8, 2, 2)  # the body's layers as stacked: device 0, then device 1
  [0, 1, 4, 5, 2, 3, 6, 7]
  >>> layer_of(1, 2, 2, 2, 4)  # device 1's unit 2 (chunk 1, first layer)
  6
  >>> pipeline_schedule_for("1F1B", 2), pipeline_schedule_for("ZBH1", 1)
  ('VPP', 'ZBH1')
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["TABLE_RUN", "chunked", "interleaved_order", "layer_of", "layer_order_params"]
__all__ += ["check_chunks_agree", "check_microbatches", "check_virtual", "pipeline_schedule_for"]

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

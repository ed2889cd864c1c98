"""What a pipeline schedule does per training step, counted: ticks, work, bubbles, collectives.

The accounting of :mod:`jfleet.parallel.pipeline_schedule` (``pipeline_loss``) and
:mod:`jfleet.parallel.pipeline_forward` (the ``to_distributed`` stand-in), for the cost
model, the benchmarks and the structural tests: :func:`schedule_stats` (ticks,
collective-permutes, bubble fraction, stash slots), :func:`stage_ticks` (per stage, the
units of forward / recompute / backward work and skipped bubbles) and
:func:`taken_branches` (how often a stage takes each branch of the compiled conditionals,
for :func:`jfleet.testing.hlo.executed_flops`).

Example:
  >>> schedule_stats("FThenB", 4, 8)["ticks"], stage_ticks("FThenB", 4, 8)[0]["bubble"]
  (22, 6)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The schedule names :func:`pipeline_loss` accepts (Paddle's ``schedule_mode`` values).
SCHEDULES = ("FThenB", "1F1B")


def schedule_stats(schedule: str, num_stages: int, num_microbatches: int) -> dict[str, Any]:
    """Ticks, collective-permutes and bubble of one training step of a schedule.

    Args:
      schedule: ``"FThenB"`` or ``"1F1B"``.
      num_stages: pipeline stages ``P`` (the ``pp`` degree).
      num_microbatches: micro-batches ``M`` per step.

    Returns:
      A dict with ``schedule``, ``num_stages``, ``num_microbatches`` and

      * ``ticks``: loop iterations per step: FThenB ``2(M + P - 1)`` (forward loop, then
        its transpose), 1F1B ``M + 2(P - 1)`` (each tick one forward and one backward);
      * ``collective_permutes``: ``lax.ppermute`` executions per step (one per tick and
        direction): FThenB ``2(M + P - 1)``, 1F1B ``2(M + 2P - 2)``; 0 when ``P == 1``;
      * ``bubble_fraction``: the idle share of a stage's time, ``(P - 1) / (M + P - 1)``
        for both (bubble ticks skip their work with ``lax.cond``, so the lockstep 1F1B
        costs ``(P - 1)`` forward-only, ``M`` forward+backward and ``(P - 1)``
        backward-only ticks, like GPipe);
      * ``stash_slots``: micro-batches whose activations a stage holds at once: FThenB
        ``M`` (every micro-batch's, or only its stage inputs with remat), 1F1B
        ``max(2(P - 1), 1)`` stage inputs.

    Raises:
      ValueError: an unknown schedule, or counts below 1.

    Example:
      >>> schedule_stats("1F1B", 4, 8)["collective_permutes"]
      28
      >>> schedule_stats("FThenB", 4, 8)["collective_permutes"]
      22
    """
    _check_schedule(schedule)
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1.")
    p, m = num_stages, num_microbatches
    if schedule == "FThenB":
        ticks, per_step, stash = 2 * (m + p - 1), 2 * (m + p - 1), m
    else:
        ticks, per_step, stash = m + 2 * (p - 1), 2 * (m + 2 * p - 2), max(2 * (p - 1), 1)
    return {
        "schedule": schedule,
        "num_stages": p,
        "num_microbatches": m,
        "ticks": ticks,
        "collective_permutes": per_step if p > 1 else 0,
        "bubble_fraction": (p - 1) / (m + p - 1),
        "stash_slots": stash,
    }


#: The kinds of work :func:`stage_ticks` counts, one micro-batch through one stage each.
TICK_KINDS = ("forward", "recompute", "backward", "bubble")


def stage_ticks(
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    *,
    remat: bool = False,
    loss_inside: bool = True,
    num_virtual: int = 1,
) -> list[dict[str, int]]:
    """Per stage, how many units of each kind of work one training step runs.

    A unit is one micro-batch through one stage: ``"forward"``, ``"recompute"`` (a forward
    run again in the backward pass), ``"backward"`` (the vjp), ``"bubble"`` (a tick slot
    whose work ``lax.cond`` skips). Executed work per stage is ``forward + recompute +
    backward`` units; the slowest stage sets the step time.

    * :func:`~jfleet.parallel.pipeline_schedule.pipeline_loss` (``loss_inside=True``):
      FThenB (``2(M + P - 1)`` ticks) runs ``M`` forwards and ``M`` backwards (pulled back
      from the forward's saved matmul outputs), with remat ``M`` recomputes instead;
      ``2(P - 1)`` ticks are bubbles. 1F1B (``M + 2(P - 1)`` ticks of a forward slot and a
      backward slot) recomputes ``M`` forwards on every stage but the last, which runs
      each micro-batch's forward, loss and backward in one tick; ``4(P - 1)`` slots are
      bubbles.
    * :func:`~jfleet.parallel.pipeline_forward.pipeline_forward` (``loss_inside=False``,
      the ``to_distributed`` stand-in): FThenB as above; 1F1B (the same program as FThenB
      with remat) runs ``M`` forwards, ``M`` recomputes and ``M`` backwards; ``2(P - 1)``
      bubbles on every stage. With ``num_virtual = v > 1`` (VPP: 1F1B's program over
      interleaved stages) a unit is one micro-batch through one of the stage's ``v``
      chunks: ``v M`` of each kind and still ``2(P - 1)`` bubbles, each a chunk long.

    Example:
      >>> stage_ticks("1F1B", 2, 4)
      [{'forward': 4, 'recompute': 4, 'backward': 4, 'bubble': 4}, \
{'forward': 4, 'recompute': 0, 'backward': 4, 'bubble': 4}]
    """
    stats = schedule_stats(schedule, num_stages, num_microbatches)
    p, m = stats["num_stages"], stats["num_microbatches"]
    if num_virtual > 1:
        if schedule != "1F1B" or loss_inside:
            raise ValueError(
                f"num_virtual={num_virtual} counts the stand-in's VPP (schedule '1F1B', "
                f"loss_inside=False); got schedule={schedule!r}, loss_inside={loss_inside}."
            )
        vm = num_virtual * m
        return [dict(zip(TICK_KINDS, (vm, vm, vm, 2 * (p - 1)), strict=True)) for _ in range(p)]
    out = []
    for stage in range(p):
        if schedule == "1F1B" and loss_inside:
            counts = (m, 0 if stage == p - 1 else m, m, 4 * (p - 1))
        elif schedule == "1F1B" or remat:
            counts = (m, m, m, 2 * (p - 1))
        else:
            counts = (m, 0, m, 2 * (p - 1))
        out.append(dict(zip(TICK_KINDS, counts, strict=True)))
    return out


def taken_branches(
    schedule: str,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    *,
    loss_inside: bool = True,
    num_virtual: int = 1,
) -> Callable[[Any], tuple[int, ...]]:
    """``taken(conditional)``: how often ``stage`` takes each branch of a pipelined step's
    conditionals, for :func:`jfleet.testing.hlo.executed_flops`.

    The conditionals these schedules compile to: a bubble-skipping ``lax.cond`` in a loop
    of ``n`` ticks, ``(skip, work)``, whose work runs ``M`` times (not on 1F1B's last stage
    with the loss inside, which runs its forwards in the switch); 1F1B's three-way switch
    ``(skip, backward, last stage's forward + loss + backward)``; the head's cond (weight
    1), taken on the last stage only. With ``num_virtual = v`` (the stand-in's VPP) the
    work runs ``v M`` times, a chunk each.

    Example:
      >>> from types import SimpleNamespace as C
      >>> taken = taken_branches("1F1B", 3, 4, 8)
      >>> taken(C(weight=14, branch_flops=(0, 5, 9))), taken(C(weight=14, branch_flops=(0, 5)))
      ((6, 0, 8), (14, 0))
    """
    m, last = num_microbatches * num_virtual, stage == num_stages - 1

    def taken(c: Any) -> tuple[int, ...]:
        n, branches = c.weight, len(c.branch_flops)
        if branches == 3:
            return (n - m, 0, m) if last else (n - m, m, 0)
        if n == 1:
            return (0, 1) if last else (1, 0)
        if schedule == "1F1B" and loss_inside and last:
            return (n, 0)
        return (n - m, m)

    return taken


def _check_schedule(schedule: Any) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not a pipeline schedule; use one of {list(SCHEDULES)}."
        )

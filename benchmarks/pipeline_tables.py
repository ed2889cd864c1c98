"""Interleaved (VPP) and zero-bubble (ZB-H1) pipelines against 1F1B, from compiled programs.

Run from the repository root (8 emulated CPU devices; about a minute on 2 cores)::

    python benchmarks/pipeline_tables.py   # prints the table, writes it to RESULTS.md

It compiles (never runs) one training step, ``jax.jit(jax.value_and_grad(loss))`` with
respect to the stage weights, the head and the inputs, on a ``pp 4 x dp 2`` mesh, for a
stack of ``8`` tanh layers of ``D x D`` (``8 / (P v)`` per chunk) and a ``D x D``
squared-error head, a fixed micro-batch size and ``M`` in (4, 8, 16), and reports per
device:

* ``ticks`` and ``bubble``: the schedule table's (:mod:`jfleet.parallel.pipeline_table`,
  unit-cost ticks, ``B`` = two) or, for ``1F1B (scan)``, the lockstep 1F1B of
  :func:`jfleet.parallel.pipeline_schedule.pipeline_loss` (``schedule_stats``);
* ``exec / ideal``: executed dot FLOPs of the slowest device (each ``lax.switch``
  weighted by the branches the table takes there, :func:`jfleet.testing.hlo.
  executed_flops`) over the table's own ideal (its ops, recompute included, and the head);
* ``exec / work``: the same over the work without recompute (forward + backward, 3
  chunk forwards per chunk and micro-batch, and the head);
* ``temp MiB``: ``memory_analysis().temp_size_in_bytes``;
* ``permutes``: collective-permutes per step counted in the HLO (loop-weighted) and the
  table's ``2T``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)

# isort: split
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.results_file import write_section
from jfleet.parallel import pipeline_table as tables
from jfleet.parallel.pipeline_executor import table_pipeline_loss
from jfleet.parallel.pipeline_schedule import pipeline_loss, schedule_stats
from jfleet.testing import hlo

MiB = 2**20
P, DP, LAYERS, D, MB = 4, 2, 8, 64, 8


def stage_fn(w, x, side, shared):
    def layer(h, k):
        return jnp.tanh(h @ k), None

    return jax.lax.scan(layer, x, w)[0]


def head_fn(h, y, t):
    return jnp.mean((y @ h - t) ** 2)


def compiled(schedule: str, m: int, v: int) -> tuple[str, int]:
    mesh = jax.make_mesh((DP, P), ("dp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    per_chunk = LAYERS // (P * v)
    shape = (P, v, per_chunk, D, D) if schedule != "1F1B (scan)" else (P, per_chunk, D, D)
    w = jax.ShapeDtypeStruct(shape, jnp.float32)
    h = jax.ShapeDtypeStruct((D, D), jnp.float32)
    x = jax.ShapeDtypeStruct((DP * m * MB, D), jnp.float32)
    t = jnp.zeros((DP * m * MB, D))

    def loss(w, h, x):
        if schedule == "1F1B (scan)":
            return pipeline_loss(
                stage_fn, head_fn, w, h, x, t, mesh=mesh, schedule="1F1B", num_microbatches=m
            )
        return table_pipeline_loss(
            stage_fn, head_fn, w, h, x, t, mesh=mesh, schedule=schedule, num_microbatches=m,
            num_virtual=v,
        )  # fmt: skip

    c = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(w, h, x).compile()
    return c.as_text(), c.memory_analysis().temp_size_in_bytes


def row(schedule: str, m: int, v: int) -> str:
    text, temp = compiled(schedule, m, v)
    permutes = hlo.summarize(text)["collective-permute"].count
    if schedule == "1F1B (scan)":
        stats = schedule_stats("1F1B", P, m)
        bubble = f"{stats['bubble_fraction']:.3f}"
        return (
            f"| {schedule} | {m} | 1 | {stats['ticks']} | {bubble} | - | - | {temp / MiB:.2f} | "
            f"{permutes} / {stats['collective_permutes']} |"
        )
    table = tables.schedule_table(schedule, P, m, v)
    stats = tables.schedule_stats(table)
    branch = tables.slot_plan(table)["branch"]
    forward = 2 * MB * D * D * (LAYERS // (P * v))  # one chunk, one micro-batch
    head = 3 * 2 * MB * D * D
    ratios, works = [], []
    for device in range(P):
        counts = np.bincount(branch[:, device], minlength=6)
        got = hlo.executed_flops(text, lambda c, counts=counts: counts)
        heads = head * m if device == P - 1 else 0
        ratios.append(got / (stats["work_per_stage"][device] * forward + heads))
        works.append(got / (3 * v * m * forward + heads))
    slowest = int(np.argmax(works))
    return (
        f"| {schedule} | {m} | {v} | {stats['ticks']} | {stats['bubble_fraction']:.3f} | "
        f"{ratios[slowest]:.3f} | {works[slowest]:.3f} | {temp / MiB:.2f} | "
        f"{permutes} / {stats['collective_permutes']} |"
    )


def main() -> None:
    lines = [
        "<!-- pipeline_tables: begin -->",
        "# Interleaved (VPP) and zero-bubble (ZB-H1) pipelines against 1F1B",
        "",
        "- command: `python benchmarks/pipeline_tables.py`",
        f"- pp {P} x dp {DP}, {LAYERS} tanh layers of {D} x {D}, micro-batch {MB} rows, "
        "8 emulated CPU devices; columns as in the module docstring",
        "",
        "| schedule | M | v | ticks | bubble | exec / ideal | exec / work | temp MiB | permutes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines[4:]))
    for m in (4, 8, 16):
        for schedule, v in (("1F1B (scan)", 1), ("1F1B", 1), ("VPP", 2), ("ZBH1", 1)):
            lines.append(row(schedule, m, v))
            print(lines[-1], flush=True)
    lines += [
        "",
        "Reading: the tables' bubble is idle slots over all slots with unit-cost ticks (B = "
        "BI + W, two); VPP's equals (P-1)/(vM+P-1). ZB-H1's W pass recomputes the chunk "
        "and its cotangent chain, so it executes more work than 1F1B (exec / work) for a "
        "third of its bubble ticks.",
        "<!-- pipeline_tables: end -->",
    ]
    print(f"written to {write_section('pipeline_tables', chr(10).join(lines))}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Pipeline activation memory and collectives: FThenB (GPipe) against 1F1B.

Run from the repository root (8 emulated CPU devices; about a minute on 2 cores)::

    python benchmarks/pipeline_memory.py          # prints the table, writes the results

It compiles (never runs) one training step, ``jax.jit(jax.value_and_grad(loss))`` of
:func:`jfleet.parallel.pipeline_schedule.pipeline_loss` with respect to the stage weights,
the head and the inputs, on a ``pp 4 x dp 2`` mesh, for a stack of tanh-MLP stages
(``layers`` layers of ``D x D`` per stage) and a softmax cross-entropy head, with a fixed
micro-batch size and ``M`` in (4, 8, 16) micro-batches, and reports per device:

* ``memory_analysis().temp_size_in_bytes`` of FThenB without recompute, FThenB with
  ``remat=True`` and 1F1B, and the ratios of 1F1B to both (on CPU
  ``peak_memory_in_bytes`` is argument + output only and leaves temp out);
* the growth of temp from M=4 to M=16 (what stays constant is weights and gradient
  buffers; what grows is activations);
* the collective-permutes per step counted in the compiled HLO (loop bodies weighted by
  their trip count, :mod:`jfleet.testing.hlo`) beside :func:`schedule_stats`' formula, and the
  all-reduces (the data- and pipeline-parallel gradient reductions, once after the loop).

The results go to a section of ``benchmarks/RESULTS.md`` (replaced on each run) when that
file exists, else to ``benchmarks/PIPELINE_RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)

# isort: split
import flax
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType

from benchmarks.results_file import write_section
from jfleet.parallel.pipeline_schedule import pipeline_loss, schedule_stats
from jfleet.testing import hlo

MiB = 2**20
HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- pipeline_memory: begin -->", "<!-- pipeline_memory: end -->"
CLASSES = 8


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmark setting (sizes per data-parallel replica)."""

    stages: int = 4
    dp: int = 2
    width: int = 256
    layers: int = 4
    micro_batch: int = 64
    microbatches: tuple[int, ...] = (4, 8, 16)


@dataclasses.dataclass(frozen=True)
class Row:
    """Measurements of one (micro-batch size, M)."""

    micro_batch: int
    m: int
    temp_fthenb: int
    temp_remat: int
    temp_1f1b: int
    permutes_fthenb: int
    permutes_1f1b: int
    all_reduces: tuple[int, int]


def _stage(w, x, side, shared):
    return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0]


def _head(h, y, t):
    return optax.softmax_cross_entropy_with_integer_labels(y @ h, t).mean()


def measure(cfg: Config, m: int, schedule: str, remat: bool = False) -> tuple[int, dict]:
    """(temp bytes, collective summary) of one compiled training step."""
    mesh = jax.make_mesh(
        (cfg.dp, cfg.stages),
        ("dp", "pp"),
        axis_types=(AxisType.Auto,) * 2,
        devices=jax.devices()[: cfg.dp * cfg.stages],
    )
    rows = m * cfg.micro_batch * cfg.dp
    args = (
        jax.ShapeDtypeStruct((cfg.stages, cfg.layers, cfg.width, cfg.width), jnp.float32),
        jax.ShapeDtypeStruct((cfg.width, CLASSES), jnp.float32),
        jax.ShapeDtypeStruct((rows, cfg.width), jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
    )

    def loss(w, h, x, t):
        return pipeline_loss(
            _stage, _head, w, h, x, t, mesh=mesh, schedule=schedule, num_microbatches=m,
            remat=remat,
        )  # fmt: skip

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes, hlo.summarize(compiled.as_text())


def run(cfg: Config) -> list[Row]:
    """One :class:`Row` per M."""
    out = []
    for m in cfg.microbatches:
        temp_f, sum_f = measure(cfg, m, "FThenB")
        temp_r, _ = measure(cfg, m, "FThenB", remat=True)
        temp_1, sum_1 = measure(cfg, m, "1F1B")
        out.append(
            Row(
                micro_batch=cfg.micro_batch,
                m=m,
                temp_fthenb=temp_f,
                temp_remat=temp_r,
                temp_1f1b=temp_1,
                permutes_fthenb=sum_f["collective-permute"].count,
                permutes_1f1b=sum_1["collective-permute"].count,
                all_reduces=(sum_f["all-reduce"].count, sum_1["all-reduce"].count),
            )
        )
        print(f"  micro-batch {cfg.micro_batch}, M={m}: done", flush=True)
    return out


def table(cfg: Config, rows: list[Row]) -> str:
    """The Markdown table of the rows (one config), with a growth line."""
    head = (
        "| micro-batch | M | FThenB temp | FThenB remat temp | 1F1B temp | 1F1B / FThenB "
        "| 1F1B / FThenB remat | collective-permutes FThenB (formula) "
        "| collective-permutes 1F1B (formula) | all-reduces FThenB / 1F1B |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        f_formula = schedule_stats("FThenB", cfg.stages, r.m)["collective_permutes"]
        o_formula = schedule_stats("1F1B", cfg.stages, r.m)["collective_permutes"]
        lines.append(
            f"| {r.micro_batch} | {r.m} | {r.temp_fthenb / MiB:.3f} | {r.temp_remat / MiB:.3f} "
            f"| {r.temp_1f1b / MiB:.3f} | {r.temp_1f1b / r.temp_fthenb:.3f} "
            f"| {r.temp_1f1b / r.temp_remat:.3f} | {r.permutes_fthenb} ({f_formula}) "
            f"| {r.permutes_1f1b} ({o_formula}) | {r.all_reduces[0]} / {r.all_reduces[1]} |"
        )
    first, last = rows[0], rows[-1]
    grow = {
        "FThenB": last.temp_fthenb - first.temp_fthenb,
        "remat": last.temp_remat - first.temp_remat,
        "1F1B": last.temp_1f1b - first.temp_1f1b,
    }
    ratio = grow["1F1B"] / grow["FThenB"] if grow["FThenB"] else float("nan")
    lines.append(
        f"| {first.micro_batch} | growth {first.m} -> {last.m} | {grow['FThenB'] / MiB:.3f} "
        f"| {grow['remat'] / MiB:.3f} | {grow['1F1B'] / MiB:.3f} | {ratio:.3f} (growth) "
        "| | | | |"
    )
    return head + "\n".join(lines) + "\n"


def report(cfg: Config, micro_batches: tuple[int, ...], tables: list[str]) -> str:
    """The results section: header lines, the tables and how to read them."""
    params = cfg.layers * cfg.width * cfg.width * 4 / MiB
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"{BEGIN}\n"
        "# Pipeline schedules: activation memory and collectives\n\n"
        "- command: `python benchmarks/pipeline_memory.py`\n"
        f"- date: {date}\n"
        f"- versions: jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, "
        f"Python {platform.python_version()}\n"
        f"- machine: {platform.machine()}, nproc {os.cpu_count()}, {jax.device_count()} "
        "emulated CPU devices\n"
        f"- model: {cfg.stages} stages (pp {cfg.stages} x dp {cfg.dp}), {cfg.layers} tanh layers "
        f"of {cfg.width} x {cfg.width} per stage ({params:.3f} MiB of fp32 weights per stage), "
        f"softmax cross-entropy head; micro-batch sizes {list(micro_batches)} per data-parallel "
        "replica; step = `jax.jit(jax.value_and_grad(loss))` w.r.t. stage weights, head and "
        "inputs, compiled, not run\n"
        "- MiB per device, `memory_analysis().temp_size_in_bytes`. FThenB keeps every "
        "micro-batch's activations (remat: only every stage input); 1F1B keeps a ring of "
        f"2(P-1) = {2 * (cfg.stages - 1)} stage inputs and recomputes the stage in its "
        "backward.\n\n"
        + "\n".join(tables)
        + "\nReading: 1F1B's temp is flat in M (two parameter-sized gradient buffers, the stash "
        "ring and one micro-batch's recompute); FThenB's grows linearly with M. Collective-"
        "permutes are counted in the compiled HLO, loop bodies weighted by their trip count: "
        "FThenB 2(M+P-1), 1F1B 2(M+2P-2) (one activation and one cotangent permute per tick of "
        "M+2(P-1) ticks). The all-reduces (gradients over dp, head and input gradients over pp, "
        "the loss) do not grow with M: they run once, after the loop.\n"
        f"{END}\n"
    )


def write(section: str, results: Path | None = None) -> Path:
    """Replaces (or appends) this benchmark's section of RESULTS.md."""
    return write_section("pipeline_memory", section, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    cfg = Config()
    tables = []
    for mb in args.micro_batches:
        c = dataclasses.replace(cfg, micro_batch=mb)
        tables.append(table(c, run(c)))
    section = report(cfg, tuple(args.micro_batches), tables)
    print(section)
    if not args.no_write:
        print(f"written to {write(section)}")


if __name__ == "__main__":
    main()

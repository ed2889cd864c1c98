"""Pipeline schedules: executed work per device against the schedule's ideal and dp8.

Run from the repository root (8 emulated CPU devices; a few minutes on 2 cores)::

    python benchmarks/pipeline_schedules.py          # prints the table, writes the results

A Llama-style model (:class:`jfleet.models.llama.TinyLlama`, width 128, 4 blocks, vocab
256, batch 16 x 64 tokens) on dp2 x pp4 and dp2 x pp2 x mp2, M = 2, 4, 8 micro-batches.
Each row compiles (never runs) one training step and reports per device:

* ``executed``: the dot FLOPs the slowest stage executes (:func:`jfleet.testing.hlo.
  executed_flops`: dots outside conditionals plus each conditional's branches weighted by
  how often the stage takes them, :func:`~jfleet.parallel.schedule_ticks.taken_branches`);
* ``/ ideal``: executed over the schedule's own ideal, the dp8 step's dot FLOPs plus one
  forward of the blocks per device where the schedule recomputes (no bubble work, every
  layer split over the 8 devices);
* ``/ dp8``: executed over the dp8 step of the same model and batch (the ideal for any
  layout of 8 devices without recompute);
* ``bubble``: a stage's bubble ticks (skipped by ``lax.cond``), from
  :func:`~jfleet.parallel.schedule_ticks.stage_ticks`;
* ``temp``: ``memory_analysis().temp_size_in_bytes`` of the compiled step;
* ``permutes``: collective-permutes per step in the HLO (loop bodies by trip count).

Entry points: ``stand-in`` is what ``to_distributed`` runs
(:class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks`, the loss in the model's own code;
``make_train_step(lm_loss).lower(...)`` of the returned model); ``pipeline_loss`` runs the
same blocks with the final norm, head and loss inside the pipeline (what ``PipelineLayer``
runs). The table is built from :data:`ROW_PRODUCERS`, one function per entry point:
add a producer for another schedule (interleaved, zero-bubble) and its rows join the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)

# isort: split
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from benchmarks.results_file import write_section
from jfleet import make_train_step
from jfleet.auto_parallel import ToDistributedConfig, to_distributed
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.parallel import pipeline_table as tables
from jfleet.parallel import stack
from jfleet.parallel.pipeline_executor import table_pipeline_loss
from jfleet.parallel.pipeline_schedule import pipeline_loss
from jfleet.parallel.schedule_ticks import stage_ticks, taken_branches
from jfleet.parallel.virtual_stages import TABLE_RUN, chunked
from jfleet.testing import hlo

SECTION = "pipeline_schedules"
MiB = 2**20
LAYOUTS = ({"dp": 2, "pp": 4}, {"dp": 2, "pp": 2, "mp": 2})
MICROBATCHES = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Setting:
    """The model and batch every row shares."""

    width: int = 128
    blocks: int = 4
    vocab: int = 256
    batch: int = 16
    seq: int = 64

    def model(self, layers: int | None = None) -> TinyLlama:
        blocks = self.blocks if layers is None else layers
        return TinyLlama(vocab=self.vocab, width=self.width, heads=4, kv_heads=2, layers=blocks)

    def batches(self) -> list:
        return lm_batches(1, batch=self.batch, seq=self.seq, vocab=self.vocab)


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled step."""

    entry: str
    schedule: str
    layout: str
    m: int
    executed: float
    ideal: float
    dp8: float
    bubble: int
    temp: int
    permutes: int

    @property
    def vs_ideal(self) -> float:
        return self.executed / self.ideal

    @property
    def vs_dp8(self) -> float:
        return self.executed / self.dp8


@dataclasses.dataclass(frozen=True)
class Reference:
    """Dot FLOPs per device of the dp8 step, and of one forward of the blocks at dp8."""

    step: float
    blocks_forward: float


def layout_name(degrees: dict[str, int]) -> str:
    return " x ".join(f"{a}{n}" for a, n in degrees.items() if n > 1)


def distribute(setting: Setting, degrees: dict, m: int | None, schedule: str | None):
    """``to_distributed`` on this mesh (fleet reset first); the model, optimizer, batch."""
    from jfleet import fleet

    fleet._reset()
    config = ToDistributedConfig(
        force_mesh=degrees, zero_stage=0, recompute=False, num_microbatches=m, schedule=schedule
    )
    model, opt, loader = to_distributed(
        setting.model(), optax.adam(1e-3), setting.batches(), config=config
    )
    return model, opt, next(iter(loader))


def reference(setting: Setting) -> Reference:
    """The dp8 training step's dot FLOPs, and the blocks' share of a dp8 forward."""
    model, opt, batch = distribute(setting, {"dp": 8}, None, None)
    step = hlo.dot_flops(make_train_step(lm_loss).lower(model, opt, batch).compile().as_text())

    def forward(layers: int) -> float:
        m = setting.model(layers)
        graphdef, state = nnx.split(m)
        fn = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
        return hlo.dot_flops(fn.lower(state, batch["tokens"]).compile().as_text())

    return Reference(step, forward(setting.blocks) - forward(0))


def measure(
    text: str, schedule: str, stages: int, m: int, *, loss_inside: bool, v: int = 1
) -> float:
    """Executed dot FLOPs per device: the slowest stage's (``v`` chunks a stage)."""
    return max(
        hlo.executed_flops(
            text, taken_branches(schedule, s, stages, m, loss_inside=loss_inside, num_virtual=v)
        )
        for s in range(stages)
    )


def row(entry, schedule, degrees, m, compiled, ref, *, loss_inside, v=1) -> Row:
    """One table row; ``schedule`` ``"VPP"`` is the stand-in's 1F1B over ``v`` chunks."""
    text = compiled.as_text()
    stages = degrees["pp"]
    counted = "1F1B" if schedule == "VPP" else schedule
    ticks = max(
        stage_ticks(counted, stages, m, loss_inside=loss_inside, num_virtual=v),
        key=lambda t: t["recompute"],
    )
    return Row(
        entry=entry,
        schedule=schedule if v == 1 else f"{schedule} v={v}",
        layout=layout_name(degrees),
        m=m,
        executed=measure(text, counted, stages, m, loss_inside=loss_inside, v=v),
        ideal=ref.step + (ref.blocks_forward if ticks["recompute"] else 0.0),
        dp8=ref.step,
        bubble=ticks["bubble"],
        temp=compiled.memory_analysis().temp_size_in_bytes,
        permutes=hlo.summarize(text)["collective-permute"].count,
    )


def stand_in_rows(setting: Setting, degrees: dict, m: int, ref: Reference) -> list[Row]:
    """``to_distributed``'s stand-in: FThenB (GPipe), 1F1B, and VPP (2 interleaved chunks a
    stage) where ``pp x 2`` divides the blocks and ``pp`` divides ``M``."""
    out = []
    pp = degrees["pp"]
    interleaves = setting.blocks % (2 * pp) == 0 and m % pp == 0
    for schedule in ("FThenB", "1F1B", *(("VPP",) if interleaves else ())):
        model, opt, batch = distribute(setting, degrees, m, schedule)
        compiled = make_train_step(lm_loss).lower(model, opt, batch).compile()
        v = 2 if schedule == "VPP" else 1
        out.append(row("stand-in", schedule, degrees, m, compiled, ref, loss_inside=False, v=v))
    return out


def head_loss(scale: jax.Array, lm_head: jax.Array, y: jax.Array, labels: jax.Array) -> jax.Array:
    """TinyLlama's final RMSNorm, head and ``lm_loss`` on one micro-batch."""
    y = y.astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6) * scale
    logits = y @ lm_head
    picked = jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * jax.nn.log_softmax(logits), -1)
    return -jnp.mean(picked)


def compiled_inside(model, batch, m: int, schedule: str, v: int = 1) -> Any:
    """The compiled gradient step of the model's blocks with norm, head and loss inside the
    pipeline: :func:`pipeline_loss`, or with ``schedule`` ``"VPP"`` / ``"ZBH1"`` the table
    executor (``v`` chunks per stage; the blocks run in stacked order, which changes no
    work)."""
    mesh = model.layers.mesh
    body_def, body = nnx.split(model.layers.body)
    embed_def, embed = nnx.split(model.embed_tokens)
    norm = model.norm.scale[...]
    tokens, labels = batch["tokens"], batch["labels"]

    def loss(body, embed, norm, lm_head):
        x = nnx.merge(embed_def, embed)(tokens)
        inputs, carried, side, shared = stack.stage_inputs(x)
        stage_fn = stack.stage_function(body_def, inputs)
        stage_fn, params, carried_in = stack.widened_stage(
            stage_fn, nnx.to_pure_dict(body), carried, mesh=mesh
        )

        def head_fn(h, y, t):
            return head_loss(h[0], h[1], y[0], t)

        run, extra = pipeline_loss, {}
        if schedule in TABLE_RUN:
            run, extra = table_pipeline_loss, {"num_virtual": v}
            params = chunked(params, v)
        return run(
            stage_fn, head_fn, params, (norm, lm_head), carried_in, labels, side, shared,
            mesh=mesh, schedule=schedule, num_microbatches=m, **extra,
        )  # fmt: skip

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    return grad.lower(body, embed, norm, model.lm_head[...]).compile()


def pipeline_loss_rows(setting: Setting, degrees: dict, m: int, ref: Reference) -> list[Row]:
    """The same blocks with norm, head and loss inside the pipeline (``pipeline_loss``)."""
    model, _, batch = distribute(setting, degrees, m, "FThenB")
    out = []
    for schedule in ("FThenB", "1F1B"):
        compiled = compiled_inside(model, batch, m, schedule)
        out.append(row("pipeline_loss", schedule, degrees, m, compiled, ref, loss_inside=True))
    return out


def table_rows(setting: Setting, degrees: dict, m: int, ref: Reference) -> list[Row]:
    """Interleaved VPP (v = 2, where the blocks split into ``2P`` chunks and ``P`` divides
    ``M``) and ZB-H1, the table executor (:mod:`jfleet.parallel.pipeline_executor`) with
    the loss inside. Ideal: the dp8 step plus the blocks' forwards the table adds per
    chunk and micro-batch over a plain forward + backward (3): VPP 1 (its recompute),
    ZB-H1 3 (``BI`` and ``W`` each recompute, ``W`` also runs the cotangent chain);
    bubble: the table's idle ticks per stage (unit ticks, ``B`` two)."""
    p = degrees["pp"]
    runs = [("ZBH1", 1)]
    if setting.blocks % (2 * p) == 0 and m % p == 0:
        runs.insert(0, ("VPP", 2))
    model, _, batch = distribute(setting, degrees, m, "FThenB")
    out = []
    for schedule, v in runs:
        compiled = compiled_inside(model, batch, m, schedule, v)
        table = tables.schedule_table(schedule, p, m, v)
        stats = tables.schedule_stats(table)
        text = compiled.as_text()
        extra = max(stats["work_per_stage"]) / (v * m) - 3
        executed = max(hlo.executed_flops(text, tables.taken_branches(table, s)) for s in range(p))
        name = f"{schedule} v={v}" if v > 1 else schedule
        out.append(
            Row("pipeline_loss", name, layout_name(degrees), m, executed,
                ref.step + extra * ref.blocks_forward, ref.step, stats["bubble_ticks"],
                compiled.memory_analysis().temp_size_in_bytes,
                hlo.summarize(text)["collective-permute"].count)
        )  # fmt: skip
    return out


#: One function per entry point / schedule family: ``(setting, degrees, M, reference)``
#: to rows. Add producers (interleaved, zero-bubble) here.
ROW_PRODUCERS: list[Callable[[Setting, dict, int, Reference], list[Row]]] = [
    stand_in_rows,
    pipeline_loss_rows,
    table_rows,
]


def collect(setting: Setting) -> list[Row]:
    ref = reference(setting)
    rows = []
    for degrees in LAYOUTS:
        for m in MICROBATCHES:
            for produce in ROW_PRODUCERS:
                got = produce(setting, degrees, m, ref)
                for r in got:
                    print(
                        f"{r.entry} {r.schedule} {r.layout} M={r.m}: {r.vs_dp8:.2f}x dp8",
                        file=sys.stderr,
                    )
                rows += got
    return rows


def render(rows: list[Row], setting: Setting, command: str) -> str:
    """The results section: one table row per compiled step, then what it shows."""
    lines = [
        "## Pipeline schedules: executed work per device",
        "",
        f"TinyLlama width {setting.width}, {setting.blocks} blocks, vocab {setting.vocab}, "
        f"batch {setting.batch} x {setting.seq} tokens, 8 emulated CPU devices, jax "
        f"{jax.__version__}; `{command}`. Executed dot FLOPs of the slowest stage, from the "
        "compiled HLO with each conditional's branches weighted by the ticks the schedule "
        "takes them (`hlo.executed_flops`); ideal = the dp8 step + one forward of the blocks "
        "where the schedule recomputes. Bubble ticks are skipped by `lax.cond`.",
        "",
        "| entry | schedule | layout | M | executed GFLOP | / ideal | / dp8 | bubble ticks "
        "| temp MiB | permutes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.entry} | {r.schedule} | {r.layout} | {r.m} | {r.executed / 1e9:.3f} "
            f"| {r.vs_ideal:.2f} | {r.vs_dp8:.2f} | {r.bubble} "
            f"| {r.temp / MiB:.1f} | {r.permutes} |"
        )
    lines += ["", *findings(rows)]
    return "\n".join(lines) + "\n"


def findings(rows: list[Row]) -> list[str]:
    """The issue's target: the stand-in at dp2 x pp4, M=4, against pipeline_loss's 1F1B."""
    pick = {(r.entry, r.schedule, r.layout, r.m): r for r in rows}
    out = []
    one = pick.get(("stand-in", "1F1B", "dp2 x pp4", 4))
    gpipe = pick.get(("stand-in", "FThenB", "dp2 x pp4", 4))
    inside = pick.get(("pipeline_loss", "1F1B", "dp2 x pp4", 4))
    if one and gpipe and inside:
        out.append(
            f"- Stand-in at dp2 x pp4, M=4: 1F1B executes {one.vs_dp8:.2f}x the dp8 step "
            f"({one.vs_ideal:.2f}x its ideal, with its recompute) against FThenB's "
            f"{gpipe.vs_dp8:.2f}x (no recompute); pipeline_loss 1F1B (PipelineLayer's "
            f"schedule) {inside.vs_dp8:.2f}x. Temp memory: 1F1B {one.temp / MiB:.1f} MiB, "
            f"FThenB {gpipe.temp / MiB:.1f} MiB."
        )
    vpp = pick.get(("stand-in", "VPP v=2", "dp2 x pp2 x mp2", 4))
    one_f = pick.get(("stand-in", "1F1B", "dp2 x pp2 x mp2", 4))
    if vpp and one_f:
        out.append(
            f"- Stand-in VPP (2 chunks a stage) at dp2 x pp2 x mp2, M=4: {vpp.vs_ideal:.2f}x "
            f"its ideal (1F1B's work) against 1F1B's {one_f.vs_ideal:.2f}x; bubble "
            f"{vpp.bubble} of 2 x (2 x 4 + 1) chunk ticks ({vpp.bubble / 18:.3f} = (P - 1) / "
            f"(vM + P - 1)) against 1F1B's {one_f.bubble} of 2 x (4 + 1) stage ticks "
            f"({one_f.bubble / 10:.3f}); {vpp.permutes} collective-permutes against "
            f"{one_f.permutes}; temp "
            f"{vpp.temp / MiB:.1f} MiB against {one_f.temp / MiB:.1f} MiB."
        )
    worst = max(rows, key=lambda r: r.vs_ideal, default=None)
    if worst:
        out.append(
            f"- Every step executes at most {worst.vs_ideal:.2f}x its schedule's "
            f"ideal (the most: {worst.entry} {worst.schedule} {worst.layout} M={worst.m}); "
            "pipeline_loss's excess is its head, run on the last stage for the replica's rows."
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if jax.device_count() < 8:
        print(f"need 8 devices, have {jax.device_count()}", file=sys.stderr)
        return 1
    setting = Setting()
    rows = collect(setting)
    section = render(rows, setting, "python benchmarks/pipeline_schedules.py")
    print(section)
    if not args.no_write:
        print(f"written to {write_section(SECTION, section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The auto-parallel cost model against the compiler: memory, collective bytes and FLOPs.

Run from the repository root (8 emulated CPU devices; several minutes on 2 cores)::

    python benchmarks/cost_model_check.py              # prints the tables, writes RESULTS.md
    python benchmarks/cost_model_check.py --no-write   # print only

Two subjects are checked, through one code path (:class:`Subject`: a fresh model, one
batch, the loss and the ``forward`` hook):

* each layout of :data:`LAYOUTS` on the Llama-style :class:`jfleet.models.llama.TinyLlama`
  (vocab 512, width 128, 8 heads, 4 kv heads, SwiGLU hidden 256, 4 layers; batch 16 x 64
  tokens; fp32 Adam);
* every style of :data:`jfleet.testing.nnx_styles.STYLES` (tiny decoder LMs written in
  public Flax NNX styles; batch :data:`STYLE_BATCH` x :data:`STYLE_SEQ` tokens, so batch
  and sequence differ) under :data:`STYLE_LAYOUTS`: dp2 x mp4, dp2 x sharding2 x mp2
  ZeRO-3 and, for styles with ``pipelines``, dp2 x pp2 x mp2 FThenB M=2.

For each it runs what a user runs: :func:`jfleet.auto_parallel.to_distributed` with that
mesh forced (``ToDistributedConfig(force_mesh=..., zero_stage=..., recompute=False,
num_microbatches=..., forward=...)``: it plans with the cost model, calls ``fleet.init``,
places the parameters and the Adam state, and with ``pp > 1`` replaces the decoder blocks
by the FThenB pipelined stand-in), then lowers the one training engine's step,
``jfleet.make_train_step(loss).lower(model, opt, batch)``, and compiles it (not run). It
compares, per device,

* the predicted memory of the plan applied (``get_plan(model).chosen.memory.total``) with
  the compiled step's ``memory_analysis()``: ``argument + output - alias + temp``
  (outputs alias the donated arguments, so this is the step's peak; on CPU
  ``peak_memory_in_bytes`` leaves temp out);
* the predicted collective bytes (``chosen.collectives.total``) with the bytes
  :func:`jfleet.testing.hlo.summarize` counts in the compiled HLO (all kinds; loop bodies
  weighted by trip count; XLA:CPU's all-reduce + slice in place of a reduce-scatter has
  the same bytes in that accounting);
* the predicted dot FLOPs of one step as executed (``chosen.flops``) with
  :func:`executed_flops` of the compiled HLO (while bodies weighted by their trip counts,
  ``cost_analysis()`` counts a loop body once; a pipeline's bubble-skipping conditionals
  weighted by the ticks its slowest stage takes each branch).

The tolerances (:data:`TOLERANCES`: memory ±25%, collective bytes ±15%, FLOPs ±10%) are
the ones ``tests/auto_parallel/test_cost_model.py`` holds the model to; the tables mark
the ratios outside them, and nothing here loosens them.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)

# isort: split
import jax
import optax
from flax import nnx

from benchmarks.results_file import environment, write_section
from jfleet import make_train_step
from jfleet.auto_parallel import (
    Plan,
    ToDistributedConfig,
    estimate,
    get_plan,
    get_profile,
    match_patterns,
    to_distributed,
)
from jfleet.auto_parallel import Workload as PlanWorkload
from jfleet.fleet import DistributedStrategy
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.parallel.schedule_ticks import taken_branches
from jfleet.testing import hlo
from jfleet.testing.nnx_styles import STYLES, Style
from jfleet.training.distributed_model import apply_strategy_amp

MiB = 2**20
KiB = 2**10
SECTION = "cost_model_check"
#: XLA:CPU options that skip LLVM's expensive optimisations (same HLO, faster compile).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class Workload:
    """The model and batch every layout is checked with."""

    vocab: int = 512
    width: int = 128
    heads: int = 8
    kv_heads: int = 4
    hidden: int = 256
    layers: int = 4
    batch: int = 16
    seq: int = 64

    def model(self) -> TinyLlama:
        """A fresh model (``to_distributed`` places and changes it in place)."""
        return TinyLlama(
            self.vocab, self.width, self.heads, self.kv_heads, self.layers, self.hidden
        )

    def batch_data(self) -> dict:
        """One batch of token ids as NumPy arrays."""
        return lm_batches(1, batch=self.batch, seq=self.seq, vocab=self.vocab)[0]

    def describe(self) -> str:
        """One line for the report."""
        return (
            f"`TinyLlama(vocab={self.vocab}, width={self.width}, heads={self.heads}, "
            f"kv_heads={self.kv_heads}, layers={self.layers}, hidden={self.hidden})`, batch "
            f"{self.batch} x {self.seq} tokens, fp32, `optax.adam`"
        )


#: ``(mesh degrees, ZeRO stage, pipeline micro-batches)`` of the layouts checked
#: (micro-batches None without a pipeline; pipelines are FThenB, to_distributed's).
LAYOUTS: tuple[tuple[dict[str, int], int, int | None], ...] = (
    ({"dp": 8}, 0, None),
    ({"dp": 2, "mp": 4}, 0, None),
    ({"dp": 4, "mp": 2}, 0, None),
    ({"sharding": 8}, 1, None),
    ({"dp": 2, "sharding": 4}, 2, None),
    ({"sharding": 4, "mp": 2}, 3, None),
    ({"dp": 2, "sharding": 2, "mp": 2}, 1, None),
    ({"sharding": 8}, 3, None),
    ({"dp": 2, "pp": 2, "mp": 2}, 0, 2),
    ({"dp": 4, "pp": 2}, 0, 4),
    ({"dp": 2, "pp": 4}, 0, 2),
    ({"pp": 2, "sharding": 2, "mp": 2}, 3, 2),
    ({"dp": 2, "pp": 2, "sharding": 2}, 1, 2),
)

#: ``(mesh degrees, ZeRO stage, micro-batches, schedule, recompute)`` checked beside
#: :data:`LAYOUTS`: the stand-in's 1F1B (stage inputs stashed, the stage recomputed in
#: its backward loop), its VPP (1F1B over 2 interleaved chunks a stage), recompute
#: without a pipeline (scanned blocks at dp8, and at ZeRO-3 where each block gathers its
#: weights in the loop: FSDP), selective recompute (scanned blocks keeping their
#: weight-matmul outputs; pipelined stages stashing them per micro-batch, FThenB, 1F1B and
#: VPP) and FThenB with full recompute (the stage recomputed from its stashed input).
SCHEDULE_LAYOUTS: tuple[tuple[dict[str, int], int, int | None, str | None, bool | str], ...] = (
    ({"dp": 2, "pp": 2, "mp": 2}, 0, 2, "1F1B", False),
    ({"dp": 4, "pp": 2}, 0, 4, "1F1B", False),
    ({"dp": 2, "pp": 4}, 0, 8, "1F1B", False),
    ({"dp": 2, "pp": 4}, 0, 8, "FThenB", False),
    ({"dp": 2, "pp": 2, "mp": 2}, 0, 2, "VPP", False),
    ({"dp": 4, "pp": 2}, 0, 4, "VPP", False),
    ({"dp": 8}, 0, None, None, True),
    ({"sharding": 8}, 3, None, None, True),
    ({"dp": 8}, 0, None, None, "selective"),
    ({"dp": 2, "mp": 4}, 0, None, None, "selective"),
    ({"dp": 4, "pp": 2}, 0, 4, "FThenB", "selective"),
    ({"dp": 2, "pp": 2, "mp": 2}, 0, 2, "1F1B", "selective"),
    ({"dp": 4, "pp": 2}, 0, 4, "VPP", "selective"),
    ({"dp": 4, "pp": 2}, 0, 4, "FThenB", True),
)

#: Batch and sequence length of the NNX-zoo checks (they differ, so a layout that confused
#: the batch and sequence axes would show).
STYLE_BATCH, STYLE_SEQ = 8, 16

#: The layouts every style of :data:`jfleet.testing.nnx_styles.STYLES` is checked under:
#: tensor parallel, ZeRO-3 with tensor parallel, and (styles with ``pipelines``) a pipeline
#: with tensor parallel.
STYLE_LAYOUTS: tuple[tuple[dict[str, int], int, int | None], ...] = (
    ({"dp": 2, "mp": 4}, 0, None),
    ({"dp": 2, "sharding": 2, "mp": 2}, 3, None),
    ({"dp": 2, "pp": 2, "mp": 2}, 0, 2),
)


def style_layouts(style: Style) -> list[tuple[dict[str, int], int, int | None]]:
    """:data:`STYLE_LAYOUTS` that apply to ``style`` (no pipeline where it cannot pipeline)."""
    return [lay for lay in STYLE_LAYOUTS if style.pipelines or "pp" not in lay[0]]


@dataclasses.dataclass(frozen=True)
class Row:
    """One layout of one subject: predicted and measured memory, collective bytes and dot
    FLOPs (per device)."""

    subject: str
    name: str
    predicted_memory: int
    measured_memory: int
    predicted_bytes: int
    measured_bytes: int
    measured_kinds: dict[str, int]
    predicted_flops: float
    measured_flops: float
    compile_seconds: float
    h100_memory: int | None = None
    #: an AMP O2 row: XLA:CPU runs its bf16 matmuls and collectives in fp32, so the
    #: ``h100`` profile (bf16 on the GPU) is compared on the resident state alone
    half: bool = False
    h100_resident: int | None = None
    measured_argument: int | None = None

    @property
    def h100_ratio(self) -> float:
        """predicted memory under the ``h100`` profile / measured (nan when not estimated)."""
        return self.h100_memory / self.measured_memory if self.h100_memory else float("nan")

    @property
    def memory_ratio(self) -> float:
        """predicted / measured memory."""
        return self.predicted_memory / self.measured_memory

    @property
    def bytes_ratio(self) -> float:
        """predicted / measured collective bytes."""
        return self.predicted_bytes / self.measured_bytes if self.measured_bytes else float("nan")

    @property
    def flops_ratio(self) -> float:
        """predicted / measured dot FLOPs."""
        return self.predicted_flops / self.measured_flops if self.measured_flops else float("nan")


def layout_id(degrees: dict[str, int], stage: int, microbatches: int | None) -> str:
    """A short id (``dp2_pp2_mp2_zero0_m2``) for test parameters and logs."""
    name = "_".join(f"{a}{n}" for a, n in degrees.items()) + f"_zero{stage}"
    return name + (f"_m{microbatches}" if microbatches else "")


@dataclasses.dataclass(frozen=True)
class Subject:
    """What one check trains: a fresh model, one batch, the loss and how the model is called.

    ``forward`` is ``ToDistributedConfig.forward`` (``None``: ``model(batch["tokens"])``).
    """

    name: str
    build: Callable[[], nnx.Module]
    batch: Callable[[], dict]
    loss_fn: Callable[[nnx.Module, dict], jax.Array]
    forward: Callable[[nnx.Module, dict], jax.Array] | None = None


def subject(what: Workload | Style | Subject) -> Subject:
    """The :class:`Subject` of a TinyLlama :class:`Workload` or an NNX-zoo :class:`Style`
    (a style at :data:`STYLE_BATCH` x :data:`STYLE_SEQ` tokens)."""
    if isinstance(what, Subject):
        return what
    if isinstance(what, Workload):
        return Subject("TinyLlama", what.model, what.batch_data, lm_loss)
    return Subject(
        what.name,
        lambda: what.build(nnx.Rngs(0)),
        lambda: what.batches(1, batch=STYLE_BATCH, seq=STYLE_SEQ)[0],
        what.loss_fn,
        what.forward,
    )


def lower_step(
    what: Workload | Style | Subject,
    degrees: dict[str, int],
    stage: int,
    microbatches: int | None = None,
    *,
    schedule: str | None = None,
    recompute: bool | str = False,
    accumulate: int = 1,
    sequence_parallel: bool = False,
    o2: bool = False,
) -> tuple[jax.stages.Lowered, Plan]:
    """``to_distributed`` on this mesh, then the engine's step lowered for one batch.

    Resets fleet first (``to_distributed`` calls ``fleet.init``). Returns the lowered
    step and the :class:`~jfleet.auto_parallel.Plan` that was applied. ``accumulate > 1``
    is ``ToDistributedConfig(accumulate_steps=accumulate)``: the loader yields ``what``'s
    batch in that many calls, the strategy's gradient merge makes one update of them; the
    step is lowered for one call. ``o2``: the strategy's AMP O2 (:func:`o2_strategy`: bf16
    parameters, fp32 masters) with Megatron's distributed optimizer
    (``ToDistributedConfig(distributed_optimizer=True)``).
    """
    from jfleet import fleet

    sub = subject(what)
    fleet._reset()
    config = ToDistributedConfig(
        force_mesh=degrees,
        zero_stage=stage,
        recompute=recompute,
        schedule=schedule if microbatches else None,
        num_microbatches=microbatches,
        forward=sub.forward,
        accumulate_steps=accumulate if accumulate > 1 else None,
        sequence_parallel=sequence_parallel,
        strategy=o2_strategy() if o2 else None,
        distributed_optimizer=True if o2 else None,
    )
    model, opt, loader = to_distributed(sub.build(), optax.adam(1e-3), [sub.batch()], config=config)
    batch = next(iter(loader))
    return make_train_step(sub.loss_fn).lower(model, opt, batch), get_plan(model)


def o2_strategy() -> DistributedStrategy:
    """AMP O2 in bf16 (``amp_configs={"use_pure_bf16": True}``): bf16 parameters, fp32
    master weights and moments."""
    strategy = DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"use_pure_bf16": True}
    return strategy


def compiled_memory(compiled: jax.stages.Compiled) -> int:
    """The compiled step's peak per device: argument + output - alias + temp (outputs alias
    the donated arguments; on CPU ``peak_memory_in_bytes`` leaves temp out)."""
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def check(
    what: Workload | Style | Subject,
    degrees: dict[str, int],
    stage: int,
    microbatches: int | None = None,
    *,
    schedule: str | None = None,
    recompute: bool | str = False,
    compiler_options: dict | None = None,
    sequence_parallel: bool = False,
    o2: bool = False,
) -> Row:
    """Applies, lowers, compiles and compares one layout of a TinyLlama workload or a style.

    ``compiler_options`` go to ``Lowered.compile`` (the tests pass :data:`FAST_COMPILE`:
    LLVM's optimisation level changes neither the HLO nor its buffer assignment, so
    neither the collectives, the dots nor ``memory_analysis``).
    """
    start = time.perf_counter()
    lowered, plan = lower_step(
        what,
        degrees,
        stage,
        microbatches,
        schedule=schedule,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        o2=o2,
    )
    compiled = lowered.compile(compiler_options)
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    measured = compiled_memory(compiled)
    kinds = {k: s.bytes for k, s in hlo.summarize(text).items() if s.count}
    h100 = h100_resident = None
    if isinstance(what, Workload):  # the same layout planned for an H100 (speed differs)
        model = what.model()
        if o2:  # as the run stores it: bf16 parameters (their fp32 masters beside them)
            model = nnx.eval_shape(lambda m: apply_strategy_amp(m, o2_strategy()), model)
        h100 = estimate(
            match_patterns(model),
            PlanWorkload(
                batch_size=what.batch,
                seq_len=what.seq,
                sequence_parallel=sequence_parallel,
                dtype="bfloat16" if o2 else "float32",
            ),
            plan.chosen.layout,
            get_profile("h100"),
            devices_per_node=8,
        ).memory
        h100, h100_resident = h100.total, h100.resident
    return Row(
        subject=subject(what).name,
        name=plan.layout.name,
        predicted_memory=plan.chosen.memory.total,
        measured_memory=measured,
        predicted_bytes=plan.chosen.collectives.total,
        measured_bytes=sum(kinds.values()),
        measured_kinds=kinds,
        predicted_flops=plan.chosen.flops,
        measured_flops=executed_flops(text, plan),
        compile_seconds=seconds,
        h100_memory=h100,
        half=o2,
        h100_resident=h100_resident,
        measured_argument=compiled.memory_analysis().argument_size_in_bytes,
    )


def check_accumulation(
    workload: Workload, degrees: dict[str, int], stage: int, accumulate: int
) -> tuple[float, float]:
    """Gradient accumulation: ``to_distributed`` told ``accumulate_steps=accumulate`` at
    ``workload``'s batch (its plan's ``Layout(accumulate_steps=accumulate)``) against the
    compiled step of one call (``workload.batch / accumulate`` rows, the strategy's
    gradient merge). Returns (memory, collective bytes) ratios, predicted / compiled, per
    call."""
    lowered, plan = lower_step(workload, degrees, stage, accumulate=accumulate)
    assert plan.layout.accumulate_steps == accumulate, plan.layout.name
    compiled = lowered.compile(FAST_COMPILE)
    measured = compiled_memory(compiled)
    measured_bytes = sum(k.bytes for k in hlo.summarize(compiled.as_text()).values() if k.count)
    c = plan.chosen
    return c.memory.total / measured, c.collectives.total / accumulate / measured_bytes


def executed_flops(text: str, plan: Plan) -> float:
    """Dot FLOPs per device one step executes: :func:`jfleet.testing.hlo.dot_flops` without
    a pipeline; with one, the slowest stage's, each conditional's branches weighted by how
    often that stage takes them (the stand-in skips its bubble ticks with ``lax.cond``;
    :func:`jfleet.parallel.schedule_ticks.taken_branches`)."""
    lay = plan.layout
    if lay.pp == 1:
        return hlo.dot_flops(text)
    return max(
        hlo.executed_flops(
            text,
            taken_branches(
                lay.schedule,
                s,
                lay.pp,
                lay.num_microbatches,
                loss_inside=False,
                num_virtual=lay.num_virtual_stages,
            ),
        )
        for s in range(lay.pp)
    )


#: How far predicted / measured may be from 1 (the limits the tests hold the model to).
TOLERANCES = {"memory": 0.25, "collective bytes": 0.15, "FLOPs": 0.10}


def ratios(row: Row) -> dict[str, float]:
    """``row``'s predicted / measured ratios, by the names of :data:`TOLERANCES`."""
    return {
        "memory": row.memory_ratio,
        "collective bytes": row.bytes_ratio,
        "FLOPs": row.flops_ratio,
    }


def outside(row: Row) -> dict[str, float]:
    """The ratios of ``row`` outside :data:`TOLERANCES` (empty when all are within)."""
    return {k: r for k, r in ratios(row).items() if not abs(r - 1.0) <= TOLERANCES[k]}


def _cell(row: Row, what: str) -> str:
    """A ratio, bold where it is outside its tolerance."""
    text = f"{ratios(row)[what]:.3f}"
    return f"**{text}**" if what in outside(row) else text


def _span(rows: list[Row], what: str) -> str:
    values = [ratios(r)[what] for r in rows]
    return f"{what} {min(values):.3f} to {max(values):.3f}"


def _outliers(rows: list[Row]) -> str:
    """One sentence per row outside a tolerance: which ratio, by how much."""
    parts = []
    for r in rows:
        worse = ", ".join(
            f"{k} {v:.3f} ({(v - 1) * 100:+.1f}%, limit ±{TOLERANCES[k] * 100:.0f}%)"
            for k, v in outside(r).items()
        )
        if worse:
            parts.append(f"{r.subject} {r.name}: {worse}")
    return "; ".join(parts) if parts else "none"


def _flops(value: float) -> str:
    return f"{value / 1e6:.3f}"


#: How the TinyLlama table's predictions are made (the formulas' summary).
LLAMA_NOTES = (
    "The formulas are in `jfleet/auto_parallel/cost/cost_model.py`. Memory "
    "is resident state (parameters, Adam moments, batch) plus the larger of two "
    "temporary peaks: all activations (and ZeRO-3's gathered parameters) between forward "
    "and backward, or the whole local gradient with the reduction's output at the end "
    "(scanned blocks at ZeRO-2 / 3: one block gathered at a time and each block's gradient "
    "reduce-scattered in the loop, so the shard and one block's instead; the rows at 4 and "
    "16 blocks of width 256 check that with recompute on and off, and mp + SP with "
    "recompute, each block's saved input split over mp). Under SP the blocks' "
    "projections run Megatron's program (`jfleet/auto_parallel/apply/sequence_dots.py`): "
    "a reduce-scatter where each all-reduce was, and an all-gather of the sequence before "
    "the attention's and the MLP's column projections in every forward pass and of each "
    "row output's cotangent, so the loop moves activations, not weights. "
    "Collective bytes are the tensor-parallel all-reduces (forward after o and down; "
    "backward one per column projection, as XLA reduces q, k and v's input gradients "
    "separately), the vocabulary-parallel embedding and head, the gradient reduction "
    "and ZeRO's parameter all-gather. Where ZeRO runs over the sharding axis alone the "
    "prediction is a little high: XLA reduced the embedding's gradient as an all-to-all "
    "of the token rows instead of an all-reduce of the table. FLOPs are the matmuls of "
    "one step as executed (forward, and the backward's input and weight gradients), each "
    "divided by the axes that split it; a pipeline's stage runs M micro-batches (bubble "
    "ticks skip their work), 1F1B one more forward of them."
)
#: What the pipelined rows run.
PIPELINE_NOTES = (
    "Pipelined layouts run to_distributed's stand-in (`PipelinedBlocks` -> "
    "`jfleet.parallel.pipeline_forward`, a forward and a backward loop of M + P - 1 ticks "
    "inside a `shard_map`, bubble ticks skipped by `lax.cond`). FThenB keeps its M "
    "micro-batches' residuals, 1F1B only their stage inputs and recomputes the stage in "
    "its backward loop; both add one micro-batch's backward working set and the stage's "
    "gradient accumulators. The batch rows split over the data axes x `pp`, so the "
    "embedding and head run on 1 / P of them and the stack all-gathers its input and "
    "reduce-scatters its output over `pp` (and the reverse for the cotangents); the "
    "blocks' gradients leave the `shard_map` summed over `dp x sharding` (one "
    "all-reduce, not ZeRO's two-step reduction). The tensor-parallel all-reduces sit in "
    "the loops' bodies, counted on every tick. With `mp` inside the stages (Megatron's "
    "scatter / gather) the stashed stage inputs, the sends between stages, the stack's "
    "buffers and its gather / scatter over `pp` are split over `mp`, and all-gathered over "
    "`mp` where a stage or the code around the stack reads them. Recompute without a "
    "pipeline saves "
    "memory only inside a loop on XLA:CPU (scanned blocks; the ZeRO-3 row keeps its "
    "blocks unrolled and recomputes with the forward pass, see `jfleet/parallel/recompute.py`)."
)


#: Gradient accumulation checked against the strategy's gradient merge: (mesh, ZeRO stage,
#: accumulation steps), on the TinyLlama workload (one call: batch / steps rows).
#: ``(mesh degrees, ZeRO stage, recompute, sequence parallel, O2)`` checked at
#: :data:`DEPTHS` blocks of a wider TinyLlama (:data:`DEPTH_WORKLOAD`), issue 37: ZeRO-2 /
#: ZeRO-3 per block on scanned blocks (FSDP), recompute on and off, tensor + sequence
#: parallel with full recompute (each block's saved input split over ``mp``), and AMP O2
#: with Megatron's distributed optimizer (bf16 parameters; fp32 masters and moments split
#: over dp x sharding), with and without tensor parallel.
DEPTH_LAYOUTS: tuple[tuple[dict[str, int], int, bool, bool, bool], ...] = (
    ({"sharding": 8}, 3, True, False, False),
    ({"sharding": 8}, 3, False, False, False),
    ({"sharding": 8}, 2, True, False, False),
    ({"sharding": 4, "mp": 2}, 3, True, False, False),
    ({"dp": 2, "mp": 4}, 0, True, True, False),
    ({"dp": 2, "sharding": 4}, 1, True, False, True),
    ({"dp": 2, "sharding": 2, "mp": 2}, 1, False, False, True),
)
DEPTHS = (4, 16)


def depth_workload(layers: int) -> Workload:
    """TinyLlama at width 256 (hidden 512, 4 heads) and ``layers`` blocks."""
    return Workload(width=256, heads=4, kv_heads=4, hidden=512, layers=layers)


ACCUMULATION_LAYOUTS = (
    ({"dp": 2, "mp": 4}, 0, 2),
    ({"dp": 2, "sharding": 4}, 2, 2),
    ({"sharding": 4, "mp": 2}, 3, 2),
)


def render_accumulation(results: list[tuple[str, int, float, float]]) -> str:
    """The gradient-accumulation table: (layout name, steps, memory ratio, bytes ratio)."""
    lines = [
        "## Gradient accumulation",
        "",
        "`to_distributed(..., config=ToDistributedConfig(accumulate_steps=A))`: its plan's "
        "`Layout(accumulate_steps=A)` predicted at the whole batch against one call of the "
        "step (the loader yields batch / A rows a call; the strategy's gradient merge, "
        "`k_steps=A`, makes one update of A calls), compiled: the merged gradient is "
        "optimizer state, one call's batch and activations are live, every call reduces its "
        "gradients. Ratios predicted / compiled, per call.",
        "",
        "| layout | A | memory ratio | collective bytes ratio |",
        "|---|---|---|---|",
    ]
    lines += [f"| {n} | {a} | {m:.3f} | {b:.3f} |" for n, a, m, b in results]
    return "\n".join(lines)


def _h100(row: Row) -> str:
    """The h100 profile's memory ratio, bold outside the memory tolerance."""
    ratio = row.h100_ratio
    if ratio != ratio:
        return "-"
    if row.half:  # the GPU's bf16 program is not the one XLA:CPU compiles: resident state
        ratio = row.h100_resident / row.measured_argument
        cell = f"resident {ratio:.3f}"
        return cell if abs(ratio - 1) <= TOLERANCES["memory"] else f"**{cell}**"
    cell = f"{ratio:.2f}"
    return cell if abs(ratio - 1) <= TOLERANCES["memory"] else f"**{cell}**"


def render(rows: list[Row], style_rows: list[Row], workload: Workload) -> str:
    """The Markdown section for RESULTS.md: the TinyLlama table, then the NNX-zoo table."""
    lines = [
        "# Auto-parallel cost model vs the compiled step",
        "",
        *environment("python benchmarks/cost_model_check.py"),
        f"- models: {workload.describe()}; and every style of `jfleet.testing.nnx_styles."
        f"STYLES` (tiny decoder LMs written in public Flax NNX styles), batch {STYLE_BATCH} x "
        f"{STYLE_SEQ} tokens, fp32, `optax.adam`",
        "- applied and compiled as a user runs it: `to_distributed(model, optax.adam(1e-3), "
        "loader, config=ToDistributedConfig(force_mesh=..., zero_stage=..., recompute=False, "
        "num_microbatches=..., forward=...))`, then `make_train_step(loss).lower(model, opt, "
        "batch).compile()` (the one training engine; pipelines are to_distributed's FThenB "
        "stand-in; `forward` and `loss` are the style's, `lm_loss` for TinyLlama)",
        "- predicted: the applied plan's (`get_plan(model)`) `chosen.memory.total`, "
        "`chosen.collectives.total` and `chosen.flops`; measured: the compiled step's "
        "`memory_analysis()` (argument + output - alias + temp), the collective bytes "
        "`jfleet.testing.hlo.summarize` counts in its HLO and the dot FLOPs "
        "`jfleet.testing.hlo.dot_flops` counts (while-loop bodies weighted by their trip "
        "counts; `cost_analysis()` counts a loop body once). Per device; ratios are predicted "
        "/ compiled.",
        f"- tolerances the test suite holds the model to (`tests/auto_parallel/"
        f"test_cost_model.py`): memory ±{TOLERANCES['memory'] * 100:.0f}%, collective bytes "
        f"±{TOLERANCES['collective bytes'] * 100:.0f}%, FLOPs "
        f"±{TOLERANCES['FLOPs'] * 100:.0f}%; a ratio outside its tolerance is **bold**.",
        "- h100 profile ratio: the same layout's memory as the `h100` profile predicts it "
        "(`estimate(..., get_profile('h100'))`; its 5% allocator margin comes off the "
        "budget, not the prediction) over the compiled figure: where it differs from the "
        "`cpu` ratio, the two profiles describe different programs (issue 37, item 6). "
        "AMP O2 rows: XLA:CPU runs bf16 matmuls and collectives in fp32 (every dot and "
        "collective of the compiled step is f32; the `cpu` profile's "
        "`half_precision_fp32` predicts that program), so the GPU's bf16 program cannot be "
        "compiled here and the h100 cell compares what both programs keep alike, the "
        "resident state (bf16 parameters, fp32 masters and moments split over every data "
        "rank, the batch), with the compiled arguments.",
        "",
        "## TinyLlama",
        "",
        "MiB and MFLOP per device.",
        "",
        "| layout | predicted memory | compiled memory | ratio | h100 profile ratio "
        "| predicted collective bytes | compiled collective bytes | ratio | predicted MFLOP "
        "| compiled MFLOP | ratio | compiled bytes, by kind |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kinds = ", ".join(f"{k} {v / MiB:.3f}" for k, v in r.measured_kinds.items()) or "-"
        lines.append(
            f"| {r.name} | {r.predicted_memory / MiB:.3f} | {r.measured_memory / MiB:.3f} "
            f"| {_cell(r, 'memory')} | {_h100(r)} | {r.predicted_bytes / MiB:.3f} "
            f"| {r.measured_bytes / MiB:.3f} | {_cell(r, 'collective bytes')} "
            f"| {_flops(r.predicted_flops)} | {_flops(r.measured_flops)} "
            f"| {_cell(r, 'FLOPs')} | {kinds} |"
        )
    lines += [
        "",
        f"Ratios: {_span(rows, 'memory')}, {_span(rows, 'collective bytes')}, "
        f"{_span(rows, 'FLOPs')} over {len(rows)} layouts "
        f"({sum('pp' in r.name for r in rows)} pipelined). Outside a tolerance: "
        f"{_outliers(rows)}.",
        "",
        LLAMA_NOTES,
        "",
        PIPELINE_NOTES,
        "",
        "## NNX-style zoo",
        "",
        "Every style of `jfleet.testing.nnx_styles.STYLES` under "
        + ", ".join(dict.fromkeys(r.name for r in style_rows))
        + " (the pipeline only for styles with `pipelines=True`; `dropout`'s blocks own RNG "
        "streams and are not pipelined). KiB and MFLOP per device.",
        "",
        "| style | layout | predicted memory | compiled memory | ratio "
        "| predicted collective bytes | compiled collective bytes | ratio | predicted MFLOP "
        "| compiled MFLOP | ratio | compiled bytes, by kind |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in style_rows:
        kinds = ", ".join(f"{k} {v / KiB:.1f}" for k, v in r.measured_kinds.items()) or "-"
        lines.append(
            f"| {r.subject} | {r.name} | {r.predicted_memory / KiB:.1f} "
            f"| {r.measured_memory / KiB:.1f} | {_cell(r, 'memory')} "
            f"| {r.predicted_bytes / KiB:.1f} | {r.measured_bytes / KiB:.1f} "
            f"| {_cell(r, 'collective bytes')} | {_flops(r.predicted_flops)} "
            f"| {_flops(r.measured_flops)} | {_cell(r, 'FLOPs')} | {kinds} |"
        )
    lines += [
        "",
        f"Ratios: {_span(style_rows, 'memory')}, {_span(style_rows, 'collective bytes')}, "
        f"{_span(style_rows, 'FLOPs')} over {len(style_rows)} style layouts. "
        f"{sum(not outside(r) for r in style_rows)} of {len(style_rows)} are within every "
        f"tolerance. Outside a tolerance: {_outliers(style_rows)}.",
        "",
        STYLE_NOTES,
        "",
    ]
    return "\n".join(lines)


#: What the NNX-zoo table shows where the model misses (written from the run recorded; the
#: sentence listing the misses above it is computed).
STYLE_NOTES = (
    "These tiny models show where the cost model is not yet general. (1) FLOPs match on "
    "every style and layout. Where `mp` 4 does not divide 2 kv heads (`einsum_gemma`, "
    "`gqa_qknorm`, `gemma_alternating` at dp2 x mp4) the plan keeps the kv weights whole "
    "and XLA computes on each `mp` rank only the kv heads its q heads need (gcd(kv heads, "
    "mp) groups) forward and for the input's gradient, the weight's gradient whole; the "
    "cost model counts exactly that (before it did, these rows were up to 14.5% high). The "
    "all-gathers XLA adds there are not predicted, so their collective bytes are low. "
    "`gqa_qknorm_mqa` (one kv head) has one group: the projection runs whole on every rank. "
    "(2) Memory: the resident state (parameters, Adam moments, batch) matches the compiled "
    "arguments to a few bytes; the activation term, fitted on TinyLlama at width 128, puts "
    "these width 32-64 models at 0.82-1.13 of the compiled figure at dp2 x mp4 (the q/k "
    "norms over head_dim are not counted as width-sized norms, which took `gqa_qknorm` "
    "from 1.71 to 1.25; 1.06 now); `dropout` is the low end: the per-block term is for "
    "blocks without dropout, whose masks the step keeps too. (3) ZeRO-3 over `dp x "
    "sharding` with `mp` now scans its blocks and gathers one block at a time (issue 37): "
    "the predicted bytes are within 11% on every style but `dropout`, whose blocks own RNG "
    "streams, cannot be stacked and run unrolled (one gather a parameter): the planner "
    "now learns that from the planning trace and predicts the unrolled program (its "
    "all-gathers exactly; bytes +45% and memory 0.77 before), the rest of the gap is the "
    "unrolled step's gradient reduction. (4) `gemma_alternating` pipelined: a stage "
    "is one period-2 super-block run unrolled, and its working set is now counted per "
    "period unit, not per block (1.27 before, 1.21 now); the rest is the stand-in's "
    "working-set constants, fitted on TinyLlama's stages. No tolerance is loosened for "
    "them; they are the cost model's to fix."
)


def main(argv: list[str] | None = None) -> int:
    """Checks every layout, prints the table and writes it into RESULTS.md."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if jax.device_count() < 8:
        print(f"need 8 devices, have {jax.device_count()}", file=sys.stderr)
        return 1
    workload = Workload()
    rows = []
    for degrees, stage, microbatches in LAYOUTS:
        schedule = "FThenB" if microbatches else None
        rows.append(check(workload, degrees, stage, microbatches, schedule=schedule))
        row = rows[-1]
        print(f"checked {row.subject} {row.name} ({row.compile_seconds:.1f} s)", file=sys.stderr)
    for degrees, stage, microbatches, schedule, recompute in SCHEDULE_LAYOUTS:
        rows.append(
            check(workload, degrees, stage, microbatches, schedule=schedule, recompute=recompute)
        )
        row = rows[-1]
        print(f"checked {row.subject} {row.name} ({row.compile_seconds:.1f} s)", file=sys.stderr)
    style_rows = []
    for style in STYLES.values():
        for degrees, stage, microbatches in style_layouts(style):
            schedule = "FThenB" if microbatches else None
            style_rows.append(check(style, degrees, stage, microbatches, schedule=schedule))
            row = style_rows[-1]
            print(
                f"checked {row.subject} {row.name} ({row.compile_seconds:.1f} s)", file=sys.stderr
            )
    for degrees, stage, recompute, sp, o2 in DEPTH_LAYOUTS:
        for layers in DEPTHS:
            row = check(
                depth_workload(layers), degrees, stage, recompute=recompute,
                sequence_parallel=sp, o2=o2,
            )  # fmt: skip
            extra = (", SP" if sp else "") + (", O2 + distributed optimizer" if o2 else "")
            name = f"{row.name}{extra}, {layers} blocks (width 256)"
            rows.append(dataclasses.replace(row, name=name))
            print(f"checked {row.subject} {name} ({row.compile_seconds:.1f} s)", file=sys.stderr)
    accumulation = []
    for degrees, stage, steps in ACCUMULATION_LAYOUTS:
        memory, nbytes = check_accumulation(workload, degrees, stage, steps)
        name = layout_id(degrees, stage, None)
        accumulation.append((name, steps, memory, nbytes))
        print(f"checked accumulation {name} A={steps}", file=sys.stderr)
    section = render(rows, style_rows, workload) + "\n" + render_accumulation(accumulation) + "\n"
    print(section)
    if not args.no_write:
        print(f"written to {write_section(SECTION, section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""ZeRO memory and communication: DP against ZeRO-1/2/3, measured against the ZeRO paper.

Run from the repository root (8 emulated CPU devices; about two minutes on 2 cores)::

    python benchmarks/zero_memory.py               # prints the tables, writes benchmarks/RESULTS.md
    python benchmarks/zero_memory.py --only-depth  # the depth table alone

First, the depth table (issue 37): ``to_distributed`` on a TinyLlama whose blocks it scans,
at 4 and 16 blocks, recompute on and off, DP against ZeRO-2 and ZeRO-3 over ``sharding`` 8:
the compiled step's argument and temp bytes, the collectives inside the layer loops (ZeRO-3
gathers one block at a time and reduce-scatters its gradient there,
:mod:`jfleet.parallel.layer_gather`), temp's growth with depth against the issue's bound,
and the cost model's prediction under the ``cpu`` and ``h100`` profiles.

Then the ZeRO paper's comparison:

For each configuration (DP over 8 devices; ZeRO-1, -2, -3 over a sharding axis of 4 with dp 2,
and over a sharding axis of 8) it trains a GPT-shaped :class:`jfleet.models.TinyLM` with
fp32 Adam through jfleet's engine and reports, per device:

* bytes of parameters, gradients and optimizer state, from the arrays' shards (gradients
  from the layout the engine constrains them to: the ZeRO layout at stage >= 2, else the
  parameters' layout), beside the ZeRO paper's formula;
* the compiled step's ``memory_analysis()`` (argument, output, aliased, temporary bytes);
* the collectives of the compiled step (count and bytes per kind, from the HLO text, see
  :mod:`benchmarks.hlo`), and their volume beside the paper's;
* the engine's step time beside a hand-written ``jax.jit`` step with the same shardings
  (:class:`BaselineStep`), as a ratio, and whether the two programs have the same
  collectives.

Formulas (Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC20, arXiv:1910.02054; Sec. 3.1 and 5 for memory, Sec. 7 for
communication), for Phi parameters in fp32 with Adam (two fp32 moments, no master copy)
and a ZeRO degree N (the sharding axis):

* memory per device: DP 4Phi + 4Phi + 8Phi = 16Phi; ZeRO-1 4Phi + 4Phi + 8Phi/N;
  ZeRO-2 4Phi + (4Phi + 8Phi)/N; ZeRO-3 16Phi/N;
* communication volume per device, in the paper's accounting (an all-reduce of B bytes
  moves 2B: a reduce-scatter B plus an all-gather B; the (N-1)/N factors are dropped):
  DP all-reduce 2 x 4Phi; ZeRO-1/2 reduce-scatter of gradients plus all-gather of
  parameters 2 x 4Phi; ZeRO-3 two all-gathers of parameters (forward, backward) plus a
  reduce-scatter 3 x 4Phi. With a dp axis of size d > 1 beside the sharding axis, the
  gradient shards are all-reduced over dp as well: + 2 x 4Phi/N.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.results_file import environment, write_section
from jfleet import DistributedStrategy, fleet, make_train_step
from jfleet.auto_parallel import (
    ToDistributedConfig,
    estimate,
    get_plan,
    get_profile,
    match_patterns,
    to_distributed,
)
from jfleet.auto_parallel import Workload as PlanWorkload
from jfleet.mesh.placement import Placement
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.optim.loss_scale import finite_flags
from jfleet.testing import hlo

MiB = 2**20
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


@dataclasses.dataclass(frozen=True)
class Config:
    """One parallel layout: ``hybrid_configs`` and the ZeRO stage (0: plain DP)."""

    name: str
    hybrid: dict
    stage: int = 0

    def strategy(self) -> DistributedStrategy:
        """The ``DistributedStrategy`` for this layout."""
        strategy = DistributedStrategy()
        strategy.hybrid_configs = dict(self.hybrid)
        if self.stage:
            strategy.sharding_configs = {"stage": self.stage}
        return strategy


CONFIGS = (
    Config("DP (dp 8)", {"dp_degree": 8}),
    Config("ZeRO-1 (sharding 4 x dp 2)", {"dp_degree": 2, "sharding_degree": 4}, 1),
    Config("ZeRO-2 (sharding 4 x dp 2)", {"dp_degree": 2, "sharding_degree": 4}, 2),
    Config("ZeRO-3 (sharding 4 x dp 2)", {"dp_degree": 2, "sharding_degree": 4}, 3),
    Config("ZeRO-1 (sharding 8)", {"dp_degree": 1, "sharding_degree": 8}, 1),
    Config("ZeRO-2 (sharding 8)", {"dp_degree": 1, "sharding_degree": 8}, 2),
    Config("ZeRO-3 (sharding 8)", {"dp_degree": 1, "sharding_degree": 8}, 3),
)


@dataclasses.dataclass(frozen=True)
class Workload:
    """Model size and batch: ``TinyLM(vocab, width, hidden)``, ``batch x seq`` tokens."""

    vocab: int = 512
    width: int = 256
    hidden: int = 1024
    batch: int = 32
    seq: int = 32

    def model(self) -> TinyLM:
        """A fresh model (same seed every time)."""
        return TinyLM(self.vocab, self.width, self.hidden)

    def batch_data(self) -> dict:
        """One batch of token ids as NumPy arrays."""
        return lm_batches(1, batch=self.batch, seq=self.seq, vocab=self.vocab)[0]


#: The small workload the tests use (TinyLM defaults).
SMALL = Workload(vocab=64, width=32, hidden=64, batch=16, seq=8)


def make_tx() -> optax.GradientTransformation:
    """The optimizer every configuration trains with: fp32 Adam."""
    return optax.adam(1e-3)


# ------------------------------------------------------------------ measuring
def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of arrays (first addressable shard of each)."""
    return sum(
        x.addressable_shards[0].data.nbytes
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array)
    )


def layout_bytes(tree: Any, shardings: Any) -> int:
    """Bytes per device of arrays shaped like ``tree`` laid out by ``shardings``."""
    return sum(
        math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
        for x, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True)
    )


def gradient_shardings(plan: Placement, params: Any) -> Any:
    """The layout the engine gives gradients: ZeRO at stage >= 2, else the parameters'."""
    if plan.zero_stage >= 2:
        return plan.param_shardings(params, zero=True)
    return jax.tree.map(lambda x: x.sharding, params)


def _on_mesh(x: Any, mesh: jax.sharding.Mesh) -> Any:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return x
    return jax.device_put(x, NamedSharding(mesh, P()))


class BaselineStep:
    """A hand-written ``jax.jit`` train step with the shardings jfleet's engine uses.

    ``nnx.split`` the module into parameters and the rest; a pure function computes the
    loss and gradients with ``jax.value_and_grad``, constrains the gradients to the ZeRO
    layout at stage >= 2 (as the engine does), applies the Optax update, and returns new
    parameters, optimizer state, the loss and, as the engine's non-finite guard does, one
    finite flag per floating leaf of the loss and gradients. It is jitted with in and out
    shardings equal to the arrays' shardings and donates parameters and optimizer state.

    Parameters are placed by ``plan.param_shardings`` (ZeRO-sharded at stage 3); the
    optimizer state is ``tx.init`` of the parameters in the ZeRO layout at stage >= 1.

    Example:
      >>> step = BaselineStep(module, optax.adam(1e-3), plan, batch, lm_loss)  # doctest: +SKIP
      >>> loss = step()  # doctest: +SKIP
    """

    def __init__(
        self,
        module: nnx.Module,
        tx: optax.GradientTransformation,
        plan: Placement,
        batch: Any,
        loss_fn: Callable[[nnx.Module, Any], jax.Array],
    ) -> None:
        mesh = plan.mesh
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        params = jax.device_put(params, plan.param_shardings(params))
        rest = jax.tree.map(lambda x: _on_mesh(x, mesh), rest)
        state_params = params
        if plan.zero_stage >= 1:
            state_params = jax.device_put(params, plan.param_shardings(params, zero=True))
        opt_state = jax.tree.map(lambda x: _on_mesh(x, mesh), tx.init(state_params))
        batch = plan.shard_batch(batch)
        grad_shardings = plan.param_shardings(params, zero=True) if plan.zero_stage >= 2 else None
        # a hand-written ZeRO-3 (FSDP) step gathers the sharded parameters for the step
        gathered = plan.param_shardings(params, zero=False) if plan.zero_stage >= 3 else None

        def shardings(tree: Any) -> Any:
            return jax.tree.map(lambda x: x.sharding, tree)

        param_sh, opt_sh = shardings(params), shardings(opt_state)

        def train_step(params, rest, opt_state, batch):
            def objective(params):
                if gathered is not None:
                    params = jax.lax.with_sharding_constraint(params, gathered)
                model = nnx.merge(graphdef, params, rest)
                return jnp.asarray(loss_fn(model, batch), jnp.float32)

            loss, grads = jax.value_and_grad(objective)(params)
            if grad_shardings is not None:
                grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (
                optax.apply_updates(params, updates),
                opt_state,
                loss,
                finite_flags((loss, grads)),
            )

        self.fn = jax.jit(
            train_step,
            in_shardings=(param_sh, shardings(rest), opt_sh, shardings(batch)),
            out_shardings=(param_sh, opt_sh, NamedSharding(mesh, P()), NamedSharding(mesh, P())),
            donate_argnums=(0, 2),
        )
        self.params, self.rest, self.opt_state, self.batch = params, rest, opt_state, batch

    def lower(self) -> jax.stages.Lowered:
        """The lowered step for the current arrays."""
        return self.fn.lower(self.params, self.rest, self.opt_state, self.batch)

    def __call__(self) -> jax.Array:
        """One step on the stored batch; returns the loss."""
        self.params, self.opt_state, loss, _ = self.fn(
            self.params, self.rest, self.opt_state, self.batch
        )
        return loss


@dataclasses.dataclass
class Result:
    """What :func:`run_config` measured for one configuration (bytes are per device)."""

    config: Config
    phi: int
    zero_degree: int
    dp: int
    param_bytes: int
    grad_bytes: int
    opt_bytes: int
    memory: dict[str, int]
    engine: dict[str, hlo.KindSummary]
    baseline: dict[str, hlo.KindSummary] | None = None
    same_collectives: bool | None = None
    same_layout: bool | None = None
    engine_times: list[float] = dataclasses.field(default_factory=list)
    baseline_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.opt_bytes

    def formula(self) -> dict[str, float]:
        """The paper's per-device bytes: params, grads, optimizer state, comm volume."""
        phi, n, stage = self.phi, self.zero_degree, self.config.stage
        volume = 2 * 4 * phi if stage < 3 else 3 * 4 * phi
        if stage and self.dp > 1:
            volume += 2 * 4 * phi / n
        return {
            "params": 4 * phi / (n if stage >= 3 else 1),
            "grads": 4 * phi / (n if stage >= 2 else 1),
            "opt": 8 * phi / (n if stage >= 1 else 1),
            "volume": volume,
        }

    def volume(self, *, as_reduce_scatter: bool) -> float:
        """Measured volume in the paper's accounting (all-reduce 2B, the others B).

        With ``as_reduce_scatter``, the part of an all-reduce that is only sliced afterwards
        counts as a reduce-scatter (B, not 2B): what XLA on GPU/TPU compiles it to.
        """
        total = 0.0
        for kind, s in self.engine.items():
            if kind == "all-reduce":
                sliced = s.sliced_bytes if as_reduce_scatter else 0
                total += 2 * (s.bytes - sliced) + sliced
            else:
                total += s.bytes
        return total


def _time_interleaved(
    calls: list[Callable[[], jax.Array]], warmup: int, repeats: int
) -> list[list[float]]:
    """Seconds of each run of each call, run alternately so drift hits them alike."""
    for _ in range(warmup):
        for call in calls:
            jax.block_until_ready(call())
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[i].append(time.perf_counter() - start)
    return times


def run_config(
    config: Config,
    workload: Workload = Workload(),
    *,
    baseline: bool = True,
    timing: bool = True,
    warmup: int = 2,
    repeats: int = 10,
    log: Callable[[str], None] = lambda _: None,
) -> Result:
    """Builds the engine step (and the baseline) for ``config`` and measures them.

    Args:
      config: the layout.
      workload: model size and batch.
      baseline: also build the hand-written step and compare its collectives and layout.
      timing: time both steps (needs ``baseline``).
      warmup: untimed steps of each before timing.
      repeats: timed steps of each.
      log: called with a progress message before each slow phase.

    Raises:
      ValueError: ``timing`` without ``baseline``.
    """
    if timing and not baseline:
        raise ValueError("timing=True compares against the baseline; pass baseline=True.")
    fleet._reset()
    fleet.init(is_collective=True, strategy=config.strategy(), log_level="WARNING")
    model = fleet.distributed_model(workload.model())
    opt = fleet.distributed_optimizer(make_tx())
    plan = model.placement
    opt.init(model, plan)
    batch = plan.shard_batch(workload.batch_data())
    step = make_train_step(lm_loss)

    params = nnx.state(model, nnx.Param)
    phi = sum(x.size for x in jax.tree.leaves(params))
    log("compiling the engine step")
    compiled = step.lower(model, opt, batch).compile()
    stats = compiled.memory_analysis()
    memory = {
        "argument": stats.argument_size_in_bytes,
        "output": stats.output_size_in_bytes,
        "alias": stats.alias_size_in_bytes,
        "temp": stats.temp_size_in_bytes,
    }
    engine_text = compiled.as_text()
    result = Result(
        config=config,
        phi=phi,
        zero_degree=plan.zero_degree,
        dp=plan.mesh.shape["dp"],
        param_bytes=shard_bytes(params),
        grad_bytes=layout_bytes(params, gradient_shardings(plan, params)),
        opt_bytes=shard_bytes(nnx.state(opt)),
        memory=memory,
        engine=hlo.summarize(engine_text),
    )
    if not baseline:
        fleet._reset()
        return result
    log("compiling the hand-written baseline")
    hand = BaselineStep(workload.model(), make_tx(), plan, workload.batch_data(), lm_loss)
    hand_text = hand.lower().compile().as_text()
    result.baseline = hlo.summarize(hand_text)
    result.same_collectives = hlo.signature(engine_text) == hlo.signature(hand_text)
    result.same_layout = (shard_bytes(hand.params), shard_bytes(hand.opt_state)) == (
        shard_bytes(params),
        shard_bytes(opt.opt_state),
    )
    if timing:
        log(f"timing ({warmup} warm-ups, {repeats} runs each, alternating)")
        result.engine_times, result.baseline_times = _time_interleaved(
            [lambda: step(model, opt, batch), hand], warmup, repeats
        )
    fleet._reset()
    return result


# ------------------------------------------------------------------ report
def _mib(n: float) -> str:
    return f"{n / MiB:.3f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def _yes(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "NO")


def render(results: list[Result], workload: Workload, header: list[str]) -> str:
    """The Markdown report: environment, memory, collectives and timing tables."""
    dp = results[0]
    lines = ["# ZeRO benchmark results", ""]
    lines += header
    lines += [
        f"- model: `TinyLM(vocab={workload.vocab}, width={workload.width}, "
        f"hidden={workload.hidden})`, Phi = {dp.phi:,} parameters (fp32, "
        f"{_mib(4 * dp.phi)} MiB); batch {workload.batch} x {workload.seq} tokens; "
        "`optax.adam` (two fp32 moments)",
        "- MiB are per device. Formulas: Rajbhandari et al., *ZeRO: Memory Optimizations "
        "Toward Training Trillion Parameter Models*, SC20 (arXiv:1910.02054); see "
        "`benchmarks/README.md`.",
        "",
        "## Memory per device: measured (paper formula)",
        "",
        "| config | params | grads | optimizer state | total | formula total "
        "| total / DP | formula / DP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    dp_formula = sum(v for k, v in dp.formula().items() if k != "volume")
    for r in results:
        f = r.formula()
        formula_total = f["params"] + f["grads"] + f["opt"]
        lines.append(
            f"| {r.config.name} | {_mib(r.param_bytes)} ({_mib(f['params'])}) "
            f"| {_mib(r.grad_bytes)} ({_mib(f['grads'])}) "
            f"| {_mib(r.opt_bytes)} ({_mib(f['opt'])}) "
            f"| {_mib(r.total_bytes)} | {_mib(formula_total)} "
            f"| {_ratio(r.total_bytes, dp.total_bytes)} | {_ratio(formula_total, dp_formula)} |"
        )
    lines += [
        "",
        "Gradients are counted in the layout the engine constrains them to (the ZeRO layout at "
        "stage >= 2, else the parameters' layout); optimizer state includes Adam's step count "
        "and the optimizer's step counter.",
        "",
        "## Compiled step: `memory_analysis()` per device (MiB)",
        "",
        "| config | argument | output | aliased (donated) | temp | argument + temp "
        "| (argument + temp) / DP |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r.memory
        peak, dp_peak = m["argument"] + m["temp"], dp.memory["argument"] + dp.memory["temp"]
        lines.append(
            f"| {r.config.name} | {_mib(m['argument'])} | {_mib(m['output'])} "
            f"| {_mib(m['alias'])} | {_mib(m['temp'])} | {_mib(peak)} | {_ratio(peak, dp_peak)} |"
        )
    lines += [
        "",
        "Outputs alias the donated arguments, so argument + temp approximates the step's peak "
        "(on CPU `peak_memory_in_bytes` leaves temp out). Temp holds the full-size gradients "
        "before they are reduced (and, at stage 3, the gathered parameters): XLA computes the "
        "whole backward pass before the reduction, so ZeRO-2's smaller gradient layout shows "
        "in the arrays the step keeps, not in this program's temp.",
    ]
    kinds = hlo.KINDS
    lines += [
        "",
        "## Collectives per step (engine): count / MiB",
        "",
        "| config | "
        + " | ".join(kinds)
        + " | volume | volume, sliced all-reduce as reduce-scatter | paper formula "
        "| volume / DP | as-RS / DP | formula / DP |",
        "|---|" + "---|" * (len(kinds) + 6),
    ]
    dp_volume = dp.volume(as_reduce_scatter=False)
    dp_formula_volume = dp.formula()["volume"]
    for r in results:
        cells = []
        for kind in kinds:
            s = r.engine[kind]
            cell = f"{s.count} / {_mib(s.bytes)}" if s.count else "-"
            if kind == "all-reduce" and s.sliced_bytes:
                cell += f" (sliced {_mib(s.sliced_bytes)})"
            cells.append(cell)
        volume = r.volume(as_reduce_scatter=False)
        as_rs = r.volume(as_reduce_scatter=True)
        formula = r.formula()["volume"]
        lines.append(
            f"| {r.config.name} | "
            + " | ".join(cells)
            + f" | {_mib(volume)} | {_mib(as_rs)} | {_mib(formula)} "
            f"| {_ratio(volume, dp_volume)} | {_ratio(as_rs, dp_volume)} "
            f"| {_ratio(formula, dp_formula_volume)} |"
        )
    lines += [
        "",
        "Bytes of a collective are its full buffer per execution (the array of an all-reduce, "
        "the input of a reduce-scatter, the output of an all-gather), weighted by loop trip "
        "counts. *Volume* is the paper's accounting: an all-reduce of B bytes counts 2B "
        "(reduce-scatter + all-gather), every other collective B. *Sliced* is the part of the "
        "all-reduces whose result the program only reads through a `dynamic-slice`: XLA:CPU "
        "has no pass that turns that pair into a reduce-scatter (GPU and TPU run "
        "`ReduceScatterCreator`), so on CPU the ZeRO gradient reduction shows as all-reduce + "
        "slice; the *as reduce-scatter* column counts those bytes once, as a GPU build would.",
        "",
        "## Step time: engine vs hand-written `jax.jit` with the same shardings",
        "",
        "| config | engine ms | baseline ms | engine / baseline | spread (max/min) "
        "| same collectives (kind, count, bytes) | same per-device param / optimizer bytes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.engine_times:
            engine, base = (statistics.median(t) for t in (r.engine_times, r.baseline_times))
            spread = max(max(t) / min(t) for t in (r.engine_times, r.baseline_times))
            timing = f"{1e3 * engine:.1f} | {1e3 * base:.1f} | {engine / base:.3f} | {spread:.2f}"
        else:
            timing = "- | - | - | -"
        lines.append(
            f"| {r.config.name} | {timing} | {_yes(r.same_collectives)} | {_yes(r.same_layout)} |"
        )
    lines += [
        "",
        "Medians of the timed runs, engine and baseline alternating. Times on emulated CPU "
        "devices measure the total CPU work of 8 devices sharing the machine's cores and are "
        "noisy (spread is the worse of the two programs' max/min); read the ratio, not the "
        "milliseconds, and only a difference of ~2x as real. The engine's time includes its "
        "Python work per call (`nnx.split` / `nnx.update` of model and optimizer, batch "
        "placement).",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ depth (issue 37)
#: The depth table's layouts: (name, force_mesh, ZeRO stage).
DEPTH_CONFIGS = (
    ("DP (dp 8)", {"dp": 8}, 0),
    ("ZeRO-2 (sharding 8)", {"sharding": 8}, 2),
    ("ZeRO-3 (sharding 8)", {"sharding": 8}, 3),
)
DEPTH_LAYERS = (4, 16)
#: gradient accumulation's calls per update in the merged-backward rows (each call gets the
#: workload's batch, so its activations are those of the rows without accumulation)
DEPTH_ACCUMULATE = 2


@dataclasses.dataclass(frozen=True)
class DepthWorkload:
    """``TinyLlama(vocab, width, heads, kv_heads=heads, hidden, layers)``, scanned by
    ``to_distributed``; ``batch x seq`` tokens."""

    vocab: int = 512
    width: int = 256
    heads: int = 4
    hidden: int = 512
    batch: int = 16
    seq: int = 64

    def model(self, layers: int) -> TinyLlama:
        return TinyLlama(
            vocab=self.vocab, width=self.width, heads=self.heads, hidden=self.hidden,
            layers=layers,
        )  # fmt: skip

    @property
    def block_bytes(self) -> int:
        """fp32 bytes of one block: q, k, v, o, gate, up, down, two norms."""
        w = self.width
        return 4 * (4 * w * w + 3 * w * self.hidden + 2 * w)

    def saved_bytes(self, recompute: bool) -> int:
        """Bytes one block saves for the backward pass, per device (8 data ranks): its input
        under full recompute; else its matmul outputs (q, k, v, scores, p @ v, o, gate, up,
        down; ``dots_saveable``)."""
        tokens = self.batch * self.seq // 8
        if recompute:
            return 4 * tokens * self.width
        w = self.width
        return 4 * tokens * (3 * w + self.heads * self.seq + 2 * w + 2 * self.hidden + w)


@dataclasses.dataclass
class DepthRow:
    """One compiled step of the depth table."""

    name: str
    layers: int
    recompute: bool
    argument: int
    temp: int
    loop_gathers: int
    loop_scatters: int
    outside_gathers: int
    predicted: dict[str, int]
    accumulate: int = 1


def depth_row(
    workload: DepthWorkload,
    name: str,
    mesh: dict,
    stage: int,
    layers: int,
    recompute: bool,
    accumulate: int = 1,
) -> DepthRow:
    """``to_distributed`` at ``mesh`` / ``stage``, the engine's step compiled (not run);
    with ``accumulate`` calls per update, each of the workload's batch."""
    batch = workload.batch * accumulate
    data = lm_batches(1, batch=batch, seq=workload.seq, vocab=workload.vocab)
    config = ToDistributedConfig(
        force_mesh=mesh, zero_stage=stage, recompute=recompute, accumulate_steps=accumulate
    )
    model, opt, loader = to_distributed(
        workload.model(layers), make_tx(), data, device_num=8, config=config
    )
    layout = get_plan(model).chosen.layout
    compiled = make_train_step(lm_loss).lower(model, opt, next(iter(loader))).compile()
    m = compiled.memory_analysis()
    found = hlo.collectives(compiled.as_text())
    loop = [c for c in found if c.weight == layers]
    patterns = match_patterns(workload.model(layers))
    plan_workload = PlanWorkload(batch_size=batch, seq_len=workload.seq)
    predicted = {
        profile: estimate(
            patterns, plan_workload, layout, get_profile(profile), devices_per_node=8
        ).memory.total
        for profile in ("cpu", "h100")
    }
    fleet._reset()
    return DepthRow(
        name=name,
        layers=layers,
        recompute=recompute,
        argument=m.argument_size_in_bytes,
        temp=m.temp_size_in_bytes,
        loop_gathers=sum(c.bytes for c in loop if c.kind == "all-gather"),
        loop_scatters=sum(c.sliced_bytes + (c.bytes if c.kind == "reduce-scatter" else 0)
                          for c in loop if c.kind in ("all-reduce", "reduce-scatter")),
        outside_gathers=sum(c.bytes for c in found if c.kind == "all-gather" and c.weight == 1),
        predicted=predicted,
        accumulate=accumulate,
    )  # fmt: skip


def run_depth(workload: DepthWorkload, log: Callable[[str], None]) -> list[DepthRow]:
    """Every depth-table row: each layout, recompute on and off, at each depth."""
    rows = []
    for name, mesh, stage in DEPTH_CONFIGS:
        for recompute in (True, False):
            for layers in DEPTH_LAYERS:
                log(f"{name}, {layers} layers, recompute={recompute}")
                rows.append(depth_row(workload, name, mesh, stage, layers, recompute))
    for name, mesh, stage in DEPTH_CONFIGS:  # gradient merge in the backward loop
        for layers in DEPTH_LAYERS if stage >= 2 else ():
            log(f"{name}, {layers} layers, accumulate {DEPTH_ACCUMULATE}")
            rows.append(depth_row(workload, name, mesh, stage, layers, True, DEPTH_ACCUMULATE))
    return rows


def render_depth(rows: list[DepthRow], workload: DepthWorkload, header: list[str]) -> str:
    """The depth table: the compiled step at 4 and 16 layers, and issue 37's bounds."""
    shallow, deep = DEPTH_LAYERS
    block = workload.block_bytes
    lines = ["## ZeRO as the layer loop keeps it: 4 and 16 scanned blocks (issue 37)", ""]
    lines += header
    lines += [
        f"- model: `TinyLlama(vocab={workload.vocab}, width={workload.width}, "
        f"heads={workload.heads}, hidden={workload.hidden})`, blocks scanned by "
        f"`to_distributed`; one block {_mib(block)} MiB fp32; batch {workload.batch} x "
        f"{workload.seq}; fp32 Adam; the engine's step compiled, `memory_analysis()` per "
        "device (MiB)",
        "- loop all-gather / reduce-scatter: bytes of the collectives inside the layer loops "
        "per iteration, i.e. per block (the forward and the backward loop together; a "
        "reduce-scatter is XLA:CPU's all-reduce read through a slice); outside: all-gathers "
        "run once per step (ZeRO-2's: the updated parameters)",
        "- predicted: the cost model's peak for the same layout (`cpu` / `h100` profile) "
        "over the compiled argument + temp",
        "",
        "| config | blocks | recompute | argument | temp | argument + temp | / DP's "
        "| loop all-gather per block | loop reduce-scatter per block | outside all-gather "
        "| predicted cpu | predicted h100 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    dp = {(r.layers, r.recompute): r for r in rows if r.name.startswith("DP")}
    merged = [r for r in rows if r.accumulate > 1]
    rows = [r for r in rows if r.accumulate == 1]
    for r in rows:
        peak = r.argument + r.temp
        base = dp[(r.layers, r.recompute)]
        lines.append(
            f"| {r.name} | {r.layers} | {'on' if r.recompute else 'off'} | {_mib(r.argument)} "
            f"| {_mib(r.temp)} | {_mib(peak)} | {_ratio(peak, base.argument + base.temp)} "
            f"| {_mib(r.loop_gathers)} | {_mib(r.loop_scatters)} "
            f"| {_mib(r.outside_gathers)} | {_ratio(r.predicted['cpu'], peak)} "
            f"| {_ratio(r.predicted['h100'], peak)} |"
        )
    lines += [
        "",
        f"Growth of temp from {shallow} to {deep} blocks against issue 37's bound, 1.25 x "
        "(the added blocks' saved activations + two gathered blocks; ZeRO-2 without the "
        "gathered blocks), saved activations per block as "
        "`DepthWorkload.saved_bytes` counts them:",
        "",
        "| config | recompute | temp growth | added saved activations | bound | within "
        "| ZeRO-2: bound + the added gradient shards | within "
        "| growth per added block / one block's whole gradient |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r.name, r.layers, r.recompute): r for r in rows}
    for name, _, stage in DEPTH_CONFIGS:
        if not stage:
            continue
        for recompute in (True, False):
            growth = by[(name, deep, recompute)].temp - by[(name, shallow, recompute)].temp
            saved = (deep - shallow) * workload.saved_bytes(recompute)
            bound = 1.25 * (saved + (2 * block if stage >= 3 else 0))
            sharded = bound + (deep - shallow) * block / 8 if stage == 2 else None
            lines.append(
                f"| {name} | {'on' if recompute else 'off'} | {_mib(growth)} | {_mib(saved)} "
                f"| {_mib(bound)} | {_yes(growth <= bound)} "
                f"| {_mib(sharded) if sharded else '-'} "
                f"| {_yes(growth <= sharded) if sharded else '-'} "
                f"| {_ratio(growth / (deep - shallow), block)} |"
            )
    lines += [
        "",
        "Issue 37's ZeRO-2 bound leaves out what ZeRO-2 keeps per block by definition: its "
        "gradient shard (1/8 of a block, fp32), which lives in temp from the backward "
        "loop until the update; the column beside it adds that shard and nothing else. No "
        "whole-size gradient exists (last column: an added block costs well under its whole "
        "gradient; the reduce-scatter runs inside the loop), and the updated parameters "
        "are gathered back one block at a time (`layer_gather.regather`).",
        "",
    ]
    return "\n".join(lines + _render_merged(merged, by, workload))


def _render_merged(merged: list[DepthRow], by: dict, workload: DepthWorkload) -> list[str]:
    """The gradient-accumulation rows: the backward loop adds into the accumulator."""
    shallow, deep = DEPTH_LAYERS
    lines = [
        f"Gradient accumulation ({DEPTH_ACCUMULATE} calls per update, each of the batch "
        "above; the strategy's gradient merge), recompute on: the backward loop adds each "
        "block's gradient shard into its row of the accumulator "
        "(`jfleet/parallel/merged_backward.py`), so temp keeps no stacked gradient beside "
        "the accumulator (which is optimizer state: argument). Temp against the same step "
        "without accumulation, the growth per added block against its saved input, and "
        "the cost model's peak over the compiled argument + temp:",
        "",
        "| config | blocks | argument | temp | temp without accumulation | temp growth "
        "per added block / saved input | predicted cpu | predicted h100 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    at = {(r.name, r.layers): r for r in merged}
    for r in merged:
        plain = by[(r.name, r.layers, True)]
        growth = (at[(r.name, deep)].temp - at[(r.name, shallow)].temp) / (deep - shallow)
        peak = r.argument + r.temp
        lines.append(
            f"| {r.name} | {r.layers} | {_mib(r.argument)} | {_mib(r.temp)} "
            f"| {_mib(plain.temp)} | {_ratio(growth, workload.saved_bytes(True))} "
            f"| {_ratio(r.predicted['cpu'], peak)} | {_ratio(r.predicted['h100'], peak)} |"
        )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    """Runs every configuration, prints the report and writes it to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to write the report")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per program")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per program")
    parser.add_argument("--no-timing", action="store_true", help="skip the step times")
    parser.add_argument(
        "--only-depth", action="store_true", help="only the depth table (issue 37's ZeRO)"
    )
    args = parser.parse_args(argv)
    if jax.device_count() < 8:
        print(f"need 8 devices, have {jax.device_count()}", file=sys.stderr)
        return 1
    start = time.perf_counter()
    command = "python benchmarks/zero_memory.py" + (" " + " ".join(argv or sys.argv[1:])).rstrip()

    def log_depth(message: str) -> None:
        print(f"[depth] {message} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

    depth = DepthWorkload()
    depth_report = render_depth(run_depth(depth, log_depth), depth, environment(command))
    print(depth_report)
    write_section("zero_depth", depth_report, args.out)
    if args.only_depth:
        return 0
    workload = Workload()
    results = []
    for i, config in enumerate(CONFIGS, 1):
        prefix = f"[{i}/{len(CONFIGS)}] {config.name}:"

        def log(message: str, prefix: str = prefix) -> None:
            print(f"{prefix} {message} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)

        results.append(
            run_config(
                config,
                workload,
                timing=not args.no_timing,
                warmup=args.warmup,
                repeats=args.repeats,
                log=log,
            )
        )
    report = render(results, workload, environment(command))
    print(report)
    write_section("zero_memory", report, args.out)
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

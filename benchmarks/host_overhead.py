"""Host overhead of the engine: its steps/s against a hand-written ``jax.jit`` step.

Run from the repository root (8 emulated CPU devices; about a minute on 2 cores)::

    python benchmarks/host_overhead.py             # prints the table, writes RESULTS.md
    python benchmarks/host_overhead.py --no-write  # print only

A small model (``jfleet.models.TinyLM()``, fp32, ``optax.adam``) trains through
``jfleet.make_train_step`` and through ``benchmarks.zero_memory.BaselineStep`` (the
split state, the same in and out shardings, the same ZeRO gradient constraint and
finite flags, donated parameters and optimizer state), on dp 8 and on ZeRO-2
(sharding 4 x dp 2). Both get the same batch, already placed on the mesh. A round
runs ``--steps`` steps of one of them back to back and waits for the last loss;
rounds alternate between the two, ``--rounds`` each, after a warm-up round of each.
The table gives the median steps/s, the spread (max / min of the rounds) and the
ratio of the medians (engine / baseline).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)

# isort: split
import jax
import optax

from benchmarks.results_file import environment, write_section
from benchmarks.zero_memory import BaselineStep
from jfleet import fleet, make_train_step
from jfleet.mesh.placement import resolve_placement
from jfleet.models import TinyLM, lm_batches, lm_loss

SECTION = "host_overhead"
CASES = {
    "dp 8": ({"dp_degree": 8}, {}),
    "ZeRO-2 (sharding 4 x dp 2)": (
        {"dp_degree": 2, "sharding_degree": 4},
        {"sharding": True, "sharding_configs": {"stage": 2}},
    ),
}


def measure(name: str, rounds: int, steps: int) -> dict:
    """Steps/s of every round of the engine and the baseline for case ``name``."""
    hybrid, extra = CASES[name]
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = hybrid
    for key, value in extra.items():
        setattr(strategy, key, value)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.adam(1e-3))
    plan = resolve_placement(None, model)
    batch = plan.shard_batch(lm_batches(1)[0])
    step = make_train_step(lm_loss)
    baseline = BaselineStep(TinyLM(), optax.adam(1e-3), plan, batch, lm_loss)

    def engine() -> jax.Array:
        return step(model, opt, batch)

    def run(call) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            loss = call()
        jax.block_until_ready(loss)
        return steps / (time.perf_counter() - start)

    run(engine), run(baseline)  # compile and warm up
    got: dict[str, list[float]] = {"engine": [], "baseline": []}
    for _ in range(rounds):
        got["engine"].append(run(engine))
        got["baseline"].append(run(baseline))
    return got


def render(results: dict, rounds: int, steps: int, command: str) -> str:
    lines = [
        "# Engine host overhead: `make_train_step` vs a hand-written `jax.jit` step",
        "",
        *environment(command),
        "- model: `TinyLM()` (fp32), `optax.adam`, batch 16 x 8 tokens placed on the mesh once; "
        "baseline: `benchmarks.zero_memory.BaselineStep` (split state, same shardings, "
        "donation, ZeRO gradient constraint, finite flags)",
        f"- {rounds} rounds of {steps} steps each per program, alternating, after one warm-up "
        "round each; steps/s of a round = steps / (time to the last loss ready)",
        "",
        "| config | engine steps/s | baseline steps/s | engine / baseline | "
        "spread engine (max/min) | spread baseline (max/min) |",
        "|---|---|---|---|---|---|",
    ]
    for name, got in results.items():
        e, b = got["engine"], got["baseline"]
        me, mb = statistics.median(e), statistics.median(b)
        lines.append(
            f"| {name} | {me:.1f} | {mb:.1f} | {me / mb:.3f} | {max(e) / min(e):.2f} | "
            f"{max(b) / min(b):.2f} |"
        )
    lines += [
        "",
        "The engine's call holds, besides the jitted step: the fast path's checks "
        "(same model and optimizer objects, graph unchanged: "
        "`jfleet.training.graph_watch.GraphWatch`), "
        "reading and writing back each variable's value, the batch placement, the "
        "non-finite guard's bookkeeping and the atomic (signal-safe) install.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--rounds", type=int, default=15, help="rounds per program (median)")
    parser.add_argument("--steps", type=int, default=50, help="steps per round")
    args = parser.parse_args(argv)
    results = {name: measure(name, args.rounds, args.steps) for name in CASES}
    section = render(results, args.rounds, args.steps, "python benchmarks/host_overhead.py")
    print(section)
    if not args.no_write:
        print(f"written to {write_section(SECTION, section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

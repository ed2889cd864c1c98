"""MoE token exchange per layout: the compiled step's all-to-alls against the cost model.

Run from the repository root (8 emulated CPU devices; about a minute on 2 cores)::

    python benchmarks/moe_exchange.py            # prints the table, writes benchmarks/RESULTS.md

For each layout (``hybrid_configs``) and capacity rule it builds
:class:`jfleet.models.TinyMoELM` (8 experts a layer, top 2, GShard gate, 2 layers) through
``fleet.distributed_model``, compiles one training step (not run) and reads, per MoE layer:
the all-to-alls of the compiled HLO (count, buffer bytes, bytes sent) beside
:mod:`jfleet.auto_parallel.cost.cost_moe`'s prediction, and the expert kernels' bytes per
device from their shardings.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import optax
from flax import nnx

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)
from benchmarks.results_file import environment, write_section
from jfleet import fleet, make_train_step
from jfleet.auto_parallel.cost.cost_moe import moe_exchange, moe_exchange_bytes
from jfleet.models import TinyMoELM, lm_batches, moe_lm_loss
from jfleet.testing import hlo, make_strategy

VOCAB, WIDTH, HIDDEN, EXPERTS, LAYERS, BATCH, SEQ = 64, 32, 64, 8, 2, 16, 32
LAYOUTS = (
    ("dp2 x ep4", {"dp_degree": 2, "ep_degree": 4}, False),
    ("ep8", {"ep_degree": 8}, False),
    ("dp4 x ep2", {"dp_degree": 4, "ep_degree": 2}, False),
    ("ep4 x mp2 (tokens over mp)", {"ep_degree": 4, "mp_degree": 2}, True),
    ("dp8 (ep 1)", {"dp_degree": 8}, False),
)
CAPACITIES = (("dropless", None), ("capacity 1.0", 1.0), ("capacity 1.25", 1.25))


def row(name: str, hybrid: dict, split_mp: bool, rule: str, factor: float | None) -> list[str]:
    """One layout and capacity rule: the compiled step's all-to-alls and the prediction."""
    fleet.init(is_collective=True, strategy=make_strategy(hybrid), log_level="WARNING")
    capacity = None if factor is None else (factor, factor)
    gate = {"type": "gshard", "top_k": 2, "capacity": capacity, "random_routing": False}
    model = fleet.distributed_model(
        TinyMoELM(VOCAB, WIDTH, HIDDEN, EXPERTS, LAYERS, gate=gate, split_mp=split_mp)
    )
    opt = fleet.distributed_optimizer(optax.adam(1e-3))
    batch = lm_batches(1, batch=BATCH, seq=SEQ, vocab=VOCAB)[0]
    step = make_train_step(moe_lm_loss).lower(model, opt, batch).compile()
    found = [c for c in hlo.collectives(step.as_text()) if c.kind == "all-to-all"]
    mesh = model.module.moes[0].mesh
    ep = mesh.shape["ep"]
    token_devices = 1
    for axis in model.module.moes[0].token_axes:
        token_devices *= mesh.shape[axis]
    buffer = moe_exchange_bytes(
        tokens=BATCH * SEQ // token_devices, width=WIDTH, k=2, experts=EXPERTS,
        capacity_factor=factor,
    )  # fmt: skip
    predicted = moe_exchange(buffer, ep=ep, bandwidth=1.0)
    count = sum(c.weight for c in found) / LAYERS
    measured = sum(c.weight * c.bytes for c in found) / LAYERS
    sent = sum(c.weight * c.wire_bytes for c in found) / LAYERS
    want = predicted.count * buffer if ep > 1 else 0
    experts = nnx.state(model.module.moes[0].experts, nnx.Param)
    local = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(experts))
    whole = sum(x.nbytes for x in jax.tree.leaves(experts))
    fleet._reset()
    return [
        name, rule, f"{count:g}", f"{int(measured)}", f"{int(want)}",
        f"{measured / want:.3f}" if want else "-", f"{int(sent)}",
        f"{int(predicted.wire_bytes) if ep > 1 else 0}", f"{local}", f"{local / whole:.3f}",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows = [row(*layout, *cap) for layout in LAYOUTS for cap in CAPACITIES]
    lines = [
        "## MoE token exchange per layout (issue 39)",
        "",
        *environment("python benchmarks/moe_exchange.py"),
        f"- model: `TinyMoELM(vocab={VOCAB}, width={WIDTH}, hidden={HIDDEN}, "
        f"experts={EXPERTS}, layers={LAYERS})`, GShard gate top 2 (no random routing), "
        f"batch {BATCH} x {SEQ}, fp32 Adam; the training step compiled, not run",
        "- per MoE layer: all-to-alls in the compiled HLO (forward and backward), their "
        "buffer bytes and bytes sent per device, beside `jfleet.auto_parallel.cost.cost_moe` "
        "(`E x C x D` buffers, 4 a layer, `(ep - 1) / ep` of each sent); expert kernel "
        "bytes held per device (one layer) and their share of the layer's experts",
        "",
        "| layout | capacity | all-to-alls | buffer bytes | predicted | ratio | sent | "
        "predicted sent | expert bytes / device | share |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        write_section("moe_exchange", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

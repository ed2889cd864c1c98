"""MoE token exchange per layout: the compiled step's all-to-alls against the cost model.

Run from the repository root (8 emulated CPU devices; about a minute on 2 cores)::

    python benchmarks/moe_exchange.py            # prints the table, writes benchmarks/RESULTS.md

For each layout (``hybrid_configs``) and capacity rule it builds
:class:`jfleet.models.TinyMoELM` (8 experts a layer, top 2, GShard gate, 2 layers) through
``fleet.distributed_model``, compiles one training step (not run) and reads, per MoE layer:
the all-to-alls of the compiled HLO (count, buffer bytes, bytes sent) beside
:mod:`jfleet.auto_parallel.cost.cost_moe`'s prediction, and the expert kernels' bytes per
device from their shardings.

A second table does the same for a traced model's own one-hot dispatch (the Qwen3-MoE style
of :mod:`jfleet.testing.nnx_styles.moe_styles`, experts of width 128) through
``to_distributed`` with a forced ``ep``: each MoE layer's tokens are all-gathered over the
``ep`` group (:mod:`jfleet.auto_parallel.apply.expert_tokens`), which the cost model prices
(:func:`~jfleet.auto_parallel.cost.cost_moe.ring_exchange_time`); the table reads the
compiled step's all-gathers beside the prediction, checks no expert stack is gathered, and
shows the layout the search picks. A third does the same for the style's ``ragged_dot``
dispatch (:mod:`jfleet.auto_parallel.apply.expert_rows`: all-gathers and reduce-scatters
over ``ep``), with its memory beside the cost model's.
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
from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
from jfleet.auto_parallel.cost.cost_moe import moe_exchange, moe_exchange_bytes
from jfleet.models import TinyMoELM, lm_batches, moe_lm_loss
from jfleet.testing import hlo, make_strategy
from jfleet.testing.nnx_styles import MOE_STYLES
from jfleet.testing.nnx_styles.moe_styles import (
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from jfleet.testing.nnx_styles.registry import token_batches

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


RING_FFN, RING_LAYOUTS = 128, ({"dp": 4, "ep": 2}, {"dp": 2, "ep": 4}, {"ep": 8})
QWEN3_MOE, GPT_OSS = MOE_STYLES["qwen3_moe"], MOE_STYLES["gpt_oss"]


def _traced_step(force: dict | None, batch: int, dispatch: str, seq: int = 32) -> tuple:
    """The ``qwen3_moe`` style (``dispatch`` its own; ``"gather"``: the ``gpt_oss`` style)
    with experts of width :data:`RING_FFN` through ``to_distributed`` (mesh ``force``-d, or
    searched: None) on ``batch`` sequences of ``seq`` tokens: ``(config, model, plan,
    compiled training step)``."""
    if dispatch == "gather":
        style, config = GPT_OSS, GptOssConfig(intermediate_size=RING_FFN)
        model = GptOssForCausalLM(config, rngs=nnx.Rngs(0))
    else:
        style = QWEN3_MOE
        config = Qwen3MoeConfig(
            moe_intermediate_size=RING_FFN, dispatch=dispatch, capacity_factor=1.0
        )
        model = Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0))
    model, opt, loader = to_distributed(
        model, optax.adam(1e-3), token_batches(1, vocab=64, batch=batch, seq=seq), 8,
        config=ToDistributedConfig(forward=style.forward, force_mesh=force),
    )  # fmt: skip
    step = make_train_step(style.loss_fn).lower(model, opt, next(iter(loader))).compile()
    return config, model, get_plan(model), step


def _expert_kernels(mlp: nnx.Module) -> tuple:
    """A MoE layer's stacked expert kernels (Qwen3-MoE's, or gpt-oss's)."""
    if hasattr(mlp, "experts"):
        return mlp.experts.gate_up_proj, mlp.experts.down_proj
    return mlp.gate_proj, mlp.up_proj


def ring_row(force: dict | None, dispatch: str = "dense") -> list[str]:
    """A traced dispatch (one-hot ``dense`` or ``ragged``) at one forced mesh (None: the
    search's pick): the compiled step's all-gathers per MoE layer beside the cost
    model's (and, for ``ragged``, its reduce-scatters over ep: their count and bytes)."""
    config, model, plan, step = _traced_step(force, 8, dispatch, seq=8)
    layers, ep = config.num_hidden_layers, plan.layout.ep
    found_all = hlo.collectives(step.as_text())
    gathers = [c for c in found_all if c.kind == "all-gather"]
    found = [c for c in gathers if c.group_size == ep]  # over the ep group
    others = sum(c.weight * c.bytes for c in gathers if c.group_size != ep) / layers
    measured = sum(c.weight * c.bytes for c in found) / layers
    predicted = plan.chosen.collectives.all_gather / layers
    scattered = [c for c in found_all if c.kind == "reduce-scatter" and c.group_size == ep]
    summed = sum(c.weight * c.bytes for c in scattered) / layers
    summed_predicted = plan.chosen.collectives.reduce_scatter / layers
    mlp = model.model.layers[0].mlp
    kernels = _expert_kernels(mlp)
    whole = any(c.bytes >= min(w[...].nbytes for w in kernels) for c in gathers)  # any group
    local = sum(w[...].addressable_shards[0].data.nbytes for w in kernels)
    tags = ([] if force else ["searched"]) + (["gpt-oss gather"] if dispatch == "gather" else [])
    row = [
        plan.layout.name + (f" ({', '.join(tags)})" if tags else ""),
        f"{sum(c.weight for c in found) / layers:g}", f"{int(measured)}", f"{int(predicted)}",
        f"{measured / predicted:.3f}" if predicted else "-", f"{int(others)}",
        "yes" if whole else "no",
        f"{local / sum(w[...].nbytes for w in kernels):.3f}",
    ]  # fmt: skip
    if dispatch in ("ragged", "gather"):
        row[5:5] = [
            f"{sum(c.weight for c in scattered) / layers:g}", f"{int(summed)}",
            f"{int(summed_predicted)}",
            f"{summed / summed_predicted:.3f}" if summed_predicted else "-",
        ]  # fmt: skip
    return row


MEMORY_ROWS = (  # (forced mesh, batch of 32-token sequences, dispatch)
    ({"ep": 8}, 64, "capacity"), ({"ep": 8}, 32, "capacity"), ({"ep": 8}, 16, "capacity"),
    ({"dp": 2, "ep": 4}, 64, "capacity"), ({"dp": 2, "ep": 4}, 32, "capacity"),
    ({"dp": 4, "ep": 2}, 32, "capacity"), ({"dp": 8}, 32, "capacity"),
    ({"ep": 8}, 32, "dense"), ({"dp": 2, "ep": 4}, 32, "dense"), ({"dp": 8}, 32, "dense"),
)  # fmt: skip
RAGGED_MEMORY_ROWS = (  # (forced mesh, batch of 32-token sequences): fitted, then held out
    ({"dp": 8}, 32), ({"ep": 8}, 32), ({"ep": 8}, 64), ({"dp": 2, "ep": 4}, 32),
    ({"dp": 2, "ep": 4}, 64), ({"dp": 4, "ep": 2}, 64), ({"dp": 8}, 64),
)  # fmt: skip


def memory_row(force: dict, batch: int, dispatch: str) -> list[str]:
    """A traced einsum dispatch's compiled step (argument + temp bytes a device) beside the
    cost model's total (its capacity terms read off two rows, the rest held out)."""
    _, _, plan, step = _traced_step(force, batch, dispatch)
    mem = step.memory_analysis()
    compiled = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    predicted = plan.chosen.memory.total
    mib = 2**20
    return [
        plan.layout.name, dispatch, f"{batch * 32}", f"{compiled / mib:.2f}",
        f"{predicted / mib:.2f}", f"{predicted / compiled:.2f}",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows = [row(*layout, *cap) for layout in LAYOUTS for cap in CAPACITIES]
    ring = [ring_row(force) for force in (*RING_LAYOUTS, None)]
    memory = [memory_row(*r) for r in MEMORY_ROWS]
    ragged_ring = [ring_row(force, "ragged") for force in (*RING_LAYOUTS, None)]
    ragged_ring += [ring_row(force, "gather") for force in (*RING_LAYOUTS, None)]
    ragged_memory = [memory_row(force, batch, "ragged") for force, batch in RAGGED_MEMORY_ROWS]
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
        "",
        "### A traced model's own one-hot dispatch over ep (`to_distributed`)",
        "",
        f"- model: the `qwen3_moe` style (`Qwen3MoeForCausalLM`, 8 experts of width {RING_FFN}, "
        "top 2, 2 layers, every expert on every token, one-hot combine), batch 8 x 8; "
        "`to_distributed` with the mesh forced, or searched (last row)",
        "- per MoE layer: all-gathers over the ep group in the compiled HLO and their bytes, "
        "beside the cost model's (`ring_exchange_time`: the layer's input forward, its "
        "output's cotangent backward, `ep x T x D` each); the bytes of the step's other "
        "all-gathers (over dp: the model's own load-balancing loss takes every layer's "
        "router logits over the whole batch, which the cost model does not price); whether "
        "an expert stack is all-gathered; the experts' share held per device",
        "",
        "| layout | all-gathers over ep | bytes | predicted | ratio | other all-gather bytes "
        "| expert stack gathered | share |",
        "|---|---|---|---|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in ring),
        "",
        "### A traced einsum dispatch's memory (`capacity_memory`)",
        "",
        f"- model: the `qwen3_moe` style, experts of width {RING_FFN}, every expert on every "
        "token (`dense`) or GShard's capacity rule over the whole batch with factor 1.0 "
        "(`capacity`: one-hot `[T, E, C]` dispatch and combine tensors, quadratic in the "
        "tokens); sequences of 32; `to_distributed` with the mesh forced",
        "- compiled: argument + temp bytes of one device's training step; predicted: the "
        "cost model's total. `cost_moe.SLOT_TENSORS` (3 `[T, E, C]` tensors a layer) was "
        "read off the first row and `cost_moe.SLOT_OVER_EP` (the share split over ep alone, "
        "not over the dp ranks that split the capacity rule's tokens) off the dp8 capacity "
        "row; the rest are held out",
        "",
        "| layout | dispatch | tokens | compiled MiB | predicted MiB | ratio |",
        "|---|---|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in memory),
        "",
        "### A traced ragged_dot dispatch over ep (`ragged_ring`, `ragged_memory`)",
        "",
        f'- model: the `qwen3_moe` style with `dispatch="ragged"` (token copies sorted by '
        f"expert, `jax.lax.ragged_dot` per projection), and the `gpt_oss` style (each "
        "token's experts' weights gathered, `w[expert_indices]`), experts of width "
        f"{RING_FFN}; "
        "`to_distributed` with the mesh forced, or searched (marked): each MoE layer runs "
        "in a shard_map (`jfleet.auto_parallel.apply.expert_rows`), its tokens all-gathered "
        "over ep and its output reduce-scattered, each rank's ragged_dots restricted to its "
        "experts' rows (gpt-oss's products with gathered weights run as such ragged_dots of "
        "the token copies sorted by expert)",
        "- per MoE layer (batch 8 x 8): all-gathers and reduce-scatters over the ep group and "
        "their bytes beside `ring_exchange_time`'s; other all-gather bytes; whether an "
        "expert stack is gathered; the experts' share per device",
        "",
        "| layout | all-gathers over ep | bytes | predicted | ratio | reduce-scatters over ep "
        "| bytes | predicted | ratio | other all-gather bytes | expert stack gathered | share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in ragged_ring),
        "",
        "- memory (sequences of 32): compiled argument + temp bytes of one device's training "
        "step beside the cost model's total. `cost_moe.CPU_RAGGED_PRODUCTS` (XLA:CPU computes "
        "a ragged_dot as one product per group over every row) was read off the dp8 row at "
        "1024 tokens, then `cost_moe.RING_ROW_BUFFERS` off the ep8 row at 1024 tokens; the "
        "rest are held out",
        "",
        "| layout | dispatch | tokens | compiled MiB | predicted MiB | ratio |",
        "|---|---|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in ragged_memory),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        write_section("moe_exchange", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compile scaling: a non-pipelined ``to_distributed`` step with scanned vs unrolled blocks.

Run from the repository root (8 emulated CPU devices; a few minutes on 2 cores)::

    python benchmarks/compile_scaling.py             # prints the tables, writes RESULTS.md
    python benchmarks/compile_scaling.py --no-write  # print only

A Llama-style model (``TinyLlama``, width 128, 8 heads / 4 kv heads, batch 16 x 64
tokens) goes through ``to_distributed`` on dp 8, its decoder blocks scanned (the default,
:class:`~jfleet.auto_parallel.apply.scanned_blocks.ScannedBlocks`) or unrolled
(``ToDistributedConfig(scan_layers=False)``), and the engine's training step
(``make_train_step(lm_loss)``, Adam) is lowered and compiled for 2, 4, 8, 16 and 32
blocks. The table gives the compiled HLO's instruction count
(:func:`jfleet.testing.hlo.instruction_count`), the seconds to trace, lower and compile
(and their ratio to the 2-block step of the same kind, measured in this process) and the
compiled temporary memory per device (``memory_analysis().temp_size_in_bytes``).

A second table measures recompute at the issue's size (width 128, batch 32 x 128, 4
blocks, dp 8): compiled temp memory and loop-weighted dot FLOPs
(:func:`jfleet.testing.hlo.dot_flops`) without and with ``recompute=True``, scanned
(``jax.checkpoint`` of each scanned block) and unrolled (``nnx.remat`` around each block).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)

# isort: split
import optax

from benchmarks.results_file import environment, write_section
from jfleet import fleet, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, to_distributed
from jfleet.auto_parallel.apply.scanned_blocks import ScannedBlocks
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.testing import hlo

SECTION = "compile_scaling"
BLOCKS = (2, 4, 8, 16, 32)
KINDS = {"scanned": True, "unrolled": False}
MiB = 2**20


def measure(
    blocks: int, scan: bool, *, batch: int = 16, seq: int = 64, recompute: bool = False
) -> dict:
    """One compiled dp8 step: instructions, seconds, temp bytes, dot FLOPs."""
    fleet._reset()
    config = ToDistributedConfig(force_mesh={"dp": 8}, scan_layers=scan, recompute=recompute)
    model, opt, loader = to_distributed(
        TinyLlama(vocab=256, width=128, heads=8, kv_heads=4, layers=blocks),
        optax.adam(1e-3),
        lm_batches(1, batch=batch, seq=seq, vocab=256),
        config=config,
    )
    if isinstance(model.layers, ScannedBlocks) != scan:
        raise RuntimeError(f"asked for scan_layers={scan}, got {type(model.layers).__name__}")
    data = next(iter(loader))
    start = time.perf_counter()
    compiled = make_train_step(lm_loss).lower(model, opt, data).compile()
    seconds = time.perf_counter() - start
    text = compiled.as_text()
    return {
        "instructions": hlo.instruction_count(text),
        "seconds": seconds,
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "flops": hlo.dot_flops(text),
    }


def scaling() -> dict:
    """``{kind: {blocks: row}}`` for every kind and depth (the 2-block steps first)."""
    measure(BLOCKS[0], True)  # warm-up: the process's first compile pays one-off costs
    return {kind: {n: measure(n, scan) for n in BLOCKS} for kind, scan in KINDS.items()}


def recompute_rows() -> dict:
    """``{(kind, recompute): row}`` at width 128, batch 32 x 128, 4 blocks."""
    return {
        (kind, remat): measure(4, scan, batch=32, seq=128, recompute=remat)
        for kind, scan in KINDS.items()
        for remat in (False, True)
    }


def render(rows: dict, remat: dict, command: str) -> str:
    lines = [
        "# Compile scaling: scanned vs unrolled decoder blocks (non-pipelined `to_distributed`)",
        "",
        *environment(command),
        "- model: `TinyLlama(vocab=256, width=128, heads=8, kv_heads=4, layers=N)`, Adam, "
        "batch 16 x 64 tokens, `to_distributed` forced to dp 8; the engine's step "
        "(`make_train_step(lm_loss)`) lowered and compiled once per row",
        "- instructions: every instruction of the compiled HLO once "
        "(`jfleet.testing.hlo.instruction_count`); seconds: trace + lower + compile, and "
        "the ratio to the 2-block step of the same kind; temp: compiled temporary memory "
        "per device",
        "",
        "| blocks | scanned instructions | unrolled instructions | scanned s (x 2 blocks) "
        "| unrolled s (x 2 blocks) | scanned temp MiB | unrolled temp MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    s0, u0 = rows["scanned"][BLOCKS[0]], rows["unrolled"][BLOCKS[0]]
    for n in BLOCKS:
        s, u = rows["scanned"][n], rows["unrolled"][n]
        lines.append(
            f"| {n} | {s['instructions']:,} | {u['instructions']:,} | "
            f"{s['seconds']:.2f} ({s['seconds'] / s0['seconds']:.2f}x) | "
            f"{u['seconds']:.2f} ({u['seconds'] / u0['seconds']:.2f}x) | "
            f"{s['temp'] / MiB:.2f} | {u['temp'] / MiB:.2f} |"
        )
    s32, s4 = rows["scanned"][32], rows["scanned"][4]
    lines += [
        "",
        f"Scanned, 32 blocks / 4 blocks: {s32['instructions'] / s4['instructions']:.3f}x the "
        "instructions (the issue's bound: 1.2x). Without recompute each scanned block runs "
        "under `jax.checkpoint(policy=dots_saveable)`: its matmul outputs are kept as "
        "stacked `[blocks, ...]` arrays and only elementwise work is redone in the backward "
        "(the same dot FLOPs); a plain scan, keeping every residual, measured 84.8 MiB temp "
        "at 32 blocks against the unrolled step's 61.3.",
        "",
        "## Recompute inside the scan (width 128, batch 32 x 128, 4 blocks, dp 8)",
        "",
        "| blocks run | recompute | temp MiB | dot GFLOP (loop-weighted) |",
        "|---|---|---|---|",
    ]
    for (kind, on), row in remat.items():
        lines.append(
            f"| {kind} | {'yes' if on else 'no'} | {row['temp'] / MiB:.1f} | "
            f"{row['flops'] / 1e9:.3f} |"
        )
    s_off, s_on = remat[("scanned", False)], remat[("scanned", True)]
    u_off, u_on = remat[("unrolled", False)], remat[("unrolled", True)]
    lines += [
        "",
        f"Recompute as `jax.checkpoint` of each scanned block takes temp from "
        f"{s_off['temp'] / MiB:.1f} to {s_on['temp'] / MiB:.1f} MiB "
        f"({s_on['temp'] / s_off['temp']:.2f}x) for {s_on['flops'] / s_off['flops']:.2f}x the "
        f"dot FLOPs; `nnx.remat` around unrolled blocks only from {u_off['temp'] / MiB:.1f} to "
        f"{u_on['temp'] / MiB:.1f} MiB ({u_on['temp'] / u_off['temp']:.2f}x) on XLA:CPU (its "
        "optimization barriers are gone from the compiled HLO). Measured on CPU only.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    section = render(scaling(), recompute_rows(), "python benchmarks/compile_scaling.py")
    print(section)
    if not args.no_write:
        print(f"written to {write_section(SECTION, section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tensor and sequence parallel: per-block collective bytes beside Megatron's formula.

Run from the repository root (8 emulated CPU devices; about 20 s on 2 cores)::

    python benchmarks/tensor_parallel.py            # prints the table, writes the results
    python benchmarks/tensor_parallel.py --no-write

It builds one transformer block, :class:`jfleet.models.parallel_gpt.GPTBlock` from jfleet's
tensor-parallel layers (column-parallel fused qkv and MLP up projection, row-parallel
attention output and MLP down projection; with sequence parallel their
``*SequenceParallelLinear`` forms), on a ``dp 2 x mp 4`` mesh, compiles (never runs) three
programs of it and counts the collectives in the compiled HLO (:mod:`jfleet.testing.hlo`):

* ``forward``: ``block(x)``;
* ``forward + backward``: ``jax.vjp(block, params, x)`` applied to a cotangent ``g`` that is
  an input of the program, as the layer above would hand it down in a stack of blocks;
  returns the output and the gradients of parameters and input;
* ``value_and_grad(sum)``: ``jax.value_and_grad(lambda p, x: block(p, x).sum())``, the
  block alone under a scalar loss.

Inputs are laid out as between blocks: ``[b, s, h]`` split over the data axes on ``b``,
and with sequence parallel over ``mp`` on ``s``.

Megatron's figure (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", MLSys 2023, arXiv:2205.05198, Sec. 4.2.2): per layer, tensor parallel
runs 2 all-reduces in the forward pass (attention output, MLP output) and 2 in the backward
pass (the gradients of the attention and MLP inputs), each of one ``[s, b, h]`` activation,
so ``4 b s h`` elements, ``4 b s h x bytes-per-element``; sequence parallel replaces each
all-reduce by an all-gather and a reduce-scatter of the same buffer (a ring all-reduce *is*
a reduce-scatter followed by an all-gather), so the same volume. Here ``b`` is the batch one
tensor-parallel group processes: the **per-data-parallel-replica batch** (global batch /
dp), and ``s`` the full sequence.

Bytes are jfleet.testing.hlo's ``bytes``: the full buffer of each collective per execution (the
array of an all-reduce, the input of a reduce-scatter, the output of an all-gather),
summed; "all-reduce units" count an all-gather + reduce-scatter pair of ``B`` bytes as one
all-reduce of ``B``, the accounting of Megatron's figure. Ring bytes sent per device
(``wire_bytes``: ``2 (n-1)/n B`` for an all-reduce, ``(n-1)/n B`` for the others) are shown
beside them.

The results go to a section of ``benchmarks/RESULTS.md`` between markers (replaced on each
run; the other sections are kept) when that file exists, else to
``benchmarks/TENSOR_PARALLEL_RESULTS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)

# isort: split
import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.results_file import write_section
from jfleet import DistributedStrategy, fleet
from jfleet.models.parallel_gpt import GPTBlock, TinyGPT
from jfleet.testing import hlo

MiB = 2**20
HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- tensor_parallel: begin -->", "<!-- tensor_parallel: end -->"

FORWARD = "forward"
VJP = "forward + backward"
SUM = "value_and_grad(sum)"
PROGRAMS = (FORWARD, VJP, SUM)
LAYOUTS = {"TP": False, "TP + SP": True}


@dataclasses.dataclass(frozen=True)
class Config:
    """One block and mesh. ``batch`` is Megatron's ``b``: the batch per data-parallel replica."""

    dp: int = 2
    mp: int = 4
    batch: int = 8
    seq: int = 128
    width: int = 256
    heads: int = 8
    ffn: int = 4
    dtype: str = "float32"

    @property
    def global_batch(self) -> int:
        """The batch of the whole program: ``dp x batch`` rows."""
        return self.dp * self.batch

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one activation element."""
        return jnp.dtype(self.dtype).itemsize

    @property
    def activation_bytes(self) -> int:
        """One ``[b, s, h]`` activation of a tensor-parallel group: ``b s h x bytes``."""
        return self.batch * self.seq * self.width * self.bytes_per_element

    def megatron_bytes(self, program: str) -> int:
        """Megatron's per-layer bytes (all-reduce units): ``2 b s h`` forward, else ``4 b s h``."""
        return (2 if program == FORWARD else 4) * self.activation_bytes


@dataclasses.dataclass(frozen=True)
class Measurement:
    """The collectives of one compiled program, split by replica groups.

    Attributes:
      layout: ``"TP"`` or ``"TP + SP"``.
      program: one of :data:`PROGRAMS`.
      activation_bytes: one ``[b, s, h]`` activation (:attr:`Config.activation_bytes`).
      mp: the collectives over the mp groups whose buffer holds at least one ``[b, s, h]``
        activation (the tensor-parallel traffic Megatron counts).
      mp_small: the other collectives over the mp groups (with sequence parallel: the
        gradients of the norms and row-parallel biases, which act on sequence-split
        activations and are summed over mp).
      other: collectives over other groups (the gradients' all-reduce over dp).
      temp_bytes: ``memory_analysis().temp_size_in_bytes`` per device.
    """

    layout: str
    program: str
    activation_bytes: int
    mp: tuple[hlo.Collective, ...]
    mp_small: tuple[hlo.Collective, ...]
    other: tuple[hlo.Collective, ...]
    temp_bytes: int

    def bytes(self, kind: str) -> int:
        """Summed buffer bytes of the mp activation collectives of ``kind``."""
        return sum(c.weight * c.bytes for c in self.mp if c.kind == kind)

    def count(self, kind: str) -> int:
        """Executions of the mp activation collectives of ``kind`` (a combined one counts once)."""
        return sum(c.weight for c in self.mp if c.kind == kind)

    def buffers(self, kind: str) -> float:
        """:meth:`bytes` in ``[b, s, h]`` activations (a combined all-reduce holds several)."""
        return self.bytes(kind) / self.activation_bytes

    @property
    def all_reduce_units(self) -> float:
        """All-reduce bytes + (all-gather + reduce-scatter bytes) / 2: Megatron's accounting."""
        pairs = self.bytes("all-gather") + self.bytes("reduce-scatter")
        return self.bytes("all-reduce") + pairs / 2

    @property
    def wire_bytes(self) -> float:
        """Ring bytes one device sends for the mp activation collectives."""
        return sum(c.weight * c.wire_bytes for c in self.mp)

    @property
    def sliced_bytes(self) -> int:
        """All-reduce bytes read only through a dynamic-slice (a decomposed reduce-scatter)."""
        return sum(c.weight * c.sliced_bytes for c in self.mp)

    @property
    def small_bytes(self) -> int:
        """Summed buffer bytes of :attr:`mp_small`."""
        return sum(c.weight * c.bytes for c in self.mp_small)

    @property
    def other_bytes(self) -> int:
        """Summed buffer bytes of :attr:`other`."""
        return sum(c.weight * c.bytes for c in self.other)


def _init(cfg: Config) -> jax.sharding.Mesh:
    fleet._reset()
    strategy = DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": cfg.dp, "mp_degree": cfg.mp}
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    return fleet.get_hybrid_communicate_group().mesh


def block(cfg: Config, sequence_parallel: bool) -> GPTBlock:
    """Block 0 of a one-block tensor-parallel TinyGPT on the fleet mesh (``fleet.init`` first)."""
    gpt = TinyGPT(
        vocab=8 * cfg.mp,
        width=cfg.width,
        heads=cfg.heads,
        layers=1,
        hidden=cfg.ffn * cfg.width,
        tensor_parallel=True,
        sequence_parallel=sequence_parallel,
    )
    return gpt.blocks[0]


def compile_program(cfg: Config, sequence_parallel: bool, program: str) -> jax.stages.Compiled:
    """The compiled ``program`` of one block (inputs as abstract, sharded shapes)."""
    mesh = _init(cfg)
    graphdef, params = nnx.split(block(cfg, sequence_parallel))
    # between blocks: batch split over the data axes, sequence over mp with sequence parallel
    sharding = NamedSharding(mesh, P(("dp", "sharding"), "mp" if sequence_parallel else None))
    x = jax.ShapeDtypeStruct(
        (cfg.global_batch, cfg.seq, cfg.width), jnp.dtype(cfg.dtype), sharding=sharding
    )

    def forward(params, x):
        return nnx.merge(graphdef, params)(x)

    if program == FORWARD:
        fn, args = forward, (params, x)
    elif program == VJP:

        def fn(params, x, g):
            out, pullback = jax.vjp(forward, params, x)
            return out, pullback(g)

        args = (params, x, x)
    elif program == SUM:

        def fn(params, x):
            return jax.value_and_grad(lambda p, x: jnp.sum(forward(p, x)), argnums=(0, 1))(
                params, x
            )

        args = (params, x)
    else:
        raise ValueError(f"program={program!r} is not one of {PROGRAMS}.")
    return jax.jit(fn).lower(*args).compile()


def measure(cfg: Config, layout: str, program: str) -> Measurement:
    """Compiles ``program`` for ``layout`` (a key of :data:`LAYOUTS`) and sorts its collectives."""
    compiled = compile_program(cfg, LAYOUTS[layout], program)
    mesh = fleet.get_hybrid_communicate_group().mesh
    mp_groups = {tuple(int(d) for d in row) for row in mesh.device_ids.reshape(-1, cfg.mp)}
    found = hlo.collectives(compiled.as_text())
    fleet._reset()

    def on_mp(c: hlo.Collective) -> bool:
        return c.groups is not None and {tuple(g) for g in c.groups} == mp_groups

    return Measurement(
        layout=layout,
        program=program,
        activation_bytes=cfg.activation_bytes,
        mp=tuple(c for c in found if on_mp(c) and c.bytes >= cfg.activation_bytes),
        mp_small=tuple(c for c in found if on_mp(c) and c.bytes < cfg.activation_bytes),
        other=tuple(c for c in found if not on_mp(c)),
        temp_bytes=compiled.memory_analysis().temp_size_in_bytes,
    )


def run(cfg: Config, programs: tuple[str, ...] = PROGRAMS, log=lambda _: None) -> list[Measurement]:
    """One :class:`Measurement` per (program, layout)."""
    out = []
    for program in programs:
        for layout in LAYOUTS:
            start = time.perf_counter()
            out.append(measure(cfg, layout, program))
            log(f"  {layout:<8} {program:<20} {time.perf_counter() - start:5.1f} s")
    return out


# ------------------------------------------------------------------ report
def _mib(n: float) -> str:
    return f"{n / MiB:.3f}"


def _kinds(m: Measurement) -> str:
    parts = []
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
        if m.count(kind):
            ops = f" in {m.count(kind)} ops" if m.count(kind) != m.buffers(kind) else ""
            parts.append(f"{m.buffers(kind):g} x {kind}{ops}: {_mib(m.bytes(kind))}")
    return "; ".join(parts) or "-"


def table(cfg: Config, rows: list[Measurement]) -> str:
    """The Markdown table of the measurements."""
    head = (
        "| layout | program | mp collectives of activations: k x kind ([b, s, h] buffers): MiB "
        "| all-reduce units (MiB) | Megatron (MiB) | measured / Megatron "
        "| ring bytes sent per device (MiB) | small mp all-reduces (KiB) "
        "| dp all-reduce (MiB) | temp (MiB) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for m in rows:
        formula = cfg.megatron_bytes(m.program)
        small = f"{m.small_bytes / 1024:.2f}" if m.mp_small else "-"
        other = _mib(m.other_bytes) if m.other else "-"
        lines.append(
            f"| {m.layout} | {m.program} | {_kinds(m)} | {_mib(m.all_reduce_units)} "
            f"| {_mib(formula)} | {m.all_reduce_units / formula:.3f} | {_mib(m.wire_bytes)} "
            f"| {small} | {other} | {_mib(m.temp_bytes)} |"
        )
    return head + "\n".join(lines) + "\n"


def _reading(cfg: Config, rows: list[Measurement]) -> list[str]:
    """How to read the table, with the numbers taken from the measurements."""
    by = {(m.layout, m.program): m for m in rows}
    out = []
    tp, sp = by.get(("TP", VJP)), by.get(("TP + SP", VJP))
    if tp:
        ops = tp.count("all-reduce")
        note = (
            f" in {ops} all-reduce ops (XLA combines some into one tuple all-reduce; the bytes "
            "are unchanged)"
            if ops != tp.buffers("all-reduce")
            else ""
        )
        out.append(
            f"Tensor parallel, forward + backward: {tp.buffers('all-reduce'):g} all-reduces of "
            f"one b s h activation{note}, {tp.all_reduce_units / cfg.megatron_bytes(VJP):.3f} x "
            "Megatron's 4 b s h: 2 in the forward pass (attention output, MLP output), 2 in the "
            "backward pass (gradients of the qkv and MLP-up inputs)."
        )
    if tp and sp:
        out.append(
            f"Sequence parallel, forward + backward: {sp.buffers('all-gather'):g} all-gathers + "
            f"{sp.buffers('reduce-scatter'):g} reduce-scatters of the same b s h buffer. The "
            f"summed buffers double ({_mib(tp.bytes('all-reduce'))} -> "
            f"{_mib(sp.bytes('all-gather') + sp.bytes('reduce-scatter'))} MiB); the volume in "
            f"all-reduce units ({_mib(sp.all_reduce_units)} MiB) and the ring bytes each device "
            f"sends ({_mib(sp.wire_bytes)} vs {_mib(tp.wire_bytes)} MiB) equal tensor "
            "parallel's, as the paper says. They are real all-gathers and reduce-scatters even "
            "on CPU (the sequence-parallel layers issue them inside `shard_map`), not "
            f"all-reduce + dynamic-slice (sliced bytes: {sp.sliced_bytes})."
        )
        out.append(
            f"Sequence parallel also all-reduces {sp.small_bytes / 1024:.2f} KiB over mp "
            f"({sp.small_bytes // cfg.bytes_per_element // cfg.width} x h values: the two "
            "LayerNorms' scale and bias and the two row-parallel biases act on sequence-split "
            "activations, so each rank holds a partial gradient): O(h) beside the O(b s h) "
            "activations, and not in Megatron's figure."
        )
        out.append(
            f"Temp memory per device (`memory_analysis()`): {_mib(tp.temp_bytes)} MiB under TP, "
            f"{_mib(sp.temp_bytes)} MiB under SP for forward + backward, where the norms, "
            "residuals and their gradients are `[b, s/mp, h]` under SP."
        )
    tsum, ssum = by.get(("TP", SUM)), by.get(("TP + SP", SUM))
    if tsum and ssum:
        out.append(
            f"`value_and_grad(sum)`: tensor parallel again {tsum.buffers('all-reduce'):g} "
            f"all-reduces; sequence parallel {ssum.buffers('all-gather'):g} all-gathers + "
            f"{ssum.buffers('reduce-scatter'):g} reduce-scatters, "
            f"{ssum.all_reduce_units / cfg.megatron_bytes(SUM):.3f} x the figure: the cotangent "
            "of the block output is a constant (ones), so XLA folds away the backward all-gather "
            "of the MLP output's reduce-scatter. Inside a model the cotangent comes from the "
            "layer above and that all-gather is there (`forward + backward`)."
        )
    return out


def report(cfg: Config, rows: list[Measurement], command: str) -> str:
    """The results section: header lines, the table and how to read it."""
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    b, s, h, n = cfg.batch, cfg.seq, cfg.width, cfg.mp
    bpe = cfg.bytes_per_element
    groups = fleet_groups(cfg)
    return (
        f"{BEGIN}\n"
        "# Tensor and sequence parallel: collective bytes per transformer block\n\n"
        f"- command: `{command}`\n"
        f"- date: {date}\n"
        f"- versions: jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, "
        f"Python {platform.python_version()}\n"
        f"- machine: {platform.machine()}, nproc {os.cpu_count()}, {jax.device_count()} "
        "emulated CPU devices\n"
        "- block: `jfleet.models.parallel_gpt.GPTBlock("
        f"h={h}, heads={cfg.heads}, hidden={cfg.ffn * h})` "
        "from jfleet's tensor-parallel layers (pre-norm; fused qkv and MLP up column-parallel, "
        f"attention output and MLP down row-parallel), {cfg.dtype} ({bpe} bytes per element); "
        f"dp {cfg.dp} x mp {n}; global batch {cfg.global_batch}, so **b = {b} per data-parallel "
        f"replica** (the batch one mp group of {n} devices processes), s = {s}, h = {h}: one "
        f"`[b, s, h]` activation is {_mib(cfg.activation_bytes)} MiB (per device "
        f"`[{b}, {s}, {h}]` under TP, `[{b}, {s // n}, {h}]` under SP)\n"
        f"- Megatron's figure: 4 b s h x {bpe} = {_mib(cfg.megatron_bytes(VJP))} MiB per layer, "
        f"forward + backward (forward alone: 2 b s h x {bpe} = "
        f"{_mib(cfg.megatron_bytes(FORWARD))} MiB); Korthikanti et al., *Reducing Activation "
        "Recomputation in Large Transformer Models* (arXiv:2205.05198), Sec. 4.2.2\n"
        "- programs (compiled, not run): `forward` = `block(x)`; `forward + backward` = "
        "`jax.vjp(block, params, x)` applied to a cotangent that is a program input (the block "
        "inside a stack); `value_and_grad(sum)` = gradients of `block(x).sum()`\n\n"
        + table(cfg, rows)
        + "\nBytes are `jfleet.testing.hlo`'s plain `bytes` (the full buffer of each collective "
        f"per execution), summed over the collectives on the mp groups {groups} whose buffer holds "
        "at least one `[b, s, h]` activation; `k x kind` counts those buffers (a combined "
        "all-reduce of two is `2 x all-reduce in 1 ops`). *All-reduce units* count an "
        "all-gather + reduce-scatter pair of B bytes as one all-reduce of B (a ring all-reduce "
        "is exactly that pair), the accounting of Megatron's figure, which the ratio column "
        "uses. *Ring bytes sent per device* is `wire_bytes` (all-reduce 2(n-1)/n B, all-gather "
        "and reduce-scatter (n-1)/n B), for reference. *Small mp all-reduces* are parameter "
        "gradients, not activations; *dp all-reduce* is the parameter gradients' reduction "
        "over dp (the per-device parameter bytes).\n\n"
        "Reading:\n\n" + "".join(f"* {line}\n" for line in _reading(cfg, rows)) + f"{END}\n"
    )


def fleet_groups(cfg: Config) -> list[list[int]]:
    """The mp groups of a ``dp x mp`` mesh (mp innermost): device ids per group."""
    return [list(range(g * cfg.mp, (g + 1) * cfg.mp)) for g in range(cfg.dp)]


def write(section: str, results: Path | None = None) -> Path:
    """Replaces (or appends) this benchmark's section of RESULTS.md."""
    return write_section("tensor_parallel", section, results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=Config.batch, help="b per dp replica")
    parser.add_argument("--seq", type=int, default=Config.seq, help="s")
    parser.add_argument("--width", type=int, default=Config.width, help="h")
    parser.add_argument("--heads", type=int, default=Config.heads, help="attention heads")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    if jax.device_count() < 8:
        print(f"need 8 devices, have {jax.device_count()}", file=sys.stderr)
        return 1
    cfg = Config(batch=args.batch, seq=args.seq, width=args.width, heads=args.heads)
    start = time.perf_counter()
    rows = run(cfg, log=lambda message: print(message, file=sys.stderr, flush=True))
    command = (
        "python benchmarks/tensor_parallel.py"
        + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    )
    section = report(cfg, rows, command)
    print(section)
    if not args.no_write:
        print(f"written to {write(section)}", file=sys.stderr)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

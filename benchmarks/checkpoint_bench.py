"""Checkpoint cost: save and restore time, bytes on disk, and async save's step slowdown.

Run from the repository root (8 emulated CPU devices; about four minutes on 2 cores)::

    python benchmarks/checkpoint_bench.py             # prints the table, writes RESULTS.md
    python benchmarks/checkpoint_bench.py --no-write  # print only
    python benchmarks/checkpoint_bench.py --checksums # the checksums' cost (about 3 minutes)

For two sizes of ``jfleet.models.llama.TinyLlama`` (the size of ``examples/resume.py`` and
a wider, deeper one) with ``optax.adam``, trained and saved on the example's mesh
(dp2 x pp2 x mp2, pipelined) and restored onto dp8, and the reverse, it measures with
``jfleet.checkpoint.CheckpointManager``:

* bytes on disk of one checkpoint (model + Adam state + loader position + description);
* a synchronous save (``async_save=False``: ``save`` returns when the files are written);
* an async save: the time ``save`` blocks the caller (device-to-host copy), and the training
  steps run while its files are written, as the ratio of their median time to the median
  of steps without a save in flight, measured alternately in the same process;
* restore in place onto the same mesh, and onto the other (a fresh ``to_distributed`` model).

``--checksums`` measures instead what the per-leaf checksums (``jfleet.checkpoint.integrity``)
add: synchronous save and same-mesh restore with them and with them turned off, alternated
in one process, on dp8 (its own section of RESULTS.md).

Times are medians of ``--repeats`` runs. The 8 emulated devices and Orbax's writer threads
share the machine's cores, so the slowdown ratio is an upper bound of what an accelerator
sees (where the step runs on the device, not on the cores that write) and the absolute
times are those of this machine only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: CPU, 8 emulated devices, before JAX starts)

# isort: split
import jax
import optax
import orbax.checkpoint as ocp
from flax import nnx

from benchmarks.results_file import environment, write_section
from jfleet import ToDistributedConfig, make_train_step, to_distributed
from jfleet.checkpoint import CheckpointManager
from jfleet.checkpoint import manager as manager_module
from jfleet.models import lm_loss, stride_batches
from jfleet.models.llama import TinyLlama

SECTION = "checkpoint_bench"
CHECKSUM_SECTION = "checkpoint_checksums"
PIPELINED = {"dp": 2, "pp": 2, "mp": 2}  # examples/resume.py's mesh
FLAT = {"dp": 8}
#: (the mesh that trains and saves, the other mesh it is also restored onto)
MOVES = ((PIPELINED, FLAT), (FLAT, PIPELINED))
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    vocab: int
    width: int
    layers: int

    def model(self) -> TinyLlama:
        return TinyLlama(
            vocab=self.vocab, width=self.width, heads=8, kv_heads=4, layers=self.layers, seed=0
        )

    def describe(self) -> str:
        return (
            f"`TinyLlama(vocab={self.vocab}, width={self.width}, heads=8, kv_heads=4, "
            f"layers={self.layers})`"
        )


SIZES = (Size("example", 64, 64, 4), Size("wide", 512, 256, 8))


def mesh_name(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k}{v}" for k, v in mesh.items())


@dataclasses.dataclass
class Row:
    size: Size
    mesh: dict[str, int]
    other: dict[str, int]
    params: int
    disk_bytes: int
    save_s: float  # synchronous save, files written
    async_block_s: float  # what an async save blocks the caller for
    step_s: float  # median step without a save in flight
    saving_step_s: float  # median step while an async save writes
    saving_steps: int  # steps measured while saving (all repeats)
    restore_same_s: float
    restore_other_s: float

    @property
    def slowdown(self) -> float:
        return self.saving_step_s / self.step_s


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build(size: Size, mesh: dict[str, int], steps: int) -> tuple[Any, Any, Any]:
    return to_distributed(
        size.model(),
        optax.adam(1e-3),
        stride_batches(steps, vocab=size.vocab),
        config=ToDistributedConfig(force_mesh=mesh),
    )


def measure(size: Size, mesh: dict, other: dict, repeats: int, window: int, root: Path) -> Row:
    """One size trained and saved on ``mesh``, restored onto it and onto ``other``."""
    steps = 2 + repeats * (3 * window + 8)
    model, opt, loader = build(size, mesh, steps)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    batches = iter(loader)
    step = make_train_step(lm_loss)

    def one_step() -> float:
        return timed(lambda: float(step(model, opt, next(batches))))

    one_step(), one_step()  # compile, warm up

    with CheckpointManager(root / "sync", async_save=False) as mngr:
        save = [timed(lambda r=r: mngr.save(r, model, opt, loader=loader)) for r in range(repeats)]
    on_disk = disk_bytes(root / "sync" / "0")

    base: list[float] = []
    saving: list[float] = []
    block: list[float] = []
    with CheckpointManager(root / "async") as mngr:
        orbax_mngr: ocp.CheckpointManager = mngr._mngr  # is_saving_in_progress: Orbax's
        for r in range(repeats):
            base += [one_step() for _ in range(window)]
            block.append(timed(lambda r=r: mngr.save(r, model, opt, loader=loader)))
            for _ in range(window + 8):  # steps while the files are written
                if not orbax_mngr.is_saving_in_progress():
                    break
                saving.append(one_step())
            mngr.wait_until_finished()
            base += [one_step() for _ in range(window)]

    with CheckpointManager(root / "sync") as mngr:
        same = [timed(lambda: mngr.restore(model=model, optimizer=opt)) for _ in range(repeats)]
        model, opt, _ = build(size, other, steps)  # a fresh run on another mesh
        moved = [timed(lambda: mngr.restore(model=model, optimizer=opt)) for _ in range(repeats)]
    return Row(
        size=size,
        mesh=mesh,
        other=other,
        params=params,
        disk_bytes=on_disk,
        save_s=statistics.median(save),
        async_block_s=statistics.median(block),
        step_s=statistics.median(base),
        saving_step_s=statistics.median(saving) if saving else float("nan"),
        saving_steps=len(saving),
        restore_same_s=statistics.median(same),
        restore_other_s=statistics.median(moved),
    )


@dataclasses.dataclass
class ChecksumRow:
    size: Size
    params: int
    save_s: tuple[float, float]  # (with checksums, without)
    restore_s: tuple[float, float]
    checksum_s: tuple[float, float]  # (at save, at restore): time inside the checksums

    @property
    def growth(self) -> tuple[float, float]:
        """(save, restore) time with checksums over time without, minus 1."""
        return (
            self.save_s[0] / self.save_s[1] - 1,
            self.restore_s[0] / self.restore_s[1] - 1,
        )

    @property
    def share(self) -> tuple[float, float]:
        """(save, restore): the checksums' own time over the rest of the operation's."""
        return (
            self.checksum_s[0] / (self.save_s[0] - self.checksum_s[0]),
            self.checksum_s[1] / (self.restore_s[0] - self.checksum_s[1]),
        )


@contextlib.contextmanager
def _checksums(on: bool, spent: list[float]) -> Any:
    """Checksums as usual (their time appended to ``spent``), or none (every leaf's set
    empty at save and at restore)."""
    saved = manager_module.fingerprints

    def timed_checksums(flat: dict) -> dict:
        start = time.perf_counter()
        try:
            return saved(flat)
        finally:
            spent.append(time.perf_counter() - start)

    manager_module.fingerprints = timed_checksums if on else lambda flat: {}
    try:
        yield
    finally:
        manager_module.fingerprints = saved


def _restored(mngr: CheckpointManager, model: Any, opt: Any) -> None:
    """A restore, until the arrays are in place (not only dispatched)."""
    mngr.restore(model=model, optimizer=opt)
    jax.block_until_ready((nnx.state(model), nnx.state(opt)))


def measure_checksums(size: Size, repeats: int, root: Path) -> ChecksumRow:
    """Sync save and same-mesh restore with and without checksums, alternated, on dp8."""
    model, opt, loader = build(size, FLAT, 4)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    times: dict[tuple[str, bool], list[float]] = {}
    for r in range(repeats + 1):  # the first round warms up (compiles) and is dropped
        for on in (True, False) if r % 2 else (False, True):
            where, spent = root / f"{r}{on}", []
            with _checksums(on, spent), CheckpointManager(where, async_save=False) as mngr:
                save = timed(lambda m=mngr: m.save(0, model, opt, loader=loader))
                restore = timed(lambda m=mngr: _restored(m, model, opt))
            shutil.rmtree(where)
            if r:
                times.setdefault(("save", on), []).append(save)
                times.setdefault(("restore", on), []).append(restore)
            if r and on:
                times.setdefault(("checksum at save", on), []).append(spent[0])
                times.setdefault(("checksum at restore", on), []).append(spent[1])
    med = {k: statistics.median(v) for k, v in times.items()}
    return ChecksumRow(
        size,
        params,
        (med["save", True], med["save", False]),
        (med["restore", True], med["restore", False]),
        (med["checksum at save", True], med["checksum at restore", True]),
    )


def render_checksums(rows: list[ChecksumRow], repeats: int, command: str) -> str:
    lines = [
        "# Checkpoint checksums: what they add to save and restore",
        "",
        *environment(command, versions_extra=f"orbax-checkpoint {ocp.__version__}, "),
        f"- models: {'; '.join(f'{s.name}: {s.describe()}' for s in SIZES)}; fp32, "
        "`optax.adam`, on dp8; a checkpoint as in the table above",
        "- with: `CheckpointManager` as shipped (a 64-bit checksum per leaf, summed on the "
        "host over each distinct block once, stored in the step's description, recomputed "
        "and compared at restore); without: the same with every checksum set empty",
        f"- times: medians of {repeats} rounds, with and without alternated in one process "
        "(a first round, which compiles, dropped); save synchronous (`async_save=False`), "
        "restore in place onto the same mesh, until the arrays are ready",
        "- checksum time: the median time spent computing the checksums inside a save / "
        "restore with them, and its share: that time over the rest of the operation (the "
        "growth the checksums cause, measured directly; the end-to-end growth compares two "
        "noisy medians)",
        "",
        "| model | parameters | save with (s) | save without (s) | end-to-end growth "
        "| checksum time at save (s) | share | restore with (s) | restore without (s) "
        "| end-to-end growth | checksum time at restore (s) | share |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        (grow_save, grow_restore), (share_save, share_restore) = r.growth, r.share
        lines.append(
            f"| {r.size.name} | {r.params:,} | {r.save_s[0]:.3f} | {r.save_s[1]:.3f} "
            f"| {grow_save:+.1%} | {r.checksum_s[0]:.3f} | {share_save:.1%} "
            f"| {r.restore_s[0]:.3f} | {r.restore_s[1]:.3f} | {grow_restore:+.1%} "
            f"| {r.checksum_s[1]:.3f} | {share_restore:.1%} |"
        )
    worst = max(max(r.share) for r in rows)
    verdict = "within" if worst <= 0.10 else "above"
    lines += [
        "",
        f"* The checksums add at most {worst:.1%} to a save or a restore, {verdict} the 10% "
        "goal: each process reads each distinct block of each array once on the host (a "
        "replicated array once, not once per device) and does about four integer passes "
        "over it. The end-to-end columns differ by more than that, either sign: this "
        "machine's run-to-run noise (2 cores shared with other jobs).",
    ]
    return "\n".join(lines) + "\n"


def render(rows: list[Row], repeats: int, command: str) -> str:
    lines = [
        "# Checkpoints: save and restore time, bytes on disk, async save's step slowdown",
        "",
        *environment(command, versions_extra=f"orbax-checkpoint {ocp.__version__}, "),
        f"- models: {'; '.join(f'{s.name}: {s.describe()}' for s in SIZES)}; "
        f"fp32, `optax.adam`, batch 16 x 8 tokens, placed by `to_distributed` "
        "(`force_mesh`) on the saving mesh; on a pipelined mesh the decoder layers run "
        "stacked `[pp, layers/pp, ...]` and are stored per layer (unstacked on save, "
        "restacked on restore)",
        "- a checkpoint: parameters + Adam moments and count + the loader position + the run's "
        "description (`CheckpointManager.save(step, model, opt, loader=loader)`)",
        f"- times: medians of {repeats} runs; save (sync): `async_save=False`, until the files "
        "are written; async save blocks: the time `save` holds the caller with "
        "`async_save=True`; restore: `restore(model=..., optimizer=...)` in place, onto the "
        "saving mesh and onto the other mesh (a fresh `to_distributed` model)",
        "- step slowdown while saving: the median training step while an async save's files "
        "are being written over the median step without a save, alternated in the same "
        "process. The 8 emulated devices and Orbax's writer threads share the cores, so this "
        "is an upper bound of what an accelerator sees; within one run step times vary by "
        "1.1-2x, so only ratios well above that mean anything",
        "",
        "| model | parameters | saving mesh | on disk (MiB) | save, sync (s) "
        "| async save blocks (s) | step (s) | step while saving / step "
        "| steps measured while saving | restore, same mesh (s) | restore, other mesh (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.size.name} | {r.params:,} | {mesh_name(r.mesh)} | {r.disk_bytes / MiB:.2f} "
            f"| {r.save_s:.3f} | {r.async_block_s:.3f} | {r.step_s:.4f} | {r.slowdown:.2f} "
            f"| {r.saving_steps} | {r.restore_same_s:.3f} | {r.restore_other_s:.3f} "
            f"({mesh_name(r.other)}) |"
        )
    return "\n".join([*lines, "", *findings(rows)]) + "\n"


def findings(rows: list[Row]) -> list[str]:
    """What the table says, worded from its own numbers."""
    by = {(r.size.name, r.mesh is PIPELINED): r for r in rows}
    out = [
        "* On disk: fp32 weights and two Adam moments, 12 bytes per parameter, plus Orbax's "
        "metadata, the loader position and the run's description; Orbax compresses chunks "
        "(zstd), so a larger model can take a little less: "
        + "; ".join(
            f"{s.name} {by[s.name, False].disk_bytes / (12 * by[s.name, False].params):.2f} x "
            "12 bytes per parameter"
            for s in SIZES
        )
        + " (from dp8; the table has both meshes: the same arrays, the description differs).",
    ]
    for s in SIZES:
        flat, piped = by[s.name, False], by[s.name, True]
        slow = piped.save_s > 2 * flat.save_s
        out.append(
            f"* {s.name}: saving from the pipelined mesh takes {piped.save_s:.2f} s against "
            f"{flat.save_s:.2f} s from dp8, and restoring onto it {flat.restore_other_s:.2f} s "
            f"against {piped.restore_other_s:.2f} s onto dp8."
            + (
                " The difference is jfleet's mapping of the stacked `[pp, layers/pp, ...]` "
                "leaves to and from per-layer arrays (`jfleet.checkpoint.layout._unstack` / "
                "`_stack`, jitted per leaf shape and sharding and cached after the first "
                "call), not Orbax's writing."
                if slow
                else ""
            )
        )
        out.append(
            f"* {s.name}, async: `save` holds the caller {flat.async_block_s:.2f} s on dp8 "
            f"({flat.async_block_s / flat.save_s:.0%} of a synchronous save) and "
            f"{piped.async_block_s:.2f} s on the pipelined mesh (the unstacking runs before "
            "Orbax takes over). Steps while the files are written take "
            f"{flat.slowdown:.2f}x (dp8) and {piped.slowdown:.2f}x (pipelined) a step "
            "without a save; the writer threads take cores from the 8 emulated devices here."
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--repeats", type=int, default=3, help="runs per time (median)")
    parser.add_argument("--window", type=int, default=4, help="steps without saving per run")
    parser.add_argument("--checksums", action="store_true", help="the checksums' cost only")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="jfleet-ckpt-bench-"))
    if args.checksums:
        try:
            found = [measure_checksums(s, args.repeats, root / s.name) for s in SIZES]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        text = render_checksums(
            found, args.repeats, "python benchmarks/checkpoint_bench.py --checksums"
        )
        print(text)
        if not args.no_write:
            print(f"written to {write_section(CHECKSUM_SECTION, text)}", file=sys.stderr)
        return 0
    try:
        rows = [
            measure(size, mesh, other, args.repeats, args.window, root / f"{size.name}{i}")
            for size in SIZES
            for i, (mesh, other) in enumerate(MOVES)
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    section = render(rows, args.repeats, "python benchmarks/checkpoint_bench.py")
    print(section)
    if not args.no_write:
        print(f"written to {write_section(SECTION, section)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

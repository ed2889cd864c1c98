"""Stop a run, resume it on another mesh, and get the uninterrupted run's losses.

    python examples/resume.py                                   # dp2 x pp2 x mp2, resumed on dp8
    python examples/resume.py --steps 20 --save-at 8 --check    # require equal losses (1e-5)
    python examples/resume.py --mesh dp=8 --resume-mesh dp=2,mp=4 --dir /tmp/run1

The first run trains ``jfleet.models.llama.TinyLlama`` (made by ``jfleet.to_distributed`` on
``--mesh``) for ``--steps`` steps and saves a checkpoint with ``jfleet.checkpoint.
CheckpointManager`` after step ``--save-at``: the model, the Adam state, the loader's data
position and the losses so far. Saving is asynchronous (the files are written while the run
goes on) and changes nothing in the run, so the run's losses are the uninterrupted curve, and
its checkpoint is what a run stopped at ``--save-at`` would have left behind.

The second half runs as a user resumes after a stop: a fresh Python process (this script
with ``--resume``) builds the same model with ``to_distributed`` on ``--resume-mesh``,
restores the latest checkpoint into it (each array read straight into its sharding on the
new mesh; a pipeline's stacked ``[pp, layers/pp, ...]`` body mapped to and from the per-layer
leaves on disk), and trains to ``--steps``: the loader continues with the batch after the
checkpoint. Both loss curves are printed with their largest difference; ``--check`` exits
with status 1 if it exceeds 1e-5 (fp32: another mesh sums in another order).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import optax
from llama_to_distributed import parse_mesh  # the same --mesh syntax (examples/ is on the path)
from tqdm import tqdm

from jfleet import ToDistributedConfig, make_train_step, to_distributed
from jfleet.checkpoint import CheckpointManager
from jfleet.models import lm_loss, stride_batches
from jfleet.models.llama import TinyLlama

VOCAB = 64
TOLERANCE = 1e-5
RESUMED = "resumed losses: "  # the line the resuming process hands its losses back on


def mesh_text(mesh: dict[str, int]) -> str:
    return ",".join(f"{axis}={degree}" for axis, degree in mesh.items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=12, help="steps of the whole run")
    parser.add_argument("--save-at", type=int, default=6, help="the step the run stops after")
    parser.add_argument("--mesh", type=parse_mesh, default=parse_mesh("dp=2,pp=2,mp=2"))
    parser.add_argument("--resume-mesh", type=parse_mesh, default=parse_mesh("dp=8"))
    parser.add_argument(
        "--dir", type=Path, default=None, help="checkpoint directory (default: a fresh temp dir)"
    )
    parser.add_argument(
        "--check", action="store_true", help=f"exit 1 if the curves differ by > {TOLERANCE:g}"
    )
    parser.add_argument(
        "--resume", action="store_true", help="internal: the resuming process (restore, train)"
    )
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows of 8 tokens)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--devices", type=int, default=8, help="devices to use (device_num)")
    args = parser.parse_args(argv)
    if not 1 <= args.save_at < args.steps:
        parser.error(
            f"--save-at={args.save_at} with --steps={args.steps}: the run must stop after a "
            "step before its last, so 1 <= --save-at < --steps"
        )
    return args


def build(args: argparse.Namespace, mesh: dict[str, int]) -> tuple[Any, Any, Any]:
    """The model (always from seed 0), Adam and the loader, placed on ``mesh``."""
    return to_distributed(
        TinyLlama(vocab=VOCAB, width=64, heads=8, kv_heads=4, layers=4, seed=0),
        optax.adam(args.lr),
        stride_batches(args.steps, batch=args.batch, vocab=VOCAB),
        device_num=args.devices,
        config=ToDistributedConfig(force_mesh=mesh),
    )


def train(step: Any, model: Any, opt: Any, batches: Any, total: int, desc: str) -> list[float]:
    """Runs ``step`` over ``batches`` (one compile per step object: keep the object)."""
    losses: list[float] = []
    bar = tqdm(batches, total=total, desc=desc)  # a progress bar with the loss
    for batch in bar:
        losses.append(float(step(model, opt, batch)))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    return losses


def first_run(args: argparse.Namespace) -> list[float]:
    """Trains every step on ``--mesh``, saving after ``--save-at`` (async)."""
    model, opt, loader = build(args, args.mesh)
    batches = iter(loader)
    desc = f"run on {mesh_text(args.mesh)}"
    step = make_train_step(lm_loss)
    losses = train(step, model, opt, itertools.islice(batches, args.save_at), args.save_at, desc)
    with CheckpointManager(args.dir) as mngr:
        mngr.save(args.save_at, model, opt, loader=loader, extra={"losses": losses})
        print(f"saved step {args.save_at} to {args.dir} (async: training goes on)", flush=True)
        losses += train(step, model, opt, batches, args.steps - args.save_at, desc)
    return losses  # leaving the manager waited for the files


def resume(args: argparse.Namespace) -> list[float]:
    """Restores the latest checkpoint onto ``--resume-mesh`` and trains to ``--steps``."""
    model, opt, loader = build(args, args.resume_mesh)
    with CheckpointManager(args.dir) as mngr:
        meta = mngr.restore(model=model, optimizer=opt, loader=loader)
    print(
        f"restored step {meta['step']} (saved on {meta['mesh_shape']}) onto "
        f"{mesh_text(args.resume_mesh)}; batches seen: {loader.state()['batches']}",
        flush=True,
    )
    step = make_train_step(lm_loss)
    desc = f"resumed on {mesh_text(args.resume_mesh)}"
    rest = train(step, model, opt, loader, args.steps - meta["step"], desc)
    return meta["extra"]["losses"] + rest


def resume_in_a_fresh_process(args: argparse.Namespace) -> list[float]:
    cmd = [sys.executable, __file__, "--resume", "--dir", str(args.dir)]
    cmd += ["--steps", str(args.steps), "--save-at", str(args.save_at)]
    cmd += ["--mesh", mesh_text(args.mesh), "--resume-mesh", mesh_text(args.resume_mesh)]
    cmd += ["--batch", str(args.batch), "--lr", str(args.lr), "--devices", str(args.devices)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    lines = proc.stdout.splitlines()
    print("\n".join(line for line in lines if not line.startswith(RESUMED)), flush=True)
    if proc.returncode:
        raise SystemExit(f"the resuming process failed with status {proc.returncode}")
    return json.loads(next(line for line in lines if line.startswith(RESUMED))[len(RESUMED) :])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ["JAX_PLATFORMS"] == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)  # before anything uses JAX
    if args.resume:
        print(RESUMED + json.dumps(resume(args)))
        return 0
    if args.dir is None:
        args.dir = Path(tempfile.mkdtemp(prefix="jfleet-resume-"))
    print(f"{jax.device_count()} {jax.default_backend()} devices", flush=True)
    whole = first_run(args)
    where = mesh_text(args.resume_mesh)
    print(f"-- stop after step {args.save_at}; a fresh process resumes on {where}")
    resumed = resume_in_a_fresh_process(args)

    print(f"\n{'step':>4}  {'uninterrupted':>13}  {'stopped + resumed':>17}")
    for i, (a, b) in enumerate(zip(whole, resumed, strict=True), start=1):
        mark = "  <- resumed from here" if i == args.save_at + 1 else ""
        print(f"{i:4d}  {a:13.6f}  {b:17.6f}{mark}")
    gap = max(abs(a - b) for a, b in zip(whole, resumed, strict=True))
    print(f"largest per-step difference {gap:.2e}")
    if not whole[-1] < whole[0]:
        print("error: the loss did not decrease", file=sys.stderr)
        return 1
    if args.check:
        if not gap <= TOLERANCE:
            print(f"error: the resumed run differs by {gap:.2e} > {TOLERANCE:g}", file=sys.stderr)
            return 1
        print(f"check passed: the resumed run equals the uninterrupted one within {TOLERANCE:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One call parallelises a plain Llama-style model: ``jfleet.to_distributed`` on 8 devices.

    python examples/llama_to_distributed.py                          # the plan the cost model picks
    python examples/llama_to_distributed.py --mesh dp=2,pp=2,mp=2    # force a pipelined mesh
    python examples/llama_to_distributed.py --steps 10 --check       # compare with one device
    python -m jfleet.launch --nproc_per_node 4 --devices 0,1,2,3,4,5,6,7 \
        examples/llama_to_distributed.py --mesh dp=4,mp=2                # 4 processes x 2 devices

The model (``jfleet.models.llama.TinyLlama``: embedding, rotary attention, SwiGLU MLP,
RMSNorm, four decoder layers, a bare head matrix) and the optimizer (``optax.adam``) have
no distributed code. ``to_distributed(model, optimizer, loader, device_num=8)`` matches
the model's parts, lets the cost model choose a layout, builds the fleet mesh and returns
the model placed on it, the optimizer with its state placed, and a loader yielding sharded
batches; ``print(get_plan(model))`` shows the plan, every layout it compared and each
parameter's ``PartitionSpec``. Training is ``jfleet.make_train_step(loss_fn)`` in a loop,
with a tqdm progress bar showing the loss.

The task is learnable (each next token is the current one plus a fixed stride), so the loss
falls from about ln(64) ~ 4.2 towards 0. ``--check`` trains the same model from the same
initial values on one device with a plain ``nnx.jit`` step and an ``nnx.Optimizer`` and
exits with status 1 if any step's loss differs by more than 1e-4; the script also exits
with status 1 if the final loss is not below the first.

Set JAX_PLATFORMS (e.g. ``JAX_PLATFORMS=cuda``) to train on real accelerators instead; then
``--devices`` is the number of them to use.

Under ``python -m jfleet.launch`` (several processes, on one or several nodes) the script
joins the job first (``jfleet.role_maker.initialize_distributed``: the launcher's
``PADDLE_*`` variables), each process keeps the devices the launcher gave it and
``--devices`` is the job's total. Every process reads the same global batches:
``ToDistributedConfig(global_batches=True)`` makes each keep the rows its devices hold, so
the script has no per-process code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import optax
from flax import nnx
from tqdm import tqdm

from jfleet import ToDistributedConfig, make_train_step, to_distributed
from jfleet.auto_parallel import get_plan
from jfleet.models import lm_loss, stride_batches
from jfleet.models.llama import TinyLlama
from jfleet.role_maker import PaddleCloudRoleMaker, initialize_distributed
from jfleet.topology import AXIS_NAMES, EP

VOCAB = 64
# jfleet.topology's axis names, outermost first; to_distributed does not plan ep yet
AXES = tuple(a for a in AXIS_NAMES if a != EP)
TOLERANCE = 1e-4


def parse_mesh(text: str) -> dict[str, int]:
    """``"dp=2,pp=2,mp=2"`` -> ``{"dp": 2, "pp": 2, "mp": 2}`` (argparse type)."""
    mesh: dict[str, int] = {}
    for item in text.split(","):
        axis, sep, degree = item.strip().partition("=")
        if not sep or axis not in AXES or not degree.isdigit() or int(degree) < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} in {text!r}: expected axis=degree with axis one of {', '.join(AXES)} "
                "and degree a positive int, e.g. dp=2,pp=2,mp=2"
            )
        mesh[axis] = int(degree)
    return mesh


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument(
        "--mesh",
        type=parse_mesh,
        default=None,
        help="force the mesh, e.g. dp=2,pp=2,mp=2 (missing axes 1); default: the cost model's",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"also train on one device and require equal losses (within {TOLERANCE:g})",
    )
    parser.add_argument("--batch", type=int, default=16, help="global batch (rows of 8 tokens)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    parser.add_argument("--devices", type=int, default=8, help="devices to use (device_num)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: need at least 2 steps to see the loss move")
    return args


def build_model() -> TinyLlama:
    """The model, always from the same seed: every run starts from the same values."""
    return TinyLlama(vocab=VOCAB, width=64, heads=8, kv_heads=4, layers=4, seed=0)


def batches(steps: int, batch: int) -> Iterator[dict[str, Any]]:
    """A streaming loader: any iterable of NumPy (or JAX) batches works, a generator too."""
    yield from stride_batches(steps, batch=batch, vocab=VOCAB)


def train_distributed(args: argparse.Namespace) -> list[float]:
    config = ToDistributedConfig(force_mesh=args.mesh, global_batches=True)
    model, optimizer, loader = to_distributed(
        build_model(),
        optax.adam(args.lr),
        batches(args.steps, args.batch),
        device_num=args.devices,
        config=config,
    )
    plan = get_plan(model)
    print(plan, end="\n\n")
    print(f"layout: {plan.layout.name}  mesh: {plan.mesh_shape}", flush=True)

    step = make_train_step(lm_loss)
    losses: list[float] = []
    bar = tqdm(total=args.steps, desc=plan.layout.name)  # a progress bar with the loss
    start = time.perf_counter()
    for i, batch in enumerate(loader, start=1):
        losses.append(float(step(model, optimizer, batch)))
        bar.update()
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if i == 1 or i % args.log_every == 0 or i == args.steps:
            tqdm.write(f"step {i:4d}/{args.steps}  loss {losses[-1]:.4f}")
    bar.close()
    print(f"{len(losses)} steps in {time.perf_counter() - start:.1f} s (the first compiles)")
    return losses


def train_one_device(args: argparse.Namespace) -> list[float]:
    """The same training as a plain single-device Flax NNX loop, for ``--check``."""
    model = build_model()
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)

    @nnx.jit
    def train_step(model: TinyLlama, optimizer: nnx.Optimizer, batch: dict) -> jax.Array:
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    return [float(train_step(model, optimizer, b)) for b in batches(args.steps, args.batch)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Started by python -m jfleet.launch: join the job before anything uses JAX; the
    # launcher gave this process its devices. Alone: emulate --devices CPU devices.
    if not initialize_distributed(PaddleCloudRoleMaker()) and os.environ["JAX_PLATFORMS"] == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)  # before anything uses JAX
    print(f"{jax.device_count()} {jax.default_backend()} devices", flush=True)

    losses = train_distributed(args)
    print(f"first loss {losses[0]:.4f}  final loss {losses[-1]:.4f}")
    print(f"losses {json.dumps(losses)}")
    status = 0
    if not losses[-1] < losses[0]:
        print("error: the loss did not decrease", file=sys.stderr)
        status = 1

    if args.check:
        reference = train_one_device(args)
        gap = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        print(
            f"one device: first loss {reference[0]:.4f}  final loss {reference[-1]:.4f}  "
            f"largest per-step difference {gap:.2e}"
        )
        if not gap <= TOLERANCE:
            print(f"error: the losses differ from one device's by {gap:.2e}", file=sys.stderr)
            status = 1
        else:
            print(f"check passed: every step's loss equals one device's within {TOLERANCE:g}")
    return status


if __name__ == "__main__":
    sys.exit(main())

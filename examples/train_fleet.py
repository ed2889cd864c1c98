"""Trains a tiny language model with Fleet's hybrid parallelism on 8 emulated CPU devices.

    python examples/train_fleet.py                       # dp 2 x ZeRO-2 over sharding 4
    python examples/train_fleet.py --amp bf16 --stage 3  # ZeRO-3 with bf16 AMP (O1)
    python examples/train_fleet.py --dp 8 --sharding 1   # plain data parallel

The script is a Paddle Fleet script line by line: ``fleet.init`` with a
``DistributedStrategy``, ``fleet.distributed_model``, ``fleet.distributed_optimizer``,
then ``model.train_batch`` in a loop. The task is learnable (each next token is the
current one plus a fixed stride), so the loss falls from ln(64) ~ 4.2 towards 0; the
script exits with status 1 if the final loss is not below the first.

Set JAX_PLATFORMS (e.g. ``JAX_PLATFORMS=cuda``) to train on real accelerators instead;
then ``--devices`` is ignored and the degrees must multiply to the device count. The same
script runs unchanged under ``python -m jfleet.launch`` (several processes): ``--devices``
is the job's total (``jfleet.emulate_devices`` gives each process its share), ``fleet.init``
joins the processes into one mesh, and each passes ``jfleet.data.local_rows`` of every
global batch; the losses are those of one process::

    python -m jfleet.launch --nproc_per_node 2 examples/train_fleet.py
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import optax

import jfleet
from jfleet import fleet
from jfleet.data import local_rows
from jfleet.models import TinyLM, lm_loss, stride_batches

VOCAB = 64
AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--dp", type=int, default=2, help="dp_degree (data parallel)")
    parser.add_argument("--sharding", type=int, default=4, help="sharding_degree (ZeRO axis)")
    parser.add_argument(
        "--stage", type=int, default=2, choices=(1, 2, 3), help="ZeRO stage over the sharding axis"
    )
    parser.add_argument("--amp", default="none", choices=("none", "bf16", "fp16"), help="AMP O1")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument(
        "--batch", type=int, default=16, help="global batch (divisible by dp x sharding)"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    parser.add_argument(
        "--devices", type=int, default=8, help="emulated CPU devices (only with JAX_PLATFORMS=cpu)"
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: need at least 2 steps to see the loss move")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ["JAX_PLATFORMS"] == "cpu":
        jfleet.emulate_devices(args.devices)  # the job's devices, split over its processes

    # 1. the strategy: Paddle's switches and configs, unchanged
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "sharding_degree": args.sharding}
    strategy.sharding_configs = {"stage": args.stage}
    if args.amp != "none":
        strategy.amp = True
        strategy.amp_configs = {"dtype": AMP_DTYPES[args.amp]}
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    hcg = fleet.get_hybrid_communicate_group()
    print(
        f"mesh axes: {dict(hcg.mesh.shape)} on {jax.device_count()} {jax.default_backend()} devices"
    )
    zero = (
        f"ZeRO stage {args.stage} over sharding {args.sharding}" if args.sharding > 1 else "no ZeRO"
    )
    print(f"strategy: dp {args.dp}, {zero}, amp {args.amp}")

    # 2. the model and the optimizer, wrapped by fleet
    model = fleet.distributed_model(TinyLM(vocab=VOCAB))
    optimizer = fleet.distributed_optimizer(optax.adam(args.lr))

    # 3. the training loop; with several processes each passes its own rows of a batch
    losses = []
    for step, batch in enumerate(stride_batches(args.steps, batch=args.batch), start=1):
        loss = float(model.train_batch(local_rows(batch), optimizer, loss_fn=lm_loss))
        losses.append(loss)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}/{args.steps}  loss {loss:.4f}", flush=True)

    print(f"applied meta-optimizers: {fleet._get_applied_meta_list()}")
    if args.amp == "fp16":
        print(f"fp16 loss scale: {fleet.get_loss_scaling():g}")
    print(f"first loss {losses[0]:.4f}  final loss {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        print("error: the loss did not decrease", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

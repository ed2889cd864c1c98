"""Trains a small GPT with tensor (and sequence) parallelism on 8 emulated CPU devices.

    python examples/tensor_parallel_gpt.py                        # dp 2 x mp 4
    python examples/tensor_parallel_gpt.py --sequence-parallel    # + Megatron sequence parallel
    python examples/tensor_parallel_gpt.py --dp 2 --sharding 2 --mp 2

The model is :class:`jfleet.models.parallel_gpt.TinyGPT` built from ``fleet.meta_parallel`` layers
in the Megatron layout: the fused q/k/v projection and the MLP's up projection are
``ColumnParallelLinear`` (kernel split on the output dim, ``P(None, 'mp')``), the attention
output and the MLP's down projection ``RowParallelLinear`` (kernel split on the input dim,
``P('mp', None)``), the embedding a ``VocabParallelEmbedding`` and the loss a
``ParallelCrossEntropy`` over vocabulary-split logits. With ``--sequence-parallel`` the
activations between those regions (norms, residual adds) are split over the sequence on
``mp`` as well. The training loop is a Paddle Fleet script: ``fleet.init``,
``fleet.distributed_model``, ``fleet.distributed_optimizer``, ``model.train_batch``.

The task is learnable (each next token is the current one plus a fixed stride), so the
loss falls from ln(64) ~ 4.2 towards 0; the script exits with status 1 if the final loss
is not below the first.

Set JAX_PLATFORMS (e.g. ``JAX_PLATFORMS=cuda``) to train on real accelerators instead;
then ``--devices`` is ignored and the degrees must multiply to the device count.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import optax
from flax import nnx

from jfleet import fleet
from jfleet.models import stride_batches
from jfleet.models.parallel_gpt import TinyGPT, gpt_loss
from jfleet.parallel.sequence import is_sequence_parallel_parameter

VOCAB = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--dp", type=int, default=2, help="dp_degree (data parallel)")
    parser.add_argument("--mp", type=int, default=4, help="mp_degree (tensor parallel)")
    parser.add_argument("--sharding", type=int, default=1, help="sharding_degree (ZeRO axis)")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split the activations between tensor-parallel regions over the sequence on mp",
    )
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument(
        "--batch", type=int, default=16, help="global batch (divisible by dp x sharding)"
    )
    parser.add_argument(
        "--seq", type=int, default=16, help="sequence length (divisible by mp with -SP)"
    )
    parser.add_argument("--width", type=int, default=64, help="model width (divisible by mp)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (divisible by mp)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    parser.add_argument(
        "--devices", type=int, default=8, help="emulated CPU devices (only with JAX_PLATFORMS=cpu)"
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: need at least 2 steps to see the loss move")
    return args


def spec(variable: nnx.Variable) -> str:
    """The variable's shape and its PartitionSpec on the mesh."""
    value = variable[...]
    return f"{tuple(value.shape)!s:<12} {value.sharding.spec}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ["JAX_PLATFORMS"] == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)

    # 1. the strategy: dp x (sharding) x mp; the mp layers need fleet.init first, as in Paddle
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": args.dp,
        "sharding_degree": args.sharding,
        "mp_degree": args.mp,
    }
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    hcg = fleet.get_hybrid_communicate_group()
    print(
        f"mesh axes: {dict(hcg.mesh.shape)} on {jax.device_count()} {jax.default_backend()} devices"
    )
    print(f"model parallel groups: {fleet.get_hybrid_parallel_topology().get_comm_list('model')}")
    print(
        f"strategy: dp {args.dp}, sharding {args.sharding}, mp {args.mp}, "
        f"sequence parallel {'on' if args.sequence_parallel else 'off'}"
    )

    # 2. the model from meta_parallel layers, and the optimizer, wrapped by fleet
    model = fleet.distributed_model(
        TinyGPT(
            vocab=VOCAB,
            width=args.width,
            heads=args.heads,
            layers=args.layers,
            tensor_parallel=True,
            sequence_parallel=args.sequence_parallel,
        )
    )
    optimizer = fleet.distributed_optimizer(optax.adam(args.lr))
    gpt = model.module
    block = gpt.blocks[0]
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(gpt, nnx.Param)))
    print(f"TinyGPT: {n_params:,} parameters; layouts of block 0 (global shape, spec):")
    layouts = {
        "embed.embedding     (vocab-parallel)": gpt.embed.embedding,
        "attn.qkv.kernel     (column)": block.attn.qkv.kernel,
        "attn.o.kernel       (row)": block.attn.o.kernel,
        "attn.o.bias": block.attn.o.bias,
        "mlp.up.kernel       (column)": block.mlp.up.kernel,
        "mlp.down.kernel     (row)": block.mlp.down.kernel,
        "norm1.scale": block.norm1.scale,
        "head.kernel         (column)": gpt.head.kernel,
    }
    for name, variable in layouts.items():
        print(f"  {name:<38}{spec(variable)}")
    if args.sequence_parallel:
        marked = [
            jax.tree_util.keystr(path)
            for path, v in jax.tree_util.tree_leaves_with_path(
                nnx.state(gpt, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
            )
            if is_sequence_parallel_parameter(v)
        ]
        print(f"sequence-parallel parameters (LayerNorm scales and biases): {len(marked)}")

    # 3. the training loop
    batches = stride_batches(args.steps, batch=args.batch, seq=args.seq, vocab=VOCAB)
    losses = []
    for step, batch in enumerate(batches, start=1):
        loss = float(model.train_batch(batch, optimizer, loss_fn=gpt_loss))
        losses.append(loss)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}/{args.steps}  loss {loss:.4f}", flush=True)

    print(f"applied meta-optimizers: {fleet._get_applied_meta_list()}")
    print(f"first loss {losses[0]:.4f}  final loss {losses[-1]:.4f}")
    if not losses[-1] < losses[0]:
        print("error: the loss did not decrease", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

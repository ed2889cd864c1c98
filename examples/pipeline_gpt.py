"""Trains a small GPT with pipeline x data x tensor parallelism on 8 emulated CPU devices.

    python examples/pipeline_gpt.py                       # pp 2 x dp 2 x mp 2, both schedules
    python examples/pipeline_gpt.py --schedule 1F1B
    python examples/pipeline_gpt.py --pp 4 --dp 2 --mp 1 --accumulate-steps 8

The model is a Paddle-style ``PipelineLayer``: a vocabulary-parallel embedding, ``--layers``
GPT blocks built from tensor-parallel layers (:class:`jfleet.models.parallel_gpt.GPTBlock`), a final
LayerNorm and an LM head that is the embedding again (``SharedLayerDesc``: one tied
weight). The blocks are the pipelined body: their parameters are stacked ``[pp, layers/pp,
...]`` and split over the ``pp`` axis, each block keeping its Megatron layout on ``mp``;
the embedding runs before the pipeline and the norm + head + loss on its last stage. Each
step splits the batch into ``accumulate_steps`` micro-batches per data-parallel replica and
runs them through the ``pipeline_configs`` schedule: ``FThenB`` (GPipe: all forwards, then
all backwards) or ``1F1B`` (one forward, one backward; activation memory bounded by the
stages). With ``--schedule both`` the same model trains once with each; from the same seed
they give the same losses.

The task is learnable (each next token is the current one plus a fixed stride), so the
loss falls from ln(64) ~ 4.2; the script exits with status 1 if it does not fall.

Set JAX_PLATFORMS (e.g. ``JAX_PLATFORMS=cuda``) to train on real accelerators instead;
then ``--devices`` is ignored and the degrees must multiply to the device count.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import optax
from flax import nnx

from jfleet import fleet
from jfleet.models import stride_batches
from jfleet.models.parallel_gpt import GPTBlock
from jfleet.parallel.pipeline_schedule import schedule_stats

VOCAB = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--schedule",
        choices=["1F1B", "FThenB", "F-then-B", "both"],
        default="both",
        help="pipeline_configs['schedule_mode']; 'both' trains once with each",
    )
    parser.add_argument("--pp", type=int, default=2, help="pp_degree (pipeline stages)")
    parser.add_argument("--dp", type=int, default=2, help="dp_degree (data parallel)")
    parser.add_argument("--mp", type=int, default=2, help="mp_degree (tensor parallel)")
    parser.add_argument("--micro-batch-size", type=int, default=2, help="rows per micro-batch")
    parser.add_argument(
        "--accumulate-steps", type=int, default=4, help="micro-batches per step (M)"
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps per schedule")
    parser.add_argument("--seq", type=int, default=16, help="sequence length")
    parser.add_argument("--width", type=int, default=32, help="model width (divisible by mp)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (divisible by mp)")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks (divisible by pp)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--log-every", type=int, default=5, help="print the loss every N steps")
    parser.add_argument(
        "--devices", type=int, default=8, help="emulated CPU devices (only with JAX_PLATFORMS=cpu)"
    )
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: need at least 2 steps to see the loss move")
    return args


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Paddle's ``loss_fn(output, labels)``: the micro-batch's mean next-token loss."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def gpt_layers(args: argparse.Namespace) -> list:
    """The GPT as layer descriptions: tied embedding / head around ``--layers`` blocks.

    Tensor-parallel layers (Megatron layout) when ``--mp`` is above 1, plain Flax layers
    (the same parameters from the same seed) otherwise.
    """
    from jfleet.fleet.meta_parallel import (
        ColumnParallelLinear,
        LayerDesc,
        RowParallelLinear,
        SharedLayerDesc,
        VocabParallelEmbedding,
    )

    if args.mp > 1:
        column = functools.partial(ColumnParallelLinear, has_bias=True, gather_output=False)
        row = functools.partial(RowParallelLinear, has_bias=True, input_is_parallel=True)
        embedding = functools.partial(SharedLayerDesc, "embed", VocabParallelEmbedding)
        weight = "weight"
    else:
        column = row = functools.partial(nnx.Linear, use_bias=True)
        embedding = functools.partial(SharedLayerDesc, "embed", nnx.Embed)
        weight = "embedding"
    block = LayerDesc(GPTBlock, args.width, args.heads, 4 * args.width, column=column, row=row)
    return [
        embedding(None, weight, VOCAB, args.width),  # tokens -> [batch, seq, width]
        *[block] * args.layers,
        LayerDesc(nnx.LayerNorm, args.width),
        embedding(lambda emb, x: emb.attend(x), weight, VOCAB, args.width),  # the tied head
    ]


def train(args: argparse.Namespace, schedule: str) -> list[float]:
    """``fleet.init`` for the schedule, the pipeline model, ``--steps`` of ``train_batch``."""
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "pp_degree": args.pp, "mp_degree": args.mp}
    strategy.pipeline_configs = {
        "micro_batch_size": args.micro_batch_size,
        "accumulate_steps": args.accumulate_steps,
        "schedule_mode": schedule,
    }
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")

    # the PipelineLayer is built after fleet.init: num_stages is the pp degree, and the
    # parallel layers are created on the fleet's mesh
    from jfleet.fleet.meta_parallel import PipelineLayer

    # seg_method by block class, as PaddleNLP's pipes do: the blocks split evenly over the
    # stages (the embedding on the first, norm and head on the last), so they are stacked.
    layer = PipelineLayer(
        gpt_layers(args), loss_fn=cross_entropy, seed=0, seg_method="layer:GPTBlock"
    )
    model = fleet.distributed_model(layer)
    optimizer = fleet.distributed_optimizer(optax.adam(args.lr))
    qkv = layer.body.attn.qkv.kernel[...]
    stats = schedule_stats(model.schedule, model.num_stages, model.accumulate_steps)
    print(f"\n== schedule {schedule} ({model.schedule})")
    print(
        f"stages {model.num_stages}, {layer.layers_per_stage} GPTBlock(s) per stage, layer "
        f"boundaries {list(layer.segment_parts)}; body qkv kernel {tuple(qkv.shape)} "
        f"{qkv.sharding.spec}"
    )
    print(
        f"per step: {stats['ticks']} ticks, {stats['collective_permutes']} collective-permutes, "
        f"bubble {stats['bubble_fraction']:.2f}; a stage keeps the activations of "
        f"{stats['stash_slots']} micro-batch(es)"
    )
    batch = args.micro_batch_size * args.accumulate_steps * args.dp
    losses = []
    for step, b in enumerate(
        stride_batches(args.steps, batch=batch, seq=args.seq, vocab=VOCAB), start=1
    ):
        loss = float(model.train_batch((b["tokens"], b["labels"]), optimizer))
        losses.append(loss)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}/{args.steps}  loss {loss:.4f}", flush=True)
    print(f"first loss {losses[0]:.4f}  final loss {losses[-1]:.4f}")
    return losses


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ["JAX_PLATFORMS"] == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)
    print(
        f"pp {args.pp} x dp {args.dp} x mp {args.mp} on {jax.device_count()} "
        f"{jax.default_backend()} devices; batch {args.micro_batch_size} x "
        f"{args.accumulate_steps} micro-batches x dp {args.dp}"
    )
    schedules = ["FThenB", "1F1B"] if args.schedule == "both" else [args.schedule]
    runs = {s: train(args, s) for s in schedules}
    failed = [s for s, losses in runs.items() if not losses[-1] < losses[0]]
    if len(runs) == 2:
        gap = max(abs(a - b) for a, b in zip(*runs.values(), strict=True))
        print(f"\nlargest loss difference between the schedules: {gap:.2e}")
    if failed:
        print(f"error: the loss did not decrease with {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MFU measured against the plan: a Llama trained through ``to_distributed`` in bf16.

Meant for one GPU machine (one H200: under 4 minutes at the default ~1B size)::

    JAX_PLATFORMS=cuda python benchmarks/gpu_mfu.py --profile h200
    python benchmarks/gpu_mfu.py --tiny                # CPU, 8 emulated devices (the suite)

It builds a Llama (:class:`jfleet.models.llama.TinyLlama`: width 2048, 16 layers, 16
heads, MLP 5632, vocabulary 32000: ~1.0B parameters), lets ``to_distributed`` plan and
place it with the strategy's AMP in bf16 (the plan's dtype), times ``--steps`` steps of
the engine's train step after one compiling step, and times the same steps of a plain
``nnx.jit`` step (``nnx.value_and_grad`` + ``nnx.Optimizer``) on one device. Reported: the
plan's layout, its predicted step time and MFU, the measured step time and MFU of both, and
measured / predicted. MFU is model FLOPs without recompute (``6 N`` per token plus the
attention's ``12 l h s`` per token, as ``benchmarks/published_configs.py`` defines it) over
step time x devices x the profile's bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks  # noqa: F401  (first: the platform, before JAX starts)

# isort: split
import jax
import numpy as np
import optax
from flax import nnx

from jfleet import DistributedStrategy, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
from jfleet.auto_parallel.cost.profiles import get_profile
from jfleet.models import lm_loss
from jfleet.models.llama import TinyLlama

SIZES = {
    "1b": {"width": 2048, "layers": 16, "heads": 16, "hidden": 5632, "vocab": 32000},
    "tiny": {"width": 64, "layers": 2, "heads": 4, "hidden": 128, "vocab": 256},
}


def _batches(n: int, batch: int, seq: int, vocab: int) -> list[dict]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(n, batch, seq + 1), dtype=np.int32)
    return [{"tokens": t[:, :-1], "labels": t[:, 1:]} for t in tokens]


def model_flops(size: dict, params: int, tokens: int, seq: int) -> float:
    """Model FLOPs of one step without recompute: ``6 N`` a token plus the attention's."""
    return tokens * (6 * params + 12 * size["layers"] * size["width"] * seq)


def _timed(step, n: int) -> float:
    """Seconds a step, over ``n`` calls after one that compiles."""
    jax.block_until_ready(step())
    start = time.perf_counter()
    for _ in range(n):
        out = step()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n


def _distributed(size: dict, args: argparse.Namespace, data: list[dict]) -> tuple:
    strategy = DistributedStrategy()
    strategy.amp = True
    strategy.amp_configs = {"dtype": "bfloat16"}
    model = TinyLlama(**size, seed=0)
    config = ToDistributedConfig(strategy=strategy, profile=args.profile)
    model, optimizer, loader = to_distributed(
        model, optax.adam(1e-4), iter(data), device_num=len(jax.devices()), config=config
    )
    step = make_train_step(lm_loss)
    batches = iter(loader)
    return get_plan(model), _timed(lambda: step(model, optimizer, next(batches)), args.steps)


def _plain(size: dict, args: argparse.Namespace, data: list[dict]) -> float:
    model = TinyLlama(**size, seed=0)
    optimizer = nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    batches = iter(data)
    return _timed(lambda: train_step(model, optimizer, next(batches)), args.steps)


def run(args: argparse.Namespace) -> dict:
    """Measures both steps; returns the report as a dict."""
    size = SIZES["tiny" if args.tiny else "1b"]
    data = _batches(2 * args.steps + 2, args.batch, args.seq, size["vocab"])
    plan, measured = _distributed(size, args, data[: args.steps + 1])
    plain = _plain(size, args, data[args.steps + 1 :])
    params = sum(int(np.prod(p.shape)) for p in plan.params)
    flops = model_flops(size, params, args.batch * args.seq, args.seq)
    peak = get_profile(args.profile).flops("bfloat16") * len(jax.devices())
    predicted = plan.chosen.time.total
    return {
        "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
        "params": params,
        "layout": plan.layout.name,
        "plan_dtype": plan.dtype,
        "predicted_s": predicted,
        "measured_s": measured,
        "plain_jit_s": plain,
        "predicted_mfu": flops / (predicted * peak),
        "measured_mfu": flops / (measured * peak),
        "plain_jit_mfu": flops / (plain * peak / len(jax.devices())),
        "measured_over_predicted": measured / predicted,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU, the suite)")
    parser.add_argument("--profile", default=None, help="default: cpu with --tiny, else h200")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=None, help="default 16 (tiny: 8)")
    parser.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 16)")
    args = parser.parse_args(argv)
    args.profile = args.profile or ("cpu" if args.tiny else "h200")
    args.batch = args.batch or (8 if args.tiny else 16)
    args.seq = args.seq or (16 if args.tiny else 2048)
    report = run(args)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A model that no single device holds: planned from its shapes, created split, loaded, trained.

    python examples/bigger_than_one_device.py                   # budget: 1/3 of the state
    python examples/bigger_than_one_device.py --budget-fraction 0.2 --steps 8

A per-device ``memory_budget`` below the whole model's fp32 training state (parameters,
gradients and Adam's two moments) rules out every layout that keeps the model whole on a
device. ``to_distributed`` is given the function that builds the model instead of the
model: it plans on the abstract model (``nnx.eval_shape``: shapes only) and creates the
parameters directly in the planned shardings (one compiled program; a pipeline, one per
stage), so no device and no host ever holds a parameter the plan splits whole.

The model's weights then come from a checkpoint written by an earlier run on another mesh
(here dp=2 x mp=4, saved with ``jfleet.checkpoint.state_dict.save_model``): ``load_model``
reads each array straight into its new sharding (a pipeline stage's layers onto that
stage's devices alone). The script prints the plan, the per-device bytes against the whole
state, the largest difference between the loaded and the saved weights (0), and trains a
few steps from them; it exits with status 1 if a check fails. Weights in Hugging Face's
Llama naming load the same way: ``jfleet.checkpoint.hf_weights.load_safetensors(path,
model, LLAMA_HF)``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from jfleet import ToDistributedConfig, make_train_step, to_distributed
from jfleet.auto_parallel import get_plan
from jfleet.checkpoint.layout import logical_leaves
from jfleet.checkpoint.state_dict import load_model, save_model
from jfleet.models import lm_loss, stride_batches
from jfleet.models.llama import TinyLlama

MiB = 2**20


def build(seed: int = 0) -> TinyLlama:
    """The model: no distributed code (a bigger one only changes these numbers)."""
    return TinyLlama(vocab=256, width=128, heads=8, kv_heads=4, layers=4, seed=seed)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--budget-fraction", type=float, default=1 / 3,
        help="the per-device memory budget as a fraction of the whole fp32 training state",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.budget_fraction < 1:
        parser.error(f"--budget-fraction {args.budget_fraction}: expected a value in (0, 1)")
    return args


def training_state_bytes() -> int:
    """Parameters, gradients and Adam's two moments of the whole model, in fp32."""
    abstract = nnx.eval_shape(build)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    return 4 * params * 4


def pretrained(where: Path) -> dict[str, np.ndarray]:
    """An earlier run on dp=2 x mp=4: trained a few steps, saved; returns its weights."""
    config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4})
    batches = stride_batches(3, vocab=256, seed=1)
    model, opt, loader = to_distributed(
        lambda: build(seed=1), optax.adam(1e-2), batches, config=config
    )
    step = make_train_step(lm_loss)
    for batch in loader:
        step(model, opt, batch)
    save_model(where, model)
    return {k: np.asarray(v) for k, v in logical_leaves(model, model).items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.environ["JAX_PLATFORMS"] == "cpu":
        jax.config.update("jax_num_cpu_devices", args.devices)  # before anything uses JAX
    state = training_state_bytes()
    budget = int(state * args.budget_fraction)
    print(f"whole fp32 training state {state / MiB:.2f} MiB; budget {budget / MiB:.2f} MiB/device")

    where = Path(tempfile.mkdtemp(prefix="jfleet-pretrained-")) / "weights"
    saved = pretrained(where)
    print(f"pretrained weights saved on dp=2 x mp=4 at {where}")

    config = ToDistributedConfig(memory_budget=budget)
    model, opt, loader = to_distributed(
        build, optax.adam(1e-2), stride_batches(args.steps, vocab=256, seed=2), config=config
    )
    plan = get_plan(model)
    per_device = plan.chosen.memory.total
    print(f"layout: {plan.layout.name}; predicted {per_device / MiB:.2f} MiB/device")
    biggest = max(
        int(np.prod(v.get_value().sharding.shard_shape(v.shape))) * v.dtype.itemsize
        for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    )
    print(f"created split: the largest parameter shard on a device is {biggest / 1024:.1f} KiB")

    load_model(where, model)
    loaded = {k: np.asarray(v) for k, v in logical_leaves(model, model).items()}
    gap = max(float(np.abs(loaded[k] - saved[k]).max()) for k in saved)
    print(f"loaded into {plan.layout.name}: largest |loaded - saved| = {gap:g}")

    step = make_train_step(lm_loss)
    losses = []
    for batch in (bar := tqdm(loader, total=args.steps, desc="train", file=sys.stdout)):
        losses.append(float(step(model, opt, batch)))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    problems = []
    if per_device > budget:
        problems.append(f"the plan needs {per_device} B/device, above the budget {budget}")
    if gap != 0:
        problems.append(f"the loaded weights differ from the saved ones by {gap}")
    if not losses[-1] < losses[0]:
        problems.append("the loss did not decrease")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

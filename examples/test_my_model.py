"""Testing your own parallel code with jfleet's pytest plugin and ``jfleet.testing``.

A user's test file: a small Flax NNX model of our own, checked on 8 emulated CPU devices:

    pip install "jfleet[testing]"
    pytest --jfleet-devices 8 examples/test_my_model.py

Without ``--jfleet-devices 8`` the tests that need 8 devices fail with a message that says
to add it.
"""

from functools import partial

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import ToDistributedConfig, make_train_step, to_distributed
from jfleet.testing import (
    assert_collectives,
    assert_peak_memory_below,
    assert_sharded_as,
    assert_trains_like_one_device,
    require_devices,
)

VOCAB, WIDTH, LAYERS = 64, 32, 2


class Block(nnx.Module):
    """Pre-norm MLP block with a residual."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class MyModel(nnx.Module):
    """Token embedding, MLP blocks, a norm and a vocabulary head."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(WIDTH, rngs=rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_model() -> MyModel:
    return MyModel(rngs=nnx.Rngs(0))  # a fixed seed: both runs start alike


def loss_fn(model, batch):
    logits = model(batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def batches(n: int, size: int = 16, seq: int = 8) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, size=(size, seq + 1), dtype=np.int32)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:]})
    return out


# fp32 Adam over a few steps: the sharded run sums in another order, and Adam turns a
# tiny gradient's rounding into a step of up to the learning rate.
TOL = dict(rtol=1e-4, atol=1e-4)


def test_tensor_parallel_trains_like_one_device(fleet_reset):
    # to_distributed with a forced mesh; a ToDistributedConfig or a Fleet strategy works too
    layout = {"dp": 2, "mp": 4}
    assert_trains_like_one_device(
        make_model, optax.adam(1e-2), batches(4), loss_fn=loss_fn, layout=layout, **TOL
    )


def my_data_parallel_trainer(mesh):
    """Our own data-parallel training loop: shard_map over 'dp', gradients averaged."""

    def train(model, tx, batches, loss_fn):
        graphdef, params = nnx.split(model)
        opt_state = tx.init(params)

        @jax.jit
        @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(), P("dp")), out_specs=P())
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(
                params
            )
            grads, loss = jax.lax.pmean((grads, loss), "dp")
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        losses = []
        for batch in batches:
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
        nnx.update(model, params)
        return losses

    return train


def test_my_own_data_parallel_loop_trains_like_one_device(mesh_factory):
    mesh = mesh_factory(dp=8)
    trainer = my_data_parallel_trainer(mesh)
    assert_trains_like_one_device(
        make_model, optax.adam(1e-2), batches(4), loss_fn=loss_fn, layout=trainer, **TOL
    )


@pytest.fixture
def tensor_parallel(fleet_reset):
    """The model placed by to_distributed on dp 2 x mp 4, blocks kept one by one."""
    require_devices(8)
    config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4}, scan_layers=False)
    model, opt, loader = to_distributed(make_model(), optax.adam(1e-2), batches(1), config=config)
    return model, opt, next(iter(loader))


def test_mlp_is_split_megatron_style(tensor_parallel):
    model, _, _ = tensor_parallel
    # column-parallel up projection, row-parallel down projection
    assert_sharded_as(
        model,
        {
            "blocks.*.up.kernel": (None, "mp"),
            "blocks.*.down.kernel": ("mp", None),
            "blocks.*.norm.scale": (),
        },
    )


def test_forward_all_reduces_once_per_block(tensor_parallel):
    model, _, batch = tensor_parallel
    forward = nnx.jit(lambda m, tokens: m(tokens))
    # A row-parallel down projection sums its partial outputs over 'mp': one all-reduce
    # per block; the vocabulary-parallel embedding sums its masked lookups: one more. The
    # column-parallel head leaves the logits split over 'mp' (no collective).
    assert_collectives(forward, model, batch["tokens"], expected={"all-reduce": LAYERS + 1})


def test_train_step_fits_in_memory(tensor_parallel):
    model, opt, batch = tensor_parallel
    step = make_train_step(loss_fn)
    # parameters (~30k floats), Adam moments and activations: far below 16 MiB per device
    assert_peak_memory_below(step, 16 * 2**20, model, opt, batch)

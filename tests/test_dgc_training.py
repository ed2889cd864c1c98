"""strategy.dgc end to end: fleet.distributed_optimizer + train_batch at dp8."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet
from jfleet.optim import hyperparams
from jfleet.testing.reference import train_one_device
from tests.fleet_setup import init_fleet

DP, D, LR, STEPS = 8, 128, 0.02, 20
BEGIN = 2  # dense momentum steps before compression


class Regression(nnx.Module):
    """y = x W: W has 128 x 128 = 16384 entries, the smallest size DGC compresses."""

    def __init__(self) -> None:
        self.w = nnx.Linear(D, D, use_bias=False, rngs=nnx.Rngs(0))
        self.b = nnx.Param(jnp.zeros(D))  # small: averaged densely, plain momentum

    def __call__(self, x):
        return self.w(x) + self.b[...]


def loss_fn(model: nnx.Module, batch: dict) -> jnp.ndarray:
    return jnp.mean(jnp.sum((model(batch["x"]) - batch["y"]) ** 2, -1))


def batches(n: int) -> list[dict]:
    """A teacher that differs from the initial W in 64 of its 16384 weights (by +-1): the
    error a 0.1% exchange can find; a dense error needs far more steps at that sparsity."""
    rng = np.random.default_rng(0)
    w_true = np.array(Regression().w.kernel[...])
    w_true.reshape(-1)[rng.choice(D * D, 64, replace=False)] += rng.choice([-1.0, 1.0], 64)
    out = []
    for _ in range(n):
        x = rng.normal(size=(64, D)).astype(np.float32)
        out.append({"x": x, "y": x @ w_true})
    return out


def test_dgc_trains_dense_momentum_first_then_sparse_updates_and_converges():
    init_fleet(
        {"dp_degree": DP},
        dgc=True,
        dgc_configs={"rampup_begin_step": BEGIN, "rampup_step": 1, "sparsity": [0.999]},
    )
    model = fleet.distributed_model(Regression())
    opt = fleet.distributed_optimizer(hyperparams.momentum(LR, momentum=0.9))
    assert "DGCMomentumOptimizer" in fleet._get_applied_meta_list()
    data = batches(STEPS)
    losses, changed = [], []
    for batch in data:
        before = np.asarray(model.module.w.kernel[...])
        losses.append(float(model.train_batch(batch, opt, loss_fn=loss_fn)))
        changed.append(np.count_nonzero(np.asarray(model.module.w.kernel[...]) != before))
    # before rampup_begin_step: the user's momentum SGD on the dense average, as on one device
    ref_losses, _ = train_one_device(
        Regression(), optax.sgd(LR, momentum=0.9), data[: BEGIN + 1], loss_fn
    )
    np.testing.assert_allclose(losses[: BEGIN + 1], ref_losses, rtol=1e-5)
    # after: W moves only where some replica sent one of its top 0.1% (16 entries each)
    k = int(D * D * 0.001)
    assert min(changed[:BEGIN]) > 10 * DP * k  # dense steps move thousands of weights
    assert 0 < max(changed[BEGIN:]) <= DP * k
    # and it learns: the loss falls by more than 5x in 20 steps (63.7 -> 5.7 measured)
    assert losses[-1] < losses[0] / 5, (losses[0], losses[-1])


@pytest.mark.parametrize(
    ("hybrid", "tx", "error"),
    [
        ({"dp_degree": DP}, hyperparams.adam(1e-3), r"needs a Momentum optimizer.*got 'adam'"),
        (
            {"dp_degree": 1, "mp_degree": DP},
            hyperparams.momentum(0.1),
            r"more than one data-parallel worker.*dp x sharding x ep = 1",
        ),
    ],
)
def test_dgc_checks_are_clear_errors(hybrid, tx, error):
    init_fleet(hybrid, dgc=True)
    with pytest.raises(ValueError, match=error):
        fleet.distributed_optimizer(tx)

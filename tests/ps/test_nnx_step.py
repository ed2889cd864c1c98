"""A sparse table inside a user's ``nnx.jit`` step with an NNX model and ``nnx.Optimizer``:
the whole training (pull, dense + sparse gradients, push) on 8 devices equals one device."""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType

from jfleet.mesh.topology import DP
from jfleet.ps import CtrAccessor, SparseSGDRule, SparseTable

FIELDS, DIM, BATCH, STEPS = 3, 8, 16, 6


def train(devices: int) -> list[float]:
    mesh = jax.make_mesh(
        (devices,), (DP,), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices]
    )
    acc = CtrAccessor(SparseSGDRule("adam", learning_rate=0.05))
    table = SparseTable(1024, DIM, acc, mesh=mesh, seed=1)
    model = nnx.Sequential(nnx.Linear(FIELDS * DIM, 16, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(16, 1, rngs=nnx.Rngs(1)))  # fmt: skip
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit(donate_argnums=2)
    def step(model, opt, tstate, rows, inverse, show, click, labels):
        pulled = table.pull(tstate, rows)

        def loss_fn(model, pulled):
            z = model(pulled[inverse].reshape(BATCH, -1))[:, 0]
            return optax.sigmoid_binary_cross_entropy(z, labels).mean()

        loss, (g_model, g_rows) = nnx.value_and_grad(loss_fn, argnums=(0, 1))(model, pulled)
        opt.update(model, g_model)
        return table.push(tstate, rows, g_rows * BATCH, show, click), loss

    rng = np.random.default_rng(0)
    losses = []
    for _ in range(STEPS):
        ids = rng.integers(0, 40, (BATCH, FIELDS)) + (np.arange(FIELDS) << 20)
        labels = (ids[:, 0] % 2).astype(np.float32)  # learnable from field 0
        b = table.prepare(ids, labels)
        batch = (b.rows, b.inverse, b.show, b.click, labels)
        table.state, loss = step(model, opt, table.state, *batch)
        losses.append(float(loss))
    return losses


def test_an_nnx_step_with_a_sparse_table_on_8_devices_equals_one_device():
    one, eight = train(1), train(8)
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    assert eight[-1] < eight[0]

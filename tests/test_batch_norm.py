"""sync_batch_norm at dp8: on, one device on the global batch; off, one device per replica."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet, make_train_step
from jfleet.auto_parallel import to_distributed
from jfleet.optim.communication import mean_communication
from jfleet.precision.batch_norm import SyncBatchNorm, is_sync, replicas_of
from jfleet.testing import hlo
from jfleet.testing.reference import train_one_device
from jfleet.testing.trees import assert_trees_close
from tests.fleet_setup import init_fleet

DP = 8
LR = 0.1
TOL = {"rtol": 1e-5, "atol": 1e-5}


class ConvBN(nnx.Module):
    """Conv -> BatchNorm over (N, H, W) -> relu -> pool -> Linear: the ResNet stem, tiny."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(2, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
        self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.relu(self.bn(self.conv(x)))
        return self.head(h.mean((1, 2)))


def loss_fn(model: nnx.Module, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def batches(n: int = 2) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        # each replica's rows get their own offset and spread: per-replica statistics differ
        shift = np.repeat(rng.normal(size=(DP, 1, 1, 1, 2)) * 2.0, 4, axis=1).reshape(32, 1, 1, 2)
        x = rng.normal(size=(32, 4, 4, 2)) * (1.0 + np.abs(shift)) + shift
        out.append({"x": x.astype(np.float32), "y": rng.normal(size=(32,)).astype(np.float32)})
    return out


def _stats(model: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))


def _distributed(sync: bool):
    init_fleet({"dp_degree": DP}, sync_batch_norm=sync)
    model = fleet.distributed_model(ConvBN(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.sgd(LR))
    return model, opt


def _grads_on_mesh(model: nnx.Module, batch: dict) -> tuple[jax.Array, nnx.State]:
    """Loss and parameter gradients of the placed model on the sharded batch (no update)."""
    graphdef, state = nnx.split(model.module)
    grad = jax.value_and_grad(lambda s, b: loss_fn(nnx.merge(graphdef, s), b))
    loss, grads = jax.jit(grad)(state, model.placement.shard_batch(batch))
    return loss, nnx.state(nnx.merge(graphdef, grads), nnx.Param)


def _forward_reductions(model: nnx.Module, data: dict) -> int:
    """All-reduces in the compiled forward pass on the sharded batch."""
    graphdef, state = nnx.split(model.module)
    forward = lambda s, b: nnx.merge(graphdef, s)(b["x"])  # noqa: E731
    text = jax.jit(forward).lower(state, model.placement.shard_batch(data)).compile().as_text()
    return sum(c.kind == "all-reduce" for c in hlo.collectives(text))


def test_sync_on_equals_one_device_on_the_global_batch():
    data = batches()
    model, opt = _distributed(sync=True)
    assert replicas_of(model.module.bn) == 1
    assert _forward_reductions(model, data[0]) > 0  # the statistics are reduced over dp
    loss, grads = _grads_on_mesh(model, data[0])
    ref = ConvBN(nnx.Rngs(0))
    ref_loss, ref_grads = nnx.value_and_grad(loss_fn)(ref, jax.tree.map(jnp.asarray, data[0]))
    np.testing.assert_allclose(float(loss), float(ref_loss), **TOL)
    assert_trees_close(grads, nnx.state(ref_grads, nnx.Param), **TOL)

    losses = [float(model.train_batch(b, opt, loss_fn=loss_fn)) for b in data]
    ref = ConvBN(nnx.Rngs(0))
    ref_losses, ref_params = train_one_device(ref, optax.sgd(LR), data, loss_fn)
    np.testing.assert_allclose(losses, ref_losses, **TOL)
    assert_trees_close(nnx.state(model.module, nnx.Param), ref_params, **TOL)
    assert_trees_close(_stats(model.module), _stats(ref), **TOL)


def _per_replica_reference(batch: dict) -> tuple[float, nnx.State, dict]:
    """One device run per replica's rows: the mean loss, gradient and running statistics."""
    losses, grads, stats = [], [], []
    for r in range(DP):
        shard = jax.tree.map(lambda a, r=r: jnp.asarray(a[r * 4 : (r + 1) * 4]), batch)
        ref = ConvBN(nnx.Rngs(0))
        loss, g = nnx.value_and_grad(loss_fn)(ref, shard)
        losses.append(loss)
        grads.append(nnx.state(g, nnx.Param))
        stats.append(_stats(ref))
    mean = lambda trees: jax.tree.map(lambda *xs: sum(xs) / DP, *trees)  # noqa: E731
    return float(np.mean(losses)), mean(grads), mean(stats)


def test_sync_off_is_one_device_per_replica_and_differs_from_sync_on():
    data = batches(1)
    model, opt = _distributed(sync=False)
    assert replicas_of(model.module.bn) == DP and type(model.module.bn).__name__ == "BatchNorm"
    ref_loss, ref_grads, ref_stats = _per_replica_reference(data[0])
    loss, grads = _grads_on_mesh(model, data[0])
    np.testing.assert_allclose(float(loss), ref_loss, **TOL)
    assert_trees_close(grads, ref_grads, **TOL)

    params0 = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model.module, nnx.Param)))
    loss = model.train_batch(data[0], opt, loss_fn=loss_fn)
    np.testing.assert_allclose(float(loss), ref_loss, **TOL)
    want = jax.tree.map(lambda p, g: p - LR * g, params0, nnx.to_pure_dict(ref_grads))
    assert_trees_close(nnx.state(model.module, nnx.Param), want, **TOL)
    assert_trees_close(_stats(model.module), ref_stats, **TOL)  # the replica mean

    # the global-batch statistics give another loss and other running statistics
    glob = ConvBN(nnx.Rngs(0))
    glob_loss = float(loss_fn(glob, jax.tree.map(jnp.asarray, data[0])))
    assert abs(glob_loss - ref_loss) > 1e-2
    assert np.max(np.abs(_stats(glob)["bn"]["var"] - ref_stats["bn"]["var"])) > 1e-2


def test_sync_off_forward_has_no_collective_and_eval_batch_uses_replica_statistics():
    data = batches(1)[0]
    model, _ = _distributed(sync=False)
    assert _forward_reductions(model, data) == 0  # each replica's statistics stay local
    outputs = model.eval_batch([data["x"]], compute_loss=False)
    want = []
    for r in range(DP):
        ref = ConvBN(nnx.Rngs(0))
        want.append(ref(jnp.asarray(data["x"][r * 4 : (r + 1) * 4])))
    np.testing.assert_allclose(np.asarray(outputs), np.concatenate(want), **TOL)
    model.module.eval()  # running averages: per-replica and global runs agree
    ref = ConvBN(nnx.Rngs(0))
    ref.eval()
    got = model.eval_batch([data["x"]], compute_loss=False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref(jnp.asarray(data["x"]))), **TOL)


def test_convert_sync_batchnorm_and_errors():
    init_fleet({"dp_degree": DP})  # Paddle's default: sync_batch_norm=False
    model = SyncBatchNorm.convert_sync_batchnorm(ConvBN(nnx.Rngs(0)))
    assert is_sync(model.bn) and isinstance(model.bn, nnx.BatchNorm)
    wrapped = fleet.distributed_model(model)
    assert replicas_of(wrapped.module.bn) == 1
    plain = fleet.distributed_model(ConvBN(nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"divisible by 8.*sync_batch_norm=True"):
        plain(jnp.ones((12, 4, 4, 2)))
    with pytest.raises(TypeError, match="expected a flax.nnx Module"):
        SyncBatchNorm.convert_sync_batchnorm([1])


@pytest.mark.parametrize("sync", [True, False])
def test_the_engines_per_replica_step_keeps_the_statistics(sync):
    """Inside the replica shard_map (fp16_allreduce, DGC) each module sees one replica's
    rows: sync all-reduces their statistics, off keeps them; same references as above."""
    data = batches(1)[0]
    model, opt = _distributed(sync=sync)
    opt.communication = mean_communication()  # the replica hook with an exact fp32 mean
    params0 = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model.module, nnx.Param)))
    loss = model.train_batch(data, opt, loss_fn=loss_fn)
    if sync:
        ref = ConvBN(nnx.Rngs(0))
        batch = jax.tree.map(jnp.asarray, data)
        ref_loss, ref_grads = nnx.value_and_grad(loss_fn)(ref, batch)
        ref_loss, ref_grads, ref_stats = (
            float(ref_loss),
            nnx.state(ref_grads, nnx.Param),
            _stats(ref),
        )
    else:
        ref_loss, ref_grads, ref_stats = _per_replica_reference(data)
    np.testing.assert_allclose(float(loss), ref_loss, **TOL)
    want = jax.tree.map(lambda p, g: p - LR * g, params0, nnx.to_pure_dict(ref_grads))
    assert_trees_close(nnx.state(model.module, nnx.Param), want, **TOL)
    assert_trees_close(_stats(model.module), ref_stats, **TOL)


def test_to_distributed_models_get_per_replica_statistics():
    data = batches(1)
    model, opt, loader = to_distributed(ConvBN(nnx.Rngs(0)), optax.sgd(LR), data)
    assert replicas_of(model.bn) == DP  # planned dp8, Paddle's default sync_batch_norm=False
    loss = make_train_step(loss_fn)(model, opt, next(iter(loader)))
    np.testing.assert_allclose(float(loss), _per_replica_reference(data[0])[0], **TOL)

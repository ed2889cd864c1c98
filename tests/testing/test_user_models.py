"""A user's own model and batches: a CNN on {"image", "label"} dicts, only ``loss_fn`` given."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import ToDistributedConfig, make_train_step, to_distributed
from jfleet.auto_parallel import get_plan
from jfleet.testing import assert_trains_like_one_device, default_tolerance, state_as_numpy
from jfleet.testing.reference import train_one_device


class CNN(nnx.Module):
    """The Flax MNIST tutorial's shape of model, shrunk: conv, pool, two dense layers."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.hidden = nnx.Linear(4 * 4 * 4, 32, rngs=rngs)
        self.out = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv(x)), window_shape=(2, 2), strides=(2, 2))
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def cnn() -> CNN:
    return CNN(nnx.Rngs(0))


def loss_fn(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def batches(n: int, key: str = "image") -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            key: rng.normal(size=(16, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, 16).astype(np.int32),
        }
        for _ in range(n)
    ]


def test_a_cnn_on_image_label_dicts_goes_through_to_distributed_with_only_loss_fn():
    model, opt, loader = to_distributed(
        cnn(), optax.adam(1e-2), batches(2), config=ToDistributedConfig(loss_fn=loss_fn)
    )
    assert get_plan(model).layout.size == 8
    step = make_train_step(loss_fn)
    losses = [float(step(model, opt, batch)) for batch in loader]
    want, _ = train_one_device(cnn(), optax.adam(1e-2), batches(2), loss_fn)
    np.testing.assert_allclose(losses, want, rtol=default_tolerance(8))


def renamed(model, batch):
    """The loss of batches whose input key no trace rule knows ("pixels")."""
    return loss_fn(model, {**batch, "image": batch["pixels"]})


def test_a_dict_batch_under_an_unknown_key_is_traced_through_loss_fn():
    with pytest.raises(ValueError, match=r"ToDistributedConfig\(loss_fn=loss_fn\)"):
        to_distributed(cnn(), optax.sgd(0.1), batches(1, "pixels"))
    model, _, _ = to_distributed(
        cnn(), optax.sgd(0.1), batches(1, "pixels"), config=ToDistributedConfig(loss_fn=renamed)
    )
    assert get_plan(model).layout.size == 8


@pytest.mark.parametrize("layout", [{"dp": 8}, {"dp": 2, "mp": 4}])
def test_the_cnn_trains_like_one_device_at_the_default_tolerance(layout):
    # "pixels" is no known input key: only tracing loss_fn lets to_distributed read the model
    data = batches(3, "pixels")
    assert_trains_like_one_device(cnn, optax.adam(1e-2), data, loss_fn=renamed, layout=layout)


def test_state_as_numpy_compares_a_distributed_model_with_a_plain_one():
    plain = cnn()
    model, _, _ = to_distributed(
        cnn(),
        optax.sgd(0.1),
        batches(1),
        config=ToDistributedConfig(force_mesh={"dp": 2, "mp": 4}, loss_fn=loss_fn),
    )
    got, want = state_as_numpy(model), state_as_numpy(plain)
    assert list(got) == list(want)
    for key in want:
        assert type(got[key]) is np.ndarray
        np.testing.assert_array_equal(got[key], want[key])


def test_the_default_tolerance_scales_with_the_parameter_and_the_reduction_depth():
    assert default_tolerance(8) == pytest.approx(4e-5)

    def nudged(by: float):
        def trainer(model, tx, data, loss):
            losses, _ = train_one_device(model, tx, data, loss)
            model.out.bias[...] = model.out.bias[...].at[0].add(by)
            return losses

        return trainer

    # a bias near 1: 3e-5 is within fp32 reordering on 8 devices, 1e-3 is a bug
    args = (cnn, optax.sgd(0.1), batches(1))
    assert_trains_like_one_device(*args, loss_fn=loss_fn, layout=nudged(3e-5))
    with pytest.raises(AssertionError, match="'out.bias': 1 of 10 values differ"):
        assert_trains_like_one_device(*args, loss_fn=loss_fn, layout=nudged(1e-3))

"""``fleet.amp_init``, ``fleet.minimize`` and the federated names (Paddle's static-graph and
federated-learning Fleet calls; ``qat_init`` is in ``test_quantization.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import Placement, fleet, make_train_step
from jfleet.fleet.fleet_base import Fleet
from jfleet.precision.amp import decorate
from tests.fleet_setup import init_fleet

F32 = jnp.dtype(jnp.float32)
BF16 = jnp.dtype(jnp.bfloat16)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.fc(x))))


def mse(model, batch):
    return jnp.mean((model(batch["x"]).astype(jnp.float32) - batch["y"]) ** 2)


def batches(n: int = 3) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(16, 8)).astype(np.float32),
            "y": rng.normal(size=(16, 4)).astype(np.float32),
        }
        for _ in range(n)
    ]


def dtypes(model) -> dict[str, jnp.dtype]:
    return {
        ".".join(map(str, p)): v.get_value().dtype
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def params(model) -> dict[str, np.ndarray]:
    return {
        ".".join(map(str, p)): np.asarray(v.get_value(), np.float32)
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def train(model, opt, data) -> list[float]:
    step = make_train_step(mse)
    return [float(step(model, opt, b)) for b in data]


# ------------------------------------------------------------------------------- amp_init
def test_amp_init_casts_for_o2_keeps_fp32_masters_and_trains_as_decorate():
    data = batches()
    init_fleet(amp=True, amp_configs={"use_pure_bf16": True})
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    model = Placement.from_fleet().place_params(MLP(nnx.Rngs(0)))  # placed, still fp32
    assert set(dtypes(model).values()) == {F32}
    assert fleet.amp_init(place="gpu:0", scope=object(), model=model) is None
    assert dtypes(model) == {
        "fc.kernel": BF16,
        "fc.bias": BF16,
        "norm.scale": F32,  # a black (norm) module keeps fp32
        "norm.bias": F32,
        "out.kernel": BF16,
        "out.bias": BF16,
    }
    masters = opt.opt_state.master_params  # made by amp_init, before any step
    assert masters["fc"]["kernel"].get_value().dtype == F32
    np.testing.assert_array_equal(
        np.asarray(masters["fc"]["kernel"].get_value()), params(model)["fc.kernel"]
    )
    losses = train(model, opt, data)

    init_fleet()  # the same run, written with paddle.amp.decorate
    ref = Placement.from_fleet().place_params(MLP(nnx.Rngs(0)))
    ref_opt = fleet.distributed_optimizer(optax.adam(1e-2))
    ref, ref_opt = decorate(ref, ref_opt, level="O2", dtype="bfloat16")
    ref_losses = train(ref, ref_opt, data)
    assert losses == ref_losses  # bit for bit
    assert dtypes(model) == dtypes(ref)
    for name, value in params(ref).items():
        np.testing.assert_array_equal(params(model)[name], value, err_msg=name)


def test_amp_init_after_distributed_model_finds_the_work_done():
    init_fleet(amp=True, amp_configs={"use_pure_fp16": True})
    model = fleet.distributed_model(MLP(nnx.Rngs(0)))  # casts for O2 already
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    before = params(model)
    fleet.amp_init()  # the last distributed model
    assert params(model).keys() == before.keys()
    assert dtypes(model)["module.fc.kernel"] == jnp.float16 and opt.is_bound


@pytest.mark.parametrize(
    "settings, match",
    [
        ({}, r"strategy\.amp = True and strategy\.amp_configs = \{'use_pure_fp16': True\}"),
        ({"amp": True}, r"now strategy\.amp=True at level O1"),
    ],
)
def test_amp_init_without_amp_o2_names_the_switch(settings, match):
    init_fleet(**settings)
    fleet.distributed_optimizer(optax.sgd(0.1))
    with pytest.raises(ValueError, match=match):
        fleet.amp_init(model=MLP(nnx.Rngs(0)))


def test_amp_init_needs_the_optimizer_and_comes_before_training():
    init_fleet(amp=True, amp_configs={"use_pure_bf16": True})
    model = MLP(nnx.Rngs(0))
    with pytest.raises(RuntimeError, match=r"call fleet\.distributed_optimizer\(opt\) first"):
        fleet.amp_init(model=model)
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    with pytest.raises(ValueError, match="no model given"):
        fleet.amp_init()
    opt.init(model)  # state made for the fp32 parameters, as a first step would
    with pytest.raises(ValueError, match="call amp_init before the first step"):
        fleet.amp_init(model=model)
    assert set(dtypes(model).values()) == {F32}  # nothing was cast


# ------------------------------------------------------------------------------- minimize
def test_minimize_is_the_engine_step_on_the_distributed_optimizer():
    data = batches()
    init_fleet({"dp_degree": 8})
    model = fleet.distributed_model(MLP(nnx.Rngs(0)))
    fleet.distributed_optimizer(optax.adam(1e-2))
    losses = [float(fleet.minimize(mse, batch=b)) for b in data]

    ref = fleet.distributed_model(MLP(nnx.Rngs(0)))
    ref_losses = train(ref, fleet.distributed_optimizer(optax.adam(1e-2)), data)
    assert losses == ref_losses
    for name, value in params(ref).items():
        np.testing.assert_array_equal(params(model)[name], value, err_msg=name)

    plain = Placement.from_fleet().place_params(MLP(nnx.Rngs(0)))  # not a DistributedModel
    fleet.distributed_optimizer(optax.adam(1e-2))
    plain_losses = [float(fleet.minimize(mse, None, model=plain, batch=b)) for b in data]
    np.testing.assert_allclose(plain_losses, ref_losses, rtol=1e-6)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: fleet.minimize([mse, mse], batch=1), ValueError, r"list of 2 losses"),
        (lambda: fleet.minimize(jnp.float32(1.0), batch=1), TypeError, r"loss=ArrayImpl\)"),
        (lambda: fleet.minimize(mse, parameter_list=["w"], batch=1), ValueError, r"wrt filter"),
        (lambda: fleet.minimize(mse, no_grad_set={"w"}, batch=1), ValueError, r"no_grad_set="),
        (lambda: fleet.minimize(mse), TypeError, r"needs batch="),
        (lambda: fleet.minimize(mse, batch=1), RuntimeError, r"distributed_optimizer\(opt\)"),
    ],
)
def test_minimize_refuses_what_means_nothing_here(call, error, match):
    init_fleet()
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------- federated names
FEDERATED = ("init_coordinator", "make_fl_strategy", "get_fl_client")


@pytest.mark.parametrize("name", FEDERATED)
def test_federated_calls_say_federated_mode_is_not_offered_and_why(name):
    assert name in fleet.__all__ and callable(getattr(Fleet, name))
    init_fleet()
    with pytest.raises(NotImplementedError, match=rf"fleet\.{name}\(\): federated.*SPMD"):
        getattr(fleet, name)()
    with pytest.raises(NotImplementedError, match="no coordinator or client role"):
        getattr(fleet.fleet, name)()


def test_is_coordinator_answers_false_after_init():
    with pytest.raises(RuntimeError):
        fleet.is_coordinator()
    init_fleet()
    assert fleet.is_coordinator() is False and fleet.fleet.is_coordinator() is False
    assert {"amp_init", "qat_init", "minimize", "is_coordinator"} <= set(fleet.__all__)

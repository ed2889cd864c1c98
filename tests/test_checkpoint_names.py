"""Paddle's save / load names over jfleet.checkpoint: saved on one mesh, loaded on another."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jfleet.distributed as dist
from jfleet import fleet
from jfleet.checkpoint import layout
from jfleet.distributed.sharding import (
    group_sharded_parallel,
    load_group_sharded_model,
    save_group_sharded_model,
)
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
from tests.fleet_setup import init_fleet

# A failed tensorstore read can report to Orbax's closed event loop later: harmless.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def linear(seed: int) -> nnx.Linear:
    return nnx.Linear(8, 4, rngs=nnx.Rngs(seed))


def counted(shape: tuple, dtype) -> np.ndarray:
    """Distinct values per element: what a loaded leaf must hold."""
    return (np.arange(int(np.prod(shape))).reshape(shape) + 1).astype(dtype)


def fill(opt) -> None:
    """Sets every optimizer leaf to ``counted`` values, keeping its sharding."""
    for var in layout.state_leaves(opt).values():
        old = var.get_value()
        var.set_value(jax.device_put(counted(old.shape, old.dtype), old.sharding))


def assert_counted(opt) -> None:
    leaves = layout.state_leaves(opt)
    assert len(leaves) > 3  # step, mu / nu of kernel and bias
    for path, var in leaves.items():
        value = var.get_value()
        np.testing.assert_array_equal(value, counted(value.shape, value.dtype), err_msg=str(path))


def test_state_dict_saved_on_one_mesh_loads_into_another_mesh_in_place(tmp_path):
    devices = np.array(jax.devices())
    mesh8 = jax.make_mesh((8,), ("a",), devices=devices)
    mesh24 = jax.make_mesh((2, 4), ("b", "c"), devices=devices[::-1])
    w = np.arange(64, dtype=np.float32).reshape(8, 8) / 7
    saved = {
        "layer.w": jax.device_put(w, NamedSharding(mesh8, P("a"))),
        "layer.step": jnp.int32(5),
        "host": np.arange(3),
    }
    dist.save_state_dict(saved, tmp_path / "sd", coordinator_rank=0)
    target_sharding = NamedSharding(mesh24, P(None, ("b", "c")))
    target = {
        "layer.w": jax.device_put(np.zeros((8, 8), np.float32), target_sharding),
        "host": np.zeros(3, np.int64),
    }
    dist.load_state_dict(target, tmp_path / "sd")  # "layer.step" is not asked for
    np.testing.assert_array_equal(target["layer.w"], w)
    np.testing.assert_array_equal(target["host"], [0, 1, 2])
    dist.save_state_dict({"host": np.arange(3) * 2}, tmp_path / "sd")  # replaces the directory
    with pytest.raises(ValueError, match=r"'layer.w' is not in the state dict"):
        dist.load_state_dict(target, tmp_path / "sd")
    assert target["layer.w"].sharding == target_sharding  # read into the target's placement
    # nnx.Variables are set in place: Paddle's model.state_dict() round trip
    model = linear(1)
    state = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}
    dist.save_state_dict(state, tmp_path / "model")
    fresh = linear(2)
    dist.load_state_dict(
        {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(fresh))},
        tmp_path / "model",
    )
    np.testing.assert_array_equal(fresh.kernel[...], linear(1).kernel[...])
    np.testing.assert_array_equal(fresh.bias[...], linear(1).bias[...])


def test_fleet_save_on_zero3_loads_on_data_parallel(tmp_path):
    init_fleet({"dp_degree": 2, "sharding_degree": 4}, sharding=True, sharding_configs={"stage": 3})
    model = fleet.distributed_model(linear(0))
    opt = fleet.distributed_optimizer(optax.adam(0.1))
    opt.init(model)
    fill(opt)
    assert not model.module.kernel.get_value().sharding.is_fully_replicated  # ZeRO-3 shards
    fleet.save(str(tmp_path / "all"))  # the last distributed model and optimizer
    fleet.save_dense_params(None, str(tmp_path / "dense"))
    fleet._reset()

    init_fleet({"dp_degree": 8})
    model = fleet.distributed_model(linear(3))
    opt = fleet.distributed_optimizer(optax.adam(0.1))
    opt.init(model)
    placed = model.module.kernel.get_value().sharding
    fleet.load_model(str(tmp_path / "dense"))  # parameters only: the optimizer keeps its state
    np.testing.assert_array_equal(model.module.kernel[...], linear(0).kernel[...])
    assert not np.asarray(layout.state_leaves(opt)[("step",)].get_value()).any()
    fleet.load_model(str(tmp_path / "all"))
    np.testing.assert_array_equal(model.module.kernel[...], linear(0).kernel[...])
    np.testing.assert_array_equal(model.module.bias[...], linear(0).bias[...])
    assert model.module.kernel.get_value().sharding == placed
    assert_counted(opt)
    # save_persistables / explicit objects: the same files as fleet.save
    other = linear(4)
    fleet.save_persistables("executor", str(tmp_path / "p"), model=model, optimizer=opt)
    fleet.load_model(str(tmp_path / "p"), model=other)
    np.testing.assert_array_equal(other.kernel[...], linear(0).kernel[...])


def test_group_sharded_model_saved_at_p_g_os_loads_at_os(tmp_path):
    model, opt, _ = group_sharded_parallel(linear(0), optax.adam(0.1), "p_g_os")
    opt.init(model)
    fill(opt)
    save_group_sharded_model(model, str(tmp_path / "out"), optimizer=opt)
    fleet._reset()

    init_fleet({"dp_degree": 4, "sharding_degree": 2})
    model, opt, _ = group_sharded_parallel(linear(5), optax.adam(0.1), "os")
    opt.init(model)
    load_group_sharded_model(model, str(tmp_path / "out"), optimizer=opt)
    np.testing.assert_array_equal(model.module.kernel[...], linear(0).kernel[...])
    assert_counted(opt)


def test_fleet_save_with_feed_writes_an_inference_model(tmp_path):
    model = linear(0)
    x = jnp.ones((2, 8))
    fleet.save(str(tmp_path / "infer"), feed=[x], model=model)
    np.testing.assert_allclose(fleet.load_inference_model(str(tmp_path / "infer"))(x), model(x))


def _saved(tmp_path) -> str:
    path = str(tmp_path / "sd")
    dist.save_state_dict({"w": jnp.zeros((2, 3))}, path)
    return path


def _dense_into_optimizer(tmp_path) -> None:
    model = linear(0)
    fleet.save_dense_params(None, str(tmp_path), model=model)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fleet.load_model(str(tmp_path), model=model, optimizer=opt)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda p: dist.save_state_dict({"w": [1, 2]}, str(p / "x")),
            TypeError,
            r"save_state_dict: state_dict\['w'\] is a list; expected a jax.Array",
        ),
        (
            lambda p: dist.save_state_dict([jnp.zeros(2)], str(p / "x")),
            TypeError,
            r"save_state_dict\(state_dict=list\): expected a dict of name -> array",
        ),
        (
            lambda p: dist.save_state_dict({"a": jnp.zeros(1), "a.b": jnp.zeros(1)}, str(p)),
            ValueError,
            r"keys 'a' and 'a.b' clash",
        ),
        (
            lambda p: dist.load_state_dict({"v": jnp.zeros((2, 3))}, _saved(p)),
            ValueError,
            r"'v' is not in the state dict at .*sd' \(it holds e.g. \['w'\]\)",
        ),
        (
            lambda p: dist.load_state_dict({"w": jnp.zeros((3, 2))}, _saved(p)),
            ValueError,
            r"'w' has shape \(2, 3\) in .* but \(3, 2\) in the dict given",
        ),
        (
            lambda p: dist.load_state_dict({"w": jnp.zeros(2)}, str(p / "nothing")),
            FileNotFoundError,
            r"load_state_dict: no state dict at .*nothing'",
        ),
        (
            lambda p: fleet.load_model(str(p), mode=1, model=linear(0)),
            ValueError,
            r"fleet.load_model\(mode=1\): only mode=0",
        ),
        (
            lambda p: fleet.save(str(p), fetch=lambda m, x: m(x), model=linear(0)),
            ValueError,
            r"fleet.save: fetch=<function .*> without feed",
        ),
        (
            lambda p: fleet.save(str(p), model=linear(0), inference=True),
            ValueError,
            r"fleet.save: configs \['inference'\] are not understood",
        ),
        (
            lambda p: fleet.save_persistables(None, str(p)),
            ValueError,
            r"fleet.save_persistables: model=None and no model was wrapped",
        ),
        (
            _dense_into_optimizer,
            ValueError,
            r"holds no optimizer state \(saved without one, or with save_dense_params\)",
        ),
        (
            lambda p: load_group_sharded_model({"w": 1}, str(p)),
            TypeError,
            r"load_group_sharded_model\(model=dict\): expected the nnx.Module",
        ),
    ],
)
def test_bad_arguments_name_the_value(tmp_path, call, error, match):
    with pytest.raises(error, match=match):
        call(tmp_path)


class Stack(nnx.Module):
    """The plain model behind a four-layer PipelineLayer: ``layers.<i>``."""

    def __init__(self) -> None:
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(9)) for _ in range(4)])


def test_fleet_save_of_a_pipeline_loads_into_the_plain_model(tmp_path):
    init_fleet({"dp_degree": 2, "pp_degree": 2, "mp_degree": 2})
    model = fleet.distributed_model(PipelineLayer([LayerDesc(nnx.Linear, 4, 4)] * 4, num_stages=2))
    kernels = {}
    for path, var in layout.state_leaves(model).items():
        old = var.get_value()
        var.set_value(jax.device_put(counted(old.shape, old.dtype), old.sharding))
        if path[-1] == "kernel":
            kernels = counted(old.shape, old.dtype).reshape(4, 4, 4)  # [pp, L/pp] -> layer
    fleet.save(str(tmp_path / "pp"), model=model)
    fleet._reset()
    plain = Stack()
    fleet.load_model(str(tmp_path / "pp"), model=plain)
    for i in range(4):
        np.testing.assert_array_equal(plain.layers[i].kernel[...], kernels[i])

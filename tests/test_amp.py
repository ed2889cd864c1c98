"""Tests for jfleet.amp: Paddle's O1/O2 precision policy on Flax NNX modules."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.precision.amp import (
    DEFAULT_BLACK_LIST,
    DEFAULT_WHITE_LIST,
    AmpPolicy,
    apply_amp,
    cast_floating,
)

F32 = jnp.dtype(jnp.float32)


class ColumnParallelLinear(nnx.Module):
    """Stands in for a later tensor-parallel layer: white by its name's suffix."""

    def __init__(self, din, dout, *, rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (din, dout)))
        self.dtype = None

    def __call__(self, x):
        x, w = nnx.nn.dtypes.promote_dtype((x, self.weight[...]), dtype=self.dtype)
        return x @ w


class Dense(nnx.Linear):
    """A user subclass of a white class."""


class Scale(nnx.Module):
    """A gray module: neither list names it."""

    def __init__(self, n):
        self.gain = nnx.Param(jnp.ones(n))
        self.dtype = None

    def __call__(self, x):
        return x * self.gain[...]


class Net(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(16, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
        self.rms = nnx.RMSNorm(8, rngs=rngs)
        self.fc = nnx.Linear(8, 8, rngs=rngs)
        self.col = ColumnParallelLinear(8, 8, rngs=rngs)
        self.dense = Dense(8, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
        self.scale = Scale(8)
        self.conv = nnx.Conv(8, 4, kernel_size=(3,), rngs=rngs)
        self.pos = nnx.Param(jnp.zeros(8))
        self.step = nnx.Variable(jnp.zeros((), jnp.int32))
        self.mask = nnx.Variable(jnp.ones(8, bool))
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, ids):
        out = {}
        out["embed"] = x = self.embed(ids)
        x = x + self.pos[...]
        out["norm"] = h = self.norm(x)
        out["attn"] = a = self.attn(h)
        out["rms"] = r = self.rms(a)
        out["fc"] = y = self.fc(r)
        out["col"] = y = self.col(y)
        out["dense"] = y = self.dense(y)
        out["bn"] = y = self.bn(y)
        out["scale"] = y = self.scale(y)
        out["conv"] = self.conv(y)
        return out


def _net():
    return Net(nnx.Rngs(0))


def _param_dtypes(model):
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): v.get_value().dtype for path, v in flat}


def _raw(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


IDS = jnp.array([[1, 2, 3, 4]])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_o1_sets_compute_dtypes_and_keeps_fp32_params(dtype):
    half = jnp.dtype(dtype)
    model = apply_amp(_net(), dtype=dtype, level="O1")
    for name in ("embed", "attn", "fc", "col", "dense", "conv"):
        assert getattr(model, name).dtype == half, name
    for sub in ("query", "key", "value", "out"):  # LinearGeneral children of the attention
        assert getattr(model.attn, sub).dtype == half
    for name in ("norm", "rms", "bn"):
        assert getattr(model, name).dtype == F32, name
    assert model.scale.dtype is None  # gray: untouched
    assert set(_param_dtypes(model).values()) == {F32}

    out = model(IDS)
    for name in ("embed", "attn", "fc", "col", "dense", "conv"):
        assert out[name].dtype == half, name
    for name in ("norm", "rms", "bn"):
        assert out[name].dtype == F32, name
    assert out["scale"].dtype == F32  # gray follows its inputs: fp32 BN output * fp32 gain
    assert model.norm(jnp.ones((1, 8), half)).dtype == F32  # black upcasts half inputs


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_o2_casts_params_except_black_modules(dtype):
    half = jnp.dtype(dtype)
    model = _net()
    rng_before = jax.tree.map(_raw, nnx.state(model, nnx.RngState))
    apply_amp(model, dtype=dtype, level="O2")
    dtypes = _param_dtypes(model)
    for path, got in dtypes.items():
        black = path.split(".")[0] in ("norm", "rms", "bn")
        assert got == (F32 if black else half), path
    assert dtypes["pos"] == half  # the root Net is gray: Paddle's O2 casts it too
    assert dtypes["scale.gain"] == half
    assert model.step.get_value().dtype == jnp.int32
    assert model.mask.get_value().dtype == jnp.bool_
    assert model.bn.mean.get_value().dtype == F32  # BatchStat, not a Param
    rng_after = jax.tree.map(_raw, nnx.state(model, nnx.RngState))
    jax.tree.map(np.testing.assert_array_equal, rng_before, rng_after)

    out = model(IDS)
    assert out["fc"].dtype == half and out["conv"].dtype == half
    assert out["norm"].dtype == F32 and out["bn"].dtype == F32


def test_o2_outputs_under_nnx_jit():
    model = apply_amp(_net(), dtype="bfloat16", level="O2")
    out = nnx.jit(lambda m, ids: m(ids))(model, IDS)
    assert out["dense"].dtype == jnp.bfloat16 and out["rms"].dtype == F32


def test_custom_lists_move_classes():
    model = apply_amp(
        _net(),
        dtype="bfloat16",
        level="O2",
        custom_white_list=["LayerNorm"],
        custom_black_list=("Linear", "ColumnParallelLinear"),
    )
    half = jnp.dtype(jnp.bfloat16)
    dtypes = _param_dtypes(model)
    assert model.norm.dtype == half and dtypes["norm.scale"] == half
    assert model.fc.dtype == F32 and dtypes["fc.kernel"] == F32
    assert model.col.dtype == F32 and dtypes["col.weight"] == F32
    # Dense subclasses Linear; with "Linear" black and "Dense" unlisted, the MRO says black.
    assert model.dense.dtype == F32 and dtypes["dense.kernel"] == F32
    # LinearGeneral is its own class, still white.
    assert model.attn.query.dtype == half and dtypes["attn.query.kernel"] == half


def test_subclass_name_decides_first():
    policy = AmpPolicy(custom_black_list=["Dense"])
    assert policy.classify(Dense) == "black"
    assert policy.classify(nnx.Linear) == "white"
    assert AmpPolicy().classify(Dense) == "white"
    assert AmpPolicy().classify(Scale) == "gray"

    class VocabParallelEmbedding(nnx.Module):
        pass

    assert AmpPolicy().classify(VocabParallelEmbedding) == "white"


def test_policy_is_frozen_hashable_and_normalised():
    policy = AmpPolicy(dtype=jnp.bfloat16, level="O2", custom_white_list={"B", "A"})
    assert policy.dtype == "bfloat16" and policy.compute_dtype == jnp.dtype(jnp.bfloat16)
    assert policy.custom_white_list == ("A", "B")
    assert hash(policy) == hash(
        AmpPolicy(dtype="bfloat16", level="O2", custom_white_list=["A", "B"])
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.level = "O1"
    assert "LayerNorm" in policy.black_list and "Linear" in policy.white_list
    assert {"Linear", "Embed", "MultiHeadAttention"} <= DEFAULT_WHITE_LIST
    assert {"LayerNorm", "RMSNorm", "BatchNorm"} <= DEFAULT_BLACK_LIST


def test_o2_keeps_param_sharding():
    mesh = jax.make_mesh((8,), ("mp",), axis_types=(AxisType.Auto,))
    model = nnx.Linear(4, 16, rngs=nnx.Rngs(0))
    sharding = NamedSharding(mesh, P(None, "mp"))
    model.kernel.set_value(jax.device_put(model.kernel.get_value(), sharding))
    apply_amp(model, dtype="float16", level="O2")
    kernel = model.kernel.get_value()
    assert kernel.dtype == jnp.float16
    assert kernel.sharding.is_equivalent_to(sharding, 2)


def test_o2_on_abstract_model():
    abstract = nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    apply_amp(abstract, dtype="bfloat16", level="O2")
    assert abstract.kernel.get_value().dtype == jnp.bfloat16


def test_cast_floating():
    tree = {
        "y": jnp.ones(2, jnp.bfloat16),
        "f": jnp.ones(2, jnp.float16),
        "n": jnp.arange(2),
        "b": jnp.array([True]),
        "none": None,
        "py": 3,
    }
    out = cast_floating(tree, jnp.float32)
    assert out["y"].dtype == F32 and out["f"].dtype == F32
    assert out["n"].dtype == jnp.int32 and out["b"].dtype == jnp.bool_
    assert out["none"] is None and out["py"] == 3
    assert jax.jit(cast_floating, static_argnums=1)(tree["y"], jnp.float32).dtype == F32


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "float32"}, ValueError, r"dtype='float32' is not a half-precision"),
        ({"dtype": "fp16"}, ValueError, r"dtype='fp16'"),
        ({"dtype": jnp.int8}, ValueError, r"dtype=.*int8"),
        ({"level": "O3"}, ValueError, r"level='O3' is not an AMP level"),
        ({"level": "o1"}, ValueError, r"level='o1'"),
        ({"level": 2}, ValueError, r"level=2"),
        (
            {"custom_white_list": ["Linear", "Conv"], "custom_black_list": ["Conv"]},
            ValueError,
            r"'Conv' in both custom_white_list and custom_black_list",
        ),
        ({"custom_white_list": "Linear"}, TypeError, r"custom_white_list='Linear' must be a list"),
        (
            {"custom_black_list": [nnx.LayerNorm]},
            TypeError,
            r"custom_black_list entries.*LayerNorm",
        ),
        ({"custom_black_list": [""]}, TypeError, r"custom_black_list entries.*\[''\]"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        apply_amp(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), **kwargs)


def test_model_must_be_an_nnx_module():
    with pytest.raises(TypeError, match=r"model must be an nnx.Module; got dict"):
        apply_amp({"w": jnp.ones(2)})


# ------------------------------------------------------- auto_cast / decorate (paddle.amp)


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.norm(self.fc(x)))


def _manual_mlp(model, x, half):
    """The same forward with the casts written out: Linear in ``half``, LayerNorm in fp32."""
    fc, norm, out = model.fc, model.norm, model.out
    h = x.astype(half) @ fc.kernel[...].astype(half) + fc.bias[...].astype(half)
    h = h.astype(F32)
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    h = (h - mean) / jnp.sqrt(var + norm.epsilon) * norm.scale[...] + norm.bias[...]
    return h.astype(half) @ out.kernel[...].astype(half) + out.bias[...].astype(half)


def test_auto_cast_equals_a_manual_cast_and_restores_on_exit():
    from jfleet.precision.amp import auto_cast

    model = MLP(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 4))
    before = model(x)
    with auto_cast(model, dtype="bfloat16") as same:
        assert same is model
        inside = model(x)
    want = _manual_mlp(model, x, jnp.bfloat16)
    assert inside.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(inside, F32), np.asarray(want, F32), rtol=1e-2)
    assert model.fc.dtype is None and model.norm.dtype is None  # both restored
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(before))
    with pytest.raises(RuntimeError), auto_cast(model, dtype="float16"):
        raise RuntimeError("boom")
    assert model.fc.dtype is None  # restored after an exception too
    with auto_cast(model, enable=False):
        assert model.fc.dtype is None


def test_decorate_o2_casts_params_and_adds_master_weights():
    import optax

    from jfleet import fleet
    from jfleet.optim.master_weights import MasterWeightsState
    from jfleet.precision.amp import decorate

    model, tx = decorate(MLP(nnx.Rngs(0)), optax.sgd(0.1), level="O2", dtype="float16")
    assert _param_dtypes(model) == {
        "fc.kernel": jnp.float16,
        "fc.bias": jnp.float16,
        "norm.scale": F32,
        "norm.bias": F32,
        "out.kernel": jnp.float16,
        "out.bias": jnp.float16,
    }
    assert isinstance(tx.init(nnx.state(model, nnx.Param)), MasterWeightsState)
    same = MLP(nnx.Rngs(0))
    assert decorate(same, level="O1") is same and same.fc.dtype is None  # O1: nothing

    fleet.init(is_collective=True, log_level="WARNING")
    dist = fleet.distributed_model(MLP(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    [dist], [opt] = decorate([dist], [opt], level="O2", dtype="bfloat16")
    opt.init(dist)
    assert isinstance(opt.opt_state, MasterWeightsState)
    assert opt.opt_state.master_params["module"]["fc"]["kernel"].get_value().dtype == F32


def test_decorate_o2_gives_an_nnx_optimizer_master_weights():
    """Paddle's decorate(model, optimizer) with the optimizer already bound to the model:
    a new nnx.Optimizer over the cast parameters, whose step updates fp32 masters."""
    import optax

    from jfleet.optim.master_weights import MasterWeightsState
    from jfleet.precision.amp import decorate

    model = MLP(nnx.Rngs(0))
    kernel = np.asarray(model.fc.kernel[...])  # fp32, before decorate
    opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    model, opt = decorate(model, opt, level="O2", dtype="bfloat16")
    assert isinstance(opt, nnx.Optimizer) and isinstance(opt.opt_state, MasterWeightsState)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), nnx.state(model, nnx.Param))
    opt.update(model, grads)
    masters = opt.opt_state.master_params["fc"]["kernel"].get_value()
    want = jnp.asarray(kernel).astype(jnp.bfloat16).astype(F32) - 0.5 * jnp.float32(
        jnp.bfloat16(1e-3)
    )
    np.testing.assert_allclose(masters, want, rtol=1e-6)  # updated in fp32, not in bf16
    assert model.fc.kernel[...].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m: _enter(m, level="O3"), ValueError, r"level='O3' is not an AMP level"),
        (lambda m: _enter(m, dtype="int8"), ValueError, r"dtype='int8' is not a half"),
        (lambda m: _enter(m, enable="yes"), TypeError, r"auto_cast\(enable='yes'\)"),
        (lambda m: _enter("model"), TypeError, r"model must be an nnx\.Module; got str"),
        (lambda m: _decorate(3), TypeError, r"int is not an nnx\.Module"),
        (lambda m: _decorate(m, optimizers=[5]), TypeError, r"int is neither an optax"),
        (lambda m: _decorate(m, master_weight="yes"), TypeError, r"master_weight='yes'"),
        (
            lambda m: _decorate([m, m], optimizers=[optax.sgd(1.0)] * 3),
            ValueError,
            r"got 2 models and 3 optimizers",
        ),
        (lambda m: _decorate(m, optimizers=_trained(m)), ValueError, r"has taken 1 steps"),
    ],
)
def test_bad_auto_cast_and_decorate_input(call, error, match):
    with pytest.raises(error, match=match):
        call(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def _trained(model):
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    opt.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    return opt


def _enter(model, **kwargs):
    from jfleet.precision.amp import auto_cast

    with auto_cast(model, **kwargs):
        pass


def _decorate(models, **kwargs):
    from jfleet.precision.amp import decorate

    return decorate(models, level="O2", **kwargs)

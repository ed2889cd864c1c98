"""Quantisation-aware training: ``jfleet.quantization``, ``strategy.qat`` and ``fleet.qat_init``.

Expected values are written from Paddle's formulas in NumPy here (abs-max fake quantisation
``round(clip(v, -s, s) / s * 127) * s / 127``, the moving-average scale recurrence, the
straight-through gradient), never read back from the code under test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet
from jfleet.precision.quantization import (
    QUANTIZABLE,
    QatConfig,
    QuantStat,
    dequantize,
    export_int8,
    fake_quant,
    qat_summary,
    quant_scales,
    quantize_model,
)
from jfleet.testing import assert_trees_close, train_one_device
from jfleet.testing.nnx_styles import STYLES
from tests.fleet_setup import init_fleet

N8 = 127  # 2**(8-1) - 1


def qdq(v: np.ndarray, s, n: int = N8) -> np.ndarray:
    """Paddle's fake quantise-dequantise, in NumPy (float64)."""
    s = np.asarray(s, np.float64)
    return np.round(np.clip(v, -s, s) / s * n) * s / n


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, din: int = 8, hidden: int = 16, dout: int = 4):
        self.fc1 = nnx.Linear(din, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


class Mixed(nnx.Module):
    """One layer of each quantisable NNX class."""

    def __init__(self, rngs: nnx.Rngs):
        self.fc = nnx.Linear(4, 8, rngs=rngs)
        self.general = nnx.LinearGeneral(8, (2, 4), rngs=rngs)
        self.einsum = nnx.Einsum("bhd,hdo->bo", (2, 4, 3), rngs=rngs)
        self.conv = nnx.Conv(1, 2, (3,), rngs=rngs)
        self.norm = nnx.LayerNorm(3, rngs=rngs)

    def __call__(self, x):
        y = self.einsum(self.general(jax.nn.relu(self.fc(x))))
        return self.norm(y + self.conv(y[..., None]).sum(-1))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def test_fake_quant_is_paddles_formula_with_a_straight_through_gradient():
    v = jnp.linspace(-1.5, 1.5, 41)
    got = np.asarray(fake_quant(v, 1.0, bits=8))
    np.testing.assert_allclose(got, qdq(np.asarray(v, np.float64), 1.0), atol=1e-7)
    assert np.abs(got).max() == pytest.approx(1.0)  # clipped to the scale
    np.testing.assert_allclose(np.asarray(fake_quant(v, 1.0, bits=4)), qdq(v, 1.0, 7), atol=1e-7)
    grad = jax.grad(lambda x: jnp.sum(fake_quant(x, 1.0) * jnp.arange(41.0)))(v)
    np.testing.assert_array_equal(np.asarray(grad), np.arange(41.0))  # identity, even clipped


def test_a_quantised_linear_has_the_straight_through_gradients_of_its_quantised_operands():
    layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    x = np.asarray(jax.random.uniform(jax.random.key(1), (5, 3), minval=-1, maxval=1))
    w = np.asarray(layer.kernel[...], np.float64)
    quantize_model(layer)
    g = np.asarray(jax.random.normal(jax.random.key(2), (5, 2)))

    def objective(layer, x):
        return jnp.sum(layer(x) * g)

    grads, gx = nnx.jit(nnx.grad(objective, argnums=(0, 1)))(layer, jnp.asarray(x))
    s_x = (0.9 * 1 + np.abs(x).max()) / (0.9 * 1 + 1)  # first training call, from state 1
    xq = qdq(x, s_x)
    wq = qdq(w, np.abs(w).max(0, keepdims=True))  # per output column
    np.testing.assert_allclose(np.asarray(grads["kernel"][...]), xq.T @ g, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gx), g @ wq.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grads["bias"][...]), g.sum(0), rtol=1e-5)


def _layer_bound(x: np.ndarray, w: np.ndarray, s_x: float, s_w: np.ndarray) -> np.ndarray:
    """Bound on ``|qdq(x) @ qdq(w) - x @ w|`` per output, from the scales (int8)."""
    dx = s_x / (2 * N8) + np.maximum(0.0, np.abs(x) - s_x)  # rounding, plus clipping
    dw = s_w / (2 * N8)  # per output channel; weights are never clipped (abs-max scale)
    return (np.abs(x) + dx) @ np.broadcast_to(dw, w.shape) + dx @ np.abs(w)


def test_quantised_outputs_are_within_the_int8_error_derived_from_the_scales():
    model = MLP(nnx.Rngs(0))
    x = np.asarray(jax.random.uniform(jax.random.key(1), (32, 8), minval=-1, maxval=1), np.float64)
    w1, b1 = (np.asarray(v[...], np.float64) for v in (model.fc1.kernel, model.fc1.bias))
    w2, b2 = (np.asarray(v[...], np.float64) for v in (model.fc2.kernel, model.fc2.bias))
    h = np.maximum(x @ w1 + b1, 0.0)
    y = h @ w2 + b2  # the float model
    assert quantize_model(model) == ["fc1", "fc2"]
    forward = nnx.jit(lambda m, x: m(x))
    for _ in range(40):  # training calls: the activation scales approach the inputs' abs-max
        got = np.asarray(forward(model, jnp.asarray(x, jnp.float32)), np.float64)

    scales = quant_scales(model)
    np.testing.assert_allclose(scales["fc1"]["weight"], np.abs(w1).max(0), rtol=1e-6)
    s1, s2 = float(scales["fc1"]["activation"]), float(scales["fc2"]["activation"])
    # Layer 1 on the true input; layer 2 on the quantised model's own hidden activations
    # (relu is 1-Lipschitz, so |h_q - h| <= bound1), plus what layer 2 adds on them.
    bound1 = _layer_bound(x, w1, s1, scales["fc1"]["weight"])
    h_q = np.maximum(
        qdq(x, s1) @ qdq(w1, np.abs(w1).max(0, keepdims=True)) + b1, 0.0
    )  # as the model computes it
    assert np.all(np.abs(h_q - h) <= bound1 + 1e-5)
    bound = bound1 @ np.abs(w2) + _layer_bound(h_q, w2, s2, scales["fc2"]["weight"])
    err = np.abs(got - y)
    assert np.all(err <= bound + 1e-5), (err.max(), bound.min())
    assert err.max() > 1e-4  # it did quantise
    # The bound is int8-sized, not vacuous: the same model at 4 bits breaks it.
    model4 = MLP(nnx.Rngs(0))
    quantize_model(model4, QatConfig(weight_bits=4, activation_bits=4))
    for _ in range(40):
        got4 = np.asarray(forward(model4, jnp.asarray(x, jnp.float32)), np.float64)
    assert np.any(np.abs(got4 - y) > bound + 1e-5)


def test_the_moving_average_scale_follows_paddles_recurrence_and_eval_keeps_it():
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    quantize_model(layer)
    state, accum = 1.0, 1.0  # Paddle initialises both to 1 (and the scale to 0.001)
    assert float(layer.qat_scale[...]) == pytest.approx(0.001)
    step = nnx.jit(lambda m, x: m(x))
    for peak in (3.0, 0.5, 2.0, 7.0):
        step(layer, jnp.array([[peak, -0.25], [0.1, -peak / 2]]))
        state, accum = 0.9 * state + 1, 0.9 * accum + peak
        assert float(layer.qat_state[...]) == pytest.approx(state, rel=1e-6)
        assert float(layer.qat_accum[...]) == pytest.approx(accum, rel=1e-6)
        assert float(layer.qat_scale[...]) == pytest.approx(accum / state, rel=1e-6)
    layer.eval()  # nnx's eval: use the stored scale, update nothing
    x = jnp.array([[100.0, 0.0]])
    out = np.asarray(step(layer, x))
    assert float(layer.qat_scale[...]) == pytest.approx(accum / state, rel=1e-6)
    w = np.asarray(layer.kernel[...], np.float64)
    want = qdq(np.asarray(x), accum / state) @ qdq(w, np.abs(w).max(0, keepdims=True))
    np.testing.assert_allclose(out, want + np.asarray(layer.bias[...]), rtol=1e-5)
    layer.train()
    step(layer, x)
    assert float(layer.qat_state[...]) == pytest.approx(0.9 * state + 1, rel=1e-6)


def test_every_nnx_projection_class_is_quantised_per_output_channel_and_exported():
    model = Mixed(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, 4))
    forward = nnx.jit(lambda m, x: m(x))
    assert quantize_model(model) == ["conv", "einsum", "fc", "general"]
    assert qat_summary(model)["general"] == "QuantizedLinearGeneral"
    assert isinstance(model.fc, nnx.Linear) and isinstance(model.fc.qat_scale, QuantStat)
    params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert "fc.kernel" in params and not any("qat" in p for p in params)  # paths kept
    forward(model, x)
    scales = quant_scales(model)
    kernels = {n: np.asarray(getattr(model, n).kernel[...]) for n in scales}
    want = {  # the abs-max over the kernel axes contracted with the input
        "fc": np.abs(kernels["fc"]).max(0),  # [in, out]
        "general": np.abs(kernels["general"]).max(0),  # [in, 2, 4]
        "einsum": np.abs(kernels["einsum"]).max((0, 1)),  # "hdo": o is the output
        "conv": np.abs(kernels["conv"]).max((0, 1)),  # [width, in, out]
    }
    for name, value in want.items():
        np.testing.assert_allclose(scales[name]["weight"], value, rtol=1e-6)
        assert scales[name]["activation"].shape == ()
    exported = export_int8(model)
    for name, w in exported.items():
        assert w.values.dtype == np.int8 and np.abs(w.values.astype(int)).max() == 127
        back = dequantize(w.values, w.scale, w.bits)
        np.testing.assert_allclose(back, qdq(kernels[name], w.scale), atol=1e-7)
    # The export is enough for inference: the layer (in eval mode) from ints and scales.
    model.eval()
    fc = exported["fc"]
    xq = np.round(np.clip(np.asarray(x), -fc.activation_scale, fc.activation_scale)
                  / fc.activation_scale * 127)  # fmt: skip
    acc = xq.astype(np.int32) @ fc.values.astype(np.int32)  # int8 x int8 -> int32
    y = acc * (fc.activation_scale * fc.scale / 127**2) + np.asarray(model.fc.bias[...])
    np.testing.assert_allclose(y, np.asarray(forward(model.fc, x)), rtol=1e-5, atol=1e-6)
    per_tensor = Mixed(nnx.Rngs(0))
    quantize_model(per_tensor, QatConfig(channel_wise_abs_max=False))
    assert quant_scales(per_tensor)["fc"]["weight"].shape == ()


@pytest.mark.parametrize("name", ["mha", "einsum_gemma"])
def test_public_nnx_styles_train_quantised_with_excluded_paths_left_float(name):
    style = STYLES[name]
    model = style.build(nnx.Rngs(0))
    layers = {".".join(map(str, p)) for p, n in nnx.iter_graph(model) if isinstance(n, QUANTIZABLE)}
    skip = sorted(layers)[0].rsplit(".", 1)[0] or sorted(layers)[0]  # a block's prefix
    done = quantize_model(model, QatConfig(not_quant_pattern=(skip,)))
    assert done == sorted(p for p in layers if skip not in p) and done
    batch = style.batches(1)[0]
    float_model = style.build(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(style.loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    loss = float(step(model, opt, batch))
    ref = float(nnx.jit(style.loss_fn)(float_model, batch))
    assert loss == pytest.approx(ref, rel=0.05) and loss != ref
    first = next(m for p, m in nnx.iter_graph(model) if ".".join(map(str, p)) == done[0])
    assert float(first.qat_state[...]) == pytest.approx(1.9)  # stats moved in the jitted step


def test_strategy_qat_at_dp8_equals_one_device_and_scales_follow_the_global_batch():
    tx = optax.adam(1e-2)
    strategy = init_fleet({"dp_degree": 8}, qat=True)
    model = fleet.distributed_model(MLP(nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(tx)
    assert "QATOptimizer" in opt.applied_meta_list
    rng = np.random.default_rng(0)
    peaks = [1.5, 4.0, 2.5]  # above the other entries (at most 1)
    batches = []
    for peak in peaks:
        x = rng.uniform(-1, 1, (16, 8)).astype(np.float32)
        x[5, 3] = peak  # the global max|x| of this batch, on one data-parallel shard
        batches.append({"x": x, "y": rng.normal(size=(16, 4)).astype(np.float32)})
    state = accum = 1.0
    losses = []
    for batch, peak in zip(batches, peaks, strict=True):
        losses.append(float(model.train_batch(batch, opt, loss_fn=mse)))
        state, accum = 0.9 * state + 1, 0.9 * accum + peak
        assert float(model.module.fc1.qat_scale[...]) == pytest.approx(accum / state, rel=1e-6)
    assert model.module.fc1.qat_scale[...].sharding.is_fully_replicated
    ref_losses, ref_params = train_one_device(MLP(nnx.Rngs(0)), tx, batches, mse, strategy=strategy)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(nnx.state(model.module, nnx.Param), ref_params, rtol=1e-5, atol=1e-6)


def test_qat_init_quantises_a_model_and_refuses_without_the_strategy():
    init_fleet()
    with pytest.raises(ValueError, match=r"strategy\.qat = True"):
        fleet.qat_init(model=MLP(nnx.Rngs(0)))
    init_fleet(qat=True, qat_configs={"not_quant_pattern": ["fc2"], "weight_bits": 4})
    model = MLP(nnx.Rngs(0))
    assert fleet.qat_init(None, None, None, model=model) == ["fc1"]
    assert model.fc1.qat_config.weight_bits == 4 and not hasattr(model.fc2, "qat_scale")
    assert fleet.qat_init(model=model) == ["fc1"]  # again: kept as it is
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model(model, QatConfig())
    with pytest.raises(ValueError, match="no model given"):
        fleet.qat_init()
    placed = fleet.distributed_model(MLP(nnx.Rngs(0)))  # distributed_model quantised it
    assert fleet.qat_init() == ["module.fc1"] and placed.module.fc1.qat_config.weight_bits == 4


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: QatConfig(weight_bits=1), ValueError, r"weight_bits=1: expected an int from 2"),
        (lambda: QatConfig(activation_bits=8.0), ValueError, r"activation_bits=8\.0"),
        (lambda: QatConfig(not_quant_pattern="fc"), TypeError, r"not_quant_pattern='fc'"),
        (lambda: quantize_model(3), TypeError, r"model=int\): expected a flax\.nnx\.Module"),
        (lambda: quantize_model(MLP(nnx.Rngs(0)), {}), TypeError, r"expected a jfleet\.quant"),
    ],
)
def test_bad_qat_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_stacked_layers_are_refused():
    @nnx.vmap(in_axes=0, out_axes=0)
    def stacked(key):
        return nnx.Linear(2, 2, rngs=nnx.Rngs(key))

    layer = stacked(jax.random.split(jax.random.key(0), 3))
    with pytest.raises(NotImplementedError, match=r"stacked kernel of shape \(3, 2, 2\)"):
        quantize_model(layer)


def test_tensor_parallel_linears_quantise_and_equal_the_unsplit_run():
    """Column + Row parallel linears at dp2 x mp4 against the same layers at dp8 (mp 1)."""
    from jfleet.fleet.meta_parallel import ColumnParallelLinear, RowParallelLinear

    class TPMLP(nnx.Module):
        def __init__(self, rngs):
            self.up = ColumnParallelLinear(8, 16, has_bias=True, gather_output=False, rngs=rngs)
            self.down = RowParallelLinear(16, 4, input_is_parallel=True, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    rng = np.random.default_rng(1)
    data = [
        {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 4))}
        for _ in range(2)
    ]
    runs = []
    for hybrid in ({"dp_degree": 2, "mp_degree": 4}, {"dp_degree": 8}):
        init_fleet(hybrid, qat=True)
        model = fleet.distributed_model(TPMLP(nnx.Rngs(0)))
        assert qat_summary(model) == {
            "module.down": "QuantizedRowParallelLinear",
            "module.up": "QuantizedColumnParallelLinear",
        }
        opt = fleet.distributed_optimizer(optax.sgd(0.1))
        losses = [float(model.train_batch(b, opt, loss_fn=mse)) for b in data]
        runs.append((losses, quant_scales(model), nnx.state(model.module, nnx.Param)))
    (tp_losses, tp_scales, tp_params), (losses, scales, params) = runs
    np.testing.assert_allclose(tp_losses, losses, rtol=1e-5)
    for name in scales:
        for kind in ("weight", "activation"):
            np.testing.assert_allclose(tp_scales[name][kind], scales[name][kind], rtol=1e-5)
    assert_trees_close(
        jax.tree.map(np.asarray, tp_params), jax.tree.map(np.asarray, params), rtol=1e-5, atol=1e-6
    )

"""Tests for jfleet.optim.clip: Paddle's gradient clipping, mesh-independent."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.optim.clip import (
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByValue,
    clip_by_global_norm,
    clip_by_norm,
    clip_by_value,
    global_norm,
)

SPECS = {
    "kernel": ((8, 4), P("x", "y")),
    "kernel_t": ((4, 8), P("y", "x")),
    "bias": ((4,), P("y")),
    "emb": ((16, 6), P(("x", "y"), None)),
    "row": ((8, 3), P("x", None)),
    "scalar": ((), P()),
    "replicated": ((5,), P()),
}


def _host_grads(scale=1.0):
    rng = np.random.default_rng(0)
    return {k: (scale * rng.normal(size=s)).astype(np.float32) for k, (s, _) in SPECS.items()}


def _sharded(host):
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k][1])) for k, v in host.items()}


def _np_norm(host):
    return np.sqrt(sum(np.sum(np.square(v.astype(np.float64))) for v in host.values()))


def test_global_norm_of_mixed_sharded_grads_equals_single_device_norm():
    host = _host_grads()
    sharded = _sharded(host)
    single = float(global_norm({k: jnp.asarray(v) for k, v in host.items()}))
    on_mesh = float(global_norm(sharded))
    jitted = float(jax.jit(global_norm)(sharded))
    want = _np_norm(host)
    np.testing.assert_allclose(single, want, rtol=1e-6)
    np.testing.assert_allclose(on_mesh, single, rtol=1e-6)
    np.testing.assert_allclose(jitted, single, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_exact_scaling_above_threshold_on_mesh(jit):
    host = _host_grads()
    norm = _np_norm(host)
    clip_norm = norm / 3.0
    tx = clip_by_global_norm(clip_norm)
    sharded = _sharded(host)
    update = jax.jit(tx.update) if jit else tx.update
    out, _ = update(sharded, tx.init(sharded))
    for k, v in host.items():
        np.testing.assert_allclose(out[k], v * (clip_norm / norm), rtol=1e-6, atol=1e-8)
        assert out[k].sharding.is_equivalent_to(sharded[k].sharding, v.ndim), k
    np.testing.assert_allclose(float(global_norm(out)), clip_norm, rtol=1e-6)


def test_no_scaling_below_or_at_threshold():
    host = _host_grads()
    norm = float(global_norm(host))
    # Paddle's hybrid clip would still scale these. "At" the threshold allows one rounding:
    # the sharded sum of squares inside the step may come out an ulp above the host's.
    for clip_norm in (norm * 1.5, norm * (1 + 1e-6)):
        tx = ClipGradByGlobalNorm(clip_norm)
        out, _ = jax.jit(tx.update)(_sharded(host), tx.init(None))
        for k, v in host.items():
            np.testing.assert_array_equal(out[k], v)


def test_low_precision_grads_sum_squares_in_fp32_and_keep_dtype():
    g = {"a": jnp.full((4096,), 8.0, jnp.bfloat16)}  # a bfloat16 running sum would lose bits
    np.testing.assert_allclose(float(global_norm(g)), np.sqrt(4096 * 64.0), rtol=1e-6)
    out, _ = clip_by_global_norm(1.0).update(g, None)
    assert out["a"].dtype == jnp.bfloat16
    np.testing.assert_allclose(out["a"].astype(np.float32), 1.0 / 64.0, rtol=1e-2)


def test_clip_by_norm_is_per_tensor():
    g = {"big": jnp.array([3.0, 4.0]), "small": jnp.array([0.3, 0.4])}
    for tx in (clip_by_norm(1.0), ClipGradByNorm(clip_norm=1.0)):
        out, _ = tx.update(g, tx.init(g))
        np.testing.assert_allclose(out["big"], [0.6, 0.8], rtol=1e-6)
        np.testing.assert_array_equal(out["small"], g["small"])


def test_clip_by_value_with_paddle_argument_order():
    g = jnp.array([-3.0, -0.5, 0.5, 3.0])
    np.testing.assert_array_equal(clip_by_value(1.0).update(g, None)[0], [-1, -0.5, 0.5, 1])
    np.testing.assert_array_equal(
        ClipGradByValue(2.0, -0.25).update(g, None)[0], [-0.25, -0.25, 0.5, 2.0]
    )


def test_empty_tree():
    assert float(global_norm({})) == 0.0
    out, _ = clip_by_global_norm(1.0).update({}, None)
    assert out == {}


BAD = [
    ("zero", lambda: clip_by_global_norm(0.0), ValueError, "clip_norm=0.0"),
    ("negative", lambda: ClipGradByGlobalNorm(-1.0), ValueError, "clip_norm=-1.0"),
    ("nan", lambda: clip_by_norm(float("nan")), ValueError, "clip_norm=nan"),
    ("bool", lambda: clip_by_global_norm(True), TypeError, "clip_norm=True"),
    ("string", lambda: ClipGradByNorm("1"), TypeError, "clip_norm='1'"),
    ("max <= 0 without min", lambda: ClipGradByValue(-1.0), ValueError, "max=-1.0"),
    ("min > max", lambda: clip_by_value(1.0, 2.0), ValueError, "min=2.0"),
    ("inf bound", lambda: clip_by_value(float("inf")), ValueError, "max=inf"),
]


@pytest.mark.parametrize("make,error,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_name_the_value(make, error, text):
    with pytest.raises(error, match=re.escape(text)):
        make()

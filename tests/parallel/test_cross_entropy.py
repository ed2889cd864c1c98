"""ParallelCrossEntropy equals the dense loss and never holds a token's full-vocabulary logits."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from jfleet import fleet
from jfleet.mesh.layer_mesh import named
from jfleet.mesh.topology import DATA_AXES, MP
from jfleet.parallel.cross_entropy import ParallelCrossEntropy, parallel_cross_entropy
from tests.fleet_setup import fleet_mesh, init_fleet

IGNORE = -100
CONFIGS = {
    "mp4_dp2": {"dp_degree": 2, "mp_degree": 4},
    "mp2_sharding2_dp2": {"dp_degree": 2, "mp_degree": 2, "sharding_degree": 2},
    "mp1_dp8": {"dp_degree": 8},
}


def make_batch(mesh: Mesh, shape=(8, 6, 64), dtype=jnp.float32, seed=0):
    """Vocab-split logits, labels with a few ignored tokens, a random per-token weight."""
    rng = np.random.default_rng(seed)
    logits = (3.0 * rng.standard_normal(shape, np.float32)).astype(dtype)
    labels = rng.integers(0, shape[-1], shape[:-1], np.int32)
    labels[0, :3] = IGNORE
    labels[5, -1] = IGNORE
    weight = rng.uniform(0.5, 1.5, shape[:-1]).astype(np.float32)
    logits = jax.device_put(logits, named(mesh, DATA_AXES, None, MP))
    labels = jax.device_put(labels, named(mesh, DATA_AXES, None))
    return logits, labels, weight


@jax.jit
def dense_loss(logits, labels, ignore_index=IGNORE):
    """The single-device reference: optax on fp32 logits, ignored tokens set to 0."""
    keep = labels != ignore_index
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), jnp.where(keep, labels, 0)
    )
    return jnp.where(keep, loss, 0.0)


@jax.jit
def dense_value_and_grad(logits, labels, weight):
    """The reference's weighted total and its gradient w.r.t. fp32 logits."""
    return jax.value_and_grad(lambda x: (dense_loss(x, labels) * weight).sum())(
        logits.astype(jnp.float32)
    )


@pytest.mark.parametrize("hybrid", CONFIGS.values(), ids=CONFIGS.keys())
def test_loss_and_grad_equal_dense(hybrid):
    init_fleet(hybrid)
    mesh = fleet_mesh()
    logits, labels, weight = make_batch(mesh)
    ce = ParallelCrossEntropy()

    @jax.jit
    def parallel(x, y):
        return jax.value_and_grad(lambda x: (ce(x, y)[..., 0] * weight).sum())(x)

    loss = jax.jit(ce)(logits, labels)
    assert loss.shape == (8, 6, 1) and loss.dtype == jnp.float32
    np.testing.assert_allclose(loss[..., 0], dense_loss(logits, labels), rtol=1e-5, atol=1e-6)

    total, grad = parallel(logits, labels)
    ref_total, ref_grad = dense_value_and_grad(np.asarray(logits), np.asarray(labels), weight)
    np.testing.assert_allclose(total, ref_total, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert grad.dtype == logits.dtype
    assert grad.sharding.is_equivalent_to(logits.sharding, grad.ndim)

    ignored = np.asarray(labels) == IGNORE
    assert ignored.sum() == 4
    assert np.all(np.asarray(loss)[ignored] == 0.0)
    assert np.all(np.asarray(grad)[ignored] == 0.0)
    assert np.all(np.abs(np.asarray(grad)[~ignored]).sum(-1) > 0)


def test_eager_functional_and_labels_with_trailing_one():
    init_fleet(CONFIGS["mp4_dp2"])
    logits, labels, _ = make_batch(fleet.get_hybrid_communicate_group().mesh)
    loss = parallel_cross_entropy(logits, labels)
    np.testing.assert_allclose(loss[..., 0], dense_loss(logits, labels), rtol=1e-5, atol=1e-6)
    # Paddle's other label layout, [..., 1], gives the same [..., 1] loss
    np.testing.assert_array_equal(parallel_cross_entropy(logits, labels[..., None]), loss)
    # unsharded host inputs are split over mp on entry
    host = parallel_cross_entropy(np.asarray(logits), np.asarray(labels))
    np.testing.assert_allclose(host, loss, rtol=1e-6)


def test_custom_ignore_index_ignores_a_real_class():
    init_fleet(CONFIGS["mp4_dp2"])
    mesh = fleet_mesh()
    logits, labels, _ = make_batch(mesh)
    labels = np.where(np.asarray(labels) == IGNORE, 3, np.asarray(labels))
    labels[1] = 7  # a whole row of class 7, owned by the first mp shard
    ce = ParallelCrossEntropy(ignore_index=7)
    grad = jax.jit(jax.grad(lambda x, y: ce(x, y).sum()))(logits, labels)
    loss = ce(logits, labels)
    np.testing.assert_allclose(loss[..., 0], dense_loss(logits, labels, 7), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(loss)[1] == 0.0)
    assert np.all(np.asarray(grad)[1] == 0.0)
    # -100 is now an ordinary out-of-range label
    labels[0, 0] = IGNORE
    assert np.isnan(np.asarray(ce(logits, labels))[0, 0, 0])


@pytest.mark.parametrize("hybrid", [CONFIGS["mp4_dp2"], CONFIGS["mp1_dp8"]], ids=["mp4", "mp1"])
def test_bf16_logits_use_fp32_math(hybrid):
    init_fleet(hybrid)
    mesh = fleet_mesh()
    logits, labels, weight = make_batch(mesh, dtype=jnp.bfloat16)
    ce = ParallelCrossEntropy()
    loss = jax.jit(ce)(logits, labels)
    assert loss.dtype == jnp.float32
    # exact fp32 math on the bf16 values, not bf16 math
    np.testing.assert_allclose(loss[..., 0], dense_loss(logits, labels), rtol=1e-5, atol=1e-6)
    grad = jax.jit(jax.grad(lambda x: (ce(x, labels)[..., 0] * weight).sum()))(logits)
    _, ref = dense_value_and_grad(np.asarray(logits), np.asarray(labels), weight)
    assert grad.dtype == jnp.bfloat16
    # the fp32 gradient rounded once to bf16 (one bf16 ulp of rounding difference allowed)
    np.testing.assert_allclose(grad.astype(jnp.float32), ref, rtol=2**-7, atol=1e-7)


def test_out_of_range_labels_give_nan_for_that_token_only():
    init_fleet(CONFIGS["mp4_dp2"])
    mesh = fleet_mesh()
    logits, labels, _ = make_batch(mesh)
    vocab = logits.shape[-1]
    bad = np.array(labels)
    bad[2, 1], bad[3, 4] = vocab, -1
    loss, grad = jax.jit(jax.value_and_grad(lambda x: parallel_cross_entropy(x, bad).sum()))(logits)
    per_token = np.asarray(parallel_cross_entropy(logits, bad))[..., 0]
    is_bad = np.zeros(per_token.shape, bool)
    is_bad[2, 1] = is_bad[3, 4] = True
    assert np.isnan(loss)
    assert np.all(np.isnan(per_token[is_bad]))
    assert np.all(np.isnan(np.asarray(grad)[is_bad]))
    good = ~is_bad
    np.testing.assert_allclose(per_token[good], dense_loss(logits, labels)[good], rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(grad)[good]))


def test_mesh_argument_and_mesh_without_mp():
    with pytest.raises(RuntimeError, match=r"fleet\.init"):
        ParallelCrossEntropy()
    mesh = Mesh(np.array(jax.devices()[:2]), ("dp",))  # no mp axis at all
    logits = np.log(np.array([[1.0, 1.0, 2.0, 4.0], [1.0, 1.0, 1.0, 1.0]], np.float32))
    labels = np.array([3, 0], np.int32)
    ce = ParallelCrossEntropy(mesh=mesh)
    np.testing.assert_allclose(ce(logits, labels)[:, 0], [np.log(2.0), np.log(4.0)], rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: ce(x, labels).sum()))(logits)
    np.testing.assert_allclose(grad, [[0.125, 0.125, 0.25, -0.5], [-0.75, 0.25, 0.25, 0.25]])


def test_works_inside_nnx_jit():
    init_fleet(CONFIGS["mp4_dp2"])
    ce = ParallelCrossEntropy()
    logits, labels, _ = make_batch(fleet.get_hybrid_communicate_group().mesh)
    total = nnx.jit(lambda m, x, y: m(x, y).sum())(ce, logits, labels)
    np.testing.assert_allclose(total, dense_loss(logits, labels).sum(), rtol=1e-5)


# ------------------------------------------------------------------------------ structure
SHAPE_RE = re.compile(r"\b(?:f32|bf16)\[([0-9,]*)\]")
COLLECTIVE_RE = re.compile(
    r"=\s*(\([^=]*\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)


def _numel(shape: str) -> int:
    return int(np.prod([int(d) for d in shape.split(",") if d]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_program_never_holds_full_vocab(dtype):
    init_fleet(CONFIGS["mp4_dp2"])
    mesh = fleet_mesh()
    b, s, vocab = 8, 16, 512
    logits, labels, _ = make_batch(mesh, shape=(b, s, vocab), dtype=dtype)
    ce = ParallelCrossEntropy()

    def f(x, y):
        return ce(x, y).mean()

    compiled = jax.jit(jax.value_and_grad(f)).lower(logits, labels).compile()
    hlo = compiled.as_text()

    shapes = [tuple(int(d) for d in m.split(",") if d) for m in SHAPE_RE.findall(hlo)]
    local_vocab, local_tokens = vocab // 4, (b // 2) * s
    assert (b // 2, s, local_vocab) in shapes  # the per-device logits / gradient
    full = sorted({sh for sh in shapes if sh and sh[-1] == vocab})
    assert not full, f"arrays over the full vocabulary {vocab} per device: {full}"

    collectives = COLLECTIVE_RE.findall(hlo)
    kinds = {kind for _, kind in collectives}
    assert kinds == {"all-reduce"}, kinds  # no all-gather of logits
    sizes = [_numel(sh) for result, _ in collectives for sh in SHAPE_RE.findall(result)]
    # per-token all-reduces on mp (max, then the two sums, maybe combined) + the mean's scalar
    assert max(sizes) == local_tokens, sizes
    assert sum(sizes) <= 3 * local_tokens + 1, sizes

    # temporaries: at most the fp32 copy of the local vocab shard (bf16 input) plus
    # per-token vectors; a full-vocab fp32 logits array per device would be 4x that
    temp = compiled.memory_analysis().temp_size_in_bytes
    full_vocab_bytes = (b // 2) * s * vocab * 4
    shard_bytes = full_vocab_bytes // 4
    limit = (shard_bytes if dtype == jnp.bfloat16 else 0) + 16 * local_tokens * 4
    assert temp <= limit < full_vocab_bytes // 3, (temp, limit, full_vocab_bytes)


# --------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("logits", "labels", "error", "message"),
    [
        (np.float32(1.0), np.int32(0), ValueError, r"shape \(\) \(rank 0\)"),
        (
            np.zeros((2, 3, 8), np.float32),
            np.zeros((2, 4), np.int32),
            ValueError,
            r"labels have shape \(2, 4\) but logits have shape \(2, 3, 8\)",
        ),
        (
            np.zeros((2, 3, 8), np.float32),
            np.zeros((2, 3, 2), np.int32),
            ValueError,
            r"\(2, 3, 2\).*\(2, 3\).*\(2, 3, 1\)",
        ),
        (np.zeros((2, 8), np.float32), np.zeros((2,), np.float32), TypeError, "float32"),
        (np.zeros((2, 8), np.int32), np.zeros((2,), np.int32), TypeError, "int32"),
        (
            np.zeros((2, 10), np.float32),
            np.zeros((2,), np.int32),
            ValueError,
            r"vocabulary size 10 .* mp degree 4",
        ),
    ],
    ids=["scalar-logits", "labels-shape", "labels-trailing", "float-labels", "int-logits", "vocab"],
)
def test_bad_inputs_name_the_value(logits, labels, error, message):
    init_fleet(CONFIGS["mp4_dp2"])
    with pytest.raises(error, match=message):
        ParallelCrossEntropy()(logits, labels)


@pytest.mark.parametrize("ignore_index", [-100.0, True, "-100"])
def test_bad_ignore_index(ignore_index):
    init_fleet(CONFIGS["mp4_dp2"])
    with pytest.raises(TypeError, match=re.escape(repr(ignore_index))):
        ParallelCrossEntropy(ignore_index)
    with pytest.raises(TypeError, match=re.escape(repr(ignore_index))):
        parallel_cross_entropy(np.zeros((2, 8)), np.zeros(2, int), ignore_index=ignore_index)

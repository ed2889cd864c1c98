"""DGC: momentum correction and top-k exchange against the paper's formulas, on 8 replicas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jfleet.mesh.topology import DP
from jfleet.optim import hyperparams
from jfleet.optim.dgc import dgc_communication, dgc_momentum, momentum_of, sparsity_index
from jfleet.testing import hlo

R = 8
M = 0.9
SHAPE = (128, 128)  # 16384 entries: Paddle's smallest compressed parameter
BEGIN, RAMPUP, SPARSITY = 1, 2, [0.9, 0.999]
STEPS = 5  # dense, 0.9, 0.9, 0.999, 0.999


def _grads(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "w": rng.normal(size=(R, *SHAPE)).astype(np.float32),
        "b": rng.normal(size=(R, 4)).astype(np.float32),
    }


def _paper_reference() -> list[dict]:
    """Lin et al. 2018, Alg. 1 with momentum correction and factor masking, per replica."""
    u = np.zeros((R, *SHAPE))
    v = np.zeros((R, *SHAPE))
    out = []
    for t in range(STEPS):
        g = {k: x.astype(np.float64) for k, x in _grads(t).items()}
        if t < BEGIN:
            out.append({"w": g["w"].mean(0), "b": g["b"].mean(0), "sent": None, "u": u, "v": v})
            continue
        s = SPARSITY[min((t - BEGIN) * len(SPARSITY) // RAMPUP, len(SPARSITY) - 1)]
        k = int(np.prod(SHAPE) * (1 - s))
        u = M * u + g["w"]
        v = v + u
        sent = np.zeros_like(v)
        for r in range(R):
            flat = v[r].reshape(-1)
            top = np.argsort(-np.abs(flat))[:k]
            mask = np.zeros(flat.shape, bool)
            mask[top] = True
            sent[r] = np.where(mask, flat, 0).reshape(SHAPE)
        u = np.where(sent != 0, 0, u)
        v = np.where(sent != 0, 0, v)
        out.append({"w": sent.sum(0) / R, "b": g["b"].mean(0), "sent": sent, "u": u, "v": v})
    return out


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((R,), (DP,), axis_types=(AxisType.Auto,))


def _compile(mesh, comm):
    """The per-replica reduce as one program over the mesh, and the initial state."""

    def per_replica(grads, state):
        grads = jax.tree.map(lambda x: x[0], grads)
        state = jax.tree.map(lambda x: x[0], state)
        mean, state = comm.reduce(grads, state)
        return mean, jax.tree.map(lambda x: x[None], state)

    def init(grads):
        return jax.tree.map(lambda x: x[None], comm.init(jax.tree.map(lambda x: x[0], grads)))

    spec = P(DP)
    grads = jax.tree.map(jnp.asarray, _grads(0))
    state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=spec, out_specs=spec))(grads)
    step = jax.jit(jax.shard_map(per_replica, mesh=mesh, in_specs=spec, out_specs=(P(), spec)))
    return step, state


def test_momentum_correction_and_top_k_follow_the_paper(mesh):
    comm = dgc_communication(M, rampup_begin_step=BEGIN, rampup_step=RAMPUP, sparsity=SPARSITY)
    step, state = _compile(mesh, comm)
    for t, want in enumerate(_paper_reference()):
        mean, state = step(jax.tree.map(jnp.asarray, _grads(t)), state)
        np.testing.assert_allclose(np.asarray(mean["w"]), want["w"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(mean["b"]), want["b"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(state.u["w"]), want["u"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(state.v["w"]), want["v"], rtol=1e-5, atol=1e-5)
        assert int(state.count[0]) == t + 1
        if t >= RAMPUP + BEGIN:  # ramped up to 0.999: each replica sends <= 0.1%
            per_replica = np.count_nonzero(want["sent"].reshape(R, -1), axis=1)
            assert per_replica.max() <= 0.001 * np.prod(SHAPE)
            assert np.count_nonzero(np.asarray(mean["w"])) <= per_replica.sum()
    assert state.u["b"].shape == (R, 0)  # small parameters are averaged densely, no state


def test_only_the_top_k_values_and_indices_travel(mesh):
    step, state = _compile(mesh, dgc_communication(M))  # Paddle's defaults: 0.999 from step 0
    text = step.lower(jax.tree.map(jnp.asarray, _grads(0)), state).compile().as_text()
    moved = sum(c.bytes * c.weight for c in hlo.collectives(text))  # XLA may combine them
    k = int(np.prod(SHAPE) * (1 - 0.999))  # 16 of 16384 entries per replica
    # b averaged densely (16 bytes); w: 8 replicas' k float32 values and k int32 indices,
    # 1040 bytes where a dense reduction of w moves 65536
    assert moved == 16 + 2 * R * k * 4


def test_the_optimizer_is_momentum_then_sgd_with_the_learning_rate():
    tx = dgc_momentum(hyperparams.momentum(0.5, momentum=M), rampup_begin_step=2, min_numel=4)
    params = {"w": jnp.zeros(4), "b": jnp.zeros(2)}
    state = tx.init(params)
    trace_w = trace_b = np.zeros(2)
    for t in range(4):
        g = {"w": jnp.full(4, t + 1.0), "b": jnp.full(2, t + 1.0)}
        u, state = tx.update(g, state, params)
        trace_b = M * trace_b + (t + 1.0)
        trace_w = M * trace_w + (t + 1.0)
        want_w = -0.5 * (t + 1.0) if t >= 2 else -0.5 * trace_w[0]
        np.testing.assert_allclose(np.asarray(u["w"]), want_w, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(u["b"]), -0.5 * trace_b[0], rtol=1e-6)


def test_ramp_up_and_checks():
    assert [int(sparsity_index(t, 0, 1, 1)) for t in range(3)] == [0, 0, 0]
    assert [int(sparsity_index(t, 1, 3, 3)) for t in range(5)] == [-1, 0, 1, 2, 2]
    with pytest.raises(ValueError, match=r"needs a Momentum optimizer.*got 'adam'"):
        momentum_of(hyperparams.adam(1e-3))
    with pytest.raises(ValueError, match=r"readable hyperparameters.*inject_hyperparams"):
        momentum_of(optax.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"nesterov=True"):
        momentum_of(hyperparams.momentum(0.1, nesterov=True))
    with pytest.raises(ValueError, match=r"sparsity=\[1\.0\].*in \[0, 1\)"):
        dgc_communication(0.9, sparsity=[1.0])

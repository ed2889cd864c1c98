"""A GPT built from jfleet's tensor-parallel layers equals the plain model on one device."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet
from jfleet.models import lm_batches
from jfleet.models.parallel_gpt import GPTBlock, TinyGPT, gpt_loss
from jfleet.testing import assert_trees_close, hlo, train_one_device
from tests.fleet_setup import init_fleet

HYBRIDS = {
    "mp4_dp2": {"dp_degree": 2, "mp_degree": 4},
    "mp2_sharding2_dp2": {"dp_degree": 2, "sharding_degree": 2, "mp_degree": 2},
}
MP_GROUPS = {"mp4_dp2": [[0, 1, 2, 3], [4, 5, 6, 7]]}
STEPS = 5
TOL = dict(rtol=1e-5, atol=1e-6)


def close(got, want):
    assert_trees_close(got, want, **TOL)


# SGD, not Adam: the key bias's true gradient is exactly zero (softmax ignores a shift
# shared by all keys), and Adam would blow its ~1e-9 rounding noise up to +-lr steps.
def make_tx():
    return optax.sgd(0.5)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_forward_and_gradients_equal_the_plain_model(hybrid, sequence_parallel):
    batch = jax.tree.map(jnp.asarray, lm_batches(1)[0])
    plain = TinyGPT()
    want_logits = plain(batch["tokens"])
    want_grads = nnx.jit(nnx.grad(gpt_loss))(plain, batch)
    init_fleet(HYBRIDS[hybrid])
    model = TinyGPT(tensor_parallel=True, sequence_parallel=sequence_parallel)
    close(nnx.state(model, nnx.Param), nnx.state(plain, nnx.Param))  # same initial values
    assert model.blocks[0].attn.qkv.kernel.sharding.spec == jax.sharding.PartitionSpec(None, "mp")
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, batch["tokens"])
    # logits are O(1) sums of 32- and 128-term products computed in another order per
    # shard: a few float32 ulps of the largest terms (~2e-6) apart
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
    grads = nnx.jit(nnx.grad(gpt_loss))(model, batch)  # eagerly, every op would compile
    close(nnx.state(grads, nnx.Param), nnx.state(want_grads, nnx.Param))


@functools.cache
def _one_device():
    """The plain TinyGPT's steps on one device: losses and parameters (read only)."""
    return train_one_device(TinyGPT(), make_tx(), lm_batches(STEPS), gpt_loss)


@pytest.mark.parametrize(
    ("hybrid", "sequence_parallel"),
    [("mp4_dp2", False), ("mp4_dp2", True), ("mp2_sharding2_dp2", False)],
    ids=["mp4_dp2-tp", "mp4_dp2-tp+sp", "mp2_sharding2_dp2-tp"],
)
def test_five_training_steps_equal_the_plain_model(hybrid, sequence_parallel):
    batches = lm_batches(STEPS)
    want_losses, want_params = _one_device()
    init_fleet(HYBRIDS[hybrid])
    model = fleet.distributed_model(
        TinyGPT(tensor_parallel=True, sequence_parallel=sequence_parallel)
    )
    opt = fleet.distributed_optimizer(make_tx())
    losses = np.array([float(model.train_batch(b, opt, loss_fn=gpt_loss)) for b in batches])
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    close(nnx.state(model.module, nnx.Param), want_params)


def block_collectives(sequence_parallel: bool):
    init_fleet(HYBRIDS["mp4_dp2"])
    model = TinyGPT(tensor_parallel=True, sequence_parallel=sequence_parallel)
    block: GPTBlock = model.blocks[0]
    x = jnp.zeros((8, 8, 32), jnp.float32)  # [b, s, h]
    if sequence_parallel:
        from jfleet.parallel.sequence import scatter_to_sequence_parallel

        x = scatter_to_sequence_parallel(x, seq_axis=1)
    graphdef, state = nnx.split(block)
    text = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).compile().as_text()
    return hlo.collectives(text)


def test_tensor_parallel_block_forward_has_exactly_two_mp_all_reduces():
    found = block_collectives(sequence_parallel=False)
    assert [c.kind for c in found] == ["all-reduce", "all-reduce"], found
    for c in found:
        assert [list(g) for g in c.groups] == MP_GROUPS["mp4_dp2"]
        assert c.bytes == 4 * 8 * 32 * 4  # [b/dp, s, h] fp32: attention out, MLP out


def test_sequence_parallel_block_moves_the_same_bytes_as_gathers_and_scatters():
    tp = block_collectives(sequence_parallel=False)
    sp = block_collectives(sequence_parallel=True)
    kinds = sorted(c.kind for c in sp)
    assert kinds == ["all-gather", "all-gather", "reduce-scatter", "reduce-scatter"], sp
    for c in sp:
        assert [list(g) for g in c.groups] == MP_GROUPS["mp4_dp2"]
    # one all-reduce = one reduce-scatter + one all-gather of the same full buffer
    assert sum(c.bytes for c in sp) == 2 * sum(c.bytes for c in tp)


def test_sequence_length_not_divisible_by_mp_is_a_clear_error():
    init_fleet(HYBRIDS["mp4_dp2"])
    model = TinyGPT(tensor_parallel=True, sequence_parallel=True)
    tokens = jnp.zeros((8, 6), jnp.int32)
    with pytest.raises(ValueError, match=r"sequence length 6 .* mp degree 4"):
        model(tokens)


def test_meta_parallel_names_are_importable_both_ways():
    import jfleet.fleet.meta_parallel as mp
    from jfleet.fleet.meta_parallel import ColumnParallelLinear, ParallelCrossEntropy

    assert (
        mp.ColumnParallelLinear is ColumnParallelLinear is fleet.meta_parallel.ColumnParallelLinear
    )
    assert mp.ParallelCrossEntropy is ParallelCrossEntropy

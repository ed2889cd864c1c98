"""Paddle's RNG state tracker, model-parallel seeding, and dropout under tensor parallelism."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from jfleet import DistributedStrategy, fleet
from jfleet.parallel.layers import ColumnParallelLinear, RowParallelLinear
from jfleet.parallel.random import (
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    StreamState,
    apply_tensor_init_seed,
    get_rng_state_tracker,
    local_seed,
    model_parallel_random_seed,
)
from tests.fleet_setup import init_fleet


def _key_data(key):
    return np.asarray(jax.random.key_data(key))


# --------------------------------------------------------------- seeds
def test_local_seed_is_paddles_formula():
    assert local_seed(100, mp_rank=0) == 101
    assert local_seed(100, mp_rank=3, pp_rank=1, pp_size=2) == 100 + 1 + 3 * 2 + 1


def test_model_parallel_random_seed_registers_one_local_seed_per_mp_rank():
    init_fleet({"dp_degree": 2, "pp_degree": 2, "mp_degree": 2})
    assert model_parallel_random_seed(10) == 10
    state = get_rng_state_tracker().get_states_tracker()[MODEL_PARALLEL_RNG]
    # seed + 1 + mp_rank * pp_size + pp_rank, pp_rank 0 (this process's stage)
    assert state == StreamState(seeds=(11, 13), draws=0)
    # calling it again re-seeds (the tracker is reset first, as in Paddle)
    model_parallel_random_seed(20)
    assert get_rng_state_tracker().get_states_tracker()[MODEL_PARALLEL_RNG].seeds == (21, 23)


def test_model_parallel_random_seed_draws_one_like_paddle():
    init_fleet({"dp_degree": 2, "mp_degree": 4})
    np.random.seed(0)
    drawn = model_parallel_random_seed()
    np.random.seed(0)
    assert drawn == np.random.randint(0, 10000)
    seeds = get_rng_state_tracker().get_states_tracker()[MODEL_PARALLEL_RNG].seeds
    assert seeds == tuple(drawn + 1 + r for r in range(4))


def test_seed_zero_is_a_seed():
    init_fleet({"dp_degree": 2, "mp_degree": 4})
    assert model_parallel_random_seed(0) == 0
    assert get_rng_state_tracker().get_states_tracker()[MODEL_PARALLEL_RNG].seeds == (1, 2, 3, 4)


def test_apply_tensor_init_seed_follows_paddles_fleet_init():
    strategy = init_fleet({"dp_degree": 8}, tensor_parallel_configs={"tensor_init_seed": 5})
    assert apply_tensor_init_seed(strategy) is None  # mp 1: nothing seeded
    assert get_rng_state_tracker().get_states_tracker() == {}
    strategy = init_fleet(
        {"dp_degree": 2, "mp_degree": 4}, tensor_parallel_configs={"tensor_init_seed": 42}
    )
    assert apply_tensor_init_seed(strategy) == 42
    assert get_rng_state_tracker().get_states_tracker()[MODEL_PARALLEL_RNG].seeds[0] == 43
    strategy = init_fleet({"dp_degree": 2, "mp_degree": 4})  # tensor_init_seed -1: drawn
    assert 0 <= apply_tensor_init_seed(strategy) < 10000


# --------------------------------------------------------------- the tracker
def test_streams_advance_and_give_fold_in_keys():
    tracker = RNGStatesTracker()
    tracker.add("global_seed", 7)
    first = tracker.key("global_seed")
    with tracker.rng_state("global_seed") as rngs:
        inside = rngs.default.key[...]
    np.testing.assert_array_equal(
        _key_data(first), _key_data(jax.random.fold_in(jax.random.key(7), 0))
    )
    np.testing.assert_array_equal(
        _key_data(inside), _key_data(jax.random.fold_in(jax.random.key(7), 1))
    )
    assert tracker.get_states_tracker()["global_seed"].draws == 2


def test_shard_keys_one_per_mp_rank():
    tracker = RNGStatesTracker()
    tracker.add("local", [3, 9])
    keys = tracker.shard_keys("local", 2)
    for key, seed in zip(keys, (3, 9), strict=True):
        want = jax.random.fold_in(jax.random.key(seed), 0)
        np.testing.assert_array_equal(_key_data(key), _key_data(want))
    tracker.add("shared", 5)  # one seed: every rank draws the same
    a, b = tracker.shard_keys("shared", 2)
    np.testing.assert_array_equal(_key_data(a), _key_data(b))


def test_states_save_and_restore():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    saved = tracker.get_states_tracker()
    k1 = tracker.key("a")
    tracker.set_states_tracker(saved)
    np.testing.assert_array_equal(_key_data(tracker.key("a")), _key_data(k1))
    with pytest.raises(ValueError, match="seed 1 already exists"):
        tracker.add("b", 1)  # the restored states keep their seeds taken
    tracker.reset()
    tracker.add("b", 1)


def test_tracker_misuse_is_a_clear_error():
    tracker = RNGStatesTracker()
    tracker.add("model_parallel_rng", [11, 12, 13, 14])
    with pytest.raises(ValueError, match=r"seed 12 already exists \(adding state 'other'\)"):
        tracker.add("other", 12)
    with pytest.raises(ValueError, match=r"state 'model_parallel_rng' already exists"):
        tracker.add("model_parallel_rng", 99)
    with (
        pytest.raises(ValueError, match=r"state 'dropout' does not exist; registered: \["),
        tracker.rng_state("dropout"),
    ):
        pass
    with pytest.raises(ValueError, match=r"state 'nope' does not exist"):
        tracker.key("nope")
    with pytest.raises(ValueError, match=r"seed=-1 must be a non-negative int"):
        tracker.add("neg", -1)
    with pytest.raises(ValueError, match=r"seed=True must be a non-negative int"):
        tracker.add("flag", True)
    with pytest.raises(ValueError, match=r"seed=\[\] must be"):
        tracker.add("empty", [])
    with pytest.raises(ValueError, match=r"seed \(5, 5\) repeats a seed"):
        tracker.add("twice", [5, 5])
    with pytest.raises(ValueError, match=r"holds 4 per-rank seeds but the mesh has mp degree 2"):
        tracker.shard_keys("model_parallel_rng", 2)
    with pytest.raises(TypeError, match=r"states \['x'\] are not StreamState"):
        tracker.set_states_tracker({"x": 3})
    # a failed add leaves the tracker as it was
    assert set(tracker.get_states_tracker()) == {"model_parallel_rng"}


def test_seeding_needs_fleet_init_and_a_valid_seed():
    with pytest.raises(RuntimeError, match=r"fleet.init\(\) first"):
        model_parallel_random_seed(1)
    init_fleet({"dp_degree": 2, "mp_degree": 4})
    with pytest.raises(ValueError, match=r"seed=-3 must be a non-negative int or None"):
        model_parallel_random_seed(-3)


# --------------------------------------------------------------- dropout
def _dropout(x, key):
    drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=key))
    return nnx.jit(lambda d, x: d(x))(drop, x)


def test_dropout_on_split_activations_differs_per_mp_shard():
    init_fleet({"dp_degree": 2, "mp_degree": 4})
    col = ColumnParallelLinear(8, 16, gather_output=False, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) + 3.0
    y = col(x)
    key = jax.random.key(1)
    out = _dropout(y, key)
    assert out.sharding.spec[-1] == "mp"  # the mask was drawn split, shard by shard
    mask = np.asarray(out) != 0
    shards = [mask[:, 4 * r : 4 * (r + 1)] for r in range(4)]
    assert all(not np.array_equal(shards[0], s) for s in shards[1:])
    # and it is the single-device draw of the global mask with the same key
    np.testing.assert_allclose(out, _dropout(np.asarray(y), key), rtol=1e-6)


def test_dropout_on_replicated_activations_is_the_same_on_every_mp_rank():
    init_fleet({"dp_degree": 2, "mp_degree": 4})
    row = RowParallelLinear(16, 8, rngs=nnx.Rngs(0))
    y = row(np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32))
    key = jax.random.key(2)
    out = _dropout(y, key)
    assert "mp" not in jax.tree.leaves(tuple(out.sharding.spec))  # replicated over mp
    # the 4 mp devices of each dp group hold the same buffer: one mask, not four
    by_rows: dict = {}
    for shard in out.addressable_shards:
        by_rows.setdefault(str(shard.index), []).append(np.asarray(shard.data))
    assert len(by_rows) == 2 and all(len(bufs) == 4 for bufs in by_rows.values())
    for bufs in by_rows.values():
        for buf in bufs[1:]:
            np.testing.assert_array_equal(buf, bufs[0])
    np.testing.assert_allclose(out, _dropout(np.asarray(y), key), rtol=1e-6)


def _paddle_kernel(seed: int):
    from jfleet.parallel.layers import ColumnParallelLinear
    from jfleet.parallel.random import set_init_mode

    s = DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
    s.tensor_parallel_configs = {"tensor_init_seed": seed}
    fleet.init(is_collective=True, strategy=s, log_level="WARNING")
    set_init_mode("paddle")
    from flax import nnx

    return np.asarray(ColumnParallelLinear(8, 16, rngs=nnx.Rngs(0)).kernel[...])


def test_strategy_tensor_init_seed_drives_paddle_init():
    a, b, c = _paddle_kernel(7), _paddle_kernel(7), _paddle_kernel(8)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)

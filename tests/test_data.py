"""The sharded loader on its own: batches on the data axes of a fleet mesh, its iteration."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import DATA_AXES, MP
from jfleet.testing import make_strategy
from jfleet.training.data import ShardedLoader, batch_shape, peek


@pytest.fixture
def placement() -> Placement:
    """The placement of a fleet run on dp2 x sharding2 x mp2 (8 devices)."""
    strategy = make_strategy({"dp_degree": 2, "sharding_degree": 2, "mp_degree": 2})
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    return Placement.from_fleet()


def lm_batch(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "tokens": rng.integers(0, 64, (rows, 8), dtype=np.int32),
        "labels": rng.integers(0, 64, (rows, 8), dtype=np.int32),
    }


def rows_per_device(x: jax.Array) -> dict[int, tuple[int, int]]:
    """``{device id: (first row, last row + 1)}`` of a placed batch."""
    return {
        s.device.id: (s.index[0].start or 0, s.index[0].stop or x.shape[0])
        for s in x.addressable_shards
    }


def test_batches_are_split_over_the_data_axes_and_replicated_over_mp(placement):
    mesh = placement.mesh
    batches = [lm_batch(16, seed) for seed in range(3)]
    placed = list(ShardedLoader(batches, placement))
    assert len(placed) == 3
    for raw, got in zip(batches, placed, strict=True):
        for key in ("tokens", "labels"):
            x = got[key]
            assert isinstance(x, jax.Array) and x.shape == (16, 8)
            assert x.sharding.spec == P(DATA_AXES)
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, P(DATA_AXES)), 2)
            np.testing.assert_array_equal(np.asarray(x), raw[key])
            rows = rows_per_device(x)
            assert len(rows) == 8 and sorted(set(rows.values())) == [
                (0, 4),
                (4, 8),
                (8, 12),
                (12, 16),
            ]
            # the two devices of an mp group hold the same rows
            for group in mesh.devices.reshape(-1, mesh.shape[MP]):
                assert len({rows[d.id] for d in group}) == 1


def test_scalar_leaves_are_replicated(placement):
    batch = {"tokens": np.zeros((8, 4), np.int32), "step": np.int32(3)}
    (got,) = ShardedLoader([batch], placement)
    assert got["step"].sharding.spec == P() and int(got["step"]) == 3
    assert got["tokens"].sharding.spec == P(DATA_AXES)


def test_a_one_shot_iterator_keeps_the_peeked_first_batch(placement):
    batches = [lm_batch(8, seed) for seed in range(3)]
    source = iter(batches)
    first = peek(source)
    loader = ShardedLoader(source, placement, first)
    placed = list(loader)
    assert len(placed) == 3  # the peeked batch comes first, not lost
    for raw, got in zip(batches, placed, strict=True):
        np.testing.assert_array_equal(np.asarray(got["tokens"]), raw["tokens"])
    assert list(loader) == []  # a one-shot iterator is consumed once


def test_a_reiterable_loader_is_read_anew_and_first_is_not_repeated(placement):
    batches = [lm_batch(8, seed) for seed in range(2)]
    first = peek(batches)
    assert first is batches[0]
    loader = ShardedLoader(batches, placement, first)
    for _ in range(2):  # every epoch sees exactly the list's batches
        placed = list(loader)
        assert len(placed) == 2
        np.testing.assert_array_equal(np.asarray(placed[0]["tokens"]), batches[0]["tokens"])


def test_len_is_the_wrapped_loaders(placement):
    assert len(ShardedLoader([lm_batch(8)] * 5, placement)) == 5
    with pytest.raises(TypeError):
        len(ShardedLoader(iter([lm_batch(8)]), placement))


def test_a_batch_the_data_parallel_size_does_not_divide_is_an_error(placement):
    loader = ShardedLoader([lm_batch(8), lm_batch(6)], placement)
    it = iter(loader)
    next(it)
    with pytest.raises(
        ValueError,
        match=(
            r"\['labels'\] has batch size 6, which the data-parallel size 4 "
            r"\(dp 2 x sharding 2\) does not divide; use a batch size that is a multiple of 4"
        ),
    ):
        next(it)


def test_the_placement_must_be_a_placement():
    with pytest.raises(TypeError, match=r"placement=None .* is not a jfleet.placement.Placement"):
        ShardedLoader([lm_batch(8)], None)


def test_peek_refuses_what_gives_no_batch():
    with pytest.raises(TypeError, match="dataloader=int is not iterable"):
        peek(3)
    with pytest.raises(ValueError, match="yielded no batch"):
        peek([])


def test_batch_shape_reads_batch_and_sequence():
    assert batch_shape({"x": np.zeros((4, 3), np.float32), "ids": np.zeros((4, 7), int)}) == (
        4,
        7,
    )  # the token ids give the sequence length
    assert batch_shape(np.zeros((4,))) == (4, 1)
    open_batch = types.SimpleNamespace(shape=(-1, 32), dtype=np.int32)  # Paddle's InputSpec
    assert batch_shape(open_batch) == (None, 32)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        batch_shape({"a": np.zeros((4, 2)), "b": np.zeros((5, 2))})
    with pytest.raises(ValueError, match="has no arrays"):
        batch_shape({"a": np.float32(1.0)})

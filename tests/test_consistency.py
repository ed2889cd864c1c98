"""Tests for jfleet/runtime/consistency.py in one process: fingerprints, messages, the protocol.

The multi-process protocol runs here against a fake key-value store standing in for the
coordination service, with the process layout faked as 2 processes; the real thing is
tests/test_consistency_multiprocess.py.
"""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest

from jfleet.mesh.topology import DP, MP
from jfleet.runtime import consistency
from jfleet.runtime import coordination as _coordination
from jfleet.runtime.consistency import (
    ConsistencyTimeoutError,
    InconsistentBatchError,
    InconsistentJobError,
    check_batch,
    check_init,
    compare_batches,
    compare_fingerprints,
    describe_batch,
    describe_ranks,
    fingerprint,
)
from jfleet.training.strategy import DistributedStrategy


def hybrid(dp: int, mp: int) -> DistributedStrategy:
    strategy = DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": dp, "mp_degree": mp}
    return strategy


def mesh(dp: int, mp: int, devices=None) -> jax.sharding.Mesh:
    devices = np.asarray(devices if devices is not None else jax.devices()).reshape(dp, mp)
    return jax.sharding.Mesh(devices, (DP, MP))


# ------------------------------------------------------------------ messages


def test_describe_ranks_groups_equal_values():
    values = {0: "a", 1: "a", 2: "a", 3: "b", 5: "a", 4: "c"}
    assert describe_ranks(values) == "ranks 0-2, 5 a; rank 3 b; rank 4 c"


def test_equal_fingerprints_agree():
    a = fingerprint(hybrid(2, 4), mesh(2, 4))
    assert compare_fingerprints({0: a, 1: fingerprint(hybrid(2, 4), mesh(2, 4))}) == []
    assert a["hybrid_configs"]["dp_degree"] == 2 and a["mesh shape"] == [2, 4]
    assert a["strategy"] == {"hybrid_configs.dp_degree": 2, "hybrid_configs.mp_degree": 4}


def test_different_strategies_name_each_ranks_degrees():
    prints = {
        0: fingerprint(hybrid(2, 4), mesh(2, 4)),
        1: fingerprint(hybrid(4, 2), mesh(4, 2)),
    }
    assert compare_fingerprints(prints) == [
        "hybrid_configs differs: rank 0 dp2·mp4; rank 1 dp4·mp2",
        "mesh shape differs: rank 0 dp2·mp4; rank 1 dp4·mp2",
    ]


def test_a_changed_setting_is_named_with_its_path():
    amp = hybrid(2, 4)
    amp.amp = True
    amp.amp_configs = {"init_loss_scaling": 1024.0}
    lines = compare_fingerprints(
        {0: fingerprint(amp, mesh(2, 4)), 1: fingerprint(hybrid(2, 4), mesh(2, 4))}
    )
    assert lines == [
        "strategy.amp differs: rank 0 True; rank 1 (default)",
        "strategy.amp_configs.init_loss_scaling differs: rank 0 1024.0; rank 1 (default)",
    ]


def test_an_order_difference_shows_the_orders():
    other = hybrid(2, 4)
    other.hybrid_configs = {"order": ["mp", "dp", "pp", "sharding", "sep"]}
    lines = compare_fingerprints(
        {0: fingerprint(hybrid(2, 4), mesh(2, 4)), 1: fingerprint(other, mesh(2, 4))}
    )
    assert lines == [
        "hybrid_configs differs: rank 0 dp2·mp4 (order dp/pp/sharding/sep/mp); "
        "rank 1 dp2·mp4 (order mp/dp/pp/sharding/sep)"
    ]


def test_versions_process_count_and_devices_are_compared():
    a = fingerprint(hybrid(2, 4), mesh(2, 4))
    b = dict(a, **{"jax version": "0.9.0", "process count": 4})
    b["mesh devices"] = a["mesh devices"][::-1]
    assert compare_fingerprints({0: a, 1: b, 2: a}) == [
        "process count differs: ranks 0, 2 1; rank 1 4",
        f"jax version differs: ranks 0, 2 {jax.__version__}; rank 1 0.9.0",
        "mesh devices differs: ranks 0, 2 [0, 1, 2, 3, 4, 5, 6, 7]; "
        "rank 1 [7, 6, 5, 4, 3, 2, 1, 0]",
    ]


def test_batches_differing_in_rows_name_the_global_size():
    x4 = describe_batch({"x": np.zeros((4, 8), np.int32)})
    x8 = describe_batch({"x": np.zeros((8, 8), np.int32)})
    assert compare_batches({0: x4, 1: x8}, count=2) == [
        "['x'] differs: rank 0 int32[4, 8]; rank 1 int32[8, 8]",
        "so the global batch size would be (processes x local rows): "
        "rank 0 2 x 4 = 8; rank 1 2 x 8 = 16",
    ]
    assert compare_batches({0: x4, 1: x4}, count=2) == []


def test_batches_differing_in_dtype_or_structure():
    ints = {"x": np.zeros((4, 8), np.int32), "y": np.zeros((4,), np.float32)}
    longs = {"x": np.zeros((4, 8), np.int64), "y": np.zeros((4,), np.float32)}
    assert compare_batches({0: describe_batch(ints), 1: describe_batch(longs)}, count=2) == [
        "['x'] differs: rank 0 int32[4, 8]; rank 1 int64[4, 8]"
    ]
    assert compare_batches(
        {0: describe_batch(ints), 1: describe_batch({"x": ints["x"]})}, count=2
    ) == [
        "the batch's structure differs: rank 0 {['x'] int32[4, 8], ['y'] float32[4]}; "
        "rank 1 {['x'] int32[4, 8]}"
    ]


def test_a_peer_that_kept_its_shape_is_named():
    x4 = describe_batch({"x": np.zeros((4, 8), np.int32)})
    lines = compare_batches({0: x4, 1: None}, count=2, notes={1: " at call #3 (...)"})
    assert lines == ["rank 1 kept its earlier batch shape at call #3 (...)"]


def test_batch_signature_skips_global_arrays_and_sees_dtypes():
    x = np.zeros((4, 8), np.int32)
    assert consistency.batch_signature({"x": x}) != consistency.batch_signature({"x": x + 0.0})
    assert consistency.batch_signature([x, 1]) != consistency.batch_signature((x, 1))


@pytest.mark.parametrize("raw", ["soon", "0", "-3", "inf"])
def test_bad_timeout_variable(monkeypatch, raw):
    monkeypatch.setenv("JFLEET_CONSISTENCY_TIMEOUT", raw)
    with pytest.raises(ValueError, match=rf"JFLEET_CONSISTENCY_TIMEOUT='{raw}' is not a positive"):
        consistency.timeout_s()


# ---------------------------------------------------- the protocol, 2 processes faked


class FakeStore:
    """The coordination key-value store, counting operations; peers' values preset."""

    def __init__(self, monkeypatch, values=None):
        self.values = dict(values or {})
        self.ops = 0
        for name in ("put", "try_get", "wait_get", "delete"):
            monkeypatch.setattr(_coordination, name, getattr(self, name))
        monkeypatch.setattr(_coordination, "available", lambda: True)

    def put(self, key, value):
        self.ops += 1
        self.values[key] = value

    def try_get(self, key):
        self.ops += 1
        return self.values.get(key)

    def delete(self, key):
        self.ops += 1
        self.values.pop(key, None)

    def wait_get(self, key, timeout_s):
        self.ops += 1
        if key not in self.values:
            raise TimeoutError(key)
        return self.values[key]


@pytest.fixture
def two_processes(monkeypatch):
    """This process is rank 0 of 2; consistency state fresh; short timeouts."""
    monkeypatch.setattr(consistency, "_layout", lambda: (0, 2))
    monkeypatch.setattr(consistency, "_state", consistency._State())
    monkeypatch.setattr(consistency, "_generation", 0)
    monkeypatch.setenv("JFLEET_CONSISTENCY_TIMEOUT", "0.05")


def test_one_process_checks_nothing(monkeypatch):
    store = FakeStore(monkeypatch)
    check_init(hybrid(2, 4), mesh(2, 4))
    check_batch({"x": np.zeros((4, 8), np.int32)})
    assert store.ops == 0


def test_init_raises_on_every_difference(two_processes, monkeypatch):
    peer = fingerprint(hybrid(4, 2), mesh(4, 2))
    FakeStore(monkeypatch, {"init/1/1": peer})
    with pytest.raises(
        InconsistentJobError,
        match=r"(?s)disagree at fleet.init \(call #1; this "
        r"is rank 0\).*rank 0 dp2·mp4; rank 1 dp4·mp2.*same DistributedStrategy",
    ):
        check_init(hybrid(2, 4), mesh(2, 4))
    # The next fleet.init is the next round: keys numbered by the call.
    FakeStore(monkeypatch, {"init/2/1": fingerprint(hybrid(2, 4), mesh(2, 4))})
    check_init(hybrid(2, 4), mesh(2, 4))


def test_init_names_a_peer_that_never_arrives(two_processes, monkeypatch):
    FakeStore(monkeypatch)
    with pytest.raises(
        ConsistencyTimeoutError,
        match=r"rank 1 did not reach fleet.init call #1 .* within 0.05 s "
        r"\(JFLEET_CONSISTENCY_TIMEOUT\); this is rank 0 of 2",
    ):
        check_init(hybrid(2, 4), mesh(2, 4))


def test_unchanged_batches_cost_no_coordination(two_processes, monkeypatch):
    x = {"x": np.zeros((4, 8), np.int32)}
    store = FakeStore(monkeypatch, {"batch/0/0/1": describe_batch(x)})
    check_batch(x)
    assert store.ops == 3  # put call #0, put latest, wait for rank 1: equal
    store.ops = 0
    start = time.perf_counter()
    for _ in range(1000):
        check_batch({"x": np.zeros((4, 8), np.int32)})
    per_call = (time.perf_counter() - start) / 1000
    assert store.ops == 0
    assert per_call < 1e-3, per_call  # measured ~10 us


def test_a_shape_change_on_this_process_only_is_named(two_processes, monkeypatch):
    x8 = {"x": np.zeros((4, 8), np.int32)}
    store = FakeStore(monkeypatch, {"batch/0/0/1": describe_batch(x8)})
    check_batch(x8)
    # Rank 1 published nothing for call #1: it kept its shape (its latest, from call #0).
    store.values["batch/0/latest/1"] = {"call": 0, "batch": describe_batch(x8)}
    with pytest.raises(
        InconsistentBatchError,
        match=r"\['x'\] differs: rank 0 int32\[4, 4\]; rank 1 int32\[4, 8\] \(its batch since "
        r"shard_batch call #0; it published no new shape for call #1 within 0.05 s\)",
    ):
        check_batch({"x": np.zeros((4, 4), np.int32)})
    # Back to the shape every process has: no error (rank 1's latest still says 4 x 8).
    check_batch(x8)


def test_a_peer_without_any_batch_times_out_by_name(two_processes, monkeypatch):
    FakeStore(monkeypatch)
    with pytest.raises(
        ConsistencyTimeoutError,
        match=r"rank 1 published no batch within 0.05 s of this process's shard_batch call #0",
    ):
        check_batch({"x": np.zeros((4, 8), np.int32)})


def test_global_batches_are_not_checked(two_processes, monkeypatch):
    store = FakeStore(monkeypatch)
    monkeypatch.setattr(consistency, "batch_signature", lambda batch: None)
    check_batch({"x": np.zeros((4, 8), np.int32)})  # stands for an all-global batch
    assert store.ops == 0 and consistency._state.calls == 0


def test_shapes_changing_every_step_keep_the_store_bounded(two_processes, monkeypatch):
    store = FakeStore(monkeypatch)
    for call in range(6):
        x = {"x": np.zeros((4, 1 + call), np.int32)}
        store.values[f"batch/0/{call}/1"] = describe_batch(x)  # rank 1 agrees
        check_batch(x)
    mine = sorted(k for k in store.values if k.endswith("/0") and "latest" not in k)
    assert mine == ["batch/0/4/0", "batch/0/5/0"]
    assert store.values["batch/0/latest/0"]["call"] == 5


def test_a_heartbeat_past_the_call_ends_the_wait_at_once(two_processes, monkeypatch):
    """A peer whose heartbeat says it went past the call without publishing kept its shape."""
    x8 = {"x": np.zeros((4, 8), np.int32)}
    store = FakeStore(monkeypatch, {"batch/0/0/1": describe_batch(x8)})
    check_batch(x8)
    assert consistency.batch_progress() == [0, 1]
    store.values["batch/0/latest/1"] = {"call": 0, "batch": describe_batch(x8)}
    store.values["watchdog/rank/1"] = {"batch_progress": [0, 2]}  # rank 1 is past call #1
    monkeypatch.setenv("JFLEET_CONSISTENCY_TIMEOUT", "30")
    start = time.monotonic()
    with pytest.raises(
        InconsistentBatchError,
        match=r"rank 1 int32\[4, 8\] \(its batch since shard_batch call #0; it went past "
        r"call #1 without a new shape\)",
    ):
        check_batch({"x": np.zeros((4, 4), np.int32)})
    assert time.monotonic() - start < 5
    assert consistency.batch_progress() == [0, 1]  # the failed call is not passed


def test_a_heartbeat_of_another_round_is_ignored(two_processes, monkeypatch):
    x8 = {"x": np.zeros((4, 8), np.int32)}
    store = FakeStore(monkeypatch, {"batch/0/0/1": describe_batch(x8)})
    check_batch(x8)
    store.values["batch/0/latest/1"] = {"call": 0, "batch": describe_batch(x8)}
    store.values["watchdog/rank/1"] = {"batch_progress": [7, 2]}  # another fleet.init round
    with pytest.raises(InconsistentBatchError, match=r"no new shape for call #1 within 0.05 s"):
        check_batch({"x": np.zeros((4, 4), np.int32)})

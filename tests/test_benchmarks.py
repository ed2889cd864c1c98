"""The benchmark's HLO collective counter, and ZeRO's memory and communication on 8 devices.

Uses ``benchmarks/hlo.py`` and ``benchmarks/zero_memory.py`` at TinyLM's default size,
without timing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import zero_memory
from jfleet import hlo

MESH_AXIS = "x"


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((8,), (MESH_AXIS,))


def _sharded_rows(rows: int = 64, cols: int = 16) -> jax.Array:
    return jax.device_put(jnp.ones((rows, cols)), NamedSharding(_mesh(), P(MESH_AXIS)))


# ------------------------------------------------------------------ HLO counter
def test_reduction_over_sharded_rows_is_one_all_reduce_of_the_result():
    x = _sharded_rows()
    replicated = NamedSharding(_mesh(), P())
    text = jax.jit(lambda a: a.sum(0), out_shardings=replicated).lower(x).compile().as_text()
    found = hlo.collectives(text)
    assert [(c.kind, c.weight, c.bytes, c.group_size) for c in found] == [
        ("all-reduce", 1, 16 * 4, 8)
    ]
    assert hlo.signature(text) == {"all-reduce": (1, 64)}
    assert found[0].wire_bytes == pytest.approx(2 * 7 / 8 * 64)


def test_scan_body_is_weighted_by_its_trip_count():
    x = _sharded_rows()

    def f(a):
        def body(c, _):
            return jnp.tanh(jnp.sum(a * c, axis=0)), None  # an all-reduce every iteration

        return jax.lax.scan(body, jnp.ones(16), None, length=5)[0]

    replicated = NamedSharding(_mesh(), P())
    text = jax.jit(f, out_shardings=replicated).lower(x).compile().as_text()
    assert "known_trip_count" in text
    (found,) = hlo.collectives(text)
    assert (found.kind, found.weight, found.bytes, found.trip_count_known) == (
        "all-reduce",
        5,
        64,
        True,
    )
    assert hlo.summarize(text)["all-reduce"].bytes == 5 * 64


ASYNC_HLO = """
HloModule async_forms, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%wrapped_reduce_scatter (p0: f32[64]) -> f32[16] {
  %p0 = f32[64]{0} parameter(0)
  ROOT %rs = f32[16]{0} reduce-scatter(%p0), replica_groups={{0,1,2,3},{4,5,6,7}}, \
dimensions={0}, to_apply=%add
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %cp = f32[8]{0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}
  ROOT %out = (s32[], f32[8]{0}) tuple(%i, %cp)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %t = (s32[], f32[8]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[32], y: f32[64], z: f32[8]) -> f32[32] {
  %x = f32[32]{0} parameter(0)
  %y = f32[64]{0} parameter(1)
  %z = f32[8]{0} parameter(2)
  %ars = f32[32]{0} all-reduce-start(%x), replica_groups=[2,4]<=[8], to_apply=%add
  %ard = f32[32]{0} all-reduce-done(%ars)
  %ags = (f32[8]{0}, f32[64]{0}) all-gather-start(%z), replica_groups=[1,8]<=[8], \
dimensions={0}
  %agd = f32[64]{0} all-gather-done(%ags)
  %rss = ((f32[64]{0}), f32[16]{0}) async-start(%y), calls=%wrapped_reduce_scatter
  %rsu = ((f32[64]{0}), f32[16]{0}) async-update(%rss), calls=%wrapped_reduce_scatter
  %rsd = f32[16]{0} async-done(%rsu), calls=%wrapped_reduce_scatter
  %c0 = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%c0, %z)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[32]{0} add(%ard, %ard)
}
"""


def test_async_forms_are_counted_once_and_loops_by_trip_count():
    found = {c.kind: c for c in hlo.collectives(ASYNC_HLO)}
    assert sorted(found) == ["all-gather", "all-reduce", "collective-permute", "reduce-scatter"]
    assert (found["all-reduce"].bytes, found["all-reduce"].group_size) == (128, 4)
    assert (found["all-gather"].bytes, found["all-gather"].group_size) == (256, 8)
    assert (found["reduce-scatter"].bytes, found["reduce-scatter"].group_size) == (256, 4)
    assert (found["collective-permute"].weight, found["collective-permute"].bytes) == (3, 32)
    assert hlo.signature(ASYNC_HLO) == {
        "all-reduce": (1, 128),
        "reduce-scatter": (1, 256),
        "all-gather": (1, 256),
        "collective-permute": (3, 96),
    }


def test_all_reduce_read_only_through_dynamic_slice_counts_as_sliced():
    x = _sharded_rows()
    out = NamedSharding(_mesh(), P(MESH_AXIS))  # reduce, then keep 1/8 per device
    text = jax.jit(lambda a: a.sum(0), out_shardings=out).lower(x).compile().as_text()
    summary = hlo.summarize(text)
    if summary["reduce-scatter"].count:  # a backend that forms reduce-scatters
        assert summary["reduce-scatter"].bytes == 64
    else:  # XLA:CPU: all-reduce + dynamic-slice
        assert (summary["all-reduce"].bytes, summary["all-reduce"].sliced_bytes) == (64, 64)


# ------------------------------------------------------------------ ZeRO on 8 devices
HYBRID = {"dp_degree": 2, "sharding_degree": 4}
CONFIGS = {
    "dp8": zero_memory.Config("DP", {"dp_degree": 8}),
    "zero1": zero_memory.Config("ZeRO-1", HYBRID, 1),
    "zero2": zero_memory.Config("ZeRO-2", HYBRID, 2),
    "zero3": zero_memory.Config("ZeRO-3", HYBRID, 3),
}


#: The configurations also compiled as a hand-written jit step (each costs a compile).
WITH_BASELINE = ("zero2", "zero3")


@pytest.fixture(scope="module")
def results() -> dict[str, zero_memory.Result]:
    """Each configuration measured once (TinyLM defaults, no timing)."""
    return {
        key: zero_memory.run_config(
            config, zero_memory.SMALL, baseline=key in WITH_BASELINE, timing=False
        )
        for key, config in CONFIGS.items()
    }


def _within(got: float, want: float, rel: float = 0.05) -> bool:
    return abs(got - want) <= rel * want


def test_zero1_shards_optimizer_state_over_the_sharding_axis(results):
    dp, zero1 = results["dp8"], results["zero1"]
    assert _within(zero1.opt_bytes, dp.opt_bytes / 4), (zero1.opt_bytes, dp.opt_bytes)
    assert zero1.param_bytes == dp.param_bytes


def test_zero2_shards_gradients_and_reduces_them_sharded(results):
    dp, zero2 = results["dp8"], results["zero2"]
    assert _within(zero2.grad_bytes, dp.grad_bytes / 4), (zero2.grad_bytes, dp.grad_bytes)
    # DP: all-reduces only, none of them sliced afterwards.
    assert {k for k, s in dp.engine.items() if s.count} == {"all-reduce"}
    assert dp.engine["all-reduce"].sliced_bytes == 0
    # ZeRO-2: the gradients are reduce-scattered, which XLA:CPU spells all-reduce +
    # dynamic-slice (no ReduceScatterCreator pass on CPU); either way they cover the
    # whole gradient, and the dp all-reduce then carries only a 1/4 shard.
    scattered = zero2.engine["reduce-scatter"].bytes + zero2.engine["all-reduce"].sliced_bytes
    assert scattered >= 0.95 * 4 * zero2.phi, (scattered, 4 * zero2.phi)
    assert zero2.engine["reduce-scatter"].count or zero2.engine["all-reduce"].sliced_bytes
    # The updated parameter shards are gathered back (parameters stay replicated).
    assert _within(zero2.engine["all-gather"].bytes, 4 * zero2.phi)


def test_zero3_shards_parameters(results):
    dp, zero3 = results["dp8"], results["zero3"]
    assert _within(zero3.param_bytes, dp.param_bytes / 4), (zero3.param_bytes, dp.param_bytes)
    assert zero3.memory["argument"] < 0.3 * dp.memory["argument"]


def test_measured_bytes_match_the_paper_formulas(results):
    for key, r in results.items():
        f = r.formula()
        assert _within(r.param_bytes, f["params"]), key
        assert _within(r.grad_bytes, f["grads"]), key
        assert _within(r.opt_bytes, f["opt"]), key


@pytest.mark.parametrize("key", WITH_BASELINE)
def test_engine_has_the_collectives_of_a_hand_written_jit_step(results, key):
    r = results[key]

    def sig(summary):
        return {k: (s.count, s.bytes) for k, s in summary.items() if s.count}

    assert sig(r.engine) == sig(r.baseline)
    assert r.same_collectives
    assert r.same_layout


def test_report_renders_every_configuration(results):
    report = zero_memory.render(list(results.values()), zero_memory.SMALL, {"command": "`pytest`"})
    for config in CONFIGS.values():
        assert f"| {config.name} |" in report
    assert "Rajbhandari" in report

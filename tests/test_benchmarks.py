"""The benchmark's HLO collective counter, ZeRO's memory and communication on 8 devices, and
tensor parallel's per-block collective bytes.

Uses ``benchmarks/hlo.py`` and ``benchmarks/zero_memory.py`` at TinyLM's default size,
without timing, and ``benchmarks/tensor_parallel.py`` at its own configuration.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import tensor_parallel, zero_memory
from jfleet.testing import hlo

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
    report = zero_memory.render(list(results.values()), zero_memory.SMALL, ["- command: `pytest`"])
    for config in CONFIGS.values():
        assert f"| {config.name} |" in report
    assert "Rajbhandari" in report


# ------------------------------------------------------------------ tensor parallel, one block
TP_PROGRAMS = (tensor_parallel.FORWARD, tensor_parallel.VJP)


@pytest.fixture(scope="module")
def tp_rows() -> dict[tuple[str, str], tensor_parallel.Measurement]:
    """The benchmark's block at its own configuration: forward and forward + backward."""
    rows = tensor_parallel.run(tensor_parallel.Config(), TP_PROGRAMS)
    return {(m.layout, m.program): m for m in rows}


def _tp_expected(cfg: tensor_parallel.Config) -> dict[str, int]:
    """Megatron's bytes for the configuration, derived from its sizes (fp32)."""
    assert cfg.dtype == "float32"
    b, s, h, n = cfg.batch, cfg.seq, cfg.width, cfg.mp  # b: the batch per dp replica
    activation = b * s * h * 4  # one [b, s, h] activation of one mp group
    # per device: column qkv (h x 3h) and up (h x ffn h) kernels and biases split over mp,
    # row o (h x h) and down (ffn h x h) kernels split, their biases and the 2 norms whole
    f = cfg.ffn
    params = ((3 + 1 + 2 * f) * h * h + (3 + f) * h) // n + (2 + 4) * h
    return {
        "forward": 2 * activation,  # attention output, MLP output
        "forward + backward": 4 * activation,  # + the qkv and MLP-up input gradients
        "sp params": 6 * h * 4,  # norm1, norm2 scale + bias; o and down biases
        "param bytes": params * 4,
    }


def test_tensor_parallel_block_moves_megatrons_bytes(tp_rows):
    cfg = tensor_parallel.Config()
    want = _tp_expected(cfg)
    for program in TP_PROGRAMS:
        m = tp_rows[("TP", program)]
        assert m.bytes("all-reduce") == want[program], (program, m.mp)
        assert m.bytes("all-gather") == m.bytes("reduce-scatter") == 0, (program, m.mp)
        assert m.all_reduce_units == want[program] == cfg.megatron_bytes(program)
        assert not m.mp_small, m.mp_small
    fwd = tp_rows[("TP", tensor_parallel.FORWARD)]
    assert [c.kind for c in fwd.mp] == ["all-reduce", "all-reduce"], fwd.mp
    assert not fwd.other, fwd.other


def test_sequence_parallel_block_moves_the_same_volume_as_gathers_and_scatters(tp_rows):
    cfg = tensor_parallel.Config()
    want = _tp_expected(cfg)
    for program in TP_PROGRAMS:
        tp, sp = tp_rows[("TP", program)], tp_rows[("TP + SP", program)]
        # each all-reduce of B becomes an all-gather of B and a reduce-scatter of B
        assert sp.bytes("all-gather") == sp.bytes("reduce-scatter") == want[program], sp.mp
        assert sp.bytes("all-reduce") == 0 and sp.sliced_bytes == 0, sp.mp
        assert sp.all_reduce_units == tp.all_reduce_units == cfg.megatron_bytes(program)
        assert sp.wire_bytes == pytest.approx(tp.wire_bytes)
        assert sp.wire_bytes == pytest.approx(2 * (cfg.mp - 1) / cfg.mp * want[program])
    vjp = tp_rows[("TP + SP", tensor_parallel.VJP)]
    assert [c.kind for c in vjp.mp_small] == ["all-reduce"], vjp.mp_small
    assert vjp.small_bytes == want["sp params"]


def test_tensor_parallel_gradients_are_all_reduced_over_dp_only(tp_rows):
    want = _tp_expected(tensor_parallel.Config())
    dp_groups = [(0, 4), (1, 5), (2, 6), (3, 7)]
    for layout in tensor_parallel.LAYOUTS:
        m = tp_rows[(layout, tensor_parallel.VJP)]
        assert [(c.kind, list(c.groups)) for c in m.other] == [("all-reduce", dp_groups)]
        assert m.other_bytes == want["param bytes"]


def test_tensor_parallel_report_replaces_only_its_section(tp_rows, tmp_path):
    cfg = tensor_parallel.Config()
    section = tensor_parallel.report(cfg, list(tp_rows.values()), "pytest")
    assert section.startswith(tensor_parallel.BEGIN) and section.endswith(
        tensor_parallel.END + "\n"
    )
    row = "| TP + SP | forward + backward | 4 x all-gather: 4.000; 4 x reduce-scatter: 4.000 |"
    assert row in section
    assert "Korthikanti" in section and "b = 8 per data-parallel replica" in section
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "# ZeRO\n\nzero table\n\n<!-- pipeline_memory: begin -->\np\n"
        "<!-- pipeline_memory: end -->\n"
    )
    tensor_parallel.write(section, results)
    tensor_parallel.write(section.replace("Korthikanti", "K."), results)  # re-run: replaced
    text = results.read_text()
    assert text.startswith("# ZeRO\n\nzero table\n") and "<!-- pipeline_memory: end -->" in text
    assert text.count(tensor_parallel.BEGIN) == 1 and "Korthikanti" not in text


def test_checkpoint_bench_renders_its_table():
    """The checkpoint benchmark's table and findings, from made-up rows (nothing compiled)."""
    from benchmarks import checkpoint_bench as cb

    rows = [
        cb.Row(
            s, m, o, 1000, 12000 + i, 1.0 + 2 * (m is cb.PIPELINED), 0.5, 0.01, 0.02, 5, 0.3, 0.4
        )
        for i, s in enumerate(cb.SIZES)
        for m, o in cb.MOVES
    ]
    text = cb.render(rows, 3, "cmd")
    assert text.count("| example |") == 2 and "| 2.00 |" in text and "(dp8) |" in text
    assert "_unstack" in text  # the pipelined saves were 3x slower: the finding names why


def test_planner_ranking_reliability_is_one_for_steady_rounds_and_low_for_noise():
    from benchmarks import planner_ranking as pr

    def result(ratios):
        timed = [pr.Timed(candidate=None, ratios=list(r)) for r in ratios]
        return pr.SizeResult(size=None, timed=timed, chosen="", seconds=0.0)

    steady = [[1 + i / 10] * 4 for i in range(10)]  # every round ranks them alike
    np.testing.assert_allclose(result(steady).reliability(), (1.0, 1.0))
    rng = np.random.default_rng(0)
    noise = rng.uniform(0.9, 1.1, size=(40, 4))  # rounds disagree: no order to predict
    r, ceiling = result(noise).reliability()
    assert abs(r) < 0.4 and (ceiling != ceiling or ceiling < 0.8)


def test_published_fsdp_rows_parse_and_one_plans_as_run():
    """Issue 37's published FSDP table: every row is pinned and sourced, a third is held
    out, the published throughputs convert to the source's MFU, and one row plans, fits
    and is matched or beaten by jfleet's pick."""
    from benchmarks import published_fsdp as pf
    from jfleet.auto_parallel.search.model_shapes import MODEL_SHAPES

    assert len({r.name for r in pf.ROWS}) == len(pf.ROWS)
    assert 3 * sum(r.held_out for r in pf.ROWS) >= len(pf.ROWS)
    for row in pf.ROWS:
        assert row.source in pf.SOURCES and row.shape in MODEL_SHAPES and row.gpus % 8 == 0
        assert row.batch == row.micro * row.accumulate * row.data
        assert row.recompute in (False, True, "selective")
        if row.source_mfu is not None:  # the same model FLOPs as the source's MFU
            assert pf.published_mfu(row) * 100 == pytest.approx(row.source_mfu, rel=0.015)
    row = next(r for r in pf.ROWS if r.name == "mpt-13b-h100-8")
    result = pf.run_row(row)
    pub, pick = result["published"], result["pick"]
    assert pub.fits and pub.layout.degrees["sharding"] == 8 and pub.layout.zero_stage == 3
    assert 0.7 <= pf.mfu(row, pub.time.total) / pf.published_mfu(row) <= 1.3
    assert pick.time.total <= pub.time.total
    assert "| mpt-13b-h100-8 | 8 h100 | sharding8 (FSDP, O1) | 2 x 1 x 8 = 16, 2048 |" in (
        pf.table([result])
    )

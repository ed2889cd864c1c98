"""Planning at scale without the devices (issue 26): the offline plan, its CLI, and the
memory / time terms the GPU profiles add (ZeRO-divided gradients, masters, accumulation,
fused attention, overlap, no CPU-fitted loop traffic)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from jfleet.auto_parallel.cost.cost_model import estimate
from jfleet.auto_parallel.cost.layout import Layout, Workload
from jfleet.auto_parallel.cost.profiles import get_profile
from jfleet.auto_parallel.match.attention_trace import (
    scores_materialised,
    without_attention_products,
)
from jfleet.auto_parallel.match.patterns import match_patterns
from jfleet.auto_parallel.search.cluster_plan import Cluster, main, plan
from jfleet.auto_parallel.search.layouts import enumerate_layouts
from jfleet.auto_parallel.search.model_shapes import MODEL_SHAPES, ModelShape, abstract_model
from jfleet.auto_parallel.search.plan import Plan
from jfleet.auto_parallel.search.planner import prune_dominated
from jfleet.models.llama import TinyLlama

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SMALL = ModelShape(
    arch="llama", layers=4, width=256, heads=8, kv_heads=4, ffn=512, vocab=1024, seq_len=512
)


@pytest.fixture(scope="module")
def found():
    return match_patterns(abstract_model(SMALL))


def _est(found, layout, profile="h100", batch=64, dtype="bfloat16", scan_layers=True, **kw):
    work = Workload(batch_size=batch, seq_len=SMALL.seq_len, dtype=dtype, **kw)
    return estimate(found, work, layout, profile, devices_per_node=8, scan_layers=scan_layers)


def test_offline_plan_needs_no_devices_and_plans_the_cluster():
    p = plan(abstract_model(SMALL), (64, 512), Cluster(nodes=16, profile="h100"))
    assert (p.device_num, p.node_num, p.dtype) == (8, 16, "bfloat16")
    assert p.chosen.fits and p.layout.size == 128
    assert p.layout.mp <= 8  # tensor parallel stays inside a node
    again = Plan.from_json(p.to_json())  # accumulation and the GPU profile's fields kept
    assert again.layout == p.layout and again.profile == p.profile


def test_cli_plans_a_given_shape(capsys):
    argv = ["--arch", "llama", "--layers", "4", "--width", "256", "--heads", "8",
            "--ffn", "512", "--vocab", "1024", "--seq", "256", "--batch", "32",
            "--nodes", "2", "--profile", "a100"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "jfleet plan:" in out and "on 16 devices (2 node(s) x 8), profile a100" in out
    assert "\nmodel: Llama: width 256," in out  # not the zoo's TinyLlama


def test_cli_and_cluster_errors_name_the_value():
    with pytest.raises(SystemExit):
        main(["--arch", "llama", "--layers", "4"])  # the other sizes missing
    with pytest.raises(ValueError, match="nodes=0"):
        Cluster(nodes=0)
    with pytest.raises(ValueError, match="batch="):
        plan(abstract_model(SMALL), (64,), Cluster())
    with pytest.raises(ValueError, match="profile='tpu9'"):
        Cluster(profile="tpu9")


def test_named_shapes_have_their_published_sizes():
    published = {"llama2-70b": 69.0, "megatron-18.4b": 18.4, "megatron-1008b": 1008.0,
                 "megatron-145.6b": 145.6, "gpt3-175b": 175.0, "llama3-405b": 405.0}  # fmt: skip
    for name, billions in published.items():
        assert MODEL_SHAPES[name].params / 1e9 == pytest.approx(billions, rel=0.01), name


def test_zero3_divides_gradients_on_gpus_and_in_scanned_blocks(found):
    """Scanned blocks reduce-scatter each block's gradient in the loop under every
    profile (FSDP, one program); unrolled, XLA:CPU keeps the whole local gradient (measured)
    and the GPU profiles count the shard."""
    z1 = Layout(sharding=8, zero_stage=1)
    z3 = Layout(sharding=8, zero_stage=3)
    for profile in ("h100", "cpu"):
        one, three = _est(found, z1, profile).memory, _est(found, z3, profile).memory
        assert three.grads < one.grads / 2 and three.grad_copies == 1, profile
    gpu1, gpu3 = (_est(found, z, scan_layers=False).memory for z in (z1, z3))
    assert gpu3.grads < gpu1.grads / 2 and gpu3.grad_copies == 1
    cpu1, cpu3 = (_est(found, z, "cpu", scan_layers=False).memory for z in (z1, z3))
    assert cpu3.grads == cpu1.grads and cpu3.grad_copies == 2  # measured on XLA:CPU


def test_half_precision_parameters_carry_fp32_masters_and_moments():
    fp32 = match_patterns(TinyLlama(vocab=64, width=32, heads=4, layers=2))
    params = tuple(dataclasses.replace(p, dtype="bfloat16") for p in fp32.params)
    half = dataclasses.replace(fp32, params=params)  # as after AMP O2's cast
    work = Workload(batch_size=8, seq_len=8, dtype="bfloat16")
    a = estimate(fp32, work, Layout(dp=8), "h100", devices_per_node=8).memory
    b = estimate(half, work, Layout(dp=8), "h100", devices_per_node=8).memory
    assert b.params * 2 == a.params  # bf16 weights
    # Adam's two fp32 moments and an fp32 master: 12 bytes an element (+ the step count)
    assert b.optimizer - 4 == 12 * (b.params // 2)


def test_accumulation_keeps_one_micro_batch_of_activations(found):
    one = _est(found, Layout(dp=8))
    four = _est(found, Layout(dp=8, accumulate_steps=4))
    assert four.memory.activations < one.memory.activations / 2
    assert four.flops == one.flops  # the same work
    # the engine's gradient merge reduces every call's gradients
    assert four.collectives.all_reduce == 4 * one.collectives.all_reduce
    assert four.memory.optimizer > one.memory.optimizer  # the accumulator


def test_wide_search_offers_accumulation_every_m_and_v(found):
    work = Workload(batch_size=64, seq_len=512)
    narrow, _ = enumerate_layouts(found, work, device_num=8)
    wide, _ = enumerate_layouts(found, work, device_num=8, wide=True)
    assert {lay.accumulate_steps for lay in narrow} == {1}
    assert {lay.accumulate_steps for lay in wide if lay.mesh_name == "dp8"} == {1, 2, 4, 8}
    ms = {lay.num_microbatches for lay in wide if lay.mesh_name == "pp2 x mp4"}
    assert ms == {2, 4, 8, 16, 32, 64}
    assert len(prune_dominated([_est(found, lay) for lay in wide])) < len(wide)


def test_fused_attention_keeps_no_scores_but_counts_their_flops(found):
    fused = without_attention_products(found)
    assert scores_materialised(found) and not scores_materialised(fused)
    a, b = _est(found, Layout(dp=8)), _est(fused, Layout(dp=8))
    assert b.memory.activations < a.memory.activations
    assert b.flops == pytest.approx(a.flops, rel=0.02)


def test_gpu_time_overlaps_the_reduction_and_skips_cpu_loop_traffic(found):
    h100 = get_profile("h100")
    bare = dataclasses.replace(h100, comm_overlap=0.0)
    lay = Layout(dp=8)
    assert _est(found, lay, h100).time.data_parallel < _est(found, lay, bare).time.data_parallel
    piped = Layout(pp=2, dp=4, schedule="1F1B", num_microbatches=4)
    assert _est(found, piped, h100).time.memory_traffic == 0.0
    assert _est(found, piped, "cpu").time.memory_traffic > 0.0


def test_profiles_have_fp8_and_both_a100s():
    assert get_profile("h100").flops("float8_e4m3fn") == pytest.approx(2 * 989.4e12, rel=1e-3)
    assert get_profile("a100-40gb").memory_bytes * 2 == get_profile("a100-80gb").memory_bytes
    assert get_profile("h200").usable_memory < get_profile("h200").memory_bytes
    assert get_profile("cpu").usable_memory == get_profile("cpu").memory_bytes


def test_published_configs_row_fits_and_predicts_mfu():
    from benchmarks import published_configs as pc

    row = next(r for r in pc.ROWS if r.name == "1.7B")
    result = pc.run_row(row)
    want = pc.published_mfu(result["shape"], row.tflops)
    got = pc.model_flops(result["shape"], row.batch) / (
        result["published"].time.total * row.gpus * pc.PEAK
    )
    assert result["published"].fits and 0.7 <= got / want <= 1.3
    assert result["pick"].time.total <= result["published"].time.total


def test_gpu_mfu_runs_at_tiny_size(capsys):
    from benchmarks import gpu_mfu

    assert gpu_mfu.main(["--tiny", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert '"plan_dtype": "bfloat16"' in out and '"measured_s"' in out


@pytest.mark.parametrize(
    ("field", "value"), [("comm_overlap", 1.5), ("memory_margin", 1.0), ("matmul_efficiency", 0.0)]
)
def test_profile_fractions_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(get_profile("h100"), **{field: value})


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_abstract_model_has_the_structure_of_a_full_build(arch):
    from flax import nnx

    from jfleet.auto_parallel.search.model_shapes import _build

    shape = dataclasses.replace(SMALL, arch=arch, layers=3)
    fast, full = abstract_model(shape), nnx.eval_shape(lambda: _build(shape))

    def params(m):
        return {k: (v.shape, v.dtype) for k, v in nnx.to_flat_state(nnx.state(m, nnx.Param))}

    assert params(fast) == params(full)

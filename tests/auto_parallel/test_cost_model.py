"""The cost model: against the compiler, against the ZeRO paper, its formulas and ranking."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cost_model_check
from jfleet.auto_parallel import (
    HardwareProfile,
    Layout,
    Workload,
    estimate,
    get_profile,
    match_patterns,
)
from jfleet.auto_parallel.cost.cost_model import rank
from jfleet.auto_parallel.cost.step_work import step_flops
from jfleet.auto_parallel.search.layouts import enumerate_layouts
from jfleet.models.llama import TinyLlama
from jfleet.testing.nnx_styles import STYLES

#: The check's model at 2 layers and batch 8 (one block a pipeline stage at pp 2).
SMALL = cost_model_check.Workload(layers=2, batch=8)

#: Tensor parallel, ZeRO-2 over dp x sharding, ZeRO-3 with tensor parallel, and a pipeline
#: with tensor parallel (the benchmark checks more, at full size).
CHECKED = (
    ({"dp": 2, "mp": 4}, 0, None),
    ({"dp": 2, "sharding": 4}, 2, None),
    ({"sharding": 4, "mp": 2}, 3, None),
    ({"dp": 2, "pp": 2, "mp": 2}, 0, 2),
)


@pytest.mark.parametrize(
    ("degrees", "stage", "microbatches"),
    CHECKED,
    ids=[cost_model_check.layout_id(*layout) for layout in CHECKED],
)
def test_predictions_match_the_compiled_step(degrees, stage, microbatches):
    """to_distributed + the engine's compiled step: memory within 25%, bytes within 15%,
    dot FLOPs (while bodies weighted by their trip counts) within 10%."""
    row = cost_model_check.check(
        SMALL,
        degrees,
        stage,
        microbatches,
        schedule="FThenB" if microbatches else None,
        compiler_options=cost_model_check.FAST_COMPILE,
    )
    assert 0.75 <= row.memory_ratio <= 1.25, row
    assert 0.85 <= row.bytes_ratio <= 1.15, row
    assert 0.98 <= row.flops_ratio <= 1.02, row  # measured: 1.000 (the limit is 10%)


def test_sequence_parallel_collectives_match_the_compiled_step():
    """mp + SP with recompute: the blocks' projections run Megatron's program
    (``apply.sequence_dots``), whose reduce-scatters and all-gathers the cost model counts
    (before it, GSPMD all-gathered the blocks' weights: measured 0.77 here)."""
    row = cost_model_check.check(
        SMALL, {"dp": 2, "mp": 4}, 0, recompute=True, sequence_parallel=True,
        compiler_options=cost_model_check.FAST_COMPILE,
    )  # fmt: skip
    assert 0.75 <= row.memory_ratio <= 1.25, row
    assert 0.85 <= row.bytes_ratio <= 1.15, row


def test_o2_distributed_optimizer_matches_the_compiled_step():
    """AMP O2 with Megatron's distributed optimizer (bf16 parameters; fp32 masters and
    moments split over dp x sharding). XLA:CPU runs its bf16 dots and collectives in fp32
    (``HardwareProfile.half_precision_fp32``): counted at 2 bytes the collective bytes
    come out at 0.50 of the compiled step's, and the memory at 0.68 (measured). The
    resident state is what a GPU keeps too: the ``h100`` profile predicts the compiled
    arguments to 1%."""
    row = cost_model_check.check(
        SMALL, {"dp": 2, "sharding": 4}, 1, recompute=True, o2=True,
        compiler_options=cost_model_check.FAST_COMPILE,
    )  # fmt: skip
    assert "over dp x sharding" in row.name, row.name  # the distributed optimizer
    assert 0.75 <= row.memory_ratio <= 1.25, row
    assert 0.85 <= row.bytes_ratio <= 1.15, row
    assert abs(row.h100_resident / row.measured_argument - 1) < 0.01, row


@pytest.mark.parametrize(
    ("degrees", "stage"), [({"dp": 2, "mp": 4}, 0), ({"dp": 2, "sharding": 4}, 2)]
)
def test_gradient_accumulation_matches_the_engines_gradient_merge(degrees, stage):
    """Layout(accumulate_steps=2) against one call of the strategy's gradient merge: the
    accumulator is optimizer state, one call's activations and batch, every call reduces."""
    workload = dataclasses.replace(SMALL, batch=16)  # 8 rows a call
    memory, nbytes = cost_model_check.check_accumulation(workload, degrees, stage, 2)
    assert 0.75 <= memory <= 1.25 and 0.85 <= nbytes <= 1.15, (memory, nbytes)


@pytest.mark.parametrize("seq", [64, 256])
def test_selective_recompute_matches_the_compiled_step(seq):
    """Scanned blocks keeping their weight-matmul outputs (dp2 x mp4): memory within 25%
    (measured 1.13 at 64 tokens, 1.07 at 256, where the s x s scores it recomputes
    dominate), collective bytes within 15%, dot FLOPs (the attention cores twice)
    within 10%."""
    workload = dataclasses.replace(SMALL, seq=seq)
    row = cost_model_check.check(
        workload,
        {"dp": 2, "mp": 4},
        0,
        recompute="selective",
        compiler_options=cost_model_check.FAST_COMPILE,
    )
    assert "selective recompute" in row.name
    assert 0.75 <= row.memory_ratio <= 1.25, row
    assert 0.85 <= row.bytes_ratio <= 1.15, row
    assert 0.9 <= row.flops_ratio <= 1.1, row


@pytest.mark.parametrize(
    ("degrees", "schedule", "recompute", "layers"),
    [
        ({"dp": 4, "pp": 2}, "FThenB", "selective", 2),
        ({"dp": 2, "pp": 2, "mp": 2}, "1F1B", "selective", 2),
        ({"dp": 4, "pp": 2}, "VPP", "selective", 4),
        ({"dp": 4, "pp": 2}, "FThenB", True, 2),
    ],
)
def test_pipelined_recompute_matches_the_compiled_step(degrees, schedule, recompute, layers):
    """Selective recompute in a pipeline (each stage stashing its blocks' weight-matmul
    outputs per micro-batch; 1F1B runs FThenB's program, VPP the same per chunk) and FThenB
    with recompute (1F1B's recomputing program), 256 tokens: memory within 25%, collective
    bytes within 15%, dot FLOPs (the stage's attention cores, or its whole forward, once
    more) within 10%."""
    workload = dataclasses.replace(SMALL, seq=256, layers=layers)
    row = cost_model_check.check(
        workload,
        degrees,
        0,
        2,
        schedule=schedule,
        recompute=recompute,
        compiler_options=cost_model_check.FAST_COMPILE,
    )
    assert ("selective recompute" in row.name) == (recompute == "selective"), row.name
    assert 0.75 <= row.memory_ratio <= 1.25, row
    assert 0.85 <= row.bytes_ratio <= 1.15, row
    assert 0.9 <= row.flops_ratio <= 1.1, row


@pytest.mark.parametrize(
    ("schedule", "workload", "name"),
    [
        ("1F1B", SMALL, "1F1B M=2"),
        ("VPP", cost_model_check.Workload(layers=4, batch=8), "VPP v=2 M=2"),
    ],
)
def test_the_recomputing_stand_ins_match_the_compiled_step(schedule, workload, name):
    """to_distributed's 1F1B stand-in (stage inputs stashed, the stage recomputed in its
    own backward loop, bubbles skipped, rows split over pp) and its VPP (2 chunks of one
    block a stage, chunk inputs stashed, v M + P - 1 ticks a loop; measured 0.85, 1.07,
    1.05): memory within 25%, collective bytes within 15%, executed dot FLOPs (the slowest
    stage's, conditionals weighted by the ticks that take them) within 10%. FThenB is
    ``CHECKED``'s dp2 x pp2 x mp2 row."""
    row = cost_model_check.check(
        workload,
        {"dp": 2, "pp": 2, "mp": 2},
        0,
        2,
        schedule=schedule,
        compiler_options=cost_model_check.FAST_COMPILE,
    )
    assert name in row.name
    assert 0.75 <= row.memory_ratio <= 1.25, row
    assert 0.85 <= row.bytes_ratio <= 1.15, row
    assert 0.9 <= row.flops_ratio <= 1.1, row


def test_interleaved_stages_shrink_the_bubble_for_more_transfers():
    """VPP against 1F1B at P=4, M=4: bubble (P-1)/(vM) of the blocks' compute instead of
    (P-1)/M, the same executed FLOPs, 2(vM+P-1) permutes instead of 2(M+P-1), v M chunk
    inputs stashed (one chunk's working set)."""
    found = _llama(layers=8)
    work = Workload(batch_size=32, seq_len=64)
    one = _est(found, Layout(pp=4, dp=2, schedule="1F1B", num_microbatches=4), work, "h100")
    vpp = Layout(pp=4, dp=2, schedule="VPP", num_microbatches=4, num_virtual_stages=2)
    two = _est(found, vpp, work, "h100")
    assert two.time.bubble == pytest.approx(one.time.bubble / 2)
    assert two.time.compute == pytest.approx(one.time.compute)
    assert two.flops == pytest.approx(one.flops)
    act = 32 // 2 // 4 * 64 * 128 * 4  # one micro-batch's b s h bytes
    assert one.collectives.collective_permute == 2 * (4 + 4 - 1) * act
    assert two.collectives.collective_permute == 2 * (2 * 4 + 4 - 1) * act
    per_token = (2 * 4 * 128 + 4 * 128 + 2 * 8 * 64 + 5 * 256) * 4  # one block's internals
    tokens = 32 // 2 * 64
    stash = tokens * 128 * 4  # the local batch's b s h bytes: 1F1B stashes it once
    mb = tokens // 4  # a micro-batch's tokens; a working set: 2 + 1 blocks, one block 1.3
    work_set = {1: (2 + 1) * mb * per_token, 2: 1.3 * mb * per_token}
    assert two.memory.activations - one.memory.activations == pytest.approx(
        stash - (work_set[1] - work_set[2]), rel=1e-6
    )
    assert _est(found, vpp, work).time.bubble == 0  # shared CPU cores: no bubble anyway


def test_a_budget_below_fthenb_picks_vpp_over_1f1b_and_says_why():
    """On an accelerator at P=4, M=4 interleaving saves more bubble than its transfers
    cost: under a budget FThenB does not fit, the planner takes VPP, not 1F1B, and its
    plan holds each device's interleaved blocks."""
    from jfleet.auto_parallel.search.planner import plan_for

    model = nnx.eval_shape(
        lambda: TinyLlama(vocab=512, width=1024, heads=8, kv_heads=4, layers=8, hidden=4096)
    )
    kw = {"device_num": 8, "batch_size": 16, "seq_len": 512, "profile": "h100"}
    kw |= {"force_mesh": {"dp": 2, "pp": 4}, "num_microbatches": 4, "zero_stage": 0}
    roomy = plan_for(model, **kw)
    by_name = {c.layout.name: c for c in roomy.candidates}
    vpp, one = by_name["dp2 x pp4 (VPP v=2 M=4)"], by_name["dp2 x pp4 (1F1B M=4)"]
    fthenb = by_name["dp2 x pp4 (FThenB M=4)"]
    assert vpp.time.total < one.time.total and vpp.memory.total < fthenb.memory.total
    tight = plan_for(model, memory_budget=(vpp.memory.total + fthenb.memory.total) / 2, **kw)
    assert tight.layout.name == "dp2 x pp4 (VPP v=2 M=4)"
    assert tight.stages == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert {p.stage for p in tight.params if p.path.startswith("layers.5.")} == {1}
    lost = {c.layout.name: c.reason for c in tight.candidates}
    assert lost["dp2 x pp4 (1F1B M=4)"].endswith("slower than the best: more pipeline bubble time")
    assert lost["dp2 x pp4 (FThenB M=4)"].startswith("does not fit")


def test_a_memory_budget_between_the_schedules_picks_1f1b():
    """Given a pipeline, the planner picks FThenB where it is faster and fits (on an
    accelerator, where the recomputed forward costs more than FThenB's stash traffic; on
    the emulated CPU devices 1F1B is measured faster), and 1F1B when the budget lies
    between the two schedules' predicted memory."""
    from jfleet.auto_parallel.search.planner import plan_for

    model = nnx.eval_shape(
        lambda: TinyLlama(vocab=512, width=1024, heads=8, kv_heads=4, layers=4, hidden=4096)
    )  # abstract: large enough that compute, not loop traffic, sets an H100's step time
    kw = {"device_num": 8, "batch_size": 16, "seq_len": 512, "recompute": False}
    kw |= {"profile": "h100"}
    kw |= {"force_mesh": {"dp": 4, "pp": 2}, "num_microbatches": 2, "zero_stage": 0}
    kw |= {"num_virtual_stages": 1}  # one chunk a stage (VPP: the test after this one)
    roomy = plan_for(model, **kw)
    by_schedule = {c.layout.schedule: c for c in roomy.candidates}
    fthenb, one_f = by_schedule["FThenB"].memory.total, by_schedule["1F1B"].memory.total
    assert one_f < fthenb
    assert roomy.schedule == "FThenB"  # faster here: no recomputed forward
    assert by_schedule["FThenB"].time.total < by_schedule["1F1B"].time.total
    tight = plan_for(model, memory_budget=(one_f + fthenb) / 2, **kw)
    assert tight.schedule == "1F1B"
    assert plan_for(model, memory_budget=fthenb * 1.01, **kw).schedule == "FThenB"


#: NNX-zoo styles checked at dp2 x mp4 (the benchmark checks every style, more layouts).
STYLES_CHECKED = ("linear_general", "einsum_gemma", "gqa_qknorm")

#: Ratios a style misses at dp2 x mp4 (batch 8 x 16), not asserted until the cost model
#: covers them (benchmarks/RESULTS.md, section cost_model_check, says why):
#: einsum_gemma's collective bytes 0.69 and gqa_qknorm's 0.79 (2 kv heads stay whole at
#: mp 4; XLA partitions part of their projection over mp and all-gathers it, unpredicted),
#: gqa_qknorm's memory 1.71 (activations predicted about twice the compiled temporaries);
#: einsum_gemma's memory 1.30 with its blocks scanned (to_distributed's default at pp 1;
#: 1.21 unrolled): the cost model counts an unrolled step's activations.
MISSES = {"einsum_gemma": {"bytes", "memory"}, "gqa_qknorm": {"memory", "bytes"}}


@pytest.mark.parametrize("name", STYLES_CHECKED)
def test_predictions_match_the_compiled_step_on_nnx_styles(name):
    """Models written in public NNX styles at dp2 x mp4: FLOPs within 10%, memory within
    25% and collective bytes within 15%, except the misses listed in :data:`MISSES`."""
    row = cost_model_check.check(
        STYLES[name], {"dp": 2, "mp": 4}, 0, compiler_options=cost_model_check.FAST_COMPILE
    )
    # Scanned blocks (to_distributed's default at pp 1): where 2 kv heads stay whole, XLA
    # partitions more of their projections over mp inside the scan than unrolled, 4-5%
    # fewer dot FLOPs than predicted (einsum_gemma 1.051, gqa_qknorm 1.045; unrolled 1.000).
    high = 1.06 if name in ("einsum_gemma", "gqa_qknorm") else 1.02
    assert 0.98 <= row.flops_ratio <= high, row  # the limit is 10%
    if "memory" not in MISSES.get(name, ()):
        assert 0.75 <= row.memory_ratio <= 1.25, row
    if "bytes" not in MISSES.get(name, ()):
        assert 0.85 <= row.bytes_ratio <= 1.15, row


def test_pipelined_super_blocks_memory_matches_the_compiled_step():
    """Gemma's local / global blocks pipeline as super-blocks of 2 (dp2 x pp2 x mp2, one
    unit a stage, run unrolled inside): memory within 25% of the compiled step. Counting
    the stage's 2 blocks as a loop over blocks (residual stack + slice) predicted 1.27."""
    row = cost_model_check.check(
        STYLES["gemma_alternating"],
        {"dp": 2, "pp": 2, "mp": 2},
        0,
        2,
        schedule="FThenB",
        compiler_options=cost_model_check.FAST_COMPILE,
    )
    assert 0.75 <= row.memory_ratio <= 1.25, row
    assert 0.98 <= row.flops_ratio <= 1.02, row


def _llama(**kw):
    args = {"vocab": 512, "width": 128, "heads": 8, "kv_heads": 4, "layers": 4, "hidden": 256}
    return match_patterns(nnx.eval_shape(lambda: TinyLlama(**(args | kw))))


def _est(found, layout, work=None, profile="cpu", per_node=8, scan_layers=True):
    work = work or Workload(batch_size=16, seq_len=64)
    return estimate(
        found, work, layout, get_profile(profile), devices_per_node=per_node,
        scan_layers=scan_layers,
    )  # fmt: skip


def test_zero_stages_divide_state_as_the_paper_says():
    found = _llama()
    phi = sum(p.nbytes for p in found.params)  # fp32 bytes
    blocks = sum(p.nbytes for p in found.params if p.block is not None)
    one_block, outside = blocks // len(found.blocks), phi - blocks
    dp = _est(found, Layout(dp=8)).memory
    z = {s: _est(found, Layout(sharding=8, zero_stage=s)).memory for s in (1, 2, 3)}
    assert dp.params == phi and dp.optimizer == 2 * phi + 4 and dp.grads == phi
    assert z[1].params == phi and z[1].optimizer == 2 * phi // 8 + 4
    # scanned blocks (to_distributed's default) run ZeRO-2 / 3 per block (FSDP): one
    # block gathered at a time (the embedding and head where they run), each block's
    # gradient reduce-scattered in the loop
    assert z[3].params == phi // 8 and z[3].gathered == max(outside, one_block)
    assert z[3].grads == outside // 8 + blocks // 8 + one_block and z[3].grad_copies == 1
    assert z[2].grads == outside + blocks // 8 + one_block and z[2].params == phi
    # unrolled, XLA:CPU gathers every parameter for the step and keeps the whole local
    # gradient before reducing it: ZeRO-2 compiles to ZeRO-1's step
    unrolled = {
        s: _est(found, Layout(sharding=8, zero_stage=s), scan_layers=False).memory
        for s in (1, 2, 3)
    }
    assert unrolled[3].gathered == phi and unrolled[2] == unrolled[1]
    assert _est(found, Layout(sharding=8, zero_stage=1)).collectives.total == 2 * phi


def test_sequence_parallel_recompute_keeps_each_block_input_split_over_mp():
    """Full recompute keeps each block's input for the backward pass; under tensor +
    sequence parallelism the stack carries it split over ``mp`` (measured on the compiled
    step: TinyLlama width 256, dp2 x mp4, 4 -> 12 scanned blocks, 131,072 B a block with SP,
    524,288 B without): an added block costs 1/4 of its whole input with SP."""
    layout = Layout(dp=2, mp=4, recompute=True)
    growth = {}
    for sp in (False, True):
        work = Workload(batch_size=16, seq_len=64, sequence_parallel=sp)
        acts = [_est(_llama(layers=n), layout, work).memory.activations for n in (4, 8)]
        growth[sp] = acts[1] - acts[0]
    one_input = 4 * (16 // 2 * 64) * 128  # fp32 b s h of one block, per device
    assert growth[False] - growth[True] == 4 * one_input * 3 // 4, growth


def test_tensor_parallel_collectives_count_each_column_projection():
    found = _llama()
    c = _est(found, Layout(dp=2, mp=4)).collectives
    act = 16 // 2 * 64 * 128 * 4  # b s h bytes per device
    per_layer = (2 + 3 + 2) * act  # fwd: o, down; bwd: q, k, v and gate, up
    outside = 2 * act + 2 * (16 // 2 * 64 * 4)  # embedding fwd, head bwd, 2 softmax stats
    grads = sum(p.nbytes for p in found.params) // 4  # every parameter here is split 4 ways
    norm_bytes = sum(p.nbytes for p in found.params if p.role == "norm")
    assert c.all_reduce == 4 * per_layer + outside + grads + norm_bytes * 3 // 4


def test_pipeline_schedules_bubble_and_transfers():
    found = _llama()
    work = Workload(batch_size=32, seq_len=64)
    g = {
        m: _est(found, Layout(pp=4, dp=2, schedule="FThenB", num_microbatches=m), work)
        for m in (4, 16)
    }
    f = {
        m: _est(found, Layout(pp=4, dp=2, schedule="1F1B", num_microbatches=m), work)
        for m in (4, 16)
    }
    # bubble = the blocks' compute x (P-1)/M, the blocks' compute the same at every M
    assert g[16].time.bubble == pytest.approx(g[4].time.bubble * 4 / 16)
    assert g[4].time.bubble < g[4].time.compute
    act = 32 // 2 // 4 * 64 * 128 * 4  # one micro-batch's b s h bytes at M=4
    # both stand-in schedules: a forward and a backward loop of M + P - 1 ticks
    assert g[4].collectives.collective_permute == 2 * (4 + 4 - 1) * act
    assert f[4].collectives.collective_permute == g[4].collectives.collective_permute
    # FThenB keeps every micro-batch's residuals, 1F1B only their stage inputs plus one
    # micro-batch's internals: less, and falling with M (the working set is one
    # micro-batch's); 1F1B recomputes the stage forward: one more forward of the blocks
    assert f[16].memory.activations < f[4].memory.activations < g[4].memory.activations
    assert f[16].memory.activations < g[16].memory.activations
    per_token = (2 * 4 * 128 + 4 * 128 + 2 * 8 * 64 + 5 * 256) * 4  # norms, attn, SwiGLU
    tokens = 32 // 2 * 64
    one = {m: (tokens // m) * per_token for m in (4, 16)}  # one block a stage
    drop = f[4].memory.activations - f[16].memory.activations
    assert drop == pytest.approx(1.3 * (one[4] - one[16]), rel=1e-6)
    fwd_blocks, _, _ = step_flops(found, work, f[4].layout)
    assert f[4].flops - g[4].flops == pytest.approx(fwd_blocks / 4, rel=1e-9)


def test_links_across_nodes_are_slower():
    found = _llama()
    h100 = dataclasses.replace(get_profile("h100"), collective_latency=0.0, comm_overlap=0.0)
    inside = _est(found, Layout(dp=8), profile=h100, per_node=8).time.data_parallel
    across = _est(found, Layout(dp=8), profile=h100, per_node=4).time.data_parallel
    # dp8 over two nodes of 4: each node's 4 members run a ring channel through their own NIC
    assert across / inside == pytest.approx(
        h100.intra_node_bandwidth / (4 * h100.inter_node_bandwidth)
    )
    # dp2 beside mp4 in each node of 4: one member a node, one NIC's bandwidth
    dp2 = _est(found, Layout(dp=2, mp=4), profile=h100, per_node=4).time.data_parallel
    dp2_inside = _est(found, Layout(dp=2, mp=4), profile=h100, per_node=8).time.data_parallel
    assert dp2 / dp2_inside == pytest.approx(h100.intra_node_bandwidth / h100.inter_node_bandwidth)
    # dp outermost, mp innermost: with 4 devices a node, mp4's group stays inside one
    mp = _est(found, Layout(dp=2, mp=4), profile=h100, per_node=4).time
    mp_inside = _est(found, Layout(dp=2, mp=4), profile=h100, per_node=8).time
    assert mp.tensor_parallel == pytest.approx(mp_inside.tensor_parallel)
    assert mp.data_parallel > mp_inside.data_parallel


def test_rank_gives_every_loser_a_reason():
    found = _llama()
    layouts, _ = enumerate_layouts(found, Workload(batch_size=16, seq_len=64), device_num=8)
    cands = [_est(found, lay) for lay in layouts]
    budget = sorted(c.memory.total for c in cands)[len(cands) // 2]
    ranked = rank(cands, budget)
    assert ranked[0].reason == "best" and ranked[0].fits
    fitting = [c for c in ranked if c.fits]
    assert [c.time.total for c in fitting] == sorted(c.time.total for c in fitting)
    for c in ranked[1:]:
        assert c.reason.startswith(("does not fit: ", "as fast as the best")) or (
            "slower than the best: more " in c.reason
        ), c.reason
    assert all(not c.fits for c in ranked[len(fitting) :])


def test_profiles():
    assert get_profile() is get_profile("cpu")
    assert get_profile("H200").memory_bytes == 141 * 10**9
    assert get_profile("a100").flops("bfloat16") == 312e12
    assert get_profile("h100").flops("int8") == get_profile("h100").flops("float32")
    with pytest.raises(ValueError, match=r"profile='tpu' is not a known profile"):
        get_profile("tpu")
    with pytest.raises(ValueError, match=r"'intra_node_bandwidth': 0"):
        HardwareProfile(
            name="x",
            peak_flops={"float32": 1.0},
            memory_bytes=1,
            intra_node_bandwidth=0,
            inter_node_bandwidth=1,
        )
    with pytest.raises(ValueError, match="peak_flops is empty"):
        HardwareProfile(
            name="x", peak_flops={}, memory_bytes=1, intra_node_bandwidth=1, inter_node_bandwidth=1
        )

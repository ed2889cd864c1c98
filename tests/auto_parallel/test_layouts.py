"""Layouts: the enumeration, each shape rule with its reason, and the layout's own checks."""

from __future__ import annotations

import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel import Layout, Workload, enumerate_layouts, match_patterns
from jfleet.auto_parallel.cost.layout import SCHEDULES, mesh_name
from jfleet.auto_parallel.search.layouts import shape_problem
from jfleet.mesh.topology import AXIS_NAMES
from jfleet.models.llama import TinyLlama
from tests.auto_parallel.conv_net import ConvNet

WORK = Workload(batch_size=16, seq_len=64)
#: mp=8 cuts the 4 query heads: the reason names the parameter, its shape, and the fix
#: (k / v would stay whole: only q and o, 2 per block x 4 blocks, are counted).
HEADS_REASON = (
    "mp=8 does not divide the 4 heads of layers.0.self_attn.q_proj.kernel [128x128] "
    "(role q, split on dim 1) (and 7 more parameter(s) alike); use mp in (1, 2, 4), or sizes "
    "that 8 divides"
)


def _llama(**kw):
    args = {"vocab": 512, "width": 128, "heads": 8, "kv_heads": 4, "layers": 4, "hidden": 256}
    return match_patterns(nnx.eval_shape(lambda: TinyLlama(**(args | kw))))


def test_enumeration_respects_the_shapes():
    found = _llama(heads=4, kv_heads=2)
    layouts, excluded = enumerate_layouts(found, WORK, device_num=8)
    meshes = {lay.mesh_name for lay in layouts}
    assert "mp8" not in meshes and "pp8" not in meshes
    assert dict(excluded) == {
        "mp8": HEADS_REASON,
        "pp8": "pp=8 is more than the 4 blocks (every pipeline stage needs one); use pp <= 4",
    }
    assert all(lay.size == 8 and lay.sep == 1 for lay in layouts)
    assert {lay.zero_stage for lay in layouts if lay.sharding > 1} == {1, 2, 3}
    assert {lay.schedule for lay in layouts if lay.pp > 1} == {"FThenB", "1F1B", "VPP"}
    # VPP: M a multiple of pp and a block in each of the pp x 2 chunks (pp 2 only)
    vpp = [lay for lay in layouts if lay.schedule == "VPP"]
    assert vpp and all(lay.pp == 2 and lay.num_virtual_stages == 2 for lay in vpp)
    assert all(lay.num_microbatches % 2 == 0 and not lay.recompute for lay in vpp)
    assert all(lay.num_virtual_stages == 1 for lay in layouts if lay.schedule != "VPP")
    forced, why = enumerate_layouts(
        found, WORK, device_num=8, force_mesh={"dp": 2, "pp": 4}, schedule="VPP"
    )
    assert forced == [] and "each of the pp x 2 virtual stages (4 blocks)" in dict(why)["dp2 x pp4"]
    two_nodes, _ = enumerate_layouts(found, WORK, device_num=2, node_num=4)
    assert max(lay.mp for lay in two_nodes) == 2


def test_every_mesh_is_either_enumerated_or_excluded_with_a_reason():
    found = _llama()
    layouts, excluded = enumerate_layouts(found, WORK, device_num=8)
    # the 4 axes dp, pp, sharding, mp (no sep without sequence parallelism): 8 = 2^3 gives
    # C(3 + 3, 3) = 20 ordered factorisations
    assert len({lay.mesh_name for lay in layouts}) + len(excluded) == 20
    assert not {lay.mesh_name for lay in layouts} & {m for m, _ in excluded}
    assert all(reason for _, reason in excluded)


@pytest.mark.parametrize(
    ("kw", "mesh", "reason"),
    [
        ({"heads": 4, "kv_heads": 4}, "mp8", HEADS_REASON),
        (
            {"hidden": 250},
            "dp2 x mp4",
            "mp=4 does not divide the 250 hidden features of layers.0.mlp.gate_proj.kernel "
            "[128x250] (role gate, split on dim 1) (and 11 more parameter(s) alike); use mp in "
            "(1, 2), or sizes that 4 divides",
        ),
        (
            {"layers": 3},
            "dp2 x pp4",
            "pp=4 is more than the 3 blocks (every pipeline stage needs one); use pp <= 3",
        ),
    ],
    ids=["heads", "hidden", "blocks"],
)
def test_an_excluded_mesh_names_its_reason(kw, mesh, reason):
    _, excluded = enumerate_layouts(_llama(**kw), WORK, device_num=8)
    assert dict(excluded)[mesh] == reason


def test_an_odd_vocabulary_stays_whole_instead_of_excluding_the_mesh():
    found = _llama(vocab=510)  # issue 27: the embedding and head are kept whole at mp=4
    layouts, excluded = enumerate_layouts(found, WORK, device_num=8)
    assert "dp2 x mp4" in {lay.mesh_name for lay in layouts} and "dp2 x mp4" not in dict(excluded)
    head = next(p for p in found.params if p.role == "head")
    assert (head.spec_for(2), head.spec_for(4)) == (P(None, "mp"), P())


def test_kv_heads_mp_does_not_divide_stay_whole_and_q_o_are_split():
    found = _llama()  # 8 heads, 4 kv heads: at mp8 each rank holds one q head, all kv heads
    layouts, excluded = enumerate_layouts(found, WORK, device_num=8)
    assert "mp8" in {lay.mesh_name for lay in layouts} and "mp8" not in dict(excluded)
    k = next(p for p in found.params if p.path == "layers.0.self_attn.k_proj.kernel")
    q = next(p for p in found.params if p.path == "layers.0.self_attn.q_proj.kernel")
    assert (k.spec_for(4), k.spec_for(8)) == (P(None, "mp"), P())
    assert q.spec_for(8) == P(None, "mp")
    assert [p.path for p in found.replicated_at(8) if p.block == 0] == [
        "layers.0.self_attn.k_proj.kernel",
        "layers.0.self_attn.v_proj.kernel",
    ]


def test_mp_stays_inside_a_node():
    _, excluded = enumerate_layouts(_llama(), WORK, device_num=2, node_num=4)
    assert dict(excluded)["dp2 x mp4"] == "mp=4 exceeds the 2 devices of a node"


def test_a_model_without_transformer_parts_gets_no_mp_and_no_pp():
    found = match_patterns(ConvNet())
    layouts, excluded = enumerate_layouts(found, Workload(batch_size=8, seq_len=1), device_num=4)
    assert {lay.mesh_name for lay in layouts} == {"dp4", "dp2 x sharding2", "sharding4"}
    reasons = dict(excluded)
    assert reasons["mp4"] == "no tensor-parallel parts were recognised"
    assert reasons["pp4"] == "no run of >= 2 identical blocks to pipeline"


def test_the_batch_and_sequence_rules():
    found = _llama()
    odd = Workload(batch_size=6, seq_len=64)
    assert (
        shape_problem(found, odd, {"dp": 4}, 8) == "dp x sharding = 4 does not divide batch_size=6"
    )
    assert shape_problem(found, odd, {"dp": 2, "sharding": 2}, 8) == (
        "dp x sharding = 4 does not divide batch_size=6"
    )
    assert shape_problem(found, odd, {"dp": 2, "mp": 2}, 8) is None
    assert shape_problem(found, WORK, {"sep": 2}, 8) == "sep > 1 needs sequence_parallel=True"
    sp = Workload(batch_size=16, seq_len=6, sequence_parallel=True)
    assert shape_problem(found, sp, {"sep": 4}, 8) == "sep=4 does not divide seq_len=6"
    assert shape_problem(found, sp, {"sep": 2}, 8) is None


def test_sequence_parallel_adds_sep_meshes():
    found = _llama()
    plain, _ = enumerate_layouts(found, WORK, device_num=8)
    sp, _ = enumerate_layouts(
        found, Workload(batch_size=16, seq_len=64, sequence_parallel=True), device_num=8
    )
    assert max(lay.sep for lay in plain) == 1
    assert {lay.sep for lay in sp} == {1, 2, 4, 8}
    assert {lay.mesh_name for lay in plain} < {lay.mesh_name for lay in sp}


def test_forced_settings_narrow_the_enumeration():
    found = _llama()
    layouts, excluded = enumerate_layouts(
        found, WORK, device_num=8, force_mesh={"dp": 2, "pp": 2, "mp": 2}, schedule="FThenB"
    )
    assert excluded == []
    assert {lay.mesh_name for lay in layouts} == {"dp2 x pp2 x mp2"}
    assert {lay.schedule for lay in layouts} == {"FThenB"}
    # 8 sequences a replica at pp 2: micro-batch counts of at least P, 2P and 4P
    assert sorted({lay.num_microbatches for lay in layouts}) == [2, 4, 8]
    assert {lay.recompute for lay in layouts} == {False, True}

    _, excluded = enumerate_layouts(
        found, WORK, device_num=8, force_mesh={"dp": 2, "pp": 2, "mp": 2}, num_microbatches=3
    )
    assert excluded == [
        (
            "dp2 x pp2 x mp2",
            "num_microbatches=3 does not divide the 8 sequences per data-parallel replica",
        )
    ]
    layouts, excluded = enumerate_layouts(found, WORK, device_num=8, zero_stage=2)
    assert {lay.zero_stage for lay in layouts} == {2}
    assert dict(excluded)["dp8"] == "zero_stage=2 needs sharding > 1"
    layouts, excluded = enumerate_layouts(found, WORK, device_num=8, zero_stage=0)
    assert all(lay.sharding == 1 for lay in layouts)
    assert dict(excluded)["sharding8"] == "zero_stage=0 but sharding=8"
    layouts, _ = enumerate_layouts(found, WORK, device_num=8, recompute=False)
    assert not any(lay.recompute for lay in layouts)


def test_1f1b_is_not_offered_twice_with_recompute():
    layouts, _ = enumerate_layouts(_llama(), WORK, device_num=8)
    one_f = [lay for lay in layouts if lay.schedule == "1F1B"]
    assert one_f and not any(lay.recompute for lay in one_f)
    forced, _ = enumerate_layouts(_llama(), WORK, device_num=8, recompute=True)
    assert any(lay.schedule == "1F1B" for lay in forced)
    assert all(lay.recompute for lay in forced)


def test_layout_views():
    lay = Layout(dp=2, pp=2, mp=2, schedule="FThenB", num_microbatches=4, recompute=True)
    assert tuple(lay.degrees) == AXIS_NAMES
    assert lay.size == 8 and lay.data_degree == 2
    assert lay.mesh_name == "dp2 x pp2 x mp2"
    assert lay.name == "dp2 x pp2 x mp2 (FThenB M=4, recompute)"
    assert Layout().mesh_name == "single device"
    # tie-break: data parallel alone is the simplest; ZeRO and recompute count against
    assert Layout(dp=8).complexity() < Layout(dp=4, mp=2).complexity()
    assert (
        Layout(dp=4, sharding=2, zero_stage=1).complexity()
        < Layout(dp=4, sharding=2, zero_stage=3).complexity()
    )
    assert mesh_name({"mp": 4, "dp": 2}) == "dp2 x mp4"  # always in mesh order
    assert SCHEDULES == ("FThenB", "1F1B", "VPP")
    vpp = Layout(dp=2, pp=2, mp=2, schedule="VPP", num_microbatches=4, num_virtual_stages=2)
    assert vpp.name == "dp2 x pp2 x mp2 (VPP v=2 M=4)"


def test_layout_and_workload_validation():
    with pytest.raises(ValueError, match="zero_stage=1 needs a sharding axis"):
        Layout(dp=8, zero_stage=1)
    with pytest.raises(ValueError, match="sharding=2 without a ZeRO stage"):
        Layout(sharding=2)
    with pytest.raises(ValueError, match=r"pp=2 needs schedule in \('FThenB', '1F1B', 'VPP'\)"):
        Layout(pp=2, dp=4)
    with pytest.raises(ValueError, match=r"schedule='VPP' with num_virtual_stages=1"):
        Layout(pp=2, dp=4, schedule="VPP", num_microbatches=2)
    with pytest.raises(ValueError, match=r"schedule='1F1B' with num_virtual_stages=2"):
        Layout(pp=2, dp=4, schedule="1F1B", num_microbatches=2, num_virtual_stages=2)
    with pytest.raises(ValueError, match=r"groups of pp=4; num_microbatches=2"):
        Layout(pp=4, dp=2, schedule="VPP", num_microbatches=2, num_virtual_stages=2)
    with pytest.raises(ValueError, match="only apply with pp > 1"):
        Layout(dp=2, num_microbatches=2)
    with pytest.raises(ValueError, match="mp=0 must be an int >= 1"):
        Layout(mp=0)
    with pytest.raises(ValueError, match="dp=True must be an int >= 1"):
        Layout(dp=True)
    with pytest.raises(ValueError, match="optimizer='adagrad' is not known"):
        Workload(batch_size=1, seq_len=1, optimizer="adagrad")
    with pytest.raises(ValueError, match="seq_len=0 must be an int >= 1"):
        Workload(batch_size=1, seq_len=0)
    with pytest.raises(ValueError, match="dtype='float77' is not a dtype name"):
        Workload(batch_size=1, seq_len=1, dtype="float77")

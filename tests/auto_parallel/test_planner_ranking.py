"""benchmarks/planner_ranking.py: its rank correlation, program sharing and table (no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import planner_ranking as pr
from jfleet.auto_parallel import Layout, Workload, estimate, match_patterns
from jfleet.models.llama import TinyLlama


def test_spearman_is_the_correlation_of_ranks_with_ties_averaged():
    assert pr.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert pr.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): Pearson of the ranks
    assert pr.spearman([1, 5, 5, 9], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)


def _candidates():
    found = match_patterns(nnx.eval_shape(lambda: TinyLlama(vocab=64, width=32, layers=2)))
    work = Workload(batch_size=16, seq_len=8)
    lays = {
        "dp8": Layout(dp=8),
        "1f1b": Layout(dp=4, pp=2, schedule="1F1B", num_microbatches=2),
        "fthenb_rc": Layout(dp=4, pp=2, schedule="FThenB", num_microbatches=2, recompute=True),
        "fthenb": Layout(dp=4, pp=2, schedule="FThenB", num_microbatches=2),
    }
    return {k: estimate(found, work, v, devices_per_node=8) for k, v in lays.items()}


def test_a_pipeline_with_recompute_is_timed_as_1f1b():
    c = _candidates()
    assert pr.program_key(c["1f1b"]) == pr.program_key(c["fthenb_rc"])
    assert pr.program_key(c["fthenb"]) != pr.program_key(c["1f1b"])
    assert pr.program_key(c["dp8"]) == ("dp8",)


def test_render_reports_pick_fastest_and_correlation():
    c = _candidates()
    timed = [
        pr.Timed(candidate=c["dp8"], ratios=[1.0], seconds=[0.01, 0.012]),
        pr.Timed(candidate=c["fthenb"], ratios=[0.8, 0.9, 0.85]),
        pr.Timed(candidate=c["1f1b"], ratios=[1.5, 1.4, 1.6]),
    ]
    result = pr.SizeResult(pr.SIZES["example"], timed, "dp8", 60.0)
    assert result.fastest.name == c["fthenb"].layout.name
    assert result.pick_vs_fastest() == pytest.approx(1.0 / 0.85)
    text = pr.render([result], 3, [])
    assert "| example |" in text and "1.176" in text
    assert "**(pick)**" in text


def test_measurements_round_trip_through_json():
    import json

    c = _candidates()
    timed = [
        pr.Timed(candidate=c["dp8"], ratios=[1.0], seconds=[0.01]),
        pr.Timed(candidate=c["1f1b"], ratios=[1.5, 1.4], temp=3, moved=5, flops=7.0),
    ]
    result = pr.SizeResult(pr.SIZES["wide"], timed, "dp8", 60.0, rounds=2)
    back = pr.from_dict(json.loads(json.dumps(pr.as_dict(result))))
    assert back.rounds == 2 and back.size == result.size and back.chosen == "dp8"
    assert [t.candidate for t in back.timed] == [t.candidate for t in timed]
    assert back.pick_vs_fastest() == result.pick_vs_fastest()


def test_candidates_timed_later_join_their_size_once():
    """``--only VPP --merge F``: the new run's candidates join F's size, a candidate timed
    again replacing F's timing of it (a changed program); the baseline is not added twice."""
    c = _candidates()
    earlier = pr.SizeResult(
        pr.SIZES["example"],
        [pr.Timed(candidate=c["dp8"], ratios=[1.0]), pr.Timed(candidate=c["fthenb"], ratios=[0.9])],
        "dp8", 60.0, command="first",
    )  # fmt: skip
    new = pr.SizeResult(
        pr.SIZES["example"],
        [pr.Timed(candidate=c["dp8"], ratios=[1.0]), pr.Timed(candidate=c["1f1b"], ratios=[1.2]),
         pr.Timed(candidate=c["fthenb"], ratios=[0.7])],
        "dp8", 10.0, command="second",
    )  # fmt: skip
    other = pr.SizeResult(pr.SIZES["wide"], [pr.Timed(candidate=c["fthenb_rc"])], "dp8", 1.0)
    joined = pr._joined(earlier, [other, new])
    assert [t.name for t in joined.timed] == [c[k].layout.name for k in ("dp8", "1f1b", "fthenb")]
    assert joined.by_name(c["fthenb"].layout.name).ratios == [0.7]  # timed again: replaced
    assert joined.by_name("dp8").ratios == [1.0]
    assert joined.command == "first` + `second"

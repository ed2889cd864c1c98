"""benchmarks/pipeline_schedules.py: its table and findings from made-up rows (nothing compiled)."""

from __future__ import annotations

from benchmarks import pipeline_schedules as ps


def test_the_table_renders_every_row_and_names_the_target():
    rows = [
        ps.Row(entry, schedule, "dp2 x pp4", 4, executed, 100.0, 80.0, 6, 2**20, 14)
        for entry, schedule, executed in [
            ("stand-in", "FThenB", 160.0),
            ("stand-in", "1F1B", 100.0),
            ("pipeline_loss", "1F1B", 96.0),
        ]
    ]
    text = ps.render(rows, ps.Setting(), "cmd")
    assert text.count("| stand-in |") == 2 and "| 1.60 | 2.00 |" in text
    assert "M=4: 1F1B executes 1.25x the dp8 step" in text and "FThenB's 2.00x" in text
    assert "at most 1.60x its schedule's ideal (the most: stand-in FThenB" in text
    assert [ps.stand_in_rows, ps.pipeline_loss_rows, ps.table_rows] == ps.ROW_PRODUCERS


def test_the_vpp_finding_compares_it_with_1f1b_at_the_same_mesh():
    rows = [
        ps.Row("stand-in", schedule, "dp2 x pp2 x mp2", 4, executed, 100.0, 80.0, bubble, 2**20, n)
        for schedule, executed, bubble, n in [("1F1B", 101.0, 2, 10), ("VPP v=2", 102.0, 2, 18)]
    ]
    text = ps.render(rows, ps.Setting(), "cmd")
    assert "Stand-in VPP (2 chunks a stage) at dp2 x pp2 x mp2, M=4: 1.02x its ideal" in text
    assert "bubble 2 of 2 x (2 x 4 + 1) chunk ticks (0.111 = (P - 1) / (vM + P - 1))" in text
    assert "against 1F1B's 2 of 2 x (4 + 1) stage ticks (0.200); 18 collective-permutes" in text

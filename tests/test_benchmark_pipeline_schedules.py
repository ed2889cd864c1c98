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
    assert [ps.stand_in_rows, ps.pipeline_loss_rows] == ps.ROW_PRODUCERS

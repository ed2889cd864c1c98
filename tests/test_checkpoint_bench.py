"""The checkpoint benchmark's checksum table, from made-up rows (nothing compiled or saved)."""

from __future__ import annotations


def test_the_checksum_table_reports_the_share_and_its_verdict():
    from benchmarks import checkpoint_bench as cb

    rows = [
        cb.ChecksumRow(cb.SIZES[0], 1000, (1.05, 1.0), (0.5, 0.6), (0.05, 0.02)),
        cb.ChecksumRow(cb.SIZES[1], 9000, (2.0, 1.5), (1.1, 1.0), (0.1, 0.1)),
    ]
    text = cb.render_checksums(rows, 5, "cmd")
    assert "| example | 1,000 | 1.050 | 1.000 | +5.0% | 0.050 | 5.0% |" in text, text
    assert "| 0.600 | -16.7% | 0.020 | 4.2% |" in text, text
    assert "add at most 10.0% to a save or a restore, within the 10% goal" in text, text
    rows[1].checksum_s = (0.5, 0.1)
    assert "add at most 33.3% to a save or a restore, above" in cb.render_checksums(rows, 5, "c")

"""examples/ctr_wide_deep.py --quick: wide & deep in parameter-server mode learns the hidden
click rule (test AUC from chance to above 0.7), with the day's shrink and a table save."""

from __future__ import annotations

import re

from tests.test_examples import check_ok, run_example


def test_ctr_wide_deep_learns_the_clicks():
    out = check_ok(run_example("ctr_wide_deep.py", "--quick"))
    before = float(re.search(r"^before training: test AUC (\d\.\d+)$", out, re.M).group(1))
    after = float(re.search(r"^test AUC (\d\.\d+)$", out, re.M).group(1))
    assert abs(before - 0.5) < 0.1, out  # an untrained model guesses
    assert after > 0.7, out
    evicted = [int(n) for n in re.findall(r"^day \d+: shrink evicted (\d+) rows$", out, re.M)]
    assert len(evicted) == 2 and evicted[0] > 0, out
    used = int(re.search(r"table rows in use: (\d+)", out).group(1))
    saved = int(re.search(r"^save_one_table: (\d+) rows", out, re.M).group(1))
    assert saved == used > 1000, out

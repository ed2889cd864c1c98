"""No internal exception leaves the matcher: 500 randomly composed block forms, traced
abstractly, each get roles or a named reason (issue 27).

A run checks one round of :data:`ROUNDS`: a fixed fifth of the 500 forms, chosen by the day
(``JFLEET_FORMS_ROUND=K`` picks round K), so five days' runs cover all 500 and a failure
names the round that reproduces it.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
from flax import nnx

from jfleet.auto_parallel.patterns import match_patterns
from jfleet.auto_parallel.planner import plan_for
from tests.auto_parallel.random_forms import FormModel, random_forms

ALL_FORMS = random_forms(500, seed=27)
ROUNDS = 5
ROUND = int(os.environ.get("JFLEET_FORMS_ROUND", datetime.date.today().toordinal() % ROUNDS))
FORMS = ALL_FORMS[ROUND::ROUNDS]
REPRODUCE = f"(round {ROUND} of {ROUNDS}: JFLEET_FORMS_ROUND={ROUND} reproduces it)"


def _abstract(form):
    return nnx.eval_shape(lambda: FormModel(form, nnx.Rngs(0)))


def test_every_form_is_matched_without_an_internal_error():
    failures = []
    for form in FORMS:
        model = _abstract(form)
        try:
            found = match_patterns(model, model.inputs())
        except Exception as err:  # collected, so one run names every failing form
            failures.append(f"{form}: {type(err).__name__}: {err}")
            continue
        unread = [n for n in found.notes if "could not be read" in n]
        bad_units = [
            p.path
            for p in found.params
            if p.split_dim is not None and p.units and p.shape[p.split_dim] % p.units
        ]
        if unread or bad_units:
            failures.append(f"{form}: {unread or bad_units}")
    assert not failures, f"{len(failures)} of {len(FORMS)} forms {REPRODUCE}:\n" + "\n".join(
        failures[:10]
    )


def _raised_by_jfleet(err: BaseException) -> bool:
    """A documented error: an explicit ``raise`` in jfleet, not a failure inside it."""
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return "/jfleet/" in frame.filename and (frame.line or "").lstrip().startswith("raise")


def test_a_round_is_a_fifth_of_the_forms_and_the_rounds_cover_them_all():
    covered = [form for k in range(ROUNDS) for form in ALL_FORMS[k::ROUNDS]]
    assert len(FORMS) == 100 and sorted(map(repr, covered)) == sorted(map(repr, ALL_FORMS))


@pytest.mark.parametrize("start", [0, 1])
def test_the_planner_raises_only_documented_errors_on_the_forms(start):
    for form in ALL_FORMS[ROUND + ROUNDS * start :: 40]:
        model = _abstract(form)
        patterns = match_patterns(model, model.inputs())
        try:
            plan_for(model, device_num=8, batch_size=8, seq_len=6, patterns=patterns)
        except (ValueError, TypeError) as err:
            assert _raised_by_jfleet(err), f"{form} {REPRODUCE}: {type(err).__name__}: {err}"

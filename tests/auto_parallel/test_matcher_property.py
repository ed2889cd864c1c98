"""No internal exception leaves the matcher: 500 randomly composed block forms, traced
abstractly, each get roles or a named reason (issue 27); the forms whose blocks wrap their
activation (``(cache, x)`` with the cache None, ``(x, None)``, ``{"hidden": x, "cache":
None}``, ``(x, aux)``) scan at pp = 1 to what the unrolled blocks return (issue 35).

A run checks one round of :data:`ROUNDS`: a fixed fifth of the 500 forms, chosen by the day
(``JFLEET_FORMS_ROUND=K`` picks round K), so five days' runs cover all 500 and a failure
names the round that reproduces it.
"""

from __future__ import annotations

import datetime
import functools
import os
import traceback

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jfleet.auto_parallel.apply.scanned_blocks import scan_blocks
from jfleet.auto_parallel.match.block_calls import block_outputs
from jfleet.auto_parallel.match.block_check import block_problems
from jfleet.auto_parallel.match.patterns import match_patterns
from jfleet.auto_parallel.search.planner import plan_for
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


#: Forms whose blocks wrap the activation, the cache None in training (issue 35).
WRAPPED = ("cache_first", "x_none", "dict_cache", "tuple", "dict")
#: Per return form, three two-block forms of the round (one block leaves nothing to stack).
SCANNED_FORMS = [
    form
    for ret in WRAPPED
    for form in [f for f in ALL_FORMS if f.ret == ret and f.layers == 2][ROUND::ROUNDS][:3]
]


def test_a_scanned_stack_hands_on_the_activation_of_every_return_form():
    """At pp = 1 with scan_layers=True, the stack is scanned or kept unrolled with a reason,
    and the scanned forward returns what the unrolled one does (traced abstractly)."""
    assert {f.ret for f in SCANNED_FORMS} == set(WRAPPED)
    failures, scanned = [], 0
    for form in SCANNED_FORMS:
        model = _abstract(form)
        inputs = model.inputs()
        blocks = list(match_patterns(model, inputs).blocks)
        if not blocks:  # the matcher's reason is in its notes; nothing to scan
            continue
        x = jnp.zeros(inputs.shape, inputs.dtype)
        call = lambda model=model, x=x: model(x)  # noqa: E731
        _, problem = block_problems(model, blocks, call)
        if problem:
            assert isinstance(problem, str) and problem, form
            continue
        outputs = block_outputs(model, blocks, call)
        graphdef, state = nnx.split(model)

        def forward(state, inputs, scan, outputs=outputs, graphdef=graphdef):
            m = nnx.merge(graphdef, state)
            if scan:
                scan_blocks(m, "blocks", outputs=outputs)
            return m(inputs)

        try:
            got = jax.eval_shape(functools.partial(forward, scan=True), state, inputs)
        except Exception as err:  # collected, so one run names every failing form
            failures.append(f"{form}: {type(err).__name__}: {err}")
            continue
        want = jax.eval_shape(functools.partial(forward, scan=False), state, inputs)
        if jax.tree.structure(got) != jax.tree.structure(want) or jax.tree.map(
            lambda a, b: (a.shape, a.dtype) != (b.shape, b.dtype), got, want
        ) != jax.tree.map(lambda a: False, want):
            failures.append(f"{form}: scanned {got}, unrolled {want}")
        scanned += 1
    assert not failures, f"{len(failures)} forms {REPRODUCE}:\n" + "\n".join(failures[:10])
    assert scanned >= len(SCANNED_FORMS) // 2, scanned  # the check ran, not only reasons

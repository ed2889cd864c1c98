"""Paddle's LR schedulers: each formula over the first epochs, state round trips, bad input."""

from __future__ import annotations

import math

import pytest

from jfleet.optim import lr


def run(scheduler, epochs=8):
    """The learning rate each epoch sees: read, then step (Paddle's loop)."""
    out = []
    for _ in range(epochs):
        out.append(scheduler())
        scheduler.step()
    return out


# Expected values written from Paddle's documented formulas, epoch e = 0, 1, 2, ...
CASES = {
    "piecewise": (
        lambda: lr.PiecewiseDecay(boundaries=[2, 5], values=[1.0, 0.5, 0.1]),
        [1.0, 1.0, 0.5, 0.5, 0.5, 0.1, 0.1, 0.1],
    ),
    "step": (
        lambda: lr.StepDecay(0.8, step_size=3, gamma=0.5),
        [0.8, 0.8, 0.8, 0.4, 0.4, 0.4, 0.2, 0.2],
    ),
    "multistep": (
        lambda: lr.MultiStepDecay(1.0, milestones=[1, 4], gamma=0.1),
        [1.0, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.01],
    ),
    "exponential": (
        lambda: lr.ExponentialDecay(2.0, gamma=0.5),
        [2.0 * 0.5**e for e in range(8)],
    ),
    "noam": (
        lambda: lr.NoamDecay(d_model=64, warmup_steps=4, learning_rate=2.0),
        [2.0 / 8 * min(1 if e == 0 else e**-0.5, e / 8) for e in range(8)],
    ),
    "polynomial": (
        lambda: lr.PolynomialDecay(1.0, decay_steps=4, end_lr=0.2, power=2.0),
        [0.8 * (1 - min(e, 4) / 4) ** 2 + 0.2 for e in range(8)],
    ),
    "polynomial_cycle": (
        lambda: lr.PolynomialDecay(1.0, decay_steps=2, end_lr=0.0, cycle=True),
        # decay steps grow to 2 * ceil(e / 2): e=3 -> 1 - 3/4, e=4 -> 1 - 4/4, e=5 -> 1 - 5/6
        [1.0, 0.5, 0.0, 0.25, 0.0, 1 / 6, 0.0, 1 / 8],
    ),
    "lambda": (
        lambda: lr.LambdaDecay(0.5, lr_lambda=lambda e: 1.0 / (e + 1)),
        [0.5 / (e + 1) for e in range(8)],
    ),
    "cosine": (
        lambda: lr.CosineAnnealingDecay(1.0, T_max=4, eta_min=0.2),
        [0.2 + 0.8 * (1 + math.cos(math.pi * e / 4)) / 2 for e in range(8)],
    ),
    "warmup_float": (
        lambda: lr.LinearWarmup(0.5, warmup_steps=4, start_lr=0.1, end_lr=0.5),
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5],
    ),
    "warmup_scheduler": (
        lambda: lr.LinearWarmup(
            lr.StepDecay(0.4, step_size=2, gamma=0.5), warmup_steps=2, start_lr=0.0, end_lr=0.4
        ),
        [0.0, 0.2, 0.4, 0.4, 0.2, 0.2, 0.1, 0.1],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_scheduler_matches_paddles_formula(name):
    make, want = CASES[name]
    assert run(make()) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_state_dict_round_trip_resumes_the_schedule():
    full = run(lr.LinearWarmup(lr.StepDecay(1.0, 2, 0.5), 2, 0.0, 1.0), 8)
    first = lr.LinearWarmup(lr.StepDecay(1.0, 2, 0.5), 2, 0.0, 1.0)
    head = run(first, 5)
    saved = first.state_dict()
    assert set(saved) == {"last_epoch", "last_lr", "LinearWarmup_LR"}
    resumed = lr.LinearWarmup(lr.StepDecay(1.0, 2, 0.5), 2, 0.0, 1.0)
    resumed.set_state_dict(saved)
    assert head + run(resumed, 3) == pytest.approx(full)


def test_step_to_an_epoch_uses_the_closed_form():
    s = lr.CosineAnnealingDecay(1.0, T_max=10)
    s.step(5)
    assert s.last_epoch == 5 and s() == pytest.approx(0.5)
    s = lr.StepDecay(1.0, step_size=2, gamma=0.1, last_epoch=3)  # resumes after epoch 3
    assert s.last_epoch == 4 and s() == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: lr.StepDecay(0.1, step_size=2, gamma=1.5), ValueError, r"gamma=1\.5.*< 1\.0"),
        (lambda: lr.StepDecay(0.1, step_size=2.5), TypeError, r"step_size=2\.5.*int"),
        (lambda: lr.StepDecay(-0.1, step_size=2), ValueError, r"learning_rate=-0\.1.*>= 0"),
        (lambda: lr.PiecewiseDecay([2, 4], [1.0]), ValueError, r"1 values for 2 boundaries"),
        (
            lambda: lr.MultiStepDecay(0.1, milestones=[3, 1]),
            ValueError,
            r"milestones=\[3, 1\].*increasing",
        ),
        (lambda: lr.ExponentialDecay(0.1, gamma=1.0), ValueError, r"gamma=1\.0.*\(0, 1\)"),
        (lambda: lr.LinearWarmup(0.1, 0, 0.0, 0.1), ValueError, r"warmup_steps=0.*positive int"),
        (
            lambda: lr.LinearWarmup(0.1, 2, start_lr=0.5, end_lr=0.1),
            ValueError,
            r"start_lr=0\.5, end_lr=0\.1.*greater",
        ),
        (lambda: lr.LambdaDecay(0.1, lr_lambda=0.9), TypeError, r"lr_lambda=0\.9.*function"),
        (lambda: lr.CosineAnnealingDecay(0.1, T_max=0), ValueError, r"T_max=0.*positive int"),
        (lambda: lr.NoamDecay(d_model=0, warmup_steps=2), ValueError, r"d_model=0.*> 0"),
        (lambda: lr.StepDecay(0.1, 2)(7), TypeError, r"called with a step count"),
        (
            lambda: lr.StepDecay(0.1, 2).set_state_dict({"last_epoch": 1}),
            RuntimeError,
            r"can't find \[ last_lr \]",
        ),
    ],
)
def test_bad_scheduler_input(make, error, match):
    with pytest.raises(error, match=match):
        make()

"""Interrupts never tear a step: old state or new state, never deleted buffers; SIGTERM hook."""

from __future__ import annotations

import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet, make_train_step
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.runtime import interrupts
from jfleet.training.engine import StepStateLostError, TrainStep, _raise_if_lost
from tests.fleet_setup import init_fleet
from tests.subprocess_util import run_python

TRIALS = 20


def snapshot(model, opt):
    """Host copies of the model's and optimizer's state (raises if a buffer was deleted)."""
    return jax.device_get((nnx.state(model), nnx.state(opt)))


def restore(model, opt, snap, shardings):
    model_state, opt_state = jax.device_put(snap, shardings)
    nnx.update(model, model_state)
    nnx.update(opt, opt_state)


def same(a, b) -> bool:
    flat_a, tree_a = jax.tree.flatten(a)
    flat_b, tree_b = jax.tree.flatten(b)
    if tree_a != tree_b:
        return False
    return all(np.array_equal(x, y) for x, y in zip(flat_a, flat_b, strict=True))


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler for each test, as an interactive run has it: a suite
    started as a shell's background job (``pytest &``) inherits SIGINT ignored, and these
    tests check what jfleet does with the handler it finds."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def zero3_step():
    """A ZeRO-3 (sharding 8) TinyLM, its optimizer, one compiled step and a batch."""
    init_fleet({"dp_degree": 1, "sharding_degree": 8}, sharding_configs={"stage": 3})
    model = fleet.distributed_model(TinyLM(vocab=128, width=128, hidden=256))
    opt = fleet.distributed_optimizer(optax.adam(1e-3))
    batch = lm_batches(1, batch=32, seq=16, vocab=128)[0]
    step = TrainStep(lm_loss, model.placement, nonfinite="warn")
    jax.block_until_ready(step(model.module, opt, batch))  # compiles; later calls reuse it
    return model.module, opt, step, batch


def test_keyboard_interrupt_at_random_moments_leaves_old_or_new_state(zero3_step, monkeypatch):
    model, opt, step, batch = zero3_step
    shardings = jax.tree.map(lambda x: x.sharding, (nnx.state(model), nnx.state(opt)))
    # Where the atomic section lies in a call (host time from the call's start), so half the
    # interrupts aim at it; the other half fall anywhere in the call or just after it.
    marks = []

    class Timed(interrupts.atomic):  # records where each call's atomic section lies
        def __enter__(self):
            marks.append(time.perf_counter())
            return super().__enter__()

        def __exit__(self, *exc):
            marks.append(time.perf_counter())  # before re-delivery: the section's end
            super().__exit__(*exc)

    monkeypatch.setattr(interrupts, "atomic", Timed)
    calls, sections = [], []
    for _ in range(3):
        start = time.perf_counter()
        step(model, opt, batch)
        calls.append(time.perf_counter() - start)
        sections.append((marks[-2] - start, marks[-1] - start))
        jax.block_until_ready(nnx.state(model))
    window = 1.5 * float(np.median(calls))
    rng = np.random.default_rng(14)
    pre = snapshot(model, opt)
    # The kernel's interval timer delivers SIGALRM at the chosen moment whatever the main
    # thread holds (a timer thread would first need the GIL, which the jitted call keeps);
    # Python runs its handler at the next bytecode, exactly where a real Ctrl-C would land,
    # and the handler turns it into SIGINT.
    alarm = signal.signal(signal.SIGALRM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    try:
        outcomes = {"old": 0, "new": 0}
        deferred = 0
        for trial in range(TRIALS):
            restore(model, opt, pre, shardings)  # replay: the post-step state, computed apart
            step(model, opt, batch)
            post = snapshot(model, opt)
            restore(model, opt, pre, shardings)
            jax.block_until_ready(nnx.state(model))
            count = interrupts.deferred_signal_count()
            section = np.median(sections, axis=0)  # aim at where recent sections lay
            delay = rng.uniform(*section) if trial % 2 else rng.uniform(0.0, window)
            interrupted = False
            marks.clear()
            try:
                start = time.perf_counter()
                signal.setitimer(signal.ITIMER_REAL, delay)
                step(model, opt, batch)
                time.sleep(window + delay)  # a pending KeyboardInterrupt is raised here
            except KeyboardInterrupt:
                interrupted = True
            assert interrupted, f"trial {trial}: the interrupt never arrived"
            deferred += interrupts.deferred_signal_count() > count
            if len(marks) == 2:
                sections.append((marks[0] - start, marks[1] - start))
            got = snapshot(model, opt)  # "Array has been deleted" would raise here
            assert same(got, pre) or same(got, post), f"trial {trial}: neither old nor new state"
            outcomes["old" if same(got, pre) else "new"] += 1
            pre = got
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, alarm)
    print(
        f"interrupts: {outcomes}, {deferred} of {TRIALS} inside the atomic section "
        f"(section {section[0] * 1e3:.1f}-{section[1] * 1e3:.1f} ms of {window / 1.5 * 1e3:.1f})"
    )
    assert outcomes["old"] + outcomes["new"] == TRIALS
    assert deferred >= 1  # some interrupts landed inside dispatch-and-install


def test_atomic_defers_sigint_to_the_end_of_the_block():
    order = []
    with pytest.raises(KeyboardInterrupt), interrupts.atomic():
        signal.raise_signal(signal.SIGINT)
        order.append("block finished")
    assert order == ["block finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_atomic_on_another_thread_swaps_nothing():
    seen = []

    def work():
        with interrupts.atomic():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


def test_step_state_lost_error_says_what_was_lost_and_how_to_recover():
    x = jnp.ones(3)
    x.delete()
    with pytest.raises(StepStateLostError, match=r"1 of their arrays are deleted.*checkpoint"):
        _raise_if_lost(({"w": x}, {}), RuntimeError("XlaRuntimeError: boom"))
    _raise_if_lost(({"w": jnp.ones(3)}, {}), RuntimeError("kept"))  # nothing lost: no error


@pytest.fixture
def sigterm_recorder():
    """SIGTERM handled by a recorder (the handler in force before on_termination)."""
    events = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: events.append("previous"))
    yield events
    signal.signal(signal.SIGTERM, previous)
    interrupts._callbacks.clear()


def test_sigterm_inside_a_step_runs_the_hook_after_it_once_and_continue_keeps_running(
    sigterm_recorder,
):
    events = sigterm_recorder
    interrupts.on_termination(lambda: events.append("hook") or interrupts.CONTINUE)
    with interrupts.atomic():
        signal.raise_signal(signal.SIGTERM)
        events.append("step installed")
    assert events == ["step installed", "hook"]  # deferred; CONTINUE: no SystemExit
    signal.raise_signal(signal.SIGTERM)  # the hook ran once: the previous handler now
    assert events == ["step installed", "hook", "previous"]


def test_sigterm_hook_exits_with_143_by_default(sigterm_recorder):
    interrupts.on_termination(lambda: sigterm_recorder.append("saved"))
    with pytest.raises(SystemExit) as info:
        signal.raise_signal(signal.SIGTERM)
    assert info.value.code == 143 and sigterm_recorder == ["saved"]


def test_on_termination_bad_input():
    with pytest.raises(TypeError, match=r"fn=3\): fn must be a callable"):
        interrupts.on_termination(3)
    errors = []

    def register():
        try:
            interrupts.on_termination(print)
        except ValueError as err:
            errors.append(str(err))

    thread = threading.Thread(target=register, name="worker")
    thread.start()
    thread.join()
    assert errors and "from thread 'worker'" in errors[0] and "main thread" in errors[0]


def test_debug_nans_after_a_first_step_raises_floating_point_error_and_keeps_the_model():
    init_fleet({"dp_degree": 8})
    model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
    opt = fleet.distributed_optimizer(optax.sgd(0.1))
    step = make_train_step(lambda m, b: jnp.mean(jnp.log(m(b["x"]) ** 2 * b["s"])))
    x = jnp.ones((8, 4))
    step(model.module, opt, {"x": x, "s": jnp.ones((8, 2))})
    kernel = np.asarray(model.module.kernel[...])
    jax.config.update("jax_debug_nans", True)
    try:
        with pytest.raises(FloatingPointError):
            step(model.module, opt, {"x": x, "s": -jnp.ones((8, 2))})  # log(< 0): NaN
    finally:
        jax.config.update("jax_debug_nans", False)
    np.testing.assert_array_equal(np.asarray(model.module.kernel[...]), kernel)  # readable


SIGTERM_CHILD = """
import os, signal, sys, threading
import jax
jax.config.update("jax_num_cpu_devices", 2)
import numpy as np, optax
from flax import nnx
from jfleet import fleet
from jfleet.runtime import interrupts
from jfleet.models import TinyLM, lm_batches, lm_loss

fleet.init(is_collective=True, log_level="WARNING")
model = fleet.distributed_model(TinyLM())
opt = fleet.distributed_optimizer(optax.sgd(0.1))
batches = lm_batches(1)
steps = []

def save():
    kernel = np.asarray(model.module.head.kernel[...])  # readable: a step boundary
    print(f"HOOK after {len(steps)} steps, kernel finite {np.isfinite(kernel).all()}", flush=True)

interrupts.on_termination(save)
try:
    for i in range(100000):
        model.train_batch(batches[0], opt, loss_fn=lm_loss)
        steps.append(i)
        if i == 0:  # compiled: SIGTERM arrives while it trains
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
finally:
    print(f"FINALLY {len(steps)}", flush=True)
print("NOT REACHED")
"""


def test_sigterm_runs_the_hook_once_at_a_step_boundary_and_exits_143():
    start = time.monotonic()
    result = run_python(SIGTERM_CHILD, timeout=90)
    elapsed = time.monotonic() - start
    out = result.stdout
    assert result.returncode == interrupts.EXIT_CODE == 143, result.stderr[-2000:]
    assert out.count("HOOK after") == 1 and "kernel finite True" in out, out
    assert "FINALLY" in out and "NOT REACHED" not in out, out
    assert "SIGTERM received: running 1 termination callback(s)" in result.stderr
    assert elapsed < 60


SIGTERM_IN_GC_CALLBACK_CHILD = """
import gc, os, signal, time
from jfleet.runtime import interrupts

interrupts.on_termination(lambda: print("HOOK", flush=True))
sent = []

def send_inside_the_callback(phase, info):
    if phase == "start" and not sent:
        os.kill(os.getpid(), signal.SIGTERM)
        sent.append(1)  # Python runs the handler here, inside the gc callback

gc.callbacks.append(send_inside_the_callback)
gc.collect()
gc.callbacks.remove(send_inside_the_callback)
for _ in range(500):
    time.sleep(0.01)
print("NOT REACHED", flush=True)
"""


def test_sigterm_handled_inside_a_gc_callback_still_runs_the_hook_and_exits_143():
    # JAX registers a gc callback; a SystemExit raised in one is printed as "ignored" and
    # the process goes on training. The hook must run, once, and the process must exit.
    result = run_python(SIGTERM_IN_GC_CALLBACK_CHILD, timeout=60)
    assert result.returncode == 143, (result.stdout, result.stderr[-2000:])
    assert result.stdout.count("HOOK") == 1 and "NOT REACHED" not in result.stdout
    assert "Exception ignored" not in result.stderr, result.stderr[-2000:]

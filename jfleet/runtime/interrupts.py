"""Signals that cannot tear a training step: atomic sections and the SIGTERM exit hook.

The engine donates the model's and the optimizer's buffers to each step, so between
dispatching a step and installing its outputs the Python objects point at deleted
arrays. :class:`atomic` makes that stretch uninterruptible from Python: on the main
thread, SIGINT (and SIGTERM when a Python handler owns it) are recorded instead of
handled, and delivered again, to the handler that was in force, once the section ends,
so a ``KeyboardInterrupt`` is raised with the new state installed. Signals are only
ever handled on the main thread, so a step that runs on another thread cannot be torn
by one; there the section only holds a lock that the SIGTERM hook waits for.

:func:`on_termination` registers callbacks that run once when SIGTERM arrives: at the
end of the step in progress, or at once between steps. After them the process exits
with code 143 (128 + SIGTERM) by raising ``SystemExit(143)`` (``finally`` blocks run),
unless a callback returns :data:`CONTINUE`.

Example:
  >>> with atomic():
  ...     pass  # a SIGINT here is delivered when the block ends
  >>> deferred_signal_count() >= 0
  True
"""

from __future__ import annotations

import gc
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import jax

from jfleet.runtime.log import logger

__all__ = ["CONTINUE", "atomic", "deferred_signal_count", "on_termination"]

EXIT_CODE = 128 + signal.SIGTERM
"""The exit status after the termination callbacks ran: 143, as a shell reports SIGTERM."""

CONTINUE = object()
"""Returned by a termination callback: do not exit; the training loop stops itself."""

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_main = threading.main_thread()
_depth = 0  # nesting of atomic sections on the main thread
_pending: list[int] = []  # signals received inside the current main-thread section
_saved: dict[int, Any] = {}  # the handlers the section replaced
_deferred_total = 0
_worker_lock = threading.Lock()  # held by sections on other threads; the hook waits for it


def _defer(signum: int, frame: Any) -> None:
    global _deferred_total
    _deferred_total += 1
    if signum not in _pending:
        _pending.append(signum)


def deferred_signal_count() -> int:
    """How many signals arrived inside an atomic section (and were delivered after it).

    Example:
      >>> isinstance(deferred_signal_count(), int)
      True
    """
    return _deferred_total


class atomic:  # noqa: N801 (used as a statement, like ``contextlib.suppress``)
    """A ``with`` block that SIGINT and SIGTERM cannot interrupt; they are delivered after it.

    On the main thread, for each of SIGINT and SIGTERM whose handler is a Python one
    (``signal.getsignal`` returns a callable: Python's ``KeyboardInterrupt`` handler, the
    :func:`on_termination` hook, yours), the handler is swapped for one that records the
    signal, and put back when the block ends; recorded signals are then raised again
    (``signal.raise_signal``), in arrival order, so the original handler runs just after
    the block (a ``KeyboardInterrupt`` propagates from the ``with`` statement). Signals
    left to the C level (``SIG_DFL``, ``SIG_IGN``, or a handler installed outside Python,
    such as JAX's preemption notifier) are not touched: the process's default action or
    that handler applies. Nested blocks defer to the outermost. Cost: one
    ``signal.getsignal`` and two ``signal.signal`` calls per swapped signal, measured at
    8 us per block with SIGINT alone and 14 us with a Python SIGTERM handler too.

    On another thread nothing is swapped (Python runs signal handlers on the main thread
    only, so they cannot interrupt this block); the block holds a lock that the SIGTERM
    hook acquires before running its callbacks, so they see the step's new state.

    Example:
      >>> with atomic():
      ...     x = 1
    """

    __slots__ = ("_main_thread",)

    def __enter__(self) -> atomic:
        global _depth
        self._main_thread = threading.current_thread() is _main
        if not self._main_thread:
            _worker_lock.acquire()
            return self
        if _depth == 0:
            for signum in _SIGNALS:
                handler = signal.getsignal(signum)
                if callable(handler):
                    _saved[signum] = handler
                    signal.signal(signum, _defer)
        _depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        global _depth
        if not self._main_thread:
            _worker_lock.release()
            return
        _depth -= 1
        if _depth:
            return
        for signum, handler in _saved.items():
            signal.signal(signum, handler)
        _saved.clear()
        if _pending:
            pending = list(_pending)
            _pending.clear()
            for signum in pending:
                signal.raise_signal(signum)  # the restored handler runs now


# ---------------------------------------------------------------------------- SIGTERM hook
_callbacks: list[Callable[[], Any]] = []
_previous_sigterm: Any = None


#: Seconds before a SIGTERM that arrived where an exception is lost is sent again.
_REDELIVER_AFTER = 0.02


def _swallows_exceptions(frame: Any) -> bool:
    """Whether ``frame`` runs inside a gc callback (JAX registers one) or a ``__del__``:
    Python reports an exception raised there as "ignored" and carries on."""
    hooks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        code = frame.f_code
        if code in hooks or code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def _on_sigterm(signum: int, frame: Any) -> None:
    if _swallows_exceptions(frame):
        # Raising SystemExit here would be ignored and the process would go on training:
        # send the signal again from a thread, to be handled once the frame is left.
        threading.Timer(_REDELIVER_AFTER, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return
    callbacks = list(_callbacks)
    _callbacks.clear()
    # A second SIGTERM while the callbacks run (or later) gets the handler from before.
    signal.signal(signal.SIGTERM, _previous_sigterm or signal.SIG_DFL)
    logger.warning(
        "SIGTERM received: running %d termination callback(s), then exiting with %d",
        len(callbacks),
        EXIT_CODE,
    )
    keep_running = False
    with _worker_lock:  # a step on another thread finishes installing its state first
        for fn in callbacks:
            if fn() is CONTINUE:
                keep_running = True
    if keep_running:
        logger.warning("SIGTERM: a termination callback returned CONTINUE; not exiting")
        return
    raise SystemExit(EXIT_CODE)


def on_termination(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Runs ``fn()`` once when this process receives SIGTERM, then exits with code 143.

    Typical use: save a checkpoint when the scheduler preempts the job::

        @jfleet.interrupts.on_termination
        def _save():
            mgr.save(step, model, optimizer)
            mgr.wait_until_finished()

    SIGTERM during a training step runs the callbacks when the step's new state is
    installed (the step is an :class:`atomic` section); between steps, at once. Callbacks
    run in registration order, on the main thread, once: a second SIGTERM gets the
    handler that was in force before the first ``on_termination``. Then ``SystemExit(143)``
    is raised where the main thread was (``finally`` blocks and ``atexit`` run), unless a
    callback returned :data:`CONTINUE` (training goes on; the loop must stop itself, e.g.
    on a flag the callback set). A callback may also call ``sys.exit(code)`` itself.

    Several processes: the scheduler signals each process, and each runs its callbacks
    at its own step boundary. A collective save needs every process at the same step, so
    have the callback agree on one first (or save asynchronously at a step all reach).
    ``jax.distributed.initialize`` starts JAX's preemption notifier, which owns SIGTERM
    at the C level (``jax_enable_preemption_service``, on by default) so that
    ``jax.experimental.multihost_utils.reached_preemption_sync_point(step)`` can agree on a
    step across processes. The two cannot share the signal: the first ``on_termination``
    takes SIGTERM from JAX's notifier (a warning says so once ``jax.distributed`` runs).
    Use one of them: this hook, or ``reached_preemption_sync_point`` in the loop (without
    any ``on_termination``; then a SIGTERM never interrupts a step, JAX only records it).

    Args:
      fn: a callable without arguments; its return value is ignored unless it is
        :data:`CONTINUE`.

    Returns:
      ``fn`` (so it works as a decorator).

    Raises:
      TypeError: ``fn`` is not callable.
      ValueError: called from a thread other than the main one (signal handlers can only
        be installed there).

    Example:
      >>> import signal
      >>> previous = signal.getsignal(signal.SIGTERM)
      >>> _ = on_termination(lambda: print("saving"))
      >>> signal.getsignal(signal.SIGTERM).__name__
      '_on_sigterm'
      >>> _ = signal.signal(signal.SIGTERM, previous); _callbacks.clear()
    """
    global _previous_sigterm
    if not callable(fn):
        raise TypeError(
            f"on_termination(fn={fn!r}): fn must be a callable without arguments, e.g. "
            "lambda: mgr.save(step, model, optimizer)."
        )
    if threading.current_thread() is not _main:
        raise ValueError(
            f"on_termination(fn={fn!r}) was called from thread "
            f"{threading.current_thread().name!r}; signal handlers can only be installed "
            "from the main thread. Register the callback there."
        )
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        _previous_sigterm = current if current is not None else signal.SIG_DFL
        _warn_if_jax_owns_sigterm()
        signal.signal(signal.SIGTERM, _on_sigterm)
    _callbacks.append(fn)
    return fn


def _warn_if_jax_owns_sigterm() -> None:
    # jax.distributed.is_initialized() does not start a backend (process_count() would).
    if jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service:
        logger.warning(
            "on_termination: jax.distributed.initialize started JAX's preemption notifier, "
            "which owns SIGTERM; the termination callbacks take it over, so "
            "multihost_utils.reached_preemption_sync_point will not see SIGTERM. Use one "
            "of the two."
        )

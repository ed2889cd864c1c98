"""The ``jfleet`` logger: each record reaches every handler once, and prints once.

Every module logs through ``logging.getLogger("jfleet")`` (or a child of it);
``fleet.init(log_level=...)`` sets its level and gives it a console handler that prints
``[jfleet INFO] ...``. The level also applies to the loggers of JAX, absl and Orbax, never
below ``WARNING``, so ``log_level="ERROR"`` quiets them too.

Where the records go. Logging's advice for libraries is to add no handler and let records
propagate to the application's. jfleet keeps that advice for every handler the application
(or a tool such as pytest) adds: each gets each record exactly once. It differs in one
place, for a reason: absl calls ``logging.basicConfig()`` on its first log call when the root
logger has no handler, and Orbax logs through absl when it is imported, so nearly every
jfleet process has a root console handler that nobody configured, printing
``INFO:jfleet:...``. The ``jfleet`` logger therefore does not propagate; instead:

* the handlers on the ``jfleet`` logger itself (its console handler; a capture handler
  that pytest attaches to non-propagating loggers) see the record there;
* a forwarding handler hands it to every root handler not already on the ``jfleet``
  logger, except a *default console handler*: a stream on stderr / stdout whose format is
  ``logging.BASIC_FORMAT`` (what a bare ``basicConfig()`` makes, absl's included);
* jfleet's console handler prints unless the application gave the root logger a console
  handler of its own format, which then prints the record in that format.

So a record prints once on the console (as ``[jfleet INFO]`` unless the application chose
its own format) and reaches each file, capture or custom handler once.

Example:
  >>> from jfleet.runtime.log import logger, set_log_level
  >>> set_log_level("WARNING")
  >>> logging.getLogger("jax").level >= logging.WARNING
  True
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("jfleet")

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Libraries whose loggers follow jfleet's level (never below WARNING).
QUIETED = ("jax", "absl", "orbax", "etils")


def _is_console(handler: logging.Handler) -> bool:
    """Whether ``handler`` writes to the process's stderr or stdout."""
    stream = getattr(handler, "stream", None)
    consoles = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    return isinstance(handler, logging.StreamHandler) and any(stream is s for s in consoles)


def _is_default_console(handler: logging.Handler) -> bool:
    """A console handler in ``basicConfig()``'s default format (absl installs one unasked)."""
    fmt = getattr(handler.formatter, "_fmt", None)
    return _is_console(handler) and fmt in (None, logging.BASIC_FORMAT)


def _app_console_present() -> bool:
    """Whether the application gave the root logger a console handler of its own format."""
    return any(_is_console(h) and not _is_default_console(h) for h in logging.getLogger().handlers)


class _Console(logging.StreamHandler):
    """jfleet's console line, ``[jfleet LEVEL] message``, unless the application prints it."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("[jfleet %(levelname)s] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not _app_console_present():
            super().emit(record)


class _ToRootHandlers(logging.Handler):
    """Hands a record to each root handler that has not seen it and is no default console."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger().handlers:
            if handler in logger.handlers or _is_default_console(handler):
                continue
            if record.levelno >= handler.level:
                handler.handle(record)


def set_log_level(level: str | int) -> None:
    """Sets the level of the ``jfleet`` logger (and JAX's, absl's, Orbax's, at least WARNING).

    The first call gives the ``jfleet`` logger its console handler (stderr,
    ``[jfleet LEVEL] message``) and its forwarder to the root logger's handlers: every
    handler sees each record once, and the console prints it once (the module docstring
    says how).

    Args:
      level: a level name (``"DEBUG"``, ``"INFO"``, ``"WARNING"``, ``"ERROR"``,
        ``"CRITICAL"``, any case) or a ``logging`` integer level.

    Raises:
      ValueError: an unknown level name.
      TypeError: neither a string nor an int.

    Example:
      >>> set_log_level("ERROR")
      >>> logging.getLogger("absl").level
      40
      >>> set_log_level("INFO")
    """
    if isinstance(level, bool) or not isinstance(level, (str, int)):
        raise TypeError(
            f"log_level={level!r} ({type(level).__name__}) is not a level; expected one of "
            f"{_LEVELS} or a logging integer level."
        )
    if isinstance(level, str):
        name = level.upper()
        if name not in _LEVELS:
            raise ValueError(f"log_level={level!r} is not a level; expected one of {_LEVELS}.")
        level = getattr(logging, name)
    logger.setLevel(level)
    for name in QUIETED:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    if not any(getattr(h, "_jfleet", False) for h in logger.handlers):
        for h in (_Console(), _ToRootHandlers()):
            h._jfleet = True  # type: ignore[attr-defined]
            logger.addHandler(h)
        logger.propagate = False

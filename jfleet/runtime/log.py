"""The ``jfleet`` logger: each record printed once, and JAX's chatter kept at the same level.

Every module logs through ``logging.getLogger("jfleet")`` (or a child of it);
``fleet.init(log_level=...)`` sets its level. Its one console handler prints
``[jfleet INFO] ...``; the logger then stops propagating to the root logger's console
handlers (which a library such as Orbax may have installed with ``logging.basicConfig``,
printing every record a second time as ``INFO:jfleet:...``) but still hands each record to
the root's other handlers (log files, pytest's ``caplog``). The level also applies to the
loggers of JAX, absl and Orbax, never below ``WARNING``, so ``log_level="ERROR"`` quiets
them too.

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
    stream = getattr(handler, "stream", None)
    consoles = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    return isinstance(handler, logging.StreamHandler) and any(stream is s for s in consoles)


class _ToRootHandlers(logging.Handler):
    """Hands a record to the root logger's handlers that do not print to the console."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger().handlers:
            if not _is_console(handler) and record.levelno >= handler.level:
                handler.handle(record)


def set_log_level(level: str | int) -> None:
    """Sets the level of the ``jfleet`` logger (and JAX's, absl's, Orbax's, at least WARNING).

    The first call gives the ``jfleet`` logger its one console handler (stderr,
    ``[jfleet LEVEL] message``); records still reach the root logger's file and capture
    handlers, never its console ones (so nothing prints twice).

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
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[jfleet %(levelname)s] %(message)s"))
        forward = _ToRootHandlers()
        for h in (handler, forward):
            h._jfleet = True  # type: ignore[attr-defined]
            logger.addHandler(h)
        logger.propagate = False

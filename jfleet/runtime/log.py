"""The ``jfleet`` logger.

Every module logs through ``logging.getLogger("jfleet")`` (or a child of it);
``fleet.init(log_level=...)`` sets its level.

Example:
  >>> from jfleet.runtime.log import logger, set_log_level
  >>> set_log_level("WARNING")
"""

from __future__ import annotations

import logging

logger = logging.getLogger("jfleet")

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def set_log_level(level: str | int) -> None:
    """Sets the level of the ``jfleet`` logger and gives it a stderr handler once.

    Args:
      level: a level name (``"DEBUG"``, ``"INFO"``, ``"WARNING"``, ``"ERROR"``,
        ``"CRITICAL"``, any case) or a ``logging`` integer level.

    Raises:
      ValueError: an unknown level name.
      TypeError: neither a string nor an int.
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
    if not any(getattr(h, "_jfleet", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[jfleet %(levelname)s] %(message)s"))
        handler._jfleet = True  # type: ignore[attr-defined]
        logger.addHandler(handler)

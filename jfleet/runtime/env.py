"""jfleet's settings read from the environment: the ``JFLEET_*`` seconds, one parser.

The start-up, heartbeat, shutdown, consistency, step, peer and kill-grace timeouts all come
from variables; :func:`seconds` reads each, with the default when unset and one wording
for a bad value.

Example:
  >>> seconds("JFLEET_STEP_TIMEOUT", 1800.0, env={"JFLEET_STEP_TIMEOUT": "60"})
  60.0
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping


def seconds(
    name: str,
    default: float,
    *,
    env: Mapping[str, str] | None = None,
    whole: bool = False,
    allow_zero: bool = False,
) -> float:
    """``$name`` as seconds (``default`` when unset or empty).

    Args:
      name: the variable.
      default: its value when unset.
      env: where to read it (default ``os.environ``).
      whole: a whole number is required (returned as an ``int``).
      allow_zero: 0 is accepted (else the value must be positive).

    Raises:
      ValueError: the value is not a finite number of that kind; the message names the
        variable, the value and the fix.

    Example:
      >>> seconds("JFLEET_INIT_TIMEOUT", 300, env={}, whole=True)
      300
    """
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        value = math.nan
    if not (value >= 0 if allow_zero else value > 0) or math.isinf(value):
        kind = "whole number" if whole else "number"
        what = f"a {kind} of seconds >= 0" if allow_zero else f"a positive {kind} of seconds"
        raise ValueError(
            f"{name}={raw!r} is not {what}; set it to e.g. {name}={default:g}, or unset it "
            f"for the default ({default:g})."
        )
    return value

"""The one way a Paddle name that has nothing to do under SPMD says so: logged once.

Example:
  >>> log_noop("fused_allreduce_gradients", "gradients are already summed")
"""

from __future__ import annotations

from jfleet.runtime.log import logger

_logged: set[str] = set()


def log_noop(name: str, reason: str) -> None:
    """Logs at INFO, once per process and ``name``, that ``name`` does nothing and why."""
    if name not in _logged:
        _logged.add(name)
        logger.info("%s does nothing under SPMD: %s", name, reason)

"""Paddle's ``fleet.utils.log_util``: the fleet logger (jfleet's ``"jfleet"`` logger).

Example:
  >>> logger.name
  'jfleet'
"""

from jfleet._logging import logger as logger
from jfleet._logging import set_log_level as set_log_level

__all__ = ["logger", "set_log_level"]

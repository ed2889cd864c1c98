"""Paddle's ``fleet.utils.log_util``: the fleet logger (jfleet's ``"jfleet"`` logger).

Example:
  >>> logger.name
  'jfleet'
"""

from jfleet.runtime.log import logger as logger
from jfleet.runtime.log import set_log_level as set_log_level

__all__ = ["logger", "set_log_level"]

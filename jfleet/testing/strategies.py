"""Strategies from keywords, the fixture every test and benchmark of a parallel mode starts from.

Example:
  >>> s = make_strategy({"dp_degree": 2, "mp_degree": 4}, amp=True)
  >>> s.hybrid_configs["mp_degree"], s.amp
  (4, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jfleet.training.strategy import DistributedStrategy

__all__ = ["make_strategy"]


def make_strategy(hybrid: Mapping[str, Any] | None = None, **settings: Any) -> DistributedStrategy:
    """A ``DistributedStrategy`` with ``hybrid_configs=hybrid`` and each setting assigned.

    Args:
      hybrid: the ``hybrid_configs`` to set (merged into the defaults), or None.
      **settings: strategy attributes, e.g. ``amp=True``,
        ``sharding_configs={"stage": 2}``, ``pipeline_configs={...}``.

    Raises:
      The strategy's own errors for unknown names or bad values.

    Example:
      >>> make_strategy({"dp_degree": 2}, amp=True).amp
      True
    """
    strategy = DistributedStrategy()
    if hybrid:
        strategy.hybrid_configs = dict(hybrid)
    for name, value in settings.items():
        setattr(strategy, name, value)
    return strategy

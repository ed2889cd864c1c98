"""Paddle's ``paddle.distributed.fleet.recompute`` package: the functional recompute forms.

Example:
  >>> from jfleet.fleet.recompute import recompute, recompute_hybrid, recompute_sequential
  >>> recompute.__name__
  'recompute'
"""

from jfleet.parallel.recompute import recompute as recompute
from jfleet.parallel.recompute import recompute_hybrid as recompute_hybrid
from jfleet.parallel.recompute import recompute_sequential as recompute_sequential

__all__ = ["recompute", "recompute_hybrid", "recompute_sequential"]

"""Paddle's ``paddle.distributed.fleet.utils``: recompute and the hybrid-parallel helpers.

``from jfleet.fleet.utils import recompute`` is Paddle's most used Fleet import
(``paddle.distributed.fleet`` → ``jfleet.fleet``). The submodules carry Paddle's names:
:mod:`~jfleet.fleet.utils.sequence_parallel_utils`,
:mod:`~jfleet.fleet.utils.hybrid_parallel_util`,
:mod:`~jfleet.fleet.utils.mix_precision_utils`, :mod:`~jfleet.fleet.utils.log_util`.

Example:
  >>> from jfleet.fleet.utils import recompute, sequence_parallel_utils
  >>> recompute.__module__, sequence_parallel_utils.ScatterOp.__name__
  ('jfleet.parallel.recompute', 'ScatterOp')
"""

from jfleet.fleet.utils import hybrid_parallel_util as hybrid_parallel_util
from jfleet.fleet.utils import log_util as log_util
from jfleet.fleet.utils import mix_precision_utils as mix_precision_utils
from jfleet.fleet.utils import sequence_parallel_utils as sequence_parallel_utils
from jfleet.parallel.recompute import is_in_recompute as is_in_recompute
from jfleet.parallel.recompute import recompute as recompute
from jfleet.parallel.recompute import recompute_hybrid as recompute_hybrid
from jfleet.parallel.recompute import recompute_sequential as recompute_sequential

__all__ = [
    "hybrid_parallel_util",
    "is_in_recompute",
    "log_util",
    "mix_precision_utils",
    "recompute",
    "recompute_hybrid",
    "recompute_sequential",
    "sequence_parallel_utils",
]

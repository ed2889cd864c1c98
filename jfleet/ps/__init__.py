"""Parameter-server mode as SPMD: sparse embedding tables sharded over the devices.

An operational subsystem (beside ``checkpoint`` and ``launch``, none importing another).

May import: runtime, mesh, optim, parallel, models, precision, training, auto_parallel.

:mod:`~jfleet.ps.table` (the table: pull / push kernels), :mod:`~jfleet.ps.accessor`
(Paddle's ``CtrCommonAccessor``: statistics and sparse SGD rules), :mod:`~jfleet.ps.hashing`
(feature ids to rows), :mod:`~jfleet.ps.lifecycle` (``set_date``, ``shrink``),
:mod:`~jfleet.ps.storage` (save / load modes, the cache), :mod:`~jfleet.ps.registry` (tables
by id) and :mod:`~jfleet.ps.role_maker` (Paddle's PS roles: every process a worker and a
server). ``fleet.init(is_collective=False)`` and ``fleet``'s PS methods sit on top.

Example:
  >>> import numpy as np
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=False, log_level="WARNING")
  >>> table = SparseTable(1 << 12, 8, CtrAccessor(SparseSGDRule("adam")))
  >>> table.lookup(np.array([2**40 + 7])).shape
  (1, 8)
"""

from jfleet.ps.accessor import CtrAccessor as CtrAccessor
from jfleet.ps.accessor import SparseSGDRule as SparseSGDRule
from jfleet.ps.hashing import SparseBatch as SparseBatch
from jfleet.ps.hashing import hash_ids as hash_ids
from jfleet.ps.hashing import prepare as prepare
from jfleet.ps.lifecycle import set_date as set_date
from jfleet.ps.lifecycle import shrink as shrink
from jfleet.ps.role_maker import PSRoleMaker as PSRoleMaker
from jfleet.ps.storage import load_table as load_table
from jfleet.ps.storage import save_cache as save_cache
from jfleet.ps.storage import save_cache_table as save_cache_table
from jfleet.ps.storage import save_table as save_table
from jfleet.ps.table import SparseTable as SparseTable
from jfleet.ps.table import TableState as TableState

__all__ = [
    "CtrAccessor",
    "PSRoleMaker",
    "SparseBatch",
    "SparseSGDRule",
    "SparseTable",
    "TableState",
    "hash_ids",
    "load_table",
    "prepare",
    "save_cache",
    "save_cache_table",
    "save_table",
    "set_date",
    "shrink",
]

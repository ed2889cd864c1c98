"""Parameter-server mode as SPMD: sparse tables sharded over the devices.

See :mod:`jfleet.ps.table` (the table), :mod:`jfleet.ps.accessor` (Paddle's
``CtrCommonAccessor``), :mod:`jfleet.ps.hashing` (ids to rows), :mod:`jfleet.ps.lifecycle`
(``set_date``, ``shrink``), :mod:`jfleet.ps.storage` (save / load / cache) and
:mod:`jfleet.ps.role_maker` (Paddle's PS role variables).
"""

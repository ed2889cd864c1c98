"""Stage 3 of ``to_distributed``: search the layouts.

Takes in: the matched model, a workload and a cluster (devices, nodes, a profile, or a
cluster you are not on, described by :mod:`~jfleet.auto_parallel.search.cluster_plan`).
Gives out: a :class:`~jfleet.auto_parallel.search.plan.Plan`: the cheapest layout that
fits, each parameter's ``PartitionSpec``, the predicted time and memory, and every other
candidate with the reason it lost.

* ``layouts``: every layout the model's shapes allow, and why the other meshes are out.
* ``planner``: cost each one and choose (:func:`~jfleet.auto_parallel.search.planner.plan_for`).
* ``plan``: the result as data, a table and JSON; ``cluster_plan``, ``model_shapes``:
  planning abstract models offline.

May import: the layers below ``auto_parallel``; the match and cost stages.

Example:
  >>> from jfleet.auto_parallel.search.planner import plan_for
  >>> from jfleet.models.llama import TinyLlama
  >>> plan_for(TinyLlama(), device_num=8, batch_size=64, seq_len=8).layout.name
  'dp8'
"""

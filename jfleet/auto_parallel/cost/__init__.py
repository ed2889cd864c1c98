"""Stage 2 of ``to_distributed``: cost a layout.

Takes in: the matched model (:class:`~jfleet.auto_parallel.match.matched.ModelPatterns`),
a :class:`~jfleet.auto_parallel.cost.layout.Layout` (mesh degrees, ZeRO stage, schedule,
recompute), a :class:`~jfleet.auto_parallel.cost.layout.Workload` and a hardware profile.
Gives out: a :class:`~jfleet.auto_parallel.cost.cost_model.Candidate`: per-device memory,
collective bytes and step time, each with its terms, and why a layout does not fit.

* ``layout``: the inputs; ``profiles``: the hardware (emulated CPU, A100, H100, H200, ...).
* ``step_shape``, ``step_work``, ``memo``: what one step of a layout computes and holds.
* ``cost_memory``, ``cost_comm``, ``cost_types``, ``cost_model``: the terms and the sum.
* ``cost_moe``: a mixture of experts' terms (expert weights over ``ep``, their compute, the
  all-to-alls, the expert gradients' reduction).

May import: the layers below ``auto_parallel``; the match stage.

The cost model reads matched patterns; matching never imports the cost model.

Example:
  >>> from jfleet.auto_parallel.cost.cost_model import estimate
  >>> from jfleet.auto_parallel.cost.layout import Layout, Workload
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))
  >>> work = Workload(batch_size=8, seq_len=8)
  >>> tp = estimate(found, work, Layout(dp=2, mp=2), devices_per_node=4)
  >>> dp = estimate(found, work, Layout(dp=4), devices_per_node=4)
  >>> tp.collectives.total > dp.collectives.total
  True
"""

"""Stage 1 of ``to_distributed``: match the model.

Takes in: an unannotated Flax NNX model and one example forward call.
Gives out: :class:`~jfleet.auto_parallel.match.matched.ModelPatterns` (each parameter's
role and tensor-parallel split, the model's sizes and products, its repeated decoder
blocks) and, for those blocks, what each call takes and what becomes of its outputs
(:class:`~jfleet.auto_parallel.match.block_extras.BlockOutputs`, the planning-time
checks of :mod:`~jfleet.auto_parallel.match.block_check`).

* ``dataflow``, ``tag_walk``, ``attention_trace``: trace one forward abstractly and follow
  every projection's dimensions through it.
* ``module_parts``, ``pairs``, ``patterns``, ``matched``: read the parts, the column / row
  pairs and the roles from the module tree and the trace.
* ``block_calls``, ``block_check``, ``block_extras``: how the decoder blocks are called,
  whether they can be stacked, and what they hand on besides the activation.

May import: the layers below ``auto_parallel`` (runtime, mesh, optim, parallel, models,
precision, training), and no other stage: every later stage reads what matching gives.

Example:
  >>> from jfleet.auto_parallel.match.patterns import match_patterns
  >>> from jfleet.models.llama import TinyLlama
  >>> found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))
  >>> found.blocks
  ('layers.0', 'layers.1')
"""

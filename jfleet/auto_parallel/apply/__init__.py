"""Stage 4 of ``to_distributed``: apply the plan.

Takes in: a :class:`~jfleet.auto_parallel.search.plan.Plan` and the model it was made for.
Gives out: the same model object, restructured and placed: its decoder blocks become a
pipelined (:class:`~jfleet.auto_parallel.apply.blocks.PipelinedBlocks`) or scanned
(:class:`~jfleet.auto_parallel.apply.scanned_blocks.ScannedBlocks`) stand-in, recomputed
or sequence-parallel where the plan says, and every parameter is annotated and sharded
(:func:`~jfleet.auto_parallel.apply.apply_plan.apply_plan`).

May import: the layers below ``auto_parallel``; the match, cost and search stages.

Example:
  >>> from flax import nnx
  >>> from jfleet.auto_parallel.apply.scanned_blocks import scan_blocks
  >>> from jfleet.models.llama import TinyLlama
  >>> model = TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2)
  >>> type(scan_blocks(model, "layers")).__name__
  'ScannedBlocks'
"""

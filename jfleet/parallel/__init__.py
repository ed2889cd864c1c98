"""The parallel layer: tensor / sequence-parallel layers, the block stacker, pipelines.

``layers``, ``sequence`` and ``cross_entropy`` are Megatron's column / row / vocabulary-
parallel layers on the fleet's mesh; ``stack`` stacks repeated blocks; ``pipeline_*``,
``stages``, ``segment`` and ``virtual_stages`` build and run pipeline schedules (FThenB,
1F1B, VPP, ZB-H1) in one ``shard_map``; ``layer_gather`` gathers a stacked block's ZeRO-3
weights where it runs (FSDP); ``recompute`` is activation recomputation;
``loss`` the one loss check every step and pipeline shares; ``moe`` the mixture-of-experts
layer over the expert-parallel axis (routing, all-to-all dispatch and combine in ``shard_map``).

May import: runtime, mesh, optim.
"""

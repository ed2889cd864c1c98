"""The training layer: the strategy, the one training-step engine and what it runs on.

``strategy`` (with ``strategy_schema`` and ``prototxt``) is Paddle's
``DistributedStrategy``; ``run`` starts a run (``fleet.init``'s work); ``engine`` is the
one jitted training step; ``replicas`` combines data-parallel replicas' gradients;
``distributed_model`` / ``distributed_optimizer`` apply a strategy to a model and an
optimizer; ``pipeline_parallel`` is Paddle's ``PipelineParallel.train_batch``; ``data``
turns any iterable of batches into sharded global arrays.

May import: runtime, mesh, optim, parallel, models, precision.
"""

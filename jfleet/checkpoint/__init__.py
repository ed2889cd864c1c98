"""Checkpoints on Orbax: save and resume a run across meshes, ZeRO stages and pipelines.

An operational subsystem (beside ``launch`` and ``ps``, none importing another): files a
run writes and reads back, inference artefacts included.

May import: runtime, mesh, optim, parallel, models, precision, training, auto_parallel.

:class:`CheckpointManager` (``manager.py``) saves the model, the optimizer's whole state,
a ``ShardedLoader``'s data position and a description of the run; ``layout.py`` maps the
running layout (``DistributedModel`` wrapper, stacked pipeline bodies) to the one logical
layout on disk (``layers.3.mlp.up_proj.kernel``) and back.

Example:
  >>> from jfleet.checkpoint import CheckpointManager
  >>> CheckpointManager.__name__
  'CheckpointManager'
"""

from jfleet.checkpoint.manager import CheckpointManager as CheckpointManager

__all__ = ["CheckpointManager"]

"""The precision layer: what numbers a step computes in, and what it does when they break.

AMP O1 / O2 in fp16 and bf16 (``amp``, Paddle's ``paddle.amp``), dynamic loss scaling
(``grad_scaler``: ``GradScaler``), quantisation-aware training (``quantization``), the
batch-norm policy (``batch_norm``: sync BN) and the non-finite guard (``nonfinite``).
``scalable`` states what they need of an optimizer, so this layer never imports the
training layer's ``DistributedOptimizer``.

May import: runtime, mesh, optim, parallel.
"""

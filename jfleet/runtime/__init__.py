"""The run-time layer: processes and their faults, below everything else.

What a process needs before any mesh exists: environment parsing (``env``), the
``jfleet`` logger (``log``), Paddle's role makers and ``jax.distributed`` start-up
(``role_maker``), the coordination service's key-value store (``coordination``), the job
watchdog (``watchdog``), cross-process consistency checks (``consistency``) and
termination signals (``interrupts``).

May import: nothing of jfleet (the standard library, NumPy and JAX only).
"""

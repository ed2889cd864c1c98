"""The mesh layer: one hybrid mesh, its axis names, the current run, placement, collectives.

``topology`` holds the one axis vocabulary (``dp``, ``pp``, ``sharding``, ``sep``,
``mp``) and Paddle's ``CommunicateTopology`` / ``HybridCommunicateGroup``; ``context`` the
current run that ``fleet.init`` starts; ``layer_mesh`` the mesh parallel layers are built
on; ``placement`` where parameters and batches go; ``lazy`` (Paddle's ``LazyGuard``) and
``create`` make a model that was never whole directly in its layout; ``collective`` and
``group_collective`` Paddle's collectives as mesh-axis operations; ``collective_perf``
times them (``python -m jfleet.collective_perf``).

May import: runtime.
"""

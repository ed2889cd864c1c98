"""Benchmarks of jfleet (run as scripts: ``python benchmarks/zero_memory.py``)."""

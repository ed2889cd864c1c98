"""The job watchdog (skeleton: filled in by issue 14's watchdog work).

The engine tells it when a step starts and when its outputs are dispatched; with several
processes it watches peers through :mod:`jfleet._coordination`. In a single process every
function here returns at once.

Example:
  >>> step_started("train"); step_dispatched("train", None)
"""

from __future__ import annotations

from typing import Any


def start() -> None:
    """Starts watching this multi-process job (``initialize_distributed`` calls it)."""


def step_started(kind: str) -> None:
    """The engine is about to prepare and dispatch a ``kind`` ("train" / "eval") step."""


def step_dispatched(kind: str, outputs: Any) -> None:
    """The engine dispatched a ``kind`` step whose results are ``outputs`` (arrays)."""

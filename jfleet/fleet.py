"""Placeholder while the package is being laid out; replaced in this change."""

_STATE = None


def _reset() -> None:
    global _STATE
    _STATE = None

"""The non-finite guard: what a training step does when its loss or a gradient is inf / nan.

``DistributedStrategy().nonfinite`` (a jfleet setting) or ``make_train_step(loss_fn,
nonfinite=...)`` picks one of :data:`MODES`:

- ``"warn"`` (default): the step updates as usual (a NaN reaches the parameters); the
  first non-finite step of a train step is logged as a warning with its step number, and
  every one is counted (``TrainStep.nonfinite_steps``). No host sync: a step's flag is
  read at a later call, once more than ``Guard.depth`` (8) flags wait.
- ``"skip"``: the update is dropped on device: parameters and optimizer state (its update
  count included) stay bit-identical; logged once and counted as for ``"warn"``.
- ``"raise"``: the update is dropped as for ``"skip"`` and :class:`NonFiniteError` is
  raised after the step, naming the step and the first non-finite leaf (``loss``, or a
  gradient path). It reads the step's flag on the host, so each step waits for the
  previous one to finish (one sync per step).

The check runs on the loss and every gradient before the update, with the found-inf
reduction of fp16 loss scaling (:func:`jfleet.optim.loss_scale.finite_flags`). With loss
scaling on, overflowing gradients are the scaler's business (it skips the update and lowers
the scale, as Paddle's AMP does), so the guard checks the loss only: a non-finite loss is
counted, warned about or raised on; its update is skipped by the scaler in every mode.

Step numbers count the calls of one train step object (``train_batch`` shares one per loss
function and placement), from 1.

Example:
  >>> check_mode("skip", "nonfinite")
  'skip'
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from jfleet.runtime.log import logger

__all__ = ["MODES", "NonFiniteError", "check_mode"]

MODES = ("warn", "skip", "raise")
"""What a step does with a non-finite loss or gradient (see the module docstring)."""

_COMMON_CAUSE = (
    "Common causes: a learning rate too high (divergence), log or sqrt of a non-positive "
    "value, or token ids >= the vocabulary size: nnx.Embed returns NaN rows for "
    "out-of-range ids, which makes the loss NaN."
)


class NonFiniteError(FloatingPointError):
    """A train step with ``nonfinite="raise"`` saw an inf / nan loss or gradient.

    Attributes:
      step: the step number (calls of this train step, from 1).
      leaf: the first non-finite leaf: ``"loss"`` or a gradient path such as
        ``"grads['blocks'][0]['mlp']['kernel']"``.

    Example:
      >>> issubclass(NonFiniteError, FloatingPointError)  # catch either
      True
    """

    def __init__(self, step: int, leaf: str) -> None:
        self.step, self.leaf = step, leaf
        super().__init__(
            f"non-finite value at step {step}: {leaf} is inf or nan (the first such leaf of "
            "the loss and gradients). The step's update was skipped: parameters and "
            f"optimizer state are those from before step {step}. {_COMMON_CAUSE} Pass "
            "nonfinite='skip' to drop such steps and go on, or 'warn' to only log them."
        )


def check_mode(value: Any, where: str) -> str:
    """``value`` if it is one of :data:`MODES`; else an error naming ``where`` it was given.

    Raises:
      ValueError: ``value`` is not one of the three modes.

    Example:
      >>> check_mode("warn", "make_train_step(nonfinite=...)")
      'warn'
    """
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(
            f"{where}={value!r} is not a non-finite mode; expected one of "
            f"{', '.join(map(repr, MODES))} (default 'warn')."
        )
    return value


def leaf_names(paths: list) -> list[str]:
    """Readable names of the ``(loss, grads)`` leaves at ``paths`` (key paths, in flag order).

    Example:
      >>> import jax
      >>> paths = [p for p, _ in jax.tree_util.tree_flatten_with_path((1.0, {"w": [2.0]}))[0]]
      >>> leaf_names(paths)
      ['loss', "grads['w'][0]"]
    """
    names = []
    for head, *rest in paths:
        rest = tuple(k for k in rest if not isinstance(k, jax.tree_util.GetAttrKey))
        names.append("loss" if head.idx == 0 else "grads" + jax.tree_util.keystr(rest))
    return names


class Guard:
    """The host side of the guard for one train step: counts, warns once, raises.

    Flags of ``"warn"`` and ``"skip"`` steps wait in a short queue: once more than
    ``depth`` wait, the oldest is read (blocking) and every other one that is ready, so
    the host runs at most ``depth`` steps ahead of the device and reads flags in batches
    (a read can wait for the step the device runs now).
    """

    depth = 8

    def __init__(self) -> None:
        self.calls = 0
        self._count = 0
        self._warned = False
        self._pending: collections.deque = collections.deque()

    def record(self, mode: str, flags: jax.Array, names: list[str]) -> None:
        """Takes step ``calls + 1``'s per-leaf finite flags; raises in ``"raise"`` mode."""
        self.calls += 1
        if mode == "raise":
            self._read(self.calls, flags, names, mode)
            return
        self._pending.append((self.calls, flags, names, mode))
        self.drain(block=False)

    def drain(self, block: bool) -> None:
        """Reads the waiting flags that are ready (all of them with ``block=True``)."""
        pending = self._pending
        if not block and len(pending) <= self.depth:
            return  # reading a flag can wait for the step running now: read them in batches
        taken = []
        while pending and (block or len(pending) > self.depth or pending[0][1].is_ready()):
            taken.append(pending.popleft())
        values = jax.device_get([flags for _, flags, _, _ in taken])  # one transfer
        for (step, _, names, mode), flags in zip(taken, values, strict=True):
            self._read(step, flags, names, mode)

    @property
    def count(self) -> int:
        self.drain(block=True)
        return self._count

    def _read(self, step: int, flags: jax.Array, names: list[str], mode: str) -> None:
        flags = np.asarray(flags)
        if flags.all():
            return
        self._count += 1
        leaf = names[int(np.argmin(flags))]
        if mode == "raise":
            raise NonFiniteError(step, leaf)
        if not self._warned:
            self._warned = True
            what = "its update was skipped" if mode == "skip" else "the update was applied"
            logger.warning(
                "non-finite value at step %d: %s is inf or nan; %s (nonfinite=%r). "
                "Logged once; TrainStep.nonfinite_steps counts them. %s",
                step,
                leaf,
                what,
                mode,
                _COMMON_CAUSE,
            )

"""Paddle's learning-rate schedulers (``paddle.optimizer.lr``), stepped on the host.

Each class has Paddle's name, arguments, defaults and formula. A scheduler is a small
host-side object: ``last_epoch`` counts ``step()`` calls (it starts at 0 after
construction, as in Paddle), ``last_lr`` (also ``scheduler()``) is the learning rate
for the current epoch, ``get_lr()`` computes it, ``state_dict()`` /
``set_state_dict()`` save and restore it.

How it reaches the optimizer: pass it to ``train_batch(..., lr_scheduler=scheduler)``
(each step applies ``last_lr``, then calls ``scheduler.step()``), or write it yourself
with ``opt.set_lr(scheduler())`` after ``scheduler.step()``. The learning rate is then a
value in the optimizer state, so changing it never recompiles the step.

A scheduler is **not** an optax schedule: ``optax.adam(StepDecay(...))`` would call it
with the step count inside the compiled step, where a host object cannot run; it
raises a ``TypeError`` that says so. For a schedule inside the optimizer use an optax
schedule (``optax.piecewise_constant_schedule``, ``optax.cosine_decay_schedule``...).

Example:
  >>> s = StepDecay(learning_rate=0.5, step_size=2, gamma=0.1)
  >>> lrs = []
  >>> for _ in range(5):
  ...     lrs.append(round(s(), 6))
  ...     s.step()
  >>> lrs
  [0.5, 0.5, 0.05, 0.05, 0.005]
"""

from __future__ import annotations

import itertools
import math
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "CosineAnnealingDecay",
    "ExponentialDecay",
    "LRScheduler",
    "LambdaDecay",
    "LinearWarmup",
    "MultiStepDecay",
    "NoamDecay",
    "PiecewiseDecay",
    "PolynomialDecay",
    "StepDecay",
]


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}({name}={value!r}): {name} must be a number (int or float).")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{owner}({name}={value!r}): {name} must be finite.")
    return value


def _positive_int(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(
            f"{owner}({name}={value!r}): {name} must be a positive int (a number of steps), "
            f"e.g. {name}=100."
        )
    return int(value)


class LRScheduler:
    """Paddle's scheduler base class: subclasses define :meth:`get_lr`.

    Args:
      learning_rate: the base learning rate (``base_lr``), >= 0.
      last_epoch: the epoch to start after; -1 (default) starts at epoch 0.
      verbose: print the learning rate at every ``step``.

    Raises:
      TypeError: ``learning_rate`` is not a number. ValueError: it is negative.
    """

    def __init__(self, learning_rate: float = 0.1, last_epoch: int = -1, verbose: bool = False):
        lr = _number(type(self).__name__, "learning_rate", learning_rate)
        if lr < 0:
            raise ValueError(
                f"{type(self).__name__}(learning_rate={learning_rate!r}): the learning rate "
                "must be >= 0."
            )
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, numbers.Integral):
            raise TypeError(
                f"{type(self).__name__}(last_epoch={last_epoch!r}): last_epoch must be an int "
                "(-1 to start from the beginning)."
            )
        self.base_lr = lr
        self.last_lr = lr
        self.last_epoch = int(last_epoch)
        self.verbose = verbose
        self.step()

    def __call__(self, *count: Any) -> float:
        """The learning rate of the current epoch (``last_lr``)."""
        if count:
            raise TypeError(
                f"{type(self).__name__} was called with a step count, as an optax learning-rate "
                "schedule is (e.g. optax.adam(scheduler)); a Paddle-style scheduler is stepped "
                "on the host instead. Pass it to train_batch(..., lr_scheduler=scheduler) or "
                "call opt.set_lr(scheduler()) after scheduler.step(); for a schedule inside "
                "the optimizer use an optax schedule (optax.piecewise_constant_schedule, ...)."
            )
        return self.last_lr

    def step(self, epoch: int | None = None) -> None:
        """Moves to the next epoch (or to ``epoch``) and computes ``last_lr``."""
        if epoch is None:
            self.last_epoch += 1
            self.last_lr = self.get_lr()
        else:
            self.last_epoch = int(epoch)
            closed = getattr(self, "_get_closed_form_lr", None)
            self.last_lr = closed() if closed is not None else self.get_lr()
        if self.verbose:
            print(
                f"Epoch {self.last_epoch}: {type(self).__name__} set learning rate to "
                f"{self.last_lr}."
            )

    def get_lr(self) -> float:
        """The learning rate at ``last_epoch``; subclasses define it."""
        raise NotImplementedError(f"{type(self).__name__} must define get_lr().")

    def state_keys(self) -> None:
        """Sets ``self.keys``, the attributes :meth:`state_dict` saves."""
        self.keys = ["last_epoch", "last_lr"]

    def state_dict(self) -> dict[str, Any]:
        """``last_epoch`` and ``last_lr`` (Paddle's keys)."""
        self.state_keys()
        return {key: self.__dict__[key] for key in self.keys if key in self.__dict__}

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output.

        Raises:
          RuntimeError: a key is missing (Paddle's error).
        """
        self.state_keys()
        for key in self.keys:
            if key not in state_dict:
                raise RuntimeError(
                    f"{type(self).__name__}.set_state_dict: can't find [ {key} ] in state_dict "
                    f"(keys {sorted(state_dict)}); pass what state_dict() returned."
                )
            self.__dict__[key] = state_dict[key]
        if len(state_dict) > len(self.keys):
            warnings.warn(
                "There are some unused values in state_dict; the scheduler that saved it may "
                "differ from this one.",
                stacklevel=2,
            )

    set_dict = set_state_dict


class NoamDecay(LRScheduler):
    """``lr = learning_rate * d_model**-0.5 * min(epoch**-0.5, epoch * warmup_steps**-1.5)``.

    Example:
      >>> s = NoamDecay(d_model=16, warmup_steps=2)
      >>> s.step(); round(s(), 6)
      0.088388
    """

    def __init__(
        self,
        d_model: float,
        warmup_steps: int,
        learning_rate: float = 1.0,
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        if _number("NoamDecay", "d_model", d_model) <= 0:
            raise ValueError(f"NoamDecay(d_model={d_model!r}): d_model must be > 0.")
        self.d_model = d_model
        self.warmup_steps = _positive_int("NoamDecay", "warmup_steps", warmup_steps)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        a = 1 if self.last_epoch == 0 else self.last_epoch**-0.5
        b = self.warmup_steps**-1.5 * self.last_epoch
        return self.base_lr * (self.d_model**-0.5) * min(a, b)


class PiecewiseDecay(LRScheduler):
    """``values[i]`` while ``epoch < boundaries[i]``, the last value after.

    Example:
      >>> s = PiecewiseDecay(boundaries=[2], values=[1.0, 0.5])
      >>> [s()] + [(s.step(), s())[1] for _ in range(2)]
      [1.0, 1.0, 0.5]
    """

    def __init__(
        self,
        boundaries: Sequence[int],
        values: Sequence[float],
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        if not isinstance(boundaries, list | tuple) or not isinstance(values, list | tuple):
            raise TypeError(
                f"PiecewiseDecay(boundaries={boundaries!r}, values={values!r}): both must be "
                "lists or tuples."
            )
        if len(values) != len(boundaries) + 1:
            raise ValueError(
                f"PiecewiseDecay: {len(values)} values for {len(boundaries)} boundaries; "
                f"values must have one more element than boundaries (got values={values!r})."
            )
        self.boundaries = list(boundaries)
        self.values = [_number("PiecewiseDecay", "values", v) for v in values]
        super().__init__(last_epoch=last_epoch, verbose=verbose)

    def get_lr(self) -> float:
        for boundary, value in zip(self.boundaries, self.values, strict=False):
            if self.last_epoch < boundary:
                return value
        return self.values[-1]


class PolynomialDecay(LRScheduler):
    """Polynomial decay from ``learning_rate`` to ``end_lr`` over ``decay_steps`` (Paddle's
    formula, with ``cycle`` restarting over multiples of ``decay_steps``).

    Example:
      >>> s = PolynomialDecay(1.0, decay_steps=4, end_lr=0.0)
      >>> s.step(2); s()
      0.5
    """

    def __init__(
        self,
        learning_rate: float,
        decay_steps: int,
        end_lr: float = 0.0001,
        power: float = 1.0,
        cycle: bool = False,
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        self.decay_steps = _positive_int("PolynomialDecay", "decay_steps", decay_steps)
        self.end_lr = _number("PolynomialDecay", "end_lr", end_lr)
        if _number("PolynomialDecay", "power", power) <= 0:
            raise ValueError(f"PolynomialDecay(power={power!r}): power must be > 0.")
        self.power = float(power)
        self.cycle = bool(cycle)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        epoch, steps = self.last_epoch, self.decay_steps
        if self.cycle:
            steps = self.decay_steps * (1 if epoch == 0 else math.ceil(epoch / self.decay_steps))
        else:
            epoch = min(epoch, self.decay_steps)
        return (self.base_lr - self.end_lr) * ((1 - epoch / steps) ** self.power) + self.end_lr


class LinearWarmup(LRScheduler):
    """Linear warm-up from ``start_lr`` to ``end_lr`` over ``warmup_steps``, then
    ``learning_rate`` (a number, or a scheduler stepped from 0 after the warm-up).

    Example:
      >>> s = LinearWarmup(StepDecay(0.1, step_size=1, gamma=0.5), 2, start_lr=0.0, end_lr=0.1)
      >>> [round((s(), s.step())[0], 6) for _ in range(4)]
      [0.0, 0.05, 0.1, 0.05]
    """

    def __init__(
        self,
        learning_rate: float | LRScheduler,
        warmup_steps: int,
        start_lr: float,
        end_lr: float,
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        if not isinstance(learning_rate, LRScheduler):
            _number("LinearWarmup", "learning_rate", learning_rate)
        self.learning_rate = learning_rate
        self.warmup_steps = _positive_int("LinearWarmup", "warmup_steps", warmup_steps)
        self.start_lr = _number("LinearWarmup", "start_lr", start_lr)
        self.end_lr = _number("LinearWarmup", "end_lr", end_lr)
        if not self.end_lr > self.start_lr:
            raise ValueError(
                f"LinearWarmup(start_lr={start_lr!r}, end_lr={end_lr!r}): end_lr must be "
                "greater than start_lr."
            )
        super().__init__(start_lr, last_epoch, verbose)

    def state_dict(self) -> dict[str, Any]:
        """The base state, plus the wrapped scheduler's under ``"LinearWarmup_LR"``."""
        state = super().state_dict()
        if isinstance(self.learning_rate, LRScheduler):
            state["LinearWarmup_LR"] = self.learning_rate.state_dict()
        return state

    def set_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the base state and the wrapped scheduler's."""
        own = {k: v for k, v in state_dict.items() if k != "LinearWarmup_LR"}
        super().set_state_dict(own)
        if isinstance(self.learning_rate, LRScheduler):
            self.learning_rate.set_state_dict(state_dict["LinearWarmup_LR"])

    def get_lr(self) -> float:
        if self.last_epoch < self.warmup_steps:
            fraction = self.last_epoch / self.warmup_steps
            return (self.end_lr - self.start_lr) * fraction + self.start_lr
        if isinstance(self.learning_rate, LRScheduler):
            self.learning_rate.step(self.last_epoch - self.warmup_steps)
            return self.learning_rate()
        return float(self.learning_rate)


class ExponentialDecay(LRScheduler):
    """``lr = learning_rate * gamma**epoch``, ``gamma`` in (0, 1).

    Example:
      >>> s = ExponentialDecay(1.0, gamma=0.5)
      >>> s.step(); s.step(); s()
      0.25
    """

    def __init__(
        self, learning_rate: float, gamma: float, last_epoch: int = -1, verbose: bool = False
    ) -> None:
        if not 0.0 < _number("ExponentialDecay", "gamma", gamma) < 1.0:
            raise ValueError(
                f"ExponentialDecay(gamma={gamma!r}): gamma must be in the open interval (0, 1) "
                "so that the learning rate decays."
            )
        self.gamma = float(gamma)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        return self.base_lr * (self.gamma**self.last_epoch)


class MultiStepDecay(LRScheduler):
    """``lr = learning_rate * gamma**i`` after the i-th of the increasing ``milestones``.

    Example:
      >>> s = MultiStepDecay(1.0, milestones=[1, 3], gamma=0.5)
      >>> [(s(), s.step())[0] for _ in range(4)]
      [1.0, 0.5, 0.5, 0.25]
    """

    def __init__(
        self,
        learning_rate: float,
        milestones: Sequence[int],
        gamma: float = 0.1,
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        if not isinstance(milestones, list | tuple):
            raise TypeError(
                f"MultiStepDecay(milestones={milestones!r}): milestones must be a list or tuple "
                "of increasing epochs."
            )
        if any(a >= b for a, b in itertools.pairwise(milestones)):
            raise ValueError(
                f"MultiStepDecay(milestones={milestones!r}): the milestones must be increasing."
            )
        if _number("MultiStepDecay", "gamma", gamma) >= 1.0:
            raise ValueError(f"MultiStepDecay(gamma={gamma!r}): gamma must be < 1.0.")
        self.milestones = list(milestones)
        self.gamma = float(gamma)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        passed = sum(1 for m in self.milestones if self.last_epoch >= m)
        return self.base_lr * (self.gamma**passed)


class StepDecay(LRScheduler):
    """``lr = learning_rate * gamma**(epoch // step_size)``."""

    def __init__(
        self,
        learning_rate: float,
        step_size: int,
        gamma: float = 0.1,
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        if isinstance(step_size, bool) or not isinstance(step_size, numbers.Integral):
            raise TypeError(
                f"StepDecay(step_size={step_size!r}): step_size must be an int (epochs "
                "between decays)."
            )
        self.step_size = _positive_int("StepDecay", "step_size", step_size)
        if _number("StepDecay", "gamma", gamma) >= 1.0:
            raise ValueError(f"StepDecay(gamma={gamma!r}): gamma must be < 1.0.")
        self.gamma = float(gamma)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        return self.base_lr * (self.gamma ** (self.last_epoch // self.step_size))


class LambdaDecay(LRScheduler):
    """``lr = learning_rate * lr_lambda(epoch)``.

    Example:
      >>> s = LambdaDecay(0.5, lr_lambda=lambda epoch: 0.5**epoch)
      >>> s.step(); s()
      0.25
    """

    def __init__(
        self,
        learning_rate: float,
        lr_lambda: Callable[[int], float],
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        if not callable(lr_lambda):
            raise TypeError(
                f"LambdaDecay(lr_lambda={lr_lambda!r}): lr_lambda must be a function of the "
                "epoch, e.g. lambda epoch: 0.95 ** epoch."
            )
        self.lr_lambda = lr_lambda
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        return self.base_lr * self.lr_lambda(self.last_epoch)


class CosineAnnealingDecay(LRScheduler):
    """Cosine annealing from ``learning_rate`` to ``eta_min`` over ``T_max`` epochs (Paddle's
    recursive form when stepped one epoch at a time, the closed form for ``step(epoch)``).

    Example:
      >>> s = CosineAnnealingDecay(1.0, T_max=2)
      >>> [round((s(), s.step())[0], 6) for _ in range(3)]
      [1.0, 0.5, 0.0]
    """

    def __init__(
        self,
        learning_rate: float,
        T_max: int,  # noqa: N803 (Paddle's name)
        eta_min: float = 0,
        last_epoch: int = -1,
        verbose: bool = False,
    ) -> None:
        self.T_max = _positive_int("CosineAnnealingDecay", "T_max", T_max)
        self.eta_min = _number("CosineAnnealingDecay", "eta_min", eta_min)
        super().__init__(learning_rate, last_epoch, verbose)

    def get_lr(self) -> float:
        epoch, t_max, low = self.last_epoch, self.T_max, self.eta_min
        if epoch == 0:
            return self.base_lr
        if (epoch - 1 - t_max) % (2 * t_max) == 0:
            return self.last_lr + (self.base_lr - low) * (1 - math.cos(math.pi / t_max)) / 2
        ratio = (1 + math.cos(math.pi * epoch / t_max)) / (
            1 + math.cos(math.pi * (epoch - 1) / t_max)
        )
        return ratio * (self.last_lr - low) + low

    def _get_closed_form_lr(self) -> float:
        cosine = 1 + math.cos(math.pi * self.last_epoch / self.T_max)
        return self.eta_min + (self.base_lr - self.eta_min) * cosine / 2

"""LocalSGD and adaptive LocalSGD: Paddle's ``strategy.localsgd`` / ``adaptive_localsgd``.

Data-parallel replicas train on their own shards of the batch with their own parameters
and optimizer state, and average their parameters with one collective every ``k``
steps instead of all-reducing gradients every step. The engine runs it
(:func:`jfleet.replicas.localsgd_step`); this module holds the configuration, the state
and Paddle's schedule.

Paddle's schedule (its static-graph ``LocalSGDOptimizer``), with ``step`` counting from 1:

* ``step <= begin_step``: the replicas average after every step (data parallel, in effect);
* after that, they average when ``step - last_sync == k_steps``.

``last_sync`` starts at ``begin_step`` (LocalSGD) or 0 (adaptive), as Paddle's do.
Adaptive LocalSGD records the replicas' mean loss ``loss0`` and the learning rate ``lr0``
of step 1, and at each average after ``begin_step`` sets
``k = ceil(sqrt(lr0 * loss / (lr * loss0) * init_k_steps))`` clamped to ``[1, 16]``
(:func:`adaptive_k_steps`), with ``loss`` the replicas' mean loss of that step and ``lr``
the learning rate the step applied. (Paddle's adaptive optimizer reads ``init_k_steps``
and ``begin_step`` from ``localsgd_configs``, a slip; jfleet reads
``adaptive_localsgd_configs``.)

What the user's model holds: the parameters of the last average (Paddle's "snapshot"),
which every replica starts its next local steps from; the replicas' current parameters
are ``opt.local_state.params``, one row per replica (a leading dimension sharded over the
data axes). Right after an average the two agree. A checkpoint of the model and the
optimizer (``nnx.state(optimizer)`` includes ``local_state`` and the per-replica optimizer
state) resumes exactly, on a mesh with the same number of data-parallel replicas.

Example:
  >>> int(adaptive_k_steps(lr0=0.1, loss0=2.0, lr=0.1, loss=8.0, init_k_steps=1))
  2
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["MAX_K_STEPS", "LocalSGDConfig", "LocalSGDState", "adaptive_k_steps", "sync_due"]

#: Paddle's clamp of the adaptive interval.
MIN_K_STEPS, MAX_K_STEPS = 1, 16


@dataclasses.dataclass(frozen=True)
class LocalSGDConfig:
    """What the strategy asked for.

    Attributes:
      k_steps: the interval between averages (adaptive: ``init_k_steps``).
      begin_step: steps up to this one average after every step.
      adaptive: Paddle's adaptive LocalSGD (``k`` follows the loss).
    """

    k_steps: int
    begin_step: int
    adaptive: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.k_steps, bool) or not isinstance(self.k_steps, int) or self.k_steps < 1:
            raise ValueError(f"k_steps={self.k_steps!r} must be an int >= 1.")
        if isinstance(self.begin_step, bool) or not isinstance(self.begin_step, int):
            raise ValueError(f"begin_step={self.begin_step!r} must be an int >= 0.")
        if self.begin_step < 0:
            raise ValueError(f"begin_step={self.begin_step!r} must be an int >= 0.")

    @property
    def meta_name(self) -> str:
        """Paddle's meta-optimizer name."""
        return "AdaptiveLocalSGDOptimizer" if self.adaptive else "LocalSGDOptimizer"

    @property
    def switch(self) -> str:
        """The strategy switch, for error messages."""
        return "strategy.adaptive_localsgd=True" if self.adaptive else "strategy.localsgd=True"

    def init(self, params: Any) -> LocalSGDState:
        """The state before the first step; ``params`` are the replicas' (stacked) parameters."""
        return LocalSGDState(
            params=params,
            step=jnp.zeros((), jnp.int32),
            last_sync=jnp.asarray(0 if self.adaptive else self.begin_step, jnp.int32),
            k_steps=jnp.asarray(self.k_steps, jnp.int32),
            loss0=jnp.zeros((), jnp.float32),
            lr0=jnp.zeros((), jnp.float32),
        )


class LocalSGDState(NamedTuple):
    """LocalSGD's state (in ``DistributedOptimizer.local_state``).

    Attributes:
      params: each replica's parameters, with a leading replica dimension.
      step: steps taken (Paddle's step counter after the step).
      last_sync: the step of the last average.
      k_steps: the current interval (adaptive: updated at each average).
      loss0: adaptive: the replicas' mean loss at step 1.
      lr0: adaptive: the learning rate at step 1.
    """

    params: Any
    step: jax.Array
    last_sync: jax.Array
    k_steps: jax.Array
    loss0: jax.Array
    lr0: jax.Array


def sync_due(step: jax.Array, last_sync: jax.Array, k_steps: jax.Array, begin_step: int):
    """Whether the replicas average after ``step`` (Paddle's rule, see the module docstring).

    Example:
      >>> [bool(sync_due(s, 1, 3, 1)) for s in (1, 2, 3, 4)]
      [True, False, False, True]
    """
    return jnp.where(step > begin_step, step - last_sync == k_steps, True)


def adaptive_k_steps(lr0: Any, loss0: Any, lr: Any, loss: Any, init_k_steps: int) -> jax.Array:
    """Paddle's adaptive interval ``ceil(sqrt(lr0 * loss / (lr * loss0) * init_k))`` in [1, 16].

    A ratio that is not finite and positive (a zero loss or learning rate) gives
    ``init_k_steps``.

    Example:
      >>> int(adaptive_k_steps(0.1, 1.0, 0.1, 1000.0, 4))
      16
    """
    num = jnp.asarray(lr0, jnp.float32) * jnp.asarray(loss, jnp.float32)
    den = jnp.asarray(lr, jnp.float32) * jnp.asarray(loss0, jnp.float32)
    ratio = num / jnp.where(den == 0, 1.0, den) * init_k_steps
    ok = (den != 0) & jnp.isfinite(ratio) & (ratio > 0)
    k = jnp.ceil(jnp.sqrt(jnp.where(ok, ratio, 1.0)))
    k = jnp.clip(k, MIN_K_STEPS, MAX_K_STEPS).astype(jnp.int32)
    return jnp.where(ok, k, jnp.int32(init_k_steps))

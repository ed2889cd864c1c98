"""Paddle's ``paddle.amp.GradScaler``, in the functional form that fits JAX.

A :class:`GradScaler` holds no scale of its own: it configures the one loss-scale
transform, :func:`jfleet.optim.loss_scale.dynamic_loss_scaling`, attaches it to a
distributed optimizer's chain (before the optimizer's state is made), and reads the
scale and its counters back from the optimizer state. The engine multiplies the loss by
the scale, and the transform unscales the gradients, skips a step with a non-finite
gradient and updates the scale by Paddle's rule, all inside the one compiled step.

How Paddle's imperative calls map:

- ``scaled = scaler.scale(loss); scaled.backward(); scaler.step(opt); scaler.update()``
  (or ``scaler.minimize(opt, scaled)``): ``model.train_batch(batch, opt, loss_fn,
  scaler=scaler)`` does all of it in one compiled step; so does
  ``scaler.minimize(opt, loss_fn, model, batch)``. With gradients you took yourself,
  ``grads = nnx.grad(lambda m: scaler.scale(loss_fn(m, batch)))(model)`` then
  ``scaler.step(opt, model, grads)``.
- ``scaler.update()`` and ``scaler.unscale_(opt)``: logged no-ops. The step updates the
  scale itself, and unscales the gradients before any clipping in the chain.
- ``fleet.distributed_scaler(scaler)``: returns ``scaler``; the finite check is already
  global over the mesh (SPMD arrays), which is what Paddle's wrapper adds.
- ``scaler.state_dict()`` / ``scaler.load_state_dict(d)``: Paddle's keys.
- Inside your own jitted step, multiply the loss by ``opt.loss_scale`` (a traced value
  read from the optimizer state) rather than calling ``scaler.scale``.

Defaults are ``paddle.amp.GradScaler``'s (2**16, x2 every 2000 finite steps, x0.5 on
every non-finite step), not those of ``strategy.amp_configs``. Where Paddle's eager
scaler and its ``update_loss_scaling`` op differ, the op is followed (a decrease never
takes the scale below 1.0): see :mod:`jfleet.optim.loss_scale`.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> from jfleet.precision.amp import GradScaler
  >>> from jfleet.optim import hyperparams
  >>> _ = fleet.init(is_collective=True)
  >>> model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> opt = fleet.distributed_optimizer(hyperparams.sgd(0.1))
  >>> scaler = distributed_scaler(GradScaler(init_loss_scaling=1024.0))
  >>> loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))}
  >>> loss = model.train_batch(batch, opt, loss_fn=loss_fn, scaler=scaler)
  >>> scaler.get_loss_scaling(), scaler.state_dict()["incr_count"]
  (1024.0, 1)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jfleet.mesh.placement import write_variable
from jfleet.optim.loss_scale import dynamic_loss_scaling
from jfleet.precision.scalable import ScalableOptimizer
from jfleet.runtime.log import logger

if TYPE_CHECKING:
    from jfleet.training.distributed_optimizer import DistributedOptimizer

__all__ = ["GradScaler", "distributed_scaler"]

_STATE_KEYS = (
    "scale",
    "incr_ratio",
    "decr_ratio",
    "incr_every_n_steps",
    "decr_every_n_nan_or_inf",
    "incr_count",
    "decr_count",
    "use_dynamic_loss_scaling",
)


class GradScaler:
    """Paddle's ``GradScaler``: dynamic fp16 loss scaling attached to an optimizer.

    Args:
      enable: ``False`` makes every method a pass-through (no scaling).
      init_loss_scaling: the first scale, > 0.
      incr_ratio: growth factor, > 1.
      decr_ratio: shrink factor, in (0, 1).
      incr_every_n_steps: consecutive finite steps before the scale grows, >= 1.
      decr_every_n_nan_or_inf: non-finite steps before the scale shrinks, >= 1.
      use_dynamic_loss_scaling: ``False`` keeps the scale fixed (non-finite steps are
        still skipped).

    Raises:
      TypeError / ValueError: an argument of the wrong type or out of range (the checks
        of :func:`~jfleet.optim.loss_scale.dynamic_loss_scaling`).

    One scaler serves one optimizer (Paddle's scripts use one of each).
    """

    def __init__(
        self,
        enable: bool = True,
        init_loss_scaling: float = 2.0**16,
        incr_ratio: float = 2.0,
        decr_ratio: float = 0.5,
        incr_every_n_steps: int = 2000,
        decr_every_n_nan_or_inf: int = 1,
        use_dynamic_loss_scaling: bool = True,
    ) -> None:
        if not isinstance(enable, bool):
            raise TypeError(f"GradScaler(enable={enable!r}): enable must be True or False.")
        self._enable = enable
        self._config = _checked(
            init_loss_scaling=init_loss_scaling,
            incr_ratio=incr_ratio,
            decr_ratio=decr_ratio,
            incr_every_n_steps=incr_every_n_steps,
            decr_every_n_nan_or_inf=decr_every_n_nan_or_inf,
            use_dynamic_loss_scaling=use_dynamic_loss_scaling,
        )
        self._optimizer: Callable[[], DistributedOptimizer | None] = lambda: None
        self._pending_counts: tuple[int, int] | None = None  # loaded before attaching

    # ------------------------------------------------------------------ reading
    def is_enable(self) -> bool:
        """Whether the scaler scales at all."""
        return self._enable

    def is_use_dynamic_loss_scaling(self) -> bool:
        """Whether the scale changes (Paddle's rule) or stays fixed."""
        return self._enable and self._config["use_dynamic_loss_scaling"]

    def get_init_loss_scaling(self) -> float:
        """The scale the optimizer state starts from."""
        return float(self._config["init_loss_scaling"])

    def get_loss_scaling(self) -> float:
        """The current scale: read from the attached optimizer's state (1.0 when disabled).

        Before the optimizer's state exists it is the initial scale.
        """
        if not self._enable:
            return 1.0
        state = self._live_state()
        if state is None:
            return self.get_init_loss_scaling()
        return float(state.loss_scale.get_value())

    @property
    def config(self) -> dict[str, Any]:
        """The :func:`~jfleet.optim.loss_scale.dynamic_loss_scaling` keyword arguments."""
        return dict(self._config)

    # -------------------------------------------------------------------- using
    def transform(self, inner: optax.GradientTransformation) -> optax.GradientTransformation:
        """``inner`` wrapped by the loss-scale transform with this scaler's settings.

        For a plain optax training loop; a distributed optimizer gets it through
        :meth:`attach`. A disabled scaler returns ``inner`` unchanged.
        """
        if not self._enable:
            return inner
        return dynamic_loss_scaling(inner, **self._config)

    def attach(self, optimizer: DistributedOptimizer) -> DistributedOptimizer:
        """Adds this scaler's loss scaling to ``optimizer`` (once); returns the optimizer.

        Raises:
          TypeError: not a distributed optimizer.
          ValueError: the optimizer scales the loss already another way (``strategy.amp``
            or another scaler), its state was made without scaling, or this scaler
            serves another optimizer already.
        """
        if not isinstance(optimizer, ScalableOptimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is not a DistributedOptimizer; wrap "
                "it with fleet.distributed_optimizer(...) before using a GradScaler."
            )
        if not self._enable:
            return optimizer
        current = self._optimizer()
        if current is not None and current is not optimizer:
            raise ValueError(
                "this GradScaler already serves another optimizer; make one GradScaler per "
                "optimizer."
            )
        optimizer.attach_loss_scaling(self._config)
        self._optimizer = weakref.ref(optimizer)
        if self._pending_counts is not None:
            good, bad = self._pending_counts
            scale = self._config["init_loss_scaling"]
            optimizer.when_bound("scaler", lambda opt: _write_scaling(opt, scale, good, bad))
            self._pending_counts = None
        return optimizer

    def scale(self, loss: Any) -> jax.Array:
        """``loss`` times the current scale (float32); ``loss`` itself when disabled.

        Inside your own jitted step multiply by ``opt.loss_scale`` instead (a traced
        value read from the optimizer state).
        """
        if not self._enable:
            return loss
        return jnp.asarray(loss, jnp.float32) * jnp.float32(self.get_loss_scaling())

    def minimize(
        self,
        optimizer: DistributedOptimizer,
        loss_fn: Callable[[nnx.Module, Any], Any],
        model: nnx.Module,
        batch: Any,
    ) -> jax.Array:
        """One scaled engine step (Paddle's ``scaler.minimize(opt, scaled_loss)``); the loss."""
        self.attach(optimizer)
        return optimizer.minimize(loss_fn, model, batch)

    def step(self, optimizer: DistributedOptimizer, model: nnx.Module, grads: Any) -> None:
        """Applies ``grads`` of the *scaled* loss (``scaler.scale(loss)``), as Paddle's
        ``scaler.step(opt)``: unscaled, checked and skipped if not finite, scale updated."""
        self.attach(optimizer)
        if not optimizer.is_bound:
            optimizer.init(model)
        optimizer.step(model, grads)

    def update(self) -> None:
        """Paddle's ``scaler.update()``: a no-op (logged); the step updated the scale."""
        logger.debug("GradScaler.update(): no-op, the scale is updated inside the step")

    def unscale_(self, optimizer: DistributedOptimizer) -> None:
        """Paddle's ``scaler.unscale_(opt)``: a no-op (logged).

        The loss-scale transform unscales the gradients first thing in the step, before
        any clipping in the optimizer chain, which is what ``unscale_`` is called for.
        """
        del optimizer
        logger.debug("GradScaler.unscale_(): no-op, the step unscales before clipping")

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Paddle's keys: ``scale``, the ratios and periods, ``incr_count``, ``decr_count``,
        ``use_dynamic_loss_scaling``. Empty for a disabled scaler (as in Paddle)."""
        if not self._enable:
            return {}
        state = self._live_state()
        good = 0 if state is None else int(state.good_steps.get_value())
        bad = 0 if state is None else int(state.bad_steps.get_value())
        cfg = self._config
        return {
            "scale": np.asarray(self.get_loss_scaling(), np.float32),
            "incr_ratio": cfg["incr_ratio"],
            "decr_ratio": cfg["decr_ratio"],
            "incr_every_n_steps": cfg["incr_every_n_steps"],
            "decr_every_n_nan_or_inf": cfg["decr_every_n_nan_or_inf"],
            "incr_count": good,
            "decr_count": bad,
            "use_dynamic_loss_scaling": cfg["use_dynamic_loss_scaling"],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads :meth:`state_dict`'s output: the settings, the scale and the counters.

        Raises:
          RuntimeError: an empty dict (saved from a disabled scaler), as Paddle raises.
          KeyError: keys missing (they are listed).
          ValueError: the optimizer's state already exists and the settings differ.
        """
        if not state_dict:
            raise RuntimeError(
                "GradScaler.load_state_dict({}): the state dict is empty, probably saved from "
                "a disabled GradScaler; load one saved with enable=True."
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise KeyError(
                f"GradScaler.load_state_dict: keys {missing} are missing; pass the dict that "
                "GradScaler.state_dict() returned."
            )
        scale = float(np.asarray(state_dict["scale"]).reshape(()))
        counts = int(state_dict["incr_count"]), int(state_dict["decr_count"])
        config = _checked(
            init_loss_scaling=scale,
            incr_ratio=state_dict["incr_ratio"],
            decr_ratio=state_dict["decr_ratio"],
            incr_every_n_steps=int(state_dict["incr_every_n_steps"]),
            decr_every_n_nan_or_inf=int(state_dict["decr_every_n_nan_or_inf"]),
            use_dynamic_loss_scaling=bool(state_dict["use_dynamic_loss_scaling"]),
        )
        optimizer = self._optimizer()
        if optimizer is not None and optimizer.is_bound:
            same = {k: v for k, v in config.items() if k != "init_loss_scaling"}
            ours = {k: v for k, v in self._config.items() if k != "init_loss_scaling"}
            if same != ours:
                raise ValueError(
                    f"GradScaler.load_state_dict: settings {same} differ from the ones the "
                    f"optimizer was compiled with, {ours}; load the state before the first step."
                )
            _write_scaling(optimizer, scale, *counts)
            return
        self._config = config
        if optimizer is not None:  # attached, state not made yet: compile with the new config
            optimizer.loss_scaling_config = None
            optimizer.has_loss_scaling = False
            optimizer.attach_loss_scaling(config)
            optimizer.when_bound("scaler", lambda opt: _write_scaling(opt, scale, *counts))
        else:
            self._pending_counts = counts

    def _live_state(self) -> Any:
        optimizer = self._optimizer()
        if optimizer is None or not optimizer.is_bound:
            return None
        return optimizer.loss_scaling_state

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config.items())
        return f"GradScaler(enable={self._enable}, {args})"


def _checked(**config: Any) -> dict[str, Any]:
    """``config`` validated by the loss-scale transform itself (one set of checks)."""
    dynamic_loss_scaling(optax.identity(), **config)
    return {
        "init_loss_scaling": float(config["init_loss_scaling"]),
        "incr_ratio": float(config["incr_ratio"]),
        "decr_ratio": float(config["decr_ratio"]),
        "incr_every_n_steps": int(config["incr_every_n_steps"]),
        "decr_every_n_nan_or_inf": int(config["decr_every_n_nan_or_inf"]),
        "use_dynamic_loss_scaling": bool(config["use_dynamic_loss_scaling"]),
    }


def _write_scaling(optimizer: DistributedOptimizer, scale: float, good: int, bad: int) -> None:
    state = optimizer.loss_scaling_state
    for var, value in ((state.loss_scale, scale), (state.good_steps, good), (state.bad_steps, bad)):
        write_variable(var, value)


def distributed_scaler(scaler: GradScaler) -> GradScaler:
    """Paddle's ``fleet.distributed_scaler``: returns ``scaler`` itself.

    Paddle wraps the scaler so that the ``found_inf`` flag is all-reduced over the
    model-parallel groups. Under SPMD the finite check runs on global arrays, so it
    already covers every device of the mesh: nothing to add.

    Raises:
      TypeError: ``scaler`` is not a :class:`GradScaler`.

    Example:
      >>> distributed_scaler(GradScaler()).get_loss_scaling()
      65536.0
    """
    if not isinstance(scaler, GradScaler):
        raise TypeError(
            f"distributed_scaler(scaler={scaler!r}): expected a jfleet.amp.GradScaler; build "
            "one with jfleet.amp.GradScaler(init_loss_scaling=...)."
        )
    return scaler

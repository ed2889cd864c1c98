"""Static-graph Fleet calls, eagerly: ``amp_init``, ``qat_init``, ``minimize``.

Paddle's static mode builds a program, lets ``fleet.distributed_optimizer(...).minimize(loss)``
rewrite it, runs the startup program and then finishes AMP or QAT with ``amp_init`` /
``qat_init``. jfleet has no programs: the model is an NNX module and the step is a function.
The mapping:

================================  =============================================================
Paddle (static)                   jfleet
================================  =============================================================
``amp_init(place, scope, ...)``   cast the model's parameters for AMP O2 (every module but the
                                  norms, :mod:`jfleet.amp`) and make the distributed optimizer's
                                  state, with its fp32 master weights, for them
``qat_init(place, scope, ...)``   fake-quantise the model's projections
                                  (:func:`jfleet.quantization.quantize_model`)
``minimize(loss, ...)``           one training step of ``loss(model, batch)`` through the
                                  engine, on the distributed optimizer; returns the loss
``place``, ``scope``,             accepted; they do nothing here (logged once): arrays live where
``startup_program``,              their shardings say, parameters live in the model, and there
``test_program``                  is no separate test program (evaluate the same model)
================================  =============================================================

The model is ``model=`` (a jfleet keyword), else the last one ``fleet.distributed_model``
returned. ``fleet.distributed_model`` already applies ``strategy.amp`` O2 and ``strategy.qat``
to the model it places, so after it ``amp_init`` / ``qat_init`` find that work done (and
``amp_init`` makes the optimizer's state with its masters); they cast / quantise a model
placed another way (``jfleet.Placement.from_fleet().place_params(model)``, then
``jfleet.make_train_step``).

Example:
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> s = fleet.DistributedStrategy(); s.qat = True
  >>> s.qat_configs = {"not_quant_pattern": ["head"]}
  >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
  >>> model = fleet.distributed_model(nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0))))
  >>> fleet.qat_init()  # distributed_model quantised it already: the layers' paths
  ['module.layers.0']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jfleet.checkpoint.inference import load_inference_model, save_inference_model
from jfleet.fleet._noop import log_noop
from jfleet.optim.compiler import amp_settings
from jfleet.precision.amp import AmpPolicy
from jfleet.precision.quantization import QatConfig, quantize_model
from jfleet.training.distributed_optimizer import DistributedOptimizer
from jfleet.training.engine import TrainStep, cached_step

__all__ = ["StaticMethods"]

_PLACE = "arrays are placed by their shardings on the fleet's mesh"
_SCOPE = "parameters live in the NNX model, not in a scope"
_PROGRAM = "there are no programs under JAX: evaluate the same model (model.eval() for QAT)"


class StaticMethods:
    """``amp_init``, ``qat_init`` and ``minimize``, mixed into :class:`~jfleet.fleet.Fleet`.

    They need ``fleet.init``; ``amp_init`` and ``minimize`` also the distributed optimizer.
    """

    # Provided by Fleet (with ``_require_init``).
    _optimizer: DistributedOptimizer | None
    _model: nnx.Module | None

    #: Paddle's ``Fleet.save_inference_model``: :func:`jfleet.inference.save_inference_model`
    #: (a ``jax.export`` forward and its parameters), the same function as the module's.
    save_inference_model = staticmethod(save_inference_model)
    #: Paddle's ``Fleet.load_inference_model``: :func:`jfleet.inference.load_inference_model`.
    load_inference_model = staticmethod(load_inference_model)

    def _target_model(self, what: str, model: nnx.Module | None) -> nnx.Module:
        if model is None:
            model = self._model
        if model is None:
            raise ValueError(
                f"fleet.{what}: no model given and none was wrapped by fleet.distributed_model; "
                f"pass model=... (an nnx.Module) or call fleet.distributed_model(model) first."
            )
        if not isinstance(model, nnx.Module):
            raise TypeError(f"fleet.{what}(model={type(model).__name__}): expected an nnx.Module.")
        return model

    def _static_noops(self, what: str, **given: Any) -> None:
        reasons = {"place": _PLACE, "scope": _SCOPE}
        for name, value in given.items():
            if value is not None:
                log_noop(f"fleet.{what}({name}=...)", reasons.get(name, _PROGRAM))

    def amp_init(
        self,
        place: Any = None,
        scope: Any = None,
        test_program: Any = None,
        use_fp16_test: bool = False,
        *,
        model: nnx.Module | None = None,
    ) -> None:
        """Casts the model's parameters for AMP O2, fp32 masters kept (Paddle's ``amp_init``).

        The parameters of every module except the black-listed ones (norms) become the O2
        dtype (``use_pure_fp16``: float16, ``use_pure_bf16``: bfloat16), by the same policy as
        :func:`jfleet.amp.decorate` (``amp_configs`` custom lists included); the distributed
        optimizer then makes its state for them, fp32 master copies included, so training
        from here equals ``decorate(model, opt, level="O2")``. Masters are the fp32 values of
        the cast parameters (Paddle's static ``amp_init`` keeps the uncast startup values as
        masters: they differ by at most half a unit in the last place of the half dtype).
        Already cast parameters are left as they are (after ``fleet.distributed_model``).

        Args:
          place: Paddle's device; does nothing (logged).
          scope: Paddle's variable scope; does nothing (logged).
          test_program: Paddle's test program; does nothing (logged): evaluation runs the
            same half-precision model.
          use_fp16_test: Paddle's switch to cast the test program; True does nothing (logged)
            for the same reason.
          model: (jfleet) the model; default the last ``fleet.distributed_model``.

        Raises:
          RuntimeError: no ``fleet.init``, or no ``fleet.distributed_optimizer`` yet.
          ValueError: the strategy is not AMP O2 (the message names the switches); no model;
            the optimizer's state was already made for parameters of other dtypes.

        Example:
          >>> import optax
          >>> from flax import nnx
          >>> from jfleet import fleet
          >>> s = fleet.DistributedStrategy(); s.amp = True
          >>> s.amp_configs = {"use_pure_fp16": True}
          >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
          >>> from jfleet import Placement
          >>> opt = fleet.distributed_optimizer(optax.sgd(0.1))
          >>> model = Placement.from_fleet().place_params(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
          >>> fleet.amp_init(model=model)
          >>> model.kernel.dtype, opt.opt_state.master_params["kernel"].get_value().dtype
          (dtype('float16'), dtype('float32'))
        """
        run = self._require_init("amp_init")
        settings = amp_settings(run.strategy)
        if settings is None or settings.level != "O2":
            raise ValueError(
                "fleet.amp_init casts parameters for pure half-precision training (AMP O2): "
                "set strategy.amp = True and strategy.amp_configs = {'use_pure_fp16': True} "
                "(or 'use_pure_bf16': True) before fleet.distributed_optimizer; now "
                f"strategy.amp={run.strategy.amp}"
                + (f" at level {settings.level}" if settings else "")
                + "."
            )
        if self._optimizer is None:
            raise RuntimeError(
                "fleet.amp_init needs the AMP optimizer: call fleet.distributed_optimizer(opt) "
                "first (Paddle's amp_init belongs to the AMP meta-optimizer)."
            )
        self._static_noops("amp_init", place=place, scope=scope, test_program=test_program)
        if not isinstance(use_fp16_test, bool):
            raise TypeError(f"fleet.amp_init(use_fp16_test={use_fp16_test!r}): expected a bool.")
        if use_fp16_test:
            log_noop("fleet.amp_init(use_fp16_test=True)", _PROGRAM)
        model = self._target_model("amp_init", model)
        cfg = run.strategy.amp_configs
        policy = AmpPolicy(
            dtype=settings.dtype,
            level="O2",
            custom_white_list=tuple(cfg["custom_white_list"]),
            custom_black_list=tuple(cfg["custom_black_list"]),
        )
        opt = self._optimizer
        before = _dtypes(model)
        if opt.is_bound and opt._model() is model:
            probe = nnx.clone(model)
            if _dtypes(policy.apply(probe)) != before:
                raise ValueError(
                    "fleet.amp_init: the distributed optimizer already made its state for this "
                    "model's fp32 parameters (a step ran); call amp_init before the first "
                    "step, as Paddle runs it after the startup program and before training."
                )
        policy.apply(model)
        opt.init(model)

    def qat_init(
        self,
        place: Any = None,
        scope: Any = None,
        test_program: Any = None,
        *,
        model: nnx.Module | None = None,
    ) -> list[str]:
        """Fake-quantises the model's projections for QAT (Paddle's ``qat_init``).

        Applies ``strategy.qat_configs`` with :func:`jfleet.quantization.quantize_model`:
        weights per output channel (``channel_wise_abs_max``) and inputs by a moving-average
        abs-max scale, straight-through gradients. A model that ``fleet.distributed_model``
        placed is already quantised (nothing more happens).

        Args:
          place, scope, test_program: Paddle's static arguments; do nothing (logged): the
            test model is the same model (``model.eval()`` uses the stored scales).
          model: (jfleet) the model; default the last ``fleet.distributed_model``.

        Returns:
          The dotted paths of the quantised layers.

        Raises:
          RuntimeError: no ``fleet.init``.
          ValueError: ``strategy.qat`` is off (as Paddle), or no model.
          NotImplementedError: stacked (pipelined or scanned) layers.

        Example:
          >>> from flax import nnx
          >>> from jfleet import fleet
          >>> s = fleet.DistributedStrategy(); s.qat = True
          >>> _ = fleet.init(is_collective=True, strategy=s, log_level="WARNING")
          >>> fleet.qat_init(model=nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
          ['']
        """
        run = self._require_init("qat_init")
        if not run.strategy.qat:
            raise ValueError(
                "fleet.qat_init can only be used when quantisation-aware training is on: set "
                "strategy.qat = True (and strategy.qat_configs) before fleet.init."
            )
        self._static_noops("qat_init", place=place, scope=scope, test_program=test_program)
        model = self._target_model("qat_init", model)
        return quantize_model(model, QatConfig.from_strategy(run.strategy))

    def minimize(
        self,
        loss: Callable[[nnx.Module, Any], Any],
        startup_program: Any = None,
        parameter_list: Any = None,
        no_grad_set: Any = None,
        *,
        model: nnx.Module | None = None,
        batch: Any = None,
    ) -> jax.Array:
        """One training step on the distributed optimizer (Paddle's ``fleet.minimize``).

        Paddle differentiates a loss tensor already in its program; in JAX the loss is a
        function, differentiated where it is evaluated. So ``loss`` is ``loss(model, batch)``
        (a scalar or ``(loss, aux)``), and the step is the engine's (``jfleet.make_train_step``;
        the same compiled step as ``model.train_batch``): gradients, the strategy's
        meta-optimizers, the update. Returns the fp32 loss, not Paddle's ``(optimize_ops,
        params_grads)``: there are no operators, and the gradients are not kept.

        Args:
          loss: ``loss(model, batch) -> loss``.
          startup_program: does nothing (logged): parameters are initialised when the model
            is built.
          parameter_list, no_grad_set: must be None: which parameters train is the
            optimizer's ``wrt`` filter (``fleet.distributed_optimizer(nnx.Optimizer(model, tx,
            wrt=...))``), fixed when its state is made.
          model: (jfleet) the model; default the last ``fleet.distributed_model``.
          batch: (jfleet) the global batch, required.

        Raises:
          TypeError: ``loss`` is a value (an array) instead of a function, or no ``batch``.
          ValueError: a list of losses (Paddle allows it in parameter-server mode only),
            ``parameter_list`` / ``no_grad_set`` given, no model.
          RuntimeError: no ``fleet.init`` or no ``fleet.distributed_optimizer``.

        Example:
          >>> import jax.numpy as jnp, optax
          >>> from flax import nnx
          >>> from jfleet import fleet
          >>> _ = fleet.init(is_collective=True, log_level="WARNING")
          >>> model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
          >>> _ = fleet.distributed_optimizer(optax.sgd(0.1))
          >>> loss_fn = lambda m, b: jnp.mean(m(b) ** 2)
          >>> float(fleet.minimize(loss_fn, batch=jnp.ones((8, 4)))) > 0
          True
        """
        self._require_init("minimize")
        if isinstance(loss, list | tuple):
            raise ValueError(
                f"fleet.minimize got a list of {len(loss)} losses; Paddle allows a list in "
                "parameter-server mode only. Pass one loss(model, batch) function."
            )
        if not callable(loss):
            raise TypeError(
                f"fleet.minimize(loss={type(loss).__name__}): a computed loss value cannot be "
                "differentiated afterwards in JAX; pass the function instead: "
                "fleet.minimize(lambda model, batch: ..., batch=batch)."
            )
        for name, value in (("parameter_list", parameter_list), ("no_grad_set", no_grad_set)):
            if value is not None:
                raise ValueError(
                    f"fleet.minimize({name}=...): the trained parameters are chosen by the "
                    "optimizer's wrt filter when its state is made: "
                    "fleet.distributed_optimizer(nnx.Optimizer(model, tx, wrt=...)); pass "
                    f"{name}=None."
                )
        if startup_program is not None:
            log_noop("fleet.minimize(startup_program=...)", "parameters exist once built")
        if batch is None:
            raise TypeError("fleet.minimize needs batch=... (the global batch for loss).")
        if self._optimizer is None:
            raise RuntimeError(
                "fleet.minimize steps the distributed optimizer: call "
                "fleet.distributed_optimizer(opt) first."
            )
        model = self._target_model("minimize", model)
        if callable(getattr(model, "train_batch", None)):
            return self._optimizer.minimize(loss, model, batch)  # DistributedModel, pipeline
        return cached_step(TrainStep, loss, None)(model, self._optimizer, batch)


def _dtypes(model: nnx.Module) -> dict[str, Any]:
    """``{path: dtype}`` of the model's parameters."""
    return {
        ".".join(map(str, path)): var.get_value().dtype
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }

"""``fleet.distributed_optimizer``: an ``nnx.Optimizer`` whose chain a strategy compiled.

The optimizer is created before the model is known (as in Paddle), so its state is
made when it first meets a model: in ``DistributedModel.train_batch``, in a step
from :func:`jfleet.make_train_step`, or explicitly with :meth:`DistributedOptimizer.init`.
From then on it is an ordinary ``nnx.Optimizer``: ``opt.update(model, grads)`` works
inside a user's own ``@nnx.jit`` step, with these limits — the user's step does not
scale the loss for fp16 (use the engine, or multiply the loss by ``opt.loss_scale``
yourself) and does not constrain gradients to the ZeRO-2 layout (the update is
still correct; only the gradient all-reduce is not turned into a reduce-scatter).

Example:
  >>> import optax
  >>> from flax import nnx
  >>> from jfleet import fleet
  >>> _ = fleet.init(is_collective=True)
  >>> model = fleet.distributed_model(nnx.Linear(4, 2, rngs=nnx.Rngs(0)))
  >>> opt = fleet.distributed_optimizer(optax.adam(1e-3)).init(model)
  >>> int(opt.step[...])
  0
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx.training.optimizer import OptState, to_opt_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.optim.loss_scale import loss_scale_of
from jfleet.placement import Placement, resolve_placement


class DistributedOptimizer(nnx.Optimizer):
    """An ``nnx.Optimizer`` over a strategy-compiled Optax chain, bound on first use.

    Attributes:
      tx: the compiled chain (outermost meta-optimizer first).
      applied_meta_list: names of the meta-optimizers the strategy applied, in
        Paddle's naming (``["AMPOptimizer", "GradientMergeOptimizer", ...]``).
      inner_tx: the optimizer the user gave.
    """

    def __init__(
        self,
        tx: optax.GradientTransformation,
        *,
        inner_tx: optax.GradientTransformation,
        applied_meta_list: tuple[str, ...] = (),
        has_loss_scaling: bool = False,
        wrt: Any = nnx.Param,
    ) -> None:
        self.tx = tx
        self.inner_tx = inner_tx
        self.wrt = wrt
        self.graph = None
        self.applied_meta_list = tuple(applied_meta_list)
        self.has_loss_scaling = has_loss_scaling
        self.step = nnx.data(None)
        self.opt_state = nnx.data(None)
        self._param_paths: tuple[str, ...] | None = None
        self._model: Callable[[], Any] = lambda: None

    @property
    def is_bound(self) -> bool:
        """Whether the state has been made for a model."""
        return self._param_paths is not None

    def init(self, model: nnx.Module, placement: Placement | None = None) -> DistributedOptimizer:
        """Makes the optimizer state for ``model`` (once), placed for ``placement``.

        ``placement`` defaults to the model's (a ``DistributedModel``), else the run's.

        ZeRO stage >= 1 shards every parameter-shaped state leaf (moments,
        accumulated gradients, master weights) over the ZeRO axis; scalars are
        replicated over the mesh.

        Raises:
          ValueError: already bound to a model with other parameters.
        """
        if self.is_bound and self._model() is model:
            return self  # the common case, every step: nothing to look at
        paths = _param_paths(nnx.state(model, self.wrt))
        if self.is_bound:
            if paths != self._param_paths:
                raise ValueError(
                    "this distributed optimizer was initialised for a model with parameters "
                    f"{_short(self._param_paths)}, but is now used with one with parameters "
                    f"{_short(paths)}; make one distributed optimizer per model."
                )
            return self
        plan = resolve_placement(placement, model)
        params = nnx.state(model, self.wrt)
        if plan.zero_stage >= 1:
            params = jax.device_put(params, plan.param_shardings(params, zero=True))
        state = to_opt_state(self.tx.init(params))
        replicated = plan.named(P())

        def on_mesh(x: Any) -> Any:
            sharding = x.sharding if isinstance(x, jax.Array) else None
            if isinstance(sharding, NamedSharding) and sharding.mesh == plan.mesh:
                return x
            return jax.device_put(x, replicated)

        # The step donates model and optimizer buffers, so no buffer may appear twice
        # (optax and inject_hyperparams can hand out one constant for several leaves).
        taken = {_buffer(x) for x in jax.tree.leaves(nnx.state(model))}
        state = jax.tree.map(lambda x: _own_buffer(on_mesh(x), taken), state)
        self.step = OptState(jax.device_put(jnp.array(0, dtype=jnp.uint32), replicated))
        self.opt_state = nnx.data(state)
        self._param_paths = paths
        self._model = weakref.ref(model)
        return self

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> optax.Updates:
        """Applies gradients (see ``nnx.Optimizer.update``); needs :meth:`init` first."""
        if not self.is_bound:
            raise RuntimeError(
                "the distributed optimizer has no state yet; call opt.init(model) first "
                "(train_batch and make_train_step steps do it for you)."
            )
        return super().update(model, grads, **kwargs)

    @property
    def loss_scale(self) -> jax.Array:
        """The current fp16 loss scale (1.0 when the strategy has no loss scaling)."""
        if not self.has_loss_scaling or not self.is_bound:
            return jnp.asarray(1.0, jnp.float32)
        return loss_scale_of(nnx.as_pure(self.opt_state))


def _buffer(x: Any) -> int | None:
    if not isinstance(x, jax.Array) or not x.addressable_shards:
        return None
    return x.addressable_shards[0].data.unsafe_buffer_pointer()


def _own_buffer(x: Any, taken: set) -> Any:
    """``x``, or a copy of it when its buffer is already in ``taken``; records the buffer."""
    key = _buffer(x)
    if key is None:
        return x
    if key in taken:
        x = jnp.copy(x)
        key = _buffer(x)
    taken.add(key)
    return x


def _param_paths(params: nnx.State) -> tuple[str, ...]:
    return tuple(
        jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)
    )


def _short(paths: tuple[str, ...] | None) -> str:
    paths = paths or ()
    return ", ".join(paths[:4]) + (f", ... ({len(paths)} in all)" if len(paths) > 4 else "")

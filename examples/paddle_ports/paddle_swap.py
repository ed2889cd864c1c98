"""The framework swap of the Paddle ports: Paddle's eager tensor habits in JAX terms.

Only what JAX spells differently from Paddle, never a distributed feature (those are
jfleet's own names). Each function names the Paddle call it stands for:

- ``seed(s)`` for ``paddle.seed(s)``: JAX has no global generator, so the ports draw
  parameters from one ``nnx.Rngs`` (``rngs()``) and tensors from one numpy generator,
  both reseeded here.
- ``randn(shape, dtype)`` for ``paddle.randn``.
- ``parameters(layer)`` for ``layer.parameters()``: the ``nnx.Param`` variables in
  Paddle's order (a layer's own parameters first, in the order they were created,
  then each sub-layer's, in the order they were assigned). NNX sorts by name.
- ``set_value(param, value)`` for ``param.set_value(value)``: the new value keeps the
  parameter's sharding (a ``jax.Array`` is placed where the old one lived).
- ``numpy(x)`` for ``x.numpy()``.

Example:
  >>> import paddle_swap
  >>> from flax import nnx
  >>> paddle_swap.seed(0)
  >>> layer = nnx.Linear(2, 3, rngs=paddle_swap.rngs())
  >>> [p.shape for p in paddle_swap.parameters(layer)]
  [(2, 3), (3,)]
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx.training.optimizer import OptState

_STATE: dict[str, Any] = {"rngs": nnx.Rngs(0), "gen": np.random.default_rng(0)}


def seed(value: int) -> None:
    """``paddle.seed(value)``: reseeds the parameter keys and the tensor generator."""
    _STATE["rngs"] = nnx.Rngs(value)
    _STATE["gen"] = np.random.default_rng(value)


def rngs() -> nnx.Rngs:
    """The ``nnx.Rngs`` that layers draw their parameters from (Paddle's global generator)."""
    return _STATE["rngs"]


def randn(shape: Any, dtype: Any = "float32", mp: int | None = None) -> jax.Array:
    """``paddle.randn(shape, dtype)``: standard normal values from the seeded generator.

    ``mp=axis`` places the array split over the model-parallel group on ``axis``
    (:func:`shard_over`): the ranks' ``[..., n/mp]`` tensors as one global array.
    """
    value = jnp.asarray(_STATE["gen"].standard_normal(tuple(shape)), dtype)
    return value if mp is None else shard_over(value, mp)


def parameters(layer: Any) -> list[nnx.Param]:
    """``layer.parameters()``: the ``nnx.Param`` variables in Paddle's order.

    A layer with its own ``parameters()`` method (jfleet's pipeline layers, whose
    stages keep their parameters in per-stage buffers) answers for itself.
    """
    own_method = getattr(layer, "parameters", None)
    if callable(own_method):
        return list(own_method())
    own: list[nnx.Param] = []
    subs: list[nnx.Param] = []
    seen: set[int] = set()

    def walk(node: Any) -> None:
        for value in vars(node).values():
            _visit(value, own if node is layer else subs)

    def _visit(value: Any, out: list[nnx.Param]) -> None:
        if id(value) in seen:
            return
        if isinstance(value, nnx.Param):
            seen.add(id(value))
            out.append(value)
        elif isinstance(value, nnx.Module):
            seen.add(id(value))
            for item in parameters(value):
                if id(item) not in seen:
                    seen.add(id(item))
                    subs.append(item)
        elif isinstance(value, (list, tuple)) or type(value).__name__ == "List":
            for item in value:
                _visit(item, out)

    walk(layer)
    return own + subs


def set_value(param: nnx.Variable, value: Any) -> None:
    """``param.set_value(value)``: the value replaces the parameter's, on its devices."""
    if not isinstance(param, nnx.Variable):  # a pipeline's view of a parameter
        param.set_value(value)
        return
    old = param[...]
    new = jnp.asarray(value, old.dtype).reshape(old.shape)
    param[...] = jax.device_put(new, old.sharding)


def numpy(x: Any) -> np.ndarray:
    """``x.numpy()``."""
    return np.asarray(x)


def shard_over(value: Any, axis: int = -1, group: Any = None) -> jax.Array:
    """A Paddle rank's slice as SPMD holds it: ``value`` split over ``group`` on ``axis``.

    In Paddle each rank of a group creates its own ``[..., n/ranks]`` tensor; in SPMD
    that is one global array of size ``n`` on ``axis`` whose shard on rank ``r`` is
    rank ``r``'s slice. ``group`` defaults to the model-parallel group.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jfleet import fleet

    hcg = fleet.get_hybrid_communicate_group()
    group = hcg.get_model_parallel_group() if group is None else group
    value = jnp.asarray(value)
    spec = [None] * value.ndim
    spec[axis] = group.axis_name
    return jax.device_put(value, NamedSharding(hcg.mesh, P(*spec)))


def create_parameter(
    shape: Any, is_bias: bool = False, dtype: Any = "float32", rngs: nnx.Rngs | None = None
) -> nnx.Param:
    """``layer.create_parameter(shape, is_bias=...)``: Xavier-uniform weights, zero biases.

    As Paddle's Xavier initialiser, a 1-D weight uses its size as both fans. The key comes
    from ``rngs`` (a layer's own), else from :func:`rngs`.
    """
    if is_bias:
        return nnx.Param(jnp.zeros(tuple(shape), dtype))
    shape = tuple(shape)
    fan_in, fan_out = (shape[0], shape[0]) if len(shape) == 1 else (shape[0], shape[1])
    limit = float(np.sqrt(6.0 / (fan_in + fan_out)))
    key = (rngs or _STATE["rngs"]).params()
    return nnx.Param(jax.random.uniform(key, shape, dtype, -limit, limit))


def softmax_with_cross_entropy(logits: jax.Array, label: jax.Array) -> jax.Array:
    """``paddle.nn.functional.softmax_with_cross_entropy(logits, label)``: ``[..., 1]`` losses."""
    import optax

    loss = optax.softmax_cross_entropy_with_integer_labels(logits, label[..., 0])
    return loss[..., None]


def local(x: Any) -> jax.Array:
    """A Paddle rank's own tensor, read on the host: the piece of ``x`` on rank 0's device.

    jfleet's collectives treat rank ``r``'s tensor as the piece of a global array that
    device ``r`` holds; code that Paddle runs on its rank's tensors
    (``paddle.concat(gathered, axis=1)``) runs on the host's pieces (one process: the host
    is rank 0). This is ``jfleet.collective.local_value`` (Paddle's ``x._local_value()``).
    """
    from jfleet.collective import local_value

    return jnp.asarray(local_value(x))


class Optimizer(nnx.Optimizer):
    """``paddle.optimizer.<Name>(learning_rate, parameters=layer.parameters(), ...)``.

    Paddle's eager optimizer over one model: ``make_tx`` is the optax optimizer
    (``optax.sgd``, ``optax.adamw``...), built with its learning rate injected
    (``optax.inject_hyperparams``), so ``learning_rate`` may be a number or a Paddle
    scheduler (``jfleet.optim.lr``), read at every step as Paddle reads it.
    ``optimizer.step(model, grads)`` is ``loss.backward(); optimizer.step()`` with the
    gradients as values (``optimizer.step[...]`` still counts the updates).
    ``fleet.distributed_optimizer`` takes it as it takes any ``nnx.Optimizer``.
    """

    def __init__(
        self,
        make_tx: Any,
        learning_rate: Any,
        parameters: nnx.Module,
        multi_precision: bool = False,
        **hyper: Any,
    ):
        self.lr_source = learning_rate
        tx = optax.inject_hyperparams(make_tx)(learning_rate=self.get_lr(), **hyper)
        if multi_precision:  # Paddle's fp32 master weights of half-precision parameters
            from jfleet.optim.master_weights import master_weights

            tx = master_weights(tx)
        super().__init__(parameters, tx, wrt=nnx.Param)
        counter = _Step(self.step.get_value())
        object.__setattr__(counter, "_owner", weakref.ref(self))
        self.step = counter

    def get_lr(self) -> float:
        """The learning rate of the next step (Paddle's ``get_lr``)."""
        lr = self.lr_source
        return float(lr()) if callable(lr) else float(lr)

    def clear_grad(self) -> None:
        """Paddle's ``clear_grad``: nothing to clear, JAX gradients are values."""


class _Step(OptState):
    """The update counter, callable as Paddle's ``optimizer.step`` (with the gradients)."""

    __slots__ = ("_owner",)

    def __call__(self, model: nnx.Module, grads: Any) -> None:
        optimizer = self._owner()
        _lr_state(optimizer.opt_state)[...] = jnp.asarray(optimizer.get_lr())
        _update(optimizer, model, grads)


def _lr_state(state: Any) -> Any:
    """The injected learning rate in an optimizer state (maybe inside master weights)."""
    found = [
        node.hyperparams["learning_rate"]
        for node in jax.tree.leaves(state, is_leaf=lambda n: hasattr(n, "hyperparams"))
        if hasattr(node, "hyperparams")
    ]
    return found[0]


@nnx.jit
def _update(optimizer: nnx.Optimizer, model: nnx.Module, grads: Any) -> None:
    optimizer.update(model, grads)


def cross_entropy(input: jax.Array, label: jax.Array) -> jax.Array:
    """``paddle.nn.functional.cross_entropy(input, label)``: the mean loss, in float32."""
    return softmax_with_cross_entropy(jnp.asarray(input, jnp.float32), label).mean()


def state_dict(layer: nnx.Module) -> Any:
    """``layer.state_dict()``: the layer's parameters (a copy, as Paddle's loading copies)."""
    return jax.tree.map(jnp.copy, nnx.state(layer, nnx.Param))


def set_state_dict(layer: nnx.Module, state: Any) -> None:
    """``layer.set_state_dict(state)``: copies ``state`` into ``layer``."""
    nnx.update(layer, jax.tree.map(jnp.copy, state))


class Dataset:
    """``paddle.io.Dataset``: ``__getitem__`` and ``__len__``."""


class DataLoader:
    """``paddle.io.DataLoader(dataset, batch_size, shuffle=False, drop_last, num_workers=0)``.

    Calling it (as Paddle's scripts do, ``train_loader()``) yields the batches in order:
    each field stacked over the batch into one array.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        shuffle: bool = False,
        drop_last: bool = False,
        num_workers: int = 0,
    ) -> None:
        if shuffle or num_workers:
            raise NotImplementedError("paddle_swap.DataLoader: shuffle / workers not ported")
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last

    def __call__(self) -> Any:
        n = len(self.dataset)
        stop = n - n % self.batch_size if self.drop_last else n
        for start in range(0, stop, self.batch_size):
            items = [self.dataset[i] for i in range(start, min(start + self.batch_size, n))]
            yield [jnp.asarray(np.stack(field)) for field in zip(*items, strict=True)]

    __iter__ = __call__


def per_rank(value: Any, group: Any) -> jax.Array:
    """Each rank of ``group`` holding its own copy of ``value``, free to differ.

    Paddle's ranks each create a ``[n, ...]`` tensor; SPMD holds them as one global
    ``[ranks * n, ...]`` array split over the group, rank ``r``'s piece its tensor.
    """
    value = jnp.asarray(value)
    whole = jnp.concatenate([value] * group.nranks, axis=0)
    return shard_over(whole, 0, group)

"""Mixed-precision policy for Flax NNX models: Paddle's AMP levels O1 and O2.

Paddle decides per operator (white list: run in half precision; black list: keep fp32;
everything else follows its inputs). Flax NNX layers already separate the compute dtype
(``self.dtype``, applied through ``promote_dtype`` to inputs and params at call time)
from the storage dtype of their params, so jfleet decides per module class:

- **O1** (``amp_configs`` default): white modules compute in half precision
  (``module.dtype = half``) while their params stay fp32; black modules compute in fp32
  (``module.dtype = float32`` where the module has a ``dtype``); other modules are left
  alone and follow their inputs.
- **O2** (``use_pure_fp16`` / ``use_pure_bf16``): as O1, and the floating ``nnx.Param``
  values of every module that is not black are cast to half precision, as Paddle's
  ``amp_decorate(level="O2")`` casts every layer except the excluded ones. Black modules
  (the norm layers) keep fp32 params for both dtypes (Paddle keeps LayerNorm fp32 only
  for float16; jfleet keeps norms fp32 for bfloat16 too). Pair O2 with
  :func:`jfleet.optim.master_weights.master_weights` so the optimizer updates fp32
  masters.

Outside a strategy, Paddle's ``paddle.amp`` calls have these equivalents:

- ``with paddle.amp.auto_cast(...)``: ``with auto_cast(model, ...)``. A JAX context
  manager cannot reach a model it is not given, and NNX layers choose their compute
  dtype from an attribute, so :func:`auto_cast` takes the model, sets the policy's
  compute dtypes on enter and restores the previous ones on exit. It never casts
  parameters (``decorate`` does, for O2), so ``level`` only chooses which of the
  policy's lists apply. Calls (and ``train_batch``) inside the block compile with the
  half-precision dtypes; after it the model computes as before.
- ``paddle.amp.decorate(models, optimizers, level="O2")``: :func:`decorate` casts the
  parameters of non-black modules to half precision for good (``apply_amp(level="O2")``)
  and adds fp32 master weights to the optimizers. At O1 it changes nothing, as in Paddle.
- ``paddle.amp.GradScaler``: :class:`jfleet.grad_scaler.GradScaler`, re-exported here.

Only floating ``nnx.Param`` values are ever cast: integer and boolean variables, batch
statistics, caches and RNG state are untouched. Casting keeps each array's sharding.

Compute the loss in float32: cast the model outputs with :func:`cast_floating` (the
training-step engine does this) before the loss, and never multiply a half-precision
loss by the loss scale.

List entries name module classes (``"Linear"``, ``"LayerNorm"``). A module's class and
its base classes are looked up in method-resolution order and the first listed name
decides, so a subclass of ``nnx.Linear`` is white unless its own name is black-listed.
Beyond the named classes, any class whose name ends with ``"Linear"`` or ``"Embedding"``
is white (this covers ``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jfleet.parallel.loss import cast_floating as cast_floating
from jfleet.precision.scalable import ScalableOptimizer
from jfleet.runtime.log import logger

__all__ = [
    "DEFAULT_BLACK_LIST",
    "DEFAULT_WHITE_LIST",
    "AmpPolicy",
    "GradScaler",
    "apply_amp",
    "auto_cast",
    "cast_floating",
    "decorate",
]

DEFAULT_WHITE_LIST: frozenset[str] = frozenset(
    {"Linear", "LinearGeneral", "Einsum", "Conv", "ConvTranspose", "Embed", "MultiHeadAttention"}
)
"""Module classes that compute in half precision by default."""

DEFAULT_BLACK_LIST: frozenset[str] = frozenset(
    {"LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm", "InstanceNorm"}
)
"""Module classes that stay fp32 (compute and params) by default."""

_WHITE_SUFFIXES = ("Linear", "Embedding")
_LEVELS = ("O1", "O2")
_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}

Category = Literal["white", "black", "gray"]


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in _DTYPES:
        raise ValueError(
            f"dtype={dtype!r} is not a half-precision AMP dtype; expected 'float16' or "
            "'bfloat16' (Paddle's amp dtypes). For fp32 training, do not apply AMP."
        )
    return name


def _names(arg: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise TypeError(
            f"{arg}={value!r} must be a list/tuple/set of module class names, e.g. "
            f"{arg}=['Linear']."
        )
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        raise TypeError(
            f"{arg} entries must be non-empty module class names (str); got {bad!r} in "
            f"{value!r}. Use names such as 'Linear' or 'LayerNorm', not classes."
        )
    return tuple(sorted(set(value)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AmpPolicy:
    """A validated, hashable AMP policy (Paddle ``amp_configs`` in module-class terms).

    Attributes:
        dtype: ``"float16"`` or ``"bfloat16"`` (a numpy/JAX dtype is accepted and stored
            by name).
        level: ``"O1"`` (half compute in white modules) or ``"O2"`` (also half params
            everywhere except black modules).
        custom_white_list: class names moved into the white list (stored sorted).
        custom_black_list: class names moved into the black list (stored sorted).

    Raises:
        ValueError: unknown ``dtype`` or ``level``, or a name in both custom lists.
        TypeError: a custom list is not a collection of class-name strings.

    Example:
        >>> policy = AmpPolicy(dtype="bfloat16", level="O2", custom_black_list=["Embed"])
        >>> policy.classify(nnx.Embed), policy.classify(nnx.Linear)
        ('black', 'white')
    """

    dtype: str = "float16"
    level: str = "O1"
    custom_white_list: tuple[str, ...] = ()
    custom_black_list: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.level not in _LEVELS:
            raise ValueError(
                f"level={self.level!r} is not an AMP level; expected 'O1' (mixed "
                "precision, fp32 params) or 'O2' (pure half precision, fp32 norms)."
            )
        white = _names("custom_white_list", self.custom_white_list)
        black = _names("custom_black_list", self.custom_black_list)
        both = sorted(set(white) & set(black))
        if both:
            raise ValueError(
                f"{', '.join(repr(n) for n in both)} in both custom_white_list and "
                "custom_black_list; a module class can only be in one of them. Remove it "
                "from one list."
            )
        object.__setattr__(self, "custom_white_list", white)
        object.__setattr__(self, "custom_black_list", black)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The half-precision dtype as a ``jnp.dtype``."""
        return jnp.dtype(_DTYPES[self.dtype])

    @property
    def white_list(self) -> frozenset[str]:
        """Named white classes: defaults plus custom white, minus custom black."""
        return (DEFAULT_WHITE_LIST | set(self.custom_white_list)) - set(self.custom_black_list)

    @property
    def black_list(self) -> frozenset[str]:
        """Named black classes: defaults plus custom black, minus custom white."""
        return (DEFAULT_BLACK_LIST | set(self.custom_black_list)) - set(self.custom_white_list)

    def classify(self, module: nnx.Module | type) -> Category:
        """Returns ``"white"``, ``"black"`` or ``"gray"`` for a module or module class."""
        cls = module if isinstance(module, type) else type(module)
        white, black = self.white_list, self.black_list
        for klass in cls.__mro__:
            name = klass.__name__
            if name in black:
                return "black"
            if name in white or name.endswith(_WHITE_SUFFIXES):
                return "white"
        return "gray"

    def apply(self, model: nnx.Module) -> nnx.Module:
        """Applies the policy to ``model`` in place and returns it (see :func:`apply_amp`)."""
        modules, params, _ = self._set_compute_dtypes(model)
        if self.level == "O2":
            # A module holding other layers' parameters in buffers (pipeline stages of
            # different layers) casts them itself, layer by layer.
            holders = [
                (tuple(path), node)
                for path, node in nnx.iter_graph(model)
                if callable(getattr(node, "cast_held_params", None))
            ]
            for path, param in params:
                if any(path[: len(at)] == at for at, _ in holders):
                    continue
                if _owner_category(modules, path) != "black":
                    _cast_param(param, self.compute_dtype)
            for at, holder in holders:
                holder.cast_held_params(
                    self.compute_dtype,
                    keep=lambda p, at=at: _owner_category(modules, at + p) == "black",
                )
        return model

    def _set_compute_dtypes(self, model: nnx.Module) -> tuple[dict, list, list]:
        """Sets white / black modules' compute ``dtype``; returns the categories by path, the
        params by path, and ``(module, old dtype)`` for each module changed."""
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"model must be an nnx.Module; got {type(model).__name__}. Build the model "
                "with flax.nnx before applying AMP."
            )
        half = self.compute_dtype
        modules: dict[tuple, Category] = {}
        params: list[tuple[tuple, nnx.Param]] = []
        changed: list[tuple[nnx.Module, Any]] = []
        nodes = list(nnx.iter_graph(model))  # walk first, mutate after
        for path, node in nodes:
            if isinstance(node, nnx.Module):
                category = self.classify(node)
                modules[tuple(path)] = category
                if category != "gray" and hasattr(node, "dtype"):
                    changed.append((node, node.dtype))
                    node.dtype = half if category == "white" else jnp.dtype(jnp.float32)
            elif isinstance(node, nnx.Param):
                params.append((tuple(path), node))
        return modules, params, changed


def _owner_category(modules: dict[tuple, Category], path: tuple) -> Category:
    """Category of the innermost module whose path is a prefix of ``path``."""
    for end in range(len(path) - 1, -1, -1):
        category = modules.get(path[:end])
        if category is not None:
            return category
    return "gray"


def _cast_param(param: nnx.Param, dtype: jnp.dtype) -> None:
    value = param.get_value()
    if not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.floating):
        return
    if value.dtype == dtype:
        return
    if isinstance(value, jax.ShapeDtypeStruct):
        param.set_value(jax.ShapeDtypeStruct(value.shape, dtype, sharding=value.sharding))
    else:
        param.set_value(value.astype(dtype))


def apply_amp(
    model: nnx.Module,
    *,
    dtype: str = "float16",
    level: str = "O1",
    custom_white_list: list[str] | tuple[str, ...] | set[str] = (),
    custom_black_list: list[str] | tuple[str, ...] | set[str] = (),
) -> nnx.Module:
    """Applies Paddle's O1/O2 mixed precision to an NNX model, in place.

    O1 sets the compute ``dtype`` of white modules to ``dtype`` and of black modules to
    float32; params stay fp32. O2 also casts the floating params of all non-black
    modules to ``dtype``. See the module docstring for the lists and the rules.

    Args:
        model: the model; modified in place.
        dtype: ``"float16"`` or ``"bfloat16"``.
        level: ``"O1"`` or ``"O2"``.
        custom_white_list: module class names to run in half precision.
        custom_black_list: module class names to keep in fp32.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: unknown ``dtype`` or ``level``, or a name in both custom lists.
        TypeError: ``model`` is not an ``nnx.Module`` or a list is malformed.

    Example:
        >>> from flax import nnx
        >>> layer = apply_amp(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), dtype="bfloat16")
        >>> layer(jnp.ones((1, 2))).dtype, layer.kernel.dtype
        (dtype(bfloat16), dtype('float32'))
    """
    policy = AmpPolicy(
        dtype=dtype,
        level=level,
        custom_white_list=custom_white_list,
        custom_black_list=custom_black_list,
    )
    return policy.apply(model)


@contextlib.contextmanager
def auto_cast(
    model: nnx.Module,
    enable: bool = True,
    custom_white_list: list[str] | tuple[str, ...] | set[str] | None = None,
    custom_black_list: list[str] | tuple[str, ...] | set[str] | None = None,
    level: str = "O1",
    dtype: str = "float16",
) -> Iterator[nnx.Module]:
    """Paddle's ``paddle.amp.auto_cast`` for one model: half-precision compute inside the block.

    On enter the compute ``dtype`` of white modules becomes ``dtype`` and that of black
    modules float32 (see :class:`AmpPolicy`); on exit every changed module gets its
    previous dtype back, even after an exception. Parameters are never cast here.

    Args:
        model: the model whose modules compute in half precision (Paddle's ``auto_cast``
            reaches every layer implicitly; in JAX the model is named).
        enable: ``False`` changes nothing.
        custom_white_list: module class names to run in half precision.
        custom_black_list: module class names to keep in fp32.
        level: ``"O1"`` or ``"O2"`` (validated; parameters are cast by :func:`decorate`).
        dtype: ``"float16"`` or ``"bfloat16"``.

    Yields:
        ``model``.

    Raises:
        ValueError / TypeError: as :class:`AmpPolicy` (naming the bad value).

    Example:
        >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> with auto_cast(layer, dtype="bfloat16"):
        ...     inside = layer(jnp.ones((1, 2))).dtype
        >>> inside, layer(jnp.ones((1, 2))).dtype
        (dtype(bfloat16), dtype('float32'))
    """
    policy = AmpPolicy(
        dtype=dtype,
        level=level,
        custom_white_list=tuple(custom_white_list or ()),
        custom_black_list=tuple(custom_black_list or ()),
    )
    if not isinstance(enable, bool):
        raise TypeError(f"auto_cast(enable={enable!r}): enable must be True or False.")
    if not enable:
        yield model
        return
    _, _, changed = policy._set_compute_dtypes(model)
    try:
        yield model
    finally:
        for module, old in reversed(changed):
            module.dtype = old


def decorate(
    models: Any,
    optimizers: Any = None,
    level: str = "O1",
    dtype: str = "float16",
    master_weight: bool | None = None,
    save_dtype: str | None = None,
) -> Any:
    """Paddle's ``paddle.amp.decorate``: at O2, half-precision parameters and fp32 masters.

    ``level="O1"`` returns the arguments unchanged (Paddle's O1 decorate does nothing).
    ``level="O2"`` applies :func:`apply_amp` at O2 to each model (compute dtypes and the
    parameters of non-black modules cast to ``dtype``) and, unless
    ``master_weight=False``, gives each optimizer fp32 master weights
    (:func:`jfleet.optim.master_weights.master_weights`): an optax transformation is
    returned wrapped, a distributed optimizer is recompiled with them before its state
    is made. ``save_dtype`` is accepted and ignored (logged): jfleet does not hook saving;
    cast with :func:`cast_floating` when saving.

    Returns:
        ``models`` (same kind: one model or a list) when ``optimizers`` is None, else
        ``(models, optimizers)``.

    Raises:
        TypeError: a model is not an ``nnx.Module``, an optimizer is neither an optax
            transformation nor a distributed optimizer.
        ValueError: a bad ``level`` / ``dtype``, or a distributed optimizer already bound.

    Example:
        >>> import optax
        >>> layer, tx = decorate(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), optax.sgd(0.1), "O2")
        >>> layer.kernel.dtype
        dtype('float16')
    """
    policy = AmpPolicy(dtype=dtype, level=level)
    if master_weight is not None and not isinstance(master_weight, bool):
        raise TypeError(f"decorate(master_weight={master_weight!r}): expected None, True or False.")
    if save_dtype is not None:
        logger.info("amp.decorate(save_dtype=%r): ignored, jfleet does not hook saving", save_dtype)
    many = isinstance(models, list | tuple)
    model_list = list(models) if many else [models]
    for model in model_list:
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"decorate(models=...): {type(model).__name__} is not an nnx.Module; pass the "
                "model (or a list of models)."
            )
    opt_many = isinstance(optimizers, list | tuple) and not hasattr(optimizers, "update")
    opt_list = [] if optimizers is None else list(optimizers) if opt_many else [optimizers]
    if policy.level == "O2":
        for model in model_list:
            policy.apply(model)
        if master_weight is not False:
            owners = _owners(model_list, opt_list)
            opt_list = [_with_master_weights(o, m) for o, m in zip(opt_list, owners, strict=True)]
    out_models = type(models)(model_list) if many else model_list[0]
    if optimizers is None:
        return out_models
    return out_models, (type(optimizers)(opt_list) if opt_many else opt_list[0])


def _owners(models: list, optimizers: list) -> list:
    """The model each optimizer updates: paired by position, or the one model for all."""
    if len(models) == len(optimizers):
        return models
    if len(models) == 1:
        return models * len(optimizers)
    raise ValueError(
        f"decorate got {len(models)} models and {len(optimizers)} optimizers; pass one "
        "optimizer per model (paired by position) or a single model."
    )


def _with_master_weights(optimizer: Any, model: nnx.Module) -> Any:
    from jfleet.optim.master_weights import master_weights

    if isinstance(optimizer, ScalableOptimizer):  # fleet.distributed_optimizer
        optimizer.add_master_weights()
        return optimizer
    if isinstance(optimizer, nnx.Optimizer):
        # Its state was made for the fp32 parameters: a new optimizer over the cast model,
        # as Paddle's decorate runs before training (a trained state would be lost).
        if int(optimizer.step[...]) != 0:
            raise ValueError(
                f"decorate(optimizers=...): this nnx.Optimizer has taken "
                f"{int(optimizer.step[...])} steps; its state would be lost. Decorate before "
                "training, as in Paddle."
            )
        return nnx.Optimizer(model, master_weights(optimizer.tx), wrt=optimizer.wrt)
    if not hasattr(optimizer, "update"):
        raise TypeError(
            f"decorate(optimizers=...): {type(optimizer).__name__} is neither an optax "
            "GradientTransformation, an nnx.Optimizer nor a fleet.distributed_optimizer; "
            "pass optax.adam(...), nnx.Optimizer(model, tx, wrt=nnx.Param) or the "
            "distributed optimizer."
        )
    return master_weights(optimizer)


from jfleet.precision.grad_scaler import GradScaler as GradScaler  # noqa: E402 (re-export)

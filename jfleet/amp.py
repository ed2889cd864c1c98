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

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = [
    "DEFAULT_BLACK_LIST",
    "DEFAULT_WHITE_LIST",
    "AmpPolicy",
    "apply_amp",
    "cast_floating",
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
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"model must be an nnx.Module; got {type(model).__name__}. Build the model "
                "with flax.nnx before applying AMP."
            )
        half = self.compute_dtype
        modules: dict[tuple, Category] = {}
        params: list[tuple[tuple, nnx.Param]] = []
        nodes = list(nnx.iter_graph(model))  # walk first, mutate after
        for path, node in nodes:
            if isinstance(node, nnx.Module):
                category = self.classify(node)
                modules[tuple(path)] = category
                if category != "gray" and hasattr(node, "dtype"):
                    node.dtype = half if category == "white" else jnp.dtype(jnp.float32)
            elif isinstance(node, nnx.Param):
                params.append((tuple(path), node))
        if self.level == "O2":
            for path, param in params:
                if _owner_category(modules, path) != "black":
                    _cast_param(param, half)
        return model


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


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Casts every floating array in ``tree`` to ``dtype``; other leaves are unchanged.

    Use it to bring half-precision model outputs to float32 before the loss.

    Args:
        tree: a pytree (arrays, scalars, ``None``...).
        dtype: the target floating dtype, e.g. ``jnp.float32``.

    Returns:
        The tree with floating leaves cast.

    Example:
        >>> out = cast_floating({"y": jnp.ones(2, jnp.bfloat16), "n": jnp.arange(2)}, jnp.float32)
        >>> out["y"].dtype, out["n"].dtype
        (dtype('float32'), dtype('int32'))
    """

    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)

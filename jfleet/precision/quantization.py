"""Quantisation-aware training (Paddle's ``strategy.qat`` / ``QATOptimizer``) on NNX modules.

Paddle's QAT pass inserts fake quantise-dequantise operators before every quantisable
operator (``conv2d``, ``depthwise_conv2d``, ``mul``, ``matmul``, ``matmul_v2``). jfleet does
the same to the projections of an NNX model as they are: every ``nnx.Linear``,
``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv`` and ``nnx.ConvTranspose``, and jfleet's
tensor-parallel ``ColumnParallelLinear`` / ``RowParallelLinear`` (Paddle has quantised
versions of both), user subclasses included, gets, in place, a subclass whose call
fake-quantises

* the **weight** (the kernel; never the bias): abs-max scale per output channel when
  ``channel_wise_abs_max`` (the kernel's axes that are not contracted with the input),
  else one scale for the whole kernel; ``weight_bits`` bits;
* the **activation** (the layer's input): one scale from a moving average of the batch's
  abs-max, Paddle's ``moving_average_abs_max`` with rate 0.9: ``state = 0.9 * state + 1``,
  ``accum = 0.9 * accum + max|x|``, ``scale = accum / state`` (from ``state = accum = 1``,
  ``scale = 0.001`` as Paddle initialises them), updated on every training call and used
  as stored after ``model.eval()``; ``activation_bits`` bits.

A value ``v`` with scale ``s`` and ``b`` bits becomes ``round(clip(v, -s, s) / s * n) * s / n``
with ``n = 2**(b-1) - 1`` (127 for int8); rounding is XLA's (ties to even). Gradients are
straight-through: the fake-quantised value's gradient is passed to the float value as it is
(Paddle's fake quantise-dequantise gradient is the identity too). Under SPMD ``max|x|`` is the
global batch's (the data-parallel replicas share one scale; Paddle's replicas each keep their
own unless asked to reduce them).

The module keeps its parameter paths (``fc.kernel`` stays ``fc.kernel``); its statistics are
:class:`QuantStat` variables beside the kernel (``qat_scale``, ``qat_state``,
``qat_accum``), not trained and not optimizer state. ``not_quant_pattern`` entries exclude a
module when one of them is a substring of its dotted path (``"head"`` excludes ``lm_head`` and
everything under ``head.*``), as Paddle skips operators whose name scope contains one.

Exports: :func:`quant_scales` (the scales per quantised module) and :func:`export_int8`
(integer weights with their scales, for inference: ``dequantize(values, scale, bits)`` gives
the fake-quantised kernel back exactly; run the layer with it and the input quantised with
``activation_scale``).

Limits: layers stacked for a pipeline or a ``lax.scan`` (a kernel with a leading stack axis)
are refused (so ``strategy.qat`` with ``pp_degree > 1``; ``to_distributed`` with a QAT strategy
keeps the blocks unrolled, not scanned, and a forced ``pp`` stops with the reason); matmuls on bare
``nnx.Param`` arrays (not in a layer) and embedding lookups stay float, as Paddle quantises
neither; ``qat_configs['algo']`` is accepted and unused (Paddle's QAT pass ignores it too).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> layer = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  >>> quantize_model(layer, QatConfig())
  ['']
  >>> y = layer(jnp.ones((2, 4)))
  >>> sorted(quant_scales(layer)[""])
  ['activation', 'weight']
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.parallel.layers import ColumnParallelLinear, RowParallelLinear
from jfleet.parallel.recompute import module_paths
from jfleet.runtime.log import logger

__all__ = [
    "MOVING_RATE",
    "QUANTIZABLE",
    "Int8Weight",
    "QatConfig",
    "QuantStat",
    "dequantize",
    "export_int8",
    "fake_quant",
    "qat_summary",
    "quant_scales",
    "quantize_model",
]

MOVING_RATE = 0.9
"""Paddle's default rate of the moving-average activation scale."""

_PARALLEL = (ColumnParallelLinear, RowParallelLinear)

QUANTIZABLE: tuple[type, ...] = (
    nnx.Linear,
    nnx.LinearGeneral,
    nnx.Einsum,
    nnx.Conv,
    nnx.ConvTranspose,
    *_PARALLEL,
)
"""The layer classes (and their subclasses) QAT fake-quantises: Flax's projections and
jfleet's tensor-parallel linears (``fleet.meta_parallel``, sequence-parallel ones included)."""


class QuantStat(nnx.Variable):
    """A QAT statistic (activation scale, moving-average state and accumulator): not trained."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class QatConfig:
    """Paddle's ``qat_configs`` (plus the moving rate), validated and hashable.

    Attributes:
      channel_wise_abs_max: one weight scale per output channel (else one per kernel).
      weight_bits: bits of the quantised weights (2..16).
      activation_bits: bits of the quantised activations (2..16).
      not_quant_pattern: modules whose dotted path contains one of these are left float.
      moving_rate: rate of the moving-average activation scale (Paddle's 0.9).

    Example:
      >>> QatConfig(weight_bits=4).weight_bits
      4
    """

    channel_wise_abs_max: bool = True
    weight_bits: int = 8
    activation_bits: int = 8
    not_quant_pattern: tuple[str, ...] = ()
    moving_rate: float = MOVING_RATE

    def __post_init__(self) -> None:
        for name in ("weight_bits", "activation_bits"):
            bits = getattr(self, name)
            if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
                raise ValueError(
                    f"qat_configs {name}={bits!r}: expected an int from 2 to 16 (8 is int8)."
                )
        if not isinstance(self.channel_wise_abs_max, bool):
            raise TypeError(
                f"qat_configs channel_wise_abs_max={self.channel_wise_abs_max!r}: expected "
                "True or False."
            )
        patterns = self.not_quant_pattern
        if isinstance(patterns, str) or not all(isinstance(p, str) and p for p in patterns):
            raise TypeError(
                f"qat_configs not_quant_pattern={patterns!r}: expected a list of non-empty "
                "strings (parts of module paths, e.g. ['lm_head'])."
            )
        object.__setattr__(self, "not_quant_pattern", tuple(patterns))
        if not 0.0 < float(self.moving_rate) < 1.0:
            raise ValueError(f"moving_rate={self.moving_rate!r}: expected a float in (0, 1).")

    @classmethod
    def from_strategy(cls, strategy: Any) -> QatConfig:
        """The config of ``strategy.qat_configs`` (``algo`` is logged and unused)."""
        cfg = strategy.qat_configs
        if cfg["algo"]:
            logger.info(
                "qat_configs algo=%r is unused: Paddle's QAT pass ignores it too", cfg["algo"]
            )
        return cls(
            channel_wise_abs_max=bool(cfg["channel_wise_abs_max"]),
            weight_bits=int(cfg["weight_bits"]),
            activation_bits=int(cfg["activation_bits"]),
            not_quant_pattern=tuple(cfg["not_quant_pattern"]),
        )


def _levels(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def _qdq(x: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    """Quantise-dequantise in fp32 (no gradient rule: callers add the straight-through one)."""
    n = _levels(bits)
    xf = x.astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.round(jnp.clip(xf, -safe, safe) / safe * n)
    return jnp.where(scale > 0, q * safe / n, 0.0).astype(x.dtype)


def fake_quant(x: jax.Array, scale: Any, bits: int = 8) -> jax.Array:
    """Fake-quantises ``x`` with ``scale`` (broadcastable) to ``bits``; straight-through gradient.

    The value is ``round(clip(x, -scale, scale) / scale * n) * scale / n`` (``n = 2**(bits-1)
    - 1``) exactly; the gradient with respect to ``x`` is the identity, none flows to ``scale``.

    Example:
      >>> float(fake_quant(jnp.float32(0.3), 1.0, bits=2))  # n = 1: 0.3 rounds to 0
      0.0
      >>> float(jax.grad(lambda v: fake_quant(v, 1.0, bits=2))(0.3))
      1.0
    """
    return _straight_through(jnp.asarray(x), jnp.asarray(scale, jnp.float32), bits)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _straight_through(x: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    return _qdq(x, scale, bits)


def _straight_through_fwd(x: jax.Array, scale: jax.Array, bits: int) -> tuple[jax.Array, Any]:
    return _qdq(x, scale, bits), scale


def _straight_through_bwd(bits: int, scale: jax.Array, g: jax.Array) -> tuple[jax.Array, Any]:
    return g, jnp.zeros_like(scale)


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)


def _weight_scale(kernel: jax.Array, reduce_axes: tuple[int, ...], channel_wise: bool) -> Any:
    """The abs-max weight scale: per output channel (kept dims) or one for the kernel."""
    w = jnp.abs(jax.lax.stop_gradient(kernel).astype(jnp.float32))
    if channel_wise:
        return jnp.max(w, axis=reduce_axes, keepdims=True)
    return jnp.max(w)


def _contracted_axes(module: nnx.Module, einsum_str: str | None) -> tuple[int, ...]:
    """The kernel's axes contracted with the input (the rest are output channels)."""
    ndim = module.kernel.get_value().ndim
    if isinstance(module, nnx.LinearGeneral):
        start = len(module.batch_axis)
        return tuple(range(start, start + len(module.in_features)))
    if isinstance(module, nnx.Einsum):
        spec = (einsum_str or module.einsum_str or "").replace(" ", "")
        lhs, out = spec.split("->")
        rhs = lhs.split(",")[1]
        if "..." in rhs:
            return tuple(range(ndim))  # no named output channels: one scale
        return tuple(i for i, c in enumerate(rhs) if c not in out)
    return tuple(range(ndim - 1))  # Linear, Conv, ConvTranspose: the last axis is the output


def _expected_ndim(module: nnx.Module) -> int | None:
    if isinstance(module, nnx.LinearGeneral):
        return len(module.batch_axis) + len(module.in_features) + len(module.out_features)
    if isinstance(module, nnx.Einsum):
        return len(module.kernel_shape)
    if isinstance(module, nnx.Conv | nnx.ConvTranspose):
        return len(module.kernel_size) + 2
    return 2  # Linear


def _quantize_input(layer: Any, inputs: Any) -> jax.Array:
    """The layer's input fake-quantised; in training, the moving-average scale moves first."""
    cfg: QatConfig = layer.qat_config
    x = jnp.asarray(inputs)
    if layer.use_running_average:
        scale = layer.qat_scale.get_value()
    else:
        rate = cfg.moving_rate
        batch_max = jnp.max(jnp.abs(jax.lax.stop_gradient(x).astype(jnp.float32)))
        state = rate * layer.qat_state.get_value() + 1.0
        accum = rate * layer.qat_accum.get_value() + batch_max
        scale = accum / state
        layer.qat_state.set_value(state)
        layer.qat_accum.set_value(accum)
        layer.qat_scale.set_value(scale)
    return fake_quant(x, scale, cfg.activation_bits)


def _quant_call(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """A quantised Flax layer's call: the input, and the kernel where the layer promotes its
    operands (``self.promote_dtype``, which every Flax projection calls), fake-quantised."""
    cfg: QatConfig = self.qat_config
    xq = _quantize_input(self, inputs)
    einsum_str = kwargs.get("einsum_str", args[0] if args else None)
    axes = _contracted_axes(self, einsum_str if isinstance(einsum_str, str) else None)
    original = self.promote_dtype

    def promote(arrays: Sequence[Any], dtype: Any = None) -> Any:
        operand, kernel, bias = arrays
        w_scale = _weight_scale(kernel, axes, cfg.channel_wise_abs_max)
        kernel = fake_quant(kernel, w_scale, cfg.weight_bits)
        return original((operand, kernel, bias), dtype=dtype)

    self.promote_dtype = promote
    try:
        return self._qat_base.__call__(self, xq, *args, **kwargs)
    finally:
        self.promote_dtype = original


def _quant_call_parallel(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
    """A quantised tensor-parallel linear's call: the input and the kernel fake-quantised (the
    kernel's value is swapped for the call, so the layer's own mp layout and collectives run
    on it; the gradient reaches the kernel straight through)."""
    cfg: QatConfig = self.qat_config
    xq = _quantize_input(self, inputs)
    kernel = self.kernel.get_value()
    w_scale = _weight_scale(kernel, (0,), cfg.channel_wise_abs_max)  # [in, out]
    self.kernel.set_value(fake_quant(kernel, w_scale, cfg.weight_bits))
    try:
        return self._qat_base.__call__(self, xq, *args, **kwargs)
    finally:
        self.kernel.set_value(kernel)


_CLASSES: dict[type, type] = {}


def _is_quantized(node: Any) -> bool:
    return type(node) in _QUANTIZED


_QUANTIZED: set[type] = set()


def _quantized_class(base: type) -> type:
    """``Quantized<Base>``, a direct subclass of the layer's class with the quantised call (one
    per class, registered in this module so that it pickles by name)."""
    cls = _CLASSES.get(base)
    if cls is None:
        name = f"Quantized{base.__name__}"
        if name in globals():  # another class of that name (a user's, a recomputed layer)
            name = f"{name}_{len(_CLASSES)}"
        namespace = {
            "__module__": __name__,
            "__qualname__": name,
            "__slots__": (),  # the layer's object layout, so that ``__class__`` can change
            "__call__": _quant_call_parallel if issubclass(base, _PARALLEL) else _quant_call,
            "_qat_base": base,
            "__doc__": f"{base.__name__} with QAT fake quantisation (jfleet.quantization).",
        }
        cls = type(name, (base,), namespace)
        globals()[name] = cls
        _CLASSES[base] = cls
        _QUANTIZED.add(cls)
    return cls


def _replicated_like(kernel: Any, value: jax.Array) -> jax.Array:
    """``value`` replicated on the kernel's mesh (a placed model), else as it is."""
    sharding = kernel.sharding if isinstance(kernel, jax.Array) else None
    if isinstance(sharding, NamedSharding):
        return jax.device_put(value, NamedSharding(sharding.mesh, P()))
    return value


def quantize_model(model: nnx.Module, config: QatConfig | None = None) -> list[str]:
    """Makes every quantisable layer of ``model`` fake-quantise, in place (see the module doc).

    Already quantised layers are kept (with the same config). New statistics are replicated
    on the mesh of the layer's kernel when it has one.

    Args:
      model: an NNX model (any public style: the layers are found by class, not by name).
      config: the settings; default :class:`QatConfig()` (Paddle's ``qat_configs`` defaults).

    Returns:
      The dotted paths of the quantised layers (``""`` for ``model`` itself), sorted.

    Raises:
      TypeError: ``model`` is not an ``nnx.Module``, ``config`` not a :class:`QatConfig`.
      ValueError: a layer already quantised with another config.
      NotImplementedError: a layer whose kernel is stacked (pipelined or scanned blocks).

    Example:
      >>> rngs = nnx.Rngs(0)
      >>> net = nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 2, rngs=rngs))
      >>> quantize_model(net, QatConfig(not_quant_pattern=("layers.1",)))
      ['layers.0']
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"quantize_model(model={type(model).__name__}): expected a flax.nnx.Module."
        )
    config = QatConfig() if config is None else config
    if not isinstance(config, QatConfig):
        raise TypeError(f"config={config!r}: expected a jfleet.quantization.QatConfig.")
    found = [(path, node) for path, node in module_paths(model) if isinstance(node, QUANTIZABLE)]
    done: list[str] = []
    for path, module in found:
        if any(pattern in path for pattern in config.not_quant_pattern):
            continue
        if _is_quantized(module):
            if module.qat_config != config:
                raise ValueError(
                    f"layer {path or '<model>'!r} is already quantised with {module.qat_config}; "
                    f"it cannot take {config} too. Quantise each model once."
                )
            done.append(path)
            continue
        kernel = module.kernel.get_value()
        if kernel.ndim != _expected_ndim(module):
            raise NotImplementedError(
                f"layer {path!r} ({type(module).__name__}) has a stacked kernel of shape "
                f"{tuple(kernel.shape)} (pipelined or scanned blocks); QAT quantises unstacked "
                "layers only. Leave it out with qat_configs not_quant_pattern, or quantise "
                "before stacking."
            )
        module.__class__ = _quantized_class(type(module))
        module.qat_config = config
        module.use_running_average = False
        module.qat_scale = QuantStat(_replicated_like(kernel, jnp.asarray(0.001, jnp.float32)))
        module.qat_state = QuantStat(_replicated_like(kernel, jnp.asarray(1.0, jnp.float32)))
        module.qat_accum = QuantStat(_replicated_like(kernel, jnp.asarray(1.0, jnp.float32)))
        done.append(path)
    logger.info("QAT: %d layer(s) fake-quantised", len(done))
    return sorted(done)


def _quantized(model: nnx.Module) -> list[tuple[str, Any]]:
    seen: set[int] = set()
    out = []
    for path, node in module_paths(model):
        if _is_quantized(node) and id(node) not in seen:  # a shared layer once
            seen.add(id(node))
            out.append((path, node))
    return out


def _kernel_scale(module: Any) -> tuple[jax.Array, jax.Array]:
    """The module's kernel and its weight scale (shape broadcastable to the kernel)."""
    kernel = module.kernel.get_value()
    axes = _contracted_axes(module, None)
    return kernel, _weight_scale(kernel, axes, module.qat_config.channel_wise_abs_max)


def quant_scales(model: nnx.Module) -> dict[str, dict[str, np.ndarray]]:
    """The scales of every quantised layer: ``{path: {"weight": ..., "activation": ...}}``.

    ``weight`` has one entry per output channel (the kernel's non-contracted axes, e.g.
    ``[out]`` for a Linear), or is a scalar without ``channel_wise_abs_max``; ``activation`` is
    the stored moving-average input scale. Both are float32 NumPy arrays.

    Example:
      >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0)); _ = quantize_model(layer)
      >>> quant_scales(layer)[""]["weight"].shape
      (3,)
    """
    out: dict[str, dict[str, np.ndarray]] = {}
    for path, module in _quantized(model):
        kernel, scale = _kernel_scale(module)
        axes = _contracted_axes(module, None)
        weight = np.asarray(scale)
        if module.qat_config.channel_wise_abs_max:
            weight = weight.reshape([n for i, n in enumerate(kernel.shape) if i not in axes])
        out[path] = {"weight": weight, "activation": np.asarray(module.qat_scale.get_value())}
    return out


class Int8Weight(NamedTuple):
    """A quantised kernel for inference: ``values * scale / (2**(bits-1) - 1)`` is the kernel.

    Attributes:
      values: the integer kernel (int8 for up to 8 bits, int16 above).
      scale: float32 weight scale, broadcastable to ``values`` (per output channel or one).
      bits: the weight bits.
      activation_scale: the input's float32 scale (quantise inputs with it at ``activation_bits``).
      activation_bits: the activation bits.
    """

    values: np.ndarray
    scale: np.ndarray
    bits: int
    activation_scale: np.ndarray
    activation_bits: int


def export_int8(model: nnx.Module) -> dict[str, Int8Weight]:
    """The integer kernels and scales of every quantised layer, keyed by dotted path.

    ``dequantize(w.values, w.scale, w.bits)`` equals the kernel the training forward used
    (bit for bit in float32). For int8 inference compute ``x_int = round(clip(x, -a, a) / a *
    127)`` with ``a = activation_scale``, multiply ``x_int`` by ``values`` in int32 and rescale by
    ``a * scale / 127**2`` (then add the float bias).

    Example:
      >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0)); _ = quantize_model(layer)
      >>> export_int8(layer)[""].values.dtype
      dtype('int8')
    """
    out: dict[str, Int8Weight] = {}
    for path, module in _quantized(model):
        cfg: QatConfig = module.qat_config
        kernel, scale = _kernel_scale(module)
        n = _levels(cfg.weight_bits)
        safe = jnp.where(scale > 0, scale, 1.0)
        q = jnp.round(jnp.clip(kernel.astype(jnp.float32), -safe, safe) / safe * n)
        dtype = np.int8 if cfg.weight_bits <= 8 else np.int16
        out[path] = Int8Weight(
            values=np.asarray(q).astype(dtype),
            scale=np.asarray(scale, np.float32),
            bits=cfg.weight_bits,
            activation_scale=np.asarray(module.qat_scale.get_value(), np.float32),
            activation_bits=cfg.activation_bits,
        )
    return out


def dequantize(values: Any, scale: Any, bits: int = 8) -> np.ndarray:
    """``values * scale / (2**(bits-1) - 1)`` in float32: an exported kernel back as floats.

    Example:
      >>> dequantize(np.array([127, -64], np.int8), np.float32(0.5)).tolist()
      [0.5, -0.25196850299835205]
    """
    n = _levels(bits)
    return np.asarray(values, np.float32) * np.asarray(scale, np.float32) / np.float32(n)


def qat_summary(model: nnx.Module) -> Mapping[str, str]:
    """``{path: class name}`` of the quantised layers (for logs and tests)."""
    return {path: type(module).__name__ for path, module in _quantized(model)}

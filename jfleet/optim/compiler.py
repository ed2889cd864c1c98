"""The strategy compiler: one ``DistributedStrategy`` -> one Optax chain, in a fixed order.

Paddle builds a graph of meta-optimizers from white and black lists and chains the
longest path. jfleet keeps the result of that graph for the meta-optimizers it
provides and writes the order down once (outermost first)::

    ShardingOptimizer        placement only (ZeRO stage 1/2/3 over the sharding axis)
    QATOptimizer             model side only (fake quantisation, jfleet.quantization)
    FP16AllReduceOptimizer   the replicas' gradients summed in fp16 (bf16 under bf16 AMP)
    LocalSGDOptimizer | AdaptiveLocalSGDOptimizer   replicas step alone, average every k
    MasterWeights (O2)       fp32 master copy of half-precision parameters
    GradientMergeOptimizer   optax.MultiSteps semantics: move every k-th call
    AMPOptimizer             dynamic loss scaling: unscale, skip non-finite steps
    RecomputeOptimizer       model side only (jax.checkpoint on named sub-modules)
    LambOptimizer | LarsOptimizer   replace the user's Adam / Momentum
    DGCMomentumOptimizer     replaces the user's Momentum; its top-k exchange is the
                             replicas' gradient communication (jfleet.optim.dgc)
    the user's optimizer

GradientMerge wraps AMP as in Paddle, so the loss scale stays fixed while
micro-batches accumulate and a merged step with a non-finite gradient is skipped
whole; the master weights sit outside both, so merged gradients accumulate in fp32.

FP16AllReduce and LocalSGD act between the data-parallel replicas, not on the chain:
the compiled result carries them as ``communication`` (how replicas combine gradients,
:mod:`jfleet.optim.communication`) and ``localsgd`` (:mod:`jfleet.optim.localsgd`), and
the engine runs each replica's part of the step (:mod:`jfleet.replicas`). Under LocalSGD
the whole chain runs per replica.

Combinations Paddle forbids are errors naming both switches (``lamb`` with
``lars``, ``dgc`` with ``amp``, ``fp16_allreduce``, ``lamb``, ``lars`` or
``gradient_merge``, ``localsgd`` or ``adaptive_localsgd``, ``localsgd`` with
``adaptive_localsgd``), and so are the ones jfleet cannot honour (LocalSGD with fp16
loss scaling, with ``fp16_allreduce`` — it all-reduces no gradients — or with
``sharding``): never silently dropped.

Example:
  >>> import optax
  >>> from jfleet import DistributedStrategy
  >>> from jfleet.optim.compiler import compile_strategy
  >>> s = DistributedStrategy()
  >>> s.gradient_merge = True
  >>> s.gradient_merge_configs = {"k_steps": 4}
  >>> compile_strategy(optax.sgd(0.1), s).applied_meta_list
  ('GradientMergeOptimizer',)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import optax

from jfleet.mesh import context as _context
from jfleet.mesh.topology import DATA_AXES
from jfleet.optim.communication import GradientCommunication, fp16_allreduce
from jfleet.optim.dgc import dgc_communication, dgc_momentum, momentum_of
from jfleet.optim.gradient_merge import gradient_merge
from jfleet.optim.lamb_lars import lamb_from, lars_from
from jfleet.optim.localsgd import LocalSGDConfig
from jfleet.optim.loss_scale import dynamic_loss_scaling
from jfleet.optim.master_weights import master_weights as _master_weights
from jfleet.runtime.log import logger

# Pairs Paddle's meta-optimizer black lists forbid.
_CONFLICTS = (
    ("lamb", "lars", "LAMB and LARS both replace the inner optimizer; pick one"),
    ("dgc", "amp", "Paddle's AMP meta-optimizer black-lists DGC"),
    ("dgc", "fp16_allreduce", "Paddle's FP16AllReduce meta-optimizer black-lists DGC"),
    ("dgc", "lamb", "DGC replaces a Momentum optimizer, LAMB an Adam one"),
    ("dgc", "lars", "DGC and LARS both replace the Momentum optimizer; pick one"),
    (
        "dgc",
        "gradient_merge",
        "Paddle's GradientMerge does not wrap DGC, which exchanges gradients every step",
    ),
    ("localsgd", "adaptive_localsgd", "LocalSGD and AdaptiveLocalSGD black-list each other"),
    ("dgc", "localsgd", "LocalSGD averages parameters and exchanges no gradients to compress"),
    (
        "dgc",
        "adaptive_localsgd",
        "AdaptiveLocalSGD averages parameters and exchanges no gradients to compress",
    ),
)
_NOT_YET: tuple[str, ...] = ()  # every meta-optimizer of the seed is provided

#: The documented order of meta-optimizers, outermost first.
META_ORDER = (
    "ShardingOptimizer",
    "QATOptimizer",
    "FP16AllReduceOptimizer",
    "LocalSGDOptimizer",
    "AdaptiveLocalSGDOptimizer",
    "GradientMergeOptimizer",
    "AMPOptimizer",
    "RecomputeOptimizer",
    "LambOptimizer",
    "LarsOptimizer",
    "DGCMomentumOptimizer",
)


@dataclasses.dataclass(frozen=True)
class AmpSettings:
    """What ``strategy.amp`` asks for: compute dtype, O-level, loss scaling on/off."""

    dtype: str
    level: str
    loss_scaling: bool


@dataclasses.dataclass(frozen=True)
class CompiledChain:
    """The compiled optimizer: the chain, the applied meta-optimizers, the AMP settings, and
    how the data-parallel replicas combine their gradients (``communication``: None for
    GSPMD's own fp32 reduction; :mod:`jfleet.optim.communication`) or their parameters
    (``localsgd``: :mod:`jfleet.optim.localsgd`)."""

    tx: optax.GradientTransformation
    applied_meta_list: tuple[str, ...]
    amp: AmpSettings | None
    communication: GradientCommunication | None = None
    localsgd: LocalSGDConfig | None = None


def amp_settings(strategy: Any) -> AmpSettings | None:
    """The AMP settings of a strategy (None when ``strategy.amp`` is off).

    O2 comes from ``use_pure_fp16`` / ``use_pure_bf16`` (Paddle); O1's dtype from
    ``amp_configs['dtype']`` (a jfleet key, default ``"float16"``). Loss scaling is
    used for float16 only; bfloat16 has fp32's range and needs none (Paddle
    disables it for bf16 too).
    """
    if not strategy.amp:
        return None
    cfg = strategy.amp_configs
    if cfg["use_pure_fp16"] and cfg["use_pure_bf16"]:
        raise ValueError(
            "amp_configs has use_pure_fp16=True and use_pure_bf16=True; O2 takes one dtype, "
            "set only one of them."
        )
    if cfg["use_pure_fp16"]:
        dtype, level = "float16", "O2"
    elif cfg["use_pure_bf16"]:
        dtype, level = "bfloat16", "O2"
    else:
        dtype, level = cfg["dtype"], "O1"
    return AmpSettings(dtype=dtype, level=level, loss_scaling=dtype == "float16")


def check_combinations(strategy: Any) -> None:
    """Raises for switch pairs Paddle forbids and meta-optimizers jfleet lacks."""
    for a, b, why in _CONFLICTS:
        if getattr(strategy, a) and getattr(strategy, b):
            raise ValueError(
                f"strategy.{a}=True and strategy.{b}=True cannot be combined ({why}); "
                f"turn one of them off."
            )
    for name in _NOT_YET:
        if getattr(strategy, name):
            raise NotImplementedError(
                f"strategy.{name}=True: this meta-optimizer is not available in jfleet yet; "
                f"set strategy.{name}=False."
            )


def compile_strategy(
    tx: optax.GradientTransformation,
    strategy: Any,
    *,
    loss_scaling: Mapping[str, Any] | None = None,
    master_weights: bool = False,
) -> CompiledChain:
    """Builds the one Optax chain a strategy asks for around the user's optimizer.

    Args:
      tx: the user's optimizer.
      strategy: a ``DistributedStrategy``.
      loss_scaling: :func:`~jfleet.optim.loss_scale.dynamic_loss_scaling` keyword
        arguments from a :class:`jfleet.amp.GradScaler` given outside the strategy; put in
        the AMP slot (and ``"AMPOptimizer"`` recorded). The strategy must not scale too.
      master_weights: fp32 master weights from ``jfleet.amp.decorate(level="O2")``, put
        where O2 puts them (once, if the strategy asks for O2 as well).

    Returns:
      A :class:`CompiledChain` (``tx``, ``applied_meta_list`` in META_ORDER, ``amp``,
      ``communication``, ``localsgd``).

    Raises:
      ValueError: forbidden combinations (naming both switches), LAMB without an
        Adam-family optimizer, LARS without a momentum one, bad config values.
      NotImplementedError: meta-optimizers jfleet does not provide yet.
    """
    check_combinations(strategy)
    applied: list[str] = []
    tx = _trust_ratio_optimizers(tx, strategy, applied)
    communication = None
    if strategy.dgc:
        tx, communication = _dgc(tx, strategy.dgc_configs)
        applied.append("DGCMomentumOptimizer")
    if strategy.recompute:
        applied.append("RecomputeOptimizer")
    if strategy.qat:
        applied.append("QATOptimizer")
    amp = amp_settings(strategy)
    tx = _loss_scaled(tx, strategy, amp, loss_scaling, applied)
    if strategy.gradient_merge:
        cfg = strategy.gradient_merge_configs
        tx = gradient_merge(tx, k_steps=cfg["k_steps"], avg=cfg["avg"])
        applied.append("GradientMergeOptimizer")
    if master_weights or (amp is not None and amp.level == "O2"):
        tx = _master_weights(tx)
    if strategy.sharding or strategy.hybrid_configs["sharding_degree"] > 1:
        applied.append("ShardingOptimizer")
    localsgd = _localsgd(strategy, amp, loss_scaling)
    if localsgd is not None:
        applied.append(localsgd.meta_name)
    if strategy.fp16_allreduce:
        half = "bfloat16" if amp is not None and amp.dtype == "bfloat16" else "float16"
        communication = fp16_allreduce(half)
        applied.append("FP16AllReduceOptimizer")
    applied.sort(key=META_ORDER.index)
    return CompiledChain(
        tx=tx,
        applied_meta_list=tuple(applied),
        amp=amp,
        communication=communication,
        localsgd=localsgd,
    )


def _trust_ratio_optimizers(
    tx: optax.GradientTransformation, strategy: Any, applied: list[str]
) -> optax.GradientTransformation:
    """LAMB / LARS from the strategy around ``tx`` (each recorded in ``applied``)."""
    if strategy.lamb:
        cfg = strategy.lamb_configs
        tx = lamb_from(
            tx,
            lamb_weight_decay=cfg["lamb_weight_decay"],
            exclude_from_weight_decay=tuple(cfg["exclude_from_weight_decay"]),
        )
        applied.append("LambOptimizer")
    if strategy.lars:
        cfg = strategy.lars_configs
        tx = lars_from(
            tx,
            lars_coeff=cfg["lars_coeff"],
            lars_weight_decay=cfg["lars_weight_decay"],
            epsilon=cfg["epsilon"],
            exclude_from_weight_decay=tuple(cfg["exclude_from_weight_decay"]),
        )
        applied.append("LarsOptimizer")
    return tx


def _loss_scaled(
    tx: optax.GradientTransformation,
    strategy: Any,
    amp: Any,
    loss_scaling: Mapping[str, Any] | None,
    applied: list[str],
) -> optax.GradientTransformation:
    """fp16 loss scaling from a GradScaler or from ``strategy.amp`` (never both)."""
    if loss_scaling is not None:
        if amp is not None and amp.loss_scaling:
            raise ValueError(
                "a GradScaler was given, but strategy.amp already scales the fp16 loss "
                f"(amp_configs init_loss_scaling={strategy.amp_configs['init_loss_scaling']}); "
                "use one of them: pass scaler=None, or set strategy.amp=False."
            )
        tx = dynamic_loss_scaling(tx, **loss_scaling)
        applied.append("AMPOptimizer")
    if amp is not None:
        if amp.loss_scaling:
            cfg = strategy.amp_configs
            tx = dynamic_loss_scaling(
                tx,
                init_loss_scaling=cfg["init_loss_scaling"],
                incr_every_n_steps=cfg["incr_every_n_steps"],
                decr_every_n_nan_or_inf=cfg["decr_every_n_nan_or_inf"],
                incr_ratio=cfg["incr_ratio"],
                decr_ratio=cfg["decr_ratio"],
                use_dynamic_loss_scaling=cfg["use_dynamic_loss_scaling"],
            )
        else:
            logger.info("AMP with %s: no loss scaling (it has fp32's range)", amp.dtype)
        if "AMPOptimizer" not in applied:
            applied.append("AMPOptimizer")
    return tx


def _dgc(
    tx: optax.GradientTransformation, cfg: Mapping[str, Any]
) -> tuple[optax.GradientTransformation, GradientCommunication]:
    """``strategy.dgc``: the DGC optimizer replacing the user's Momentum, and its exchange.

    Raises:
      ValueError: not a Momentum optimizer, or one data-parallel worker (Paddle's checks).
    """
    run = _context.current()
    if run is not None:
        shape = dict(run.mesh.shape)
        workers = 1
        for axis in DATA_AXES:
            workers *= shape.get(axis, 1)
        if workers < 2:
            raise ValueError(
                "strategy.dgc=True needs more than one data-parallel worker (as Paddle's DGC "
                f"does), but dp x sharding x ep = {workers}; set hybrid_configs dp_degree > 1, or "
                "strategy.dgc=False."
            )
    begin, rampup, sparsity = cfg["rampup_begin_step"], cfg["rampup_step"], cfg["sparsity"]
    communication = dgc_communication(
        momentum_of(tx), rampup_begin_step=begin, rampup_step=rampup, sparsity=sparsity
    )
    return dgc_momentum(tx, rampup_begin_step=begin), communication


def _localsgd(
    strategy: Any, amp: AmpSettings | None, loss_scaling: Mapping[str, Any] | None
) -> LocalSGDConfig | None:
    """LocalSGD's settings from the strategy (None when off), checked against the rest."""
    if strategy.localsgd:
        cfg = strategy.localsgd_configs
        config = LocalSGDConfig(k_steps=cfg["k_steps"], begin_step=cfg["begin_step"])
    elif strategy.adaptive_localsgd:
        cfg = strategy.adaptive_localsgd_configs
        config = LocalSGDConfig(
            k_steps=cfg["init_k_steps"], begin_step=cfg["begin_step"], adaptive=True
        )
    else:
        return None
    name = config.switch.split("=")[0]
    if (amp is not None and amp.loss_scaling) or loss_scaling is not None:
        other = "strategy.amp=True (float16)" if loss_scaling is None else "a GradScaler"
        raise ValueError(
            f"{config.switch} cannot be combined with {other}: fp16 loss scaling would keep "
            "a loss scale per replica. Use AMP in bfloat16 (amp_configs={'dtype': "
            f"'bfloat16'}}), which needs no scaling, or set {name}=False."
        )
    if strategy.fp16_allreduce:
        raise ValueError(
            f"{config.switch} and strategy.fp16_allreduce=True cannot be combined: LocalSGD "
            "averages parameters and all-reduces no gradients, so fp16_allreduce would do "
            "nothing; turn one of them off."
        )
    if strategy.sharding:
        raise ValueError(
            f"{config.switch} and strategy.sharding=True cannot be combined: each replica "
            "keeps its own optimizer state, which ZeRO would split between them; turn one "
            "of them off."
        )
    return config

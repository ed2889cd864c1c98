"""Paddle's ``CtrCommonAccessor``: per-row statistics and the sparse SGD rules of a table.

A sparse table row holds an embedding ``w`` (``dim`` floats), its optimizer slots, and the
CTR statistics Paddle keeps per feature: ``show`` and ``click`` counts, ``delta_score``
(the show/click score gained since the row was last saved) and ``unseen_days``.

The score is Paddle's ``ShowClickScore``: ``(show - click) * nonclk_coeff + click *
click_coeff``. A push of a batch (``push_show`` occurrences, ``push_click`` of them
clicked, gradient ``g`` summed over the occurrences) does, per touched row, what Paddle's
``CtrCommonAccessor::Update`` does: ``show += push_show``, ``click += push_click``,
``delta_score += score(push_show, push_click)``, ``unseen_days = 0``, then the row's
``embed_sgd_rule`` on ``g / push_show`` (``show_scale``; otherwise ``g``):

* ``naive``: ``w -= learning_rate * g``;
* ``adagrad`` (``SparseAdaGradSGDRule``, one ``g2sum`` per row):
  ``w -= learning_rate * sqrt(initial_g2sum / (initial_g2sum + g2sum)) * g``, then
  ``g2sum += mean(g ** 2)``;
* ``adam`` (``SparseAdamSGDRule``, moments per element, ``beta1_pow`` / ``beta2_pow`` per
  row starting at the decay rates): ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
  ``w -= learning_rate * sqrt(1 - beta2_pow) / (1 - beta1_pow) * m / (sqrt(v) + eps)``,
  then ``beta*_pow *= b*``.

Weights are clipped to ``weight_bounds`` after each update; new rows start uniform in
``[-initial_range, initial_range]``. One rule covers the whole row (Paddle splits the row
into ``embed_w`` and ``embedx_w`` with two rules and an ``embedx_threshold``; here the
model decides what the columns mean).

Example:
  >>> acc = CtrAccessor(embed_sgd_rule=SparseSGDRule("naive", learning_rate=0.5))
  >>> import jax.numpy as jnp
  >>> w, slots = acc.embed_sgd_rule.apply(jnp.ones((1, 2)), {}, jnp.ones((1, 2)))
  >>> w.tolist()
  [[0.5, 0.5]]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["RULES", "CtrAccessor", "SparseSGDRule"]

#: The sparse SGD rules offered, by Paddle's ``embed_sparse_optimizer`` names.
RULES = ("naive", "adagrad", "adam")


def _positive(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{owner}({name}={value!r}): expected a positive number.")
    return float(value)


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{owner}({name}={value!r}): expected a number.")
    return float(value)


@dataclasses.dataclass(frozen=True)
class SparseSGDRule:
    """A row optimizer with Paddle's ``embed_sparse_*`` names and defaults.

    Args:
      name: ``"adagrad"`` (default), ``"adam"`` or ``"naive"``.
      learning_rate: Paddle's default 0.05.
      initial_g2sum: adagrad's prior gradient square sum (3.0).
      initial_range: new rows are uniform in ``[-initial_range, initial_range]`` (1e-4).
      weight_bounds: ``(low, high)`` every weight is clipped to after an update.
      beta1_decay_rate / beta2_decay_rate / ada_epsilon: adam's (0.9, 0.999, 1e-8).

    Example:
      >>> SparseSGDRule("adam").slot_shapes(4)
      {'gsum': (4,), 'g2sum': (4,), 'beta1_pow': (), 'beta2_pow': ()}
    """

    name: str = "adagrad"
    learning_rate: float = 0.05
    initial_g2sum: float = 3.0
    initial_range: float = 1e-4
    weight_bounds: tuple[float, float] = (-10.0, 10.0)
    beta1_decay_rate: float = 0.9
    beta2_decay_rate: float = 0.999
    ada_epsilon: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in RULES:
            raise ValueError(
                f"SparseSGDRule(name={self.name!r}): expected one of {list(RULES)} "
                "(Paddle's embed_sparse_optimizer names)."
            )
        owner = "SparseSGDRule"
        for field in ("learning_rate", "initial_g2sum", "ada_epsilon"):
            _positive(owner, field, getattr(self, field))
        if _number(owner, "initial_range", self.initial_range) < 0:
            raise ValueError(f"{owner}(initial_range={self.initial_range!r}): expected >= 0.")
        for field in ("beta1_decay_rate", "beta2_decay_rate"):
            value = _number(owner, field, getattr(self, field))
            if not 0 < value < 1:
                raise ValueError(f"{owner}({field}={value!r}): expected a rate in (0, 1).")
        bounds = tuple(self.weight_bounds)
        if len(bounds) != 2 or not _number(owner, "weight_bounds", bounds[0]) < _number(
            owner, "weight_bounds", bounds[1]
        ):
            raise ValueError(
                f"{owner}(weight_bounds={self.weight_bounds!r}): expected (low, high), low < high."
            )
        object.__setattr__(self, "weight_bounds", (float(bounds[0]), float(bounds[1])))

    def slot_shapes(self, dim: int) -> dict[str, tuple[int, ...]]:
        """The optimizer slots of one row: name -> shape (``()`` is one float per row)."""
        if self.name == "adagrad":
            return {"g2sum": ()}
        if self.name == "adam":
            return {"gsum": (dim,), "g2sum": (dim,), "beta1_pow": (), "beta2_pow": ()}
        return {}

    def slot_init(self, name: str) -> float:
        """The value a slot starts at in a new (or evicted) row."""
        return {"beta1_pow": self.beta1_decay_rate, "beta2_pow": self.beta2_decay_rate}.get(
            name, 0.0
        )

    def init_rows(self, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """Fresh weights for ``shape`` rows: uniform in ``[-initial_range, initial_range]``."""
        r = self.initial_range
        return jax.random.uniform(key, shape, jnp.float32, -r, r)

    def apply(
        self, w: jax.Array, slots: Mapping[str, jax.Array], g: jax.Array
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One update of rows ``w`` ``[n, dim]`` by their (already show-scaled) gradient ``g``."""
        lr = self.learning_rate
        if self.name == "naive":
            w, slots = w - lr * g, {}
        elif self.name == "adagrad":
            g2sum = slots["g2sum"]
            ratio = lr * jnp.sqrt(self.initial_g2sum / (self.initial_g2sum + g2sum))
            w = w - g * ratio[:, None]
            slots = {"g2sum": g2sum + jnp.mean(g * g, axis=1)}
        else:
            b1, b2 = self.beta1_decay_rate, self.beta2_decay_rate
            p1, p2 = slots["beta1_pow"], slots["beta2_pow"]
            m = b1 * slots["gsum"] + (1 - b1) * g
            v = b2 * slots["g2sum"] + (1 - b2) * g * g
            step = lr * jnp.sqrt(1 - p2) / (1 - p1)
            w = w - step[:, None] * m / (jnp.sqrt(v) + self.ada_epsilon)
            slots = {"gsum": m, "g2sum": v, "beta1_pow": p1 * b1, "beta2_pow": p2 * b2}
        return jnp.clip(w, *self.weight_bounds), slots


@dataclasses.dataclass(frozen=True)
class CtrAccessor:
    """Paddle's ``CtrCommonAccessor`` settings (``ctr_accessor_param``), with its defaults.

    Args:
      embed_sgd_rule: the row optimizer (default adagrad).
      nonclk_coeff / click_coeff: weights of a non-clicked and a clicked show in the score.
      base_threshold: a row is saved in base / delta saves and cached only with a score at
        least this.
      delta_threshold: a delta save (mode 1) takes rows whose score gained since their last
        save is at least this.
      delta_keep_days: base / delta / cache saves skip rows unseen for more days.
      show_click_decay_rate: show and click are multiplied by it once per day
        (:func:`jfleet.ps.lifecycle.set_date`).
      delete_threshold: ``shrink`` evicts rows scoring below it.
      delete_after_unseen_days: ``shrink`` evicts rows unseen for more days.
      show_scale: divide a pushed gradient by the row's shows in the batch (Paddle: True).

    Example:
      >>> CtrAccessor().score(10.0, 1.0)  # 9 non-clicks * 0.1 + 1 click * 1.0
      1.9
    """

    embed_sgd_rule: SparseSGDRule = dataclasses.field(default_factory=SparseSGDRule)
    nonclk_coeff: float = 0.1
    click_coeff: float = 1.0
    base_threshold: float = 1.5
    delta_threshold: float = 0.25
    delta_keep_days: float = 16
    show_click_decay_rate: float = 0.98
    delete_threshold: float = 0.8
    delete_after_unseen_days: float = 30
    show_scale: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.embed_sgd_rule, SparseSGDRule):
            raise TypeError(
                f"CtrAccessor(embed_sgd_rule={self.embed_sgd_rule!r}): expected a "
                "SparseSGDRule, e.g. SparseSGDRule('adam')."
            )
        for field in dataclasses.fields(self):
            if field.name in ("embed_sgd_rule", "show_scale"):
                continue
            value = _number("CtrAccessor", field.name, getattr(self, field.name))
            if value < 0:
                raise ValueError(f"CtrAccessor({field.name}={value!r}): expected >= 0.")
        rate = self.show_click_decay_rate
        if not 0 < rate <= 1:
            raise ValueError(
                f"CtrAccessor(show_click_decay_rate={rate!r}): expected a rate in (0, 1]."
            )

    def score(self, show: Any, click: Any) -> Any:
        """Paddle's ``ShowClickScore``: ``(show - click) * nonclk_coeff + click * click_coeff``."""
        return (show - click) * self.nonclk_coeff + click * self.click_coeff

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data (saved next to a table)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CtrAccessor:
        """The inverse of :meth:`to_dict`."""
        data = dict(data)
        rule = dict(data.pop("embed_sgd_rule"))
        rule["weight_bounds"] = tuple(rule["weight_bounds"])
        return cls(embed_sgd_rule=SparseSGDRule(**rule), **data)

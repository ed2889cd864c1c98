"""A model's routed experts, as the cost model prices them: :class:`MoESpec`.

:attr:`~jfleet.auto_parallel.match.matched.ModelPatterns.moe` holds one when the model's
decoder blocks route their tokens to experts. The patterns' ``params`` and ``dots`` then
describe the model *without* its routed experts and routers (attention, norms, shared
experts or dense MLPs, embedding, head); the spec adds the experts' weights, their
compute, the router and the all-to-alls
(:mod:`jfleet.auto_parallel.cost.cost_moe`). Shape-built plans set it
(:class:`~jfleet.auto_parallel.search.model_shapes.ModelShape`'s ``moe``), and so does the
matcher for traced code routing to stacked experts
(:func:`~jfleet.auto_parallel.match.experts.find_experts`), which holds the expert weights
and routers in ``routed`` instead of ``params``.

Example:
  >>> mixtral = MoESpec(experts=8, top_k=2, expert_ffn=14336, layers=32)
  >>> mixtral.expert_params(4096) / 1e9, mixtral.active_expert_params(4096) / 1e9
  (45.098205184, 11.275337728)
"""

from __future__ import annotations

import dataclasses

__all__ = ["DISPATCHES", "MoESpec"]

#: :attr:`MoESpec.dispatch`'s values.
DISPATCHES = ("exchange", "einsum", "list", "ragged", "gather", "own")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The routed experts of a decoder.

    Attributes:
      experts: routed experts a MoE layer (``E``).
      top_k: experts a token takes (``k``).
      expert_ffn: each expert's MLP hidden size.
      layers: MoE layers (each with its router and ``E`` experts).
      every: one block in ``every`` is a MoE layer (1: all of them).
      gated: SwiGLU experts (gate, up, down: 3 matrices) or not (up, down: 2).
      capacity_factor: GShard's factor (``ceil(f T k / E)`` slots an expert, tokens over it
        dropped), or None for dropless.
      dispatch: how tokens reach the experts: ``"exchange"``, jfleet's all-to-alls
        (:func:`jfleet.parallel.moe.layer.moe`; shape-built plans); ``"einsum"``, a traced
        model's own code applying each whole expert stack in products that keep the expert
        dimension (every expert on every token and a one-hot combine, Qwen3-MoE's CPU path;
        or the slots of a one-hot capacity dispatch, GShard's and MaxText's
        ``dense_matmul``), which ``to_distributed`` runs over ``ep`` by gathering each MoE
        layer's tokens over the ``ep`` group (:mod:`jfleet.auto_parallel.apply.expert_tokens`);
        ``"list"``, a list of expert modules each applied to every token and masked
        (Mixtral's reference), which ``to_distributed`` runs over ``ep`` with each expert's
        hidden dimension split over ``ep`` in the ring of experts (``rows_per_token`` as
        ``"einsum"``'s);
        ``"ragged"``, a traced model's ``jax.lax.ragged_dot`` over its token copies sorted
        by expert (tunix's Megablox path, MaxText's ``sparse_matmul``), which
        ``to_distributed`` runs over ``ep`` with each rank computing its experts' rows of the
        ``ep`` group's tokens (:mod:`jfleet.auto_parallel.apply.expert_rows`);
        ``"gather"``, a per-token gather of the experts' weights (``w[expert_indices]``,
        gpt-oss's reference), which runs as written at ``ep = 1`` and over ``ep`` as the
        ragged one, its gathers and their products computed as ``ragged_dot`` products over the
        rank's experts' rows; ``"own"``, any other traced dispatch of routed rows, which
        GSPMD does not run over ``ep`` as priced: ``ep`` is not searched.
      rows_per_token: with ``"einsum"`` or ``"list"``, the expert rows the traced products
        compute a token (``E`` for every expert on every token, ``E x C / T`` with ``C``
        slots an expert); None otherwise.
    """

    experts: int
    top_k: int
    expert_ffn: int
    layers: int
    every: int = 1
    gated: bool = True
    capacity_factor: float | None = None
    dispatch: str = "exchange"
    rows_per_token: float | None = None

    def __post_init__(self) -> None:
        for f in ("experts", "top_k", "expert_ffn", "layers", "every"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoESpec({f}={value!r}): expected an int >= 1.")
        if self.top_k > self.experts:
            raise ValueError(f"MoESpec(top_k={self.top_k}) exceeds experts={self.experts}.")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoESpec(capacity_factor={self.capacity_factor!r}) must be > 0.")
        if self.dispatch not in DISPATCHES:
            raise ValueError(
                f"MoESpec(dispatch={self.dispatch!r}): expected one of {', '.join(DISPATCHES)}."
            )

    @property
    def matrices(self) -> int:
        """Weight matrices an expert (3 gated, 2 not)."""
        return 3 if self.gated else 2

    def one_expert(self, width: int) -> int:
        """One expert's weights (elements)."""
        return self.matrices * width * self.expert_ffn

    def expert_params(self, width: int) -> int:
        """Every MoE layer's routed experts and router (elements)."""
        return self.layers * (self.experts * self.one_expert(width) + width * self.experts)

    def active_expert_params(self, width: int) -> int:
        """What one token runs of them: ``k`` experts and the router a layer (elements)."""
        return self.layers * (self.top_k * self.one_expert(width) + width * self.experts)

"""Mixture-of-experts decoder LMs written the way public JAX / Flax NNX MoE code writes them
(issue 39, item 5): imitated from reading the public code, nothing copied.

* :class:`Qwen3MoeForCausalLM` (``qwen3_moe``): Qwen3-MoE as tunix's Flax NNX port and
  Hugging Face's port write it: the experts' weights stacked as bare ``nnx.Param``\\ s
  ``gate_proj`` / ``up_proj`` ``[E, D, F]`` and ``down_proj`` ``[E, F, D]``, a router
  ``nnx.Linear(D, E, use_bias=False)`` named ``gate``, a softmax over all experts then the
  top-k, renormalised (``norm_topk_prob=True``). ``dispatch="dense"`` sends every token
  through every expert and weights the outputs by a zero-filled ``[T, E]`` combine matrix
  (tunix's CPU path); ``dispatch="ragged"`` sorts the token copies by expert and runs
  ``jax.lax.ragged_dot`` over the groups (tunix's Megablox path, MaxText's ``sparse_matmul``);
  ``dispatch="capacity"`` gives each expert ``ceil(capacity_factor * T * k / E)`` slots, fills
  them in routing order by a cumulative sum of the one-hot choices (first choices first),
  drops the rest, and moves the tokens in and out of the ``[E, C, D]`` buffers by einsums
  with the one-hot dispatch and combine tensors (GShard's and MaxText's ``dense_matmul``).
  Attention: the ``gqa_qknorm`` style's :class:`~.ports.Qwen3Attention` (GQA, q/k norms).
* :class:`MixtralForCausalLM` (``mixtral``): Mistral's reference and Hugging Face's Mixtral:
  a ``block_sparse_moe`` holding a router ``gate`` and an ``nnx.List`` of expert MLPs with
  ``w1`` / ``w2`` / ``w3``; the top-2 of the router logits, then a softmax over those two;
  each expert applied to the tokens routed to it through a ``jnp.where`` mask (static shapes).
* :class:`GptOssForCausalLM` (``gpt_oss``): OpenAI's gpt-oss reference and Hugging Face's
  port: one fused, interleaved ``gate_up_proj [E, D, 2F]`` read as ``[..., ::2]`` /
  ``[..., 1::2]``, biases ``gate_up_proj_bias`` / ``down_proj_bias``, the clamped SwiGLU
  (alpha 1.702, limit 7.0, ``(up + 1)``), a biased ``router`` whose top-4 logits are
  softmaxed, the selected experts' weights gathered per token (the reference's
  ``weight[expert_indices]``), and attention with a learned sink logit per head joining the
  softmax, sliding-window and full attention alternating over the layers.

Qwen3-MoE and Mixtral return ``(logits, aux)``: a Switch load-balancing loss ``E * sum_e
f_e P_e`` (:func:`load_balancing_loss`) times ``router_aux_loss_coef``, in two forms. Qwen3-MoE's
decoder layers return ``(x, router_logits)`` and the model takes one loss over every layer's
logits concatenated (Hugging Face's ``load_balancing_loss_func``); Mixtral's layers return
``(x, aux)`` with their own router's loss and the model adds them up (MaxText's per-layer
loss; the summed block output ``to_distributed`` carries through pipelines). GPT-OSS returns
logits alone, as the reference does.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> call = nnx.jit(lambda m, t: m(t))  # one program (eagerly, each op runs on its own)
  >>> model = MixtralForCausalLM(MixtralConfig(), rngs=nnx.Rngs(0))
  >>> logits, aux = call(model, jnp.zeros((2, 6), jnp.int32))
  >>> logits.shape, aux.shape
  ((2, 6, 64), ())
  >>> call(GptOssForCausalLM(GptOssConfig(), rngs=nnx.Rngs(0)), jnp.zeros((2, 6), jnp.int32)).shape
  (2, 6, 64)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jfleet.testing.nnx_styles._shared import arange_positions, rope
from jfleet.testing.nnx_styles.ports import Qwen3Attention, Qwen3Config

__all__ = [
    "GptOssAttention",
    "GptOssConfig",
    "GptOssExperts",
    "GptOssForCausalLM",
    "GptOssMLP",
    "MixtralConfig",
    "MixtralForCausalLM",
    "MixtralSparseMoeBlock",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeSparseMoeBlock",
    "clamped_swiglu",
    "load_balancing_loss",
]


def load_balancing_loss(router_logits: jax.Array, top_k: int) -> jax.Array:
    """The Switch / Hugging Face load-balancing loss ``E * sum_e f_e P_e`` of one router.

    ``f_e``: the fraction of tokens with ``e`` among their top-k experts; ``P_e``: the mean
    router probability of ``e``; ``router_logits: [T, E]``. ``top_k`` when both are uniform.

    Example:
      >>> float(load_balancing_loss(jnp.zeros((4, 8)).at[:, :2].set(1.0), 2)) > 1.0
      True
    """
    experts = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, selected = jax.lax.top_k(probs, top_k)
    tokens_per_expert = jax.nn.one_hot(selected, experts).sum(axis=-2).mean(axis=0)
    return experts * jnp.sum(tokens_per_expert * probs.mean(axis=0))


def _causal_mask(positions: jax.Array, window: int | None = None) -> jax.Array:
    """``[b, 1, s, s]``: key at or before the query (and within ``window`` of it)."""
    delta = positions[:, :, None] - positions[:, None, :]
    visible = delta >= 0
    if window is not None:
        visible = visible & (delta < window)
    return visible[:, None]


# --- qwen3_moe: stacked experts, dense or ragged dispatch -------------------------------------
@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3Config's attention fields plus the MoE ones (Hugging Face's names).

    Example:
      >>> Qwen3MoeConfig().num_experts, Qwen3MoeConfig(dispatch="ragged").dispatch
      (8, 'ragged')
    """

    vocab_size: int = 64
    hidden_size: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 16
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001
    dispatch: str = "dense"
    capacity_factor: float = 1.25

    def __post_init__(self):
        if self.dispatch not in ("dense", "ragged", "capacity"):
            raise ValueError(f"dispatch={self.dispatch!r}: use 'dense', 'ragged' or 'capacity'.")


class Qwen3MoeSparseMoeBlock(nnx.Module):
    """Stacked experts ``[E, D, F]`` behind a softmax-then-top-k router named ``gate``.

    Returns ``(out, router_logits)``: ``out [b, s, D]``, ``router_logits [b * s, E]``.

    Example:
      >>> block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(), rngs=nnx.Rngs(0))
      >>> block.gate_proj.shape, block.down_proj.shape
      ((8, 32, 16), (8, 16, 32))
    """

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        e, d, f = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(0.1)
        self.gate = nnx.Linear(d, e, use_bias=False, rngs=rngs)
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f)))
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, f)))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d)))

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [T, D]`` -> ``(weights [T, k], experts [T, k], router_logits [T, E])``."""
        router_logits = self.gate(x)
        probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.config.num_experts_per_tok)
        if self.config.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights.astype(x.dtype), experts, router_logits

    def dense(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """Every token through every expert, weighted by a zero-filled ``[T, E]`` matrix."""
        combine = jnp.sum(weights[..., None] * jax.nn.one_hot(experts, self.config.num_experts), 1)
        gate = jnp.einsum("td,edf->tef", x, self.gate_proj[...])
        up = jnp.einsum("td,edf->tef", x, self.up_proj[...])
        out = jnp.einsum("tef,efd->ted", nnx.silu(gate) * up, self.down_proj[...])
        return jnp.einsum("ted,te->td", out, combine)

    def ragged(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """The token copies sorted by expert, one ``ragged_dot`` per projection, unsorted."""
        k = experts.shape[-1]
        flat = experts.reshape(-1)
        order = jnp.argsort(flat)
        group_sizes = jnp.bincount(flat, length=self.config.num_experts).astype(jnp.int32)
        sorted_x = jnp.repeat(x, k, axis=0)[order]
        gate = jax.lax.ragged_dot(sorted_x, self.gate_proj[...], group_sizes)
        up = jax.lax.ragged_dot(sorted_x, self.up_proj[...], group_sizes)
        out = jax.lax.ragged_dot(nnx.silu(gate) * up, self.down_proj[...], group_sizes)
        out = out[jnp.argsort(order)].reshape(x.shape[0], k, x.shape[-1])
        return jnp.einsum("tkd,tk->td", out, weights)

    def capacity(self, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
        """``C`` slots an expert filled in routing order; one-hot einsums in and out."""
        (t, k), e = experts.shape, self.config.num_experts
        slots = math.ceil(self.config.capacity_factor * t * k / e)
        chosen = jax.nn.one_hot(experts, e, dtype=jnp.int32)  # [T, k, E]
        order = chosen.transpose(1, 0, 2).reshape(k * t, e)  # every first choice first
        position = (jnp.cumsum(order, axis=0) - 1).reshape(k, t, e).transpose(1, 0, 2)
        kept = chosen * (position < slots)
        dispatch = jax.nn.one_hot(jnp.sum(position * kept, -1), slots) * kept.sum(-1)[..., None]
        dispatch = jnp.einsum("tke,tkc->tec", kept.astype(x.dtype), dispatch)  # [T, E, C]
        combine = jnp.einsum("tk,tke,tec->tec", weights, kept.astype(x.dtype), dispatch)
        expert_in = jnp.einsum("tec,td->ecd", dispatch, x)
        gate = jnp.einsum("ecd,edf->ecf", expert_in, self.gate_proj[...])
        up = jnp.einsum("ecd,edf->ecf", expert_in, self.up_proj[...])
        out = jnp.einsum("ecf,efd->ecd", nnx.silu(gate) * up, self.down_proj[...])
        return jnp.einsum("ecd,tec->td", out, combine)

    def __call__(self, hidden_states: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, s, d = hidden_states.shape
        x = hidden_states.reshape(b * s, d)
        weights, experts, router_logits = self.route(x)
        dispatch = getattr(self, self.config.dispatch)
        return dispatch(x, weights, experts).reshape(b, s, d), router_logits


class Qwen3MoeDecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        eps = config.rms_norm_eps
        self.input_layernorm = nnx.RMSNorm(config.hidden_size, epsilon=eps, rngs=rngs)
        self.self_attn = Qwen3Attention(config, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(config.hidden_size, epsilon=eps, rngs=rngs)
        self.mlp = Qwen3MoeSparseMoeBlock(config, rngs=rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, mask: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """``(hidden_states, router_logits [b * s, E])``, as Hugging Face's layer returns them
        with ``output_router_logits=True``."""
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        out, router_logits = self.mlp(self.post_attention_layernorm(x))
        return x + out, router_logits


class Qwen3MoeForCausalLM(nnx.Module):
    """``model(input_ids) -> (logits, aux)``; blocks at ``model.layers``.

    Example:
      >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(dispatch="ragged"), rngs=nnx.Rngs(0))
      >>> nnx.jit(lambda m, t: m(t))(model, jnp.zeros((2, 6), jnp.int32))[0].shape  # one program
      (2, 6, 64)
    """

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = nnx.Dict(
            embed_tokens=nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs),
            layers=nnx.List(
                Qwen3MoeDecoderLayer(config, rngs=rngs) for _ in range(config.num_hidden_layers)
            ),
            norm=nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, rngs=rngs),
        )
        self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        positions = arange_positions(input_ids)
        mask = _causal_mask(positions)
        hidden_states, all_router_logits = self.model.embed_tokens(input_ids), ()
        for decoder_layer in self.model.layers:
            hidden_states, router_logits = decoder_layer(hidden_states, positions, mask)
            all_router_logits += (router_logits,)
        logits = self.lm_head(self.model.norm(hidden_states))
        aux_loss = load_balancing_loss(
            jnp.concatenate(all_router_logits, axis=0), self.config.num_experts_per_tok
        )
        return logits, self.config.router_aux_loss_coef * aux_loss


# --- mixtral: a list of expert MLPs, top-2 then softmax, masked ------------------------------
@dataclasses.dataclass(frozen=True)
class MixtralConfig:
    """Hugging Face's Mixtral field names, tiny.

    Example:
      >>> MixtralConfig().num_local_experts, MixtralConfig().num_experts_per_tok
      (8, 2)
    """

    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 16
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    router_aux_loss_coef: float = 0.02


class MixtralAttention(nnx.Module):
    def __init__(self, config: MixtralConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        kv = config.num_key_value_heads * self.head_dim
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.q_proj = linear(config.hidden_size, config.hidden_size)
        self.k_proj, self.v_proj = linear(config.hidden_size, kv), linear(config.hidden_size, kv)
        self.o_proj = linear(config.hidden_size, config.hidden_size)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, -1, self.head_dim)
        k = self.k_proj(x).reshape(b, s, -1, self.head_dim)
        v = self.v_proj(x).reshape(b, s, -1, self.head_dim)
        theta = self.config.rope_theta
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        return self.o_proj(jax.nn.dot_product_attention(q, k, v, mask=mask).reshape(b, s, -1))


class MixtralBlockSparseTop2MLP(nnx.Module):
    def __init__(self, config: MixtralConfig, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        self.w1 = nnx.Linear(d, f, use_bias=False, rngs=rngs)
        self.w2 = nnx.Linear(f, d, use_bias=False, rngs=rngs)
        self.w3 = nnx.Linear(d, f, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(nnx.silu(self.w1(x)) * self.w3(x))


class MixtralSparseMoeBlock(nnx.Module):
    """A router ``gate`` and an ``nnx.List`` of ``w1`` / ``w2`` / ``w3`` experts; each token
    goes to the top-2 of its router logits, weighted by the softmax over those two.

    Returns ``(out [b, s, D], router_logits [b * s, E])``.

    Example:
      >>> block = MixtralSparseMoeBlock(MixtralConfig(), rngs=nnx.Rngs(0))
      >>> len(block.experts), block.experts[0].w2.kernel.shape
      (8, (16, 32))
    """

    def __init__(self, config: MixtralConfig, *, rngs: nnx.Rngs):
        self.top_k = config.num_experts_per_tok
        self.gate = nnx.Linear(
            config.hidden_size, config.num_local_experts, use_bias=False, rngs=rngs
        )
        self.experts = nnx.List(
            MixtralBlockSparseTop2MLP(config, rngs=rngs) for _ in range(config.num_local_experts)
        )

    def __call__(self, hidden_states: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, s, d = hidden_states.shape
        x = hidden_states.reshape(b * s, d)
        router_logits = self.gate(x)
        top_logits, selected_experts = jax.lax.top_k(router_logits, self.top_k)
        routing_weights = jax.nn.softmax(top_logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        results = jnp.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = selected_experts == i  # [T, k]: at most one slot per token
            weight = jnp.sum(jnp.where(chosen, routing_weights, 0.0), axis=-1)
            results = results + jnp.where(chosen.any(-1)[:, None], weight[:, None] * expert(x), 0.0)
        return results.reshape(b, s, d), router_logits


class MixtralDecoderLayer(nnx.Module):
    def __init__(self, config: MixtralConfig, *, rngs: nnx.Rngs):
        self.top_k = config.num_experts_per_tok
        eps = config.rms_norm_eps
        self.input_layernorm = nnx.RMSNorm(config.hidden_size, epsilon=eps, rngs=rngs)
        self.self_attn = MixtralAttention(config, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(config.hidden_size, epsilon=eps, rngs=rngs)
        self.block_sparse_moe = MixtralSparseMoeBlock(config, rngs=rngs)

    def __call__(
        self, x: jax.Array, positions: jax.Array, mask: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        out, router_logits = self.block_sparse_moe(self.post_attention_layernorm(x))
        return x + out, load_balancing_loss(router_logits, self.top_k)


class MixtralForCausalLM(nnx.Module):
    """``model(input_ids) -> (logits, aux)``; blocks at ``model.layers``.

    Example:
      >>> MixtralForCausalLM(MixtralConfig(), rngs=nnx.Rngs(0)).model.layers[1].top_k
      2
    """

    def __init__(self, config: MixtralConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = nnx.Dict(
            embed_tokens=nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs),
            layers=nnx.List(
                MixtralDecoderLayer(config, rngs=rngs) for _ in range(config.num_hidden_layers)
            ),
            norm=nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, rngs=rngs),
        )
        self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        positions = arange_positions(input_ids)
        mask = _causal_mask(positions)
        hidden_states, aux_loss = self.model.embed_tokens(input_ids), 0.0
        for layer in self.model.layers:
            hidden_states, layer_aux = layer(hidden_states, positions, mask)
            aux_loss = aux_loss + layer_aux
        logits = self.lm_head(self.model.norm(hidden_states))
        return logits, self.config.router_aux_loss_coef * aux_loss


# --- gpt_oss: fused interleaved gate/up with biases, clamped swiglu, attention sinks ---------
@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """The gpt-oss reference's / Hugging Face's field names, tiny (window 4 on even layers).

    Example:
      >>> GptOssConfig().layer_types
      ('sliding_attention', 'full_attention')
    """

    vocab_size: int = 64
    hidden_size: int = 32
    intermediate_size: int = 16
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    num_local_experts: int = 8
    num_experts_per_tok: int = 4
    sliding_window: int = 4
    swiglu_limit: float = 7.0
    rope_theta: float = 150_000.0
    rms_norm_eps: float = 1e-5

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(self.num_hidden_layers)
        )


def clamped_swiglu(gate_up: jax.Array, alpha: float = 1.702, limit: float = 7.0) -> jax.Array:
    """GPT-OSS's SwiGLU of an interleaved ``[..., 2F]``: gate ``::2`` clamped above at
    ``limit``, up ``1::2`` clamped to ``[-limit, limit]``, ``gate * sigmoid(alpha * gate) *
    (up + 1)``.

    Example:
      >>> round(float(clamped_swiglu(jnp.array([100.0, 0.0]))[0]), 3)  # the gate is clamped to 7
      7.0
    """
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1.0)


class GptOssAttention(nnx.Module):
    """Biased GQA projections and a learned ``sinks [H]`` logit per head that joins each
    query's softmax (and takes its share of the probability); ``sliding_window`` or None.

    Example:
      >>> GptOssAttention(GptOssConfig(), 4, rngs=nnx.Rngs(0)).sinks.shape
      (4,)
    """

    def __init__(self, config: GptOssConfig, sliding_window: int | None, *, rngs: nnx.Rngs):
        self.config, self.sliding_window = config, sliding_window
        h, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        linear = functools.partial(nnx.Linear, use_bias=True, rngs=rngs)
        self.q_proj = linear(config.hidden_size, h * hd)
        self.k_proj = linear(config.hidden_size, kv * hd)
        self.v_proj = linear(config.hidden_size, kv * hd)
        self.o_proj = linear(h * hd, config.hidden_size)
        self.sinks = nnx.Param(jnp.zeros((h,)))

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        hd, theta = self.config.head_dim, self.config.rope_theta
        q = rope(self.q_proj(x).reshape(b, s, -1, hd), positions, theta)
        k = rope(self.k_proj(x).reshape(b, s, -1, hd), positions, theta)
        v = self.v_proj(x).reshape(b, s, -1, hd)
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(q.dtype)
        mask = _causal_mask(positions, self.sliding_window)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        sinks = jnp.broadcast_to(self.sinks[...][None, :, None, None], (b, q.shape[2], s, 1))
        combined = jnp.concatenate([scores, sinks.astype(scores.dtype)], axis=-1)
        combined = combined - jnp.max(combined, axis=-1, keepdims=True)
        probs = jax.nn.softmax(combined, axis=-1)[..., :-1]  # the sink's share is dropped
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return self.o_proj(out.reshape(b, s, -1))


class GptOssExperts(nnx.Module):
    """``gate_up_proj [E, D, 2F]`` (interleaved) and ``down_proj [E, F, D]`` with biases;
    each token's selected experts' weights are gathered (``gate_up_proj[expert_indices]``).

    Example:
      >>> experts = GptOssExperts(GptOssConfig(), rngs=nnx.Rngs(0))
      >>> experts.gate_up_proj.shape, experts.gate_up_proj_bias.shape
      ((8, 32, 32), (8, 32))
    """

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs):
        self.limit = config.swiglu_limit
        e, d, f = config.num_local_experts, config.hidden_size, config.intermediate_size
        init = nnx.initializers.normal(0.1)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (e, d, 2 * f)))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((e, 2 * f)))
        self.down_proj = nnx.Param(init(rngs.params(), (e, f, d)))
        self.down_proj_bias = nnx.Param(jnp.zeros((e, d)))

    def __call__(self, x: jax.Array, expert_indices: jax.Array, weights: jax.Array) -> jax.Array:
        """``x [T, D]``, ``expert_indices`` / ``weights [T, k]`` -> ``[T, D]``."""
        w1 = self.gate_up_proj[...][expert_indices]  # [T, k, D, 2F]
        h = jnp.einsum("td,tkdf->tkf", x, w1) + self.gate_up_proj_bias[...][expert_indices]
        h = clamped_swiglu(h, limit=self.limit)
        w2 = self.down_proj[...][expert_indices]  # [T, k, F, D]
        out = jnp.einsum("tkf,tkfd->tkd", h, w2) + self.down_proj_bias[...][expert_indices]
        return jnp.einsum("tkd,tk->td", out, weights)


class GptOssMLP(nnx.Module):
    """A biased ``router``; the top-k logits, then their softmax; :class:`GptOssExperts`.

    Example:
      >>> GptOssMLP(GptOssConfig(), rngs=nnx.Rngs(0)).router.bias.shape
      (8,)
    """

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs):
        self.top_k = config.num_experts_per_tok
        self.router = nnx.Linear(config.hidden_size, config.num_local_experts, rngs=rngs)
        self.experts = GptOssExperts(config, rngs=rngs)

    def __call__(self, hidden_states: jax.Array) -> jax.Array:
        b, s, d = hidden_states.shape
        x = hidden_states.reshape(b * s, d)
        top_logits, expert_indices = jax.lax.top_k(self.router(x), self.top_k)
        weights = jax.nn.softmax(top_logits.astype(jnp.float32), axis=-1).astype(x.dtype)
        return self.experts(x, expert_indices, weights).reshape(b, s, d)


class GptOssDecoderLayer(nnx.Module):
    def __init__(self, config: GptOssConfig, layer_idx: int, *, rngs: nnx.Rngs):
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        eps = config.rms_norm_eps
        self.input_layernorm = nnx.RMSNorm(config.hidden_size, epsilon=eps, rngs=rngs)
        window = config.sliding_window if sliding else None
        self.self_attn = GptOssAttention(config, window, rngs=rngs)
        self.post_attention_layernorm = nnx.RMSNorm(config.hidden_size, epsilon=eps, rngs=rngs)
        self.mlp = GptOssMLP(config, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions)
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(nnx.Module):
    """``model(input_ids) -> logits``; blocks at ``model.layers`` (sliding, full, ...).

    Example:
      >>> model = GptOssForCausalLM(GptOssConfig(), rngs=nnx.Rngs(0))
      >>> [layer.self_attn.sliding_window for layer in model.model.layers]
      [4, None]
    """

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs):
        self.model = nnx.Dict(
            embed_tokens=nnx.Embed(config.vocab_size, config.hidden_size, rngs=rngs),
            layers=nnx.List(
                GptOssDecoderLayer(config, i, rngs=rngs) for i in range(config.num_hidden_layers)
            ),
            norm=nnx.RMSNorm(config.hidden_size, epsilon=config.rms_norm_eps, rngs=rngs),
        )
        self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        positions = arange_positions(input_ids)
        hidden_states = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden_states = layer(hidden_states, positions)
        return self.lm_head(self.model.norm(hidden_states))

"""Issue 39 item 4: ``to_distributed`` recognises routed experts in traced user code
(:mod:`jfleet.auto_parallel.match.experts`) and splits them over a forced ``ep``; its search
keeps them off ``ep`` (their own dispatch is not what the cost model prices) and says so."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, match_patterns, to_distributed
from jfleet.auto_parallel.match.moe_spec import MoESpec
from jfleet.auto_parallel.search.plan import Plan
from jfleet.auto_parallel.search.planner import plan_for
from jfleet.models.llama import TinyLlama
from jfleet.testing import assert_trees_close, hlo, train_one_device
from jfleet.testing.nnx_styles import MOE_STYLES
from jfleet.testing.nnx_styles.moe_styles import (
    GptOssConfig,
    GptOssForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from jfleet.testing.nnx_styles.registry import token_batches

from .test_moe_styles import STEPS, one_device

STACKED = ("qwen3_moe", "qwen3_moe_ragged", "gpt_oss")
#: Per style: the router module and the stacked expert weights, under a block.
ROUTED = {
    "qwen3_moe": ("mlp.gate", ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    "gpt_oss": (
        "mlp.router",
        tuple(
            f"mlp.experts.{w}"
            for w in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        ),
    ),
}
ROUTED["qwen3_moe_ragged"] = ROUTED["qwen3_moe"]
ROUTED["mixtral"] = ("block_sparse_moe.gate", ())
#: How each style reaches its experts: every expert on every token (a one-hot combine),
#: ragged_dots over token copies sorted by expert, or a per-token gather of the experts'
#: weights.
DISPATCH = {
    "qwen3_moe": ("einsum", 8.0),
    "qwen3_moe_ragged": ("ragged", None),
    "gpt_oss": ("gather", None),
    "mixtral": ("list", 8.0),
}


@functools.cache
def _matched(name: str):
    style = MOE_STYLES[name]
    model = style.build(nnx.Rngs(0))
    return model, match_patterns(model, style.batches(1)[0], forward=style.forward)


def _config_spec(name: str, dispatch: tuple = ("exchange", None)) -> MoESpec:
    config = GptOssConfig() if name == "gpt_oss" else Qwen3MoeConfig()
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return MoESpec(
        experts=experts,
        top_k=config.num_experts_per_tok,
        expert_ffn=ffn,
        layers=config.num_hidden_layers,
        dispatch=dispatch[0],
        rows_per_token=dispatch[1],
    )


@pytest.mark.parametrize("name", STACKED)
def test_stacked_experts_are_matched_as_the_style_s_config_and_left_out_of_params(name):
    model, found = _matched(name)
    assert found.moe == _config_spec(name, DISPATCH[name])
    router, experts = ROUTED[name]
    routed = {p.path: p for p in found.routed}
    want = set()
    for layer in range(MOE_STYLES[name].layers):
        at = f"{MOE_STYLES[name].blocks_at}.{layer}."
        want |= {at + w for w in experts} | {p for p in routed if p.startswith(at + router + ".")}
        assert routed[at + router + ".kernel"].role == "router"
    assert set(routed) == want
    # params and dots describe the model without them (the spec prices them)
    assert not {p.path for p in found.params} & set(routed)
    assert not {d.param for d in found.dots} & set(routed)
    # no product of two activations but attention's two a layer (scores and values)
    assert sum(d.param is None for d in found.dots) == 2 * found.dims.layers
    total = sum(p.size for p in (*found.params, *found.routed))
    assert total == sum(v.size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_mixtral_s_list_of_expert_modules_is_matched_as_listed_experts():
    """Mixtral's ``nnx.List`` of 8 ``w1`` / ``w2`` / ``w3`` experts beside its router: a
    ``"list"`` dispatch, every expert on every token (8 rows a token); each expert's
    kernels keep their column / row split (the dimension ep splits too)."""
    _, found = _matched("mixtral")
    assert (found.moe.dispatch, found.moe.rows_per_token) == ("list", 8.0)
    assert (found.moe.experts, found.moe.top_k, found.moe.expert_ffn) == (8, 2, 16)
    routed = {p.path: p for p in found.routed}
    at = "model.layers.0.block_sparse_moe."
    assert routed[at + "gate.kernel"].role == "router"
    kernels = {p for p in routed if p.startswith(at + "experts.")}
    assert len(kernels) == 8 * 3
    assert {routed[at + f"experts.3.{w}.kernel"].split_dim for w in ("w1", "w3")} == {1}
    assert routed[at + "experts.3.w2.kernel"].split_dim == 0
    assert not {p.path for p in found.params} & set(routed)


def test_a_list_of_unlike_modules_beside_a_router_is_not_taken_and_the_note_says_why():
    """Experts of two widths in one list: no listed experts; the note says what was looked
    for."""
    model = MOE_STYLES["mixtral"].build(nnx.Rngs(0))  # not _matched's (shared) one
    for layer in model.model.layers:
        expert = layer.block_sparse_moe.experts[5]
        expert.w1 = nnx.Linear(32, 24, use_bias=False, rngs=nnx.Rngs(1))
        expert.w3 = nnx.Linear(32, 24, use_bias=False, rngs=nnx.Rngs(2))
        expert.w2 = nnx.Linear(24, 32, use_bias=False, rngs=nnx.Rngs(3))
    style = MOE_STYLES["mixtral"]
    found = match_patterns(model, style.batches(1)[0], forward=style.forward)
    assert found.moe is None and found.routed == ()
    (note,) = [n for n in found.notes if "routes to the top 2 of 8 experts" in n]
    assert "nor a list of 8 alike expert modules" in note and "1 more blocks" in note


def test_a_dense_model_has_no_routed_experts():
    found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))
    assert found.moe is None and found.routed == ()


def test_forced_dp2_ep4_splits_qwen3_experts_a_quarter_a_device_and_trains_like_one_device():
    style = MOE_STYLES["qwen3_moe"]
    config = ToDistributedConfig(forward=style.forward, force_mesh={"dp": 2, "ep": 4})
    model, opt, loader = to_distributed(
        style.build(nnx.Rngs(0)), optax.adam(1e-3), style.batches(STEPS), 8, config=config
    )
    plan = get_plan(model)
    assert plan.layout.ep == 4 and plan.layout.dp == 2
    mlp = model.model.layers[0].mlp
    for kernel in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        assert kernel[...].sharding.spec[0] == "ep"
        assert kernel[...].addressable_shards[0].data.shape[0] == 8 // 4  # 1/ep of E a device
    assert mlp.gate.kernel[...].sharding.is_fully_replicated  # the router stays whole
    step = make_train_step(style.loss_fn)
    losses = [float(step(model, opt, batch)) for batch in loader]
    want = one_device("qwen3_moe")  # 3 Adam steps at 1e-3 on one device (shared, cached)
    assert want[-1] < want[0]
    assert_trees_close(np.asarray(losses), np.asarray(want), devices=8)


def _big_experts(dispatch: str) -> nnx.Module:
    """Qwen3-MoE (every expert on every token, capacity 1.0, or ragged_dots over the sorted
    token copies) whose experts outweigh its tokens: 8 experts of width 128 against 64
    tokens of width 32."""
    config = Qwen3MoeConfig(moe_intermediate_size=128, dispatch=dispatch, capacity_factor=1.0)
    return Qwen3MoeForCausalLM(config, rngs=nnx.Rngs(0))


def _searched_ep8(build, style, dispatch: tuple) -> tuple:
    """``build()`` matched with ``dispatch`` (its kind, rows a token) and through
    ``to_distributed``'s search: ep8 chosen, the note saying why (the best ep1 slower);
    ``(model, optimizer, loader, the plan's ring-of-experts note)``."""
    found = match_patterns(build(), style.batches(1)[0], forward=style.forward)
    assert (found.moe.dispatch, found.moe.rows_per_token) == dispatch
    model, opt, loader = to_distributed(
        build(), optax.adam(1e-3), style.batches(3), 8,
        config=ToDistributedConfig(forward=style.forward),
    )  # fmt: skip
    plan = get_plan(model)
    assert plan.layout.ep == 8, plan.layout.name
    (why,) = [n for n in plan.notes if n.startswith("ep8 chosen")]
    assert "tokens gathered over ep8" in why and "slower than the best" in why, why
    (how,) = [n for n in plan.notes if "ring of experts" in n]
    return model, opt, loader, how


@pytest.mark.parametrize("dispatch, rows", [("dense", 8.0), ("capacity", 2.0)])
def test_searched_ep_gathers_tokens_never_experts_trains_like_one_device_and_says_why(
    dispatch, rows
):
    """Experts that outweigh the tokens: the search picks ep8 for the model's own einsum
    dispatch (every expert on every token: 8 rows a token; GShard's capacity 1.0 dispatch:
    16 slots x 8 experts / 64 tokens = 2), priced with each MoE layer's tokens gathered over
    ep. The compiled step all-gathers the tokens (the bytes the cost model predicted) and
    never an expert stack, holds 1/8 of the experts a device, trains like one device (the
    same tokens dropped: the capacity rule is the code's, over the whole batch), and the
    plan says why."""
    style = MOE_STYLES["qwen3_moe"]
    model, opt, loader, how = _searched_ep8(
        functools.partial(_big_experts, dispatch), style, ("einsum", rows)
    )
    plan = get_plan(model)
    assert "the experts never move" in how, how
    assert plan.moe_layers == ("model.layers.0.mlp", "model.layers.1.mlp")
    assert Plan.from_json(plan.to_json()).moe_layers == plan.moe_layers
    mlp = model.model.layers[0].mlp
    for kernel in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        assert kernel[...].addressable_shards[0].data.shape[0] == 1  # 1 of 8 experts
    batches = list(loader)
    step = make_train_step(style.loss_fn)
    text = step.lower(model, opt, batches[0]).compile().as_text()
    gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
    # no [8, 32, 128] expert stack; 2 MoE layers x (input forward, output cotangent
    # backward) x the 8 x 8 x 32 tokens, over the 8 ep ranks
    assert [(c.weight, c.bytes, c.group_size) for c in gathers] == [(1, 8 * 8 * 32 * 4, 8)] * 4
    gathered = sum(c.weight * c.bytes for c in gathers)
    assert gathered == pytest.approx(plan.chosen.collectives.all_gather, rel=0.15)
    assert type(mlp).__qualname__ == "Qwen3MoeSparseMoeBlock[ep tokens]"
    losses = [float(step(model, opt, batch)) for batch in batches]
    want, _ = train_one_device(
        _big_experts(dispatch), optax.adam(1e-3), style.batches(3), style.loss_fn
    )
    assert want[-1] < want[0]
    assert_trees_close(np.asarray(losses), np.asarray(want), devices=8)


def _gpt_oss_big() -> nnx.Module:
    """gpt-oss with experts of width 128 (gate_up 256) against 64 tokens of width 32."""
    return GptOssForCausalLM(GptOssConfig(intermediate_size=128), rngs=nnx.Rngs(0))


def _mixtral_big() -> nnx.Module:
    """Mixtral with experts of width 128 against 64 tokens of width 32."""
    return MixtralForCausalLM(MixtralConfig(intermediate_size=128), rngs=nnx.Rngs(0))


#: Per style: (build, its MoE layer's class, an expert kernel under the layer, the
#: dimension ep splits in it, what the ring's note says each device computes).
ROWS = {
    "qwen3_moe_ragged": (
        lambda: _big_experts("ragged"), "Qwen3MoeSparseMoeBlock", "gate_proj", 0,
        "restricted to the rows of its 1 expert",
    ),
    "gpt_oss": (
        _gpt_oss_big, "GptOssMLP", "experts.gate_up_proj", 0,
        "restricted to the rows of the device's 1 expert",
    ),
    "mixtral": (
        _mixtral_big, "MixtralSparseMoeBlock", "experts.3.w1.kernel", 1,
        "1/8 of every expert's hidden dimension",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ROWS))
def test_searched_ep_runs_each_rank_s_rows_of_the_gathered_tokens_like_one_device(name):
    """Experts that outweigh the tokens, applied by ragged_dots over the token copies sorted
    by expert (tunix's Megablox path), by products with each token's gathered experts'
    weights (gpt-oss's reference) or as a list of modules each on every token (Mixtral's):
    the search picks ep8. Each MoE layer runs in a shard_map: the compiled step all-gathers
    the tokens over the 8 ep ranks and reduce-scatters the output (forward; the cotangents
    the reverse: the bytes the cost model predicted), never gathers an expert's weights,
    holds 1/8 of them a device and trains like one device; the plan says how, and its JSON
    keeps it."""
    build, layer_class, kernel, ep_dim, computes = ROWS[name]
    style = MOE_STYLES[name]
    rows = 8.0 if name == "mixtral" else None
    model, opt, loader, how = _searched_ep8(build, style, (DISPATCH[name][0], rows))
    plan = get_plan(model)
    assert computes in how and "reduce-scattered" in how, how
    layers = tuple(f"model.layers.{i}.{ROUTED[name][0].split('.')[0]}" for i in range(2))
    assert (plan.moe_layers, plan.moe_dispatch) == (layers, DISPATCH[name][0])
    again = Plan.from_json(plan.to_json())
    assert (again.moe_layers, again.moe_dispatch) == (plan.moe_layers, plan.moe_dispatch)
    entry = plan.spec(f"{layers[0]}.{kernel}")[ep_dim]  # ep outside mp (of 1) for a list
    assert entry in ("ep", ("ep", "mp")), entry
    classes = {type(m).__qualname__ for _, m in nnx.iter_graph(model)}  # scanned or not
    assert f"{layer_class}[ep rows]" in classes and layer_class not in classes
    held = next(  # the first block's, or the scanned stack's
        v[...]
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if ".".join(map(str, path)).endswith(f"{layers[0].rsplit('.', 1)[-1]}.{kernel}")
    )
    at = held.ndim - len(plan.spec(f"{layers[0]}.{kernel}")) + ep_dim  # behind a scan's axis
    assert held.addressable_shards[0].data.shape[at] == held.shape[at] // 8
    batches = list(loader)
    step = make_train_step(style.loss_fn)
    found = hlo.collectives(step.lower(model, opt, batches[0]).compile().as_text())
    tokens = 8 * 8 * 32 * 4  # the 8 ep ranks' 8 x 8 tokens of width 32, fp32
    # 2 MoE layers x (forward input, backward output cotangent) gathered; x (forward
    # output, backward input cotangent) summed and scattered, all over the 8 ep ranks. In
    # a loop over scanned blocks (weight = trips; Mixtral's), the backward gathers the
    # input again (a scanned block keeps its products alone)
    scanned = name == "mixtral"
    for kind, field, want in (
        ("all-gather", "all_gather", 6 if scanned else 4),
        ("reduce-scatter", "reduce_scatter", 4),
    ):
        ring = [c for c in found if c.kind == kind and c.bytes == tokens and c.group_size == 8]
        assert sum(c.weight for c in ring) == want, [c for c in found if c.kind == kind]
        predicted = getattr(plan.chosen.collectives, field)
        assert want * tokens == pytest.approx(predicted, rel=0.15)
    assert max(c.bytes for c in found if c.kind == "all-gather") <= tokens  # no expert
    losses = [float(step(model, opt, batch)) for batch in batches]
    want, _ = train_one_device(build(), optax.adam(1e-3), style.batches(3), style.loss_fn)
    assert want[-1] < want[0]
    assert_trees_close(np.asarray(losses), np.asarray(want), devices=8)


def test_only_stacked_kernels_and_their_biases_are_taken_beside_a_router():
    style = MOE_STYLES["qwen3_moe"]
    model = style.build(nnx.Rngs(0))
    for layer in model.model.layers:  # [E, 7]: no expert kernel's output, so no expert bias
        layer.mlp.table = nnx.Param(jnp.zeros((8, 7)))
    found = match_patterns(model, style.batches(1)[0], forward=style.forward)
    assert found.moe == _config_spec("qwen3_moe", DISPATCH["qwen3_moe"])
    assert "model.layers.0.mlp.table" in {p.path for p in found.params}
    assert "model.layers.0.mlp.table" not in {p.path for p in found.routed}


def test_forced_ep_with_pp_on_a_traced_dispatch_is_refused_with_the_reason():
    """No compile. The tokens are gathered over ep at each MoE layer's boundary, a
    constraint a pipeline stage (manual over the data axes) cannot hold: refused, with
    the way out."""
    model, found = _matched("qwen3_moe")
    with pytest.raises(ValueError, match=r"ep=2 with pp > 1: .* use jfleet's MoELayer"):
        plan_for(
            model, device_num=8, batch_size=8, seq_len=8, patterns=found,
            force_mesh={"dp": 2, "pp": 2, "ep": 2},
        )  # fmt: skip


def test_zero3_beside_ep_gathers_each_expert_shard_over_sharding_only_and_trains_like_one_device():
    """sharding2 x ep4 at ZeRO-3, capacity dispatch: ZeRO gathers each device's 2 of the 8
    experts over the 2 sharding ranks (never a whole stack over ep), the only all-gathers
    over the 4 ep ranks are the tokens, and it trains like one device."""
    style = MOE_STYLES["qwen3_moe"]
    config = ToDistributedConfig(
        forward=style.forward, force_mesh={"sharding": 2, "ep": 4}, zero_stage=3
    )
    model, opt, loader = to_distributed(
        _big_experts("capacity"), optax.adam(1e-3), style.batches(3), 8, config=config
    )
    assert get_plan(model).zero_stage == 3
    batches = list(loader)
    step = make_train_step(style.loss_fn)
    found = hlo.collectives(step.lower(model, opt, batches[0]).compile().as_text())
    gathers = [c for c in found if c.kind == "all-gather"]
    local_stack = 2 * 32 * 128 * 4  # 2 experts x [32, 128] fp32
    assert max(c.bytes for c in gathers) == local_stack
    assert {c.bytes for c in gathers if c.group_size == 4} == {4 * 8 * 32 * 4}  # the tokens
    losses = [float(step(model, opt, batch)) for batch in batches]
    want, _ = train_one_device(
        _big_experts("capacity"), optax.adam(1e-3), style.batches(3), style.loss_fn
    )
    assert_trees_close(np.asarray(losses), np.asarray(want), devices=8)


@pytest.mark.parametrize("force", [{"ep": 8}, {"dp": 8}])
def test_the_capacity_dispatch_s_one_hot_tensors_are_in_the_predicted_memory(force):
    """GShard's capacity rule over the whole batch keeps ``[T, E, C]`` one-hot tensors,
    quadratic in the tokens: at 1024 tokens they are most of the step's memory (the
    prediction without them is 0.35 of the compiled step at ep8; at dp8, where GSPMD does
    not split all of them over dp, 0.5 with them all split), and the cost model's total is
    within its ±25% of the compiled arguments + temporaries."""
    style = MOE_STYLES["qwen3_moe"]
    model, opt, loader = to_distributed(
        _big_experts("capacity"), optax.adam(1e-3),
        token_batches(1, vocab=64, batch=32, seq=32), 8,
        config=ToDistributedConfig(forward=style.forward, force_mesh=force),
    )  # fmt: skip
    step = make_train_step(style.loss_fn).lower(model, opt, next(iter(loader))).compile()
    mem = step.memory_analysis()
    compiled = mem.argument_size_in_bytes + mem.temp_size_in_bytes
    assert get_plan(model).chosen.memory.total == pytest.approx(compiled, rel=0.25)


def test_a_ragged_dispatch_s_expert_gradients_are_all_reduced_at_zero2_as_predicted():
    """sharding8 at ZeRO-2, ragged dispatch: each MoE layer's shard_map sums the experts'
    gradients over its data axes (an all-reduce; no reduce-scatter), and the cost model
    prices that: the step's all-reduced bytes within 5% of the prediction."""
    style = MOE_STYLES["qwen3_moe"]
    config = ToDistributedConfig(forward=style.forward, force_mesh={"sharding": 8}, zero_stage=2)
    model, opt, loader = to_distributed(
        _big_experts("ragged"), optax.adam(1e-3), style.batches(1), 8, config=config
    )
    plan = get_plan(model)
    assert plan.moe_dispatch == "ragged" and plan.chosen.collectives.reduce_scatter == 0
    found = hlo.collectives(
        make_train_step(style.loss_fn).lower(model, opt, next(iter(loader))).compile().as_text()
    )
    assert not [c for c in found if c.kind == "reduce-scatter"]
    summed = sum(c.weight * c.bytes for c in found if c.kind == "all-reduce")
    assert summed == pytest.approx(plan.chosen.collectives.all_reduce, rel=0.05)

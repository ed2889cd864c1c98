"""Issue 39 item 4: ``to_distributed`` recognises routed experts in traced user code
(:mod:`jfleet.auto_parallel.match.experts`) and splits them over a forced ``ep``; its search
keeps them off ``ep`` (their own dispatch is not what the cost model prices) and says so."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, match_patterns, to_distributed
from jfleet.auto_parallel.cost.layout import Workload
from jfleet.auto_parallel.match.moe_spec import MoESpec
from jfleet.auto_parallel.search.layouts import enumerate_layouts
from jfleet.auto_parallel.search.planner import plan_for
from jfleet.models.llama import TinyLlama
from jfleet.testing import assert_trees_close
from jfleet.testing.nnx_styles import MOE_STYLES
from jfleet.testing.nnx_styles.moe_styles import GptOssConfig, Qwen3MoeConfig

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


@functools.cache
def _matched(name: str):
    style = MOE_STYLES[name]
    model = style.build(nnx.Rngs(0))
    return model, match_patterns(model, style.batches(1)[0], forward=style.forward)


def _config_spec(name: str) -> MoESpec:
    config = GptOssConfig() if name == "gpt_oss" else Qwen3MoeConfig()
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    ffn = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return MoESpec(
        experts=experts,
        top_k=config.num_experts_per_tok,
        expert_ffn=ffn,
        layers=config.num_hidden_layers,
    )


@pytest.mark.parametrize("name", STACKED)
def test_stacked_experts_are_matched_as_the_style_s_config_and_left_out_of_params(name):
    model, found = _matched(name)
    assert found.moe == _config_spec(name)
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


def test_mixtral_s_list_of_expert_modules_is_not_taken_and_the_notes_say_why():
    _, found = _matched("mixtral")
    assert found.moe is None and found.routed == ()
    (note,) = [n for n in found.notes if "routes to the top 2 of 8 experts" in n]
    assert "no expert dimension to split over ep" in note and "1 more blocks" in note


def test_a_dense_model_has_no_routed_experts():
    found = match_patterns(TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2))
    assert found.moe is None and found.routed == ()


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_the_search_keeps_traced_experts_off_ep_and_says_why(name):
    """No compile. The cost model prices jfleet's dispatch over ep; a traced model's own
    dispatch runs as GSPMD partitions it (the xfail below: whole expert stacks gathered),
    so the search offers no ep > 1 layout for it, and the plan says so and how to force it.
    The same experts with their dispatch priced as jfleet's (``routed`` emptied: what a
    shape-built plan is) are searched over ep."""
    model, found = _matched(name)
    plan = plan_for(model, device_num=8, batch_size=8, seq_len=8, patterns=found)
    assert {c.layout.ep for c in plan.candidates} == {1}
    (note,) = [n for n in plan.notes if n.startswith("ep not searched")]
    assert "as GSPMD partitions it" in note and "force_mesh" in note
    priced = dataclasses.replace(found, routed=())
    layouts, _ = enumerate_layouts(priced, Workload(batch_size=8, seq_len=8), device_num=8)
    assert {lay.ep for lay in layouts} > {1}


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


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="the model's own one-hot dispatch runs as GSPMD partitions it: at ep8 the backward "
    "gathers each [8, 32, 16] expert stack whole (and every token to every rank), where the "
    "cost model prices jfleet's moe() (4 all-to-alls a layer, experts never gathered); "
    "swapping the dispatch for jfleet.parallel.moe.moe would pass it",
)
def test_forced_ep8_qwen3_step_never_gathers_an_expert_stack_whole():
    style = MOE_STYLES["qwen3_moe"]
    config = ToDistributedConfig(forward=style.forward, force_mesh={"ep": 8})
    model, opt, loader = to_distributed(
        style.build(nnx.Rngs(0)), optax.adam(1e-3), style.batches(1), 8, config=config
    )
    hlo = make_train_step(style.loss_fn).lower(model, opt, next(iter(loader))).compile()
    gathered = re.findall(r"= (f32\[[\d,]+\])\{[^}]*\} all-gather(?:-start)?\(", hlo.as_text())
    assert gathered, "expected the step to all-gather something (the router logits at least)"
    assert not {"f32[8,32,16]", "f32[8,16,32]"} & set(gathered), gathered


def test_only_stacked_kernels_and_their_biases_are_taken_beside_a_router():
    style = MOE_STYLES["qwen3_moe"]
    model = style.build(nnx.Rngs(0))
    for layer in model.model.layers:  # [E, 7]: no expert kernel's output, so no expert bias
        layer.mlp.table = nnx.Param(jnp.zeros((8, 7)))
    found = match_patterns(model, style.batches(1)[0], forward=style.forward)
    assert found.moe == _config_spec("qwen3_moe")
    assert "model.layers.0.mlp.table" in {p.path for p in found.params}
    assert "model.layers.0.mlp.table" not in {p.path for p in found.routed}

"""Tests for jfleet/optim/compiler.py: one strategy -> one chain, in the documented order."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest

from jfleet.optim import hyperparams
from jfleet.optim.compiler import META_ORDER, amp_settings, compile_strategy
from jfleet.optim.gradient_merge import GradientMergeState
from jfleet.optim.lamb_lars import LambState, LarsState
from jfleet.optim.loss_scale import DynamicLossScalingState
from jfleet.optim.master_weights import MasterWeightsState
from jfleet.testing import make_strategy

PARAMS = {"w": jnp.ones((4, 4), jnp.float32), "b": jnp.zeros((4,), jnp.float32)}


def state_chain(state) -> list[type]:
    """jfleet's state types from the outermost meta-optimizer inwards (optax's left out)."""
    chain = []
    while hasattr(state, "inner_state"):
        if type(state).__module__.startswith("jfleet."):
            chain.append(type(state))
        state = state.inner_state
    return chain


def test_a_plain_strategy_returns_the_users_optimizer_itself():
    tx = optax.adam(1e-3)
    compiled = compile_strategy(tx, make_strategy())
    assert compiled.tx is tx
    assert compiled.applied_meta_list == ()
    assert compiled.amp is None


def test_gradient_merge_wraps_loss_scaling_wraps_lamb():
    strategy = make_strategy(
        amp=True,
        amp_configs={"dtype": "float16"},
        gradient_merge=True,
        gradient_merge_configs={"k_steps": 2},
        lamb=True,
    )
    compiled = compile_strategy(hyperparams.adam(1e-3), strategy)
    assert compiled.applied_meta_list == (
        "GradientMergeOptimizer",
        "AMPOptimizer",
        "LambOptimizer",
    )
    chain = state_chain(compiled.tx.init(PARAMS))
    assert chain == [GradientMergeState, DynamicLossScalingState, LambState]


def test_o2_puts_master_weights_outside_gradient_merge():
    strategy = make_strategy(
        amp=True,
        amp_configs={"use_pure_bf16": True},
        gradient_merge=True,
        gradient_merge_configs={"k_steps": 2},
    )
    compiled = compile_strategy(optax.sgd(0.1), strategy)
    assert compiled.amp.level == "O2" and not compiled.amp.loss_scaling
    half = {k: v.astype(jnp.bfloat16) for k, v in PARAMS.items()}
    assert state_chain(compiled.tx.init(half)) == [MasterWeightsState, GradientMergeState]


def test_lars_replaces_a_momentum_optimizer():
    compiled = compile_strategy(hyperparams.momentum(0.1, 0.9), make_strategy(lars=True))
    assert compiled.applied_meta_list == ("LarsOptimizer",)
    assert state_chain(compiled.tx.init(PARAMS)) == [LarsState]


@pytest.mark.parametrize(
    "settings, names",
    [
        (dict(recompute=True), ("RecomputeOptimizer",)),
        (dict(sharding=True), ("ShardingOptimizer",)),
        (dict(), ()),
    ],
)
def test_model_side_and_placement_meta_optimizers_leave_the_chain_alone(settings, names):
    tx = optax.sgd(0.1)
    compiled = compile_strategy(tx, make_strategy(**settings))
    assert compiled.applied_meta_list == names
    assert compiled.tx is tx


def test_a_sharding_degree_counts_as_sharding():
    compiled = compile_strategy(optax.sgd(0.1), make_strategy({"sharding_degree": 4}))
    assert compiled.applied_meta_list == ("ShardingOptimizer",)


def test_applied_names_follow_the_documented_order():
    strategy = make_strategy(
        {"sharding_degree": 2},
        amp=True,
        gradient_merge=True,
        recompute=True,
        lamb=True,
    )
    names = compile_strategy(hyperparams.adam(1e-3), strategy).applied_meta_list
    assert list(names) == sorted(names, key=META_ORDER.index)
    assert len(names) == 5


@pytest.mark.parametrize(
    "configs, want",
    [
        ({}, ("float16", "O1", True)),
        ({"dtype": "bfloat16"}, ("bfloat16", "O1", False)),
        ({"use_pure_fp16": True}, ("float16", "O2", True)),
        ({"use_pure_bf16": True}, ("bfloat16", "O2", False)),
    ],
)
def test_amp_settings(configs, want):
    got = amp_settings(make_strategy(amp=True, amp_configs=configs))
    assert (got.dtype, got.level, got.loss_scaling) == want


def test_amp_off_has_no_settings():
    assert amp_settings(make_strategy()) is None


def test_two_pure_dtypes_are_refused():
    strategy = make_strategy(amp=True, amp_configs={"use_pure_fp16": True, "use_pure_bf16": True})
    with pytest.raises(ValueError, match="use_pure_fp16=True and use_pure_bf16=True"):
        amp_settings(strategy)


def test_forbidden_pairs_name_both_switches():
    with pytest.raises(ValueError, match=r"strategy\.lamb=True and strategy\.lars=True"):
        compile_strategy(optax.adam(1e-3), make_strategy(lamb=True, lars=True))


@pytest.mark.parametrize("other", ["lamb", "lars", "gradient_merge", "localsgd"])
def test_dgc_forbidden_pairs_name_both_switches(other):
    with pytest.raises(ValueError, match=rf"strategy\.dgc=True and strategy\.{other}=True"):
        compile_strategy(optax.sgd(0.1, momentum=0.9), make_strategy(dgc=True, **{other: True}))

"""Paddle's ``LazyGuard`` + ``fleet.distributed_model``: a model that is never whole.

Inside ``jfleet.LazyGuard()`` a model's construction returns its abstract model;
``fleet.distributed_model`` and ``group_sharded_parallel`` create it in the fleet's
layout, one program per device set that holds no whole copy of a split parameter
(compiled memory per device, ``tests.creation_util``). The values equal the construction
compiled on one device, bitwise; training equals one device (fp32 tolerances of the
suite). The models: one written in the style of Flax's own guide to sharding (its
``DotReluDot``: ``nnx.with_partitioning`` initialisers; our axis names), jfleet's tensor-
parallel TinyLlama, and Paddle's ``PipelineLayer`` description of a GPT (issue 38).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.nnx.module import ModuleMeta

import jfleet
from jfleet import fleet, group_sharded_parallel, make_train_step
from jfleet.mesh import lazy as lazy_module
from jfleet.mesh.lazy import LazyGuard, factory_of
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.models.parallel_gpt import TinyGPT, gpt_loss
from jfleet.parallel.pipeline_layer import PipelineLayer
from jfleet.testing import assert_trees_close, make_strategy, train_one_device
from tests.creation_util import (
    assert_created_in_shards,
    compiled_on_one_device,
    creation_programs,
    values,
)


class DotReluDot(nnx.Module):
    """Two matmuls around a ReLU, their kernels split over ``mp`` by their initialisers, as
    Flax's "Scale up on multiple devices" guide writes it."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth, depth, use_bias=False, kernel_init=nnx.with_partitioning(init, (None, "mp")),
            rngs=rngs,
        )  # fmt: skip
        self.w2 = nnx.Param(init(rngs.params(), (depth, depth)), out_sharding=("mp", None))

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.relu(self.dot1(x)) @ self.w2


def _fresh(hybrid: dict) -> None:
    fleet._fleet._reset()
    fleet.init(is_collective=True, strategy=make_strategy(hybrid), log_level="WARNING")


def test_the_guard_defers_only_the_outermost_module_and_restores_construction():
    _fresh({"mp_degree": 8})
    with jax.set_mesh(fleet.get_hybrid_communicate_group().mesh), LazyGuard():
        model = DotReluDot(16, rngs=nnx.Rngs(0))
        inner = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
    assert isinstance(model.w2.get_value(), jax.ShapeDtypeStruct)
    assert isinstance(model.dot1.kernel.get_value(), jax.ShapeDtypeStruct)
    assert factory_of(inner) is not None and factory_of(model) is not None
    built = nnx.Linear(2, 2, rngs=nnx.Rngs(1))  # after the guard: built at once
    assert isinstance(built.kernel.get_value(), jax.Array) and factory_of(built) is None
    with pytest.raises(RuntimeError, match="boom"), LazyGuard():
        raise RuntimeError("boom")
    assert ModuleMeta.__call__ is lazy_module._EAGER_CALL
    assert isinstance(nnx.Linear(2, 2, rngs=nnx.Rngs(1)).kernel.get_value(), jax.Array)
    # the same seed builds the same values each time: the arguments' Rngs are captured
    a, b = factory_of(model)(), factory_of(model)()
    np.testing.assert_array_equal(a.w2.get_value(), b.w2.get_value())


def test_flax_guide_style_model_is_created_split_with_its_one_device_values(monkeypatch):
    _fresh({"dp_degree": 2, "mp_degree": 4})
    with jax.set_mesh(fleet.get_hybrid_communicate_group().mesh), LazyGuard():
        model = DotReluDot(64, rngs=nnx.Rngs(0))  # Flax's guide builds under the mesh
    factory = factory_of(model)
    with creation_programs(monkeypatch) as programs:
        placed = fleet.distributed_model(model)
    want = compiled_on_one_device(factory)
    for k, v in values(want).items():
        np.testing.assert_array_equal(values(placed.module)[k], v, err_msg=k)
    assert placed.module.dot1.kernel.get_value().sharding.shard_shape((64, 64)) == (64, 16)
    assert placed.module.w2.get_value().sharding.shard_shape((64, 64)) == (16, 64)
    assert_created_in_shards(placed.module, programs, factory)
    x = jnp.ones((8, 64))
    np.testing.assert_allclose(placed(x), want(x), rtol=1e-5, atol=1e-6)


def llama() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2, seed=3)


def gpt() -> TinyGPT:
    return TinyGPT(tensor_parallel=True, seed=3)


def sgd() -> optax.GradientTransformation:
    """For the GPT: its key bias's gradient is zero in exact arithmetic, rounding noise in
    fp32, which Adam would turn into +-lr steps (as in test_pipeline_parallel.py)."""
    return optax.sgd(0.5, momentum=0.9)


def adam() -> optax.GradientTransformation:
    return optax.adam(1e-2)


@pytest.mark.parametrize(
    ("hybrid", "level", "factory", "plain", "loss", "tx"),
    [
        ({"dp_degree": 2, "mp_degree": 4}, None, gpt, lambda: TinyGPT(seed=3), gpt_loss, sgd),
        ({"sharding_degree": 8}, "p_g_os", llama, llama, lm_loss, adam),
    ],
    ids=["distributed_model-tensor-parallel-gpt-dp2-mp4", "group_sharded-p_g_os-llama-sharding8"],
)
def test_a_lazy_model_is_created_split_and_trains_like_one_device(
    hybrid, level, factory, plain, loss, tx, monkeypatch
):
    _fresh(hybrid)
    with jfleet.LazyGuard():
        lazy = factory()
    with creation_programs(monkeypatch) as programs:
        if level is None:
            model = fleet.distributed_model(lazy)
            opt = fleet.distributed_optimizer(tx())
        else:
            model, opt, _ = group_sharded_parallel(lazy, tx(), level)
    assert_created_in_shards(model.module, programs, factory)
    got_values = values(model.module)
    for k, v in values(compiled_on_one_device(factory)).items():
        np.testing.assert_array_equal(got_values[k], v, err_msg=k)

    reference = plain()
    want, _ = train_one_device(reference, tx(), lm_batches(3), loss)
    step = make_train_step(loss)
    losses = [float(step(model, opt, batch)) for batch in lm_batches(3)]
    assert_trees_close(np.asarray(losses), np.asarray(want), devices=8)
    assert_trees_close(values(model.module), values(reference), devices=8)


def test_a_lazy_pipeline_layer_is_created_stage_by_stage(monkeypatch):
    from tests.parallel.test_pipeline_layer import as_tinygpt, ce, gpt_descs

    strategy = make_strategy(
        {"dp_degree": 2, "pp_degree": 2, "mp_degree": 2},
        pipeline_configs={"micro_batch_size": 2, "accumulate_steps": 2},
    )
    fleet._fleet._reset()
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")

    def build() -> PipelineLayer:
        return PipelineLayer(gpt_descs(True), loss_fn=ce, seed=0)

    with LazyGuard():
        lazy = build()
    with creation_programs(monkeypatch) as programs:
        model = fleet.distributed_model(lazy)
    assert len(programs) == 2, "one creation program per pipeline stage"
    eager = build()
    model_eager = fleet.distributed_model(eager)
    got = as_tinygpt(nnx.state(model.module, nnx.Param))
    want = as_tinygpt(nnx.state(model_eager.module, nnx.Param))
    # eager construction rounds the variance-scaled initialisers 1 ulp apart at most
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), 1)
    assert_created_in_shards(model.module, programs, lambda: _annotated(build))


def _annotated(build):
    model = build()
    model.annotate(fleet.get_hybrid_communicate_group().mesh)
    return model


def test_an_abstract_model_without_its_construction_is_an_error_naming_the_fix():
    _fresh({"dp_degree": 8})
    abstract = nnx.eval_shape(lambda: nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"abstract Linear .*LazyGuard"):
        fleet.distributed_model(abstract)
    with pytest.raises(TypeError, match="returned a dict"):
        fleet.distributed_model(lambda: {"w": 1})

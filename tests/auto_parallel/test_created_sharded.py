"""``to_distributed(factory)``: a model created in its planned layout, never whole anywhere.

The factory is planned on its abstract model (``nnx.eval_shape``) and run inside one
``jax.jit`` whose outputs are the planned shardings (a pipeline: one per stage)
(:func:`jfleet.mesh.create.create_placed`). On three meshes (scanned dp2 x mp4, pipelined
dp2 x pp2 x mp2, ZeRO-3 sharding8) the created parameters equal the construction compiled
on one device bitwise (and eager construction within 1 ulp), and no creation program holds
a whole copy of a split parameter (its compiled memory per device,
``tests.creation_util``). The pipelined model, and a plan for a per-device budget below the
whole model's fp32 training state, train 3 Adam steps like one device (fp32:
``assert_trees_close`` over 8 devices). A checkpoint saved at dp2 x mp4 loads into ZeRO-3
and into the pipeline, each array read into its own layout (issue 38).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
from jfleet.checkpoint import layout
from jfleet.checkpoint.state_dict import load_model, save_model
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.testing import assert_trees_close, train_one_device
from tests.creation_util import (
    assert_created_in_shards,
    compiled_on_one_device,
    creation_programs,
    values,
)

STEPS = 3


def factory() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=4, seed=3)


def wide_factory() -> TinyLlama:
    """For ZeRO-3's scanned stack: at width 32 its 8-way shards are so small that the
    initialisers' fixed scratch puts the creation program at 1.39 x the one-device ratio
    (1.22 at width 64, 1.17 at 128: stacking holds a block's shards and the stack's)."""
    return TinyLlama(vocab=64, width=64, heads=8, kv_heads=4, layers=4, seed=3)


def other_seed() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=4, seed=5)


def _created(config: ToDistributedConfig, monkeypatch, build=factory) -> tuple:
    """``to_distributed(build, ...)``, with each creation program's compiled memory."""
    with creation_programs(monkeypatch) as programs:
        made = to_distributed(build, optax.adam(1e-2), lm_batches(STEPS), config=config)
    return (*made, programs)


@functools.cache
def _compiled_values(build) -> dict[str, np.ndarray]:
    """The construction compiled on one device, once per factory (read only)."""
    return values(compiled_on_one_device(build))


@functools.cache
def _one_device() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``factory()`` trained on one device: its losses and parameters (both tests train it)."""
    want_model = factory()
    want_losses, _ = train_one_device(want_model, optax.adam(1e-2), lm_batches(STEPS), lm_loss)
    return np.asarray(want_losses), values(want_model)


def _trains_like_one_device(model, opt, loader) -> None:
    want_losses, want_values = _one_device()
    step = make_train_step(lm_loss)
    losses = np.asarray([float(step(model, opt, batch)) for batch in loader])
    # under a planned gradient accumulation each call returns its micro-batch's mean loss;
    # the batch's is their mean (equal micro-batches)
    losses = losses.reshape(STEPS, -1).mean(axis=1)
    assert_trees_close(losses, want_losses, devices=8)
    assert_trees_close(values(model), want_values, devices=8)


@pytest.mark.parametrize(
    ("mesh", "zero", "train"),
    [
        ({"dp": 2, "mp": 4}, None, False),
        ({"dp": 2, "pp": 2, "mp": 2}, None, True),  # created stage by stage
        ({"sharding": 8}, 3, False),  # (the budget test below trains a planned layout)
    ],
    ids=["dp2-mp4-scanned", "dp2-pp2-mp2-pipelined", "sharding8-zero3"],
)
def test_a_factory_is_created_in_its_planned_layout_never_whole(mesh, zero, train, monkeypatch):
    fleet._fleet._reset()
    config = ToDistributedConfig(force_mesh=mesh, zero_stage=zero)
    build = wide_factory if zero == 3 else factory
    model, opt, loader, programs = _created(config, monkeypatch, build)
    got = values(model)
    want = _compiled_values(build)
    assert got.keys() == want.keys()
    differ = [k for k in want if not np.array_equal(got[k], want[k])]
    assert not differ, (
        f"created values differ from the one-device compiled construction at {differ}"
    )
    # eager construction rounds the variance-scaled normal initialisers differently: 1 ulp
    eager = values(build())
    for k in want:
        np.testing.assert_array_max_ulp(got[k], eager[k], maxulp=1)

    assert_created_in_shards(model, programs, build)
    if train:
        _trains_like_one_device(model, opt, loader)


def test_a_budget_below_the_whole_training_state_is_planned_and_created(monkeypatch):
    """A per-device budget below the whole model's parameters (0.9 x a quarter of Adam's
    fp32 training state: parameters, gradients, two moments): the plan splits the
    parameters, and the model is created split. (At half the state ZeRO-2 fits with the
    parameters whole: its scanned blocks reduce-scatter their gradients per block.)"""
    fleet._fleet._reset()
    abstract = nnx.eval_shape(factory)
    state_bytes = 4 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract)))
    budget = int(0.9 * state_bytes // 4)
    config = ToDistributedConfig(memory_budget=budget)
    model, opt, loader, programs = _created(config, monkeypatch)
    plan = get_plan(model)
    assert plan.chosen.memory.total <= budget, str(plan)
    assert_created_in_shards(model, programs, factory)
    _trains_like_one_device(model, opt, loader)


def test_what_cannot_be_created_is_an_error_naming_the_fix():
    fleet._fleet._reset()
    with pytest.raises(TypeError, match=r"abstract TinyLlama .* pass the function that builds"):
        to_distributed(nnx.eval_shape(factory), optax.adam(1e-2), lm_batches(1))
    with pytest.raises(TypeError, match="returned a dict, not an nnx.Module"):
        to_distributed(lambda: {"w": 1}, optax.adam(1e-2), lm_batches(1))
    with pytest.raises(TypeError, match="model is a int, neither an nnx.Module nor a function"):
        to_distributed(3, optax.adam(1e-2), lm_batches(1))


def test_a_checkpoint_from_another_mesh_loads_into_created_models_never_whole(
    tmp_path, monkeypatch
):
    """Saved at dp2 x mp4, loaded into ZeRO-3 over sharding8 and into dp2 x pp2 x mp2
    (stacked by stage): every restored array is read into its own layout (a pipelined
    layer onto its stage's devices only, split as the plan splits it), and the values are
    the saved ones."""
    fleet._fleet._reset()
    saved_config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4})
    saved, _, _ = to_distributed(other_seed, optax.adam(1e-2), lm_batches(1), config=saved_config)
    save_model(tmp_path / "ckpt", saved)
    want = values(saved)

    for mesh, zero in [({"sharding": 8}, 3), ({"dp": 2, "pp": 2, "mp": 2}, None)]:
        fleet._fleet._reset()
        config = ToDistributedConfig(force_mesh=mesh, zero_stage=zero)
        model, _, _ = to_distributed(factory, optax.adam(1e-2), lm_batches(1), config=config)
        restored: list[dict] = []
        running_values = layout.running_values

        def spy(model, obj, arrays, restored=restored, running_values=running_values):
            restored.append(dict(arrays))
            running_values(model, obj, arrays)

        monkeypatch.setattr(layout, "running_values", spy)
        load_model(tmp_path / "ckpt", model)
        monkeypatch.undo()

        running = values(model)
        for k, v in want.items():
            np.testing.assert_array_equal(running[k], v, err_msg=f"{mesh}: {k}")
        arrays = {k: v for part in restored for k, v in part.items() if k in want}
        assert arrays.keys() == want.keys()
        for key, array in arrays.items():
            shard = array.sharding.shard_shape(array.shape)
            assert all(s.data.shape == shard for s in array.addressable_shards), key
        if "pp" in mesh:  # each stacked layer on its stage's 4 devices alone
            layers = [a for k, a in arrays.items() if k.startswith("layers.")]
            assert layers and all(len(a.sharding.device_set) == 4 for a in layers)
        split = [k for k, a in arrays.items() if a.sharding.shard_shape(a.shape) != a.shape]
        assert len(split) >= len(arrays) // 2, f"{mesh}: few restored arrays are split {split}"

"""Scan over layers: without a pipeline, alike blocks run as one scan and the step stays flat.

``to_distributed`` at pp 1 replaces the blocks by a :class:`ScannedBlocks`: values,
gradients and 3 Adam steps equal one device (fp32 1e-5), with sequence parallel, for
TinyLlama with recompute and for a public NNX style without (Gemma-style blocks taking
positions and alternating local / global attention: super-blocks of 2); the compiled
step's instruction count does not grow from 4 to 32 blocks; recompute saves memory inside
the scan; checkpoints move between scanned, plain and pipelined runs.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import DistributedStrategy, fleet, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
from jfleet.auto_parallel.apply.blocks import PipelinedBlocks
from jfleet.auto_parallel.apply.scanned_blocks import ScannedBlocks, scan_blocks
from jfleet.checkpoint import CheckpointManager, layout
from jfleet.models import lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.models.parallel_gpt import GPTBlock
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
from jfleet.testing import assert_trees_close, hlo, train_one_device
from jfleet.testing.nnx_styles import STYLES

STEPS = 3
TOL = 1e-5


def llama() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=4)


#: name -> (build, batches(n), loss_fn, forward, mesh, settings, period)
CASES = {
    "llama-recompute-sp": (
        llama,
        lm_batches,
        lm_loss,
        None,
        {"dp": 2, "mp": 4},
        {"recompute": True, "sequence_parallel": True},
        1,
    ),
    "gemma-alternating-sp": (
        lambda: STYLES["gemma_alternating"].build(nnx.Rngs(0)),
        STYLES["gemma_alternating"].batches,
        STYLES["gemma_alternating"].loss_fn,
        None,
        {"dp": 2, "mp": 4},
        {"sequence_parallel": True},
        2,
    ),
}


def by_block(model: nnx.Module, tree: nnx.State) -> dict:
    """``tree`` (the model's params or grads) keyed by the plain model's per-block paths."""
    shadow = nnx.clone(model)
    nnx.update(shadow, tree)
    return layout.logical_leaves(shadow, shadow)


def flat(tree: nnx.State) -> dict:
    return {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(tree)}


@pytest.mark.parametrize("name", list(CASES))
def test_scanned_blocks_compute_and_train_like_one_device(name):
    build, batches, loss_fn, forward, mesh, settings, period = CASES[name]
    data = batches(STEPS)
    config = ToDistributedConfig(force_mesh=mesh, forward=forward, **settings)
    model, opt, loader = to_distributed(build(), optax.adam(1e-2), data, config=config)
    stand_in = nnx.iter_modules(model)
    (scanned,) = [m for _, m in stand_in if isinstance(m, ScannedBlocks)]
    assert scanned.period == period and scanned.recompute == bool(settings.get("recompute"))
    with pytest.raises(IndexError, match="one scanned stack"):
        scanned[0]
    batch = next(iter(loader))

    @nnx.jit
    def value_and_grads(model, batch):
        return nnx.value_and_grad(loss_fn)(model, batch)

    loss, grads = value_and_grads(model, batch)
    want_loss, want_grads = value_and_grads(build(), jax.tree.map(jnp.asarray, data[0]))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=0, atol=TOL)
    assert_trees_close(by_block(model, grads), flat(want_grads), rtol=TOL, atol=TOL)
    step = make_train_step(loss_fn)
    losses = [float(step(model, opt, b)) for b in loader]
    want, _ = train_one_device(build(), optax.adam(1e-2), data, loss_fn)
    np.testing.assert_allclose(losses, want, rtol=0, atol=TOL)


def test_stacked_parameters_keep_their_tensor_parallel_and_zero_layouts():
    config = ToDistributedConfig(force_mesh={"dp": 2, "sharding": 2, "mp": 2}, zero_stage=1)
    model, opt, _ = to_distributed(llama(), optax.adam(1e-2), lm_batches(1), config=config)
    plan = get_plan(model)
    assert isinstance(model.layers, ScannedBlocks)
    var = model.layers.body.self_attn.q_proj.kernel
    entry = plan._param("layers.0.self_attn.q_proj.kernel")
    assert var.shape == (1, 4, 32, 32)
    # the stacked axes unsharded; each block's layout behind them, as the plan says
    assert var[...].sharding.spec == P(None, None, *entry.spec)
    want_zero = (None, None, *entry.zero_spec) + (None,) * (2 - len(entry.zero_spec))
    assert var.get_metadata("optimizer_sharding") == want_zero and "sharding" in str(want_zero)
    mu = opt.opt_state[0].mu["layers"]["body"]["self_attn"]["q_proj"]["kernel"][...]
    assert mu.sharding.spec == P(*want_zero)


def compiled_step(layers: int, **settings) -> jax.stages.Compiled:
    config = ToDistributedConfig(force_mesh={"dp": 8}, **settings)
    data = lm_batches(1, batch=64, seq=16)
    model, opt, loader = to_distributed(
        TinyLlama(width=16, heads=2, layers=layers), optax.adam(1e-2), data, config=config
    )
    return make_train_step(lm_loss).lower(model, opt, next(iter(loader))).compile()


@pytest.fixture(scope="module")
def deep_steps() -> dict:
    return {
        "4": compiled_step(4),
        "32": compiled_step(32),
        "32-recompute": compiled_step(32, recompute=True),
    }


def test_the_compiled_step_does_not_grow_with_the_number_of_blocks(deep_steps):
    shallow = hlo.instruction_count(deep_steps["4"].as_text())
    deep = hlo.instruction_count(deep_steps["32"].as_text())
    assert deep <= 1.2 * shallow, (shallow, deep)  # unrolled: 5,117 -> 36,929


def test_recompute_inside_the_scan_saves_memory(deep_steps):
    kept, recomputed = deep_steps["32"], deep_steps["32-recompute"]
    # the forward runs again in the backward pass (dots loop-weighted) ...
    assert hlo.dot_flops(recomputed.as_text()) > 1.2 * hlo.dot_flops(kept.as_text())
    # ... and the 32 blocks' matmul outputs are not kept (measured 0.23x)
    temp = recomputed.memory_analysis().temp_size_in_bytes
    assert temp < 0.4 * kept.memory_analysis().temp_size_in_bytes


def pipeline_layer(blocks: int) -> PipelineLayer:
    block = LayerDesc(GPTBlock, 16, 2, 32, column=nnx.Linear, row=nnx.Linear)
    descs = [LayerDesc(nnx.Embed, 32, 16), *[block] * blocks, LayerDesc(nnx.Linear, 16, 32)]
    return PipelineLayer(descs, num_stages=1, loss_fn=lambda y, t: jnp.mean((y - t) ** 2))


def test_a_one_stage_pipeline_layer_is_flat_in_depth():
    tokens, target = jnp.zeros((4, 8), int), jnp.zeros((4, 8, 32))

    def count(blocks: int) -> int:
        model = pipeline_layer(blocks)
        assert model.body is not None  # identical blocks: one stacked body, run by a scan
        graphdef, params = nnx.split(model)

        def loss(params):
            return nnx.merge(graphdef, params).loss(tokens, target)

        return hlo.instruction_count(jax.jit(jax.grad(loss)).lower(params).compile().as_text())

    assert count(32) <= 1.2 * count(4)


def test_a_checkpoint_moves_between_scanned_plain_and_pipelined_runs(tmp_path):
    def build(mesh, **settings):
        fleet._reset()
        config = ToDistributedConfig(force_mesh=mesh, **settings)
        return to_distributed(llama(), optax.adam(1e-2), lm_batches(2), config=config)

    def logical(model, opt) -> dict:  # copied: the next step donates the arrays
        leaves = {**layout.logical_leaves(model, model), **layout.logical_leaves(model, opt)}
        return {k: np.asarray(v) for k, v in leaves.items()}

    model, opt, loader = build({"dp": 8})
    assert isinstance(model.layers, ScannedBlocks)
    step = make_train_step(lm_loss)
    for batch in loader:
        step(model, opt, batch)
    with CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(2, model, opt)
    saved = logical(model, opt)
    assert {"layers.0.mlp.up_proj.kernel", "layers.3.mlp.up_proj.kernel"} <= set(saved)
    runs = {"plain": ({"dp": 2, "mp": 4}, {"scan_layers": False}, nnx.List),
            "pipelined": ({"dp": 4, "pp": 2}, {}, PipelinedBlocks)}  # fmt: skip
    for name, (mesh, settings, kind) in runs.items():
        model, opt, _ = build(mesh, **settings)
        assert isinstance(model.layers, kind), name
        with CheckpointManager(tmp_path) as mngr:
            mngr.restore(model=model, optimizer=opt)
        assert_trees_close(logical(model, opt), saved, rtol=0, atol=0)
    # and back: the plain run's per-block leaves restore into a scanned run
    with CheckpointManager(tmp_path / "plain", async_save=False) as mngr:
        mngr.save(2, model, opt)
    model, opt, _ = build({"dp": 2, "mp": 4})
    assert isinstance(model.layers, ScannedBlocks)
    with CheckpointManager(tmp_path / "plain") as mngr:
        mngr.restore(model=model, optimizer=opt)
    assert_trees_close(logical(model, opt), saved, rtol=0, atol=0)


def test_blocks_that_cannot_be_stacked_stay_unrolled_and_scanning_can_be_switched_off(caplog):
    style = STYLES["dropout"]  # blocks own RNG streams
    config = ToDistributedConfig(force_mesh={"dp": 8}, forward=style.forward)
    with caplog.at_level(logging.INFO, logger="jfleet"):
        model, _, _ = to_distributed(
            style.build(nnx.Rngs(0)), optax.sgd(0.1), style.batches(1), config=config
        )
    assert not any(isinstance(m, ScannedBlocks) for _, m in nnx.iter_modules(model))
    assert "kept unrolled (not scanned)" in caplog.text
    (note,) = [n for n in get_plan(model).notes if "kept unrolled (not scanned)" in n]
    assert "RngKey" in note and "note: " + note in str(get_plan(model))  # the plan says why
    fleet._reset()
    config = ToDistributedConfig(force_mesh={"dp": 8}, scan_layers=False)
    model, _, _ = to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)
    assert type(model.layers) is nnx.List and len(model.layers) == 4


def test_blocks_given_state_by_the_strategy_stay_unrolled_and_train_like_one_device(caplog):
    # QAT adds moving-average scales (QuantStat) to the blocks after planning: they cannot
    # be stacked, so the blocks stay unrolled (logged) instead of failing to scan.
    strategy = DistributedStrategy()
    strategy.qat = True
    batches = lm_batches(2)
    config = ToDistributedConfig(force_mesh={"dp": 8}, strategy=strategy)
    with caplog.at_level(logging.INFO, logger="jfleet"):
        model, opt, loader = to_distributed(llama(), optax.sgd(0.1), batches, config=config)
    assert not any(isinstance(m, ScannedBlocks) for _, m in nnx.iter_modules(model))
    assert "kept unrolled (not scanned)" in caplog.text and "QuantStat" in caplog.text
    step = make_train_step(lm_loss)
    losses = [float(step(model, opt, b)) for b in loader]
    fleet._reset()
    expected, _ = train_one_device(llama(), optax.sgd(0.1), batches, lm_loss, strategy=strategy)
    # 1e-4: fake quantisation rounds, so a sum in another order can move one value a step
    np.testing.assert_allclose(losses, expected, rtol=1e-4)


# ------------------------------------------------------------------ what each policy recomputes
def _grad_flops(recompute: bool, selective: bool, batch: dict) -> float:
    """Dot FLOPs of one compiled gradient of a scanned TinyLlama (one device)."""
    model = TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=4, hidden=64)
    scan_blocks(model, "layers", recompute=recompute, selective=selective)
    graphdef, state = nnx.split(model)

    def grads(state, batch):
        return nnx.grad(lm_loss)(nnx.merge(graphdef, state), batch)

    return hlo.dot_flops(jax.jit(grads).lower(state, batch).compile().as_text())


def test_selective_recompute_recomputes_the_attention_core_and_nothing_else():
    """Issue 40: against the step that keeps every matmul output, selective recompute runs
    the attention core's two products (q k^T and p v, batched over heads) once more in the
    backward pass, and full recompute every product of the block whose output the backward
    reads; counted in the compiled
    program. A selective policy that saves every product, or none, fails here."""
    b, s, d, kv, hidden, layers = 2, 64, 32, 16, 64, 4
    batch = lm_batches(1, batch=b, seq=s)[0]
    keep, selective, full = (
        _grad_flops(recompute, sel, batch)
        for recompute, sel in ((False, False), (False, True), (True, False))
    )
    core = layers * 2 * (2 * b * s * s * d)  # q k^T and p v, each 2 b s^2 d per block
    # q, k, v, o, gate and up; not down: its output only joins the residual stream, and a
    # product's backward reads its inputs, never its output
    projections = layers * 2 * b * s * (d * d + 2 * d * kv + d * d + 2 * d * hidden)
    assert selective - keep == pytest.approx(core, rel=0.01), (
        f"selective recompute ran {selective - keep:.0f} more dot FLOPs than keeping every "
        f"product; the attention cores are {core} (0: it saved the cores; more: it "
        "recomputed the projections too)"
    )
    assert full - keep == pytest.approx(core + projections, rel=0.01), (full - keep, core)

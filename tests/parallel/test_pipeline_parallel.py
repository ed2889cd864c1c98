"""fleet.distributed_model(PipelineLayer).train_batch trains exactly like one device.

Every run trains the GPT of ``test_pipeline_layer.py`` (TinyGPT as layer descriptions)
for three ``train_batch`` steps through the engine and compares the losses and the final
parameters with TinyGPT trained by a plain ``nnx.jit`` step on one device from the same
seed. With SGD, ``params_after = params_before - lr * grad`` each step, so equal
parameters after the steps mean equal gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import DistributedStrategy, fleet
from jfleet.models import lm_batches
from jfleet.models.parallel_gpt import TinyGPT, gpt_loss
from jfleet.optim import hyperparams, lr
from jfleet.optim.clip import clip_by_global_norm
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
from jfleet.testing import assert_trees_close, make_strategy, train_one_device
from jfleet.training.pipeline_parallel import PipelineParallel

from .test_pipeline_layer import BLOCKS, HEADS, HIDDEN, VOCAB, WIDTH, as_tinygpt, ce, gpt_descs

STEPS, BATCH, SEQ = 3, 16, 4
# Losses: rtol 1e-5 (the fp32 bound). Parameters after 3 SGD steps of lr 0.5: the
# pipelined run sums gradients per micro-batch and replica, in another order than one
# device, and each step feeds the next, so elements near zero differ by a few 1e-6.
FP32 = dict(rtol=1e-5, atol=1e-5)
# AMP bf16 O1: every Linear runs in bfloat16 (eps 7.8e-3). A matmul over a micro-batch of
# 2 sequences and over the whole batch of 16 round differently, so the very first loss
# differs by ~4e-4 relative and parameters by up to ~9e-5 after 3 (clipped) steps, which
# move them by up to ~5e-3; 3-5x margins.
BF16 = dict(rtol=2e-3, atol=3e-4)


def sgd():
    """SGD with momentum: a state for ZeRO to shard. Not Adam: a gradient that is exactly
    zero in exact arithmetic (the key bias's) is rounding noise, which Adam would turn into
    +-lr steps."""
    return optax.sgd(0.5, momentum=0.9)


def batches() -> list:
    return lm_batches(STEPS, batch=BATCH, seq=SEQ, vocab=VOCAB)


def pipeline_strategy(hybrid: dict, micro: int, acc: int, schedule: str = "1F1B", **settings):
    """A strategy with ``pipeline_configs`` (micro-batch size, accumulate steps, schedule)."""
    configs = {"micro_batch_size": micro, "accumulate_steps": acc, "schedule_mode": schedule}
    return make_strategy(hybrid, pipeline_configs=configs, **settings)


def reference_run(strategy, make_tx):
    """TinyGPT on one device: plain nnx.jit step, the strategy's model settings and chain."""
    model = TinyGPT(VOCAB, WIDTH, HEADS, BLOCKS, HIDDEN, seed=0)
    losses, params = train_one_device(model, make_tx(), batches(), gpt_loss, strategy=strategy)
    return losses, nnx.to_pure_dict(params)


@functools.cache
def fp32_reference():
    return reference_run(DistributedStrategy(), sgd)


def pipeline_run(strategy, make_tx=sgd, tensor_parallel=False):
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = PipelineLayer(gpt_descs(tensor_parallel), loss_fn=ce, seed=0)
    model = fleet.distributed_model(layer)
    assert isinstance(model, PipelineParallel)
    opt = fleet.distributed_optimizer(make_tx())
    losses = [float(model.train_batch((b["tokens"], b["labels"]), opt)) for b in batches()]
    return np.array(losses), as_tinygpt(nnx.state(model.module, nnx.Param)), model, opt


# ------------------------------------------------------------------ equality
@pytest.mark.parametrize("schedule", ["FThenB", "1F1B"])
def test_pp2_dp2_mp2_trains_like_one_device(schedule):
    want_losses, want_params = fp32_reference()
    strategy = pipeline_strategy({"dp_degree": 2, "pp_degree": 2, "mp_degree": 2}, 2, 4, schedule)
    losses, params, model, _ = pipeline_run(strategy, tensor_parallel=True)
    assert model.schedule == schedule and model.accumulate_steps == 4
    assert model.module.body.attn.qkv.kernel.sharding.spec == P("pp", None, None, "mp")
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(params, want_params, **FP32, check_dtypes=False)


def test_pp4_dp2_four_micro_batches_with_lr_scheduler_and_eval():
    want_losses, want_params = fp32_reference()
    strategy = pipeline_strategy({"dp_degree": 2, "pp_degree": 4}, 2, 4, "F-then-B")
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = PipelineLayer(gpt_descs(), loss_fn=ce, seg_method="layer:GPTBlock", seed=0)
    model = fleet.distributed_model(layer)
    assert (model.schedule, model.num_stages) == ("FThenB", 4)
    opt = fleet.distributed_optimizer(hyperparams.momentum(0.5, 0.9))  # sgd()'s, readable lr
    scheduler = lr.StepDecay(0.5, step_size=STEPS)  # 0.5 for the steps, then 0.05
    data = [{"tokens": b["tokens"], "labels": b["labels"]} for b in batches()]
    losses = [float(model.train_batch(b, opt, lr_scheduler=scheduler)) for b in data]
    assert scheduler.last_epoch == STEPS and opt.get_lr() == pytest.approx(0.05)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(
        as_tinygpt(nnx.state(model.module, nnx.Param)), want_params, **FP32, check_dtypes=False
    )

    # evaluation: the trained model's loss (pipelined, forward only) and outputs
    ref = TinyGPT(VOCAB, WIDTH, HEADS, BLOCKS, HIDDEN, seed=0)
    nnx.update(ref, nnx.State(as_tinygpt(nnx.state(model.module, nnx.Param))))
    batch = jax.tree.map(jnp.asarray, data[0])
    want_loss, want_logits = nnx.jit(lambda m, b: (gpt_loss(m, b), m(b["tokens"])))(ref, batch)
    loss = model.eval_batch(data[0], compute_loss=True)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    logits = model.eval_batch(data[0])  # Paddle 3.x: compute_loss=False by default
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)


def test_pp2_sharding2_dp2_zero1_trains_like_one_device():
    want_losses, want_params = fp32_reference()
    strategy = pipeline_strategy(
        {"dp_degree": 2, "sharding_degree": 2, "pp_degree": 2}, 2, 2, sharding=True
    )
    losses, params, model, opt = pipeline_run(strategy)
    assert model.placement.zero_stage == 1
    trace = nnx.as_pure(opt.opt_state)[0].trace["module"]
    for leaf in (trace["body"]["attn"]["qkv"]["kernel"], trace["pre"][0]["layer"]["embedding"]):
        assert "sharding" in jax.tree.leaves(tuple(leaf.sharding.spec))  # ZeRO-1: state split
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(params, want_params, **FP32, check_dtypes=False)


def test_pp2_ep2_dp2_trains_like_one_device():
    """The expert axis is data to a dense pipeline: micro-batches split over dp x ep."""
    want_losses, want_params = fp32_reference()
    strategy = pipeline_strategy({"dp_degree": 2, "ep_degree": 2, "pp_degree": 2}, 2, 2)
    losses, params, model, _ = pipeline_run(strategy)
    assert model.placement.data_axes == ("dp", "sharding", "ep")
    assert model.placement.data_parallel_size == 4  # 2 rows x 2 micro-batches x 4 = 16
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(params, want_params, **FP32, check_dtypes=False)


def test_amp_bf16_o1_with_gradient_clipping_trains_like_one_device():
    def clipped():  # the norm is below the gradients' (~1): every step clips
        return optax.chain(clip_by_global_norm(0.05), optax.sgd(0.5))

    settings = dict(amp=True, amp_configs={"dtype": "bfloat16"})
    want_losses, want_params = reference_run(pipeline_strategy({}, 1, 1, **settings), clipped)
    strategy = pipeline_strategy({"dp_degree": 4, "pp_degree": 2}, 2, 2, **settings)
    losses, params, model, _ = pipeline_run(strategy, clipped)
    assert model.module.body.attn.qkv.dtype == jnp.bfloat16  # O1 applied to the stacked body
    np.testing.assert_allclose(losses, want_losses, rtol=BF16["rtol"])
    assert_trees_close(params, want_params, **BF16, check_dtypes=False)
    initial = as_tinygpt(nnx.state(PipelineLayer(gpt_descs(), num_stages=1), nnx.Param))
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(initial), strict=True)
    )
    assert moved > 10 * BF16["atol"]  # the run really trained


# ------------------------------------------------------------------ errors
def init(hybrid: dict, micro: int = 2, acc: int = 4, schedule: str = "1F1B"):
    fleet.init(
        is_collective=True,
        strategy=pipeline_strategy(hybrid, micro, acc, schedule),
        log_level="ERROR",
    )


def tiny_pipeline(stages: int = 2) -> PipelineLayer:
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    return PipelineLayer([LayerDesc(nnx.Linear, 4, 4)] * 4, num_stages=stages, loss_fn=mse)


def test_micro_batch_product_mismatch_names_the_three_numbers():
    init({"dp_degree": 2, "pp_degree": 2, "mp_degree": 2}, micro=2, acc=4)
    model = fleet.distributed_model(tiny_pipeline())
    opt = fleet.distributed_optimizer(sgd())
    data = (jnp.ones((12, 4)), jnp.zeros((12, 4)))
    message = (
        r"micro_batch_size=2 x accumulate_steps=4 = 8 must equal the batch size per "
        r"data-parallel replica, 6 \(a batch of 12 rows over dp 2 x sharding 1 = 2 replicas\)"
        r".*batches of 16 rows"
    )
    with pytest.raises(ValueError, match=message):
        model.train_batch(data, opt)
    init({"dp_degree": 4, "pp_degree": 2}, micro=1, acc=2)
    model = fleet.distributed_model(tiny_pipeline())
    with pytest.raises(ValueError, match=r"micro_batch_size=1 x accumulate_steps=2 = 2 must"):
        model.eval_batch(data, compute_loss=True)


def test_bad_train_batch_arguments_are_clear_errors():
    init({"dp_degree": 4, "pp_degree": 2})
    model = fleet.distributed_model(tiny_pipeline())
    opt = fleet.distributed_optimizer(sgd())
    data = (jnp.ones((32, 4)), jnp.zeros((32, 4)))
    with pytest.raises(TypeError, match=r"scaler=<object.*expected a jfleet.amp.GradScaler"):
        model.train_batch(data, opt, scaler=object())
    with pytest.raises(TypeError, match=r"lr_scheduler=0.1\): expected a Paddle-style"):
        model.train_batch(data, opt, lr_scheduler=0.1)
    with pytest.raises(ValueError, match=r"loss_fn_idx=1 is out of range.*1 loss function"):
        model.train_batch(data, opt, loss_fn_idx=1)
    with pytest.raises(ValueError, match=r"keys \['inputs', 'labels', 'mask'\]"):
        model.train_batch({"inputs": data[0], "labels": data[1], "mask": data[1]}, opt)


@pytest.mark.parametrize(
    ("schedule", "error", "message"),
    [
        ("ZBVPP", NotImplementedError, r"'ZBVPP' is not available.*\['FThenB', '1F1B', 'VPP'"),
        ("VPP", ValueError, r"'VPP' \(interleaved stages\) needs .*num_virtual_pipeline_stages"),
        ("GPipe", ValueError, r"schedule_mode='GPipe' is not valid.*'1F1B', 'FThenB'"),
    ],
)
def test_schedule_names_that_do_not_exist_or_are_not_available(schedule, error, message):
    with pytest.raises(error, match=message):
        init({"dp_degree": 4, "pp_degree": 2}, schedule=schedule)
        fleet.distributed_model(tiny_pipeline())


def test_distributed_model_needs_a_matching_pipeline_layer():
    init({"dp_degree": 4, "pp_degree": 2})
    with pytest.raises(
        TypeError, match=r"pp_degree=2 needs the model as a PipelineLayer, got Linear"
    ):
        fleet.distributed_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"num_stages=4, but the fleet's pp_degree is 2"):
        fleet.distributed_model(tiny_pipeline(stages=4))


def test_pp_not_dividing_the_devices_fails_at_fleet_init():
    with pytest.raises(ValueError, match=r"pp_degree=3 .*= 6.*8 dev"):
        init({"dp_degree": 2, "pp_degree": 3})


def test_meta_parallel_exports_the_pipeline_names():
    import jfleet.fleet.meta_parallel as mp
    from jfleet.parallel import pipeline_layer
    from jfleet.training import pipeline_parallel

    assert mp.PipelineLayer is pipeline_layer.PipelineLayer
    assert mp.LayerDesc is pipeline_layer.LayerDesc
    assert mp.SharedLayerDesc is pipeline_layer.SharedLayerDesc
    assert mp.PipelineParallel is pipeline_parallel.PipelineParallel
    assert fleet.meta_parallel.PipelineLayer is pipeline_layer.PipelineLayer


def test_parallel_cross_entropy_works_as_the_pipeline_loss():
    """The vocabulary-parallel loss on the last stage trains like the dense one."""

    from jfleet.fleet.meta_parallel import (
        ColumnParallelLinear,
        LayerDesc,
        PipelineLayer,
        RowParallelLinear,
        SharedLayerDesc,
        VocabParallelEmbedding,
        parallel_cross_entropy,
    )
    from jfleet.models import stride_batches
    from jfleet.models.parallel_gpt import GPTBlock

    def layers():
        column = functools.partial(ColumnParallelLinear, has_bias=True, gather_output=False)
        row = functools.partial(RowParallelLinear, has_bias=True, input_is_parallel=True)
        embed = functools.partial(SharedLayerDesc, "embed", VocabParallelEmbedding)
        block = LayerDesc(GPTBlock, 16, 2, 32, column=column, row=row)
        return [
            embed(None, "weight", 32, 16),
            *[block] * 2,
            LayerDesc(nnx.LayerNorm, 16),
            embed(lambda e, x: e.attend(x), "weight", 32, 16),
        ]

    def dense(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels
        ).mean()

    def vocab_parallel(logits, labels):
        return parallel_cross_entropy(logits, labels).mean()

    losses = {}
    for name, loss_fn in (("dense", dense), ("parallel", vocab_parallel)):
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 2, "pp_degree": 2, "mp_degree": 2}
        strategy.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2}
        fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
        model = fleet.distributed_model(PipelineLayer(layers(), loss_fn=loss_fn, seed=0))
        opt = fleet.distributed_optimizer(optax.adam(1e-2))
        batches = stride_batches(2, batch=8, seq=8, vocab=32)
        losses[name] = [float(model.train_batch((b["tokens"], b["labels"]), opt)) for b in batches]
    np.testing.assert_allclose(losses["parallel"], losses["dense"], rtol=1e-5)

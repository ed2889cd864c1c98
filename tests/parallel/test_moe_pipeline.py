"""An MoE LM in a pipeline (issue 39): Paddle's ``PipelineLayer`` of ``LayerDesc``\\ s whose
blocks hold ``MoELayer``\\ s (8 experts, GShard top 2, dropless) trains on dp2 x pp2 x ep2
like the same layers on one device (fp32, 3 Adam steps, losses and parameters). Inside a
stage each device holds ``E / ep`` experts and the tokens move by all-to-all over ``ep``;
the gate's loss rides with the activation and is the mean over micro-batches of each
micro-batch's loss; blocks that carry ``LoadStats`` instead get the whole batch's
load-balancing loss under FThenB (pp2 x 4 micro-batches: values, gradients, 3 Adam steps)
and each micro-batch's, noted once, under 1F1B; what stays unsupported is refused clearly.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.mesh.topology import AXIS_NAMES
from jfleet.models.moe_lm import ExpertLayer
from jfleet.parallel import pipeline_layer, stack
from jfleet.parallel.moe import LoadStats, moe_stats
from jfleet.parallel.moe.moe_layer import MoELayer
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
from jfleet.testing import assert_trees_close, hlo, make_strategy, train_one_device
from jfleet.training.engine import TrainStep, cached_step
from jfleet.training.pipeline_parallel import _PipelineObjective

VOCAB, D, HIDDEN, EXPERTS, LAYERS, SEQ = 32, 8, 16, 8, 2, 8
REPLICAS, MICRO = 4, 2  # dp2 x ep2 data replicas; micro-batches a step
BATCH = REPLICAS * MICRO  # one row a micro-batch a replica
AUX_WEIGHT = 0.1
HYBRID = {"dp_degree": 2, "pp_degree": 2, "ep_degree": 2}
DROPLESS = {"type": "gshard", "top_k": 2, "capacity": None, "random_routing": False}


# ------------------------------------------------------------------ the layers
class EmbedPipe(nnx.Module):
    """tokens -> (hidden, the gates' loss so far: zeros a row)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

    def __call__(self, tokens):
        return self.embed(tokens), jnp.zeros(tokens.shape[:1], jnp.float32)


class MoEBlockPipe(nnx.Module):
    """Pre-norm MoE block with a residual; adds its gate's loss to the carried loss."""

    def __init__(self, gate: dict, *, mesh: Mesh | None = None, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        experts = [ExpertLayer(D, HIDDEN, rngs=rngs) for _ in range(EXPERTS)]
        self.moe = MoELayer(D, experts, gate=dict(gate), mesh=mesh, rngs=rngs)

    def __call__(self, x):
        h, aux = x
        h = h + self.moe(self.norm(h))
        return h, aux + self.moe.gate.get_loss()


class HeadPipe(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.head = nnx.Linear(D, VOCAB, rngs=rngs)

    def __call__(self, x):
        h, aux = x
        return self.head(h), aux


def loss_fn(output, labels):
    logits, aux = output
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return ce + AUX_WEIGHT * jnp.mean(aux)


def descs(gate=DROPLESS, layers=LAYERS) -> list:
    return [
        LayerDesc(EmbedPipe),
        *[LayerDesc(MoEBlockPipe, gate) for _ in range(layers)],
        LayerDesc(HeadPipe),
    ]


class Sequential(nnx.Module):
    """The same layers (same seed, same build order) on one device, run in turn."""

    def __init__(self, mesh: Mesh, layers: int = LAYERS):
        rngs = nnx.Rngs(0)
        self.embed = EmbedPipe(rngs=rngs)
        self.blocks = nnx.List(
            [MoEBlockPipe(DROPLESS, mesh=mesh, rngs=rngs) for _ in range(layers)]
        )
        self.head = HeadPipe(rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batches(n: int = 3) -> list:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1), dtype=np.int32)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def micro_batch_mean_loss(model: Sequential, batch) -> jax.Array:
    """The pipeline's objective on one device: micro-batch ``k`` is row ``k`` of every
    replica's rows; the gates' loss is each micro-batch's, averaged over them."""
    tokens, labels = (a.reshape(REPLICAS, MICRO, SEQ) for a in batch)
    return jnp.mean(jnp.stack([loss_fn(model(tokens[:, k]), labels[:, k]) for k in range(MICRO)]))


def one_device_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(AXIS_NAMES)), AXIS_NAMES)


def reference(data, layers=LAYERS):
    model = Sequential(one_device_mesh(), layers)
    losses, _ = train_one_device(model, optax.adam(1e-2), data, micro_batch_mean_loss)
    return losses, model


def pipeline_train(data, layers=LAYERS, **kwargs):
    configs = {"micro_batch_size": 1, "accumulate_steps": MICRO, **kwargs}
    strategy = make_strategy(HYBRID, pipeline_configs=configs)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = PipelineLayer(descs(layers=layers), num_stages=2, loss_fn=loss_fn, seed=0)
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    losses = np.array([float(model.train_batch(b, opt)) for b in data])
    return losses, layer, model, opt, float(model.eval_batch(data[0], compute_loss=True))


def as_pipeline_params(ref: Sequential) -> dict:
    """The reference's parameters as :func:`pipeline_params` gives them (blocks stacked)."""
    blocks = [nnx.to_pure_dict(nnx.state(b, nnx.Param)) for b in ref.blocks]
    body = jax.tree.map(lambda *a: jnp.stack(a), *blocks)
    return {
        "pre": nnx.to_pure_dict(nnx.state(ref.embed, nnx.Param)),
        "body": body,
        "post": nnx.to_pure_dict(nnx.state(ref.head, nnx.Param)),
    }


def pipeline_params(layer: PipelineLayer) -> dict:
    """The trained parameters, the stacked body's in layer order (padded slots left out)."""
    body = nnx.to_pure_dict(nnx.state(layer.body, nnx.Param))
    return {
        "pre": nnx.to_pure_dict(nnx.state(layer.pre[0].layer, nnx.Param)),
        "body": stack.layer_order(body, layer.chunk_sizes),
        "post": nnx.to_pure_dict(nnx.state(layer.post[0].layer, nnx.Param)),
    }


# ------------------------------------------------------------------ tests
@pytest.fixture(scope="module")
def trained():
    data = batches()
    return data, reference(data), pipeline_train(data)


def test_dropless_moe_lm_pipeline_trains_like_one_device(trained):
    _, (want_losses, ref), (got_losses, layer, *_) = trained
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert_trees_close(pipeline_params(layer), as_pipeline_params(ref), devices=8)
    # each device holds its stage's E / ep experts of every expert kernel
    kernel = layer.body.moe.experts.htoh4.kernel[...]
    assert kernel.shape == (2, LAYERS // 2, 1, EXPERTS, D, HIDDEN)
    assert kernel.sharding.shard_shape(kernel.shape) == (1, LAYERS // 2, 1, EXPERTS // 2, D, HIDDEN)


def test_uneven_stages_train_like_one_device(trained):
    """Three MoE blocks on two stages (1 and 2): the padded slot's scratch state and its
    split experts ride through like the others."""
    data = trained[0][:2]
    want_losses, ref = reference(data, layers=3)
    got_losses, layer, *_ = pipeline_train(data, layers=3)
    assert layer.chunk_sizes == (1, 2)
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert_trees_close(pipeline_params(layer), as_pipeline_params(ref), devices=8)


def test_eval_batch_gives_the_trained_models_loss(trained):
    """The forward-only pipeline (experts split over ep too) against the one-device model."""
    data, (_, ref), (*_, evaluated) = trained
    want = nnx.jit(micro_batch_mean_loss)(ref, data[0])
    np.testing.assert_allclose(evaluated, want, rtol=1e-5)


def test_fthenb_trains_like_one_device_too(trained):
    data, (want_losses, ref), _ = trained
    got_losses, layer, *_ = pipeline_train(data, schedule_mode="FThenB")
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert_trees_close(pipeline_params(layer), as_pipeline_params(ref), devices=8)


def test_the_gate_loss_is_in_the_objective(trained):
    """Without the gates' loss the one-device run trains otherwise: the pipeline's equality
    above includes it."""
    data, (want_losses, _), _ = trained
    global AUX_WEIGHT
    weight, AUX_WEIGHT = AUX_WEIGHT, 0.0
    try:
        losses, _ = reference(data[:1])
    finally:
        AUX_WEIGHT = weight
    assert abs(losses[0] - want_losses[0]) > 1e-4


def test_the_compiled_step_holds_e_over_ep_experts_and_exchanges_over_ep(trained):
    """The training step's program: expert kernels only as each device's ``E / ep`` slice
    (no whole expert kernel, no all-gather), and all-to-alls over the two ``ep`` ranks."""
    data, _, (_, _, model, opt, _) = trained
    batch = model.placement.shard_batch(data[0])
    step = cached_step(TrainStep, _PipelineObjective(0, False), model.placement)
    text = step.lower(model, opt, batch).compile().as_text()
    local = f"f32[1,{LAYERS // 2},1,{EXPERTS // 2},{D},{HIDDEN}]"
    assert local in text
    assert not re.search(rf"f32\[\d+,\d+,1,{EXPERTS},{D},{HIDDEN}\]", text)
    found = hlo.collectives(text)
    exchanges = [c for c in found if c.kind == "all-to-all"]
    assert exchanges and all(c.group_size == 2 for c in exchanges)
    assert not [c for c in found if c.kind == "all-gather"]


def test_what_a_pipelined_body_does_not_keep_is_refused(trained):
    *_, (_, layer, *_) = trained
    with pytest.raises(ValueError, match=r"stacked in a pipelined body .* inside the block"):
        layer.body.moe.gate.get_loss()
    with pytest.raises(ValueError, match=r"stacked in a pipelined body .* no counts"):
        moe_stats(layer)


def test_random_routing_in_a_pipeline_is_refused():
    """GShard's random routing draws from an RNG stream, which a pipelined body may not hold."""
    gate = dict(DROPLESS, random_routing=True)
    fleet.init(is_collective=True, strategy=make_strategy(HYBRID), log_level="WARNING")
    kinds = r"\(\['RngCount', 'RngKey'\]\)"
    with pytest.raises(ValueError, match=rf"MoEBlockPipe layers hold state .*{kinds}.*=False"):
        PipelineLayer(descs(gate), num_stages=2, loss_fn=loss_fn, seed=0)


def test_interleaved_schedule_with_split_experts_is_refused():
    configs = {"micro_batch_size": 1, "accumulate_steps": MICRO, "schedule_mode": "ZBH1"}
    fleet.init(
        is_collective=True,
        strategy=make_strategy(HYBRID, pipeline_configs=configs),
        log_level="WARNING",
    )
    model = fleet.distributed_model(PipelineLayer(descs(), num_stages=2, loss_fn=loss_fn))
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    with pytest.raises(ValueError, match=r"schedule='ZBH1' cannot run .* split over 'ep'"):
        model.train_batch(batches(1)[0], opt)


def test_whole_experts_inside_a_shard_map_are_refused():
    """Inside a shard_map manual over ``ep`` the layer needs its ``E / ep`` experts; given
    all of them (replicated in), it says so instead of running the wrong ones."""
    mesh = jax.make_mesh((2,), ("ep",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    layer = MoELayer(D, [ExpertLayer(D, HIDDEN, rngs=nnx.Rngs(i)) for i in range(4)],
                     gate=DROPLESS, mesh=mesh, rngs=nnx.Rngs(0))  # fmt: skip
    graphdef, state = nnx.split(layer)

    def body(state, x):
        return nnx.merge(graphdef, state)(x)

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("ep")), out_specs=P("ep")))
    with pytest.raises(ValueError, match=r"holds 4 expert\(s\) of 4 over ep=2"):
        run(state, jnp.ones((4, D)))


# ------------------------------------------------- the whole batch's load-balancing loss
# Blocks that carry their MoE layers' router statistics (LoadStats) with the activation:
# under FThenB the pipeline sums them over the micro-batches before the loss, so the
# nonlinear GShard loss is the whole batch's (value and gradient) at pp2 x M4; under
# 1F1B it stays each micro-batch's, averaged, and a note says so once.
MICRO4 = 4


class EmbedStats(nnx.Module):
    """tokens -> (hidden, empty router statistics for the LAYERS MoE layers)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

    def __call__(self, tokens):
        return self.embed(tokens), LoadStats.zeros(tokens.shape[0], LAYERS, EXPERTS)


class MoEBlockStats(MoEBlockPipe):
    def __call__(self, x):
        h, stats = x
        y, stats = self.moe(self.norm(h), load_stats=stats)
        return h + y, stats


def whole_loss_fn(output, labels):
    logits, stats = output
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return ce + AUX_WEIGHT * stats.loss()


class SequentialStats(Sequential):
    def __init__(self, mesh: Mesh):
        rngs = nnx.Rngs(0)
        self.embed = EmbedStats(rngs=rngs)
        self.blocks = nnx.List([MoEBlockStats(DROPLESS, mesh=mesh, rngs=rngs) for _ in range(2)])
        self.head = HeadPipe(rngs=rngs)


def whole_batch_loss(model, batch):
    return whole_loss_fn(model(batch[0]), batch[1])


def micro4_batches(n: int) -> list:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, VOCAB, (n, REPLICAS * MICRO4, SEQ + 1), dtype=np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def stats_pipeline(schedule: str) -> tuple:
    configs = {"micro_batch_size": 1, "accumulate_steps": MICRO4, "schedule_mode": schedule}
    strategy = make_strategy(HYBRID, pipeline_configs=configs)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    descs = [LayerDesc(EmbedStats), *[LayerDesc(MoEBlockStats, DROPLESS)] * 2, LayerDesc(HeadPipe)]
    layer = PipelineLayer(descs, num_stages=2, loss_fn=whole_loss_fn, seed=0)
    return layer, fleet.distributed_model(layer)


def micro_batch_mean(model, batch, m):
    """The one-device mean over the ``m`` micro-batches of each one's objective."""
    tokens, labels = (a.reshape(REPLICAS, m, SEQ) for a in batch)
    parts = [whole_batch_loss(model, (tokens[:, k], labels[:, k])) for k in range(m)]
    return jnp.mean(jnp.stack(parts))


def in_layer_order(pipeline_grads, layer, one_device_grads) -> tuple[dict, dict]:
    """Both gradients as :func:`pipeline_params` gives parameters (blocks stacked)."""
    got, want = nnx.to_pure_dict(pipeline_grads), nnx.to_pure_dict(one_device_grads)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *want["blocks"].values())
    return (
        {
            "pre": got["pre"][0]["layer"],
            "body": stack.layer_order(got["body"], layer.chunk_sizes),
            "post": got["post"][0]["layer"],
        },
        {"pre": want["embed"], "body": stacked, "post": want["head"]},
    )


def test_load_stats_under_fthenb_give_the_whole_batchs_loss_at_pp2_m4():
    """Values, gradients, 3 Adam steps and parameters equal one device's whole-batch
    objective, which differs from the micro-batches' mean (what 1F1B trains)."""
    data = micro4_batches(3)
    ref = SequentialStats(one_device_mesh())
    micro_mean = nnx.jit(micro_batch_mean, static_argnums=2)(ref, data[0], MICRO4)
    want_grads = nnx.jit(nnx.grad(whole_batch_loss))(ref, data[0])
    want, _ = train_one_device(ref, optax.adam(1e-2), data, whole_batch_loss)
    assert abs(want[0] - micro_mean) > 1e-3  # the two objectives differ here
    layer, model = stats_pipeline("FThenB")
    batch = model.placement.shard_batch(data[0])
    grads = nnx.jit(
        nnx.grad(lambda lay: lay.pipeline_loss(*batch, schedule="FThenB", num_microbatches=4))
    )(layer)
    assert_trees_close(*in_layer_order(grads, layer, want_grads), devices=8)
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    got = np.array([float(model.train_batch(b, opt)) for b in data])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert_trees_close(pipeline_params(layer), as_pipeline_params(ref), devices=8)


def test_load_stats_under_1f1b_are_each_micro_batchs_and_a_note_says_so(caplog):
    """1F1B cannot have the whole batch's statistics before its first backward: its loss is
    the micro-batches' mean (the forward schedule's value here), noted once."""
    data = micro4_batches(1)
    layer, model = stats_pipeline("1F1B")
    batch = model.placement.shard_batch(data[0])
    pipeline_layer._NOTED.discard("1F1B")
    run = lambda lay: lay.pipeline_loss(*batch, schedule="1F1B", num_microbatches=MICRO4)  # noqa: E731
    with caplog.at_level("WARNING", logger="jfleet"):
        got = nnx.jit(run)(layer)
        nnx.eval_shape(run, layer)
    ref = SequentialStats(one_device_mesh())
    want = nnx.jit(micro_batch_mean, static_argnums=2)(ref, data[0], MICRO4)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert caplog.text.count("schedule_mode='FThenB' gives the whole batch's") == 1, caplog.text

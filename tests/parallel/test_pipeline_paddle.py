"""A pipeline written as Paddle writes it trains exactly like the same layers on one device.

The model is a ``PipelineLayer`` subclass in PaddleNLP's style (descriptions appended to a
list attribute): a tied embedding / LM head written as two classes sharing one
``SharedLayerDesc`` key, four different layer types and a parameter-free function between
them, stages split by Paddle's ``"uniform"`` rule (stage 0 = embedding + 2 layers, stage
1 = function + 2 layers + head), an activation ``(hidden, [L, L] float mask, int
positions)`` and a loss module with a parameter of its own. Two ``train_batch`` steps
under each schedule are compared with the same layers (same seed, same build order) run
sequentially by a plain ``nnx.jit`` step on one device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet import fleet
from jfleet.fleet.meta_parallel import ColumnParallelLinear, ParallelCrossEntropy
from jfleet.parallel import segment, stack
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer, SharedLayerDesc
from jfleet.parallel.stages import FlatStages, Run
from jfleet.precision.amp import apply_amp
from jfleet.testing import make_strategy, train_one_device
from jfleet.training.engine import TrainStep, cached_step
from jfleet.training.pipeline_parallel import _PipelineObjective

V, W, L, BATCH = 16, 8, 4, 8
FP32 = dict(rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ Paddle-style layers
class EmbeddingPipe(nnx.Module):
    """tokens -> (hidden, causal [L, L] float mask, int positions)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embedding_weight = nnx.Param(jax.random.normal(rngs.params(), (V, W)) * 0.5)

    def __call__(self, tokens):
        n = tokens.shape[1]
        mask = jnp.tril(jnp.ones((n, n), jnp.float32)) / jnp.arange(1, n + 1)[:, None]
        positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), tokens.shape)
        return self.embedding_weight[...][tokens], mask, positions


class LMHeadPipe(nnx.Module):
    """The tied head: its own bias, the embedding's weight (shared_weight_attr)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embedding_weight = nnx.Param(jnp.zeros((V, W)))
        self.bias = nnx.Param(jax.random.normal(rngs.params(), (V,)) * 0.1)


def logits_helper(head, inputs):
    return inputs[0] @ head.embedding_weight[...].T + head.bias[...]


class MixPipe(nnx.Module):
    """Mixes positions through the [L, L] mask, adds the int positions as a sinusoid."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(W, W, rngs=rngs)

    def __call__(self, inputs):
        h, mask, positions = inputs
        angle = jnp.sin(positions[..., None].astype(jnp.float32) + jnp.arange(W))
        return (
            h + jnp.tanh(self.linear(jnp.einsum("qk,bkw->bqw", mask, h) + angle)),
            mask,
            positions,
        )


class ScalePipe(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (W,)))
        self.shift = nnx.Param(0.1 * jax.random.normal(rngs.params(), (W,)))

    def __call__(self, inputs):
        h, mask, positions = inputs
        return h * self.scale[...] + self.shift[...], mask, positions


class NormPipe(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(W, rngs=rngs)

    def __call__(self, inputs):
        h, mask, positions = inputs
        return self.norm(h), mask, positions


class GatePipe(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(W, W, use_bias=False, rngs=rngs)
        self.bias = nnx.Param(jnp.zeros((W,)))

    def __call__(self, inputs):
        h, mask, positions = inputs
        return h * jax.nn.sigmoid(self.gate(h) + self.bias[...]), mask, positions


class Tanh(nnx.Module):
    """A layer without parameters."""

    def __call__(self, x):
        return jnp.tanh(x)


def gelu_pipe(inputs):
    h, mask, positions = inputs
    return jax.nn.gelu(h), mask, positions


class CriterionPipe(nnx.Module):
    """Cross-entropy of tempered logits: a loss module with a parameter that trains."""

    def __init__(self):
        self.temperature = nnx.Param(jnp.ones(()))

    def __call__(self, logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(
            logits * self.temperature[...], labels
        ).mean()


def descs() -> list:
    return [
        SharedLayerDesc("embed", EmbeddingPipe, shared_weight_attr="embedding_weight"),
        LayerDesc(MixPipe),
        LayerDesc(ScalePipe),
        gelu_pipe,
        LayerDesc(NormPipe),
        LayerDesc(GatePipe),
        SharedLayerDesc(
            "embed", LMHeadPipe, forward_func=logits_helper, shared_weight_attr="embedding_weight"
        ),
    ]


class LlamaLikePipe(PipelineLayer):
    """PaddleNLP's way: descriptions appended to a list attribute, then PipelineLayer.__init__."""

    def __init__(self, loss_fn, **kwargs):
        self._sequential_layers = []
        for desc in descs():
            self._sequential_layers.append({"layer": desc, "name_prefix": "llama"})
        layers = [entry["layer"] for entry in self._sequential_layers]
        super().__init__(layers=layers, loss_fn=loss_fn, **kwargs)


class Sequential(nnx.Module):
    """The same layers built in the same order from the same seed, run one after another."""

    def __init__(self, loss, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = EmbeddingPipe(rngs=rngs)
        self.body = nnx.List([cls(rngs=rngs) for cls in (MixPipe, ScalePipe)])
        self.tail = nnx.List([cls(rngs=rngs) for cls in (NormPipe, GatePipe)])
        self.head = LMHeadPipe(rngs=rngs)
        self.head.embedding_weight = self.embed.embedding_weight
        self.loss = loss

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.body:
            x = layer(x)
        x = gelu_pipe(x)
        for layer in self.tail:
            x = layer(x)
        return logits_helper(self.head, x)


def batches(steps: int = 2) -> list:
    keys = jax.random.split(jax.random.key(7), 2 * steps)
    return [
        (
            np.asarray(jax.random.randint(keys[2 * i], (BATCH, L), 0, V)),
            np.asarray(jax.random.randint(keys[2 * i + 1], (BATCH, L), 0, V)),
        )
        for i in range(steps)
    ]


def reference(loss) -> tuple:
    model = Sequential(loss)

    def loss_fn(model, batch):
        out = model.loss(model(batch[0]), batch[1])
        return out.mean()

    losses, _ = train_one_device(model, optax.sgd(0.5), batches(), loss_fn)
    return losses, model


#: The PipelineParallel and optimizer of the last :func:`run` (for the memory test).
LAST_RUN: list = []


def run(schedule: str, loss, mp: int = 2, micro: bool = False):
    """Two train_batch steps at dp x pp 2 x mp (2 micro-batches of 8 / 2 / dp rows each)."""
    dp = 8 // (2 * mp)
    configs = {"micro_batch_size": BATCH // 2 // dp, "accumulate_steps": 2}
    configs["schedule_mode"] = schedule
    hybrid = {"dp_degree": dp, "pp_degree": 2, "mp_degree": mp}
    strategy = make_strategy(hybrid, pipeline_configs=configs)
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = LlamaLikePipe(loss(), seed=0)
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(optax.sgd(0.5))
    LAST_RUN[:] = [model, opt]
    first, last = batches()
    losses = [float(model.train_batch(first, opt))]
    if micro:  # the last step's micro-batch losses, and the trained model's outputs
        per_micro = np.asarray(model.train_batch(last, opt, return_micro_batch_loss=True))
        return np.asarray([*losses, per_micro.mean()]), layer, per_micro, model.eval_batch(last)
    losses.append(float(model.train_batch(last, opt)))
    return np.asarray(losses), layer


def assert_same_layers(layer: PipelineLayer, ref: Sequential) -> None:
    """Stage rows rebuilt into layers equal the reference's layers."""
    stages = layer.stages
    s0, s1 = (stages.layers(s, stages.rows(s)) for s in range(2))
    pairs = [
        (layer.shared_layers["embed"], ref.embed),
        (s0[1].layer, ref.body[0]),
        (s0[2].layer, ref.body[1]),
        (s1[1].layer, ref.tail[0]),
        (s1[2].layer, ref.tail[1]),
        (layer.shared_layers["embed:LMHeadPipe"], ref.head),
    ]
    if isinstance(ref.loss, nnx.Module):
        pairs.append((layer.loss_fns[0], ref.loss))
    for got, want in pairs:
        chex_close(nnx.state(got), nnx.state(want))  # stage layers hold stages.Slot views


def chex_close(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **FP32)


def micro_losses_of_step_two(loss) -> np.ndarray:
    """The second step's micro-batch losses on one device: micro-batch i is rows 2i, 2i + 1
    of each of the dp 2 replicas' 4 rows, its loss the mean over the replicas."""
    start = Sequential(loss)
    train_one_device(
        start, optax.sgd(0.5), batches()[:1], lambda m, b: m.loss(m(b[0]), b[1]).mean()
    )
    tokens, labels = batches()[1]
    rows = [start.loss(start(tokens[r : r + 1]), labels[r : r + 1]).mean() for r in range(BATCH)]
    return np.asarray(rows).reshape(2, 2, 2).mean(axis=(0, 2))


@pytest.fixture(scope="module")
def one_f_one_b():
    result = run("1F1B", CriterionPipe, micro=True)
    model, opt = LAST_RUN  # the trained PipelineParallel and its optimizer
    return result, reference(CriterionPipe()), (model, opt)


# ------------------------------------------------------------------ tests
def test_different_layers_per_stage_train_like_one_device_1f1b(one_f_one_b):
    (losses, layer, per_micro, outputs), (want_losses, ref), _ = one_f_one_b
    assert layer.segment_parts == (0, 3, 7) and layer.body is None
    np.testing.assert_allclose(losses, want_losses, **FP32)
    assert_same_layers(layer, ref)
    assert float(layer.loss_fns[0].temperature[...]) != 1.0  # the loss module trained
    np.testing.assert_allclose(per_micro, micro_losses_of_step_two(CriterionPipe()), **FP32)
    np.testing.assert_allclose(outputs, ref(batches()[1][0]), **FP32)  # eval_batch: outputs
    # the tied weight is one parameter: the head's is the embedding's
    tied = layer.shared_layers["embed:LMHeadPipe"].embedding_weight
    assert tied is layer.shared_layers["embed"].embedding_weight


def test_each_device_holds_only_its_stage(one_f_one_b):
    (_, layer, _, _), _, (model, opt) = one_f_one_b
    stages = layer.stages
    # stage 0: Mix (W*W + W) + Scale (2W); stage 1: Norm (2W) + Gate (W*W + W)
    share = W * W + 3 * W
    assert stages.sizes == (share, share)
    flat = stages.flat["float32"][...]
    assert flat.shape == (2, share)
    assert {s.data.shape for s in flat.addressable_shards} == {(1, share)}
    rows = [s.index[0].start or 0 for s in flat.addressable_shards]
    assert sorted(rows) == [0] * 4 + [1] * 4  # 4 devices (dp x mp) per stage
    # The compiled training step's arguments on one device: its stage's row (share floats),
    # what every device holds (the tied embedding and head bias, the loss module's
    # temperature, the stage templates' one-byte placeholders), the optimizer's step counter
    # and the device's rows of the batch (tokens and labels, split over dp 2): not the other
    # stage's parameters.
    batch = model.placement.shard_batch(batches()[0])
    step = cached_step(TrainStep, _PipelineObjective(0, False), model.placement)
    compiled = step.lower(model, opt, batch).compile()
    everywhere = V * W + V + 1  # embedding_weight, the head's bias, temperature
    placeholders = sum(x.nbytes for x in jax.tree.leaves(nnx.state(stages.templates)))
    batch_bytes = 2 * BATCH * L * 4 // 2
    expected = 4 * (share + everywhere) + placeholders + 4 + batch_bytes
    assert compiled.memory_analysis().argument_size_in_bytes == expected


def test_fthenb_with_parallel_cross_entropy_micro_losses_and_outputs_like_one_device():
    losses, layer, per_micro, outputs = run("FThenB", ParallelCrossEntropy, micro=True)

    def per_token(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    want_losses, ref = reference(per_token)
    np.testing.assert_allclose(losses, want_losses, **FP32)
    assert_same_layers(layer, ref)
    np.testing.assert_allclose(outputs, ref(batches()[1][0]), **FP32)  # eval_batch: outputs
    np.testing.assert_allclose(per_micro, micro_losses_of_step_two(per_token), **FP32)


def test_recompute_interval_checkpoints_stage_layers_same_values():
    plain = LlamaLikePipe(CriterionPipe(), num_stages=2, seed=0)
    remat = LlamaLikePipe(CriterionPipe(), num_stages=2, seed=0, recompute_interval=1)
    tokens, labels = batches(1)[0]

    def grads(model):
        return nnx.value_and_grad(lambda m: m.loss(tokens, labels))(model)

    text = str(jax.make_jaxpr(grads)(remat))
    assert "checkpoint" in text or "remat" in text
    assert "checkpoint" not in str(jax.make_jaxpr(grads)(plain))
    (a, ga), (b, gb) = grads(plain), grads(remat)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    chex_close(ga, gb)


def test_paddle_segmentation_rules():
    names = ["Embed"] + ["Block"] * 6 + ["Norm", "Head"]
    # Paddle's uniform: 9 // 4 = 2 each, the 9 % 4 = 1 extra to the last stage
    assert segment.uniform(9, 4) == [0, 2, 4, 6, 9]
    assert segment.uniform(10, 4) == [0, 2, 4, 7, 10]
    assert segment.segment_layers(names, 3, "layer:^block$") == [0, 3, 5, 9]
    assert segment.segment_layers(names, 2, [0, 4, 9]) == [0, 4, 9]
    # a stage holding only a function: parameter-free stage runs in the switch
    model = PipelineLayer(
        [LayerDesc(nnx.Linear, 2, 2), jnp.tanh, LayerDesc(nnx.Linear, 2, 2)],
        num_stages=3,
        seed=0,
    )
    assert model.stages.sizes == (6, 0, 6)


# ------------------------------------------------------------------ bad input
def _head_of_other_shape():
    small = functools.partial(nnx.Embed, 8, 4)
    return [
        SharedLayerDesc("e", nnx.Embed, None, "embedding", 16, 4),
        LayerDesc(nnx.Linear, 4, 4),
        SharedLayerDesc("e", small, lambda e, x: e.attend(x), "embedding"),
    ]


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (
            lambda: PipelineLayer(_head_of_other_shape(), num_stages=1),
            ValueError,
            r"key 'e': Embed.embedding is float32\[8, 4\] but Embed.embedding is float32\[16, 4\]",
        ),
        (
            lambda: PipelineLayer([LayerDesc(nnx.Linear, 2, 2)] * 2, loss_fn=CriterionPipe),
            TypeError,
            r"is a class \(CriterionPipe\); pass an instance, loss_fn=CriterionPipe\(\)",
        ),
        (
            lambda: PipelineLayer([LayerDesc(nnx.Linear, 2, 2)] * 2, seg_method="layer:("),
            ValueError,
            r"seg_method='layer:\(': bad regular expression",
        ),
        (
            lambda: FlatStages([[Run(nnx.BatchNorm(2, rngs=nnx.Rngs(0)))]]),
            ValueError,
            r"pipeline stage 0's layers hold state other than nnx.Param \(\['BatchStat'\]\)",
        ),
        (
            lambda: stack.stage_inputs((jnp.ones((3, 3)), jnp.ones((4, 2), int)), batch=4),
            ValueError,
            r"of shapes \(\(3, 3\), \(4, 2\)\) \(batch 4\).*at least one floating array whose "
            r"leading dimension is the batch",
        ),
        (
            lambda: stack.stage_inputs((jnp.ones((4, 2)), jnp.ones((3, 3))))[0].activation_of(
                [jnp.ones((4, 2))], []
            ),
            ValueError,
            r"has 1 leaves that are not batch first.*activation_of got 0 shared inputs",
        ),
    ],
)
def test_bad_settings_are_clear_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_parameter_free_stage_trains_and_bad_splits_are_refused():
    strategy = make_strategy({"dp_degree": 4, "pp_degree": 2})
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    x = jnp.ones((8, 4))
    zigzag = PipelineLayer(
        [LayerDesc(nnx.Linear, 4, 6), LayerDesc(nnx.Linear, 6, 4)] * 2,
        seg_method=[0, 1, 2, 4],
        num_stages=3,
        loss_fn=mse,
    )
    three_stages = jax.make_mesh((3,), ("pp",), devices=jax.devices()[:3])
    with pytest.raises(
        ValueError, match=r"after layer 0: \['float32\[8, 6\]'\]; after layer 1: \['float32"
    ):
        zigzag.pipeline_loss(x, x, mesh=three_stages)
    three = PipelineLayer([LayerDesc(nnx.Linear, 4, 4)] * 3, num_stages=2, loss_fn=mse)
    # 3 identical layers over 2 stages, [0, 1, 3]: one stacked body padded to 2 a stage
    assert three.stages is None and three.chunk_sizes == (1, 2)
    # a stage of parameter-free layers (identical LayerDescs: formerly a lax.scan crash)
    free = PipelineLayer([LayerDesc(Tanh)] * 2 + [LayerDesc(nnx.Linear, 4, 4)] * 2, loss_fn=mse)
    assert free.stages.sizes == (0, 40) and free.body is None
    y = jnp.arange(32.0).reshape(8, 4) / 32

    @nnx.jit
    def both(model):
        sequential = nnx.value_and_grad(lambda m: m.loss(x, y))(model)
        piped = nnx.value_and_grad(lambda m: m.pipeline_loss(x, y, num_microbatches=2))(model)
        return sequential, piped

    (want, want_grads), (got, grads) = both(free)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    chex_close(grads, want_grads)
    tied_inside = PipelineLayer(
        [
            LayerDesc(nnx.Linear, 4, 4),
            SharedLayerDesc("t", nnx.Linear, None, "kernel", 4, 4),
            LayerDesc(nnx.Linear, 4, 4),
            SharedLayerDesc("t", nnx.Linear, None, "kernel", 4, 4),
        ],
        loss_fn=mse,
    )
    with pytest.raises(ValueError, match=r"layers \[1, 3\] are SharedLayerDescs inside"):
        tied_inside.pipeline_loss(x, x)


def test_parameters_in_paddle_order_read_and_written_through_views():
    flat = PipelineLayer(
        [LayerDesc(nnx.Linear, 2, 3), jnp.tanh, LayerDesc(nnx.LayerNorm, 3)], num_stages=2
    )
    params = flat.parameters()
    assert [p.shape for p in params] == [(2, 3), (3,), (3,), (3,)]  # kernel, bias, scale, bias
    params[0].set_value(np.arange(6.0).reshape(2, 3))
    kernel = flat.stages.layers(0, flat.stages.rows(0))[0].layer.kernel[...]
    np.testing.assert_array_equal(kernel, np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(params[0][...], kernel)
    with pytest.raises(ValueError, match=r"set_value got shape \(2,\) for a parameter of shape"):
        params[0].set_value(np.ones(2))

    stacked = PipelineLayer([LayerDesc(nnx.Linear, 2, 2)] * 4, num_stages=2)
    params = stacked.parameters()
    assert [p.shape for p in params] == [(2, 2), (2,)] * 4
    params[3].set_value(np.full(2, 7.0))  # layer 1's bias: stage 0, its second layer
    np.testing.assert_array_equal(stacked.body.bias[...][0, 1], [7.0, 7.0])
    assert float(jnp.abs(stacked.body.bias[...][1]).sum()) == 0.0


def test_amp_settings_reach_the_layers_of_flat_stages():
    model = LlamaLikePipe(CriterionPipe(), num_stages=2, seed=0)
    apply_amp(model, dtype="bfloat16", level="O1")  # what fleet.distributed_model applies
    gate = model.stages.layers(1, model.stages.rows(1))[2].layer.gate
    assert gate.dtype == jnp.bfloat16  # a white-listed Linear in stage 1 computes in bf16
    assert gate.kernel[...].dtype == jnp.float32  # O1: parameters stay fp32
    norm = model.stages.layers(1, model.stages.rows(1))[1].layer.norm
    assert norm.dtype in (None, jnp.float32)  # black-listed: fp32


def test_zero3_shards_the_stage_buffers_and_trains_like_one_device():
    """ZeRO-3 over sharding 2 at pp 2 x mp 2: each stage's row is split over the sharding
    axis too, and two Adam steps equal one device."""
    configs = {"micro_batch_size": BATCH // 4, "accumulate_steps": 2, "schedule_mode": "1F1B"}
    hybrid = {"dp_degree": 1, "pp_degree": 2, "sharding_degree": 2, "mp_degree": 2}
    strategy = make_strategy(hybrid, pipeline_configs=configs, sharding_configs={"stage": 3})
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = LlamaLikePipe(CriterionPipe(), seed=0)
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(optax.adam(0.05))
    losses = [float(model.train_batch(b, opt)) for b in batches()]
    flat = layer.stages.flat["float32"][...]
    assert {s.data.shape for s in flat.addressable_shards} == {(1, flat.shape[1] // 2)}
    ref = Sequential(CriterionPipe())
    want, _ = train_one_device(
        ref, optax.adam(0.05), batches(), lambda m, b: m.loss(m(b[0]), b[1]).mean()
    )
    np.testing.assert_allclose(losses, want, **FP32)
    assert_same_layers(layer, ref)


def test_amp_o2_casts_flat_stage_layers_as_unpipelined_ones():
    """O2 casts a stage's Linear to half and keeps its LayerNorm fp32, as without a pipeline
    (the buffers regroup by dtype); values are the fp32 ones cast."""
    model = LlamaLikePipe(CriterionPipe(), num_stages=2, seed=0)
    before = model.stages.layers(1, model.stages.rows(1))
    norm_scale, gate_kernel = before[1].layer.norm.scale[...], before[2].layer.gate.kernel[...]
    apply_amp(model, dtype="bfloat16", level="O2")
    assert sorted(model.stages.flat) == ["bfloat16", "float32"]
    after = model.stages.layers(1, model.stages.rows(1))
    np.testing.assert_array_equal(after[1].layer.norm.scale[...], norm_scale)  # fp32 kept
    assert after[1].layer.norm.scale[...].dtype == jnp.float32
    assert after[2].layer.gate.kernel[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(after[2].layer.gate.kernel[...], gate_kernel.astype(jnp.bfloat16))
    reference = Sequential(CriterionPipe())
    apply_amp(reference, dtype="bfloat16", level="O2")
    assert reference.tail[0].norm.scale[...].dtype == jnp.float32  # the same rule unpipelined


def test_tensor_parallel_layers_in_stages_of_different_layers_are_refused_at_mp2():
    strategy = make_strategy({"dp_degree": 2, "pp_degree": 2, "mp_degree": 2})
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    column = LayerDesc(ColumnParallelLinear, 4, 4, gather_output=True)
    model = PipelineLayer(
        [LayerDesc(nnx.Linear, 4, 4), column, LayerDesc(nnx.Linear, 4, 4)],
        loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
    )
    assert model.segment_parts == (0, 1, 3) and model.stages.sharded[0][:2] == (1, 0)
    x = jnp.ones((8, 4))
    with pytest.raises(NotImplementedError, match=r"run tensor-parallel parameters \(layer 1: "):
        model.pipeline_loss(x, x, num_microbatches=2)

"""PipelineLayer: the same model as TinyGPT, segmentation, recompute, tied weights, errors.

The GPT is jfleet's :class:`~jfleet.models.parallel_gpt.TinyGPT` described as layers: built with
the same seed, the PipelineLayer has TinyGPT's parameters (stacked) whatever the number
of stages and the tensor-parallel degree, and computes the same function.
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
from jfleet.mesh.topology import MP, PP
from jfleet.models import lm_batches
from jfleet.models.parallel_gpt import GPTBlock, TinyGPT, gpt_loss
from jfleet.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer, SharedLayerDesc
from jfleet.parallel.pipeline_schedule import SCHEDULES

VOCAB, WIDTH, HEADS, HIDDEN, BLOCKS = 32, 16, 2, 32, 4
TOL = dict(rtol=1e-5, atol=1e-6)
PLAIN = (functools.partial(nnx.Linear, use_bias=True),) * 2
TENSOR_PARALLEL = (
    functools.partial(ColumnParallelLinear, has_bias=True, gather_output=False),
    functools.partial(RowParallelLinear, has_bias=True, input_is_parallel=True),
)


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def gpt_descs(tensor_parallel: bool = False, blocks: int = BLOCKS) -> list:
    """TinyGPT(VOCAB, WIDTH, HEADS, blocks, HIDDEN) as layer descriptions (same build order)."""
    column, row = TENSOR_PARALLEL if tensor_parallel else PLAIN
    if tensor_parallel:
        embed = LayerDesc(VocabParallelEmbedding, VOCAB, WIDTH)
        head = LayerDesc(ColumnParallelLinear, WIDTH, VOCAB, has_bias=False, gather_output=False)
    else:
        embed = LayerDesc(nnx.Embed, VOCAB, WIDTH)
        head = LayerDesc(nnx.Linear, WIDTH, VOCAB, use_bias=False)
    block = LayerDesc(GPTBlock, WIDTH, HEADS, HIDDEN, column=column, row=row)
    return [embed] + [block] * blocks + [LayerDesc(nnx.LayerNorm, WIDTH), head]


def init(**hybrid: int) -> None:
    strategy = DistributedStrategy()
    strategy.hybrid_configs = hybrid
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")


def as_tinygpt(tree) -> dict:
    """A PipelineLayer's pure state (params or grads) in TinyGPT's layout."""
    pure = nnx.to_pure_dict(tree)
    body = jax.tree.map(lambda a: np.asarray(a).reshape(-1, *a.shape[2:]), pure["body"])
    blocks = {i: jax.tree.map(lambda a, i=i: a[i], body) for i in range(BLOCKS)}
    return {
        "embed": pure["pre"][0]["layer"],
        "blocks": blocks,
        "norm": pure["post"][0]["layer"],
        "head": pure["post"][1]["layer"],
    }


def assert_close(got, want, **tol):
    want = nnx.to_pure_dict(want) if isinstance(want, nnx.State) else want
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path), **(tol or TOL)
        )


# ------------------------------------------------------------------ the same model
def test_same_seed_builds_tinygpt_whatever_the_stages_and_mp():
    want = nnx.state(TinyGPT(VOCAB, WIDTH, HEADS, BLOCKS, HIDDEN, seed=0), nnx.Param)
    for stages in (1, 2, 4):
        model = PipelineLayer(gpt_descs(), num_stages=stages, seg_method="layer:GPTBlock", seed=0)
        assert model.body.attn.qkv.kernel.shape == (stages, BLOCKS // stages, WIDTH, 3 * WIDTH)
        assert_close(as_tinygpt(nnx.state(model, nnx.Param)), want, rtol=0, atol=0)
    init(dp_degree=2, pp_degree=2, mp_degree=2)
    model = PipelineLayer(gpt_descs(tensor_parallel=True), seed=0)  # num_stages: pp_degree
    assert model.num_stages == 2
    assert_close(as_tinygpt(nnx.state(model, nnx.Param)), want, rtol=0, atol=0)
    kernel = model.body.attn.qkv.kernel
    assert kernel.get_metadata("out_sharding") == (PP, None, None, MP)
    assert kernel.sharding.spec == P(PP, None, None, MP)
    assert model.body.norm1.scale.sharding.spec == P(PP, None, None)


def test_call_and_loss_are_the_sequential_model():
    ref = TinyGPT(VOCAB, WIDTH, HEADS, BLOCKS, HIDDEN, seed=0)
    model = PipelineLayer(gpt_descs(), num_stages=2, loss_fn=ce, seed=0)
    batch = jax.tree.map(jnp.asarray, lm_batches(1, batch=4, seq=5, vocab=VOCAB)[0])

    @nnx.jit
    def run(model, ref):
        got = model(batch["tokens"]), model.loss(batch["tokens"], batch["labels"])
        return got, (ref(batch["tokens"]), gpt_loss(ref, batch))

    (logits, loss), (want_logits, want_loss) = run(model, ref)
    np.testing.assert_allclose(logits, want_logits, **TOL)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)


# ------------------------------------------------------------------ segmentation
@pytest.mark.parametrize(
    ("seg_method", "stages", "parts"),
    [
        ("uniform", 2, (0, 3, 7)),
        ("layer:gptblock", 4, (0, 2, 3, 4, 7)),
        ([0, 3, 7], 2, (0, 3, 7)),
        ([0, 2, 3, 4, 7], 4, (0, 2, 3, 4, 7)),
    ],
)
def test_seg_methods_find_the_body(seg_method, stages, parts):
    model = PipelineLayer(gpt_descs(), num_stages=stages, seg_method=seg_method)
    assert model.body_range == (1, 5)
    assert (model.num_layers, model.layers_per_stage) == (BLOCKS, BLOCKS // stages)
    assert model.segment_parts == parts
    assert [model.get_stage_from_index(i) for i in (0, 4, 6)] == [0, stages - 1, stages - 1]
    assert (len(model.pre), len(model.post)) == (1, 2)


class Dense(nnx.Module):
    """tanh(x @ w + b): a small nonlinear layer."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


def test_recompute_interval_checkpoints_groups_with_the_same_values():
    x = jax.random.normal(jax.random.key(0), (4, 8))
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    plain = PipelineLayer([LayerDesc(Dense, 8)] * 4, num_stages=1, loss_fn=mse)
    remat = PipelineLayer(
        [LayerDesc(Dense, 8)] * 4, num_stages=1, loss_fn=mse, recompute_interval=3
    )

    def loss(model):
        return model.loss(x, jnp.zeros_like(x))

    assert "remat" not in str(jax.make_jaxpr(lambda: loss(plain))())
    # 4 layers by 3: a scan over one group of 3 under jax.checkpoint, then a group of 1
    assert str(jax.make_jaxpr(lambda: loss(remat))()).count("remat2[") == 2

    @nnx.jit
    def both(plain, remat):
        return nnx.value_and_grad(loss)(plain), nnx.value_and_grad(loss)(remat)

    want, got = both(plain, remat)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    assert_close(nnx.to_pure_dict(got[1]), want[1])


# ------------------------------------------------------------------ tied weights
class TiedGPT(nnx.Module):
    """The single-device reference: one embedding used for the input and as the LM head."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List(
            [
                GPTBlock(WIDTH, HEADS, HIDDEN, column=PLAIN[0], row=PLAIN[1], rngs=rngs)
                for _ in range(BLOCKS)
            ]
        )
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))


def tied_descs() -> list:
    column, row = TENSOR_PARALLEL
    embed = functools.partial(SharedLayerDesc, "embed", VocabParallelEmbedding)
    return [
        embed(None, "weight", VOCAB, WIDTH),
        *[LayerDesc(GPTBlock, WIDTH, HEADS, HIDDEN, column=column, row=row)] * BLOCKS,
        LayerDesc(nnx.LayerNorm, WIDTH),
        embed(lambda layer, x: layer.attend(x), "weight", VOCAB, WIDTH),
    ]


def test_tied_embedding_and_head_equal_the_shared_single_device_model():
    batch = jax.tree.map(jnp.asarray, lm_batches(1, batch=16, seq=4, vocab=VOCAB)[0])
    ref = TiedGPT(rngs=nnx.Rngs(0))
    want_loss, want = nnx.jit(
        nnx.value_and_grad(lambda m: ce(m(batch["tokens"]), batch["labels"]))
    )(ref)

    init(dp_degree=2, pp_degree=2, mp_degree=2)
    model = PipelineLayer(tied_descs(), loss_fn=ce, seed=0)
    assert model.pre[0].layer is model.post[1].layer  # one module, one Param
    tables = [a for a in jax.tree.leaves(nnx.state(model, nnx.Param)) if a.shape == (32, 16)]
    assert len(tables) == 1

    @nnx.jit
    def both(model):
        out = []
        for schedule in SCHEDULES:
            loss = functools.partial(
                PipelineLayer.pipeline_loss, schedule=schedule, num_microbatches=4
            )
            out.append(nnx.value_and_grad(loss)(model, batch["tokens"], batch["labels"]))
        return out

    for loss, grads in both(model):
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
        # nnx lists a shared Param once, under its first path in key order ("post")
        pure = nnx.to_pure_dict(grads)
        assert "pre" not in pure
        body = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), pure["body"])
        got = {
            "blocks": {i: jax.tree.map(lambda a, i=i: a[i], body) for i in range(BLOCKS)},
            "embed": pure["post"][1]["layer"],
            "norm": pure["post"][0]["layer"],
        }
        assert_close(got, {k: nnx.to_pure_dict(want)[k] for k in got})


# ------------------------------------------------------------------ masks and positions
class Inputs(nnx.Module):
    """Paddle-style pre layer: tokens -> (hidden, attention mask, integer position ids).

    Token 0 is padding: the mask is False there and positions count real tokens only.
    """

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = VocabParallelEmbedding(VOCAB, WIDTH, rngs=rngs)

    def __call__(self, tokens):
        mask = tokens != 0
        positions = jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
        return self.embed(tokens), mask, positions


class MaskedBlock(nnx.Module):
    """Takes and returns ``(hidden, mask, position_ids)``: causal attention over the unmasked
    keys, the positions entering as a sinusoid (tensor-parallel q/k/v and output)."""

    def __init__(self, *, rngs: nnx.Rngs):
        column, row = TENSOR_PARALLEL
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.qkv = column(WIDTH, 3 * WIDTH, rngs=rngs)
        self.o = row(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, inputs):
        x, mask, positions = inputs
        b, s, w = x.shape
        hd = w // HEADS
        angle = positions[..., None].astype(jnp.float32) / (1.0 + jnp.arange(w))
        qkv = self.qkv(self.norm(x) + jnp.sin(angle)).reshape(b, s, HEADS, 3, hd)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
        allowed = jnp.tril(jnp.ones((s, s), bool)) & mask[:, None, None, :]
        allowed = allowed | jnp.eye(s, dtype=bool)  # every row sees itself
        probs = jax.nn.softmax(jnp.where(allowed, logits, -1e30), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, w)
        return x + self.o(out), mask, positions


def hidden(inputs):
    return inputs[0]


def test_stages_pass_a_mask_and_position_ids_like_paddle_with_both_schedules():
    init(dp_degree=2, pp_degree=2, mp_degree=2)
    head = LayerDesc(ColumnParallelLinear, WIDTH, VOCAB, has_bias=False, gather_output=False)
    descs = [LayerDesc(Inputs), *[LayerDesc(MaskedBlock)] * 4, hidden]
    model = PipelineLayer(
        [*descs, LayerDesc(nnx.LayerNorm, WIDTH), head],
        loss_fn=ce,
        seg_method="layer:MaskedBlock",
        seed=0,
    )
    assert (model.num_stages, model.layers_per_stage, len(model.post)) == (2, 2, 3)

    k = jax.random.split(jax.random.key(3), 3)
    tokens = jax.random.randint(k[0], (8, 6), 1, VOCAB)
    pad = jnp.arange(6)[None, :] < jax.random.randint(k[1], (8, 1), 0, 4)
    tokens = jnp.where(pad, 0, tokens)  # left padding of 0-3 tokens per row
    labels = jax.random.randint(k[2], (8, 6), 0, VOCAB)
    _, mask, positions = model.run_pre(tokens)
    assert (mask.dtype, positions.dtype) == (jnp.bool_, jnp.int32)
    assert not bool(mask.all()) and int(positions.max()) == 5

    @nnx.jit
    def run(model):
        out = [nnx.value_and_grad(lambda m: m.loss(tokens, labels))(model)]
        for schedule in SCHEDULES:
            loss = functools.partial(
                PipelineLayer.pipeline_loss, schedule=schedule, num_microbatches=2
            )
            out.append(nnx.value_and_grad(loss)(model, tokens, labels))
        return out

    (want_loss, want), *got = run(model)
    for schedule, (loss, grads) in zip(SCHEDULES, got, strict=True):
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5, err_msg=schedule)
        assert_close(nnx.to_pure_dict(grads), want)


# ------------------------------------------------------------------ errors
LINEAR = LayerDesc(nnx.Linear, 4, 4)


def _bad(**kw):
    kw.setdefault("layers", gpt_descs())
    kw.setdefault("num_stages", 2)
    return functools.partial(PipelineLayer, **kw)


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (
            _bad(seg_method="layer:Decoder"),
            ValueError,
            r"'layer:Decoder' matches no layer.*\['Embed', 'GPTBlock', 'LayerNorm', 'Linear'\]",
        ),
        (_bad(num_stages=8), ValueError, r"num_stages=8 is more than the 7 layers"),
        (_bad(seg_method=[0, 1.5, 7]), TypeError, r"seg_method=\[0, 1.5, 7\] must be 'uniform'"),
        (_bad(seg_method=[0, 7]), ValueError, r"3 non-decreasing stage boundaries from 0 to 7"),
        (_bad(seg_method="even"), ValueError, r"seg_method='even' is not a segmentation method"),
        (
            _bad(  # no identical run on every stage (gpt_descs' 4 blocks now split 0,2 / 2,0)
                layers=[LayerDesc(nnx.Linear, 4, 8), LayerDesc(nnx.Linear, 8, 4)] * 2,
                num_virtual_pipeline_stages=2,
            ),
            ValueError,
            r"num_virtual_pipeline_stages=2 needs a stacked body of identical layers with every",
        ),
        (
            _bad(layers=[LayerDesc(nnx.BatchNorm, 4)] * 2),
            ValueError,
            r"hold state other than nnx.Param \(\['BatchStat'\]\)",
        ),
        (
            _bad(layers=[SharedLayerDesc("e", nnx.Embed, None, "weight", 8, 4), *[LINEAR] * 2]),
            ValueError,
            r"no attribute shared_weight_attr='weight'; its parameters: \['embedding'\]",
        ),
        (_bad(layers=[lambda x: x]), ValueError, r"num_stages=2 is more than the 1 layers"),
        (_bad(layers=["embed"]), TypeError, r"these are not: 0: 'embed'"),
        (_bad(recompute_interval=-1), ValueError, r"recompute_interval=-1"),
    ],
)
def test_bad_layer_settings_are_clear_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_pipeline_loss_needs_a_loss_fn_and_a_matching_mesh():
    model = PipelineLayer(gpt_descs(), num_stages=4)
    tokens = jnp.zeros((8, 4), jnp.int32)
    with pytest.raises(ValueError, match="has no loss_fn"):
        model.pipeline_loss(tokens, tokens)
    init(dp_degree=4, pp_degree=2)
    model = PipelineLayer(gpt_descs(), num_stages=4, loss_fn=ce)
    with pytest.raises(ValueError, match=r"num_stages=4 but the mesh's 'pp' axis has size 2"):
        model.pipeline_loss(tokens, tokens)


def test_layer_desc_gives_rngs_only_to_layers_whose_init_takes_it():
    """An nnx.Module class's signature is (*args, **kwargs); its __init__ decides."""

    class Scale(nnx.Module):  # Paddle-style layer: no rngs argument
        def __init__(self, n):
            self.w = nnx.Param(jnp.full((n,), 2.0))

        def __call__(self, x):
            return x * self.w

    assert LayerDesc(Scale, 3).build_layer(nnx.Rngs(0)).w.shape == (3,)
    with_rngs = LayerDesc(nnx.Linear, 3, 2).build_layer(nnx.Rngs(1))
    expected = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(with_rngs.kernel[...], expected.kernel[...])

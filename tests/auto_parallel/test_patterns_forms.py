"""The matcher on forms public code writes (issue 27): KV caches written in the training call,
the token embedding found by dataflow (never by shape), forms that used to crash it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.match.patterns import match_patterns
from jfleet.testing.nnx_styles import LlamaCacheTransformer, ModelArgs
from tests.auto_parallel.random_forms import Form, FormModel

COL, ROW = P(None, "mp"), P("mp", None)


def _cache_forward(model, batch):
    """A fresh cache every step, written with a dynamic update and read back."""
    logits, _ = model(batch["tokens"], cache=model.init_cache(batch["tokens"].shape[0]))
    return logits


def test_projections_written_into_a_kv_cache_keep_their_roles():
    model = nnx.eval_shape(lambda: LlamaCacheTransformer(ModelArgs(), rngs=nnx.Rngs(0)))
    batch = {"tokens": jax.ShapeDtypeStruct((2, 8), jnp.int32)}
    found = match_patterns(model, batch, forward=_cache_forward)
    roles = {p.path: (p.role, p.spec) for p in found.params if p.block == 1}
    assert roles["layers.1.attention.wq.kernel"] == ("q", COL)
    assert roles["layers.1.attention.wk.kernel"] == ("k", COL)
    assert roles["layers.1.attention.wv.kernel"] == ("v", COL)
    assert roles["layers.1.attention.wo.kernel"] == ("o", ROW)
    assert (found.dims.heads, found.dims.kv_heads) == (4, ModelArgs().n_kv_heads or 4)


@pytest.mark.parametrize("cache", ["update_slice", "scatter"])
def test_a_cache_update_or_scatter_keeps_k_and_v(cache):
    form = Form("separate", 2, cache, False, "none", "gelu", "tuple", "rms", "embed", "separate", 2)
    model = nnx.eval_shape(lambda: FormModel(form, nnx.Rngs(0)))
    found = match_patterns(model, model.inputs())
    assert {found.role(f"blocks.0.attn.{n}.kernel") for n in "qkvo"} == {"q", "k", "v", "o"}
    assert found.dims.kv_heads == 2 and not found.replicated_in_blocks


class LearnedPositions(nnx.Module):
    """A learned position table as wide as it is long (max_len == width == 16)."""

    def __init__(self, rngs: nnx.Rngs):
        self.pos = nnx.Embed(16, 16, rngs=rngs)  # listed first, and square
        self.tokens = nnx.Embed(50, 16, rngs=rngs)
        self.q = nnx.Linear(16, 16, rngs=rngs)  # a dense 16 -> 16, as the table's rows
        self.o = nnx.Linear(16, 16, rngs=rngs)
        self.head = nnx.Linear(16, 50, rngs=rngs)

    def __call__(self, ids):
        x = self.tokens(ids) + self.pos(jnp.arange(ids.shape[1]))
        return self.head(x + self.o(nnx.relu(self.q(x))))


def test_the_token_embedding_is_the_table_the_inputs_index_not_a_square_position_table():
    found = match_patterns(LearnedPositions(nnx.Rngs(0)), jnp.zeros((2, 8), jnp.int32))
    assert found.role("tokens.embedding") == "embedding"
    assert found.role("pos.embedding") == "position_embedding"
    assert (found.dims.vocab, found.dims.width, found.tied_head) == (50, 16, False)
    assert found.role("head.kernel") == "head"


def test_the_nanogpt_style_head_is_found_although_its_position_table_is_square():
    from jfleet.testing.nnx_styles import STYLES

    style = STYLES["dropout"]  # wpe is MAX_SEQ x width = 32 x 32
    model = nnx.eval_shape(lambda: style.build(nnx.Rngs(0)))
    found = match_patterns(model, jnp.zeros((2, 8), jnp.int32))
    assert found.role("transformer.wte.embedding") == "embedding"
    assert found.role("lm_head.kernel") == "head" and found.dims.vocab == 64


def _form(**kw):
    base = dict(
        attn="separate", kv_heads=2, cache="none", bias=True, score_bias="none", mlp="gelu",
        ret="array", norm="rms", inputs="embed", head="separate", layers=2,
    )  # fmt: skip
    form = Form(**{**base, **kw})
    model = nnx.eval_shape(lambda: FormModel(form, nnx.Rngs(0)))
    return model, match_patterns(model, model.inputs(8))


def test_an_interleaved_gate_up_kernel_splits_contiguously_with_its_down_projection():
    _, found = _form(mlp="fused_strided")  # gate, up = h[..., ::2], h[..., 1::2]
    fused = "blocks.0.mlp.gate_up.kernel"
    assert (found.role(fused), found.spec(fused)) == ("gate_up", COL)
    assert found.role("blocks.0.mlp.down.kernel") == "down" and found.mlp == "swiglu"


def test_a_strided_qkv_kernel_splits_by_heads():
    _, found = _form(attn="fused_strided")  # q, k, v = h[..., 0::3], h[..., 1::3], ...
    info = {p.path: p for p in found.params}["blocks.1.attn.qkv.kernel"]
    assert (info.role, info.split_dim, info.units) == ("qkv", 1, 4)
    assert found.attention == "fused"


@pytest.mark.parametrize("score_bias", ["relative", "sinks"])
def test_an_attention_bias_table_joins_the_heads_split(score_bias):
    _, found = _form(score_bias=score_bias)
    assert {found.role(f"blocks.0.attn.{n}.kernel") for n in "qkvo"} == {"q", "k", "v", "o"}
    table = "rel.embedding" if score_bias == "relative" else "sinks"
    info = {p.path: p for p in found.params}[f"blocks.0.attn.{table}"]
    assert (info.split_dim, info.units) == (info.shape.index(4), 4)  # by the 4 query heads


def test_a_small_head_stays_whole_at_mp4_with_its_reason_in_the_plan():
    from jfleet.auto_parallel.search.planner import plan_for

    model, found = _form(inputs="features", head="small", kv_heads=4)  # a 16 x 10 classifier
    assert found.role("head.kernel") == "head" and 10 not in found.split_dims()
    mesh = {"dp": 2, "mp": 4}
    plan = plan_for(model, device_num=8, batch_size=8, seq_len=6, force_mesh=mesh, patterns=found)
    head = {p.path: p for p in plan.params}["head.kernel"]
    assert head.spec == P() and "mp=4 does not divide its 10" in head.replicated_why
    assert plan.spec("blocks.0.attn.q.kernel") == COL


class ScaledBlock(nnx.Module):
    """Reads ``scale`` in its call; ``layer_idx`` only bookkeeps."""

    def __init__(self, i: int, scale: float):
        self.layer_idx, self.scale = i, scale
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(i))

    def __call__(self, x):
        return self.linear(x) * self.scale


def test_blocks_differing_only_in_an_unread_attribute_are_one_stack():
    from jfleet.parallel.alike import block_period, first_difference
    from jfleet.testing.nnx_styles.beyond_lm import VisionTransformer

    vit = nnx.eval_shape(lambda: VisionTransformer(rngs=nnx.Rngs(0)))
    assert first_difference(vit.blocks[0], vit.blocks[1]) is None  # layer_idx 0 vs 1
    assert match_patterns(vit, jnp.zeros((2, 8, 8, 3))).block_period == 1
    same = [ScaledBlock(i, 2.0) for i in range(4)]
    assert block_period(same) == 1
    read = [ScaledBlock(i, float(i % 2)) for i in range(4)]  # scale is read: a real period
    assert block_period(read) == 2
    assert "scale" in first_difference(read[0], read[1])


class SlicedGateUp(nnx.Module):
    """A fused gate/up kernel ``[D, 2F]`` read as ``h[..., :F]`` / ``h[..., F:]``."""

    def __init__(self, rngs: nnx.Rngs):
        self.gate_up = nnx.Linear(16, 48, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(24, 16, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = self.gate_up(x)
        return self.down(nnx.silu(h[..., :24]) * h[..., 24:])


class SlicedBlocks(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(40, 16, rngs=rngs)
        self.blocks = nnx.List([SlicedGateUp(rngs) for _ in range(2)])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.embed.attend(x)


@pytest.mark.parametrize("read", ["jnp.split", "slices"])
def test_a_contiguous_fused_gate_up_stays_whole_naming_why_and_the_layout_that_splits(read):
    """Gate | up side by side: rank r would need columns r of both halves, which no
    PartitionSpec of a [D, 2F] kernel places; the pair stays whole with both reasons."""
    if read == "jnp.split":
        _, found = _form(mlp="fused")  # gate, up = jnp.split(h, 2, axis=-1)
        cut = "split into 2 contiguous parts"
    else:
        model = nnx.eval_shape(lambda: SlicedBlocks(nnx.Rngs(0)))
        found = match_patterns(model, jnp.zeros((2, 6), jnp.int32))
        cut = "contiguous slice [0:24] of 48"
    why = dict(found.replicated_in_blocks)
    fused, down = "blocks.0.mlp.gate_up.kernel", "blocks.0.mlp.down.kernel"
    if read == "slices":
        fused, down = "blocks.0.gate_up.kernel", "blocks.0.down.kernel"
    assert found.role(fused) is None and found.role(down) is None and found.mlp is None
    assert f"read in parts ({cut})" in why[fused] and "interleaved (h[..., ::2]" in why[fused]
    assert why[down].startswith(f"its input comes from {fused}, whose output is read in parts")


def test_forcing_mp_on_a_contiguous_gate_up_is_refused_naming_the_kernel_its_shape_and_why():
    model, found = _form(mlp="fused")
    from jfleet.auto_parallel.search.planner import plan_for

    with pytest.raises(ValueError, match=r"blocks\.0\.mlp\.gate_up\.kernel \[16x48\]: its output"):
        plan_for(model, device_num=8, batch_size=8, seq_len=6, force_mesh={"dp": 2, "mp": 4},
                 patterns=found)  # fmt: skip


def test_an_interleaved_linear_gate_up_trains_like_one_device_at_dp2_mp4():
    """The layout the refusal points to: the same fused nnx.Linear read h[..., ::2] /
    h[..., 1::2] splits with its down projection and trains like one device."""
    import numpy as np
    import optax

    from jfleet import make_train_step
    from jfleet.auto_parallel import ToDistributedConfig, get_plan, to_distributed
    from jfleet.testing import train_one_device
    from jfleet.testing.nnx_styles.registry import token_batches

    form = Form("separate", 2, "none", False, "none", "fused_strided", "array", "rms", "embed",
                "separate", 2)  # fmt: skip

    def loss_fn(model, batch):
        logits = model(jnp.asarray(batch["tokens"]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    batches = token_batches(10, seq=6, vocab=40)
    one = FormModel(form, nnx.Rngs(0))
    reference, _ = train_one_device(one, optax.adam(1e-2), batches, loss_fn)
    config = ToDistributedConfig(force_mesh={"dp": 2, "mp": 4})
    model, opt, loader = to_distributed(
        FormModel(form, nnx.Rngs(0)), optax.adam(1e-2), batches, config=config
    )
    plan = get_plan(model)
    assert plan.spec("blocks.0.mlp.gate_up.kernel") == COL
    assert plan.spec("blocks.1.mlp.down.kernel") == ROW
    step = make_train_step(loss_fn)
    losses = [float(step(model, opt, batch)) for batch in loader]
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-4, atol=1e-4)


def test_an_encoder_decoder_has_two_stacks_both_counted_and_no_pipeline_with_the_reason():
    from jfleet.auto_parallel.cost.layout import Workload
    from jfleet.auto_parallel.cost.step_work import layers_and_norms, tp_reductions
    from jfleet.auto_parallel.search.layouts import shape_problem
    from jfleet.testing.nnx_styles.beyond_lm import EncoderDecoder

    model = nnx.eval_shape(lambda: EncoderDecoder(rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((2, 8), jnp.int32)
    found = match_patterns(model, tokens, forward=lambda m, t: m(t, t))
    # both stacks, in the order the forward runs them (the tree lists decoder first)
    assert found.blocks == ("encoder.0", "encoder.1", "decoder.0", "decoder.1")
    assert [(len(p), c) for p, c in found.stacks] == [(2, "T5EncoderBlock"), (2, "T5DecoderBlock")]
    assert found.dims.layers == 4 and found.block_period is None
    assert "2 x T5EncoderBlock (encoder) + 2 x T5DecoderBlock (decoder)" in found.summary()
    roles = {p.path: (p.role, p.block) for p in found.params}
    assert roles["encoder.1.attn.o.kernel"] == ("o", 1)
    assert roles["decoder.0.cross_attn.k.kernel"] == ("k", 2)  # cross-attention paired
    assert roles["decoder.1.cross_attn.o.kernel"] == ("o", 3)
    # the cost model's per-block terms are the mean over both stacks: an encoder block has
    # 2 split rows (attn.o, mlp.wo) and 4 columns (q, k, v, wi); a decoder block 3 rows
    # (self o, cross o, wo) and 7 columns: (2 x 2 + 2 x 3) / 4, (2 x 4 + 2 x 7) / 4
    assert tp_reductions(found, 4) == (2.5, 5.5)
    assert layers_and_norms(found) == (4, 2)  # (2 x 2 + 2 x 3) / 4 = 2.5 norms, rounded
    why = shape_problem(found, Workload(batch_size=8, seq_len=8), {"dp": 4, "pp": 2}, 8)
    assert why == (
        "the model has 2 block stacks (encoder: 2 x T5EncoderBlock, decoder: 2 x "
        "T5DecoderBlock); a pipeline runs one stack of alike blocks, so a model with several "
        "runs with pp=1"
    )


def test_an_mlp_of_experts_is_described_with_their_count_and_a_plain_one_without():
    _, found = _form(mlp="experts")  # w_out [E, F, D] contracted batch-wise over E = 3
    assert found.dims.experts == 3 and "mlp gelu (hidden 24, 3 experts)" in found.summary()
    _, plain = _form(mlp="gelu")
    assert plain.dims.experts == 0 and "mlp gelu (hidden 24)," in plain.summary()

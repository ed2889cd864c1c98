"""Pattern matching: roles, dims, blocks and what is left unmatched, on five architectures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel.match.patterns import match_patterns
from jfleet.models import TinyLM
from jfleet.models.gpt2 import TinyGPT2
from jfleet.models.llama import TinyLlama
from jfleet.models.parallel_gpt import TinyGPT
from tests.auto_parallel.conv_net import CONV_NET_PATHS, ConvNet

COL, ROW, VOCAB, REP = P(None, "mp"), P("mp", None), P("mp", None), P()


def shapes(build, *args, **kwargs):
    """The model's shapes only (``nnx.eval_shape``): matching never needs values."""
    return nnx.eval_shape(lambda: build(*args, **kwargs))


def _roles(found, prefix: str) -> dict[str, tuple[str | None, P]]:
    return {
        p.path[len(prefix) :]: (p.role, p.spec) for p in found.params if p.path.startswith(prefix)
    }


def test_llama_with_grouped_query_heads():
    found = match_patterns(shapes(TinyLlama, vocab=64, width=32, heads=4, kv_heads=2, layers=3))
    assert (found.attention, found.mlp, found.norm, found.tied_head) == (
        "separate",
        "swiglu",
        "rmsnorm",
        False,
    )
    d = found.dims
    assert (d.vocab, d.width, d.heads, d.kv_heads, d.head_dim, d.hidden, d.layers) == (
        64, 32, 4, 2, 8, 64, 3,
    )  # fmt: skip
    assert found.blocks == ("layers.0", "layers.1", "layers.2")
    assert found.block_class == "LlamaDecoderLayer"
    assert _roles(found, "layers.1.") == {
        "input_layernorm.scale": ("norm", REP),
        "post_attention_layernorm.scale": ("norm", REP),
        "self_attn.q_proj.kernel": ("q", COL),
        "self_attn.k_proj.kernel": ("k", COL),
        "self_attn.v_proj.kernel": ("v", COL),
        "self_attn.o_proj.kernel": ("o", ROW),
        "mlp.gate_proj.kernel": ("gate", COL),
        "mlp.up_proj.kernel": ("up", COL),
        "mlp.down_proj.kernel": ("down", ROW),
    }
    assert found.role("embed_tokens.embedding") == "embedding"
    assert found.spec("embed_tokens.embedding") == VOCAB
    assert (found.role("lm_head"), found.spec("lm_head")) == ("head", COL)  # a bare [H, V] Param
    assert found.role("norm.scale") == "norm"
    assert found.unmatched == () and found.recognised
    assert {p.block for p in found.params if p.path.startswith("layers.2.")} == {2}


def test_gpt2_fused_qkv_with_bias_and_tied_head():
    found = match_patterns(shapes(TinyGPT2, vocab=64, width=32, heads=4, layers=2))
    assert (found.attention, found.mlp, found.norm, found.tied_head) == (
        "fused",
        "gelu",
        "layernorm",
        True,
    )
    assert found.has_attention_bias
    assert (found.dims.heads, found.dims.kv_heads, found.dims.hidden) == (4, 4, 128)
    assert _roles(found, "h.0.") == {
        "ln_1.scale": ("norm", REP),
        "ln_1.bias": ("norm", REP),
        "ln_2.scale": ("norm", REP),
        "ln_2.bias": ("norm", REP),
        "attn.c_attn.kernel": ("qkv", COL),
        "attn.c_attn.bias": ("qkv", P("mp")),
        "attn.c_proj.kernel": ("o", ROW),
        "attn.c_proj.bias": ("o", REP),
        "mlp.c_fc.kernel": ("up", COL),
        "mlp.c_fc.bias": ("up", P("mp")),
        "mlp.c_proj.kernel": ("down", ROW),
        "mlp.c_proj.bias": ("down", REP),
    }
    # the token table is the one the (tied) head produces; the position table stays replicated
    assert (found.role("wte.embedding"), found.spec("wte.embedding")) == ("embedding", VOCAB)
    assert (found.role("wpe.embedding"), found.spec("wpe.embedding")) == (
        "position_embedding",
        REP,
    )
    assert found.unmatched == ()


def test_tiny_gpt_fused_qkv_and_separate_head():
    found = match_patterns(shapes(TinyGPT, vocab=64, width=32, heads=4, layers=2))
    assert (found.attention, found.mlp, found.tied_head, found.dims.heads) == (
        "fused",
        "gelu",
        False,
        4,
    )
    assert (found.role("blocks.0.attn.qkv.kernel"), found.role("blocks.0.attn.o.kernel")) == (
        "qkv",
        "o",
    )
    assert (found.role("head.kernel"), found.spec("head.kernel")) == ("head", COL)
    assert found.unmatched == ()


def test_tiny_lm_is_mlp_blocks_only():
    found = match_patterns(shapes(TinyLM))
    assert (found.attention, found.mlp, found.dims.layers) == (None, "gelu", 2)
    assert _roles(found, "blocks.0.") == {
        "norm.scale": ("norm", REP),
        "norm.bias": ("norm", REP),
        "up.kernel": ("up", COL),
        "up.bias": ("up", P("mp")),
        "down.kernel": ("down", ROW),
        "down.bias": ("down", REP),
    }
    assert (found.spec("head.kernel"), found.spec("head.bias")) == (COL, P("mp"))
    assert found.unmatched == ()


def test_conv_net_is_reported_unmatched():
    found = match_patterns(shapes(ConvNet))
    assert not found.recognised
    assert set(found.unmatched) == CONV_NET_PATHS
    assert all(p.spec == REP for p in found.params)
    assert (found.attention, found.mlp, found.blocks, found.tied_head) == (None, None, (), None)


# ------------------------------------------------------------------ structure over names
class OpaqueAttention(nnx.Module):
    """Multi-head attention whose four width x width projections have meaningless names."""

    def __init__(self, width, heads, *, rngs, call_needs_mask=False):
        self.n = heads  # not a recognised attribute name: heads come from the trace
        self.needs_mask = call_needs_mask
        self.a = nnx.Linear(width, width, rngs=rngs)  # output projection
        self.b = nnx.Linear(width, width, rngs=rngs)  # q
        self.c = nnx.Linear(width, width, rngs=rngs)  # k
        self.d = nnx.Linear(width, width, rngs=rngs)  # v

    def _attend(self, x):
        bsz, s, w = x.shape
        q, k, v = (f(x).reshape(bsz, s, self.n, w // self.n) for f in (self.b, self.c, self.d))
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        return self.a(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(bsz, s, w))

    def __call__(self, x, *rest):
        if self.needs_mask and not rest:
            raise TypeError("mask required")
        return self._attend(x)


class OpaqueModel(nnx.Module):
    def __init__(self, call_needs_mask=False):
        rngs = nnx.Rngs(0)
        self.tok = nnx.Embed(50, 16, rngs=rngs)
        self.mix = nnx.List(
            [OpaqueAttention(16, 4, rngs=rngs, call_needs_mask=call_needs_mask) for _ in range(2)]
        )

    def __call__(self, t):
        x = self.tok(t)
        for m in self.mix:
            x = x + m(x)
        return self.tok.attend(x)


def test_output_projection_and_heads_come_from_the_dataflow_not_the_names():
    found = match_patterns(shapes(OpaqueModel))
    assert (found.attention, found.dims.heads, found.dims.kv_heads) == ("separate", 4, 4)
    roles = _roles(found, "mix.0.")
    assert roles["a.kernel"] == ("o", ROW)
    assert {roles[f"{n}.kernel"][0] for n in "bcd"} == {"q", "k", "v"}
    assert roles["a.bias"] == ("o", REP) and roles["b.bias"][1] == P("mp")


def test_an_untraceable_ambiguous_attention_stays_replicated_with_a_note():
    found = match_patterns(shapes(OpaqueModel, call_needs_mask=True))
    assert found.attention is None
    assert "mix.0.a.kernel" in found.unmatched
    assert any("was not traced" in n and "forward" in n for n in found.notes)


class HFLayoutAttention(nnx.Module):
    """A fused qkv laid out [3, heads, head_dim]: a contiguous split would cut across q/k/v."""

    def __init__(self, width, heads, *, rngs):
        self.num_heads = heads
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.proj = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        bsz, s, w = x.shape
        qkv = self.qkv(x).reshape(bsz, s, 3, self.num_heads, w // self.num_heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        return self.proj(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(bsz, s, w))


def test_fused_qkv_in_the_hugging_face_layout_is_not_split():
    class M(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.emb = nnx.Embed(40, 16, rngs=rngs)
            self.attn = HFLayoutAttention(16, 4, rngs=rngs)

        def __call__(self, t):
            return self.emb.attend(self.attn(self.emb(t)))

    found = match_patterns(shapes(M))
    assert found.role("attn.qkv.kernel") is None and found.spec("attn.qkv.kernel") == REP
    assert any("attn.qkv.kernel" in n and "[3, heads, head_dim]" in n for n in found.notes)
    assert found.role("emb.embedding") == "embedding"


def test_no_parameters_and_not_a_module_are_errors():
    class Empty(nnx.Module):
        def __call__(self, x):
            return x

    with pytest.raises(ValueError, match="Empty has no nnx.Param"):
        match_patterns(Empty())
    with pytest.raises(TypeError, match="not an nnx.Module"):
        match_patterns({"w": jnp.ones(3)})


def test_a_concrete_model_matches_like_its_shapes():
    model = TinyLlama(vocab=64, width=16, heads=4, kv_heads=2, layers=2)
    assert match_patterns(model) == match_patterns(
        shapes(TinyLlama, vocab=64, width=16, heads=4, kv_heads=2, layers=2)
    )


class FusedGQA(nnx.Module):
    """A fused qkv under grouped-query attention, laid out per kv group: [kv, group + 2, d]."""

    def __init__(self, width, heads, kv_heads, *, rngs):
        self.h, self.kv, self.d = heads, kv_heads, width // heads
        self.wqkv = nnx.Linear(width, width + 2 * kv_heads * self.d, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(width, width, use_bias=False, rngs=rngs)

    def __call__(self, x):
        bsz, s, w = x.shape
        group = self.h // self.kv
        qkv = self.wqkv(x).reshape(bsz, s, self.kv, group + 2, self.d)
        q = qkv[..., :group, :].reshape(bsz, s, self.h, self.d)
        k = jnp.repeat(qkv[..., group, :], group, axis=2)
        v = jnp.repeat(qkv[..., group + 1, :], group, axis=2)
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        return self.wo(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(bsz, s, w))


def test_fused_grouped_query_heads_come_from_the_per_group_reshape():
    class M(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.emb = nnx.Embed(40, 32, rngs=rngs)
            self.attn = FusedGQA(32, 4, 2, rngs=rngs)

        def __call__(self, t):
            return self.emb.attend(self.attn(self.emb(t)))

    found = match_patterns(shapes(M))
    assert (found.attention, found.dims.heads, found.dims.kv_heads, found.dims.head_dim) == (
        "fused",
        4,
        2,
        8,
    )
    assert found.role("attn.wqkv.kernel") == "qkv" and found.role("attn.wo.kernel") == "o"
    assert found.notes == ()


class ScannedMLP(nnx.Module):
    """MaxText-style: every layer's weights stacked ``[layers, ...]`` and run by a scan."""

    def __init__(self, layers: int = 3, width: int = 16, hidden: int = 32):
        rngs = nnx.Rngs(0)
        init = nnx.initializers.lecun_normal()
        self.embed = nnx.Embed(64, width, rngs=rngs)
        self.up = nnx.Param(init(rngs.params(), (layers, width, hidden)))
        self.down = nnx.Param(init(rngs.params(), (layers, hidden, width)))

    def __call__(self, tokens):
        def layer(x, weights):
            up, down = weights
            return x + jax.nn.gelu(x @ up) @ down, None

        x, _ = jax.lax.scan(layer, self.embed(tokens), (self.up[...], self.down[...]))
        return self.embed.attend(x)


def test_a_model_scanned_over_stacked_layers_is_paired_past_the_layer_dim():
    found = match_patterns(shapes(ScannedMLP))
    assert (found.role("up"), found.spec("up")) == ("up", P(None, None, "mp"))
    assert (found.role("down"), found.spec("down")) == ("down", P(None, "mp", None))
    assert (found.mlp, found.dims.hidden) == ("gelu", 32)
    # every layer's products are counted: 3 trips of two [2 x 8 tokens] x 16 x 32 matmuls,
    # plus the tied head's 16 x 64
    per_layer = 2 * (2 * 8) * 16 * 32 * 2
    assert sum(d.flops for d in found.dots) == 3 * per_layer + 2 * (2 * 8) * 16 * 64

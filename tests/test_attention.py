"""The reference models' attention (issue 37, item 5): ``jax.nn.dot_product_attention`` with the
implementation chosen by platform gives the hand-written attention's numbers on CPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfleet.models import attention as attention_mod
from jfleet.models import gpt2, llama, parallel_gpt
from jfleet.models.attention import (
    attention_implementation,
    causal_attention,
    reference_attention,
)
from jfleet.models.gpt2 import TinyGPT2
from jfleet.models.llama import TinyLlama
from jfleet.models.parallel_gpt import TinyGPT


def _qkv(dtype, kv_heads, heads=4, seq=16, head_dim=8):
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(kq, (2, seq, heads, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (2, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (2, seq, kv_heads, head_dim), jnp.float32).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_equals_the_hand_written_attention_on_cpu(dtype, kv_heads):
    q, k, v = _qkv(dtype, kv_heads)
    got = jax.jit(causal_attention)(q, k, v)
    want = jax.jit(reference_attention)(q, k, v)
    assert got.dtype == want.dtype == dtype and got.shape == q.shape
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    else:  # XLA keeps the scores in fp32 (the old code rounded them to bf16 first): 1 ulp
        np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7)


def test_gradients_equal_the_hand_written_attention():
    q, k, v = _qkv(jnp.float32, 2)

    def grads(f):
        return jax.jit(jax.grad(lambda *a: (f(*a) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)

    for g, w in zip(grads(causal_attention), grads(reference_attention), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def _hand_written(monkeypatch):
    for mod in (llama, gpt2, parallel_gpt):
        monkeypatch.setattr(mod, "causal_attention", reference_attention)


@pytest.mark.parametrize(
    "build",
    [
        lambda: TinyLlama(vocab=64, width=32, heads=4, kv_heads=2, layers=2),
        lambda: TinyGPT2(vocab=64, width=32, heads=4, layers=2),
        lambda: TinyGPT(vocab=64, width=32, heads=4, layers=2),
    ],
    ids=["llama_gqa", "gpt2", "gpt"],
)
def test_models_keep_their_numbers(build, monkeypatch):
    """The models' logits equal the hand-written attention's (same seed, same params)."""
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    model = build()
    got = np.asarray(model(tokens))
    _hand_written(monkeypatch)
    want = np.asarray(build()(tokens))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_models_call_the_platform_attention(monkeypatch):
    """Each reference model's attention goes through causal_attention (not an inline copy)."""
    calls = []

    def counting(q, k, v, **kw):
        calls.append(q.shape)
        return reference_attention(q, k, v)

    for mod in (llama, gpt2, parallel_gpt):
        monkeypatch.setattr(mod, "causal_attention", counting)
    tokens = jnp.zeros((1, 8), jnp.int32)
    for model in (TinyLlama(layers=2), TinyGPT2(layers=2), TinyGPT(layers=2)):
        model(tokens)
    assert len(calls) == 6


def test_seed_initialisation_is_unchanged():
    """The parameters of seed 0 (pinned from before the attention change)."""

    def total(model):
        leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
        return sum(float(jnp.abs(x).sum()) for x in leaves), len(leaves)

    assert total(TinyLlama(kv_heads=2)) == pytest.approx(LLAMA_SEED0, rel=1e-6)
    assert total(TinyGPT2()) == pytest.approx(GPT2_SEED0, rel=1e-6)


#: ``total(...)`` of seed 0 at the commit before the change (sum of |params|, leaf count).
LLAMA_SEED0 = (3237.0984420776367, 21)
GPT2_SEED0 = (3698.744659423828, 28)


def test_implementation_by_platform_dtype_and_head_dim():
    assert attention_implementation("gpu", "bfloat16", 128) == "cudnn"
    assert attention_implementation("cuda", jnp.float16, 64) == "cudnn"
    assert attention_implementation("gpu", "float32", 128) == "xla"  # cuDNN refuses fp32
    assert attention_implementation("gpu", "bfloat16", 160, max_head_dim=128) == "xla"
    assert attention_implementation("gpu", "bfloat16", 12) == "xla"  # not a multiple of 8
    assert attention_implementation("cpu", "bfloat16", 128) == "xla"
    assert attention_implementation("tpu", "bfloat16", 128) == "xla"


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="platform='metal'"):
        attention_implementation("metal", "bfloat16", 128)
    with pytest.raises(ValueError, match="head_dim=0"):
        attention_implementation("gpu", "bfloat16", 0)
    q, k, v = _qkv(jnp.float32, 3, heads=4)
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        causal_attention(q, k, v)
    with pytest.raises(ValueError, match="expected q"):
        causal_attention(q[0], k, v)
    q, k, v = _qkv(jnp.float32, 2)
    with pytest.raises(ValueError, match="implementation='flash'"):
        causal_attention(q, k, v, implementation="flash")


def test_cpu_runs_the_xla_implementation_in_the_marked_scope():
    q, k, v = _qkv(jnp.float32, 2)
    jaxpr = jax.make_jaxpr(causal_attention)(q, k, v)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2  # scores and values: XLA's implementation (materialised)
    assert all(attention_mod.PLATFORM_ATTENTION in str(e.source_info.name_stack) for e in dots)

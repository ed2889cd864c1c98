"""remat_class: the one class swap behind apply_recompute and to_distributed's block wrapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfleet.recompute import apply_recompute, is_recomputed, remat_class


class Flagged(nnx.Module):
    """A block whose call takes an array argument and a Python flag that steers control flow."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x, bias, *, deterministic=False):
        if not deterministic:  # a traced flag would raise here
            x = 2 * x
        return jnp.tanh(self.linear(x) + bias)


def grads_and_jaxpr(module, x, bias):
    graphdef, state = nnx.split(module)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, bias, deterministic=True) ** 2)

    grads = jax.grad(loss, argnums=(0, 1))
    return grads(state, x), str(jax.make_jaxpr(grads)(state, x))


def test_remat_class_recomputes_arrays_keeps_flags_static_and_caches():
    x, bias = jnp.ones((2, 3)), jnp.full((3,), 0.5)
    plain = Flagged(rngs=nnx.Rngs(0))
    want, jaxpr = grads_and_jaxpr(plain, x, bias)
    assert "remat" not in jaxpr and not is_recomputed(plain)

    module = Flagged(rngs=nnx.Rngs(0))
    module.__class__ = remat_class(Flagged)
    assert remat_class(Flagged) is type(module)  # one subclass per setting
    assert type(module).__name__ == "Flagged" and isinstance(module, Flagged)
    assert type(module).__qualname__ == Flagged.__qualname__ and is_recomputed(module)
    got, jaxpr = grads_and_jaxpr(module, x, bias)
    assert jaxpr.count("remat2[") == 1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_after_tag_and_a_subclass_without_recompute():
    def double(y):
        return 2 * y

    x, bias = jnp.ones((2, 3)), jnp.zeros((3,))
    module = Flagged(rngs=nnx.Rngs(0))
    want = 2 * module(x, bias, deterministic=True)
    module.__class__ = remat_class(Flagged, after=double, recompute=False, tag="to_distributed")
    assert type(module).__qualname__ == "Flagged[to_distributed]"
    assert not is_recomputed(module)
    np.testing.assert_allclose(module(x, bias, deterministic=True), want)
    assert remat_class(Flagged, after=double) is not remat_class(Flagged)


def test_apply_recompute_marks_modules_once_and_refuses_bad_settings():
    class Net(nnx.Module):
        def __init__(self):
            self.block = Flagged(rngs=nnx.Rngs(0))

    net = apply_recompute(apply_recompute(Net(), ["block"]), ["Flagged"])
    assert is_recomputed(net.block) and type(net.block).__mro__[1] is Flagged
    with pytest.raises(ValueError, match=r"policy='everything' is not a checkpoint policy"):
        remat_class(Flagged, policy="everything")
    with pytest.raises(TypeError, match=r"must be an nnx.Module subclass"):
        remat_class(int)

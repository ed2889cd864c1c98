"""remat_class: the one class swap behind apply_recompute and to_distributed's block wrapping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jfleet.parallel import recompute as recompute_module
from jfleet.parallel.recompute import (
    apply_recompute,
    is_in_recompute,
    is_recomputed,
    module_paths,
    recompute,
    recompute_hybrid,
    recompute_sequential,
    remat_class,
)


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


# ------------------------------------------------ Paddle's functional recompute (issue 12)
class DropBlock(nnx.Module):
    """Linear then dropout: recompute must replay the same mask in the backward pass."""

    def __init__(self, seed: int = 0):
        self.linear = nnx.Linear(4, 4, rngs=nnx.Rngs(seed))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(seed + 1))

    def __call__(self, x):
        return jnp.tanh(self.drop(self.linear(x)))


def value_grad_jaxpr(loss, model, x):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def pure(params, rest, x):
        return loss(nnx.merge(graphdef, params, rest, copy=True), x)

    f = jax.value_and_grad(pure)
    return f(params, rest, x), str(jax.make_jaxpr(f)(params, rest, x))


def test_functional_recompute_equals_the_plain_call_and_checkpoints(caplog, monkeypatch):
    monkeypatch.setattr(recompute_module, "_LOGGED", set())  # logged once per process
    x = jnp.arange(12.0).reshape(3, 4) / 10
    plain = lambda m, x: jnp.sum(m(x) ** 2)  # noqa: E731
    as_module = lambda m, x: jnp.sum(recompute(m, x, use_reentrant=False) ** 2)  # noqa: E731
    as_function = lambda m, x: jnp.sum(recompute(lambda h: m.linear(h) * 2, x) ** 2)  # noqa: E731
    want, jaxpr = value_grad_jaxpr(plain, DropBlock(), x)
    assert "remat" not in jaxpr
    with caplog.at_level("INFO", logger="jfleet"):
        got, jaxpr = value_grad_jaxpr(as_module, DropBlock(), x)
    assert jaxpr.count("remat2[") == 1  # the checkpoint is in the program
    assert "use_reentrant=False" in caplog.text and "no effect under JAX" in caplog.text
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)  # same dropout mask when recomputed
    # a function closing over a module: value and gradient of 2 * linear(x)
    (value, grads), jaxpr = value_grad_jaxpr(as_function, DropBlock(), x)
    assert jaxpr.count("remat2[") == 1
    ref = DropBlock().linear
    np.testing.assert_allclose(value, jnp.sum((2 * ref(x)) ** 2), rtol=1e-6)
    y = 2 * ref(x)
    np.testing.assert_allclose(grads["linear"]["kernel"][...], x.T @ (2 * y * 2), rtol=1e-5)


def test_recompute_sequential_checkpoints_all_segments_but_the_last():
    class Chain(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([nnx.Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(5)])

    x = jnp.ones((2, 4))
    seen = []

    def probe(h):
        seen.append(is_in_recompute())
        return h

    def plain(m, x):
        for layer in m.layers:
            x = layer(x)
        return jnp.sum(x**2)

    def segmented(m, x):
        return jnp.sum(recompute_sequential({"segments": 2}, m.layers, x) ** 2)

    want, _ = value_grad_jaxpr(plain, Chain(), x)
    got, jaxpr = value_grad_jaxpr(segmented, Chain(), x)
    assert jaxpr.count("remat2[") == 1
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)

    # 5 callables in 3 segments of 1: the first two recomputed, the last three not
    def chain(m, x):
        layers = nnx.Sequential(probe, *m.layers[:3], probe)
        return jnp.sum(recompute_sequential({"segments": 3}, layers, x))

    _, jaxpr = value_grad_jaxpr(chain, Chain(), x)
    assert jaxpr.count("remat2[") == 2 and seen[-2:] == [True, False]


def test_checkpoint_names_match_an_alias_path():
    class Tied(nnx.Module):
        def __init__(self):
            self.embed = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.head = self.embed  # the same module under a second attribute

    net = apply_recompute(Tied(), ["head"])
    assert is_recomputed(net.embed)
    assert [p for p, _ in module_paths(net)] == ["", "embed", "head"]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: recompute(3, 1.0), TypeError, r"function=3\): int is not callable"),
        (
            lambda: recompute(jnp.tanh, 1.0, preserve_rng_state="yes"),
            TypeError,
            r"preserve_rng_state='yes' \(str\) must be True or False",
        ),
        (
            lambda: recompute(jnp.tanh, 1.0, offload_indices=[0.5]),
            TypeError,
            r"offload_indices=\[0.5\] must be a list of argument indices",
        ),
        (
            lambda: recompute_sequential([2], [jnp.tanh], 1.0),
            TypeError,
            r"ctx=\[2\]\): ctx must be a dict",
        ),
        (
            lambda: recompute_sequential({"segment": 2}, [jnp.tanh], 1.0),
            ValueError,
            r"ctx keys \['segment'\] are unknown; valid keys: \['segments'",
        ),
        (
            lambda: recompute_sequential({"segments": 3}, [jnp.tanh, jnp.tanh], 1.0),
            ValueError,
            r"ctx\['segments'\]=3 must be an int in \[1, 2\]",
        ),
        (
            lambda: recompute_sequential({}, "tanh", 1.0),
            TypeError,
            r"functions='tanh'\): expected a list of layers",
        ),
        (
            lambda: recompute_hybrid({"offload": False, "mp": 1}, jnp.tanh, 1.0),
            ValueError,
            r"recompute_hybrid: ctx keys \['mp'\] are unknown",
        ),
    ],
)
def test_functional_recompute_bad_arguments_name_the_value(call, error, match):
    with pytest.raises(error, match=match):
        call()

"""Expert-parallel MoE dispatch and combine in ``shard_map`` against one device (issue 39).

The reference below is written plainly for one device, with no buffers and no
collectives: every (token, choice) runs its expert's kernels gathered per token, and the
capacity rule is applied per token group (the tokens one device holds in the sharded run).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.parallel.moe import (
    ExpertWeights,
    assign_slots,
    exchange,
    expert_capacity,
    load_balancing_loss,
    moe,
    router_z_loss,
)
from jfleet.testing import hlo
from jfleet.testing.trees import assert_trees_close

D, F, E, T, K = 16, 32, 8, 64, 2
EP = "ep"


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(shape), names)


LAYOUTS = {
    "dp2xep4": ((2, 4), ("dp", EP)),
    "ep8": ((8,), (EP,)),
    "ep4xdp2": ((4, 2), (EP, "dp")),
}


def make_inputs(gated: bool = False, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (T, D), jnp.float32)
    router = jax.random.normal(keys[1], (D, E), jnp.float32) * 0.5
    weights = ExpertWeights(
        jax.random.normal(keys[2], (E, D, F), jnp.float32) / math.sqrt(D),
        jax.random.normal(keys[3], (E, F, D), jnp.float32) / math.sqrt(F),
        jax.random.normal(keys[4], (E, D, F), jnp.float32) / math.sqrt(D) if gated else None,
    )
    cotangent = jax.random.normal(keys[5], (T, D), jnp.float32)
    return x, router, weights, cotangent


def reference(x, router, weights, *, k, groups, capacity_factor, normalize=True):
    """One device, loop-free: the same routing and capacity rule, no buffers."""
    tokens, _ = x.shape
    per_group = tokens // groups
    logits = x @ router
    probs = jax.nn.softmax(logits, axis=-1)
    top, experts = jax.lax.top_k(probs, k)
    combine = top / top.sum(-1, keepdims=True) if normalize else top
    if capacity_factor is None:
        capacity = per_group
    else:
        capacity = max(1, min(per_group, math.ceil(capacity_factor * per_group * k / E - 1e-9)))
    # GShard's priority inside each group: all first choices in token order, then seconds.
    by_choice = experts.reshape(groups, per_group, k).transpose(0, 2, 1).reshape(groups, -1)
    onehot = jax.nn.one_hot(by_choice, E, dtype=jnp.int32)
    position = ((jnp.cumsum(onehot, axis=1) - 1) * onehot).sum(-1)
    kept = (position < capacity).reshape(groups, k, per_group).transpose(0, 2, 1)
    kept = kept.reshape(tokens, k)
    w_in, w_out = weights.w_in[experts], weights.w_out[experts]  # [T, k, ...]
    hidden = jnp.einsum("td,tkdf->tkf", x, w_in)
    if weights.w_gate is None:
        hidden = jax.nn.silu(hidden)
    else:
        hidden = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, weights.w_gate[experts])) * hidden
    out = jnp.einsum("tkf,tkfd->tkd", hidden, w_out)
    y = jnp.sum(out * (combine * kept)[..., None], axis=1)
    chosen = jax.nn.one_hot(experts, E, dtype=jnp.int32)  # [T, k, E]
    routed = chosen.sum((0, 1))
    dropped = (chosen * (~kept)[..., None]).sum((0, 1))
    fraction = routed / (tokens * k)
    balance = E * jnp.sum(fraction * probs.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return y, (balance, z, routed, dropped, kept)


def objective(layer):
    """Loss = <y, cotangent> + aux losses; value, aux and gradients in one program."""

    def run(x, router, weights, cotangent):
        y, aux = layer(x, router, weights)
        loss = jnp.sum(y * cotangent) + 0.1 * aux[0] + 0.01 * aux[1]
        return loss, (y, aux)

    return jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2), has_aux=True))


def place(mesh, token_axes, x, router, weights, cotangent):
    tokens = NamedSharding(mesh, P(token_axes))
    experts = NamedSharding(mesh, P(EP))
    return (
        jax.device_put(x, tokens),
        jax.device_put(router, NamedSharding(mesh, P())),
        jax.tree.map(lambda w: jax.device_put(w, experts), weights),
        jax.device_put(cotangent, tokens),
    )


def sharded_and_reference(layout, capacity_factor, *, normalize=True, gated=False, **kw):
    shape, names = LAYOUTS[layout]
    mesh = make_mesh(shape, names)
    x, router, weights, cotangent = make_inputs(gated)
    layer = lambda x, r, w: moe(  # noqa: E731
        x, r, w, mesh=mesh, k=K, capacity_factor=capacity_factor, normalize=normalize, **kw
    )
    got = objective(layer)(*place(mesh, names, x, router, weights, cotangent))
    return mesh, got, one_device(capacity_factor, normalize, gated)


@functools.cache
def one_device(capacity_factor, normalize: bool, gated: bool):
    """The reference's value, aux and gradients on the same inputs: one compile per rule
    (it depends on no layout; read only)."""
    x, router, weights, cotangent = make_inputs(gated)
    ref = lambda x, r, w: reference(  # noqa: E731
        x, r, w, k=K, groups=len(jax.devices()), capacity_factor=capacity_factor,
        normalize=normalize,
    )  # fmt: skip
    return objective(ref)(x, router, weights, cotangent)


def check_equal(got, want):
    (loss, (y, aux)), grads = got
    (ref_loss, (ref_y, ref_aux)), ref_grads = want
    assert_trees_close(y, ref_y, devices=8)
    assert_trees_close(loss, ref_loss, devices=8)
    assert_trees_close((aux.load_balancing_loss, aux.router_z_loss), ref_aux[:2], devices=8)
    np.testing.assert_array_equal(aux.routed, ref_aux[2])
    np.testing.assert_array_equal(aux.dropped, ref_aux[3])
    assert_trees_close(grads, ref_grads, devices=8)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "cf1"])
def test_sharded_moe_equals_one_device(layout, capacity_factor):
    mesh, got, want = sharded_and_reference(layout, capacity_factor)
    check_equal(got, want)
    dropped, kept = got[0][1][1].dropped, want[0][1][1][4]
    if capacity_factor is None:
        assert int(dropped.sum()) == 0
    else:  # the rule bites, and a token with every choice dropped comes out zero
        assert int(dropped.sum()) == int((~kept).sum()) > 0
        gone = np.flatnonzero(~np.asarray(kept).any(-1))
        np.testing.assert_array_equal(np.asarray(got[0][1][0])[gone], 0.0)
    # expert kernels and their gradients: E / ep experts per device
    ep = mesh.shape[EP]
    for w in jax.tree.leaves(got[1][2]):
        assert {s.data.shape[0] for s in w.addressable_shards} == {E // ep}


def test_drop_order_is_gshards_first_choices_first():
    slots = assign_slots(jnp.array([[1, 0], [0, 2], [0, 1]]), 3, 2)
    # choice-major: t0c0 t1c0 t2c0 t0c1 t1c1 t2c1; expert 0 is full before t0's second choice
    assert slots.kept.tolist() == [True, True, True, False, True, True]
    assert slots.expert.tolist() == [1, 0, 0, 0, 2, 1]


def test_gated_experts_without_renormalisation_equal_one_device():
    """GShard's weights (top-k probabilities as they are), SwiGLU experts."""
    _, got, want = sharded_and_reference("dp2xep4", 1.25, normalize=False, gated=True)
    check_equal(got, want)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "cf1"])
def test_ragged_dot_compute_equals_einsum(capacity_factor):
    _, got, want = sharded_and_reference("dp2xep4", capacity_factor, compute="ragged_dot")
    check_equal(got, want)
    _, einsum, _ = sharded_and_reference("dp2xep4", capacity_factor, compute="einsum")
    assert_trees_close(got, einsum, devices=1)
    assert "ragged_dot" in traced("dp2xep4", compute="ragged_dot")
    assert "ragged_dot" not in traced("dp2xep4", compute="einsum")


def traced(layout, **kw) -> str:
    """The jaxpr of a layer's forward, as text."""
    mesh = make_mesh(*LAYOUTS[layout])
    x, router, weights, _ = make_inputs()
    layer = lambda x, r, w: moe(x, r, w, mesh=mesh, k=K, **kw)  # noqa: E731
    return str(jax.make_jaxpr(layer)(x, router, weights))


def emulated_ragged_all_to_all(ep: int, calls: list[str]):
    """``ragged_all_to_all`` from an all-gather, for XLA:CPU, which lacks the collective;
    each trace of it appends the axis name to ``calls``."""

    def collective(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                   axis_name):  # fmt: skip
        everyone = [
            jax.lax.all_gather(a, axis_name)
            for a in (operand, input_offsets, send_sizes, output_offsets)
        ]
        rows, starts, sizes, lands = everyone
        calls.append(axis_name)
        me = jax.lax.axis_index(axis_name)
        i = jnp.arange(output.shape[0])
        result = output
        for s in range(ep):
            land, size, start = lands[s, me], sizes[s, me], starts[s, me]
            inside = (i >= land) & (i < land + size)
            taken = rows[s][jnp.clip(start + i - land, 0, operand.shape[0] - 1)]
            result = jnp.where(inside[:, None], taken, result)
        return result

    return collective


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "cf1"])
def test_ragged_path_with_an_emulated_collective_equals_one_device(monkeypatch, capacity_factor):
    """The GPU / TPU path's offsets and sorting, run on CPU through an emulated collective."""
    calls = []
    monkeypatch.setattr(exchange, "RAGGED_ALL_TO_ALL", emulated_ragged_all_to_all(4, calls))
    _, got, want = sharded_and_reference("dp2xep4", capacity_factor, path="ragged")
    check_equal(got, want)
    assert calls == [EP, EP]  # dispatch and combine, traced once


def test_the_ragged_path_lowers_to_ragged_all_to_alls():
    """XLA:CPU cannot compile it (jax#34755), but it lowers, gradient included: two per
    layer forward, two more (their transposes) in a training step."""
    mesh = make_mesh((2, 4), ("dp", EP))
    x, router, weights, cotangent = make_inputs()
    layer = lambda x, r, w: moe(x, r, w, mesh=mesh, k=K, path="ragged")  # noqa: E731
    text = jax.jit(layer).lower(x, router, weights).as_text()
    assert text.count("ragged_all_to_all") == 2
    step = objective(layer).lower(x, router, weights, cotangent).as_text()
    assert step.count("ragged_all_to_all") == 4


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "cf1"])
def test_two_all_to_alls_per_layer_forward(capacity_factor):
    mesh = make_mesh((2, 4), ("dp", EP))
    args = place(mesh, ("dp", EP), *make_inputs())
    layer = lambda x, r, w: moe(x, r, w, mesh=mesh, k=K, capacity_factor=capacity_factor)  # noqa: E731
    compiled = jax.jit(layer).lower(*args[:3]).compile()
    text = compiled.as_text()
    found = hlo.summarize(text)["all-to-all"]
    tokens = T // 8
    capacity = expert_capacity(tokens, K, E, capacity_factor)
    assert found.count == 2  # dispatch + combine
    assert found.bytes == 2 * E * capacity * D * 4  # [E, C, D] float32 each way, per device
    assert {c.group_size for c in hlo.collectives(text) if c.kind == "all-to-all"} == {4}
    # the expert kernels enter the program split over ep
    (_, _, experts), _ = compiled.input_shardings
    assert experts.w_in.shard_shape((E, D, F)) == (E // 4, D, F)
    assert experts.w_out.shard_shape((E, F, D)) == (E // 4, F, D)
    # a training step: the two transposes move the cotangents back the same way
    step = hlo.summarize(objective(layer).lower(*args).compile().as_text())["all-to-all"]
    assert (step.count, step.bytes) == (4, 2 * found.bytes)


def test_aux_losses_in_shard_map_equal_the_whole_batch():
    mesh = make_mesh((2, 4), ("dp", EP))
    logits = jax.random.normal(jax.random.key(3), (T, E)) * 2

    def losses(logits, axis_names=()):
        probs = jax.nn.softmax(logits, -1)
        experts = jax.lax.top_k(probs, K)[1]
        balance = load_balancing_loss(probs, experts, axis_names=axis_names)
        return balance + router_z_loss(logits, axis_names=axis_names)

    sharded = jax.shard_map(
        lambda z: losses(z, ("dp", EP)), mesh=mesh, in_specs=P(("dp", EP)), out_specs=P()
    )
    got = jax.jit(jax.value_and_grad(sharded))(logits)
    want = jax.jit(jax.value_and_grad(losses))(logits)
    assert_trees_close(got, want, devices=8)
    # one device's slice alone gives another value: the psums matter
    local = jax.jit(losses)(logits[: T // 8])
    assert abs(float(local) - float(want[0])) > 1e-3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k": 9}, r"k=9 experts per token cannot exceed the 8 experts; use 1 <= k <= 8"),
        ({"capacity_factor": 0.0}, r"capacity_factor=0.0 must be a positive number"),
        ({"capacity_factor": -1.0}, r"capacity_factor=-1.0 must be a positive number"),
        ({"experts": 6}, r"over ep=4; use a multiple of 4 experts"),
        ({"axis_name": "expert"}, r"axis_name='expert' is not an axis of the mesh"),
        ({"tokens": 60}, r"60 tokens do not split over the 8 devices"),
        ({"compute": "grouped"}, r"compute='grouped' is not an expert compute"),
        ({"path": "ring"}, r"path='ring' is not an exchange"),
    ],
)
def test_bad_input_is_refused_with_the_fix(change, message):
    mesh = make_mesh((2, 4), ("dp", EP))
    experts, tokens = change.pop("experts", E), change.pop("tokens", T)
    weights = ExpertWeights(jnp.zeros((experts, D, F)), jnp.zeros((experts, F, D)))
    kwargs = {"k": K, **change}
    with pytest.raises(ValueError, match=message):
        moe(jnp.zeros((tokens, D)), jnp.zeros((D, experts)), weights, mesh=mesh, **kwargs)

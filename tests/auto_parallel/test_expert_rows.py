"""A traced ``ragged_dot`` dispatch over ``ep`` (:mod:`jfleet.auto_parallel.apply.expert_rows`,
:mod:`jfleet.auto_parallel.match.ragged_rows`) on MoE blocks written here in the styles of
public code the repository's own styles do not cover: Hugging Face's Qwen2-MoE block (a
shared expert behind a sigmoid gate beside the routed ones, no top-k renormalisation) with
MaxText's ``sparse_matmul`` sort / ``take`` / ``ragged_dot`` dispatch; and one whose output
is not linear in its experts' rows, which the matcher keeps off ``ep`` and says why."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.auto_parallel import match_patterns
from jfleet.auto_parallel.apply.expert_rows import ring_ragged_experts
from jfleet.auto_parallel.search.planner import plan_for
from jfleet.testing import hlo

E, D, F, K = 8, 16, 8, 2
STACKS = ("experts_gate", "experts_up", "experts_down")


class SharedExpertMoeBlock(nnx.Module):
    """Qwen2-MoE's sparse block: ``gate`` routes each token to the top-2 of a softmax over 8
    experts (weights not renormalised), the expert stacks applied MaxText-style (copies
    sorted by expert with ``take``, ``ragged_dot`` per projection, unsorted, weighted), plus
    ``shared_expert(x) * sigmoid(shared_expert_gate(x))``. ``nonlinear_out``: a ``tanh`` on
    the routed experts' sum (what no ep rank can compute from its own rows)."""

    def __init__(self, *, rngs: nnx.Rngs, nonlinear_out: bool = False):
        init = nnx.initializers.normal(0.2)
        self.gate = nnx.Linear(D, E, use_bias=False, rngs=rngs)
        self.experts_gate = nnx.Param(init(rngs.params(), (E, D, F)))
        self.experts_up = nnx.Param(init(rngs.params(), (E, D, F)))
        self.experts_down = nnx.Param(init(rngs.params(), (E, F, D)))
        self.shared_expert = nnx.Dict(
            gate_proj=nnx.Linear(D, 2 * F, use_bias=False, rngs=rngs),
            up_proj=nnx.Linear(D, 2 * F, use_bias=False, rngs=rngs),
            down_proj=nnx.Linear(2 * F, D, use_bias=False, rngs=rngs),
        )
        self.shared_expert_gate = nnx.Linear(D, 1, use_bias=False, rngs=rngs)
        self.nonlinear_out = nonlinear_out

    def __call__(self, hidden_states: jax.Array) -> tuple[jax.Array, jax.Array]:
        b, s, _ = hidden_states.shape
        x = hidden_states.reshape(-1, D)
        router_logits = self.gate(x)
        weights, selected = jax.lax.top_k(jax.nn.softmax(router_logits, axis=-1), K)
        flat = selected.reshape(-1)
        sorted_indices = jnp.argsort(flat)
        group_size = jnp.bincount(flat, length=E)
        rows = jnp.take(x, sorted_indices // K, axis=0)
        layer_w0 = jax.lax.ragged_dot(rows, self.experts_gate[...], group_size)
        layer_w1 = jax.lax.ragged_dot(rows, self.experts_up[...], group_size)
        intermediate = jax.nn.silu(layer_w0) * layer_w1
        out = jax.lax.ragged_dot(intermediate, self.experts_down[...], group_size)
        out = jnp.take(out, jnp.argsort(sorted_indices), axis=0).reshape(-1, K, D)
        routed = jnp.einsum("tkd,tk->td", out, weights)
        if self.nonlinear_out:
            routed = jnp.tanh(routed)
        shared = self.shared_expert["down_proj"](
            nnx.silu(self.shared_expert["gate_proj"](x)) * self.shared_expert["up_proj"](x)
        )
        y = routed + jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
        return y.reshape(b, s, D), router_logits


def _loss(block: nnx.Module, x: jax.Array) -> jax.Array:
    y, logits = block(x)
    return jnp.sum(y**2) + jnp.sum(jnp.sin(logits))


def _mesh(shape: dict[str, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("shape", [{"dp": 2, "ep": 4}, {"ep": 4, "mp": 2}])
def test_a_shared_expert_beside_ragged_experts_runs_over_ep_like_one_device(shape):
    """The shared expert's output is the same on every ep rank (it sees the gathered tokens)
    and is added to the routed experts' partial sums once (on rank 0); values and every
    gradient equal one device's, each rank holds 2 of the 8 experts, and the compiled step
    moves the tokens (all-gathered, reduce-scattered over ep) and never an expert stack."""
    x = jax.random.normal(jax.random.key(1), (8, 4, D))
    block = SharedExpertMoeBlock(rngs=nnx.Rngs(0))
    grad = nnx.jit(nnx.value_and_grad(_loss))
    want_loss, want_grads = grad(block, x)
    mesh = _mesh(shape)
    ring_ragged_experts(_Holder(block), ["block"], mesh, STACKS)
    for name in STACKS:
        param = getattr(block, name)
        param[...] = jax.device_put(param[...], NamedSharding(mesh, P("ep")))
    data = tuple(a for a in ("dp", "ep") if a in shape)
    xs = jax.device_put(x, NamedSharding(mesh, P(data)))
    loss, grads = grad(block, xs)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    chex.assert_trees_all_close(nnx.state(grads), nnx.state(want_grads), rtol=1e-5, atol=1e-6)
    assert block.experts_down[...].addressable_shards[0].data.shape[0] == 2
    found = hlo.collectives(grad.lower(block, xs).compile().as_text())
    # the ep group's 8 / dp x 4 tokens of width 16, fp32: the input and the output's
    # cotangent gathered, the output scattered (and the input's cotangent where x is
    # differentiated: not here)
    tokens = 8 // shape.get("dp", 1) * 4 * D * 4
    ring = [(c.kind, c.bytes) for c in found if c.group_size == 4 and c.bytes == tokens]
    assert sorted(ring) == [("all-gather", tokens)] * 2 + [("reduce-scatter", tokens)], [
        (c.kind, c.bytes, c.group_size) for c in found
    ]
    stack = E * D * F * 4  # one whole expert stack, fp32
    assert all(c.bytes < stack for c in found if c.kind == "all-gather"), [
        (c.kind, c.bytes, c.group_size) for c in found
    ]


class _Holder(nnx.Module):
    def __init__(self, block: nnx.Module):
        self.block = block


class TwoMoeLayers(nnx.Module):
    """Two residual MoE blocks: what the matcher needs to see a repeating MoE layer."""

    def __init__(self, *, nonlinear_out: bool = False):
        rngs = nnx.Rngs(0)
        self.layers = nnx.List(
            SharedExpertMoeBlock(rngs=rngs, nonlinear_out=nonlinear_out) for _ in range(2)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def test_a_block_not_linear_in_its_experts_rows_is_matched_off_ep_and_refused_at_its_equation():
    """A tanh on the routed experts' sum: no ep rank can compute it from its own rows. The
    matcher prices the dispatch as routed rows (ep is not searched) and its note names the
    equation; run over ep anyway, the layer raises that reason at its first trace. Without
    the tanh, the same block is matched as a ragged dispatch."""
    x = jnp.zeros((2, 4, D))
    assert match_patterns(TwoMoeLayers(), x).moe.dispatch == "ragged"
    model = TwoMoeLayers(nonlinear_out=True)
    found = match_patterns(model, x)
    assert found.moe.dispatch == "own"
    (note,) = [n for n in found.notes if "an ep rank cannot compute" in n]
    assert "tanh" in note and "not linear" in note and "ep is not searched" in note, note
    assert type(model.layers[0]) is SharedExpertMoeBlock  # the check's classes are undone
    # the search offers no ep for it and says why; forced, its experts go over ep with the
    # tokens left to GSPMD (and the cost model prices jfleet's all-to-alls: the note says so)
    plan = plan_for(model, device_num=8, batch_size=8, seq_len=4, patterns=found)
    assert {c.layout.ep for c in plan.candidates} == {1}
    (why,) = [n for n in plan.notes if n.startswith("ep not searched")]
    assert "force_mesh" in why, why
    forced = plan_for(
        model, device_num=8, batch_size=8, seq_len=4, patterns=found, force_mesh={"ep": 8}
    )
    assert forced.layout.ep == 8 and forced.moe_layers == ()
    ring_ragged_experts(model, ["layers.0"], _mesh({"dp": 2, "ep": 4}), STACKS)
    with pytest.raises(ValueError, match=r"SharedExpertMoeBlock's expert dispatch over ep: "
                       r"at `.*tanh.*not linear"):  # fmt: skip
        jax.eval_shape(model.layers[0], jnp.zeros((8, 4, D)))


def test_a_sum_with_rows_no_rank_computed_exactly_is_refused():
    """No compile. A tanh of a product's rows is exact on this rank's rows only: added to
    the unsorted output (a sum over ranks), the other rows' values would be summed too."""
    from jfleet.auto_parallel.match.ragged_rows import ExpertRows

    def layer(x, w):
        experts = jnp.argmax(x[:, :E], axis=-1)
        order = jnp.argsort(experts)
        out = jax.lax.ragged_dot(x[order], w, jnp.bincount(experts, length=E))
        return out[jnp.argsort(order)] + jnp.tanh(out)

    jaxpr = jax.make_jaxpr(layer)(jnp.ones((64, D)), jnp.ones((E, D, F)))
    with pytest.raises(ValueError, match=r"add .* not linear in the experts' summed rows"):
        ExpertRows(E, 4, tokens=64).layer(jaxpr.jaxpr, [], None, ["replicated", "stack"])


def test_a_running_count_over_the_tokens_is_refused_and_one_over_the_experts_is_not():
    """No compile. A capacity rule (each token's position among its expert's, a cumsum over
    the token copies) would, over ep, drop the ep group's tokens, not the batch's: refused.
    MaxText's group offsets (a cumsum over the 8 experts' sizes) are not a count over
    tokens."""
    from jfleet.auto_parallel.match.ragged_rows import ExpertRows

    def layer(x, w, keep_first):
        experts = jnp.argmax(x[:, :E], axis=-1)
        order = jnp.argsort(experts)
        sizes = jnp.bincount(experts, length=E)
        offsets = jnp.cumsum(sizes)  # over the experts
        out = jax.lax.ragged_dot(x[order], w, sizes)[jnp.argsort(order)]
        if keep_first:  # the first 4 copies an expert: a running count over the tokens
            position = jnp.cumsum(jax.nn.one_hot(experts, E), axis=0)[jnp.arange(64), experts]
            out = out * (position <= 4)[:, None]
        return out + 0 * offsets[0]

    kinds = ["replicated", "stack"]
    for keep_first in (False, True):
        jaxpr = jax.make_jaxpr(lambda x, w, k=keep_first: layer(x, w, k))(
            jnp.ones((64, D)), jnp.ones((E, D, F))
        )
        rows = ExpertRows(E, 4, tokens=64)
        if not keep_first:
            assert rows.layer(jaxpr.jaxpr, list(jaxpr.consts), None, kinds)[1] == ["partial"]
            continue
        with pytest.raises(ValueError, match=r"a running cumsum over 64 token rows couples"):
            rows.layer(jaxpr.jaxpr, list(jaxpr.consts), None, kinds)

"""jfleet.parallel.stack (stacking, annotation, running, stage inputs, widening) and
pipeline_forward on its own, against the sequential loop in values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from jfleet.auto_parallel.apply.blocks import PipelinedBlocks, pipeline_blocks
from jfleet.mesh.topology import DP, MP, PP
from jfleet.parallel import stack
from jfleet.parallel.pipeline_forward import pipeline_forward

D, BATCH, SEQ = 4, 8, 3
#: Compile with LLVM's optimisations off (as test_pipeline_schedule does).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def make_mesh(**degrees: int) -> jax.sharding.Mesh:
    names, shape = tuple(degrees), tuple(degrees.values())
    n = int(np.prod(shape))
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n]
    )


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


class Tagged(nnx.Module):
    """(hidden, mask, positions) -> (hidden', mask, positions); hidden' reads all three and
    a table argument, and ``scale`` is a Python flag that must stay static."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, inputs, table, scale=1.0):
        h, mask, positions = inputs
        assert isinstance(scale, float)  # a Python value, not a tracer
        y = jnp.tanh(self.linear(h) + table[positions]) * scale
        return jnp.where(mask[..., None], y, h), mask, positions


def layers(n: int) -> list:
    return [Tagged(rngs=nnx.Rngs(i)) for i in range(n)]


def tagged_inputs(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (BATCH, SEQ, D))
    mask = jax.random.bernoulli(k[1], 0.7, (BATCH, SEQ))
    positions = jax.random.randint(k[2], (BATCH, SEQ), 0, 5)
    table = jax.random.normal(k[3], (5, D)) / 3
    return (h, mask, positions), table


def loop(mods, x, *args, **kwargs):
    for mod in mods:
        x = mod(x, *args, **kwargs)
    return x


# ------------------------------------------------------------------ stacking, annotation
def test_stack_layers_orders_stages_and_keeps_the_inner_layout():
    mods = layers(4)
    for mod in mods:
        mod.linear.kernel.set_metadata(out_sharding=(None, MP))
    body = stack.stack_layers(mods, 2)
    assert type(body) is Tagged and body.linear.kernel.shape == (2, 2, D, D)
    for s in range(2):
        for i in range(2):
            np.testing.assert_array_equal(
                body.linear.kernel[s, i], mods[2 * s + i].linear.kernel[...]
            )
    assert body.linear.kernel.get_metadata("out_sharding") == (None, None, None, MP)

    mesh = make_mesh(dp=4, pp=2)
    stack.annotate_stack(body, mesh, 2)
    assert body.linear.kernel.get_metadata("out_sharding") == (PP, None, None, MP)
    assert body.linear.bias.get_metadata("out_sharding") == (PP, None, None)
    assert body.linear.kernel.get_metadata("mesh") is mesh
    stack.annotate_stack(body, make_mesh(dp=8), 2)  # no pp axis of that size: unsharded
    assert body.linear.kernel.get_metadata("out_sharding") == (None, None, None, MP)


@pytest.mark.parametrize(
    ("mods", "stages", "error", "message"),
    [
        ([nnx.BatchNorm(D, rngs=nnx.Rngs(0))] * 2, 1, ValueError, r"other than nnx.Param"),
        ([nnx.Linear(D, D, rngs=nnx.Rngs(0)), "layer"], 1, TypeError, r"1: str"),
        (layers(3), 2, ValueError, r"num_stages=2 does not split the 3 Tagged layers"),
        ([], 1, ValueError, r"layers=\[\]"),
    ],
)
def test_stack_layers_refusals(mods, stages, error, message):
    with pytest.raises(error, match=message):
        stack.stack_layers(mods, stages)


# ------------------------------------------------------------------ running
def test_run_layers_is_the_loop_with_remat_groups_and_after():
    mods = layers(3)
    x, table = tagged_inputs()
    body = stack.stack_layers(mods, 1)
    want = loop(mods, x, table, scale=0.5)
    got = stack.run_stack(body, x, table, scale=0.5, remat_interval=2)
    assert [a.dtype for a in got] == [a.dtype for a in x]
    assert_trees_close(got, want)

    graphdef, state = nnx.split(body)
    params = jax.tree.map(lambda a: a[0], nnx.to_pure_dict(state))

    def run(params, interval, after=None):
        return stack.run_layers(
            graphdef, params, x, (table,), {"scale": 0.5}, remat_interval=interval, after=after
        )[0]

    # 3 layers by 2: a scan over one group of 2 under jax.checkpoint, then a group of 1
    assert str(jax.make_jaxpr(lambda p: run(p, 2))(params)).count("remat2[") == 2
    assert "remat" not in str(jax.make_jaxpr(lambda p: run(p, 0))(params))
    doubled = run(params, 0, after=lambda y: (2 * y[0], y[1], y[2]))
    h = x[0]
    for mod in mods:
        h = 2 * mod((h, x[1], x[2]), table, scale=0.5)[0]
    np.testing.assert_allclose(doubled, h, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ stage inputs
def test_stage_inputs_split_the_activation_and_arguments_and_rebuild_them():
    (h, mask, positions), table = tagged_inputs()
    rows = jnp.ones((BATCH, 2))
    inputs, carried, side, shared = stack.stage_inputs(
        (h, mask, positions), (table, rows), {"scale": 0.5}
    )
    assert inputs.floating == (True, False, False)
    assert inputs.kinds == (stack.SHARED, stack.SIDE, stack.STATIC)
    assert [a.dtype for a in carried] == [jnp.float32]
    assert [a.dtype for a in side] == [jnp.bool_, jnp.int32, jnp.float32]
    assert len(shared) == 1 and shared[0] is table
    x = inputs.activation_of(carried, side)
    assert x[1] is mask and x[2] is positions
    args, kwargs = inputs.arguments_of(side, shared)
    assert args[0] is table and args[1] is rows and kwargs == {"scale": 0.5}
    assert inputs.carried_of((2 * h, mask, positions))[0].shape == h.shape

    declared, _, side, shared = stack.stage_inputs(h, (table, rows), per_sample=(0,))
    assert declared.kinds == (stack.SIDE, stack.SHARED) and side[0] is table

    with pytest.raises(ValueError, match=r"structure they take"):
        inputs.carried_of(h)
    with pytest.raises(ValueError, match=r"at least one floating array"):
        stack.stage_inputs((mask, positions))
    square = jnp.ones((SEQ, SEQ, D))  # batch == seq: a [3, 3] argument is ambiguous
    with pytest.raises(ValueError, match=r"argument 0 .*\(3, 3\).*per_sample_args"):
        stack.stage_inputs(square, (jnp.ones((SEQ, SEQ)),))


# ------------------------------------------------------------------ widening
def test_widening_crosses_in_float32_and_leaves_ints_alone():
    tree = {"h": jnp.ones(2, jnp.bfloat16), "ids": jnp.ones(2, jnp.int32), "f": jnp.ones(2)}
    wide = stack.widen(tree)
    assert {k: v.dtype for k, v in wide.items()} == {
        "h": jnp.float32,
        "ids": jnp.int32,
        "f": jnp.float32,
    }
    assert stack.widen(tree, wide=False)["h"].dtype == jnp.bfloat16
    assert stack.narrow(wide, tree)["h"].dtype == jnp.bfloat16

    w = jax.random.normal(jax.random.key(0), (D, D)).astype(jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (BATCH, D)).astype(jnp.bfloat16)
    seen = []

    def stage_fn(w, x, side, shared):
        seen.append((w.dtype, x.dtype))
        return jnp.tanh(x @ w) + side

    mesh = make_mesh(pp=2)
    assert stack.widens_on(mesh)  # the test machine is CPU
    fn, w32, x32 = stack.widened_stage(stage_fn, w, x, mesh=mesh)
    assert (w32.dtype, x32.dtype) == (jnp.float32, jnp.float32)
    y = fn(w32, x32, jnp.ones((), jnp.bfloat16), ())
    assert y.dtype == jnp.float32 and seen[-1] == (jnp.bfloat16, jnp.bfloat16)
    np.testing.assert_array_equal(y, stage_fn(w, x, jnp.ones((), jnp.bfloat16), ()))
    assert stack.widened(stage_fn, (w, x), wide=False) is stage_fn


# ------------------------------------------------------------------ pipeline_forward
def masked_stage(w, x, side, shared):
    """Two tanh layers; rows read int positions into a shared table, masked rows pass."""
    positions, keep = side

    def layer(h, wl):
        y = jnp.tanh(h @ wl["w"] + wl["b"]) + shared[positions]
        return jnp.where(keep[:, None], y, h), None

    return jax.lax.scan(layer, x, w)[0]


@pytest.mark.parametrize(("dp", "pp", "m"), [(2, 2, 2), (2, 4, 1)])
def test_pipeline_forward_is_the_sequential_loop_in_values_and_gradients(dp, pp, m):
    mesh = make_mesh(**{DP: dp, PP: pp})
    rows = dp * m * 2
    k = jax.random.split(jax.random.key(pp), 6)
    w = {
        "w": jax.random.normal(k[0], (pp, 2, D, D)) / 2,
        "b": 0.1 * jax.random.normal(k[1], (pp, 2, D)),
    }
    x = jax.random.normal(k[2], (rows, D))
    side = (
        jax.random.randint(k[3], (rows,), 0, 5),
        jax.random.bernoulli(k[4], 0.7, (rows,)),
    )
    table = jax.random.normal(k[5], (5, D)) / 3
    probe = jnp.arange(rows * D, dtype=jnp.float32).reshape(rows, D) / (rows * D)

    def sequential(w, x, table):
        for s in range(pp):
            x = masked_stage(jax.tree.map(lambda a, s=s: a[s], w), x, side, table)
        return x

    def pipelined(w, x, table, remat=False):
        return pipeline_forward(
            masked_stage, w, x, side, table, mesh=mesh, num_microbatches=m, remat=remat
        )

    def everything(w, x, table):
        out = {}
        for name, f in (
            ("seq", sequential),
            ("pipe", pipelined),
            ("remat", lambda *a: pipelined(*a, remat=True)),
        ):
            probed = lambda w, x, t, f=f: jnp.sum(f(w, x, t) * probe)  # noqa: E731
            out[name] = (f(w, x, table), jax.grad(probed, (0, 1, 2))(w, x, table))
        return out

    out = jax.jit(everything).lower(w, x, table).compile(FAST_COMPILE)(w, x, table)
    want_y, (want_w, want_x, want_table) = out["seq"]
    assert float(jnp.abs(want_table).sum()) > 0
    for name in ("pipe", "remat"):
        y, (d_w, d_x, d_table) = out[name]
        assert_trees_close(y, want_y)
        assert_trees_close((d_w, d_x), (want_w, want_x))
        assert not np.any(np.asarray(d_table)), name  # shared inputs get no gradient


def test_a_stack_runs_through_pipeline_forward_with_side_activation_leaves():
    """stage_inputs + stage_function + widened_stage + pipeline_forward (PipelinedBlocks'
    path): the int / bool activation leaves reach every stage; equals the loop."""
    mesh = make_mesh(**{DP: 2, PP: 2})
    mods = layers(4)
    x, table = tagged_inputs(seed=1)
    body = stack.stack_layers(mods, 2)
    graphdef, state = nnx.split(body)

    def pipelined(params, h):
        inputs, carried, side, shared = stack.stage_inputs((h, *x[1:]), (table,), {"scale": 0.5})
        fn = stack.stage_function(graphdef, inputs, remat_interval=1)
        fn, params, carried_in = stack.widened_stage(fn, params, carried, mesh=mesh)
        y = pipeline_forward(fn, params, carried_in, side, shared, mesh=mesh, num_microbatches=2)
        return inputs.activation_of(stack.narrow(y, carried), side)

    def sequential(params, h):
        flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), params)
        return stack.run_layers(graphdef, flat, (h, *x[1:]), (table,), {"scale": 0.5})

    def both(params, h):
        out = []
        for f in (pipelined, sequential):
            squares = lambda p, h, f=f: jnp.sum(f(p, h)[0] ** 2)  # noqa: E731
            out.append((f(params, h), jax.grad(squares, (0, 1))(params, h)))
        return out

    params = nnx.to_pure_dict(state)
    (got, got_grads), (want, want_grads) = jax.jit(both)(params, x[0])
    assert got[1].dtype == jnp.bool_ and got[2].dtype == jnp.int32
    assert_trees_close(got, want)
    assert_trees_close(got_grads, want_grads)


# ------------------------------------------------------------------ blocks that alternate
# A tiny decoder as public NNX ports of Gemma 2/3 write it: the blocks are one class, and
# even blocks attend within a sliding window while odd ones attend globally (a static
# setting; the parameter shapes are the same).
WIDTH, HEADS, VOCAB, WINDOW, TOKENS = 16, 2, 32, 3, 8


class Attention(nnx.Module):
    def __init__(self, sliding_window: int | None, *, rngs: nnx.Rngs):
        self.num_heads = HEADS
        self.sliding_window = sliding_window
        self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(WIDTH, WIDTH, use_bias=False, rngs=rngs)

    def __call__(self, x, positions, mask=None):
        b, t, _ = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.num_heads, -1), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        if mask is None:
            distance = positions[:, :, None] - positions[:, None, :]
            mask = distance >= 0
            if self.sliding_window is not None:
                mask = mask & (distance < self.sliding_window)
        scores = jnp.where(mask[:, None], scores, -1e30)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.out(y.reshape(b, t, WIDTH))


class Block(nnx.Module):
    def __init__(self, i: int, *, rngs: nnx.Rngs):
        self.sliding_window = WINDOW if i % 2 == 0 else None  # local, global, local, ...
        self.attn_norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.attn = Attention(self.sliding_window, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(WIDTH, rngs=rngs)
        self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
        self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, positions, mask=None):
        x = x + self.attn(self.attn_norm(x), positions, mask)
        return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class Decoder(nnx.Module):
    block_class = Block

    def __init__(self, kinds=(0, 1, 2, 3), *, seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.layers = nnx.List([self.block_class(i, rngs=rngs) for i in kinds])
        self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.embed.attend(self.norm(x))


def lm_data(batch: int = 4):
    tokens = jax.random.randint(jax.random.key(7), (batch, TOKENS + 1), 0, VOCAB)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(model, tokens, targets):
    logits = model(tokens)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)), logits


def test_first_difference_names_the_setting_and_both_values():
    local, wide = Block(0, rngs=nnx.Rngs(0)), Block(1, rngs=nnx.Rngs(1))
    assert stack.first_difference(local, Block(2, rngs=nnx.Rngs(2))) is None
    assert stack.first_difference(wide, local) == "attribute 'attn.sliding_window' (None vs 3)"
    narrow = nnx.Linear(WIDTH, WIDTH, rngs=nnx.Rngs(0))
    assert stack.first_difference(narrow, nnx.Linear(WIDTH, 8, rngs=nnx.Rngs(0))) == (
        "parameter 'bias' (shape (16,) vs (8,))"
    )
    assert stack.first_difference(local, narrow) == "its class (Block vs Linear)"


def test_block_period_of_alternating_identical_and_irregular_blocks():
    assert stack.block_period(Decoder().layers) == 2
    assert stack.block_period(Decoder(kinds=(0, 0, 0, 0)).layers) == 1
    assert stack.block_period(Decoder(kinds=(0, 1, 1, 1)).layers) is None
    assert stack.block_period(Decoder(kinds=(1,)).layers) == 1


def test_alternating_blocks_are_refused_without_their_period():
    """Before the check every block ran as block 0 (all local attention): silently wrong."""
    blocks = list(Decoder().layers)
    with pytest.raises(
        ValueError,
        match=r"layer 1 differs from layer 0 in attribute 'attn.sliding_window' \(None vs 3\)"
        r".*period=2",
    ):
        stack.stack_layers(blocks, 2)
    with pytest.raises(ValueError, match=r"do not repeat every 2: layer 3 differs from layer 1"):
        stack.stack_layers(list(Decoder(kinds=(0, 1, 2, 2)).layers), 1, period=2)
    with pytest.raises(ValueError, match=r"period=3 does not divide the 4 Block layers"):
        stack.stack_layers(blocks, 1, period=3)
    with pytest.raises(ValueError, match=r"in 2 super-blocks of 2 evenly; .* dividing 2"):
        stack.stack_layers(blocks, 4, period=2)
    mesh = make_mesh(dp=2, pp=2)
    with pytest.raises(ValueError, match=r"layer 1 differs from layer 0 .*sliding_window"):
        PipelinedBlocks(blocks, mesh=mesh, num_microbatches=2, period=1)
    irregular = list(Decoder(kinds=(0, 1, 1, 1)).layers)
    with pytest.raises(ValueError, match=r"block 1 differs from block 0 .*sliding_window"):
        PipelinedBlocks(irregular, mesh=mesh, num_microbatches=2)


def test_super_blocks_stack_and_run_each_block_with_its_own_setting():
    blocks = list(Decoder().layers)
    body = stack.stack_layers(blocks, 2, period=2)
    assert type(body) is stack.SuperBlock
    assert [layer.attn.sliding_window for layer in body.layers] == [WINDOW, None]
    assert body.layers[1].up.kernel.shape == (2, 1, WIDTH, 2 * WIDTH)
    np.testing.assert_array_equal(body.layers[1].up.kernel[1, 0], blocks[3].up.kernel[...])
    x = jax.random.normal(jax.random.key(0), (2, TOKENS, WIDTH))
    positions = jnp.broadcast_to(jnp.arange(TOKENS), (2, TOKENS))
    want = loop(blocks, x, positions)
    assert_trees_close(stack.run_stack(body, x, positions, remat_interval=1), want)


def test_pipelined_super_blocks_equal_one_device_in_values_and_gradients():
    """dp2 x pp2 x mp2, 4 alternating blocks as 2 super-blocks of 2 (one per stage),
    plain, and with recompute and sequence-parallel constraints after each block: the loss,
    logits and every gradient equal one device's."""
    auto = (AxisType.Auto,) * 3
    mesh = jax.make_mesh((2, 2, 2), (DP, PP, MP), axis_types=auto, devices=jax.devices()[:8])
    reference = Decoder()
    plain, recomputed = nnx.clone(reference), nnx.clone(reference)
    stand_in = pipeline_blocks(plain, "layers", mesh=mesh, num_microbatches=2)
    assert stand_in.period == 2 and type(stand_in.body) is stack.SuperBlock
    pipeline_blocks(
        recomputed, "layers", mesh=mesh, num_microbatches=2, recompute=True, seq_axes=(MP,)
    )
    tokens, targets = lm_data()
    grad = nnx.value_and_grad(lm_loss, has_aux=True)

    @nnx.jit
    def run(reference, plain, recomputed):
        return [grad(m, tokens, targets) for m in (reference, plain, recomputed)]

    ((want_loss, want_logits), want), *pipelined = run(reference, plain, recomputed)
    for (loss, logits), grads in pipelined:
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert_trees_close(grads["embed"], want["embed"], atol=1e-5)
        assert_trees_close(grads["norm"], want["norm"], atol=1e-5)
        body = grads["layers"]["body"]["layers"]
        for b in range(4):
            stage, k = divmod(b, 2)
            got = jax.tree.map(lambda a, s=stage: a[s, 0], body[k])
            assert_trees_close(got, want["layers"][b], atol=1e-5)

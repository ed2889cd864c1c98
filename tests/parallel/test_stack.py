"""jfleet.parallel.stack (stacking, annotation, running, stage inputs, widening) and
pipeline_forward on its own, against the sequential loop in values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from jfleet.parallel import stack
from jfleet.parallel.pipeline_schedule import pipeline_forward
from jfleet.topology import DP, MP, PP

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

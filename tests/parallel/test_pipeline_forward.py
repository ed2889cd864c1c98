"""pipeline_forward (the stand-in) and both entry points' executed work, structurally.

Gradients of both stand-in schedules, with the batch split over pp or not, against the
sequential model on one device (fp32). Executed dot FLOPs per device: the compiled HLO's
dots outside conditionals plus each conditional's branches weighted by the ticks
:func:`stage_ticks` says the slowest stage takes them, against the ideal computed from
the unpipelined program (its dot FLOPs / devices, plus one forward per micro-batch where
the schedule recomputes). With ``mp`` inside the stages: what stages send and stash is
split over it (Megatron's scatter / gather), values and gradients unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet.mesh.topology import DP, MP, PP
from jfleet.parallel.pipeline_forward import pipeline_forward, rows_fit
from jfleet.parallel.pipeline_schedule import pipeline_loss, stage_ticks, taken_branches
from jfleet.parallel.virtual_stages import interleaved_order
from jfleet.testing import hlo
from jfleet.testing.trees import assert_trees_close

STAGES, LAYERS, D, M, BATCH = 4, 2, 32, 4, 64


def stage_fn(w, x, mask, scale):
    """Two tanh layers run by a ``lax.scan`` (the stand-in's stages scan their blocks)."""
    return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl) * mask[:, None] * scale, None), x, w)[0]


def sequential(w, x, mask):
    for s in range(STAGES):
        x = stage_fn(w[s], x, mask, 0.9)
    return x


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, STAGES), (DP, PP), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def problem():
    k = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(k[0], (STAGES, LAYERS, D, D)) / 4
    x = jax.random.normal(k[1], (BATCH, D))
    mask = 0.5 + 0.5 * jax.random.uniform(k[2], (BATCH,))
    return w, x, mask


def interleaved(w, v):
    """``[P, L, ...]`` stage weights (layer ``s L + l``) restacked for ``v`` chunks a stage:
    row ``s`` holds chunks ``s, s + P, ...`` of ``L / v`` layers (differentiable)."""
    flat = w.reshape(STAGES * LAYERS, *w.shape[2:])
    return flat[jnp.array(interleaved_order(STAGES * LAYERS, STAGES, v))].reshape(w.shape)


def stand_in_loss(mesh, schedule, rows, remat=False, v=1):
    def loss(w, x, mask):
        y = pipeline_forward(
            stage_fn, interleaved(w, v) if v > 1 else w, x, mask, jnp.float32(0.9), mesh=mesh,
            num_microbatches=M, schedule=schedule, remat=remat, rows_over_pp=rows,
            num_virtual=v,
        )  # fmt: skip
        return jnp.mean(y**2), y

    return loss


@pytest.mark.parametrize(
    "schedule, rows, remat, v",
    [
        ("FThenB", False, False, 1),
        ("FThenB", True, True, 1),
        ("1F1B", False, False, 1),
        ("1F1B", True, False, 1),
        ("VPP", True, False, 2),  # interleaved: 2 chunks of 1 layer per stage
    ],
)
def test_the_stand_in_is_the_sequential_model_in_values_and_gradients(
    mesh, problem, schedule, rows, remat, v
):
    w, x, mask = problem

    def one_device(w, x):
        y = sequential(w, x, mask)
        return jnp.mean(y**2), y

    want = jax.jit(jax.value_and_grad(one_device, (0, 1), has_aux=True))(w, x)
    loss = stand_in_loss(mesh, schedule, rows, remat, v)
    got = jax.jit(jax.value_and_grad(lambda w, x: loss(w, x, mask), (0, 1), has_aux=True))(w, x)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    y = got[0][1]
    assert y.sharding.spec == (jax.sharding.PartitionSpec((DP, PP)) if rows else y.sharding.spec)
    if rows:  # each device holds 1 / (dp x pp) of the rows, in the unsplit order
        assert y.addressable_shards[0].data.shape[0] == BATCH // (2 * STAGES)


def test_rows_over_pp_needs_rows_that_split(mesh, problem):
    w, x, mask = problem
    assert rows_fit(BATCH, mesh, M) and not rows_fit(12, mesh, M)
    with pytest.raises(ValueError, match=r"20 rows.*pipeline stages 8.*rows_over_pp=False"):
        pipeline_forward(stage_fn, w, x[:20], mask[:20], 1.0, mesh=mesh, num_microbatches=2,
                         rows_over_pp=True)  # fmt: skip


# ------------------------------------------------------------------ executed FLOPs
def dense_flops(w, x, mask):
    """Dot FLOPs of one device's unpipelined forward and training step (whole batch)."""
    fwd = jax.jit(lambda w, x: sequential(w, x, mask)).lower(w, x).compile().as_text()
    grad = jax.grad(lambda w, x: jnp.mean(sequential(w, x, mask) ** 2), (0, 1))
    step = jax.jit(grad).lower(w, x).compile().as_text()
    return hlo.dot_flops(fwd), hlo.dot_flops(step)


@pytest.fixture(scope="module")
def ideal_parts(problem):
    return dense_flops(*problem)


@pytest.mark.parametrize(
    "entry, schedule, remat, v",
    [
        ("stand-in", "1F1B", False, 1),
        ("stand-in", "FThenB", True, 1),
        ("pipeline_loss", "1F1B", False, 1),
        ("pipeline_loss", "FThenB", True, 1),
        ("stand-in", "FThenB", False, 1),
        ("stand-in", "1F1B", False, 2),  # VPP: 1F1B's program over 2 chunks a stage
    ],
)
def test_executed_dot_flops_per_device_are_the_schedules_own_work(
    mesh, problem, ideal_parts, entry, schedule, remat, v
):
    w, x, mask = problem
    if entry == "stand-in":
        loss = stand_in_loss(mesh, schedule, rows=True, remat=remat, v=v)
        step = jax.grad(lambda w, x: loss(w, x, mask)[0], (0, 1))
    else:  # a head without dots: the stages are all the work

        def step(w, x):
            def loss(w, x):
                return pipeline_loss(
                    stage_fn, lambda h, y, t: jnp.mean((y - t) ** 2), w, (), x,
                    jnp.zeros_like(x), mask, jnp.float32(0.9), mesh=mesh, schedule=schedule,
                    num_microbatches=M, remat=remat,
                )  # fmt: skip

            return jax.grad(loss, (0, 1))(w, x)

    text = jax.jit(step).lower(w, x).compile().as_text()
    loss_inside = entry == "pipeline_loss"
    ticks = stage_ticks(schedule, STAGES, M, remat=remat, loss_inside=loss_inside, num_virtual=v)
    executed = max(
        hlo.executed_flops(
            text, taken_branches(schedule, s, STAGES, M, loss_inside=loss_inside, num_virtual=v)
        )
        for s in range(STAGES)
    )
    forward, dense_step = ideal_parts
    devices = mesh.size
    slowest = max(ticks, key=lambda t: t["recompute"])
    per_unit = forward / devices / M / v  # one micro-batch's forward through one chunk
    ideal = dense_step / devices + slowest["recompute"] * per_unit
    assert executed == pytest.approx(ideal, rel=0.05), (executed, ideal)
    # the program holds the bubbles' work in branches not taken: dot_flops counts them
    assert hlo.dot_flops(text) > executed


# the program holds branches not all taken


def test_interleaved_loops_have_v_m_plus_p_minus_1_ticks_of_which_p_minus_1_bubbles(mesh, problem):
    """VPP's bubble, structurally: each loop's bubble-skipping cond runs v M + P - 1 times
    and works v M of them (a chunk each), so the idle share is (P - 1) / (v M + P - 1)."""
    w, x, mask = problem
    for v, want in ((1, M + STAGES - 1), (2, 2 * M + STAGES - 1)):
        loss = stand_in_loss(mesh, "1F1B", rows=True, v=v)
        step = jax.grad(lambda w, x, loss=loss: loss(w, x, mask)[0], (0, 1))
        text = jax.jit(step).lower(w, x).compile().as_text()
        looped = [c.weight for c in hlo.conditionals(text) if c.weight > 1]
        assert looped and set(looped) == {want}, (v, looped)
        ticks = stage_ticks("1F1B", STAGES, M, loss_inside=False, num_virtual=v)[0]
        bubble = ticks["bubble"] / (2 * want)  # both loops' idle ticks over all ticks
        assert bubble == pytest.approx((STAGES - 1) / (v * M + STAGES - 1))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"schedule": "VPP", "num_virtual": 1}, r"'VPP' with num_virtual=1.*num_virtual >= 2"),
        ({"schedule": "FThenB", "num_virtual": 2}, r"'FThenB' with num_virtual=2"),
        ({"schedule": "VPP", "num_virtual": 2, "num_microbatches": 2},
         r"groups of the pipeline degree 4; accumulate_steps \(micro-batches\)=2.*use 4"),
        ({"schedule": "VPP", "num_virtual": 3}, r"do not split into 3 chunks"),
    ],
)  # fmt: skip
def test_interleaving_errors_name_the_setting_and_the_fix(mesh, problem, kwargs, message):
    w, x, mask = problem
    kwargs = {"num_microbatches": M, **kwargs}
    with pytest.raises(ValueError, match=message):
        pipeline_forward(stage_fn, w, x, mask, 1.0, mesh=mesh, **kwargs)


# ------------------------------------------------------------------ tensor parallel inside
MB, T, DM, F = 2, 16, 32, 64  # micro-batch rows, sequence, width, MLP hidden


def mlp_layer(x, w):
    """A Megatron MLP on ``[b, T, DM]``: up split over mp by columns, down by rows."""
    up, down = w
    h = jax.lax.with_sharding_constraint(jnp.tanh(x @ up), P(None, None, MP))
    return x + h @ down, None


def mlp_stage(w, x, side, shared):
    """The stage's (or chunk's) layers ``[K, ...]`` in turn."""
    return jax.lax.scan(mlp_layer, x, w)[0]


def mp_problem(mesh, m, v=1):
    """Two layers a stage (``v = 2``: one per chunk, restacked interleaved) and a batch."""
    k = jax.random.split(jax.random.key(1), 3)
    stages = mesh.shape[PP]
    up = jax.random.normal(k[0], (stages, 2, DM, F)) / 6
    down = jax.random.normal(k[1], (stages, 2, F, DM)) / 8
    if v > 1:
        order = jnp.array(interleaved_order(2 * stages, stages, v))
        up, down = (a.reshape(2 * stages, *a.shape[2:])[order].reshape(a.shape) for a in (up, down))
    w = (jax.device_put(up, NamedSharding(mesh, P(PP, None, None, MP))),
         jax.device_put(down, NamedSharding(mesh, P(PP, None, MP, None))))  # fmt: skip
    rows = m * MB * mesh.shape[DP]
    x = jax.device_put(jax.random.normal(k[2], (rows, T, DM)), NamedSharding(mesh, P()))
    return w, x


def mp_step(mesh, m, schedule, v=1):
    def loss(w, x):
        y = pipeline_forward(mlp_stage, w, x, mesh=mesh, num_microbatches=m, schedule=schedule,
                             num_virtual=v)  # fmt: skip
        return jnp.mean(y**2)

    return jax.jit(jax.value_and_grad(loss, (0, 1)))


@pytest.mark.parametrize("schedule, v", [("1F1B", 1), ("FThenB", 1), ("VPP", 2)])
def test_with_mp_the_stages_send_and_stash_one_mp_th_and_compute_the_same(schedule, v):
    mesh = jax.make_mesh((1, 2, 4), (DP, PP, MP), axis_types=(AxisType.Auto,) * 3)
    w, x = mp_problem(mesh, 4, v)
    layers = interleaved_order(4, 2, v)  # the layer each stacked position holds

    def one_device(w, x):
        flat = [a.reshape(-1, *a.shape[2:]) for a in w]
        for n in sorted(range(len(layers)), key=layers.__getitem__):  # in layer order
            x = mlp_layer(x, (flat[0][n], flat[1][n]))[0]
        return jnp.mean(x**2)

    with jax.set_mesh(mesh):
        want = jax.jit(jax.value_and_grad(one_device, (0, 1)))(w, x)
    step = mp_step(mesh, 4, schedule, v)
    assert_trees_close(step(w, x), want, rtol=1e-5, atol=1e-5)
    # Megatron's scatter / gather: each send carries 1 / mp of a micro-batch's activation,
    # all-gathered over mp after it
    permutes = [c for c in hlo.collectives(step.lower(w, x).compile().as_text())
                if c.kind == "collective-permute"]  # fmt: skip
    assert permutes and {c.bytes for c in permutes} == {MB * T * DM * 4 // 4}


def test_with_mp_the_stash_and_the_stacks_buffers_are_split():
    """1F1B's compiled temp per micro-batch: the stashed inputs, the stack's gathered input,
    outputs and input cotangents split over mp (1/4 each), the whole output the loss reads
    (measured at mp4: 1.75 stage inputs a micro-batch; 3 with every buffer whole)."""
    mesh = jax.make_mesh((1, 2, 4), (DP, PP, MP), axis_types=(AxisType.Auto,) * 3)

    def temp(m):
        w, x = mp_problem(mesh, m)
        compiled = mp_step(mesh, m, "1F1B").lower(w, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    per_microbatch = (temp(16) - temp(8)) / 8
    assert per_microbatch < 2 * MB * T * DM * 4, per_microbatch

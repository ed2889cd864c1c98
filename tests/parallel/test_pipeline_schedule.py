"""pipeline_loss: FThenB and 1F1B against the sequential model, collectives, memory, errors.

The stages are tiny MLPs (2 layers per stage, run by a ``lax.scan``) and the head a linear
softmax cross-entropy on integer targets. Every comparison differentiates the loss with
respect to the stage parameters, the head parameters and the inputs, and compares with the
same model run sequentially on one device (fp32, rtol 1e-5).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.mesh.topology import DP, MP, PP
from jfleet.parallel.pipeline_schedule import SCHEDULES, pipeline_loss, schedule_stats
from jfleet.testing import hlo

D, LAYERS, CLASSES, MICRO = 16, 2, 5, 2
RTOL, ATOL = 1e-5, 1e-6
#: Compile with LLVM's optimisations off: a third less compile time on CPU; the HLO passes,
#: buffer assignment (temp bytes) and collectives are the same as with the defaults.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


# ------------------------------------------------------------------ the model
def stage_fn(w, x, side, shared):
    """Two tanh layers, weights ``w['w']: [L, D, D]``, ``w['b']: [L, D]`` (no side inputs)."""

    def layer(h, wl):
        return jnp.tanh(h @ wl["w"] + wl["b"]), None

    return jax.lax.scan(layer, x, w)[0]


def head_fn(h, y, t):
    """Mean softmax cross-entropy of one micro-batch."""
    return optax.softmax_cross_entropy_with_integer_labels(y @ h["w"], t).mean()


def sequential_loss(sp, hp, x, t, m, stage=stage_fn):
    """The reference: every micro-batch through every stage in turn, one device."""

    def one(x, t):
        y = jax.lax.scan(lambda h, w: (stage(w, h, (), ()), None), x, sp)[0]
        return head_fn(hp, y, t)

    return jnp.mean(jax.vmap(one)(x.reshape(m, -1, D), t.reshape(m, -1)))


def make_problem(stages: int, batch: int, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 5)
    sp = {
        "w": jax.random.normal(k[0], (stages, LAYERS, D, D)) / 3,
        "b": 0.1 * jax.random.normal(k[1], (stages, LAYERS, D)),
    }
    hp = {"w": jax.random.normal(k[2], (D, CLASSES)) / 3}
    x = jax.random.normal(k[3], (batch, D))
    t = jax.random.randint(k[4], (batch,), 0, CLASSES)
    return sp, hp, x, t


def make_mesh(**degrees: int) -> jax.sharding.Mesh:
    names, shape = tuple(degrees), tuple(degrees.values())
    n = int(np.prod(shape))
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n]
    )


def assert_trees_close(got, want):
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL, err_msg=jax.tree_util.keystr(path)
        )


def check_against_sequential(mesh, m, stage=stage_fn, variants=None):
    """Loss and (stage, head, input) gradients of each variant equal the sequential model's."""
    stages = mesh.shape[PP]
    data = mesh.shape.get(DP, 1)
    sp, hp, x, t = make_problem(stages, m * MICRO * data)
    variants = variants or [{"schedule": s} for s in SCHEDULES]

    def everything(sp, hp, x):
        out = []
        for kw in variants:
            loss = lambda a, b, c, kw=kw: pipeline_loss(  # noqa: E731
                stage, head_fn, a, b, c, t, mesh=mesh, num_microbatches=m, **kw
            )
            out.append(jax.value_and_grad(loss, argnums=(0, 1, 2))(sp, hp, x))
        ref = jax.value_and_grad(sequential_loss, argnums=(0, 1, 2))(sp, hp, x, t, m, stage)
        return out, ref

    compiled = jax.jit(everything).lower(sp, hp, x).compile(FAST_COMPILE)
    out, (ref_loss, ref_grads) = compiled(sp, hp, x)
    for kw, (loss, grads) in zip(variants, out, strict=True):
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL, err_msg=str(kw))
        assert_trees_close(grads, ref_grads)
    return out


# ------------------------------------------------------------------ equality
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("pp", [2, 4])
def test_both_schedules_match_sequential(pp, m):
    check_against_sequential(make_mesh(pp=pp), m)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("pp", [2, 4])
def test_with_data_parallel_matches_sequential(pp, m):
    mesh = make_mesh(dp=2, pp=pp)
    out = check_against_sequential(mesh, m)
    for _, (d_stage, d_head, d_x) in out:
        assert d_stage["w"].sharding.is_equivalent_to(NamedSharding(mesh, P(PP)), 4)
        assert d_head["w"].sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)
        assert d_x.sharding.is_equivalent_to(NamedSharding(mesh, P(DP)), 2)


def mp_stage_fn(w, x, side, shared):
    """stage_fn with its weights constrained to column-parallel over the automatic ``mp``.

    Inside the pipeline's shard_map, shardings name the current (partly manual) mesh; the
    single-device reference has no mesh and runs it unconstrained.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if MP not in mesh.axis_names:
        return stage_fn(w, x, side, shared)
    w = dict(w)
    w["w"] = jax.lax.with_sharding_constraint(w["w"], NamedSharding(mesh, P(None, None, MP)))
    return stage_fn(w, x, side, shared)


@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("pp", [2, 4])
def test_with_tensor_parallel_matches_sequential(pp, m):
    mesh = make_mesh(pp=pp, mp=2)
    out = check_against_sequential(mesh, m, stage=mp_stage_fn)
    for _, (d_stage, _, _) in out:  # the constraint shows in the gradient's layout
        assert d_stage["w"].sharding.is_equivalent_to(NamedSharding(mesh, P(PP, None, None, MP)), 4)


def test_fleet_mesh_pp2_dp2_mp2():
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "pp_degree": 2, "mp_degree": 2}
    fleet.init(is_collective=True, strategy=strategy)
    mesh = fleet.get_hybrid_communicate_group().mesh
    check_against_sequential(mesh, 2, stage=mp_stage_fn)


def test_remat_and_forward_only_match():
    mesh = make_mesh(pp=4)
    check_against_sequential(mesh, 4, variants=[{"schedule": "FThenB", "remat": True}])
    sp, hp, x, t = make_problem(4, 4 * MICRO)
    ref = sequential_loss(sp, hp, x, t, 4)
    loss = jax.jit(  # no differentiation: the forward-only loop (the same for both schedules)
        lambda sp, hp, x: pipeline_loss(
            stage_fn, head_fn, sp, hp, x, t, mesh=mesh, schedule="1F1B", num_microbatches=4
        )
    )(sp, hp, x)
    np.testing.assert_allclose(float(loss), float(ref), rtol=RTOL)


def side_stage_fn(w, x, side, shared):
    """stage_fn whose rows also read per-sample int positions and a bool mask (``side``)
    and a shared table: masked-out rows pass through, the others add their table row."""
    positions, keep = side
    h = stage_fn(w, x, (), ()) + shared[positions]
    return jnp.where(keep[:, None], h, x)


def test_side_and_shared_inputs_reach_every_stage_and_get_no_gradient():
    mesh = make_mesh(dp=2, pp=2)
    m = 2
    sp, hp, x, t = make_problem(2, m * MICRO * 2)
    k = jax.random.split(jax.random.key(7), 3)
    positions = jax.random.randint(k[0], (x.shape[0],), 0, 5)
    keep = jax.random.bernoulli(k[1], 0.7, (x.shape[0],))
    table = jax.random.normal(k[2], (5, D)) / 4

    def reference(sp, hp, x, table):
        def one(x, t, positions, keep):
            y = jax.lax.scan(
                lambda h, w: (side_stage_fn(w, h, (positions, keep), table), None), x, sp
            )[0]
            return head_fn(hp, y, t)

        split = lambda a: a.reshape(m, -1, *a.shape[1:])  # noqa: E731
        return jnp.mean(jax.vmap(one)(split(x), split(t), split(positions), split(keep)))

    def everything(sp, hp, x, table):
        out = []
        for schedule in SCHEDULES:
            loss = lambda a, b, c, d, s=schedule: pipeline_loss(  # noqa: E731
                side_stage_fn, head_fn, a, b, c, t, (positions, keep), d,
                mesh=mesh, schedule=s, num_microbatches=m,
            )  # fmt: skip
            out.append(jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(sp, hp, x, table))
        return out, jax.value_and_grad(reference, argnums=(0, 1, 2))(sp, hp, x, table)

    compiled = jax.jit(everything).lower(sp, hp, x, table).compile(FAST_COMPILE)
    out, (ref_loss, ref_grads) = compiled(sp, hp, x, table)
    assert float(jnp.abs(ref_grads[0]["w"]).sum()) > 0
    for schedule, (loss, grads) in zip(SCHEDULES, out, strict=True):
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL, err_msg=schedule)
        assert_trees_close(grads[:3], ref_grads)
        assert not np.any(np.asarray(grads[3])), schedule  # shared: never differentiated


# ------------------------------------------------------------------ with nnx.grad
class PipelinedModel(nnx.Module):
    """Embedding, a stack of stages (leading axis = stage), linear head."""

    def __init__(self, stages: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(11, D, rngs=rngs)
        sp, hp, _, _ = make_problem(stages, 1, seed=3)
        self.stage_w = nnx.Param(sp["w"])
        self.stage_b = nnx.Param(sp["b"])
        self.head_w = nnx.Param(hp["w"])

    def params(self):
        return {"w": self.stage_w[...], "b": self.stage_b[...]}, {"w": self.head_w[...]}


def test_nnx_grad_reaches_the_embedding_and_scales_with_the_cotangent():
    mesh = make_mesh(dp=2, pp=4)
    m = 4
    tokens = jax.random.randint(jax.random.key(1), (m * MICRO * 2,), 0, 11)
    targets = jax.random.randint(jax.random.key(2), (m * MICRO * 2,), 0, CLASSES)

    def pipelined(model, schedule):
        sp, hp = model.params()
        loss = pipeline_loss(
            stage_fn, head_fn, sp, hp, model.embed(tokens), targets,
            mesh=mesh, schedule=schedule, num_microbatches=m,
        )  # fmt: skip
        return 4.0 * loss  # a loss scale: the custom VJP multiplies by the cotangent

    def reference(model):
        sp, hp = model.params()
        return 4.0 * sequential_loss(sp, hp, model.embed(tokens), targets, m)

    model = PipelinedModel(4, rngs=nnx.Rngs(0))
    want = nnx.jit(nnx.grad(reference))(model)
    for schedule in SCHEDULES:
        got = nnx.jit(nnx.grad(lambda mod, s=schedule: pipelined(mod, s)))(model)
        assert float(jnp.abs(got["embed"]["embedding"][...]).sum()) > 0
        assert_trees_close(nnx.to_pure_dict(got), nnx.to_pure_dict(want))


# ------------------------------------------------------------------ compiled programs
MEM_D, MEM_MICRO, MEM_STAGES, MEM_M = 256, 32, 4, (4, 8, 16)


@pytest.fixture(scope="module")
def compiled_steps():
    """value_and_grad under jit, P=4 x dp 2, D=256, micro-batch 32 per replica: per (schedule, M)
    the temp bytes and the loop-weighted collective counts."""
    mesh = make_mesh(dp=2, pp=MEM_STAGES)
    out = {}
    for m in MEM_M:
        rows = m * MEM_MICRO * 2
        args = (
            jax.ShapeDtypeStruct((MEM_STAGES, LAYERS, MEM_D, MEM_D), jnp.float32),
            jax.ShapeDtypeStruct((MEM_STAGES, LAYERS, MEM_D), jnp.float32),
            jax.ShapeDtypeStruct((MEM_D, CLASSES), jnp.float32),
            jax.ShapeDtypeStruct((rows, MEM_D), jnp.float32),
            jax.ShapeDtypeStruct((rows,), jnp.int32),
        )
        for schedule in SCHEDULES:

            def loss(w, b, h, x, t, s=schedule, m=m):
                return pipeline_loss(
                    stage_fn, head_fn, {"w": w, "b": b}, {"w": h}, x, t,
                    mesh=mesh, schedule=s, num_microbatches=m,
                )  # fmt: skip

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
            compiled = step.lower(*args).compile(FAST_COMPILE)
            counts = hlo.summarize(compiled.as_text())
            out[schedule, m] = {
                "temp": compiled.memory_analysis().temp_size_in_bytes,
                "permutes": counts["collective-permute"].count,
                "all_reduces": counts["all-reduce"].count,
            }
    return out


@pytest.mark.parametrize("m", MEM_M)
def test_collective_permutes_per_step(compiled_steps, m):
    p = MEM_STAGES
    assert compiled_steps["FThenB", m]["permutes"] == 2 * (m + p - 1)
    assert compiled_steps["1F1B", m]["permutes"] == 2 * (m + 2 * p - 2)
    for schedule in SCHEDULES:
        stats = schedule_stats(schedule, p, m)
        assert compiled_steps[schedule, m]["permutes"] == stats["collective_permutes"]


def test_gradient_all_reduces_happen_once_after_the_loop(compiled_steps):
    """dp and pp are manual: the all-reduces do not grow with the micro-batch count."""
    for schedule in SCHEDULES:
        counts = {compiled_steps[schedule, m]["all_reduces"] for m in MEM_M}
        assert len(counts) == 1 and counts.pop() <= 4, (schedule, counts)


def test_1f1b_activation_memory_is_bounded_by_stages(compiled_steps):
    temp = {key: v["temp"] for key, v in compiled_steps.items()}
    lo, hi = MEM_M[0], MEM_M[-1]
    assert temp["1F1B", hi] <= 0.5 * temp["FThenB", hi], temp
    growth_1f1b = temp["1F1B", hi] - temp["1F1B", lo]
    growth_fthenb = temp["FThenB", hi] - temp["FThenB", lo]
    assert growth_fthenb > 0, temp
    assert growth_1f1b < growth_fthenb / 3, temp


# ------------------------------------------------------------------ schedule_stats
def test_schedule_stats():
    assert schedule_stats("FThenB", 4, 8) == {
        "schedule": "FThenB",
        "num_stages": 4,
        "num_microbatches": 8,
        "ticks": 22,
        "collective_permutes": 22,
        "bubble_fraction": 3 / 11,
        "stash_slots": 8,
    }
    one = schedule_stats("1F1B", 4, 8)
    assert (one["ticks"], one["collective_permutes"], one["stash_slots"]) == (14, 28, 6)
    assert schedule_stats("1F1B", 1, 3)["collective_permutes"] == 0


# ------------------------------------------------------------------ errors
def _call(**overrides):
    mesh = overrides.pop("mesh", None) or make_mesh(dp=2, pp=2)
    sp, hp, x, t = make_problem(2, 8)
    kwargs = {"schedule": "1F1B", "num_microbatches": 2, "mesh": mesh}
    args = {"stage_fn": stage_fn, "head_fn": head_fn, "stage_params": sp, "head_params": hp}
    args |= {"inputs": x, "targets": t}
    for key in list(overrides):
        if key in args:
            args[key] = overrides.pop(key)
    kwargs |= overrides
    return pipeline_loss(*args.values(), **kwargs)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"schedule": "Interleaved"}, r"schedule='Interleaved'.*\['FThenB', '1F1B'\]"),
        ({"num_microbatches": 0}, r"num_microbatches=0"),
        (
            {"num_microbatches": 3},
            r"batch of 8 rows, which the micro-batch count x data-parallel size 6 "
            r"\(num_microbatches 3 x dp 2\).*num_microbatches dividing 4: \[1, 2, 4\]",
        ),
        ({"mesh": "mesh"}, r"no pipeline axis pp_axis='pp'"),
        ({"stage_params": {"w": jnp.zeros((4, 2, D, D))}}, r"size 2.*\['w'\]: \(4, 2, 16, 16\)"),
        ({"targets": jnp.zeros((6,), jnp.int32)}, r"one batch size.*\[6, 8\]"),
        ({"side": jnp.zeros((4, 3))}, r"inputs, targets, side must share one batch size.*\[4, 8\]"),
        ({"stage_fn": lambda w, x, s, c: x[:, :3]}, r"stage_fn must return.*float32\[2, 3\]"),
        ({"head_fn": lambda h, y, t: y.sum(0)}, r"head_fn must return a scalar.*\(16,\)"),
        ({"stage_fn": "f"}, r"stage_fn='f' is not callable"),
    ],
)
def test_bad_inputs_are_clear_errors(overrides, message):
    if overrides.get("mesh") == "mesh":
        overrides["mesh"] = make_mesh(dp=2, mp=2)
    error = TypeError if overrides.get("stage_fn") == "f" else ValueError
    with pytest.raises(error, match=message):
        _call(**overrides)


def test_mesh_with_wrong_pp_size_names_both_sizes():
    with pytest.raises(ValueError, match=r"size 4 \(the mesh's 'pp' size\)"):
        _call(mesh=make_mesh(dp=2, pp=4))


@pytest.mark.parametrize(
    ("args", "message"),
    [(("GPipe", 4, 2), r"schedule='GPipe'"), (("1F1B", 0, 2), r"num_stages=0")],
)
def test_schedule_stats_errors(args, message):
    with pytest.raises(ValueError, match=message):
        schedule_stats(*args)

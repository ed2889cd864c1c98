"""Tensor-parallel layers equal nnx.Linear / nnx.Embed on one device, with Megatron's comms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jfleet import DistributedStrategy, fleet, make_train_step
from jfleet.mesh.layer_mesh import named
from jfleet.mesh.topology import DATA_AXES, MP
from jfleet.parallel import random as tp_random
from jfleet.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from jfleet.parallel.random import get_rng_state_tracker
from jfleet.testing import hlo
from tests.fleet_setup import fleet_mesh, init_fleet

HYBRIDS = {
    "mp4_dp2": {"dp_degree": 2, "mp_degree": 4},
    "mp2_sharding2_dp2": {"dp_degree": 2, "sharding_degree": 2, "mp_degree": 2},
}
FP32 = dict(rtol=1e-5, atol=1e-6)
B, S, IN, OUT, VOCAB = 4, 3, 8, 16, 16


# --------------------------------------------------------------- the layer cases
# name -> (build TP layer, build reference, input maker, output spec's last entry, param specs)
def _x(rng):
    return rng.standard_normal((B, S, IN)).astype(np.float32)


def _x_out(rng):
    return rng.standard_normal((B, S, OUT)).astype(np.float32)


def _ids(rng):
    return rng.integers(-VOCAB, VOCAB, (B, S)).astype(np.int32)


def _query(rng):
    return rng.standard_normal((B, S, IN)).astype(np.float32)


class _Attend(nnx.Module):
    """Calls an embedding's attend, so a case can differentiate it like a layer."""

    def __init__(self, emb):
        self.emb = emb

    def __call__(self, q):
        return self.emb.attend(q)


CASES = {
    "column_gather": (
        lambda r: ColumnParallelLinear(IN, OUT, has_bias=True, rngs=r),
        lambda r: nnx.Linear(IN, OUT, rngs=r),
        _x,
        None,
        {"kernel": P(None, "mp"), "bias": P("mp")},
    ),
    "column_split": (
        lambda r: ColumnParallelLinear(IN, OUT, has_bias=True, gather_output=False, rngs=r),
        lambda r: nnx.Linear(IN, OUT, rngs=r),
        _x,
        "mp",
        {"kernel": P(None, "mp"), "bias": P("mp")},
    ),
    "column_no_bias": (
        lambda r: ColumnParallelLinear(IN, OUT, rngs=r),  # Paddle: has_bias=None -> no bias
        lambda r: nnx.Linear(IN, OUT, use_bias=False, rngs=r),
        _x,
        None,
        {"kernel": P(None, "mp")},
    ),
    "row_parallel_input": (
        lambda r: RowParallelLinear(OUT, IN, input_is_parallel=True, rngs=r),
        lambda r: nnx.Linear(OUT, IN, rngs=r),
        _x_out,
        None,
        {"kernel": P("mp", None), "bias": P()},
    ),
    "row_full_input": (
        lambda r: RowParallelLinear(OUT, IN, rngs=r),
        lambda r: nnx.Linear(OUT, IN, rngs=r),
        _x_out,
        None,
        {"kernel": P("mp", None), "bias": P()},
    ),
    "embedding": (
        lambda r: VocabParallelEmbedding(VOCAB, IN, rngs=r),
        lambda r: nnx.Embed(VOCAB, IN, rngs=r),
        _ids,
        None,
        {"embedding": P("mp", None)},
    ),
    "embedding_attend": (
        lambda r: _Attend(VocabParallelEmbedding(VOCAB, IN, rngs=r)),
        lambda r: _Attend(nnx.Embed(VOCAB, IN, rngs=r)),
        _query,
        "mp",
        {"emb": {"embedding": P("mp", None)}},
    ),
}


def _forward_and_grads(model, x, w, jit):
    differentiable = jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)

    def loss(m, x):
        y = m(x)
        return jnp.sum(y * w), y

    def run(m, x):
        if differentiable:
            (_, y), (gm, gx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, x)
        else:
            (_, y), gm = nnx.value_and_grad(loss, has_aux=True)(m, x)
            gx = None
        return y, gm, gx

    return (nnx.jit(run) if jit else run)(model, x)


_REFERENCES: dict = {}


def _reference(case):
    """The plain Flax layer on one device (no mesh involved), its input, output and grads."""
    if case not in _REFERENCES:
        _, build_ref, make_x, _, _ = CASES[case]
        rng = np.random.default_rng(0)
        x = make_x(rng)
        ref = build_ref(nnx.Rngs(3))
        shape = jax.eval_shape(lambda x: ref(x), x).shape
        w = rng.standard_normal(shape).astype(np.float32)
        _REFERENCES[case] = ref, x, w, _forward_and_grads(ref, x, w, jit=True)
    return _REFERENCES[case]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("hybrid", list(HYBRIDS))
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_flax_layer_on_one_device(case, hybrid, jit):
    build, _, _, last, specs = CASES[case]
    ref, x, w, (want_y, want_gm, want_gx) = _reference(case)

    init_fleet(HYBRIDS[hybrid])
    mesh = fleet_mesh()
    model = build(nnx.Rngs(3))
    # the same initial parameters as the Flax layer (the replicable init contract)
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(ref, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, **FP32, err_msg=jax.tree_util.keystr(path))
    params = nnx.state(model, nnx.Param)
    got_specs = jax.tree.map(lambda v: v.sharding.spec, nnx.to_pure_dict(params))
    assert got_specs == specs
    if case == "row_parallel_input":  # hand it an input already split over mp
        x = jax.device_put(x, named(mesh, DATA_AXES, None, MP))

    got_y, got_gm, got_gx = _forward_and_grads(model, x, w, jit=jit)
    np.testing.assert_allclose(got_y, want_y, **FP32)
    want_sharding = named(mesh, DATA_AXES, *([None] * (got_y.ndim - 2)), last)
    assert got_y.sharding.is_equivalent_to(want_sharding, got_y.ndim), got_y.sharding
    got_g = jax.tree_util.tree_leaves_with_path(nnx.state(got_gm, nnx.Param))
    want_g = jax.tree.leaves(nnx.state(want_gm, nnx.Param))
    for (path, g), wg in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(g, wg, **FP32, err_msg=jax.tree_util.keystr(path))
    if got_gx is not None:
        np.testing.assert_allclose(got_gx, want_gx, **FP32)


def test_any_input_rank_and_uneven_batch():
    init_fleet(HYBRIDS["mp4_dp2"])
    col = ColumnParallelLinear(IN, OUT, has_bias=True, gather_output=False, rngs=nnx.Rngs(0))
    ref = nnx.Linear(IN, OUT, rngs=nnx.Rngs(0))
    for shape in [(IN,), (3, IN), (2, 2, 3, IN)]:  # batch 3 is not divisible by dp 2
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        y = col(x)
        np.testing.assert_allclose(y, ref(x), **FP32)
        assert y.sharding.spec[-1] == "mp"


def test_weight_aliases_and_paddle_attributes():
    init_fleet(HYBRIDS["mp4_dp2"])
    col = ColumnParallelLinear(IN, OUT, has_bias=True, rngs=nnx.Rngs(0), name="ignored")
    row = RowParallelLinear(OUT, IN, fuse_matmul_bias=True, rngs=nnx.Rngs(0))
    emb = VocabParallelEmbedding(
        VOCAB, IN, mp_group=fleet.get_hybrid_communicate_group().get_model_parallel_group(),
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    assert col.weight is col.kernel and row.weight is row.kernel and emb.weight is emb.embedding
    assert col.has_bias and row.has_bias and col.world_size == 4 and col.is_mp
    assert col.output_size_per_partition == OUT // 4
    assert row.input_size_per_partition == OUT // 4 and emb.per_part_size == VOCAB // 4
    with pytest.raises(AttributeError):
        col.weight = col.kernel


def test_out_of_range_ids_give_zero_rows():
    init_fleet(HYBRIDS["mp4_dp2"])
    emb = VocabParallelEmbedding(VOCAB, IN, rngs=nnx.Rngs(0))
    out = nnx.jit(lambda m, i: m(i))(emb, np.array([[VOCAB, -VOCAB - 1], [-1, 0]], np.int32))
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(out[1, 0], emb.embedding[...][VOCAB - 1])


def test_low_precision_compute_dtype():
    init_fleet(HYBRIDS["mp4_dp2"])
    col = ColumnParallelLinear(IN, OUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    emb = VocabParallelEmbedding(VOCAB, IN, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda m, x: m(x))
    assert col.kernel[...].dtype == jnp.float32
    assert call(col, np.ones((2, IN), np.float32)).dtype == jnp.bfloat16
    # a bfloat16 table lookup (its psum runs in float32 on CPU, see masked_vocab_lookup)
    assert call(emb, np.ones((2, 3), np.int32)).dtype == jnp.bfloat16


# --------------------------------------------------------------- compiled HLO
def collectives(text: str) -> list[tuple[str, list[list[int]]]]:
    """(kind, replica groups) of every collective in optimised HLO text."""
    return [(c.kind, [list(g) for g in c.groups or ()]) for c in hlo.collectives(text)]


def replica_groups(line: str) -> list[list[int]]:
    return [list(g) for g in hlo.replica_groups(line)]


def test_replica_group_parser_reads_both_forms():
    assert replica_groups("replica_groups={{0,1,2,3},{4,5,6,7}}, x") == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]
    assert replica_groups("replica_groups=[2,4]<=[8], x") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    dp_groups = [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert replica_groups("replica_groups=[4,2]<=[2,4]T(1,0), x") == dp_groups
    mesh_form = (
        "replica_groups=mesh['axis_0'=4,'axis_1'=2,'axis_2'=1], device_ids=([2,4]T(1,0)) "
        "{'axis_0'}, use_global_device_ids=true"
    )
    assert replica_groups(mesh_form) == MP_GROUPS
    assert replica_groups(mesh_form.replace("{'axis_0'}", "{'axis_1'}")) == dp_groups


MP_GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = ColumnParallelLinear(IN, OUT, has_bias=True, gather_output=False, rngs=rngs)
        self.down = RowParallelLinear(OUT, IN, input_is_parallel=True, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def _hlo(model, fn, *args):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, *a: fn(nnx.merge(graphdef, s), *a)).lower(state, *args).compile()


def test_megatron_mlp_forward_has_one_all_reduce_over_mp():
    init_fleet(HYBRIDS["mp4_dp2"])
    mlp = _MLP(nnx.Rngs(0))
    x = np.ones((B, S, IN), np.float32)
    found = collectives(_hlo(mlp, lambda m, x: m(x), x).as_text())
    assert found == [("all-reduce", MP_GROUPS)], found


def test_megatron_mlp_backward_never_gathers_a_kernel():
    init_fleet(HYBRIDS["mp4_dp2"])
    mlp = _MLP(nnx.Rngs(0))
    x = np.ones((B, S, IN), np.float32)

    def grads(m, x):
        return nnx.grad(lambda m: jnp.sum(m(x)))(m)

    found = collectives(_hlo(mlp, grads, x).as_text())
    kinds = {kind for kind, _ in found}
    assert kinds <= {"all-reduce"}, found  # the mp and dp gradient reductions only


def test_row_slices_a_replicated_input_locally():
    init_fleet(HYBRIDS["mp4_dp2"])
    row = RowParallelLinear(OUT, IN, rngs=nnx.Rngs(0))  # input_is_parallel=False
    found = collectives(_hlo(row, lambda m, x: m(x), np.ones((B, S, OUT), np.float32)).as_text())
    assert found == [("all-reduce", MP_GROUPS)], found


def test_column_gather_output_all_gathers_over_mp():
    init_fleet(HYBRIDS["mp4_dp2"])
    col = ColumnParallelLinear(IN, OUT, rngs=nnx.Rngs(0))
    found = collectives(_hlo(col, lambda m, x: m(x), np.ones((B, IN), np.float32)).as_text())
    assert found == [("all-gather", MP_GROUPS)], found


def test_vocab_parallel_embedding_never_gathers_the_table():
    init_fleet(HYBRIDS["mp4_dp2"])
    emb = VocabParallelEmbedding(VOCAB, IN, rngs=nnx.Rngs(0))
    ids = np.zeros((B, S), np.int32)
    text = _hlo(emb, lambda m, i: m(i), ids).as_text()
    found = collectives(text)
    assert found == [("all-reduce", MP_GROUPS)], found
    # the reduced value is the [batch/dp, seq, hidden] output, not the table
    (reduce,) = hlo.collectives(text)
    assert reduce.bytes == (B // 2) * S * IN * 4, reduce
    # attend (a tied head) needs no communication at all
    q = np.ones((B, S, IN), np.float32)
    assert collectives(_hlo(emb, lambda m, q: m.attend(q), q).as_text()) == []


# --------------------------------------------------------------- Paddle init mode
def _shard(array, axis, r, n):
    size = array.shape[axis] // n
    return np.take(np.asarray(array), np.arange(r * size, (r + 1) * size), axis=axis)


def test_paddle_init_draws_each_shard_from_its_local_seed():
    init_fleet(HYBRIDS["mp4_dp2"])
    assert tp_random.model_parallel_random_seed(123) == 123
    tp_random.set_init_mode("paddle")
    # fan-in scaled (each shard sees its own fan-in, as in Paddle), untruncated: quick to
    # compile
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal")
    col = ColumnParallelLinear(IN, OUT, has_bias=True, kernel_init=init, rngs=nnx.Rngs(0))
    row = RowParallelLinear(OUT, IN, kernel_init=init, rngs=nnx.Rngs(0))
    emb = VocabParallelEmbedding(VOCAB, IN, embedding_init=init, rngs=nnx.Rngs(0))
    layers = [(col.kernel, 1), (row.kernel, 0), (emb.embedding, 0)]
    draw_shard = jax.jit(init, static_argnums=(1, 2))
    for draw, (param, axis) in enumerate(layers):
        assert param.sharding.spec[axis] == "mp"
        shards = [_shard(param[...], axis, r, 4) for r in range(4)]
        for r, shard in enumerate(shards):
            key = jax.random.fold_in(jax.random.key(tp_random.local_seed(123, r)), draw)
            np.testing.assert_allclose(shard, draw_shard(key, shard.shape, jnp.float32), **FP32)
        assert not np.allclose(shards[0], shards[1])
    # the replicable draw differs; biases are drawn as in replicable mode
    tp_random.set_init_mode("replicable")
    col_r = ColumnParallelLinear(IN, OUT, has_bias=True, kernel_init=init, rngs=nnx.Rngs(0))
    assert not np.allclose(col.kernel[...], col_r.kernel[...])
    np.testing.assert_array_equal(col.bias[...], col_r.bias[...])
    assert tp_random.get_rng_state_tracker().get_states_tracker()["model_parallel_rng"].draws == 3


def test_init_mode_keyword_overrides_module_mode():
    init_fleet(HYBRIDS["mp4_dp2"])
    tp_random.model_parallel_random_seed(7)
    paddle = ColumnParallelLinear(IN, OUT, init_mode="paddle", rngs=nnx.Rngs(0))
    ref = nnx.Linear(IN, OUT, use_bias=False, rngs=nnx.Rngs(0))
    replicable = ColumnParallelLinear(IN, OUT, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(replicable.kernel[...], ref.kernel[...], **FP32)
    assert not np.allclose(paddle.kernel[...], ref.kernel[...])


def test_paddle_init_at_mp1_is_the_replicable_init():
    init_fleet({"dp_degree": 8})
    tp_random.set_init_mode("paddle")  # no seed needed: mp 1 bypasses the tracker, as in Paddle
    col = ColumnParallelLinear(IN, OUT, has_bias=True, rngs=nnx.Rngs(2))
    np.testing.assert_allclose(col.kernel[...], nnx.Linear(IN, OUT, rngs=nnx.Rngs(2)).kernel[...])


def test_fleet_init_seeds_the_tracker_as_paddle_does():
    init_fleet(HYBRIDS["mp4_dp2"])  # tensor_init_seed -1: a drawn seed, as in Paddle
    layer = ColumnParallelLinear(IN, OUT, init_mode="paddle", rngs=nnx.Rngs(0))
    assert layer.kernel.shape == (IN, OUT)


def test_paddle_init_without_seed_is_a_clear_error():
    init_fleet(HYBRIDS["mp4_dp2"])
    get_rng_state_tracker().reset()  # as if no seed had been set
    with pytest.raises(RuntimeError, match="model_parallel_random_seed"):
        ColumnParallelLinear(IN, OUT, init_mode="paddle", rngs=nnx.Rngs(0))


# --------------------------------------------------------------- the engine
class _TinyTiedLM(nnx.Module):
    """Embedding -> Megatron MLP -> tied head, from TP layers or from plain Flax layers."""

    def __init__(self, tp: bool, rngs: nnx.Rngs):
        if tp:
            self.emb = VocabParallelEmbedding(VOCAB, IN, rngs=rngs)
            self.mlp = _MLP(rngs)
        else:
            self.emb = nnx.Embed(VOCAB, IN, rngs=rngs)
            self.mlp = _RefMLP(rngs)

    def __call__(self, ids):
        h = self.emb(ids)
        return self.emb.attend(h + self.mlp(h))


class _RefMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(IN, OUT, rngs=rngs)
        self.down = nnx.Linear(OUT, IN, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


def test_engine_trains_tp_model_like_flax_on_one_device():
    """distributed_model places TP params by their metadata; ZeRO-3 adds 'sharding'."""
    ids = np.random.default_rng(0).integers(0, VOCAB, (8, S + 1)).astype(np.int32)
    batch = {"x": ids[:, :-1], "y": ids[:, 1:]}

    def loss_fn(m, b):
        logits = m(b["x"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    ref = _TinyTiedLM(False, nnx.Rngs(0))
    opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    step_ref = nnx.jit(lambda m, o, b: o.update(m, nnx.grad(loss_fn)(m, b)))
    for _ in range(3):
        step_ref(ref, opt, batch)

    strategy = DistributedStrategy()
    strategy.hybrid_configs = HYBRIDS["mp2_sharding2_dp2"]
    strategy.sharding_configs = {"stage": 3}
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    model = fleet.distributed_model(_TinyTiedLM(True, nnx.Rngs(0)))
    dopt = fleet.distributed_optimizer(optax.adam(1e-2))
    step = make_train_step(loss_fn)
    for _ in range(3):
        step(model, dopt, batch)
    kernel_spec = model.module.mlp.up.kernel.sharding.spec
    assert "mp" in jax.tree.leaves(tuple(kernel_spec)) and "sharding" in str(kernel_spec)
    got = jax.tree_util.tree_leaves_with_path(nnx.state(model.module, nnx.Param))
    want = jax.tree.leaves(nnx.state(ref, nnx.Param))
    for (path, g), w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **FP32, err_msg=jax.tree_util.keystr(path))


# --------------------------------------------------------------- bad input
def test_bad_sizes_name_the_numbers():
    init_fleet(HYBRIDS["mp4_dp2"])
    with pytest.raises(ValueError, match=r"out_features=10 is not divisible by the mp degree 4"):
        ColumnParallelLinear(8, 10, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"in_features=6 is not divisible by the mp degree 4"):
        RowParallelLinear(6, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"num_embeddings=10 is not divisible by the mp degree 4"):
        VocabParallelEmbedding(10, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"in_features=0 must be a positive int"):
        ColumnParallelLinear(0, 8, rngs=nnx.Rngs(0))
    assert not RowParallelLinear(8, 8, use_bias=False, rngs=nnx.Rngs(0)).use_bias
    assert RowParallelLinear(8, 8, rngs=nnx.Rngs(0)).use_bias  # Paddle's default
    with pytest.raises(ValueError, match=r"has_bias=True .* use_bias=False"):
        ColumnParallelLinear(8, 8, has_bias=True, use_bias=False, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mp_group=.*not the fleet's model-parallel group"):
        RowParallelLinear(
            8, 8, mp_group=fleet.get_hybrid_communicate_group().get_data_parallel_group(),
            rngs=nnx.Rngs(0),
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"init_mode='megatron' must be one of"):
        ColumnParallelLinear(8, 8, init_mode="megatron", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"init_mode='x' must be one of"):
        tp_random.set_init_mode("x")


def test_bad_inputs_name_the_numbers():
    init_fleet(HYBRIDS["mp4_dp2"])
    row = RowParallelLinear(16, 8, input_is_parallel=True, rngs=nnx.Rngs(0))
    # a per-rank slice (16 / 4) instead of the global array
    with pytest.raises(ValueError, match=r"last dim 4, but in_features=16") as info:
        row(np.ones((2, 4), np.float32))
    assert "full width in_features=16" in str(info.value) and "holds 4" in str(info.value)
    with pytest.raises(ValueError, match=r"last dim 5, but in_features=16\.$"):
        RowParallelLinear(16, 8, rngs=nnx.Rngs(0))(np.ones((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 3\) has last dim 3, but in_features=8"):
        ColumnParallelLinear(8, 8, rngs=nnx.Rngs(0))(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"last dim none \(a scalar\)"):
        ColumnParallelLinear(8, 8, rngs=nnx.Rngs(0))(np.float32(1.0))
    emb = VocabParallelEmbedding(16, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"ids have dtype float32"):
        emb(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"shape \(2, 4\) must have last dim embedding_dim=8"):
        emb.attend(np.ones((2, 4), np.float32))
    # the check holds under jit too (shapes are static)
    with pytest.raises(ValueError, match=r"last dim 4, but in_features=16"):
        nnx.jit(lambda m, x: m(x))(row, np.ones((2, 4), np.float32))


def test_layers_need_a_mesh():
    with pytest.raises(RuntimeError, match=r"fleet.init\(is_collective=True"):
        ColumnParallelLinear(8, 8, rngs=nnx.Rngs(0))

"""to_distributed: every applied plan trains like one device; bad inputs are clear errors."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import DistributedStrategy, fleet, make_eval_step, make_train_step
from jfleet.auto_parallel import ToDistributedConfig, get_plan, match_patterns, planner
from jfleet.auto_parallel.apply.blocks import PipelinedBlocks
from jfleet.auto_parallel.apply.scanned_blocks import ScannedBlocks
from jfleet.auto_parallel.search.plan import spec_from_json
from jfleet.auto_parallel.to_distributed import to_distributed
from jfleet.models import lm_batches, lm_loss
from jfleet.models.gpt2 import TinyGPT2
from jfleet.models.llama import TinyLlama
from jfleet.testing import train_one_device
from tests.auto_parallel.conv_net import ConvNet

#: The module (``jfleet.auto_parallel.to_distributed`` is the function of the same name).
to_distributed_module = importlib.import_module("jfleet.auto_parallel.to_distributed")
STEPS = 10
#: fp32 Adam over 10 steps: the reductions run in another order on 8 devices.
TOL = 1e-4


def llama() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=2)


def gpt2() -> TinyGPT2:
    return TinyGPT2(vocab=64, width=32, heads=4, layers=2)


MODELS = {"llama": llama, "gpt2": gpt2}


def single_device_losses(name: str, steps: int = STEPS, batch: int = 16) -> tuple[float, ...]:
    """The first ``steps`` losses of the same training on one device (computed once)."""
    return _single_device_losses(name, max(steps, STEPS), batch)[:steps]


@functools.cache
def _single_device_losses(name: str, steps: int, batch: int) -> tuple[float, ...]:
    return tuple(adam_one_device(MODELS[name](), lm_batches(steps, batch=batch)))


def adam_one_device(model: nnx.Module, batches: list) -> list[float]:
    """Adam 1e-2 on one device: the reference every layout must meet."""
    return list(train_one_device(model, optax.adam(1e-2), batches, lm_loss)[0])


def train(model, opt, loader) -> list[float]:
    step = make_train_step(lm_loss)
    return [float(step(model, opt, batch)) for batch in loader]


def spec_of(x: jax.Array) -> P:
    return x.sharding.spec


def stack_program(model: nnx.Module, *args) -> str:
    """The traced program of a pipelined stand-in's call (nested jaxprs included)."""
    return str(jax.make_jaxpr(model.layers.run)(jnp.zeros((16, 8, 32)), *args))


def per_block(model: nnx.Module) -> dict[str, tuple[int, tuple]]:
    """``{path: (ndim, optimizer_sharding)}`` by the plain model's paths (a scanned stack's
    ``layers.body.<p>`` ``[1, L, ...]`` stands for ``layers.<i>.<p>``, its 2 axes dropped)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        layout = var.get_metadata("optimizer_sharding", None)
        if isinstance(model.layers, ScannedBlocks) and tuple(path[:2]) == ("layers", "body"):
            rest = ".".join(map(str, path[2:]))
            for i in range(model.layers.num_layers):
                out[f"layers.{i}.{rest}"] = (var.ndim - 2, layout and tuple(layout)[2:])
        else:
            out[".".join(map(str, path))] = (var.ndim, layout)
    return out


def optimizer_layouts(model: nnx.Module) -> dict[str, tuple]:
    """Each parameter's ``optimizer_sharding`` metadata (the layout of its optimizer state)."""
    return {path: layout for path, (_, layout) in per_block(model).items()}


def planned_optimizer_layouts(plan, model: nnx.Module) -> dict[str, tuple]:
    """What the plan's ZeRO specs say the optimizer layouts are, one entry per dimension."""
    ndims = {path: ndim for path, (ndim, _) in per_block(model).items()}
    return {
        p.path: tuple(p.zero_spec) + (None,) * (ndims[p.path] - len(p.zero_spec))
        for p in plan.params
    }


@pytest.mark.parametrize(
    ("mesh", "zero"),
    [
        (None, None),  # the cost model's pick
        ({"dp": 8}, 0),
        ({"dp": 2, "mp": 4}, 0),
        ({"dp": 2, "pp": 2, "mp": 2}, 0),
        ({"dp": 2, "sharding": 2, "mp": 2}, 3),
    ],
    ids=["picked", "dp8", "dp2-mp4", "dp2-pp2-mp2", "zero3-dp2-sharding2-mp2"],
)
def test_llama_trains_like_one_device(mesh, zero):
    config = ToDistributedConfig(force_mesh=mesh, zero_stage=zero)
    model, opt, loader = to_distributed(
        llama(), optax.adam(1e-2), lm_batches(STEPS), device_num=8, config=config
    )
    plan = get_plan(model)
    if mesh is not None:
        assert {a: n for a, n in plan.mesh_shape.items() if n > 1} == mesh
    degrees = plan.mesh_shape
    # The plan is applied, not only computed: parameters sit where the plan says.
    if degrees["pp"] > 1:
        assert isinstance(model.layers, PipelinedBlocks)
        q = model.layers.body.self_attn.q_proj.kernel[...]
        assert q.shape == (2, 1, 32, 32)
        assert spec_of(q) == P("pp", None, None, "mp")
    elif isinstance(model.layers, ScannedBlocks):  # one scan over the stacked blocks
        q = model.layers.body.self_attn.q_proj.kernel[...]
        assert q.shape == (1, 2, 32, 32)
        want = plan.zero_specs if zero == 3 else plan.specs  # ZeRO-3: split between steps
        assert spec_of(q) == P(None, None, *want["layers.0.self_attn.q_proj.kernel"])
    else:
        q = model.layers[0].self_attn.q_proj.kernel[...]
        want = plan.zero_specs if zero == 3 else plan.specs
        assert spec_of(q) == want["layers.0.self_attn.q_proj.kernel"]
        if degrees["mp"] > 1:
            assert "mp" in jax.tree.leaves(tuple(spec_of(q)))
    if zero:
        moments = [
            x for x in jax.tree.leaves(nnx.state(opt)) if getattr(x, "shape", ())[-2:] == (32, 32)
        ]
        assert moments and all("sharding" in str(spec_of(x)) for x in moments)
        assert optimizer_layouts(model) == planned_optimizer_layouts(plan, model)
    batch = next(iter(loader))
    assert spec_of(batch["tokens"]) == P(("dp", "sharding", "ep"))  # the data axes
    losses = train(model, opt, loader)
    np.testing.assert_allclose(losses, single_device_losses("llama"), rtol=0, atol=TOL)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    "mesh", [{"dp": 2, "mp": 4}, {"dp": 2, "pp": 2, "mp": 2}], ids=["dp2-mp4", "dp2-pp2-mp2"]
)
def test_gpt2_with_fused_qkv_and_tied_head_trains_like_one_device(mesh):
    model, opt, loader = to_distributed(
        gpt2(), optax.adam(1e-2), lm_batches(STEPS), config=ToDistributedConfig(force_mesh=mesh)
    )
    plan = get_plan(model)
    assert plan.spec("h.0.attn.c_attn.bias") == P("mp")
    assert "tied head" in plan.architecture
    losses = train(model, opt, loader)
    np.testing.assert_allclose(losses, single_device_losses("gpt2"), rtol=0, atol=TOL)


def test_own_nnx_jit_step_works_on_the_returned_objects():
    model, opt, loader = to_distributed(
        llama(),
        nnx.Optimizer(llama(), optax.adam(1e-2), wrt=nnx.Param),
        lm_batches(4),
        config=ToDistributedConfig(force_mesh={"dp": 2, "mp": 4}),
    )
    assert type(model) is TinyLlama

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lm_loss)(model, batch)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, b)) for b in loader]
    np.testing.assert_allclose(losses, single_device_losses("llama", 4), rtol=0, atol=TOL)


def test_recompute_sequence_parallel_and_a_device_subset():
    # 6 of the 8 devices (Paddle refuses anything but its table), recompute and SP on.
    config = ToDistributedConfig(
        force_mesh={"dp": 3, "mp": 2}, recompute=True, sequence_parallel=True
    )
    model, opt, loader = to_distributed(
        llama(), optax.adam(1e-2), lm_batches(3, batch=12), device_num=6, config=config
    )
    plan = get_plan(model)
    assert plan.recompute and plan.sequence_parallel and plan.device_num == 6
    mesh = fleet.get_hybrid_communicate_group().mesh
    assert mesh.devices.size == 6

    @nnx.jit
    def block_output(model, x):
        (blocks,) = model.layers  # the blocks, scanned: one callable
        return blocks(x)

    # Sequence parallel: a block's output leaves it split over mp on the sequence axis.
    y = block_output(model, jnp.zeros((12, 8, 32)))
    want = NamedSharding(mesh, P(("dp", "sharding"), "mp", None))
    assert y.sharding.is_equivalent_to(want, 3), y.sharding
    losses = train(model, opt, loader)
    np.testing.assert_allclose(losses, single_device_losses("llama", 3, 12), rtol=0, atol=TOL)


def test_pipelined_recompute_and_a_reproduced_plan():
    config = ToDistributedConfig(force_mesh={"dp": 4, "pp": 2}, recompute=True)
    model, opt, loader = to_distributed(llama(), optax.adam(1e-2), lm_batches(3), config=config)
    first = get_plan(model)
    assert first.recompute and isinstance(model.layers, PipelinedBlocks)
    # FThenB with recompute runs 1F1B's program: the backward loop recomputes each stage
    # from its stashed input (no jax.checkpoint inside; test_cost_model's
    # test_pipelined_recompute_matches_the_compiled_step: memory and FLOPs as charged)
    assert model.layers.schedule == "FThenB" and "remat" not in stack_program(model)
    losses = train(model, opt, loader)
    np.testing.assert_allclose(losses, single_device_losses("llama", 3), rtol=0, atol=TOL)

    fleet._fleet._reset()
    again = ToDistributedConfig(plan=first.to_json())
    model, opt, loader = to_distributed(llama(), optax.adam(1e-2), lm_batches(3), config=again)
    assert get_plan(model) == first
    # the same plan on the same mesh compiles the same program: bit-identical losses
    assert train(model, opt, loader) == losses


def test_a_generator_loader_is_read_once_and_sharded():
    def batches():
        yield from lm_batches(3)

    model, _, loader = to_distributed(llama(), optax.sgd(0.1), batches())
    placed = list(loader)
    assert len(placed) == 3  # the batch peeked for planning is not lost
    assert all(spec_of(b["labels"]) == P(("dp", "sharding", "ep")) for b in placed)
    assert get_plan(model).optimizer == "sgd"


def test_the_model_is_matched_once_and_the_plans_zero_specs_are_applied(monkeypatch):
    calls = []

    def counted(model, *args, **kwargs):
        calls.append(type(model).__name__)
        return match_patterns(model, *args, **kwargs)

    monkeypatch.setattr(to_distributed_module, "match_patterns", counted)
    monkeypatch.setattr(planner, "match_patterns", counted)
    config = ToDistributedConfig(force_mesh={"dp": 2, "sharding": 2, "mp": 2}, zero_stage=1)
    model, _, _ = to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)
    assert calls == ["TinyLlama"]
    plan = get_plan(model)
    assert plan.zero_stage == 1
    layouts = optimizer_layouts(model)
    assert layouts == planned_optimizer_layouts(plan, model)
    assert any("sharding" in str(spec) for spec in layouts.values())


def test_a_given_plans_zero_spec_is_the_optimizer_state_layout():
    """A plan's ZeRO layouts are applied as they are, not recomputed by the placement."""
    config = ToDistributedConfig(force_mesh={"dp": 2, "sharding": 2, "mp": 2}, zero_stage=1)
    model, _, _ = to_distributed(
        llama(), optax.sgd(0.1, momentum=0.9), lm_batches(1), config=config
    )
    stored = json.loads(get_plan(model).to_json())
    fleet._reset()
    (entry,) = [p for p in stored["params"] if p["path"] == "lm_head"]
    assert spec_from_json(entry["zero_spec"]) == P("sharding", "mp")  # what zero_spec picks
    entry["zero_spec"] = [None, ["sharding", "mp"]]  # a layout of the plan's own
    config = ToDistributedConfig(plan=json.dumps(stored))
    model, opt, _ = to_distributed(
        llama(), optax.sgd(0.1, momentum=0.9), lm_batches(1), config=config
    )
    assert model.lm_head.get_metadata("optimizer_sharding") == (None, ("sharding", "mp"))
    momentum = opt.opt_state[0].trace["lm_head"]
    assert spec_of(momentum[...]) == P(None, ("sharding", "mp"))


def test_the_config_is_frozen():
    config = ToDistributedConfig(zero_stage=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.zero_stage = 2
    assert dataclasses.replace(config, zero_stage=2).zero_stage == 2


def test_a_given_plan_checks_the_loaders_batch():
    model, _, _ = to_distributed(
        llama(), optax.sgd(0.1), lm_batches(1), config=ToDistributedConfig(force_mesh={"dp": 8})
    )
    plan = get_plan(model)
    fleet._fleet._reset()
    with pytest.raises(
        ValueError,
        match=r"batch size is 12, which the data-parallel size 8 \(dp 8 x sharding 1\) does not "
        r"divide; plan dp8 needs a batch size that is a multiple of 8",
    ):
        to_distributed(
            llama(), optax.sgd(0.1), lm_batches(1, batch=12), config=ToDistributedConfig(plan=plan)
        )


def conv_loss(model: nnx.Module, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def test_an_unrecognised_model_runs_data_parallel_with_a_warning(caplog):
    rng = np.random.default_rng(0)
    data = [
        {"x": rng.normal(size=(8, 6, 6, 1)).astype(np.float32), "y": rng.normal(size=8)}
        for _ in range(3)
    ]
    with caplog.at_level(logging.WARNING, logger="jfleet"):
        model, opt, loader = to_distributed(ConvNet(), optax.sgd(0.1), data)
    assert "conv.kernel" in caplog.text and "data parallel" in caplog.text
    assert get_plan(model).mesh_shape["dp"] == 8
    step = make_train_step(conv_loss)
    losses = [float(step(model, opt, b)) for b in loader]

    expected, _ = train_one_device(ConvNet(), optax.sgd(0.1), data, conv_loss)
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)


class NoParams(nnx.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return x


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1), device_num=16),
         ValueError, r"device_num=16 x node_num=1 = 16 devices .* only 8"),
        (lambda: to_distributed(NoParams(), optax.sgd(0.1), lm_batches(1)),
         ValueError, "NoParams has no nnx.Param"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1, batch=12),
                                config=ToDistributedConfig(force_mesh={"dp": 8})),
         ValueError, r"dp x sharding = 8 does not divide batch_size=12"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1),
                                config=ToDistributedConfig(force_mesh={"dp": 3, "mp": 2})),
         ValueError, r"multiplies out to dp3 x mp2 = 6"),
        (lambda: to_distributed(llama(), "adam", lm_batches(1)),
         TypeError, "'adam'.*optax"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1),
                                config=ToDistributedConfig(schedule="2F2B")),
         ValueError, "'2F2B' is not a pipeline schedule"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1),
                                config=ToDistributedConfig(num_virtual_pipeline_stages=0)),
         ValueError, r"config.num_virtual_pipeline_stages=0 must be an int >= 1"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=ToDistributedConfig(
            schedule="FThenB", num_virtual_pipeline_stages=2)),
         ValueError, r"config.schedule='FThenB' with config.num_virtual_pipeline_stages=2"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=ToDistributedConfig(
            force_mesh={"dp": 4, "pp": 2}, schedule="VPP")),
         ValueError, r"dp4 x pp2: VPP needs .* a block in each of the pp x 2 virtual stages"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), []),
         ValueError, "no batch"),
        (lambda: to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config={"dp": 8}),
         TypeError, "ToDistributedConfig"),
        (lambda: get_plan(llama()),
         ValueError, "not returned by to_distributed"),
    ],
    ids=["too-many-devices", "no-params", "batch-not-divisible", "mesh-product",
         "not-an-optimizer", "1f1b", "vpp-count", "vpp-schedule", "vpp-blocks", "empty-loader",
         "config-type", "get-plan"],
)  # fmt: skip
def test_bad_inputs_are_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_later_batch_not_divisible_by_the_data_parallel_size_is_an_error():
    data = lm_batches(1, batch=16) + lm_batches(1, batch=12)
    _, _, loader = to_distributed(
        llama(), optax.sgd(0.1), data, config=ToDistributedConfig(force_mesh={"dp": 8})
    )
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError, match=r"batch size 12.*data-parallel size 8"):
        next(it)


class InputSpec:
    """Paddle's ``InputSpec(shape, dtype, name)``: -1 marks a dimension left open."""

    def __init__(self, shape: list[int], dtype: str, name: str) -> None:
        self.shape, self.dtype, self.name = tuple(shape), dtype, name


def test_input_spec_states_the_shapes_the_cost_model_plans_for():
    spec = [InputSpec([-1, 128], "int64", "tokens"), InputSpec([-1, 128], "int64", "labels")]
    config = ToDistributedConfig(input_spec=spec)
    model, _, _ = to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)
    plan = get_plan(model)
    assert (plan.batch_size, plan.seq_len) == (16, 128)  # batch from the loader, seq stated


def test_a_returned_model_is_not_distributed_twice():
    config = ToDistributedConfig(force_mesh={"dp": 4, "pp": 2})
    model, _, _ = to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)
    with pytest.raises(ValueError, match=r"already returned by to_distributed \(plan dp4 x pp2"):
        to_distributed(model, optax.sgd(0.1), lm_batches(1))


def test_a_plan_for_another_model_is_refused():
    model, _, _ = to_distributed(gpt2(), optax.sgd(0.1), lm_batches(1))
    plan = get_plan(model)
    fleet._fleet._reset()
    config = ToDistributedConfig(plan=plan)
    with pytest.raises(ValueError, match="does not match the plan"):
        to_distributed(llama(), optax.sgd(0.1), lm_batches(1), config=config)


def test_the_config_strategy_adds_meta_optimizers_and_eval_runs_the_pipeline():
    strategy = DistributedStrategy()
    strategy.gradient_merge = True
    strategy.gradient_merge_configs = {"k_steps": 2, "avg": True}
    strategy.hybrid_configs = {"mp_degree": 8}  # replaced by the plan's degrees
    config = ToDistributedConfig(force_mesh={"dp": 4, "pp": 2}, strategy=strategy)
    model, opt, loader = to_distributed(llama(), optax.adam(1e-2), lm_batches(2), config=config)
    assert "GradientMergeOptimizer" in opt.applied_meta_list
    assert fleet.get_hybrid_communicate_group().get_model_parallel_world_size() == 1
    batches = list(loader)
    before = float(make_eval_step(lm_loss)(model, batches[0]))
    assert abs(before - single_device_losses("llama", 1)[0]) < TOL  # the pipelined forward
    kernel = model.layers.body.mlp.up_proj.kernel
    start = np.asarray(kernel[...])
    step = make_train_step(lm_loss)
    step(model, opt, batches[0])
    np.testing.assert_array_equal(np.asarray(kernel[...]), start)  # merged, not applied
    step(model, opt, batches[1])
    assert not np.allclose(np.asarray(kernel[...]), start)  # applied at the k-th step


def test_a_sep_axis_splits_the_sequence_between_pipelined_blocks():
    config = ToDistributedConfig(force_mesh={"dp": 2, "pp": 2, "sep": 2}, sequence_parallel=True)
    model, opt, loader = to_distributed(llama(), optax.adam(1e-2), lm_batches(3), config=config)
    assert model.layers.seq_axes == ("sep",)
    assert "sharding_constraint" in stack_program(model)  # pinned between the blocks
    losses = train(model, opt, loader)
    np.testing.assert_allclose(losses, single_device_losses("llama", 3), rtol=0, atol=TOL)


class ArgBlock(nnx.Module):
    """A block that takes a per-sample mask, a shared table and a Python flag."""

    def __init__(self, width: int, rngs: nnx.Rngs) -> None:
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, use_bias=False, rngs=rngs)

    def __call__(self, x, mask, table, *, deterministic: bool = True):
        h = self.down(jax.nn.gelu(self.up(self.norm(x)))) * mask[..., None] + table
        return x + (h if deterministic else 2 * h)


class ArgModel(nnx.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 4) -> None:
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.layers = nnx.List([ArgBlock(width, rngs) for _ in range(layers)])
        self.head = nnx.Linear(width, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = (tokens % 3 != 0).astype(x.dtype)
        seq, width = x.shape[1], x.shape[2]
        table = 0.01 * jnp.sin(jnp.arange(seq)[:, None] * jnp.arange(width)[None, :])
        for layer in self.layers:
            x = layer(x, mask, table, deterministic=True)
        return x @ self.head.kernel[...]


@pytest.mark.parametrize(
    ("mesh", "batch", "per_sample"),
    [({"dp": 4, "pp": 2}, 16, None), ({"dp": 2, "pp": 2, "mp": 2}, 8, (0,)), ({"dp": 8}, 8, None)],
    ids=["pp-by-shape", "pp-declared", "recompute-no-pp"],
)
def test_blocks_with_masks_tables_and_flags(mesh, batch, per_sample):
    data = lm_batches(2, batch=batch)
    config = ToDistributedConfig(force_mesh=mesh, recompute=True, per_sample_args=per_sample)
    model, opt, loader = to_distributed(ArgModel(), optax.adam(1e-2), data, config=config)
    # pipelined or scanned (no pipeline), each block recomputed inside the stack's loop
    assert model.layers.recompute
    losses = train(model, opt, loader)
    np.testing.assert_allclose(losses, adam_one_device(ArgModel(), data), rtol=0, atol=TOL)


def test_a_batch_sized_argument_that_could_be_a_table_is_told_apart_by_the_trace():
    # batch 8 x seq 8: the mask [8, 8] and the table [8, 32] both lead with 8; traced again
    # at twice the batch, only the mask grows with it, so it alone is split per micro-batch
    config = ToDistributedConfig(force_mesh={"dp": 4, "pp": 2})
    model, _, _ = to_distributed(ArgModel(), optax.sgd(0.1), lm_batches(1, batch=8), config=config)
    assert model.layers.per_sample == (0,)

"""jfleet.checkpoint: a resumed run equals the uninterrupted one, on the same mesh and others."""

from __future__ import annotations

import itertools
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.auto_parallel import ToDistributedConfig
from jfleet.auto_parallel.apply.blocks import PipelinedBlocks
from jfleet.auto_parallel.to_distributed import to_distributed
from jfleet.checkpoint import CheckpointManager, layout
from jfleet.mesh.placement import Placement
from jfleet.mesh.topology import DP, MP, PP, SHARDING
from jfleet.models import TinyLM, lm_batches, lm_loss
from jfleet.models.llama import TinyLlama
from jfleet.parallel.pipeline_layer import LayerDesc, PipelineLayer
from jfleet.testing import assert_trees_close, make_strategy
from jfleet.training.data import ShardedLoader
from jfleet.training.engine import make_train_step
from tests.subprocess_util import run_python

# A failed tensorstore read (the truncated-file case) leaves callbacks that report to Orbax's
# closed event loop later, during whichever test runs then: harmless, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEPS, SAVE_AT = 6, 3
PIPELINE = {"dp": 2, "pp": 2, "mp": 2}


def llama() -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=4)


def build(mesh: dict, **config):
    return to_distributed(
        llama(),
        optax.adam(1e-2),
        lm_batches(STEPS, batch=16),
        config=ToDistributedConfig(force_mesh=mesh, **config),
    )


def train(model, opt, batches) -> list[float]:
    step = make_train_step(lm_loss)
    return [float(step(model, opt, b)) for b in batches]


def saved_run(tmp_path_factory, mesh: dict) -> tuple[list[float], object]:
    """6 steps on ``mesh``, saved (async) after step 3: losses, directory."""
    directory = tmp_path_factory.mktemp("ckpt")
    model, opt, loader = build(mesh)
    batches = iter(loader)
    losses = train(model, opt, itertools.islice(batches, SAVE_AT))
    with CheckpointManager(directory, max_to_keep=2) as mngr:
        assert mngr.save(SAVE_AT, model, opt, loader=loader, extra={"losses": losses})
        losses += train(model, opt, batches)
    return losses, directory


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The dp2 x pp2 x mp2 run (pipelined blocks), saved after step 3."""
    return saved_run(tmp_path_factory, PIPELINE)


@pytest.fixture(scope="module")
def reference_dp8(tmp_path_factory):
    """The dp8 run, saved after step 3."""
    return saved_run(tmp_path_factory, {"dp": 8})


def resumed(reference, mesh: dict, **config) -> tuple[list[float], dict, object]:
    directory = reference[1]
    model, opt, loader = build(mesh, **config)
    with CheckpointManager(directory) as mngr:
        meta = mngr.restore(model=model, optimizer=opt, loader=loader)
    return train(model, opt, loader), meta, (model, opt)


def test_resume_on_the_same_mesh_is_bit_exact_and_continues_the_data(reference):
    losses, directory = reference
    got, meta, (_, opt) = resumed(reference, PIPELINE)
    assert got == losses[SAVE_AT:]  # bit for bit; the loader gave batches 3, 4, 5
    assert meta["step"] == SAVE_AT and meta["extra"] == {"losses": losses[:SAVE_AT]}
    assert meta["mesh_shape"] == {"dp": 2, "pp": 2, "sharding": 1, "sep": 1, "ep": 1, "mp": 2}
    assert meta["plan"]["mesh"]["pp"] == 2
    assert int(opt.step[...]) == STEPS
    # on disk: the plain model's per-layer paths, no stacked [pp, L/pp, ...] leaf
    names = {p.name for p in (directory / str(SAVE_AT) / "state").iterdir()}
    assert "_METADATA" in names
    with CheckpointManager(directory) as mngr:
        stored = mngr._mngr.item_metadata(SAVE_AT)["state"]
    layer = stored["model"]["layers"]["3"]["mlp"]["up_proj"]["kernel"]
    assert tuple(layer.shape) == (32, 64) and "body" not in stored["model"]["layers"]
    assert tuple(
        stored["optimizer"]["opt_state"]["0"]["mu"]["layers"]["3"]["mlp"]["up_proj"]["kernel"].shape
    ) == (32, 64)


@pytest.mark.parametrize(
    ("source", "mesh"),
    [
        ("reference", {"dp": 8}),
        ("reference", {"dp": 2, "pp": 4}),
        ("reference_dp8", {"dp": 2, "mp": 4}),
    ],
    ids=["dp2-pp2-mp2-to-dp8", "pp2-to-pp4", "dp8-to-dp2-mp4"],
)
def test_resume_on_another_mesh_matches(request, source, mesh):
    run = request.getfixturevalue(source)
    got, _, (model, _) = resumed(run, mesh)
    np.testing.assert_allclose(got, run[0][SAVE_AT:], rtol=0, atol=1e-5)
    if mesh.get("pp", 1) > 1:  # restacked into this mesh's [pp, L/pp, ...]
        kernel = model.layers.body.mlp.up_proj.kernel[...]
        assert kernel.shape[:2] == (4, 1) and kernel.sharding.spec[0] == PP


# ---------------------------------------------------------------- cheap objects, bad input
def linear(seed: int = 0, width: int = 2):
    model = nnx.Linear(width, 2, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def test_interval_max_to_keep_and_steps(tmp_path):
    model, opt = linear()
    with CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2) as mngr:
        saved = [mngr.save(s, model, opt) for s in range(1, 7)]
        mngr.wait_until_finished()
        assert saved == [False, True, False, True, False, True]
        assert mngr.all_steps() == [4, 6] and mngr.latest_step() == 6
    (tmp_path / "8.orbax-checkpoint-tmp-123").mkdir()  # a partial write
    with CheckpointManager(tmp_path) as again:
        assert again.latest_step() == 6


def test_bad_inputs_are_clear_errors(tmp_path):
    model, opt = linear()
    with pytest.raises(ValueError, match=r"save_interval_steps=0: expected an int >= 1"):
        CheckpointManager(tmp_path, save_interval_steps=0)
    with pytest.raises(ValueError, match=r"max_to_keep=0: expected None"):
        CheckpointManager(tmp_path, max_to_keep=0)
    with (
        CheckpointManager(tmp_path / "empty") as empty,
        pytest.raises(FileNotFoundError, match=r"no checkpoint in .*empty"),
    ):
        empty.restore(model=model, optimizer=opt)
    mngr = CheckpointManager(tmp_path / "run", async_save=False)
    mngr.save(1, model, opt)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 5 in .*run; its steps"):
        mngr.restore(5, model=model, optimizer=opt)
    wide, wide_opt = linear(width=3)
    with pytest.raises(ValueError, match=r"another model: model leaf 'kernel' has shape \(2, 2\)"):
        mngr.restore(model=wide, optimizer=wide_opt)
    other = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"another model: model leaf 'layers.0.bias'"):
        mngr.restore(model=other, optimizer=nnx.Optimizer(other, optax.adam(1e-2), wrt=nnx.Param))
    with pytest.raises(ValueError, match=r"holds no data position: it was saved without loader"):
        mngr.restore(model=model, optimizer=opt, loader=object())
    for data in (tmp_path / "run" / "1" / "state" / "d").iterdir():  # truncate the array data
        data.write_bytes(data.read_bytes()[:3])
    with pytest.raises(ValueError, match=r"run/1 could not be read .*damaged or truncated"):
        mngr.restore(model=model, optimizer=opt)
    mngr.close()


# ---------------------------------------------------------------- Fleet runs (TinyLM)
def fleet_losses(strategy, batches, directory, *, restore=False):
    """Trains a fresh Fleet TinyLM on ``batches``, saving after SAVE_AT steps (or restoring
    first): the losses, the model's and optimizer's states at the checkpoint (saved or just
    restored) and the loss scale."""
    fleet._reset()
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    model = fleet.distributed_model(TinyLM())
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    losses, state = [], None
    with CheckpointManager(directory, async_save=False) as mngr:
        for i, batch in enumerate([None, *batches] if restore else batches):
            if (i == 0) if restore else (i == SAVE_AT):
                if restore:
                    mngr.restore(model=model, optimizer=opt)
                else:
                    mngr.save(SAVE_AT, model, opt)
                state = jax.tree.map(np.asarray, (nnx.state(model), nnx.state(opt)))
                scale = fleet.get_loss_scaling() if opt.has_loss_scaling else None
            if batch is not None:
                losses.append(float(model.train_batch(batch, opt, loss_fn=lm_loss)))
    return losses, state, scale


FP16_O2 = {
    "amp": True,
    "amp_configs": {
        "use_pure_fp16": True,
        "init_loss_scaling": 1024.0,
        "incr_every_n_steps": 2,
        "decr_every_n_nan_or_inf": 3,
    },
}
MOVES = {
    "zero3-sharding8-to-zero1-dp2xsharding4": (
        make_strategy({"sharding_degree": 8}, sharding_configs={"stage": 3}),
        make_strategy({"dp_degree": 2, "sharding_degree": 4}, sharding_configs={"stage": 1}),
    ),
    "fp16-o2-loss-scale": (make_strategy({"dp_degree": 8}, **FP16_O2),) * 2,
    # a mesh with an expert axis saves and restores like any other
    "dp2xep4-to-zero1-dp2xsharding4": (
        make_strategy({"dp_degree": 2, "ep_degree": 4}),
        make_strategy({"dp_degree": 2, "sharding_degree": 4}, sharding_configs={"stage": 1}),
    ),
    "dp8-to-dp2xep4": (
        make_strategy({"dp_degree": 8}),
        make_strategy({"dp_degree": 2, "ep_degree": 4}),
    ),
    "gradient-merge-k4-mid-accumulation": (
        make_strategy({"dp_degree": 8}, gradient_merge=True, gradient_merge_configs={"k_steps": 4}),
    )
    * 2,
}


@pytest.mark.parametrize("move", list(MOVES))
def test_fleet_resume_equals_the_uninterrupted_run(move, tmp_path):
    save_with, restore_with = MOVES[move]
    batches = lm_batches(STEPS)
    want, saved, scale = fleet_losses(save_with, batches, tmp_path)
    got, restored, restored_scale = fleet_losses(
        restore_with, batches[SAVE_AT:], tmp_path, restore=True
    )
    # parameters and the whole optimizer state (moments, loss scale and counters,
    # accumulator, step)
    assert_trees_close(restored, saved, rtol=0, atol=0)
    if move.startswith("fp16"):  # 1024 doubled after 2 good steps; step 3 counted once
        assert scale == restored_scale == 2048.0
    if save_with is restore_with:
        assert got == want[SAVE_AT:]
    else:
        np.testing.assert_allclose(got, want[SAVE_AT:], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- PipelineLayer -> plain model
class Dense(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


DESCS = [LayerDesc(nnx.Linear, 4, 8)] + [LayerDesc(Dense, 8)] * 4 + [LayerDesc(nnx.Linear, 8, 4)]


class Plain(nnx.Module):
    """The same layer list as ``DESCS``, run in order: no pipeline."""

    def __init__(self, seed: int) -> None:
        self.layers = nnx.List([d.build_layer(nnx.Rngs(seed)) for d in DESCS])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_pipeline_layer_resumes_as_the_plain_model_of_its_layers(tmp_path):
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(16, 4)).astype("f4"),) * 2 for _ in range(STEPS)]
    strategy = make_strategy(
        {"dp_degree": 4, "pp_degree": 2},
        pipeline_configs={"micro_batch_size": 2, "accumulate_steps": 2},
    )
    fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
    layer = PipelineLayer(DESCS, loss_fn=mse, seg_method="layer:Dense", seed=0)
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(optax.adam(1e-2))
    want = []
    with CheckpointManager(tmp_path, async_save=False) as mngr:
        for i, batch in enumerate(data):
            if i == SAVE_AT:
                mngr.save(SAVE_AT, model, opt)
                stacked = np.asarray(layer.body.linear.kernel[...])  # [2 stages, 2, 8, 8]
            want.append(float(model.train_batch(batch, opt)))
        fleet._reset()
        plain = Plain(seed=1)  # other values: the restore must overwrite them all
        plain_opt = nnx.Optimizer(plain, optax.adam(1e-2), wrt=nnx.Param)
        mngr.restore(model=plain, optimizer=plain_opt)
        stored = mngr._mngr.item_metadata(SAVE_AT)["state"]["model"]
    assert sorted(stored["layers"]) == [str(i) for i in range(6)]
    np.testing.assert_array_equal(  # body layer 3 (stage 1, row 0 of the stack)
        plain.layers[3].linear.kernel[...], stacked[1, 0]
    )

    @nnx.jit
    def step(m, o, x, y):
        loss, grads = nnx.value_and_grad(lambda m: mse(m(x), y))(m)
        o.update(m, grads)
        return loss

    got = [float(step(plain, plain_opt, *batch)) for batch in data[SAVE_AT:]]
    np.testing.assert_allclose(got, want[SAVE_AT:], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- the logical layout itself
class Alternating(nnx.Module):
    """A block whose static setting alternates: to_distributed stacks pairs (period 2)."""

    def __init__(self, flip: bool, rngs: nnx.Rngs) -> None:
        self.flip = flip
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return -self.linear(x) if self.flip else self.linear(x)


class Holder(nnx.Module):
    def __init__(self, layers) -> None:
        self.layers = layers


@pytest.mark.parametrize("virtual", [1, 2])  # 2: interleaved, device s holds chunks s, s + 2
def test_super_blocks_map_to_per_layer_leaves_and_back(virtual):
    blocks = [Alternating(i % 2 == 1, nnx.Rngs(i)) for i in range(8)]
    kernels = [np.asarray(b.linear.kernel[...]) for b in blocks]
    mesh = jax.make_mesh((4, 2), (DP, PP), axis_types=(AxisType.Auto,) * 2)
    model = Holder(
        PipelinedBlocks(
            blocks, mesh=mesh, num_microbatches=2, schedule="VPP" if virtual > 1 else "FThenB",
            num_virtual_stages=virtual,
        )
    )  # fmt: skip
    stacked = np.asarray(model.layers.body.layers[1].linear.kernel[...])  # the odd layers
    assert model.layers.period == 2 and stacked.shape[:2] == (2, 2)
    # unit (s, k) holds super-block (k P + s) interleaved, else (s L + k): its odd layer
    unit = (lambda s, k: k * 2 + s) if virtual > 1 else (lambda s, k: s * 2 + k)
    for s, k in np.ndindex(2, 2):
        np.testing.assert_array_equal(stacked[s, k], kernels[2 * unit(s, k) + 1])
    flat = layout.logical_leaves(model, model)
    assert sorted(flat) == sorted(
        f"layers.{i}.linear.{n}" for i in range(8) for n in ("bias", "kernel")
    )
    for i, want in enumerate(kernels):
        np.testing.assert_array_equal(flat[f"layers.{i}.linear.kernel"], want)
    model.layers.body.layers[1].linear.kernel[...] = jnp.zeros_like(stacked)
    layout.running_values(model, model, flat)  # back into [P, L/(pP), ...]
    np.testing.assert_array_equal(model.layers.body.layers[1].linear.kernel[...], stacked)


def test_unsupported_layouts_and_positions_are_clear_errors():
    mixed = [LayerDesc(nnx.Linear, 4, 8), LayerDesc(Dense, 8), LayerDesc(nnx.Linear, 8, 4)]
    flat_stages = PipelineLayer(mixed, num_stages=3, seed=0)  # stages of different layers
    assert flat_stages.stages is not None
    with pytest.raises(NotImplementedError, match=r"PipelineLayer with stages of different layers"):
        layout.logical_leaves(flat_stages, flat_stages)
    loader = ShardedLoader([np.zeros((8, 1))], Placement(jax.make_mesh((4, 2), (DP, SHARDING))))
    with pytest.raises(ValueError, match=r"restore\(state=\{'batches': -1\}\): expected"):
        loader.restore({"batches": -1})


# ---------------------------------------------------------------- kill -9 during an async save
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    code = f"""
        import os, signal, optax
        from flax import nnx
        from jfleet.checkpoint import CheckpointManager
        model = nnx.Linear(2048, 2048, rngs=nnx.Rngs(0))  # 16 MiB, 48 with Adam's moments
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        mngr = CheckpointManager({str(tmp_path)!r})
        mngr.save(1, model, opt)
        mngr.wait_until_finished()
        model.kernel[...] = model.kernel[...] + 1
        mngr.save(2, model, opt)  # returns while the files are written
        os.kill(os.getpid(), signal.SIGKILL)
    """
    child = run_python(code, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert any(p.name.startswith("2.orbax-checkpoint-tmp") for p in tmp_path.iterdir())  # partial
    model = nnx.Linear(2048, 2048, rngs=nnx.Rngs(1))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with CheckpointManager(tmp_path) as mngr:
        assert mngr.latest_step() == 1 and mngr.all_steps() == [1]
        mngr.restore(model=model, optimizer=opt)
    want = nnx.Linear(2048, 2048, rngs=nnx.Rngs(0)).kernel[...]
    np.testing.assert_array_equal(model.kernel[...], want)


# ---------------------------------------------------------------- colliding saves, unfit meshes
def test_colliding_saves_foreign_files_and_in_flight_restores(tmp_path):
    model, opt = linear()
    with pytest.raises(NotADirectoryError, match=r"afile is a file: expected a directory"):
        (tmp_path / "afile").write_text("x")
        CheckpointManager(tmp_path / "afile")
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("not a checkpoint")  # ignored
    (run / "9").mkdir()  # named like a step, not a checkpoint
    (run / "8.orbax-checkpoint-tmp-1").mkdir()  # another process's unfinished save of step 8
    with (
        CheckpointManager(run) as mngr,
        pytest.raises(ValueError, match=r"run/9 is named like a step but is not a checkpoint"),
    ):
        mngr.save(2, model, opt)
    (run / "9").rmdir()
    with CheckpointManager(run) as mngr:
        assert mngr.save(2, model, opt)  # async: in flight
        with pytest.raises(ValueError, match=r"step 2 already has a checkpoint in .*being saved"):
            mngr.save(2, model, opt)
        fresh, fresh_opt = linear(seed=1)
        assert mngr.restore(2, model=fresh, optimizer=fresh_opt)["step"] == 2  # waits for it
        np.testing.assert_array_equal(fresh.kernel[...], model.kernel[...])
        assert mngr.all_steps() == [2]
        with pytest.raises(ValueError, match=r"step 2 already has a checkpoint in .*steps \[2\]"):
            mngr.save(2, model, opt)
        with pytest.raises(ValueError, match=r"step 1 is before the latest checkpoint's step 2"):
            mngr.save(1, model, opt)
        with pytest.raises(
            FileNotFoundError, match=r"8.orbax-checkpoint-tmp-1 is a save of it not"
        ):
            mngr.restore(8, model=model, optimizer=opt)
    assert sorted(p.name for p in run.iterdir()) == [
        ".jfleet-writer.lock",
        "2",
        "8.orbax-checkpoint-tmp-1",
        "notes.txt",
    ]


def test_a_mesh_that_does_not_divide_a_stored_shape_is_named(tmp_path):
    saved = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, saved, nnx.Optimizer(saved, optax.adam(1e-2), wrt=nnx.Param))
        mesh = jax.make_mesh((4, 2), (MP, DP), axis_types=(AxisType.Explicit,) * 2)
        wide = nnx.Linear(2, 4, rngs=nnx.Rngs(0))  # width 4: what mp4 can split
        for var, spec in ((wide.kernel, P(None, MP)), (wide.bias, P(MP))):
            var.set_value(jax.device_put(var.get_value(), NamedSharding(mesh, spec)))
        opt = nnx.Optimizer(wide, optax.adam(1e-2), wrt=nnx.Param)
        with pytest.raises(
            ValueError,
            match=r"model leaf 'bias' has logical shape \(3,\) \(the running model's: \(4,\)\), "
            r"whose dimension 0 \(3\) the running mesh axis 'mp' \(size 4\) does not divide; "
            r"restore on a mesh whose 'mp' degree divides 3",
        ):
            mngr.restore(model=wide, optimizer=opt)

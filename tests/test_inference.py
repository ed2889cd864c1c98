"""The exported inference artefact equals the live model, loads without the model's code,
and refuses bad directories, files and inputs with errors that say what to do."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jfleet import fleet
from jfleet.checkpoint.inference import load_inference_model, save_inference_model
from jfleet.models.llama import TinyLlama
from jfleet.models.parallel_gpt import TinyGPT
from tests.fleet_setup import init_fleet
from tests.subprocess_util import paddle_launch_envs, run_many, run_python

VOCAB = 32


def tokens(batch: int, seq: int = 8) -> np.ndarray:
    return (np.arange(batch * seq, dtype=np.int32).reshape(batch, seq) * 7) % VOCAB


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A small TinyLlama, its artefact directory, and the live model's jitted logits."""
    model = TinyLlama(vocab=VOCAB, width=16, heads=2, layers=1, seed=1)
    dirname = str(tmp_path_factory.mktemp("llama"))
    # exported for a GPU as well, as on a GPU machine by default: it still runs here on CPU
    save_inference_model(dirname, model, (tokens(2),), platforms=("cuda", "cpu"))
    live = nnx.jit(lambda m, x: m(x))
    want = {b: np.asarray(live(model, tokens(b))) for b in (2, 3)}
    return dirname, want


def test_llama_artefact_equals_the_live_model_at_two_batch_sizes(llama):
    dirname, want = llama
    loaded = load_inference_model(dirname)
    assert loaded.input_specs == [("b", 8, "int32")]
    assert loaded.output_specs == [("b", 8, VOCAB, "float32")]
    for b in (2, 3):  # 2 is the example's batch; 3 runs through the symbolic "b"
        np.testing.assert_allclose(np.asarray(loaded(tokens(b))), want[b], rtol=1e-6, atol=1e-6)
    with open(os.path.join(dirname, "manifest.json")) as f:
        manifest = json.load(f)
    paths = [p["path"] for p in manifest["params"]]
    assert "layers.0.mlp.up_proj.kernel" in paths and "lm_head" in paths
    assert {p["path"]: p["shape"] for p in manifest["params"]}["lm_head"] == [16, VOCAB]
    # the parameters are arguments of the exported function, not constants baked into it
    with open(os.path.join(dirname, "forward.jaxexport"), "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    assert len(exported.in_avals) == len(paths) + 1
    assert manifest["versions"]["jax"] == jax.__version__
    assert manifest["platforms"] == list(exported.platforms) == ["cuda", "cpu"]
    assert sorted(os.listdir(dirname)) == ["forward.jaxexport", "manifest.json", "params.npz"]


def test_tensor_parallel_distributed_model_exports_to_one_device(tmp_path):
    init_fleet({"dp_degree": 2, "mp_degree": 4})
    tp = fleet.distributed_model(
        TinyGPT(vocab=VOCAB, width=16, heads=2, layers=1, tensor_parallel=True, seed=2)
    )
    qkv = tp.module.blocks[0].attn.qkv
    assert qkv.kernel.sharding.spec == P(None, "mp") and qkv.mesh.size == 8
    save_inference_model(tmp_path, tp, (tokens(4),))
    loaded = load_inference_model(tmp_path)
    live = nnx.jit(lambda m, x: m(x))
    for b in (4, 6):  # the example's batch (dp-divisible) and another
        got = loaded(tokens(b))
        assert got.sharding.num_devices == 1
        # the live model sums its mp shards in another order: a few fp32 ulps (~1e-6) apart
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(live(tp, tokens(b))), rtol=1e-5, atol=2e-6
        )
    # the sharded parameters were gathered whole, and the live model was left on its mesh
    params = np.load(tmp_path / "params.npz")
    np.testing.assert_array_equal(params["blocks.0.attn.qkv.kernel"], np.asarray(qkv.kernel[...]))
    assert qkv.mesh.size == 8 and qkv.kernel.sharding.spec == P(None, "mp")


def test_a_fresh_process_without_the_model_classes_loads_and_runs_it(llama, tmp_path):
    dirname, want = llama
    np.save(tmp_path / "want.npy", want[3])
    code = f"""
        import sys
        sys.modules["jfleet.models"] = None  # the model's classes cannot be imported
        import jax, numpy as np
        from jfleet.checkpoint.inference import load_inference_model
        model = load_inference_model({dirname!r})
        x = (np.arange(24, dtype=np.int32).reshape(3, 8) * 7) % {VOCAB}
        np.testing.assert_allclose(
            np.asarray(model(x)), np.load({str(tmp_path / "want.npy")!r}), rtol=1e-6, atol=1e-6
        )
        print("ran on", jax.device_count(), "device(s)")
    """
    result = run_python(code, env={"JAX_NUM_CPU_DEVICES": "1"}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ran on 1 device(s)" in result.stdout


def test_a_batch_the_forward_cannot_leave_symbolic_is_fixed_with_a_note(tmp_path, caplog):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))

    def forward(m, x):  # a Python branch on the batch size: not exportable symbolically
        return m(x) if x.shape[0] > 1 else -m(x)

    with caplog.at_level("INFO", logger="jfleet"):
        save_inference_model(tmp_path, model, (np.ones((2, 2), np.float32),), forward=forward)
    assert "exporting the example's fixed shapes [(2, 2)]" in caplog.text
    loaded = load_inference_model(tmp_path)
    assert loaded.input_specs == [(2, 2, "float32")]
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(model(x)), rtol=1e-6)
    with pytest.raises(ValueError, match=r"expected shape \(2, 2\).*got shape \(3, 2\)"):
        loaded(np.ones((3, 2), np.float32))


class NormedDropout(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(2, 3, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.norm = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dropout(self.linear(x)))


def test_statistics_and_prng_keys_travel_with_the_parameters(tmp_path):
    model = NormedDropout(nnx.Rngs(3))
    model.norm.mean[...] = np.array([0.5, -1.0, 2.0], np.float32)  # not the initial zeros
    model.eval()
    x = np.arange(8, dtype=np.float32).reshape(4, 2)
    save_inference_model(tmp_path, model, (x,))
    loaded = load_inference_model(tmp_path)
    paths = [p["path"] for p in loaded.manifest["params"]]
    assert "norm.mean" in paths and "dropout.rngs.key" in paths  # the key as its uint32 data
    np.testing.assert_allclose(np.asarray(loaded(x)), np.asarray(model(x)), rtol=1e-6)


def copy_of(dirname, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(dirname, target)
    return target


def test_missing_directory_and_missing_file_are_clear_errors(llama, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'.*nowhere' does not exist.*save_inference_mod"):
        load_inference_model(tmp_path / "nowhere")
    target = copy_of(llama[0], tmp_path)
    os.remove(target / "forward.jaxexport")
    with pytest.raises(FileNotFoundError, match=r"forward.jaxexport is missing.*not a complete"):
        load_inference_model(target)


def test_another_format_version_is_a_clear_error(llama, tmp_path):
    target = copy_of(llama[0], tmp_path)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["format_version"] = 99
    (target / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json: format_version=99, not 2; .* reads form"):
        load_inference_model(target)


@pytest.mark.parametrize("damage", ["truncated", "one byte flipped"])
def test_a_damaged_parameter_file_is_a_clear_error(llama, tmp_path, damage):
    target = copy_of(llama[0], tmp_path)
    path = target / "params.npz"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"params.npz does not match .* \(truncated or corrupted"):
        load_inference_model(target)


def test_inputs_of_the_wrong_shape_dtype_or_count_name_expected_and_given(llama):
    loaded = load_inference_model(llama[0])
    with pytest.raises(
        ValueError,
        match=r"expected shape \('b', 8\) dtype int32 .* got shape "
        r"\(2, 8\) dtype float32; .*astype\('int32'\)",
    ):
        loaded(tokens(2).astype(np.float32))
    with pytest.raises(ValueError, match=r"expected shape \('b', 8\) .* got shape \(2, 5\)"):
        loaded(tokens(2, seq=5))
    with pytest.raises(ValueError, match=r"takes 1 inputs .* got 2"):
        loaded(tokens(2), tokens(2))


@pytest.mark.parametrize(
    "forward",
    [lambda m, x: float(m(x).sum()), lambda m, x: {"logits": m(x), "name": "head"}],
    ids=["python float of a traced value", "a string output"],
)
def test_a_forward_that_cannot_be_exported_says_what_to_do(tmp_path, forward):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"could not export the forward .* pure function .*"
        r"pass forward=",
    ):
        save_inference_model(tmp_path, model, (np.ones((2, 2), np.float32),), forward=forward)
    assert not (tmp_path / "manifest.json").exists()


def test_unknown_platforms_and_an_artefact_for_another_backend_are_clear_errors(tmp_path):
    model, x = nnx.Linear(2, 3, rngs=nnx.Rngs(0)), np.ones((1, 2), np.float32)
    with pytest.raises(ValueError, match=r"platforms=\['gpu'\]: expected .* 'cuda', not 'gpu'"):
        save_inference_model(tmp_path, model, (x,), platforms=["gpu"])
    save_inference_model(tmp_path, model, (x,), platforms=["tpu"])  # lowered, never run here
    with pytest.raises(
        ValueError,
        match=r"exported for platforms \['tpu'\]; .* on 'cpu'; "
        r"re-export it .*platforms=\[\.\.\., 'cpu'\]",
    ):
        load_inference_model(tmp_path)


def test_a_forward_pinned_to_a_mesh_of_its_own_is_refused(tmp_path):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((8,), ("x",), (jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])

    def forward(m, x):
        return jax.lax.with_sharding_constraint(m(x), NamedSharding(mesh, P("x")))

    with pytest.raises(ValueError, match=r"the forward uses 8 devices .* remove the sharding"):
        save_inference_model(tmp_path, model, (np.ones((8, 2), np.float32),), forward=forward)


def test_a_model_or_inputs_of_the_wrong_kind_are_clear_errors(tmp_path):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"model of type dict; expected an nnx.Module"):
        save_inference_model(tmp_path, {"w": np.ones(2)}, (np.ones((1, 2), np.float32),))
    with pytest.raises(TypeError, match=r"example_inputs=.* must be a tuple .* \(x,\)"):
        save_inference_model(tmp_path, model, np.ones((1, 2), np.float32))
    with pytest.raises(TypeError, match=r"example_inputs\[0\] is a str; expected an array"):
        save_inference_model(tmp_path, model, ("tokens",))


MULTIPROCESS_CHILD = """
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
from jfleet import fleet
from jfleet.checkpoint.inference import save_inference_model
from jfleet.models.parallel_gpt import TinyGPT

strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {{"dp_degree": 2, "mp_degree": 4}}
fleet.init(is_collective=True, strategy=strategy, log_level="WARNING")
model = fleet.distributed_model(
    TinyGPT(vocab={vocab}, width=16, heads=2, layers=1, tensor_parallel=True, seed=2)
)
kernel = model.module.blocks[0].attn.qkv.kernel[...]
assert jax.process_count() == 2 and not kernel.is_fully_addressable
x = (np.arange(32, dtype=np.int32).reshape(4, 8) * 7) % {vocab}
save_inference_model({dirname!r}, model, (x,))
print("SAVED", jax.process_index(), flush=True)
"""


def test_two_processes_gather_their_shards_and_process_0_writes(tmp_path):
    dirname = str(tmp_path / "artefact")
    code = MULTIPROCESS_CHILD.format(vocab=VOCAB, dirname=dirname)
    results = run_many([code, code], envs=paddle_launch_envs(2, heartbeat=20), timeout=180)
    for rank, result in enumerate(results):
        assert result.returncode == 0 and f"SAVED {rank}" in result.stdout, result.stderr[-4000:]
    # the same initial values as the plain model on one device (seeded per parameter)
    plain = TinyGPT(vocab=VOCAB, width=16, heads=2, layers=1, seed=2)
    loaded = load_inference_model(dirname)
    want = nnx.jit(lambda m, x: m(x))(plain, tokens(3))
    np.testing.assert_allclose(
        np.asarray(loaded(tokens(3))), np.asarray(want), rtol=1e-5, atol=2e-6
    )

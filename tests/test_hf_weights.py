"""Hugging Face safetensors into a running layout, each process reading only its slices.

A directory in Hugging Face's Llama naming (``model.layers.<i>...weight``, PyTorch's
``[out, in]`` kernels, two files as sharded checkpoints are written, a rotary
``inv_freq`` buffer to ignore) is written from a TinyLlama by the test, then loaded with
the shipped :data:`~jfleet.checkpoint.hf_weights.LLAMA_HF` map into models laid out by
``to_distributed`` (created from a factory, never whole). The reference is the same
files read whole with ``safetensors.numpy.load_file`` into a one-device model by hand.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jfleet import fleet
from jfleet.auto_parallel import ToDistributedConfig, to_distributed
from jfleet.checkpoint import hf_weights
from jfleet.checkpoint.hf_weights import LLAMA_HF, WeightMap, load_safetensors
from jfleet.checkpoint.layout import logical_leaves
from jfleet.models import lm_batches
from jfleet.models.llama import TinyLlama
from tests.creation_util import values

LAYERS = 4


def factory(seed: int = 3) -> TinyLlama:
    return TinyLlama(vocab=64, width=32, heads=8, kv_heads=4, layers=LAYERS, seed=seed)


def hf_name(key: str) -> tuple[str, bool]:
    """The test's own spelling of Hugging Face's Llama names (not the shipped map)."""
    if key == "embed_tokens.embedding":
        return "model.embed_tokens.weight", False
    if key == "lm_head":
        return "lm_head.weight", True
    if key == "norm.scale":
        return "model.norm.weight", False
    name = "model." + key.replace(".kernel", ".weight").replace(".scale", ".weight")
    return name, key.endswith(".kernel")


def write_hf_checkpoint(where, model) -> dict[str, np.ndarray]:
    """``model`` as a two-file Hugging Face checkpoint; returns what was written."""
    tensors = {}
    for key, value in logical_leaves(model, model).items():
        name, transpose = hf_name(key)
        value = np.asarray(value)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    first = {
        n: t for n, t in tensors.items() if n.startswith(("model.layers.0.", "model.layers.1."))
    }
    first["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(2, np.float32)
    rest = {n: t for n, t in tensors.items() if n not in first}
    where.mkdir()
    save_file(first, where / "model-00001-of-00002.safetensors")
    save_file(rest, where / "model-00002-of-00002.safetensors")
    return tensors


def whole_reference(where) -> TinyLlama:
    """The files read whole, placed by hand into a one-device model."""
    tensors = {}
    for file in sorted(where.glob("*.safetensors")):
        tensors.update(load_file(file))
    model = factory(seed=0)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        keys = ".".join(str(p) for p in path)
        name, transpose = hf_name(keys)
        var.set_value(tensors[name].T if transpose else tensors[name])
    return model


@pytest.fixture
def hf_dir(tmp_path):
    where = tmp_path / "llama-hf"
    write_hf_checkpoint(where, factory(seed=5))
    return where


class _Reads:
    """Records the shape of every slice read from the files."""

    def __init__(self, monkeypatch):
        self.shapes: dict[str, list[tuple]] = {}
        real = hf_weights.safe_open
        reads = self

        class Opened:
            def __init__(self, *args, **kwargs):
                self.inner = real(*args, **kwargs)

            def __enter__(self):
                self.f = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_slice(self, name):
                stored = self.f.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return stored.get_shape()

                    def __getitem__(self, index):
                        part = stored[index]
                        reads.shapes.setdefault(name, []).append(part.shape)
                        return part

                return Slice()

        monkeypatch.setattr(hf_weights, "safe_open", Opened)


@pytest.mark.parametrize(
    "mesh", [{"dp": 2, "pp": 2, "mp": 2}, {"sharding": 8}], ids=["dp2-pp2-mp2", "zero3-sharding8"]
)
def test_hf_llama_loads_slice_by_slice_and_equals_loading_it_whole(hf_dir, mesh, monkeypatch):
    fleet._fleet._reset()
    config = ToDistributedConfig(force_mesh=mesh, zero_stage=3 if "sharding" in mesh else None)
    model, _, _ = to_distributed(factory, optax.adam(1e-2), lm_batches(1), config=config)
    reads = _Reads(monkeypatch)
    load_safetensors(hf_dir, model, LLAMA_HF)
    reference = whole_reference(hf_dir)

    got, want = values(model), values(reference)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    tokens = lm_batches(1)[0]["tokens"]
    got_logits, want_logits = _logits(model, tokens), _logits(reference, tokens)
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-5, atol=1e-5)

    # every read is one device's slice: a split tensor is never read whole
    stored = {n: t.shape for f in hf_dir.glob("*.safetensors") for n, t in load_file(f).items()}
    whole_reads = [
        name for name, shapes in reads.shapes.items()
        if len(shapes) > 1 and any(s == stored[name] for s in shapes)
    ]  # fmt: skip
    assert not whole_reads, f"split tensors read whole: {whole_reads}"
    assert sum(len(s) > 1 for s in reads.shapes.values()) >= len(reads.shapes) // 2


def _logits(model, tokens) -> np.ndarray:
    return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def _damage(where, how: str) -> str:
    """Changes the checkpoint at ``where``; returns the tensor the error must name."""
    files = sorted(where.glob("*.safetensors"))
    tensors = load_file(files[1])
    if how == "missing":
        del tensors["model.norm.weight"]
        save_file(tensors, files[1])
        return "model.norm.weight"
    if how == "extra":
        tensors["model.layers.9.mlp.up_proj.weight"] = np.ones((2, 2), np.float32)
        save_file(tensors, files[1])
        return "model.layers.9.mlp.up_proj.weight"
    if how == "misshaped":
        tensors["lm_head.weight"] = np.ones((64, 31), np.float32)
        save_file(tensors, files[1])
        return "lm_head.weight"
    raw = files[1].read_bytes()  # truncated: the header promises more data than is there
    files[1].write_bytes(raw[: len(raw) - 1000])
    return files[1].name


@pytest.mark.parametrize("how", ["missing", "extra", "misshaped", "truncated"])
def test_a_damaged_or_mismatched_checkpoint_names_the_tensor_and_loads_nothing(hf_dir, how):
    fleet._fleet._reset()
    model = factory()
    before = values(model)
    name = _damage(hf_dir, how)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_safetensors(hf_dir, model, LLAMA_HF)
    after = values(model)
    assert all(np.array_equal(before[k], after[k]) for k in before), "loaded partially"


def test_a_parameter_no_rule_places_is_an_error_naming_it(hf_dir):
    partial = WeightMap(LLAMA_HF.rules[:-1], LLAMA_HF.ignore)
    with pytest.raises(ValueError, match=r"no rule .* 'lm_head'"):
        load_safetensors(hf_dir, factory(), partial)

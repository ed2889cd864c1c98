"""Hugging Face ``safetensors`` weights into a model's running layout, slice by slice.

A pretrained model too big for one device cannot be loaded whole and then placed.
:func:`load_safetensors` reads each parameter straight into its running sharding with
``jax.make_array_from_callback``: every device's shard is read as that slice of the file
(``safetensors``' ``get_slice``), so a process reads only the slices its devices hold
(PaddleNLP and torchtitan read Hugging Face checkpoints the same way; reading each
tensor whole on every host is what makes others run out of host memory). A pipeline
stage's layers are read onto that stage's devices alone (the logical layout of
:mod:`jfleet.checkpoint.layout`).

Names differ between the files and the model, and so do layouts: a PyTorch ``Linear``
stores ``[out, in]`` where ``nnx.Linear`` keeps ``[in, out]``. A :class:`WeightMap` says,
for each of the model's logical paths (``layers.3.mlp.up_proj.kernel``), which tensor of
the files holds it and whether it is transposed. :data:`LLAMA_HF` is the map for
:class:`jfleet.models.llama.TinyLlama` (and any model with its names) from Hugging Face's
Llama naming (``model.layers.3.mlp.up_proj.weight``); both use the ``rotate_half`` form of
rotary embeddings, so the query and key projections need no permutation.

Writing a map for another model: list ``(logical path regex, file name template,
transpose)`` rules (``re.fullmatch`` on the logical path; the template may use its groups,
``\\1``), and ``ignore`` the file's tensors that have no place in the model (logged).

Host memory beyond the destination shards: the slices of one tensor this process holds
(read once per distinct slice, kept until that tensor's shards are on their devices).

Everything is checked before anything is read: a parameter no rule places, a tensor the
files lack, a tensor of the files no rule uses (and not ignored), a shape other than the
model's, a damaged file, all raise ``ValueError`` naming the tensor; the model is changed
only when every tensor was read.

Example:
  >>> import tempfile, numpy as np
  >>> from flax import nnx
  >>> from safetensors.numpy import save_file
  >>> path = tempfile.mkdtemp()
  >>> w = np.arange(6, dtype=np.float32).reshape(3, 2)  # PyTorch's [out, in]
  >>> save_file({"proj.weight": w, "proj.bias": np.zeros(3, np.float32)}, f"{path}/m.safetensors")
  >>> rules = WeightMap(((r"kernel", "proj.weight", True), (r"bias", "proj.bias", False)))
  >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> load_safetensors(path, model, rules)
  >>> bool((model.kernel[...] == w.T).all())
  True
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jfleet.checkpoint import layout
from jfleet.runtime.log import logger

__all__ = ["LLAMA_HF", "WeightMap", "load_safetensors"]


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """Where each of a model's parameters is in a set of files, and in which layout.

    Attributes:
      rules: ``(logical path regex, file tensor name template, transpose)``; the first
        rule whose regex matches a parameter's whole logical path gives its tensor's name
        (``re.Match.expand`` of the template) and whether the file stores it transposed
        (``[out, in]`` for a 2-D kernel: the file's axes reversed).
      ignore: regexes of the files' tensor names with no place in the model (logged).

    Example:
      >>> LLAMA_HF.source("layers.3.mlp.up_proj.kernel")
      ('model.layers.3.mlp.up_proj.weight', True)
    """

    rules: tuple[tuple[str, str, bool], ...]
    ignore: tuple[str, ...] = ()

    def source(self, key: str) -> tuple[str, bool] | None:
        """The file's tensor name for logical path ``key`` and its transpose flag (None: no
        rule places it)."""
        for pattern, template, transpose in self.rules:
            found = re.fullmatch(pattern, key)
            if found:
                return found.expand(template), transpose
        return None

    def ignored(self, name: str) -> bool:
        """Whether the files' tensor ``name`` is one the model has no place for."""
        return any(re.fullmatch(pattern, name) for pattern in self.ignore)


#: Hugging Face Llama (``LlamaForCausalLM``) names onto :class:`~jfleet.models.llama.TinyLlama`'s.
LLAMA_HF = WeightMap(
    rules=(
        (r"embed_tokens\.embedding", "model.embed_tokens.weight", False),
        (
            r"layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.kernel",
            r"model.layers.\1.\2.weight",
            True,
        ),
        (
            r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.scale",
            r"model.layers.\1.\2.weight",
            False,
        ),
        (r"norm\.scale", "model.norm.weight", False),
        (r"lm_head", "lm_head.weight", True),
    ),
    ignore=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)


def load_safetensors(path: str | os.PathLike, model: nnx.Module, weight_map: WeightMap) -> None:
    """Loads ``model``'s parameters from the ``.safetensors`` files at ``path`` in place.

    Args:
      path: one ``.safetensors`` file, or a directory of them (a sharded Hugging Face
        checkpoint: every ``*.safetensors`` file in it; a tensor in two files is an error).
      model: the running model (any mesh, ZeRO stage, pipeline or scanned stacking; a
        ``DistributedModel`` too); each parameter keeps its sharding and dtype (the files'
        values are cast to it on the host, slice by slice).
      weight_map: the names and layouts (:class:`WeightMap`; :data:`LLAMA_HF`).

    Raises:
      ValueError: a parameter no rule places, a tensor missing from or unused in the
        files, a shape other than the model's, a file that cannot be read: each names the
        tensor and file. The model is unchanged then.
    """
    files = _tensor_files(Path(path))
    targets = layout.logical_params(model)
    sources = _sources(targets, files, weight_map)
    loaded = {
        key: _read(files[name], name, transpose, targets[key])
        for key, (name, transpose) in sources.items()
    }
    layout.running_values(model, model, loaded)


def _tensor_files(path: Path) -> dict[str, Path]:
    """``{tensor name: file}`` over the files at ``path`` (headers only)."""
    if path.is_dir():
        paths = sorted(path.glob("*.safetensors"))
        if not paths:
            raise ValueError(f"load_safetensors: no *.safetensors file in {str(path)!r}.")
    elif path.is_file():
        paths = [path]
    else:
        raise ValueError(f"load_safetensors: {str(path)!r} is neither a file nor a directory.")
    where: dict[str, Path] = {}
    for file in paths:
        try:
            with safe_open(file, framework="numpy") as f:
                names = list(f.keys())
        except (SafetensorError, OSError) as error:
            raise ValueError(
                f"load_safetensors: {str(file)!r} is not a readable safetensors file "
                f"({type(error).__name__}: {error}); it is damaged or truncated."
            ) from error
        for name in names:
            if name in where:
                raise ValueError(
                    f"load_safetensors: tensor {name!r} is in both {where[name].name!r} and "
                    f"{file.name!r}; keep one file per tensor."
                )
            where[name] = file
    return where


def _sources(
    targets: dict[str, jax.ShapeDtypeStruct], files: dict[str, Path], weight_map: WeightMap
) -> dict[str, tuple[str, bool]]:
    """``{logical path: (tensor name, transpose)}``, every name and shape checked."""
    sources: dict[str, tuple[str, bool]] = {}
    for key, target in targets.items():
        found = weight_map.source(key)
        if found is None:
            raise ValueError(
                f"load_safetensors: no rule of the weight map places the model's parameter "
                f"{key!r} {tuple(target.shape)}; add (regex, tensor name, transpose) for it."
            )
        name, transpose = found
        if name not in files:
            raise ValueError(
                f"load_safetensors: tensor {name!r} (for the model's {key!r}) is not in the "
                f"files ({len(files)} tensors, e.g. {sorted(files)[:3]})."
            )
        with safe_open(files[name], framework="numpy") as f:
            stored = tuple(f.get_slice(name).get_shape())
        shape = stored[::-1] if transpose else stored
        if shape != tuple(target.shape):
            layout_note = " transposed" if transpose else ""
            raise ValueError(
                f"load_safetensors: tensor {name!r} in {files[name].name!r} has shape {stored}"
                f"{layout_note} = {shape}, but the model's {key!r} is {tuple(target.shape)}."
            )
        sources[key] = found
    used = {name for name, _ in sources.values()}
    unused = sorted(n for n in files if n not in used and not weight_map.ignored(n))
    if unused:
        raise ValueError(
            f"load_safetensors: {len(unused)} tensor(s) of the files have no place in the "
            f"model: {unused[:5]}; map them, or list them in WeightMap.ignore."
        )
    skipped = sorted(n for n in files if n not in used)
    if skipped:
        logger.info("load_safetensors: ignored by the weight map: %s", skipped[:5])
    return sources


def _read(file: Path, name: str, transpose: bool, target: jax.ShapeDtypeStruct) -> jax.Array:
    """Tensor ``name`` as ``target`` (shape, dtype, sharding), each shard read as its slice."""
    slices: dict[tuple, np.ndarray] = {}  # one read per distinct slice (replicas share it)

    try:
        with safe_open(file, framework="numpy") as f:
            stored = f.get_slice(name)

            def shard(index: tuple[slice, ...]) -> np.ndarray:
                key = tuple((s.start, s.stop, s.step) for s in index)
                if key not in slices:
                    part = stored[index[::-1]].T if transpose else stored[index]
                    slices[key] = np.asarray(part, dtype=target.dtype)
                return slices[key]

            return jax.make_array_from_callback(target.shape, target.sharding, shard)
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"load_safetensors: tensor {name!r} in {str(file)!r} could not be read "
            f"({type(error).__name__}: {error}); the file is damaged or truncated."
        ) from error

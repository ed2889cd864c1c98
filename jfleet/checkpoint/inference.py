"""An exported inference artefact: a serialised forward function plus its parameters.

:func:`save_inference_model` exports a model's forward with ``jax.export`` (StableHLO,
parameters as explicit arguments, a symbolic batch dimension when the forward allows it)
and writes three files into a directory:

- ``forward.jaxexport``: ``jax.export.Exported.serialize()`` of ``f(params, *inputs)``;
- ``params.npz``: the parameters as plain arrays keyed by their model path (no pickle),
  gathered from whatever sharding they had;
- ``manifest.json``: format version, input / output specs, parameter paths, shapes and
  dtypes, the SHA-256 of the parameter file and of the forward file, jfleet and jax
  versions.

:func:`load_inference_model` checks every field of the manifest, that both files match
their SHA-256 before either is used (a swapped or damaged forward never runs) and that
this process's backend is one of the exported platforms, exactly. The hashes detect damage
and a file swapped on its own; whoever can rewrite the whole directory can rewrite the
manifest too (see ``SECURITY.md``).

:func:`load_inference_model` needs none of the model's Python classes: it returns an
:class:`InferenceModel`, a callable that runs on this process's first local device.

The forward is traced on a one-device mesh with the model's axis names (parallel layers
are re-pointed from the fleet's mesh to it on a private copy of the model), so the
artefact needs one device, whatever mesh trained the model, on every platform it was
exported for (a one-device program: data-parallel serving is the caller's loop).

Paddle mapping: Paddle's ``fleet.save_inference_model(dirname, feeded_var_names,
target_vars, executor)`` saves a static program; here the program is the traced
forward and the feeds are ``example_inputs``. Paddle's ``fleet.load_inference_model(
path_prefix, executor)`` returns ``[program, feed_target_names, fetch_targets]``; here
one callable stands for all three: call it (the program), ``.input_specs`` (the feeds'
shapes and dtypes) and ``.output_specs`` (the fetch targets).

Example:
  >>> import tempfile, numpy as np
  >>> from flax import nnx
  >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  >>> d = tempfile.mkdtemp()
  >>> save_inference_model(d, model, (np.ones((4, 3), np.float32),))
  >>> loaded = load_inference_model(d)
  >>> loaded.input_specs
  [('b', 3, 'float32')]
  >>> loaded(np.ones((5, 3), np.float32)).shape
  (5, 2)
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jfleet.runtime.log import logger

FORMAT_VERSION = 2  # 2: the manifest records the forward file's SHA-256
MANIFEST = "manifest.json"
FORWARD = "forward.jaxexport"
PARAMS = "params.npz"
BATCH = "b"
_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # jax.export's names


def save_inference_model(
    dirname: str | os.PathLike,
    model: nnx.Module,
    example_inputs: Sequence[Any],
    *,
    forward: Callable[..., Any] | None = None,
    platforms: Sequence[str] | None = None,
) -> None:
    """Exports ``forward(model, *example_inputs)`` and its parameters into ``dirname``.

    Args:
      dirname: directory to write (created if missing; the three files are replaced).
      model: an NNX module, or a ``DistributedModel`` (its ``.module`` is exported).
        Parameters may be sharded, across processes too: they are gathered, and only
        process 0 writes.
      example_inputs: positional inputs (arrays); their shapes and dtypes fix the
        signature, except the leading (batch) dimension, exported as the symbolic
        ``"b"`` when the forward allows it (else fixed, with a logged note).
      forward: ``forward(model, *inputs)`` returning arrays; default ``model(*inputs)``.
      platforms: platforms to lower for (jax.export's names: ``"cpu"``, ``"cuda"``,
        ``"rocm"``, ``"tpu"``); default the current backend plus ``"cpu"``, so a model
        exported on a GPU also runs on CPU.

    Raises:
      TypeError: ``model`` is not an NNX module, or an input is not an array.
      ValueError: an unknown platform, a forward that cannot be exported (side effects
        on traced values, non-array outputs; jax's error is chained), or one that pins
        values to a multi-device mesh other than its layers'.

    Example:
      >>> import tempfile, numpy as np
      >>> from flax import nnx
      >>> save_inference_model(tempfile.mkdtemp(), nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
      ...                      (np.ones((1, 2), np.float32),))
    """
    module, inputs = _checked_export_args(model, example_inputs)
    if platforms is None:
        platforms = list(dict.fromkeys([jax.default_backend(), "cpu"]))
    platforms = _check_platforms(platforms)
    forward = forward or (lambda m, *xs: m(*xs))
    graphdef, names, flat, treedef, keys = _host_copy(module)

    def fn(params: list, *xs: Any) -> Any:
        params = [
            jax.random.wrap_key_data(p, impl=keys[i]) if i in keys else p
            for i, p in enumerate(params)
        ]
        return forward(nnx.merge(graphdef, jax.tree.unflatten(treedef, params)), *xs)

    param_specs = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in flat]
    exported = _export(fn, param_specs, inputs, platforms)
    if exported.nr_devices != 1:
        raise ValueError(
            f"save_inference_model: the forward uses {exported.nr_devices} devices (it pins "
            "values to a mesh of its own, not the model's layers' mesh); the artefact runs on "
            "one device: remove the sharding constraints from forward=..., or build them on "
            "the layers' mesh attribute."
        )
    os.makedirs(dirname, exist_ok=True)
    if jax.process_index() == 0:
        _write_artefact(dirname, exported, names, flat)


def _checked_export_args(model: Any, example_inputs: Any) -> tuple[nnx.Module, tuple]:
    """The module to export (a ``DistributedModel``'s ``.module``) and the inputs, checked."""
    module = getattr(model, "module", model)
    if not isinstance(module, nnx.Module):
        raise TypeError(
            f"save_inference_model got model of type {type(model).__name__}; expected an "
            "nnx.Module or a DistributedModel; pass the model you trained."
        )
    inputs = tuple(example_inputs) if isinstance(example_inputs, list | tuple) else None
    if inputs is None:
        raise TypeError(
            f"example_inputs={example_inputs!r} must be a tuple of arrays (the forward's "
            "positional inputs); wrap a single input as (x,)."
        )
    for i, x in enumerate(inputs):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(
                f"example_inputs[{i}] is a {type(x).__name__}; expected an array "
                "(numpy or jax); convert it with np.asarray."
            )
    return module, inputs


def _write_artefact(dirname: Any, exported: Any, names: list, flat: list) -> None:
    """The parameters, the serialised forward and the manifest (with their hashes)."""
    # each file is written under a temporary name and moved into place, the manifest last:
    # a crash leaves whole files, and a manifest that disagrees with them is refused on load
    params_path = os.path.join(dirname, PARAMS)
    with open(params_path + ".tmp", "wb") as f:
        np.savez(f, **dict(zip(names, flat, strict=True)))
    with open(os.path.join(dirname, FORWARD) + ".tmp", "wb") as f:
        f.write(exported.serialize())
    manifest = {
        "format_version": FORMAT_VERSION,
        "inputs": [_spec(a) for a in exported.in_avals[len(flat) :]],
        "outputs": [_spec(a) for a in exported.out_avals],
        "output_tree": str(exported.out_tree),
        "params": [
            {"path": n, "shape": list(p.shape), "dtype": str(p.dtype)}
            for n, p in zip(names, flat, strict=True)
        ],
        "params_sha256": _sha256(params_path + ".tmp"),
        "forward_sha256": _sha256(os.path.join(dirname, FORWARD) + ".tmp"),
        "platforms": list(exported.platforms),
        "versions": {"jfleet": _jfleet_version(), "jax": jax.__version__},
    }
    with open(os.path.join(dirname, MANIFEST) + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    for name in (PARAMS, FORWARD, MANIFEST):
        os.replace(os.path.join(dirname, name) + ".tmp", os.path.join(dirname, name))


class InferenceModel:
    """A loaded inference artefact: ``model(*inputs)`` runs the exported forward.

    Attributes:
      input_specs: one ``(*shape, dtype)`` tuple per input; ``"b"`` is the batch.
      output_specs: the same for the flattened outputs (Paddle's fetch targets).
      manifest: the artefact's ``manifest.json``.
    """

    def __init__(self, dirname: str, exported: jax.export.Exported, params: list, manifest: dict):
        self.dirname = dirname
        self.manifest = manifest
        self.input_specs = [tuple(s) for s in manifest["inputs"]]
        self.output_specs = [tuple(s) for s in manifest["outputs"]]
        self._params = jax.device_put(params, jax.local_devices()[0])
        self._call = jax.jit(exported.call)

    def __call__(self, *inputs: Any) -> Any:
        """Runs the forward on ``inputs`` (shapes and dtypes as ``input_specs``).

        Raises:
          ValueError: wrong number of inputs, or an input of the wrong shape or dtype.
        """
        self._check(inputs)
        return self._call(self._params, *inputs)

    def _check(self, inputs: tuple) -> None:
        if len(inputs) != len(self.input_specs):
            raise ValueError(
                f"{self.dirname} takes {len(self.input_specs)} inputs {self.input_specs}; "
                f"got {len(inputs)}; pass them positionally in that order."
            )
        batch = None
        for i, (x, spec) in enumerate(zip(inputs, self.input_specs, strict=True)):
            *want, dtype = spec
            shape = tuple(np.shape(x))
            got_dtype = str(getattr(x, "dtype", np.asarray(x).dtype))
            fits = len(shape) == len(want) and all(
                w in (BATCH, s) for w, s in zip(want, shape, strict=True)
            )
            if not fits or got_dtype != dtype:
                raise ValueError(
                    f"input {i} of {self.dirname}: expected shape {tuple(want)} dtype {dtype} "
                    f"('b' is any batch size); got shape {shape} dtype {got_dtype}; "
                    f"reshape or cast it (e.g. x.astype('{dtype}'))."
                )
            if BATCH in want:
                size = shape[want.index(BATCH)]
                if batch is not None and size != batch:
                    raise ValueError(
                        f"input {i} of {self.dirname} has batch {size}, input 0 had {batch}; "
                        "all inputs share the batch dimension 'b'."
                    )
                batch = size


def load_inference_model(dirname: str | os.PathLike) -> InferenceModel:
    """Loads an artefact written by :func:`save_inference_model`; no model code needed.

    Raises:
      FileNotFoundError: ``dirname`` or one of its files is missing.
      ValueError: another format version, an artefact not exported for this backend,
        or a parameter file that does not match its manifest (truncated, corrupted).

    Example:
      >>> import tempfile, numpy as np
      >>> from flax import nnx
      >>> d = tempfile.mkdtemp()
      >>> save_inference_model(d, nnx.Linear(2, 3, rngs=nnx.Rngs(0)),
      ...                      (np.ones((1, 2), np.float32),))
      >>> load_inference_model(d).output_specs
      [('b', 3, 'float32')]
    """
    dirname = os.fspath(dirname)
    fix = "save it with jfleet.inference.save_inference_model(dirname, model, example_inputs)"
    if not os.path.isdir(dirname):
        raise FileNotFoundError(f"inference model directory {dirname!r} does not exist; {fix}.")
    for name in (MANIFEST, FORWARD, PARAMS):
        if not os.path.isfile(os.path.join(dirname, name)):
            raise FileNotFoundError(
                f"{os.path.join(dirname, name)} is missing: {dirname!r} is not a complete "
                f"inference model; {fix}."
            )
    manifest = read_manifest(os.path.join(dirname, MANIFEST))
    backend = jax.default_backend()
    if backend not in manifest["platforms"]:
        raise ValueError(
            f"{dirname!r} was exported for platforms {manifest['platforms']}; this process runs "
            f"on {backend!r}; re-export it with save_inference_model(..., "
            f"platforms=[..., {backend!r}])."
        )
    params = _load_params(dirname, manifest)
    path = os.path.join(dirname, FORWARD)
    fix = "re-save the model with save_inference_model, or restore the file from a copy"
    with open(path, "rb") as f:
        data = f.read()
    listed = os.path.join(dirname, MANIFEST)
    if hashlib.sha256(data).hexdigest() != manifest["forward_sha256"]:
        raise ValueError(
            f"{path} does not match the SHA-256 its manifest {listed} records (damaged, or "
            f"swapped for another forward); {fix}."
        )
    try:
        exported = jax.export.deserialize(bytearray(data))
    except Exception as error:  # flatbuffer / MLIR errors of a file the manifest vouched for
        raise ValueError(
            f"{path} cannot be deserialised ({type(error).__name__}); {fix}."
        ) from None
    want = len(manifest["params"]) + len(manifest["inputs"])
    if len(exported.in_avals) != want or len(exported.out_avals) != len(manifest["outputs"]):
        raise ValueError(
            f"{path} takes {len(exported.in_avals)} arguments and gives "
            f"{len(exported.out_avals)} outputs; its manifest {listed} says {want} and "
            f"{len(manifest['outputs'])}; {fix}."
        )
    return InferenceModel(dirname, exported, params, manifest)


def _host_copy(module: nnx.Module) -> tuple[Any, list[str], list[np.ndarray], Any, dict]:
    """A copy of ``module`` on host arrays, its layers re-pointed to a one-device mesh.

    Returns the copy's graphdef, the state's paths, host arrays (a PRNG key as its key
    data) and treedef, and the PRNG implementation of each key leaf by its index.
    """
    graphdef, state = nnx.split(module)
    state = jax.tree.map(_gather, state)
    copy = nnx.merge(graphdef, state)
    meshes = {}
    for _, node in nnx.iter_graph(copy):
        mesh = getattr(node, "mesh", None)
        if isinstance(node, nnx.Module) and isinstance(mesh, Mesh) and mesh.size > 1:
            if mesh not in meshes:
                devices = np.array(jax.local_devices()[:1]).reshape((1,) * len(mesh.axis_names))
                meshes[mesh] = Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)
            node.mesh = meshes[mesh]
    graphdef, state = nnx.split(copy)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    names = [_path_name(path) for path, _ in leaves]
    keys = {i: jax.random.key_impl(x) for i, (_, x) in enumerate(leaves) if _is_key(x)}
    flat = [
        np.asarray(jax.random.key_data(x)) if i in keys else x for i, (_, x) in enumerate(leaves)
    ]
    return graphdef, names, flat, treedef, keys


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _check_platforms(platforms: Sequence[str]) -> list[str]:
    known = _PLATFORMS
    given = [platforms] if isinstance(platforms, str) else list(platforms)
    bad = [p for p in given if p not in known]
    if bad or not given:
        raise ValueError(
            f"platforms={platforms!r}: expected a non-empty list from {known} (jax.export's "
            "names; 'cuda', not 'gpu'); e.g. platforms=['cuda', 'cpu']."
        )
    return list(dict.fromkeys(given))


def _gather(x: Any) -> Any:
    """A host copy of one array, from every process when it spans processes.

    A PRNG key array stays a key array (its key data gathered and wrapped again).
    """
    if _is_key(x):
        return jax.random.wrap_key_data(
            _gather(jax.random.key_data(x)), impl=jax.random.key_impl(x)
        )
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _path_name(path: tuple) -> str:
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    if parts and parts[-1] == "value":  # nnx.Variable's own leaf
        parts = parts[:-1]
    return ".".join(parts)


def _export(fn: Callable, param_specs: list, inputs: tuple, platforms: Sequence[str]) -> Any:
    concrete = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in inputs]
    exporter = jax.export.export(jax.jit(fn), platforms=platforms)
    if all(np.ndim(x) >= 1 for x in inputs) and inputs:
        (b,) = jax.export.symbolic_shape(BATCH)
        symbolic = [jax.ShapeDtypeStruct((b, *s.shape[1:]), s.dtype) for s in concrete]
        try:
            return exporter(param_specs, *symbolic)
        except Exception as e:  # retried with fixed shapes below
            logger.info(
                "save_inference_model: the forward does not export with a symbolic batch "
                "dimension (%s: %s); exporting the example's fixed shapes %s instead.",
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
                [s.shape for s in concrete],
            )
    try:
        return exporter(param_specs, *concrete)
    except Exception as e:
        raise ValueError(
            f"save_inference_model could not export the forward ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); the forward must be a pure "
            "function of the model and its array inputs returning arrays (no float()/print "
            "of traced values, no Python objects in the outputs); pass forward=... that "
            "returns only the arrays you need."
        ) from e


def _manifest_error(path: str, what: str) -> ValueError:
    return ValueError(
        f"{path}: {what}; re-export the model with save_inference_model (this jfleet reads "
        f"format_version={FORMAT_VERSION}), or restore the file from a copy."
    )


def _specs_ok(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(spec, list)
        and spec
        and isinstance(spec[-1], str)
        and all((type(d) is int and d >= 0) or d == BATCH for d in spec[:-1])
        for spec in value
    )


def _is_sha256(value: Any) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def read_manifest(path: str) -> dict[str, Any]:
    """An artefact's ``manifest.json``, every field checked.

    Raises:
      ValueError: not JSON, not an object, another format version, or a field missing or
        of the wrong kind; the message names the file and the field.

    Example:
      >>> import tempfile, os
      >>> p = os.path.join(tempfile.mkdtemp(), "manifest.json")
      >>> _ = open(p, "w").write("[1]")
      >>> read_manifest(p)
      Traceback (most recent call last):
      ...
      ValueError: ...manifest.json: expected a JSON object, got list; re-export the model ...
    """
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise _manifest_error(path, f"not readable as JSON ({error})") from None
    if not isinstance(manifest, dict):
        raise _manifest_error(path, f"expected a JSON object, got {type(manifest).__name__}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise _manifest_error(path, f"format_version={version!r}, not {FORMAT_VERSION}")
    checks = {
        "inputs": _specs_ok,
        "outputs": _specs_ok,
        "output_tree": lambda v: isinstance(v, str),
        "params": lambda v: isinstance(v, list) and all(_param_entry_ok(e) for e in v),
        "params_sha256": _is_sha256,
        "forward_sha256": _is_sha256,
        "platforms": lambda v: (
            isinstance(v, list) and v and all(isinstance(p, str) and p in _PLATFORMS for p in v)
        ),
        "versions": lambda v: isinstance(v, dict),
    }
    for key, ok in checks.items():
        if key not in manifest or not ok(manifest[key]):
            raise _manifest_error(path, f"field {key!r} is missing or malformed")
    return manifest


def _param_entry_ok(entry: Any) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        return False
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return False
    try:
        np.dtype(entry.get("dtype"))
    except TypeError:
        return False
    return isinstance(entry.get("dtype"), str)


def _spec(aval: Any) -> list:
    return [d if isinstance(d, int) else str(d) for d in aval.shape] + [str(aval.dtype)]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_params(dirname: str, manifest: dict) -> list[np.ndarray]:
    path = os.path.join(dirname, PARAMS)
    fix = "re-save the model with save_inference_model, or restore the file from a copy"
    listed = os.path.join(dirname, MANIFEST)
    if _sha256(path) != manifest.get("params_sha256"):
        raise ValueError(
            f"{path} does not match the SHA-256 its manifest {listed} records (truncated or "
            f"corrupted); {fix}."
        )
    params = []
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [e["path"] for e in manifest["params"] if e["path"] not in data.files]
            if missing or len(data.files) != len(manifest["params"]):
                raise ValueError(
                    f"{path} holds parameters {sorted(data.files)[:5]}...; its manifest {listed} "
                    f"lists {len(manifest['params'])} (e.g. missing {missing[:3]}); {fix}."
                )
            for entry in manifest["params"]:
                x = data[entry["path"]]
                if list(x.shape) != entry["shape"] or str(x.dtype) != entry["dtype"]:
                    raise ValueError(
                        f"{path}: parameter {entry['path']} has shape {x.shape} dtype "
                        f"{x.dtype}; the manifest {listed} says {entry['shape']} "
                        f"{entry['dtype']}; {fix}."
                    )
                params.append(x)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError) as e:
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}); {fix}.") from e
    return params


def _jfleet_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jfleet")
    except PackageNotFoundError:
        return "unknown"

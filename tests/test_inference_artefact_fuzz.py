"""Damaged inference artefacts: every one a clear error naming the damaged file, none loaded.

One tiny artefact, then more than 50 damaged copies: its manifest field by field, its
forward (bytes flipped across the file, truncated, emptied, swapped for another model's),
its parameters. A swapped or damaged forward is refused by its SHA-256 before it is
deserialised; the platform check is exact.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from jfleet.checkpoint.inference import load_inference_model, save_inference_model

X = np.ones((2, 3), np.float32)


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    """(the artefact, another model's artefact of the same signature)."""
    a, b = (tmp_path_factory.mktemp(n) for n in ("a", "b"))
    save_inference_model(a, nnx.Linear(3, 2, rngs=nnx.Rngs(0)), (X,))
    save_inference_model(b, nnx.Linear(3, 2, rngs=nnx.Rngs(1)), (X,))
    return a, b


def _manifest(change: Callable[[dict], object]) -> Callable[[Path, Path], str]:
    def damage(target: Path, other: Path) -> str:
        m = json.loads((target / "manifest.json").read_text())
        out = change(m)
        (target / "manifest.json").write_text(json.dumps(m if out is None else out))
        return "manifest.json"

    return damage


def _set(key, value):
    return _manifest(lambda m: m.__setitem__(key, value))


def _bytes(name: str, change: Callable[[bytes], bytes]) -> Callable[[Path, Path], str]:
    def damage(target: Path, other: Path) -> str:
        path = target / name
        path.write_bytes(change(path.read_bytes()))
        return name

    return damage


def _flip_at(fraction: float) -> Callable[[bytes], bytes]:
    def flip(data: bytes) -> bytes:
        at = min(int(len(data) * fraction), len(data) - 1)
        return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]

    return flip


def _swap(name: str) -> Callable[[Path, Path], str]:
    def damage(target: Path, other: Path) -> str:
        shutil.copy(other / name, target / name)
        return name

    return damage


DAMAGES: dict[str, Callable[[Path, Path], str]] = {
    "manifest a list": _manifest(lambda m: [m]),
    "manifest a number": _manifest(lambda m: 3),
    "manifest not json": _bytes("manifest.json", lambda d: d[: len(d) // 2]),
    "manifest empty": _bytes("manifest.json", lambda d: b""),
    "manifest binary": _bytes("manifest.json", lambda d: b"\xff\xfe" + d),
    **{
        f"manifest without {k}": _manifest(lambda m, k=k: m.pop(k) and None)
        for k in (
            "format_version",
            "inputs",
            "outputs",
            "output_tree",
            "params",
            "params_sha256",
            "forward_sha256",
            "platforms",
            "versions",
        )
    },
    "format_version 1": _set("format_version", 1),
    "format_version string": _set("format_version", "2"),
    "platforms xcpux": _set("platforms", "xcpux"),
    "platforms a substring": _set("platforms", ["xcpux"]),
    "platforms empty": _set("platforms", []),
    "platforms gpu": _set("platforms", ["gpu"]),
    "inputs not specs": _set("inputs", [[2, 3]]),
    "inputs a string": _set("inputs", "b,3"),
    "inputs negative dim": _set("inputs", [["b", -3, "float32"]]),
    "inputs one more": _manifest(lambda m: m["inputs"].append(["b", 3, "float32"])),
    "outputs one fewer": _set("outputs", []),
    "params an object": _set("params", {"kernel": [3, 2]}),
    "params bad dtype": _manifest(lambda m: m["params"][0].__setitem__("dtype", "float99")),
    "params bad shape": _manifest(lambda m: m["params"][0].__setitem__("shape", [3, "x"])),
    "params shape wrong": _manifest(lambda m: m["params"][0].__setitem__("shape", [2, 3])),
    "params path unknown": _manifest(lambda m: m["params"][0].__setitem__("path", "evil")),
    "params one fewer": _manifest(lambda m: m["params"].pop() and None),
    "params_sha256 short": _set("params_sha256", "abc"),
    "params_sha256 other": _set("params_sha256", "0" * 64),
    "forward_sha256 other": _set("forward_sha256", "0" * 64),
    "forward_sha256 upper": _manifest(
        lambda m: m.__setitem__("forward_sha256", m["forward_sha256"].upper())
    ),
    "versions a list": _set("versions", []),
    "forward swapped for another model's": _swap("forward.jaxexport"),
    "params swapped for another model's": _swap("params.npz"),
    "forward empty": _bytes("forward.jaxexport", lambda d: b""),
    "forward truncated": _bytes("forward.jaxexport", lambda d: d[: len(d) // 2]),
    "forward one byte more": _bytes("forward.jaxexport", lambda d: d + b"\0"),
    "params empty": _bytes("params.npz", lambda d: b""),
    "params truncated": _bytes("params.npz", lambda d: d[:-10]),
    **{
        f"forward bit flipped at {f:.0%}": _bytes("forward.jaxexport", _flip_at(f))
        for f in (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)
    },
    **{f"params bit flipped at {f:.0%}": _bytes("params.npz", _flip_at(f)) for f in (0.0, 0.5)},
}


def test_there_are_at_least_50_damages():
    assert len(DAMAGES) >= 50, len(DAMAGES)


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_damaged_artefact_is_a_clear_error_naming_the_file(artefacts, tmp_path, name):
    good, other = artefacts
    target = tmp_path / "copy"
    shutil.copytree(good, target)
    damaged = DAMAGES[name](target, other)
    with pytest.raises((ValueError, FileNotFoundError)) as caught:
        load_inference_model(target)
    message = str(caught.value)
    assert str(target / damaged) in message, f"{name}: {message}"
    assert len(message) < 800, message


def test_the_artefact_itself_loads_and_runs(artefacts):
    good, _ = artefacts
    want = nnx.Linear(3, 2, rngs=nnx.Rngs(0))(X)
    np.testing.assert_allclose(load_inference_model(good)(X), want, rtol=1e-6)

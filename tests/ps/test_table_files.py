"""Damaged sparse-table files: each one a clear error naming the file, none loaded.

One saved table, then more than 50 damaged copies (its metadata and its part file, field by
field): every :func:`load_table` raises a ``ValueError`` naming the damaged file, and the
table it was loading into keeps its rows.
"""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from jfleet.mesh.topology import DP
from jfleet.ps import SparseTable, load_table, save_table

ROWS, DIM = 64, 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A table with 3 rows, saved (mode 0): (table, its directory)."""
    mesh = jax.make_mesh((8,), (DP,), axis_types=(AxisType.Auto,))
    table = SparseTable(ROWS, DIM, mesh=mesh, table_id=5)
    b = table.prepare(np.array([[1], [2], [3]], np.int64), labels=[1.0, 0.0, 1.0])
    g = np.full((b.rows.size, DIM), 0.1, np.float32)
    table.state = table.push(table.state, b.rows, g, b.show, b.click)
    root = tmp_path_factory.mktemp("table")
    assert save_table(table, root, 0) == 3
    return table, root


def _meta(change: Callable[[dict], object]) -> Callable[[Path], str]:
    def damage(src: Path) -> str:
        meta = json.loads((src / "meta.json").read_text())
        out = change(meta)
        (src / "meta.json").write_text(json.dumps(meta if out is None else out))
        return "meta.json"

    return damage


def _drop(key):
    return _meta(lambda m: m.pop(key) and None)


def _set(key, value):
    return _meta(lambda m: m.__setitem__(key, value))


def _part(change: Callable[[dict], None]) -> Callable[[Path], str]:
    def damage(src: Path) -> str:
        path = src / "part-00000.npz"
        with np.load(path) as npz:
            arrays = {k: npz[k] for k in npz.files}
        change(arrays)
        np.savez(path, **arrays)
        return "part-00000.npz"

    return damage


def _raw(data: Callable[[bytes], bytes]) -> Callable[[Path], str]:
    def damage(src: Path) -> str:
        path = src / "part-00000.npz"
        path.write_bytes(data(path.read_bytes()))
        return "part-00000.npz"

    return damage


def _pickled(src: Path) -> str:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z, np.load(src / "part-00000.npz") as npz:
        for k in npz.files:
            arr = npz[k].astype(object) if k == "emb" else npz[k]
            with z.open(f"{k}.npy", "w") as f:
                np.lib.format.write_array(f, arr, allow_pickle=True)
    (src / "part-00000.npz").write_bytes(buf.getvalue())
    return "part-00000.npz"


def _rows(fn):
    return _part(lambda a: a.__setitem__("rows", fn(a["rows"])))


def _field(name, fn):
    return _part(lambda a: a.__setitem__(name, fn(a[name])))


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


DAMAGES: dict[str, Callable[[Path], str]] = {
    "meta list": _meta(lambda m: [1]),
    "meta string": _meta(lambda m: "table"),
    "meta not json": lambda src: (src / "meta.json").write_text("{oops") and "meta.json",
    "meta empty": lambda src: (src / "meta.json").write_text("") or "meta.json",
    "meta binary": lambda src: (src / "meta.json").write_bytes(b"\xff\xfe\x00") and "meta.json",
    **{f"meta without {k}": _drop(k) for k in ("table_id", "num_rows", "dim", "accessor")},
    **{f"meta without {k}": _drop(k) for k in ("mode", "rows_saved", "processes")},
    "num_rows string": _set("num_rows", "64"),
    "num_rows float": _set("num_rows", 64.0),
    "num_rows zero": _set("num_rows", 0),
    "dim negative": _set("dim", -2),
    "dim bool": _set("dim", True),
    "day evil": _set("day", "evil"),
    "day float": _set("day", 1.5),
    "mode 7": _set("mode", 7),
    "mode bool": _set("mode", False),
    "processes 0": _set("processes", 0),
    "processes 2 (a part missing)": lambda src: _set("processes", 2)(src) and "part-00001.npz",
    "rows_saved negative": _set("rows_saved", -1),
    "rows_saved says 4": _set("rows_saved", 4),
    "rows_saved says 2": _set("rows_saved", 2),
    "table_id of another": _set("table_id", 6),
    "table_id bool": _set("table_id", True),
    "accessor string": _set("accessor", "ctr"),
    "accessor empty": _set("accessor", {}),
    "accessor unknown field": _meta(lambda m: m["accessor"].__setitem__("evil", 1)),
    "part empty": _raw(lambda d: b""),
    "part not a zip": _raw(lambda d: b"not a zip file at all" * 10),
    "part truncated": _raw(lambda d: d[: len(d) // 2]),
    "part flipped directory": _raw(lambda d: _flip(d, len(d) - 30)),
    "part deleted": lambda src: (src / "part-00000.npz").unlink() or "part-00000.npz",
    "part pickled": _pickled,
    "part extra array": _part(lambda a: a.__setitem__("evil", np.zeros(3))),
    "part without emb": _part(lambda a: [a.pop("emb")]),
    "part without rows": _part(lambda a: [a.pop("rows")]),
    "part without show": _part(lambda a: [a.pop("show")]),
    "rows float": _rows(lambda r: r.astype(np.float64) + 0.5),
    "rows float integral": _rows(lambda r: r.astype(np.float32)),
    "rows negative": _rows(lambda r: np.where(r == r[0], -1, r)),
    "rows out of range": _rows(lambda r: np.where(r == r[0], ROWS, r)),
    "rows far out of range": _rows(lambda r: np.where(r == r[0], 10**9, r)),
    "rows duplicate": _rows(lambda r: np.concatenate([r[:1], r[:1], r[2:]])),
    "rows 2-D": _rows(lambda r: r.reshape(-1, 1)),
    "rows strings": _rows(lambda r: r.astype(str)),
    "emb inf": _field("emb", lambda e: np.where(np.arange(e.size).reshape(e.shape), e, np.inf)),
    "emb nan": _field("emb", lambda e: np.full_like(e, np.nan)),
    "emb 1e300": _field("emb", lambda e: e.astype(np.float64) * 0 + 1e300),
    "emb wrong dim": _field("emb", lambda e: np.zeros((e.shape[0], DIM + 1), e.dtype)),
    "emb one row short": _field("emb", lambda e: e[:-1]),
    "emb strings": _field("emb", lambda e: e.astype(str)),
    "show inf": _field("show", lambda s: np.full_like(s, np.inf)),
    "present as float": _field("present", lambda p: p.astype(np.float32)),
    "present as ints": _field("present", lambda p: p.astype(np.int32) * 2),
}


def _state(table):
    return jax.tree.map(np.asarray, table.state)


def test_there_are_at_least_50_damages():
    assert len(DAMAGES) >= 50, len(DAMAGES)


@pytest.mark.parametrize("name", sorted(DAMAGES))
def test_a_damaged_table_file_is_a_clear_error_naming_it(saved, tmp_path, name):
    table, root = saved
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    src = copy / str(table.table_id)
    file = DAMAGES[name](src)
    target = SparseTable(ROWS, DIM, mesh=table.mesh, seed=3, table_id=table.table_id)
    before = _state(target)
    with pytest.raises(ValueError) as caught:
        load_table(target, copy, 0)
    message = str(caught.value)
    named = str(src / file) in message or (file.startswith("part-") and f"{src}:" in message)
    assert named, f"{name}: {message}"
    assert "Traceback" not in message and len(message) < 600, message
    after = _state(target)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)), name


def test_the_undamaged_table_still_loads(saved, tmp_path):
    table, root = saved
    target = SparseTable(ROWS, DIM, mesh=table.mesh, seed=3, table_id=table.table_id)
    assert load_table(target, root, 0) == 3
    live = _state(table).present
    np.testing.assert_array_equal(_state(target).emb[live], _state(table).emb[live])

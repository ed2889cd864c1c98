"""Reading a saved sparse table's files, every field checked: nothing loads that is not sound.

:func:`read_saved` reads ``meta.json`` and the ``part-<process>.npz`` files written by
:func:`jfleet.ps.storage.save_table` and checks them against the table they load into: the
metadata's schema (types, ranges, the table's ``num_rows`` / ``dim`` / SGD rule), each
part's arrays (no pickles; exactly the table's fields; integral row ids in
``0..num_rows-1``, none twice; one row of values per row id, of the table's trailing shape,
finite once cast to the table's dtypes) and the total against ``rows_saved``. Any fault is
a :class:`TableFileError` (a ``ValueError``) naming the file, the field and what was
expected.

Example:
  >>> import json, tempfile, pathlib
  >>> d = pathlib.Path(tempfile.mkdtemp())
  >>> _ = (d / "meta.json").write_text("[1]")
  >>> read_meta(d / "meta.json")
  Traceback (most recent call last):
  ...
  jfleet.ps.table_files.TableFileError: .../meta.json: expected a JSON object with the ...
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TableFileError", "read_meta", "read_parts"]

_MODES = (0, 1, 2, "cache")
_FIX = "save the table again with fleet.save_one_table, or load another copy"


class TableFileError(ValueError):
    """A saved table's file that is missing a field, malformed or inconsistent."""


def _fail(path: Path, what: str) -> TableFileError:
    return TableFileError(f"{path}: {what}; {_FIX}.")


def _int(meta: dict, key: str, low: int, path: Path, *, optional: bool = False) -> Any:
    value = meta.get(key)
    if value is None and optional:
        return None
    if type(value) is not int or value < low:
        raise _fail(path, f"{key}={value!r}: expected an integer >= {low}")
    return value


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` parsed and checked field by field.

    Raises:
      TableFileError: not JSON, not an object, or a field missing or of the wrong kind.
    """
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise _fail(path, f"not readable as JSON ({error})") from None
    if not isinstance(meta, dict):
        raise _fail(
            path, f"expected a JSON object with the table's metadata, got {type(meta).__name__}"
        )
    for key in ("table_id", "num_rows", "dim", "rows_saved", "processes"):
        _int(meta, key, 0 if key in ("table_id", "rows_saved") else 1, path)
    _int(meta, "day", 0, path, optional=True)
    if meta.get("mode") not in _MODES or isinstance(meta.get("mode"), bool):
        raise _fail(path, f"mode={meta.get('mode')!r}: expected one of {_MODES}")
    if not isinstance(meta.get("accessor"), dict):
        raise _fail(path, f"accessor={meta.get('accessor')!r}: expected a JSON object")
    return meta


def _load_part(path: Path, fields: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict:
    try:
        with np.load(path, allow_pickle=False) as npz:
            names = set(npz.files)
            want = {"rows", *fields}
            if names != want:
                raise _fail(
                    path,
                    f"holds arrays {sorted(names)}; expected exactly {sorted(want)} (the table's "
                    "fields)",
                )
            return {name: npz[name] for name in want}
    except TableFileError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as error:
        raise _fail(
            path, f"not a readable .npz part file ({type(error).__name__}: {error})"
        ) from None


def _check_part(
    path: Path, part: dict, fields: dict[str, tuple[tuple[int, ...], np.dtype]], num_rows: int
) -> None:
    rows = part["rows"]
    if rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise _fail(path, f"rows has dtype {rows.dtype} and shape {rows.shape}: expected 1-D ints")
    bad = rows[(rows < 0) | (rows >= num_rows)]
    if bad.size:
        raise _fail(path, f"row id {int(bad[0])} is outside 0..{num_rows - 1}")
    for name, (trailing, dtype) in fields.items():
        a = part[name]
        if a.shape != (rows.size, *trailing):
            raise _fail(
                path, f"{name} has shape {a.shape}: expected {(rows.size, *trailing)} (one per row)"
            )
        if a.dtype.kind not in "biuf" or (dtype.kind == "b") != (a.dtype.kind == "b"):
            raise _fail(path, f"{name} has dtype {a.dtype}: expected {dtype}")
        if a.dtype.kind == "f" and np.dtype(dtype).kind == "f":
            with np.errstate(over="ignore", invalid="ignore"):
                finite = np.isfinite(a.astype(dtype))
            if not finite.all():
                at = int(np.argmin(finite.reshape(rows.size, -1).all(axis=1)))
                raise _fail(
                    path,
                    f"{name} of row {int(rows[at])} is not a finite {np.dtype(dtype).name} "
                    f"({a.reshape(rows.size, -1)[at][:4]})",
                )
        elif a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
            raise _fail(path, f"{name} holds non-integral values: expected {dtype}")


def read_parts(
    src: Path, meta: dict, fields: dict[str, tuple[tuple[int, ...], np.dtype]]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The rows and field arrays of every part file, checked (see the module docstring).

    Args:
      src: the table's directory.
      meta: its checked ``meta.json``.
      fields: ``{field: (trailing shape, dtype)}`` of the table loaded into.

    Raises:
      TableFileError: a part missing, unreadable or inconsistent; a row id twice; a total
        other than ``rows_saved``.
    """
    parts = []
    for p in range(meta["processes"]):
        path = src / f"part-{p:05d}.npz"
        part = _load_part(path, fields)
        _check_part(path, part, fields, meta["num_rows"])
        parts.append(part)
    rows = np.concatenate([p["rows"] for p in parts]).astype(np.int64)
    unique, counts = np.unique(rows, return_counts=True)
    if (counts > 1).any():
        raise _fail(src, f"row id {int(unique[counts > 1][0])} is saved more than once")
    if rows.size != meta["rows_saved"]:
        raise _fail(
            src / "meta.json",
            f"rows_saved={meta['rows_saved']} but the part files hold {rows.size} rows",
        )
    data = {
        name: np.concatenate([p[name] for p in parts]).astype(dtype)
        for name, (_, dtype) in fields.items()
    }
    return rows.astype(np.int32), data

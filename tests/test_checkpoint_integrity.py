"""Checkpoints that can be trusted: damage is an error, one writer per directory, failed
saves that can be retried, unfinished saves reported once.

The corruption sweep damages every file of a tiny checkpoint five ways (flip 1 byte, flip
16 bytes, truncate, empty, delete) and restores each copy: every restore either raises or
gives back exactly the saved values and description, never other values.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jfleet.checkpoint import CheckpointManager
from jfleet.checkpoint.integrity import fingerprints

# Orbax reads a damaged array's shards concurrently; when one read fails, the coroutines of
# the others are dropped unawaited and complain when collected ("Exception ignored in
# <coroutine ... _read_array_index_and_device_put>"). Ignored here, and collected before a
# test of this module ends, so that the complaint does not land on a later module's test.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True)
def _collect_dropped_reads():
    """Collects Orbax's dropped shard reads while this module's warning filter holds."""
    yield
    gc.collect()


def linear(seed: int = 0, width: int = 4):
    model = nnx.Linear(width, width, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _values(model, opt) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((nnx.state(model), nnx.state(opt)))]


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "delete":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        n = 1 if how == "flip1" else 16
        at = len(data) // 2 if how == "flip1" else len(data) // 3
        chunk = bytes(b ^ 0xFF for b in data[at : at + n])
        path.write_bytes(data[:at] + chunk + data[at + n :])


DAMAGES = ("flip1", "flip16", "truncate", "empty", "delete")


def test_every_damaged_file_is_an_error_or_a_faithful_restore(tmp_path, caplog):
    model, opt = linear(width=32)  # a 4 KiB kernel: stored in a data file, not inlined
    model.kernel[...] = model.kernel[...] * 3  # not the fresh model's values
    pristine = tmp_path / "pristine"
    with CheckpointManager(pristine, async_save=False) as mngr:
        mngr.save(1, model, opt, extra={"lr": 0.1, "note": "sweep"})
    want = _values(model, opt)
    files = sorted(p.relative_to(pristine) for p in (pristine / "1").rglob("*") if p.is_file())
    assert len(files) >= 10, files
    outcomes = {"error": 0, "faithful": 0}
    silent = []
    for i, rel in enumerate(files):
        for how in DAMAGES:
            copy = tmp_path / f"c{i}_{how}"
            shutil.copytree(pristine, copy)
            _damage(copy / rel, how)
            fresh, fresh_opt = linear(seed=1, width=32)
            try:
                with CheckpointManager(copy, async_save=False) as mngr:
                    meta = mngr.restore(1, model=fresh, optimizer=fresh_opt)
            except (ValueError, FileNotFoundError, RuntimeError) as error:
                outcomes["error"] += 1
                assert str(error), (rel, how)
                continue
            got = _values(fresh, fresh_opt)
            same = all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))
            if same and meta["extra"] == {"lr": 0.1, "note": "sweep"} and meta["step"] == 1:
                outcomes["faithful"] += 1
            else:
                silent.append((str(rel), how))
            shutil.rmtree(copy)
    assert not silent, f"silently wrong restores: {silent} (outcomes {outcomes})"
    assert outcomes["error"] >= len(files), outcomes  # most damage is caught, not luck


def test_swapped_array_files_name_the_step_and_the_leaf(tmp_path):
    model, opt = linear()
    with CheckpointManager(tmp_path / "a", async_save=False) as mngr:
        mngr.save(7, model, opt)
    model.kernel[...] = model.kernel[...] + 1
    with CheckpointManager(tmp_path / "b", async_save=False) as mngr:
        mngr.save(7, model, opt)
    shutil.rmtree(tmp_path / "a" / "7" / "state")  # well-formed arrays, other values
    shutil.copytree(tmp_path / "b" / "7" / "state", tmp_path / "a" / "7" / "state")
    fresh, fresh_opt = linear(seed=1)
    with (
        CheckpointManager(tmp_path / "a") as mngr,
        pytest.raises(ValueError, match=r"a/7 \(step 7\) is damaged: leaf 'model/kernel'"),
    ):
        mngr.restore(model=fresh, optimizer=fresh_opt)


def test_one_flipped_bit_changes_the_checksum():
    values = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    sums = fingerprints({"w": values})
    for element in (0, 9, 63):
        for bit in (0, 17, 31):
            flipped = values.copy()
            flipped.reshape(-1).view(np.uint32)[element] ^= np.uint32(1 << bit)
            assert fingerprints({"w": flipped}) != sums, (element, bit)
    swapped = values.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values in other places
    assert fingerprints({"w": swapped}) != sums


def test_a_second_writer_is_refused_and_no_reported_save_is_lost(tmp_path):
    model, opt = linear()
    first = CheckpointManager(tmp_path, async_save=False)
    second = CheckpointManager(tmp_path, async_save=False)  # readers are welcome
    saved = [s for s in range(6) if first.save(s, model, opt)]
    with pytest.raises(RuntimeError, match=r"another CheckpointManager is saving into .*pid"):
        second.save(10, model, opt)
    assert second.all_steps() == saved == list(range(6))
    first.close()
    assert second.save(10, model, opt)  # the first one closed: the lock is free
    second.close()


def test_a_second_process_is_refused(tmp_path):
    model, opt = linear()
    with CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, model, opt)
        code = (
            "import optax; from flax import nnx\n"
            "from jfleet.checkpoint import CheckpointManager\n"
            "m = nnx.Linear(4, 4, rngs=nnx.Rngs(0))\n"
            "o = nnx.Optimizer(m, optax.adam(1e-2), wrt=nnx.Param)\n"
            f"CheckpointManager({str(tmp_path)!r}).save(2, m, o)\n"
        )
        from tests.subprocess_util import run_python

        child = run_python(code, timeout=120)
        err = child.stderr
        assert child.returncode == 1, err[-2000:]
        assert "RuntimeError: another CheckpointManager is saving into" in err, err[-2000:]
        assert mngr.all_steps() == [1]


@contextlib.contextmanager
def _tiny_disk(path: Path, size: str):
    path.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False, timeout=10)


def test_a_save_that_ran_out_of_space_is_reported_once_and_can_be_retried(tmp_path):
    model, opt = linear(width=256)
    with _tiny_disk(tmp_path / "disk", "400k") as disk:
        mngr = CheckpointManager(disk / "run")
        assert mngr.save(1, model, opt)
        mngr.wait_until_finished()
        model.kernel[...] = model.kernel[...] + 1
        assert mngr.save(2, model, opt)  # async: the disk fills up in the background
        with pytest.raises(RuntimeError, match=r"save of step\(s\) \[2\] .* failed .*space"):
            mngr.wait_until_finished()
        mngr.wait_until_finished()  # reported once: not again
        assert mngr.all_steps() == [1]  # the previous checkpoint is intact
        shutil.rmtree(disk / "run" / "1")  # free the space
        assert mngr.save(2, model, opt)  # the same step again
        mngr.wait_until_finished()
        fresh, fresh_opt = linear(seed=1, width=256)
        assert mngr.restore(model=fresh, optimizer=fresh_opt)["step"] == 2
        np.testing.assert_array_equal(fresh.kernel[...], model.kernel[...])
        mngr.close()


def test_an_unfinished_save_is_reported_once(tmp_path, caplog):
    model, opt = linear()
    with CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, model, opt)
    (tmp_path / "2.orbax-checkpoint-tmp").mkdir()  # a save killed midway
    (tmp_path / "2.orbax-checkpoint-tmp" / "state").write_text("half")
    with caplog.at_level(logging.WARNING, logger="jfleet"), CheckpointManager(tmp_path) as mngr:
        assert mngr.all_steps() == [1]
        assert mngr.save(2, model, opt)  # over the leftover
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1, 2]
    said = [r.getMessage() for r in caplog.records if "unfinished save" in r.getMessage()]
    assert len(said) == 1 and "an unfinished save of step 2" in said[0], said
    assert not any("already exists" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("spec", [("a", "b"), ("b", None), (None, None)], ids=str)
def test_the_checksum_does_not_depend_on_the_layout(spec):
    values = np.linspace(-3, 3, 8 * 12, dtype=np.float32).reshape(8, 12)
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    placed = jax.device_put(values, jax.NamedSharding(mesh, jax.P(*spec)))
    assert fingerprints({"w": placed}) == fingerprints({"w": values})
    for dtype in (np.int8, np.float16, np.bool_):
        small = (values > 0).astype(dtype)
        assert fingerprints({"w": jax.device_put(small, placed.sharding)}) == fingerprints(
            {"w": small}
        )


def test_a_checkpoint_saved_without_checksums_restores_with_a_warning(tmp_path, caplog):
    model, opt = linear()
    with CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(1, model, opt, extra={"note": "old"})
    meta_file = tmp_path / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    del meta["checksums"]  # as an older jfleet wrote it
    meta_file.write_text(json.dumps(meta))
    fresh, fresh_opt = linear(seed=1)
    with caplog.at_level(logging.WARNING, logger="jfleet"), CheckpointManager(tmp_path) as mngr:
        assert mngr.restore(model=fresh, optimizer=fresh_opt)["extra"] == {"note": "old"}
    np.testing.assert_array_equal(fresh.kernel[...], model.kernel[...])
    assert any("has no checksums" in r.getMessage() for r in caplog.records)


def test_a_failed_synchronous_save_can_be_retried_at_the_same_step(tmp_path, monkeypatch):
    model, opt = linear()
    mngr = CheckpointManager(tmp_path, async_save=False)
    real = type(mngr._mngr).save
    calls = []

    def failing_once(self, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            raise OSError("injected: the disk went away")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(mngr._mngr), "save", failing_once)
    with pytest.raises(OSError, match="injected"):
        mngr.save(3, model, opt)
    assert mngr.save(3, model, opt)  # the same step again
    assert mngr.all_steps() == [3] and calls == [3, 3]
    mngr.close()

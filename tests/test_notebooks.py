"""Every notebook in notebooks/ runs top to bottom, and is stored with its outputs.

Each notebook runs in a temporary copy of notebooks/ (its working directory), in a
fresh ``python3`` kernel that this test defines itself: the kernel spec points at
``sys.executable``, so the kernel imports the jfleet and JAX of this interpreter
whatever kernel specs the machine has (a fresh CI machine that only ran
``pip install -e ".[dev]"`` may have none, or one for another Python).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient

from tests.subprocess_util import REPO_ROOT, child_env

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 300  # seconds per cell
KERNEL = "python3"


def kernel_manager(tmp_path: Path) -> AsyncKernelManager:
    """A kernel manager whose ``python3`` kernel runs on this very interpreter."""
    kernels = tmp_path / "kernels"
    spec = kernels / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (jfleet tests)",
                "language": "python",
                "env": {"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2"},
            }
        )
    )
    km = AsyncKernelManager(
        kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
    )
    assert km.kernel_spec.argv[0] == sys.executable
    return km


def kernel_env(tmp_path: Path) -> dict[str, str]:
    """The kernel's environment: the tests' child environment, private IPython state."""
    env = child_env({"IPYTHONDIR": str(tmp_path / "ipython")})
    env.pop("MPLBACKEND", None)  # ipykernel picks the inline backend itself
    return env


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path, tmp_path, monkeypatch):
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    workdir = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOK_DIR, workdir)
    nb = nbformat.read(workdir / path.name, as_version=4)
    client = NotebookClient(
        nb,
        km=kernel_manager(tmp_path),
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT,
        allow_errors=False,
        resources={"metadata": {"path": str(workdir)}},
    )
    # a failing cell raises CellExecutionError with the cell's traceback
    client.execute(cleanup_kc=True, env=kernel_env(tmp_path))
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_with_its_outputs(path):
    """A reader on GitHub sees the outputs: every code cell ran, in order, without errors."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: execution counts {counts}; run it top to bottom in a fresh kernel and save"
    )
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{path.name} saved with errors"
    if any("matplotlib" in c.source for c in code):
        assert any("image/png" in o.get("data", {}) for o in outputs), (
            f"{path.name} plots but was saved without its figure"
        )

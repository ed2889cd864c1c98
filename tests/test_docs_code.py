"""Every code block in the README and in docs/ runs, as pasted.

* README: one screen (at most 150 lines); each Python block runs in a fresh interpreter
  with no environment beyond ``PATH`` and ``HOME`` (and the checkout importable), as on a
  fresh CPU-only machine; so does the Quick start's first command, minus its
  ``pip install``.
* docs/*.md: each file's Python blocks run in order in one namespace, in this process (8
  emulated devices), in a temporary working directory. A block that needs several
  processes is preceded by ``<!-- multi-process: tests/<file>.py::<test> -->`` and is
  covered by that test instead, which must exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import quick_start_commands

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"(?:<!-- multi-process: (\S+?)::(\w+) -->\n)?```python\n(.*?)```", re.S)
TIMEOUT = 300
COMPILE_SPEED = ("XLA_FLAGS",)


def python_blocks(path: Path) -> list[tuple[str | None, str]]:
    """``(covering test or None, code)`` of each Python block of a Markdown file."""
    out = []
    for match in BLOCK.finditer(path.read_text()):
        covered = f"{match.group(1)}::{match.group(2)}" if match.group(1) else None
        out.append((covered, match.group(3)))
    return out


def clean_run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(cwd))}
    env["PYTHONPATH"] = str(ROOT)  # this checkout, as `pip install -e .` would give
    # only how fast XLA compiles (conftest.py): nothing that sets devices or platforms, which
    # the snippet must do itself
    env.update({k: v for k, v in os.environ.items() if k in COMPILE_SPEED})
    try:
        proc = subprocess.run(
            [sys.executable, *argv],
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{argv} ran past {TIMEOUT}s:\n{err.stdout}\n{err.stderr}") from err
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_readme_fits_one_screen_and_has_its_two_snippets():
    lines = README.read_text().count("\n")
    assert lines <= 150, f"README.md has {lines} lines; move the detail to docs/"
    assert len(python_blocks(README)) == 2


@pytest.mark.parametrize("index", [0, 1], ids=["to_distributed", "fleet"])
def test_a_readme_snippet_runs_as_pasted_on_a_cpu_only_machine(index, tmp_path):
    covered, code = python_blocks(README)[index]
    assert covered is None
    out = clean_run(["-c", code], tmp_path).stdout
    assert "loss" in out, out


def test_the_quick_start_example_runs_in_a_clean_environment(tmp_path):
    command = quick_start_commands()[0].split("&&", 1)[1].split()
    assert command[0] == "python"
    out = clean_run([str(ROOT / command[1]), *command[2:]], tmp_path).stdout
    assert "final loss" in out, out


def test_docs_links_in_the_readme_exist():
    for link in re.findall(r"\]\(((?:docs/|CONTRIBUTING)[^)#]*)", README.read_text()):
        assert (ROOT / link).exists(), link


def test_every_relative_link_in_the_guides_exists():
    for path in DOCS:
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / link).exists(), f"{path.name} links to {link}"


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_every_python_block_of_a_guide_runs(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for i, (covered, code) in enumerate(python_blocks(path)):
        if covered is not None:
            file, test = covered.split("::")
            assert f"def {test}(" in (ROOT / file).read_text(), f"{path.name}: {covered}"
            continue
        try:
            exec(compile(code, f"{path.name}[block {i}]", "exec"), namespace)
        except Exception as err:
            raise AssertionError(f"{path.name}, Python block {i} fails:\n{code}") from err

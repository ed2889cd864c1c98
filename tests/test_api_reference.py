"""The API reference builds from the docstrings with no warning and lists every public name.

``docs/api/conf.py`` writes one page per public package from the names it exports; Sphinx
(the ``docs`` extra, also in ``dev``) builds them with warnings as errors.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"


def _conf():
    """docs/api/conf.py, imported: its package list and its reading of what each exports."""
    spec = importlib.util.spec_from_file_location("jfleet_api_conf", API / "conf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONF = _conf()
PACKAGES = CONF.PACKAGES


def exported(package: str) -> set[str]:
    return {name for name, _ in CONF.public_names(package)}


#: Exported names whose docstring has no ``>>>`` example yet, and why (this list only shrinks).
WITHOUT_EXAMPLE: dict[str, str] = {}  # name -> why it has no example (none now)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(API),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"sphinx-build failed:\n{proc.stdout}\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def test_the_reference_builds_with_warnings_as_errors(built):
    assert (built / "index.html").is_file()


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_has_an_entry(built, package):
    page = (API / "reference" / f"{package}.rst").read_text()
    listed = set(
        re.findall(rf"^\.\. (?:auto\w+|py:data):: {re.escape(package)}\.(\w+)$", page, re.M)
    )
    assert exported(package) - listed == set(), f"{package}: names without an entry"
    html = (built / "reference" / f"{package}.html").read_text()
    shown = set(re.findall(r'<span class="sig-name descname"><span class="pre">(\w+)</span>', html))
    assert listed - shown == set(), f"{package}: entries missing from the built page"


def test_every_exported_name_has_an_example_but_the_listed_few():
    missing = set()
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in exported(package):
            if ">>>" not in (inspect.getdoc(getattr(module, name)) or ""):
                missing.add(f"{package}.{name}")
    assert missing - set(WITHOUT_EXAMPLE) == set(), "add a >>> example to their docstrings"
    assert set(WITHOUT_EXAMPLE) - missing == set(), "they have one now: drop them from the list"

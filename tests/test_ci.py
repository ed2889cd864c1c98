"""CI's files stay true: the constraints pin every dependency, the smoke list names real
modules once each, and .ci/run runs the smoke job after the README's test command."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / ".ci"
sys.path.insert(0, str(CI))

import versions  # noqa: E402  (.ci/versions.py)


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["dev"]
    return [versions.canonical(re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0]) for d in deps]


def test_the_constraints_pin_every_declared_dependency():
    pins = versions.read(CI / "constraints.txt")
    missing = [name for name in _requirements() if name not in pins]
    assert not missing, f"not in .ci/constraints.txt: {missing}; rewrite it after a green run"


def test_each_pin_satisfies_what_pyproject_declares():
    from packaging.requirements import Requirement

    pins = versions.read(CI / "constraints.txt")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    refused = []
    for line in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(line)
        pinned = pins.get(versions.canonical(req.name))
        if pinned is not None and not req.specifier.contains(pinned, prereleases=True):
            refused.append(f"{req} but {req.name}=={pinned}")
    assert not refused, f"pip would refuse .ci/constraints.txt: {refused}"


def test_the_smoke_list_names_each_existing_module_once():
    lines = [ln.strip() for ln in (CI / "smoke_tests.txt").read_text().splitlines()]
    modules = [ln.lstrip("!").split()[0].split("::", 1)[0] for ln in lines if ln and ln[0] != "#"]
    assert modules and len(modules) == len(set(modules)), "a module listed twice"
    gone = [m for m in modules if not (ROOT / m).is_file()]
    assert not gone, f"listed in .ci/smoke_tests.txt but not in the tree: {gone}"


def test_ci_runs_the_smoke_job_after_the_suite():
    run = (CI / "run").read_text()
    assert run.index("python -m pytest -q") < run.index("bash .ci/smoke")
    assert "--smoke" in (CI / "smoke").read_text()

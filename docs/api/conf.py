"""Sphinx configuration of jfleet's API reference, built from the docstrings.

The pages are written here, at configuration time, from the names each public package
exports (its ``__all__``, else its public non-module attributes), so the reference always
lists what ``import jfleet`` and friends offer, wherever the code behind a name lives.

    sphinx-build -W -b html docs/api docs/_build/api
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the checkout, importable without installing

#: The public packages, in the order the index lists them.
PACKAGES = (
    "jfleet",
    "jfleet.fleet",
    "jfleet.distributed",
    "jfleet.incubate.distributed.models.moe",
    "jfleet.testing",
    "jfleet.auto_parallel",
)

project = "jfleet"
author = "the jfleet authors"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_default_options = {"undoc-members": False}
autodoc_typehints = "none"  # signatures carry jax / flax types that have no pages here
exclude_patterns = ["_build"]
html_theme = "alabaster"
suppress_warnings = ["ref.python"]  # cross-references into modules this reference omits


def public_names(package: str) -> list[tuple[str, str]]:
    """``(name, directive)`` of each name ``package`` exports, sorted by name."""
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    out = []
    for name in sorted(set(names)):
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            continue  # submodules: reached through their package's own names
        if inspect.isclass(obj):
            directive = "autoclass"
        elif callable(obj):
            directive = "autofunction"
        else:
            directive = "autodata"
        out.append((name, directive))
    return out


def data_doc(package: str, name: str) -> list[str]:
    """The ``#:`` comment above a plain value (a dict, ...) where a jfleet module defines it."""
    from sphinx.pycode import ModuleAnalyzer

    obj = getattr(importlib.import_module(package), name)
    for modname, module in sorted(sys.modules.items()):
        if modname.startswith("jfleet") and getattr(module, name, None) is obj:
            try:
                docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
            except Exception:
                continue
            if ("", name) in docs:
                return [f"   {line}" for line in docs["", name] if line]
    return [f"   A ``{type(obj).__name__}``."]


def entry(package: str, name: str, directive: str, seen: set[int]) -> list[str]:
    """One reference entry; a name already documented under an earlier package is not
    indexed twice."""
    obj = getattr(importlib.import_module(package), name)
    again = id(obj) in seen
    seen.add(id(obj))
    plain_value = directive == "autodata" and not type(obj).__module__.startswith("jfleet")
    if plain_value:
        return [
            f".. py:data:: {package}.{name}",
            *(["   :no-index:"] if again else []),
            "",
            *data_doc(package, name),
            "",
        ]
    return [f".. {directive}:: {package}.{name}", *(["   :no-index:"] if again else []), ""]


def write_pages() -> None:
    out = HERE / "reference"
    out.mkdir(exist_ok=True)
    seen: set[int] = set()
    for package in PACKAGES:
        lines = [f"``{package}``", "=" * (len(package) + 4), "", f".. module:: {package}", ""]
        doc = inspect.getdoc(importlib.import_module(package)) or ""
        lines += [doc.split("\n\n")[0], ""]
        for name, directive in public_names(package):
            lines += entry(package, name, directive, seen)
        (out / f"{package}.rst").write_text("\n".join(lines))


write_pages()

"""The package's plumbing: its import graph, its axis vocabulary, its file sizes, the README tree.

Read from the syntax trees of ``jfleet/``: every ``import`` counts, at module level or
inside a function, except those under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "jfleet"
FACADE = "jfleet.fleet"
#: Modules that may import the facade: the facade's own package, ``jfleet.distributed``
#: (Paddle's ``paddle.distributed`` path, which holds ``fleet``), and to_distributed,
#: which starts a run with ``fleet.init``.
MAY_IMPORT_FACADE = (
    "jfleet.fleet",
    "jfleet.auto_parallel.to_distributed",
    "jfleet",
    # Paddle's ``paddle.distributed`` facade: re-exports ``fleet`` and group_sharded.
    "jfleet.distributed",
    "jfleet.distributed.sharding",
    # assert_trains_like_one_device trains a strategy the Fleet way (fleet.init,
    # distributed_model, distributed_optimizer); nothing in jfleet imports jfleet.testing.
    "jfleet.testing.assertions",
)
AXIS_MODULE = "jfleet.topology"
AXIS_NAMES = {"dp", "pp", "sharding", "sep", "mp"}
#: String constants equal to an axis name that are not axis names.
NOT_AXES = {
    # Paddle's ``strategy.sharding`` switch: a setting's name, not the mesh axis.
    ("jfleet.strategy", "sharding"),
    ("jfleet._strategy_schema", "sharding"),
    # ``getattr(x, "sharding")``: a jax.Array's attribute.
    ("jfleet.collective", "sharding"),
    ("jfleet.group_collective", "sharding"),
    ("jfleet.checkpoint.manager", "sharding"),
    # ``jfleet.distributed.sharding``: Paddle's ``paddle.distributed.sharding`` module.
    ("jfleet.distributed", "sharding"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of every node under an ``if TYPE_CHECKING:`` block."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = getattr(test, "id", None) or getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skipped.update(id(n) for n in ast.walk(child))
    return skipped


def imported_modules(module: str, path: Path) -> set[str]:
    """The jfleet modules ``module`` imports (``from pkg import sub`` counts ``pkg.sub``)."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in MODULES and m != module}


GRAPH = {m: imported_modules(m, p) for m, p in MODULES.items()}


def _edges_without_package_inits() -> dict[str, set[str]]:
    """The graph, where importing ``a.b`` does not count as importing the package ``a``.

    Python runs ``a/__init__.py`` before ``a.b``, but an ``__init__`` that only re-exports
    its submodules is not a dependency of them; what matters is who needs whose code.
    """
    return {m: {t for t in targets if not m.startswith(t + ".")} for m, targets in GRAPH.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_has_no_cycle():
    assert find_cycle(_edges_without_package_inits()) is None


def test_only_the_facade_and_to_distributed_import_the_facade():
    offenders = sorted(
        m
        for m, targets in GRAPH.items()
        if (FACADE in targets or any(t.startswith(FACADE + ".") for t in targets))
        and not (m in MAY_IMPORT_FACADE or m.startswith(FACADE + "."))
    )
    assert offenders == []


def test_the_context_imports_nothing_of_jfleet():
    assert GRAPH["jfleet._context"] == set()


def _docstring_ids(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            ids.add(id(node.value))  # attribute docstrings after an assignment
    return ids


def _message_ids(tree: ast.AST) -> set[int]:
    """String parts of f-strings and arguments of exceptions: messages, not code."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            ids.update(id(n) for n in ast.walk(node))
        elif isinstance(node, ast.Raise) and node.exc is not None:
            ids.update(id(n) for n in ast.walk(node.exc))
    return ids


def axis_literals(module: str, path: Path) -> list[str]:
    """``module:line "name"`` for each axis name written as a string constant in code."""
    tree = ast.parse(path.read_text())
    skip = _docstring_ids(tree) | _message_ids(tree)
    return [
        f"{module}:{node.lineno} {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and node.value in AXIS_NAMES
        and id(node) not in skip
        and (module, node.value) not in NOT_AXES
    ]


def test_axis_literal_scan_sees_code_and_skips_docs():
    source = (
        'def f(m):\n    """Uses "dp"."""\n    raise ValueError(f"{m} lacks mp")\n'
        '    return m["dp"]\n'
    )
    path = PACKAGE.parent / "tests" / "_axis_probe.py"
    try:
        path.write_text(source)
        assert axis_literals("probe", path) == ["probe:4 'dp'"]
    finally:
        path.unlink()


def test_axis_names_are_spelled_in_one_module():
    found = [
        hit
        for module, path in MODULES.items()
        if module != AXIS_MODULE
        for hit in axis_literals(module, path)
    ]
    assert found == []
    assert axis_literals(AXIS_MODULE, MODULES[AXIS_MODULE])  # the vocabulary is there


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_file_over_800_lines(module):
    lines = MODULES[module].read_text().count("\n")
    assert lines <= 800, f"{module} has {lines} lines; split it along its concepts"


def test_readme_layout_matches_the_tree():
    readme = (REPO / "CONTRIBUTING.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    listed = set()
    folders: list[str] = []
    for line in block.splitlines():
        match = re.match(r"^( *)(\S+)", line)
        if not match:
            continue
        depth, name = len(match.group(1)) // 2, match.group(2)
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        elif name.endswith(".py"):
            listed.add("/".join([*folders, name]))
    actual = {str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")}
    assert sorted(actual - listed) == [], "modules missing from the README's layout"
    assert sorted(listed - actual) == [], "README layout lists modules that do not exist"

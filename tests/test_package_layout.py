"""The package's plumbing: its import graph, its axis vocabulary, its file sizes, the README tree.

Read from the syntax trees of ``jfleet/``: every ``import`` counts, at module level or
inside a function, except those under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "jfleet"
#: The layers, bottom first. A module imports only from its own package or from a package
#: of a lower layer (function-local imports included); packages of one layer do not import
#: each other. ``jfleet/__init__`` sits on top (and imports nothing eagerly).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("runtime",),
    ("mesh",),
    ("optim",),
    ("parallel",),
    ("models", "precision"),
    ("training",),
    ("auto_parallel",),
    ("checkpoint", "launch", "ps"),
    ("fleet",),
    ("distributed", "incubate"),
    ("testing",),
)
AXIS_MODULE = "jfleet.mesh.topology"
AXIS_NAMES = {"dp", "pp", "sharding", "sep", "ep", "mp"}
#: String constants equal to an axis name that are not axis names.
NOT_AXES = {
    # Paddle's ``strategy.sharding`` switch: a setting's name, not the mesh axis.
    ("jfleet.training.strategy", "sharding"),
    ("jfleet.training.strategy_schema", "sharding"),
    # ``getattr(x, "sharding")``: a jax.Array's attribute.
    ("jfleet.mesh.collective", "sharding"),
    ("jfleet.mesh.group_collective", "sharding"),
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


def imported_modules(module: str, path: Path, typing: bool = False) -> set[str]:
    """The jfleet modules ``module`` imports (``from pkg import sub`` counts ``pkg.sub``;
    ``from pkg import name`` counts ``pkg``); with ``typing``, those imported for type
    checkers only as well."""
    tree = ast.parse(path.read_text())
    skipped = set() if typing else _type_checking_nodes(tree)
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
            for alias in node.names:  # ``from pkg import sub`` imports sub, not pkg's names
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
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


def test_no_cycle_counting_imports_for_type_checkers():
    """Issue 36: ``fleet_base`` and ``util_base`` imported each other under
    ``TYPE_CHECKING``; type checkers and readers follow those imports too."""
    typed = {m: imported_modules(m, p, typing=True) for m, p in MODULES.items()}
    assert (
        find_cycle({m: {t for t in ts if not m.startswith(t + ".")} for m, ts in typed.items()})
        is None
    )


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_has_no_cycle():
    assert find_cycle(_edges_without_package_inits()) is None


def package_of(module: str) -> str:
    """The top-level package of a jfleet module (``jfleet`` for the root ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "jfleet"


LEVEL = {pkg: level for level, pkgs in enumerate(LAYERS) for pkg in pkgs} | {"jfleet": len(LAYERS)}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a module in a higher layer or a sibling package."""
    found = []
    for module, targets in graph.items():
        here = package_of(module)
        for target in targets - {"jfleet"}:  # ``from jfleet import x``: x is counted
            there = package_of(target)
            if there != here and LEVEL[there] >= LEVEL[here]:
                found.append(f"{module} ({here}) -> {target} ({there})")
    return sorted(found)


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(LEVEL) - {"jfleet"}


def test_no_module_imports_from_a_higher_layer():
    assert layer_violations(GRAPH) == []


def test_the_layer_check_finds_a_planted_upward_import():
    planted = dict(GRAPH)
    planted["jfleet.mesh.topology"] = {*GRAPH["jfleet.mesh.topology"], "jfleet.training.engine"}
    planted["jfleet.launch.args"] = {*GRAPH["jfleet.launch.args"], "jfleet.ps.table"}
    assert layer_violations(planted) == [
        "jfleet.launch.args (launch) -> jfleet.ps.table (ps)",
        "jfleet.mesh.topology (mesh) -> jfleet.training.engine (training)",
    ]


def test_no_cycle_counting_package_inits():
    """Strict: importing ``pkg.sub`` runs ``pkg/__init__``, so a package's submodules must
    not import the package itself (``from jfleet import fleet`` inside ``jfleet.fleet.x``)."""
    assert find_cycle(GRAPH) is None


def test_the_cycle_check_finds_a_planted_cycle():
    planted = dict(GRAPH)
    planted["jfleet.fleet.meta_parallel"] = {*GRAPH["jfleet.fleet.meta_parallel"], "jfleet.fleet"}
    assert find_cycle(planted) is not None


def _jfleet_imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute ``jfleet...`` module an ``import`` statement names, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("jfleet")]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found += [(node.lineno, node.module)] if node.module.startswith("jfleet") else []
    return found


def test_jfleet_imports_its_modules_by_their_homes():
    """Inside the package, no import goes through an alias of an earlier release
    (``jfleet.amp``): aliases would hide the import from the layer check."""
    missing = [
        f"{module}:{line} {name}"
        for module, path in MODULES.items()
        for line, name in _jfleet_imports(path)
        if name not in MODULES
    ]
    assert missing == []


def test_ls_jfleet_shows_the_layers():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    # the eleven layers' fourteen packages (three Paddle facades among them) and __init__
    assert len(entries) <= 16, entries
    assert [e for e in entries if e.endswith(".py")] == ["__init__.py"]


@pytest.mark.parametrize("package", sorted(set(LEVEL) - {"jfleet"}))
def test_each_layer_says_what_it_is_and_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text())) or ""
    assert "May import:" in doc, f"jfleet/{package}/__init__.py: no 'May import:' line"
    allowed = doc.split("May import:", 1)[1].split("\n\n", 1)[0]
    below = sorted(p for p in LEVEL if LEVEL[p] < LEVEL[package])
    named = sorted(p for p in LEVEL if re.search(rf"\b{p}\b", allowed))
    assert named == below or (not below and "nothing" in allowed), (package, named, below)


#: ``jfleet.auto_parallel``'s stages in the order ``to_distributed`` calls them (issue 36). A
#: stage's modules import from their own stage or an earlier one; the package top
#: (``to_distributed``, ``config``) may import every stage, and no stage imports the top.
STAGES = ("match", "cost", "search", "apply")
AUTO = "jfleet.auto_parallel"


def stage_rank(module: str) -> int:
    """A module's stage as its place in :data:`STAGES`; the package top ranks last."""
    part = module[len(AUTO) + 1 :].split(".")[0]
    return STAGES.index(part) if part in STAGES else len(STAGES)


def stage_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import, inside ``auto_parallel``, of a later stage or the top."""
    found = []
    for module, targets in graph.items():
        if not module.startswith(AUTO + "."):
            continue
        for target in targets:
            inside = target.startswith(AUTO + ".")
            if inside and stage_rank(target) > stage_rank(module):
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_auto_parallel_stages_import_only_earlier_stages():
    assert stage_violations(_edges_without_package_inits()) == []


def test_the_stage_check_finds_a_planted_back_import():
    planted = _edges_without_package_inits()
    planted[f"{AUTO}.match.patterns"] |= {f"{AUTO}.cost.profiles"}
    planted[f"{AUTO}.cost.cost_model"] |= {f"{AUTO}.search.planner"}
    planted[f"{AUTO}.apply.blocks"] |= {f"{AUTO}.config"}
    planted[f"{AUTO}.search.plan"] |= {f"{AUTO}.match.matched"}  # an earlier stage: allowed
    assert stage_violations(planted) == [
        f"{AUTO}.apply.blocks -> {AUTO}.config",
        f"{AUTO}.cost.cost_model -> {AUTO}.search.planner",
        f"{AUTO}.match.patterns -> {AUTO}.cost.profiles",
    ]


def test_ls_auto_parallel_shows_the_stages():
    here = PACKAGE / "auto_parallel"
    entries = sorted(p.name for p in here.iterdir() if p.name != "__pycache__")
    folders = [e for e in entries if (here / e).is_dir()]
    assert folders == sorted(STAGES)
    assert len(entries) - len(folders) <= 4, entries


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_says_what_it_takes_gives_and_may_import(stage):
    doc = ast.get_docstring(
        ast.parse((PACKAGE / "auto_parallel" / stage / "__init__.py").read_text())
    )
    assert "Takes in:" in doc and "Gives out:" in doc, stage
    allowed = doc.split("May import:", 1)[1].split("\n\n", 1)[0]
    named = [s for s in STAGES if re.search(rf"\b{s}\b", allowed)]
    assert named == list(STAGES[: STAGES.index(stage)]), (stage, named)


def test_old_auto_parallel_module_paths_alias_their_stage_homes():
    code = (
        "import jfleet.auto_parallel.patterns as old, jfleet.auto_parallel.match.patterns as new\n"
        "assert old is new, (old, new)\n"
        "from jfleet.auto_parallel.layouts import Layout, enumerate_layouts\n"
        "from jfleet.auto_parallel.cost.layout import Layout as Home\n"
        "assert Layout is Home\n"
        "from jfleet.auto_parallel import planner\n"
        "import jfleet.auto_parallel.search.planner as p2\n"
        "assert planner is p2\n"
        "import runpy, sys\n"  # the CLI the README names keeps its flat path
        "sys.argv = ['cluster_plan', '--help']\n"
        "try:\n    runpy.run_module('jfleet.auto_parallel.cluster_plan', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('OK')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]
    assert "usage: python -m jfleet.auto_parallel.cluster_plan" in out.stdout


def test_the_context_imports_nothing_of_jfleet():
    assert GRAPH["jfleet.mesh.context"] == set()


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


def long_functions(tree: ast.AST, limit: int = 100) -> list[str]:
    """``name (N lines)`` for each function or method longer than ``limit`` lines."""
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_function_length_check_sees_a_long_function():
    body = "".join(f"    x{i} = {i}\n" for i in range(101))
    assert long_functions(ast.parse(f"def f():\n{body}")) == ["f (102 lines)"]
    assert long_functions(ast.parse("def g():\n    return 1\n")) == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_over_100_lines(module):
    """Files are split by concept (a review rule in CONTRIBUTING.md), functions by steps."""
    found = long_functions(ast.parse(MODULES[module].read_text()))
    assert found == [], f"{module}: {found}; cut it into named steps"


def code_lines(module: str, name: str) -> int:
    """Lines of a top-level function's code, its docstring left out."""
    tree = ast.parse(MODULES[module].read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
    return fn.end_lineno - body[0].lineno + 1


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("jfleet.auto_parallel.match.patterns", "match_patterns"),
        ("jfleet.auto_parallel.cost.cost_model", "estimate"),
        ("jfleet.auto_parallel.search.planner", "plan_for"),
    ],
)
def test_the_planners_core_reads_as_named_steps(module, name):
    """Issue 25: matching, the cost model and the planner each call named steps."""
    assert code_lines(module, name) <= 60


def test_the_launcher_imports_no_jax():
    """``python -m jfleet.launch --help`` loads neither JAX nor NumPy: the package root
    is lazy and the launcher stands on the run-time layer alone."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['jfleet.launch', '--help']\n"
        "try:\n    runpy.run_module('jfleet.launch', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print('LOADED', sorted(m for m in ('jax', 'numpy', 'flax', 'optax') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert "--nproc_per_node" in out.stdout, out.stderr
    assert "LOADED []" in out.stdout, out.stdout[-500:]


def test_public_names_load_lazily_and_old_paths_alias_their_homes():
    code = (
        "import sys, jfleet\n"
        "assert 'jax' not in sys.modules\n"
        "import jfleet.amp, jfleet.precision.amp, jfleet.strategy\n"
        "assert jfleet.amp is jfleet.precision.amp\n"
        "assert jfleet.amp.__spec__.name == 'jfleet.precision.amp'\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('jfleet.amp').origin.endswith('precision/amp.py')\n"
        "from jfleet.collective_perf import timing\n"
        "import jfleet.mesh.collective_perf.timing as t2\n"
        "assert timing is t2\n"
        "assert jfleet.DistributedStrategy is jfleet.strategy.DistributedStrategy\n"
        "assert 'to_distributed' in dir(jfleet)\n"
        "missing = [n for n in jfleet.__all__ if getattr(jfleet, n, None) is None]\n"
        "assert not missing, missing\n"
        "try:\n    jfleet.no_such_name\nexcept AttributeError as e:\n    print('ERR', e)\n"
        "print('OK')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.stdout.strip().endswith("OK"), out.stderr[-2000:]
    assert "has no attribute 'no_such_name'" in out.stdout


def test_contributing_layout_matches_the_tree():
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
    assert sorted(actual - listed) == [], "modules missing from CONTRIBUTING.md's layout"
    assert sorted(listed - actual) == [], "CONTRIBUTING.md lists modules that do not exist"
